/* SPDX-License-Identifier: Apache-2.0 */
/* `moert ab A.json B.json`: trains two configs of the same model side by side in one process, steps
 * interleaved A, B, A, B..., and compares step and stage times, activation memory and the losses. */
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ab_plot.h"
#include "ab_stats.h"
#include "cli_common.h"
#include "harness.h"
#include "output.h"
#include "report.h"
#include "trainer.h"

#define PROG                "moert ab"
#define DEFAULT_WARMUP      3
#define DEFAULT_MAX_STEPS   50
#define BOOTSTRAP_RESAMPLES 2000
#define BOOTSTRAP_SEED      20261126u /* fixed, and written in the report: the same steps give the same intervals */

static void ab_usage(FILE *f)
{
    fprintf(f,
            "usage: moert ab CONFIG_A CONFIG_B [options]\n"
            "  Trains A and B on the same model, data and seed in one process, one step of A then one of B,\n"
            "  and prints per figure (step time, each stage, activation memory) A's and B's median with its\n"
            "  p10-p90 spread and the ratio B/A, and whether the two agree on the loss of every step.\n"
            "  A and B may differ in their plugin sections and in train.steps, lr, weight_decay, teacher_scale\n"
            "  and log_every; any other difference ($.model, $.parallel.ranks, $.train.tokens_per_rank,\n"
            "  seq_length, seed, data, input_shift) is refused with exit status 2.\n"
            "options:\n"
            "  --set KEY=JSON     override a value of both configs (repeatable)\n"
            "  --set-a KEY=JSON   override a value of A only (repeatable)\n"
            "  --set-b KEY=JSON   override a value of B only (repeatable)\n"
            "  --warmup N         unmeasured steps first (default %d)\n"
            "  --steps N          measured steps (default A's train.steps, at most %d)\n"
            "  --rtol X           relative tolerance of the agreement check (default: the looser of the\n"
            "                     tolerances A's and B's precision recipes declare)\n"
            "  --aa               also run A' (a second copy of A) interleaved with A and B, and print the\n"
            "                     A'/A interval beside each B/A one: the machine's noise floor\n"
            "  --report FILE      write every figure as JSON to FILE and a Markdown table beside it (.md)\n"
            "  --plot FILE.png    draw step time and loss of both over the steps (python3 with matplotlib;\n"
            "                     the data goes to FILE.plot.json)\n"
            "  --sequential       run all of A, free it, then all of B: for runs that do not fit in memory\n"
            "                     twice (the figures then lose the interleaving's protection against drift)\n"
            "  --quiet            no progress lines\n",
            DEFAULT_WARMUP, DEFAULT_MAX_STEPS);
}

/* ---- figures ---- */

/* The timed figures, in ms: the step, each stage of the executor, the stages' sum, then the backward's parts. */
enum {
    FIGURE_STEP = 0,
    FIGURE_FIRST_STAGE = 1,
    FIGURE_LAYER = 1 + MOERT_LAYER_STAGES,
    FIGURE_FIRST_PART = FIGURE_LAYER + 1,
    FIGURE_COUNT = FIGURE_FIRST_PART + MOERT_LAYER_BACKWARD_PARTS
};

static const char *figure_name(int f)
{
    if (f == FIGURE_STEP) return "step";
    if (f == FIGURE_LAYER) return "layer";
    if (f >= FIGURE_FIRST_PART) return moert_layer_backward_part_name(f - FIGURE_FIRST_PART);
    return moert_layer_stage_name(f - FIGURE_FIRST_STAGE);
}

/* What the table calls the figure. */
static const char *figure_label(int f, char *buf, size_t size)
{
    if (f == FIGURE_STEP) return "step";
    if (f == FIGURE_LAYER) return "layer fwd+bwd";
    if (f >= FIGURE_FIRST_PART) {
        snprintf(buf, size, "backward: %s", figure_name(f));
        return buf;
    }
    return figure_name(f);
}

static double figure_ms(const moert_step_record *r, int f)
{
    if (f == FIGURE_STEP) return r->seconds * 1e3;
    if (f >= FIGURE_FIRST_PART) return r->backward_part_seconds[f - FIGURE_FIRST_PART] * 1e3;
    if (f != FIGURE_LAYER) return r->stage_seconds[f - FIGURE_FIRST_STAGE] * 1e3;
    double sum = 0.0;
    for (int s = 0; s < MOERT_LAYER_STAGES; s++) sum += r->stage_seconds[s];
    return sum * 1e3;
}

/* The median and the 10th and 90th percentiles of a sample. */
typedef struct spread {
    double median, p10, p90;
} spread;

static int compare_doubles(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Quantile q of sorted[n] by linear interpolation between the nearest ranks. */
static double quantile(const double *sorted, int64_t n, double q)
{
    double pos = q * (double)(n - 1);
    int64_t i = (int64_t)floor(pos);
    if (i >= n - 1) return sorted[n - 1];
    return sorted[i] + (pos - (double)i) * (sorted[i + 1] - sorted[i]);
}

static spread spread_of(double *values, int64_t n)
{
    spread s = {0, 0, 0};
    if (n == 0) return s;
    qsort(values, (size_t)n, sizeof *values, compare_doubles);
    s.median = quantile(values, n, 0.5);
    s.p10 = quantile(values, n, 0.1);
    s.p90 = quantile(values, n, 0.9);
    return s;
}

/* ---- the config values an A/B compares and reports ---- */

#define AB_SLOTS 4 /* router, dispatcher, precision, memory_policy: the plugin sections */
static const char *const slot_keys[AB_SLOTS] = {"router", "dispatcher", "precision", "memory_policy"};

/* A side's config as the run uses it (moert_config_get_*: defaults filled in). */
typedef struct ab_config {
    char name[256], source[512];
    struct {
        int64_t hidden, ffn_hidden, num_experts, topk, num_layers;
        char dtype[16];
    } model;
    struct {
        int64_t ranks, overlap_wgrad, defer_wgrad_join, overlap_dgrad_first, overlap_prepare_after_dgrads,
            overlap_prepare_own_stream, overlap_comm_sms;
        char cuda_graph[16], overlap_micro_batches[16];
    } parallel;
    struct {
        int64_t steps, tokens_per_rank, seq_length, micro_batches, seed, log_every;
        double lr, weight_decay, teacher_scale, input_shift;
        char data[16];
    } train;
    char plugin[AB_SLOTS][1600]; /* each section's plugin, resolved */
    json_t *section[AB_SLOTS];   /* each plugin section with its "plugin" filled in */
} ab_config;

/* Reads what the A/B needs from cfg into c (c->section[] to be freed with free_ab_config). */
static moert_result read_ab_config(const moert_config *cfg, ab_config *c)
{
    moert_result rc = MOERT_OK;
    static const struct {
        const char *key;
        size_t offset;
    } ints[] = {
        {"model.hidden", offsetof(ab_config, model.hidden)},
        {"model.ffn_hidden", offsetof(ab_config, model.ffn_hidden)},
        {"model.num_experts", offsetof(ab_config, model.num_experts)},
        {"model.topk", offsetof(ab_config, model.topk)},
        {"model.num_layers", offsetof(ab_config, model.num_layers)},
        {"parallel.ranks", offsetof(ab_config, parallel.ranks)},
        {"parallel.overlap_wgrad", offsetof(ab_config, parallel.overlap_wgrad)},
        {"parallel.defer_wgrad_join", offsetof(ab_config, parallel.defer_wgrad_join)},
        {"parallel.overlap_dgrad_first", offsetof(ab_config, parallel.overlap_dgrad_first)},
        {"parallel.overlap_prepare_after_dgrads", offsetof(ab_config, parallel.overlap_prepare_after_dgrads)},
        {"parallel.overlap_prepare_own_stream", offsetof(ab_config, parallel.overlap_prepare_own_stream)},
        {"parallel.overlap_comm_sms", offsetof(ab_config, parallel.overlap_comm_sms)},
        {"train.steps", offsetof(ab_config, train.steps)},
        {"train.tokens_per_rank", offsetof(ab_config, train.tokens_per_rank)},
        {"train.seq_length", offsetof(ab_config, train.seq_length)},
        {"train.micro_batches", offsetof(ab_config, train.micro_batches)},
        {"train.seed", offsetof(ab_config, train.seed)},
        {"train.log_every", offsetof(ab_config, train.log_every)},
    };
    static const struct {
        const char *key;
        size_t offset;
    } reals[] = {
        {"train.lr", offsetof(ab_config, train.lr)},
        {"train.weight_decay", offsetof(ab_config, train.weight_decay)},
        {"train.teacher_scale", offsetof(ab_config, train.teacher_scale)},
        {"train.input_shift", offsetof(ab_config, train.input_shift)},
    };
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        HARNESS_CHECK(moert_config_get_int(cfg, ints[i].key, (int64_t *)((char *)c + ints[i].offset)));
    for (size_t i = 0; i < sizeof reals / sizeof reals[0]; i++)
        HARNESS_CHECK(moert_config_get_double(cfg, reals[i].key, (double *)((char *)c + reals[i].offset)));
    HARNESS_CHECK(moert_config_get_string(cfg, "name", c->name, sizeof c->name));
    HARNESS_CHECK(moert_config_get_string(cfg, "model.dtype", c->model.dtype, sizeof c->model.dtype));
    HARNESS_CHECK(
        moert_config_get_string(cfg, "parallel.cuda_graph", c->parallel.cuda_graph, sizeof c->parallel.cuda_graph));
    HARNESS_CHECK(moert_config_get_string(cfg, "parallel.overlap_micro_batches", c->parallel.overlap_micro_batches,
                                          sizeof c->parallel.overlap_micro_batches));
    HARNESS_CHECK(moert_config_get_string(cfg, "train.data", c->train.data, sizeof c->train.data));
    snprintf(c->source, sizeof c->source, "%s", moert_config_source(cfg));
    for (int s = 0; s < AB_SLOTS; s++) {
        char key[64], text[16384];
        snprintf(key, sizeof key, "%s.plugin", slot_keys[s]);
        HARNESS_CHECK(moert_config_get_string(cfg, key, c->plugin[s], sizeof c->plugin[s]));
        HARNESS_CHECK(moert_config_get_json(cfg, slot_keys[s], text, sizeof text));
        c->section[s] = json_loads(text, 0, NULL);
        if (!c->section[s]) {
            rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "reading the config's $.%s", slot_keys[s]);
            goto fail;
        }
    }
fail:
    return rc;
}

