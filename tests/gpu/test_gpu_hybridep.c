/* GPU test of the "hybridep" dispatcher's CUDA path (TMA bulk copies or vector copies into the peers' buffers, no host
 * sync in a step) against its CPU path, the reference, on 1, 2, 4 and 8 GPUs (as many as there are; a thread per GPU).
 * Same routing and data on both paths: uniform, one hot expert with the last rank's experts receiving nothing, a rank
 * with no tokens, tokens with every copy dropped, an fp32 row of odd length (vector fallback, in low-latency and in
 * normal mode), low-latency mode, vector copies, and the deepseek-v3 shape (H 7168, K 8, E 256) at 8 and 16 SMs and
 * in low-latency mode with 8 blocks. dispatch (the received rows, the
 * CPU's num_recv of them), combine_backward, the device counts and d_topk_probs must match bit for bit; combine and
 * dispatch_backward's d_x within fp32-accumulation tolerance; rows past the received ones untouched; a second
 * identical step gives the same bits. With two GPUs or more: a rank that dispatches alone, and a rank with a bad expert
 * id; both are reported, naming the rank, by the first call after the failing kernel finished (no host sync in a
 * step: the kernels leave a status word in mapped pinned memory). The low-latency tuning options (ll_threads, ll_piece,
 * ll_flag, ll_fence) have cases of their own. CUDA graphs: the instance declares itself graph-capturable; every rank
 * captures prepare + the four calls on its stream (one graph each), replays it 3 times with a new routing written
 * into the same topk_idx buffer before each replay, eager calls of the same instance in between; every output of a
 * replay must match the eager calls' bit for bit and the CPU path as above (low-latency and normal mode). Every case
 * runs with timeout_ms 5000. Progress goes to stdout line by line. Prints a table last. Exits 77 without a GPU. */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_hybridep: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "moert/dispatcher.h"

#define DISPATCHER "hybridep"
#define TIMEOUT_S 20.0          /* the rank threads' communicators */
#define CASE_TIMEOUT "5000"     /* timeout_ms of every case's instances */
#define MAX_WORLD 8

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t die_lock = PTHREAD_MUTEX_INITIALIZER;

/* Ends the test after a failure of its own scaffolding on any rank thread: once, without atexit handlers (exit()
 * from several threads at a time is undefined). */
static void die(void)
{
    pthread_mutex_lock(&die_lock);
    fflush(stdout);
    fflush(stderr);
    _exit(1);
}

/* A progress line from rank 0 (stdout is line-buffered). */
static void progress(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void progress(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&lock);
    vprintf(fmt, ap);
    fputc('\n', stdout);
    fflush(stdout);
    pthread_mutex_unlock(&lock);
    va_end(ap);
}

/* Counts one failed check and prints why (thread-safe). */
static void failure(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void failure(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&lock);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    test_failures++;
    pthread_mutex_unlock(&lock);
    va_end(ap);
}

/* A CUDA call of the test's own scaffolding: a failure there ends the test. */
#define CK(call)                                                                                             \
    do {                                                                                                     \
        cudaError_t e_ = (call);                                                                             \
        if (e_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
            die();                                                                                           \
        }                                                                                                    \
    } while (0)

/* A plugin call that must succeed; prints the plugin's message otherwise. */
static bool call_ok(test_instance *ti, moert_result rc, const char *what, const char *where, int line)
{
    if (rc == MOERT_OK) return true;
    failure("%s:%d: %s: %s failed (%s): %s", __FILE__, line, where, what, moert_result_name(rc),
            moert_host_take_error(ti->host));
    return false;
}
#define CALL(ti, call, where) call_ok((ti), (call), #call, (where), __LINE__)

static void *host_alloc(size_t bytes)
{
    void *p = calloc(1, bytes + 64);
    if (!p) {
        fprintf(stderr, "out of host memory\n");
        die();
    }
    return p;
}

static void fill_random(void *buf, moert_dtype dtype, int64_t n, uint64_t *rng, double scale)
{
    moert_tensor t = moert_tensor_1d(buf, moert_cpu(), dtype, n);
    for (int64_t i = 0; i < n; i++) moert_store(&t, i, scale * test_uniform(rng));
}

static void *device_copy(cudaStream_t s, const void *host, size_t bytes)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 64));
    if (bytes) CK(cudaMemcpyAsync(d, host, bytes, cudaMemcpyHostToDevice, s));
    return d;
}

static void *device_poisoned(cudaStream_t s, size_t bytes)
{
    void *d = NULL;
    CK(cudaMalloc(&d, bytes + 64));
    CK(cudaMemsetAsync(d, 0xFF, bytes + 64, s));
    return d;
}

static void download(cudaStream_t s, void *host, const void *d, size_t bytes)
{
    CK(cudaStreamSynchronize(s));
    if (bytes) CK(cudaMemcpy(host, d, bytes, cudaMemcpyDeviceToHost));
}

static int64_t bytes_differ(const void *a, const void *b, size_t n)
{
    const unsigned char *x = a, *y = b;
    int64_t d = 0;
    for (size_t i = 0; i < n; i++) d += x[i] != y[i];
    return d;
}

static bool all_poison(const void *a, size_t n)
{
    const unsigned char *x = a;
    for (size_t i = 0; i < n; i++)
        if (x[i] != 0xFF) return false;
    return true;
}

/* ||got - want|| / ||want|| (NaN when got has a NaN). */
static double rel_error(const void *got, const void *want, moert_dtype dtype, int64_t n)
{
    moert_tensor g = moert_tensor_1d((void *)got, moert_cpu(), dtype, n);
    moert_tensor w = moert_tensor_1d((void *)want, moert_cpu(), dtype, n);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double a = moert_load(&g, i), b = moert_load(&w, i);
        num += (a - b) * (a - b);
        den += b * b;
    }
    if (num != num) return NAN;
    if (den == 0) return num == 0 ? 0 : INFINITY;
    return sqrt(num / den);
}

/* ---- cases ---- */

