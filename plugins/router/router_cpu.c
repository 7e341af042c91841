/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference math of the top-k router (see router_cpu.h and docs/plugins/router.md). */
#include "router_cpu.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* Added to the sum of sigmoid scores before dividing by it, as Megatron does. */
#define ROUTER_SIGMOID_NORM_EPS 1e-20
/* Sinkhorn: the epsilon inside its two divisions (Megatron's value). */
#define ROUTER_SINKHORN_EPS 1e-8

/* The larger of two sizes. */
static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Doubles router_cpu_route uses as scratch for T tokens. */
int64_t router_cpu_route_scratch_doubles(const router_params *p, int64_t T)
{
    int64_t E = p->num_experts;
    int64_t n = 2 * E + max_i64(p->num_groups, 1);
    if (p->balancing == ROUTER_BALANCE_SINKHORN) n += T * E + T + 2 * E;
    return n;
}

/* The router's linear layer: logits = x . w^T. */
void router_cpu_logits(const double *x, const double *w, int64_t T, int64_t H, int64_t E, double *logits)
{
    for (int64_t t = 0; t < T; t++) {
        const double *xt = x + t * H;
        for (int64_t e = 0; e < E; e++) {
            const double *we = w + e * H;
            double acc = 0.0;
            for (int64_t h = 0; h < H; h++) acc += xt[h] * we[h];
            logits[t * E + e] = acc;
        }
    }
}

/* Largest of n values. */
static double row_max(const double *v, int64_t n)
{
    double m = v[0];
    for (int64_t i = 1; i < n; i++)
        if (v[i] > m) m = v[i];
    return m;
}

/* Softmax of one row, shifted by its maximum. */
void router_cpu_softmax(const double *in, int64_t n, double *out)
{
    double m = row_max(in, n);
    double z = 0.0;
    for (int64_t i = 0; i < n; i++) {
        out[i] = exp(in[i] - m);
        z += out[i];
    }
    for (int64_t i = 0; i < n; i++) out[i] /= z;
}

/* log(sum(exp)) of one row, shifted by its maximum. */
double router_cpu_logsumexp(const double *in, int64_t n)
{
    double m = row_max(in, n);
    double z = 0.0;
    for (int64_t i = 0; i < n; i++) z += exp(in[i] - m);
    return m + log(z);
}

/* The logistic function without overflow for large |v|. */
double router_cpu_sigmoid(double v)
{
    if (v >= 0.0) return 1.0 / (1.0 + exp(-v));
    double e = exp(v);
    return e / (1.0 + e);
}

/* Top-k by repeated arg-max; a strict '>' while scanning upwards makes the lower index win ties. */
void router_cpu_topk(const double *scores, int64_t E, int64_t K, const unsigned char *allowed, int32_t *idx)
{
    for (int64_t k = 0; k < K; k++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (allowed && !allowed[e]) continue;
            bool taken = false;
            for (int64_t j = 0; j < k; j++)
                if (idx[j] == e) {
                    taken = true;
                    break;
                }
            if (taken) continue;
            /* best < 0 also takes a NaN score, so every slot gets an expert */
            if (best < 0 || scores[e] > scores[best]) best = e;
        }
        idx[k] = (int32_t)best;
    }
}

/* Sum of the n largest of v[0..m) (n <= m), without changing v. */
static double sum_of_largest(const double *v, int64_t m, int64_t n, unsigned char *used)
{
    memset(used, 0, (size_t)m);
    double sum = 0.0;
    for (int64_t k = 0; k < n; k++) {
        int64_t best = -1;
        for (int64_t i = 0; i < m; i++)
            if (!used[i] && (best < 0 || v[i] > v[best])) best = i;
        used[best] = 1;
        sum += v[best];
    }
    return sum;
}

/* Group-limited top-k of one token (DeepSeek-V3's node-limited routing, Megatron's group_limited_topk). */
void router_cpu_group_topk(const double *scores, int64_t E, int64_t K, int64_t G, int64_t Kg,
                           unsigned char *bytes_scratch, double *group_scratch, int32_t *idx)
{
    unsigned char *allowed = bytes_scratch;         /* E */
    unsigned char *group_taken = bytes_scratch + E; /* G */
    if (G < 1 || Kg < 1) {
        router_cpu_topk(scores, E, K, NULL, idx);
        return;
    }
    int64_t per_group = E / G;
    int64_t per_group_k = K / Kg;
    for (int64_t g = 0; g < G; g++)
        group_scratch[g] = sum_of_largest(scores + g * per_group, per_group, per_group_k, allowed);
    /* the Kg best groups, ties to the lower group index */
    memset(group_taken, 0, (size_t)G);
    for (int64_t k = 0; k < Kg; k++) {
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
            if (!group_taken[g] && (best < 0 || group_scratch[g] > group_scratch[best])) best = g;
        group_taken[best] = 1;
    }
    for (int64_t e = 0; e < E; e++) allowed[e] = group_taken[e / per_group];
    router_cpu_topk(scores, E, K, allowed, idx);
}

