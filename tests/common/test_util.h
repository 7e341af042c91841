/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by moert's tests: assertions, plugin instances, ranks as threads. */
#ifndef MOERT_TEST_UTIL_H
#define MOERT_TEST_UTIL_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm.h"
#include "config.h"
#include "error.h"
#include "host.h"
#include "loader.h"
#include "moert/moert.h"

#define TEST_SKIP 77

extern int test_failures;

#define EXPECT(cond)                                                                                                   \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);                                        \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

#define EXPECT_EQ_INT(a, b)                                                                                            \
    do {                                                                                                               \
        long long _a = (long long)(a), _b = (long long)(b);                                                            \
        if (_a != _b) {                                                                                                \
            fprintf(stderr, "%s:%d: %s == %lld, expected %s == %lld\n", __FILE__, __LINE__, #a, _a, #b, _b);           \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

/* |a-b| <= atol + rtol*|b| */
#define EXPECT_NEAR(a, b, atol, rtol)                                                                                  \
    do {                                                                                                               \
        double _a = (double)(a), _b = (double)(b);                                                                     \
        if (!(fabs(_a - _b) <= (atol) + (rtol)*fabs(_b))) {                                                            \
            fprintf(stderr, "%s:%d: %s = %.10g, expected %.10g (%s)\n", __FILE__, __LINE__, #a, _a, _b, #b);           \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

/* A moert call that must succeed; prints the error message otherwise. */
#define EXPECT_OK(call)                                                                                                \
    do {                                                                                                               \
        moert_result _r = (call);                                                                                      \
        if (_r != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, moert_error_message());               \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

/* The last error message must contain `needle`. */
#define EXPECT_ERROR_CONTAINS(needle)                                                                                  \
    do {                                                                                                               \
        const char *_m = moert_error_message();                                                                        \
        if (!strstr(_m, (needle))) {                                                                                   \
            fprintf(stderr, "%s:%d: error message \"%s\" lacks \"%s\"\n", __FILE__, __LINE__, _m, (needle));           \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

/* Ends a test: 0 if nothing failed. */
int test_finish(const char *name);

/* One plugin instance for one layer on one rank, with options from JSON text. */
typedef struct test_instance {
    moert_plugin plugin;
    json_t *options;
    moert_section *section;
    moert_host *host;
    void *ctx;
} test_instance;

/* Loads plugin `spec` of `kind`, builds its host (comm may be NULL for one rank) and calls init. */
moert_result test_instance_open(test_instance *ti, moert_plugin_kind kind, const char *spec, const char *options_json,
                                const moert_layer_info *layer, moert_comm_group *comm, int rank, int world);
/* The same on a CUDA rank: the host gets the rank's memory pool, NCCL communicator (may be NULL for a world
 * of one) and stream, as the runtime's rank_init gives them (core/src/host.h). No CUDA header needed. */
moert_result test_instance_open_cuda(test_instance *ti, moert_plugin_kind kind, const char *spec,
                                     const char *options_json, const moert_layer_info *layer, moert_comm_group *comm,
                                     int rank, int world, struct moert_cuda_pool *pool, struct moert_nccl_comm *nccl,
                                     moert_stream stream);
/* Receives the figures a plugin reports (host->metric): name, value and unit of each. */
typedef void (*test_metric_fn)(void *user, const char *name, double value, const char *unit);
/* test_instance_open_cuda (pool, nccl and stream may be NULL on the CPU) with the host's figures handed to
 * metric(metric_user, ...), so a test can check what a plugin reports. */
moert_result test_instance_open_metrics(test_instance *ti, moert_plugin_kind kind, const char *spec,
                                        const char *options_json, const moert_layer_info *layer, moert_comm_group *comm,
                                        int rank, int world, struct moert_cuda_pool *pool, struct moert_nccl_comm *nccl,
                                        moert_stream stream, test_metric_fn metric, void *metric_user);
void test_instance_close(test_instance *ti);
/* Checks that plugin `spec` of `kind` refuses a layer on a device it has no path for, with MOERT_ERR_UNSUPPORTED and
 * a message naming `what` (e.g. "the bf16 precision plugin") and the device: pinned host memory always, a CUDA
 * device in a build without CUDA. `layer` is otherwise valid for the plugin. */
void test_expect_device_refused(moert_plugin_kind kind, const char *spec, const moert_layer_info *layer,
                                const char *what);

/* Runs fn(rank, user) on `world` threads and waits for them. */
void test_run_ranks(int world, void (*fn)(int rank, void *user), void *user);

/* Deterministic uniform numbers in [-1, 1) from a seed (splitmix64). */
double test_uniform(uint64_t *state);

/* A layer description with the common fields filled. */
moert_layer_info test_layer(int64_t hidden, int64_t ffn, int64_t experts, int64_t topk, int64_t tokens, int world,
                            int rank, moert_dtype dtype);

#endif
