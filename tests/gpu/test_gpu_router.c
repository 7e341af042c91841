/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "topk" router plugin's CUDA path against its CPU path (the reference), the same inputs through both:
 * every mode the CUDA path serves (softmax post and pre, sigmoid with expert bias, group-limited top-k and
 * scaling, aux_loss, seq_aux_loss, global_aux_loss, z_loss, capacity with both drop policies and padding, sinkhorn,
 * input jitter, force_load_balancing, compute_dtype fp32 and fp64), x in fp32 and bf16, several steps so the expert
 * bias moves; a padded capacity route captured in a CUDA graph. Checked per step: topk_idx equal (a mismatch is allowed only at a near tie of the CPU's
 * selection scores, |a - b| <= 1e-5, and counted), probs (fp32 x: within 1e-4; bf16 x: 2e-2 relative),
 * tokens_per_expert, the losses (1e-4 relative; every other forward defers them to forward_losses), d_x and d_weight after backward (1e-3 relative to the norm
 * of the CPU's increment), the expert bias after end_step; no new cudaMalloc in a steady-state step; the
 * options the CUDA path refuses and its messages. With two GPUs: the bias update all-reduces the counts of
 * both ranks and of every forward since the last end_step. Exits 77 without a GPU or without CUDA.
 */
#include "test_util.h"

#ifndef MOERT_HAVE_CUDA

int main(void)
{
    printf("gpu_router: built without CUDA, skipped\n");
    return TEST_SKIP;
}

#else

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "error.h"
#include "host.h"
#include "moert/router.h"
#include "router_noise.h"

#define TIE 1e-5

/* A CUDA call in the test itself. */
#define CUDA_OK(call)                                                                                                  \
    do {                                                                                                               \
        cudaError_t e_ = (call);                                                                                       \
        if (e_ != cudaSuccess) {                                                                                       \
            fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));              \
            test_failures++;                                                                                           \
        }                                                                                                              \
    } while (0)

enum score_kind { SCORE_POST = 0, SCORE_PRE = 1, SCORE_SIGMOID = 2, SCORE_SINKHORN = 3 };

/* One configuration of the router, run on the CPU and on the GPU. */
typedef struct router_mode {
    const char *name;
    const char *options;   /* the plugin's JSON options */
    enum score_kind score; /* for the near-tie analysis */
    int64_t groups, group_topk;
    int64_t T, H, E, K;
    int64_t seq_length;
    int steps;             /* optimizer steps (forward, backward, end_step) */
    int forwards_per_step; /* forwards (each with its backward) before each end_step */
    /* what the near-tie analysis must know of the options: */
    bool capacity;      /* capacity_factor: dropped copies may differ where probs nearly tie */
    double jitter_eps;  /* input_jitter_eps */
    bool force_balance; /* force_load_balancing */
    uint64_t seed;      /* the option "seed" (42 when not given) */
} router_mode;

/* One rank's CUDA resources, as the runtime gives them. */
typedef struct gpu_rank {
    int device;
    moert_cuda_pool *pool;
    moert_stream stream;
    moert_nccl_comm *nccl;
} gpu_rank;

/* Host copies of one forward's inputs and outputs. */
typedef struct step_data {
    int64_t T, H, E, K;
    moert_dtype dtype;
    void *x;        /* [T,H] dtype */
    float *w;       /* [E,H] */
    float *d_probs; /* [T,K] */
    void *d_x0;     /* [T,H] dtype: d_x before backward */
    float *d_w0;    /* [E,H] */
} step_data;

/* Outputs of one side (host copies). */
typedef struct side_out {
    int32_t *idx;
    float *probs;
    int64_t *tpe;
    void *d_x;
    float *d_w;
    double *bias; /* [E] after end_step (NULL without expert bias) */
    moert_router_losses losses;
} side_out;

static double load_dtype(moert_dtype dtype, const void *p, int64_t i)
{
    moert_tensor t = moert_tensor_1d((void *)p, moert_cpu(), dtype, i + 1);
    return moert_load(&t, i);
}

static void store_dtype(moert_dtype dtype, void *p, int64_t i, double v)
{
    moert_tensor t = moert_tensor_1d(p, moert_cpu(), dtype, i + 1);
    moert_store(&t, i, v);
}

/* ---- the inputs ---- */

static void step_data_make(step_data *d, const router_mode *m, moert_dtype dtype, uint64_t seed)
{
    memset(d, 0, sizeof *d);
    d->T = m->T;
    d->H = m->H;
    d->E = m->E;
    d->K = m->K;
    d->dtype = dtype;
    size_t es = moert_dtype_size(dtype);
    int64_t T = m->T, H = m->H, E = m->E, K = m->K;
    d->x = calloc((size_t)(T * H + 1), es);
    d->d_x0 = calloc((size_t)(T * H + 1), es);
    d->w = calloc((size_t)(E * H), sizeof(float));
    d->d_w0 = calloc((size_t)(E * H), sizeof(float));
    d->d_probs = calloc((size_t)(T * K + 1), sizeof(float));
    uint64_t s = seed;
    /* logits of order 1: x in [-1, 1), w in [-3, 3) / sqrt(H) */
    double wscale = 3.0 / sqrt((double)H);
    for (int64_t i = 0; i < T * H; i++) store_dtype(dtype, d->x, i, test_uniform(&s));
    for (int64_t i = 0; i < E * H; i++) d->w[i] = (float)(wscale * test_uniform(&s));
    for (int64_t i = 0; i < T * K; i++) d->d_probs[i] = (float)test_uniform(&s);
    for (int64_t i = 0; i < T * H; i++) store_dtype(dtype, d->d_x0, i, 0.1 * test_uniform(&s));
    for (int64_t i = 0; i < E * H; i++) d->d_w0[i] = (float)(0.1 * test_uniform(&s));
}

static void step_data_free(step_data *d)
{
    free(d->x);
    free(d->d_x0);
    free(d->w);
    free(d->d_w0);
    free(d->d_probs);
}

static void side_out_alloc(side_out *o, const step_data *d)
{
    memset(o, 0, sizeof *o);
    o->idx = calloc((size_t)(d->T * d->K + 1), sizeof(int32_t));
    o->probs = calloc((size_t)(d->T * d->K + 1), sizeof(float));
    o->tpe = calloc((size_t)d->E, sizeof(int64_t));
    o->d_x = calloc((size_t)(d->T * d->H + 1), moert_dtype_size(d->dtype));
    o->d_w = calloc((size_t)(d->E * d->H), sizeof(float));
    o->bias = calloc((size_t)d->E, sizeof(double));
}

static void side_out_free(side_out *o)
{
    free(o->idx);
    free(o->probs);
    free(o->tpe);
    free(o->d_x);
    free(o->d_w);
    free(o->bias);
}

/* ---- one forward + backward on each side ---- */

/* The CPU side: host tensors straight from the step data. */
/* MOERT_ROUTER_FORWARD_INFERENCE for an evaluation's forward on both sides (no backward follows), else 0. */
static uint32_t inference_flag;