typedef struct dispatch_case {
    const char *name;
    moert_dtype dtype;
    int64_t hidden, experts, topk, tokens; /* rank r has tokens + 5*r tokens */
    double drop;                           /* probability that a copy is dropped (-1) */
    double hot;                            /* probability that a copy goes to expert 0 */
    bool starve_last;                      /* the last rank's experts receive nothing (world > 1) */
    bool empty_first;                      /* rank 0 has no tokens */
    bool drop_whole;                       /* every fourth token has all its copies dropped */
    const char *options;
} dispatch_case;

static const dispatch_case cases[] = {
    {"uniform bf16 H256 K4 E16", MOERT_BF16, 256, 16, 4, 300, 0.10, 0.0, false, false, false, "{}"},
    {"hot, last rank starved, fp32 H33", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, false, "{}"},
    {"no tokens on rank 0 bf16 K3", MOERT_BF16, 48, 16, 3, 50, 0.05, 0.0, false, true, false, "{\"num_sms\": 8}"},
    {"dropped tokens bf16 H64 K2 (tma)", MOERT_BF16, 64, 8, 2, 120, 0.0, 0.0, false, false, true,
     "{\"num_sms\": 6, \"low_latency\": \"off\"}"},
    {"low-latency bf16 H512 K8 E32", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\"}"},
    {"vector copies bf16 H512 K6 E32", MOERT_BF16, 512, 32, 6, 200, 0.05, 0.1, false, false, false,
     "{\"copy\": \"vector\", \"low_latency\": \"off\"}"},
    {"deepseek shape bf16 16 SMs", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.0, false, false, false,
     "{\"num_sms\": 16, \"low_latency\": \"off\"}"},
    {"deepseek shape bf16 8 SMs, hot", MOERT_BF16, 7168, 256, 8, 256, 0.0, 0.3, false, false, false,
     "{\"num_sms\": 8, \"low_latency\": \"off\"}"},
    {"fp32 H33 normal mode 3 SMs, starved", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"num_sms\": 3, \"low_latency\": \"off\"}"},
    {"deepseek shape low-latency 8 blocks", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.0, false, false, false,
     "{\"num_sms\": 8, \"low_latency\": \"on\"}"},
    {"ll 1024 threads, per-block flag", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_threads\": 1024, \"ll_flag\": \"per_block\", \"ll_fence\": \"block\"}"},
    {"ll 2 KB pieces, block fence", MOERT_BF16, 7168, 256, 8, 100, 0.05, 0.0, false, false, false,
     "{\"low_latency\": \"on\", \"ll_piece\": 2048, \"ll_fence\": \"block\", \"num_sms\": 16}"},
    {"ll fp32 H33 512-B pieces, per-block", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"low_latency\": \"on\", \"ll_piece\": 512, \"ll_flag\": \"per_block\", \"ll_threads\": 1024}"},
    {"ll thread fence (before the default)", MOERT_BF16, 7168, 256, 8, 128, 0.02, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_fence\": \"thread\"}"},
};
#define CASES ((int)(sizeof cases / sizeof cases[0]))

typedef struct case_row {
    int world;
    const char *name;
    int64_t recv_rows, layout_diffs, dispatch_diffs, combine_bytes, cb_diffs, dx_bytes, dprobs_diffs, repeat_diffs;
    double combine_err, dx_err, tol;
    bool ran;
} case_row;

#define WORLDS 4 /* 1, 2, 4 and 8 GPUs, as many as the machine has */
static case_row table[WORLDS * CASES];
static case_row graph_case_rows[WORLDS * 4]; /* the graph cases against the CPU (GRAPH_CASES, defined below) */

typedef struct stall_row {
    int world;
    bool ran, ok;
    double seconds;
    char message[200];
} stall_row;
static stall_row stall_table[WORLDS];

typedef struct world_run {
    int world, index;
    moert_comm_group *comm;
    moert_nccl_group *nccl_group;
} world_run;

typedef struct rank_env {
    int rank, world;
    char where[32];
    moert_comm_group *comm;
    moert_cuda_pool *pool;
    moert_nccl_comm *nccl;
    cudaStream_t stream;
} rank_env;

static moert_device gpu_of(const rank_env *env) { return (moert_device){MOERT_DEVICE_CUDA, env->rank}; }

/* topk_idx: distinct experts per token, some dropped, optionally one hot expert, a starved rank, dropped tokens. */
static void make_routing(const dispatch_case *cs, int world, int64_t tokens, uint64_t *rng, int32_t *idx)
{
    const int64_t E = cs->experts, K = cs->topk, El = E / world;
    const int64_t allowed = cs->starve_last && world > 1 ? E - El : E;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = -1;
            if ((test_uniform(rng) + 1) / 2 >= cs->drop && !(cs->drop_whole && t % 4 == 1)) {
                for (int attempt = 0; attempt < 64 && e < 0; attempt++) {
                    int32_t pick = (test_uniform(rng) + 1) / 2 < cs->hot
                                       ? 0
                                       : (int32_t)((test_uniform(rng) + 1) / 2 * (double)allowed) % (int32_t)allowed;
                    bool used = false;
                    for (int64_t j = 0; j < k; j++) used = used || idx[t * K + j] == pick;
                    if (!used) e = pick;
                }
            }
            idx[t * K + k] = e;
        }
}

/* Inputs and outputs of one step on one rank (host copies). */
typedef struct step_data {
    int64_t T, H, K, cap, nrecv;
    size_t es;
    int32_t *idx;
    void *x, *d_y, *d_x0, *y_expert, *d_recv_x;
    float *probs, *d_recv_probs;
    int64_t tokens_per_expert[256];
    void *recv_x, *y, *d_y_expert, *d_x; /* recv_x with 2 rows past capacity */
    float *recv_probs, *d_topk_probs;
} step_data;

static void outputs_alloc(step_data *o, const step_data *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    o->recv_x = host_alloc((size_t)(d->cap + 2) * rowb);
    o->recv_probs = host_alloc((size_t)d->cap * sizeof(float));
    o->y = host_alloc((size_t)d->T * rowb);
    o->d_y_expert = host_alloc((size_t)d->cap * rowb);
    o->d_x = host_alloc((size_t)d->T * rowb);
    o->d_topk_probs = host_alloc((size_t)(d->T * d->K) * sizeof(float));
}

