/* SPDX-License-Identifier: Apache-2.0 */
/* A launcher's environment (RANK, WORLD_SIZE, ...) makes moert run one rank per process; where that cannot
 * work (no CUDA, no GPU, a mismatched world, the CPU asked for) the error says why. */
#include <stdlib.h>

#include "test_util.h"
#include "trainer.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#endif

static const char *config =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 4, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 1},"
    " \"parallel\": {\"ranks\": 2, \"device\": \"%s\"}, \"train\": {\"tokens_per_rank\": 4}}";

static moert_result create(const char *device, int ranks)
{
    char json[512];
    snprintf(json, sizeof json, config, device);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    moert_result rc = moert_config_load_string(json, "launch-test", &cfg);
    if (rc == MOERT_OK && ranks != 2) {
        char v[16];
        snprintf(v, sizeof v, "%d", ranks);
        rc = moert_config_set(cfg, "parallel.ranks", v);
    }
    if (rc == MOERT_OK) rc = moert_runtime_create(cfg, &rt);
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return rc;
}

int main(void)
{
    /* without the variables: ranks as threads */
    unsetenv("WORLD_SIZE");
    unsetenv("RANK");
    EXPECT_OK(create("cpu", 2));

    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "1", 1);
    setenv("LOCAL_RANK", "1", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", "29999", 1);
#ifdef MOERT_HAVE_CUDA
    EXPECT_EQ_INT(create("auto", 4), MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS(
        "config error at $.parallel.ranks: 4 ranks, but the launcher started 2 processes (WORLD_SIZE)");
    EXPECT_EQ_INT(create("cpu", 2), MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("config error at $.parallel.device: \"cpu\", but the launcher started a process per rank");
    int gpus = 0;
    if (moert_cuda_device_count(&gpus) != MOERT_OK || gpus < 2) {
        EXPECT_EQ_INT(create("auto", 2), MOERT_ERR_UNSUPPORTED);
        EXPECT_ERROR_CONTAINS("rank 1: LOCAL_RANK 1 but");
    }
    unsetenv("MASTER_ADDR");
    EXPECT_EQ_INT(create("auto", 2), MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("MASTER_ADDR");
#else
    EXPECT_EQ_INT(create("auto", 2), MOERT_ERR_UNSUPPORTED);
    EXPECT_ERROR_CONTAINS("launched as a process per rank (WORLD_SIZE=2), but this build has no CUDA/NCCL");
#endif
    return test_finish("launch");
}
