/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA router: one warp per token; lane l holds experts l, l+32, ... (8 slots for E <= 256). */
#include "router_cuda.h"
#include "router_noise.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>

#define LOSS_WARPS 16 /* the warps of a block of loss_values_kernel (a fixed grid of LOSS_BLOCKS blocks) */
/* Kernels that take a warp per token run TOKEN_WARPS warps a block, one token a warp: a token's work is a chain of
 * dependent warp reductions, so the more tokens an SM has in flight the better (the layout before, 8 tokens a warp in
 * blocks of 4 warps, kept too few; bench/router_bench, docs/plugins/router.md). */
#define TOKEN_WARPS   8
#define MAXK          MOERT_ROUTER_CUDA_MAX_TOPK
#define FULL_MASK     0xffffffffu
#define NORMALIZE_EPS 1e-20f

#include "../lib/plugin_cuda_check.h"

/* The parameters the kernels read, checked and narrowed on the host. */
typedef struct kernel_params {
    int tokens, experts, topk, score, groups, group_topk, normalize;
    double scale;
} kernel_params;

/* exp, log and max in the arithmetic of the scalar type (the kernels run in fp32, or fp64 for compute_dtype fp64). */
__device__ __forceinline__ float s_exp(float v) { return expf(v); }
__device__ __forceinline__ double s_exp(double v) { return exp(v); }
__device__ __forceinline__ float s_log(float v) { return logf(v); }
__device__ __forceinline__ double s_log(double v) { return log(v); }
__device__ __forceinline__ float s_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double s_max(double a, double b) { return fmax(a, b); }

/* Strict order of candidates: higher value first, then lower index; index < 0 is "none". */
template <typename S> __device__ __forceinline__ bool better(S v, int i, S best_v, int best_i)
{
    if (i < 0) return false;
    if (best_i < 0) return true;
    return v > best_v || (v == best_v && i < best_i);
}

/* Warp-wide best of (value, index, payload); every lane gets the same answer. */
template <typename S> __device__ __forceinline__ void warp_best(S &v, int &i, S &payload)
{
    for (int o = 16; o > 0; o >>= 1) {
        S ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        S op = __shfl_xor_sync(FULL_MASK, payload, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
            payload = op;
        }
    }
}

/* The value of the slot that holds expert e in the lane that owns it, broadcast to the warp. */
template <typename S, int NS> __device__ __forceinline__ S value_of_expert(const S (&v)[NS], int e)
{
    S mine = (S)0;
    const int slot = e >= 0 ? (e >> 5) : 0;
#pragma unroll
    for (int j = 0; j < NS; j++)
        if (j == slot) mine = v[j];
    return __shfl_sync(FULL_MASK, mine, e >= 0 ? (e & 31) : 0);
}

/* A candidate of a float top-k as one 64-bit key, the larger the better: the value's bits in an order that compares
 * as the values do (-0 as +0; NaN below every number), then the complement of the expert index, so that equal values
 * go to the lower index as in better(). 0 is "none". */
__device__ __forceinline__ unsigned long long candidate_key(float v, int e)
{
    uint32_t u = 0;
    if (v == v) {
        u = __float_as_uint(v == 0.0f ? 0.0f : v);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    }
    return ((unsigned long long)u << 32) | (0xffffffffu - (uint32_t)e);
}

/* The warp's largest key, in every lane: the largest value part, then the largest index part among its lanes. */
__device__ __forceinline__ unsigned long long warp_best_key(unsigned long long key)
{
    const uint32_t hi = (uint32_t)(key >> 32), lo = (uint32_t)key;
    const uint32_t best_hi = __reduce_max_sync(FULL_MASK, hi);
    const uint32_t best_lo = __reduce_max_sync(FULL_MASK, hi == best_hi ? lo : 0u);
    return ((unsigned long long)best_hi << 32) | best_lo;
}

/* Top-k of one token over the lanes' allowed slots (bit j of `allowed`: slot j of this lane) of sel: K rounds of a
 * warp-wide best, the higher value first, then the lower index. top_idx[k] gets the k-th expert (-1 where fewer are
 * allowed), top_pay[k] pay at it; the same in every lane. fp32 compares one packed key a slot (two warp reductions a
 * round); fp64 the (value, index, payload) triples. */
template <typename S, int NS>
__device__ __forceinline__ void topk_slots(int topk, int lane, unsigned allowed, const S (&sel)[NS], const S (&pay)[NS],
                                           int (&top_idx)[MAXK], S (&top_pay)[MAXK])
{
    if constexpr (sizeof(S) == sizeof(float)) {
        unsigned long long key[NS];
#pragma unroll
        for (int j = 0; j < NS; j++) key[j] = ((allowed >> j) & 1u) ? candidate_key(sel[j], j * 32 + lane) : 0ull;
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            top_idx[k] = -1;
            top_pay[k] = (S)0;
            if (k >= topk) continue;
            unsigned long long mine = 0ull;
#pragma unroll
            for (int j = 0; j < NS; j++) mine = key[j] > mine ? key[j] : mine;
            const unsigned long long best = warp_best_key(mine);
            const int bi = best != 0ull ? (int)(0xffffffffu - (uint32_t)best) : -1;
            top_idx[k] = bi;
            top_pay[k] = value_of_expert(pay, bi);
#pragma unroll
            for (int j = 0; j < NS; j++)
                if (bi >= 0 && (bi & 31) == lane && (bi >> 5) == j) key[j] = 0ull;
        }
    } else {
        unsigned taken = 0;
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            top_idx[k] = -1;
            top_pay[k] = (S)0;
            if (k >= topk) continue;
            S bv = (S)0, bp = (S)0;
            int bi = -1;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                const int e = j * 32 + lane;
                const bool open = ((allowed >> j) & 1u) && !((taken >> j) & 1u);
                if (open && better(sel[j], e, bv, bi)) {
                    bv = sel[j];
                    bi = e;
                    bp = pay[j];
                }
            }
            warp_best(bv, bi, bp);
            top_idx[k] = bi;
            top_pay[k] = bp;
            if (bi >= 0 && (bi & 31) == lane) taken |= 1u << (bi >> 5);
        }
    }
}

template <typename S> __device__ __forceinline__ S warp_max(S x)
{
    for (int o = 16; o > 0; o >>= 1) x = s_max(x, __shfl_xor_sync(FULL_MASK, x, o));
    return x;
}

template <typename S> __device__ __forceinline__ S warp_sum(S x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}

/* Loads a token's logits into the lane's slots (-inf past E). */
template <typename S, int NS>
__device__ __forceinline__ void load_logits(const S *row, int experts, int lane, S (&l)[NS])
{
#pragma unroll
    for (int j = 0; j < NS; j++) {
        int e = j * 32 + lane;
        l[j] = e < experts ? row[e] : -INFINITY;
    }
}

/* Full softmax over the experts, in place (slots past E get 0). */
template <typename S, int NS>
__device__ __forceinline__ void softmax_slots(int experts, int lane, const S (&l)[NS], S (&s)[NS])
{
    S m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NS; j++) m = s_max(m, l[j]);
    m = warp_max(m);
    S sum = (S)0;
#pragma unroll
    for (int j = 0; j < NS; j++) {
        s[j] = (j * 32 + lane < experts) ? s_exp(l[j] - m) : (S)0;
        sum += s[j];
    }
    sum = warp_sum(sum);
    const S inv = (S)1 / sum;
#pragma unroll
    for (int j = 0; j < NS; j++) s[j] *= inv;
}

template <typename S> __device__ __forceinline__ S sigmoid(S x) { return (S)1 / ((S)1 + s_exp(-x)); }

