/* SPDX-License-Identifier: Apache-2.0 */
/* MoE Parallel Folding (docs/parallel.md): the MoE layers' own ETP x EP x EDP grid over 8 CPU ranks as threads.
 * - The trainer (moert_runtime_*): EP8, EP4 x EDP2, EP2 x ETP2 x EDP2, ETP2 x EP4 and ETP8 give the loss, the
 *   stack's output, every gradient (router, experts, shared expert) and a training curve of the EP1 run (8 ranks,
 *   EDP8: every rank holds every expert) on the same global batch, to 1e-12 (fp64); also with both dispatchers, with
 *   every activation recomputed, and with offloaded ones.
 * - The embedding API: the same layouts through moert_launch, the caller reducing the expert gradients over each EDP
 *   group and the router's and shared expert's over every rank, once over a caller's collectives table; the layers'
 *   info reports each rank's place in the grid.
 * - Bad layouts are refused with messages naming the key: the product, experts or width that do not split, deepep in
 *   an expert-parallel group smaller than the world (CPU ranks; GPUs: tests/gpu/test_gpu_folding.c).
 */
#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "comm.h"
#include "runtime.h"
#include "test_util.h"

#define WORLD     8
#define H         8
#define F         16
#define E         8
#define FS        6 /* the shared expert's width */
#define TOKENS    6 /* per rank */
#define TOTAL     (WORLD * TOKENS)
#define TOLERANCE 1e-12

typedef struct layout {
    int etp, ep, edp;
} layout;

/* The layouts compared with EP1 (EDP8). */
static const layout layouts[] = {{1, 8, 1}, {1, 4, 2}, {2, 2, 2}, {2, 4, 1}, {8, 1, 1}};
#define LAYOUTS (int)(sizeof layouts / sizeof layouts[0])
static const layout ep1 = {1, 1, 8};

/* ---- the trainer ---- */

static const char *trainer_config =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 16, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\", \"shared_expert_ffn_hidden\": 6, \"shared_expert_gate\": true},"
    " \"parallel\": {\"ranks\": 8, \"expert_tensor_parallel\": %d, \"expert_data_parallel\": %d,"
    " \"expert_parallel\": %d}, \"train\": {\"tokens_per_rank\": 6, \"seed\": 5, \"lr\": 0.01},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.01,"
    " \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01, \"z_loss_coeff\": 0.001},"
    " \"dispatcher\": {\"plugin\": \"%s\"}, \"memory_policy\": %s}";

#define CURVE 3

/* What a run of the trainer gives: the first step's loss, output and gradients (global order), then a curve. */
typedef struct outcome {
    double loss;
    double *output;
    double *grads;
    int64_t grad_count;
    double curve[CURVE];
    bool ok;
} outcome;

static moert_config *trainer_cfg(layout l, const char *dispatcher, const char *memory)
{
    char json[2048];
    snprintf(json, sizeof json, trainer_config, l.etp, l.edp, l.ep, dispatcher, memory);
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "folding-test", &cfg));
    return cfg;
}

static void train(layout l, const char *dispatcher, const char *memory, outcome *out)
{
    memset(out, 0, sizeof *out);
    moert_config *cfg = trainer_cfg(l, dispatcher, memory);
    moert_runtime *rt = NULL;
    if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    if (moert_runtime_forward_backward(rt, 1, &out->loss) != MOERT_OK) {
        fprintf(stderr, "ETP%d x EP%d x EDP%d: %s\n", l.etp, l.ep, l.edp, moert_error_message());
        test_failures++;
        goto exit;
    }
    const int64_t outputs = moert_runtime_output_numel(rt);
    out->output = calloc((size_t)outputs, sizeof(double));
    for (int64_t i = 0; i < outputs; i++) EXPECT_OK(moert_runtime_output(rt, i, &out->output[i]));
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) out->grad_count += 2 * moert_runtime_param_numel(rt, (moert_param_id)p);
    out->grads = calloc((size_t)out->grad_count, sizeof(double));
    int64_t k = 0;
    for (int layer = 0; layer < 2; layer++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++)
            for (int64_t i = 0; i < moert_runtime_param_numel(rt, (moert_param_id)p); i++)
                EXPECT_OK(
                    moert_runtime_param(rt, layer, (moert_param_id)p, i, MOERT_PARAM_READ, NULL, &out->grads[k++]));
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = CURVE};
    EXPECT_OK(moert_runtime_train(rt, &opts));
    for (int s = 0; s < CURVE && s < rt->record_count; s++) out->curve[s] = rt->records[s].loss;
    out->ok = true;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