/* Megatron's sinkhorn(): balances exp(logits) towards uniform token and expert marginals. */
int64_t router_cpu_sinkhorn(const double *logits, int64_t T, int64_t E, double tol, int64_t max_iters, double *scratch,
                            double *out)
{
    double *d0 = scratch, *d1 = scratch + T, *d1_old = scratch + T + E;
    double *c = out;
    for (int64_t i = 0; i < T * E; i++) c[i] = exp(logits[i]);
    for (int64_t t = 0; t < T; t++) d0[t] = 1.0;
    for (int64_t e = 0; e < E; e++) d1[e] = d1_old[e] = 1.0;
    int64_t iters = 0;
    bool converged = false;
    while (iters < max_iters) {
        iters++;
        for (int64_t t = 0; t < T; t++) {
            double acc = 0.0;
            for (int64_t e = 0; e < E; e++) acc += d1[e] * c[t * E + e];
            d0[t] = (1.0 / (double)T) / (acc + ROUTER_SINKHORN_EPS);
        }
        for (int64_t e = 0; e < E; e++) {
            double acc = 0.0;
            for (int64_t t = 0; t < T; t++) acc += d0[t] * c[t * E + e];
            d1[e] = (1.0 / (double)E) / (acc + ROUTER_SINKHORN_EPS);
        }
        double err = 0.0;
        for (int64_t e = 0; e < E; e++) {
            err += fabs(d1_old[e] - d1[e]);
            d1_old[e] = d1[e];
        }
        if (err / (double)E <= tol) {
            converged = true;
            break;
        }
    }
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++) out[t * E + e] = d1[e] * c[t * E + e] * d0[t];
    return converged ? iters : -1;
}

/* Top-k of one token's selection scores, group-limited when configured. */
static void select_experts(const router_params *p, const double *scores, router_scratch *s, double *group_scratch,
                           int32_t *idx)
{
    if (p->num_groups > 0)
        router_cpu_group_topk(scores, p->num_experts, p->topk, p->num_groups, p->group_topk, s->bytes, group_scratch,
                              idx);
    else
        router_cpu_topk(scores, p->num_experts, p->topk, NULL, idx);
}

/* Selection and probs for every token (Megatron's topk_routing_with_score_function and sinkhorn routing). */
int64_t router_cpu_route(const router_params *p, const double *logits, const double *expert_bias, int64_t T,
                         router_scratch *scratch, int32_t *sel_idx, double *probs)
{
    int64_t E = p->num_experts, K = p->topk;
    double *row = scratch->doubles;                   /* E: selection scores of one token */
    double *full = row + E;                           /* E: softmax or sigmoid of one token */
    double *group = full + E;                         /* num_groups */
    double *sink = group + max_i64(p->num_groups, 1); /* T*E sinkhorn output, then T+2E of its scratch */
    const bool f32 = p->compute_f32;
    int64_t iters = 0;

    if (p->balancing == ROUTER_BALANCE_SINKHORN)
        iters = router_cpu_sinkhorn(logits, T, E, ROUTER_SINKHORN_TOLERANCE, ROUTER_SINKHORN_MAX_ROUNDS, sink + T * E,
                                    sink);

    for (int64_t t = 0; t < T; t++) {
        const double *l = logits + t * E;
        int32_t *idx = sel_idx + t * K;
        double *pr = probs + t * K;
        if (p->balancing == ROUTER_BALANCE_SINKHORN) {
            /* selection on the balanced scores; probs from the plain activation, not renormalised */
            router_cpu_topk(sink + t * E, E, K, NULL, idx);
            if (K > 1) {
                router_cpu_softmax(l, E, full);
                for (int64_t k = 0; k < K; k++) pr[k] = router_cpu_as_compute(f32, full[idx[k]]);
            } else {
                pr[0] = router_cpu_as_compute(f32, router_cpu_sigmoid(l[idx[0]]));
            }
        } else if (p->score_function == ROUTER_SCORE_SOFTMAX && !p->pre_softmax) {
            /* top-k on the logits, softmax over the K selected */
            select_experts(p, l, scratch, group, idx);
            double m = l[idx[0]];
            for (int64_t k = 1; k < K; k++)
                if (l[idx[k]] > m) m = l[idx[k]];
            double z = 0.0;
            for (int64_t k = 0; k < K; k++) {
                pr[k] = exp(l[idx[k]] - m);
                z += pr[k];
            }
            for (int64_t k = 0; k < K; k++) pr[k] = router_cpu_as_compute(f32, pr[k] / z);
        } else if (p->score_function == ROUTER_SCORE_SOFTMAX) {
            /* softmax over all experts, top-k of it, no renormalisation */
            router_cpu_softmax(l, E, full);
            for (int64_t e = 0; e < E; e++) full[e] = router_cpu_as_compute(f32, full[e]);
            select_experts(p, full, scratch, group, idx);
            for (int64_t k = 0; k < K; k++) pr[k] = full[idx[k]];
        } else {
            /* sigmoid; the bias moves the selection only; normalised over the K selected when K > 1 */
            for (int64_t e = 0; e < E; e++) {
                full[e] = router_cpu_as_compute(f32, router_cpu_sigmoid(l[e]));
                row[e] = router_cpu_as_compute(f32, full[e] + (expert_bias ? expert_bias[e] : 0.0));
            }
            select_experts(p, row, scratch, group, idx);
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) {
                pr[k] = full[idx[k]];
                sum += pr[k];
            }
            if (K > 1)
                for (int64_t k = 0; k < K; k++)
                    pr[k] = router_cpu_as_compute(f32, pr[k] / (sum + ROUTER_SIGMOID_NORM_EPS));
        }
        for (int64_t k = 0; k < K; k++) pr[k] = router_cpu_as_compute(f32, pr[k] * p->scaling_factor);
    }
    return iters;
}

