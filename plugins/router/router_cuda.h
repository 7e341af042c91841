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
#define MOERT_ROUTER_CUDA_MAX_TOPK 8
#define MOERT_ROUTER_CUDA_MAX_GROUPS 32

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
} moert_router_cuda_loss_params;

/*
 * counts [B*E + 1] int64 (B = T/S): counts[b*E + e] = tokens of sequence b whose plain top-K over P (no
 * bias, groups or capacity; ties to the lower index) holds e; counts[B*E] = T. Zeroed first. P is monotone
 * in the logits for both score functions, so the top-K is taken over the logits.
 */
moert_result moert_router_cuda_aux_counts(const moert_host *host, cudaStream_t stream,
                                          const moert_router_cuda_loss_params *p, const float *logits,
                                          int64_t *counts);
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
                                           const moert_router_cuda_loss_params *p, const float *logits,
                                           const double *f, const double *aux_scale, int want_z, double *workspace,
                                           double *out);
/*
 * d_logits [T,E] += aux_grad_scale * d(A sum P f)/d(logits) (when f is given; A read from *aux_scale)
 *                 + z_grad * lse_t * softmax(logits[t])   (z_grad = loss_scale * 2 * z_coeff / T; 0: off).
 */
moert_result moert_router_cuda_loss_backward(const moert_host *host, cudaStream_t stream,
                                             const moert_router_cuda_loss_params *p, const float *logits,
                                             const double *f, const double *aux_scale, double aux_grad_scale,
                                             double z_grad, float *d_logits);

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
