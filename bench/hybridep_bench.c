/* SPDX-License-Identifier: Apache-2.0 */
/* The "hybridep" dispatcher's CUDA path on every visible GPU (a thread per GPU, EP = the GPU count), through the plugin
 * as the executor calls it: dispatch and combine of the deepseek-v3 shape (T 4096 tokens per rank, H 7168, top-8 of 256
 * experts, uniform routing, bf16) at 8, 12 and 16 SMs (TMA, then vector copies), "deepep" at 24 SMs in the
 * same run (the reference: its whole call, and its NVLink phase alone with bench_nvlink_only), the floor of a
 * timed call (a 16-byte memset timed alike: launch, events, the ranks' skew), the low-latency mode at T 1, 32, 128 and
 * 256 on every SM, its block count (num_sms) swept at T 1 (8, 32, 128) and T 128 (8, 16, 32, 64, 128), and the normal
 * mode at T 128 beside it; then the low-latency tuning variants (ll_threads, ll_piece, ll_flag, ll_fence: plugin
 * options, so one binary times them all) at T 1, 32, 128, 256 beside the default, and a table of them last.
 *
 * The acceptance reading is whole call against whole call: each hybridep line (and the summary at the end) gives its
 * bandwidth as a percentage of deepep's whole call at 24 SMs measured in this run (the same routing, so the same
 * bytes); deepep's NVLink phase alone is printed beside it for reference, never used for the percentage.
 *
 * Timed per call with CUDA events on each rank's stream after a barrier of the rank threads; a call's time is the
 * largest over ranks, the figure the median over repeats (after 3 warm-up calls). The back-to-back lines time the
 * low-latency calls as a decode loop runs them: dispatch, combine, dispatch, ... queued after one barrier, a call's
 * time from the end of the one before (time_back_to_back), so the host barrier's wake-up skew is not in them. Bytes: the token rows one rank
 * writes to the other ranks (a row per token and other rank holding one of its experts; the largest over ranks);
 * GB/s against 450 GB/s, NVLink4 per GPU and direction.
 *
 *   hybridep_bench [out.json]   environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT, MOERT_BENCH_REPEATS (20),
 *                               MOERT_BENCH_ONLY=ll (only the low-latency lines: the floor, the sweep, the variants)
 *                               or =normal (only deepep's two reference lines and hybridep's normal-mode lines),
 *                               MOERT_BENCH_SMS (hybridep's normal-mode SM counts, "8,12,16"; at most 6),
 *                               MOERT_BENCH_TOKENS (tokens per rank of the normal-mode and reference lines, 4096).
 *                               Progress goes to stdout line by line; every instance runs with timeout_ms 10000.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "test_util.h"

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "moert/dispatcher.h"

#define MAX_GPUS    8
#define MAX_REPEATS 200
#define WARMUP      3
#define NVLINK_GBS  450.0

static pthread_mutex_t die_lock = PTHREAD_MUTEX_INITIALIZER;

/* Ends the process after a failure on any rank thread, once, without atexit handlers. */
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

#define PCALL(ti, call)                                                                                                \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) {                                                                                          \
            fprintf(stderr, "%s:%d: %s failed (%s): %s\n", __FILE__, __LINE__, #call, moert_result_name(r_),           \
                    moert_host_take_error((ti)->host));                                                                \
            die();                                                                                                     \
        }                                                                                                              \
    } while (0)

typedef struct variant {
    char name[80];
    const char *plugin;
    char options[200];
    int64_t T;
    bool normal;       /* a hybridep normal-mode line at the normal-mode T (compared) */
    int ll_group;      /* a low-latency tuning variant: its row + 1, else 0 */
    bool back_to_back; /* timed in a stream of dispatch, combine, dispatch, ... after one barrier (steady state) */
    double dispatch_ms[MAX_REPEATS], combine_ms[MAX_REPEATS]; /* per repeat: the largest over ranks */
    double bytes;                                             /* the largest over ranks */
    double dispatch_us, combine_us;                           /* medians */
} variant;