/* Megatron's get_capacity(T*K, E, capacity_factor). */
int64_t router_cpu_capacity(int64_t T, int64_t K, int64_t E, double capacity_factor)
{
    return (int64_t)ceil((double)(T * K) / (double)E * capacity_factor);
}

/* int64 scratch of router_cpu_apply_capacity: order and merge buffer (T*K each), offsets and cursors (E+1 each). */
int64_t router_cpu_capacity_scratch_ints(int64_t T, int64_t K, int64_t E) { return 2 * T * K + 2 * (E + 1); }

/* Stable merge sort of positions by descending prob (equal probs keep their order: the earlier token). */
static void sort_by_prob_desc(int64_t *pos, int64_t n, const double *probs, int64_t *tmp)
{
    for (int64_t width = 1; width < n; width *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * width) {
            int64_t mid = lo + width < n ? lo + width : n;
            int64_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            int64_t i = lo, j = mid, o = lo;
            while (i < mid && j < hi) tmp[o++] = (probs[pos[j]] > probs[pos[i]]) ? pos[j++] : pos[i++];
            while (i < mid) tmp[o++] = pos[i++];
            while (j < hi) tmp[o++] = pos[j++];
        }
        memcpy(pos, tmp, (size_t)n * sizeof *pos);
    }
}

/* Megatron's apply_router_token_dropping without padding: at most `capacity` copies per expert. */
int64_t router_cpu_apply_capacity(const int32_t *sel_idx, const double *probs, int64_t T, int64_t K, int64_t E,
                                  int64_t capacity, router_drop_policy policy, int64_t *scratch, unsigned char *kept)
{
    int64_t N = T * K;
    int64_t *order = scratch;         /* N: positions t*K+k grouped by expert, in token order */
    int64_t *tmp = scratch + N;       /* N: merge sort buffer */
    int64_t *start = scratch + 2 * N; /* E+1: where each expert's positions begin */
    int64_t *cursor = start + E + 1;  /* E+1: where the next position of each expert goes */
    memset(start, 0, (size_t)(E + 1) * sizeof *start);
    for (int64_t i = 0; i < N; i++) start[sel_idx[i] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t e = 0; e <= E; e++) cursor[e] = start[e];
    for (int64_t i = 0; i < N; i++) order[cursor[sel_idx[i]]++] = i;

    for (int64_t i = 0; i < N; i++) kept[i] = 1;
    int64_t dropped = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = start[e + 1] - start[e];
        if (n <= capacity) continue;
        int64_t *pos = order + start[e];
        if (policy == ROUTER_DROP_PROBS) sort_by_prob_desc(pos, n, probs, tmp);
        for (int64_t j = capacity; j < n; j++) kept[pos[j]] = 0;
        dropped += n - capacity;
    }
    return dropped;
}