static void free_outcome(outcome *o)
{
    free(o->output);
    free(o->grads);
}

/* The largest difference of b from a, each value relative to max(1, |a|). */
static double worst_of(const double *a, const double *b, int64_t n)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs(a[i] - b[i]) / fmax(1.0, fabs(a[i])));
    return worst;
}

static void compare_trainer(const char *dispatcher, const char *memory)
{
    outcome ref, got;
    train(ep1, dispatcher, memory, &ref);
    if (!ref.ok) return;
    for (int i = 0; i < LAYOUTS; i++) {
        layout l = layouts[i];
        train(l, dispatcher, memory, &got);
        if (got.ok) {
            double worst = fabs(got.loss - ref.loss) / fmax(1.0, fabs(ref.loss));
            worst = fmax(worst, worst_of(ref.output, got.output, TOTAL * H));
            worst = fmax(worst, worst_of(ref.grads, got.grads, ref.grad_count));
            worst = fmax(worst, worst_of(ref.curve, got.curve, CURVE));
            printf("trainer, %s, memory %s: ETP%d x EP%d x EDP%d against EP1 (EDP8): loss %.15f, worst difference "
                   "%.2e\n",
                   dispatcher, memory, l.etp, l.ep, l.edp, got.loss, worst);
            EXPECT(worst <= TOLERANCE);
        }
        free_outcome(&got);
    }
    free_outcome(&ref);
}

/* ---- the embedding API ---- */

static const char *const api_config =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 16, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\", \"shared_expert_ffn_hidden\": 6},"
    " \"parallel\": {\"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 6},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";

static double uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static moert_tensor t2(double *p, int64_t a, int64_t b) { return moert_tensor_2d(p, moert_cpu(), MOERT_F64, a, b); }

/* A caller's collectives table, here over the library's own threads group (so the subgroups run over a table). */
typedef struct table_user {
    moert_comm_group *group;
    int rank;
} table_user;

static int tbl_allgather(void *user, const void *send, void *recv, size_t bytes, char *error, size_t size)
{
    table_user *u = user;
    (void)error, (void)size;
    return moert_comm_allgather(u->group, u->rank, send, recv, bytes) != MOERT_OK;
}

static int tbl_allreduce(void *user, void *buf, size_t count, moert_dtype dtype, char *error, size_t size)
{
    table_user *u = user;
    (void)error, (void)size;
    return moert_comm_allreduce_sum(u->group, u->rank, buf, count, dtype) != MOERT_OK;
}

static int tbl_alltoallv(void *user, const void *send, const size_t *send_bytes, const size_t *send_offsets, void *recv,
                         const size_t *recv_bytes, const size_t *recv_offsets, char *error, size_t size)
{
    table_user *u = user;
    (void)error, (void)size;
    return moert_comm_alltoallv(u->group, u->rank, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets) !=
           MOERT_OK;
}

static int tbl_barrier(void *user, char *error, size_t size)
{
    table_user *u = user;
    (void)error, (void)size;
    return moert_comm_barrier(u->group, u->rank, "table barrier") != MOERT_OK;
}

