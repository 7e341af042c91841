/* SPDX-License-Identifier: Apache-2.0 */
/* Config: JSON files read with jansson, typed sections with JSON-path errors and unknown-key checks. */
#include "config.h"

#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "error.h"

/*
 * Every error this file reports starts with "config error at <JSON path>: " and then says what was found
 * and what was expected, e.g.
 *   config error at $.model.topk: got 9, expected an integer in [1, 8]
 *   config error at $.model.hiden: unknown key (did you mean "hidden"?)
 * docs/config.md lists them.
 */

/* ---- sections ---- */

#define SECTION_VALUE_TEXT 96

struct moert_section {
    json_t *obj;    /* borrowed; NULL: every key takes its default */
    char path[256]; /* "$.router" */
    char **known;   /* keys read or allowed, for the unknown-key check and its suggestion */
    int known_count, known_cap;
    bool describe;
    moert_option_desc *options;
    int option_count, option_cap;
    pthread_mutex_t lock; /* instances of one plugin on several rank threads may share a section */
};

/* Opens a section over obj (borrowed, may be NULL) whose JSON path is path. */
moert_section *moert_section_create(json_t *obj, const char *path)
{
    moert_section *sec = calloc(1, sizeof *sec);
    if (!sec) return NULL;
    sec->obj = json_is_object(obj) ? obj : NULL;
    snprintf(sec->path, sizeof sec->path, "%s", path ? path : "$");
    pthread_mutex_init(&sec->lock, NULL);
    return sec;
}

/* Frees the section (not the JSON object it reads). */
void moert_section_free(moert_section *sec)
{
    if (!sec) return;
    for (int i = 0; i < sec->known_count; i++) free(sec->known[i]);
    free(sec->known);
    free(sec->options);
    pthread_mutex_destroy(&sec->lock);
    free(sec);
}

/* Adds key to the known keys once; the caller holds the lock. */
static void note_known_locked(moert_section *sec, const char *key)
{
    for (int i = 0; i < sec->known_count; i++)
        if (strcmp(sec->known[i], key) == 0) return;
    if (sec->known_count == sec->known_cap) {
        int cap = sec->known_cap ? sec->known_cap * 2 : 16;
        char **grown = realloc(sec->known, (size_t)cap * sizeof *grown);
        if (!grown) return; /* the key may later be reported unknown: a message, not a crash */
        sec->known = grown;
        sec->known_cap = cap;
    }
    char *copy = strdup(key);
    if (copy) sec->known[sec->known_count++] = copy;
}

/* Marks a key as known without reading it. */
void moert_section_allow(moert_section *sec, const char *key)
{
    pthread_mutex_lock(&sec->lock);
    note_known_locked(sec, key);
    pthread_mutex_unlock(&sec->lock);
}

/* Turns on recording of option descriptors. */
void moert_section_set_describe(moert_section *sec, bool on) { sec->describe = on; }

int moert_section_option_count(const moert_section *sec) { return sec->option_count; }

const moert_option_desc *moert_section_option(const moert_section *sec, int i)
{
    return (i >= 0 && i < sec->option_count) ? &sec->options[i] : NULL;
}

/* In describe mode, records one option (the first description of a key wins); the caller holds the lock. */
static void describe_locked(moert_section *sec, const char *key, const char *type, const char *def, const char *range,
                            const char *help)
{
    if (!sec->describe) return;
    for (int i = 0; i < sec->option_count; i++)
        if (strcmp(sec->options[i].key, key) == 0) return;
    if (sec->option_count == sec->option_cap) {
        int cap = sec->option_cap ? sec->option_cap * 2 : 16;
        moert_option_desc *grown = realloc(sec->options, (size_t)cap * sizeof *grown);
        if (!grown) return;
        sec->options = grown;
        sec->option_cap = cap;
    }
    moert_option_desc *d = &sec->options[sec->option_count++];
    memset(d, 0, sizeof *d);
    snprintf(d->key, sizeof d->key, "%s", key);
    snprintf(d->type, sizeof d->type, "%s", type);
    snprintf(d->def, sizeof d->def, "%s", def ? def : "");
    snprintf(d->range, sizeof d->range, "%s", range ? range : "");
    snprintf(d->help, sizeof d->help, "%s", help ? help : "");
}

/* The value as compact JSON text, shortened to fit a message. */
static void value_text(const json_t *value, char *buf, size_t size)
{
    char *text = json_dumps(value, JSON_ENCODE_ANY | JSON_COMPACT);
    if (!text) {
        snprintf(buf, size, "(unprintable)");
        return;
    }
    if (strlen(text) < size) {
        snprintf(buf, size, "%s", text);
    } else {
        snprintf(buf, size, "%.*s...", (int)size - 4, text);
    }
    free(text);
}

/* Reports a bad value: "config error at PATH.key: got VALUE, expected WHAT". */
static moert_result bad_value(const moert_section *sec, const char *key, const json_t *value, const char *expected)
{
    char got[SECTION_VALUE_TEXT];
    value_text(value, got, sizeof got);
    return moert_error(MOERT_ERR_CONFIG, "config error at %s.%s: got %s, expected %s", sec->path, key, got, expected);
}

/* Text of an integer range: "any integer", "an integer >= 1", "an integer in [1, 8]". */
static void int_range_text(int64_t min, int64_t max, char *buf, size_t size, bool with_article)
{
    const char *a = with_article ? "an integer " : "";
    if (min == INT64_MIN && max == INT64_MAX)
        snprintf(buf, size, "%s", with_article ? "an integer" : "any");
    else if (max == INT64_MAX)
        snprintf(buf, size, "%s>= %" PRId64, a, min);
    else if (min == INT64_MIN)
        snprintf(buf, size, "%s<= %" PRId64, a, max);
    else
        snprintf(buf, size, "%s[%" PRId64 ", %" PRId64 "]", with_article ? "an integer in " : "", min, max);
}

/* Text of a float range, like int_range_text; infinite or +-DBL_MAX bounds count as open. */
static void float_range_text(double min, double max, char *buf, size_t size, bool with_article)
{
    bool no_min = min <= -DBL_MAX, no_max = max >= DBL_MAX;
    const char *a = with_article ? "a number " : "";
    if (no_min && no_max)
        snprintf(buf, size, "%s", with_article ? "a number" : "any");
    else if (no_max)
        snprintf(buf, size, "%s>= %g", a, min);
    else if (no_min)
        snprintf(buf, size, "%s<= %g", a, max);
    else
        snprintf(buf, size, "%s[%g, %g]", with_article ? "a number in " : "", min, max);
}

/* Notes key as known and returns its value (NULL if absent). */
static json_t *section_lookup(moert_section *sec, const char *key)
{
    note_known_locked(sec, key);
    return sec->obj ? json_object_get(sec->obj, key) : NULL;
}

