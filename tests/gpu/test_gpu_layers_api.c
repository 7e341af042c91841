/* SPDX-License-Identifier: Apache-2.0 */
/* The embedding API on GPUs with the caller's device buffers, against the same API on the CPU (the reference):
 * - ranks as threads, one GPU each, at EP1, EP2 and EP4 (as many as answer), on a stream the caller made;
 * - a process per GPU with a caller-distributed NCCL id (moert_nccl_unique_id in the parent, passed as hex on the
 *   command line; no port, no environment variable);
 * outputs, input gradients, expert gradients and the router gradient summed over ranks within fp32 tolerances;
 * again with $.parallel.forwards_in_flight 3, the checked micro-batch on slot 2 (its own stream and plugin instances)
 * while two others' forwards are held and their backwards write other gradient buffers, on alltoall and deepep, and
 * with the overlap on, the checked forward merged (moert_moe_forward_backward) with a held one's backward.
 * With micro-batch overlap on one GPU, a forward that needs the second slot while capturing a CUDA graph is refused.
 * Also times one deepseek-v3-shaped layer's forward+backward through the API (--bench, one GPU).
 *   usage: test_gpu_layers_api                 (the checks; exits 77 without a GPU)
 *          test_gpu_layers_api --rank R N HEX   (one process of the NCCL check)
 *          test_gpu_layers_api --bench CONFIG   (times the first layer of CONFIG at EP1 on GPU 0)
 */
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "moert/moert.h"
#include "gpu_test_util.h" /* CK: a checked CUDA call of the test itself */

extern char **environ;

#define H     64
#define F     96
#define E     8
#define TOTAL 512

static const char *config_json =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": 1}, \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";
/* the first with three forwards in flight per layer ($.parallel.forwards_in_flight) */
static const char *pipeline_json =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": 1, \"forwards_in_flight\": 3},"
    " \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";
/* the same on the deepep dispatcher (its NVLink buffers and peer protocol per slot) */
static const char *pipeline_deepep_json =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": 1, \"forwards_in_flight\": 3},"
    " \"dispatcher\": {\"plugin\": \"deepep\"}, \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";
/* the same with the micro-batch overlap on: merged calls on the third slot, every slot's calls on one stream */
static const char *pipeline_merged_json =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": 1, \"forwards_in_flight\": 3, \"overlap_micro_batches\": \"on\"},"
    " \"dispatcher\": {\"plugin\": \"deepep\"}, \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";
/* the same with a gated shared expert */
static const char *shared_json =
    "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp32\", \"shared_expert_ffn_hidden\": 80, \"shared_expert_gate\": true},"
    " \"parallel\": {\"ranks\": 1}, \"train\": {\"tokens_per_rank\": 512},"
    " \"router\": {\"score_function\": \"sigmoid\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}}";