static void outputs_free(step_data *o)
{
    void *p[] = {o->recv_x, o->recv_probs, o->y, o->d_y_expert, o->d_x, o->d_topk_probs};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

/* The four calls after prepare() on tensors of `dev` (host pointers on the CPU, device pointers on the GPU). */
static bool run_calls(test_instance *ti, moert_stream stream, moert_device dev, moert_dtype dt, const step_data *d,
                      void *x, void *probs, void *recv_x, void *recv_probs, void *y_expert, void *y, void *d_y,
                      void *d_y_expert, void *d_recv_x, void *d_recv_probs, void *d_x, void *d_topk_probs,
                      const char *where)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap;
    moert_tensor xt = moert_tensor_2d(x, dev, dt, T, H), pt = moert_tensor_2d(probs, dev, MOERT_F32, T, K);
    moert_tensor rx = moert_tensor_2d(recv_x, dev, dt, cap + 2, H), rp = moert_tensor_1d(recv_probs, dev, MOERT_F32, cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .topk_probs = &pt, .recv_x = &rx, .recv_probs = &rp};
    moert_tensor ye = moert_tensor_2d(y_expert, dev, dt, cap, H), yt = moert_tensor_2d(y, dev, dt, T, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &yt};
    moert_tensor dy = moert_tensor_2d(d_y, dev, dt, T, H), dye = moert_tensor_2d(d_y_expert, dev, dt, cap, H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    moert_tensor drx = moert_tensor_2d(d_recv_x, dev, dt, cap, H), drp = moert_tensor_1d(d_recv_probs, dev, MOERT_F32, cap);
    moert_tensor dx = moert_tensor_2d(d_x, dev, dt, T, H), dtp = moert_tensor_2d(d_topk_probs, dev, MOERT_F32, T, K);
    moert_dispatch_backward_args db = {.struct_size = sizeof db, .d_recv_x = &drx, .d_recv_probs = &drp, .d_x = &dx,
                                       .d_topk_probs = &dtp};
    return CALL(ti, vt->dispatch(ti->ctx, stream, &da), where) && CALL(ti, vt->combine(ti->ctx, stream, &ca), where) &&
           CALL(ti, vt->combine_backward(ti->ctx, stream, &cb), where) &&
           CALL(ti, vt->dispatch_backward(ti->ctx, stream, &db), where);
}

/* One CUDA step with poisoned outputs, downloaded into o. */
static bool cuda_step(const rank_env *env, test_instance *ti, const dispatch_case *cs, const step_data *d, void *const *in,
                      step_data *o)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const moert_device gpu = gpu_of(env);
    const cudaStream_t s = env->stream;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap, El = cs->experts / env->world;
    const size_t row = (size_t)H * d->es;
    moert_tensor idx = moert_tensor_2d(in[0], gpu, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, (moert_stream)s, &idx, &layout), env->where)) return false;
    int64_t dev_counts[256] = {0};
    download(s, dev_counts, layout.tokens_per_expert.data, (size_t)El * sizeof(int64_t));
    o->cap = layout.capacity;
    for (int64_t l = 0; l < El; l++) o->tokens_per_expert[l] = dev_counts[l];
    if (layout.tokens_per_expert_host != NULL || layout.num_recv != -1)
        failure("%s %s: CUDA layout has a host count array or num_recv %lld (expected NULL and -1: no host sync)",
                env->where, cs->name, (long long)layout.num_recv);
    if (layout.capacity != cap) {
        failure("%s %s: CUDA capacity %lld, CPU %lld", env->where, cs->name, (long long)layout.capacity, (long long)cap);
        return false;
    }
    void *recv_x = device_poisoned(s, (size_t)(cap + 2) * row), *recv_probs = device_poisoned(s, (size_t)cap * 4);
    void *y = device_poisoned(s, (size_t)T * row), *d_y_expert = device_poisoned(s, (size_t)cap * row);
    void *d_x = device_copy(s, d->d_x0, (size_t)T * row), *d_topk_probs = device_poisoned(s, (size_t)(T * K) * 4);
    bool ok = run_calls(ti, (moert_stream)s, gpu, cs->dtype, d, in[1], in[2], recv_x, recv_probs, in[3], y, in[4],
                        d_y_expert, in[5], in[6], d_x, d_topk_probs, env->where);
    if (ok) {
        download(s, o->recv_x, recv_x, (size_t)(cap + 2) * row);
        download(s, o->recv_probs, recv_probs, (size_t)cap * 4);
        download(s, o->y, y, (size_t)T * row);
        download(s, o->d_y_expert, d_y_expert, (size_t)cap * row);
        download(s, o->d_x, d_x, (size_t)T * row);
        download(s, o->d_topk_probs, d_topk_probs, (size_t)(T * K) * 4);
    }
    CK(cudaStreamSynchronize(s));
    void *bufs[] = {recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    return ok;
}

