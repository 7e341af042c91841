/* SPDX-License-Identifier: Apache-2.0 */
/* The embedding API (moert/layers.h) on the CPU, through public calls only:
 * - gradients of the layers' forward against finite differences (fp64, EP1): x, router weight, fc1, fc2, and the
 *   router loss's own gradient;
 * - EP2 and EP4 with ranks as threads equal EP1 on the same global tokens (outputs, input and expert gradients, the
 *   router gradient summed over ranks), and a caller's collectives table gives exactly what the threads communicator
 *   gives;
 * - the dispatcher alone: the identities of dispatch, combine and their adjoints at EP2;
 * - bad input is refused with a message naming the argument, and the calls' order is enforced.
 */
#include <pthread.h>
#include <string.h>

#include "moert/moert.h"
#include "test_util.h"

#define H     16
#define F     24
#define E     8
#define K     2
#define TOTAL 48 /* tokens over all ranks */

static const char *const routed_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\"}, \"parallel\": {\"ranks\": 1, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 48},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01,"
    " \"z_loss_coeff\": 0.001}}";
/* the same layers with a gated shared expert */
static const char *const shared_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\", \"shared_expert_ffn_hidden\": 20, \"shared_expert_gate\": true},"
    " \"parallel\": {\"ranks\": 1, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 48},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01,"
    " \"z_loss_coeff\": 0.001}}";
/* the gated shared expert with its activations recomputed and offloaded (fc1_out's offload: shared_fc1_out's "same") */
static const char *const shared_policy_json =
    "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\", \"shared_expert_ffn_hidden\": 20, \"shared_expert_gate\": true},"
    " \"parallel\": {\"ranks\": 1, \"device\": \"cpu\"}, \"train\": {\"tokens_per_rank\": 48},"
    " \"router\": {\"score_function\": \"softmax\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01,"
    " \"z_loss_coeff\": 0.001}, \"memory_policy\": {\"fc1_out\": \"offload\", \"shared_act\": \"recompute\"}}";
static const char *config_json; /* the one the tests below use */

static double uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static moert_tensor t2(double *p, int64_t a, int64_t b) { return moert_tensor_2d(p, moert_cpu(), MOERT_F64, a, b); }

/* One rank's parameters and gradients, bound into its layers. */
typedef struct rank_params {
    double *value[2][MOERT_PARAM_COUNT];
    double *grad[2][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
} rank_params;

static void bind_all(moert_layers *m, rank_params *p)
{
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            moert_tensor d;
            if (moert_layers_param_desc(m, l, (moert_param_id)w, &d) == MOERT_ERR_UNSUPPORTED) {
                p->numel[w] = 0; /* a shared-expert parameter of a config without one */
                continue;
            }
            p->numel[w] = moert_tensor_numel(&d);
            p->value[l][w] = calloc((size_t)p->numel[w], sizeof(double));
            p->grad[l][w] = calloc((size_t)p->numel[w], sizeof(double));
            moert_tensor v = d, g = d;
            v.data = p->value[l][w];
            g.data = p->grad[l][w];
            EXPECT_OK(moert_layers_bind_param(m, l, (moert_param_id)w, &v, &g));
        }
}

static void free_params(rank_params *p)
{
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            free(p->value[l][w]);
            free(p->grad[l][w]);
        }
}

/* The loss of the finite-difference check: sum(y1 * r) + router losses of both layers, y1 = layer1(layer0(x)). */
static double stack_loss(moert_layers *m, const double *x, int64_t t, const double *r)
{
    double *y0 = calloc((size_t)(t * H), sizeof(double)), *y1 = calloc((size_t)(t * H), sizeof(double));
    moert_tensor tx = t2((double *)x, t, H), ty0 = t2(y0, t, H), ty1 = t2(y1, t, H);
    moert_moe_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty0, NULL, NULL, &s0));
    EXPECT_OK(moert_moe_forward(m, 1, &ty0, &ty1, NULL, NULL, &s1));
    double loss = s0.router_loss + s1.router_loss;
    for (int64_t i = 0; i < t * H; i++) loss += y1[i] * r[i];
    free(y0);
    free(y1);
    return loss;
}

static moert_config *load_config(void)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(config_json, "layers-api-test", &cfg));
    return cfg;
}