/* Group-limited selection: the bit mask (bit j: slot j of this lane) of experts in the best Kg groups. */
template <typename S, int NS>
__device__ unsigned group_allowed_mask(const kernel_params &p, int lane, const S (&sel)[NS], S *stage, unsigned allowed)
{
#pragma unroll
    for (int j = 0; j < NS; j++) {
        int e = j * 32 + lane;
        if (e < p.experts) stage[e] = sel[j];
    }
    __syncwarp();
    const int group_size = p.experts / p.groups, per_group = p.topk / p.group_topk;
    /* lane g: sum of the top per_group scores of group g, walking the (value desc, index asc) order */
    S group_score = -INFINITY;
    int group_id = -1;
    if (lane < p.groups) {
        const S *g = stage + lane * group_size;
        S prev_v = INFINITY, sum = (S)0;
        int prev_i = -1;
        for (int r = 0; r < per_group; r++) {
            S bv = (S)0;
            int bi = -1;
            for (int i = 0; i < group_size; i++) {
                const bool after = g[i] < prev_v || (g[i] == prev_v && i > prev_i);
                if (after && better(g[i], i, bv, bi)) {
                    bv = g[i];
                    bi = i;
                }
            }
            sum += bv;
            prev_v = bv;
            prev_i = bi;
        }
        group_score = sum;
        group_id = lane;
    }
    __syncwarp(); /* stage is rewritten by the next token */
    unsigned groups_kept = 0;
    for (int r = 0; r < p.group_topk; r++) {
        S v = group_score, unused = (S)0;
        int i = ((groups_kept >> lane) & 1u) ? -1 : group_id;
        warp_best(v, i, unused);
        if (i >= 0) groups_kept |= 1u << i;
    }
    unsigned mask = 0;
#pragma unroll
    for (int j = 0; j < NS; j++) {
        int e = j * 32 + lane;
        if (((allowed >> j) & 1u) && ((groups_kept >> (e / group_size)) & 1u)) mask |= 1u << j;
    }
    return mask;
}

/* A block's counts of the experts chosen, in shared memory: zeroed by block_counts_begin, added to by
 * block_counts_add, added into the global counts (one add per expert chosen in the block) by block_counts_end. Each
 * call is made by every thread of the block. */
__device__ __forceinline__ void block_counts_begin(unsigned *hist, int experts)
{
    for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
    __syncthreads();
}

__device__ __forceinline__ void block_counts_add(unsigned *hist, int e) { atomicAdd(&hist[e], 1u); }

__device__ __forceinline__ void block_counts_end(const unsigned *hist, int experts, unsigned long long *counts)
{
    __syncthreads();
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
        if (hist[e] != 0) atomicAdd(&counts[e], (unsigned long long)hist[e]);
}

template <typename S, int NS>
__global__ void router_forward_kernel(const kernel_params p, const S *__restrict__ logits,
                                      const float *__restrict__ bias, int32_t *__restrict__ idx_out,
                                      float *__restrict__ probs_out, unsigned long long *__restrict__ counts,
                                      float *__restrict__ scores_out, const double *__restrict__ sinkhorn_d0,
                                      const double *__restrict__ sinkhorn_d1)
{
    __shared__ S stage[TOKEN_WARPS][MOERT_ROUTER_CUDA_MAX_EXPERTS];
    __shared__ unsigned hist[MOERT_ROUTER_CUDA_MAX_EXPERTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (counts) block_counts_begin(hist, p.experts);
    for (int64_t t = (int64_t)blockIdx.x * warps + warp; t < p.tokens; t += (int64_t)gridDim.x * warps) {
        S l[NS], s[NS], sel[NS];
        load_logits(logits + t * p.experts, p.experts, lane, l);
        if (p.score == MOERT_ROUTER_CUDA_SIGMOID) {
#pragma unroll
            for (int j = 0; j < NS; j++) s[j] = (j * 32 + lane < p.experts) ? sigmoid(l[j]) : (S)0;
        } else {
            softmax_slots(p.experts, lane, l, s);
        }
        unsigned allowed = 0;
#pragma unroll
        for (int j = 0; j < NS; j++) {
            int e = j * 32 + lane;
            if (e < p.experts) allowed |= 1u << j;
            if (sinkhorn_d1) /* sinkhorn: the balanced scores d1 * exp(l) * d0, formed in double as on the CPU */
                sel[j] = e < p.experts ? (S)(sinkhorn_d1[e] * exp((double)l[j]) * sinkhorn_d0[t]) : (S)-INFINITY;
            else if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST)
                sel[j] = l[j];
            else if (p.score == MOERT_ROUTER_CUDA_SIGMOID && bias)
                sel[j] = e < p.experts ? s[j] + bias[e] : -INFINITY;
            else
                sel[j] = s[j];
            if (scores_out && e < p.experts) scores_out[t * p.experts + e] = (float)s[j];
        }
        if (p.groups > 1) allowed = group_allowed_mask(p, lane, sel, stage[warp], allowed);

        /* top-k over the allowed slots; the payloads are the logits (softmax post) or the scores */
        int top_idx[MAXK];
        S top_pay[MAXK];
        topk_slots(p.topk, lane, allowed, sel, p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST ? l : s, top_idx, top_pay);

        /* probs from the payloads: logits (softmax post) or scores */
        S prob[MAXK];
        if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST) {
            S m = -INFINITY, sum = (S)0;
#pragma unroll
            for (int k = 0; k < MAXK; k++)
                if (top_idx[k] >= 0) m = s_max(m, top_pay[k]);
#pragma unroll
            for (int k = 0; k < MAXK; k++) {
                prob[k] = top_idx[k] >= 0 ? s_exp(top_pay[k] - m) : (S)0;
                sum += prob[k];
            }
#pragma unroll
            for (int k = 0; k < MAXK; k++) prob[k] /= sum;
        } else {
            S sum = (S)0;
#pragma unroll
            for (int k = 0; k < MAXK; k++) {
                prob[k] = top_idx[k] >= 0 ? top_pay[k] : (S)0;
                sum += prob[k];
            }
            if (p.normalize && p.topk > 1) {
#pragma unroll
                for (int k = 0; k < MAXK; k++) prob[k] /= (sum + NORMALIZE_EPS);
            }
        }
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            if (k < p.topk && lane == k) {
                idx_out[t * p.topk + k] = top_idx[k];
                probs_out[t * p.topk + k] = (float)(prob[k] * (S)p.scale);
                if (counts && top_idx[k] >= 0) block_counts_add(hist, top_idx[k]);
            }
        }
    }
    if (counts) block_counts_end(hist, p.experts, counts);
}

template <typename S, int NS>
__global__ void router_backward_kernel(const kernel_params p, const S *__restrict__ logits,
                                       const int32_t *__restrict__ idx_in, const float *__restrict__ d_probs,
                                       const int32_t *__restrict__ kept_idx, S *__restrict__ d_logits, int accumulate)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int64_t t = (int64_t)blockIdx.x * warps + warp; t < p.tokens; t += (int64_t)gridDim.x * warps) {
        S l[NS], s[NS];
        load_logits(logits + t * p.experts, p.experts, lane, l);
        if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_PRE) softmax_slots(p.experts, lane, l, s);
        int idx[MAXK];
        S q[MAXK], dp[MAXK], dq[MAXK];
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            idx[k] = k < p.topk ? idx_in[t * p.topk + k] : -1;
            if (idx[k] >= p.experts) idx[k] = -1;
            /* a copy dropped by capacity (kept_idx < 0) keeps its place in the normalisation but gets no gradient */
            const bool dropped = kept_idx && k < p.topk && kept_idx[t * p.topk + k] < 0;
            dp[k] = idx[k] >= 0 && !dropped ? (S)d_probs[t * p.topk + k] * (S)p.scale : (S)0;
            /* idx[k] is the same in every lane, so these branches (and their shuffles) are warp-uniform */
            S lk = value_of_expert(l, idx[k]);
            q[k] = (S)0;
            if (idx[k] >= 0) {
                if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST)
                    q[k] = lk;
                else if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_PRE)
                    q[k] = value_of_expert(s, idx[k]);
                else
                    q[k] = sigmoid(lk);
            }
        }
        /* dq: gradient with respect to the selected logits (post) or selected scores (pre, sigmoid) */
        if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST) {
            S m = -INFINITY, sum = (S)0, prob[MAXK], dot = (S)0;
#pragma unroll
            for (int k = 0; k < MAXK; k++)
                if (idx[k] >= 0) m = s_max(m, q[k]);
#pragma unroll
            for (int k = 0; k < MAXK; k++) {
                prob[k] = idx[k] >= 0 ? s_exp(q[k] - m) : (S)0;
                sum += prob[k];
            }
#pragma unroll
            for (int k = 0; k < MAXK; k++) {
                prob[k] = sum > (S)0 ? prob[k] / sum : (S)0;
                dot += prob[k] * dp[k];
            }
#pragma unroll
            for (int k = 0; k < MAXK; k++) dq[k] = prob[k] * (dp[k] - dot);
        } else if (p.normalize && p.topk > 1) {
            S sum = (S)0, dot = (S)0;
#pragma unroll
            for (int k = 0; k < MAXK; k++) {
                sum += q[k];
                dot += dp[k] * q[k];
            }
            const S Q = sum + NORMALIZE_EPS;
#pragma unroll
            for (int k = 0; k < MAXK; k++) dq[k] = idx[k] >= 0 ? dp[k] / Q - dot / (Q * Q) : (S)0;
        } else {
#pragma unroll
            for (int k = 0; k < MAXK; k++) dq[k] = dp[k];
        }
        /* softmax pre: the chain through the full softmax needs sum_k dq_k q_k */
        S dq_dot_q = (S)0;