/* One rank of an API run: its layers, parameters and gradients. */
typedef struct api_rank {
    int rank;
    layout l;
    moert_comm *comm; /* the threads communicator, or NULL: a table over `group` */
    moert_comm_group *group;
    const moert_config *cfg;
    const double *x, *r; /* global [TOTAL, H] */
    double *y, *dx;      /* global: this rank writes its rows */
    double *value[2][MOERT_PARAM_COUNT], *grad[2][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
    moert_layers_info info;
    moert_result rc;
} api_rank;

static void *api_main(void *arg)
{
    api_rank *a = arg;
    moert_comm *own = NULL;
    table_user user = {.group = a->group, .rank = a->rank};
    if (!a->comm) {
        moert_collectives table = {.struct_size = sizeof table,
                                   .user = &user,
                                   .allgather = tbl_allgather,
                                   .allreduce_sum = tbl_allreduce,
                                   .alltoallv = tbl_alltoallv,
                                   .barrier = tbl_barrier};
        a->rc = moert_comm_create_collectives(WORLD, &table, &own);
        if (a->rc != MOERT_OK) return NULL;
    }
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = a->rank,
                           .world_size = WORLD,
                           .device = moert_cpu(),
                           .comm = a->comm ? a->comm : own,
                           .expert_tensor_parallel = a->l.etp,
                           .expert_data_parallel = a->l.edp};
    moert_layers *m = NULL;
    moert_result rc = moert_layers_create(a->cfg, &launch, &m);
    if (rc == MOERT_OK) {
        a->info.struct_size = sizeof a->info;
        rc = moert_layers_get_info(m, &a->info);
    }
    for (int layer = 0; layer < 2 && rc == MOERT_OK; layer++)
        for (int p = 0; p < MOERT_PARAM_COUNT && rc == MOERT_OK; p++) {
            moert_tensor d;
            if (moert_layers_param_desc(m, layer, (moert_param_id)p, &d) != MOERT_OK) continue;
            a->numel[p] = moert_tensor_numel(&d);
            a->value[layer][p] = calloc((size_t)a->numel[p], sizeof(double));
            a->grad[layer][p] = calloc((size_t)a->numel[p], sizeof(double));
            moert_tensor v = d, g = d;
            v.data = a->value[layer][p];
            g.data = a->grad[layer][p];
            rc = moert_layers_bind_param(m, layer, (moert_param_id)p, &v, &g);
        }
    if (rc == MOERT_OK) rc = moert_layers_init_params(m, 11, NULL);
    const int64_t first = (int64_t)a->rank * TOKENS;
    double y0[TOKENS * H], d1[TOKENS * H];
    moert_tensor tx = t2((double *)a->x + first * H, TOKENS, H), ty0 = t2(y0, TOKENS, H);
    moert_tensor ty = t2(a->y + first * H, TOKENS, H), tr = t2((double *)a->r + first * H, TOKENS, H);
    moert_tensor td1 = t2(d1, TOKENS, H), tdx = t2(a->dx + first * H, TOKENS, H);
    moert_saved *s0 = NULL, *s1 = NULL;
    moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 0.5, .accumulate = false};
    if (rc == MOERT_OK) rc = moert_moe_forward(m, 0, &tx, &ty0, NULL, &s0, NULL);
    if (rc == MOERT_OK) rc = moert_moe_forward(m, 1, &ty0, &ty, NULL, &s1, NULL);
    if (rc == MOERT_OK) rc = moert_moe_backward(m, s1, &tr, &td1, &o, NULL);
    if (rc == MOERT_OK) rc = moert_moe_backward(m, s0, &td1, &tdx, &o, NULL);
    if (rc != MOERT_OK) fprintf(stderr, "API rank %d: %s\n", a->rank, moert_last_error());
    a->rc = rc;
    moert_layers_destroy(m);
    moert_comm_destroy(own);
    return NULL;
}

static void free_api_rank(api_rank *a)
{
    for (int layer = 0; layer < 2; layer++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            free(a->value[layer][p]);
            free(a->grad[layer][p]);
        }
}

static void run_api(layout l, bool table, const moert_config *cfg, const double *x, const double *r, double *y,
                    double *dx, api_rank *ranks)
{
    moert_comm *comm = NULL;
    moert_comm_group *group = NULL;
    if (table)
        EXPECT_OK(moert_comm_group_create(WORLD, 10.0, &group));
    else
        EXPECT_OK(moert_comm_create_threads(WORLD, 10.0, &comm));
    pthread_t th[WORLD];
    for (int i = 0; i < WORLD; i++) {
        ranks[i] =
            (api_rank){.rank = i, .l = l, .comm = comm, .group = group, .cfg = cfg, .x = x, .r = r, .y = y, .dx = dx};
        pthread_create(&th[i], NULL, api_main, &ranks[i]);
    }
    for (int i = 0; i < WORLD; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < WORLD; i++) EXPECT_OK(ranks[i].rc);
    moert_comm_destroy(comm);
    if (group) moert_comm_group_free(group);
}

/* The global [E, H, 2F] fc1 or [E, F, H] fc2 (value or gradient) from the ranks' shards: what the caller has after
 * reducing the expert gradients over each EDP group (the sum of the replicas' shares), with EDP rank 0's values. */
static void global_experts(const api_rank *ranks, layout l, int layer, int p, bool grad, double *out)
{
    const int64_t fl = F / l.etp, el = E / l.ep;
    memset(out, 0, sizeof(double) * E * H * 2 * F);
    for (int k = 0; k < WORLD; k++) {
        const api_rank *a = &ranks[k];
        const int j = a->info.etp_rank;
        const double *src = grad ? a->grad[layer][p] : a->value[layer][p];
        if (!grad && a->info.edp_rank != 0) continue;
        for (int64_t i = 0; i < a->numel[p]; i++) {
            int64_t e, row, col, at;
            if (p == MOERT_PARAM_FC2) { /* [el, fl, H] */
                e = i / (fl * H), row = i / H % fl, col = i % H;
                at = ((a->info.first_local_expert + e) * F + j * fl + row) * H + col;
            } else { /* [el, H, 2 fl]: gate columns of the shard, then up columns */
                e = i / (H * 2 * fl), row = i / (2 * fl) % H, col = i % (2 * fl);
                int64_t global_col = col < fl ? j * fl + col : F + j * fl + (col - fl);
                at = ((a->info.first_local_expert + e) * H + row) * 2 * F + global_col;
            }
            (void)el;
            out[at] += src[i];
        }
    }
}