static void free_ab_config(ab_config *c)
{
    for (int s = 0; s < AB_SLOTS; s++) json_decref(c->section[s]);
    memset(c->section, 0, sizeof c->section);
}

/* ---- one side of the comparison ---- */

/* What the report needs from a runtime, kept after it is destroyed (--sequential frees A before B starts). */
typedef struct ab_run_facts {
    moert_device_type device_type;
    char device_name[400];
    int world;
    int64_t activation_bytes[MOERT_LAYER_ACTIVATIONS];
    int64_t kept_bytes;
    int64_t device_peak_bytes;
    int64_t device_pool_calls;
    char graph[512];       /* moert_runtime_graph_summary: CUDA graphs captured and replayed, or why not */
    double agreement_rtol; /* what the precision recipe declares (moert_runtime_agreement_rtol) */
    char precision[64];    /* the precision plugin's name */
    bool overlapped;       /* its steps merged two micro-batches' halves (moert_runtime_overlapped) */
} ab_run_facts;

typedef struct ab_side {
    const char *path;
    const char *tag; /* "A", "B", or "A'" (--aa: a second copy of A) */
    moert_config *cfg;
    ab_config conf;               /* what the A/B reads of cfg */
    moert_runtime *rt;            /* NULL once destroyed */
    ab_run_facts facts;           /* taken after the last step */
    moert_step_record *records;   /* [warmup + steps], every step */
    int64_t done;                 /* steps completed (fewer than warmup + steps when a step failed) */
    spread figures[FIGURE_COUNT]; /* over the measured steps */
} ab_side;

/* B/A of each timed figure over the measured steps both sides completed, with its bootstrap interval; with --aa also
 * A'/A, the same for two copies of A (the noise floor). */
static ab_interval intervals[FIGURE_COUNT];
static ab_interval aa_intervals[FIGURE_COUNT];
/* Seeds of the intervals: BOOTSTRAP_SEED + figure for B/A, this + figure for A'/A. */
#define AA_SEED_OFFSET 1000u

/* What agreement means here: the loss of every step, and the first step's output and gradients. */
typedef struct ab_agreement {
    double rtol;
    char rtol_source[320]; /* where rtol comes from, as the verdict goes on after it: " from --rtol", " declared by
                                  precision bf16", ", the looser of A's precision bf16 (0.01) and B's fp8 (0.125)" */
    double loss_diff;      /* max over steps of |loss_A - loss_B| / max(|loss_A|, |loss_B|) */
    int64_t loss_worst_step;
    bool losses_identical;    /* bit for bit, every step */
    bool first_step_compared; /* interleaved runs */
    bool sequential;          /* --sequential: A is gone when B runs, so only losses are compared */
    double output_diff;       /* max |out_A - out_B| / max |out| over the first step's output */
    double gradient_diff;     /* the same per parameter tensor, the largest over tensors */
    char gradient_worst[64];  /* that tensor, e.g. "layer 0 fc1" */
    bool agree;
} ab_agreement;

/* The relative difference of two numbers: |a - b| / max(|a|, |b|); NaN against anything is infinite. */
static double relative_difference(double a, double b)
{
    if (isnan(a) || isnan(b)) return INFINITY;
    if (a == b) return 0.0;
    return fabs(a - b) / fmax(fabs(a), fabs(b));
}

/* Tracks max |a - b| and max(|a|, |b|) over a tensor's elements; their quotient is the tensor's difference. */
typedef struct tensor_diff {
    double max_diff, max_abs;
} tensor_diff;

static void tensor_diff_add(tensor_diff *d, double a, double b)
{
    double diff = (isnan(a) || isnan(b)) ? INFINITY : fabs(a - b);
    if (diff > d->max_diff) d->max_diff = diff;
    if (fabs(a) > d->max_abs) d->max_abs = fabs(a);
    if (fabs(b) > d->max_abs) d->max_abs = fabs(b);
}

static double tensor_diff_value(const tensor_diff *d)
{
    if (d->max_diff == 0.0) return 0.0;
    return d->max_abs > 0.0 ? d->max_diff / d->max_abs : INFINITY;
}

/* At most this many elements per local rank in one bulk read of a tensor (32 MiB of doubles per rank and side). */
#define COMPARE_CHUNK ((int64_t)1 << 22)

/* Compares one tensor of two runs, the output (layer < 0) or a parameter's gradient, on every local rank, `chunk`
 * elements at a time (a gradient of DeepSeek-V3's experts is gigabytes): its difference in *diff. bufa, bufb:
 * [nlocal * chunk]. */
static moert_result compare_tensor(moert_runtime *a, moert_runtime *b, int layer, moert_param_id which, int64_t numel,
                                   int64_t chunk, double *bufa, double *bufb, double *diff)
{
    moert_result rc = MOERT_OK;
    const int64_t nvalues = moert_runtime_local_ranks(a);
    tensor_diff d = {0, 0};
    for (int64_t first = 0; first < numel; first += chunk) {
        const int64_t count = numel - first < chunk ? numel - first : chunk;
        if (layer < 0) {
            HARNESS_CHECK(moert_runtime_read_output(a, first, count, bufa));
            HARNESS_CHECK(moert_runtime_read_output(b, first, count, bufb));
        } else {
            HARNESS_CHECK(moert_runtime_read_grad(a, layer, which, first, count, bufa));
            HARNESS_CHECK(moert_runtime_read_grad(b, layer, which, first, count, bufb));
        }
        for (int64_t i = 0; i < nvalues * count; i++) tensor_diff_add(&d, bufa[i], bufb[i]);
    }
    *diff = tensor_diff_value(&d);
fail:
    return rc;
}

/* After the first step: compares the stack's output and every parameter gradient of two sides (A and B, or A and A'),
 * on any device: bulk reads of every rank this process hosts, through the runtime's host services. */
static moert_result compare_first_step(ab_side *a, ab_side *b, ab_agreement *agr)
{
    moert_result rc = MOERT_OK;
    static const char *const param_names[MOERT_PARAM_COUNT] = {"router",     "fc1",        "fc2",
                                                               "shared fc1", "shared fc2", "shared gate"};
    const int nlocal = moert_runtime_local_ranks(a->rt);
    double *bufa = NULL, *bufb = NULL;
    if (moert_runtime_local_ranks(b->rt) != nlocal)
        return moert_set_last_error(MOERT_ERR_INTERNAL, "%s hosts %d ranks here and %s %d", a->tag, nlocal, b->tag,
                                    moert_runtime_local_ranks(b->rt));
    /* the buffers: the largest tensor's size, up to COMPARE_CHUNK */
    int64_t chunk = moert_runtime_local_output_numel(a->rt);
    for (int l = 0; l < a->conf.model.num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            const int64_t n = moert_runtime_local_grad_numel(a->rt, l, (moert_param_id)p);
            if (n > chunk) chunk = n;
        }
    if (chunk > COMPARE_CHUNK) chunk = COMPARE_CHUNK;
    bufa = malloc(sizeof(double) * (size_t)nlocal * (size_t)chunk);
    bufb = malloc(sizeof(double) * (size_t)nlocal * (size_t)chunk);
    if (!bufa || !bufb) {
        rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the buffers comparing the first step");
        goto fail;
    }
    HARNESS_CHECK(compare_tensor(a->rt, b->rt, -1, MOERT_PARAM_ROUTER, moert_runtime_local_output_numel(a->rt), chunk,
                                 bufa, bufb, &agr->output_diff));
    agr->gradient_diff = 0.0;
    for (int l = 0; l < a->conf.model.num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            const int64_t numel = moert_runtime_local_grad_numel(a->rt, l, (moert_param_id)p);
            if (numel == 0) continue; /* no shared expert */
            double d = 0.0;
            HARNESS_CHECK(compare_tensor(a->rt, b->rt, l, (moert_param_id)p, numel, chunk, bufa, bufb, &d));
            if (d > agr->gradient_diff) {
                agr->gradient_diff = d;
                snprintf(agr->gradient_worst, sizeof agr->gradient_worst, "layer %d %s", l, param_names[p]);
            }
        }
    agr->first_step_compared = true;
fail:
    free(bufa);
    free(bufb);
    return rc;
}