#define MAX_VARIANTS 96
#define MAX_SMS_LIST 6
#define LL_GROUPS    9
static const char *const ll_groups[LL_GROUPS][2] = {
    /* name, options added to the low-latency ones */
    {"default (512 thr, 1 KB, last_block, block)", ""},
    {"ll_threads 1024", ", \"ll_threads\": 1024"},
    {"ll_fence thread", ", \"ll_fence\": \"thread\""},
    {"ll_flag per_block + fence block", ", \"ll_flag\": \"per_block\", \"ll_fence\": \"block\""},
    {"ll_piece 2048", ", \"ll_piece\": 2048"},
    {"ll_piece 512", ", \"ll_piece\": 512"},
    {"1024 thr + per_block + block", ", \"ll_threads\": 1024, \"ll_flag\": \"per_block\", \"ll_fence\": \"block\""},
    {"1024 thr + per_block + block + 2 KB",
     ", \"ll_threads\": 1024, \"ll_flag\": \"per_block\", \"ll_fence\": \"block\", \"ll_piece\": 2048"},
    {"1024 thr + per_block + block + 512 B",
     ", \"ll_threads\": 1024, \"ll_flag\": \"per_block\", \"ll_fence\": \"block\", \"ll_piece\": 512"},
};
static struct {
    int gpus, repeats, nv, cur, ref, ref_nvlink; /* ref, ref_nvlink: deepep's whole-call and NVLink-only variants */
    int64_t H, E, K;
    variant v[MAX_VARIANTS];
    moert_comm_group *comm;
    moert_nccl_group *nccl;
    pthread_barrier_t barrier;
    pthread_mutex_t lock;
    double rank_ms[MAX_GPUS];
} B = {.lock = PTHREAD_MUTEX_INITIALIZER};

static double gbs(double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; }

/* A variant's bandwidth as a percentage of deepep's whole call at 24 SMs of this run (dispatch, or combine). */
static double pct_of_ref(const variant *v, bool dispatch)
{
    const variant *r = &B.v[B.ref];
    const double mine = gbs(v->bytes, dispatch ? v->dispatch_us : v->combine_us);
    const double ref = gbs(r->bytes, dispatch ? r->dispatch_us : r->combine_us);
    return ref > 0 ? 100.0 * mine / ref : 0.0;
}

/* The options text with its quotes escaped for a JSON string. */
static const char *json_options(const char *in, char *out, size_t size)
{
    size_t j = 0;
    for (size_t i = 0; in[i] && j + 2 < size; i++) {
        if (in[i] == '"') out[j++] = '\\';
        out[j++] = in[i];
    }
    out[j] = 0;
    return out;
}

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

/* Distinct uniform experts per token; returns the rows this rank sends to other ranks. */
static double make_routing(int rank, int64_t T, int32_t *idx, uint64_t *rng)
{
    const int64_t E = B.E, K = B.K, El = E / B.gpus;
    double out = 0;
    for (int64_t t = 0; t < T; t++) {
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
            ranks |= 1u << (e / El);
        }
        for (int d = 0; d < B.gpus; d++) out += d != rank && ((ranks >> d) & 1u);
    }
    return out;
}

/* The slowest rank's time of this repeat, after every rank has recorded its own. */
static double slowest(int rank, double ms)
{
    B.rank_ms[rank] = ms;
    pthread_barrier_wait(&B.barrier);
    double worst = 0;
    for (int r = 0; r < B.gpus; r++) worst = B.rank_ms[r] > worst ? B.rank_ms[r] : worst;
    pthread_barrier_wait(&B.barrier);
    return worst;
}

typedef struct rank_env {
    int rank;
    moert_cuda_pool *pool;
    moert_nccl_comm *nccl;
    cudaStream_t stream;
} rank_env;

/* The steady state of a decode-like loop: after one barrier each rank queues dispatch, combine, dispatch, ... with
 * an event between calls and no host wait, so the ranks stay in step through the calls' own data dependencies rather
 * than a host barrier's wake-up skew. A call's time on a rank runs from the end of its previous call to its own end;
 * per call the largest over ranks, the figure the median over the calls after the warm-up ones. */