#pragma unroll
        for (int k = 0; k < MAXK; k++) dq_dot_q += dq[k] * q[k];
#pragma unroll
        for (int j = 0; j < NS; j++) {
            const int e = j * 32 + lane;
            if (e >= p.experts) continue;
            S ds = (S)0;
#pragma unroll
            for (int k = 0; k < MAXK; k++)
                if (idx[k] == e) ds += dq[k];
            S g;
            if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_POST) {
                g = ds;
            } else if (p.score == MOERT_ROUTER_CUDA_SOFTMAX_PRE) {
                g = s[j] * (ds - dq_dot_q);
            } else {
                const S sg = sigmoid(l[j]);
                g = ds * sg * ((S)1 - sg);
            }
            S *out = d_logits + t * p.experts + e;
            *out = accumulate ? *out + g : g;
        }
    }
}

/* Checks the parameters against the kernels' limits and narrows them. */
static moert_result check_params(const moert_host *host, const moert_router_cuda_params *p, kernel_params *kp)
{
    if (!p) return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda: params are required");
    if (p->tokens < 0 || p->tokens > INT32_MAX || p->num_experts < 1 || p->topk < 1 || p->topk > p->num_experts)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda: bad sizes (tokens %lld, experts %lld, topk %lld)",
                      (long long)p->tokens, (long long)p->num_experts, (long long)p->topk);
    if (p->num_experts > MOERT_ROUTER_CUDA_MAX_EXPERTS || p->topk > MOERT_ROUTER_CUDA_MAX_TOPK)
        return report(
            host, MOERT_ERR_UNSUPPORTED, "router cuda: %lld experts, top-%lld exceed the limits (%d experts, top-%d)",
            (long long)p->num_experts, (long long)p->topk, MOERT_ROUTER_CUDA_MAX_EXPERTS, MOERT_ROUTER_CUDA_MAX_TOPK);
    if (p->score != MOERT_ROUTER_CUDA_SOFTMAX_POST && p->score != MOERT_ROUTER_CUDA_SOFTMAX_PRE &&
        p->score != MOERT_ROUTER_CUDA_SIGMOID)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda: unknown score function %d", (int)p->score);
    const int64_t groups = p->num_groups > 1 ? p->num_groups : 1;
    if (groups > 1) {
        if (groups > MOERT_ROUTER_CUDA_MAX_GROUPS || p->num_experts % groups != 0 || p->group_topk < 1 ||
            p->group_topk > groups || p->topk % p->group_topk != 0 || p->topk / p->group_topk > p->num_experts / groups)
            return report(host, MOERT_ERR_INVALID_ARGUMENT,
                          "router cuda: group-limited top-k needs groups <= %d dividing %lld experts, 1 <= group_topk "
                          "<= groups and topk a multiple of group_topk (groups %lld, group_topk %lld, topk %lld)",
                          MOERT_ROUTER_CUDA_MAX_GROUPS, (long long)p->num_experts, (long long)groups,
                          (long long)p->group_topk, (long long)p->topk);
    }
    kp->tokens = (int)p->tokens;
    kp->experts = (int)p->num_experts;
    kp->topk = (int)p->topk;
    kp->score = (int)p->score;
    kp->groups = (int)groups;
    kp->group_topk = groups > 1 ? (int)p->group_topk : 1;
    kp->normalize = p->normalize ? 1 : 0;
    kp->scale = p->scaling_factor != 0.0 ? p->scaling_factor : 1.0;
    return MOERT_OK;
}

static int grid_for_tokens(int64_t tokens)
{
    int64_t blocks = (tokens + TOKEN_WARPS - 1) / TOKEN_WARPS;
    return (int)(blocks < 16384 ? (blocks > 0 ? blocks : 1) : 16384);
}

/* Launches a kernel with the slots its experts need (a lane holds one expert of every 32 in a slot), so a layer of
 * 128 experts runs 4 slots a lane rather than the 8 of the most experts. */
#define LAUNCH_BY_SLOTS(kernel, S, experts, grid, threads, stream, ...)                                                \
    do {                                                                                                               \
        const int slots_ = ((experts) + 31) / 32;                                                                      \
        if (slots_ <= 1)                                                                                               \
            kernel<S, 1><<<(grid), (threads), 0, stream>>>(__VA_ARGS__);                                               \
        else if (slots_ <= 2)                                                                                          \
            kernel<S, 2><<<(grid), (threads), 0, stream>>>(__VA_ARGS__);                                               \
        else if (slots_ <= 4)                                                                                          \
            kernel<S, 4><<<(grid), (threads), 0, stream>>>(__VA_ARGS__);                                               \
        else                                                                                                           \
            kernel<S, MOERT_ROUTER_CUDA_MAX_EXPERTS / 32><<<(grid), (threads), 0, stream>>>(__VA_ARGS__);              \
    } while (0)

/* A kernel that takes a warp per token, over the tokens. */
#define LAUNCH_TOKEN_KERNEL(kernel, S, experts, tokens, stream, ...)                                                   \
    LAUNCH_BY_SLOTS(kernel, S, experts, grid_for_tokens(tokens), TOKEN_WARPS * 32, stream, __VA_ARGS__)

