/* SPDX-License-Identifier: Apache-2.0 */
/* The C emulation of the FP8 conversions (plugins/lib/fp8_convert.c) against CUDA's own
 * (__nv_cvt_bfloat16raw_to_fp8, saturating to the largest finite value) for every one of the 2^16 bf16
 * inputs, E4M3 and E5M2: bit-exact, so the CPU reference and the GPU agree. 77 without a GPU. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "fp8_convert.h"
#include "test_util.h"

int moert_test_cuda_fp8_of_all_bf16(uint8_t *e4m3, uint8_t *e5m2);

int main(void)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        printf("fp8_convert: no CUDA device, skipped\n");
        return TEST_SKIP;
    }
    static uint8_t cuda[2][65536];
    int err = moert_test_cuda_fp8_of_all_bf16(cuda[0], cuda[1]);
    if (err != 0) {
        fprintf(stderr, "fp8_convert: CUDA conversion failed: %s\n", cudaGetErrorString((cudaError_t)err));
        return 1;
    }
    const fp8_format formats[2] = {FP8_E4M3, FP8_E5M2};
    for (int f = 0; f < 2; f++) {
        int mismatches = 0;
        for (int i = 0; i < 65536; i++) {
            uint8_t mine = fp8_from_float(moert_bf16_to_float((uint16_t)i), formats[f]);
            if (mine != cuda[f][i]) {
                if (mismatches < 8)
                    fprintf(stderr, "%s: bf16 0x%04x (%g): moert 0x%02x, CUDA 0x%02x\n", fp8_format_name(formats[f]), i,
                            (double)moert_bf16_to_float((uint16_t)i), mine, cuda[f][i]);
                mismatches++;
            }
        }
        printf("%s: %d of 65536 bf16 inputs differ from CUDA\n", fp8_format_name(formats[f]), mismatches);
        EXPECT_EQ_INT(mismatches, 0);
    }
    return test_finish("fp8_convert");
}
