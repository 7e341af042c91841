/* SPDX-License-Identifier: Apache-2.0 */
/* Dispatcher benchmark: the "deepep" dispatcher's CUDA path (NVLink writes into peer buffers) at several SM counts,
 * against the "alltoall" dispatcher (permute, NCCL all-to-all, regroup) on the same routing, through the plugins as
 * the executor calls them. EP = every visible GPU, a thread per GPU. Default shape: the deepseek-v3 layer (T 4096
 * tokens per rank, H 7168, top-8 of 256 experts), uniform random routing, random bf16 rows.
 *
 * Timed per call with CUDA events on each rank's stream after a barrier of the rank threads; a call's time is the
 * largest over ranks, the figure the median over repeats (after 3 warm-up calls). Bytes: what one rank writes to
 * the other ranks (the largest over ranks): deepep a row per (token, other rank holding one of its experts) plus its
 * metadata; alltoall a row per (copy, other rank). GB/s against the NVLink ceiling per GPU and direction (450 GB/s
 * line rate of NVLink4; ~370 effective). Before timing, deepep's recv_x (bf16) is checked bit for bit against
 * alltoall's (the same row order) and its combine against alltoall's.
 * Each deepep figure comes twice: the whole call (NVLink phase plus the local expansion / reductions on every SM:
 * what a layer pays), and "nvlink", the same instance with bench_nvlink_only: the NVLink phase alone at that SM count
 * (each token's row into the peers, the receivers' wait for every arrival and the release), the figure comparable to
 * DeepEP's intranode dispatch/combine (whose output is one row per token and rank, no expansion by expert).
 *
 *   dispatch_bench [out.json]    environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT, MOERT_BENCH_REPEATS (20),
 *                                MOERT_BENCH_TOKENS (4096), MOERT_BENCH_SMS (default "8,12,16,24,0"; 0: every SM,
 *                                the plugin's default), MOERT_BENCH_PHASES ("call,nvlink": the whole calls and/or the
 *                                NVLink phases). Progress goes to stdout line by line; deepep runs with
 *                                timeout_ms 10000, so a stalled peer fails a call instead of hanging the bench.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "moert/dispatcher.h"

#define MAX_GPUS       8
#define MAX_VARIANTS   48
#define MAX_REPEATS    200
#define WARMUP         3
#define NVLINK_GBS     450.0
#define DEEPEP_TIMEOUT "\"timeout_ms\": 10000" /* a stalled peer fails a call within 10 s, never hangs the bench */

static pthread_mutex_t die_lock = PTHREAD_MUTEX_INITIALIZER;

/* Ends the process after a failure on any rank thread: once (exit() from several threads at a time is undefined),
 * without running atexit handlers while the other threads still use CUDA. */
static void die(void)
{
    pthread_mutex_lock(&die_lock);
    fflush(stdout);
    fflush(stderr);
    _exit(1);
}

#define CK(call)                                                                                                       \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            die();                                                                                                     \
        }                                                                                                              \
    } while (0)

/* A plugin call that must succeed: the benchmark stops otherwise. */
#define PCALL(ti, call)                                                                                                \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed (%s): %s\n", __FILE__, __LINE__, #call, moert_result_name(r_),           \
                    moert_host_take_error((ti)->host));                                                                \
            die();                                                                                                     \
        }                                                                                                              \
    } while (0)

typedef enum op_kind { OP_DISPATCH, OP_COMBINE } op_kind;

typedef struct variant {
    char name[64];
    const char *plugin;
    char options[96];
    int num_sms; /* 0 for alltoall */
    bool fp8;
    bool nvlink_only; /* deepep with bench_nvlink_only: the NVLink phase alone (rows cross, arrive, released) */
    op_kind op;
    double ms[MAX_REPEATS]; /* per repeat: the largest over ranks */
    double bytes;           /* the largest over ranks */
    double median_us;
} variant;

static struct {
    int gpus, repeats;
    int64_t T, H, E, K;
    variant v[MAX_VARIANTS];
    int nv;
    moert_comm_group *comm;
    moert_nccl_group *nccl;
    pthread_mutex_t lock;
    int64_t check_diffs;      /* bytes of deepep's recv_x that differ from alltoall's */
    double check_combine_err; /* relative error of deepep's combine against alltoall's */
} B = {.lock = PTHREAD_MUTEX_INITIALIZER};