/* Full score distribution for the balancing losses (Megatron's compute_routing_scores_for_aux_loss). */
void router_cpu_aux_scores(router_score_function fn, const double *logits, int64_t T, int64_t E, double *P)
{
    for (int64_t t = 0; t < T; t++) {
        const double *l = logits + t * E;
        double *pt = P + t * E;
        if (fn == ROUTER_SCORE_SOFTMAX) {
            router_cpu_softmax(l, E, pt);
        } else {
            double sum = 0.0;
            for (int64_t e = 0; e < E; e++) {
                pt[e] = router_cpu_sigmoid(l[e]);
                sum += pt[e];
            }
            for (int64_t e = 0; e < E; e++) pt[e] /= sum + ROUTER_SIGMOID_NORM_EPS;
        }
    }
}

/* Per-sequence expert counts of a plain top-k over P. */
void router_cpu_aux_counts(const double *P, int64_t T, int64_t E, int64_t K, int64_t S, int32_t *idx_scratch,
                           double *counts)
{
    int64_t B = T / S;
    memset(counts, 0, (size_t)(B * E) * sizeof *counts);
    for (int64_t t = 0; t < T; t++) {
        router_cpu_topk(P + t * E, E, K, NULL, idx_scratch);
        for (int64_t k = 0; k < K; k++) counts[(t / S) * E + idx_scratch[k]] += 1.0;
    }
}

/* A * sum_t sum_e P[t,e] * f[t/S, e]. */
double router_cpu_aux_loss(const double *P, const double *f, int64_t T, int64_t E, int64_t S, double A)
{
    double acc = 0.0;
    for (int64_t t = 0; t < T; t++) {
        const double *ft = f + (t / S) * E;
        for (int64_t e = 0; e < E; e++) acc += P[t * E + e] * ft[e];
    }
    return A * acc;
}

/* Gradient of the balancing loss through P to the logits. */
void router_cpu_aux_loss_backward(router_score_function fn, const double *logits, const double *P, const double *f,
                                  int64_t T, int64_t E, int64_t S, double A, double scale, double *d_logits)
{
    for (int64_t t = 0; t < T; t++) {
        const double *ft = f + (t / S) * E;
        const double *pt = P + t * E;
        const double *l = logits + t * E;
        double *dl = d_logits + t * E;
        /* dP[e] = scale*A*f[e]; both score functions need sum_e dP[e]*P[e] */
        double dot = 0.0;
        for (int64_t e = 0; e < E; e++) dot += scale * A * ft[e] * pt[e];
        if (fn == ROUTER_SCORE_SOFTMAX) {
            for (int64_t e = 0; e < E; e++) dl[e] += pt[e] * (scale * A * ft[e] - dot);
        } else {
            /* P = s / (sum s + eps): ds_e = (dP_e - sum_j dP_j P_j) / (sum s + eps); ds/dl = s (1 - s) */
            double sum = 0.0;
            for (int64_t e = 0; e < E; e++) sum += router_cpu_sigmoid(l[e]);
            double denom = sum + ROUTER_SIGMOID_NORM_EPS;
            for (int64_t e = 0; e < E; e++) {
                double s = router_cpu_sigmoid(l[e]);
                dl[e] += (scale * A * ft[e] - dot) / denom * s * (1.0 - s);
            }
        }
    }
}

/* ST-MoE router z-loss. */
double router_cpu_z_loss(const double *logits, int64_t T, int64_t E, double coeff)
{
    double acc = 0.0;
    for (int64_t t = 0; t < T; t++) {
        double z = router_cpu_logsumexp(logits + t * E, E);
        acc += z * z;
    }
    return coeff * acc / (double)T;
}

/* d/dl of coeff/T * lse^2 is coeff/T * 2 lse * softmax(l). */
void router_cpu_z_loss_backward(const double *logits, int64_t T, int64_t E, double coeff, double scale,
                                double *d_logits)
{
    for (int64_t t = 0; t < T; t++) {
        const double *l = logits + t * E;
        double m = row_max(l, E);
        double z = 0.0;
        for (int64_t e = 0; e < E; e++) z += exp(l[e] - m);
        double lse = m + log(z);
        double g = scale * coeff / (double)T * 2.0 * lse;
        for (int64_t e = 0; e < E; e++) d_logits[t * E + e] += g * exp(l[e] - m) / z;
    }
}