/* ---- the refusal rule: A and B must be the same model, data and run ---- */

static int report_int_difference(const char *key, int64_t a, int64_t b)
{
    if (a == b) return 0;
    fprintf(stderr, PROG ": not an A/B: %s is %lld in A and %lld in B\n", key, (long long)a, (long long)b);
    return 1;
}

static int report_text_difference(const char *key, const char *a, const char *b)
{
    if (!strcmp(a, b)) return 0;
    fprintf(stderr, PROG ": not an A/B: %s is \"%s\" in A and \"%s\" in B\n", key, a, b);
    return 1;
}

/* Prints a line for every key that must match and does not; returns how many differ. */
static int check_same_run(const ab_config *a, const ab_config *b)
{
    int n = 0;
    n += report_int_difference("$.model.hidden", a->model.hidden, b->model.hidden);
    n += report_int_difference("$.model.ffn_hidden", a->model.ffn_hidden, b->model.ffn_hidden);
    n += report_int_difference("$.model.num_experts", a->model.num_experts, b->model.num_experts);
    n += report_int_difference("$.model.topk", a->model.topk, b->model.topk);
    n += report_int_difference("$.model.num_layers", a->model.num_layers, b->model.num_layers);
    n += report_text_difference("$.model.dtype", a->model.dtype, b->model.dtype);
    n += report_int_difference("$.parallel.ranks", a->parallel.ranks, b->parallel.ranks);
    n += report_int_difference("$.train.tokens_per_rank", a->train.tokens_per_rank, b->train.tokens_per_rank);
    n += report_int_difference("$.train.seq_length", a->train.seq_length, b->train.seq_length);
    n += report_int_difference("$.train.micro_batches", a->train.micro_batches, b->train.micro_batches);
    n += report_int_difference("$.train.seed", a->train.seed, b->train.seed);
    n += report_text_difference("$.train.data", a->train.data, b->train.data);
    if (a->train.input_shift != b->train.input_shift) {
        fprintf(stderr, PROG ": not an A/B: $.train.input_shift is %g in A and %g in B\n", a->train.input_shift,
                b->train.input_shift);
        n++;
    }
    if (n > 0)
        fprintf(stderr, PROG ": A and B must describe the same model and run; they may differ in their plugin "
                             "sections and in train.steps, lr, weight_decay, teacher_scale and log_every\n");
    return n;
}

/* A plugin section as the runtime sees it: the object with "plugin" filled in (the default when absent). */
static json_t *plugin_section(const ab_config *cfg, int slot) { return json_deep_copy(cfg->section[slot]); }

static bool sections_equal(const ab_config *a, const ab_config *b, int slot)
{
    json_t *sa = plugin_section(a, slot), *sb = plugin_section(b, slot);
    bool same = sa && sb && json_equal(sa, sb);
    json_decref(sa);
    json_decref(sb);
    return same;
}

/* Compact JSON of a plugin section, for the header. */
static void section_text(const ab_config *cfg, int slot, char *out, size_t size)
{
    json_t *sec = plugin_section(cfg, slot);
    char *text = sec ? json_dumps(sec, JSON_COMPACT | JSON_SORT_KEYS) : NULL;
    snprintf(out, size, "%s", text ? text : "?");
    free(text);
    json_decref(sec);
}

/* ---- printing ---- */

static void format_bytes(int64_t bytes, char *out, size_t size)
{
    if (bytes >= (int64_t)1 << 30)
        snprintf(out, size, "%.2f GiB", (double)bytes / (double)(1 << 30));
    else if (bytes >= (int64_t)1 << 20)
        snprintf(out, size, "%.2f MiB", (double)bytes / (double)(1 << 20));
    else if (bytes >= 1024)
        snprintf(out, size, "%.1f KiB", (double)bytes / 1024.0);
    else
        snprintf(out, size, "%lld B", (long long)bytes);
}

static void format_spread(const spread *s, char *out, size_t size)
{
    snprintf(out, size, "%.3f [%.3f-%.3f]", s->median, s->p10, s->p90);
}

static void format_ratio(double b, double a, char *out, size_t size)
{
    if (a > 0.0)
        snprintf(out, size, "%.3f", b / a);
    else
        snprintf(out, size, "%s", b == 0.0 ? "1" : "-");
}

/* The table's rows, the same for the terminal and the Markdown file: label and the three cells. */
typedef struct table_row {
    char label[48], a[64], b[64], ratio[32];
} table_row;

enum { MEMORY_ROWS = MOERT_LAYER_ACTIVATIONS + 3 };

static int build_table(const ab_side *a, const ab_side *b, table_row *rows)
{
    int n = 0;
    for (int f = 0; f < FIGURE_COUNT; f++) {
        /* a backward part neither side ran (no recompute, no overlap) gets no row */
        if (f >= FIGURE_FIRST_PART && a->figures[f].p90 == 0.0 && b->figures[f].p90 == 0.0) continue;
        char buf[40];
        snprintf(rows[n].label, sizeof rows[n].label, "%s (ms)", figure_label(f, buf, sizeof buf));
        format_spread(&a->figures[f], rows[n].a, sizeof rows[n].a);
        format_spread(&b->figures[f], rows[n].b, sizeof rows[n].b);
        format_ratio(b->figures[f].median, a->figures[f].median, rows[n].ratio, sizeof rows[n].ratio);
        n++;
    }
    for (int m = 0; m < MEMORY_ROWS; m++) {
        int64_t va, vb;
        if (m < MOERT_LAYER_ACTIVATIONS) {
            snprintf(rows[n].label, sizeof rows[n].label, "%s size (rank 0)", moert_layer_activation_name(m));
            va = a->facts.activation_bytes[m];
            vb = b->facts.activation_bytes[m];
        } else if (m == MOERT_LAYER_ACTIVATIONS) {
            snprintf(rows[n].label, sizeof rows[n].label, "kept fwd->bwd (rank 0)");
            va = a->facts.kept_bytes;
            vb = b->facts.kept_bytes;
        } else if (m == MOERT_LAYER_ACTIVATIONS + 1) {
            if (a->facts.device_type != MOERT_DEVICE_CUDA) continue;
            snprintf(rows[n].label, sizeof rows[n].label, "GPU pool peak (rank 0)");
            va = a->facts.device_peak_bytes;
            vb = b->facts.device_peak_bytes;
        } else {
            /* cudaMalloc/cudaFree in the last step: a warm pool makes none; each one may stall the device */
            if (a->facts.device_type != MOERT_DEVICE_CUDA) continue;
            snprintf(rows[n].label, sizeof rows[n].label, "pool cudaMalloc+Free, last step");
            snprintf(rows[n].a, sizeof rows[n].a, "%lld", (long long)a->facts.device_pool_calls);
            snprintf(rows[n].b, sizeof rows[n].b, "%lld", (long long)b->facts.device_pool_calls);
            snprintf(rows[n].ratio, sizeof rows[n].ratio, "-");
            n++;
            continue;
        }
        format_bytes(va, rows[n].a, sizeof rows[n].a);
        format_bytes(vb, rows[n].b, sizeof rows[n].b);
        format_ratio((double)vb, (double)va, rows[n].ratio, sizeof rows[n].ratio);
        n++;
    }
    return n;
}

/* "outputs agree: yes (max relative loss difference 3.1e-07 over 23 steps; ...)"; with --aa the A/A's line follows,
 * "A' (a second copy of A) agrees with A: ..." */
static void format_agreement(const ab_agreement *agr, const char *what, int64_t steps, char *out, size_t size)
{
    char first[256];
    if (agr->first_step_compared)
        snprintf(first, sizeof first, "first step: output %.1e, gradients %.1e%s%s%s", agr->output_diff,
                 agr->gradient_diff, agr->gradient_worst[0] ? " (" : "", agr->gradient_worst,
                 agr->gradient_worst[0] ? ")" : "");
    else
        snprintf(first, sizeof first, "first step's output and gradients not compared %s",
                 agr->sequential ? "when sequential" : "(no step completed)");
    char worst[64] = "";
    if (agr->loss_diff > 0.0) snprintf(worst, sizeof worst, " (step %lld)", (long long)agr->loss_worst_step);
    snprintf(out, size, "%s: %s (max relative loss difference %.1e%s over %lld steps%s; %s; rtol %g%s)", what,
             agr->agree ? "yes" : "no", agr->loss_diff, worst, (long long)steps,
             agr->losses_identical ? ", identical" : "", first, agr->rtol, agr->rtol_source);
}

/* The tolerance of a comparison of two sides and where it comes from: --rtol, else the looser of what the two
 * precision recipes declare. */
static void choose_rtol(const ab_side *x, const ab_side *y, double option_rtol, ab_agreement *agr)
{
    double rx = x->facts.agreement_rtol, ry = y->facts.agreement_rtol;
    if (rx == 0.0) rx = ry; /* a side never created (--sequential, after a failed step): the other's */
    if (ry == 0.0) ry = rx;
    const char *px = x->facts.precision[0] ? x->facts.precision : y->facts.precision;
    const char *py = y->facts.precision[0] ? y->facts.precision : px;
    if (option_rtol >= 0.0) {
        agr->rtol = option_rtol;
        snprintf(agr->rtol_source, sizeof agr->rtol_source, " from --rtol");
    } else if (!strcmp(px, py) && rx == ry) {
        agr->rtol = rx;
        snprintf(agr->rtol_source, sizeof agr->rtol_source, " declared by precision %s", px);
    } else {
        agr->rtol = rx > ry ? rx : ry;
        snprintf(agr->rtol_source, sizeof agr->rtol_source, ", the looser of %s's precision %s (%g) and %s's %s (%g)",
                 x->tag, px, rx, y->tag, py, ry);
    }
}