static void compare_api(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(api_config, "folding-api-test", &cfg));
    if (!cfg) return;
    uint64_t seed = 29;
    static double x[TOTAL * H], r[TOTAL * H], y_ref[TOTAL * H], dx_ref[TOTAL * H], y[TOTAL * H], dx[TOTAL * H];
    static double a_ref[E * H * 2 * F], a_got[E * H * 2 * F];
    for (int i = 0; i < TOTAL * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    static api_rank ref[WORLD], got[WORLD];
    run_api(ep1, false, cfg, x, r, y_ref, dx_ref, ref);
    for (int i = 0; i <= LAYOUTS; i++) {
        const bool table = i == LAYOUTS; /* last: ETP2 x EP2 x EDP2 over a caller's collectives table */
        const layout l = table ? layouts[2] : layouts[i];
        run_api(l, table, cfg, x, r, y, dx, got);
        double worst = fmax(worst_of(y_ref, y, TOTAL * H), worst_of(dx_ref, dx, TOTAL * H));
        for (int layer = 0; layer < 2; layer++) {
            for (int p = MOERT_PARAM_FC1; p <= MOERT_PARAM_FC2; p++)
                for (int g = 0; g < 2; g++) { /* values (the same initial weights), then reduced gradients */
                    global_experts(ref, ep1, layer, p, g, a_ref);
                    global_experts(got, l, layer, p, g, a_got);
                    worst = fmax(worst, worst_of(a_ref, a_got, E * H * 2 * F));
                }
            /* the router's and the shared expert's: every rank's share, summed over the world */
            for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
                if (p == MOERT_PARAM_FC1 || p == MOERT_PARAM_FC2) continue;
                for (int64_t e = 0; e < ref[0].numel[p]; e++) {
                    double s_ref = 0, s_got = 0;
                    for (int k = 0; k < WORLD; k++)
                        s_ref += ref[k].grad[layer][p][e], s_got += got[k].grad[layer][p][e];
                    worst = fmax(worst, fabs(s_ref - s_got) / fmax(1.0, fabs(s_ref)));
                }
            }
        }
        printf("layers API%s: ETP%d x EP%d x EDP%d against EP1 (EDP8): worst difference %.2e\n",
               table ? " (a collectives table)" : "", l.etp, l.ep, l.edp, worst);
        EXPECT(worst <= TOLERANCE);
        /* each rank's place in the grid: rank = etp + ETP * (ep + EP * edp) */
        for (int k = 0; k < WORLD; k++) {
            const moert_layers_info *in = &got[k].info;
            EXPECT_EQ_INT(in->etp_size, l.etp);
            EXPECT_EQ_INT(in->ep_size, l.ep);
            EXPECT_EQ_INT(in->edp_size, l.edp);
            EXPECT_EQ_INT(in->etp_rank + l.etp * (in->ep_rank + l.ep * in->edp_rank), k);
            EXPECT_EQ_INT(in->num_local_experts, E / l.ep);
            EXPECT_EQ_INT(in->first_local_expert, in->ep_rank * (E / l.ep));
            EXPECT_EQ_INT(in->ffn_hidden, F);
            EXPECT_EQ_INT(in->local_ffn_hidden, F / l.etp);
            free_api_rank(&got[k]);
        }
    }
    for (int k = 0; k < WORLD; k++) free_api_rank(&ref[k]);
    moert_config_free(cfg);
}

/* ---- refused layouts ---- */