/* An integer option in [min, max]; a missing key gives def. */
moert_result moert_section_int(moert_section *sec, const char *key, int64_t def, int64_t min, int64_t max,
                               const char *help, int64_t *out)
{
    char range[96], expected[128], deftext[32];
    int_range_text(min, max, range, sizeof range, false);
    int_range_text(min, max, expected, sizeof expected, true);
    snprintf(deftext, sizeof deftext, "%" PRId64, def);
    pthread_mutex_lock(&sec->lock);
    describe_locked(sec, key, "int", deftext, range, help);
    json_t *v = section_lookup(sec, key);
    pthread_mutex_unlock(&sec->lock);
    if (!v) {
        *out = def;
        return MOERT_OK;
    }
    if (!json_is_integer(v)) return bad_value(sec, key, v, expected);
    int64_t x = (int64_t)json_integer_value(v);
    if (x < min || x > max) return bad_value(sec, key, v, expected);
    *out = x;
    return MOERT_OK;
}

/* A number option in [min, max] (integers are accepted); a missing key gives def. */
moert_result moert_section_float(moert_section *sec, const char *key, double def, double min, double max,
                                 const char *help, double *out)
{
    char range[96], expected[128], deftext[32];
    float_range_text(min, max, range, sizeof range, false);
    float_range_text(min, max, expected, sizeof expected, true);
    snprintf(deftext, sizeof deftext, "%g", def);
    pthread_mutex_lock(&sec->lock);
    describe_locked(sec, key, "float", deftext, range, help);
    json_t *v = section_lookup(sec, key);
    pthread_mutex_unlock(&sec->lock);
    if (!v) {
        *out = def;
        return MOERT_OK;
    }
    if (!json_is_number(v)) return bad_value(sec, key, v, expected);
    double x = json_number_value(v);
    if (!(x >= min && x <= max)) return bad_value(sec, key, v, expected);
    *out = x;
    return MOERT_OK;
}

/* A boolean option (true or false); a missing key gives def. */
moert_result moert_section_bool(moert_section *sec, const char *key, bool def, const char *help, bool *out)
{
    pthread_mutex_lock(&sec->lock);
    describe_locked(sec, key, "bool", def ? "true" : "false", "true|false", help);
    json_t *v = section_lookup(sec, key);
    pthread_mutex_unlock(&sec->lock);
    if (!v) {
        *out = def;
        return MOERT_OK;
    }
    if (!json_is_boolean(v)) return bad_value(sec, key, v, "true or false");
    *out = json_is_true(v);
    return MOERT_OK;
}

/* A string option; *out is borrowed from the JSON (or def). */
moert_result moert_section_string(moert_section *sec, const char *key, const char *def, const char *help,
                                  const char **out)
{
    pthread_mutex_lock(&sec->lock);
    describe_locked(sec, key, "string", def ? def : "", "", help);
    json_t *v = section_lookup(sec, key);
    pthread_mutex_unlock(&sec->lock);
    if (!v) {
        *out = def;
        return MOERT_OK;
    }
    if (!json_is_string(v)) return bad_value(sec, key, v, "a string");
    *out = json_string_value(v);
    return MOERT_OK;
}

/* One of choices (NULL-terminated); *out gets its index; a missing key gives def. */
static int edit_distance(const char *a, const char *b);

moert_result moert_section_enum(moert_section *sec, const char *key, const char *const *choices, int def,
                                const char *help, int *out)
{
    char range[192] = "", expected[320];
    int count = 0;
    for (; choices[count]; count++) {
        size_t used = strlen(range);
        snprintf(range + used, sizeof range - used, "%s%s", count ? "|" : "", choices[count]);
    }
    snprintf(expected, sizeof expected, "one of %s", range);
    pthread_mutex_lock(&sec->lock);
    describe_locked(sec, key, "enum", (def >= 0 && def < count) ? choices[def] : "", range, help);
    json_t *v = section_lookup(sec, key);
    pthread_mutex_unlock(&sec->lock);
    if (!v) {
        *out = def;
        return MOERT_OK;
    }
    if (json_is_string(v)) {
        for (int i = 0; i < count; i++) {
            if (strcmp(json_string_value(v), choices[i]) == 0) {
                *out = i;
                return MOERT_OK;
            }
        }
        /* a typo (one edit, or a few in a long word) gets a suggestion; short words are too close to guess
         * ("gpu" is one edit from "cpu", "fp16" two from "fp32") */
        const char *word = json_string_value(v);
        const char *near = moert_nearest_name(word, choices, count);
        int limit = (int)strlen(word) / 4 > 1 ? (int)strlen(word) / 4 : 1;
        if (near && strlen(word) >= 5 && edit_distance(word, near) <= limit) {
            size_t used = strlen(expected);
            snprintf(expected + used, sizeof expected - used, " (did you mean \"%s\"?)", near);
        }
    }
    return bad_value(sec, key, v, expected);
}

/* Fails on the first key that was neither read nor allowed, suggesting the nearest known one. */
moert_result moert_section_check_unknown(const moert_section *sec)
{
    if (!sec->obj) return MOERT_OK;
    moert_section *s = (moert_section *)sec;
    moert_result rc = MOERT_OK;
    pthread_mutex_lock(&s->lock);
    const char *key;
    json_t *value;
    json_object_foreach (sec->obj, key, value) {
        bool known = false;
        for (int i = 0; i < sec->known_count && !known; i++) known = strcmp(sec->known[i], key) == 0;
        if (known) continue;
        const char *near = moert_nearest_name(key, (const char *const *)sec->known, sec->known_count);
        if (near) {
            rc = moert_error(MOERT_ERR_CONFIG, "config error at %s.%s: unknown key (did you mean \"%s\"?)", sec->path,
                             key, near);
        } else {
            char list[1024] = "";
            for (int i = 0; i < sec->known_count; i++) {
                size_t used = strlen(list);
                snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", sec->known[i]);
            }
            if (sec->known_count)
                rc = moert_error(MOERT_ERR_CONFIG, "config error at %s.%s: unknown key (known keys: %s)", sec->path,
                                 key, list);
            else
                rc = moert_error(MOERT_ERR_CONFIG, "config error at %s.%s: unknown key (this section takes no keys)",
                                 sec->path, key);
        }
        break;
    }
    pthread_mutex_unlock(&s->lock);
    return rc;
}

/* Levenshtein distance between two short words (longer ones are cut at 127 characters). */
static int edit_distance(const char *a, const char *b)
{
    int la = (int)strnlen(a, 127), lb = (int)strnlen(b, 127);
    int prev[128], cur[128];
    for (int j = 0; j <= lb; j++) prev[j] = j;
    for (int i = 1; i <= la; i++) {
        cur[0] = i;
        for (int j = 1; j <= lb; j++) {
            int substitute = prev[j - 1] + (a[i - 1] != b[j - 1]);
            int remove = prev[j] + 1, insert = cur[j - 1] + 1;
            int best = substitute < remove ? substitute : remove;
            cur[j] = best < insert ? best : insert;
        }
        memcpy(prev, cur, (size_t)(lb + 1) * sizeof prev[0]);
    }
    return prev[lb];
}