static moert_result run_cpu(test_instance *ti, const step_data *d, int64_t seq_length, side_out *o)
{
    const moert_router_v1 *vt = (const moert_router_v1 *)ti->plugin.header;
    int64_t T = d->T, H = d->H, E = d->E, K = d->K;
    moert_device cpu = moert_cpu();
    moert_tensor tx = moert_tensor_2d(d->x, cpu, d->dtype, T, H);
    moert_tensor tw = moert_tensor_2d(d->w, cpu, MOERT_F32, E, H);
    moert_tensor tidx = moert_tensor_2d(o->idx, cpu, MOERT_I32, T, K);
    moert_tensor tprobs = moert_tensor_2d(o->probs, cpu, MOERT_F32, T, K);
    moert_tensor ttpe = moert_tensor_1d(o->tpe, cpu, MOERT_I64, E);
    moert_router_forward_args fa = {.struct_size = sizeof fa,
                                    .x = &tx,
                                    .weight = &tw,
                                    .topk_idx = &tidx,
                                    .topk_probs = &tprobs,
                                    .tokens_per_expert = &ttpe,
                                    .losses = &o->losses,
                                    .seq_length = seq_length,
                                    .flags = inference_flag};
    moert_result rc = vt->forward(ti->ctx, NULL, &fa);
    if (rc != MOERT_OK) return moert_error(rc, "cpu forward: %s", moert_host_take_error(ti->host));
    if (inference_flag) return MOERT_OK;
    memcpy(o->d_x, d->d_x0, (size_t)(T * H) * moert_dtype_size(d->dtype));
    memcpy(o->d_w, d->d_w0, (size_t)(E * H) * sizeof(float));
    moert_tensor tdp = moert_tensor_2d(d->d_probs, cpu, MOERT_F32, T, K);
    moert_tensor tdx = moert_tensor_2d(o->d_x, cpu, d->dtype, T, H);
    moert_tensor tdw = moert_tensor_2d(o->d_w, cpu, MOERT_F32, E, H);
    moert_router_backward_args ba = {.struct_size = sizeof ba,
                                     .x = &tx,
                                     .weight = &tw,
                                     .d_topk_probs = &tdp,
                                     .loss_scale = 0.7,
                                     .d_x = &tdx,
                                     .d_weight = &tdw};
    rc = vt->backward(ti->ctx, NULL, &ba);
    if (rc != MOERT_OK) return moert_error(rc, "cpu backward: %s", moert_host_take_error(ti->host));
    return MOERT_OK;
}

/* Device copies of one step's tensors. */
typedef struct device_step {
    void *x, *w, *idx, *probs, *tpe, *d_probs, *d_x, *d_w;
} device_step;

static void device_step_free(device_step *s)
{
    void *all[] = {s->x, s->w, s->idx, s->probs, s->tpe, s->d_probs, s->d_x, s->d_w};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i]) cudaFree(all[i]);
    memset(s, 0, sizeof *s);
}

static void *device_copy(const void *src, size_t bytes)
{
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, bytes ? bytes : 4));
    if (p && bytes) CUDA_OK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
    return p;
}

/* The GPU side: the same step on device tensors of `dev`, results copied back. */
static moert_result run_gpu(test_instance *ti, const gpu_rank *g, const step_data *d, int64_t seq_length, bool backward,
                            side_out *o)
{
    const moert_router_v1 *vt = (const moert_router_v1 *)ti->plugin.header;
    int64_t T = d->T, H = d->H, E = d->E, K = d->K;
    size_t es = moert_dtype_size(d->dtype);
    moert_device dev = {MOERT_DEVICE_CUDA, g->device};
    /* every other forward defers its losses (MOERT_ROUTER_FORWARD_DEFER_LOSSES), as the layers do: both ways are
     * checked against the CPU */
    static unsigned forwards;
    const bool defer = forwards++ % 2 == 1;
    device_step s;
    memset(&s, 0, sizeof s);
    s.x = device_copy(d->x, (size_t)(T * H) * es);
    s.w = device_copy(d->w, (size_t)(E * H) * sizeof(float));
    /* outputs poisoned, so a value the plugin does not write shows */
    CUDA_OK(cudaMalloc(&s.idx, (size_t)(T * K + 1) * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&s.probs, (size_t)(T * K + 1) * sizeof(float)));
    CUDA_OK(cudaMalloc(&s.tpe, (size_t)E * sizeof(int64_t)));
    CUDA_OK(cudaMemset(s.idx, 0x7f, (size_t)(T * K + 1) * sizeof(int32_t)));
    CUDA_OK(cudaMemset(s.probs, 0xff, (size_t)(T * K + 1) * sizeof(float)));
    CUDA_OK(cudaMemset(s.tpe, 0x7f, (size_t)E * sizeof(int64_t)));
    s.d_probs = device_copy(d->d_probs, (size_t)(T * K) * sizeof(float));
    s.d_x = device_copy(d->d_x0, (size_t)(T * H) * es);
    s.d_w = device_copy(d->d_w0, (size_t)(E * H) * sizeof(float));
    /* the copies and memsets above ran on the legacy stream, which the rank's non-blocking stream does not wait for */
    CUDA_OK(cudaDeviceSynchronize());

    moert_tensor tx = moert_tensor_2d(s.x, dev, d->dtype, T, H);
    moert_tensor tw = moert_tensor_2d(s.w, dev, MOERT_F32, E, H);
    moert_tensor tidx = moert_tensor_2d(s.idx, dev, MOERT_I32, T, K);
    moert_tensor tprobs = moert_tensor_2d(s.probs, dev, MOERT_F32, T, K);
    moert_tensor ttpe = moert_tensor_1d(s.tpe, dev, MOERT_I64, E);
    moert_router_forward_args fa = {.struct_size = sizeof fa,
                                    .x = &tx,
                                    .weight = &tw,
                                    .topk_idx = &tidx,
                                    .topk_probs = &tprobs,
                                    .tokens_per_expert = &ttpe,
                                    .losses = &o->losses,
                                    .seq_length = seq_length,
                                    .flags = (defer ? MOERT_ROUTER_FORWARD_DEFER_LOSSES : 0u) | inference_flag};
    moert_result rc = vt->forward(ti->ctx, g->stream, &fa);
    if (rc != MOERT_OK) {
        device_step_free(&s);
        return moert_error(rc, "gpu forward: %s", moert_host_take_error(ti->host));
    }
    if (backward) {
        moert_tensor tdp = moert_tensor_2d(s.d_probs, dev, MOERT_F32, T, K);
        moert_tensor tdx = moert_tensor_2d(s.d_x, dev, d->dtype, T, H);
        moert_tensor tdw = moert_tensor_2d(s.d_w, dev, MOERT_F32, E, H);
        moert_router_backward_args ba = {.struct_size = sizeof ba,
                                         .x = &tx,
                                         .weight = &tw,
                                         .d_topk_probs = &tdp,
                                         .loss_scale = 0.7,
                                         .d_x = &tdx,
                                         .d_weight = &tdw};
        rc = vt->backward(ti->ctx, g->stream, &ba);
        if (rc != MOERT_OK) {
            device_step_free(&s);
            return moert_error(rc, "gpu backward: %s", moert_host_take_error(ti->host));
        }
    }
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)g->stream));
    if (defer) { /* the losses the forward left on the device, now that the stream has passed it */
        rc = vt->forward_losses(ti->ctx, &o->losses);
        if (rc != MOERT_OK) {
            device_step_free(&s);
            return moert_error(rc, "gpu forward_losses: %s", moert_host_take_error(ti->host));
        }
    }
    CUDA_OK(cudaMemcpy(o->idx, s.idx, (size_t)(T * K) * sizeof(int32_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->probs, s.probs, (size_t)(T * K) * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->tpe, s.tpe, (size_t)E * sizeof(int64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->d_x, s.d_x, (size_t)(T * H) * es, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->d_w, s.d_w, (size_t)(E * H) * sizeof(float), cudaMemcpyDeviceToHost));
    device_step_free(&s);
    return MOERT_OK;
}

/* end_step, then the bias (if any) copied to the host as doubles. */
static moert_result end_step_and_bias(test_instance *ti, moert_stream stream, int64_t E, double *bias)
{
    const moert_router_v1 *vt = (const moert_router_v1 *)ti->plugin.header;
    moert_result rc = vt->end_step(ti->ctx, stream);
    if (rc != MOERT_OK) return moert_error(rc, "end_step: %s", moert_host_take_error(ti->host));
    const moert_tensor *b = vt->expert_bias(ti->ctx);
    for (int64_t e = 0; e < E; e++) bias[e] = 0.0;
    if (!b) return MOERT_OK;
    if (b->device.type == MOERT_DEVICE_CUDA) {
        if (b->dtype != MOERT_F32 || b->shape[0] != E)
            return moert_error(MOERT_ERR_INTERNAL, "bias tensor shape/dtype");
        float tmp[1024];
        CUDA_OK(cudaStreamSynchronize((cudaStream_t)stream));
        CUDA_OK(cudaMemcpy(tmp, b->data, (size_t)E * sizeof(float), cudaMemcpyDeviceToHost));
        for (int64_t e = 0; e < E; e++) bias[e] = tmp[e];
    } else {
        for (int64_t e = 0; e < E; e++) bias[e] = moert_load(b, e);
    }
    return MOERT_OK;
}

/* ---- comparisons ---- */

/* The logits of token t in forward number `call`, as the CPU forms them: x jittered, or random (router_noise.h). */
static void token_logits(const router_mode *m, const step_data *d, uint64_t call, int64_t t, double *l)
{
    int64_t E = d->E, H = d->H;
    uint64_t seed = m->seed ? m->seed : 42;
    uint64_t jitter_key = router_noise_key(seed, 0, 0, ROUTER_NOISE_JITTER);
    uint64_t random_key = router_noise_key(seed, 0, 0, ROUTER_NOISE_RANDOM_LOGITS);
    for (int64_t e = 0; e < E; e++) {
        double acc = 0.0;
        for (int64_t h = 0; h < H; h++) {
            double x = load_dtype(d->dtype, d->x, t * H + h);
            if (m->jitter_eps > 0.0)
                x *= router_noise_jitter(jitter_key, call, (uint64_t)t, (uint64_t)h, m->jitter_eps);
            acc += x * (double)d->w[e * H + h];
        }
        l[e] = m->force_balance ? router_noise_normal(random_key, call, (uint64_t)t, (uint64_t)e) : acc;
    }
}

/* Sinkhorn's d1 [E] over all tokens of a forward, as the CPU computes it (for the near-tie analysis). */
static void sinkhorn_d1(const router_mode *m, const step_data *d, uint64_t call, double *d1)
{
    int64_t T = d->T, E = d->E;
    double *c = calloc((size_t)(T * E), sizeof(double)), *d0 = calloc((size_t)T, sizeof(double));
    double *old = calloc((size_t)E, sizeof(double));
    for (int64_t t = 0; t < T; t++) {
        token_logits(m, d, call, t, c + t * E);
        for (int64_t e = 0; e < E; e++) c[t * E + e] = exp(c[t * E + e]);
    }
    for (int64_t e = 0; e < E; e++) d1[e] = old[e] = 1.0;
    for (int it = 0; it < 10000; it++) {
        for (int64_t t = 0; t < T; t++) {
            double acc = 0.0;
            for (int64_t e = 0; e < E; e++) acc += d1[e] * c[t * E + e];
            d0[t] = (1.0 / (double)T) / (acc + 1e-8);
        }
        double err = 0.0;
        for (int64_t e = 0; e < E; e++) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++) acc += d0[t] * c[t * E + e];
            d1[e] = (1.0 / (double)E) / (acc + 1e-8);
            err += fabs(d1[e] - old[e]);
            old[e] = d1[e];
        }
        if (err / (double)E <= 1e-4) break;
    }
    free(c);
    free(d0);
    free(old);
}

