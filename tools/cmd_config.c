/* SPDX-License-Identifier: Apache-2.0 */
/* `moert config --from-megatron ARGS...`: a moert config from Megatron-LM's MoE and model flags.
 *
 * Each flag a Megatron user passes for an MoE layer maps onto one moert key (the table below, also in
 * docs/config.md), or is ignored because it does not concern the MoE layer (attention, data, optimizer), or is
 * refused by name because moert does not model it yet: never dropped silently. Megatron's defaults apply to the
 * flags left out, so the config means what the same command line means to Megatron.
 */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"

typedef enum map_kind {
    MAP_INT,     /* an integer >= its minimum, into key */
    MAP_FLOAT,   /* a number, into key */
    MAP_ENUM,    /* one of `choices`, written as the moert value at the same position of `values` */
    MAP_TRUE,    /* a switch (no value): key = true */
    MAP_ON,      /* a switch (no value): key = "on" (an auto/off/on mode) */
    MAP_SPECIAL, /* handled in code: dispatcher, precision, recompute, tokens */
    MAP_IGNORE,  /* not about the MoE layer; `why` says so (takes a value unless `no_value`) */
    MAP_REFUSE   /* moert cannot do it yet: refused, `why` says what is missing */
} map_kind;

typedef struct flag_map {
    const char *flag;
    map_kind kind;
    const char *key;            /* dotted moert key */
    const char *const *choices; /* MAP_ENUM: Megatron's values */
    const char *const *values;  /* MAP_ENUM: moert's, same positions */
    long long min;              /* MAP_INT */
    bool no_value;              /* a switch */
    const char *why;            /* MAP_IGNORE, MAP_REFUSE */
} flag_map;

static const char *const score_choices[] = {"softmax", "sigmoid", NULL};
static const char *const balancing_choices[] = {"aux_loss", "seq_aux_loss", "global_aux_loss",
                                                "sinkhorn", "none",         NULL};
static const char *const drop_choices[] = {"probs", "position", NULL};