static float uniform(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* What one rank returns to the host: its rows of y and dx, its parameters' gradients. */
typedef struct rank_out {
    float *y, *dx; /* [t,H] */
    float *grad[2][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
} rank_out;

typedef struct rank_job {
    int rank, world;
    moert_device device;
    moert_comm *comm;
    const moert_config *cfg;
    const float *x, *r; /* global [TOTAL,H] */
    /* two more micro-batches' forwards of both layers held on slots 0 and 1 while the checked one runs on slot 2,
     * their backwards (into other gradient buffers) between its forward and its backward */
    bool pipeline;
    bool merged; /* with pipeline: the checked forward merged with a held one's backward (the overlap on) */
    rank_out out;
    moert_result rc;
    char error[2048];
} rank_job;

/* Memory of the rank's device (or host for the CPU), and the copy of host data into it. */
static void *buffer(moert_device d, size_t bytes)
{
    void *p = NULL;
    if (d.type == MOERT_DEVICE_CUDA)
        CK(cudaMalloc(&p, bytes));
    else
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
static void to_host(moert_device d, void *dst, const void *src, size_t bytes)
{
    if (d.type == MOERT_DEVICE_CUDA)
        CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
    else
        memcpy(dst, src, bytes);
}
static void from_host(moert_device d, void *dst, const void *src, size_t bytes)
{
    if (d.type == MOERT_DEVICE_CUDA)
        CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
    else
        memcpy(dst, src, bytes);
}

#define FAIL_RC(call)                                                                                                  \
    do {                                                                                                               \
        j->rc = (call);                                                                                                \
        if (j->rc != MOERT_OK) {                                                                                       \
            snprintf(j->error, sizeof j->error, "%s: %s", #call, moert_last_error());                                  \
            goto done;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* Binds every parameter both layers have to value[l][w] and its gradient to grad[l][w]. */
static moert_result bind_all(moert_layers *m, void *value[2][MOERT_PARAM_COUNT], void *grad[2][MOERT_PARAM_COUNT])
{
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            moert_tensor v, g;
            if (moert_layers_param_desc(m, l, (moert_param_id)w, &v) != MOERT_OK) continue;
            g = v;
            v.data = value[l][w];
            g.data = grad[l][w];
            moert_result rc = moert_layers_bind_param(m, l, (moert_param_id)w, &v, &g);
            if (rc != MOERT_OK) return rc;
        }
    return MOERT_OK;
}

/* One rank: bind device parameters, init, forward two layers, backward, bring the results to the host. */
static void *rank_main(void *arg)
{
    rank_job *j = arg;
    moert_layers *m = NULL, *m2 = NULL;
    void *value[2][MOERT_PARAM_COUNT] = {{0}}, *grad[2][MOERT_PARAM_COUNT] = {{0}};
    void *other_grad[2][MOERT_PARAM_COUNT] = {{0}}, *hx = NULL, *hy = NULL, *hd = NULL; /* j->pipeline's */
    int64_t t = TOTAL / j->world, first = t * j->rank;
    size_t act = (size_t)(t * H) * sizeof(float);
    moert_stream stream = NULL;
    if (j->device.type == MOERT_DEVICE_CUDA) {
        CK(cudaSetDevice(j->device.id));
        cudaStream_t s;
        CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        stream = s;
    }
    void *x = buffer(j->device, act), *h = buffer(j->device, act), *y = buffer(j->device, act);
    void *r = buffer(j->device, act), *dh = buffer(j->device, act), *dx = buffer(j->device, act);
    from_host(j->device, x, j->x + first * H, act);
    from_host(j->device, r, j->r + first * H, act);
    moert_launch launch = {
        .struct_size = sizeof launch, .rank = j->rank, .world_size = j->world, .device = j->device, .comm = j->comm};
    FAIL_RC(moert_layers_create(j->cfg, &launch, &m));
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            moert_tensor v, g;
            if (moert_layers_param_desc(m, l, (moert_param_id)w, &v) == MOERT_ERR_UNSUPPORTED) continue;
            j->out.numel[w] = moert_tensor_numel(&v);
            size_t bytes = moert_tensor_bytes(&v);
            g = v;
            v.data = value[l][w] = buffer(j->device, bytes);
            g.data = grad[l][w] = buffer(j->device, bytes);
            FAIL_RC(moert_layers_bind_param(m, l, (moert_param_id)w, &v, &g));
        }
    FAIL_RC(moert_layers_init_params(m, 7, stream));
    moert_tensor tx = moert_tensor_2d(x, j->device, MOERT_F32, t, H), th = tx, ty = tx, tr = tx, tdh = tx, tdx = tx;
    th.data = h, ty.data = y, tr.data = r, tdh.data = dh, tdx.data = dx;
    moert_saved *s0 = NULL, *s1 = NULL, *held[2][2] = {{NULL}};
    moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 0.0, .accumulate = false};
    if (j->pipeline) hx = buffer(j->device, act), hy = buffer(j->device, act), hd = buffer(j->device, act);
    moert_tensor thx = tx, thy = tx, thd = tx;
    thx.data = hx, thy.data = hy, thd.data = hd;
    for (int i = 0; j->pipeline && i < 2; i++) { /* held on slots 0 and 1, r as input; their results are not checked */
        FAIL_RC(moert_moe_forward(m, 0, &tr, &thx, stream, &held[i][0], NULL));
        FAIL_RC(moert_moe_forward(m, 1, &thx, &thy, stream, &held[i][1], NULL));
    }
    if (j->pipeline) { /* the held ones' backwards write other gradient buffers (the gradients alone rebound) */
        for (int l = 0; l < 2; l++)
            for (int w = 0; w < MOERT_PARAM_COUNT; w++)
                if (grad[l][w]) other_grad[l][w] = buffer(j->device, (size_t)j->out.numel[w] * sizeof(float));
        FAIL_RC(bind_all(m, value, other_grad));
    }
    if (j->merged) { /* the checked forward merged, layer by layer, with the first held one's backward */
        FAIL_RC(moert_moe_forward_backward(m, 0, &tx, &th, &s0, NULL, held[0][1], &tr, &thd, &o, stream));
        FAIL_RC(moert_moe_forward_backward(m, 1, &th, &ty, &s1, NULL, held[0][0], &thd, &thx, &o, stream));
        held[0][0] = held[0][1] = NULL;
    } else {
        FAIL_RC(moert_moe_forward(m, 0, &tx, &th, stream, &s0, NULL));
        FAIL_RC(moert_moe_forward(m, 1, &th, &ty, stream, &s1, NULL));
    }
    if (j->pipeline) {
        for (int i = 0; i < 2; i++) {
            if (!held[i][1]) continue;
            FAIL_RC(moert_moe_backward(m, held[i][1], &tr, &thd, &o, stream));
            FAIL_RC(moert_moe_backward(m, held[i][0], &thd, &thx, &o, stream));
        }
        FAIL_RC(bind_all(m, value, grad));
    }
    FAIL_RC(moert_moe_backward(m, s1, &tr, &tdh, &o, stream));
    FAIL_RC(moert_moe_backward(m, s0, &tdh, &tdx, &o, stream));
    /* a second moert_layers of this rank on the same communicator shares its NCCL communicator */
    FAIL_RC(moert_layers_create(j->cfg, &launch, &m2));
    FAIL_RC(bind_all(m2, value, grad));
    void *h2 = buffer(j->device, act);
    moert_tensor th2 = tx;
    th2.data = h2;
    j->rc = moert_moe_forward(m2, 0, &tx, &th2, stream, NULL, NULL);
    if (stream) CK(cudaStreamSynchronize((cudaStream_t)stream));
    release(j->device, h2);
    if (j->rc != MOERT_OK) {
        snprintf(j->error, sizeof j->error, "a second moert_layers on the same communicator: %s", moert_last_error());
        goto done;
    }
    j->out.y = malloc(act);
    j->out.dx = malloc(act);
    to_host(j->device, j->out.y, y, act);
    to_host(j->device, j->out.dx, dx, act);
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            size_t bytes = (size_t)j->out.numel[w] * sizeof(float);
            if (!bytes) continue;
            j->out.grad[l][w] = malloc(bytes);
            to_host(j->device, j->out.grad[l][w], grad[l][w], bytes);
        }
done:
    if (stream) CK(cudaStreamSynchronize((cudaStream_t)stream));
    moert_layers_destroy(m2);
    moert_layers_destroy(m);
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++)
            if (other_grad[l][w]) release(j->device, other_grad[l][w]);
    void *held_bufs[3] = {hx, hy, hd};
    for (int i = 0; i < 3; i++)
        if (held_bufs[i]) release(j->device, held_bufs[i]);
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            if (value[l][w]) release(j->device, value[l][w]);
            if (grad[l][w]) release(j->device, grad[l][w]);
        }
    void *bufs[6] = {x, h, y, r, dh, dx};
    for (int i = 0; i < 6; i++) release(j->device, bufs[i]);
    if (stream) cudaStreamDestroy((cudaStream_t)stream);
    return NULL;
}