/* Scores, top-k, probs and counts, with the plugin path's extras; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_forward_ext(const moert_host *host, cudaStream_t stream,
                                                      const moert_router_cuda_params *p,
                                                      const moert_router_cuda_route_ext *ext, const void *logits,
                                                      const float *expert_bias, int32_t *topk_idx, float *topk_probs,
                                                      int64_t *tokens_per_expert, float *scores)
{
    kernel_params kp;
    moert_result rc = check_params(host, p, &kp);
    if (rc != MOERT_OK) return rc;
    if (tokens_per_expert)
        CUDA_CHECK(host, cudaMemsetAsync(tokens_per_expert, 0, (size_t)kp.experts * sizeof(int64_t), stream));
    if (kp.tokens == 0) return MOERT_OK;
    if (!logits || !topk_idx || !topk_probs)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "router cuda forward: logits, topk_idx and topk_probs are required");
    const double *d0 = ext ? ext->sinkhorn_d0 : NULL, *d1 = ext ? ext->sinkhorn_d1 : NULL;
    if ((d0 == NULL) != (d1 == NULL))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda forward: sinkhorn needs both d0 and d1");
    const float *bias = kp.score == MOERT_ROUTER_CUDA_SIGMOID && !d1 ? expert_bias : NULL;
    if (ext && ext->logits_f64)
        LAUNCH_TOKEN_KERNEL(router_forward_kernel, double, kp.experts, kp.tokens, stream, kp, (const double *)logits,
                            bias, topk_idx, topk_probs, (unsigned long long *)tokens_per_expert, scores, d0, d1);
    else
        LAUNCH_TOKEN_KERNEL(router_forward_kernel, float, kp.experts, kp.tokens, stream, kp, (const float *)logits,
                            bias, topk_idx, topk_probs, (unsigned long long *)tokens_per_expert, scores, d0, d1);
    LAUNCH_CHECK(host, "router_forward_kernel");
    return MOERT_OK;
}

/* The plain fp32 route; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_forward(const moert_host *host, cudaStream_t stream,
                                                  const moert_router_cuda_params *p, const float *logits,
                                                  const float *expert_bias, int32_t *topk_idx, float *topk_probs,
                                                  int64_t *tokens_per_expert, float *scores)
{
    return moert_router_cuda_forward_ext(host, stream, p, NULL, logits, expert_bias, topk_idx, topk_probs,
                                         tokens_per_expert, scores);
}

/* d_logits from d_topk_probs, with the plugin path's extras; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_backward_ext(const moert_host *host, cudaStream_t stream,
                                                       const moert_router_cuda_params *p,
                                                       const moert_router_cuda_route_ext *ext, const void *logits,
                                                       const int32_t *topk_idx, const float *d_topk_probs,
                                                       void *d_logits, int accumulate)
{
    kernel_params kp;
    moert_result rc = check_params(host, p, &kp);
    if (rc != MOERT_OK) return rc;
    if (kp.tokens == 0) return MOERT_OK;
    if (!logits || !topk_idx || !d_topk_probs || !d_logits)
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "router cuda backward: logits, topk_idx, d_topk_probs and d_logits are required");
    const int32_t *kept = ext ? ext->kept_idx : NULL;
    if (ext && ext->logits_f64)
        LAUNCH_TOKEN_KERNEL(router_backward_kernel, double, kp.experts, kp.tokens, stream, kp, (const double *)logits,
                            topk_idx, d_topk_probs, kept, (double *)d_logits, accumulate);
    else
        LAUNCH_TOKEN_KERNEL(router_backward_kernel, float, kp.experts, kp.tokens, stream, kp, (const float *)logits,
                            topk_idx, d_topk_probs, kept, (float *)d_logits, accumulate);
    LAUNCH_CHECK(host, "router_backward_kernel");
    return MOERT_OK;
}

/* The plain fp32 backward; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_backward(const moert_host *host, cudaStream_t stream,
                                                   const moert_router_cuda_params *p, const float *logits,
                                                   const int32_t *topk_idx, const float *d_topk_probs, float *d_logits,
                                                   int accumulate)
{
    return moert_router_cuda_backward_ext(host, stream, p, NULL, logits, topk_idx, d_topk_probs, d_logits, accumulate);
}

/* ---- helpers of the plugin's CUDA path: conversions, counts, balancing losses, bias update ---- */

#define ELEMENTWISE_THREADS 256
#define LOSS_BLOCKS         (MOERT_ROUTER_CUDA_LOSS_WORKSPACE_DOUBLES / 2)

/* A grid for n elements, one per thread, capped (the kernels stride over the rest). */
static int grid_for_elements(int64_t n)
{
    int64_t blocks = (n + ELEMENTWISE_THREADS - 1) / ELEMENTWISE_THREADS;
    return (int)(blocks < 65535 ? (blocks > 0 ? blocks : 1) : 65535);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* fp32 -> bf16 bits, round to nearest even, NaN kept (as moert_bf16_from_float on the host). */
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f)
{
    uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

__global__ void to_f32_kernel(int64_t n, int bf16, const void *__restrict__ src, float *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] = bf16 ? bf16_bits_to_float(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

/* dst (bf16) += src, eight elements a thread in 16- and 32-byte accesses (n8: n / 8; both pointers aligned so). */
__global__ void accumulate_bf16_vec8_kernel(int64_t n8, const float4 *__restrict__ src, uint4 *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (int64_t)gridDim.x * blockDim.x) {
        const float4 a = src[2 * i], b = src[2 * i + 1];
        const float add[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        uint4 d = dst[i];
        uint32_t *w = (uint32_t *)&d;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint16_t lo = float_to_bf16_bits(bf16_bits_to_float((uint16_t)(w[j] & 0xffffu)) + add[2 * j]);
            const uint16_t hi = float_to_bf16_bits(bf16_bits_to_float((uint16_t)(w[j] >> 16)) + add[2 * j + 1]);
            w[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
        dst[i] = d;
    }
}

__global__ void accumulate_kernel(int64_t n, int bf16, const float *__restrict__ src, void *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (bf16) {
            uint16_t *d = (uint16_t *)dst;
            d[i] = float_to_bf16_bits(bf16_bits_to_float(d[i]) + src[i]);
        } else {
            ((float *)dst)[i] += src[i];
        }
    }
}

/* src [rows, cols] fp32 -> dst [rows, 3 * cols] bf16: plane p (columns p*cols ..) holds bf16 term order[p] of src,
 * the terms hi, mid, lo each the nearest bf16 to what the terms before it left (src = hi + mid + lo to 24 bits). */
__global__ void split_bf16_kernel(int64_t rows, int64_t cols, int order0, int order1, int order2,
                                  const float *__restrict__ src, uint16_t *__restrict__ dst)
{
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i % cols;
        float rest = src[i];
        uint16_t terms[3];
        for (int t = 0; t < 3; t++) {
            terms[t] = float_to_bf16_bits(rest);
            rest -= bf16_bits_to_float(terms[t]); /* exact: the term holds rest's leading bits */
        }
        uint16_t *row = dst + r * 3 * cols + c;
        row[0] = terms[order0];
        row[cols] = terms[order1];
        row[2 * cols] = terms[order2];
    }
}

/* dst [rows, cols] fp32 (+)= the sum of src's planes [rows, planes * cols], added in plane order. */
__global__ void sum_planes_kernel(int64_t rows, int64_t cols, int planes, int accumulate, const float *__restrict__ src,
                                  float *__restrict__ dst)
{
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const int64_t r = i / cols, c = i % cols;
        float sum = 0.0f;
        for (int p = 0; p < planes; p++) sum += src[r * planes * cols + p * cols + c];
        dst[i] = accumulate ? dst[i] + sum : sum;
    }
}

__global__ void add_counts_kernel(int64_t n, const long long *__restrict__ src, long long *__restrict__ dst)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dst[i] += src[i];
}

/* The full score distribution P of one token in the lane's slots (0 past E). */
template <typename S, int NS>
__device__ __forceinline__ void aux_scores_slots(int sigmoid_scores, int experts, int lane, const S (&l)[NS],
                                                 S (&P)[NS])
{
    if (!sigmoid_scores) {
        softmax_slots(experts, lane, l, P);
        return;
    }
    S sum = (S)0;
#pragma unroll
    for (int j = 0; j < NS; j++) {
        P[j] = (j * 32 + lane < experts) ? sigmoid(l[j]) : (S)0;
        sum += P[j];
    }
    const S denom = warp_sum(sum) + NORMALIZE_EPS;
#pragma unroll
    for (int j = 0; j < NS; j++) P[j] /= denom;
}

/* logsumexp of one token's logits, the same in every lane. */
template <typename S, int NS> __device__ __forceinline__ S logsumexp_slots(int experts, int lane, const S (&l)[NS])
{
    S m = -INFINITY;
#pragma unroll
    for (int j = 0; j < NS; j++) m = s_max(m, l[j]);
    m = warp_max(m);
    S sum = (S)0;
#pragma unroll
    for (int j = 0; j < NS; j++)
        if (j * 32 + lane < experts) sum += s_exp(l[j] - m);
    return m + s_log(warp_sum(sum));
}

__device__ __forceinline__ double warp_sum_double(double x)
{
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}

/* The loss kernels' sizes, narrowed. */
typedef struct loss_kernel_params {
    int tokens, experts, topk, seq, sigmoid, f64;
} loss_kernel_params;