/* "B/A: step 0.93x (B 7.0% faster), layer fwd+bwd 0.95x, activations kept 0.33x; outputs agree"; with --aa (aprime
 * not NULL) A'/A's step time follows. */
static void format_summary(const ab_side *a, const ab_side *b, const ab_side *aprime, const ab_agreement *agr,
                           char *out, size_t size)
{
    double step =
        a->figures[FIGURE_STEP].median > 0 ? b->figures[FIGURE_STEP].median / a->figures[FIGURE_STEP].median : NAN;
    double layer =
        a->figures[FIGURE_LAYER].median > 0 ? b->figures[FIGURE_LAYER].median / a->figures[FIGURE_LAYER].median : NAN;
    char faster[48] = "";
    if (isfinite(step) && step != 1.0)
        snprintf(faster, sizeof faster, " (B %.1f%% %s)", fabs(1.0 - step) * 100.0, step < 1.0 ? "faster" : "slower");
    char kept[48];
    if (a->facts.kept_bytes > 0)
        snprintf(kept, sizeof kept, "%.2fx", (double)b->facts.kept_bytes / (double)a->facts.kept_bytes);
    else
        snprintf(kept, sizeof kept, "%s", b->facts.kept_bytes == 0 ? "1.00x" : "-");
    snprintf(out, size, "summary: B/A step time %.3fx%s, layer fwd+bwd %.3fx, activations kept %s; outputs %s", step,
             faster, layer, kept, agr->agree ? "agree" : "differ");
    if (aprime) {
        size_t len = strlen(out);
        double noise = a->figures[FIGURE_STEP].median > 0
                           ? aprime->figures[FIGURE_STEP].median / a->figures[FIGURE_STEP].median
                           : NAN;
        snprintf(out + len, size - len, "; A'/A step time %.3fx (the same config twice)", noise);
    }
    if (a->facts.device_type == MOERT_DEVICE_CUDA) {
        size_t len = strlen(out);
        snprintf(out + len, size - len, "\ncuda graph: A %s; B %s", a->facts.graph, b->facts.graph);
    }
    if (a->facts.overlapped || b->facts.overlapped) {
        size_t len = strlen(out);
        snprintf(out + len, size - len,
                 "\nmicro-batch overlap: A %s, B %s; with it on, a stage's figure (and layer fwd+bwd, their sum) holds "
                 "what ran beside it from the other half, so the halves' figures overlap in time: compare the step "
                 "(the layers' own span: moert run --trace, tools/trace_summary.py)",
                 a->facts.overlapped ? "on" : "off", b->facts.overlapped ? "on" : "off");
    }
}

static void print_table(FILE *f, const table_row *rows, int n)
{
    int w0 = (int)strlen("figure"), w1 = (int)strlen("A median [p10-p90]"), w2 = (int)strlen("B median [p10-p90]");
    for (int i = 0; i < n; i++) {
        if ((int)strlen(rows[i].label) > w0) w0 = (int)strlen(rows[i].label);
        if ((int)strlen(rows[i].a) > w1) w1 = (int)strlen(rows[i].a);
        if ((int)strlen(rows[i].b) > w2) w2 = (int)strlen(rows[i].b);
    }
    fprintf(f, "%-*s  %-*s  %-*s  %s\n", w0, "figure", w1, "A median [p10-p90]", w2, "B median [p10-p90]", "B/A");
    for (int i = 0; i < n; i++)
        fprintf(f, "%-*s  %-*s  %-*s  %s\n", w0, rows[i].label, w1, rows[i].a, w2, rows[i].b, rows[i].ratio);
}

/* ---- the JSON report and its Markdown twin ---- */