/* The nearest known name within max(2, len/3) edits of word, or NULL. Ties go to the earlier name. */
const char *moert_nearest_name(const char *word, const char *const *known, int count)
{
    int len = (int)strlen(word);
    int limit = len / 3 > 2 ? len / 3 : 2;
    const char *best = NULL;
    int best_distance = INT_MAX;
    for (int i = 0; i < count; i++) {
        if (!known[i]) continue;
        int d = edit_distance(word, known[i]);
        if (d <= limit && d < best_distance) {
            best = known[i];
            best_distance = d;
        }
    }
    return best;
}

/* ---- the config file ---- */

static const char *const slot_keys[MOERT_SLOT_COUNT] = {"router", "dispatcher", "precision", "memory_policy"};
static const char *const slot_defaults[MOERT_SLOT_COUNT] = {"topk", "alltoall", "bf16", "default"};

const char *moert_slot_key(moert_slot slot)
{
    return (slot >= 0 && slot < MOERT_SLOT_COUNT) ? slot_keys[slot] : "unknown";
}

moert_plugin_kind moert_slot_kind(moert_slot slot)
{
    switch (slot) {
    case MOERT_SLOT_ROUTER: return MOERT_KIND_ROUTER;
    case MOERT_SLOT_DISPATCHER: return MOERT_KIND_DISPATCHER;
    case MOERT_SLOT_PRECISION: return MOERT_KIND_PRECISION;
    case MOERT_SLOT_MEMORY_POLICY: return MOERT_KIND_MEMORY_POLICY;
    default: return (moert_plugin_kind)0;
    }
}

/* A sub-object of root at key: NULL when absent; an error when present but not an object. */
static moert_result sub_object(json_t *root, const char *key, const char *hint, json_t **out)
{
    json_t *v = json_object_get(root, key);
    *out = NULL;
    if (!v) return MOERT_OK;
    if (!json_is_object(v)) {
        char got[SECTION_VALUE_TEXT];
        value_text(v, got, sizeof got);
        return moert_error(MOERT_ERR_CONFIG, "config error at $.%s: got %s, expected an object%s", key, got,
                           hint ? hint : "");
    }
    *out = v;
    return MOERT_OK;
}

/* A number > 0 (an exclusive bound, which moert_section_float cannot express). */
static moert_result section_positive(moert_section *sec, const char *key, double def, const char *help, double *out)
{
    moert_result rc = moert_section_float(sec, key, def, -DBL_MAX, DBL_MAX, help, out);
    if (rc != MOERT_OK || !(*out > 0)) return bad_value(sec, key, json_object_get(sec->obj, key), "a number > 0");
    return MOERT_OK;
}

/* $.model */
static moert_result parse_model(moert_config *cfg, json_t *obj)
{
    static const char *const dtypes[] = {"fp32", "bf16", "fp64", NULL};
    static const moert_dtype dtype_values[] = {MOERT_F32, MOERT_BF16, MOERT_F64};
    moert_model_config *m = &cfg->model;
    moert_result rc = MOERT_OK;
    int dtype = 0;
    moert_section *sec = moert_section_create(obj, "$.model");
    MOERT_CHECK_ALLOC(sec);
    MOERT_CHECK(moert_section_int(sec, "hidden", 64, 1, MOERT_MAX_HIDDEN, "H, the model width", &m->hidden));
    MOERT_CHECK(moert_section_int(sec, "ffn_hidden", 128, 1, MOERT_MAX_FFN_HIDDEN, "F, each expert's FFN width",
                                  &m->ffn_hidden));
    MOERT_CHECK(
        moert_section_int(sec, "num_experts", 8, 1, MOERT_MAX_EXPERTS, "E, experts over all ranks", &m->num_experts));
    MOERT_CHECK(moert_section_int(sec, "topk", 2, 1, m->num_experts, "K, experts per token", &m->topk));
    MOERT_CHECK(moert_section_int(sec, "num_layers", 2, 1, 1024, "MoE layers in the stack", &m->num_layers));
    MOERT_CHECK(moert_section_enum(sec, "dtype", dtypes, 0, "activation storage dtype", &dtype));
    m->dtype = dtype_values[dtype];
    MOERT_CHECK(moert_section_int(sec, "shared_expert_ffn_hidden", 0, 0, 1048576,
                                  "width of a shared expert: a dense SwiGLU over every token added to the routed "
                                  "experts' output (0: none)",
                                  &m->shared_expert_ffn_hidden));
    MOERT_CHECK(moert_section_bool(sec, "shared_expert_gate", false,
                                   "scale the shared expert's output by sigmoid(x . gate), a learned [H] gate",
                                   &m->shared_expert_gate));
    if (m->shared_expert_gate && m->shared_expert_ffn_hidden == 0) {
        rc = moert_error(MOERT_ERR_CONFIG, "config error at $.model.shared_expert_gate: true, but "
                                           "$.model.shared_expert_ffn_hidden is 0 (no shared expert to gate)");
        goto fail;
    }
    MOERT_CHECK(moert_section_check_unknown(sec));
fail:
    moert_section_free(sec);
    return rc;
}

static const char *const cuda_graph_modes[] = {"auto", "off", "on", NULL};

bool moert_overlap_enabled(const moert_config *cfg, int device, int64_t ep, int64_t etp, int64_t micro_batches,
                           uint32_t dispatcher_flags)
{
    const moert_parallel_config *p = &cfg->parallel;
    if (p->overlap_micro_batches != MOERT_OVERLAP_AUTO)
        return p->overlap_micro_batches == MOERT_OVERLAP_ON && micro_batches != 1;
    /* "auto": where the overlap was measured faster on GPUs: a dispatcher that takes few SMs beside the other half
     * (its header says MOERT_CAP_AUTO_OVERLAP: deepep) and narrow experts; with wider experts, or alltoall and
     * hybridep, it was even or slower */
    return micro_batches >= 2 && device == MOERT_DEVICE_CUDA && ep > 1 && (dispatcher_flags & MOERT_CAP_AUTO_OVERLAP) &&
           cfg->model.ffn_hidden / (etp > 1 ? etp : 1) <= MOERT_OVERLAP_AUTO_MAX_FFN;
}

const char *moert_cuda_graph_mode_name(int mode)
{
    return mode >= MOERT_GRAPH_AUTO && mode <= MOERT_GRAPH_ON ? cuda_graph_modes[mode] : "unknown";
}

/* The MoE layers' ETP x EP x EDP grid over $.parallel.ranks (docs/parallel.md): expert_tensor_parallel and
 * expert_data_parallel (default 1), expert_parallel (default ranks / (ETP x EDP)); their product must be the ranks,
 * the experts must split evenly over EP and the FFN width over ETP. */
