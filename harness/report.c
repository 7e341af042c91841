/* SPDX-License-Identifier: Apache-2.0 */
/* The run report: every figure of the last run as JSON. */
#include "report.h"

#include <stdlib.h>

#include "harness.h"
#include "output.h"

static json_t *plugin_json(const moert_run_plugin *p)
{
    return json_pack("{s:s, s:s, s:s, s:s}", "kind", p->kind, "name", p->name, "version", p->version, "path", p->path);
}

/* One step's figures as a JSON object (`moert ab` writes them too). */
json_t *moert_report_step_json(const moert_step_record *r)
{
    json_t *stages = json_object();
    for (int s = 0; s < MOERT_LAYER_STAGES; s++)
        json_object_set_new(stages, moert_layer_stage_name(s), json_real(r->stage_seconds[s] * 1e3));
    json_t *parts = json_object();
    for (int p = 0; p < MOERT_LAYER_BACKWARD_PARTS; p++)
        json_object_set_new(parts, moert_layer_backward_part_name(p), json_real(r->backward_part_seconds[p] * 1e3));
    return json_pack("{s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:o, s:o}", "step", (json_int_t)r->step, "loss", r->loss,
                     "mse", r->mse, "router_loss", r->router_loss, "load_max_over_mean", r->imbalance,
                     "load_max_over_mean_worst_layer", r->imbalance_max, "step_ms", r->seconds * 1e3, "stage_ms_rank0",
                     stages, "backward_parts_ms_rank0", parts);
}

/* Median over the run of one stage's time (the step's when stage < 0, backward part stage - MOERT_STAGE_COUNT's past
 * the stages), in ms. */