/* A JSON number, or null where the value is not finite (JSON has no infinity). */
static json_t *json_number(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *spread_json(const spread *s)
{
    json_t *o = json_object();
    json_object_set_new(o, "median", json_number(s->median));
    json_object_set_new(o, "p10", json_number(s->p10));
    json_object_set_new(o, "p90", json_number(s->p90));
    return o;
}

static json_t *memory_json(const ab_run_facts *rt)
{
    json_t *o = json_object();
    for (int m = 0; m < MOERT_LAYER_ACTIVATIONS; m++)
        json_object_set_new(o, moert_layer_activation_name(m), json_integer(rt->activation_bytes[m]));
    json_object_set_new(o, "kept_from_forward_to_backward", json_integer(rt->kept_bytes));
    if (rt->device_type == MOERT_DEVICE_CUDA)
        json_object_set_new(o, "gpu_pool_peak_bytes", json_integer(rt->device_peak_bytes));
    if (rt->device_type == MOERT_DEVICE_CUDA)
        json_object_set_new(o, "gpu_pool_cuda_calls_last_step", json_integer(rt->device_pool_calls));
    return o;
}

static json_t *side_json(const ab_side *s, int64_t total_steps, int64_t warmup)
{
    if (total_steps > s->done) total_steps = s->done; /* a failed step: the ones completed */
    json_t *o = json_object(), *plugins = json_object(), *steps = json_array(), *medians = json_object();
    for (int slot = 0; slot < AB_SLOTS; slot++)
        json_object_set_new(plugins, slot_keys[slot], plugin_section(&s->conf, slot));
    for (int f = 0; f < FIGURE_COUNT; f++) json_object_set_new(medians, figure_name(f), spread_json(&s->figures[f]));
    json_object_set_new(o, "cuda_graph", json_string(s->facts.graph));
    for (int64_t i = 0; i < total_steps; i++) {
        json_t *step = moert_report_step_json(&s->records[i]);
        json_object_set_new(step, "warmup", json_boolean(i < warmup));
        json_array_append_new(steps, step);
    }
    json_object_set_new(o, "config", json_string(s->conf.source));
    json_object_set_new(o, "name", json_string(s->conf.name));
    json_object_set_new(o, "plugins", plugins);
    json_object_set_new(o, "train",
                        json_pack("{s:I, s:f, s:f, s:f}", "steps", (json_int_t)s->conf.train.steps, "lr",
                                  s->conf.train.lr, "weight_decay", s->conf.train.weight_decay, "teacher_scale",
                                  s->conf.train.teacher_scale));
    json_object_set_new(o, "ms", medians);
    json_object_set_new(o, "activation_bytes_rank0", memory_json(&s->facts));
    json_object_set_new(o, "completed_steps", json_integer(s->done));
    json_object_set_new(o, "steps", steps);
    return o;
}

/* The header lines: what is compared with what, on what. */
typedef struct ab_header {
    int count;
    char lines[8 + AB_SLOTS][1200];
} ab_header;

static void header_add(ab_header *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void header_add(ab_header *h, const char *fmt, ...)
{
    if (h->count >= (int)(sizeof h->lines / sizeof h->lines[0])) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->lines[h->count++], sizeof h->lines[0], fmt, ap);
    va_end(ap);
}

/* Appends ", KEY A in A, B in B" to out when the two differ. */
static void train_key_difference(char *out, size_t size, const char *key, double a, double b)
{
    if (a == b) return;
    size_t len = strlen(out);
    snprintf(out + len, size - len, "%s%s %g in A, %g in B", len ? "; " : "", key, a, b);
}

static void build_header(const ab_side *a, const ab_side *b, int64_t warmup, int64_t steps, bool sequential, bool aa,
                         ab_header *h)
{
    const ab_config *ca = &a->conf, *cb = &b->conf;
    h->count = 0;
    header_add(h, "A \"%s\" (%s) vs B \"%s\" (%s)", ca->name, a->path, cb->name, b->path);
    char micro[64] = "";
    if (ca->train.micro_batches > 1)
        snprintf(micro, sizeof micro, " x %lld micro-batches per step (times per step)",
                 (long long)ca->train.micro_batches);
    header_add(h, "on %s; %lld layer%s, H=%lld F=%lld E=%lld K=%lld, %lld tokens per rank%s, %s storage, seed %lld",
               a->facts.device_name, (long long)ca->model.num_layers, ca->model.num_layers > 1 ? "s" : "",
               (long long)ca->model.hidden, (long long)ca->model.ffn_hidden, (long long)ca->model.num_experts,
               (long long)ca->model.topk, (long long)ca->train.tokens_per_rank, micro, ca->model.dtype,
               (long long)ca->train.seed);
    char same[512] = "";
    for (int s = 0; s < AB_SLOTS; s++) {
        if (!sections_equal(ca, cb, s)) continue;
        size_t len = strlen(same);
        snprintf(same + len, sizeof same - len, "%s%s %s", len ? ", " : "", slot_keys[s], ca->plugin[s]);
    }
    if (same[0]) header_add(h, "same in both: %s", same);
    for (int s = 0; s < AB_SLOTS; s++) {
        if (sections_equal(ca, cb, s)) continue;
        char ta[500], tb[500];
        section_text(ca, s, ta, sizeof ta);
        section_text(cb, s, tb, sizeof tb);
        header_add(h, "differs: %s: A %s, B %s", slot_keys[s], ta, tb);
    }
    char train[512] = "";
    train_key_difference(train, sizeof train, "train.steps", (double)ca->train.steps, (double)cb->train.steps);
    train_key_difference(train, sizeof train, "train.lr", ca->train.lr, cb->train.lr);
    train_key_difference(train, sizeof train, "train.weight_decay", ca->train.weight_decay, cb->train.weight_decay);
    train_key_difference(train, sizeof train, "train.teacher_scale", ca->train.teacher_scale, cb->train.teacher_scale);
    train_key_difference(train, sizeof train, "train.log_every", (double)ca->train.log_every,
                         (double)cb->train.log_every);
    if (train[0]) header_add(h, "differs: %s", train);
    if (strcmp(ca->parallel.cuda_graph, cb->parallel.cuda_graph) != 0)
        header_add(h, "differs: parallel.cuda_graph: A \"%s\", B \"%s\"", ca->parallel.cuda_graph,
                   cb->parallel.cuda_graph);
    if (strcmp(ca->parallel.overlap_micro_batches, cb->parallel.overlap_micro_batches) != 0)
        header_add(h, "differs: parallel.overlap_micro_batches: A \"%s\", B \"%s\"", ca->parallel.overlap_micro_batches,
                   cb->parallel.overlap_micro_batches);
    /* the boolean parallel keys */
    const struct {
        const char *key;
        int64_t a, b;
    } flags[] = {{"overlap_wgrad", ca->parallel.overlap_wgrad, cb->parallel.overlap_wgrad},
                 {"defer_wgrad_join", ca->parallel.defer_wgrad_join, cb->parallel.defer_wgrad_join},
                 {"overlap_dgrad_first", ca->parallel.overlap_dgrad_first, cb->parallel.overlap_dgrad_first},
                 {"overlap_prepare_after_dgrads", ca->parallel.overlap_prepare_after_dgrads,
                  cb->parallel.overlap_prepare_after_dgrads},
                 {"overlap_prepare_own_stream", ca->parallel.overlap_prepare_own_stream,
                  cb->parallel.overlap_prepare_own_stream}};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (flags[i].a != flags[i].b)
            header_add(h, "differs: parallel.%s: A %s, B %s", flags[i].key, flags[i].a ? "true" : "false",
                       flags[i].b ? "true" : "false");
    if (ca->parallel.overlap_comm_sms != cb->parallel.overlap_comm_sms)
        header_add(h, "differs: parallel.overlap_comm_sms: A %lld, B %lld", (long long)ca->parallel.overlap_comm_sms,
                   (long long)cb->parallel.overlap_comm_sms);
    const char *order = sequential ? (aa ? "sequential: all of A, then all of B, then all of A' (--sequential)"
                                         : "sequential: all of A, then all of B (--sequential)")
                                   : (aa ? "interleaved: A, B and A' in each of their 6 orders in turn"
                                         : "interleaved ABBA: A first on odd steps, B on even ones");
    header_add(h, "%lld warm-up step%s, then %lld measured step%s, %s", (long long)warmup, warmup == 1 ? "" : "s",
               (long long)steps, steps == 1 ? "" : "s", order);
    if (aa) header_add(h, "A/A: A' is a second copy of A (--aa); A'/A is the machine's noise floor beside B/A");
}

/* FILE.json -> FILE.md; any other name gets ".md" appended. */
static void markdown_path(const char *json_path, char *out, size_t size)
{
    size_t len = strlen(json_path);
    if (len > 5 && !strcmp(json_path + len - 5, ".json"))
        snprintf(out, size, "%.*s.md", (int)(len - 5), json_path);
    else
        snprintf(out, size, "%s.md", json_path);
}

/* The first line of every table `moert ab` writes: a file beside the report that does not start with it is someone
 * else's, and is not overwritten. */
#define MARKDOWN_TITLE "# moert ab\n"

typedef struct markdown_parts {
    const ab_header *h;
    const table_row *rows;
    int nrows;
    const char *verdict, *aa_verdict, *summary; /* aa_verdict: "" without --aa */
    bool aa;
} markdown_parts;

static int markdown_writer(FILE *f, void *user)
{
    const markdown_parts *m = user;
    const ab_header *h = m->h;
    const table_row *rows = m->rows;
    int nrows = m->nrows;
    const char *verdict = m->verdict, *summary = m->summary;
    fprintf(f, MARKDOWN_TITLE "\n");
    for (int i = 0; i < h->count; i++) fprintf(f, "- %s\n", h->lines[i]);
    fprintf(f, "\n| figure | A median [p10-p90] | B median [p10-p90] | B/A |\n|---|---:|---:|---:|\n");
    for (int i = 0; i < nrows; i++)
        fprintf(f, "| %s | %s | %s | %s |\n", rows[i].label, rows[i].a, rows[i].b, rows[i].ratio);
    fprintf(f, "\n%s\n\n", verdict);
    if (m->aa_verdict[0]) fprintf(f, "%s\n\n", m->aa_verdict);
    fprintf(f, "%s\n", summary);
    /* each timed figure's B/A with its interval (the figures both sides measured); with --aa, A'/A beside it */
    if (m->aa)
        fprintf(f, "\n| figure | B/A | 95%% CI | verdict | A'/A (noise floor) | A'/A 95%% CI |\n"
                   "|---|---:|---|---|---:|---|\n");
    else
        fprintf(f, "\n| figure | B/A | 95%% CI | verdict |\n|---|---:|---|---|\n");
    for (int fig = 0; fig < FIGURE_COUNT; fig++) {
        const ab_interval *iv = &intervals[fig], *aa = &aa_intervals[fig];
        if (isnan(iv->ratio) || isnan(iv->low)) continue;
        char text[160], buf[40];
        ab_verdict_text(iv, text, sizeof text);
        fprintf(f, "| %s | %.3f | %.3f-%.3f | %s |", figure_label(fig, buf, sizeof buf), iv->ratio, iv->low, iv->high,
                text);
        if (m->aa && !isnan(aa->low))
            fprintf(f, " %.3f | %.3f-%.3f |", aa->ratio, aa->low, aa->high);
        else if (m->aa)
            fprintf(f, " - | - |");
        fprintf(f, "\n");
    }
    return ferror(f) ? -1 : 0;
}

static int dump_json(FILE *f, void *root) { return json_dumpf(root, f, JSON_INDENT(1) | JSON_REAL_PRECISION(8)); }

/* Checks, before anything runs, that the report, its table and the plot can be written: none is an input config or
 * another output, none is a link, their folders are writable, and an existing table is one `moert ab` wrote. */
static int check_outputs(const char *const configs[2], const char *report, const char *md, const char *plot)
{
    const char *inputs[4] = {configs[0], configs[1], report, md};
    if (report && moert_output_check("--report", report, inputs, 2) != MOERT_OK) goto refused;
    if (report && moert_output_check("--report's table", md, inputs, 3) != MOERT_OK) goto refused;
    if (report) {
        FILE *f = fopen(md, "r");
        char first[64] = "";
        if (f) {
            if (!fgets(first, sizeof first, f)) first[0] = '\0';
            fclose(f);
            if (strcmp(first, MARKDOWN_TITLE) != 0) {
                fprintf(stderr,
                        PROG ": --report %s: the table beside it, %s, exists and was not written by moert ab; "
                             "move it away or choose another report name\n",
                        report, md);
                return 1;
            }
        }
    }
    if (plot && moert_output_check("--plot", plot, inputs, report ? 4 : 2) != MOERT_OK) goto refused;
    if (plot && report && (moert_output_same_file(plot, report) || moert_output_same_file(plot, md))) {
        fprintf(stderr, PROG ": --plot %s is also the report or its table\n", plot);
        return 1;
    }
    if (plot) {
        /* the plot's data, named after it, lands on no input, output or file the user wrote */
        char data[PATH_MAX + 16];
        moert_ab_plot_data_path(plot, data, sizeof data);
        const char *others[5] = {configs[0], configs[1], plot, report, md};
        static const char *const roles[5] = {"config A", "config B", "--plot", "--report", "--report's table"};
        for (int i = 0; i < (report ? 5 : 3); i++)
            if (moert_output_same_file(data, others[i])) {
                fprintf(stderr, PROG ": --plot %s: its data file %s would be %s, %s\n", plot, data, roles[i],
                        others[i]);
                return 1;
            }
        if (moert_output_check_derived("--plot's data", data, plot, MOERT_AB_PLOT_DATA_MARKER, others,
                                       report ? 5 : 3) != MOERT_OK)
            goto refused;
    }
    return 0;
refused:
    fprintf(stderr, PROG ": %s\n", moert_last_error());
    return 1;
}

/* The intervals of every timed figure as the report holds them (b_over_a_intervals, a_over_a_intervals). */
static json_t *intervals_json(const ab_interval *ivs, const char *order, uint64_t seed)
{
    json_t *figures = json_object();
    for (int f = 0; f < FIGURE_COUNT; f++) {
        const ab_interval *iv = &ivs[f];
        if (isnan(iv->ratio)) continue;
        char text[160];
        ab_verdict_text(iv, text, sizeof text);
        json_object_set_new(figures, figure_name(f),
                            json_pack("{s:o, s:o, s:o, s:I, s:s}", "ratio", json_number(iv->ratio), "ci_low",
                                      json_number(iv->low), "ci_high", json_number(iv->high), "pairs",
                                      (json_int_t)iv->pairs, "verdict", text));
    }
    return json_pack("{s:s, s:f, s:i, s:I, s:o}", "order", order, "level", 0.95, "resamples", BOOTSTRAP_RESAMPLES,
                     "seed", (json_int_t)seed, "figures", figures);
}

/* The agreement of two sides as the report holds it. */
static json_t *agreement_json(const ab_agreement *agr)
{
    json_t *first = json_object();
    json_object_set_new(first, "compared", json_boolean(agr->first_step_compared));
    if (agr->first_step_compared) {
        json_object_set_new(first, "output_max_relative_difference", json_number(agr->output_diff));
        json_object_set_new(first, "gradient_max_relative_difference", json_number(agr->gradient_diff));
        json_object_set_new(first, "gradient_worst",
                            agr->gradient_worst[0] ? json_string(agr->gradient_worst) : json_null());
    }
    json_t *agreement = json_object();
    const char *source = agr->rtol_source;
    while (*source == ' ' || *source == ',') source++;
    json_object_set_new(agreement, "rtol", json_real(agr->rtol));
    json_object_set_new(agreement, "rtol_source", json_string(source));
    json_object_set_new(agreement, "agree", json_boolean(agr->agree));
    json_object_set_new(agreement, "losses_identical", json_boolean(agr->losses_identical));
    json_object_set_new(agreement, "loss_max_relative_difference", json_number(agr->loss_diff));
    json_object_set_new(agreement, "loss_worst_step",
                        agr->loss_worst_step > 0 ? json_integer(agr->loss_worst_step) : json_null());
    json_object_set_new(agreement, "first_step", first);
    return agreement;
}

/* What the report and its table hold beyond the two sides: with --aa, A' and its agreement with A. */
typedef struct report_parts {
    const ab_header *h;
    const ab_agreement *agr, *aa_agr; /* aa_agr: NULL without --aa */
    const ab_side *aprime;            /* NULL without --aa */
    int64_t warmup, steps;
    const char *verdict, *aa_verdict, *summary, *timing, *order, *failure;
    const table_row *rows;
    int nrows;
} report_parts;

static moert_result write_report(const char *path, const ab_side *a, const ab_side *b, const report_parts *rp)
{
    const ab_header *h = rp->h;
    const ab_agreement *agr = rp->agr;
    const int64_t warmup = rp->warmup, steps = rp->steps;
    const char *verdict = rp->verdict, *summary = rp->summary, *failure = rp->failure;
    const ab_config *cfg = &a->conf;
    json_t *root = json_object(), *ratios = json_object(), *header = json_array(), *differ = json_array();
    for (int i = 0; i < h->count; i++) json_array_append_new(header, json_string(h->lines[i]));
    for (int s = 0; s < AB_SLOTS; s++)
        if (!sections_equal(&a->conf, &b->conf, s)) json_array_append_new(differ, json_string(slot_keys[s]));
    for (int f = 0; f < FIGURE_COUNT; f++)
        json_object_set_new(ratios, figure_name(f),
                            a->figures[f].median > 0 ? json_number(b->figures[f].median / a->figures[f].median)
                                                     : json_null());
    json_object_set_new(ratios, "kept_from_forward_to_backward",
                        a->facts.kept_bytes > 0 ? json_real((double)b->facts.kept_bytes / (double)a->facts.kept_bytes)
                                                : json_null());
    json_t *agreement = agreement_json(agr);
    if (rp->aa_agr) json_object_set_new(agreement, "a_prime", agreement_json(rp->aa_agr));

    json_object_set_new(root, "moert_version", json_string(MOERT_VERSION_STRING));
    json_object_set_new(root, "device", json_string(a->facts.device_name));
    json_object_set_new(root, "ranks", json_integer(a->facts.world));
    json_object_set_new(root, "model",
                        json_pack("{s:I, s:I, s:I, s:I, s:I, s:s}", "hidden", (json_int_t)cfg->model.hidden,
                                  "ffn_hidden", (json_int_t)cfg->model.ffn_hidden, "num_experts",
                                  (json_int_t)cfg->model.num_experts, "topk", (json_int_t)cfg->model.topk, "num_layers",
                                  (json_int_t)cfg->model.num_layers, "dtype", cfg->model.dtype));
    json_object_set_new(root, "tokens_per_rank", json_integer(cfg->train.tokens_per_rank));
    json_object_set_new(root, "micro_batches", json_integer(cfg->train.micro_batches));
    json_object_set_new(root, "seed", json_integer(cfg->train.seed));
    json_object_set_new(root, "warmup_steps", json_integer(warmup));
    json_object_set_new(root, "measured_steps", json_integer(steps));
    json_object_set_new(root, "header", header);
    json_object_set_new(root, "differing_plugin_sections", differ);
    json_object_set_new(root, "a", side_json(a, warmup + steps, warmup));
    json_object_set_new(root, "b", side_json(b, warmup + steps, warmup));
    json_object_set_new(root, "b_over_a", ratios);
    json_object_set_new(root, "b_over_a_intervals", intervals_json(intervals, rp->order, BOOTSTRAP_SEED));
    if (rp->aprime) {
        json_object_set_new(root, "a_prime", side_json(rp->aprime, warmup + steps, warmup));
        json_object_set_new(root, "a_over_a_intervals",
                            intervals_json(aa_intervals, rp->order, BOOTSTRAP_SEED + AA_SEED_OFFSET));
        json_object_set_new(root, "aa_verdict", json_string(rp->aa_verdict));
    }
    json_object_set_new(root, "agreement", agreement);
    json_object_set_new(root, "verdict", json_string(verdict));
    json_object_set_new(root, "summary", json_string(summary));
    json_object_set_new(root, "timing", json_string(rp->timing));
    json_object_set_new(root, "complete", json_boolean(failure == NULL));
    json_object_set_new(root, "failure", failure ? json_string(failure) : json_null());
    moert_result rc = moert_output_write(path, dump_json, root);
    json_decref(root);
    if (rc != MOERT_OK) {
        fprintf(stderr, PROG ": %s\n", moert_last_error());
        return rc;
    }
    char md[4096];
    markdown_path(path, md, sizeof md);
    markdown_parts parts = {h, rp->rows, rp->nrows, verdict, rp->aa_verdict, summary, rp->aprime != NULL};
    rc = moert_output_write(md, markdown_writer, &parts);
    if (rc != MOERT_OK) fprintf(stderr, PROG ": %s\n", moert_last_error());
    return rc;
}

/* ---- the command ---- */

/* A --set (side -1), --set-a (0) or --set-b (1), kept in command-line order. */
typedef struct ab_set {
    int side;
    const char *assignment;
} ab_set;

/* Parses a count option's value; -1 when it is not an integer >= min. */
/* --steps / --warmup: an integer from min to MOERT_CLI_MAX_STEPS (so that warm-up + steps never overflows), or -1. */
static long long parse_count(const char *option, const char *text, long long min)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(text, &end, 10);
    if (!end || end == text || *end || errno == ERANGE || v < min || v > MOERT_CLI_MAX_STEPS) {
        fprintf(stderr, PROG ": %s expects an integer from %lld to %d, got \"%s\"\n", option, min, MOERT_CLI_MAX_STEPS,
                text);
        return -1;
    }
    return v;
}