static void time_back_to_back(rank_env *env, variant *v, test_instance *ti, const moert_dispatch_args *da,
                              const moert_combine_args *ca)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const cudaStream_t s = env->stream;
    const int n = WARMUP + B.repeats;
    cudaEvent_t ev[2 * (WARMUP + MAX_REPEATS) + 1];
    for (int i = 0; i < 2 * n + 1; i++) CK(cudaEventCreate(&ev[i]));
    CK(cudaStreamSynchronize(s));
    pthread_barrier_wait(&B.barrier);
    CK(cudaEventRecord(ev[0], s));
    for (int i = 0; i < n; i++) {
        PCALL(ti, vt->dispatch(ti->ctx, (moert_stream)s, da));
        CK(cudaEventRecord(ev[2 * i + 1], s));
        PCALL(ti, vt->combine(ti->ctx, (moert_stream)s, ca));
        CK(cudaEventRecord(ev[2 * i + 2], s));
    }
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i++) {
        float d = 0, c = 0;
        CK(cudaEventElapsedTime(&d, ev[2 * i], ev[2 * i + 1]));
        CK(cudaEventElapsedTime(&c, ev[2 * i + 1], ev[2 * i + 2]));
        const double worst_d = slowest(env->rank, d), worst_c = slowest(env->rank, c);
        if (env->rank == 0 && i >= WARMUP) {
            v->dispatch_ms[i - WARMUP] = worst_d;
            v->combine_ms[i - WARMUP] = worst_c;
        }
    }
    for (int i = 0; i < 2 * n + 1; i++) CK(cudaEventDestroy(ev[i]));
}