typedef struct rank_state {
    int rank;
    moert_cuda_pool *pool;
    moert_nccl_comm *nccl;
    cudaStream_t stream;
    void *idx, *x, *probs, *recv_x, *recv_probs, *y_expert, *y, *ref_recv, *ref_y;
    int64_t T, cap;
    double tokens_out, copies_out; /* tokens (copies) of this rank with an expert on another rank */
} rank_state;

static double median(double *v, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Distinct uniform experts per token; the rank's counts of tokens and copies that leave it. */
static void make_routing(rank_state *st, int32_t *idx, uint64_t *rng)
{
    const int64_t E = B.E, K = B.K, El = E / B.gpus;
    st->tokens_out = st->copies_out = 0;
    for (int64_t t = 0; t < st->T; t++) {
        unsigned ranks = 0;
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            bool used;
            do {
                e = (int32_t)((test_uniform(rng) + 1) / 2 * (double)E) % (int32_t)E;
                used = false;
                for (int64_t j = 0; j < k; j++) used = used || idx[t * K + j] == e;
            } while (used);
            idx[t * K + k] = e;
            if (e / El != st->rank) {
                st->copies_out++;
                ranks |= 1u << (e / El);
            }
        }
        st->tokens_out += __builtin_popcount(ranks);
    }
}

static void barrier(int rank)
{
    if (B.gpus > 1 && moert_comm_barrier(B.comm, rank, "bench") != MOERT_OK) {
        fprintf(stderr, "barrier: %s\n", moert_error_message());
        die();
    }
}

/* Runs one variant's call `B.repeats` times after warm-up, recording each call's time (largest over ranks). */
static void time_calls(rank_state *st, test_instance *ti, variant *v)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const moert_device gpu = {MOERT_DEVICE_CUDA, st->rank};
    const moert_stream s = (moert_stream)st->stream;
    moert_tensor x = moert_tensor_2d(st->x, gpu, MOERT_BF16, st->T, B.H);
    moert_tensor p = moert_tensor_2d(st->probs, gpu, MOERT_F32, st->T, B.K);
    moert_tensor rx = moert_tensor_2d(st->recv_x, gpu, MOERT_BF16, st->cap, B.H);
    moert_tensor rp = moert_tensor_1d(st->recv_probs, gpu, MOERT_F32, st->cap);
    moert_tensor ye = moert_tensor_2d(st->y_expert, gpu, MOERT_BF16, st->cap, B.H);
    moert_tensor y = moert_tensor_2d(st->y, gpu, MOERT_BF16, st->T, B.H);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &x, .topk_probs = &p, .recv_x = &rx, .recv_probs = &rp};
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &y};
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    if (v->op == OP_COMBINE) PCALL(ti, vt->dispatch(ti->ctx, s, &da)); /* combine needs this step's dispatch */
    for (int i = 0; i < WARMUP + B.repeats; i++) {
        CK(cudaStreamSynchronize(st->stream));
        barrier(st->rank);
        CK(cudaEventRecord(e0, st->stream));
        if (v->op == OP_DISPATCH)
            PCALL(ti, vt->dispatch(ti->ctx, s, &da));
        else
            PCALL(ti, vt->combine(ti->ctx, s, &ca));
        CK(cudaEventRecord(e1, st->stream));
        CK(cudaEventSynchronize(e1));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        if (i >= WARMUP) {
            pthread_mutex_lock(&B.lock);
            if (ms > v->ms[i - WARMUP]) v->ms[i - WARMUP] = ms;
            pthread_mutex_unlock(&B.lock);
        }
    }
    double row = (double)B.H * 2;
    double bytes = 0;
    if (!strcmp(v->plugin, "deepep")) {
        double meta = (double)(((4 * B.K + 7) / 8 * 8 + 8 * B.K + 15) / 16 * 16);
        double wire = v->fp8 ? (double)B.H + (double)(B.H / 128) * 4 : row;
        bytes = st->tokens_out * ((v->op == OP_DISPATCH ? wire : row) + meta);
    } else {
        bytes = st->copies_out * row;
    }
    pthread_mutex_lock(&B.lock);
    if (bytes > v->bytes) v->bytes = bytes;
    pthread_mutex_unlock(&B.lock);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
}

