/* SPDX-License-Identifier: Apache-2.0 */
/*
 * CPU reference math of the top-k router: plain row-major arrays of doubles, no moert types beyond ints.
 * router.c owns options, tensors and state and calls these; a CUDA path will offer the same functions
 * behind a C interface of its own.
 *
 * Shapes: T tokens, H hidden, E experts, K top-k. logits [T,E]; selected expert ids [T,K] (int32, in
 * descending order of the selection score, ties to the lower expert index); probs [T,K].
 */
#ifndef MOERT_ROUTER_CPU_H
#define MOERT_ROUTER_CPU_H

#include <stdbool.h>
#include <stdint.h>

typedef enum router_score_function { ROUTER_SCORE_SOFTMAX = 0, ROUTER_SCORE_SIGMOID = 1 } router_score_function;

typedef enum router_balancing {
    ROUTER_BALANCE_NONE = 0,
    ROUTER_BALANCE_AUX_LOSS = 1,
    ROUTER_BALANCE_SEQ_AUX_LOSS = 2,
    ROUTER_BALANCE_GLOBAL_AUX_LOSS = 3,
    ROUTER_BALANCE_SINKHORN = 4
} router_balancing;

typedef enum router_drop_policy { ROUTER_DROP_PROBS = 0, ROUTER_DROP_POSITION = 1 } router_drop_policy;

/* Option compute_dtype: the arithmetic of the logits and scores (Megatron's --moe-router-dtype). auto: each path's
 * own (the CPU reference in fp64, CUDA in fp32). */
typedef enum router_compute_dtype {
    ROUTER_COMPUTE_AUTO = 0,
    ROUTER_COMPUTE_FP32 = 1,
    ROUTER_COMPUTE_FP64 = 2
} router_compute_dtype;

/* Everything that decides how logits become a selection and probs (validated by router.c). */
typedef struct router_params {
    int64_t num_experts; /* E */
    int64_t topk;        /* K */
    router_score_function score_function;
    bool pre_softmax;      /* softmax only */
    int64_t num_groups;    /* 0: no group-limited top-k */
    int64_t group_topk;    /* groups kept per token when num_groups > 0 */
    double scaling_factor; /* multiplies probs last */
    router_balancing balancing;
    double capacity_factor; /* 0: no capacity */
    router_drop_policy drop_policy;
    bool pad_to_capacity; /* every expert reports `capacity` rows (the dispatcher pads with zero rows) */
    bool compute_f32;     /* compute_dtype fp32: scores and probs rounded to fp32 as an fp32 path stores them */
} router_params;

/* Scratch router_cpu_route needs: router_cpu_route_scratch_doubles(p, T) doubles and E + num_groups bytes. */
typedef struct router_scratch {
    double *doubles;
    unsigned char *bytes;
} router_scratch;

int64_t router_cpu_route_scratch_doubles(const router_params *p, int64_t T);

/* logits[t,e] = sum_h x[t,h] * w[e,h]. */
void router_cpu_logits(const double *x, const double *w, int64_t T, int64_t H, int64_t E, double *logits);

/* out = softmax(in) over n values (in and out may alias). */
void router_cpu_softmax(const double *in, int64_t n, double *out);
/* log(sum(exp(in))) over n values, computed stably. */
double router_cpu_logsumexp(const double *in, int64_t n);
/* 1 / (1 + exp(-v)), stable for large |v|. */
double router_cpu_sigmoid(double v);

/*
 * The K largest of scores[0..E) among those with allowed[e] != 0 (allowed NULL: all), written to idx in
 * descending order; of equal scores the lower expert index comes first.
 */
void router_cpu_topk(const double *scores, int64_t E, int64_t K, const unsigned char *allowed, int32_t *idx);

/*
 * Group-limited top-k of one token: experts form G groups of E/G; a group's score is the sum of its
 * K/Kg best scores; the Kg best groups (ties to the lower group) stay allowed; then top-k over them.
 * bytes_scratch holds E + G bytes, group_scratch G doubles.
 */
void router_cpu_group_topk(const double *scores, int64_t E, int64_t K, int64_t G, int64_t Kg,
                           unsigned char *bytes_scratch, double *group_scratch, int32_t *idx);

/* Sinkhorn's stopping rule on both paths: Megatron's tolerance on mean |d1 - d1_old|, and a bound on the rounds. */
#define ROUTER_SINKHORN_TOLERANCE  1e-4
#define ROUTER_SINKHORN_MAX_ROUNDS 10000