template <typename S, int NS>
__global__ void aux_counts_kernel(const loss_kernel_params p, const S *__restrict__ logits,
                                  unsigned long long *__restrict__ counts, long long *__restrict__ total_slot)
{
    __shared__ unsigned hist[MOERT_ROUTER_CUDA_MAX_EXPERTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const bool one_row = p.seq >= p.tokens; /* one row of counts: a block histogram (else rows x E, spread out) */
    if (blockIdx.x == 0 && threadIdx.x == 0) *total_slot = p.tokens;
    if (one_row) block_counts_begin(hist, p.experts);
    for (int64_t t = (int64_t)blockIdx.x * warps + warp; t < p.tokens; t += (int64_t)gridDim.x * warps) {
        S l[NS];
        load_logits(logits + t * p.experts, p.experts, lane, l);
        unsigned allowed = 0;
#pragma unroll
        for (int j = 0; j < NS; j++)
            if (j * 32 + lane < p.experts) allowed |= 1u << j;
        int top_idx[MAXK];
        S unused[MAXK];
        topk_slots(p.topk, lane, allowed, l, l, top_idx, unused);
#pragma unroll
        for (int k = 0; k < MAXK; k++) {
            const int e = top_idx[k];
            if (k < p.topk && lane == k && e >= 0) {
                if (one_row)
                    block_counts_add(hist, e);
                else
                    atomicAdd(&counts[(t / p.seq) * p.experts + e], 1ull);
            }
        }
    }
    if (one_row) block_counts_end(hist, p.experts, counts);
}

__global__ void aux_finish_kernel(int64_t n, const long long *__restrict__ counts, double *__restrict__ global_sum,
                                  double forwards, double scale_value, double *__restrict__ f,
                                  double *__restrict__ scale)
{
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        if (global_sum) {
            global_sum[i] += (double)counts[i];
            f[i] = global_sum[i] / forwards;
        } else {
            f[i] = (double)counts[i];
        }
    }
    if (threadIdx.x == 0) {
        if (global_sum) {
            const double tokens = (double)counts[n];
            *scale = tokens > 0.0 ? scale_value / (tokens * tokens) : 0.0;
        } else {
            *scale = scale_value;
        }
    }
}

/* Per-block partial sums of the aux and z terms over a fixed grid (LOSS_BLOCKS blocks). */
template <typename S, int NS>
__global__ void loss_values_kernel(const loss_kernel_params p, const S *__restrict__ logits,
                                   const double *__restrict__ f, int want_z, double *__restrict__ partials)
{
    __shared__ double block_aux[LOSS_WARPS], block_z[LOSS_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double aux_acc = 0.0, z_acc = 0.0;
    for (int64_t t = (int64_t)blockIdx.x * LOSS_WARPS + warp; t < p.tokens; t += (int64_t)gridDim.x * LOSS_WARPS) {
        S l[NS];
        load_logits(logits + t * p.experts, p.experts, lane, l);
        if (f) {
            S P[NS];
            aux_scores_slots(p.sigmoid, p.experts, lane, l, P);
            const double *ft = f + (t / p.seq) * p.experts;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                const int e = j * 32 + lane;
                if (e < p.experts) aux_acc += (double)P[j] * ft[e];
            }
        }
        if (want_z) {
            const double lse = (double)logsumexp_slots(p.experts, lane, l);
            if (lane == 0) z_acc += lse * lse;
        }
    }
    aux_acc = warp_sum_double(aux_acc);
    z_acc = warp_sum_double(z_acc);
    if (lane == 0) {
        block_aux[warp] = aux_acc;
        block_z[warp] = z_acc;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double a = 0.0, z = 0.0;
        for (int w = 0; w < LOSS_WARPS; w++) {
            a += block_aux[w];
            z += block_z[w];
        }
        partials[2 * blockIdx.x] = a;
        partials[2 * blockIdx.x + 1] = z;
    }
}

__global__ void loss_finish_kernel(const double *__restrict__ partials, const double *__restrict__ aux_scale,
                                   double *__restrict__ out)
{
    /* one warp: lane l sums blocks l, l + 32, ... in order, then a fixed tree over the lanes */
    const int lane = threadIdx.x & 31;
    double a = 0.0, z = 0.0;
    for (int b = lane; b < LOSS_BLOCKS; b += 32) {
        a += partials[2 * b];
        z += partials[2 * b + 1];
    }
    a = warp_sum_double(a);
    z = warp_sum_double(z);
    if (lane == 0) {
        out[0] = aux_scale ? a * *aux_scale : 0.0;
        out[1] = z;
    }
}

template <typename S, int NS>
__global__ void loss_backward_kernel(const loss_kernel_params p, const S *__restrict__ logits,
                                     const double *__restrict__ f, const double *__restrict__ aux_scale,
                                     double aux_grad_scale, S z_grad, S *__restrict__ d_logits)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const S aux_coeff = f ? (S)(aux_grad_scale * *aux_scale) : (S)0;
    for (int64_t t = (int64_t)blockIdx.x * warps + warp; t < p.tokens; t += (int64_t)gridDim.x * warps) {
        S l[NS], g[NS];
        load_logits(logits + t * p.experts, p.experts, lane, l);
#pragma unroll
        for (int j = 0; j < NS; j++) g[j] = (S)0;
        if (f) {
            /* dP_e = scale * A * f_e; dot = sum_e dP_e P_e */
            const double *ft = f + (t / p.seq) * p.experts;
            S dP[NS], P[NS], s[NS], dot = (S)0, denom = (S)1;
            if (p.sigmoid) {
                S sum = (S)0;
#pragma unroll
                for (int j = 0; j < NS; j++) {
                    s[j] = (j * 32 + lane < p.experts) ? sigmoid(l[j]) : (S)0;
                    sum += s[j];
                }
                denom = warp_sum(sum) + NORMALIZE_EPS;
#pragma unroll
                for (int j = 0; j < NS; j++) P[j] = s[j] / denom;
            } else {
                softmax_slots(p.experts, lane, l, P);
            }
#pragma unroll
            for (int j = 0; j < NS; j++) {
                const int e = j * 32 + lane;
                dP[j] = e < p.experts ? aux_coeff * (S)ft[e] : (S)0;
                dot += dP[j] * P[j];
            }
            dot = warp_sum(dot);
#pragma unroll
            for (int j = 0; j < NS; j++) {
                if (p.sigmoid)
                    g[j] += (dP[j] - dot) / denom * s[j] * ((S)1 - s[j]);
                else
                    g[j] += P[j] * (dP[j] - dot);
            }
        }
        if (z_grad != (S)0) {
            S m = -INFINITY;
#pragma unroll
            for (int j = 0; j < NS; j++) m = s_max(m, l[j]);
            m = warp_max(m);
            S ex[NS], sum = (S)0;
#pragma unroll
            for (int j = 0; j < NS; j++) {
                ex[j] = (j * 32 + lane < p.experts) ? s_exp(l[j] - m) : (S)0;
                sum += ex[j];
            }
            sum = warp_sum(sum);
            const S gz = z_grad * (m + s_log(sum));
#pragma unroll
            for (int j = 0; j < NS; j++) g[j] += gz * ex[j] / sum;
        }
#pragma unroll
        for (int j = 0; j < NS; j++) {
            const int e = j * 32 + lane;
            if (e < p.experts) d_logits[t * p.experts + e] += g[j];
        }
    }
}

#define BIAS_THREADS 1024

__global__ void bias_update_kernel(int experts, long long *__restrict__ counts, double rate, float *__restrict__ bias)
{
    __shared__ long long partial[BIAS_THREADS];
    long long mine = 0;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) mine += counts[e];
    partial[threadIdx.x] = mine;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if ((int)threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    const double mean = (double)partial[0] / (double)experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        const double offset = mean - (double)counts[e];
        const double sign = offset > 0.0 ? 1.0 : offset < 0.0 ? -1.0 : 0.0;
        bias[e] = (float)((double)bias[e] + rate * sign);
        counts[e] = 0;
    }
}