static void open_instance(rank_state *st, test_instance *ti, const char *plugin, const char *options)
{
    moert_layer_info layer = test_layer(B.H, 2048, B.E, B.K, st->T, B.gpus, st->rank, MOERT_BF16);
    layer.device = (moert_device){MOERT_DEVICE_CUDA, st->rank};
    if (test_instance_open_cuda(ti, MOERT_KIND_DISPATCHER, plugin, options, &layer, B.gpus > 1 ? B.comm : NULL,
                                st->rank, B.gpus, st->pool, st->nccl, (moert_stream)st->stream) != MOERT_OK) {
        fprintf(stderr, "rank %d: opening %s %s: %s\n", st->rank, plugin, options, moert_error_message());
        die();
    }
}

static void prepare(rank_state *st, test_instance *ti)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    moert_tensor it = moert_tensor_2d(st->idx, (moert_device){MOERT_DEVICE_CUDA, st->rank}, MOERT_I32, st->T, B.K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    PCALL(ti, vt->prepare(ti->ctx, (moert_stream)st->stream, &it, &layout));
    st->cap = layout.capacity;
}

/* deepep's bf16 dispatch and combine against alltoall's on the same inputs (the same row order). */
static void check_against_alltoall(rank_state *st)
{
    const moert_device gpu = {MOERT_DEVICE_CUDA, st->rank};
    const moert_stream s = (moert_stream)st->stream;
    test_instance a, d;
    open_instance(st, &a, "alltoall", "{}");
    prepare(st, &a);
    const int64_t cap = st->cap;
    const size_t rows = (size_t)cap * (size_t)B.H * 2, toks = (size_t)st->T * (size_t)B.H * 2;
    CK(cudaMalloc(&st->ref_recv, rows + 64));
    CK(cudaMalloc(&st->ref_y, toks + 64));
    moert_tensor x = moert_tensor_2d(st->x, gpu, MOERT_BF16, st->T, B.H);
    moert_tensor p = moert_tensor_2d(st->probs, gpu, MOERT_F32, st->T, B.K);
    moert_tensor rp = moert_tensor_1d(st->recv_probs, gpu, MOERT_F32, cap);
    moert_tensor ye = moert_tensor_2d(st->y_expert, gpu, MOERT_BF16, cap, B.H);
    moert_tensor ref_rx = moert_tensor_2d(st->ref_recv, gpu, MOERT_BF16, cap, B.H);
    moert_tensor ref_y = moert_tensor_2d(st->ref_y, gpu, MOERT_BF16, st->T, B.H);
    moert_dispatch_args da = {
        .struct_size = sizeof da, .x = &x, .topk_probs = &p, .recv_x = &ref_rx, .recv_probs = &rp};
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &ref_y};
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)a.plugin.header;
    PCALL(&a, vt->dispatch(a.ctx, s, &da));
    PCALL(&a, vt->combine(a.ctx, s, &ca));
    CK(cudaStreamSynchronize(st->stream));
    test_instance_close(&a);

    open_instance(st, &d, "deepep", "{\"num_sms\": 24, " DEEPEP_TIMEOUT "}");
    prepare(st, &d);
    vt = (const moert_dispatcher_v1 *)d.plugin.header; /* deepep's own calls on deepep's ctx */
    moert_tensor rx = moert_tensor_2d(st->recv_x, gpu, MOERT_BF16, cap, B.H);
    moert_tensor y = moert_tensor_2d(st->y, gpu, MOERT_BF16, st->T, B.H);
    da.recv_x = &rx;
    ca.y = &y;
    PCALL(&d, vt->dispatch(d.ctx, s, &da));
    PCALL(&d, vt->combine(d.ctx, s, &ca));
    CK(cudaStreamSynchronize(st->stream));
    test_instance_close(&d);

    unsigned char *h1 = malloc(rows + 1), *h2 = malloc(rows + 1);
    CK(cudaMemcpy(h1, st->ref_recv, rows, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2, st->recv_x, rows, cudaMemcpyDeviceToHost));
    int64_t diffs = 0;
    for (size_t i = 0; i < rows; i++) diffs += h1[i] != h2[i];
    CK(cudaMemcpy(h1, st->ref_y, toks, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(h2, st->y, toks, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < toks / 2; i++) {
        double u = moert_bf16_to_float(((uint16_t *)h2)[i]), w = moert_bf16_to_float(((uint16_t *)h1)[i]);
        num += (u - w) * (u - w);
        den += w * w;
    }
    free(h1);
    free(h2);
    pthread_mutex_lock(&B.lock);
    B.check_diffs += diffs;
    double err = den > 0 ? sqrt(num / den) : sqrt(num);
    if (err > B.check_combine_err) B.check_combine_err = err;
    pthread_mutex_unlock(&B.lock);
    CK(cudaFree(st->ref_recv));
    CK(cudaFree(st->ref_y));
}

static void rank_main(int rank, void *user)
{
    (void)user;
    rank_state st = {.rank = rank, .T = B.T};
    moert_stream stream = NULL;
    if (moert_cuda_set_device(rank) != MOERT_OK || moert_cuda_pool_create(rank, &st.pool) != MOERT_OK ||
        moert_cuda_stream_create(rank, &stream) != MOERT_OK ||
        (B.gpus > 1 && moert_nccl_comm_init_thread(B.nccl, rank, rank, &st.nccl) != MOERT_OK)) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, moert_error_message());
        die();
    }
    st.stream = (cudaStream_t)stream;
    uint64_t rng = 12345 + 7919 * (uint64_t)rank;
    const size_t xb = (size_t)(B.T * B.H) * 2, max_rows = (size_t)(B.T * B.K * B.gpus);
    int32_t *idx = malloc((size_t)(B.T * B.K) * sizeof(int32_t));
    make_routing(&st, idx, &rng);
    uint16_t *xh = malloc(xb);
    for (int64_t i = 0; i < B.T * B.H; i++) xh[i] = moert_bf16_from_float((float)test_uniform(&rng));
    float *ph = malloc((size_t)(B.T * B.K) * sizeof(float));
    for (int64_t i = 0; i < B.T * B.K; i++) ph[i] = (float)((test_uniform(&rng) + 1) / 2);
    CK(cudaMalloc(&st.idx, (size_t)(B.T * B.K) * 4));
    CK(cudaMalloc(&st.x, xb));
    CK(cudaMalloc(&st.probs, (size_t)(B.T * B.K) * 4));
    CK(cudaMalloc(&st.y, xb));
    CK(cudaMalloc(&st.recv_x, max_rows * (size_t)B.H * 2));
    CK(cudaMalloc(&st.recv_probs, max_rows * 4));
    CK(cudaMalloc(&st.y_expert, max_rows * (size_t)B.H * 2));
    CK(cudaMemcpy(st.idx, idx, (size_t)(B.T * B.K) * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(st.x, xh, xb, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(st.probs, ph, (size_t)(B.T * B.K) * 4, cudaMemcpyHostToDevice));
    /* y_expert: random bf16 rows (only the first num_recv rows are read) */
    uint16_t *yh = malloc(xb);
    for (int64_t i = 0; i < B.T * B.H; i++) yh[i] = moert_bf16_from_float((float)test_uniform(&rng));
    for (size_t r = 0; r < max_rows; r += (size_t)B.T)
        CK(cudaMemcpy((char *)st.y_expert + r * (size_t)B.H * 2, yh,
                      ((size_t)B.T < max_rows - r ? (size_t)B.T : max_rows - r) * (size_t)B.H * 2,
                      cudaMemcpyHostToDevice));
    free(idx);
    free(xh);
    free(ph);
    free(yh);

    if (rank == 0) printf("check: deepep bf16 dispatch + combine against alltoall...\n");
    check_against_alltoall(&st);
    if (rank == 0) printf("check done\n");
    for (int i = 0; i < B.nv; i++) {
        variant *v = &B.v[i];
        if (v->op == OP_COMBINE && i > 0 && !strcmp(B.v[i - 1].options, v->options)) continue; /* done with dispatch */
        if (rank == 0)
            printf("timing %s%s\n", v->name, i + 1 < B.nv && B.v[i + 1].op == OP_COMBINE ? " (and its combine)" : "");
        test_instance ti;
        open_instance(&st, &ti, v->plugin, v->options);
        prepare(&st, &ti);
        time_calls(&st, &ti, v);
        if (i + 1 < B.nv && B.v[i + 1].op == OP_COMBINE && !strcmp(B.v[i + 1].options, v->options) &&
            !strcmp(B.v[i + 1].plugin, v->plugin))
            time_calls(&st, &ti, &B.v[i + 1]);
        CK(cudaStreamSynchronize(st.stream));
        test_instance_close(&ti);
    }
    void *bufs[] = {st.idx, st.x, st.probs, st.y, st.recv_x, st.recv_probs, st.y_expert};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    if (st.nccl) moert_nccl_comm_free(st.nccl);
    moert_cuda_pool_destroy(st.pool);
    moert_cuda_stream_destroy(stream);
}

static variant *add_variant(const char *plugin, int sms, bool fp8, bool nvlink_only, op_kind op)
{
    variant *v = &B.v[B.nv++];
    memset(v, 0, sizeof *v);
    v->plugin = plugin;
    v->num_sms = sms;
    v->fp8 = fp8;
    v->nvlink_only = nvlink_only;
    v->op = op;
    if (!strcmp(plugin, "deepep")) {
        char count[16];
        snprintf(count, sizeof count, sms ? "%d" : "all", sms);
        snprintf(v->options, sizeof v->options, "{\"num_sms\": %d, %s%s%s}", sms, DEEPEP_TIMEOUT,
                 fp8 ? ", \"dispatch_dtype\": \"fp8\"" : "", nvlink_only ? ", \"bench_nvlink_only\": true" : "");
        snprintf(v->name, sizeof v->name, "deepep %s %s %s SMs%s", op == OP_DISPATCH ? "dispatch" : "combine",
                 op == OP_COMBINE ? "bf16"
                 : fp8            ? "fp8"
                                  : "bf16",
                 count, nvlink_only ? " nvlink" : "");
    } else {
        snprintf(v->options, sizeof v->options, "{}");
        snprintf(v->name, sizeof v->name, "alltoall %s bf16", op == OP_DISPATCH ? "dispatch" : "combine");
    }
    return v;
}

static const char *env_or(const char *name, const char *def)
{
    const char *v = getenv(name);
    return v && *v ? v : def;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0); /* progress lines show where a hang or crash was */
    int gpus = 0;
    if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
        printf("dispatch_bench: no GPU, nothing to do\n");
        return 77;
    }
    B.gpus = gpus > MAX_GPUS ? MAX_GPUS : gpus;
    B.repeats = atoi(env_or("MOERT_BENCH_REPEATS", "20"));
    if (B.repeats < 1 || B.repeats > MAX_REPEATS) B.repeats = 20;
    B.T = atoll(env_or("MOERT_BENCH_TOKENS", "4096"));
    B.H = 7168;
    B.E = 256;
    B.K = 8;
    const char *phases = env_or("MOERT_BENCH_PHASES", "call,nvlink");
    const bool whole_call = strstr(phases, "call") != NULL, nvlink_phase = strstr(phases, "nvlink") != NULL;
    char sms_list[128];
    snprintf(sms_list, sizeof sms_list, "%s", env_or("MOERT_BENCH_SMS", "8,12,16,24,0"));
    for (char *tok = strtok(sms_list, ","); tok && B.nv + 6 <= MAX_VARIANTS - 2; tok = strtok(NULL, ",")) {
        int sms = atoi(tok); /* 0: every SM of the device (the plugin's default, what a layer uses) */
        if (whole_call) {
            add_variant("deepep", sms, false, false, OP_DISPATCH); /* the whole call: what a layer pays */
            add_variant("deepep", sms, false, false, OP_COMBINE);
            add_variant("deepep", sms, true, false, OP_DISPATCH);
        }
        if (nvlink_phase) {
            add_variant("deepep", sms, false, true,
                        OP_DISPATCH); /* the NVLink phase alone: what DeepEP's figures are */
            add_variant("deepep", sms, false, true, OP_COMBINE);
            add_variant("deepep", sms, true, true, OP_DISPATCH);
        }
    }
    add_variant("alltoall", 0, false, false, OP_DISPATCH);
    add_variant("alltoall", 0, false, false, OP_COMBINE);
    if (B.gpus > 1 && (moert_comm_group_create(B.gpus, 120.0, &B.comm) != MOERT_OK ||
                       moert_nccl_group_create(B.gpus, 120.0, &B.nccl) != MOERT_OK)) {
        fprintf(stderr, "communicators: %s\n", moert_error_message());
        return 1;
    }
    moert_plugin keep_a, keep_b;
    if (moert_plugin_load(MOERT_KIND_DISPATCHER, "deepep", &keep_a) != MOERT_OK ||
        moert_plugin_load(MOERT_KIND_DISPATCHER, "alltoall", &keep_b) != MOERT_OK) {
        fprintf(stderr, "plugins: %s\n", moert_error_message());
        return 1;
    }
    test_run_ranks(B.gpus, rank_main, NULL);

    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf(
        "\ndispatch_bench: EP%d on %s, T %lld per rank, H %lld, top-%lld of %lld experts, uniform routing, median of "
        "%d\n",
        B.gpus, prop.name, (long long)B.T, (long long)B.H, (long long)B.K, (long long)B.E, B.repeats);
    printf("check: deepep bf16 recv_x vs alltoall: %lld bytes differ; combine relative error %.2e\n",
           (long long)B.check_diffs, B.check_combine_err);
    printf("%-32s  %10s  %12s  %9s  %12s\n", "variant", "time us", "MB per rank", "GB/s", "of 450 GB/s");
    for (int i = 0; i < B.nv; i++) {
        variant *v = &B.v[i];
        v->median_us = 1e3 * median(v->ms, B.repeats);
        double gbs = v->bytes / (v->median_us * 1e-6) / 1e9;
        printf("%-32s  %10.1f  %12.1f  %9.1f  %11.1f%%\n", v->name, v->median_us, v->bytes / 1e6, gbs,
               100 * gbs / NVLINK_GBS);
    }
    if (argc > 1) {
        FILE *f = fopen(argv[1], "w");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", argv[1]);
            return 1;
        }
        time_t now = time(NULL);
        char date[32];
        strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
        fprintf(f,
                "{\n  \"command\": \"bench/dispatch_bench %s\",\n  \"machine\": \"%s\",\n  \"gpus\": %d,\n"
                "  \"device\": \"%s\",\n  \"git\": \"%s\",\n  \"date\": \"%s\",\n",
                argv[1], env_or("MOERT_BENCH_MACHINE", "unknown"), B.gpus, prop.name,
                env_or("MOERT_BENCH_GIT", "unknown"), date);
        fprintf(f,
                "  \"shape\": {\"tokens_per_rank\": %lld, \"hidden\": %lld, \"topk\": %lld, \"experts\": %lld, "
                "\"routing\": \"uniform\"},\n",
                (long long)B.T, (long long)B.H, (long long)B.K, (long long)B.E);
        fprintf(f,
                "  \"check\": {\"recv_x_bytes_differ_vs_alltoall\": %lld, \"combine_rel_error_vs_alltoall\": %.3e},\n",
                (long long)B.check_diffs, B.check_combine_err);
        fprintf(f, "  \"nvlink_ceiling_gbs\": %.0f,\n  \"results\": [\n", NVLINK_GBS);
        for (int i = 0; i < B.nv; i++) {
            variant *v = &B.v[i];
            double gbs = v->bytes / (v->median_us * 1e-6) / 1e9;
            const char *cfg = v->options;
            fprintf(f, "    {\"name\": \"%s\", \"value\": %.2f, \"unit\": \"us\", \"config\": %s},\n", v->name,
                    v->median_us, cfg);
            fprintf(f, "    {\"name\": \"%s bytes\", \"value\": %.0f, \"unit\": \"bytes\", \"config\": %s},\n", v->name,
                    v->bytes, cfg);
            fprintf(f, "    {\"name\": \"%s bandwidth\", \"value\": %.1f, \"unit\": \"GB/s\", \"config\": %s}%s\n",
                    v->name, gbs, cfg, i + 1 < B.nv ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    moert_plugin_unload(&keep_a);
    moert_plugin_unload(&keep_b);
    if (B.nccl) moert_nccl_group_free(B.nccl);
    if (B.comm) moert_comm_group_free(B.comm);
    return B.check_diffs ? 1 : 0;
}