static void compare(const rank_env *env, const dispatch_case *cs, const step_data *d, const step_data *g, case_row *row)
{
    const int64_t El = cs->experts / env->world;
    const size_t rowb = (size_t)d->H * d->es;
    int64_t layout_diffs = 0;
    for (int64_t l = 0; l < El; l++) layout_diffs += g->tokens_per_expert[l] != d->tokens_per_expert[l];
    int64_t disp = bytes_differ(g->recv_x, d->recv_x, (size_t)d->nrecv * rowb) +
                   bytes_differ(g->recv_probs, d->recv_probs, (size_t)d->nrecv * 4) +
                   !all_poison((const char *)g->recv_x + (size_t)d->nrecv * rowb, (size_t)(d->cap - d->nrecv + 2) * rowb);
    int64_t comb_bytes = bytes_differ(g->y, d->y, (size_t)d->T * rowb);
    double comb_err = rel_error(g->y, d->y, cs->dtype, d->T * d->H);
    int64_t cb = bytes_differ(g->d_y_expert, d->d_y_expert, (size_t)d->nrecv * rowb);
    int64_t dx_bytes = bytes_differ(g->d_x, d->d_x, (size_t)d->T * rowb);
    double dx_err = rel_error(g->d_x, d->d_x, cs->dtype, d->T * d->H);
    int64_t dp = bytes_differ(g->d_topk_probs, d->d_topk_probs, (size_t)(d->T * d->K) * 4);
    pthread_mutex_lock(&lock);
    row->layout_diffs += layout_diffs;
    row->dispatch_diffs += disp;
    row->combine_bytes += comb_bytes;
    if (!(comb_err <= row->combine_err)) row->combine_err = comb_err;
    row->cb_diffs += cb;
    row->dx_bytes += dx_bytes;
    if (!(dx_err <= row->dx_err)) row->dx_err = dx_err;
    row->dprobs_diffs += dp;
    pthread_mutex_unlock(&lock);
    if (layout_diffs || disp || cb || dp || !(comb_err <= row->tol) || !(dx_err <= row->tol))
        failure("%s %s: layout %lld, dispatch %lld bytes differ, combine error %.3g, combine_backward %lld, d_x error "
                "%.3g, d_topk_probs %lld (tolerance %.3g)", env->where, cs->name, (long long)layout_diffs,
                (long long)disp, comb_err, (long long)cb, dx_err, (long long)dp, row->tol);
}

/* One case on one rank: CPU once, CUDA twice, compared. Every rank makes the same collective calls in order. */
static void run_case(const rank_env *env, int ci, case_row *row)
{
    const dispatch_case *cs = &cases[ci];
    const int W = env->world, rank = env->rank;
    step_data d;
    memset(&d, 0, sizeof d);
    d.T = cs->empty_first && rank == 0 ? 0 : cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    moert_layer_info layer = test_layer(d.H, 8, cs->experts, d.K, cs->tokens + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_of(env);
    char where[128];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);
    char options[160]; /* the case's options with timeout_ms */
    snprintf(options, sizeof options, "{\"timeout_ms\": " CASE_TIMEOUT "%s%s", strlen(cs->options) > 2 ? ", " : "",
             cs->options + 1);
    if (rank == 0) progress("world %d, case \"%s\" %s: open", W, cs->name, options);

    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = test_instance_open_cuda(&gpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &gpu_layer,
                                               env->comm, rank, W, env->pool, env->nccl, (moert_stream)env->stream);
    if (rc2 != MOERT_OK) failure("%s: CUDA dispatcher: %s", where, moert_error_message());
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)cpu.plugin.header;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(ci + 1) + 1000003ull * (uint64_t)(rank + 1);
    d.idx = host_alloc((size_t)(d.T * d.K) * sizeof(int32_t));
    make_routing(cs, W, d.T, &rng, d.idx);
    const size_t rowb = (size_t)d.H * d.es;
    d.x = host_alloc((size_t)d.T * rowb);
    d.d_y = host_alloc((size_t)d.T * rowb);
    d.d_x0 = host_alloc((size_t)d.T * rowb);
    d.probs = host_alloc((size_t)(d.T * d.K) * sizeof(float));
    fill_random(d.x, cs->dtype, d.T * d.H, &rng, 1.0);
    fill_random(d.d_y, cs->dtype, d.T * d.H, &rng, 1.0);
    fill_random(d.d_x0, cs->dtype, d.T * d.H, &rng, 1.0);
    for (int64_t i = 0; i < d.T * d.K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);

    /* the CPU reference */
    if (rank == 0) progress("world %d, case \"%s\": CPU reference", W, cs->name);
    moert_tensor idx = moert_tensor_2d(d.idx, moert_cpu(), MOERT_I32, d.T, d.K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    bool ok = CALL(&cpu, vt->prepare(cpu.ctx, NULL, &idx, &layout), where);
    if (ok) {
        d.cap = layout.capacity;
        d.nrecv = layout.num_recv;
        for (int64_t l = 0; l < cs->experts / W; l++)
            d.tokens_per_expert[l] = ((const int64_t *)layout.tokens_per_expert.data)[l];
        d.y_expert = host_alloc((size_t)d.cap * rowb);
        d.d_recv_x = host_alloc((size_t)d.cap * rowb);
        d.d_recv_probs = host_alloc((size_t)d.cap * sizeof(float));
        fill_random(d.y_expert, cs->dtype, d.cap * d.H, &rng, 1.0);
        fill_random(d.d_recv_x, cs->dtype, d.cap * d.H, &rng, 1.0);
        fill_random(d.d_recv_probs, MOERT_F32, d.cap, &rng, 1.0);
        outputs_alloc(&d, &d);
        memset(d.recv_x, 0xFF, (size_t)(d.cap + 2) * rowb);
        memcpy(d.d_x, d.d_x0, (size_t)d.T * rowb);
        ok = run_calls(&cpu, NULL, moert_cpu(), cs->dtype, &d, d.x, d.probs, d.recv_x, d.recv_probs, d.y_expert, d.y,
                       d.d_y, d.d_y_expert, d.d_recv_x, d.d_recv_probs, d.d_x, d.d_topk_probs, where);
    }
    if (!ok) failure("%s: the CPU reference failed; the CUDA steps still run so no peer waits", where);
    if (!d.y_expert) { /* keep the collective sequence: the CUDA steps need capacity-sized inputs */
        d.y_expert = host_alloc(64);
        d.d_recv_x = host_alloc(64);
        d.d_recv_probs = host_alloc(64);
        outputs_alloc(&d, &d);
    }
    const cudaStream_t s = env->stream;
    void *in[7] = {device_copy(s, d.idx, (size_t)(d.T * d.K) * 4), device_copy(s, d.x, (size_t)d.T * rowb),
                   device_copy(s, d.probs, (size_t)(d.T * d.K) * 4), device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                   device_copy(s, d.d_y, (size_t)d.T * rowb), device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                   device_copy(s, d.d_recv_probs, (size_t)d.cap * 4)};
    step_data g1 = d, g2 = d;
    outputs_alloc(&g1, &d);
    outputs_alloc(&g2, &d);
    if (rank == 0) progress("world %d, case \"%s\": CUDA step 1", W, cs->name);
    bool ok1 = cuda_step(env, &gpu, cs, &d, in, &g1);
    if (rank == 0) progress("world %d, case \"%s\": CUDA step 2", W, cs->name);
    bool ok2 = ok1 && cuda_step(env, &gpu, cs, &d, in, &g2);
    if (rank == 0) progress("world %d, case \"%s\": compare", W, cs->name);
    if (ok && ok1) compare(env, cs, &d, &g1, row);
    if (ok && ok2) {
        compare(env, cs, &d, &g2, row);
        int64_t rep = bytes_differ(g1.recv_x, g2.recv_x, (size_t)d.nrecv * rowb) +
                      bytes_differ(g1.y, g2.y, (size_t)d.T * rowb) + bytes_differ(g1.d_x, g2.d_x, (size_t)d.T * rowb) +
                      bytes_differ(g1.d_y_expert, g2.d_y_expert, (size_t)d.nrecv * rowb);
        pthread_mutex_lock(&lock);
        row->repeat_diffs += rep;
        row->recv_rows += d.nrecv;
        pthread_mutex_unlock(&lock);
        if (rep) failure("%s: the second step differs in %lld bytes", where, (long long)rep);
    }
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < 7; i++) CK(cudaFree(in[i]));
    outputs_free(&g1);
    outputs_free(&g2);
    outputs_free(&d);
    void *hb[] = {d.idx, d.x, d.d_y, d.d_x0, d.probs, d.y_expert, d.d_recv_x, d.d_recv_probs};
    for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++) free(hb[i]);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
    if (rank == 0) progress("world %d, case \"%s\": done", W, cs->name);
}