static moert_result parse_expert_layout(moert_config *cfg, moert_section *sec)
{
    moert_parallel_config *p = &cfg->parallel;
    const int64_t ranks = p->ranks, experts = cfg->model.num_experts, ffn = cfg->model.ffn_hidden;
    moert_result rc = MOERT_OK;
    MOERT_CHECK(moert_section_int(sec, "expert_tensor_parallel", 1, 1, 64,
                                  "ETP: ranks that split every expert's FFN width (each holds ffn_hidden / ETP "
                                  "columns)",
                                  &p->expert_tensor_parallel));
    MOERT_CHECK(moert_section_int(sec, "expert_data_parallel", 1, 1, 64,
                                  "EDP: ranks that hold replicas of the same experts (their gradients are summed)",
                                  &p->expert_data_parallel));
    const int64_t etp = p->expert_tensor_parallel, edp = p->expert_data_parallel;
    const bool ep_given = json_object_get(sec->obj, "expert_parallel") != NULL;
    if (!ep_given && ranks % (etp * edp) != 0)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.%s: expert_tensor_parallel x expert_data_parallel (%" PRId64
                           " x %" PRId64 ") does not divide $.parallel.ranks (%" PRId64 "): expert_parallel x "
                           "expert_tensor_parallel x expert_data_parallel must equal the ranks",
                           edp > 1 ? "expert_data_parallel" : "expert_tensor_parallel", etp, edp, ranks);
    MOERT_CHECK(moert_section_int(sec, "expert_parallel", ranks / (etp * edp), 1, 64,
                                  "EP: ranks the experts are split over (default ranks / (ETP x EDP))",
                                  &p->expert_parallel));
    const int64_t ep = p->expert_parallel;
    if (ep * etp * edp != ranks)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.expert_parallel: got %" PRId64 ", expected %s: expert_parallel "
                           "x expert_tensor_parallel x expert_data_parallel (%" PRId64 " x %" PRId64 " x %" PRId64
                           ") must equal $.parallel.ranks (%" PRId64 ")",
                           ep,
                           ranks % (etp * edp) == 0 ? "ranks / (expert_tensor_parallel x expert_data_parallel)"
                                                    : "a size whose product with the others is the ranks",
                           ep, etp, edp, ranks);
    if (experts % ep != 0) {
        if (!ep_given && etp == 1 && edp == 1) /* the plain layout: every rank is an expert-parallel rank */
            return moert_error(MOERT_ERR_CONFIG,
                               "config error at $.parallel.ranks: got %" PRId64 ", expected a divisor of "
                               "$.model.num_experts (%" PRId64 "): every rank holds the same number of experts",
                               ranks, experts);
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.expert_parallel: got %" PRId64 "%s, expected a divisor of "
                           "$.model.num_experts (%" PRId64 "): every rank of an expert-parallel group holds the same "
                           "number of experts",
                           ep, ep_given ? "" : " (ranks / (expert_tensor_parallel x expert_data_parallel))", experts);
    }
    if (ffn % etp != 0)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.expert_tensor_parallel: got %" PRId64 ", expected a divisor of "
                           "$.model.ffn_hidden (%" PRId64 "): each rank holds ffn_hidden / expert_tensor_parallel "
                           "columns of every expert",
                           etp, ffn);
fail:
    return rc;
}

/* $.parallel (after $.model: the expert layout must split num_experts and ffn_hidden) */
static moert_result parse_parallel(moert_config *cfg, json_t *obj)
{
    static const char *const devices[] = {"auto", "cpu", "cuda", NULL};
    moert_parallel_config *p = &cfg->parallel;
    moert_result rc = MOERT_OK;
    moert_section *sec = moert_section_create(obj, "$.parallel");
    MOERT_CHECK_ALLOC(sec);
    MOERT_CHECK(moert_section_int(sec, "ranks", 1, 1, 64, "ranks: threads on the CPU, a GPU each on CUDA", &p->ranks));
    MOERT_CHECK(parse_expert_layout(cfg, sec));
    MOERT_CHECK(
        moert_section_enum(sec, "device", devices, 0, "where ranks run: auto picks cuda if present", &p->device));
    MOERT_CHECK(
        section_positive(sec, "timeout_s", 60.0, "seconds a collective waits for a stalled rank", &p->timeout_s));
    /* deadlines are computed from it: a day is longer than any collective should wait, and keeps them exact */
    if (p->timeout_s > MOERT_MAX_TIMEOUT_S) {
        rc = bad_value(sec, "timeout_s", json_object_get(sec->obj, "timeout_s"), "a number > 0 and <= 86400 (a day)");
        goto fail;
    }
    MOERT_CHECK(moert_section_enum(sec, "cuda_graph", cuda_graph_modes, 0,
                                   "capture the layers' forward and backward in CUDA graphs and replay them: auto "
                                   "when every plugin can be captured, on requires it",
                                   &p->cuda_graph));
    MOERT_CHECK(moert_section_enum(sec, "overlap_micro_batches", cuda_graph_modes, 0,
                                   "merge micro-batch i+1's forward with micro-batch i's backward, layer by layer "
                                   "(two plugin instances per layer); auto: on CUDA with > 1 rank and micro-batches",
                                   &p->overlap_micro_batches));
    MOERT_CHECK(moert_section_int(sec, "overlap_comm_sms", MOERT_OVERLAP_COMM_SMS_DEFAULT, 0,
                                  MOERT_OVERLAP_COMM_SMS_MAX,
                                  "under the overlap on CUDA: SMs the other micro-batch's GEMMs leave free while a "
                                  "dispatcher call runs (its SMs: deepep 24, hybridep its num_sms); 0: none",
                                  &p->overlap_comm_sms));
    MOERT_CHECK(moert_section_int(sec, "forwards_in_flight", 1, 1, MOERT_MAX_FORWARDS_IN_FLIGHT,
                                  "forwards each layer can hold before their backwards (a pipeline schedule's "
                                  "warm-up: the pipeline's stages); each one past the first makes one more instance "
                                  "of every plugin per layer; the overlap makes at least 2",
                                  &p->forwards_in_flight));
    MOERT_CHECK(moert_section_bool(sec, "overlap_wgrad", true,
                                   "run the weight-gradient GEMMs on a second stream beside the backward's last "
                                   "all-to-all (dispatch_backward) and the router's backward",
                                   &p->overlap_wgrad));
    MOERT_CHECK(
        moert_section_bool(sec, "defer_wgrad_join", true,
                           "under the micro-batch overlap on GPUs: a merged call's weight-gradient GEMMs run on "
                           "past the call instead of the compute stream waiting for them at its backward's end; "
                           "the gradients are whole after the next backward that is not merged",
                           &p->defer_wgrad_join));
    MOERT_CHECK(moert_section_bool(sec, "overlap_dgrad_first", false,
                                   "under the micro-batch overlap on GPUs: in a merged call the backward issues its "
                                   "expert GEMMs (dgrads and weight gradients) before the forward's routing and "
                                   "dispatcher prepare, which wait on the host, so the GPU has them to run meanwhile "
                                   "(results are the same either way)",
                                   &p->overlap_dgrad_first));
    MOERT_CHECK(moert_section_bool(sec, "overlap_prepare_after_dgrads", true,
                                   "under the micro-batch overlap on GPUs: in a merged call the forward hands the turn "
                                   "to the backward after its routing, so the backward's expert GEMMs are issued "
                                   "before the forward's dispatcher prepare waits on the host for every rank's counts; "
                                   "the prepare and the dispatch follow in one turn (results are the same either way)",
                                   &p->overlap_prepare_after_dgrads));
    MOERT_CHECK(moert_section_bool(sec, "overlap_prepare_own_stream", true,
                                   "under the micro-batch overlap on GPUs: a dispatcher whose prepare exchanges its "
                                   "counts through the host (its header declares MOERT_CAP_PREPARE_OWN_STREAM: "
                                   "deepep) runs its prepare on the slot's compute stream rather than the "
                                   "communication stream, where its host wait would end only after the other slot's "
                                   "all-to-all queued before it (results are the same either way)",
                                   &p->overlap_prepare_own_stream));
    MOERT_CHECK(moert_section_bool(sec, "shared_expert_overlap", true,
                                   "GPUs: the shared expert's forward and backward on a second stream beside the "
                                   "routing, dispatch, routed experts and combine (results are the same either way)",
                                   &p->shared_expert_overlap));
    MOERT_CHECK(moert_section_bool(sec, "offload_defer_start", false,
                                   "an offloaded activation's copy starts after the next layer's forward instead of "
                                   "when it is produced (docs/executor.md, \"Deferred start\")",
                                   &p->offload_defer_start));
    MOERT_CHECK(moert_section_check_unknown(sec));
fail:
    moert_section_free(sec);
    return rc;
}