/* Runs the stack over `world` ranks as threads on `type` devices; jobs gets each rank's results. */
static int run_threads(int world, moert_device_type type, const moert_config *cfg, const float *x, const float *r,
                       bool pipeline, bool merged, rank_job *jobs)
{
    moert_comm *comm = NULL;
    if (world > 1 && moert_comm_create_threads(world, 60.0, &comm) != MOERT_OK) {
        fprintf(stderr, "threads communicator: %s\n", moert_last_error());
        return 1;
    }
    pthread_t th[8];
    for (int i = 0; i < world; i++) {
        jobs[i] = (rank_job){.rank = i,
                             .world = world,
                             .device = {type, type == MOERT_DEVICE_CUDA ? i : 0},
                             .comm = comm,
                             .cfg = cfg,
                             .x = x,
                             .r = r,
                             .pipeline = pipeline,
                             .merged = merged};
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

/* The largest difference of a GPU run's results from the CPU reference, relative to the reference's largest value. */
static double compare(const rank_job *ref, const rank_job *got, int world)
{
    double worst = 0;
    int64_t t = TOTAL / world;
    double scale_y = 1e-30, scale_dx = 1e-30;
    for (int64_t i = 0; i < TOTAL * H; i++) {
        scale_y = fmax(scale_y, fabs(ref->out.y[i]));
        scale_dx = fmax(scale_dx, fabs(ref->out.dx[i]));
    }
    for (int k = 0; k < world; k++)
        for (int64_t i = 0; i < t * H; i++) {
            worst = fmax(worst, fabs(got[k].out.y[i] - ref->out.y[k * t * H + i]) / scale_y);
            worst = fmax(worst, fabs(got[k].out.dx[i] - ref->out.dx[k * t * H + i]) / scale_dx);
        }
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
            int64_t n = got[0].out.numel[w];
            double scale = 1e-30;
            for (int64_t i = 0; i < ref->out.numel[w]; i++) scale = fmax(scale, fabs(ref->out.grad[l][w][i]));
            for (int64_t i = 0; i < n; i++) {
                if (w != MOERT_PARAM_FC1 && w != MOERT_PARAM_FC2) { /* replicated: the ranks' shares summed */
                    double s = 0;
                    for (int k = 0; k < world; k++) s += got[k].out.grad[l][w][i];
                    worst = fmax(worst, fabs(s - ref->out.grad[l][w][i]) / scale);
                } else {
                    for (int k = 0; k < world; k++)
                        worst = fmax(worst, fabs(got[k].out.grad[l][w][i] - ref->out.grad[l][w][k * n + i]) / scale);
                }
            }
        }
    return worst;
}

static void make_inputs(float *x, float *r)
{
    uint64_t seed = 99;
    for (int i = 0; i < TOTAL * H; i++) x[i] = uniform(&seed), r[i] = uniform(&seed);
}

/* One process of the NCCL check: rank R of N, the id in hex; compares its rows with the CPU reference. */
static int process_rank(int rank, int world, const char *hex)
{
    unsigned char id[MOERT_NCCL_ID_BYTES];
    for (int i = 0; i < MOERT_NCCL_ID_BYTES; i++) sscanf(hex + 2 * i, "%2hhx", &id[i]);
    moert_config *cfg = NULL;
    if (moert_config_load_string(config_json, "gpu-layers-api", &cfg) != MOERT_OK) return 1;
    static float x[TOTAL * H], r[TOTAL * H];
    make_inputs(x, r);
    rank_job ref;
    if (run_threads(1, MOERT_DEVICE_CPU, cfg, x, r, false, false, &ref)) return 1;
    moert_comm *comm = NULL;
    if (moert_comm_create_nccl(id, world, 60.0, &comm) != MOERT_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, moert_last_error());
        return 1;
    }
    rank_job job = {
        .rank = rank, .world = world, .device = {MOERT_DEVICE_CUDA, rank}, .comm = comm, .cfg = cfg, .x = x, .r = r};
    rank_main(&job);
    moert_comm_destroy(comm);
    if (job.rc != MOERT_OK) {
        fprintf(stderr, "rank %d: %s\n", rank, job.error);
        return 1;
    }
    /* only this rank's rows and experts: compare as a world of one rank's slice */
    int64_t t = TOTAL / world;
    double worst = 0, sy = 1e-30;
    for (int64_t i = 0; i < TOTAL * H; i++) sy = fmax(sy, fabs(ref.out.y[i]));
    for (int64_t i = 0; i < t * H; i++) worst = fmax(worst, fabs(job.out.y[i] - ref.out.y[rank * t * H + i]) / sy);
    int64_t n = job.out.numel[MOERT_PARAM_FC2];
    double sg = 1e-30;
    for (int64_t i = 0; i < ref.out.numel[MOERT_PARAM_FC2]; i++)
        sg = fmax(sg, fabs(ref.out.grad[0][MOERT_PARAM_FC2][i]));
    for (int64_t i = 0; i < n; i++)
        worst = fmax(worst,
                     fabs(job.out.grad[0][MOERT_PARAM_FC2][i] - ref.out.grad[0][MOERT_PARAM_FC2][rank * n + i]) / sg);
    printf("process rank %d of %d: worst relative difference from the CPU %.2e\n", rank, world, worst);
    moert_config_free(cfg);
    return worst < 2e-4 ? 0 : 1;
}

