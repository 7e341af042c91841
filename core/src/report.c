/* SPDX-License-Identifier: Apache-2.0 */
/* The run report: every figure of the last run as JSON. */
#include <jansson.h>

#include "error.h"
#include "output.h"
#include "runtime.h"

static json_t *plugin_json(const moert_plugin *p)
{
    return json_pack("{s:s, s:s, s:s, s:s}", "kind", moert_kind_name(p->kind), "name", p->header->name, "version",
                     p->header->version ? p->header->version : "", "path", p->path);
}

/* One step's figures as a JSON object (declared in runtime.h: `moert ab` writes them too). */
json_t *moert_report_step_json(const moert_step_record *r)
{
    json_t *stages = json_object();
    for (int s = 0; s < MOERT_STAGE_COUNT; s++)
        json_object_set_new(stages, moert_stage_name((moert_stage)s), json_real(r->stage_seconds[s] * 1e3));
    json_t *parts = json_object();
    for (int p = 0; p < MOERT_BWD_PART_COUNT; p++)
        json_object_set_new(parts, moert_backward_part_name((moert_backward_part)p),
                            json_real(r->backward_part_seconds[p] * 1e3));
    return json_pack("{s:I, s:f, s:f, s:f, s:f, s:f, s:f, s:o, s:o}", "step", (json_int_t)r->step, "loss", r->loss,
                     "mse", r->mse, "router_loss", r->router_loss, "load_max_over_mean", r->imbalance,
                     "load_max_over_mean_worst_layer", r->imbalance_max, "step_ms", r->seconds * 1e3,
                     "stage_ms_rank0", stages, "backward_parts_ms_rank0", parts);
}

/* Median over the run of one stage's time (the step's when stage < 0, backward part stage - MOERT_STAGE_COUNT's past
 * the stages), in ms. */
static double median_ms(const moert_runtime *rt, int stage)
{
    int64_t n = rt->record_count;
    if (n == 0) return 0.0;
    double *v = malloc(sizeof(double) * (size_t)n);
    if (!v) return 0.0;
    for (int64_t i = 0; i < n; i++)
        v[i] = stage < 0                    ? rt->records[i].seconds
               : stage < MOERT_STAGE_COUNT ? rt->records[i].stage_seconds[stage]
                                           : rt->records[i].backward_part_seconds[stage - MOERT_STAGE_COUNT];
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

moert_result moert_runtime_write_report(const moert_runtime *rt, const char *path)
{
    const moert_config *cfg = rt->cfg;
    /* never onto the config the run read (the CLI checks this before the run; here for library callers) */
    const char *inputs[1] = {cfg->source};
    moert_result checked = moert_output_check("the report", path, inputs, 1);
    if (checked != MOERT_OK) return checked;
    int nl = (int)cfg->model.num_layers;
    int64_t e = cfg->model.num_experts;
    json_t *root = json_object(), *plugins = json_array(), *steps = json_array(), *medians = json_object();
    json_t *layers = json_array(), *memory = json_object();
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) json_array_append_new(plugins, plugin_json(&rt->plugins[s]));
    for (int64_t i = 0; i < rt->record_count; i++) json_array_append_new(steps, moert_report_step_json(&rt->records[i]));
    json_object_set_new(medians, "step", json_real(median_ms(rt, -1)));
    for (int s = 0; s < MOERT_STAGE_COUNT; s++)
        json_object_set_new(medians, moert_stage_name((moert_stage)s), json_real(median_ms(rt, s)));
    json_t *part_medians = json_object();
    for (int p = 0; p < MOERT_BWD_PART_COUNT; p++)
        json_object_set_new(part_medians, moert_backward_part_name((moert_backward_part)p),
                            json_real(median_ms(rt, MOERT_STAGE_COUNT + p)));
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
    for (int a = 0; a < MOERT_ACT_COUNT; a++)
        json_object_set_new(memory, moert_activation_name((moert_activation)a), json_integer(rt->activation_bytes[a]));
    json_object_set_new(memory, "kept_from_forward_to_backward", json_integer(rt->kept_bytes));

    json_object_set_new(root, "moert_version", json_string(MOERT_VERSION_STRING));
    json_object_set_new(root, "config", json_string(cfg->source));
    json_object_set_new(root, "name", json_string(cfg->name));
    json_object_set_new(root, "device", json_string(rt->device_name));
    json_object_set_new(root, "ranks", json_integer(rt->world));
    char graph_line[512];
    moert_runtime_graph_summary(rt, graph_line, sizeof graph_line);
    json_object_set_new(root, "cuda_graph",
                        json_pack("{s:s, s:b, s:I, s:I, s:f, s:s}", "mode", moert_cuda_graph_mode_name(cfg->parallel.cuda_graph), "used",
                                  rt->graph_captured_step > 0, "captured_step", (json_int_t)rt->graph_captured_step,
                                  "replays", (json_int_t)rt->graph_replays, "capture_ms",
                                  1e3 * rt->graph_capture_seconds, "summary", graph_line));
    json_object_set_new(root, "model", json_pack("{s:I, s:I, s:I, s:I, s:I, s:s}", "hidden", (json_int_t)cfg->model.hidden,
                                                 "ffn_hidden", (json_int_t)cfg->model.ffn_hidden, "num_experts",
                                                 (json_int_t)cfg->model.num_experts, "topk", (json_int_t)cfg->model.topk,
                                                 "num_layers", (json_int_t)cfg->model.num_layers, "dtype",
                                                 moert_dtype_name(cfg->model.dtype)));
    json_object_set_new(root, "tokens_per_rank", json_integer(cfg->train.tokens_per_rank));
    json_object_set_new(root, "micro_batches", json_integer(cfg->train.micro_batches));
    json_object_set_new(root, "plugins", plugins);
    json_object_set_new(root, "total_seconds", json_real(rt->total_seconds));
    json_object_set_new(root, "median_ms", medians);
    json_object_set_new(root, "median_backward_parts_ms", part_medians);
    json_object_set_new(root, "activation_bytes_rank0", memory);
    json_object_set_new(root, "layers", layers);
    json_object_set_new(root, "steps", steps);
    moert_result rc = moert_output_write(path, dump_json, root);
    json_decref(root);
    return rc;
}