/* $.train */
static moert_result parse_train(moert_config *cfg, json_t *obj)
{
    moert_train_config *t = &cfg->train;
    moert_result rc = MOERT_OK;
    moert_section *sec = moert_section_create(obj, "$.train");
    MOERT_CHECK_ALLOC(sec);
    MOERT_CHECK(moert_section_int(sec, "steps", 100, 0, MOERT_MAX_STEPS, "optimizer steps", &t->steps));
    MOERT_CHECK(moert_section_int(sec, "tokens_per_rank", 256, 1, MOERT_MAX_TOKENS_PER_RANK,
                                  "tokens per rank per micro-batch", &t->tokens_per_rank));
    MOERT_CHECK(moert_section_int(sec, "micro_batches", 1, 1, MOERT_MAX_MICRO_BATCHES,
                                  "micro-batches per optimizer step: their gradients add up (gradient accumulation)",
                                  &t->micro_batches));
    MOERT_CHECK(moert_section_int(sec, "seq_length", 0, 0, MOERT_MAX_TOKENS_PER_RANK,
                                  "tokens per sequence (0: one per rank)", &t->seq_length));
    MOERT_CHECK(moert_section_int(sec, "seed", 1, 0, INT64_MAX, "seed of weights and data", &t->seed));
    MOERT_CHECK(moert_section_int(sec, "log_every", 1, 1, INT64_MAX, "steps between progress lines", &t->log_every));
    MOERT_CHECK(section_positive(sec, "lr", 1e-3, "learning rate", &t->lr));
    MOERT_CHECK(
        moert_section_float(sec, "weight_decay", 0.0, 0.0, DBL_MAX, "decoupled weight decay", &t->weight_decay));
    MOERT_CHECK(moert_section_float(sec, "teacher_scale", 1.0, 0.0, DBL_MAX,
                                    "size of the teacher's output relative to its input", &t->teacher_scale));
    MOERT_CHECK(moert_section_float(sec, "input_shift", 0.5, 0.0, DBL_MAX,
                                    "inputs are N(input_shift * m, I) for a fixed random m ~ N(0, I): 0.5 routes "
                                    "unevenly at the start for the balancing to work on; 0 routes evenly",
                                    &t->input_shift));
    static const char *const data_modes[] = {"fresh", "repeat", NULL};
    int data_mode = 0;
    MOERT_CHECK(moert_section_enum(sec, "data", data_modes, 0,
                                   "fresh: a new batch every step; repeat: one batch reused (benchmarks)", &data_mode));
    t->repeat_batch = data_mode == 1;
    static const char *const optimizers[] = {"adam", "sgd", NULL};
    int optimizer = MOERT_OPTIMIZER_ADAM;
    MOERT_CHECK(moert_section_enum(sec, "optimizer", optimizers, MOERT_OPTIMIZER_ADAM,
                                   "adam: Adam with two moment buffers per parameter; sgd: plain SGD, no state",
                                   &optimizer));
    t->optimizer = (moert_optimizer)optimizer;
    MOERT_CHECK(moert_section_check_unknown(sec));
fail:
    moert_section_free(sec);
    return rc;
}

/* $.router, $.dispatcher, ...: only "plugin" is read here; the plugin's own keys are checked by the runtime. */
static moert_result parse_slot(moert_config *cfg, moert_slot slot)
{
    json_t *obj = NULL;
    char hint[96];
    snprintf(hint, sizeof hint, " like {\"plugin\": \"%s\"}", slot_defaults[slot]);
    moert_result rc = sub_object(cfg->root, slot_keys[slot], hint, &obj);
    if (rc != MOERT_OK) return rc;
    json_t *v = obj ? json_object_get(obj, "plugin") : NULL;
    const char *name = slot_defaults[slot];
    if (v) {
        if (!json_is_string(v) || json_string_length(v) == 0) {
            char got[SECTION_VALUE_TEXT];
            value_text(v, got, sizeof got);
            return moert_error(MOERT_ERR_CONFIG,
                               "config error at $.%s.plugin: got %s, expected a plugin name or a path to a .so",
                               slot_keys[slot], got);
        }
        name = json_string_value(v);
    }
    if (strlen(name) >= 512)
        return moert_error(MOERT_ERR_CONFIG, "config error at $.%s.plugin: the value is longer than 511 characters",
                           slot_keys[slot]);
    /* a relative path means the same file wherever moert is started from: it is taken from the config's folder */
    if (strchr(name, '/') && name[0] != '/' && cfg->folder[0])
        snprintf(cfg->plugin[slot], sizeof cfg->plugin[slot], "%s/%s", cfg->folder, name);
    else
        snprintf(cfg->plugin[slot], sizeof cfg->plugin[slot], "%s", name);
    return MOERT_OK;
}

