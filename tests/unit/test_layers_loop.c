/* SPDX-License-Identifier: Apache-2.0 */
/* What a training loop around the layers calls (API version 6), on the CPU through public calls only:
 * - MOERT_LAUNCH_RESIDUAL: y = x + MoE(x) and dx = dy + the MoE branch's gradient;
 * - tokens per expert of the last forward, trace spans, the offload boundary, memory from the layers;
 * - collectives over the world and the expert groups (ranks as threads), the barrier, moert_comm_fail;
 * - the loaded plugins' descriptions, the memory estimate, and CUDA graph calls refused on the CPU.
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "moert/moert.h"
#include "test_util.h"

#define H 16
#define E 8
#define K 2
#define T 32

static const char *const config_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\"}, \"parallel\": {\"ranks\": 1, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 32},"
    " \"memory_policy\": {\"fc1_out\": \"offload\"}}";

static moert_config *load_config(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(config_json, "layers-loop-test", &cfg));
    return cfg;
}

/* One rank's layers with every parameter bound to calloc'd memory and moert's initial values. */
typedef struct bound_layers {
    moert_layers *m;
    void *mem[2][MOERT_PARAM_COUNT][2];
} bound_layers;

static moert_result open_layers(const moert_config *cfg, const moert_launch *launch, bound_layers *b)
{
    memset(b, 0, sizeof *b);
    moert_result rc = moert_layers_create(cfg, launch, &b->m);
    if (rc != MOERT_OK) return rc;
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            moert_tensor d;
            if (moert_layers_param_desc(b->m, l, (moert_param_id)p, &d) != MOERT_OK) continue;
            moert_tensor v = d, g = d;
            v.data = b->mem[l][p][0] = calloc((size_t)moert_tensor_numel(&d), sizeof(double));
            g.data = b->mem[l][p][1] = calloc((size_t)moert_tensor_numel(&d), sizeof(double));
            EXPECT_OK(moert_layers_bind_param(b->m, l, (moert_param_id)p, &v, &g));
        }
    return moert_layers_init_params(b->m, 7, NULL);
}

static void close_layers(bound_layers *b)
{
    moert_layers_destroy(b->m);
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            free(b->mem[l][p][0]);
            free(b->mem[l][p][1]);
        }
}