/* Checks and narrows the loss kernels' sizes. */
static moert_result check_loss_params(const moert_host *host, const moert_router_cuda_loss_params *p,
                                      loss_kernel_params *kp)
{
    if (!p) return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda loss: params are required");
    if (p->tokens < 0 || p->tokens > INT32_MAX || p->num_experts < 1 || p->topk < 1 || p->topk > p->num_experts ||
        p->seq_length < 1 || (p->tokens > 0 && p->tokens % p->seq_length != 0))
        return report(host, MOERT_ERR_INVALID_ARGUMENT,
                      "router cuda loss: bad sizes (tokens %lld, experts %lld, topk %lld, seq_length %lld)",
                      (long long)p->tokens, (long long)p->num_experts, (long long)p->topk, (long long)p->seq_length);
    if (p->num_experts > MOERT_ROUTER_CUDA_MAX_EXPERTS || p->topk > MOERT_ROUTER_CUDA_MAX_TOPK)
        return report(
            host, MOERT_ERR_UNSUPPORTED, "router cuda: %lld experts, top-%lld exceed the limits (%d experts, top-%d)",
            (long long)p->num_experts, (long long)p->topk, MOERT_ROUTER_CUDA_MAX_EXPERTS, MOERT_ROUTER_CUDA_MAX_TOPK);
    kp->tokens = (int)p->tokens;
    kp->experts = (int)p->num_experts;
    kp->topk = (int)p->topk;
    kp->seq = p->seq_length > INT32_MAX ? INT32_MAX : (int)p->seq_length;
    kp->sigmoid = p->sigmoid ? 1 : 0;
    kp->f64 = p->logits_f64 ? 1 : 0;
    return MOERT_OK;
}

/* bf16/fp32 -> fp32; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_to_f32(const moert_host *host, cudaStream_t stream, moert_dtype src_dtype,
                                                 int64_t n, const void *src, float *dst)
{
    if (src_dtype != MOERT_BF16 && src_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "router cuda: cannot convert %s to fp32 (bf16 or fp32 only)",
                      moert_dtype_name(src_dtype));
    if (n <= 0) return MOERT_OK;
    to_f32_kernel<<<grid_for_elements(n), ELEMENTWISE_THREADS, 0, stream>>>(n, src_dtype == MOERT_BF16, src, dst);
    LAUNCH_CHECK(host, "to_f32_kernel");
    return MOERT_OK;
}

/* dst += src; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_accumulate(const moert_host *host, cudaStream_t stream, moert_dtype dst_dtype,
                                                     int64_t n, const float *src, void *dst)
{
    if (dst_dtype != MOERT_BF16 && dst_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "router cuda: cannot accumulate into %s (bf16 or fp32 only)",
                      moert_dtype_name(dst_dtype));
    if (n <= 0) return MOERT_OK;
    if (dst_dtype == MOERT_BF16 && n % 8 == 0 && (uintptr_t)src % 32 == 0 && (uintptr_t)dst % 16 == 0) {
        accumulate_bf16_vec8_kernel<<<grid_for_elements(n / 8), ELEMENTWISE_THREADS, 0, stream>>>(
            n / 8, (const float4 *)src, (uint4 *)dst);
        LAUNCH_CHECK(host, "accumulate_bf16_vec8_kernel");
        return MOERT_OK;
    }
    accumulate_kernel<<<grid_for_elements(n), ELEMENTWISE_THREADS, 0, stream>>>(n, dst_dtype == MOERT_BF16, src, dst);
    LAUNCH_CHECK(host, "accumulate_kernel");
    return MOERT_OK;
}

/* fp32 -> bf16 planes; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_split_bf16(const moert_host *host, cudaStream_t stream, int64_t rows,
                                                     int64_t cols, const int order[3], const float *src, uint16_t *dst)
{
    for (int p = 0; p < 3; p++)
        if (order[p] < 0 || order[p] > 2)
            return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda split: plane %d takes term %d (0..2)", p,
                          order[p]);
    if (rows < 0 || cols < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda split: bad sizes (rows %lld, cols %lld)",
                      (long long)rows, (long long)cols);
    if (rows * cols == 0) return MOERT_OK;
    split_bf16_kernel<<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(rows, cols, order[0],
                                                                                          order[1], order[2], src, dst);
    LAUNCH_CHECK(host, "split_bf16_kernel");
    return MOERT_OK;
}

/* Sum of planes; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_sum_planes(const moert_host *host, cudaStream_t stream, int64_t rows,
                                                     int64_t cols, int planes, int accumulate, const float *src,
                                                     float *dst)
{
    if (rows < 0 || cols < 0 || planes < 1)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda sum: bad sizes (rows %lld, cols %lld, planes %d)",
                      (long long)rows, (long long)cols, planes);
    if (rows * cols == 0) return MOERT_OK;
    sum_planes_kernel<<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(rows, cols, planes,
                                                                                          accumulate, src, dst);
    LAUNCH_CHECK(host, "sum_planes_kernel");
    return MOERT_OK;
}

/* dst += src, int64; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_add_counts(const moert_host *host, cudaStream_t stream, int64_t n,
                                                     const int64_t *src, int64_t *dst)
{
    if (n <= 0) return MOERT_OK;
    add_counts_kernel<<<grid_for_elements(n), ELEMENTWISE_THREADS, 0, stream>>>(n, (const long long *)src,
                                                                                (long long *)dst);
    LAUNCH_CHECK(host, "add_counts_kernel");
    return MOERT_OK;
}

/* Plain top-K counts per sequence; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_aux_counts(const moert_host *host, cudaStream_t stream,
                                                     const moert_router_cuda_loss_params *p, const void *logits,
                                                     int64_t *counts)
{
    loss_kernel_params kp;
    moert_result rc = check_loss_params(host, p, &kp);
    if (rc != MOERT_OK) return rc;
    const int64_t rows = kp.tokens > 0 ? kp.tokens / kp.seq : 1;
    const int64_t slots = rows * kp.experts;
    CUDA_CHECK(host, cudaMemsetAsync(counts, 0, (size_t)(slots + 1) * sizeof(int64_t), stream));
    if (kp.f64)
        LAUNCH_TOKEN_KERNEL(aux_counts_kernel, double, kp.experts, kp.tokens, stream, kp, (const double *)logits,
                            (unsigned long long *)counts, (long long *)counts + slots);
    else
        LAUNCH_TOKEN_KERNEL(aux_counts_kernel, float, kp.experts, kp.tokens, stream, kp, (const float *)logits,
                            (unsigned long long *)counts, (long long *)counts + slots);
    LAUNCH_CHECK(host, "aux_counts_kernel");
    return MOERT_OK;
}

/* f and A of the balancing loss; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_aux_finish(const moert_host *host, cudaStream_t stream, int64_t n,
                                                     const int64_t *counts, double *global_sum, double forwards,
                                                     double scale_value, double *f, double *scale)
{
    if (n < 1 || (global_sum && !(forwards > 0.0)))
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda aux finish: n %lld, forwards %g", (long long)n,
                      forwards);
    aux_finish_kernel<<<1, ELEMENTWISE_THREADS, 0, stream>>>(n, (const long long *)counts, global_sum, forwards,
                                                             scale_value, f, scale);
    LAUNCH_CHECK(host, "aux_finish_kernel");
    return MOERT_OK;
}

/* Loss values over a fixed grid; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_loss_values(const moert_host *host, cudaStream_t stream,
                                                      const moert_router_cuda_loss_params *p, const void *logits,
                                                      const double *f, const double *aux_scale, int want_z,
                                                      double *workspace, double *out)
{
    loss_kernel_params kp;
    moert_result rc = check_loss_params(host, p, &kp);
    if (rc != MOERT_OK) return rc;
    if (f && !aux_scale) return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda loss values: f needs aux_scale");
    if (kp.f64)
        LAUNCH_BY_SLOTS(loss_values_kernel, double, kp.experts, LOSS_BLOCKS, LOSS_WARPS * 32, stream, kp,
                        (const double *)logits, f, want_z, workspace);
    else
        LAUNCH_BY_SLOTS(loss_values_kernel, float, kp.experts, LOSS_BLOCKS, LOSS_WARPS * 32, stream, kp,
                        (const float *)logits, f, want_z, workspace);
    LAUNCH_CHECK(host, "loss_values_kernel");
    loss_finish_kernel<<<1, 32, 0, stream>>>(workspace, f ? aux_scale : NULL, out);
    LAUNCH_CHECK(host, "loss_finish_kernel");
    return MOERT_OK;
}

/* Loss gradients into d_logits; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_loss_backward(const moert_host *host, cudaStream_t stream,
                                                        const moert_router_cuda_loss_params *p, const void *logits,
                                                        const double *f, const double *aux_scale, double aux_grad_scale,
                                                        double z_grad, void *d_logits)
{
    loss_kernel_params kp;
    moert_result rc = check_loss_params(host, p, &kp);
    if (rc != MOERT_OK) return rc;
    if (f && !aux_scale)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda loss backward: f needs aux_scale");
    if (kp.tokens == 0 || (!f && z_grad == 0.0)) return MOERT_OK;
    if (kp.f64)
        LAUNCH_TOKEN_KERNEL(loss_backward_kernel, double, kp.experts, kp.tokens, stream, kp, (const double *)logits, f,
                            aux_scale, aux_grad_scale, z_grad, (double *)d_logits);
    else
        LAUNCH_TOKEN_KERNEL(loss_backward_kernel, float, kp.experts, kp.tokens, stream, kp, (const float *)logits, f,
                            aux_scale, aux_grad_scale, (float)z_grad, (float *)d_logits);
    LAUNCH_CHECK(host, "loss_backward_kernel");
    return MOERT_OK;
}

/* Aux-loss-free bias update; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_bias_update(const moert_host *host, cudaStream_t stream, int64_t num_experts,
                                                      int64_t *counts, double rate, float *bias)
{
    if (num_experts < 1 || num_experts > BIAS_THREADS)
        return report(host, MOERT_ERR_UNSUPPORTED, "router cuda bias update: %lld experts (at most %d)",
                      (long long)num_experts, BIAS_THREADS);
    bias_update_kernel<<<1, BIAS_THREADS, 0, stream>>>((int)num_experts, (long long *)counts, rate, bias);
    LAUNCH_CHECK(host, "bias_update_kernel");
    return MOERT_OK;
}

/* ---- capacity, sinkhorn, noise (the options of Megatron's router the plugin's CUDA path serves) ---- */

