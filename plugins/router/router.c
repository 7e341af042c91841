/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The "topk" router plugin: options, state, tensor checks and the moert_router_v1 vtable. The math is in
 * router_cpu.c (CPU reference) and, for a layer on a CUDA device, router_gpu.c (cuBLASLt and the kernels of
 * router_cuda.cu); docs/plugins/router.md describes every option and formula.
 */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/router.h"
#include "router_cpu.h"
#include "router_noise.h"
#ifdef MOERT_HAVE_CUDA
#include "router_gpu.h"
#endif

#define ROUTER_NAME "topk"
/* defaults of the options whose setting is warned about where it changes nothing (read_options) */
#define DEFAULT_BIAS_UPDATE_RATE 1e-3
#define DEFAULT_SEED             42

/* True when the host table is new enough to have `member` and it is set. */
#define HOST_HAS(h, member)                                                                                            \
    ((h)->struct_size >= offsetof(moert_host, member) + sizeof((h)->member) && (h)->member != NULL)

typedef struct router_ctx {
    const moert_host *host;
    moert_device device;    /* the layer's device: where every tensor argument must be */
    struct router_gpu *gpu; /* the CUDA path's state when the layer is on a CUDA device; NULL on the CPU */
    int64_t hidden, num_experts, topk;
    router_params params;
    bool use_expert_bias;
    double bias_update_rate;
    double aux_loss_coeff;
    double z_loss_coeff;
    int gemm;              /* router_gpu_gemm: the CUDA path's GEMM arithmetic (option "gemm") */
    int compute_dtype;     /* router_compute_dtype (option "compute_dtype") */
    double jitter_eps;     /* option "input_jitter_eps" (0: off) */
    double fwd_jitter_eps; /* the last forward's: jitter_eps, or 0 for an inference forward */
    bool force_balance;    /* option "force_load_balancing" */
    uint64_t jitter_key;   /* router_noise keys of this instance (seed, layer, rank, purpose) */
    uint64_t random_logits_key;
    uint64_t forward_calls; /* forwards so far: the `call` of the noise of the next one */
    uint64_t fwd_call;      /* the noise call of the last forward, for backward */

    /* work buffers, sized for buffer_tokens tokens */
    int64_t buffer_tokens;
    double *x;             /* [T,H] x widened to double */
    double *w;             /* [E,H] */
    double *logits;        /* [T,E] kept for backward */
    double *aux_scores;    /* [T,E] P of the balancing losses, kept for backward */
    double *aux_f;         /* [T*E] at most: f of the balancing loss, per sequence, kept for backward */
    double *probs;         /* [T,K] probs before capacity */
    double *d_probs;       /* [T,K] */
    double *d_logits;      /* [T,E] */
    double *d_x;           /* [T,H] */
    double *d_w;           /* [E,H] */
    double *route_scratch; /* router_cpu_route_scratch_doubles */
    double *k_scratch;     /* [K] */
    int32_t *sel_idx;      /* [T,K] selection before capacity, kept for backward */
    int32_t *aux_idx;      /* [K] */
    unsigned char *kept;   /* [T,K] kept for backward */
    unsigned char *bytes;  /* [E + num_groups] */
    int64_t *cap_scratch;  /* router_cpu_capacity_scratch_ints */
    int64_t *counts;       /* [E+1] int64 counts for all-reduces */
    int64_t *kept_counts;  /* [E] copies kept per expert (tokens_per_expert before padding) */

    /* the last forward, for backward */
    bool have_forward;
    bool losses_deferred;           /* it got MOERT_ROUTER_FORWARD_DEFER_LOSSES: forward_losses gives its losses */
    moert_router_losses fwd_losses; /* the CPU path's losses of a deferring forward */
    int64_t fwd_tokens;
    bool fwd_aux;         /* a balancing loss contributed */
    int64_t fwd_aux_seq;  /* S of the balancing loss */
    double fwd_aux_scale; /* A of the balancing loss */

    /* aux-loss-free balancing */
    double *expert_bias; /* [E] */
    moert_tensor bias_tensor;
    int64_t *bias_counts; /* [E] copies kept per expert since the last end_step, this rank */

    /* global_aux_loss: all-reduced counts summed over the forwards since the last end_step */
    double *global_counts; /* [E] */
    int64_t global_forwards;

    /* the instance whose step state (forward_calls, the bias and its counts, the global counts) this one uses: itself,
     * or its slot-0 twin (moert_layer_info.twin) */
    struct router_ctx *owner;
} router_ctx;

/* "cpu", "cuda:1", ... for messages. */
static const char *device_name(moert_device d, char *buf, size_t size)
{
    switch (d.type) {
    case MOERT_DEVICE_CPU: snprintf(buf, size, "cpu"); break;
    case MOERT_DEVICE_CUDA: snprintf(buf, size, "cuda:%d", d.id); break;
    case MOERT_DEVICE_CUDA_HOST: snprintf(buf, size, "cuda_host"); break;
    default: snprintf(buf, size, "device type %d", d.type); break;
    }
    return buf;
}

/* Reports a metric when the host has the service. */
static void report_metric(const router_ctx *c, const char *name, double value, const char *unit)
{
    if (HOST_HAS(c->host, metric)) c->host->metric(c->host, name, value, unit);
}

/* Frees the work buffers (not the bias or the accumulated counts). */
static void free_buffers(router_ctx *c)
{
    free(c->x);
    free(c->w);
    free(c->logits);
    free(c->aux_scores);
    free(c->aux_f);
    free(c->probs);
    free(c->d_probs);
    free(c->d_logits);
    free(c->d_x);
    free(c->d_w);
    free(c->route_scratch);
    free(c->k_scratch);
    free(c->sel_idx);
    free(c->aux_idx);
    free(c->kept);
    free(c->bytes);
    free(c->cap_scratch);
    free(c->counts);
    free(c->kept_counts);
    c->x = c->w = c->logits = c->aux_scores = c->aux_f = c->probs = c->d_probs = c->d_logits = NULL;
    c->d_x = c->d_w = c->route_scratch = c->k_scratch = NULL;
    c->sel_idx = c->aux_idx = NULL;
    c->kept = c->bytes = NULL;
    c->cap_scratch = c->counts = c->kept_counts = NULL;
    c->buffer_tokens = 0;
}