static void expect_config_error(const char *json, const char *needle)
{
    moert_config *cfg = NULL;
    EXPECT(moert_config_load_string(json, "folding-errors", &cfg) == MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS(needle);
    moert_config_free(cfg);
}

static void test_errors(void)
{
    expect_config_error("{\"parallel\": {\"ranks\": 8, \"expert_parallel\": 2}}",
                        "config error at $.parallel.expert_parallel: got 2, expected ranks / (expert_tensor_parallel "
                        "x expert_data_parallel): expert_parallel x expert_tensor_parallel x expert_data_parallel "
                        "(2 x 1 x 1) must equal $.parallel.ranks (8)");
    expect_config_error("{\"parallel\": {\"ranks\": 8, \"expert_tensor_parallel\": 3}}",
                        "config error at $.parallel.expert_tensor_parallel: expert_tensor_parallel x "
                        "expert_data_parallel (3 x 1) does not divide $.parallel.ranks (8)");
    expect_config_error("{\"parallel\": {\"ranks\": 8, \"expert_data_parallel\": 3}}",
                        "config error at $.parallel.expert_data_parallel:");
    expect_config_error("{\"model\": {\"num_experts\": 6}, \"parallel\": {\"ranks\": 8, \"expert_data_parallel\": 2}}",
                        "config error at $.parallel.expert_parallel: got 4 (ranks / (expert_tensor_parallel x "
                        "expert_data_parallel)), expected a divisor of $.model.num_experts (6)");
    expect_config_error(
        "{\"model\": {\"ffn_hidden\": 12}, \"parallel\": {\"ranks\": 8, \"expert_tensor_parallel\": 8}}",
        "config error at $.parallel.expert_tensor_parallel: got 8, expected a divisor of "
        "$.model.ffn_hidden (12)");
    /* the plain layout keeps its message */
    expect_config_error("{\"parallel\": {\"ranks\": 3}}",
                        "config error at $.parallel.ranks: got 3, expected a divisor of $.model.num_experts (8)");
    /* a good layout: the sizes as given and derived */
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"ranks\": 8, \"expert_tensor_parallel\": 2, "
                                       "\"expert_data_parallel\": 2}}",
                                       "folding-layout", &cfg));
    if (cfg) {
        EXPECT_EQ_INT(cfg->parallel.expert_parallel, 2);
        EXPECT_EQ_INT(cfg->parallel.expert_tensor_parallel, 2);
        EXPECT_EQ_INT(cfg->parallel.expert_data_parallel, 2);
    }
    moert_config_free(cfg);

    /* deepep's peer buffers need the whole world as its expert-parallel group */
    cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string("{\"parallel\": {\"ranks\": 8, \"expert_data_parallel\": 2, \"device\": "
                                       "\"cpu\"}, \"dispatcher\": {\"plugin\": \"deepep\"}}",
                                       "folding-deepep", &cfg));
    if (cfg) {
        EXPECT(moert_runtime_create(cfg, &rt) != MOERT_OK);
        EXPECT_ERROR_CONTAINS("deepep");
        EXPECT_ERROR_CONTAINS("has 4 of the 8 ranks ($.parallel.expert_parallel)");
        EXPECT_ERROR_CONTAINS("use \"alltoall\" or \"allgather\"");
    }
    moert_runtime_destroy(rt);
    moert_config_free(cfg);

    /* the embedding API: a layout that does not divide the world, one on a GPU, and a version 1 launch */
    cfg = NULL;
    EXPECT_OK(moert_config_load_string(api_config, "folding-api-errors", &cfg));
    if (!cfg) return;
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(WORLD, 10.0, &comm));
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = 0,
                           .world_size = WORLD,
                           .device = moert_cpu(),
                           .comm = comm,
                           .expert_tensor_parallel = 3};
    EXPECT(moert_layers_create(cfg, &launch, &m) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("launch->expert_tensor_parallel 3 x launch->expert_data_parallel 1 does not divide "
                          "world_size 8");
    moert_comm_destroy(comm);
    launch = (moert_launch){.struct_size = (uint32_t)offsetof(moert_launch, expert_tensor_parallel),
                            .rank = 0,
                            .world_size = 1,
                            .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    if (m) {
        moert_layers_info info = {.struct_size = (uint32_t)offsetof(moert_layers_info, ep_rank)};
        info.ep_rank = -7; /* outside the version 1 struct: left alone */
        EXPECT_OK(moert_layers_get_info(m, &info));
        EXPECT_EQ_INT(info.num_local_experts, E);
        EXPECT_EQ_INT(info.ep_rank, -7);
    }
    moert_layers_destroy(m);
    moert_config_free(cfg);
}

int main(void)
{
    test_errors();
    compare_trainer("alltoall", "{}");
    compare_trainer("allgather", "{}");
    compare_trainer("alltoall", "{\"dispatched_x\": \"recompute\", \"fc1_out\": \"recompute\", "
                                "\"swiglu_out\": \"recompute\"}");
    compare_trainer("alltoall", "{\"dispatched_x\": \"offload\", \"swiglu_out\": \"offload\"}");
    compare_api();
    return test_finish("folding");
}
