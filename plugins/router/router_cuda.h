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

#ifdef __cplusplus
}
#endif
#endif