static void print_progress(const ab_side *sides, int nsides, int64_t step, int64_t warmup, int64_t total)
{
    const moert_step_record *a = &sides[0].records[step - 1], *b = &sides[1].records[step - 1];
    printf("step %*lld/%lld%s  A loss %.6f %8.2f ms   B loss %.6f %8.2f ms",
           (int)snprintf(NULL, 0, "%lld", (long long)total), (long long)step, (long long)total,
           step <= warmup ? " (warm-up)" : "          ", a->loss, a->seconds * 1e3, b->loss, b->seconds * 1e3);
    if (nsides == 3)
        printf("   A' loss %.6f %8.2f ms", sides[2].records[step - 1].loss, sides[2].records[step - 1].seconds * 1e3);
    printf("\n");
    fflush(stdout);
}

/* Copies what the report needs from a side's runtime. */
static void take_facts(ab_side *side)
{
    moert_run_summary summary;
    moert_runtime_summary(side->rt, &summary);
    const moert_run_summary *rt = &summary;
    ab_run_facts *f = &side->facts;
    f->device_type = rt->device_type;
    snprintf(f->device_name, sizeof f->device_name, "%s", rt->device_name);
    f->world = rt->world;
    memcpy(f->activation_bytes, rt->activation_bytes, sizeof f->activation_bytes);
    f->kept_bytes = rt->kept_bytes;
    f->device_peak_bytes = rt->device_peak_bytes;
    f->device_pool_calls = rt->device_pool_calls;
    f->agreement_rtol = moert_runtime_agreement_rtol(side->rt);
    snprintf(f->precision, sizeof f->precision, "%.63s", rt->plugins[2].name); /* the precision plugin */
    moert_runtime_graph_summary(side->rt, f->graph, sizeof f->graph);
    f->overlapped = moert_runtime_overlapped(side->rt);
}