/* The CPU's selection scores of one token in double (the bias as the CPU had it at the forward); sinkhorn's are
 * log(d1 * exp(l)) = l + log d1, ordered as the balanced scores (d0 is a per-token factor). */
static void selection_scores(const router_mode *m, const step_data *d, uint64_t call, int64_t t, const double *bias,
                             const double *d1, double *sc)
{
    int64_t E = d->E;
    double mx = -INFINITY;
    token_logits(m, d, call, t, sc);
    for (int64_t e = 0; e < E; e++)
        if (sc[e] > mx) mx = sc[e];
    if (m->score == SCORE_SINKHORN) {
        for (int64_t e = 0; e < E; e++) sc[e] += log(d1[e]);
    } else if (m->score == SCORE_PRE) {
        double z = 0.0;
        for (int64_t e = 0; e < E; e++) z += exp(sc[e] - mx);
        for (int64_t e = 0; e < E; e++) sc[e] = exp(sc[e] - mx) / z;
    } else if (m->score == SCORE_SIGMOID) {
        for (int64_t e = 0; e < E; e++) sc[e] = 1.0 / (1.0 + exp(-sc[e])) + (bias ? bias[e] : 0.0);
    }
}

static bool contains(const int32_t *v, int64_t n, int32_t x)
{
    for (int64_t i = 0; i < n; i++)
        if (v[i] == x) return true;
    return false;
}

/* The Kg-th and (Kg+1)-th best group scores are within TIE (a group choice on a near tie). */
static bool group_near_tie(const router_mode *m, const double *sc, int64_t E, int64_t K)
{
    if (m->groups <= 0 || m->group_topk >= m->groups) return false;
    int64_t G = m->groups, per = E / G, take = K / m->group_topk;
    double gs[64];
    for (int64_t g = 0; g < G; g++) {
        double v[256];
        for (int64_t i = 0; i < per; i++) v[i] = sc[g * per + i];
        double sum = 0.0;
        for (int64_t r = 0; r < take; r++) {
            int64_t best = 0;
            for (int64_t i = 1; i < per; i++)
                if (v[i] > v[best]) best = i;
            sum += v[best];
            v[best] = -INFINITY;
        }
        gs[g] = sum;
    }
    for (int64_t r = 0; r < m->group_topk; r++) { /* selection sort: the first Kg + 1 */
        for (int64_t j = r + 1; j < G; j++)
            if (gs[j] > gs[r]) {
                double tmp = gs[r];
                gs[r] = gs[j];
                gs[j] = tmp;
            }
    }
    double next = -INFINITY;
    for (int64_t j = m->group_topk; j < G; j++)
        if (gs[j] > next) next = gs[j];
    return fabs(gs[m->group_topk - 1] - next) <= TIE;
}

/* A difference between the CPU's ids a and the GPU's ids b is explained by near ties of the CPU's scores. */
static bool near_tie(const router_mode *m, const double *sc, const int32_t *a, const int32_t *b, int64_t E, int64_t K)
{
    bool ok = true;
    bool same_set = true;
    for (int64_t k = 0; k < K; k++) {
        if (b[k] < 0 || b[k] >= E) return false;
        if (!contains(a, K, b[k])) same_set = false;
    }
    if (same_set) {
        for (int64_t k = 0; k < K; k++)
            if (a[k] != b[k] && fabs(sc[a[k]] - sc[b[k]]) > TIE) ok = false;
        return ok;
    }
    for (int64_t k = 0; k < K && ok; k++) {
        if (contains(a, K, b[k])) continue;
        bool paired = false;
        for (int64_t j = 0; j < K; j++)
            if (!contains(b, K, a[j]) && fabs(sc[b[k]] - sc[a[j]]) <= TIE) paired = true;
        if (!paired) ok = false;
    }
    return ok || group_near_tie(m, sc, E, K);
}

