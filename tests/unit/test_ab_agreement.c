/* SPDX-License-Identifier: Apache-2.0 */
/* What `moert ab`'s agreement check reads, on the CPU: the bulk reads of every local rank's output and gradients equal
 * the element reads (moert_runtime_output, moert_runtime_param) in any chunking, a read past a tensor's end is refused,
 * and the tolerance a precision recipe declares is read only where its vtable has the field (a plugin built against
 * the older header, or one leaving it 0, gets the default). */
#include <stdlib.h>

#include "runtime.h"
#include "test_util.h"

static const char *config_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
    " \"parallel\": {\"ranks\": 2}, \"train\": {\"tokens_per_rank\": 32, \"seed\": 5, \"lr\": 0.01}}";

/* Reads a whole tensor of every local rank in chunks of `chunk` elements into out[local * numel + i]. */
static void read_chunked(moert_runtime *rt, int layer, moert_param_id which, int64_t numel, int64_t chunk, double *out)
{
    const int nlocal = moert_runtime_local_ranks(rt);
    double *buf = malloc(sizeof(double) * (size_t)(nlocal * chunk));
    if (!buf) {
        test_failures++;
        return;
    }
    for (int64_t first = 0; first < numel; first += chunk) {
        const int64_t count = numel - first < chunk ? numel - first : chunk;
        if (layer < 0)
            EXPECT_OK(moert_runtime_read_output(rt, first, count, buf));
        else
            EXPECT_OK(moert_runtime_read_grad(rt, layer, which, first, count, buf));
        for (int r = 0; r < nlocal; r++)
            for (int64_t i = 0; i < count; i++) out[r * numel + first + i] = buf[r * count + i];
    }
    free(buf);
}

static void check_bulk_reads(moert_runtime *rt)
{
    const int nlocal = moert_runtime_local_ranks(rt);
    EXPECT_EQ_INT(nlocal, 2);
    /* the output: local rank r's slice is the global output's rows of rank r */
    const int64_t n_out = moert_runtime_local_output_numel(rt);
    EXPECT_EQ_INT(n_out * nlocal, moert_runtime_output_numel(rt));
    double *out = malloc(sizeof(double) * (size_t)(n_out * nlocal));
    if (!out) {
        test_failures++;
        return;
    }
    int64_t differ = 0;
    for (int64_t chunk = 7; chunk <= n_out; chunk = chunk * 8 > n_out && chunk < n_out ? n_out : chunk * 8) {
        read_chunked(rt, -1, MOERT_PARAM_ROUTER, n_out, chunk, out);
        for (int64_t i = 0; i < n_out * nlocal; i++) {
            double v = 0;
            EXPECT_OK(moert_runtime_output(rt, i, &v));
            differ += v != out[i];
        }
    }
    EXPECT_EQ_INT(differ, 0);
    free(out);
    /* gradients: the experts' are split over the ranks (rank r holds the global experts r*E/R...), the router's is
     * every rank's copy */
    for (int l = 0; l < rt->cfg->model.num_layers; l++)
        for (int p = MOERT_PARAM_ROUTER; p <= MOERT_PARAM_FC2; p++) {
            const int64_t n = moert_runtime_local_grad_numel(rt, l, (moert_param_id)p);
            const bool split = p != MOERT_PARAM_ROUTER;
            EXPECT_EQ_INT(split ? n * nlocal : n, moert_runtime_param_numel(rt, (moert_param_id)p));
            double *g = malloc(sizeof(double) * (size_t)(n * nlocal));
            if (!g) {
                test_failures++;
                return;
            }
            read_chunked(rt, l, (moert_param_id)p, n, 100, g);
            differ = 0;
            int64_t nonzero = 0;
            for (int r = 0; r < nlocal; r++)
                for (int64_t i = 0; i < n; i++) {
                    double want = 0;
                    EXPECT_OK(moert_runtime_param(rt, l, (moert_param_id)p, split ? r * n + i : i, MOERT_PARAM_READ,
                                                  NULL, &want));
                    differ += want != g[r * n + i];
                    nonzero += want != 0.0;
                }
            EXPECT_EQ_INT(differ, 0);
            EXPECT(nonzero > 0);
            free(g);
        }
    /* past the end, and a parameter the model lacks */
    double one[4];
    EXPECT(moert_runtime_read_output(rt, n_out - 1, 2, one) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(moert_runtime_read_grad(rt, 0, MOERT_PARAM_SHARED_FC1, 0, 1, one) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(moert_runtime_read_grad(rt, 2, MOERT_PARAM_FC1, 0, 1, one) == MOERT_ERR_INVALID_ARGUMENT);
}

/* A precision vtable of the current header with a given tolerance and struct size. */
static double declared(double rtol, uint32_t struct_size)
{
    moert_precision_v1 vt = {.header = {MOERT_PRECISION_V1_HEADER, .name = "x"}, .agreement_rtol = rtol};
    vt.header.struct_size = struct_size;
    return moert_precision_agreement_rtol(&vt.header);
}

int main(void)
{
    /* the declared tolerance: read where the vtable has it, else the default */
    EXPECT(declared(0.05, sizeof(moert_precision_v1)) == 0.05);
    EXPECT(declared(0.05, (uint32_t)MOERT_PRECISION_V1_BASE_SIZE) == MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL);
    EXPECT(declared(0.0, sizeof(moert_precision_v1)) == MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL);
    EXPECT(moert_precision_agreement_rtol(NULL) == MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL);
    EXPECT(MOERT_PRECISION_V1_BASE_SIZE == offsetof(moert_precision_v1, end_step) + sizeof(void (*)(void)));

    moert_config *cfg = NULL, *cfg8 = NULL;
    moert_runtime *rt = NULL, *rt8 = NULL;
    EXPECT_OK(moert_config_load_string(config_json, "agreement-test", &cfg));
    if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto done;
    /* nothing to read before a step */
    double v;
    EXPECT(moert_runtime_read_output(rt, 0, 1, &v) == MOERT_ERR_UNSUPPORTED);
    EXPECT_EQ_INT(moert_runtime_local_grad_numel(rt, 0, MOERT_PARAM_FC1), 0);
    EXPECT_OK(moert_runtime_step(rt, 1, NULL));
    check_bulk_reads(rt);
    /* what the built-in recipes declare: bf16 one ulp of bf16 rounded up, fp8 one E4M3 ulp */
    EXPECT(moert_runtime_agreement_rtol(rt) == 1e-2);
    EXPECT_OK(moert_config_load_string(config_json, "agreement-test-fp8", &cfg8));
    if (cfg8) EXPECT_OK(moert_config_set(cfg8, "precision", "{\"plugin\": \"fp8\"}"));
    if (cfg8) EXPECT_OK(moert_runtime_create(cfg8, &rt8));
    if (rt8) EXPECT(moert_runtime_agreement_rtol(rt8) == 0.125);
done:
    moert_runtime_destroy(rt);
    moert_runtime_destroy(rt8);
    moert_config_free(cfg);
    moert_config_free(cfg8);
    return test_finish("ab_agreement");
}