/* The residual flag against the caller adding the residual; tokens per expert, spans and figures of that run. */
static void test_residual_and_figures(void)
{
    moert_config *cfg = load_config();
    moert_launch plain = {.struct_size = sizeof plain, .rank = 0, .world_size = 1, .device = moert_cpu()};
    moert_launch residual = plain;
    residual.flags = MOERT_LAUNCH_RESIDUAL;
    bound_layers a, b;
    EXPECT_OK(open_layers(cfg, &plain, &a));
    EXPECT_OK(open_layers(cfg, &residual, &b));
    double x[T * H], dy[T * H], ya[T * H], yb[T * H], dxa[T * H], dxb[T * H];
    uint64_t s = 3;
    for (int i = 0; i < T * H; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x[i] = (double)(s >> 11) / 9007199254740992.0 - 0.5;
        dy[i] = 0.1 * sin((double)i);
    }
    moert_tensor tx = moert_tensor_2d(x, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tya = moert_tensor_2d(ya, moert_cpu(), MOERT_F64, T, H), tyb = tya;
    tyb.data = yb;
    moert_tensor tdy = moert_tensor_2d(dy, moert_cpu(), MOERT_F64, T, H);
    moert_tensor tdxa = moert_tensor_2d(dxa, moert_cpu(), MOERT_F64, T, H), tdxb = tdxa;
    tdxb.data = dxb;
    moert_saved *sa = NULL, *sb = NULL;
    EXPECT_OK(moert_moe_forward(a.m, 0, &tx, &tya, NULL, &sa, NULL));
    EXPECT_OK(moert_moe_forward(b.m, 0, &tx, &tyb, NULL, &sb, NULL));
    int64_t same = 0;
    for (int i = 0; i < T * H; i++) same += yb[i] == x[i] + ya[i];
    EXPECT_EQ_INT(same, T * H);
    int64_t before[E], after[E];
    moert_tensor tb = moert_tensor_1d(before, moert_cpu(), MOERT_I64, E), ta = tb;
    ta.data = after;
    EXPECT_OK(moert_saved_tokens_per_expert(sa, &tb, NULL));
    moert_backward_options opts = {.struct_size = sizeof opts, .router_loss_scale = 1.0, .accumulate = false};
    EXPECT_OK(moert_moe_backward(a.m, sa, &tdy, &tdxa, &opts, NULL));
    EXPECT_OK(moert_moe_backward(b.m, sb, &tdy, &tdxb, &opts, NULL));
    double worst = 0.0;
    for (int i = 0; i < T * H; i++) worst = fmax(worst, fabs(dxb[i] - (dy[i] + dxa[i])));
    EXPECT(worst < 1e-12);
    /* the last forward's counts after its backward, as the saved forward gave them */
    EXPECT_OK(moert_layers_tokens_per_expert(a.m, 0, &ta, NULL));
    int64_t sum = 0;
    for (int e = 0; e < E; e++) {
        EXPECT_EQ_INT(after[e], before[e]);
        sum += after[e];
    }
    EXPECT_EQ_INT(sum, T * K);
    EXPECT_EQ_INT(moert_layers_tokens_per_expert(a.m, 1, &ta, NULL), MOERT_ERR_INVALID_ARGUMENT); /* no forward yet */
    moert_span spans[MOERT_LAYERS_MAX_SPANS];
    int n = -1;
    EXPECT_OK(moert_layers_spans(a.m, 0, 0, spans, MOERT_LAYERS_MAX_SPANS, &n));
    EXPECT(n > 0);
    int dispatcher_calls = 0;
    for (int i = 0; i < n; i++) {
        EXPECT(spans[i].name && spans[i].stream && spans[i].dur_s >= 0.0);
        if (!strcmp(spans[i].stream, "dispatcher")) dispatcher_calls += !strncmp(spans[i].name, "dispatcher.", 11);
    }
    EXPECT_EQ_INT(dispatcher_calls, MOERT_LAYER_DISPATCHER_CALLS); /* the five calls' own spans */
    /* then the host's (API version 10): one per span of the streams, in their order; on the CPU, where the host runs
     * the work, at the same times */
    EXPECT(n % 2 == 0);
    const int device_spans = n / 2;
    EXPECT(!strcmp(spans[device_spans - 1].stream, "dispatcher"));
    for (int i = 0; i < device_spans; i++) {
        const moert_span *d = &spans[i], *h = &spans[device_spans + i];
        EXPECT(!strcmp(h->stream, "host"));
        EXPECT(!strcmp(h->name, d->name));
        EXPECT_NEAR(h->start_s, d->start_s, 0, 1e-12);
        EXPECT_NEAR(h->dur_s, d->dur_s, 0, 1e-12);
    }
    /* a caller built before API version 10 passes the capacity it knew and gets the streams' spans first (then as
     * many of the host's as fit) */
    const int old_capacity = MOERT_LAYER_STAGES - 1 + MOERT_LAYER_BACKWARD_PARTS + MOERT_LAYER_DISPATCHER_CALLS;
    EXPECT_OK(moert_layers_spans(a.m, 0, 0, spans, old_capacity, &n));
    EXPECT_EQ_INT(n, old_capacity);
    EXPECT(device_spans <= old_capacity && !strcmp(spans[device_spans - 1].stream, "dispatcher"));
    EXPECT_OK(moert_layers_spans(a.m, 0, 0, spans, 2, &n));
    EXPECT_EQ_INT(n, 2);
    EXPECT_OK(moert_layers_release_offloaded(a.m, NULL));
    moert_layer_figures fig = {.struct_size = sizeof fig};
    EXPECT_OK(moert_layers_figures(a.m, 0, &fig));
    EXPECT(fig.offload_saved_bytes > 0);
    EXPECT_EQ_INT(fig.device_pool_calls, 0);
    moert_layers_info info = {.struct_size = sizeof info};
    EXPECT_OK(moert_layers_get_info(a.m, &info));
    EXPECT(info.stream == NULL);
    close_layers(&a);
    close_layers(&b);
    moert_config_free(cfg);
}

/* Memory, plugins, the memory estimate and the CUDA-only calls on CPU layers. */
static void test_services(void)
{
    moert_config *cfg = load_config();
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    bound_layers b;
    EXPECT_OK(open_layers(cfg, &launch, &b));
    void *p = NULL;
    EXPECT_OK(moert_layers_alloc(b.m, moert_cpu(), 64, &p));
    EXPECT(p != NULL);
    moert_layers_free(b.m, moert_cpu(), p);
    EXPECT_OK(moert_layers_alloc(b.m, (moert_device){MOERT_DEVICE_CUDA_HOST, 0}, 64, &p));
    moert_layers_free(b.m, (moert_device){MOERT_DEVICE_CUDA_HOST, 0}, p);
    EXPECT_EQ_INT(moert_layers_alloc(b.m, (moert_device){MOERT_DEVICE_CUDA, 0}, 64, &p), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_layers_alloc");

    moert_plugin_description d = {.struct_size = sizeof d};
    EXPECT_OK(moert_layers_plugin(b.m, MOERT_KIND_PRECISION, &d));
    EXPECT(strcmp(d.kind_name, "precision") == 0 && strcmp(d.name, "bf16") == 0);
    EXPECT(d.agreement_rtol > 0.0 && d.agreement_rtol < 1.0);
    EXPECT(strstr(d.path, "libmoert-precision-bf16") != NULL);
    EXPECT_OK(moert_layers_plugin(b.m, MOERT_KIND_ROUTER, &d));
    EXPECT(d.agreement_rtol == 0.0);

    char why[256] = "";
    EXPECT(!moert_layers_graph_capturable(b.m, why, sizeof why));
    EXPECT(why[0] != '\0');
    EXPECT_EQ_INT(moert_layers_capture_begin(b.m, NULL), MOERT_ERR_UNSUPPORTED);
    moert_graph *g = NULL;
    EXPECT_EQ_INT(moert_layers_capture_end(b.m, NULL, "test", &g), MOERT_ERR_UNSUPPORTED);
    moert_graph_destroy(NULL);
    close_layers(&b);

    char line[512] = "";
    EXPECT_OK(moert_config_memory_estimate(cfg, 2, MOERT_DEVICE_CPU, line, sizeof line));
    EXPECT(line[0] != '\0');
    /* a buffer too small for the line: refused, saying how much it needs, and left as it was (it was cut) */
    char small[4] = "abc";
    EXPECT_EQ_INT(moert_config_memory_estimate(cfg, 2, MOERT_DEVICE_CPU, small, sizeof small),
                  MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_config_memory_estimate: buf has 4 bytes, the line needs");
    EXPECT(strcmp(small, "abc") == 0);
    EXPECT_OK(moert_config_set(cfg, "model.hidden", "65536"));
    EXPECT_OK(moert_config_set(cfg, "model.ffn_hidden", "262144"));
    EXPECT_EQ_INT(moert_config_memory_estimate(cfg, 1, MOERT_DEVICE_CPU, line, sizeof line), MOERT_ERR_OUT_OF_MEMORY);
    moert_config_free(cfg);

#ifndef MOERT_HAVE_CUDA
    moert_launcher_env env = {.struct_size = sizeof env};
    moert_comm *c = NULL;
    EXPECT_EQ_INT(moert_comm_create_launcher(10.0, &env, &c), MOERT_ERR_UNSUPPORTED);
#endif
}

/* ---- collectives: two ranks as threads, their experts replicated over EDP 2 ---- */

typedef struct rank_run {
    int rank;
    moert_comm *comm;
    const moert_config *cfg;
    bool fail_peer; /* rank 1 fails between collectives; rank 0's next collective must return */
    moert_result rc_world, rc_edp, rc_ep, rc_barrier, rc_after_fail;
    moert_result rc_bad_ndim, rc_bad_size; /* refused before any collective: no rank waits for the other */
    char bad_size_message[256];
    double world_sum[2], edp_sum, ep_sum;
    int64_t counts[3];
} rank_run;

static void *rank_main(void *arg)
{
    rank_run *r = arg;
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = r->rank,
                           .world_size = 2,
                           .device = moert_cpu(),
                           .comm = r->comm,
                           .expert_data_parallel = 2};
    bound_layers b;
    if (open_layers(r->cfg, &launch, &b) != MOERT_OK) {
        moert_comm_fail(r->comm, r->rank, moert_last_error());
        close_layers(&b);
        return NULL;
    }
    if (r->fail_peer) {
        if (r->rank == 1) {
            moert_comm_fail(r->comm, 1, "rank 1 gave up");
        } else {
            r->rc_after_fail = moert_layers_barrier(b.m);
        }
        close_layers(&b);
        return NULL;
    }
    r->world_sum[0] = r->rank + 1.0;
    r->world_sum[1] = 10.0 * r->rank;
    moert_tensor w = moert_tensor_1d(r->world_sum, moert_cpu(), MOERT_F64, 2);
    moert_tensor bad = w;
    bad.ndim = 200;
    r->rc_bad_ndim = moert_layers_allreduce_sum(b.m, MOERT_GROUP_WORLD, &bad, NULL);
    bad = w;
    bad.shape[0] = -5;
    r->rc_bad_size = moert_layers_allreduce_sum(b.m, MOERT_GROUP_WORLD, &bad, NULL);
    snprintf(r->bad_size_message, sizeof r->bad_size_message, "%s", moert_last_error());
    r->rc_world = moert_layers_allreduce_sum(b.m, MOERT_GROUP_WORLD, &w, NULL);
    r->edp_sum = r->rank + 1.0;
    moert_tensor e = moert_tensor_1d(&r->edp_sum, moert_cpu(), MOERT_F64, 1);
    r->rc_edp = moert_layers_allreduce_sum(b.m, MOERT_GROUP_EDP, &e, NULL);
    r->ep_sum = r->rank + 1.0;
    moert_tensor p = moert_tensor_1d(&r->ep_sum, moert_cpu(), MOERT_F64, 1);
    r->rc_ep = moert_layers_allreduce_sum(b.m, MOERT_GROUP_EP, &p, NULL); /* EP 1: this rank alone */
    for (int i = 0; i < 3; i++) r->counts[i] = r->rank * 100 + i;
    moert_tensor c = moert_tensor_1d(r->counts, moert_cpu(), MOERT_I64, 3);
    if (r->rc_world == MOERT_OK) r->rc_world = moert_layers_allreduce_sum(b.m, MOERT_GROUP_WORLD, &c, NULL);
    r->rc_barrier = moert_layers_barrier(b.m);
    close_layers(&b);
    return NULL;
}

static void run_two(const moert_config *cfg, bool fail_peer, rank_run *runs)
{
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(2, 5.0, &comm));
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        runs[i] = (rank_run){.rank = i, .comm = comm, .cfg = cfg, .fail_peer = fail_peer};
        pthread_create(&th[i], NULL, rank_main, &runs[i]);
    }
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    moert_comm_destroy(comm);
}