/* Starts `world` processes of this binary with a fresh NCCL id; 0 when all pass. */
static int run_processes(const char *self, int world)
{
    unsigned char id[MOERT_NCCL_ID_BYTES];
    if (moert_nccl_unique_id(id) != MOERT_OK) {
        fprintf(stderr, "moert_nccl_unique_id: %s\n", moert_last_error());
        return 1;
    }
    char hex[2 * MOERT_NCCL_ID_BYTES + 1], rank_s[8][16], world_s[16];
    for (int i = 0; i < MOERT_NCCL_ID_BYTES; i++) snprintf(hex + 2 * i, 3, "%02x", id[i]);
    snprintf(world_s, sizeof world_s, "%d", world);
    pid_t pids[8];
    for (int k = 0; k < world; k++) {
        snprintf(rank_s[k], sizeof rank_s[k], "%d", k);
        char *argv[] = {(char *)self, "--rank", rank_s[k], world_s, hex, NULL};
        if (posix_spawn(&pids[k], self, NULL, NULL, argv, environ) != 0) return 1;
    }
    int bad = 0;
    for (int k = 0; k < world; k++) {
        int status = 0;
        waitpid(pids[k], &status, 0);
        bad |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return bad;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Times layer 0 of CONFIG (its tokens_per_rank tokens, its dtype) forward+backward at EP1 on GPU 0 through the API:
 * the median of 20 after 5 warm-up passes, printed as one JSON line. */
static int bench(const char *path)
{
    moert_config *cfg = NULL;
    moert_layers *m = NULL;
    if (moert_config_load_file(path, &cfg) != MOERT_OK || moert_config_set(cfg, "model.num_layers", "1") != MOERT_OK) {
        fprintf(stderr, "%s\n", moert_last_error());
        return 1;
    }
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = {MOERT_DEVICE_CUDA, 0}};
    if (moert_layers_create(cfg, &launch, &m) != MOERT_OK) {
        fprintf(stderr, "%s\n", moert_last_error());
        return 1;
    }
    moert_layers_info info = {.struct_size = sizeof info};
    moert_layers_get_info(m, &info);
    void *value[MOERT_PARAM_COUNT], *grad[MOERT_PARAM_COUNT];
    for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
        moert_tensor v, g;
        moert_layers_param_desc(m, 0, (moert_param_id)w, &v);
        g = v;
        CK(cudaMalloc(&value[w], moert_tensor_bytes(&v)));
        CK(cudaMalloc(&grad[w], moert_tensor_bytes(&v)));
        v.data = value[w], g.data = grad[w];
        moert_layers_bind_param(m, 0, (moert_param_id)w, &v, &g);
    }
    moert_layers_init_params(m, 1, NULL);
    int64_t t = info.max_tokens;
    size_t bytes = (size_t)(t * info.hidden) * moert_dtype_size(info.dtype);
    void *x, *y, *dy, *dx;
    CK(cudaMalloc(&x, bytes));
    CK(cudaMalloc(&y, bytes));
    CK(cudaMalloc(&dy, bytes));
    CK(cudaMalloc(&dx, bytes));
    /* small random-looking values: bytes of a pattern that reads as modest bf16/fp32 numbers */
    float *hx = malloc((size_t)(t * info.hidden) * sizeof(float));
    uint64_t seed = 3;
    for (int64_t i = 0; i < t * info.hidden; i++) hx[i] = 0.5f * uniform(&seed);
    if (info.dtype == MOERT_F32) {
        CK(cudaMemcpy(x, hx, bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dy, hx, bytes, cudaMemcpyHostToDevice));
    } else { /* bf16: the upper halves of the fp32 values */
        uint16_t *hb = malloc(bytes);
        for (int64_t i = 0; i < t * info.hidden; i++) {
            uint32_t u;
            memcpy(&u, &hx[i], 4);
            hb[i] = (uint16_t)(u >> 16);
        }
        CK(cudaMemcpy(x, hb, bytes, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dy, hb, bytes, cudaMemcpyHostToDevice));
        free(hb);
    }
    free(hx);
    moert_tensor tx = moert_tensor_2d(x, launch.device, info.dtype, t, info.hidden), ty = tx, tdy = tx, tdx = tx;
    ty.data = y, tdy.data = dy, tdx.data = dx;
    double ms[25];
    int rc = 0;
    for (int i = 0; i < 25 && rc == 0; i++) {
        CK(cudaDeviceSynchronize());
        double t0 = now();
        moert_saved *s = NULL;
        moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 1.0, .accumulate = false};
        if (moert_moe_forward(m, 0, &tx, &ty, NULL, &s, NULL) != MOERT_OK ||
            moert_moe_backward(m, s, &tdy, &tdx, &o, NULL) != MOERT_OK) {
            fprintf(stderr, "%s\n", moert_last_error());
            rc = 1;
        }
        CK(cudaDeviceSynchronize());
        ms[i] = (now() - t0) * 1e3;
    }
    double sorted[20];
    memcpy(sorted, ms + 5, sizeof sorted);
    for (int a = 0; a < 20; a++)
        for (int b = a + 1; b < 20; b++)
            if (sorted[b] < sorted[a]) {
                double tmp = sorted[a];
                sorted[a] = sorted[b];
                sorted[b] = tmp;
            }
    if (rc == 0)
        printf("{\"name\": \"layers_api_fwd_bwd\", \"config\": \"%s\", \"experts\": %lld, \"tokens\": %lld, "
               "\"value\": %.3f, \"unit\": \"ms\"}\n",
               path, (long long)info.num_experts, (long long)t, 0.5 * (sorted[9] + sorted[10]));
    moert_layers_destroy(m);
    moert_config_free(cfg);
    return rc;
}