/*
 * Sinkhorn normalisation of exp(logits) [T,E] (Megatron's): d0 = (1/T)/(c.d1 + 1e-8),
 * d1 = (1/E)/(c^T.d0 + 1e-8), repeated until mean|d1 - d1_old| <= tol; out = d1 * c * d0.
 * Returns the number of iterations, or -1 if max_iters passed without converging (out still written).
 * scratch holds T + 2E doubles.
 */
int64_t router_cpu_sinkhorn(const double *logits, int64_t T, int64_t E, double tol, int64_t max_iters, double *scratch,
                            double *out);

/*
 * Selection and probs of T tokens, before capacity: sel_idx [T,K], probs [T,K] (times scaling_factor).
 * expert_bias [E] (or NULL) is added to sigmoid scores for the selection only. Returns the sinkhorn
 * iteration count (-1: did not converge) when balancing is sinkhorn, else 0.
 */
int64_t router_cpu_route(const router_params *p, const double *logits, const double *expert_bias, int64_t T,
                         router_scratch *scratch, int32_t *sel_idx, double *probs);

/* v as the compute dtype stores it: rounded to fp32 with compute_f32, else unchanged. */
static inline double router_cpu_as_compute(bool compute_f32, double v) { return compute_f32 ? (double)(float)v : v; }

/* ceil(T*K/E * capacity_factor), Megatron's get_capacity; only meaningful when capacity_factor > 0. */
int64_t router_cpu_capacity(int64_t T, int64_t K, int64_t E, double capacity_factor);

/*
 * Enforces `capacity` copies per expert: of the copies of one expert, policy probs keeps the `capacity`
 * with the highest prob (ties: the earlier token), policy position the earliest tokens. kept[T*K] gets
 * 1 or 0. Returns the number of copies dropped. scratch holds router_cpu_capacity_scratch_ints(T, K, E) values.
 */
int64_t router_cpu_capacity_scratch_ints(int64_t T, int64_t K, int64_t E);
int64_t router_cpu_apply_capacity(const int32_t *sel_idx, const double *probs, int64_t T, int64_t K, int64_t E,
                                  int64_t capacity, router_drop_policy policy, int64_t *scratch, unsigned char *kept);

/*
 * The full score distribution the balancing losses use, P [T,E]: softmax over all experts, or the
 * sigmoid normalised by its sum over experts (+1e-20).
 */
void router_cpu_aux_scores(router_score_function fn, const double *logits, int64_t T, int64_t E, double *P);

/*
 * counts [B,E] of a plain top-k (K) over P per sequence of S tokens (B = T/S; sequence b holds tokens
 * b*S .. b*S+S-1). S = T gives one row: the tokens each expert would get without bias, groups or capacity.
 * idx_scratch holds K values.
 */
void router_cpu_aux_counts(const double *P, int64_t T, int64_t E, int64_t K, int64_t S, int32_t *idx_scratch,
                           double *counts);

/*
 * Balancing loss A * sum_t sum_e P[t,e] * f[b(t),e] with b(t) = t / S: the aux, seq-aux and global-aux
 * losses differ only in f, S and A (see docs/plugins/router.md).
 */
double router_cpu_aux_loss(const double *P, const double *f, int64_t T, int64_t E, int64_t S, double A);

/* d_logits += d(scale * A * sum P*f)/d(logits) through P (softmax or normalised sigmoid). */
void router_cpu_aux_loss_backward(router_score_function fn, const double *logits, const double *P, const double *f,
                                  int64_t T, int64_t E, int64_t S, double A, double scale, double *d_logits);

/* coeff * mean_t logsumexp(logits[t,:])^2 */
double router_cpu_z_loss(const double *logits, int64_t T, int64_t E, double coeff);
/* d_logits += scale * d(z_loss)/d(logits) */
void router_cpu_z_loss_backward(const double *logits, int64_t T, int64_t E, double coeff, double scale,
                                double *d_logits);

/*
 * d_logits += gradient through the probs of router_cpu_route: d_probs [T,K] is the upstream gradient,
 * kept [T,K] (NULL: all kept) zeroes the dropped copies (their prob is the constant 0). g_scratch holds K.
 */
void router_cpu_probs_backward(const router_params *p, const double *logits, const int32_t *sel_idx,
                               const unsigned char *kept, const double *d_probs, int64_t T, double *g_scratch,
                               double *d_logits);

/* d_x [T,H] += d_logits . w; d_w [E,H] += d_logits^T . x */
void router_cpu_linear_backward(const double *d_logits, const double *x, const double *w, int64_t T, int64_t H,
                                int64_t E, double *d_x, double *d_w);

#endif