/* A stalled peer: every rank prepares; only rank 0 dispatches (timeout_ms 300); every rank waits for its stream (the
 * kernels end within the timeout), then rank 0's next call must fail with MOERT_ERR_TIMEOUT naming rank 1; the others
 * prepare again (their notify waits for rank 0 in vain), wait, and their next call names rank 0. Then a bad expert id
 * on rank 1 in a fresh instance: after the stream is done, every rank's next call reports rank 1's bad ids. */
static void run_stall(const rank_env *env, stall_row *row)
{
    const int W = env->world, rank = env->rank;
    const int64_t T = 64, H = 128, K = 2, E = 8;
    moert_layer_info layer = test_layer(H, 8, E, K, T, W, rank, MOERT_BF16);
    layer.device = gpu_of(env);
    const cudaStream_t s = env->stream;
    int32_t idx_h[64 * 2];
    for (int64_t i = 0; i < T * K; i++) idx_h[i] = (int32_t)((i * 3 + rank) % E);
    void *idx = device_copy(s, idx_h, sizeof idx_h), *x = device_poisoned(s, (size_t)(T * H) * 2);
    void *recv = device_poisoned(s, (size_t)(T * K * W) * H * 2);
    moert_tensor it = moert_tensor_2d(idx, gpu_of(env), MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    for (int round = 0; round < 2; round++) {
        test_instance ti;
        if (test_instance_open_cuda(&ti, MOERT_KIND_DISPATCHER, DISPATCHER, "{\"timeout_ms\": 300}", &layer,
                                    env->comm, rank, W, env->pool, env->nccl, (moert_stream)env->stream) != MOERT_OK) {
            failure("%s stall: open: %s", env->where, moert_error_message());
            test_instance_close(&ti);
            break;
        }
        const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti.plugin.header;
        moert_tensor xt = moert_tensor_2d(x, gpu_of(env), MOERT_BF16, T, H);
        moert_tensor rt = moert_tensor_2d(recv, gpu_of(env), MOERT_BF16, T * K * W, H);
        moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .recv_x = &rt};
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        moert_result rc = MOERT_OK;
        const char *msg = "";
        bool ok = false;
        if (round == 0) {
            if (rank == 0) progress("world %d, stall: rank 0 dispatches alone", W);
            if (CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout), env->where)) {
                if (rank == 0) CALL(&ti, vt->dispatch(ti.ctx, (moert_stream)s, &da), env->where); /* fails later */
                else CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout), env->where);  /* notify: in vain */
                CK(cudaStreamSynchronize(s)); /* bounded: the kernels give up after timeout_ms */
                rc = vt->prepare(ti.ctx, (moert_stream)s, &it, &layout);
                msg = moert_host_take_error(ti.host);
                ok = rank == 0 ? rc == MOERT_ERR_TIMEOUT && strstr(msg, "rank 1 did not deliver its rows within 300 ms")
                               : rc == MOERT_ERR_TIMEOUT && strstr(msg, "rank 0 did not send its counts within 300 ms");
            }
        } else {
            if (rank == 0) progress("world %d, bad expert id on rank 1", W);
            int32_t bad_h[64 * 2];
            memcpy(bad_h, idx_h, sizeof bad_h);
            if (rank == 1) bad_h[5] = 99;
            void *bad = device_copy(s, bad_h, sizeof bad_h);
            moert_tensor bt = moert_tensor_2d(bad, gpu_of(env), MOERT_I32, T, K);
            if (CALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &bt, &layout), env->where)) {
                CK(cudaStreamSynchronize(s));
                rc = vt->dispatch(ti.ctx, (moert_stream)s, &da);
                msg = moert_host_take_error(ti.host);
                ok = rc == MOERT_ERR_INVALID_ARGUMENT && strstr(msg, "rank 1's topk_idx had expert ids outside [0, 8)");
            }
            CK(cudaStreamSynchronize(s));
            CK(cudaFree(bad));
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        if (!ok) failure("%s %s: gave %s \"%s\"", env->where, round ? "bad ids" : "stall", moert_result_name(rc), msg);
        if (rank == 0 && round == 0) {
            row->ran = true;
            row->ok = ok;
            row->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
            snprintf(row->message, sizeof row->message, "%s", msg);
        }
        if (rank == 0 && round == 1) row->ok = row->ok && ok;
        CK(cudaStreamSynchronize(s));
        test_instance_close(&ti);
    }
    CK(cudaFree(idx));
    CK(cudaFree(x));
    CK(cudaFree(recv));
}

/* ---- CUDA graphs ---- */