static void test_gradients(void)
{
    moert_config *cfg = load_config();
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    moert_config_free(cfg); /* the layers keep their own copy */
    if (!m) return;
    rank_params p = {0};
    bind_all(m, &p);
    EXPECT_OK(moert_layers_init_params(m, 11, NULL));
    const int64_t t = 12;
    uint64_t seed = 5;
    double x[12 * H], r[12 * H], y0[12 * H], y1[12 * H], d1[12 * H], dx[12 * H];
    for (int i = 0; i < t * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    moert_tensor tx = t2(x, t, H), ty0 = t2(y0, t, H), ty1 = t2(y1, t, H), tr = t2(r, t, H);
    moert_tensor td1 = t2(d1, t, H), tdx = t2(dx, t, H);
    moert_saved *s0 = NULL, *s1 = NULL;
    moert_moe_stats st = {.struct_size = sizeof st};
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty0, NULL, &s0, &st));
    EXPECT(st.router_loss > 0 && st.aux_loss > 0 && st.z_loss > 0);
    EXPECT_NEAR(st.router_loss, st.aux_loss + st.z_loss, 1e-15, 1e-12);
    EXPECT_EQ_INT(st.dispatched_rows, t * K);
    EXPECT_OK(moert_moe_forward(m, 1, &ty0, &ty1, NULL, &s1, NULL));
    int64_t counts[E];
    moert_tensor tc = moert_tensor_1d(counts, moert_cpu(), MOERT_I64, E);
    EXPECT_OK(moert_saved_tokens_per_expert(s1, &tc, NULL));
    int64_t sum = 0;
    for (int e = 0; e < E; e++) sum += counts[e];
    EXPECT_EQ_INT(sum, t * K);
    moert_backward_options overwrite = {.struct_size = sizeof overwrite, .router_loss_scale = 1.0, .accumulate = false};
    EXPECT_OK(moert_moe_backward(m, s1, &tr, &td1, &overwrite, NULL));
    EXPECT_OK(moert_moe_backward(m, s0, &td1, &tdx, &overwrite, NULL));

    const double eps = 1e-6;
    uint64_t pick = 3;
    /* x */
    for (int n = 0; n < 6; n++) {
        int i = (int)((uniform(&pick) + 1.0) * 0.5 * (double)(t * H)) % (int)(t * H);
        double keep = x[i];
        x[i] = keep + eps;
        double up = stack_loss(m, x, t, r);
        x[i] = keep - eps;
        double down = stack_loss(m, x, t, r);
        x[i] = keep;
        EXPECT_NEAR(dx[i], (up - down) / (2 * eps), 1e-7, 1e-5);
    }
    /* every parameter of both layers */
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++)
            for (int n = 0; n < 4 && p.numel[w] > 0; n++) {
                int64_t i = (int64_t)((uniform(&pick) + 1.0) * 0.5 * (double)p.numel[w]) % p.numel[w];
                double keep = p.value[l][w][i];
                p.value[l][w][i] = keep + eps;
                double up = stack_loss(m, x, t, r);
                p.value[l][w][i] = keep - eps;
                double down = stack_loss(m, x, t, r);
                p.value[l][w][i] = keep;
                EXPECT_NEAR(p.grad[l][w][i], (up - down) / (2 * eps), 1e-7, 1e-5);
            }

    /* accumulate: a second backward of the same micro-batch doubles every gradient */
    double fc1_once = p.grad[0][MOERT_PARAM_FC1][7], router_once = p.grad[0][MOERT_PARAM_ROUTER][5];
    moert_backward_options add = {.struct_size = sizeof add, .router_loss_scale = 1.0, .accumulate = true};
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty0, NULL, &s0, NULL));
    EXPECT_OK(moert_moe_backward(m, s0, &td1, &tdx, &add, NULL));
    EXPECT_NEAR(p.grad[0][MOERT_PARAM_FC1][7], 2 * fc1_once, 1e-14, 1e-12);
    EXPECT_NEAR(p.grad[0][MOERT_PARAM_ROUTER][5], 2 * router_once, 1e-14, 1e-12);

    /* order: a second forward while one is in flight, a stale handle, a forward without saving */
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty0, NULL, &s0, NULL));
    moert_saved *again = NULL;
    EXPECT(moert_moe_forward(m, 0, &tx, &ty0, NULL, &again, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("1 micro-batch in flight per layer; $.parallel.forwards_in_flight allows up to 32");
    moert_saved_free(s0);
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty0, NULL, NULL, NULL));
    EXPECT(moert_moe_backward(m, s1, &tr, &td1, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("not a forward in flight");

    /* bad tensors name the argument */
    float xf[12 * H];
    moert_tensor wrong_dtype = moert_tensor_2d(xf, moert_cpu(), MOERT_F32, t, H);
    EXPECT(moert_moe_forward(m, 0, &wrong_dtype, &ty0, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("x is fp32, expected fp64");
    moert_tensor wrong_shape = t2(y0, t, H - 1);
    EXPECT(moert_moe_forward(m, 0, &tx, &wrong_shape, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("y has size 15 in dimension 1, expected 16");
    moert_tensor too_many = t2(x, 49, H);
    EXPECT(moert_moe_forward(m, 0, &too_many, &ty0, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("x has size 49 in dimension 0, expected 1 .. 48");
    moert_tensor strided = tx;
    strided.strides[0] = 2 * H;
    EXPECT(moert_moe_forward(m, 0, &strided, &ty0, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("x is not contiguous");
    moert_tensor on_gpu = ty0;
    on_gpu.device = (moert_device){MOERT_DEVICE_CUDA, 0};
    EXPECT(moert_moe_forward(m, 0, &tx, &on_gpu, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("y is on cuda:0, expected cpu");
    EXPECT(moert_moe_forward(m, 0, &tx, &tx, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("y may not be x's memory");
    EXPECT(moert_moe_forward(m, 2, &tx, &ty0, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("layer 2, expected 0 .. 1");
    moert_tensor d;
    EXPECT_OK(moert_layers_param_desc(m, 0, MOERT_PARAM_FC2, &d));
    EXPECT(d.ndim == 3 && d.shape[0] == E && d.shape[1] == F && d.shape[2] == H && d.dtype == MOERT_F64);
    moert_tensor bad = d;
    bad.data = p.value[0][MOERT_PARAM_FC1];
    bad.shape[1] = H;
    EXPECT(moert_layers_bind_param(m, 0, MOERT_PARAM_FC2, &bad, &bad) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("the fc2 value has size 16 in dimension 1, expected 24");
    moert_layers_info info = {0};
    EXPECT_OK(moert_layers_get_info(m, &info));
    EXPECT(info.num_layers == 2 && info.num_local_experts == E && info.max_tokens == 48 &&
           info.param_dtype == MOERT_F64 && info.slots == 1);
    double bias[E];
    moert_tensor tb = moert_tensor_1d(bias, moert_cpu(), MOERT_F64, E);
    EXPECT(moert_layers_get_expert_bias(m, 0, &tb, NULL) == MOERT_ERR_UNSUPPORTED);
    EXPECT_ERROR_CONTAINS("keeps no expert bias");
    moert_layers_destroy(m);
    free_params(&p);
}

/* Layers that are not bound refuse to run; a bad launch is refused before anything is loaded. */
static void test_launch_errors(void)
{
    moert_config *cfg = load_config();
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 2, .device = moert_cpu()};
    EXPECT(moert_layers_create(cfg, &launch, &m) == MOERT_ERR_INVALID_ARGUMENT && !m);
    EXPECT_ERROR_CONTAINS("world_size 2 needs a communicator");
    launch.world_size = 3;
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(3, 5.0, &comm));
    launch.comm = comm;
    EXPECT(moert_layers_create(cfg, &launch, &m) == MOERT_ERR_CONFIG);
    EXPECT_ERROR_CONTAINS("8 experts do not split over 3 ranks");
    moert_comm_destroy(comm);
    launch = (moert_launch){.struct_size = sizeof launch, .rank = 1, .world_size = 1, .device = moert_cpu()};
    EXPECT(moert_layers_create(cfg, &launch, &m) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("rank 1 of world_size 1");
    launch.rank = 0;
    launch.device = (moert_device){MOERT_DEVICE_CUDA, 0};
    EXPECT(moert_layers_create(cfg, &launch, &m) != MOERT_OK && !m);
    EXPECT(moert_comm_create_threads(0, 5.0, &comm) == MOERT_ERR_INVALID_ARGUMENT);
    moert_collectives empty = {.struct_size = sizeof empty};
    EXPECT(moert_comm_create_collectives(2, &empty, &comm) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("has no allgather");
    launch.device = moert_cpu();
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    double x[4 * H], y[4 * H];
    moert_tensor tx = t2(x, 4, H), ty = t2(y, 4, H);
    memset(x, 0, sizeof x);
    EXPECT(moert_moe_forward(m, 0, &tx, &ty, NULL, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("layer 0's router weight is not bound");
    moert_layers_destroy(m);
    moert_config_free(cfg);
}

/* ---- expert parallel: ranks as threads, through the threads communicator or a caller's table ---- */

/* A caller's collectives table (what a framework implements over its process group), here over a small exchange
 * between the test's threads written in the test: each rank posts its buffer, all meet at a barrier, each reads. */
typedef struct table_user {
    int rank;
    int calls; /* how often moert called the table */
} table_user;

typedef struct exchange {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int world, arrived;
    unsigned long generation;
    const void *send[4];
    const size_t *send_bytes[4], *send_offsets[4];
} exchange;

static exchange xchg = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, {0}, {0}, {0}};

static void xchg_barrier(void)
{
    pthread_mutex_lock(&xchg.lock);
    unsigned long gen = xchg.generation;
    if (++xchg.arrived == xchg.world) {
        xchg.arrived = 0;
        xchg.generation++;
        pthread_cond_broadcast(&xchg.cond);
    } else {
        while (gen == xchg.generation) pthread_cond_wait(&xchg.cond, &xchg.lock);
    }
    pthread_mutex_unlock(&xchg.lock);
}

static int tbl_barrier(void *user, char *error, size_t size)
{
    (void)error;
    (void)size;
    ((table_user *)user)->calls++;
    xchg_barrier();
    return 0;
}

static int tbl_allgather(void *user, const void *send, void *recv, size_t bytes, char *error, size_t size)
{
    (void)error;
    (void)size;
    table_user *u = user;
    u->calls++;
    xchg.send[u->rank] = send;
    xchg_barrier();
    for (int r = 0; r < xchg.world; r++) memcpy((char *)recv + (size_t)r * bytes, xchg.send[r], bytes);
    xchg_barrier();
    return 0;
}

static int tbl_allreduce(void *user, void *buf, size_t count, moert_dtype dtype, char *error, size_t size)
{
    table_user *u = user;
    u->calls++;
    size_t es = moert_dtype_size(dtype);
    void *copy = malloc(count * es + 1);
    memcpy(copy, buf, count * es);
    xchg.send[u->rank] = copy;
    xchg_barrier();
    for (size_t i = 0; i < count; i++) {
        double d = 0;
        int64_t n = 0;
        for (int r = 0; r < xchg.world; r++) {
            if (dtype == MOERT_F64)
                d += ((const double *)xchg.send[r])[i];
            else if (dtype == MOERT_F32)
                d += ((const float *)xchg.send[r])[i];
            else if (dtype == MOERT_I64)
                n += ((const int64_t *)xchg.send[r])[i];
        }
        if (dtype == MOERT_F64)
            ((double *)buf)[i] = d;
        else if (dtype == MOERT_F32)
            ((float *)buf)[i] = (float)d;
        else if (dtype == MOERT_I64)
            ((int64_t *)buf)[i] = n;
        else
            snprintf(error, size, "dtype %d", (int)dtype);
    }
    xchg_barrier();
    free(copy);
    return dtype == MOERT_F64 || dtype == MOERT_F32 || dtype == MOERT_I64 ? 0 : 1;
}

static int tbl_alltoallv(void *user, const void *send, const size_t *send_bytes, const size_t *send_offsets, void *recv,
                         const size_t *recv_bytes, const size_t *recv_offsets, char *error, size_t size)
{
    (void)error;
    (void)size;
    table_user *u = user;
    u->calls++;
    xchg.send[u->rank] = send;
    xchg.send_bytes[u->rank] = send_bytes;
    xchg.send_offsets[u->rank] = send_offsets;
    xchg_barrier();
    for (int r = 0; r < xchg.world; r++)
        memcpy((char *)recv + recv_offsets[r], (const char *)xchg.send[r] + xchg.send_offsets[r][u->rank],
               recv_bytes[r]);
    xchg_barrier();
    return 0;
}

/* What one rank computes on its share of the global tokens. */
typedef struct ep_rank {
    int rank, world;
    moert_comm *comm; /* threads communicator (shared), or NULL: make a table communicator */
    const moert_config *cfg;
    const double *x, *r; /* global [TOTAL,H] */
    double *y, *dx;      /* global [TOTAL,H]: this rank writes its rows */
    rank_params params;
    table_user user;
    moert_result rc;
} ep_rank;

static void *ep_main(void *arg)
{
    ep_rank *er = arg;
    moert_comm *own = NULL;
    if (!er->comm) {
        moert_collectives table = {.struct_size = sizeof table,
                                   .user = &er->user,
                                   .allgather = tbl_allgather,
                                   .allreduce_sum = tbl_allreduce,
                                   .alltoallv = tbl_alltoallv,
                                   .barrier = tbl_barrier};
        er->user.rank = er->rank;
        er->rc = moert_comm_create_collectives(er->world, &table, &own);
        if (er->rc != MOERT_OK) return NULL;
    }
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = er->rank,
                           .world_size = er->world,
                           .device = moert_cpu(),
                           .comm = er->comm ? er->comm : own};
    moert_layers *m = NULL;
    er->rc = moert_layers_create(er->cfg, &launch, &m);
    if (er->rc != MOERT_OK) {
        fprintf(stderr, "rank %d: %s\n", er->rank, moert_last_error());
        moert_comm_destroy(own);
        return NULL;
    }
    bind_all(m, &er->params);
    moert_layers_init_params(m, 11, NULL);
    int64_t t = TOTAL / er->world, first = t * er->rank;
    double *y0 = calloc((size_t)(t * H), sizeof(double)), *d1 = calloc((size_t)(t * H), sizeof(double));
    moert_tensor tx = t2((double *)er->x + first * H, t, H), ty0 = t2(y0, t, H), ty = t2(er->y + first * H, t, H);
    moert_tensor tr = t2((double *)er->r + first * H, t, H), td1 = t2(d1, t, H), tdx = t2(er->dx + first * H, t, H);
    moert_saved *s0 = NULL, *s1 = NULL;
    /* router losses out of the comparison: they are per-rank statistics, not a function of the global batch */
    moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 0.0, .accumulate = false};
    moert_result rc = moert_moe_forward(m, 0, &tx, &ty0, NULL, &s0, NULL);
    if (rc == MOERT_OK) rc = moert_moe_forward(m, 1, &ty0, &ty, NULL, &s1, NULL);
    if (rc == MOERT_OK) rc = moert_moe_backward(m, s1, &tr, &td1, &o, NULL);
    if (rc == MOERT_OK) rc = moert_moe_backward(m, s0, &td1, &tdx, &o, NULL);
    if (rc != MOERT_OK) fprintf(stderr, "rank %d: %s\n", er->rank, moert_last_error());
    er->rc = rc;
    free(y0);
    free(d1);
    moert_layers_destroy(m);
    moert_comm_destroy(own);
    return NULL;
}

/* Runs the two-layer stack over `world` ranks; fills y, dx and each rank's parameters and gradients. */
static void run_ep(int world, bool table, const moert_config *cfg, const double *x, const double *r, double *y,
                   double *dx, ep_rank *ranks)
{
    moert_comm *comm = NULL;
    if (!table) EXPECT_OK(moert_comm_create_threads(world, 10.0, &comm));
    xchg.world = world;
    pthread_t th[4];
    for (int i = 0; i < world; i++) {
        ranks[i] = (ep_rank){.rank = i, .world = world, .comm = comm, .cfg = cfg, .x = x, .r = r, .y = y, .dx = dx};
        pthread_create(&th[i], NULL, ep_main, &ranks[i]);
    }
    for (int i = 0; i < world; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < world; i++) EXPECT_OK(ranks[i].rc);
    moert_comm_destroy(comm);
}

static void test_expert_parallel(void)
{
    moert_config *cfg = load_config();
    uint64_t seed = 17;
    static double x[TOTAL * H], r[TOTAL * H], y1[TOTAL * H], dx1[TOTAL * H], y[TOTAL * H], dx[TOTAL * H];
    static double yt[TOTAL * H], dxt[TOTAL * H];
    for (int i = 0; i < TOTAL * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    ep_rank one[1], many[4], tabled[4];
    run_ep(1, false, cfg, x, r, y1, dx1, one);
    for (int world = 2; world <= 4; world += 2) {
        run_ep(world, false, cfg, x, r, y, dx, many);
        double worst = 0;
        for (int i = 0; i < TOTAL * H; i++) {
            worst = fmax(worst, fabs(y[i] - y1[i]));
            worst = fmax(worst, fabs(dx[i] - dx1[i]));
        }
        EXPECT(worst < 1e-12);
        /* expert gradients: rank r's local experts are EP1's experts [r*E/world, (r+1)*E/world) */
        for (int l = 0; l < 2; l++)
            for (int w = MOERT_PARAM_FC1; w <= MOERT_PARAM_FC2; w++)
                for (int k = 0; k < world; k++) {
                    int64_t n = many[k].params.numel[w];
                    for (int64_t i = 0; i < n; i++)
                        worst = fmax(worst, fabs(many[k].params.grad[l][w][i] - one[0].params.grad[l][w][k * n + i]));
                    /* initial values too: the same for any split over ranks */
                    for (int64_t i = 0; i < n; i++)
                        worst = fmax(worst, fabs(many[k].params.value[l][w][i] - one[0].params.value[l][w][k * n + i]));
                }
        /* the replicated parameters' gradients (router, shared expert): each rank's share, summed */
        for (int l = 0; l < 2; l++)
            for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
                if (w == MOERT_PARAM_FC1 || w == MOERT_PARAM_FC2) continue;
                for (int64_t i = 0; i < one[0].params.numel[w]; i++) {
                    double s = 0;
                    for (int k = 0; k < world; k++) s += many[k].params.grad[l][w][i];
                    worst = fmax(worst, fabs(s - one[0].params.grad[l][w][i]));
                }
            }
        EXPECT(worst < 1e-12);
        if (worst >= 1e-12) fprintf(stderr, "EP%d against EP1: worst difference %g\n", world, worst);

        /* a caller's collectives table: the same results bit for bit, and its functions were the ones called */
        run_ep(world, true, cfg, x, r, yt, dxt, tabled);
        EXPECT(memcmp(yt, y, sizeof y) == 0);
        EXPECT(memcmp(dxt, dx, sizeof dx) == 0);
        for (int k = 0; k < world; k++) {
            EXPECT(tabled[k].user.calls > 0);
            EXPECT(memcmp(tabled[k].params.grad[0][MOERT_PARAM_FC1], many[k].params.grad[0][MOERT_PARAM_FC1],
                          (size_t)many[k].params.numel[MOERT_PARAM_FC1] * sizeof(double)) == 0);
            free_params(&tabled[k].params);
            free_params(&many[k].params);
        }
    }
    free_params(&one[0].params);
    moert_config_free(cfg);
}

/* ---- the dispatcher alone at EP2 ---- */

typedef struct dispatch_rank {
    int rank;
    moert_comm *comm;
    const moert_config *cfg;
    moert_result rc;
} dispatch_rank;

static void *dispatch_main(void *arg)
{
    dispatch_rank *dr = arg;
    moert_launch launch = {
        .struct_size = sizeof launch, .rank = dr->rank, .world_size = 2, .device = moert_cpu(), .comm = dr->comm};
    moert_layers *m = NULL;
    if ((dr->rc = moert_layers_create(dr->cfg, &launch, &m)) != MOERT_OK) return NULL;
    const int64_t t = 10;
    int32_t idx[10 * K];
    double x[10 * H], w[10 * K], y[10 * H], dy[10 * H], dx[10 * H], dw[10 * K];
    uint64_t seed = 100 + (uint64_t)dr->rank;
    for (int i = 0; i < t; i++) {
        idx[i * K] = (int32_t)((i * 3 + dr->rank) % E);
        idx[i * K + 1] = (int32_t)((i * 3 + dr->rank + 1 + i % 5) % E);
        if (idx[i * K + 1] == idx[i * K]) idx[i * K + 1] = (idx[i * K] + 1) % E;
        w[i * K] = 0.25, w[i * K + 1] = 0.75;
    }
    for (int i = 0; i < t * H; i++) x[i] = uniform(&seed), dy[i] = uniform(&seed);
    moert_tensor ti = moert_tensor_2d(idx, moert_cpu(), MOERT_I32, t, K), tx = t2(x, t, H), tw = t2(w, t, K);
    moert_dispatch *d = NULL;
    int64_t rows = 0;
    moert_result rc = moert_dispatch_prepare(m, 0, &ti, NULL, &d, &rows);
    int64_t local[E / 2];
    moert_tensor tl = moert_tensor_1d(local, moert_cpu(), MOERT_I64, E / 2);
    if (rc == MOERT_OK) rc = moert_dispatch_tokens_per_expert(d, &tl, NULL);
    double *rx = calloc((size_t)(rows * H) + 1, sizeof(double)), *rw = calloc((size_t)rows + 1, sizeof(double));
    double *dry = calloc((size_t)(rows * H) + 1, sizeof(double)), *ones = calloc((size_t)rows + 1, sizeof(double));
    moert_tensor trx = t2(rx, rows, H), trw = moert_tensor_1d(rw, moert_cpu(), MOERT_F64, rows);
    moert_tensor tdry = t2(dry, rows, H), tones = moert_tensor_1d(ones, moert_cpu(), MOERT_F64, rows);
    moert_tensor ty = t2(y, t, H), tdy = t2(dy, t, H), tdx = t2(dx, t, H), tdw = t2(dw, t, K);
    if (rc == MOERT_OK) {
        int64_t used = 0;
        for (int e = 0; e < E / 2; e++) used += local[e];
        EXPECT(used == rows); /* alltoall knows the counts on the host: no padding rows */
    }
    /* combine before run is refused */
    EXPECT(rc != MOERT_OK || moert_dispatch_combine(d, &trx, &ty, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    if (rc == MOERT_OK) rc = moert_dispatch_run(d, &tx, &tw, &trx, &trw, NULL);
    if (rc == MOERT_OK) rc = moert_dispatch_combine(d, &trx, &ty, NULL);
    /* every token's two copies come back: y = 2 x */
    for (int i = 0; rc == MOERT_OK && i < t * H; i++) EXPECT_NEAR(y[i], 2 * x[i], 1e-15, 1e-15);
    if (rc == MOERT_OK) rc = moert_dispatch_combine_backward(d, &tdy, &tdry, NULL);
    for (int64_t i = 0; i < rows; i++) ones[i] = 1.0;
    if (rc == MOERT_OK) rc = moert_dispatch_backward(d, &tdry, &tones, &tdx, &tdw, NULL);
    /* the adjoint of a copy-and-sum: dx = 2 dy; each copy's weight gradient is its row's: 1 */
    for (int i = 0; rc == MOERT_OK && i < t * H; i++) EXPECT_NEAR(dx[i], 2 * dy[i], 1e-15, 1e-15);
    for (int i = 0; rc == MOERT_OK && i < t * K; i++) EXPECT_NEAR(dw[i], 1.0, 0, 0);
    /* the received weights are the copies' own */
    int64_t quarter = 0, three = 0;
    for (int64_t i = 0; rc == MOERT_OK && i < rows; i++) quarter += rw[i] == 0.25, three += rw[i] == 0.75;
    EXPECT(rc != MOERT_OK || quarter + three == rows);
    if (rc != MOERT_OK) fprintf(stderr, "rank %d: %s\n", dr->rank, moert_last_error());
    moert_saved *s = NULL;
    EXPECT(moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    moert_dispatch_free(d);
    /* a freed dispatch is stale: the calls refuse it, a second free ignores it (ASan: nothing read or freed twice) */
    EXPECT(moert_dispatch_run(d, &tx, &tw, &trx, &trw, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_dispatch_run: not a dispatch in flight (prepared and not freed)");
    moert_dispatch_free(d);
    dr->rc = rc;
    free(rx), free(rw), free(dry), free(ones);
    moert_layers_destroy(m);
    return NULL;
}

static void test_dispatcher(void)
{
    moert_config *cfg = load_config();
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(2, 10.0, &comm));
    dispatch_rank dr[2];
    pthread_t th[2];
    for (int i = 0; i < 2; i++) {
        dr[i] = (dispatch_rank){.rank = i, .comm = comm, .cfg = cfg};
        pthread_create(&th[i], NULL, dispatch_main, &dr[i]);
    }
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++) EXPECT_OK(dr[i].rc);
    moert_comm_destroy(comm);
    moert_config_free(cfg);
}

/* The expert bias: read and written in the caller's dtype, whatever the router keeps it in. */
static void test_expert_bias(void)
{
    const char *json = "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, "
                       "\"num_layers\": 2}, \"train\": {\"tokens_per_rank\": 48}, \"router\": {\"score_function\": "
                       "\"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": 0.5}}";
    moert_config *cfg = NULL;
    moert_layers *m = NULL;
    EXPECT_OK(moert_config_load_string(json, "bias-test", &cfg));
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    moert_config_free(cfg);
    if (!m) return;
    float set[E], got32[E];
    double got64[E];
    for (int e = 0; e < E; e++) set[e] = 0.125f * (float)(e - 3);
    moert_tensor ts = moert_tensor_1d(set, moert_cpu(), MOERT_F32, E);
    moert_tensor t32 = moert_tensor_1d(got32, moert_cpu(), MOERT_F32, E);
    moert_tensor t64 = moert_tensor_1d(got64, moert_cpu(), MOERT_F64, E);
    EXPECT_OK(moert_layers_set_expert_bias(m, 1, &ts, NULL));
    EXPECT_OK(moert_layers_get_expert_bias(m, 1, &t32, NULL));
    EXPECT_OK(moert_layers_get_expert_bias(m, 1, &t64, NULL));
    for (int e = 0; e < E; e++) {
        EXPECT(got32[e] == set[e]);
        EXPECT(got64[e] == (double)set[e]);
    }
    int64_t wrong[E];
    moert_tensor ti = moert_tensor_1d(wrong, moert_cpu(), MOERT_I64, E);
    EXPECT(moert_layers_get_expert_bias(m, 0, &ti, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("dst is int64");
    moert_layers_destroy(m);
}

/* ---- memory policies through the API: the same numbers, fewer bytes held, and the figures say so ---- */

/* The layers of config `json` on one rank, every parameter bound to p's buffers and set from seed 3; NULL on failure
 * (counted). */
static moert_layers *open_one_rank(const char *json, const char *name, rank_params *p)
{
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, name, &cfg));
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    moert_config_free(cfg);
    if (!m) return NULL;
    bind_all(m, p);
    EXPECT_OK(moert_layers_init_params(m, 3, NULL));
    return m;
}

/* Two layers forward and backward at EP1 with the memory policy of `policy_json` ("" for the default); fills y, dx and
 * the first layer's fc1 gradient, and that layer's figures. */
static void run_policy(const char *policy_json, double *y, double *dx, double *fc1_grad, moert_layer_figures *fig)
{
    char json[2048];
    snprintf(json, sizeof json, "%.*s, \"memory_policy\": {%s}}", (int)strlen(config_json) - 1, config_json,
             policy_json);
    rank_params p = {0};
    moert_layers *m = open_one_rank(json, "layers-api-policy", &p);
    if (!m) return;
    const int64_t t = 20;
    uint64_t seed = 8;
    double x[20 * H], r[20 * H], h[20 * H], dh[20 * H];
    for (int i = 0; i < t * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    moert_tensor tx = t2(x, t, H), th = t2(h, t, H), ty = t2(y, t, H), tr = t2(r, t, H), tdh = t2(dh, t, H);
    moert_tensor tdx = t2(dx, t, H);
    moert_saved *s0 = NULL, *s1 = NULL;
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &th, NULL, &s0, NULL));
    EXPECT_OK(moert_moe_forward(m, 1, &th, &ty, NULL, &s1, NULL));
    EXPECT_OK(moert_moe_backward(m, s1, &tr, &tdh, NULL, NULL));
    EXPECT_OK(moert_moe_backward(m, s0, &tdh, &tdx, NULL, NULL));
    memcpy(fc1_grad, p.grad[0][MOERT_PARAM_FC1], (size_t)p.numel[MOERT_PARAM_FC1] * sizeof(double));
    fig->struct_size = sizeof *fig;
    EXPECT_OK(moert_layers_figures(m, 0, fig));
    moert_layers_destroy(m);
    free_params(&p);
}

/* Stale saved handles: consumed by a backward, freed, or freed with their layers. The calls that take one refuse it
 * without reading it, and moert_saved_free ignores it (a garbage collector's order); ASan sees no read or free of
 * freed memory. */
static void test_stale_handles(void)
{
    rank_params p = {0};
    moert_layers *m = open_one_rank(config_json, "layers-api-stale", &p);
    if (!m) return;
    const int64_t t = 6;
    uint64_t seed = 9;
    double x[6 * H], y[6 * H], dy[6 * H], dx[6 * H];
    int64_t counts[E];
    for (int i = 0; i < t * H; i++) x[i] = uniform(&seed), dy[i] = uniform(&seed);
    moert_tensor tx = t2(x, t, H), ty = t2(y, t, H), tdy = t2(dy, t, H), tdx = t2(dx, t, H);
    moert_tensor tc = moert_tensor_1d(counts, moert_cpu(), MOERT_I64, E);
    moert_saved *s = NULL;
    /* an output over part of its input (one row apart) is refused, not only the same pointer */
    double xy[7 * H];
    moert_tensor shifted_x = t2(xy, t, H), shifted_y = t2(xy + H, t, H);
    EXPECT(moert_moe_forward(m, 0, &shifted_x, &shifted_y, NULL, &s, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_moe_forward: y may not be x's memory");
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL));
    EXPECT_OK(moert_saved_tokens_per_expert(s, &tc, NULL));
    EXPECT_OK(moert_moe_backward(m, s, &tdy, &tdx, NULL, NULL));
    /* consumed by its backward */
    EXPECT(moert_saved_tokens_per_expert(s, &tc, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("moert_saved_tokens_per_expert: saved is not a forward in flight");
    EXPECT(moert_moe_backward(m, s, &tdy, &tdx, NULL, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    moert_saved_free(s);
    /* freed, then freed again */
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL));
    moert_saved_free(s);
    moert_saved_free(s);
    /* freed with its layers, then by the caller */
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL));
    moert_layers_destroy(m);
    moert_saved_free(s);
    moert_saved_free(NULL);
    free_params(&p);
}

static void test_memory_policies(void)
{
    static double y[3][20 * H], dx[3][20 * H], g[3][E * H * 2 * F];
    moert_layer_figures fig[3];
    run_policy("", y[0], dx[0], g[0], &fig[0]);
    run_policy("\"dispatched_x\": \"offload\", \"fc1_out\": \"recompute\"", y[1], dx[1], g[1], &fig[1]);
    run_policy("\"swiglu_out\": \"offload\", \"dispatched_x\": \"recompute\"", y[2], dx[2], g[2], &fig[2]);
    for (int k = 1; k < 3; k++) {
        EXPECT(memcmp(y[k], y[0], sizeof y[0]) == 0);
        EXPECT(memcmp(dx[k], dx[0], sizeof dx[0]) == 0);
        EXPECT(memcmp(g[k], g[0], sizeof g[0]) == 0);
    }
    /* 20 tokens x 2 copies = 40 rows: dispatched_x [40,H], fc1_out [40,2F], swiglu_out [40,F] in fp64 */
    EXPECT_EQ_INT(fig[0].saved_bytes[0], 40 * H * 8);
    EXPECT_EQ_INT(fig[0].saved_bytes[1], 40 * 2 * F * 8);
    EXPECT_EQ_INT(fig[0].saved_bytes[2], 40 * F * 8);
    EXPECT_EQ_INT(fig[0].held_bytes, 40 * (H + 3 * F) * 8);
    EXPECT_EQ_INT(fig[1].held_bytes, 40 * F * 8);
    EXPECT_EQ_INT(fig[1].offload_saved_bytes, 40 * H * 8);
    EXPECT_EQ_INT(fig[1].recompute_saved_bytes, 40 * 2 * F * 8);
    EXPECT(fig[1].pinned_bytes >= 40 * H * 8);
    EXPECT(fig[0].stage_ms[0] >= 0 && fig[0].stage_ms[7] > 0);
    EXPECT(strcmp(moert_layer_stage_name(7), "backward") == 0);
    EXPECT(strcmp(moert_layer_backward_part_name(3), "fc2_wgrad") == 0);
    EXPECT(strcmp(moert_layer_activation_name(1), "fc1_out") == 0);
    EXPECT(moert_layer_stage_name(8) == NULL);
}

/* ---- the shared expert's saved activations under the memory policy ---- */

/* One run of two layers with a shared expert: the output, d_x, every gradient and both layers' figures. */
typedef struct shared_run {
    double y[20 * H], dx[20 * H];
    rank_params p;
    moert_layer_figures fig[2];
} shared_run;

/* Two layers with a shared expert (gated or not, on its own stream or not: the CPU runs both alike) forward and
 * backward at EP1 with the memory policy options `policy_json`. */
static void run_shared_policy(bool gate, bool overlap, const char *policy_json, shared_run *out)
{
    char json[2048];
    snprintf(json, sizeof json,
             "{\"model\": {\"hidden\": 16, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
             " \"dtype\": \"fp64\", \"shared_expert_ffn_hidden\": 20, \"shared_expert_gate\": %s},"
             " \"parallel\": {\"ranks\": 1, \"device\": \"cpu\", \"shared_expert_overlap\": %s},"
             " \"train\": {\"tokens_per_rank\": 48}, \"router\": {\"score_function\": \"softmax\","
             " \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}, \"memory_policy\": {%s}}",
             gate ? "true" : "false", overlap ? "true" : "false", policy_json);
    memset(out, 0, sizeof *out);
    moert_config *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "layers-api-shared-policy", &cfg));
    moert_layers *m = NULL;
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_layers_create(cfg, &launch, &m));
    moert_config_free(cfg);
    if (!m) return;
    bind_all(m, &out->p);
    EXPECT_OK(moert_layers_init_params(m, 5, NULL));
    const int64_t t = 20;
    uint64_t seed = 9;
    double x[20 * H], r[20 * H], h[20 * H], dh[20 * H];
    for (int i = 0; i < t * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
    moert_tensor tx = t2(x, t, H), th = t2(h, t, H), ty = t2(out->y, t, H), tr = t2(r, t, H), tdh = t2(dh, t, H);
    moert_tensor tdx = t2(out->dx, t, H);
    moert_saved *s0 = NULL, *s1 = NULL;
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &th, NULL, &s0, NULL));
    EXPECT_OK(moert_moe_forward(m, 1, &th, &ty, NULL, &s1, NULL));
    EXPECT_OK(moert_moe_backward(m, s1, &tr, &tdh, NULL, NULL));
    EXPECT_OK(moert_moe_backward(m, s0, &tdh, &tdx, NULL, NULL));
    for (int l = 0; l < 2; l++) {
        out->fig[l].struct_size = sizeof out->fig[l];
        EXPECT_OK(moert_layers_figures(m, l, &out->fig[l]));
    }
    /* a caller of API version 2 (figures without the shared expert's member) is served, its struct not overrun */
    moert_layer_figures old;
    memset(&old, 0xff, sizeof old);
    old.struct_size = (uint32_t)offsetof(moert_layer_figures, shared_saved_bytes);
    EXPECT_OK(moert_layers_figures(m, 0, &old));
    EXPECT(old.held_bytes == out->fig[0].held_bytes && old.shared_saved_bytes[0] == -1);
    moert_layers_destroy(m);
}

/* Whether two runs gave the same bits: output, d_x and every gradient of both layers. */
static bool same_shared_run(const shared_run *a, const shared_run *b)
{
    if (memcmp(a->y, b->y, sizeof a->y) != 0 || memcmp(a->dx, b->dx, sizeof a->dx) != 0) return false;
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++)
            if (a->p.numel[w] != b->p.numel[w] ||
                (a->p.numel[w] && memcmp(a->p.grad[l][w], b->p.grad[l][w], (size_t)a->p.numel[w] * sizeof(double))))
                return false;
    return true;
}

/* Every keep/recompute/offload combination of shared_fc1_out and shared_act, with and without the gate and the
 * overlap option, and their "same" answers through fc1_out / swiglu_out: the bits of keeping everything, and the
 * figures count the shared expert's bytes as the actions say. */
static void test_shared_memory_policies(void)
{
    static const char *const names[3] = {"keep", "recompute", "offload"};
    const int64_t fc1_bytes = 20 * 2 * 20 * 8, act_bytes = 20 * 20 * 8; /* [T, 2Fs] and [T, Fs], fp64 */
    const int64_t routed_bytes = 40 * (H + 3 * F) * 8;                  /* 40 rows of the routed experts, all kept */
    static shared_run keep, run;
    for (int g = 0; g < 2; g++)
        for (int o = 0; o < 2; o++) {
            run_shared_policy(g, o, "", &keep);
            EXPECT_EQ_INT(keep.fig[0].shared_saved_bytes[0], fc1_bytes);
            EXPECT_EQ_INT(keep.fig[0].shared_saved_bytes[1], act_bytes);
            EXPECT_EQ_INT(keep.fig[0].held_bytes, routed_bytes + fc1_bytes + act_bytes);
            for (int a1 = 0; a1 < 3; a1++)
                for (int a2 = 0; a2 < 3; a2++) {
                    char policy[256];
                    snprintf(policy, sizeof policy, "\"shared_fc1_out\": \"%s\", \"shared_act\": \"%s\"", names[a1],
                             names[a2]);
                    run_shared_policy(g, o, policy, &run);
                    if (!same_shared_run(&run, &keep)) {
                        fprintf(stderr, "shared expert (gate %d, overlap %d) %s: differs from keep\n", g, o, policy);
                        test_failures++;
                    }
                    for (int l = 0; l < 2; l++) {
                        const moert_layer_figures *f = &run.fig[l];
                        int64_t held = routed_bytes, recomputed = 0, offloaded = 0;
                        int64_t *to[3] = {&held, &recomputed, &offloaded};
                        *to[a1] += fc1_bytes;
                        *to[a2] += act_bytes;
                        EXPECT_EQ_INT(f->shared_saved_bytes[0], fc1_bytes);
                        EXPECT_EQ_INT(f->shared_saved_bytes[1], act_bytes);
                        EXPECT_EQ_INT(f->held_bytes, held);
                        EXPECT_EQ_INT(f->recompute_saved_bytes, recomputed);
                        EXPECT_EQ_INT(f->offload_saved_bytes, offloaded);
                        if (offloaded) EXPECT(f->pinned_bytes >= offloaded);
                    }
                    free_params(&run.p);
                }
            /* "same": the routed activations' answers */
            run_shared_policy(g, o, "\"fc1_out\": \"offload\", \"swiglu_out\": \"recompute\"", &run);
            EXPECT(same_shared_run(&run, &keep));
            EXPECT_EQ_INT(run.fig[0].held_bytes, 40 * H * 8);
            EXPECT_EQ_INT(run.fig[0].offload_saved_bytes, 40 * 2 * F * 8 + fc1_bytes);
            EXPECT_EQ_INT(run.fig[0].recompute_saved_bytes, 40 * F * 8 + act_bytes);
            free_params(&run.p);
            free_params(&keep.p);
        }
    EXPECT(strcmp(moert_layer_activation_name(MOERT_LAYER_ACTIVATIONS), "shared_fc1_out") == 0);
    EXPECT(strcmp(moert_layer_activation_name(MOERT_LAYER_ACTIVATIONS + 1), "shared_act") == 0);
    EXPECT(moert_layer_activation_name(MOERT_LAYER_ACTIVATIONS + 2) == NULL);
}

int main(void)
{
    EXPECT(moert_api_version() == MOERT_API_VERSION);
    for (int c = 0; c < 3; c++) {
        config_json = c == 0 ? routed_json : c == 1 ? shared_json : shared_policy_json;
        test_gradients();
        test_expert_parallel();
    }
    config_json = routed_json;
    test_launch_errors();
    test_dispatcher();
    test_memory_policies();
    test_stale_handles();
    test_shared_memory_policies();
    test_expert_bias();
    return test_finish("layers_api");
}