/* The base name of path without directory and without ".json". */
static void base_name(const char *path, char *buf, size_t size)
{
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && strcmp(base + n - 5, ".json") == 0) n -= 5;
    if (n >= size) n = size - 1;
    memcpy(buf, base, n);
    buf[n] = '\0';
}

/* a * b into *out; false when the product does not fit an int64. */
static bool mul_fits(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }

/* The product of n sizes, or -1 when it does not fit an int64. */
static int64_t checked_product(int n, const int64_t *factors)
{
    int64_t p = 1;
    for (int i = 0; i < n; i++)
        if (factors[i] < 0 || !mul_fits(p, factors[i], &p)) return -1;
    return p;
}

/*
 * Refuses sizes whose products would not fit a device: the largest buffers one rank holds, computed with overflow
 * checks, must each stay within MOERT_MAX_BUFFER_BYTES. With the key bounds this keeps every size product the core
 * and the plugins compute (rows x width x element size) far from wrapping. Counted at 8 bytes an element (fp64,
 * the widest storage). The message names the key that makes the buffer large.
 */
static moert_result check_size_products(const moert_config *cfg)
{
    const moert_model_config *m = &cfg->model;
    const int64_t world = cfg->parallel.ranks, t = cfg->train.tokens_per_rank;
    /* a rank may receive every routed row of every rank: world x T x K rows */
    const int64_t fc1_width = 2 * m->ffn_hidden;
    const int64_t widest_row = fc1_width > m->hidden ? fc1_width : m->hidden;
    struct {
        const char *key, *what;
        int n;
        int64_t f[5];
    } buffers[] = {
        {"$.model.ffn_hidden",
         "the fc1 weights of a rank (experts per rank x hidden x 2 x ffn_hidden)",
         4,
         {m->num_experts / cfg->parallel.expert_parallel, m->hidden, fc1_width / cfg->parallel.expert_tensor_parallel,
          8}},
        {"$.train.tokens_per_rank",
         "the rows dispatched to a rank (ranks x tokens_per_rank x topk rows of "
         "max(hidden, 2 x ffn_hidden) values)",
         5,
         {world, t, m->topk, widest_row, 8}},
        {"$.model.num_experts",
         "the router's scores of a rank (tokens_per_rank x num_experts)",
         3,
         {t, m->num_experts, 8}},
        {"$.model.hidden", "the router's weights (num_experts x hidden)", 3, {m->num_experts, m->hidden, 8}},
        {"$.train.tokens_per_rank",
         "the residual stream of a rank (num_layers + 1 x tokens_per_rank x hidden)",
         4,
         {m->num_layers + 1, t, m->hidden, 8}},
    };
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) {
        int64_t bytes = checked_product(buffers[i].n, buffers[i].f);
        if (bytes < 0 || bytes > MOERT_MAX_BUFFER_BYTES)
            return moert_error(MOERT_ERR_CONFIG,
                               "config error at %s: %s would take %s%.1f TiB, more than the %lld TiB any device holds; "
                               "shrink the sizes",
                               buffers[i].key, buffers[i].what, bytes < 0 ? "more than " : "",
                               bytes < 0 ? 8388608.0 : (double)bytes / 1099511627776.0,
                               (long long)(MOERT_MAX_BUFFER_BYTES >> 40));
    }
    return MOERT_OK;
}

/* Fills the typed fields from cfg->root. */
moert_result moert_config_parse(moert_config *cfg)
{
    moert_result rc = MOERT_OK;
    json_t *model = NULL, *parallel = NULL, *train = NULL;
    const char *name = NULL, *description = NULL;
    moert_section *top = NULL;
    if (!json_is_object(cfg->root)) {
        char got[SECTION_VALUE_TEXT];
        value_text(cfg->root, got, sizeof got);
        return moert_error(MOERT_ERR_CONFIG, "config error at $: got %s, expected an object", got);
    }
    top = moert_section_create(cfg->root, "$");
    MOERT_CHECK_ALLOC(top);
    MOERT_CHECK(moert_section_string(top, "name", NULL, "a name for reports", &name));
    MOERT_CHECK(moert_section_string(top, "description", "", "one line about the config", &description));
    const char *sections[] = {"model", "parallel", "train"};
    for (int i = 0; i < 3; i++) moert_section_allow(top, sections[i]);
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) moert_section_allow(top, slot_keys[s]);
    MOERT_CHECK(moert_section_check_unknown(top));

    char default_name[sizeof cfg->name];
    base_name(cfg->source, default_name, sizeof default_name);
    snprintf(cfg->name, sizeof cfg->name, "%s", name ? name : default_name);

    MOERT_CHECK(sub_object(cfg->root, "model", NULL, &model));
    MOERT_CHECK(sub_object(cfg->root, "parallel", NULL, &parallel));
    MOERT_CHECK(sub_object(cfg->root, "train", NULL, &train));
    MOERT_CHECK(parse_model(cfg, model));
    MOERT_CHECK(parse_parallel(cfg, parallel));
    MOERT_CHECK(parse_train(cfg, train));
    MOERT_CHECK(check_size_products(cfg));
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) MOERT_CHECK(parse_slot(cfg, (moert_slot)s));
fail:
    moert_section_free(top);
    return rc;
}

/* Takes ownership of root, parses it, and returns the config (or frees everything on error). folder: the file's
 * folder, absolute, or NULL for a config from a string. */
static moert_result config_from_json(json_t *root, const char *source, const char *folder, moert_config **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    moert_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg) {
        json_decref(root);
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "config: out of memory");
    }
    cfg->root = root;
    snprintf(cfg->source, sizeof cfg->source, "%s", source);
    snprintf(cfg->folder, sizeof cfg->folder, "%s", folder ? folder : "");
    MOERT_CHECK(moert_config_parse(cfg));
    *out = cfg;
    return MOERT_OK;
fail:
    moert_config_free(cfg);
    return rc;
}