static const dispatch_case graph_cases[] = {
    {"graph: low-latency bf16 H512 K8 E32", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\"}"},
    {"graph: ll per-block flag, 1024 threads", MOERT_BF16, 512, 32, 8, 100, 0.05, 0.1, false, false, true,
     "{\"low_latency\": \"on\", \"ll_flag\": \"per_block\", \"ll_fence\": \"block\", \"ll_threads\": 1024}"},
    {"graph: normal mode (tma) bf16 H512 K6", MOERT_BF16, 512, 32, 6, 200, 0.05, 0.1, false, false, false,
     "{\"low_latency\": \"off\", \"num_sms\": 4}"},
    {"graph: normal mode fp32 H33 (vector)", MOERT_F32, 33, 8, 4, 80, 0.15, 0.6, true, false, true,
     "{\"low_latency\": \"off\", \"num_sms\": 3}"},
};
#define GRAPH_CASES ((int)(sizeof graph_cases / sizeof graph_cases[0]))
#define REPLAYS 3

typedef struct graph_row {
    int world;
    const char *name;
    bool ran, capturable, captured;
    int64_t replays, recv_rows, vs_eager_diffs; /* bytes where a replay differs from the eager calls */
} graph_row;
static graph_row graph_table[WORLDS * GRAPH_CASES];

/* One graph case on one rank: captures prepare + the four calls once (d_x reset and recv_x poisoned first, inside the
 * graph), then REPLAYS times: a new routing into the same topk_idx buffer, replay, an eager step of the same instance
 * with the same routing, and the CPU reference; replay against eager bit for bit, both against the CPU (compare). */