static double median_ms(const moert_run_summary *rt, int stage)
{
    int64_t n = rt->record_count;
    if (n == 0) return 0.0;
    double *v = malloc(sizeof(double) * (size_t)n);
    if (!v) return 0.0;
    for (int64_t i = 0; i < n; i++)
        v[i] = stage < 0                    ? rt->records[i].seconds
               : stage < MOERT_LAYER_STAGES ? rt->records[i].stage_seconds[stage]
                                            : rt->records[i].backward_part_seconds[stage - MOERT_LAYER_STAGES];
    for (int64_t i = 1; i < n; i++) /* insertion sort: n is a few hundred */
        for (int64_t j = i; j > 0 && v[j - 1] > v[j]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    double m = (n % 2) ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    free(v);
    return m * 1e3;
}

/* json_dumpf for moert_output_write. */
static int dump_json(FILE *f, void *root) { return json_dumpf(root, f, JSON_INDENT(1) | JSON_REAL_PRECISION(8)); }

/* The config's values the report shows (moert_config_get_*: the values the run used, defaults filled in). */
typedef struct report_config {
    char name[256], dtype[16], cuda_graph[16];
    int64_t hidden, ffn_hidden, num_experts, topk, num_layers, tokens_per_rank, micro_batches;
} report_config;

static moert_result read_report_config(const moert_config *cfg, report_config *c)
{
    moert_result rc = MOERT_OK;
    HARNESS_CHECK(moert_config_get_string(cfg, "name", c->name, sizeof c->name));
    HARNESS_CHECK(moert_config_get_string(cfg, "model.dtype", c->dtype, sizeof c->dtype));
    HARNESS_CHECK(moert_config_get_string(cfg, "parallel.cuda_graph", c->cuda_graph, sizeof c->cuda_graph));
    HARNESS_CHECK(moert_config_get_int(cfg, "model.hidden", &c->hidden));
    HARNESS_CHECK(moert_config_get_int(cfg, "model.ffn_hidden", &c->ffn_hidden));
    HARNESS_CHECK(moert_config_get_int(cfg, "model.num_experts", &c->num_experts));
    HARNESS_CHECK(moert_config_get_int(cfg, "model.topk", &c->topk));
    HARNESS_CHECK(moert_config_get_int(cfg, "model.num_layers", &c->num_layers));
    HARNESS_CHECK(moert_config_get_int(cfg, "train.tokens_per_rank", &c->tokens_per_rank));
    HARNESS_CHECK(moert_config_get_int(cfg, "train.micro_batches", &c->micro_batches));
fail:
    return rc;
}

moert_result moert_runtime_write_report(const moert_runtime *runtime, const char *path)
{
    moert_run_summary summary;
    moert_runtime_summary(runtime, &summary);
    const moert_run_summary *rt = &summary;
    const moert_config *config = rt->cfg;
    /* never onto the config the run read (the CLI checks this before the run; here for library callers) */
    const char *inputs[1] = {moert_config_source(config)};
    moert_result checked = moert_output_check("the report", path, inputs, 1);
    if (checked != MOERT_OK) return checked;
    report_config cfg_values, *cfg = &cfg_values;
    checked = read_report_config(config, cfg);
    if (checked != MOERT_OK) return checked;
    int nl = (int)cfg->num_layers;
    int64_t e = cfg->num_experts;
    json_t *root = json_object(), *plugins = json_array(), *steps = json_array(), *medians = json_object();
    json_t *layers = json_array(), *memory = json_object();
    for (int s = 0; s < 4; s++) json_array_append_new(plugins, plugin_json(&rt->plugins[s]));
    for (int64_t i = 0; i < rt->record_count; i++)
        json_array_append_new(steps, moert_report_step_json(&rt->records[i]));
    json_object_set_new(medians, "step", json_real(median_ms(rt, -1)));
    for (int s = 0; s < MOERT_LAYER_STAGES; s++)
        json_object_set_new(medians, moert_layer_stage_name(s), json_real(median_ms(rt, s)));
    json_t *part_medians = json_object();
    for (int p = 0; p < MOERT_LAYER_BACKWARD_PARTS; p++)
        json_object_set_new(part_medians, moert_layer_backward_part_name(p),
                            json_real(median_ms(rt, MOERT_LAYER_STAGES + p)));
    for (int l = 0; l < nl && rt->final_counts; l++) {
        json_t *counts = json_array(), *layer = json_object();
        for (int64_t i = 0; i < e; i++) json_array_append_new(counts, json_integer(rt->final_counts[l * e + i]));
        json_object_set_new(layer, "tokens_per_expert", counts);
        if (rt->final_bias) {
            json_t *bias = json_array(), *bias0 = json_array();
            for (int64_t i = 0; i < e; i++) {
                json_array_append_new(bias, json_real(rt->final_bias[l * e + i]));
                if (rt->bias_start) json_array_append_new(bias0, json_real(rt->bias_start[l * e + i]));
            }
            json_object_set_new(layer, "expert_bias", bias);
            json_object_set_new(layer, "expert_bias_start", bias0);
        }
        json_array_append_new(layers, layer);
    }
    for (int a = 0; a < MOERT_LAYER_ACTIVATIONS; a++)
        json_object_set_new(memory, moert_layer_activation_name(a), json_integer(rt->activation_bytes[a]));
    json_object_set_new(memory, "kept_from_forward_to_backward", json_integer(rt->kept_bytes));

    json_object_set_new(root, "moert_version", json_string(MOERT_VERSION_STRING));
    json_object_set_new(root, "config", json_string(moert_config_source(config)));
    json_object_set_new(root, "name", json_string(cfg->name));
    json_object_set_new(root, "device", json_string(rt->device_name));
    json_object_set_new(root, "ranks", json_integer(rt->world));
    char graph_line[512];
    moert_runtime_graph_summary(runtime, graph_line, sizeof graph_line);
    json_object_set_new(root, "cuda_graph",
                        json_pack("{s:s, s:b, s:I, s:I, s:f, s:s}", "mode", cfg->cuda_graph, "used",
                                  rt->graph_captured_step > 0, "captured_step", (json_int_t)rt->graph_captured_step,
                                  "replays", (json_int_t)rt->graph_replays, "capture_ms",
                                  1e3 * rt->graph_capture_seconds, "summary", graph_line));
    json_object_set_new(root, "model",
                        json_pack("{s:I, s:I, s:I, s:I, s:I, s:s}", "hidden", (json_int_t)cfg->hidden, "ffn_hidden",
                                  (json_int_t)cfg->ffn_hidden, "num_experts", (json_int_t)cfg->num_experts, "topk",
                                  (json_int_t)cfg->topk, "num_layers", (json_int_t)cfg->num_layers, "dtype",
                                  cfg->dtype));
    json_object_set_new(root, "tokens_per_rank", json_integer(cfg->tokens_per_rank));
    json_object_set_new(root, "micro_batches", json_integer(cfg->micro_batches));
    json_object_set_new(root, "plugins", plugins);
    json_object_set_new(root, "total_seconds", json_real(rt->total_seconds));
    json_object_set_new(root, "median_ms", medians);
    json_object_set_new(root, "median_backward_parts_ms", part_medians);
    json_object_set_new(root, "activation_bytes_rank0", memory);
    json_object_set_new(root, "device_pool_peak_bytes_rank0", json_integer(rt->device_peak_bytes)); /* 0 on the CPU */
    json_object_set_new(root, "layers", layers);
    json_object_set_new(root, "steps", steps);
    moert_result rc = moert_output_write(path, dump_json, root);
    json_decref(root);
    return rc;
}