/* Reads and parses a JSON file; a syntax error names file:line:column and jansson's text. */
moert_result moert_config_load_file(const char *path, moert_config **out)
{
    json_error_t jerr;
    if (!path || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_load_file: path or out is NULL");
    *out = NULL;
    struct stat st;
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return moert_error(MOERT_ERR_IO, "%s: cannot open config: it is a folder, expected a JSON file", path);
    FILE *f = fopen(path, "rb");
    if (!f) return moert_error(MOERT_ERR_IO, "%s: cannot open config: %s", path, strerror(errno));
    json_t *root = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!root)
        return moert_error(MOERT_ERR_CONFIG, "%s:%d:%d: invalid JSON: %s", path, jerr.line, jerr.column, jerr.text);
    /* the file's folder, absolute: what relative plugin paths in it are relative to */
    char dir[PATH_MAX], folder[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else
        snprintf(dir, sizeof dir, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    if (!realpath(dir, folder) || strlen(folder) >= sizeof((moert_config *)0)->folder) {
        json_decref(root);
        return moert_error(MOERT_ERR_IO, "%s: cannot resolve the config's folder %s", path, dir);
    }
    return config_from_json(root, path, folder, out);
}

/* Parses JSON text; source_name stands for the file name in messages and the default name. */
moert_result moert_config_load_string(const char *json_text, const char *source_name, moert_config **out)
{
    json_error_t jerr;
    const char *source = source_name ? source_name : "<string>";
    if (!out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_load_string: out is NULL");
    *out = NULL;
    if (!json_text) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: no JSON text", source);
    json_t *root = json_loads(json_text, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return moert_error(MOERT_ERR_CONFIG, "%s:%d:%d: invalid JSON: %s", source, jerr.line, jerr.column, jerr.text);
    return config_from_json(root, source, NULL, out);
}

/* Sets dotted_key (e.g. "train.steps") to the JSON value in root, creating missing objects on the way. */
static moert_result set_in_json(json_t *root, const char *dotted_key, json_t *value)
{
    char path[512], seen[520] = "$";
    if (strlen(dotted_key) >= sizeof path)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "config --set: key \"%s\" is too long", dotted_key);
    snprintf(path, sizeof path, "%s", dotted_key);
    json_t *obj = root;
    char *part = path;
    for (;;) {
        char *dot = strchr(part, '.');
        if (dot) *dot = '\0';
        if (*part == '\0')
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "config --set: key \"%s\" has an empty part", dotted_key);
        if (!dot)
            return json_object_set(obj, part, value) == 0
                       ? MOERT_OK
                       : moert_error(MOERT_ERR_OUT_OF_MEMORY, "config --set: out of memory");
        size_t used = strlen(seen);
        snprintf(seen + used, sizeof seen - used, ".%s", part);
        json_t *next = json_object_get(obj, part);
        if (!next) {
            next = json_object();
            if (!next || json_object_set_new(obj, part, next) != 0)
                return moert_error(MOERT_ERR_OUT_OF_MEMORY, "config --set: out of memory");
        } else if (!json_is_object(next)) {
            char got[SECTION_VALUE_TEXT];
            value_text(next, got, sizeof got);
            return moert_error(MOERT_ERR_CONFIG, "config error at %s: cannot set %s: got %s, expected an object", seen,
                               dotted_key, got);
        }
        obj = next;
        part = dot + 1;
    }
}

/* Replaces n values (JSON text; text that is not JSON is taken as a string), in order, and parses the config once.
 * On error the config is left as it was. */
moert_result moert_config_set_many(moert_config *cfg, int n, const char *const *dotted_keys,
                                   const char *const *json_values)
{
    if (!cfg || n < 0 || (n > 0 && (!dotted_keys || !json_values)))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_set_many: a NULL config or list");
    json_t *copy = json_deep_copy(cfg->root);
    if (!copy) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "config --set: out of memory");
    moert_result rc = MOERT_OK;
    for (int i = 0; i < n && rc == MOERT_OK; i++) {
        if (!dotted_keys[i] || !json_values[i]) {
            rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_set_many: key or value %d is NULL", i);
            break;
        }
        json_error_t jerr;
        json_t *value = json_loads(json_values[i], JSON_DECODE_ANY | JSON_REJECT_DUPLICATES, &jerr);
        if (!value && json_error_code(&jerr) == json_error_duplicate_key) {
            rc = moert_error(MOERT_ERR_CONFIG, "config --set %s: invalid JSON: %s", dotted_keys[i], jerr.text);
            break;
        }
        if (!value) value = json_string(json_values[i]); /* --set router.plugin=deepep */
        if (!value) {
            rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "config --set %s: value is not valid UTF-8", dotted_keys[i]);
            break;
        }
        rc = set_in_json(copy, dotted_keys[i], value);
        json_decref(value);
    }
    if (rc != MOERT_OK) {
        json_decref(copy);
        return rc;
    }
    moert_config trial = *cfg;
    trial.root = copy;
    rc = moert_config_parse(&trial);
    if (rc != MOERT_OK) {
        json_decref(copy);
        return rc;
    }
    json_decref(cfg->root);
    *cfg = trial;
    return MOERT_OK;
}

/* Replaces one value and parses the config again; on error the config is left as it was. */
moert_result moert_config_set(moert_config *cfg, const char *dotted_key, const char *json_value)
{
    return moert_config_set_many(cfg, 1, &dotted_key, &json_value);
}

void moert_config_free(moert_config *cfg)
{
    if (!cfg) return;
    json_decref(cfg->root);
    free(cfg);
}

/* ---- reading a config back (moert/moert.h) ---- */

/* The config as moert resolved it: the core's sections with every default filled in, each plugin section with its
 * plugin resolved, and the rest of the file as written. A new object (NULL when out of memory). */
static json_t *resolved_json(const moert_config *cfg)
{
    static const char *const devices[] = {"auto", "cpu", "cuda"};
    json_t *root = json_deep_copy(cfg->root);
    if (!json_is_object(root)) {
        json_decref(root);
        root = json_object();
    }
    if (!root) return NULL;
    const moert_model_config *m = &cfg->model;
    const moert_parallel_config *p = &cfg->parallel;
    const moert_train_config *t = &cfg->train;
    json_t *model = json_pack("{s:I, s:I, s:I, s:I, s:I, s:s, s:I, s:b}", "hidden", (json_int_t)m->hidden, "ffn_hidden",
                              (json_int_t)m->ffn_hidden, "num_experts", (json_int_t)m->num_experts, "topk",
                              (json_int_t)m->topk, "num_layers", (json_int_t)m->num_layers, "dtype",
                              moert_dtype_name(m->dtype), "shared_expert_ffn_hidden",
                              (json_int_t)m->shared_expert_ffn_hidden, "shared_expert_gate", m->shared_expert_gate);
    json_t *parallel = json_pack(
        "{s:I, s:I, s:I, s:I, s:s, s:f, s:s, s:b, s:b, s:b, s:b, s:b, s:b, s:b, s:s, s:I, s:I}", "ranks",
        (json_int_t)p->ranks, "expert_parallel", (json_int_t)p->expert_parallel, "expert_tensor_parallel",
        (json_int_t)p->expert_tensor_parallel, "expert_data_parallel", (json_int_t)p->expert_data_parallel, "device",
        p->device >= 0 && p->device <= 2 ? devices[p->device] : "auto", "timeout_s", p->timeout_s, "cuda_graph",
        moert_cuda_graph_mode_name(p->cuda_graph), "overlap_wgrad", p->overlap_wgrad, "defer_wgrad_join",
        p->defer_wgrad_join, "overlap_dgrad_first", p->overlap_dgrad_first, "overlap_prepare_after_dgrads",
        p->overlap_prepare_after_dgrads, "overlap_prepare_own_stream", p->overlap_prepare_own_stream,
        "shared_expert_overlap", p->shared_expert_overlap, "offload_defer_start", p->offload_defer_start,
        "overlap_micro_batches", moert_cuda_graph_mode_name(p->overlap_micro_batches), "overlap_comm_sms",
        (json_int_t)p->overlap_comm_sms, "forwards_in_flight", (json_int_t)p->forwards_in_flight);
    json_t *train = json_pack(
        "{s:I, s:I, s:I, s:I, s:I, s:I, s:f, s:f, s:f, s:f, s:s, s:s}", "steps", (json_int_t)t->steps,
        "tokens_per_rank", (json_int_t)t->tokens_per_rank, "micro_batches", (json_int_t)t->micro_batches, "seq_length",
        (json_int_t)t->seq_length, "seed", (json_int_t)t->seed, "log_every", (json_int_t)t->log_every, "lr", t->lr,
        "weight_decay", t->weight_decay, "teacher_scale", t->teacher_scale, "input_shift", t->input_shift, "data",
        t->repeat_batch ? "repeat" : "fresh", "optimizer", t->optimizer == MOERT_OPTIMIZER_SGD ? "sgd" : "adam");
    if (!model || !parallel || !train) {
        json_decref(model);
        json_decref(parallel);
        json_decref(train);
        json_decref(root);
        return NULL;
    }
    /* the core's sections replace what the file wrote (a key the core does not read was refused at load) */
    json_object_set_new(root, "name", json_string(cfg->name));
    json_object_set_new(root, "model", model);
    json_object_set_new(root, "parallel", parallel);
    json_object_set_new(root, "train", train);
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) {
        json_t *sec = json_object_get(root, slot_keys[s]);
        if (!json_is_object(sec)) {
            sec = json_object();
            json_object_set_new(root, slot_keys[s], sec);
        }
        json_object_set_new(sec, "plugin", json_string(cfg->plugin[s]));
    }
    return root;
}