/* With micro-batch overlap ("on", 2 micro-batches a step) on GPU 0: while the layers capture a CUDA graph, a forward
 * that needs the second slot (the first holds a forward) is refused before anything is queued; the capture still
 * ends, and the first slot's backward runs after it. */
static void capture_refuses_second_slot(void)
{
    static const char *json =
        "{\"model\": {\"hidden\": 64, \"ffn_hidden\": 96, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 1,"
        " \"dtype\": \"fp32\"}, \"parallel\": {\"ranks\": 1, \"overlap_micro_batches\": \"on\"},"
        " \"train\": {\"tokens_per_rank\": 64}}";
    const moert_device dev = {MOERT_DEVICE_CUDA, 0};
    const int64_t t = 64;
    const size_t act = (size_t)(t * H) * sizeof(float);
    moert_config *cfg = NULL;
    moert_layers *m = NULL;
    moert_graph *g = NULL;
    moert_saved *s0 = NULL, *s1 = NULL;
    void *value[MOERT_PARAM_COUNT] = {0}, *grad[MOERT_PARAM_COUNT] = {0};
    static float host_x[64 * H];
    uint64_t seed = 11;
    for (int64_t i = 0; i < t * H; i++) host_x[i] = uniform(&seed);
    cudaStream_t stream;
    CK(cudaSetDevice(0));
    CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    void *x = buffer(dev, act), *y = buffer(dev, act), *y1 = buffer(dev, act), *dx = buffer(dev, act);
    from_host(dev, x, host_x, act);
    EXPECT_OK(moert_config_load_string(json, "gpu-layers-api-capture", &cfg));
    moert_launch launch = {.struct_size = sizeof launch, .rank = 0, .world_size = 1, .device = dev, .micro_batches = 2};
    if (!cfg || moert_layers_create(cfg, &launch, &m) != MOERT_OK) {
        fprintf(stderr, "capture with the second slot: %s\n", moert_last_error());
        test_failures++;
        goto done;
    }
    EXPECT(moert_layers_overlap_interleave(m, true)); /* the second slot is there */
    for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
        moert_tensor v, gr;
        if (moert_layers_param_desc(m, 0, (moert_param_id)w, &v) != MOERT_OK) continue;
        gr = v;
        v.data = value[w] = buffer(dev, moert_tensor_bytes(&v));
        gr.data = grad[w] = buffer(dev, moert_tensor_bytes(&gr));
        EXPECT_OK(moert_layers_bind_param(m, 0, (moert_param_id)w, &v, &gr));
    }
    EXPECT_OK(moert_layers_init_params(m, 7, stream));
    moert_tensor tx = moert_tensor_2d(x, dev, MOERT_F32, t, H), ty = tx, ty1 = tx, tdx = tx;
    ty.data = y, ty1.data = y1, tdx.data = dx;
    EXPECT_OK(moert_moe_forward(m, 0, &tx, &ty, stream, &s0, NULL)); /* the first slot */
    EXPECT_OK(moert_layers_capture_begin(m, stream));
    const moert_result rc = moert_moe_forward(m, 0, &tx, &ty1, stream, &s1, NULL);
    EXPECT_EQ_INT(rc, MOERT_ERR_UNSUPPORTED);
    EXPECT(strstr(moert_last_error(),
                  "slot 1 ($.parallel.overlap_micro_batches, forwards_in_flight) while capturing a CUDA graph") !=
           NULL);
    printf("capture with micro-batch overlap: a forward in the second slot refused: %s\n", moert_last_error());
    (void)moert_layers_capture_end(m, stream, "nothing (the refused forward)", &g); /* an empty capture */
    moert_graph_destroy(g);
    moert_backward_options o = {.struct_size = sizeof o, .router_loss_scale = 0.0, .accumulate = false};
    if (s0) EXPECT_OK(moert_moe_backward(m, s0, &ty, &tdx, &o, stream));
    CK(cudaStreamSynchronize(stream));
