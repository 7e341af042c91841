/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Every allocation the core makes while it creates a runtime (config sections, hosts, rank state, communicator) fails
 * in turn: moert_runtime_create must then return MOERT_ERR_OUT_OF_MEMORY (or another error) with a message, never
 * crash, and free everything it had (this test runs under valgrind, and under LeakSanitizer in sanitized builds).
 * The core is linked with -Wl,--wrap=malloc,--wrap=calloc so that the k-th allocation of the core can be refused;
 * the plugins and jansson allocate on their own and are left alone.
 */
#include <stdatomic.h>
#include <stdlib.h>

#include "test_util.h"
#include "trainer.h"

void *__real_malloc(size_t size);
void *__real_calloc(size_t n, size_t size);

static atomic_long armed_calls = 0; /* allocations seen while armed */
static atomic_long fail_at = 0;     /* the armed allocation to refuse (1-based); 0: none */
static atomic_bool armed = false;

/* True when this allocation is the one to refuse. */
static bool refuse(void)
{
    if (!atomic_load(&armed)) return false;
    long n = atomic_fetch_add(&armed_calls, 1) + 1;
    return n == atomic_load(&fail_at);
}

void *__wrap_malloc(size_t size) { return refuse() ? NULL : __real_malloc(size); }
void *__wrap_calloc(size_t n, size_t size) { return refuse() ? NULL : __real_calloc(n, size); }

int main(void)
{
    static const char *json =
        "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 8, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
        " \"parallel\": {\"ranks\": 4, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 8}}";
    moert_config *cfg = NULL;
    if (moert_config_load_string(json, "alloc-failures", &cfg) != MOERT_OK) {
        fprintf(stderr, "test_alloc_failures: %s\n", moert_last_error());
        return 1;
    }
    int refused = 0;
    for (long k = 1;; k++) {
        moert_runtime *rt = NULL;
        atomic_store(&armed_calls, 0);
        atomic_store(&fail_at, k);
        atomic_store(&armed, true);
        moert_result rc = moert_runtime_create(cfg, &rt);
        atomic_store(&armed, false);
        long seen = atomic_load(&armed_calls);
        if (seen < k) { /* every allocation of a whole creation got through: done */
            EXPECT_OK(rc);
            moert_runtime_destroy(rt);
            break;
        }
        refused++;
        if (rc == MOERT_OK) {
            /* an allocation whose failure is tolerated (e.g. an optional name list) */
            moert_runtime_destroy(rt);
            continue;
        }
        EXPECT(rt == NULL);
        if (moert_last_error()[0] == '\0') {
            fprintf(stderr, "allocation %ld refused: moert_runtime_create failed (%s) without a message\n", k,
                    moert_result_name(rc));
            test_failures++;
        }
    }
    EXPECT(refused > 10);
    printf("test_alloc_failures: %d allocations refused in turn\n", refused);
    moert_config_free(cfg);
    return test_finish("test_alloc_failures");
}