/* Creates a side's runtime and notes what the report needs from it. */
static moert_result create_side(ab_side *side, bool sequential)
{
    moert_result rc = moert_runtime_create(side->cfg, &side->rt);
    if (rc != MOERT_OK) {
        fprintf(stderr, PROG ": %s (%s): %s\n", side->tag, side->path, moert_last_error());
        /* the hint only where memory ran out: B then failed beside A */
        if (!sequential && strcmp(side->tag, "A") != 0 && rc == MOERT_ERR_OUT_OF_MEMORY)
            fprintf(stderr, PROG ": if A and B do not fit in memory together, --sequential runs A to the end, "
                                 "frees it, then runs B\n");
        return rc;
    }
    take_facts(side);
    return MOERT_OK;
}

/* One training step of a side, recorded; the memory figures are those of the last step. */
static moert_result step_side(ab_side *side, int64_t step, char *failure, size_t failure_size)
{
    moert_result rc = moert_runtime_step(side->rt, step, &side->records[step - 1]);
    if (rc != MOERT_OK) {
        snprintf(failure, failure_size, "%s (%s), step %lld: %s", side->tag, side->path, (long long)step,
                 moert_last_error());
        fprintf(stderr, PROG ": %s\n", failure);
        return rc;
    }
    side->done = step;
    take_facts(side);
    return MOERT_OK;
}

/* A and B must run on the same kind of device; returns 1 (and says why) when they do not. */
static int check_same_device(const ab_side *a, const ab_side *b)
{
    if (a->facts.device_type == b->facts.device_type) return 0;
    fprintf(stderr, PROG ": not an A/B: $.parallel.device gives %s in %s and %s in %s\n", a->facts.device_name, a->tag,
            b->facts.device_name, b->tag);
    return 1;
}

static void print_side_progress(const ab_side *side, int64_t step, int64_t warmup, int64_t total)
{
    const moert_step_record *r = &side->records[step - 1];
    printf("%s step %*lld/%lld%s  loss %.6f %8.2f ms\n", side->tag, (int)snprintf(NULL, 0, "%lld", (long long)total),
           (long long)step, (long long)total, step <= warmup ? " (warm-up)" : "          ", r->loss, r->seconds * 1e3);
    fflush(stdout);
}

/* The agreement of y with x over the steps both completed: every loss (the first step's output and gradients were
 * compared after step 1). */
static void finish_agreement(const ab_side *x, const ab_side *y, ab_agreement *agr)
{
    const int64_t done = x->done < y->done ? x->done : y->done;
    for (int64_t step = 1; step <= done; step++) {
        double lx = x->records[step - 1].loss, ly = y->records[step - 1].loss;
        double d = relative_difference(lx, ly);
        if (d > agr->loss_diff) {
            agr->loss_diff = d;
            agr->loss_worst_step = step;
        }
        if (memcmp(&lx, &ly, sizeof lx) != 0) agr->losses_identical = false;
    }
    agr->agree = agr->loss_diff <= agr->rtol &&
                 (!agr->first_step_compared || (agr->output_diff <= agr->rtol && agr->gradient_diff <= agr->rtol));
}

/* y/x of every timed figure with its bootstrap interval, over the measured steps both completed (paired by step). */
static moert_result ratio_intervals(const ab_side *x, const ab_side *y, int64_t warmup, uint64_t seed, ab_interval *out)
{
    const int64_t done = x->done < y->done ? x->done : y->done;
    const int64_t pairs = done > warmup ? done - warmup : 0;
    double *px = malloc(sizeof(double) * (size_t)(pairs + 1)), *py = malloc(sizeof(double) * (size_t)(pairs + 1));
    moert_result rc = MOERT_OK;
    HARNESS_CHECK_ALLOC(px);
    HARNESS_CHECK_ALLOC(py);
    for (int f = 0; f < FIGURE_COUNT; f++) {
        for (int64_t i = 0; i < pairs; i++) {
            px[i] = figure_ms(&x->records[warmup + i], f);
            py[i] = figure_ms(&y->records[warmup + i], f);
        }
        ab_ratio_interval(px, py, pairs, seed + (uint64_t)f, BOOTSTRAP_RESAMPLES, 0.95, &out[f]);
    }
fail:
    free(px);
    free(py);
    return rc;
}

/* One figure's timing verdict, with --aa followed by the A/A's interval: "step B faster by 4.1% (95% CI 3.2% to
 * 5.0%) [A'/A 95% CI -0.5% to +0.6%]". */
static void timing_text(int f, bool aa, char *out, size_t size)
{
    char verdict[160], noise[96] = "";
    ab_verdict_text(&intervals[f], verdict, sizeof verdict);
    if (aa) {
        char text[80];
        ab_noise_text(&aa_intervals[f], text, sizeof text);
        snprintf(noise, sizeof noise, " [%s]", text);
    }
    snprintf(out, size, "%s%s", verdict, noise);
}

int moert_cmd_ab(int argc, char **argv)
{
    const char *paths[2] = {NULL, NULL}, *report_path = NULL, *plot_path = NULL;
    long long warmup = DEFAULT_WARMUP, steps = 0;
    double rtol = -1.0; /* --rtol; below 0: the tolerance the precision recipes declare */
    int quiet = 0, status = 1;
    bool sequential = false, aa = false;
    ab_set sets[MOERT_CLI_MAX_SETS];
    int nsets = 0;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            ab_usage(stdout);
            return 0;
        } else if ((!strcmp(arg, "--set") || !strcmp(arg, "--set-a") || !strcmp(arg, "--set-b")) && has_value) {
            if (nsets == MOERT_CLI_MAX_SETS) {
                fprintf(stderr, PROG ": at most %d --set, --set-a and --set-b options\n", MOERT_CLI_MAX_SETS);
                return 2;
            }
            sets[nsets].side = !strcmp(arg, "--set") ? -1 : !strcmp(arg, "--set-a") ? 0 : 1;
            sets[nsets++].assignment = argv[++i];
            if (!moert_cli_set_ok(PROG, argv[i])) return 2;
        } else if (!strcmp(arg, "--warmup") && has_value) {
            if ((warmup = parse_count(arg, argv[++i], 0)) < 0) return 2;
        } else if (!strcmp(arg, "--steps") && has_value) {
            if ((steps = parse_count(arg, argv[++i], 1)) < 0) return 2;
        } else if (!strcmp(arg, "--rtol") && has_value) {
            char *end = NULL;
            rtol = strtod(argv[++i], &end);
            if (!end || end == argv[i] || *end || !(rtol >= 0.0) || !isfinite(rtol)) {
                fprintf(stderr, PROG ": --rtol expects a number >= 0, got \"%s\"\n", argv[i]);
                return 2;
            }
        } else if (!strcmp(arg, "--report") && has_value) {
            report_path = argv[++i];
        } else if (!strcmp(arg, "--plot") && has_value) {
            plot_path = argv[++i];
        } else if (!strcmp(arg, "--quiet")) {
            quiet = 1;
        } else if (!strcmp(arg, "--sequential")) {
            sequential = true;
        } else if (!strcmp(arg, "--aa")) {
            aa = true;
        } else if (arg[0] == '-') {
            fprintf(stderr, PROG ": unknown or incomplete option \"%s\"\n", arg);
            ab_usage(stderr);
            return 2;
        } else if (!paths[0] || !paths[1]) {
            paths[paths[0] ? 1 : 0] = arg;
        } else {
            fprintf(stderr, PROG ": two configs expected, got \"%s\" too\n", arg);
            return 2;
        }
    }
    if (!paths[0] || !paths[1]) {
        ab_usage(stderr);
        return 2;
    }
    char md[4096] = "";
    if (report_path) markdown_path(report_path, md, sizeof md);
    if (check_outputs(paths, report_path, report_path ? md : NULL, plot_path) != 0) return 1;

    /* A, B and, with --aa, A': A's config with A's overrides, run as a third side */
    ab_side sides[3] = {
        {.path = paths[0], .tag = "A"}, {.path = paths[1], .tag = "B"}, {.path = paths[0], .tag = "A'"}};
    const int nsides = aa ? 3 : 2;
    ab_agreement agr = {.losses_identical = true, .sequential = sequential};
    ab_agreement aa_agr = {.losses_identical = true, .sequential = sequential}; /* A' against A */
    double *values = NULL, *series = NULL;
    char failure[4096] = ""; /* the step that failed: the report then holds the steps completed */
    for (int s = 0; s < nsides; s++) {
        const int from = s == 2 ? 0 : s; /* whose --set-a/--set-b apply */
        const char *mine[MOERT_CLI_MAX_SETS];
        int nmine = 0;
        for (int i = 0; i < nsets; i++)
            if (sets[i].side < 0 || sets[i].side == from) mine[nmine++] = sets[i].assignment;
        char prog[32];
        snprintf(prog, sizeof prog, PROG " (%s)", sides[s].tag);
        if (moert_cli_load_config(prog, sides[s].path, mine, nmine, &sides[s].cfg) != MOERT_OK) goto exit;
        if (read_ab_config(sides[s].cfg, &sides[s].conf) != MOERT_OK) {
            fprintf(stderr, "%s: %s\n", prog, moert_last_error());
            goto exit;
        }
    }
    if (check_same_run(&sides[0].conf, &sides[1].conf) > 0) {
        status = 2;
        goto exit;
    }
    if (steps == 0) {
        steps = sides[0].conf.train.steps < DEFAULT_MAX_STEPS ? sides[0].conf.train.steps : DEFAULT_MAX_STEPS;
        if (steps < 1) steps = 1;
    }
    int64_t total = (int64_t)warmup + (int64_t)steps;
    for (int s = 0; s < nsides; s++) {
        sides[s].records = calloc((size_t)total, sizeof *sides[s].records);
        if (!sides[s].records) {
            fprintf(stderr, PROG ": out of memory\n");
            goto exit;
        }
    }
    /* Interleaved: every runtime lives at once. Sequential: each side runs to the end and is freed before the next. */
    moert_result failed_rc = MOERT_OK; /* a failed creation or step: its code gives the exit status */
    for (int s = 0; s < (sequential ? 1 : nsides); s++)
        if ((failed_rc = create_side(&sides[s], sequential)) != MOERT_OK) {
            status = moert_cli_failure_status(failed_rc);
            goto exit;
        }
    ab_header header;
    build_header(&sides[0], &sides[1], warmup, steps, sequential, aa, &header);
    for (int i = 0; i < header.count; i++) printf("%s%s\n", i == 0 ? PROG ": " : "  ", header.lines[i]);

    int log_every = (int)(sides[0].conf.train.log_every > 0 ? sides[0].conf.train.log_every : 1);
    if (!sequential) {
        for (int s = 1; s < nsides; s++)
            if (check_same_device(&sides[0], &sides[s]) != 0) {
                status = 2;
                goto exit;
            }
        for (int64_t step = 1; step <= total; step++) {
            /* ABBA (with A': all six orders in turn), so that no side always runs after the same other's work */
            int order[3];
            ab_step_order(step, nsides, order);
            for (int k = 0; k < nsides; k++)
                if ((failed_rc = step_side(&sides[order[k]], step, failure, sizeof failure)) != MOERT_OK) goto finish;
            if (step == 1) {
                if (compare_first_step(&sides[0], &sides[1], &agr) != MOERT_OK ||
                    (aa && compare_first_step(&sides[0], &sides[2], &aa_agr) != MOERT_OK)) {
                    fprintf(stderr, PROG ": comparing the first step: %s\n", moert_last_error());
                    goto exit;
                }
            }
            if (!quiet && (step % log_every == 0 || step == 1 || step == total || step == warmup))
                print_progress(sides, nsides, step, warmup, total);
        }
    } else {
        for (int s = 0; s < nsides; s++) {
            if (s > 0) {
                moert_runtime_destroy(sides[s - 1].rt);
                sides[s - 1].rt = NULL;
                if ((failed_rc = create_side(&sides[s], sequential)) != MOERT_OK) {
                    status = moert_cli_failure_status(failed_rc);
                    goto exit;
                }
                if (check_same_device(&sides[0], &sides[s]) != 0) {
                    status = 2;
                    goto exit;
                }
            }
            for (int64_t step = 1; step <= total; step++) {
                if ((failed_rc = step_side(&sides[s], step, failure, sizeof failure)) != MOERT_OK) goto finish;
                if (!quiet && (step % log_every == 0 || step == 1 || step == total || step == warmup))
                    print_side_progress(&sides[s], step, warmup, total);
            }
        }
    }
