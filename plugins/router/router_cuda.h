/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CUDA path of the top-k router: scores, (group-limited) top-k, probs and counts from fp32 logits [T,E]
 * (the caller computes logits = x @ Wr^T), and the backward from d_topk_probs to d_logits.
 * One warp per token; E <= 256, K <= 8, groups <= 32. Formulas as in docs/moe-reference (Megatron Core):
 *   softmax post: idx = topk(logits); probs = softmax over the K selected logits
 *   softmax pre:  s = softmax(logits) over E; idx = topk(s); probs = s[idx] (normalised if asked)
 *   sigmoid:      s = sigmoid(logits); idx = topk(s + expert_bias); probs = s[idx] / (sum + 1e-20) when
 *                 normalise and K > 1, else s[idx]
 *   group-limited: group score = sum of the top K/Kg selection scores of each of G contiguous groups;
 *                 only the best Kg groups' experts can be picked
 *   probs *= scaling_factor last. Ties go to the lower expert (and group) index; idx are in descending
 *   selection-score order.
 * The plugin's path adds (the _ext entry points and the kernels below them): fp64 logits and scores
 * (compute_dtype fp64), sinkhorn's balanced selection, capacity with padding, input jitter and random logits drawn
 * from router_noise.h.
 * Everything is enqueued on the stream, no host syncs. Errors go to host->set_error (host may be NULL).
 */
#ifndef MOERT_ROUTER_CUDA_H
#define MOERT_ROUTER_CUDA_H

#include <cuda_runtime.h>

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOERT_ROUTER_CUDA_MAX_EXPERTS 256
#define MOERT_ROUTER_CUDA_MAX_TOPK    8
#define MOERT_ROUTER_CUDA_MAX_GROUPS  32

typedef enum moert_router_cuda_score {
    MOERT_ROUTER_CUDA_SOFTMAX_POST = 0,
    MOERT_ROUTER_CUDA_SOFTMAX_PRE = 1,
    MOERT_ROUTER_CUDA_SIGMOID = 2
} moert_router_cuda_score;

typedef struct moert_router_cuda_params {
    int64_t tokens, num_experts, topk;
    moert_router_cuda_score score;
    int64_t num_groups;    /* G; 0 or 1: no group limit */
    int64_t group_topk;    /* Kg groups kept (K must be a multiple of it) */
    int normalize;         /* sigmoid and softmax pre: divide the K selected scores by their sum (+1e-20), K > 1 */
    double scaling_factor; /* multiplies probs last; 0 is taken as 1 */
} moert_router_cuda_params;

/*
 * logits [T,E] fp32; expert_bias [E] fp32 or NULL (sigmoid only: changes selection, not probs).
 * Outputs (device): topk_idx [T,K] int32, topk_probs [T,K] fp32; tokens_per_expert [E] int64 (overwritten,
 * counted with atomics) or NULL; scores [T,E] fp32 or NULL: the full score distribution (softmax over E, or
 * the sigmoid), e.g. for an aux loss.
 */
moert_result moert_router_cuda_forward(const moert_host *host, cudaStream_t stream, const moert_router_cuda_params *p,
                                       const float *logits, const float *expert_bias, int32_t *topk_idx,
                                       float *topk_probs, int64_t *tokens_per_expert, float *scores);

/*
 * d_logits [T,E] fp32 from d_topk_probs [T,K] through the probs of the forward with the same params,
 * logits and topk_idx (as the forward wrote it; a -1 slot counts as absent). accumulate 1 adds into
 * d_logits, 0 overwrites (experts outside the top-k get 0 then).
 */
moert_result moert_router_cuda_backward(const moert_host *host, cudaStream_t stream, const moert_router_cuda_params *p,
                                        const float *logits, const int32_t *topk_idx, const float *d_topk_probs,
                                        float *d_logits, int accumulate);

/* What the plugin's path adds to a route (NULL, or zero members: the plain route above). */
typedef struct moert_router_cuda_route_ext {
    int logits_f64;            /* logits (and d_logits) are fp64 [T,E], and the scores are computed in fp64 */
    const double *sinkhorn_d0; /* [T] and sinkhorn_d1 [E] (moert_router_cuda_sinkhorn): select the top-k of
                                * d1[e] * exp(logits[t,e]) * d0[t]; with params score SOFTMAX_PRE (K > 1) or SIGMOID,
                                * normalize 0 (K = 1) the probs are Megatron's sinkhorn activation of the logits */
    const double *sinkhorn_d1;
    const int32_t *kept_idx; /* backward: [T,K] ids after capacity; a slot < 0 there gets no gradient but stays in
                                * the normalisation of the others (the selection is topk_idx) */
} moert_router_cuda_route_ext;

/* moert_router_cuda_forward and _backward with the extras of ext (may be NULL); logits and d_logits are fp32 or, with
 * ext->logits_f64, fp64. */