/* Gradient of probs through a softmax over all E experts whose entries idx[k] received g[k]. */
static void softmax_all_backward(const double *l, int64_t E, const int32_t *idx, const double *g, int64_t K, double *dl)
{
    double m = row_max(l, E);
    double z = 0.0;
    for (int64_t e = 0; e < E; e++) z += exp(l[e] - m);
    double dot = 0.0;
    for (int64_t k = 0; k < K; k++) dot += g[k] * exp(l[idx[k]] - m) / z;
    for (int64_t e = 0; e < E; e++) dl[e] -= exp(l[e] - m) / z * dot;
    for (int64_t k = 0; k < K; k++) dl[idx[k]] += exp(l[idx[k]] - m) / z * g[k];
}

/* Gradient of probs through the sigmoid of the selected logits, normalised over them when K > 1. */
static void sigmoid_selected_backward(const double *l, const int32_t *idx, const double *g, int64_t K, double *dl)
{
    if (K == 1) {
        double s = router_cpu_sigmoid(l[idx[0]]);
        dl[idx[0]] += g[0] * s * (1.0 - s);
        return;
    }
    double sum = 0.0, gs = 0.0;
    for (int64_t k = 0; k < K; k++) {
        double s = router_cpu_sigmoid(l[idx[k]]);
        sum += s;
        gs += g[k] * s;
    }
    double denom = sum + ROUTER_SIGMOID_NORM_EPS;
    for (int64_t k = 0; k < K; k++) {
        double s = router_cpu_sigmoid(l[idx[k]]);
        double ds = g[k] / denom - gs / (denom * denom);
        dl[idx[k]] += ds * s * (1.0 - s);
    }
}

/* Gradient of probs through the softmax of the K selected logits. */
static void softmax_selected_backward(const double *l, const int32_t *idx, const double *g, int64_t K, double *dl)
{
    double m = l[idx[0]];
    for (int64_t k = 1; k < K; k++)
        if (l[idx[k]] > m) m = l[idx[k]];
    double z = 0.0;
    for (int64_t k = 0; k < K; k++) z += exp(l[idx[k]] - m);
    double dot = 0.0;
    for (int64_t k = 0; k < K; k++) dot += g[k] * exp(l[idx[k]] - m) / z;
    for (int64_t k = 0; k < K; k++) {
        double pk = exp(l[idx[k]] - m) / z;
        dl[idx[k]] += pk * (g[k] - dot);
    }
}

/* Backward of router_cpu_route's probs (the selection itself has no gradient). */
void router_cpu_probs_backward(const router_params *p, const double *logits, const int32_t *sel_idx,
                               const unsigned char *kept, const double *d_probs, int64_t T, double *g_scratch,
                               double *d_logits)
{
    int64_t E = p->num_experts, K = p->topk;
    double *g = g_scratch;
    for (int64_t t = 0; t < T; t++) {
        const double *l = logits + t * E;
        const int32_t *idx = sel_idx + t * K;
        double *dl = d_logits + t * E;
        /* upstream gradient of the unscaled probs; a dropped copy is the constant 0 */
        for (int64_t k = 0; k < K; k++)
            g[k] = (kept && !kept[t * K + k]) ? 0.0 : d_probs[t * K + k] * p->scaling_factor;
        if (p->balancing == ROUTER_BALANCE_SINKHORN) {
            if (K > 1)
                softmax_all_backward(l, E, idx, g, K, dl);
            else
                sigmoid_selected_backward(l, idx, g, K, dl);
        } else if (p->score_function == ROUTER_SCORE_SOFTMAX && !p->pre_softmax) {
            softmax_selected_backward(l, idx, g, K, dl);
        } else if (p->score_function == ROUTER_SCORE_SOFTMAX) {
            softmax_all_backward(l, E, idx, g, K, dl);
        } else {
            sigmoid_selected_backward(l, idx, g, K, dl);
        }
    }
}

/* Backward of the linear layer, accumulating. */
void router_cpu_linear_backward(const double *d_logits, const double *x, const double *w, int64_t T, int64_t H,
                                int64_t E, double *d_x, double *d_w)
{
    for (int64_t t = 0; t < T; t++) {
        const double *dl = d_logits + t * E;
        const double *xt = x + t * H;
        double *dxt = d_x + t * H;
        for (int64_t e = 0; e < E; e++) {
            double g = dl[e];
            if (g == 0.0) continue;
            const double *we = w + e * H;
            double *dwe = d_w + e * H;
            for (int64_t h = 0; h < H; h++) {
                dxt[h] += g * we[h];
                dwe[h] += g * xt[h];
            }
        }
    }
}