#define CAPACITY_THREADS 256

/* One block per expert: its copies listed in slot (= token) order, then those past `capacity` dropped. */
__global__ void capacity_kernel(int tokens, int topk, int experts, long long capacity, int policy, int pad,
                                const int32_t *__restrict__ sel_idx, int32_t *__restrict__ out_idx,
                                float *__restrict__ probs, long long *__restrict__ kept_counts,
                                long long *__restrict__ tokens_per_expert, int32_t *__restrict__ scratch)
{
    __shared__ int warp_total[CAPACITY_THREADS / 32];
    __shared__ int listed;
    const int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int32_t *list = scratch + (int64_t)e * tokens;
    const int64_t slots = (int64_t)tokens * topk;
    if (threadIdx.x == 0) listed = 0;
    __syncthreads();
    /* the slots holding e, compacted in order: a ballot per warp, the warps' totals in order */
    for (int64_t start = 0; start < slots; start += blockDim.x) {
        const int64_t i = start + threadIdx.x;
        const bool mine = i < slots && sel_idx[i] == e;
        const unsigned ballot = __ballot_sync(FULL_MASK, mine);
        if (lane == 0) warp_total[warp] = __popc(ballot);
        __syncthreads();
        int before = listed;
        for (int w = 0; w < warp; w++) before += warp_total[w];
        before += __popc(ballot & ((1u << lane) - 1u));
        if (mine && before < tokens) list[before] = (int32_t)i;
        __syncthreads();
        if (threadIdx.x == 0)
            for (int w = 0; w < warps; w++) listed += warp_total[w];
        __syncthreads();
    }
    const int n = listed < tokens ? listed : tokens;
    if (n > capacity) {
        /* the rank of each copy among the expert's: by position, or by prob (higher first, then earlier slot) */
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int32_t pj = list[j];
            long long rank = j;
            if (policy == 0) {
                const float vj = probs[pj];
                rank = 0;
                for (int i = 0; i < n; i++) {
                    const int32_t pi = list[i];
                    const float vi = probs[pi];
                    if (vi > vj || (vi == vj && pi < pj)) rank++;
                }
            }
            if (rank >= capacity) out_idx[pj] = -1;
        }
        __syncthreads(); /* every rank read the probs before any is zeroed */
        for (int j = threadIdx.x; j < n; j += blockDim.x)
            if (out_idx[list[j]] < 0) probs[list[j]] = 0.0f;
    }
    if (threadIdx.x == 0) {
        const long long kept = n < capacity ? n : capacity;
        kept_counts[e] = kept;
        tokens_per_expert[e] = pad ? capacity : kept;
    }
}

/* Token dropping; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_capacity(const moert_host *host, cudaStream_t stream, int64_t tokens,
                                                   int64_t topk, int64_t experts, int64_t capacity, int policy, int pad,
                                                   const int32_t *sel_idx, int32_t *out_idx, float *probs,
                                                   int64_t *kept_counts, int64_t *tokens_per_expert, int32_t *scratch)
{
    if (tokens < 0 || tokens > INT32_MAX || topk < 1 || experts < 1 || experts > 65535 || capacity < 0 ||
        tokens * topk > INT32_MAX || (policy != 0 && policy != 1))
        return report(
            host, MOERT_ERR_INVALID_ARGUMENT,
            "router cuda capacity: bad sizes (tokens %lld, topk %lld, experts %lld, capacity %lld, policy %d)",
            (long long)tokens, (long long)topk, (long long)experts, (long long)capacity, policy);
    if (tokens == 0) {
        CUDA_CHECK(host, cudaMemsetAsync(kept_counts, 0, (size_t)experts * sizeof(int64_t), stream));
        return MOERT_OK;
    }
    capacity_kernel<<<(unsigned)experts, CAPACITY_THREADS, 0, stream>>>(
        (int)tokens, (int)topk, (int)experts, (long long)capacity, policy, pad, sel_idx, out_idx, probs,
        (long long *)kept_counts, (long long *)tokens_per_expert, scratch);
    LAUNCH_CHECK(host, "capacity_kernel");
    return MOERT_OK;
}

#define SINKHORN_THREADS 1024

/* c = exp(logits) in fp64, one element per thread. */
template <typename S>
__global__ void sinkhorn_exp_kernel(int64_t n, const S *__restrict__ logits, double *__restrict__ c)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        c[i] = exp((double)logits[i]);
}

/* The whole normalisation in one block: row sums by warps, column sums by parts of the tokens, fixed orders. */
__global__ void sinkhorn_kernel(int tokens, int experts, const double *__restrict__ c, double tol, long long max_iters,
                                double *__restrict__ d0, double *__restrict__ d1_out, int *__restrict__ iterations)
{
    __shared__ double d1[MOERT_ROUTER_CUDA_MAX_EXPERTS], d1_old[MOERT_ROUTER_CUDA_MAX_EXPERTS];
    __shared__ double part[SINKHORN_THREADS];
    __shared__ int done;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int parts = blockDim.x / experts > 0 ? blockDim.x / experts : 1;
    const int chunk = (tokens + parts - 1) / parts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) d1[e] = d1_old[e] = 1.0;
    if (threadIdx.x == 0) done = 0;
    __syncthreads();
    long long iters = 0;
    while (iters < max_iters) {
        iters++;
        for (int t = warp; t < tokens; t += warps) {
            double acc = 0.0;
            for (int e = lane; e < experts; e += 32) acc += d1[e] * c[(int64_t)t * experts + e];
            acc = warp_sum_double(acc);
            if (lane == 0) d0[t] = (1.0 / (double)tokens) / (acc + 1e-8);
        }
        __syncthreads();
        {
            const int e = threadIdx.x % experts, p = threadIdx.x / experts;
            if (p < parts) {
                double acc = 0.0;
                const int t_end = (p + 1) * chunk < tokens ? (p + 1) * chunk : tokens;
                for (int t = p * chunk; t < t_end; t++) acc += d0[t] * c[(int64_t)t * experts + e];
                part[p * experts + e] = acc;
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < experts; e += blockDim.x) {
            double acc = 0.0;
            for (int p = 0; p < parts; p++) acc += part[p * experts + e];
            d1[e] = (1.0 / (double)experts) / (acc + 1e-8);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double err = 0.0;
            for (int e = 0; e < experts; e++) {
                err += fabs(d1_old[e] - d1[e]);
                d1_old[e] = d1[e];
            }
            done = err / (double)experts <= tol;
        }
        __syncthreads();
        if (done) break;
    }
    for (int e = threadIdx.x; e < experts; e += blockDim.x) d1_out[e] = d1[e];
    if (threadIdx.x == 0 && iterations) *iterations = done ? (int)iters : -1;
}