static void run_graph_case(const rank_env *env, const dispatch_case *cs, case_row *row, graph_row *grow)
{
    const int W = env->world, rank = env->rank;
    const moert_device gpu_dev = gpu_of(env);
    const cudaStream_t s = env->stream;
    step_data d;
    memset(&d, 0, sizeof d);
    d.T = cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    const int64_t T = d.T, H = d.H, K = d.K, El = cs->experts / W;
    const size_t rowb = (size_t)H * d.es;
    moert_layer_info layer = test_layer(H, 8, cs->experts, K, cs->tokens + 5 * MAX_WORLD, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_dev;
    char where[128], options[200];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);
    snprintf(options, sizeof options, "{\"timeout_ms\": " CASE_TIMEOUT ", %s", cs->options + 1);
    if (rank == 0) progress("world %d, case \"%s\" %s: open", W, cs->name, options);
    test_instance cpu, gpu;
    moert_result rc = test_instance_open(&cpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 = test_instance_open_cuda(&gpu, MOERT_KIND_DISPATCHER, DISPATCHER, options, &gpu_layer,
                                               env->comm, rank, W, env->pool, env->nccl, (moert_stream)s);
    if (rc2 != MOERT_OK) failure("%s: CUDA dispatcher: %s", where, moert_error_message());
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)gpu.plugin.header;
    const bool capturable =
        (moert_host_instance_flags(gpu.host, vt->header.flags) & MOERT_CAP_GRAPH_CAPTURABLE) != 0;
    if (!capturable) failure("%s: the CUDA instance does not declare MOERT_CAP_GRAPH_CAPTURABLE", where);

    /* fixed inputs; the routing changes per replay */
    uint64_t rng = 0xabcdef12345ull + 1000003ull * (uint64_t)(rank + 1);
    d.cap = layer.max_tokens * W * (K < El ? K : El);
    d.idx = host_alloc((size_t)(T * K) * sizeof(int32_t));
    d.x = host_alloc((size_t)T * rowb);
    d.d_y = host_alloc((size_t)T * rowb);
    d.d_x0 = host_alloc((size_t)T * rowb);
    d.probs = host_alloc((size_t)(T * K) * sizeof(float));
    d.y_expert = host_alloc((size_t)d.cap * rowb);
    d.d_recv_x = host_alloc((size_t)d.cap * rowb);
    d.d_recv_probs = host_alloc((size_t)d.cap * sizeof(float));
    fill_random(d.x, cs->dtype, T * H, &rng, 1.0);
    fill_random(d.d_y, cs->dtype, T * H, &rng, 1.0);
    fill_random(d.d_x0, cs->dtype, T * H, &rng, 1.0);
    for (int64_t i = 0; i < T * K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);
    fill_random(d.y_expert, cs->dtype, d.cap * H, &rng, 1.0);
    fill_random(d.d_recv_x, cs->dtype, d.cap * H, &rng, 1.0);
    fill_random(d.d_recv_probs, MOERT_F32, d.cap, &rng, 1.0);
    outputs_alloc(&d, &d);
    make_routing(cs, W, T, &rng, d.idx);
    void *in[7] = {device_copy(s, d.idx, (size_t)(T * K) * 4), device_copy(s, d.x, (size_t)T * rowb),
                   device_copy(s, d.probs, (size_t)(T * K) * 4), device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                   device_copy(s, d.d_y, (size_t)T * rowb), device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                   device_copy(s, d.d_recv_probs, (size_t)d.cap * 4)};
    void *d_x0 = device_copy(s, d.d_x0, (size_t)T * rowb);
    void *recv_x = device_poisoned(s, (size_t)(d.cap + 2) * rowb), *recv_probs = device_poisoned(s, (size_t)d.cap * 4);
    void *y = device_poisoned(s, (size_t)T * rowb), *d_y_expert = device_poisoned(s, (size_t)d.cap * rowb);
    void *d_x = device_poisoned(s, (size_t)T * rowb), *d_topk_probs = device_poisoned(s, (size_t)(T * K) * 4);
    CK(cudaStreamSynchronize(s));

    /* capture: the resets, prepare and the four calls */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (rank == 0) progress("world %d, case \"%s\": capture", W, cs->name);
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    CK(cudaMemsetAsync(recv_x, 0xFF, (size_t)(d.cap + 2) * rowb, s));
    CK(cudaMemcpyAsync(d_x, d_x0, (size_t)T * rowb, cudaMemcpyDeviceToDevice, s));
    moert_tensor it = moert_tensor_2d(in[0], gpu_dev, MOERT_I32, T, K);
    bool ok = CALL(&gpu, vt->prepare(gpu.ctx, (moert_stream)s, &it, &layout), where) &&
              run_calls(&gpu, (moert_stream)s, gpu_dev, cs->dtype, &d, in[1], in[2], recv_x, recv_probs, in[3], y,
                        in[4], d_y_expert, in[5], in[6], d_x, d_topk_probs, where);
    cudaError_t end = cudaStreamEndCapture(s, &graph);
    if (end != cudaSuccess) failure("%s: cudaStreamEndCapture: %s", where, cudaGetErrorString(end));
    if (ok && end == cudaSuccess) {
        cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
        if (inst != cudaSuccess) failure("%s: cudaGraphInstantiate: %s", where, cudaGetErrorString(inst));
        ok = inst == cudaSuccess;
    }
    ok = ok && end == cudaSuccess;
    if (!ok) failure("%s: the capture failed; replays skipped (the ranks still run the eager steps)", where);
    const int64_t *counts_dev = layout.tokens_per_expert.data;
    pthread_mutex_lock(&lock);
    grow->capturable = capturable;
    grow->captured = grow->captured || ok; /* any rank */
    pthread_mutex_unlock(&lock);

    step_data g = d, e = d;
    outputs_alloc(&g, &d);
    outputs_alloc(&e, &d);
    const moert_dispatcher_v1 *cvt = (const moert_dispatcher_v1 *)cpu.plugin.header;
    for (int r = 0; r < REPLAYS; r++) {
        if (r > 0) { /* a new routing in the same buffer */
            make_routing(cs, W, T, &rng, d.idx);
            CK(cudaMemcpyAsync(in[0], d.idx, (size_t)(T * K) * 4, cudaMemcpyHostToDevice, s));
        }
        if (rank == 0) progress("world %d, case \"%s\": replay %d", W, cs->name, r + 1);
        if (ok) {
            CK(cudaGraphLaunch(exec, s));
            int64_t dev_counts[256] = {0};
            download(s, dev_counts, counts_dev, (size_t)El * sizeof(int64_t));
            for (int64_t l = 0; l < El; l++) g.tokens_per_expert[l] = dev_counts[l];
            download(s, g.recv_x, recv_x, (size_t)(d.cap + 2) * rowb);
            download(s, g.recv_probs, recv_probs, (size_t)d.cap * 4);
            download(s, g.y, y, (size_t)T * rowb);
            download(s, g.d_y_expert, d_y_expert, (size_t)d.cap * rowb);
            download(s, g.d_x, d_x, (size_t)T * rowb);
            download(s, g.d_topk_probs, d_topk_probs, (size_t)(T * K) * 4);
        }
        /* an eager step of the same instance (its calls numbered after the replay's) and the CPU reference */
        bool eok = cuda_step(env, &gpu, cs, &d, in, &e);
        moert_tensor idx = moert_tensor_2d(d.idx, moert_cpu(), MOERT_I32, T, K);
        moert_dispatch_layout cl = {.struct_size = sizeof cl};
        bool cok = CALL(&cpu, cvt->prepare(cpu.ctx, NULL, &idx, &cl), where);
        if (cok) {
            d.nrecv = cl.num_recv;
            for (int64_t l = 0; l < El; l++) d.tokens_per_expert[l] = ((const int64_t *)cl.tokens_per_expert.data)[l];
            memset(d.recv_x, 0xFF, (size_t)(d.cap + 2) * rowb);
            memcpy(d.d_x, d.d_x0, (size_t)T * rowb);
            cok = run_calls(&cpu, NULL, moert_cpu(), cs->dtype, &d, d.x, d.probs, d.recv_x, d.recv_probs, d.y_expert,
                            d.y, d.d_y, d.d_y_expert, d.d_recv_x, d.d_recv_probs, d.d_x, d.d_topk_probs, where);
        }
        if (!cok || !eok) continue;
        compare(env, cs, &d, &e, row);
        if (!ok) continue;
        compare(env, cs, &d, &g, row);
        int64_t diff = bytes_differ(g.recv_x, e.recv_x, (size_t)(d.cap + 2) * rowb) +
                       bytes_differ(g.recv_probs, e.recv_probs, (size_t)d.nrecv * 4) +
                       bytes_differ(g.y, e.y, (size_t)T * rowb) +
                       bytes_differ(g.d_y_expert, e.d_y_expert, (size_t)d.nrecv * rowb) +
                       bytes_differ(g.d_x, e.d_x, (size_t)T * rowb) +
                       bytes_differ(g.d_topk_probs, e.d_topk_probs, (size_t)(T * K) * 4);
        for (int64_t l = 0; l < El; l++) diff += g.tokens_per_expert[l] != e.tokens_per_expert[l];
        pthread_mutex_lock(&lock);
        grow->replays += rank == 0;
        grow->recv_rows += d.nrecv;
        grow->vs_eager_diffs += diff;
        row->recv_rows += d.nrecv;
        pthread_mutex_unlock(&lock);
        if (diff) failure("%s: replay %d differs from the eager calls in %lld bytes", where, r + 1, (long long)diff);
    }
    CK(cudaStreamSynchronize(s));
    if (exec) CK(cudaGraphExecDestroy(exec));
    if (graph) CK(cudaGraphDestroy(graph));
    void *bufs[] = {d_x0, recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    for (int i = 0; i < 7; i++) CK(cudaFree(in[i]));
    outputs_free(&g);
    outputs_free(&e);
    outputs_free(&d);
    void *hb[] = {d.idx, d.x, d.d_y, d.d_x0, d.probs, d.y_expert, d.d_recv_x, d.d_recv_probs};
    for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++) free(hb[i]);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
    if (rank == 0) progress("world %d, case \"%s\": done", W, cs->name);
}