/* clang-format off */
static const flag_map flag_table[] = {
    {"--num-experts", MAP_INT, "model.num_experts", NULL, NULL, 1, false, NULL},
    {"--moe-router-topk", MAP_INT, "model.topk", NULL, NULL, 1, false, NULL},
    {"--hidden-size", MAP_INT, "model.hidden", NULL, NULL, 1, false, NULL},
    {"--moe-ffn-hidden-size", MAP_INT, "model.ffn_hidden", NULL, NULL, 1, false, NULL},
    {"--ffn-hidden-size", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--bf16", MAP_SPECIAL, NULL, NULL, NULL, 0, true, NULL},
    {"--fp16", MAP_REFUSE, NULL, NULL, NULL, 0, true, "fp16 activations are not supported (use --bf16)"},
    {"--expert-model-parallel-size", MAP_INT, "parallel.ranks", NULL, NULL, 1, false, NULL},
    {"--expert-tensor-parallel-size", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--moe-router-score-function", MAP_ENUM, "router.score_function", score_choices, score_choices, 0, false, NULL},
    {"--moe-router-pre-softmax", MAP_TRUE, "router.pre_softmax", NULL, NULL, 0, true, NULL},
    {"--moe-router-num-groups", MAP_INT, "router.num_groups", NULL, NULL, 1, false, NULL},
    {"--moe-router-group-topk", MAP_INT, "router.group_topk", NULL, NULL, 1, false, NULL},
    {"--moe-router-topk-scaling-factor", MAP_FLOAT, "router.scaling_factor", NULL, NULL, 0, false, NULL},
    {"--moe-router-load-balancing-type", MAP_ENUM, "router.load_balancing", balancing_choices, balancing_choices, 0,
     false, NULL},
    {"--moe-aux-loss-coeff", MAP_FLOAT, "router.aux_loss_coeff", NULL, NULL, 0, false, NULL},
    {"--moe-z-loss-coeff", MAP_FLOAT, "router.z_loss_coeff", NULL, NULL, 0, false, NULL},
    {"--moe-router-enable-expert-bias", MAP_TRUE, "router.expert_bias", NULL, NULL, 0, true, NULL},
    {"--moe-router-bias-update-rate", MAP_FLOAT, "router.bias_update_rate", NULL, NULL, 0, false, NULL},
    {"--moe-expert-capacity-factor", MAP_FLOAT, "router.capacity_factor", NULL, NULL, 0, false, NULL},
    {"--moe-token-drop-policy", MAP_ENUM, "router.drop_policy", drop_choices, drop_choices, 0, false, NULL},
    {"--moe-router-dtype", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--moe-token-dispatcher-type", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--moe-flex-dispatcher-backend", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--moe-enable-deepep", MAP_SPECIAL, NULL, NULL, NULL, 0, true, NULL},
    {"--moe-deepep-num-sms", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--moe-hybridep-num-sms", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--fp8-format", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--fp8-recipe", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--recompute-modules", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--recompute-granularity", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--seq-length", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--micro-batch-size", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--moe-shared-expert-intermediate-size", MAP_SPECIAL, NULL, NULL, NULL, 0, false, NULL},
    {"--moe-shared-expert-overlap", MAP_TRUE, "parallel.shared_expert_overlap", NULL, NULL, 0, true, NULL},
    {"--overlap-moe-expert-parallel-comm", MAP_ON, "parallel.overlap_micro_batches", NULL, NULL, 0, true, NULL},
    {"--delay-wgrad-compute", MAP_TRUE, "parallel.overlap_wgrad", NULL, NULL, 0, true, NULL},
    {"--moe-pad-expert-input-to-capacity", MAP_SPECIAL, NULL, NULL, NULL, 0, true, NULL},
    {"--moe-input-jitter-eps", MAP_FLOAT, "router.input_jitter_eps", NULL, NULL, 0, false, NULL},
    {"--moe-router-force-load-balancing", MAP_TRUE, "router.force_load_balancing", NULL, NULL, 0, true, NULL},
    {"--moe-layer-recompute", MAP_SPECIAL, NULL, NULL, NULL, 0, true, NULL},
    {"--moe-grouped-gemm", MAP_IGNORE, NULL, NULL, NULL, 0, true, "moert's expert GEMMs are always grouped"},
    {"--moe-permute-fusion", MAP_IGNORE, NULL, NULL, NULL, 0, true, "moert's dispatchers fuse their permutes"},
    {"--moe-router-fusion", MAP_IGNORE, NULL, NULL, NULL, 0, true, "moert's router fuses its kernels"},
    {"--moe-layer-freq", MAP_IGNORE, NULL, NULL, NULL, 0, false, "which Transformer layers are MoE is the model's"},
    {"--num-layers", MAP_IGNORE, NULL, NULL, NULL, 0, false, "a moert config describes MoE layers (model.num_layers)"},
    {"--num-attention-heads", MAP_IGNORE, NULL, NULL, NULL, 0, false, "attention"},
    {"--num-query-groups", MAP_IGNORE, NULL, NULL, NULL, 0, false, "attention"},
    {"--group-query-attention", MAP_IGNORE, NULL, NULL, NULL, 0, true, "attention"},
    {"--kv-channels", MAP_IGNORE, NULL, NULL, NULL, 0, false, "attention"},
    {"--max-position-embeddings", MAP_IGNORE, NULL, NULL, NULL, 0, false, "embeddings"},
    {"--position-embedding-type", MAP_IGNORE, NULL, NULL, NULL, 0, false, "embeddings"},
    {"--rotary-base", MAP_IGNORE, NULL, NULL, NULL, 0, false, "embeddings"},
    {"--normalization", MAP_IGNORE, NULL, NULL, NULL, 0, false, "norms"},
    {"--norm-epsilon", MAP_IGNORE, NULL, NULL, NULL, 0, false, "norms"},
    {"--swiglu", MAP_IGNORE, NULL, NULL, NULL, 0, true, "moert's experts are SwiGLU"},
    {"--untie-embeddings-and-output-weights", MAP_IGNORE, NULL, NULL, NULL, 0, true, "embeddings"},
    {"--disable-bias-linear", MAP_IGNORE, NULL, NULL, NULL, 0, true, "moert's expert GEMMs have no bias"},
    {"--tensor-model-parallel-size", MAP_IGNORE, NULL, NULL, NULL, 0, false, "attention's parallelism"},
    {"--pipeline-model-parallel-size", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--virtual-pipeline-model-parallel-size", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--num-layers-per-virtual-pipeline-stage", MAP_SPECIAL, NULL, NULL, NULL, 1, false, NULL},
    {"--context-parallel-size", MAP_IGNORE, NULL, NULL, NULL, 0, false, "attention's parallelism"},
    {"--sequence-parallel", MAP_IGNORE, NULL, NULL, NULL, 0, true, "attention's parallelism"},
    {"--global-batch-size", MAP_IGNORE, NULL, NULL, NULL, 0, false, "the data loader's"},
    {"--lr", MAP_IGNORE, NULL, NULL, NULL, 0, false, "the caller's optimizer"},
    {"--use-distributed-optimizer", MAP_IGNORE, NULL, NULL, NULL, 0, true, "the caller's optimizer"},
};
/* clang-format on */

static const flag_map *find_flag(const char *flag)
{
    for (size_t i = 0; i < sizeof flag_table / sizeof flag_table[0]; i++)
        if (!strcmp(flag_table[i].flag, flag)) return &flag_table[i];
    return NULL;
}

/* What the flags said that needs more than one key. */
typedef struct import_state {
    json_t *root;
    const char *dispatcher, *flex_backend, *fp8_format, *fp8_recipe, *recompute_modules, *granularity;
    long long seq_length, micro_batch, ffn_hidden, shared_ffn, etp;
    long long deepep_sms, hybridep_sms; /* --moe-deepep-num-sms, --moe-hybridep-num-sms (0: not given) */
    long long pipeline, virtual_stages; /* --pipeline-model-parallel-size; the interleaved schedule's flags (0: none) */
    bool bf16, deepep, moe_layer_recompute, pad_to_capacity;
    char modules[512]; /* --recompute-modules takes a list: its words, space-separated */
} import_state;

/* Sets the dotted key ("router.aux_loss_coeff") to value, making the sections it needs. */
static void set_key(json_t *root, const char *dotted, json_t *value)
{
    char section[64];
    const char *dot = strchr(dotted, '.');
    snprintf(section, sizeof section, "%.*s", (int)(dot - dotted), dotted);
    json_t *obj = json_object_get(root, section);
    if (!obj) {
        obj = json_object();
        json_object_set_new(root, section, obj);
    }
    json_object_set_new(obj, dot + 1, value);
}

static int fail(const char *fmt, const char *a, const char *b)
{
    fprintf(stderr, "moert config: ");
    fprintf(stderr, fmt, a, b);
    fputc('\n', stderr);
    return 1;
}

static bool parse_int(const char *text, long long min, long long *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (errno || end == text || *end || v < min) return false;
    *out = v;
    return true;
}

/* Any number strtod reads, inf and nan included (an overflow reads as inf): the caller refuses those by name. */
static bool parse_float(const char *text, double *out)
{
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (end == text || *end || (errno && isfinite(v))) return false;
    *out = v;
    return true;
}

/* *out = a * b, or 1 after naming both factors when the product does not fit (flag values reach LLONG_MAX) */
static int multiply(long long a, long long b, const char *what_a, const char *what_b, long long *out)
{
    if (__builtin_mul_overflow(a, b, out)) return fail("the product of %s and %s is too large", what_a, what_b);
    return 0;
}

/* Whether a command-line word is a flag rather than a value: it starts with '-', unless it is a negative number
 * ("-1", "-.5"), which argparse, too, reads as a value. */
static bool is_flag(const char *arg)
{
    if (arg[0] != '-' || arg[1] == '\0') return false;
    return !isdigit((unsigned char)arg[1]) && !(arg[1] == '.' && isdigit((unsigned char)arg[2]));
}

/* One flag and its value (NULL for a switch). Returns 0, or 1 after printing why. */
static int apply_flag(import_state *st, const flag_map *f, const char *value)
{
    long long n = 0;
    double x = 0;
    switch (f->kind) {
    case MAP_INT:
        if (!parse_int(value, f->min, &n)) return fail("%s: \"%s\" is not a positive integer", f->flag, value);
        set_key(st->root, f->key, json_integer(n));
        return 0;
    case MAP_FLOAT:
        if (!parse_float(value, &x)) return fail("%s: \"%s\" is not a non-negative number", f->flag, value);
        /* json_real refuses inf and nan: the key would be dropped without a word */
        if (!isfinite(x)) return fail("%s: expected a finite number, got %s", f->flag, value);
        if (x < 0) return fail("%s: \"%s\" is not a non-negative number", f->flag, value);
        set_key(st->root, f->key, json_real(x));
        return 0;
    case MAP_ENUM:
        for (int i = 0; f->choices[i]; i++)
            if (!strcmp(value, f->choices[i])) {
                set_key(st->root, f->key, json_string(f->values[i]));
                return 0;
            }
        return fail("%s: \"%s\" is not one of Megatron's values for it", f->flag, value);
    case MAP_TRUE: set_key(st->root, f->key, json_true()); return 0;
    case MAP_ON: set_key(st->root, f->key, json_string("on")); return 0;
    case MAP_IGNORE: return 0;
    case MAP_REFUSE: return fail("%s: %s", f->flag, f->why);
    case MAP_SPECIAL: break;
    }
    const char *flag = f->flag;
    if (!strcmp(flag, "--bf16"))
        st->bf16 = true;
    else if (!strcmp(flag, "--moe-enable-deepep"))
        st->deepep = true;
    else if (!strcmp(flag, "--moe-layer-recompute"))
        st->moe_layer_recompute = true;
    else if (!strcmp(flag, "--moe-token-dispatcher-type"))
        st->dispatcher = value;
    else if (!strcmp(flag, "--moe-flex-dispatcher-backend"))
        st->flex_backend = value;
    else if (!strcmp(flag, "--fp8-format"))
        st->fp8_format = value;
    else if (!strcmp(flag, "--fp8-recipe"))
        st->fp8_recipe = value;
    else if (!strcmp(flag, "--recompute-modules"))
        st->recompute_modules = value;
    else if (!strcmp(flag, "--recompute-granularity"))
        st->granularity = value;
    else if (!strcmp(flag, "--moe-router-dtype")) {
        if (strcmp(value, "fp32") && strcmp(value, "fp64"))
            return fail("%s: \"%s\" is not one of Megatron's values for it (fp32, fp64)", flag, value);
        /* fp32 is what the router's default compute_dtype ("auto") gives at least: left to it */
        if (!strcmp(value, "fp64")) set_key(st->root, "router.compute_dtype", json_string(value));
    } else if (!strcmp(flag, "--moe-pad-expert-input-to-capacity")) {
        st->pad_to_capacity = true;
    } else {
        long long *slot = !strcmp(flag, "--seq-length")                     ? &st->seq_length
                          : !strcmp(flag, "--micro-batch-size")             ? &st->micro_batch
                          : !strcmp(flag, "--ffn-hidden-size")              ? &st->ffn_hidden
                          : !strcmp(flag, "--expert-tensor-parallel-size")  ? &st->etp
                          : !strcmp(flag, "--moe-deepep-num-sms")           ? &st->deepep_sms
                          : !strcmp(flag, "--moe-hybridep-num-sms")         ? &st->hybridep_sms
                          : !strcmp(flag, "--pipeline-model-parallel-size") ? &st->pipeline
                          : !strcmp(flag, "--virtual-pipeline-model-parallel-size") ||
                                  !strcmp(flag, "--num-layers-per-virtual-pipeline-stage")
                              ? &st->virtual_stages
                              : &st->shared_ffn;
        if (!parse_int(value, f->min, slot)) return fail("%s: \"%s\" is not an integer in range", flag, value);
    }
    return 0;
}

/* The flags that combine into keys: dtype, ffn size, dispatcher, precision, recompute, tokens, parallelism. */
static int finish(import_state *st)
{
    json_t *model = json_object_get(st->root, "model");
    if (!model || !json_object_get(model, "num_experts")) return fail("%s%s is required", "--num-experts", "");
    if (!json_object_get(model, "hidden")) return fail("%s%s is required", "--hidden-size", "");
    if (!json_object_get(model, "ffn_hidden")) {
        if (!st->ffn_hidden) return fail("%s (or %s) is required", "--moe-ffn-hidden-size", "--ffn-hidden-size");
        set_key(st->root, "model.ffn_hidden", json_integer(st->ffn_hidden));
    }
    if (!json_object_get(model, "topk")) set_key(st->root, "model.topk", json_integer(2)); /* Megatron's default */
    set_key(st->root, "model.num_layers", json_integer(1));
    set_key(st->root, "model.dtype", json_string(st->bf16 || st->fp8_format ? "bf16" : "fp32"));
    if (st->shared_ffn > 0) set_key(st->root, "model.shared_expert_ffn_hidden", json_integer(st->shared_ffn));
    /* expert tensor parallelism (parallel folding, docs/parallel.md): the MoE ranks are EP x ETP */
    if (st->etp > 1) {
        json_t *parallel = json_object_get(st->root, "parallel");
        json_t *ep = parallel ? json_object_get(parallel, "ranks") : NULL;
        long long ep_size = ep ? (long long)json_integer_value(ep) : 1;
        set_key(st->root, "parallel.expert_parallel", json_integer(ep_size));
        set_key(st->root, "parallel.expert_tensor_parallel", json_integer(st->etp));
        long long ranks = 0;
        if (multiply(ep_size, st->etp, "--expert-model-parallel-size", "--expert-tensor-parallel-size", &ranks))
            return 1;
        set_key(st->root, "parallel.ranks", json_integer(ranks));
    }

    /* router: Megatron's balancing default is aux_loss with coefficient 0, which does nothing: none in moert */
    set_key(st->root, "router.plugin", json_string("topk"));
    json_t *router = json_object_get(st->root, "router");
    json_t *balancing = json_object_get(router, "load_balancing");
    json_t *coeff = json_object_get(router, "aux_loss_coeff");
    double c = coeff ? json_number_value(coeff) : 0.0;
    const char *type = balancing ? json_string_value(balancing) : "aux_loss";
    if (strcmp(type, "sinkhorn") && strcmp(type, "none") && c == 0.0) {
        json_object_del(router, "load_balancing");
        json_object_del(router, "aux_loss_coeff");
    } else if (!balancing) {
        set_key(st->root, "router.load_balancing", json_string("aux_loss"));
    }
    if (!json_object_get(router, "score_function")) set_key(st->root, "router.score_function", json_string("softmax"));

    /* dispatcher: allgather (Megatron's default), alltoall, or flex with a DeepEP / HybridEP backend */
    const char *plugin = "alltoall";
    const char *dtype = st->dispatcher ? st->dispatcher : "allgather"; /* Megatron's default */
    if (st->deepep) dtype = "flex";
    if (!strcmp(dtype, "alltoall"))
        plugin = "alltoall";
    else if (!strcmp(dtype, "allgather"))
        plugin = "allgather";
    else if (!strcmp(dtype, "flex")) {
        const char *backend = st->flex_backend ? st->flex_backend : "deepep";
        if (!strcmp(backend, "deepep"))
            plugin = "deepep";
        else if (!strcmp(backend, "hybridep"))
            plugin = "hybridep";
        else
            return fail("--moe-flex-dispatcher-backend: \"%s\" is not deepep or hybridep%s", backend, "");
    } else if (!strcmp(dtype, "alltoall_seq"))
        return fail("--moe-token-dispatcher-type %s: use alltoall%s", dtype, "");
    else
        return fail("--moe-token-dispatcher-type: \"%s\" is not one of Megatron's values%s", dtype, "");
    set_key(st->root, "dispatcher.plugin", json_string(plugin));
    /* the SMs of the flex backend that runs (Megatron, too, reads only that backend's flag); without one moert's
     * default stays: deepep on every SM, 24 under the micro-batch overlap; hybridep on 16 */
    const long long sms = !strcmp(plugin, "deepep")     ? st->deepep_sms
                          : !strcmp(plugin, "hybridep") ? st->hybridep_sms
                                                        : 0;
    if (sms > 0) set_key(st->root, "dispatcher.num_sms", json_integer(sms));
    /* under the micro-batch overlap the GEMMs leave the running backend's SMs to its calls (hybridep's default 16;
     * deepep's default is $.parallel.overlap_comm_sms's, 24) */
    const long long comm_sms = sms > 0 ? sms : !strcmp(plugin, "hybridep") ? 16 : 0;
    if (comm_sms > 0) set_key(st->root, "parallel.overlap_comm_sms", json_integer(comm_sms));
    /* a pipeline's 1F1B warm-up holds one forward of the first stage's layers per stage, the interleaved schedule
     * (virtual stages) up to twice that: the slots each layer needs */
    long long in_flight = st->pipeline;
    if (st->pipeline > 1 && st->virtual_stages > 0 &&
        multiply(st->pipeline, 2, "--pipeline-model-parallel-size", "2 (the interleaved schedule)", &in_flight))
        return 1;
    if (in_flight > 32) { /* $.parallel.forwards_in_flight's bound */
        char text[160];
        snprintf(text, sizeof text, "--pipeline-model-parallel-size %lld%s holds %lld forwards of a layer in flight",
                 st->pipeline, st->virtual_stages > 0 ? " (interleaved)" : "", in_flight);
        return fail("%s; moert's $.parallel.forwards_in_flight allows up to 32%s", text, "");
    }
    if (in_flight > 1) set_key(st->root, "parallel.forwards_in_flight", json_integer(in_flight));
    /* padding to capacity: the router reports every expert at capacity, the dispatcher fills the rows */
    if (st->pad_to_capacity) {
        json_t *factor = json_object_get(router, "capacity_factor");
        if (!factor) return fail("%s needs %s", "--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor");
        if (strcmp(plugin, "alltoall"))
            return fail("--moe-pad-expert-input-to-capacity: moert's %s dispatcher does not pad (alltoall does)%s",
                        plugin, "");
        set_key(st->root, "router.pad_to_capacity", json_true());
        set_key(st->root, "dispatcher.pad_to_capacity", json_true());
        set_key(st->root, "dispatcher.capacity_factor", json_real(json_number_value(factor)));
    }

    /* precision: bf16, or fp8 with its recipe and format */
    if (!st->fp8_format && st->fp8_recipe) return fail("%s needs %s", "--fp8-recipe", "--fp8-format");
    if (st->fp8_format) {
        const char *recipe = st->fp8_recipe ? st->fp8_recipe : "delayed";
        const char *moert_recipe = !strcmp(recipe, "delayed")      ? "delayed"
                                   : !strcmp(recipe, "tensorwise") ? "current"
                                   : !strcmp(recipe, "blockwise")  ? "blockwise"
                                                                   : NULL;
        if (!moert_recipe) return fail("--fp8-recipe %s: not supported (delayed, tensorwise, blockwise)%s", recipe, "");
        if (strcmp(st->fp8_format, "e4m3") && strcmp(st->fp8_format, "hybrid"))
            return fail("--fp8-format %s: not supported (e4m3, hybrid)%s", st->fp8_format, "");
        set_key(st->root, "precision.plugin", json_string("fp8"));
        set_key(st->root, "precision.recipe", json_string(moert_recipe));
        set_key(st->root, "precision.format", json_string(st->fp8_format));
    } else {
        set_key(st->root, "precision.plugin", json_string("bf16"));
    }

    /* memory: Megatron's recompute of the MoE activation, or of the whole MoE layer */
    set_key(st->root, "memory_policy.plugin", json_string("default"));
    bool act = false, whole = st->moe_layer_recompute;
    if (st->recompute_modules) {
        if (st->granularity && strcmp(st->granularity, "selective"))
            return fail("--recompute-granularity %s: only selective recompute maps onto a memory policy%s",
                        st->granularity, "");
        char modules[512];
        snprintf(modules, sizeof modules, "%s", st->recompute_modules);
        for (char *save = NULL, *m = strtok_r(modules, ", ", &save); m; m = strtok_r(NULL, ", ", &save)) {
            if (!strcmp(m, "moe_act"))
                act = true;
            else if (!strcmp(m, "moe"))
                whole = true;
            else if (strcmp(m, "core_attn") && strcmp(m, "layernorm") && strcmp(m, "mla_up_proj") && strcmp(m, "mlp") &&
                     strcmp(m, "shared_experts"))
                return fail("--recompute-modules: \"%s\" is not one of Megatron's modules%s", m, "");
        }
    }
    if (whole || act) set_key(st->root, "memory_policy.swiglu_out", json_string("recompute"));
    if (whole) {
        set_key(st->root, "memory_policy.dispatched_x", json_string("recompute"));
        set_key(st->root, "memory_policy.fc1_out", json_string("recompute"));
    }
    /* tokens per rank: Megatron has no default micro-batch size (validate_args asserts one is given), so one of the
     * pair without the other is refused rather than dropped */
    if (st->seq_length && !st->micro_batch) return fail("%s needs %s", "--seq-length", "--micro-batch-size");
    if (st->micro_batch && !st->seq_length) return fail("%s needs %s", "--micro-batch-size", "--seq-length");
    if (st->seq_length) {
        long long tokens = 0;
        if (multiply(st->seq_length, st->micro_batch, "--seq-length", "--micro-batch-size", &tokens)) return 1;
        set_key(st->root, "train.tokens_per_rank", json_integer(tokens));
    }
    return 0;
}

/* Reads whitespace-separated arguments from a file ('#' starts a comment to the end of its line). */
static int read_args_file(const char *path, char ***out, int *count, char **text_out)
{
    FILE *f = fopen(path, "r");
    if (!f) return fail("%s: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *text = malloc(cap);
    int c;
    bool comment = false;
    while (text && (c = fgetc(f)) != EOF) {
        if (c == '#') comment = true;
        if (c == '\n') comment = false;
        if (comment || c == '\\') c = ' ';
        if (len + 2 > cap) text = realloc(text, cap *= 2);
        if (text) text[len++] = (char)c;
    }
    fclose(f);
    if (!text) return fail("%s: out of memory%s", path, "");
    text[len] = '\0';
    char **args = calloc(len / 2 + 2, sizeof *args);
    int n = 0;
    for (char *save = NULL, *a = strtok_r(text, " \t\r\n", &save); a && args; a = strtok_r(NULL, " \t\r\n", &save))
        args[n++] = a;
    *out = args;
    *count = n;
    *text_out = text;
    return 0;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: moert config --from-megatron [--args-file FILE] [MEGATRON FLAGS...]\n"
               "  writes a moert config (JSON, on stdout) from Megatron-LM's MoE and model flags; a flag moert\n"
               "  cannot map is refused by name (docs/config.md, \"Megatron flags\")\n");
}

int moert_cmd_config(int argc, char **argv)
{
    if (argc < 1 || strcmp(argv[0], "--from-megatron")) {
        usage(argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) ? stdout : stderr);
        return argc >= 1 && (!strcmp(argv[0], "--help") || !strcmp(argv[0], "-h")) ? 0 : 2;
    }
    char **args = argv + 1, **file_args = NULL, *file_text = NULL;
    int nargs = argc - 1;
    if (nargs >= 2 && !strcmp(args[0], "--args-file")) {
        /* the file's flags, then the ones after it on the command line */
        int nfile = 0;
        if (read_args_file(args[1], &file_args, &nfile, &file_text)) return 1;
        char **all = realloc(file_args, (size_t)(nfile + nargs) * sizeof *all);
        if (!all) {
            free(file_args);
            free(file_text);
            return fail("%s%s", "out of memory", "");
        }
        for (int i = 2; i < nargs; i++) all[nfile + i - 2] = args[i];
        file_args = args = all;
        nargs = nfile + nargs - 2;
    }
    import_state st = {.root = json_object()};
    int status = 0;
    json_object_set_new(st.root, "name", json_string("from-megatron"));
    for (int i = 0; i < nargs && status == 0; i++) {
        char flag[128];
        const char *value = NULL, *eq = strchr(args[i], '=');
        snprintf(flag, sizeof flag, "%.*s", eq ? (int)(eq - args[i]) : (int)strlen(args[i]), args[i]);
        const flag_map *f = find_flag(flag);
        if (!f) {
            bool moe = !strncmp(flag, "--moe-", 6) || !strncmp(flag, "--fp8", 5) || !strncmp(flag, "--expert-", 9);
            status = moe ? fail("%s: an MoE flag moert does not know how to map%s", flag, "")
                         : fail("%s: not a flag moert knows (only MoE and model flags are read)%s", flag, "");
            break;
        }
        if (f->no_value) {
            /* a switch takes no value, as with Megatron's argparse (store_true): --bf16=false is refused, not read
             * as --bf16 */
            if (eq) status = fail("%s is a switch and takes no value (got \"%s\")", flag, eq + 1);
        } else if (eq) {
            value = eq + 1;
        } else if (i + 1 < nargs && !is_flag(args[i + 1])) {
            value = args[++i];
        } else {
            /* the next word is a flag (--lr --bf16): not taken as the value, which would drop that flag */
            status = fail("%s needs a value%s", flag, "");
        }
        /* Megatron reads --recompute-modules as a list (nargs '+'): every word up to the next flag */
        if (status == 0 && !strcmp(flag, "--recompute-modules")) {
            snprintf(st.modules, sizeof st.modules, "%s", value);
            for (; i + 1 < nargs && !is_flag(args[i + 1]); i++) {
                size_t used = strlen(st.modules);
                snprintf(st.modules + used, sizeof st.modules - used, " %s", args[i + 1]);
            }
            value = st.modules;
        }
        if (status == 0) status = apply_flag(&st, f, value);
    }
    if (status == 0) status = finish(&st);
    if (status == 0) {
        /* the result must be a config moert accepts */
        char *text = json_dumps(st.root, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
        moert_config *cfg = NULL;
        if (!text || moert_config_load_string(text, "from-megatron", &cfg) != MOERT_OK) {
            fprintf(stderr, "moert config: the flags give a config moert refuses: %s\n", moert_last_error());
            status = 1;
        } else {
            printf("%s\n", text);
        }
        moert_config_free(cfg);
        free(text);
    }
    json_decref(st.root);
    free(file_args);
    free(file_text);
    return status;
}
