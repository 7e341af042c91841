/* SPDX-License-Identifier: Apache-2.0 */
/* MoE Parallel Folding on GPUs (docs/parallel.md): the MoE layers' ETP x EP x EDP grid with NCCL communicators split
 * from the world's, on as many GPUs as answer (4: EP2 x EDP2, EP2 x ETP2 and the 2-GPU layouts; 2: EP1 x EDP2 and
 * EP1 x ETP2). Each layout, on the same global batch:
 * - the embedding API, ranks as threads (a GPU each), fp32, two layers: every rank's output and input gradient, the
 *   router gradient summed over every rank and the expert gradients put back in global order (summed over each EDP
 *   group) against the CPU run of one rank, within 2e-4 of the largest value (as test_gpu_layers_api); with the
 *   alltoall dispatcher, and on 4 GPUs with allgather, deepep and hybridep (an expert-parallel group of 2 of the 4);
 * - the same in bf16 (one layer: the same routing) against the GPU run of the same world with every rank an
 *   expert-parallel rank, within 5e-2;
 * - a process per GPU, the NCCL communicator from a caller-distributed id (ETP and EDP layouts): each process's output
 *   and input gradient against the CPU;
 * - the trainer (moert_runtime): the loss, every rank's output and gradients after one step (the expert gradients
 *   summed over EDP on the GPUs) and a training curve of 4 SGD steps against the same layout on CPU ranks.
 *   usage: test_gpu_folding                          (the checks; exits 77 without a GPU or with one)
 *          test_gpu_folding --rank R N ETP EDP HEX   (one process of the NCCL check)
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "gpu_test_util.h" /* CK: a checked CUDA call of the test itself */
#include "moert/moert.h"
#include "runtime.h"

extern char **environ;

#define H       64
#define F       96
#define E       8
#define TOTAL   512
#define MAXW    8
#define TOL     2e-4 /* fp32 against the CPU */
#define TOL16   5e-2 /* bf16 against the GPU run without folding (the CPU: 9e-3 at ETP2) */
#define TOL_RUN 2e-3 /* the trainer's losses */

typedef struct layout {
    int etp, ep, edp;
} layout;

static int world_of(layout l) { return l.etp * l.ep * l.edp; }

/* The layouts checked, those that fit the GPUs. */
static const layout layouts[] = {{1, 1, 2}, {2, 1, 1}, {1, 2, 2}, {2, 2, 1}};
#define LAYOUTS (int)(sizeof layouts / sizeof layouts[0])

static const char *config_fmt =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": %d,"
    " \"dtype\": \"%s\"}, \"parallel\": {\"ranks\": 1, \"timeout_s\": 30}, \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01},"
    " \"dispatcher\": {\"plugin\": \"%s\"}}";

static moert_config *api_config(int layers, const char *dtype, const char *dispatcher)
{
    char json[1024];
    snprintf(json, sizeof json, config_fmt, layers, dtype, dispatcher);
    moert_config *cfg = NULL;
    if (moert_config_load_string(json, "gpu-folding", &cfg) != MOERT_OK) {
        fprintf(stderr, "config: %s\n", moert_last_error());
        test_failures++;
    }
    return cfg;
}