/* One variant on one rank: open, prepare, dispatch then combine timed repeatedly. */
static void run_variant(rank_env *env, variant *v)
{
    const int rank = env->rank, W = B.gpus;
    const int64_t T = v->T, H = B.H, K = B.K;
    const cudaStream_t s = env->stream;
    if (!v->plugin) { /* the floor of a timed call: a 16-byte memset timed alike (launch, events, rank skew) */
        void *d;
        cudaEvent_t f0, f1;
        CK(cudaMalloc(&d, 16));
        CK(cudaEventCreate(&f0));
        CK(cudaEventCreate(&f1));
        for (int op = 0; op < 2; op++)
            for (int i = 0; i < WARMUP + B.repeats; i++) {
                CK(cudaStreamSynchronize(s));
                pthread_barrier_wait(&B.barrier);
                CK(cudaEventRecord(f0, s));
                CK(cudaMemsetAsync(d, op, 16, s));
                CK(cudaEventRecord(f1, s));
                CK(cudaEventSynchronize(f1));
                float ms = 0;
                CK(cudaEventElapsedTime(&ms, f0, f1));
                const double worst = slowest(rank, ms);
                if (rank == 0 && i >= WARMUP) (op == 0 ? v->dispatch_ms : v->combine_ms)[i - WARMUP] = worst;
            }
        CK(cudaEventDestroy(f0));
        CK(cudaEventDestroy(f1));
        CK(cudaFree(d));
        return;
    }
    moert_layer_info layer = test_layer(H, 2048, B.E, K, T, W, rank, MOERT_BF16);
    layer.device = (moert_device){MOERT_DEVICE_CUDA, rank};
    test_instance ti;
    if (test_instance_open_cuda(&ti, MOERT_KIND_DISPATCHER, v->plugin, v->options, &layer, B.comm, rank, W, env->pool,
                                env->nccl, (moert_stream)s) != MOERT_OK) {
        fprintf(stderr, "rank %d: %s %s: %s\n", rank, v->plugin, v->options, moert_error_message());
        die();
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti.plugin.header;
    uint64_t rng = 12345 + 7919ull * (uint64_t)rank;
    int32_t *idx_h = malloc((size_t)(T * K) * sizeof(int32_t));
    const double rows_out = make_routing(rank, T, idx_h, &rng);
    void *idx, *x, *probs;
    CK(cudaMalloc(&idx, (size_t)(T * K) * 4));
    CK(cudaMalloc(&x, (size_t)(T * H) * 2));
    CK(cudaMalloc(&probs, (size_t)(T * K) * 4));
    CK(cudaMemcpy(idx, idx_h, (size_t)(T * K) * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(x, 0x3c, (size_t)(T * H) * 2));
    CK(cudaMemset(probs, 0, (size_t)(T * K) * 4));
    moert_tensor it = moert_tensor_2d(idx, layer.device, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    PCALL(&ti, vt->prepare(ti.ctx, (moert_stream)s, &it, &layout));
    const int64_t cap = layout.capacity > 0 ? layout.capacity : 1;
    void *recv_x, *recv_probs, *y;
    CK(cudaMalloc(&recv_x, (size_t)cap * H * 2));
    CK(cudaMalloc(&recv_probs, (size_t)cap * 4));
    CK(cudaMalloc(&y, (size_t)(T * H) * 2));
    CK(cudaMemset(recv_x, 0, (size_t)cap * H * 2));
    moert_tensor xt = moert_tensor_2d(x, layer.device, MOERT_BF16, T, H);
    moert_tensor pt = moert_tensor_2d(probs, layer.device, MOERT_F32, T, K);
    moert_tensor rx = moert_tensor_2d(recv_x, layer.device, MOERT_BF16, cap, H);
    moert_tensor rp = moert_tensor_1d(recv_probs, layer.device, MOERT_F32, cap);
    moert_tensor yt = moert_tensor_2d(y, layer.device, MOERT_BF16, T, H);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .topk_probs = &pt, .recv_x = &rx, .recv_probs = &rp};
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &rx, .y = &yt};
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    if (v->back_to_back) time_back_to_back(env, v, &ti, &da, &ca);
    for (int op = 0; op < 2 && !v->back_to_back; op++)
        for (int i = 0; i < WARMUP + B.repeats; i++) {
            CK(cudaStreamSynchronize(s));
            pthread_barrier_wait(&B.barrier);
            CK(cudaEventRecord(e0, s));
            if (op == 0)
                PCALL(&ti, vt->dispatch(ti.ctx, (moert_stream)s, &da));
            else
                PCALL(&ti, vt->combine(ti.ctx, (moert_stream)s, &ca));
            CK(cudaEventRecord(e1, s));
            CK(cudaEventSynchronize(e1));
            float ms = 0;
            CK(cudaEventElapsedTime(&ms, e0, e1));
            const double worst = slowest(rank, ms);
            if (rank == 0 && i >= WARMUP) (op == 0 ? v->dispatch_ms : v->combine_ms)[i - WARMUP] = worst;
        }
    pthread_mutex_lock(&B.lock);
    const double bytes = rows_out * (double)H * 2;
    if (bytes > v->bytes) v->bytes = bytes;
    pthread_mutex_unlock(&B.lock);
    CK(cudaStreamSynchronize(s));
    test_instance_close(&ti);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    void *bufs[] = {idx, x, probs, recv_x, recv_probs, y};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    free(idx_h);
}

static void rank_main(int rank, void *user)
{
    (void)user;
    rank_env env = {.rank = rank};
    moert_stream stream = NULL;
    if (moert_cuda_set_device(rank) != MOERT_OK || moert_cuda_pool_create(rank, &env.pool) != MOERT_OK ||
        moert_cuda_stream_create(rank, &stream) != MOERT_OK ||
        (B.gpus > 1 && moert_nccl_comm_init_thread(B.nccl, rank, rank, &env.nccl) != MOERT_OK)) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, moert_error_message());
        die();
    }
    env.stream = (cudaStream_t)stream;
    for (int i = 0; i < B.nv; i++) {
        if (rank == 0)
            printf("variant %d/%d: %s %s ...\n", i + 1, B.nv, B.v[i].plugin ? B.v[i].plugin : "cudaMemsetAsync",
                   B.v[i].options);
        run_variant(&env, &B.v[i]);
        if (rank == 0) {
            variant *v = &B.v[i];
            v->dispatch_us = 1e3 * median(v->dispatch_ms, B.repeats);
            v->combine_us = 1e3 * median(v->combine_ms, B.repeats);
            printf("  %-40s T %5lld  dispatch %9.1f us  combine %9.1f us  %8.1f / %8.1f GB/s (%.0f%% / %.0f%% of %.0f)",
                   v->name, (long long)v->T, v->dispatch_us, v->combine_us, gbs(v->bytes, v->dispatch_us),
                   gbs(v->bytes, v->combine_us), 100.0 * gbs(v->bytes, v->dispatch_us) / NVLINK_GBS,
                   100.0 * gbs(v->bytes, v->combine_us) / NVLINK_GBS, NVLINK_GBS);
            if (v->normal)
                printf("  = %.0f%% / %.0f%% of deepep's whole call", pct_of_ref(v, true), pct_of_ref(v, false));
            printf("\n");
        }
    }
    if (env.nccl) moert_nccl_comm_free(env.nccl);
    moert_cuda_stream_destroy(stream);
    moert_cuda_pool_destroy(env.pool);
}