/* Makes every work buffer large enough for T tokens (grows only; keeps nothing of the old contents). */
static moert_result ensure_buffers(router_ctx *c, int64_t T)
{
    if (c->logits != NULL && T <= c->buffer_tokens) return MOERT_OK;
    free_buffers(c);
    int64_t n = T > 0 ? T : 1;
    int64_t H = c->hidden, E = c->num_experts, K = c->topk;
    size_t d = sizeof(double);
    c->x = malloc((size_t)(n * H) * d);
    c->w = malloc((size_t)(E * H) * d);
    c->logits = malloc((size_t)(n * E) * d);
    c->aux_scores = malloc((size_t)(n * E) * d);
    c->aux_f = malloc((size_t)(n * E) * d);
    c->probs = malloc((size_t)(n * K) * d);
    c->d_probs = malloc((size_t)(n * K) * d);
    c->d_logits = malloc((size_t)(n * E) * d);
    c->d_x = malloc((size_t)(n * H) * d);
    c->d_w = malloc((size_t)(E * H) * d);
    c->route_scratch = malloc((size_t)router_cpu_route_scratch_doubles(&c->params, n) * d);
    c->k_scratch = malloc((size_t)K * d);
    c->sel_idx = malloc((size_t)(n * K) * sizeof(int32_t));
    c->aux_idx = malloc((size_t)K * sizeof(int32_t));
    c->kept = malloc((size_t)(n * K));
    c->bytes = malloc((size_t)(E + c->params.num_groups));
    c->cap_scratch = malloc((size_t)router_cpu_capacity_scratch_ints(n, K, E) * sizeof(int64_t));
    c->counts = malloc((size_t)(E + 1) * sizeof(int64_t));
    c->kept_counts = malloc((size_t)E * sizeof(int64_t));
    if (!c->kept_counts || !c->x || !c->w || !c->logits || !c->aux_scores || !c->aux_f || !c->probs || !c->d_probs ||
        !c->d_logits || !c->d_x || !c->d_w || !c->route_scratch || !c->k_scratch || !c->sel_idx || !c->aux_idx ||
        !c->kept || !c->bytes || !c->cap_scratch || !c->counts) {
        free_buffers(c);
        c->host->set_error(c->host, "router '%s': out of memory for work buffers of %lld tokens", ROUTER_NAME,
                           (long long)T);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->buffer_tokens = n;
    return MOERT_OK;
}

/* Reads every option (so the core knows them all), then checks the combinations. */
static moert_result read_options(router_ctx *c, const moert_host *h, const moert_layer_info *layer)
{
    static const char *const score_choices[] = {"softmax", "sigmoid", NULL};
    static const char *const balancing_choices[] = {"none",     "aux_loss", "seq_aux_loss", "global_aux_loss",
                                                    "sinkhorn", NULL};
    static const char *const drop_choices[] = {"probs", "position", NULL};
    static const char *const gemm_choices[] = {"auto", "fp32", "bf16x3", NULL};  /* by router_gpu_gemm */
    static const char *const compute_choices[] = {"auto", "fp32", "fp64", NULL}; /* by router_compute_dtype */
    router_params *p = &c->params;
    moert_result rc;
    int score = 0, balancing = 0, drop = 0;
    bool pre_softmax = false, pad = false;
    int64_t num_groups = 0, group_topk = 0;
    double scaling = 1.0, capacity = 0.0;

    rc = h->option_enum(h, "score_function", score_choices, 0,
                        "how logits become scores: softmax over the experts, or one sigmoid per expert", &score);
    if (rc != MOERT_OK) return rc;
    rc = h->option_bool(h, "pre_softmax", false,
                        "softmax over all experts before top-k, probs not renormalised (softmax only)", &pre_softmax);
    if (rc != MOERT_OK) return rc;
    rc = h->option_int(h, "num_groups", 0, 0, 1 << 20,
                       "expert groups of group-limited top-k (0: off); must divide the number of experts", &num_groups);
    if (rc != MOERT_OK) return rc;
    rc = h->option_int(h, "group_topk", 0, 0, 1 << 20,
                       "groups a token may take experts from (group-limited top-k); must divide topk", &group_topk);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "scaling_factor", 1.0, 1e-6, 1e6, "multiplies the routing probs last (DeepSeek-V3: 2.5)",
                         &scaling);
    if (rc != MOERT_OK) return rc;
    rc = h->option_bool(h, "expert_bias", false,
                        "aux-loss-free balancing: a per-expert bias moves the selection (sigmoid only)",
                        &c->use_expert_bias);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "bias_update_rate", DEFAULT_BIAS_UPDATE_RATE, 0.0, 1.0,
                         "expert_bias step: bias += rate * sign(mean count - count) at end_step", &c->bias_update_rate);
    if (rc != MOERT_OK) return rc;
    rc = h->option_enum(h, "load_balancing", balancing_choices, 0,
                        "balancing: none, a switch aux loss (per batch, per sequence, global) or sinkhorn", &balancing);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "aux_loss_coeff", 0.0, 0.0, 1e6, "coefficient of the aux loss chosen by load_balancing",
                         &c->aux_loss_coeff);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "z_loss_coeff", 0.0, 0.0, 1e6, "coefficient of the router z-loss (0: off)",
                         &c->z_loss_coeff);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "capacity_factor", 0.0, 0.0, 1e6,
                         "expert capacity ceil(T*K/E * factor) per expert on this rank (0: no capacity)", &capacity);
    if (rc != MOERT_OK) return rc;
    rc = h->option_enum(h, "drop_policy", drop_choices, 0,
                        "over capacity, keep the highest-prob copies (probs) or the earliest tokens (position)", &drop);
    if (rc != MOERT_OK) return rc;
    rc = h->option_enum(h, "gemm", gemm_choices, 0,
                        "CUDA: the linear layer's arithmetic: fp32 GEMMs, or bf16x3 (fp32 operands split into three "
                        "bf16 terms, tensor cores, fp32 accumulation; bf16 activations only); auto picks bf16x3 for "
                        "bf16 activations. Ignored on the CPU",
                        &c->gemm);
    if (rc != MOERT_OK) return rc;
    rc = h->option_bool(h, "pad_to_capacity", false,
                        "with capacity_factor: every expert reports exactly its capacity of rows in tokens_per_expert "
                        "(static shapes; the dispatcher fills the padding with zero-weight rows, e.g. alltoall's "
                        "pad_to_capacity)",
                        &pad);
    if (rc != MOERT_OK) return rc;
    rc = h->option_float(h, "input_jitter_eps", 0.0, 0.0, 1.0,
                         "multiply the router's input by uniform(1-eps, 1+eps) noise, drawn from a counter-based hash "
                         "of (seed, layer, rank, forward, token, column) (0: off)",
                         &c->jitter_eps);
    if (rc != MOERT_OK) return rc;
    rc = h->option_bool(h, "force_load_balancing", false,
                        "benchmarks: replace the logits by standard normal noise (balanced routing on average); the "
                        "gradient passes straight through to the real logits",
                        &c->force_balance);
    if (rc != MOERT_OK) return rc;
    int64_t seed = 0;
    rc = h->option_int(h, "seed", DEFAULT_SEED, 0, INT64_MAX,
                       "seed of input_jitter_eps's noise and force_load_balancing's logits (mixed with the layer "
                       "index and the rank)",
                       &seed);
    if (rc != MOERT_OK) return rc;
    rc = h->option_enum(h, "compute_dtype", compute_choices, 0,
                        "the dtype of the logits and scores: fp32 or fp64 on both paths; auto: the CPU path in fp64, "
                        "CUDA in fp32",
                        &c->compute_dtype);
    if (rc != MOERT_OK) return rc;
    c->jitter_key =
        router_noise_key((uint64_t)seed, (uint64_t)layer->layer_index, (uint64_t)h->rank, ROUTER_NOISE_JITTER);
    c->random_logits_key =
        router_noise_key((uint64_t)seed, (uint64_t)layer->layer_index, (uint64_t)h->rank, ROUTER_NOISE_RANDOM_LOGITS);

    p->num_experts = c->num_experts;
    p->topk = c->topk;
    p->score_function = (router_score_function)score;
    p->pre_softmax = pre_softmax;
    p->num_groups = num_groups;
    p->group_topk = group_topk;
    p->scaling_factor = scaling;
    p->balancing = (router_balancing)balancing;
    p->capacity_factor = capacity;
    p->drop_policy = (router_drop_policy)drop;
    p->pad_to_capacity = pad;
    p->compute_f32 = c->compute_dtype == ROUTER_COMPUTE_FP32;

    /* combinations */
    int64_t E = c->num_experts, K = c->topk;
    if (pre_softmax && p->score_function != ROUTER_SCORE_SOFTMAX) {
        h->set_error(
            h,
            "config error at $.router.pre_softmax: applies to score_function softmax only (score_function is sigmoid)");
        return MOERT_ERR_CONFIG;
    }
    if (c->use_expert_bias && p->score_function != ROUTER_SCORE_SIGMOID) {
        h->set_error(h,
                     "config error at $.router.expert_bias: needs score_function sigmoid (score_function is softmax)");
        return MOERT_ERR_CONFIG;
    }
    if ((num_groups > 0) != (group_topk > 0)) {
        h->set_error(
            h,
            "config error at $.router.num_groups and $.router.group_topk: set both for group-limited top-k, or neither "
            "(num_groups %lld, group_topk %lld)",
            (long long)num_groups, (long long)group_topk);
        return MOERT_ERR_CONFIG;
    }
    if (num_groups > 0) {
        if (E % num_groups != 0) {
            h->set_error(h, "config error at $.router.num_groups: %lld does not divide the %lld experts",
                         (long long)num_groups, (long long)E);
            return MOERT_ERR_CONFIG;
        }
        if (group_topk > num_groups) {
            h->set_error(h, "config error at $.router.group_topk: %lld is more than num_groups %lld",
                         (long long)group_topk, (long long)num_groups);
            return MOERT_ERR_CONFIG;
        }
        if (K % group_topk != 0) {
            h->set_error(h, "config error at $.router.group_topk: %lld does not divide topk %lld",
                         (long long)group_topk, (long long)K);
            return MOERT_ERR_CONFIG;
        }
        if (K / group_topk > E / num_groups) {
            h->set_error(
                h,
                "config error at $.router.group_topk: topk/group_topk = %lld is more than the %lld experts of a group",
                (long long)(K / group_topk), (long long)(E / num_groups));
            return MOERT_ERR_CONFIG;
        }
    }
    if (p->balancing == ROUTER_BALANCE_SINKHORN) {
        const char *clash = NULL;
        if (p->score_function != ROUTER_SCORE_SOFTMAX)
            clash = "score_function sigmoid";
        else if (pre_softmax)
            clash = "pre_softmax";
        else if (num_groups > 0)
            clash = "num_groups";
        else if (c->use_expert_bias)
            clash = "expert_bias";
        else if (scaling != 1.0)
            clash = "scaling_factor";
        if (clash) {
            h->set_error(
                h,
                "config error at $.router.load_balancing: sinkhorn does not combine with %s (sinkhorn picks its own "
                "activation: softmax for topk > 1, sigmoid for topk 1)",
                clash);
            return MOERT_ERR_CONFIG;
        }
    }
    if (pad && !(capacity > 0.0)) {
        h->set_error(h, "config error at $.router.pad_to_capacity: needs capacity_factor > 0 (the capacity every "
                        "expert is padded to)");
        return MOERT_ERR_CONFIG;
    }
    if (c->gemm == 2 && c->jitter_eps > 0.0) { /* ROUTER_GEMM_BF16X3 */
        h->set_error(
            h,
            "config error at $.router.gemm: \"bf16x3\" takes the bf16 activations as they are, but input_jitter_eps %g "
            "multiplies them by fp32 noise; use gemm \"auto\" or \"fp32\"",
            c->jitter_eps);
        return MOERT_ERR_CONFIG;
    }
    if (c->compute_dtype == ROUTER_COMPUTE_FP64 && c->gemm != 0) {
        h->set_error(h,
                     "config error at $.router.gemm: \"%s\" is an fp32 GEMM, but compute_dtype fp64 computes the "
                     "logits in fp64; "
                     "leave gemm \"auto\"",
                     gemm_choices[c->gemm]);
        return MOERT_ERR_CONFIG;
    }
    bool aux_kind = p->balancing == ROUTER_BALANCE_AUX_LOSS || p->balancing == ROUTER_BALANCE_SEQ_AUX_LOSS ||
                    p->balancing == ROUTER_BALANCE_GLOBAL_AUX_LOSS;
    if (c->aux_loss_coeff > 0.0 && !aux_kind) {
        h->set_error(
            h,
            "config error at $.router.aux_loss_coeff: %g has no effect with load_balancing %s (choose aux_loss, "
            "seq_aux_loss or global_aux_loss)",
            c->aux_loss_coeff, balancing_choices[balancing]);
        return MOERT_ERR_CONFIG;
    }
    if (aux_kind && c->aux_loss_coeff == 0.0)
        h->log(h, MOERT_LOG_WARN, "load_balancing %s with aux_loss_coeff 0: the loss is 0",
               balancing_choices[balancing]);
    /* options set away from their defaults that change nothing here: warned, not refused (Megatron ignores them) */
    if (!c->use_expert_bias && c->bias_update_rate != DEFAULT_BIAS_UPDATE_RATE)
        h->log(h, MOERT_LOG_WARN, "$.router.bias_update_rate %g has no effect without expert_bias",
               c->bias_update_rate);
    if (!(capacity > 0.0) && drop != 0)
        h->log(h, MOERT_LOG_WARN, "$.router.drop_policy %s has no effect without capacity_factor > 0",
               drop_choices[drop]);
    if (seed != DEFAULT_SEED && !(c->jitter_eps > 0.0) && !c->force_balance)
        h->log(h, MOERT_LOG_WARN,
               "$.router.seed %lld has no effect without input_jitter_eps > 0 or force_load_balancing (it seeds "
               "their noise)",
               (long long)seed);
    return MOERT_OK;
}