static void rank_main(int rank, void *user)
{
    world_run *w = user;
    rank_env env = {.rank = rank, .world = w->world, .comm = w->comm};
    snprintf(env.where, sizeof env.where, "world %d rank %d", w->world, rank);
    moert_stream stream = NULL;
    moert_error_clear();
    if (moert_cuda_set_device(rank) != MOERT_OK || moert_cuda_pool_create(rank, &env.pool) != MOERT_OK ||
        moert_cuda_stream_create(rank, &stream) != MOERT_OK ||
        moert_nccl_comm_init_thread(w->nccl_group, rank, rank, &env.nccl) != MOERT_OK) {
        failure("%s: setting up the rank: %s", env.where, moert_error_message());
        moert_comm_abort(w->comm, rank, "setup failed");
    } else {
        env.stream = (cudaStream_t)stream;
        for (int ci = 0; ci < CASES; ci++) run_case(&env, ci, &table[w->index * CASES + ci]);
        for (int gi = 0; gi < GRAPH_CASES; gi++)
            run_graph_case(&env, &graph_cases[gi], &graph_case_rows[w->index * GRAPH_CASES + gi],
                           &graph_table[w->index * GRAPH_CASES + gi]);
        if (w->world > 1) run_stall(&env, &stall_table[w->index]);
    }
    if (stream) moert_cuda_stream_synchronize(stream);
    if (env.nccl) moert_nccl_comm_free(env.nccl);
    if (env.pool) moert_cuda_pool_destroy(env.pool);
    if (stream) moert_cuda_stream_destroy(stream);
}

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show where a hang or crash was */
    int gpus = 0;
    cudaError_t err = cudaGetDeviceCount(&gpus);
    if (err != cudaSuccess || gpus == 0) {
        printf("gpu_hybridep: no GPU (%s), skipped\n", err != cudaSuccess ? cudaGetErrorString(err) : "0 devices");
        return TEST_SKIP;
    }
    moert_plugin keep;
    memset(&keep, 0, sizeof keep);
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, DISPATCHER, &keep));
    if (test_failures) return test_finish("gpu_hybridep");
    const int worlds[WORLDS] = {1, 2, 4, 8};
    for (int i = 0; i < WORLDS; i++) {
        if (worlds[i] > gpus) continue;
        world_run w = {.world = worlds[i], .index = i};
        for (int ci = 0; ci < CASES; ci++) {
            case_row *r = &table[i * CASES + ci];
            r->world = worlds[i];
            r->name = cases[ci].name;
            r->tol = cases[ci].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
            r->ran = true;
        }
        for (int gi = 0; gi < GRAPH_CASES; gi++) {
            case_row *r = &graph_case_rows[i * GRAPH_CASES + gi];
            r->world = worlds[i];
            r->name = graph_cases[gi].name;
            r->tol = graph_cases[gi].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
            r->ran = true;
            graph_table[i * GRAPH_CASES + gi].world = worlds[i];
            graph_table[i * GRAPH_CASES + gi].name = graph_cases[gi].name;
            graph_table[i * GRAPH_CASES + gi].ran = true;
        }
        stall_table[i].world = worlds[i];
        moert_result rc = moert_comm_group_create(w.world, TIMEOUT_S, &w.comm);
        if (rc == MOERT_OK) rc = moert_nccl_group_create(w.world, TIMEOUT_S, &w.nccl_group);
        if (rc != MOERT_OK) failure("world %d: creating the communicators: %s", w.world, moert_error_message());
        else test_run_ranks(w.world, rank_main, &w);
        if (w.nccl_group) moert_nccl_group_free(w.nccl_group);
        if (w.comm) moert_comm_group_free(w.comm);
    }
    printf("\nhybridep dispatcher, CUDA vs CPU (diffs: bytes that differ; err: relative Frobenius error)\n");
    printf("%-5s  %-34s  %7s  %6s  %8s  %9s  %7s  %8s  %9s  %7s  %7s  %6s  %s\n", "world", "case", "recv", "layout",
           "dispatch", "combine", "(bytes)", "comb_bwd", "d_x", "(bytes)", "d_probs", "repeat", "ok");
    for (int i = 0; i < WORLDS * CASES; i++) {
        const case_row *r = &table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->cb_diffs && !r->dprobs_diffs && !r->repeat_diffs &&
                  r->combine_err <= r->tol && r->dx_err <= r->tol;
        printf("%-5d  %-34s  %7lld  %6lld  %8lld  %9.2e  %7lld  %8lld  %9.2e  %7lld  %7lld  %6lld  %s\n", r->world,
               r->name, (long long)r->recv_rows, (long long)r->layout_diffs, (long long)r->dispatch_diffs,
               r->combine_err, (long long)r->combine_bytes, (long long)r->cb_diffs, r->dx_err, (long long)r->dx_bytes,
               (long long)r->dprobs_diffs, (long long)r->repeat_diffs, ok ? "ok" : "FAIL");
    }
    for (int i = 0; i < WORLDS * GRAPH_CASES; i++) {
        const case_row *r = &graph_case_rows[i];
        const graph_row *gr = &graph_table[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->cb_diffs && !r->dprobs_diffs &&
                  r->combine_err <= r->tol && r->dx_err <= r->tol && gr->capturable && gr->captured &&
                  gr->replays == REPLAYS && !gr->vs_eager_diffs;
        printf("%-5d  %-34s  %7lld  %6lld  %8lld  %9.2e  %7lld  %8lld  %9.2e  %7lld  %7lld  %6s  %s  (capturable %s, "
               "%lld replays, %lld bytes differ from eager)\n", r->world, r->name, (long long)r->recv_rows,
               (long long)r->layout_diffs, (long long)r->dispatch_diffs, r->combine_err, (long long)r->combine_bytes,
               (long long)r->cb_diffs, r->dx_err, (long long)r->dx_bytes, (long long)r->dprobs_diffs, "-",
               ok ? "ok" : "FAIL", gr->capturable ? "yes" : "no", (long long)gr->replays,
               (long long)gr->vs_eager_diffs);
    }
    for (int i = 0; i < WORLDS; i++)
        if (stall_table[i].ran)
            printf("stall and bad ids, world %d: %s after %.2f s: %s\n", stall_table[i].world, stall_table[i].ok ? "ok" : "FAIL",
                   stall_table[i].seconds, stall_table[i].message);
    moert_plugin_unload(&keep);
    return test_finish("gpu_hybridep");
}

#endif