static int add(const char *name, const char *plugin, const char *options, int64_t T, bool normal)
{
    variant *v = &B.v[B.nv];
    snprintf(v->name, sizeof v->name, "%s", name);
    v->plugin = plugin;
    snprintf(v->options, sizeof v->options, "%s", options);
    v->T = T;
    v->normal = normal;
    return B.nv++;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (cudaGetDeviceCount(&B.gpus) != cudaSuccess || B.gpus == 0) {
        printf("hybridep_bench: no GPU, skipped\n");
        return TEST_SKIP;
    }
    if (B.gpus > MAX_GPUS) B.gpus = MAX_GPUS;
    const char *rep = getenv("MOERT_BENCH_REPEATS");
    B.repeats = rep ? atoi(rep) : 20;
    if (B.repeats < 1 || B.repeats > MAX_REPEATS) B.repeats = 20;
    B.H = 7168;
    B.E = 256;
    B.K = 8;
    /* deepep first: every hybridep line then prints its percentage of deepep's whole call */
    const char *only = getenv("MOERT_BENCH_ONLY");
    const bool ll_only = only && strcmp(only, "ll") == 0, normal_only = only && strcmp(only, "normal") == 0;
    const char *tokens_env = getenv("MOERT_BENCH_TOKENS");
    const int64_t T = tokens_env && atoll(tokens_env) > 0 ? atoll(tokens_env) : 4096; /* the normal-mode lines' T */
    int sms[MAX_SMS_LIST] = {8, 12, 16}, nsms = 3;
    const char *sms_env = getenv("MOERT_BENCH_SMS");
    if (sms_env && *sms_env) {
        char list[128];
        snprintf(list, sizeof list, "%s", sms_env);
        nsms = 0;
        for (char *tok = strtok(list, ","); tok && nsms < MAX_SMS_LIST; tok = strtok(NULL, ","))
            if (atoi(tok) > 0) sms[nsms++] = atoi(tok);
    }
    B.ref = add("deepep 24 SMs (reference, whole call)", "deepep", "{\"timeout_ms\": 10000, \"num_sms\": 24}",
                ll_only ? 128 : T, false);
    B.ref_nvlink =
        add("deepep 24 SMs (NVLink phase only)", "deepep",
            "{\"timeout_ms\": 10000, \"num_sms\": 24, \"bench_nvlink_only\": true}", ll_only ? 128 : T, false);
    for (int i = 0; i < nsms && !ll_only; i++) {
        char name[64], options[160];
        snprintf(name, sizeof name, "hybridep %d SMs (tma)", sms[i]);
        snprintf(options, sizeof options, "{\"timeout_ms\": 10000, \"num_sms\": %d, \"low_latency\": \"off\"}", sms[i]);
        add(name, "hybridep", options, T, true);
    }
    for (int i = 0; i < nsms && !ll_only; i++) { /* the same with vector copies in the NVLink phase (copy "vector") */
        char name[64], options[160];
        snprintf(name, sizeof name, "hybridep %d SMs (vector)", sms[i]);
        snprintf(options, sizeof options,
                 "{\"timeout_ms\": 10000, \"num_sms\": %d, \"low_latency\": \"off\", \"copy\": \"vector\"}", sms[i]);
        add(name, "hybridep", options, T, true);
    }
    const int64_t ll_tokens[4] = {1, 32, 128, 256};
    if (!normal_only) { /* MOERT_BENCH_ONLY=normal: the normal-mode lines and their reference alone */
        /* the floor every timed call pays (launch, events, the ranks' skew after the barrier), then the low-latency
         * mode: every SM at T 1..256, and a sweep of its block count (num_sms) at T 1 and 128: where the floor comes
         * from */
        add("floor: 16-byte memset timed alike", NULL, "", 1, false);
        for (int i = 0; i < 4; i++)
            add("hybridep low-latency (every SM)", "hybridep", "{\"timeout_ms\": 10000}", ll_tokens[i], false);
        const int ll_blocks[5] = {8, 16, 32, 64, 128};
        for (int t = 0; t < 2; t++)
            for (int i = 0; i < 5; i++) {
                if (t == 0 && (i == 1 || i == 3)) continue; /* T 1: 8, 32, 128 blocks */
                char name[64], options[160];
                snprintf(name, sizeof name, "hybridep low-latency %d blocks", ll_blocks[i]);
                snprintf(options, sizeof options, "{\"timeout_ms\": 10000, \"num_sms\": %d, \"low_latency\": \"on\"}",
                         ll_blocks[i]);
                add(name, "hybridep", options, t == 0 ? 1 : 128, false);
            }
        add("hybridep normal mode 16 SMs", "hybridep", "{\"timeout_ms\": 10000, \"low_latency\": \"off\"}", 128, false);
        /* the same calls back to back (a decode-like loop's steady state), beside deepep's at T 128 */
        for (int i = 0; i < 4; i++) {
            B.v[add("hybridep low-latency back-to-back (every SM)", "hybridep", "{\"timeout_ms\": 10000}", ll_tokens[i],
                    false)]
                .back_to_back = true;
            B.v[add("hybridep low-latency back-to-back, ll_fence thread", "hybridep",
                    "{\"timeout_ms\": 10000, \"low_latency\": \"on\", \"ll_fence\": \"thread\"}", ll_tokens[i], false)]
                .back_to_back = true;
        }
        B.v[add("deepep 24 SMs back-to-back", "deepep", "{\"timeout_ms\": 10000, \"num_sms\": 24}", 128, false)]
            .back_to_back = true;
        /* the low-latency tuning variants, each at T 1, 32, 128, 256 (the default again, in the same stretch of the
         * run) */
        for (int gi = 0; gi < LL_GROUPS; gi++)
            for (int i = 0; i < 4; i++) {
                char name[80], options[200];
                snprintf(name, sizeof name, "ll: %s", ll_groups[gi][0]);
                snprintf(options, sizeof options, "{\"timeout_ms\": 10000, \"low_latency\": \"on\"%s}",
                         ll_groups[gi][1]);
                B.v[add(name, "hybridep", options, ll_tokens[i], false)].ll_group = gi + 1;
            }
    }
    printf("hybridep_bench: EP%d, H %lld, top-%lld of %lld experts, bf16, %d repeats\n", B.gpus, (long long)B.H,
           (long long)B.K, (long long)B.E, B.repeats);
    pthread_barrier_init(&B.barrier, NULL, (unsigned)B.gpus);
    if (moert_comm_group_create(B.gpus, 60.0, &B.comm) != MOERT_OK ||
        (B.gpus > 1 && moert_nccl_group_create(B.gpus, 60.0, &B.nccl) != MOERT_OK)) {
        fprintf(stderr, "communicators: %s\n", moert_error_message());
        return 1;
    }
    test_run_ranks(B.gpus, rank_main, NULL);
    /* the acceptance summary: whole call against deepep's whole call at 24 SMs (NVLink phase alone for reference) */
    const variant *ref = &B.v[B.ref], *nvl = &B.v[B.ref_nvlink];
    printf("\nsummary (bytes per rank %.0f MB; target: >= 95%% of deepep's whole-call bandwidth with <= 16 SMs)\n",
           ref->bytes / 1e6);
    printf("  %-36s %10s %10s %9s %9s %11s %11s\n", "variant", "disp us", "comb us", "disp GB/s", "comb GB/s",
           "disp % ref", "comb % ref");
    for (int i = 0; i < B.nv; i++) {
        const variant *v = &B.v[i];
        if (!v->normal && i != B.ref && i != B.ref_nvlink) continue;
        printf("  %-36s %10.1f %10.1f %9.1f %9.1f", v->name, v->dispatch_us, v->combine_us,
               gbs(v->bytes, v->dispatch_us), gbs(v->bytes, v->combine_us));
        if (i == B.ref_nvlink)
            printf("   (NVLink phase only: %.0f%% / %.0f%% of the whole call's time)\n",
                   100.0 * nvl->dispatch_us / ref->dispatch_us, 100.0 * nvl->combine_us / ref->combine_us);
        else
            printf(" %10.0f%% %10.0f%%\n", pct_of_ref(v, true), pct_of_ref(v, false));
    }
    if (!normal_only) {
        for (int i = 0; i < B.nv; i++) {
            const variant *v = &B.v[i];
            if (!v->plugin || v->back_to_back || (strstr(v->name, "low-latency") && !v->ll_group))
                printf("  %-36s T %4lld: dispatch %6.1f us, combine %6.1f us%s\n", v->name, (long long)v->T,
                       v->dispatch_us, v->combine_us,
                       v->T == 128 && strstr(v->name, "low-latency") ? "  (targets 40 / 50)" : "");
        }
        printf("\nlow-latency variants, dispatch / combine us (targets at T 128: 40 / 50)\n  %-40s", "variant");
        for (int i = 0; i < 4; i++) printf("  T %-13lld", (long long)ll_tokens[i]);
        printf("\n");
        for (int gi = 0; gi < LL_GROUPS; gi++) {
            printf("  %-40s", ll_groups[gi][0]);
            for (int i = 0; i < B.nv; i++)
                if (B.v[i].ll_group == gi + 1) printf("  %6.1f / %6.1f", B.v[i].dispatch_us, B.v[i].combine_us);
            printf("\n");
        }
    }
    if (B.nccl) moert_nccl_group_free(B.nccl);
    moert_comm_group_free(B.comm);
    if (argc > 1) {
        FILE *f = fopen(argv[1], "w");
        if (!f) {
            fprintf(stderr, "cannot write %s\n", argv[1]);
            return 1;
        }
        time_t now = time(NULL);
        char date[32];
        strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
        const char *machine = getenv("MOERT_BENCH_MACHINE"), *git = getenv("MOERT_BENCH_GIT");
        fprintf(
            f,
            "{\n  \"command\": \"bench/hybridep_bench %s\",\n  \"machine\": \"%s\",\n  \"date\": \"%s\",\n"
            "  \"git\": \"%s\",\n  \"ep\": %d, \"hidden\": %lld, \"topk\": %lld, \"experts\": %lld, \"repeats\": %d,\n"
            "  \"variants\": [\n",
            argv[1], machine ? machine : "unknown", date, git ? git : "unknown", B.gpus, (long long)B.H, (long long)B.K,
            (long long)B.E, B.repeats);
        for (int i = 0; i < B.nv; i++) {
            const variant *v = &B.v[i];
            char opts[320];
            fprintf(f,
                    "    {\"name\": \"%s\", \"plugin\": \"%s\", \"options\": \"%s\", \"tokens\": %lld, "
                    "\"dispatch_us\": %.2f, \"combine_us\": %.2f, \"bytes_out\": %.0f, \"dispatch_gbs\": %.2f, "
                    "\"combine_gbs\": %.2f",
                    v->name, v->plugin ? v->plugin : "none", json_options(v->options, opts, sizeof opts),
                    (long long)v->T, v->dispatch_us, v->combine_us, v->bytes, gbs(v->bytes, v->dispatch_us),
                    gbs(v->bytes, v->combine_us));
            fprintf(f, ", \"timing\": \"%s\"", v->back_to_back ? "back_to_back" : "after_host_barrier");
            if (v->normal)
                fprintf(f, ", \"dispatch_pct_of_deepep_whole\": %.1f, \"combine_pct_of_deepep_whole\": %.1f",
                        pct_of_ref(v, true), pct_of_ref(v, false));
            fprintf(f, "}%s\n", i + 1 < B.nv ? "," : "");
        }
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    return 0;
}
