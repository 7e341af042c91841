/* SPDX-License-Identifier: Apache-2.0 */
#include "test_util.h"

#include <pthread.h>

#include "error.h"

int test_failures = 0;

int test_finish(const char *name)
{
    if (test_failures) {
        fprintf(stderr, "%s: %d check(s) failed\n", name, test_failures);
        return 1;
    }
    printf("%s: all checks passed\n", name);
    return 0;
}

static moert_result instance_init(test_instance *ti, const moert_layer_info *layer)
{
    moert_result rc = moert_plugin_init(&ti->plugin, &ti->ctx, ti->host, layer);
    if (rc != MOERT_OK) return rc;
    return moert_section_check_unknown(ti->section);
}

void test_expect_device_refused(moert_plugin_kind kind, const char *spec, const moert_layer_info *layer,
                                const char *what)
{
    char want[160];
    test_instance ti;
    moert_layer_info elsewhere = *layer;
    elsewhere.device = (moert_device){MOERT_DEVICE_CUDA_HOST, 0};
    EXPECT_EQ_INT(test_instance_open(&ti, kind, spec, "{}", &elsewhere, NULL, 0, 1), MOERT_ERR_UNSUPPORTED);
    snprintf(want, sizeof want, "%s runs on the CPU or a CUDA device, not on cuda_host", what);
    EXPECT_ERROR_CONTAINS(want);
    test_instance_close(&ti);
#ifndef MOERT_HAVE_CUDA
    elsewhere.device = (moert_device){MOERT_DEVICE_CUDA, 1};
    EXPECT_EQ_INT(test_instance_open(&ti, kind, spec, "{}", &elsewhere, NULL, 0, 1), MOERT_ERR_UNSUPPORTED);
    snprintf(want, sizeof want, "%s has only a CPU path in this build (built without CUDA); the layer is on cuda:1",
             what);
    EXPECT_ERROR_CONTAINS(want);
    test_instance_close(&ti);
#endif
}

moert_result test_instance_open(test_instance *ti, moert_plugin_kind kind, const char *spec, const char *options_json,
                                const moert_layer_info *layer, moert_comm_group *comm, int rank, int world)
{
    return test_instance_open_cuda(ti, kind, spec, options_json, layer, comm, rank, world, NULL, NULL, NULL);
}

moert_result test_instance_open_cuda(test_instance *ti, moert_plugin_kind kind, const char *spec,
                                     const char *options_json, const moert_layer_info *layer, moert_comm_group *comm,
                                     int rank, int world, struct moert_cuda_pool *pool, struct moert_nccl_comm *nccl,
                                     moert_stream stream)
{
    return test_instance_open_metrics(ti, kind, spec, options_json, layer, comm, rank, world, pool, nccl, stream, NULL,
                                      NULL);
}

moert_result test_instance_open_metrics(test_instance *ti, moert_plugin_kind kind, const char *spec,
                                        const char *options_json, const moert_layer_info *layer, moert_comm_group *comm,
                                        int rank, int world, struct moert_cuda_pool *pool, struct moert_nccl_comm *nccl,
                                        moert_stream stream, test_metric_fn metric, void *metric_user)
{
    memset(ti, 0, sizeof *ti);
    moert_result rc = moert_plugin_load(kind, spec, &ti->plugin);
    if (rc != MOERT_OK) return rc;
    json_error_t jerr;
    ti->options = json_loads(options_json ? options_json : "{}", 0, &jerr);
    if (!ti->options) return moert_error(MOERT_ERR_CONFIG, "test options: %s", jerr.text);
    ti->section = moert_section_create(ti->options, "$.test");
    moert_section_allow(ti->section, "plugin");
    moert_host_setup setup = {.who = spec,
                              .options = ti->section,
                              .comm = comm,
                              .rank = rank,
                              .world_size = world,
                              .device = layer->device,
                              .metric = metric,
                              .metric_user = metric_user,
                              .cuda_pool = pool,
                              .nccl = nccl,
                              .stream = stream};
    rc = moert_host_create(&setup, &ti->host);
    if (rc != MOERT_OK) return rc;
    return instance_init(ti, layer);
}

void test_instance_close(test_instance *ti)
{
    if (ti->ctx) moert_plugin_finalize(&ti->plugin, ti->ctx);
    if (ti->host) moert_host_free(ti->host);
    if (ti->section) moert_section_free(ti->section);
    if (ti->options) json_decref(ti->options);
    if (ti->plugin.dl) moert_plugin_unload(&ti->plugin);
    memset(ti, 0, sizeof *ti);
}

typedef struct rank_thread {
    void (*fn)(int, void *);
    void *user;
    int rank;
} rank_thread;

static void *rank_main(void *p)
{
    rank_thread *t = p;
    t->fn(t->rank, t->user);
    return NULL;
}

void test_run_ranks(int world, void (*fn)(int rank, void *user), void *user)
{
    pthread_t th[64];
    rank_thread args[64];
    for (int r = 0; r < world; r++) {
        args[r] = (rank_thread){fn, user, r};
        pthread_create(&th[r], NULL, rank_main, &args[r]);
    }
    for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
}

double test_uniform(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

moert_layer_info test_layer(int64_t hidden, int64_t ffn, int64_t experts, int64_t topk, int64_t tokens, int world,
                            int rank, moert_dtype dtype)
{
    moert_layer_info l = {.struct_size = sizeof(moert_layer_info),
                          .layer_index = 0,
                          .num_layers = 1,
                          .hidden = hidden,
                          .ffn_hidden = ffn,
                          .num_experts = experts,
                          .topk = topk,
                          .num_local_experts = experts / world,
                          .first_local_expert = (experts / world) * rank,
                          .max_tokens = tokens,
                          .dtype = dtype,
                          .device = moert_cpu()};
    return l;
}
