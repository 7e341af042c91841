/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU demo (configs/demo-cpu.json, 60 steps) gives the same loss, mse and router loss at every step, bit for bit,
 * as the revision before the embedding API (tests/fixtures/demo-cpu-losses.txt, hexadecimal doubles): moving code
 * between the runtime, the stack and the embedding API must not change a single result. */
#include <stdio.h>

#include "runtime.h"
#include "test_util.h"

int main(void)
{
    const char *root = getenv("MOERT_TEST_SOURCE_ROOT");
    char path[4096], fixture[4096];
    snprintf(path, sizeof path, "%s/configs/demo-cpu.json", root ? root : ".");
    snprintf(fixture, sizeof fixture, "%s/tests/fixtures/demo-cpu-losses.txt", root ? root : ".");
    FILE *f = fopen(fixture, "r");
    EXPECT(f != NULL);
    if (!f) return test_finish("demo_losses");
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_file(path, &cfg));
    if (cfg) EXPECT_OK(moert_config_set(cfg, "parallel.device", "\"cpu\""));
    if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
    int64_t steps = 0;
    for (int64_t s = 1; rt && s <= cfg->train.steps; s++) {
        long long step = 0;
        double want[3];
        if (fscanf(f, "%lld %la %la %la", &step, &want[0], &want[1], &want[2]) != 4) break;
        moert_step_record rec;
        EXPECT_OK(moert_runtime_step(rt, s, &rec));
        double got[3] = {rec.loss, rec.mse, rec.router_loss};
        for (int i = 0; i < 3; i++)
            if (got[i] != want[i]) {
                fprintf(stderr, "step %lld: %s %a, expected %a\n", step,
                        i == 0   ? "loss"
                        : i == 1 ? "mse"
                                 : "router_loss",
                        got[i], want[i]);
                test_failures++;
            }
        steps++;
    }
    EXPECT_EQ_INT(steps, 60);
    fclose(f);
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
    return test_finish("demo_losses");
}