moert_result moert_router_cuda_forward_ext(const moert_host *host, cudaStream_t stream,
                                           const moert_router_cuda_params *p, const moert_router_cuda_route_ext *ext,
                                           const void *logits, const float *expert_bias, int32_t *topk_idx,
                                           float *topk_probs, int64_t *tokens_per_expert, float *scores);
moert_result moert_router_cuda_backward_ext(const moert_host *host, cudaStream_t stream,
                                            const moert_router_cuda_params *p, const moert_router_cuda_route_ext *ext,
                                            const void *logits, const int32_t *topk_idx, const float *d_topk_probs,
                                            void *d_logits, int accumulate);

/*
 * Token dropping (Megatron's expert capacity) after a route: of the copies of expert e in sel_idx [T,K] (a token holds
 * an expert at most once), keep `capacity`: with policy 0 (probs) the highest of probs [T,K] (the route's output;
 * equal probs: the earlier token), with policy 1 (position) the earliest tokens. out_idx [T,K] (a copy of sel_idx)
 * gets -1 and probs 0 at the dropped slots; kept_counts [E] the copies kept; tokens_per_expert [E] the same, or
 * `capacity` for every expert with pad (the dispatcher pads). scratch: T*E int32. One block per expert.
 */
moert_result moert_router_cuda_capacity(const moert_host *host, cudaStream_t stream, int64_t tokens, int64_t topk,
                                        int64_t experts, int64_t capacity, int policy, int pad, const int32_t *sel_idx,
                                        int32_t *out_idx, float *probs, int64_t *kept_counts,
                                        int64_t *tokens_per_expert, int32_t *scratch);

/* Doubles of workspace moert_router_cuda_sinkhorn needs for T tokens and E experts. */
#define MOERT_ROUTER_CUDA_SINKHORN_WORKSPACE_DOUBLES(T, E) ((T) * (E))

/*
 * Megatron's sinkhorn normalisation of exp(logits) [T,E] (fp32, or fp64 with logits_f64), in fp64 as the CPU path:
 * d0 = d1 = 1; repeat d0[t] = (1/T) / (sum_e c[t,e] d1[e] + 1e-8), d1[e] = (1/E) / (sum_t c[t,e] d0[t] + 1e-8) until
 * mean |d1 - d1_old| <= tol or max_iters rounds. Writes d0 [T], d1 [E] and *iterations (-1: not converged). One block
 * (no host sync, a data-dependent number of rounds); workspace holds c. E <= 256.
 */
moert_result moert_router_cuda_sinkhorn(const moert_host *host, cudaStream_t stream, int64_t tokens, int64_t experts,
                                        const void *logits, int logits_f64, double tol, int64_t max_iters,
                                        double *workspace, double *d0, double *d1, int *iterations);

/* The router_noise draws of one forward (router_noise.h): jitter factors of x, or the random logits. */
typedef struct moert_router_cuda_noise {
    uint64_t key;  /* router_noise_key(seed, layer, rank, purpose) */
    uint64_t call; /* the forward's number */
    double eps;    /* jitter: uniform(1 - eps, 1 + eps) */
} moert_router_cuda_noise;

/* dst [rows, cols] (fp32, or fp64 with dst_f64) = src (bf16, fp32) times the jitter factor of (row, col) when jitter
 * is given (else an exact conversion); the product is formed in fp64 and rounded once. */
moert_result moert_router_cuda_convert(const moert_host *host, cudaStream_t stream, moert_dtype src_dtype, int64_t rows,
                                       int64_t cols, const void *src, const moert_router_cuda_noise *jitter, void *dst,
                                       int dst_f64);
/* force_load_balancing: logits [T,E] (fp32, or fp64 with logits_f64) = router_noise_normal of (call, t, e). */
moert_result moert_router_cuda_random_logits(const moert_host *host, cudaStream_t stream, int64_t tokens,
                                             int64_t experts, const moert_router_cuda_noise *noise, void *logits,
                                             int logits_f64);
/* dst [rows, cols] (bf16 or fp32) += src (fp32, or fp64 with src_f64) times the jitter factor of (row, col) when
 * jitter is given; the sum is formed in fp64 and rounded once. */
moert_result moert_router_cuda_accumulate_ext(const moert_host *host, cudaStream_t stream, moert_dtype dst_dtype,
                                              int64_t rows, int64_t cols, const void *src, int src_f64,
                                              const moert_router_cuda_noise *jitter, void *dst);

/* ---- helpers of the plugin's CUDA path (router_gpu.c) ---- */

/* dst [n] fp32 = src [n] (bf16 or fp32), exact. */
moert_result moert_router_cuda_to_f32(const moert_host *host, cudaStream_t stream, moert_dtype src_dtype, int64_t n,
                                      const void *src, float *dst);
/* dst [n] (bf16 or fp32) += src [n] fp32; the sum is formed in fp32 and rounded once (bf16: to nearest even). */
moert_result moert_router_cuda_accumulate(const moert_host *host, cudaStream_t stream, moert_dtype dst_dtype, int64_t n,
                                          const float *src, void *dst);