done:
    moert_layers_destroy(m);
    moert_config_free(cfg);
    for (int w = 0; w < MOERT_PARAM_COUNT; w++) {
        if (value[w]) release(dev, value[w]);
        if (grad[w]) release(dev, grad[w]);
    }
    void *bufs[4] = {x, y, y1, dx};
    for (int i = 0; i < 4; i++) release(dev, bufs[i]);
    cudaStreamDestroy(stream);
}

int main(int argc, char **argv)
{
    if (argc == 5 && strcmp(argv[1], "--rank") == 0) return process_rank(atoi(argv[2]), atoi(argv[3]), argv[4]);
    if (argc == 3 && strcmp(argv[1], "--bench") == 0) return bench(argv[2]);
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
        printf("test_gpu_layers_api: no GPU, skipped\n");
        return TEST_SKIP;
    }
    moert_config *cfg = NULL;
    static float x[TOTAL * H], r[TOTAL * H];
    make_inputs(x, r);
    static const char *const variants[5] = {"", ", gated shared expert", ", on slot 2 of 3 forwards in flight",
                                            ", deepep, on slot 2 of 3 forwards in flight",
                                            ", deepep, merged calls on slot 2 of 3 (overlap on)"};
    const char *const configs[5] = {config_json, shared_json, pipeline_json, pipeline_deepep_json,
                                    pipeline_merged_json};
    for (int c = 0; c < 5; c++) {
        moert_config *cc = NULL;
        EXPECT_OK(moert_config_load_string(configs[c], "gpu-layers-api", &cc));
        if (!cc) continue;
        rank_job ref, jobs[4];
        EXPECT(run_threads(1, MOERT_DEVICE_CPU, cc, x, r, false, false, &ref) == 0);
        for (int world = 1; world <= 4 && world <= gpus; world *= 2) {
            if (run_threads(world, MOERT_DEVICE_CUDA, cc, x, r, c >= 2, c == 4, jobs)) {
                test_failures++;
                continue;
            }
            double worst = compare(&ref, jobs, world);
            printf("threads, %d GPU%s%s: worst relative difference from the CPU %.2e\n", world, world > 1 ? "s" : "",
                   variants[c], worst);
            EXPECT(worst < 2e-4);
        }
        moert_config_free(cc);
    }
    EXPECT_OK(moert_config_load_string(config_json, "gpu-layers-api", &cfg));
    for (int world = 2; world <= 4 && world <= gpus; world *= 2) {
        int bad = run_processes(argv[0], world);
        printf("a process per GPU, %d GPUs, NCCL id from the caller: %s\n", world, bad ? "FAIL" : "ok");
        EXPECT(bad == 0);
    }
    moert_config_free(cfg);
    capture_refuses_second_slot();
    return test_finish("gpu_layers_api");
}