static float uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static void make_inputs(float *x, float *r)
{
    uint64_t seed = 99;
    for (int i = 0; i < TOTAL * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
}

/* fp32 <-> bf16 (round to nearest even) for the caller's buffers. */
static uint16_t to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- the embedding API, one rank ---- */

/* What one rank returns: its rows of y and dx, its parameters' gradients (fp32 on the host). */
typedef struct rank_out {
    float *y, *dx; /* [t,H] */
    float *grad[2][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
} rank_out;

typedef struct rank_job {
    int rank, world, layers;
    layout lay;
    moert_device device;
    moert_comm *comm;
    const moert_config *cfg;
    const float *x, *r; /* global [TOTAL,H] */
    rank_out out;
    moert_result rc;
    char error[2048];
} rank_job;

static void *buffer(moert_device d, size_t bytes)
{
    void *p = NULL;
    if (d.type == MOERT_DEVICE_CUDA) {
        CK(cudaMalloc(&p, bytes));
        CK(cudaMemset(p, 0, bytes));
    } else
        p = calloc(1, bytes);
    return p;
}
static void release(moert_device d, void *p)
{
    if (d.type == MOERT_DEVICE_CUDA)
        cudaFree(p);
    else
        free(p);
}

/* n values of dtype dt in `src` (device d) as floats in dst. */
static void read_floats(moert_device d, moert_dtype dt, float *dst, const void *src, int64_t n)
{
    size_t bytes = (size_t)n * moert_dtype_size(dt);
    void *tmp = malloc(bytes + 1);
    if (d.type == MOERT_DEVICE_CUDA)
        CK(cudaMemcpy(tmp, src, bytes, cudaMemcpyDeviceToHost));
    else
        memcpy(tmp, src, bytes);
    for (int64_t i = 0; i < n; i++) dst[i] = dt == MOERT_BF16 ? from_bf16(((uint16_t *)tmp)[i]) : ((float *)tmp)[i];
    free(tmp);
}
/* n floats of src into dst (device d) as dtype dt. */
static void write_floats(moert_device d, moert_dtype dt, void *dst, const float *src, int64_t n)
{
    size_t bytes = (size_t)n * moert_dtype_size(dt);
    void *tmp = malloc(bytes + 1);
    for (int64_t i = 0; i < n; i++)
        if (dt == MOERT_BF16)
            ((uint16_t *)tmp)[i] = to_bf16(src[i]);
        else
            ((float *)tmp)[i] = src[i];
    if (d.type == MOERT_DEVICE_CUDA)
        CK(cudaMemcpy(dst, tmp, bytes, cudaMemcpyHostToDevice));
    else
        memcpy(dst, tmp, bytes);
    free(tmp);
}

#define FAIL_RC(call)                                                                                                  \
    do {                                                                                                               \
        j->rc = (call);                                                                                                \
        if (j->rc != MOERT_OK) {                                                                                       \
            snprintf(j->error, sizeof j->error, "%s: %s", #call, moert_last_error());                                  \
            goto done;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* One rank: bind parameters, init, forward the layers, backward, bring the results to the host. */
static void *rank_main(void *arg)
{
    rank_job *j = arg;
    moert_layers *m = NULL;
    void *value[2][MOERT_PARAM_COUNT] = {{0}}, *grad[2][MOERT_PARAM_COUNT] = {{0}};
    moert_layers_info info = {.struct_size = sizeof info};
    int64_t t = TOTAL / j->world, first = t * j->rank;
    moert_stream stream = NULL;
    if (j->device.type == MOERT_DEVICE_CUDA) {
        CK(cudaSetDevice(j->device.id));
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        stream = s;
    }
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = j->rank,
                           .world_size = j->world,
                           .device = j->device,
                           .comm = j->comm,
                           .expert_tensor_parallel = j->lay.etp,
                           .expert_data_parallel = j->lay.edp};
    void *act[3] = {NULL, NULL, NULL}; /* x, h (between the layers), y */
    void *r = NULL, *dh = NULL, *dx = NULL;
    FAIL_RC(moert_layers_create(j->cfg, &launch, &m));
    FAIL_RC(moert_layers_get_info(m, &info));
    if (info.etp_size != j->lay.etp || info.ep_size != j->lay.ep || info.edp_size != j->lay.edp) {
        j->rc = MOERT_ERR_INTERNAL;
        snprintf(j->error, sizeof j->error, "moert_layers_get_info: ETP %d EP %d EDP %d, expected %d %d %d",
                 info.etp_size, info.ep_size, info.edp_size, j->lay.etp, j->lay.ep, j->lay.edp);
        goto done;
    }
    const moert_dtype dt = info.dtype;
    const size_t bytes = (size_t)(t * H) * moert_dtype_size(dt);
    for (int i = 0; i < 3; i++) act[i] = buffer(j->device, bytes);
    r = buffer(j->device, bytes), dh = buffer(j->device, bytes), dx = buffer(j->device, bytes);
    write_floats(j->device, dt, act[0], j->x + first * H, t * H);
    write_floats(j->device, dt, r, j->r + first * H, t * H);
    for (int l = 0; l < j->layers; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            moert_tensor v, g;
            if (moert_layers_param_desc(m, l, (moert_param_id)w, &v) != MOERT_OK) continue;
            j->out.numel[w] = moert_tensor_numel(&v);
            g = v;
            v.data = value[l][w] = buffer(j->device, moert_tensor_bytes(&v));
            g.data = grad[l][w] = buffer(j->device, moert_tensor_bytes(&v));
            FAIL_RC(moert_layers_bind_param(m, l, (moert_param_id)w, &v, &g));
        }
    FAIL_RC(moert_layers_init_params(m, 7, stream));
    moert_tensor tx = moert_tensor_2d(act[0], j->device, dt, t, H), th = tx, ty = tx, tr = tx, tdh = tx, tdx = tx;
    th.data = act[1], ty.data = j->layers == 2 ? act[2] : act[1], tr.data = r, tdh.data = dh, tdx.data = dx;
    moert_saved *s0 = NULL, *s1 = NULL;
    moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 0.0, .accumulate = false};
    FAIL_RC(moert_moe_forward(m, 0, &tx, &th, stream, &s0, NULL));
    if (j->layers == 2) {
        FAIL_RC(moert_moe_forward(m, 1, &th, &ty, stream, &s1, NULL));
        FAIL_RC(moert_moe_backward(m, s1, &tr, &tdh, &o, stream));
        FAIL_RC(moert_moe_backward(m, s0, &tdh, &tdx, &o, stream));
    } else
        FAIL_RC(moert_moe_backward(m, s0, &tr, &tdx, &o, stream));
    if (stream) CK(cudaStreamSynchronize((cudaStream_t)stream));
    j->out.y = malloc((size_t)(t * H) * sizeof(float));
    j->out.dx = malloc((size_t)(t * H) * sizeof(float));
    read_floats(j->device, dt, j->out.y, ty.data, t * H);
    read_floats(j->device, dt, j->out.dx, dx, t * H);
    for (int l = 0; l < j->layers; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            if (!j->out.numel[w]) continue;
            moert_tensor v;
            moert_layers_param_desc(m, l, (moert_param_id)w, &v);
            j->out.grad[l][w] = malloc((size_t)j->out.numel[w] * sizeof(float));
            read_floats(j->device, v.dtype, j->out.grad[l][w], grad[l][w], j->out.numel[w]);
        }
done:
    moert_layers_destroy(m);
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            if (value[l][w]) release(j->device, value[l][w]);
            if (grad[l][w]) release(j->device, grad[l][w]);
        }
    for (int i = 0; i < 3; i++)
        if (act[i]) release(j->device, act[i]);
    if (r) release(j->device, r);
    if (dh) release(j->device, dh);
    if (dx) release(j->device, dx);
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
    return NULL;
}

static void free_jobs(rank_job *jobs, int world)
{
    for (int k = 0; k < world; k++) {
        free(jobs[k].out.y);
        free(jobs[k].out.dx);
        for (int l = 0; l < 2; l++)
            for (int w = 0; w < MOERT_PARAM_COUNT; w++) free(jobs[k].out.grad[l][w]);
        memset(&jobs[k].out, 0, sizeof jobs[k].out);
    }
}

/* Runs the layers over the layout's ranks as threads on `type` devices; 0 when every rank succeeded. */
static int run_threads(layout lay, int layers, moert_device_type type, const moert_config *cfg, const float *x,
                       const float *r, rank_job *jobs)
{
    const int world = world_of(lay);
    moert_comm *comm = NULL;
    /* a rank that fails: its peers' waits end within 30 s */
    if (world > 1 && moert_comm_create_threads(world, 30.0, &comm) != MOERT_OK) {
        fprintf(stderr, "threads communicator: %s\n", moert_last_error());
        return 1;
    }
    pthread_t th[MAXW];
    for (int i = 0; i < world; i++) {
        jobs[i] = (rank_job){.rank = i,
                             .world = world,
                             .layers = layers,
                             .lay = lay,
                             .device = {type, type == MOERT_DEVICE_CUDA ? i : 0},
                             .comm = comm,
                             .cfg = cfg,
                             .x = x,
                             .r = r};
        pthread_create(&th[i], NULL, rank_main, &jobs[i]);
    }
    for (int i = 0; i < world; i++) pthread_join(th[i], NULL);
    moert_comm_destroy(comm);
    int bad = 0;
    for (int i = 0; i < world; i++)
        if (jobs[i].rc != MOERT_OK) {
            fprintf(stderr, "rank %d: %s\n", i, jobs[i].error);
            bad = 1;
        }
    return bad;
}

/* ---- results in global order ---- */

/* A run's results as one rank of the whole model would have them: y and dx of every token, the router gradient summed
 * over the ranks, the expert gradients in [E,H,2F] and [E,F,H] (each element summed over its EDP replicas). */
typedef struct global {
    double y[TOTAL * H], dx[TOTAL * H];
    double router[2][E * H], fc1[2][E * H * 2 * F], fc2[2][E * F * H];
} global;

static void globalize(const rank_job *jobs, layout lay, int layers, global *g)
{
    const int world = world_of(lay), el = E / lay.ep, fl = F / lay.etp;
    const int64_t t = TOTAL / world;
    memset(g, 0, sizeof *g);
    for (int k = 0; k < world; k++) {
        const rank_out *o = &jobs[k].out;
        const int j = k % lay.etp, p = (k / lay.etp) % lay.ep;
        for (int64_t i = 0; i < t * H; i++) g->y[k * t * H + i] = o->y[i], g->dx[k * t * H + i] = o->dx[i];
        for (int l = 0; l < layers; l++) {
            for (int i = 0; i < E * H; i++) g->router[l][i] += o->grad[l][MOERT_PARAM_ROUTER][i];
            for (int e = 0; e < el; e++)
                for (int h = 0; h < H; h++)
                    for (int c = 0; c < 2 * fl; c++) { /* [gate_j | up_j] of the shard */
                        const int col = c < fl ? j * fl + c : F + j * fl + (c - fl);
                        g->fc1[l][((p * el + e) * H + h) * 2 * F + col] +=
                            o->grad[l][MOERT_PARAM_FC1][(e * H + h) * 2 * fl + c];
                    }
            for (int e = 0; e < el; e++)
                for (int f = 0; f < fl; f++)
                    for (int h = 0; h < H; h++)
                        g->fc2[l][((p * el + e) * F + j * fl + f) * H + h] +=
                            o->grad[l][MOERT_PARAM_FC2][(e * fl + f) * H + h];
        }
    }
}

/* The largest difference of b from a, relative to a's largest value. */
static double worst_rel(const double *a, const double *b, int64_t n)
{
    double scale = 1e-30, worst = 0;
    for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(a[i]));
    for (int64_t i = 0; i < n; i++) worst = fmax(worst, fabs(a[i] - b[i]) / scale);
    return worst;
}

/* One quantity of two runs. */
typedef struct part {
    const char *name;
    const double *a, *b;
    int64_t n;
} part;

/* The worst of worst_rel over y, dx and the gradients; `which` names the quantity. */
static double compare_global(const global *ref, const global *got, int layers, char *which, size_t size)
{
    part parts[8];
    int np = 0;
    parts[np++] = (part){"y", ref->y, got->y, TOTAL * H};
    parts[np++] = (part){"dx", ref->dx, got->dx, TOTAL * H};
    for (int l = 0; l < layers; l++) {
        parts[np++] = (part){l ? "router grad (layer 1)" : "router grad", ref->router[l], got->router[l], E * H};
        parts[np++] = (part){l ? "fc1 grad (layer 1)" : "fc1 grad", ref->fc1[l], got->fc1[l], E * H * 2 * F};
        parts[np++] = (part){l ? "fc2 grad (layer 1)" : "fc2 grad", ref->fc2[l], got->fc2[l], E * F * H};
    }
    double worst = 0;
    for (int i = 0; i < np; i++) {
        double w = worst_rel(parts[i].a, parts[i].b, parts[i].n);
        if (w >= worst) {
            worst = w;
            snprintf(which, size, "%s", parts[i].name);
        }
    }
    return worst;
}

static const char *layout_name(layout l, char *buf, size_t size)
{
    snprintf(buf, size, "EP%d x ETP%d x EDP%d", l.ep, l.etp, l.edp);
    return buf;
}

/* One layout through the embedding API on the GPUs against `ref` (in global order); 1 when it fails. */
static int check_api(layout lay, int layers, const char *dtype, const char *dispatcher, const global *ref, double tol,
                     const char *against, const float *x, const float *r)
{
    static rank_job jobs[MAXW];
    static global got;
    char name[64], which[64] = "";
    moert_config *cfg = api_config(layers, dtype, dispatcher);
    if (!cfg) return 1;
    int bad = run_threads(lay, layers, MOERT_DEVICE_CUDA, cfg, x, r, jobs);
    if (!bad) {
        globalize(jobs, lay, layers, &got);
        double worst = compare_global(ref, &got, layers, which, sizeof which);
        bad = !(worst < tol);
        printf("%-5s %-22s %-9s %s: worst relative difference from %s %.2e (%s)\n", bad ? "FAIL" : "ok",
               layout_name(lay, name, sizeof name), dispatcher, dtype, against, worst, which);
    } else
        printf("FAIL  %-22s %-9s %s: a rank failed (above)\n", layout_name(lay, name, sizeof name), dispatcher, dtype);
    free_jobs(jobs, world_of(lay));
    moert_config_free(cfg);
    return bad;
}

/* ---- a process per GPU ---- */

/* One process of the NCCL check: rank R of N in layout ETP x EDP, the id in hex; compares its rows with the CPU. */
static int process_rank(int rank, int world, int etp, int edp, const char *hex)
{
    unsigned char id[MOERT_NCCL_ID_BYTES];
    for (int i = 0; i < MOERT_NCCL_ID_BYTES; i++) sscanf(hex + 2 * i, "%2hhx", &id[i]);
    moert_config *cfg = api_config(2, "fp32", "alltoall");
    if (!cfg) return 1;
    static float x[TOTAL * H], r[TOTAL * H];
    make_inputs(x, r);
    rank_job ref;
    if (run_threads((layout){1, 1, 1}, 2, MOERT_DEVICE_CPU, cfg, x, r, &ref)) return 1;
    moert_comm *comm = NULL;
    if (moert_comm_create_nccl(id, world, 30.0, &comm) != MOERT_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, moert_last_error());
        return 1;
    }
    rank_job job = {.rank = rank,
                    .world = world,
                    .layers = 2,
                    .lay = {etp, world / (etp * edp), edp},
                    .device = {MOERT_DEVICE_CUDA, rank},
                    .comm = comm,
                    .cfg = cfg,
                    .x = x,
                    .r = r};
    rank_main(&job);
    moert_comm_destroy(comm);
    if (job.rc != MOERT_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, job.error);
        return 1;
    }
    const int64_t t = TOTAL / world;
    double sy = 1e-30, sdx = 1e-30, worst = 0;
    for (int64_t i = 0; i < TOTAL * H; i++) sy = fmax(sy, fabs(ref.out.y[i])), sdx = fmax(sdx, fabs(ref.out.dx[i]));
    for (int64_t i = 0; i < t * H; i++) {
        worst = fmax(worst, fabs(job.out.y[i] - ref.out.y[rank * t * H + i]) / sy);
        worst = fmax(worst, fabs(job.out.dx[i] - ref.out.dx[rank * t * H + i]) / sdx);
    }
    printf("process rank %d of %d (ETP%d, EDP%d): worst relative difference of y and dx from the CPU %.2e\n", rank,
           world, etp, edp, worst);
    moert_config_free(cfg);
    return worst < TOL ? 0 : 1;
}