/* Sinkhorn normalisation; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_sinkhorn(const moert_host *host, cudaStream_t stream, int64_t tokens,
                                                   int64_t experts, const void *logits, int logits_f64, double tol,
                                                   int64_t max_iters, double *workspace, double *d0, double *d1,
                                                   int *iterations)
{
    if (tokens < 0 || tokens > INT32_MAX || experts < 1 || experts > MOERT_ROUTER_CUDA_MAX_EXPERTS || max_iters < 1)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda sinkhorn: bad sizes (tokens %lld, experts %lld)",
                      (long long)tokens, (long long)experts);
    if (tokens == 0) return MOERT_OK;
    const int64_t n = tokens * experts;
    if (logits_f64)
        sinkhorn_exp_kernel<double>
            <<<grid_for_elements(n), ELEMENTWISE_THREADS, 0, stream>>>(n, (const double *)logits, workspace);
    else
        sinkhorn_exp_kernel<float>
            <<<grid_for_elements(n), ELEMENTWISE_THREADS, 0, stream>>>(n, (const float *)logits, workspace);
    LAUNCH_CHECK(host, "sinkhorn_exp_kernel");
    sinkhorn_kernel<<<1, SINKHORN_THREADS, 0, stream>>>((int)tokens, (int)experts, workspace, tol, (long long)max_iters,
                                                        d0, d1, iterations);
    LAUNCH_CHECK(host, "sinkhorn_kernel");
    return MOERT_OK;
}

/* dst = src (bf16 or fp32) times the jitter factor (when jitter), in fp64, rounded once to the dst type. */
template <typename D>
__global__ void convert_kernel(int64_t rows, int64_t cols, int bf16, const void *__restrict__ src, int jitter,
                               moert_router_cuda_noise noise, D *__restrict__ dst)
{
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        double v = bf16 ? (double)bf16_bits_to_float(((const uint16_t *)src)[i]) : (double)((const float *)src)[i];
        if (jitter)
            v *= router_noise_jitter(noise.key, noise.call, (uint64_t)(i / cols), (uint64_t)(i % cols), noise.eps);
        dst[i] = (D)v;
    }
}

/* x or W widened (and jittered); see router_cuda.h. */
extern "C" moert_result moert_router_cuda_convert(const moert_host *host, cudaStream_t stream, moert_dtype src_dtype,
                                                  int64_t rows, int64_t cols, const void *src,
                                                  const moert_router_cuda_noise *jitter, void *dst, int dst_f64)
{
    if (src_dtype != MOERT_BF16 && src_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "router cuda: cannot convert %s (bf16 or fp32 only)",
                      moert_dtype_name(src_dtype));
    if (rows < 0 || cols < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda convert: bad sizes (%lld, %lld)", (long long)rows,
                      (long long)cols);
    if (rows * cols == 0) return MOERT_OK;
    moert_router_cuda_noise noise = jitter ? *jitter : moert_router_cuda_noise{0, 0, 0.0};
    const int bf16 = src_dtype == MOERT_BF16;
    if (dst_f64)
        convert_kernel<double><<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(
            rows, cols, bf16, src, jitter != NULL, noise, (double *)dst);
    else
        convert_kernel<float><<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(
            rows, cols, bf16, src, jitter != NULL, noise, (float *)dst);
    LAUNCH_CHECK(host, "convert_kernel");
    return MOERT_OK;
}

template <typename D>
__global__ void random_logits_kernel(int64_t tokens, int64_t experts, moert_router_cuda_noise noise,
                                     D *__restrict__ logits)
{
    const int64_t n = tokens * experts;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        logits[i] = (D)router_noise_normal(noise.key, noise.call, (uint64_t)(i / experts), (uint64_t)(i % experts));
}

/* force_load_balancing's logits; see router_cuda.h. */
extern "C" moert_result moert_router_cuda_random_logits(const moert_host *host, cudaStream_t stream, int64_t tokens,
                                                        int64_t experts, const moert_router_cuda_noise *noise,
                                                        void *logits, int logits_f64)
{
    if (tokens < 0 || experts < 1 || !noise)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda random logits: bad arguments");
    if (tokens == 0) return MOERT_OK;
    if (logits_f64)
        random_logits_kernel<double><<<grid_for_elements(tokens * experts), ELEMENTWISE_THREADS, 0, stream>>>(
            tokens, experts, *noise, (double *)logits);
    else
        random_logits_kernel<float><<<grid_for_elements(tokens * experts), ELEMENTWISE_THREADS, 0, stream>>>(
            tokens, experts, *noise, (float *)logits);
    LAUNCH_CHECK(host, "random_logits_kernel");
    return MOERT_OK;
}

template <typename S>
__global__ void accumulate_ext_kernel(int64_t rows, int64_t cols, int bf16, const S *__restrict__ src, int jitter,
                                      moert_router_cuda_noise noise, void *__restrict__ dst)
{
    const int64_t n = rows * cols;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        double v = (double)src[i];
        if (jitter)
            v *= router_noise_jitter(noise.key, noise.call, (uint64_t)(i / cols), (uint64_t)(i % cols), noise.eps);
        if (bf16) {
            uint16_t *d = (uint16_t *)dst;
            d[i] = float_to_bf16_bits((float)((double)bf16_bits_to_float(d[i]) + v));
        } else {
            float *d = (float *)dst;
            d[i] = (float)((double)d[i] + v);
        }
    }
}

/* dst += src (times the jitter); see router_cuda.h. */
extern "C" moert_result moert_router_cuda_accumulate_ext(const moert_host *host, cudaStream_t stream,
                                                         moert_dtype dst_dtype, int64_t rows, int64_t cols,
                                                         const void *src, int src_f64,
                                                         const moert_router_cuda_noise *jitter, void *dst)
{
    if (dst_dtype != MOERT_BF16 && dst_dtype != MOERT_F32)
        return report(host, MOERT_ERR_UNSUPPORTED, "router cuda: cannot accumulate into %s (bf16 or fp32 only)",
                      moert_dtype_name(dst_dtype));
    if (rows < 0 || cols < 0)
        return report(host, MOERT_ERR_INVALID_ARGUMENT, "router cuda accumulate: bad sizes (%lld, %lld)",
                      (long long)rows, (long long)cols);
    if (rows * cols == 0) return MOERT_OK;
    moert_router_cuda_noise noise = jitter ? *jitter : moert_router_cuda_noise{0, 0, 0.0};
    const int bf16 = dst_dtype == MOERT_BF16;
    if (src_f64)
        accumulate_ext_kernel<double><<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(
            rows, cols, bf16, (const double *)src, jitter != NULL, noise, dst);
    else
        accumulate_ext_kernel<float><<<grid_for_elements(rows * cols), ELEMENTWISE_THREADS, 0, stream>>>(
            rows, cols, bf16, (const float *)src, jitter != NULL, noise, dst);
    LAUNCH_CHECK(host, "accumulate_ext_kernel");
    return MOERT_OK;
}