/* ||a - b|| / ||b - base|| over n elements of dtype (base NULL: zero). */
static double relative_error(moert_dtype dtype, const void *a, const void *b, const void *base, int64_t n)
{
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double va = load_dtype(dtype, a, i), vb = load_dtype(dtype, b, i);
        double v0 = base ? load_dtype(dtype, base, i) : 0.0;
        num += (va - vb) * (va - vb);
        den += (vb - v0) * (vb - v0);
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static bool close_rel(double a, double b, double rtol) { return fabs(a - b) <= 1e-12 + rtol * fabs(b); }

/* Compares one step; returns the number of near-tie mismatches (hard ones are counted as failures). */
static int64_t compare_step(const char *what, const router_mode *m, const step_data *d, uint64_t call,
                            const double *cpu_bias, const side_out *c, const side_out *g, bool compare_grads)
{
    int64_t T = d->T, E = d->E, K = d->K, H = d->H;
    int64_t ties = 0, hard = 0, prob_bad = 0, capacity_diffs = 0;
    double worst_prob = 0.0;
    double *sc = calloc((size_t)E, sizeof(double)), *d1 = calloc((size_t)E, sizeof(double));
    bool have_d1 = false;
    for (int64_t t = 0; t < T; t++) {
        const int32_t *a = c->idx + t * K, *b = g->idx + t * K;
        if (memcmp(a, b, (size_t)K * sizeof(int32_t)) != 0) {
            if (m->score == SCORE_SINKHORN && !have_d1) {
                sinkhorn_d1(m, d, call, d1);
                have_d1 = true;
            }
            selection_scores(m, d, call, t, cpu_bias, d1, sc);
            bool dropped = false;
            for (int64_t k = 0; k < K; k++) dropped = dropped || a[k] < 0 || b[k] < 0;
            if (m->capacity && dropped) {
                /* which copies an expert keeps turns on its copies' probs: fp32 on the GPU, fp64 on the CPU; a
                 * near tie there (or in the selection) moves a drop. Counted, and bounded below. */
                capacity_diffs++;
                ties++;
            } else if (near_tie(m, sc, a, b, E, K)) {
                ties++;
            } else {
                if (hard < 5) {
                    fprintf(stderr, "%s: token %lld: ids differ beyond a near tie: cpu", what, (long long)t);
                    for (int64_t k = 0; k < K; k++) fprintf(stderr, " %d(%.7f)", a[k], sc[a[k]]);
                    fprintf(stderr, ", gpu");
                    for (int64_t k = 0; k < K; k++)
                        fprintf(stderr, " %d(%.7f)", b[k], b[k] >= 0 && b[k] < E ? sc[b[k]] : NAN);
                    fprintf(stderr, "\n");
                }
                hard++;
            }
            continue;
        }
        for (int64_t k = 0; k < K; k++) {
            double pc = c->probs[t * K + k], pg = g->probs[t * K + k];
            double err = fabs(pg - pc);
            bool ok = d->dtype == MOERT_BF16 ? err <= 1e-6 + 2e-2 * fabs(pc) : err <= 1e-4;
            if (!(err <= worst_prob)) worst_prob = err;
            if (!ok) {
                if (prob_bad < 5)
                    fprintf(stderr, "%s: token %lld slot %lld: prob %.8f on the GPU, %.8f on the CPU\n", what,
                            (long long)t, (long long)k, pg, pc);
                prob_bad++;
            }
        }
    }
    free(sc);
    free(d1);
    if (capacity_diffs > 1 + T / 50) {
        fprintf(stderr, "%s: %lld tokens differ in their dropped copies (at most %lld near ties expected)\n", what,
                (long long)capacity_diffs, (long long)(1 + T / 50));
        hard++;
    }
    test_failures += (int)(hard + prob_bad);
    if (ties == 0) {
        for (int64_t e = 0; e < E; e++)
            if (c->tpe[e] != g->tpe[e]) {
                fprintf(stderr, "%s: tokens_per_expert[%lld] = %lld on the GPU, %lld on the CPU\n", what, (long long)e,
                        (long long)g->tpe[e], (long long)c->tpe[e]);
                test_failures++;
            }
    } else if (!m->capacity) {
        int64_t sum = 0;
        for (int64_t e = 0; e < E; e++) sum += g->tpe[e];
        EXPECT_EQ_INT(sum, T * K);
    }
    /* a near tie may also move one copy between the plain top-K counts of the aux loss: looser then */
    double loss_tol = ties ? 1e-2 : 1e-4;
    if (!close_rel(g->losses.aux_loss, c->losses.aux_loss, loss_tol) ||
        !close_rel(g->losses.z_loss, c->losses.z_loss, loss_tol) ||
        !close_rel(g->losses.total, c->losses.total, loss_tol)) {
        fprintf(stderr, "%s: losses aux %.10g z %.10g total %.10g on the GPU, %.10g %.10g %.10g on the CPU\n", what,
                g->losses.aux_loss, g->losses.z_loss, g->losses.total, c->losses.aux_loss, c->losses.z_loss,
                c->losses.total);
        test_failures++;
    }
    double ex = 0.0, ew = 0.0;
    if (compare_grads && ties == 0 && T > 0) {
        ex = relative_error(d->dtype, g->d_x, c->d_x, d->d_x0, T * H);
        ew = relative_error(MOERT_F32, g->d_w, c->d_w, d->d_w0, E * H);
        if (!(ex <= 1e-3) || !(ew <= 1e-3)) {
            fprintf(stderr, "%s: d_x relative error %.3g, d_weight %.3g (limit 1e-3)\n", what, ex, ew);
            test_failures++;
        }
    }
    printf("%-58s ties %3lld  prob err %.1e  aux %.6g z %.6g  d_x %.1e d_w %.1e%s\n", what, (long long)ties, worst_prob,
           g->losses.aux_loss, g->losses.z_loss, ex, ew, ties && compare_grads ? " (grads not compared: ties)" : "");
    return ties;
}

/* ---- one mode, both dtypes ---- */

static void check_mode(const router_mode *m, moert_dtype dtype, const gpu_rank *g)
{
    char what[160];
    test_instance cpu, gpu;
    fprintf(stderr, "gpu_router: %s, %s x\n", m->name, moert_dtype_name(dtype)); /* progress, unbuffered */
    moert_layer_info layer = test_layer(m->H, 4, m->E, m->K, m->T, 1, 0, dtype);
    moert_layer_info glayer = layer;
    glayer.device.type = MOERT_DEVICE_CUDA;
    glayer.device.id = g->device;
    EXPECT_OK(test_instance_open(&cpu, MOERT_KIND_ROUTER, "topk", m->options, &layer, NULL, 0, 1));
    EXPECT_OK(test_instance_open_cuda(&gpu, MOERT_KIND_ROUTER, "topk", m->options, &glayer, NULL, 0, 1, g->pool,
                                      g->nccl, g->stream));
    if (!cpu.ctx || !gpu.ctx) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    int64_t E = m->E;
    double *cpu_bias = calloc((size_t)E, sizeof(double)), *gpu_bias = calloc((size_t)E, sizeof(double));
    bool all_equal = true; /* no tie so far: the biases must agree */
    uint64_t mallocs_before = 0;
    for (int step = 0; step < m->steps; step++) {
        for (int f = 0; f < m->forwards_per_step; f++) {
            if (step == m->steps - 1 && f == 0 && step > 0) {
                moert_cuda_pool_stats st;
                moert_cuda_pool_get_stats(g->pool, &st);
                mallocs_before = st.cuda_malloc_count;
            }
            step_data d;
            step_data_make(&d, m, dtype, 1000u * (uint64_t)step + 17u * (uint64_t)f + (uint64_t)dtype + 1);
            side_out c, o;
            side_out_alloc(&c, &d);
            side_out_alloc(&o, &d);
            moert_result rc = run_cpu(&cpu, &d, m->seq_length, &c);
            if (rc != MOERT_OK) {
                fprintf(stderr, "%s: %s\n", m->name, moert_error_message());
                test_failures++;
            }
            rc = run_gpu(&gpu, g, &d, m->seq_length, true, &o);
            if (rc != MOERT_OK) {
                fprintf(stderr, "%s: %s\n", m->name, moert_error_message());
                test_failures++;
            }
            snprintf(what, sizeof what, "%s %s step %d.%d", m->name, moert_dtype_name(dtype), step, f);
            /* both instances count their forwards alike: the noise of this one is call number `call` on both */
            uint64_t call = (uint64_t)(step * m->forwards_per_step + f);
            if (compare_step(what, m, &d, call, cpu_bias, &c, &o, true) > 0) all_equal = false;
            side_out_free(&c);
            side_out_free(&o);
            step_data_free(&d);
        }
        if (step == m->steps - 1 && strstr(m->options, "\"expert_bias\": true")) {
            /* an evaluation's forward before the last end_step: counted for the bias on neither side (the CPU's
             * not counting it is test_router's) */
            step_data d;
            step_data_make(&d, m, dtype, 777u + (uint64_t)dtype);
            side_out c, o;
            side_out_alloc(&c, &d);
            side_out_alloc(&o, &d);
            inference_flag = MOERT_ROUTER_FORWARD_INFERENCE;
            EXPECT_OK(run_cpu(&cpu, &d, m->seq_length, &c));
            EXPECT_OK(run_gpu(&gpu, g, &d, m->seq_length, false, &o));
            inference_flag = 0;
            side_out_free(&c);
            side_out_free(&o);
            step_data_free(&d);
        }
        EXPECT_OK(end_step_and_bias(&cpu, NULL, E, cpu_bias));
        EXPECT_OK(end_step_and_bias(&gpu, g->stream, E, gpu_bias));
        if (all_equal) {
            for (int64_t e = 0; e < E; e++)
                if (fabs(cpu_bias[e] - gpu_bias[e]) > 1e-6) {
                    fprintf(stderr, "%s %s step %d: bias[%lld] = %.8f on the GPU, %.8f on the CPU\n", m->name,
                            moert_dtype_name(dtype), step, (long long)e, gpu_bias[e], cpu_bias[e]);
                    test_failures++;
                }
        }
    }
    if (m->steps > 1) {
        /* the last step had the same T as the ones before: the pool made no new cudaMalloc for the router */
        moert_cuda_pool_stats st;
        moert_cuda_pool_get_stats(g->pool, &st);
        EXPECT_EQ_INT(st.cuda_malloc_count, mallocs_before);
    }
    free(cpu_bias);
    free(gpu_bias);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
}

/* ---- edge cases and refusals ---- */

/* An instance on the GPU must refuse to open with `options`, naming `needle`. */
static void expect_gpu_refusal(const gpu_rank *g, const char *options, int64_t E, int64_t K, const char *needle)
{
    test_instance ti;
    moert_layer_info layer = test_layer(16, 4, E, K, 8, 1, 0, MOERT_F32);
    layer.device.type = MOERT_DEVICE_CUDA;
    layer.device.id = g->device;
    moert_result rc = test_instance_open_cuda(&ti, MOERT_KIND_ROUTER, "topk", options, &layer, NULL, 0, 1, g->pool,
                                              g->nccl, g->stream);
    EXPECT_EQ_INT(rc, MOERT_ERR_UNSUPPORTED);
    if (!strstr(moert_error_message(), needle)) {
        fprintf(stderr, "refusal of %s: message \"%s\" lacks \"%s\"\n", options, moert_error_message(), needle);
        test_failures++;
    }
    test_instance_close(&ti);
}

static void check_refusals_and_edges(const gpu_rank *g)
{
    expect_gpu_refusal(g, "{}", 300, 2, "num_experts 300 is more than the CUDA kernels' 256");
    expect_gpu_refusal(g, "{}", 16, 9, "topk 9 is more than the CUDA kernels' 8");
    expect_gpu_refusal(g, "{\"gemm\": \"bf16x3\"}", 8, 2, "option gemm: \"bf16x3\" needs bf16 activations");

    /* a tensor on the wrong device, fp16 x, and no tokens */
    router_mode m = {.name = "edge", .options = "{\"z_loss_coeff\": 0.01}", .T = 8, .H = 16, .E = 8, .K = 2};
    test_instance ti;
    moert_layer_info layer = test_layer(m.H, 4, m.E, m.K, m.T, 1, 0, MOERT_F32);
    layer.device.type = MOERT_DEVICE_CUDA;
    layer.device.id = g->device;
    EXPECT_OK(test_instance_open_cuda(&ti, MOERT_KIND_ROUTER, "topk", m.options, &layer, NULL, 0, 1, g->pool, g->nccl,
                                      g->stream));
    if (!ti.ctx) return;
    const moert_router_v1 *vt = (const moert_router_v1 *)ti.plugin.header;
    step_data d;
    step_data_make(&d, &m, MOERT_F32, 5);
    side_out o;
    side_out_alloc(&o, &d);
    moert_device cpu = moert_cpu(), dev = {MOERT_DEVICE_CUDA, g->device};
    moert_tensor tx = moert_tensor_2d(d.x, cpu, MOERT_F32, m.T, m.H);
    moert_tensor tw = moert_tensor_2d(d.w, cpu, MOERT_F32, m.E, m.H);
    moert_tensor tidx = moert_tensor_2d(o.idx, cpu, MOERT_I32, m.T, m.K);
    moert_tensor tprobs = moert_tensor_2d(o.probs, cpu, MOERT_F32, m.T, m.K);
    moert_tensor ttpe = moert_tensor_1d(o.tpe, cpu, MOERT_I64, m.E);
    moert_router_forward_args fa = {.struct_size = sizeof fa,
                                    .x = &tx,
                                    .weight = &tw,
                                    .topk_idx = &tidx,
                                    .topk_probs = &tprobs,
                                    .tokens_per_expert = &ttpe,
                                    .losses = &o.losses};
    EXPECT_EQ_INT(vt->forward(ti.ctx, g->stream, &fa), MOERT_ERR_INVALID_ARGUMENT);
    const char *msg = moert_host_take_error(ti.host);
    if (!strstr(msg, "x is on cpu; this instance runs on cuda:")) {
        fprintf(stderr, "wrong-device message: \"%s\"\n", msg);
        test_failures++;
    }
    /* fp16 x: refused by the CUDA path, naming the dtypes it takes */
    void *dx = NULL, *dw = NULL, *didx = NULL, *dprobs = NULL, *dtpe = NULL;
    CUDA_OK(cudaMalloc(&dx, (size_t)(m.T * m.H) * 4));
    CUDA_OK(cudaMalloc(&dw, (size_t)(m.E * m.H) * 4));
    CUDA_OK(cudaMalloc(&didx, (size_t)(m.T * m.K) * 4));
    CUDA_OK(cudaMalloc(&dprobs, (size_t)(m.T * m.K) * 4));
    CUDA_OK(cudaMalloc(&dtpe, (size_t)m.E * 8));
    CUDA_OK(cudaMemset(dx, 0, (size_t)(m.T * m.H) * 4));
    CUDA_OK(cudaMemset(dw, 0, (size_t)(m.E * m.H) * 4));
    CUDA_OK(cudaDeviceSynchronize());
    tx = moert_tensor_2d(dx, dev, MOERT_F16, m.T, m.H);
    tw = moert_tensor_2d(dw, dev, MOERT_F32, m.E, m.H);
    tidx = moert_tensor_2d(didx, dev, MOERT_I32, m.T, m.K);
    tprobs = moert_tensor_2d(dprobs, dev, MOERT_F32, m.T, m.K);
    ttpe = moert_tensor_1d(dtpe, dev, MOERT_I64, m.E);
    EXPECT_EQ_INT(vt->forward(ti.ctx, g->stream, &fa), MOERT_ERR_UNSUPPORTED);
    msg = moert_host_take_error(ti.host);
    if (!strstr(msg, "x is fp16; the CUDA path takes fp32 or bf16")) {
        fprintf(stderr, "fp16 message: \"%s\"\n", msg);
        test_failures++;
    }
    /* no tokens: counts zeroed, losses 0, backward a no-op */
    tx = moert_tensor_2d(dx, dev, MOERT_F32, 0, m.H);
    tidx = moert_tensor_2d(didx, dev, MOERT_I32, 0, m.K);
    tprobs = moert_tensor_2d(dprobs, dev, MOERT_F32, 0, m.K);
    CUDA_OK(cudaMemset(dtpe, 0x7f, (size_t)m.E * 8));
    CUDA_OK(cudaDeviceSynchronize());
    o.losses.total = 99.0;
    EXPECT_OK(vt->forward(ti.ctx, g->stream, &fa));
    CUDA_OK(cudaStreamSynchronize((cudaStream_t)g->stream));
    CUDA_OK(cudaMemcpy(o.tpe, dtpe, (size_t)m.E * 8, cudaMemcpyDeviceToHost));
    for (int64_t e = 0; e < m.E; e++) EXPECT_EQ_INT(o.tpe[e], 0);
    EXPECT(o.losses.total == 0.0 && o.losses.z_loss == 0.0);
    moert_tensor tdp = moert_tensor_2d(dprobs, dev, MOERT_F32, 0, m.K);
    moert_tensor tdx = moert_tensor_2d(dx, dev, MOERT_F32, 0, m.H);
    moert_tensor tdw = moert_tensor_2d(dw, dev, MOERT_F32, m.E, m.H);
    moert_router_backward_args ba = {.struct_size = sizeof ba,
                                     .x = &tx,
                                     .weight = &tw,
                                     .d_topk_probs = &tdp,
                                     .loss_scale = 1.0,
                                     .d_x = &tdx,
                                     .d_weight = &tdw};
    EXPECT_OK(vt->backward(ti.ctx, g->stream, &ba));
    EXPECT(vt->expert_bias(ti.ctx) == NULL);
    cudaFree(dx);
    cudaFree(dw);
    cudaFree(didx);
    cudaFree(dprobs);
    cudaFree(dtpe);
    side_out_free(&o);
    step_data_free(&d);
    test_instance_close(&ti);
}

/* ---- capacity with padding: capturable in a CUDA graph ---- */

/* A padded capacity route without losses declares itself capturable, and a forward captured in a CUDA graph and
 * replayed gives what the same forward gave eagerly (every expert reports exactly its capacity). */
static void check_capture_without_sync(const gpu_rank *g)
{
    router_mode m = {.name = "capture", .T = 64, .H = 32, .E = 8, .K = 2};
    const char *options = "{\"capacity_factor\": 1.0, \"pad_to_capacity\": true, \"input_jitter_eps\": 0.01}";
    test_instance ti;
    moert_layer_info layer = test_layer(m.H, 4, m.E, m.K, m.T, 1, 0, MOERT_F32);
    layer.device.type = MOERT_DEVICE_CUDA;
    layer.device.id = g->device;
    EXPECT_OK(test_instance_open_cuda(&ti, MOERT_KIND_ROUTER, "topk", options, &layer, NULL, 0, 1, g->pool, g->nccl,
                                      g->stream));
    if (!ti.ctx) return;
    const moert_router_v1 *vt = (const moert_router_v1 *)ti.plugin.header;
    EXPECT(moert_host_instance_flags(ti.host, vt->header.flags) & MOERT_CAP_GRAPH_CAPTURABLE);
    step_data d;
    step_data_make(&d, &m, MOERT_F32, 77);
    side_out eager, replay;
    side_out_alloc(&eager, &d);
    side_out_alloc(&replay, &d);
    cudaStream_t stream = (cudaStream_t)g->stream;
    moert_device dev = {MOERT_DEVICE_CUDA, g->device};
    void *x = device_copy(d.x, (size_t)(m.T * m.H) * sizeof(float)), *w = device_copy(d.w, (size_t)(m.E * m.H) * 4);
    void *idx = NULL, *probs = NULL, *tpe = NULL;
    CUDA_OK(cudaMalloc(&idx, (size_t)(m.T * m.K) * sizeof(int32_t)));
    CUDA_OK(cudaMalloc(&probs, (size_t)(m.T * m.K) * sizeof(float)));
    CUDA_OK(cudaMalloc(&tpe, (size_t)m.E * sizeof(int64_t)));
    CUDA_OK(cudaDeviceSynchronize());
    moert_tensor tx = moert_tensor_2d(x, dev, MOERT_F32, m.T, m.H), tw = moert_tensor_2d(w, dev, MOERT_F32, m.E, m.H);
    moert_tensor tidx = moert_tensor_2d(idx, dev, MOERT_I32, m.T, m.K);
    moert_tensor tprobs = moert_tensor_2d(probs, dev, MOERT_F32, m.T, m.K);
    moert_tensor ttpe = moert_tensor_1d(tpe, dev, MOERT_I64, m.E);
    moert_router_losses losses;
    moert_router_forward_args fa = {.struct_size = sizeof fa,
                                    .x = &tx,
                                    .weight = &tw,
                                    .topk_idx = &tidx,
                                    .topk_probs = &tprobs,
                                    .tokens_per_expert = &ttpe,
                                    .losses = &losses};
    /* an eager forward grows the buffers; the captured one allocates nothing */
    EXPECT_OK(vt->forward(ti.ctx, g->stream, &fa));
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    moert_result rc = vt->forward(ti.ctx, g->stream, &fa);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    EXPECT_OK(rc);
    if (graph) CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    /* the graph replays forward number 1 (its noise call was fixed at capture) */
    if (exec) {
        CUDA_OK(cudaGraphLaunch(exec, stream));
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(replay.idx, idx, (size_t)(m.T * m.K) * sizeof(int32_t), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(replay.probs, probs, (size_t)(m.T * m.K) * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(replay.tpe, tpe, (size_t)m.E * sizeof(int64_t), cudaMemcpyDeviceToHost));
    }
    /* the replay against forward number 1 of a second instance, run eagerly */
    test_instance t2;
    EXPECT_OK(test_instance_open_cuda(&t2, MOERT_KIND_ROUTER, "topk", options, &layer, NULL, 0, 1, g->pool, g->nccl,
                                      g->stream));
    if (t2.ctx) {
        EXPECT_OK(vt->forward(t2.ctx, g->stream, &fa));
        EXPECT_OK(vt->forward(t2.ctx, g->stream, &fa));
        CUDA_OK(cudaStreamSynchronize(stream));
        CUDA_OK(cudaMemcpy(eager.idx, idx, (size_t)(m.T * m.K) * sizeof(int32_t), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(eager.probs, probs, (size_t)(m.T * m.K) * sizeof(float), cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(eager.tpe, tpe, (size_t)m.E * sizeof(int64_t), cudaMemcpyDeviceToHost));
        EXPECT(memcmp(eager.idx, replay.idx, (size_t)(m.T * m.K) * sizeof(int32_t)) == 0);
        EXPECT(memcmp(eager.probs, replay.probs, (size_t)(m.T * m.K) * sizeof(float)) == 0);
        int64_t cap = (int64_t)ceil((double)(m.T * m.K) / (double)m.E * 1.0);
        for (int64_t e = 0; e < m.E; e++) EXPECT_EQ_INT(replay.tpe[e], cap);
        printf("capacity 1.0 padded + jitter, no loss: captured in a CUDA graph, replay equals the eager forward\n");
    }
    test_instance_close(&t2);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    cudaFree(x);
    cudaFree(w);
    cudaFree(idx);
    cudaFree(probs);
    cudaFree(tpe);
    side_out_free(&eager);
    side_out_free(&replay);
    step_data_free(&d);
    test_instance_close(&ti);
}

/* ---- two GPUs: the expert-bias update over ranks ---- */

#define BIAS_E    16
#define BIAS_K    2
#define BIAS_T    64
#define BIAS_H    32
#define BIAS_RATE 0.01

typedef struct bias_test {
    moert_nccl_group *group;
    moert_comm_group *comm;
    int64_t counts[2][2][BIAS_E]; /* [end_step][rank][e]: copies kept since the previous end_step */
    double bias[2][2][BIAS_E];    /* [end_step][rank][e] after it */
    int failed[2];
    char error[2][512];
} bias_test;

static void bias_rank(int rank, void *user)
{
    bias_test *bt = user;
    gpu_rank g = {.device = rank};
    test_instance ti;
    memset(&ti, 0, sizeof ti);
    moert_result rc = moert_cuda_set_device(rank);
    if (rc == MOERT_OK) rc = moert_cuda_pool_create(rank, &g.pool);
    if (rc == MOERT_OK) rc = moert_cuda_stream_create(rank, &g.stream);
    if (rc == MOERT_OK) rc = moert_nccl_comm_init_thread(bt->group, rank, rank, &g.nccl);
    char options[160];
    snprintf(options, sizeof options,
             "{\"score_function\": \"sigmoid\", \"expert_bias\": true, \"bias_update_rate\": %g}", BIAS_RATE);
    moert_layer_info layer = test_layer(BIAS_H, 4, BIAS_E, BIAS_K, BIAS_T, 2, rank, MOERT_F32);
    layer.device.type = MOERT_DEVICE_CUDA;
    layer.device.id = rank;
    if (rc == MOERT_OK)
        rc = test_instance_open_cuda(&ti, MOERT_KIND_ROUTER, "topk", options, &layer, bt->comm, rank, 2, g.pool, g.nccl,
                                     g.stream);
    router_mode m = {.T = BIAS_T, .H = BIAS_H, .E = BIAS_E, .K = BIAS_K};
    /* end_step 0 after one forward; end_step 1 after two */
    for (int s = 0; s < 2 && rc == MOERT_OK; s++) {
        memset(bt->counts[s][rank], 0, sizeof bt->counts[s][rank]);
        for (int f = 0; f <= s && rc == MOERT_OK; f++) {
            step_data d;
            step_data_make(&d, &m, MOERT_F32, 7000u + 100u * (uint64_t)rank + 10u * (uint64_t)s + (uint64_t)f);
            side_out o;
            side_out_alloc(&o, &d);
            rc = run_gpu(&ti, &g, &d, 0, false, &o);
            for (int64_t e = 0; e < BIAS_E; e++) bt->counts[s][rank][e] += o.tpe[e];
            side_out_free(&o);
            step_data_free(&d);
        }
        if (rc == MOERT_OK) rc = end_step_and_bias(&ti, g.stream, BIAS_E, bt->bias[s][rank]);
    }
    if (rc != MOERT_OK) {
        bt->failed[rank] = 1;
        snprintf(bt->error[rank], sizeof bt->error[rank], "%s", moert_error_message());
        if (g.nccl) moert_nccl_comm_abort(g.nccl, "test failed");
        moert_comm_abort(bt->comm, rank, "test failed");
    }
    test_instance_close(&ti);
    if (g.nccl) moert_nccl_comm_free(g.nccl);
    if (g.stream) {
        moert_cuda_stream_synchronize(g.stream);
        moert_cuda_pool_forget_stream(g.pool, g.stream);
        moert_cuda_stream_destroy(g.stream);
    }
    if (g.pool) moert_cuda_pool_destroy(g.pool);
}

static void check_bias_two_gpus(void)
{
    bias_test bt;
    memset(&bt, 0, sizeof bt);
    EXPECT_OK(moert_nccl_group_create(2, 60.0, &bt.group));
    EXPECT_OK(moert_comm_group_create(2, 60.0, &bt.comm));
    if (!bt.group || !bt.comm) return;
    test_run_ranks(2, bias_rank, &bt);
    for (int r = 0; r < 2; r++)
        if (bt.failed[r]) {
            fprintf(stderr, "two-GPU bias test, rank %d: %s\n", r, bt.error[r]);
            test_failures++;
        }
    if (!bt.failed[0] && !bt.failed[1]) {
        double expected[BIAS_E] = {0};
        for (int s = 0; s < 2; s++) {
            int64_t total[BIAS_E], sum = 0;
            for (int64_t e = 0; e < BIAS_E; e++) {
                total[e] = bt.counts[s][0][e] + bt.counts[s][1][e];
                sum += total[e];
            }
            EXPECT_EQ_INT(sum, 2 * (s + 1) * BIAS_T * BIAS_K);
            double mean = (double)sum / BIAS_E;
            int moved = 0;
            for (int64_t e = 0; e < BIAS_E; e++) {
                double off = mean - (double)total[e];
                expected[e] += BIAS_RATE * (off > 0 ? 1.0 : off < 0 ? -1.0 : 0.0);
                for (int r = 0; r < 2; r++)
                    if (fabs(bt.bias[s][r][e] - expected[e]) > 1e-6) {
                        fprintf(stderr,
                                "two GPUs, end_step %d, rank %d: bias[%lld] = %.8f, expected %.8f (all-reduced "
                                "count %lld, mean %.2f)\n",
                                s, r, (long long)e, bt.bias[s][r][e], expected[e], (long long)total[e], mean);
                        test_failures++;
                    }
                if (expected[e] != 0.0) moved++;
            }
            EXPECT(moved > 0);
            printf("two GPUs: end_step %d: bias from the all-reduced counts of %d forward(s) per rank: ok\n", s, s + 1);
        }
    }
    moert_comm_group_free(bt.comm);
    moert_nccl_group_free(bt.group);
}

/* ---- main ---- */

int main(void)
{
    int count = 0;
    if (moert_cuda_device_count(&count) != MOERT_OK || count == 0) {
        printf("gpu_router: no CUDA device, skipped\n");
        return TEST_SKIP;
    }
    gpu_rank g = {.device = 0};
    EXPECT_OK(moert_cuda_set_device(0));
    EXPECT_OK(moert_cuda_pool_create(0, &g.pool));
    EXPECT_OK(moert_cuda_stream_create(0, &g.stream));
    if (!g.pool || !g.stream) return test_finish("gpu_router");

    const router_mode modes[] = {
        {.name = "softmax post, aux_loss (mixtral)",
         .score = SCORE_POST,
         .T = 256,
         .H = 64,
         .E = 8,
         .K = 2,
         .options = "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.02}",
         .steps = 2,
         .forwards_per_step = 1},
        {.name = "softmax post, aux_loss + z_loss (qwen3)",
         .score = SCORE_POST,
         .T = 160,
         .H = 96,
         .E = 128,
         .K = 8,
         .options = "{\"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.001, \"z_loss_coeff\": 0.001}",
         .steps = 2,
         .forwards_per_step = 1},
        {.name = "softmax pre, z_loss",
         .score = SCORE_PRE,
         .T = 100,
         .H = 72,
         .E = 40,
         .K = 3,
         .options = "{\"pre_softmax\": true, \"z_loss_coeff\": 0.01}",
         .steps = 1,
         .forwards_per_step = 1},
        {.name = "sigmoid bias G8/4 x2.5 seq_aux (deepseek-v3)",
         .score = SCORE_SIGMOID,
         .groups = 8,
         .group_topk = 4,
         .T = 128,
         .H = 80,
         .E = 64,
         .K = 8,
         .seq_length = 32,
         .options = "{\"score_function\": \"sigmoid\", \"num_groups\": 8, \"group_topk\": 4, \"scaling_factor\": 2.5, "
                    "\"expert_bias\": true, \"bias_update_rate\": 0.01, \"load_balancing\": \"seq_aux_loss\", "
                    "\"aux_loss_coeff\": 0.0001}",
         .steps = 3,
         .forwards_per_step = 1},
        {.name = "sigmoid K1, global_aux_loss, 2 forwards/step",
         .score = SCORE_SIGMOID,
         .T = 90,
         .H = 48,
         .E = 33,
         .K = 1,
         .options = "{\"score_function\": \"sigmoid\", \"load_balancing\": \"global_aux_loss\", "
                    "\"aux_loss_coeff\": 0.01}",
         .steps = 2,
         .forwards_per_step = 2},
        {.name = "softmax post, no loss, E256 K8",
         .score = SCORE_POST,
         .T = 70,
         .H = 40,
         .E = 256,
         .K = 8,
         .options = "{}",
         .steps = 1,
         .forwards_per_step = 1},
        /* option gemm: the bf16 runs above take bf16x3 (auto); here a longer H, bf16x3 and fp32 on the same data */
        {.name = "sigmoid bias G8/4 x2.5, H 1024, gemm auto",
         .score = SCORE_SIGMOID,
         .groups = 8,
         .group_topk = 4,
         .T = 192,
         .H = 1024,
         .E = 256,
         .K = 8,
         .options = "{\"score_function\": \"sigmoid\", \"num_groups\": 8, \"group_topk\": 4, \"scaling_factor\": 2.5, "
                    "\"expert_bias\": true, \"bias_update_rate\": 0.01}",
         .steps = 2,
         .forwards_per_step = 1},
        {.name = "sigmoid bias G8/4 x2.5, H 1024, gemm fp32",
         .score = SCORE_SIGMOID,
         .groups = 8,
         .group_topk = 4,
         .T = 192,
         .H = 1024,
         .E = 256,
         .K = 8,
         .options = "{\"score_function\": \"sigmoid\", \"num_groups\": 8, \"group_topk\": 4, \"scaling_factor\": 2.5, "
                    "\"expert_bias\": true, \"bias_update_rate\": 0.01, \"gemm\": \"fp32\"}",
         .steps = 2,
         .forwards_per_step = 1},
    };
    /* Megatron's router options on the CUDA path (capacity, padding, sinkhorn, input jitter, forced balance,
     * the compute dtype), each against the CPU path */
    const router_mode more_modes[] = {
        {.name = "capacity 0.5, drop probs, aux_loss",
         .score = SCORE_POST,
         .T = 128,
         .H = 64,
         .E = 16,
         .K = 2,
         .options = "{\"capacity_factor\": 0.5, \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01}",
         .steps = 2,
         .forwards_per_step = 1,
         .capacity = true},
        {.name = "capacity 0.75, drop position, padded, pre",
         .score = SCORE_PRE,
         .T = 96,
         .H = 48,
         .E = 32,
         .K = 4,
         .options = "{\"pre_softmax\": true, \"capacity_factor\": 0.75, \"drop_policy\": \"position\", "
                    "\"pad_to_capacity\": true}",
         .steps = 2,
         .forwards_per_step = 1,
         .capacity = true},
        {.name = "capacity 1.0, sigmoid bias G4/2, padded",
         .score = SCORE_SIGMOID,
         .groups = 4,
         .group_topk = 2,
         .T = 128,
         .H = 64,
         .E = 64,
         .K = 8,
         .options = "{\"score_function\": \"sigmoid\", \"num_groups\": 4, \"group_topk\": 2, \"expert_bias\": true, "
                    "\"bias_update_rate\": 0.01, \"capacity_factor\": 1.0, \"pad_to_capacity\": true}",
         .steps = 3,
         .forwards_per_step = 1,
         .capacity = true},
        {.name = "sinkhorn top-2",
         .score = SCORE_SINKHORN,
         .T = 128,
         .H = 64,
         .E = 16,
         .K = 2,
         .options = "{\"load_balancing\": \"sinkhorn\"}",
         .steps = 2,
         .forwards_per_step = 1},
        {.name = "sinkhorn top-1, z_loss",
         .score = SCORE_SINKHORN,
         .T = 100,
         .H = 40,
         .E = 8,
         .K = 1,
         .options = "{\"load_balancing\": \"sinkhorn\", \"z_loss_coeff\": 0.001}",
         .steps = 1,
         .forwards_per_step = 1},
        {.name = "input jitter 0.05, aux_loss, 2 forwards/step",
         .score = SCORE_POST,
         .T = 128,
         .H = 64,
         .E = 16,
         .K = 2,
         .options = "{\"input_jitter_eps\": 0.05, \"seed\": 9, \"load_balancing\": \"aux_loss\", "
                    "\"aux_loss_coeff\": 0.01}",
         .steps = 2,
         .forwards_per_step = 2,
         .jitter_eps = 0.05,
         .seed = 9},
        {.name = "force_load_balancing, z_loss, capacity 1.0",
         .score = SCORE_POST,
         .T = 160,
         .H = 48,
         .E = 32,
         .K = 4,
         .options = "{\"force_load_balancing\": true, \"z_loss_coeff\": 0.001, \"capacity_factor\": 1.0}",
         .steps = 2,
         .forwards_per_step = 1,
         .force_balance = true,
         .capacity = true},
        {.name = "compute_dtype fp64, aux + z_loss",
         .score = SCORE_POST,
         .T = 128,
         .H = 96,
         .E = 64,
         .K = 8,
         .options = "{\"compute_dtype\": \"fp64\", \"load_balancing\": \"aux_loss\", \"aux_loss_coeff\": 0.01, "
                    "\"z_loss_coeff\": 0.001}",
         .steps = 2,
         .forwards_per_step = 1},
        {.name = "compute_dtype fp64, sigmoid bias, jitter",
         .score = SCORE_SIGMOID,
         .T = 96,
         .H = 64,
         .E = 32,
         .K = 4,
         .options = "{\"compute_dtype\": \"fp64\", \"score_function\": \"sigmoid\", \"expert_bias\": true, "
                    "\"input_jitter_eps\": 0.02}",
         .steps = 2,
         .forwards_per_step = 1,
         .jitter_eps = 0.02},
        {.name = "compute_dtype fp32, pre_softmax",
         .score = SCORE_PRE,
         .T = 100,
         .H = 72,
         .E = 40,
         .K = 3,
         .options = "{\"compute_dtype\": \"fp32\", \"pre_softmax\": true}",
         .steps = 1,
         .forwards_per_step = 1},
    };
    for (size_t i = 0; i < sizeof more_modes / sizeof more_modes[0]; i++) {
        check_mode(&more_modes[i], MOERT_F32, &g);
        check_mode(&more_modes[i], MOERT_BF16, &g);
    }
    check_capture_without_sync(&g);
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        check_mode(&modes[i], MOERT_F32, &g);
        check_mode(&modes[i], MOERT_BF16, &g);
    }
    check_refusals_and_edges(&g);

    moert_cuda_stream_synchronize(g.stream);
    moert_cuda_pool_forget_stream(g.pool, g.stream);
    moert_cuda_stream_destroy(g.stream);
    moert_cuda_pool_destroy(g.pool);

    if (count >= 2)
        check_bias_two_gpus();
    else
        printf("one GPU: the two-GPU bias all-reduce check is skipped\n");
    return test_finish("gpu_router");
}

#endif