/* The value at a dotted key of the resolved config, or NULL (with the error set); *root must be freed after use. */
static json_t *config_lookup(const moert_config *cfg, const char *dotted_key, json_t **root)
{
    *root = NULL;
    if (!cfg || !dotted_key) {
        moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_get: cfg or dotted_key is NULL");
        return NULL;
    }
    *root = resolved_json(cfg);
    if (!*root) {
        moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_config_get: out of memory");
        return NULL;
    }
    json_t *v = *root;
    const char *at = dotted_key;
    while (v && *at) {
        const char *dot = strchr(at, '.');
        size_t n = dot ? (size_t)(dot - at) : strlen(at);
        char key[256];
        if (n >= sizeof key) break;
        memcpy(key, at, n);
        key[n] = '\0';
        v = json_is_object(v) ? json_object_get(v, key) : NULL;
        at = dot ? dot + 1 : at + n;
    }
    if (!v || *at) moert_error(MOERT_ERR_NOT_FOUND, "%s: no value at $.%s", cfg->source, dotted_key);
    return v && !*at ? v : NULL;
}

MOERT_API moert_result moert_config_get_json(const moert_config *cfg, const char *dotted_key, char *buf, size_t size)
{
    json_t *root = NULL;
    json_t *v = config_lookup(cfg, dotted_key, &root);
    moert_result rc = MOERT_OK;
    if (!v) rc = root ? MOERT_ERR_NOT_FOUND : MOERT_ERR_INVALID_ARGUMENT;
    if (v) {
        char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT | JSON_REAL_PRECISION(17));
        if (!text)
            rc = moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_config_get_json: out of memory");
        else if (!buf || strlen(text) >= size)
            rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_get_json: $.%s takes %zu bytes, buf has %zu",
                             dotted_key, strlen(text) + 1, size);
        else
            memcpy(buf, text, strlen(text) + 1);
        free(text);
    }
    json_decref(root);
    return rc;
}

/* A number or boolean of the resolved config as double and int64 (both exact where the value is an integer); with
 * want_integer a real that is not a whole number in int64's range is refused rather than cut. */
static moert_result config_get_number(const moert_config *cfg, const char *dotted_key, bool want_integer, double *real,
                                      int64_t *integer)
{
    if (!cfg || !dotted_key || !real || !integer)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_get_%s: cfg, dotted_key or out is NULL",
                           want_integer ? "int" : "double");
    json_t *root = NULL;
    json_t *v = config_lookup(cfg, dotted_key, &root);
    moert_result rc = MOERT_OK;
    if (!v)
        rc = root ? MOERT_ERR_NOT_FOUND : MOERT_ERR_INVALID_ARGUMENT;
    else if (json_is_integer(v)) {
        *integer = (int64_t)json_integer_value(v);
        *real = (double)*integer;
    } else if (json_is_real(v)) {
        *real = json_real_value(v);
        /* 2^63 is the first double past int64 */
        const bool whole = *real == floor(*real) && *real >= -9223372036854775808.0 && *real < 9223372036854775808.0;
        *integer = whole ? (int64_t)*real : 0;
        if (want_integer && !whole)
            rc = moert_error(MOERT_ERR_CONFIG, "%s: $.%s is %.17g, not an integer", cfg->source, dotted_key, *real);
    } else if (json_is_boolean(v)) {
        *integer = json_is_true(v);
        *real = (double)*integer;
    } else {
        rc = moert_error(MOERT_ERR_CONFIG, "%s: $.%s is not a number", cfg->source, dotted_key);
    }
    json_decref(root);
    return rc;
}

MOERT_API moert_result moert_config_get_int(const moert_config *cfg, const char *dotted_key, int64_t *out)
{
    double real = 0.0;
    int64_t value = 0;
    moert_result rc = config_get_number(cfg, dotted_key, true, &real, out ? &value : NULL);
    if (rc == MOERT_OK) *out = value;
    return rc;
}

MOERT_API moert_result moert_config_get_double(const moert_config *cfg, const char *dotted_key, double *out)
{
    int64_t integer = 0;
    return config_get_number(cfg, dotted_key, false, out, &integer);
}

MOERT_API moert_result moert_config_get_string(const moert_config *cfg, const char *dotted_key, char *buf, size_t size)
{
    json_t *root = NULL;
    json_t *v = config_lookup(cfg, dotted_key, &root);
    moert_result rc = MOERT_OK;
    if (!v)
        rc = root ? MOERT_ERR_NOT_FOUND : MOERT_ERR_INVALID_ARGUMENT;
    else if (!json_is_string(v))
        rc = moert_error(MOERT_ERR_CONFIG, "%s: $.%s is not a string", cfg->source, dotted_key);
    else if (!buf || json_string_length(v) >= size)
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_config_get_string: $.%s takes %zu bytes, buf has %zu",
                         dotted_key, json_string_length(v) + 1, size);
    else
        memcpy(buf, json_string_value(v), json_string_length(v) + 1);
    json_decref(root);
    return rc;
}

MOERT_API const char *moert_config_source(const moert_config *cfg) { return cfg ? cfg->source : ""; }