/* init: one instance for one layer on one rank. */
static moert_result router_init(void **ctx, const moert_host *host, const moert_layer_info *layer)
{
    char dev[32];
    *ctx = NULL;
    bool on_cuda = layer->device.type == MOERT_DEVICE_CUDA;
    if (layer->device.type != MOERT_DEVICE_CPU && !on_cuda) {
        host->set_error(host, "router '%s': device %s is not supported (cpu or cuda)", ROUTER_NAME,
                        device_name(layer->device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
#ifndef MOERT_HAVE_CUDA
    if (on_cuda) {
        host->set_error(host,
                        "router '%s': device %s is not supported by this build (the CPU path only; build "
                        "with -Dcuda=enabled for the CUDA path)",
                        ROUTER_NAME, device_name(layer->device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
#endif
    if (layer->hidden < 1 || layer->num_experts < 1 || layer->topk < 1 || layer->topk > layer->num_experts) {
        host->set_error(host,
                        "router '%s': layer needs hidden >= 1 and 1 <= topk <= num_experts "
                        "(hidden %lld, num_experts %lld, topk %lld)",
                        ROUTER_NAME, (long long)layer->hidden, (long long)layer->num_experts, (long long)layer->topk);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    router_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "router '%s': out of memory", ROUTER_NAME);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    c->device = layer->device;
    c->owner = MOERT_LAYER_INFO_HAS_TWIN(layer) && layer->twin ? (router_ctx *)layer->twin : c;
    c->hidden = layer->hidden;
    c->num_experts = layer->num_experts;
    c->topk = layer->topk;
    moert_result rc = read_options(c, host, layer);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }
    int64_t E = c->num_experts;
#ifdef MOERT_HAVE_CUDA
    if (on_cuda) {
        router_gpu_config cfg = {.name = ROUTER_NAME,
                                 .params = c->params,
                                 .use_expert_bias = c->use_expert_bias,
                                 .bias_update_rate = c->bias_update_rate,
                                 .aux_loss_coeff = c->aux_loss_coeff,
                                 .z_loss_coeff = c->z_loss_coeff,
                                 .gemm = (router_gpu_gemm)c->gemm,
                                 .compute_dtype = (router_compute_dtype)c->compute_dtype,
                                 .jitter_eps = c->jitter_eps,
                                 .jitter_key = c->jitter_key,
                                 .force_balance = c->force_balance,
                                 .random_logits_key = c->random_logits_key,
                                 .twin = c->owner != c ? c->owner->gpu : NULL};
        rc = router_gpu_create(host, layer, &cfg, &c->gpu);
        if (rc != MOERT_OK) {
            free(c);
            return rc;
        }
        host->log(host, MOERT_LOG_DEBUG, "router '%s': CUDA path on %s, E=%lld K=%lld", ROUTER_NAME,
                  device_name(layer->device, dev, sizeof dev), (long long)E, (long long)c->topk);
        *ctx = c;
        return MOERT_OK;
    }
#endif
    c->bias_counts = calloc((size_t)E, sizeof(int64_t));
    c->global_counts = calloc((size_t)E, sizeof(double));
    if (c->use_expert_bias) c->expert_bias = calloc((size_t)E, sizeof(double));
    if (!c->bias_counts || !c->global_counts || (c->use_expert_bias && !c->expert_bias)) {
        free(c->bias_counts);
        free(c->global_counts);
        free(c->expert_bias);
        free(c);
        host->set_error(host, "router '%s': out of memory", ROUTER_NAME);
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    if (c->use_expert_bias) c->bias_tensor = moert_tensor_1d(c->expert_bias, moert_cpu(), MOERT_F64, E);
    if (layer->max_tokens > 0) {
        rc = ensure_buffers(c, layer->max_tokens);
        if (rc != MOERT_OK) {
            free(c->bias_counts);
            free(c->global_counts);
            free(c->expert_bias);
            free(c);
            return rc;
        }
    }
    host->log(host, MOERT_LOG_DEBUG,
              "router '%s': E=%lld K=%lld score_function=%s pre_softmax=%d groups=%lld/%lld scaling=%g "
              "expert_bias=%d load_balancing=%d capacity_factor=%g pad=%d jitter=%g force_balance=%d compute_dtype=%d",
              ROUTER_NAME, (long long)E, (long long)c->topk,
              c->params.score_function == ROUTER_SCORE_SOFTMAX ? "softmax" : "sigmoid", c->params.pre_softmax,
              (long long)c->params.num_groups, (long long)c->params.group_topk, c->params.scaling_factor,
              c->use_expert_bias, (int)c->params.balancing, c->params.capacity_factor, c->params.pad_to_capacity,
              c->jitter_eps, c->force_balance, c->compute_dtype);
    *ctx = c;
    return MOERT_OK;
}

/* finalize: frees the instance. */
static void router_finalize(void *ctx)
{
    router_ctx *c = ctx;
    if (!c) return;
#ifdef MOERT_HAVE_CUDA
    router_gpu_destroy(c->gpu);
#endif
    free_buffers(c);
    free(c->bias_counts);
    free(c->global_counts);
    free(c->expert_bias);
    free(c);
}

/* What a tensor argument may hold: any float dtype the CPU path reads, or one integer dtype. */
enum tensor_class { CLASS_FLOAT, CLASS_I32, CLASS_I64 };

static bool dtype_in_class(moert_dtype t, enum tensor_class cls)
{
    switch (cls) {
    case CLASS_FLOAT: return t == MOERT_F32 || t == MOERT_F64 || t == MOERT_BF16 || t == MOERT_F16;
    case CLASS_I32: return t == MOERT_I32;
    case CLASS_I64: return t == MOERT_I64;
    }
    return false;
}

/* The dtypes of a class, for messages. */
static const char *class_name(enum tensor_class cls)
{
    return cls == CLASS_FLOAT ? "fp32/fp64/bf16/fp16" : cls == CLASS_I32 ? "int32" : "int64";
}

/* Checks one tensor argument: present, on the layer's device (host memory on the CPU path), contiguous, the
 * expected shape (d1 < 0: 1-D) and dtype (the CUDA path narrows the float dtypes further). */
static moert_result check_tensor(const router_ctx *c, const char *call, const char *name, const moert_tensor *t,
                                 int64_t d0, int64_t d1, enum tensor_class cls)
{
    const moert_host *h = c->host;
    char dev[32];
    int ndim = d1 < 0 ? 1 : 2;
    if (!t || (!t->data && d0 * (d1 < 0 ? 1 : d1) > 0)) {
        h->set_error(h, "router '%s' %s: %s is missing", ROUTER_NAME, call, name);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (c->gpu) {
        if (t->device.type != MOERT_DEVICE_CUDA || t->device.id != c->device.id) {
            char layer_dev[32];
            h->set_error(h, "router '%s' %s: %s is on %s; this instance runs on %s and needs its tensors there",
                         ROUTER_NAME, call, name, device_name(t->device, dev, sizeof dev),
                         device_name(c->device, layer_dev, sizeof layer_dev));
            return MOERT_ERR_INVALID_ARGUMENT;
        }
    } else if (t->device.type != MOERT_DEVICE_CPU && t->device.type != MOERT_DEVICE_CUDA_HOST) {
        h->set_error(h, "router '%s' %s: %s is on %s; this instance runs on the CPU and needs host memory", ROUTER_NAME,
                     call, name, device_name(t->device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
    bool shape_ok = t->ndim == ndim && t->shape[0] == d0 && (ndim == 1 || t->shape[1] == d1);
    if (!shape_ok || !dtype_in_class(t->dtype, cls)) {
        char want[64], got[64];
        if (ndim == 1)
            snprintf(want, sizeof want, "[%lld]", (long long)d0);
        else
            snprintf(want, sizeof want, "[%lld, %lld]", (long long)d0, (long long)d1);
        int n = snprintf(got, sizeof got, "[");
        for (int i = 0; i < t->ndim && i < MOERT_MAX_DIMS && n < (int)sizeof got - 24; i++)
            n += snprintf(got + n, sizeof got - (size_t)n, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        snprintf(got + n, sizeof got - (size_t)n, "]");
        h->set_error(h, "router '%s' %s: %s must be %s %s, got %s %s", ROUTER_NAME, call, name, want, class_name(cls),
                     got, moert_dtype_name(t->dtype));
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (!moert_tensor_is_contiguous(t)) {
        h->set_error(h, "router '%s' %s: %s must be contiguous", ROUTER_NAME, call, name);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    return MOERT_OK;
}

/* Widens n elements of a float tensor to doubles. */
static void load_all(const moert_tensor *t, int64_t n, double *out)
{
    for (int64_t i = 0; i < n; i++) out[i] = moert_load(t, i);
}

/* Input jitter of forward number `call`: x [T,H] *= uniform(1-eps, 1+eps), as the compute dtype stores it. */
static void apply_jitter(const router_ctx *c, uint64_t call, int64_t T, double *x)
{
    const int64_t H = c->hidden;
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < H; i++)
            x[t * H + i] = router_cpu_as_compute(
                c->params.compute_f32,
                x[t * H + i] * router_noise_jitter(c->jitter_key, call, (uint64_t)t, (uint64_t)i, c->fwd_jitter_eps));
}

/* force_load_balancing: logits [T,E] replaced by standard normal numbers of forward number `call`. */
static void random_logits(const router_ctx *c, uint64_t call, int64_t T, double *logits)
{
    const int64_t E = c->num_experts;
    for (int64_t t = 0; t < T; t++)
        for (int64_t e = 0; e < E; e++)
            logits[t * E + e] = router_cpu_as_compute(
                c->params.compute_f32, router_noise_normal(c->random_logits_key, call, (uint64_t)t, (uint64_t)e));
}

/* The balancing losses and the z-loss of one forward; fills losses and keeps what backward needs. */
static moert_result compute_losses(router_ctx *c, int64_t T, int64_t seq_length, moert_router_losses *losses)
{
    const moert_host *h = c->host;
    int64_t E = c->num_experts, K = c->topk;
    router_balancing b = c->params.balancing;
    losses->aux_loss = 0.0;
    losses->z_loss = 0.0;
    c->fwd_aux = false;

    bool aux_kind =
        b == ROUTER_BALANCE_AUX_LOSS || b == ROUTER_BALANCE_SEQ_AUX_LOSS || b == ROUTER_BALANCE_GLOBAL_AUX_LOSS;
    if (aux_kind && c->aux_loss_coeff > 0.0) {
        int64_t S = T;
        if (b == ROUTER_BALANCE_SEQ_AUX_LOSS && seq_length > 0) {
            if (T % seq_length != 0) {
                h->set_error(h,
                             "router '%s' forward: seq_aux_loss needs whole sequences: seq_length %lld does not "
                             "divide the %lld tokens",
                             ROUTER_NAME, (long long)seq_length, (long long)T);
                return MOERT_ERR_INVALID_ARGUMENT;
            }
            S = seq_length;
        }
        if (T > 0) {
            router_cpu_aux_scores(c->params.score_function, c->logits, T, E, c->aux_scores);
            router_cpu_aux_counts(c->aux_scores, T, E, K, S, c->aux_idx, c->aux_f);
        }
        double A = 0.0;
        if (b == ROUTER_BALANCE_GLOBAL_AUX_LOSS) {
            /* f: counts all-reduced over ranks, averaged over the forwards since the last end_step */
            for (int64_t e = 0; e < E; e++) c->counts[e] = T > 0 ? (int64_t)c->aux_f[e] : 0;
            c->counts[E] = T;
            moert_result rc = h->allreduce_sum(h, c->counts, (size_t)(E + 1), MOERT_I64, moert_cpu(), NULL);
            if (rc != MOERT_OK) return rc;
            router_ctx *o = c->owner;
            o->global_forwards++;
            for (int64_t e = 0; e < E; e++) {
                o->global_counts[e] += (double)c->counts[e];
                c->aux_f[e] = o->global_counts[e] / (double)o->global_forwards;
            }
            double total_tokens = (double)c->counts[E];
            if (total_tokens > 0) A = c->aux_loss_coeff * (double)E / ((double)K * total_tokens * total_tokens);
        } else if (T > 0) {
            double B = (double)(T / S);
            A = c->aux_loss_coeff * (double)E / ((double)K * (double)S * (double)S * B);
        }
        if (T > 0) {
            losses->aux_loss = router_cpu_aux_loss(c->aux_scores, c->aux_f, T, E, S, A);
            c->fwd_aux = true;
            c->fwd_aux_seq = S;
            c->fwd_aux_scale = A;
        }
    }
    if (c->z_loss_coeff > 0.0 && T > 0) losses->z_loss = router_cpu_z_loss(c->logits, T, E, c->z_loss_coeff);
    losses->total = losses->aux_loss + losses->z_loss;
    return MOERT_OK;
}

/* forward: logits, selection, probs, capacity, counts and losses of T tokens. */
static moert_result router_forward(void *ctx, moert_stream stream, const moert_router_forward_args *a)
{
    router_ctx *c = ctx;
    const moert_host *h = c->host;
    int64_t H = c->hidden, E = c->num_experts, K = c->topk;
    moert_result rc;
    c->have_forward = false;
    c->losses_deferred = false;
    if (!a || !a->x || !a->losses) {
        h->set_error(h, "router '%s' forward: args, x and losses are required", ROUTER_NAME);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    int64_t T = a->x->ndim == 2 ? a->x->shape[0] : -1;
    if ((rc = check_tensor(c, "forward", "x", a->x, T < 0 ? 0 : T, H, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "forward", "weight", a->weight, E, H, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "forward", "topk_idx", a->topk_idx, T, K, CLASS_I32)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "forward", "topk_probs", a->topk_probs, T, K, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "forward", "tokens_per_expert", a->tokens_per_expert, E, -1, CLASS_I64)) != MOERT_OK)
        return rc;
    /* a caller built before seq_length existed passes a shorter struct: one sequence */
    int64_t seq_length =
        a->struct_size >= offsetof(moert_router_forward_args, seq_length) + sizeof a->seq_length ? a->seq_length : 0;
    if (seq_length < 0) {
        h->set_error(h, "router '%s' forward: seq_length %lld is negative", ROUTER_NAME, (long long)seq_length);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    /* the noise of this forward (jitter, random logits) is that of call number `call`, on either path; an inference
     * forward draws no jitter */
    const uint64_t call = c->owner->forward_calls++;
    c->fwd_call = call;
    const uint32_t flags =
        a->struct_size >= offsetof(moert_router_forward_args, flags) + sizeof a->flags ? a->flags : 0;
    const bool inference = flags & MOERT_ROUTER_FORWARD_INFERENCE, defer = flags & MOERT_ROUTER_FORWARD_DEFER_LOSSES;
    c->fwd_jitter_eps = inference ? 0.0 : c->jitter_eps;
#ifdef MOERT_HAVE_CUDA
    if (c->gpu) {
        if ((rc = router_gpu_forward(c->gpu, stream, a, seq_length, call, c->fwd_jitter_eps, defer, !inference)) !=
            MOERT_OK)
            return rc;
        c->fwd_tokens = T;
        c->have_forward = true;
        c->losses_deferred = defer;
        return MOERT_OK;
    }
#endif
    if ((rc = ensure_buffers(c, T)) != MOERT_OK) return rc;

    load_all(a->x, T * H, c->x);
    if (c->fwd_jitter_eps > 0.0) apply_jitter(c, call, T, c->x);
    load_all(a->weight, E * H, c->w);
    router_cpu_logits(c->x, c->w, T, H, E, c->logits);
    for (int64_t i = 0; i < T * E; i++) {
        if (!isfinite(c->logits[i])) {
            h->set_error(h, "router '%s' forward: logit of token %lld, expert %lld is %g (check x and weight)",
                         ROUTER_NAME, (long long)(i / E), (long long)(i % E), c->logits[i]);
            return MOERT_ERR_INVALID_ARGUMENT;
        }
        c->logits[i] = router_cpu_as_compute(c->params.compute_f32, c->logits[i]);
    }
    /* Megatron's force-load-balancing: the routing (and its losses) sees random logits; backward hands their
     * gradient to the real logits unchanged (a straight-through estimator) */
    if (c->force_balance) random_logits(c, call, T, c->logits);

    router_scratch scratch = {c->route_scratch, c->bytes};
    if (T > 0) {
        int64_t iters = router_cpu_route(&c->params, c->logits, c->use_expert_bias ? c->owner->expert_bias : NULL, T,
                                         &scratch, c->sel_idx, c->probs);
        if (iters < 0) h->log(h, MOERT_LOG_WARN, "router '%s': sinkhorn did not converge", ROUTER_NAME);
    }

    int64_t dropped = 0, cap = 0;
    if (c->params.capacity_factor > 0.0 && T > 0) {
        cap = router_cpu_capacity(T, K, E, c->params.capacity_factor);
        dropped = router_cpu_apply_capacity(c->sel_idx, c->probs, T, K, E, cap, c->params.drop_policy, c->cap_scratch,
                                            c->kept);
    } else {
        memset(c->kept, 1, (size_t)(T * K));
    }

    int64_t *tpe = a->tokens_per_expert->data;
    int32_t *out_idx = a->topk_idx->data;
    int64_t *kept_counts = c->kept_counts;
    for (int64_t e = 0; e < E; e++) kept_counts[e] = 0;
    for (int64_t i = 0; i < T * K; i++) {
        if (c->kept[i]) {
            out_idx[i] = c->sel_idx[i];
            moert_store(a->topk_probs, i, c->probs[i]);
            kept_counts[c->sel_idx[i]]++;
        } else {
            out_idx[i] = -1;
            moert_store(a->topk_probs, i, 0.0);
        }
    }
    /* pad_to_capacity: every expert gets `cap` rows, the kept copies and zero-weight padding */
    for (int64_t e = 0; e < E; e++) tpe[e] = c->params.pad_to_capacity ? cap : kept_counts[e];
    /* the bias follows the tokens really routed by training forwards, never the padding nor an inference forward's
     * (an evaluation between steps must not move the next update; Megatron counts only with grad enabled) */
    if (c->use_expert_bias && !inference)
        for (int64_t e = 0; e < E; e++) c->owner->bias_counts[e] += kept_counts[e];

    /* a deferring forward's losses wait in ctx for forward_losses, as the CUDA path's wait on the device */
    moert_router_losses *losses = defer ? &c->fwd_losses : a->losses;
    if ((rc = compute_losses(c, T, seq_length, losses)) != MOERT_OK) return rc;

    /* figures for the step report */
    if (c->fwd_aux) report_metric(c, "router.aux_loss", losses->aux_loss, "");
    if (c->z_loss_coeff > 0.0) report_metric(c, "router.z_loss", losses->z_loss, "");
    if (c->params.capacity_factor > 0.0) report_metric(c, "router.dropped_copies", (double)dropped, "tokens");
    if (T > 0) {
        int64_t max_count = 0;
        for (int64_t e = 0; e < E; e++)
            if (kept_counts[e] > max_count) max_count = kept_counts[e];
        report_metric(c, "router.max_load_ratio", (double)max_count / ((double)(T * K) / (double)E), "");
    }

    c->fwd_tokens = T;
    c->have_forward = true;
    c->losses_deferred = defer;
    return MOERT_OK;
}

/* forward_losses: the losses of the last forward, which deferred them (its stream has passed it). */
static moert_result router_forward_losses(void *ctx, moert_router_losses *losses)
{
    router_ctx *c = ctx;
    if (!losses) {
        c->host->set_error(c->host, "router '%s' forward_losses: losses is required", ROUTER_NAME);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (!c->have_forward || !c->losses_deferred) {
        c->host->set_error(c->host,
                           "router '%s' forward_losses: the last forward did not defer its losses (it got no "
                           "MOERT_ROUTER_FORWARD_DEFER_LOSSES, or they were already taken)",
                           ROUTER_NAME);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    c->losses_deferred = false;
#ifdef MOERT_HAVE_CUDA
    if (c->gpu) return router_gpu_forward_losses(c->gpu, losses);
#endif
    *losses = c->fwd_losses;
    return MOERT_OK;
}

/* backward: gradients of sum(d_topk_probs * topk_probs) + loss_scale * losses.total into d_x and d_weight. */
static moert_result router_backward(void *ctx, moert_stream stream, const moert_router_backward_args *a)
{
    router_ctx *c = ctx;
    const moert_host *h = c->host;
    int64_t H = c->hidden, E = c->num_experts, K = c->topk;
    moert_result rc;
    if (!a) {
        h->set_error(h, "router '%s' backward: args are required", ROUTER_NAME);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (!c->have_forward) {
        h->set_error(h, "router '%s' backward: no forward to differentiate (call forward first)", ROUTER_NAME);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    int64_t T = c->fwd_tokens;
    if ((rc = check_tensor(c, "backward", "x", a->x, T, H, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "backward", "weight", a->weight, E, H, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "backward", "d_topk_probs", a->d_topk_probs, T, K, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "backward", "d_x", a->d_x, T, H, CLASS_FLOAT)) != MOERT_OK) return rc;
    if ((rc = check_tensor(c, "backward", "d_weight", a->d_weight, E, H, CLASS_FLOAT)) != MOERT_OK) return rc;
#ifdef MOERT_HAVE_CUDA
    if (c->gpu) return router_gpu_backward(c->gpu, stream, a, T, c->fwd_call);
#endif
    if (T == 0) return MOERT_OK;

    memset(c->d_logits, 0, (size_t)(T * E) * sizeof(double));
    load_all(a->d_topk_probs, T * K, c->d_probs);
    router_cpu_probs_backward(&c->params, c->logits, c->sel_idx, c->kept, c->d_probs, T, c->k_scratch, c->d_logits);
    if (c->fwd_aux)
        router_cpu_aux_loss_backward(c->params.score_function, c->logits, c->aux_scores, c->aux_f, T, E, c->fwd_aux_seq,
                                     c->fwd_aux_scale, a->loss_scale, c->d_logits);
    if (c->z_loss_coeff > 0.0) router_cpu_z_loss_backward(c->logits, T, E, c->z_loss_coeff, a->loss_scale, c->d_logits);

    load_all(a->x, T * H, c->x);
    if (c->fwd_jitter_eps > 0.0) apply_jitter(c, c->fwd_call, T, c->x); /* the logits' x was the jittered one */
    load_all(a->weight, E * H, c->w);
    memset(c->d_x, 0, (size_t)(T * H) * sizeof(double));
    memset(c->d_w, 0, (size_t)(E * H) * sizeof(double));
    router_cpu_linear_backward(c->d_logits, c->x, c->w, T, H, E, c->d_x, c->d_w);
    if (c->fwd_jitter_eps > 0.0) /* d x = d (x * noise) * noise */
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < H; i++)
                c->d_x[t * H + i] *=
                    router_noise_jitter(c->jitter_key, c->fwd_call, (uint64_t)t, (uint64_t)i, c->fwd_jitter_eps);
    for (int64_t i = 0; i < T * H; i++) moert_store(a->d_x, i, moert_load(a->d_x, i) + c->d_x[i]);
    for (int64_t i = 0; i < E * H; i++) moert_store(a->d_weight, i, moert_load(a->d_weight, i) + c->d_w[i]);
    return MOERT_OK;
}

/* end_step: the expert-bias update from the counts of every forward since the last call; resets the
 * global_aux_loss accumulation. Collective when expert_bias is on. */
static moert_result router_end_step(void *ctx, moert_stream stream)
{
    router_ctx *c = ctx;
    const moert_host *h = c->host;
    int64_t E = c->num_experts;
    if (c->owner != c) return MOERT_OK; /* a twin: its slot-0 instance owns the step state */
#ifdef MOERT_HAVE_CUDA
    if (c->gpu) return router_gpu_end_step(c->gpu, stream);
#endif
    if (c->use_expert_bias) {
        moert_result rc = h->allreduce_sum(h, c->bias_counts, (size_t)E, MOERT_I64, moert_cpu(), NULL);
        if (rc != MOERT_OK) return rc;
        double total = 0.0;
        for (int64_t e = 0; e < E; e++) total += (double)c->bias_counts[e];
        double mean = total / (double)E;
        double max_abs = 0.0;
        for (int64_t e = 0; e < E; e++) {
            double offset = mean - (double)c->bias_counts[e];
            double sign = offset > 0.0 ? 1.0 : offset < 0.0 ? -1.0 : 0.0;
            c->expert_bias[e] += c->bias_update_rate * sign;
            if (fabs(c->expert_bias[e]) > max_abs) max_abs = fabs(c->expert_bias[e]);
            c->bias_counts[e] = 0;
        }
        report_metric(c, "router.expert_bias_absmax", max_abs, "");
    }
    for (int64_t e = 0; e < E; e++) c->global_counts[e] = 0.0;
    c->global_forwards = 0;
    return MOERT_OK;
}

/* The expert bias for reports and tests, or NULL without expert_bias. */
static const moert_tensor *router_expert_bias(void *ctx)
{
    router_ctx *c = ctx;
#ifdef MOERT_HAVE_CUDA
    if (c->gpu) return router_gpu_expert_bias(c->gpu);
#endif
    c = c->owner;
    return c->use_expert_bias ? &c->bias_tensor : NULL;
}

/* The one exported symbol. C cannot name a variable like its type, so the symbol name comes from an asm label. */
MOERT_ROUTER_V1_EXPORT(topk_router_vtable) = {
    .header =
        {
            MOERT_ROUTER_V1_HEADER, .name = ROUTER_NAME, .version = "0.1.0",
            .description =
                "top-k router: softmax/sigmoid scores, group-limited top-k, aux/seq/global aux loss, "
                "z-loss, sinkhorn, expert bias, capacity and padding, input jitter, forced balance, fp32/fp64",
#ifdef MOERT_HAVE_CUDA
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
#else
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU),
#endif
            .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                      MOERT_CAP_DTYPE(MOERT_F16),
#ifdef MOERT_HAVE_CUDA
            .flags = MOERT_CAP_NEEDS_HOST_SYNC, /* CUDA: the loss values are copied to the host when a loss is on */
#else
            .flags = 0,
#endif
        },
    .init = router_init,
    .finalize = router_finalize,
    .forward = router_forward,
    .backward = router_backward,
    .end_step = router_end_step,
    .expert_bias = router_expert_bias,
    .forward_losses = router_forward_losses,
};
