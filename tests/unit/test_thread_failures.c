/* SPDX-License-Identifier: Apache-2.0 */
/*
 * pthread_create failing part-way through the rank threads (as under a thread limit with many ranks): the runtime
 * must fail with a message naming the rank, and must not return while the ranks already started still run on its
 * memory. pthread_create is wrapped at link time: the chosen call fails with EAGAIN, and every started rank thread
 * first sleeps a little, so that a runtime returning without joining them is caught (valgrind, AddressSanitizer
 * and ThreadSanitizer report their use of freed memory; without a tool the test usually crashes).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "runtime.h"
#include "test_util.h"

int __real_pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*fn)(void *), void *arg);

static atomic_int calls = 0;
static atomic_int fail_call = 0; /* 1-based; 0: none fails */

typedef struct delayed_start {
    void *(*fn)(void *);
    void *arg;
} delayed_start;

static void sleep_ms(long ms)
{
    struct timespec t = {.tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {}
}

/* A started rank thread: waits 200 ms, then runs the rank. */
static void *delayed(void *p)
{
    delayed_start d = *(delayed_start *)p;
    free(p);
    sleep_ms(200);
    return d.fn(d.arg);
}

int __wrap_pthread_create(pthread_t *thread, const pthread_attr_t *attr, void *(*fn)(void *), void *arg)
{
    if (atomic_fetch_add(&calls, 1) + 1 == atomic_load(&fail_call)) return EAGAIN;
    delayed_start *d = malloc(sizeof *d);
    if (!d) return ENOMEM;
    d->fn = fn;
    d->arg = arg;
    int rc = __real_pthread_create(thread, attr, delayed, d);
    if (rc != 0) free(d);
    return rc;
}

int main(void)
{
    static const char *json =
        "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 8, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2},"
        " \"parallel\": {\"ranks\": 4, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 8}}";
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "thread-failures", &cfg));
    if (!cfg) return test_finish("test_thread_failures");

    /* the third rank thread cannot start: ranks 0 and 1 are running */
    atomic_store(&calls, 0);
    atomic_store(&fail_call, 3);
    moert_runtime *rt = NULL;
    moert_result rc = moert_runtime_create(cfg, &rt);
    atomic_store(&fail_call, 0);
    EXPECT_EQ_INT(rc, MOERT_ERR_INTERNAL);
    EXPECT(rt == NULL);
    EXPECT(strcmp(moert_last_error(), "pthread_create for rank 2 failed: Resource temporarily unavailable") == 0);
    if (strcmp(moert_last_error(), "pthread_create for rank 2 failed: Resource temporarily unavailable") != 0)
        fprintf(stderr, "message: %s\n", moert_last_error());
    sleep_ms(400); /* ranks left running would now touch the freed runtime */

    /* the same at a training step: the runtime is usable for the error, and destroyed cleanly */
    EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (rt) {
        moert_step_record rec;
        atomic_store(&calls, 0);
        atomic_store(&fail_call, 4);
        rc = moert_runtime_step(rt, 1, &rec);
        atomic_store(&fail_call, 0);
        EXPECT_EQ_INT(rc, MOERT_ERR_INTERNAL);
        EXPECT(strcmp(moert_last_error(), "pthread_create for rank 3 failed: Resource temporarily unavailable") == 0);
        moert_runtime_destroy(rt);
    }
    sleep_ms(400);
    moert_config_free(cfg);
    return test_finish("test_thread_failures");
}