/* The bf16 split of fp32 values: src [rows, cols] -> dst [rows, 3 * cols], plane p (its columns p*cols ..) holding
 * term order[p] of hi, mid, lo (0, 1, 2), each the nearest bf16 to what the terms before it left: the three hold an
 * fp32 value's 24 significant bits, so GEMMs on the planes with fp32 accumulation give fp32 products on tensor cores.
 * A term may appear twice (order {0, 0, 1}) to pair with another operand's planes along K. */
moert_result moert_router_cuda_split_bf16(const moert_host *host, cudaStream_t stream, int64_t rows, int64_t cols,
                                          const int order[3], const float *src, uint16_t *dst);
/* dst [rows, cols] = (accumulate 0) or += (1) the sum over p of src [rows, planes * cols]'s plane p, in plane order. */
moert_result moert_router_cuda_sum_planes(const moert_host *host, cudaStream_t stream, int64_t rows, int64_t cols,
                                          int planes, int accumulate, const float *src, float *dst);
/* dst [n] += src [n], int64. */
moert_result moert_router_cuda_add_counts(const moert_host *host, cudaStream_t stream, int64_t n, const int64_t *src,
                                          int64_t *dst);

/*
 * Balancing losses. P [T,E] is the full score distribution: softmax over E (sigmoid 0) or the sigmoid
 * normalised by its sum over E plus 1e-20 (sigmoid 1); it is recomputed from the logits where needed.
 * Sequences: token t belongs to sequence t / seq_length (seq_length = T: one sequence).
 */
typedef struct moert_router_cuda_loss_params {
    int64_t tokens, num_experts, topk;
    int64_t seq_length; /* S >= 1, dividing tokens (when tokens > 0) */
    int sigmoid;        /* 0: P = softmax(logits); 1: P = sigmoid(logits) / (sum + 1e-20) */
    int logits_f64;     /* logits and d_logits are fp64 (else fp32) */
} moert_router_cuda_loss_params;

/*
 * counts [B*E + 1] int64 (B = T/S): counts[b*E + e] = tokens of sequence b whose plain top-K over P (no
 * bias, groups or capacity; ties to the lower index) holds e; counts[B*E] = T. Zeroed first. P is monotone
 * in the logits for both score functions, so the top-K is taken over the logits.
 */
moert_result moert_router_cuda_aux_counts(const moert_host *host, cudaStream_t stream,
                                          const moert_router_cuda_loss_params *p, const void *logits, int64_t *counts);
/*
 * The f and the scale A of the balancing loss, on the device (one block):
 *   global_sum NULL: f[i] = counts[i] for i < n, *scale = scale_value;
 *   else (global_aux_loss, n = E, counts all-reduced): global_sum[i] += counts[i], f[i] = global_sum[i] / forwards,
 *        *scale = scale_value / counts[n]^2 (0 when counts[n], the all-reduced token count, is 0).
 */
moert_result moert_router_cuda_aux_finish(const moert_host *host, cudaStream_t stream, int64_t n, const int64_t *counts,
                                          double *global_sum, double forwards, double scale_value, double *f,
                                          double *scale);

/* Doubles of workspace moert_router_cuda_loss_values needs. */
#define MOERT_ROUTER_CUDA_LOSS_WORKSPACE_DOUBLES 256

/*
 * out[0] = (*aux_scale) * sum_t sum_e P[t,e] * f[t/S, e] (0 when f is NULL), out[1] = sum_t lse_t^2 with
 * lse_t = logsumexp_e logits[t,e] (0 unless want_z). fp32 scores, double sums over a fixed grid and a fixed
 * order, so the bits depend neither on the run nor on the GPU.
 */
moert_result moert_router_cuda_loss_values(const moert_host *host, cudaStream_t stream,
                                           const moert_router_cuda_loss_params *p, const void *logits, const double *f,
                                           const double *aux_scale, int want_z, double *workspace, double *out);
/*
 * d_logits [T,E] += aux_grad_scale * d(A sum P f)/d(logits) (when f is given; A read from *aux_scale)
 *                 + z_grad * lse_t * softmax(logits[t])   (z_grad = loss_scale * 2 * z_coeff / T; 0: off).
 */
moert_result moert_router_cuda_loss_backward(const moert_host *host, cudaStream_t stream,
                                             const moert_router_cuda_loss_params *p, const void *logits,
                                             const double *f, const double *aux_scale, double aux_grad_scale,
                                             double z_grad, void *d_logits);

/*
 * Aux-loss-free bias update (one block): with mean = sum(counts) / E,
 * bias[e] += rate * sign(mean - counts[e]) (sign(0) = 0), then counts[e] = 0. E <= 1024.
 */
moert_result moert_router_cuda_bias_update(const moert_host *host, cudaStream_t stream, int64_t num_experts,
                                           int64_t *counts, double rate, float *bias);

#ifdef __cplusplus
}
#endif
#endif
