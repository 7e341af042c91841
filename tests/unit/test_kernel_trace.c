/* SPDX-License-Identifier: Apache-2.0 */
/* `moert run --trace-kernels` (harness/kernel_trace.h): the short names of CUPTI's kernel names, and starting a
 * kernel trace where CUPTI cannot serve it. The kernels themselves are checked on GPUs (tests/gpu/run.sh). */
#include <string.h>

#include "kernel_trace.h"
#include "test_util.h"

static void expect_short(const char *name, const char *want)
{
    char got[64];
    moert_kernel_short_name(name, got, sizeof got);
    if (strcmp(got, want) != 0) {
        fprintf(stderr, "short name of %s: got \"%s\", want \"%s\"\n", name, got, want);
        test_failures++;
    }
}

/* Names as CUPTI gives them: C++ kernels mangled (templates, namespaces, substitutions), C kernels plain. */
static void test_short_names(void)
{
    expect_short("_Z30bf16_wgmma_wgrad_demote_kernelPKlilPKhS2_lll", "bf16_wgmma_wgrad_demote_kernel");
    expect_short("_Z18gather_rows_kernelIfLi1EEvllPKiiPKlPKT_PS4_", "gather_rows_kernel");
    expect_short("_Z14release_kernel16deepep_cuda_call", "release_kernel");
    expect_short("_ZN3moe4gemmIfEEvPf", "gemm");
    expect_short("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIiEEEEvNT_6ParamsE", "device_kernel");
    expect_short("_ZNK3foo3barEv", "bar");
    expect_short("_ZN3foo3bazISt4pairIiiEEEvv", "baz");
    expect_short("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_"
                                                                                "tn_n_tilesize128x256x64");
    /* what the reader cannot take apart is kept whole, never cut at a wrong place */
    expect_short("_Z99short", "_Z99short");
    expect_short("_Z", "_Z");
    char tiny[5];
    moert_kernel_short_name("_Z14release_kernel16deepep_cuda_call", tiny, sizeof tiny);
    EXPECT(strcmp(tiny, "rele") == 0);
}

/* Without CUPTI (a build without CUDA, or no libcupti) starting fails with a message naming it; where it starts (a
 * CUPTI build, even with no GPU) it stops with no kernel recorded, since none ran. */
static void test_start_without_kernels(void)
{
    moert_kernel_trace *kt = NULL;
    moert_result rc = moert_kernel_trace_start(&kt);
    if (rc != MOERT_OK) {
        EXPECT(kt == NULL);
        EXPECT(strstr(moert_last_error(), "CUPTI") != NULL || strstr(moert_last_error(), "cupti") != NULL);
        fprintf(stderr, "(kernel trace not started here: %s)\n", moert_last_error());
        return;
    }
    moert_kernel_trace *second = NULL;
    EXPECT(moert_kernel_trace_start(&second) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("a kernel trace already runs");
    const moert_kernel_record *records = NULL;
    int64_t count = -1;
    EXPECT_OK(moert_kernel_trace_stop(kt, &records, &count));
    EXPECT_EQ_INT(count, 0);
    moert_kernel_trace_destroy(kt);
}

int main(void)
{
    test_short_names();
    test_start_without_kernels();
    return test_finish("test_kernel_trace");
}