/* Starts a process per rank of the layout with a fresh NCCL id; 0 when all pass. */
static int run_processes(const char *self, layout lay)
{
    const int world = world_of(lay);
    unsigned char id[MOERT_NCCL_ID_BYTES];
    if (moert_nccl_unique_id(id) != MOERT_OK) {
        fprintf(stderr, "moert_nccl_unique_id: %s\n", moert_last_error());
        return 1;
    }
    char hex[2 * MOERT_NCCL_ID_BYTES + 1], rank_s[MAXW][16], world_s[16], etp_s[16], edp_s[16];
    for (int i = 0; i < MOERT_NCCL_ID_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", id[i]);
    snprintf(world_s, sizeof world_s, "%d", world);
    snprintf(etp_s, sizeof etp_s, "%d", lay.etp);
    snprintf(edp_s, sizeof edp_s, "%d", lay.edp);
    pid_t pids[MAXW];
    int started = 0, bad = 0;
    for (int k = 0; k < world; k++) {
        snprintf(rank_s[k], sizeof rank_s[k], "%d", k);
        char *argv[] = {(char *)self, "--rank", rank_s[k], world_s, etp_s, edp_s, hex, NULL};
        if (posix_spawn(&pids[k], self, NULL, NULL, argv, environ) != 0) {
            bad = 1;
            break;
        }
        started++;
    }
    for (int k = 0; k < started; k++) {
        int status = 0;
        waitpid(pids[k], &status, 0);
        bad |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return bad;
}

/* ---- the trainer ---- */

static const char *trainer_fmt =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": %d, \"device\": \"%s\", \"expert_tensor_parallel\": %d,"
    " \"expert_data_parallel\": %d, \"timeout_s\": 30}, \"train\": {\"tokens_per_rank\": %d, \"seed\": 5, \"lr\": 0.01,"
    " \"optimizer\": \"sgd\"}, \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true,"
    " \"bias_update_rate\": 0.01, \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01},"
    " \"dispatcher\": {\"plugin\": \"alltoall\"}}";

#define CURVE 4

/* What a trainer run gives: the first step's loss, every rank's output and gradients (ranks one after the other), the
 * losses of CURVE more steps. */
typedef struct trained {
    double loss;
    double *output, *grads[2][3]; /* router, fc1, fc2 */
    int64_t out_n, grad_n[2][3];
    double curve[CURVE];
    bool ok;
} trained;

static const moert_param_id trainer_params[3] = {MOERT_PARAM_ROUTER, MOERT_PARAM_FC1, MOERT_PARAM_FC2};

static void train(layout lay, const char *device, trained *out)
{
    memset(out, 0, sizeof *out);
    const int world = world_of(lay);
    char json[2048];
    snprintf(json, sizeof json, trainer_fmt, world, device, lay.etp, lay.edp, TOTAL / world);
    moert_config *cfg = NULL;
    moert_runtime *rt = NULL;
    EXPECT_OK(moert_config_load_string(json, "gpu-folding-trainer", &cfg));
    if (cfg) EXPECT_OK(moert_runtime_create(cfg, &rt));
    if (!rt) goto exit;
    if (moert_runtime_forward_backward(rt, 1, &out->loss) != MOERT_OK) {
        fprintf(stderr, "trainer on %s: %s\n", device, moert_last_error());
        test_failures++;
        goto exit;
    }
    out->out_n = moert_runtime_local_output_numel(rt);
    out->output = calloc((size_t)(out->out_n * world), sizeof(double));
    EXPECT_OK(moert_runtime_read_output(rt, 0, out->out_n, out->output));
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < 3; p++) {
            int64_t n = moert_runtime_local_grad_numel(rt, l, trainer_params[p]);
            out->grad_n[l][p] = n;
            out->grads[l][p] = calloc((size_t)(n * world) + 1, sizeof(double));
            EXPECT_OK(moert_runtime_read_grad(rt, l, trainer_params[p], 0, n, out->grads[l][p]));
        }
    moert_train_options opts = {.struct_size = sizeof opts, .progress = NULL, .steps = CURVE};
    if (moert_runtime_train(rt, &opts) != MOERT_OK) {
        fprintf(stderr, "trainer on %s: %s\n", device, moert_last_error());
        test_failures++;
        goto exit;
    }
    for (int s = 0; s < CURVE && s < rt->record_count; s++) out->curve[s] = rt->records[s].loss;
    out->ok = rt->record_count >= CURVE;
exit:
    moert_runtime_destroy(rt);
    moert_config_free(cfg);
}

static void free_trained(trained *t)
{
    free(t->output);
    for (int l = 0; l < 2; l++)
        for (int p = 0; p < 3; p++) free(t->grads[l][p]);
}

/* The layout trained on the GPUs against the same layout on CPU ranks; 1 when it fails. */
static int check_trainer(layout lay)
{
    trained cpu, gpu;
    char name[64];
    const int world = world_of(lay);
    train(lay, "cpu", &cpu);
    train(lay, "cuda", &gpu);
    int bad = !cpu.ok || !gpu.ok;
    double worst = 0, curve = 0;
    if (!bad) {
        worst = fmax(worst, fabs(gpu.loss - cpu.loss) / fabs(cpu.loss));
        worst = fmax(worst, worst_rel(cpu.output, gpu.output, cpu.out_n * world));
        for (int l = 0; l < 2; l++)
            for (int p = 0; p < 3; p++) {
                bad |= gpu.grad_n[l][p] != cpu.grad_n[l][p];
                if (!bad) worst = fmax(worst, worst_rel(cpu.grads[l][p], gpu.grads[l][p], cpu.grad_n[l][p] * world));
            }
        for (int s = 0; s < CURVE; s++) curve = fmax(curve, fabs(gpu.curve[s] - cpu.curve[s]) / fabs(cpu.curve[s]));
        bad |= !(worst < 5 * TOL) || !(curve < TOL_RUN);
    }
    printf("%-5s %-22s trainer: step 1's loss, output and every rank's gradients vs the CPU %.2e, %d SGD steps' "
           "losses %.2e\n",
           bad ? "FAIL" : "ok", layout_name(lay, name, sizeof name), worst, CURVE, curve);
    free_trained(&cpu);
    free_trained(&gpu);
    return bad;
}

int main(int argc, char **argv)
{
    if (argc == 7 && strcmp(argv[1], "--rank") == 0)
        return process_rank(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), argv[6]);
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 2) {
        printf("test_gpu_folding: %d GPU(s), needs 2 or more, skipped\n", gpus);
        return TEST_SKIP;
    }
    if (gpus > 4) gpus = 4;
    static float x[TOTAL * H], r[TOTAL * H];
    static rank_job ref_jobs[MAXW];
    static global ref;
    make_inputs(x, r);

    /* fp32, two layers, against the CPU run of one rank */
    moert_config *cfg = api_config(2, "fp32", "alltoall");
    if (!cfg || run_threads((layout){1, 1, 1}, 2, MOERT_DEVICE_CPU, cfg, x, r, ref_jobs)) return 1;
    globalize(ref_jobs, (layout){1, 1, 1}, 2, &ref);
    free_jobs(ref_jobs, 1);
    moert_config_free(cfg);
    for (int i = 0; i < LAYOUTS; i++) {
        layout lay = layouts[i];
        if (world_of(lay) > gpus) continue;
        test_failures += check_api(lay, 2, "fp32", "alltoall", &ref, TOL, "the CPU", x, r);
        if (lay.ep > 1) { /* the other dispatchers over an expert-parallel group of 2 of the 4 ranks */
            static const char *const others[] = {"allgather", "deepep", "hybridep"};
            for (int d = 0; d < 3; d++)
                test_failures += check_api(lay, 2, "fp32", others[d], &ref, TOL, "the CPU", x, r);
        }
    }

    /* bf16, one layer, against the same world without folding on the GPUs */
    for (int world = 2; world <= gpus; world *= 2) {
        cfg = api_config(1, "bf16", "alltoall");
        layout plain = {1, world, 1};
        if (!cfg || run_threads(plain, 1, MOERT_DEVICE_CUDA, cfg, x, r, ref_jobs)) {
            printf("FAIL  EP%d bf16: the run without folding failed (above)\n", world);
            test_failures++;
            moert_config_free(cfg);
            continue;
        }
        globalize(ref_jobs, plain, 1, &ref);
        free_jobs(ref_jobs, world);
        moert_config_free(cfg);
        for (int i = 0; i < LAYOUTS; i++)
            if (world_of(layouts[i]) == world)
                test_failures += check_api(layouts[i], 1, "bf16", "alltoall", &ref, TOL16, "EP-only", x, r);
    }

    /* a process per GPU, the NCCL communicator from the caller's id */
    for (int i = 0; i < LAYOUTS; i++) {
        layout lay = layouts[i];
        if (world_of(lay) > gpus || (world_of(lay) == 2 && gpus == 4)) continue;
        char name[64];
        int bad = run_processes(argv[0], lay);
        printf("%-5s %-22s a process per GPU, NCCL id from the caller\n", bad ? "FAIL" : "ok",
               layout_name(lay, name, sizeof name));
        test_failures += bad;
    }

    /* the trainer: EDP sums of the expert gradients on the GPUs */
    for (int i = 0; i < LAYOUTS; i++)
        if (world_of(layouts[i]) <= gpus) test_failures += check_trainer(layouts[i]);
    return test_finish("gpu_folding");
}