static void test_collectives(void)
{
    moert_config *cfg = load_config();
    rank_run runs[2];
    run_two(cfg, false, runs);
    for (int i = 0; i < 2; i++) {
        EXPECT_OK(runs[i].rc_world);
        EXPECT_OK(runs[i].rc_edp);
        EXPECT_OK(runs[i].rc_ep);
        EXPECT_OK(runs[i].rc_barrier);
        EXPECT(runs[i].world_sum[0] == 3.0 && runs[i].world_sum[1] == 10.0);
        EXPECT(runs[i].edp_sum == 3.0);
        EXPECT(runs[i].ep_sum == i + 1.0);
        for (int k = 0; k < 3; k++) EXPECT_EQ_INT(runs[i].counts[k], 100 + 2 * k);
        EXPECT_EQ_INT(runs[i].rc_bad_ndim, MOERT_ERR_INVALID_ARGUMENT);
        EXPECT_EQ_INT(runs[i].rc_bad_size, MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(runs[i].bad_size_message,
                      "moert_layers_allreduce_sum: buf has size -5 in dimension 0, expected >= 0") != NULL);
    }
    /* a rank that fails between collectives releases its peer at once (not after the 5 s timeout) */
    run_two(cfg, true, runs);
    EXPECT(runs[0].rc_after_fail != MOERT_OK);
    moert_config_free(cfg);
}

int main(void)
{
    test_residual_and_figures();
    test_services();
    test_collectives();
    return test_finish("layers_loop");
}