finish:;
    /* after a failed step: the figures of the steps each side completed, and the losses of those both completed */
    const bool failed = failure[0] != '\0';
    int64_t both_done = sides[0].done < sides[1].done ? sides[0].done : sides[1].done;
    if (failed) header_add(&header, "INCOMPLETE: %s", failure);
    choose_rtol(&sides[0], &sides[1], rtol, &agr);
    finish_agreement(&sides[0], &sides[1], &agr);
    if (aa) {
        choose_rtol(&sides[0], &sides[2], rtol, &aa_agr);
        finish_agreement(&sides[0], &sides[2], &aa_agr);
    }

    values = malloc(sizeof(double) * (size_t)steps);
    if (!values) goto exit;
    for (int s = 0; s < nsides; s++) {
        int64_t measured = sides[s].done > warmup ? sides[s].done - warmup : 0;
        for (int f = 0; f < FIGURE_COUNT; f++) {
            for (int64_t i = 0; i < measured; i++) values[i] = figure_ms(&sides[s].records[warmup + i], f);
            sides[s].figures[f] = spread_of(values, measured);
        }
    }
    if (ratio_intervals(&sides[0], &sides[1], warmup, BOOTSTRAP_SEED, intervals) != MOERT_OK ||
        (aa &&
         ratio_intervals(&sides[0], &sides[2], warmup, BOOTSTRAP_SEED + AA_SEED_OFFSET, aa_intervals) != MOERT_OK)) {
        fprintf(stderr, PROG ": %s\n", moert_last_error());
        goto exit;
    }
    table_row rows[FIGURE_COUNT + MEMORY_ROWS];
    int nrows = build_table(&sides[0], &sides[1], rows);
    char verdict[1024], aa_verdict[1024] = "", summary[1536], timing[1024];
    format_agreement(&agr, "outputs agree", both_done, verdict, sizeof verdict);
    if (aa)
        format_agreement(&aa_agr, "A' (a second copy of A) agrees with A",
                         sides[0].done < sides[2].done ? sides[0].done : sides[2].done, aa_verdict, sizeof aa_verdict);
    format_summary(&sides[0], &sides[1], aa ? &sides[2] : NULL, &agr, summary, sizeof summary);
    if (failed)
        snprintf(verdict, sizeof verdict,
                 "INCOMPLETE: %s. The figures cover the steps each side completed (A %lld, B "
                 "%lld of %lld).",
                 failure, (long long)sides[0].done, (long long)sides[1].done, (long long)total);
    const char *order = sequential ? "sequential" : aa ? "A B A' rotating" : "ABBA";
    char step_text[300], layer_text[300];
    timing_text(FIGURE_STEP, aa, step_text, sizeof step_text);
    timing_text(FIGURE_LAYER, aa, layer_text, sizeof layer_text);
    snprintf(timing, sizeof timing,
             "timing (B/A, %s order, bootstrap over %lld paired steps%s): step %s; layer fwd+bwd %s", order,
             (long long)intervals[FIGURE_STEP].pairs, aa ? "; in brackets A'/A, the noise floor" : "", step_text,
             layer_text);
    printf("\n");
    print_table(stdout, rows, nrows);
    printf("\n%s\n", verdict);
    if (aa) printf("%s\n", aa_verdict);
    printf("%s\n%s\n", summary, timing);

    if (report_path) {
        report_parts rp = {.h = &header,
                           .agr = &agr,
                           .aa_agr = aa ? &aa_agr : NULL,
                           .aprime = aa ? &sides[2] : NULL,
                           .warmup = warmup,
                           .steps = steps,
                           .verdict = verdict,
                           .aa_verdict = aa_verdict,
                           .summary = summary,
                           .timing = timing,
                           .order = order,
                           .failure = failed ? failure : NULL,
                           .rows = rows,
                           .nrows = nrows};
        if (write_report(report_path, &sides[0], &sides[1], &rp) != MOERT_OK) goto exit;
        if (!quiet) printf("%sreport written to %s and %s\n", failed ? "incomplete " : "", report_path, md);
    }
    if (plot_path && both_done > 0) {
        total = both_done;
        for (int s = 2; s < nsides; s++) total = sides[s].done < total ? sides[s].done : total;
        series = malloc(sizeof(double) * 2 * (size_t)nsides * (size_t)(total + 1));
        if (!series) goto exit;
        moert_ab_plot_data plot = {.n = total,
                                   .warmup = warmup < total ? warmup : total,
                                   .nsides = nsides,
                                   .step_ratio = &intervals[FIGURE_STEP],
                                   .step_noise = aa ? &aa_intervals[FIGURE_STEP] : NULL};
        for (int s = 0; s < nsides; s++) {
            double *ms = series + (2 * s) * total, *loss = series + (2 * s + 1) * total;
            for (int64_t i = 0; i < total; i++) {
                ms[i] = sides[s].records[i].seconds * 1e3;
                loss[i] = sides[s].records[i].loss;
            }
            plot.step_ms[s] = ms;
            plot.loss[s] = loss;
            plot.label[s] = sides[s].conf.name;
        }
        const char *header_lines[sizeof header.lines / sizeof header.lines[0]];
        for (int i = 0; i < header.count; i++) header_lines[i] = header.lines[i];
        plot.header = header_lines, plot.header_count = header.count; /* the title, and what B changes */
        char err[1024];
        if (moert_ab_plot_png(plot_path, &plot, err, sizeof err) != 0) {
            fprintf(stderr, PROG ": %s\n", err);
            goto exit;
        }
        if (!quiet) printf("plot written to %s\n", plot_path);
    }
    status = failed ? moert_cli_failure_status(failed_rc) : 0;
exit:
    free(values);
    free(series);
    for (int s = 0; s < nsides; s++) {
        moert_runtime_destroy(sides[s].rt);
        free_ab_config(&sides[s].conf);
        moert_config_free(sides[s].cfg);
        free(sides[s].records);
    }
    return status;
}
