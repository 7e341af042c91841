/* SPDX-License-Identifier: Apache-2.0 */
#include "gpu_dispatch_test_harness.h"

#include "error.h"

pthread_mutex_t gpu_dispatch_table_lock = PTHREAD_MUTEX_INITIALIZER;

void gpu_dispatch_read_host_cpu_layout(const moert_dispatch_layout *layout, int64_t local_experts, gpu_dispatch_step *d)
{
    d->nrecv = layout->capacity;
    d->num_recv = layout->num_recv;
    for (int64_t l = 0; l < local_experts; l++) d->tokens_per_expert[l] = layout->tokens_per_expert_host[l];
}

void gpu_dispatch_read_host_cuda_layout(const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                                        const moert_dispatch_layout *layout, const int64_t *device_counts,
                                        gpu_dispatch_step *o)
{
    const int64_t El = cs->experts / env->world;
    if (layout->num_recv != o->num_recv || layout->tokens_per_expert.device.type != MOERT_DEVICE_CUDA ||
        layout->tokens_per_expert.device.id != env->rank || !layout->tokens_per_expert_host) {
        gpu_test_failure("%s %s: CUDA layout: num_recv %lld (CPU %lld), counts on device type %d id %d, host counts %s",
                         env->where, cs->name, (long long)layout->num_recv, (long long)o->num_recv,
                         (int)layout->tokens_per_expert.device.type, (int)layout->tokens_per_expert.device.id,
                         layout->tokens_per_expert_host ? "given" : "NULL");
        for (int64_t l = 0; l < El; l++) o->tokens_per_expert[l] = -1; /* shows as layout diffs */
        return;
    }
    /* the host copy must equal the device's counts (a difference shows in the comparison with the CPU's) */
    for (int64_t l = 0; l < El; l++)
        o->tokens_per_expert[l] =
            layout->tokens_per_expert_host[l] + 1000 * (device_counts[l] != layout->tokens_per_expert_host[l]);
}

/* The figures of the CUDA instance a plugin names (gpu_dispatch_plugin.figures): the last value of each. */
typedef struct figure_sink {
    const gpu_dispatch_plugin *plugin;
    double value[2];
} figure_sink;

static void figure_metric(void *user, const char *name, double value, const char *unit)
{
    figure_sink *f = user;
    (void)unit;
    for (int i = 0; i < 2; i++)
        if (f->plugin->figures[i] && strcmp(name, f->plugin->figures[i]) == 0) f->value[i] = value;
}

void gpu_dispatch_make_routing(const gpu_dispatch_case *cs, int world, int64_t tokens, uint64_t *rng, int32_t *idx)
{
    const int64_t E = cs->experts, K = cs->topk, El = E / world;
    const int64_t allowed = cs->starve_last && world > 1 ? E - El : E;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t k = 0; k < K; k++) {
            int32_t e = -1;
            if ((test_uniform(rng) + 1) / 2 >= cs->drop && !(cs->drop_whole && t % 4 == 1)) {
                for (int attempt = 0; attempt < 64 && e < 0; attempt++) {
                    int32_t pick = (test_uniform(rng) + 1) / 2 < cs->hot
                                       ? 0
                                       : (int32_t)((test_uniform(rng) + 1) / 2 * (double)allowed) % (int32_t)allowed;
                    bool used = false;
                    for (int64_t j = 0; j < k; j++) used = used || idx[t * K + j] == pick;
                    if (!used) e = pick;
                }
            }
            idx[t * K + k] = e;
        }
}

void gpu_dispatch_outputs_alloc(gpu_dispatch_step *o, const gpu_dispatch_step *d)
{
    const size_t rowb = (size_t)d->H * d->es;
    o->recv_x = gpu_test_host_alloc((size_t)(d->cap + 2) * rowb);
    o->recv_probs = gpu_test_host_alloc((size_t)d->cap * sizeof(float));
    o->y = gpu_test_host_alloc((size_t)d->T * rowb);
    o->d_y_expert = gpu_test_host_alloc((size_t)d->cap * rowb);
    o->d_x = gpu_test_host_alloc((size_t)d->T * rowb);
    o->d_topk_probs = gpu_test_host_alloc((size_t)(d->T * d->K) * sizeof(float));
}

void gpu_dispatch_outputs_free(gpu_dispatch_step *o)
{
    void *p[] = {o->recv_x, o->recv_probs, o->y, o->d_y_expert, o->d_x, o->d_topk_probs};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) free(p[i]);
}

bool gpu_dispatch_run_calls(test_instance *ti, moert_stream stream, moert_device dev, moert_dtype dt,
                            const gpu_dispatch_step *d, void *x, void *probs, void *recv_x, void *recv_probs,
                            void *y_expert, void *y, void *d_y, void *d_y_expert, void *d_recv_x, void *d_recv_probs,
                            void *d_x, void *d_topk_probs, const char *where)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap;
    moert_tensor xt = moert_tensor_2d(x, dev, dt, T, H), pt = moert_tensor_2d(probs, dev, MOERT_F32, T, K);
    moert_tensor rx = moert_tensor_2d(recv_x, dev, dt, cap + 2, H);
    moert_tensor rp = moert_tensor_1d(recv_probs, dev, MOERT_F32, cap);
    moert_dispatch_args da = {.struct_size = sizeof da, .x = &xt, .topk_probs = &pt, .recv_x = &rx, .recv_probs = &rp};
    moert_tensor ye = moert_tensor_2d(y_expert, dev, dt, cap, H), yt = moert_tensor_2d(y, dev, dt, T, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &ye, .y = &yt};
    moert_tensor dy = moert_tensor_2d(d_y, dev, dt, T, H), dye = moert_tensor_2d(d_y_expert, dev, dt, cap, H);
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = &dy, .d_y_expert = &dye};
    moert_tensor drx = moert_tensor_2d(d_recv_x, dev, dt, cap, H);
    moert_tensor drp = moert_tensor_1d(d_recv_probs, dev, MOERT_F32, cap);
    moert_tensor dx = moert_tensor_2d(d_x, dev, dt, T, H), dtp = moert_tensor_2d(d_topk_probs, dev, MOERT_F32, T, K);
    moert_dispatch_backward_args db = {
        .struct_size = sizeof db, .d_recv_x = &drx, .d_recv_probs = &drp, .d_x = &dx, .d_topk_probs = &dtp};
    return CALL(ti, vt->dispatch(ti->ctx, stream, &da), where) && CALL(ti, vt->combine(ti->ctx, stream, &ca), where) &&
           CALL(ti, vt->combine_backward(ti->ctx, stream, &cb), where) &&
           CALL(ti, vt->dispatch_backward(ti->ctx, stream, &db), where);
}

bool gpu_dispatch_cuda_step(const gpu_dispatch_plugin *plugin, const gpu_test_rank_env *env, test_instance *ti,
                            const gpu_dispatch_case *cs, const gpu_dispatch_step *d, void *const *in,
                            gpu_dispatch_step *o)
{
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)ti->plugin.header;
    const moert_device gpu = gpu_test_rank_device(env);
    const cudaStream_t s = env->stream;
    const int64_t T = d->T, H = d->H, K = d->K, cap = d->cap, El = cs->experts / env->world;
    const size_t row = (size_t)H * d->es;
    moert_tensor idx = moert_tensor_2d(in[0], gpu, MOERT_I32, T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    if (!CALL(ti, vt->prepare(ti->ctx, (moert_stream)s, &idx, &layout), env->where)) return false;
    int64_t dev_counts[256] = {0};
    gpu_test_download(s, dev_counts, layout.tokens_per_expert.data, (size_t)El * sizeof(int64_t));
    o->cap = layout.capacity;
    plugin->read_cuda_layout(env, cs, &layout, dev_counts, o);
    if (layout.capacity != cap) {
        gpu_test_failure("%s %s: CUDA capacity %lld, CPU %lld", env->where, cs->name, (long long)layout.capacity,
                         (long long)cap);
        return false;
    }
    void *recv_x = gpu_test_device_poisoned(s, (size_t)(cap + 2) * row);
    void *recv_probs = gpu_test_device_poisoned(s, (size_t)cap * 4);
    void *y = gpu_test_device_poisoned(s, (size_t)T * row);
    void *d_y_expert = gpu_test_device_poisoned(s, (size_t)cap * row);
    void *d_x = gpu_test_device_copy(s, d->d_x0, (size_t)T * row);
    void *d_topk_probs = gpu_test_device_poisoned(s, (size_t)(T * K) * 4);
    bool ok = gpu_dispatch_run_calls(ti, (moert_stream)s, gpu, cs->dtype, d, in[1], in[2], recv_x, recv_probs, in[3], y,
                                     in[4], d_y_expert, in[5], in[6], d_x, d_topk_probs, env->where);
    if (ok) {
        gpu_test_download(s, o->recv_x, recv_x, (size_t)(cap + 2) * row);
        gpu_test_download(s, o->recv_probs, recv_probs, (size_t)cap * 4);
        gpu_test_download(s, o->y, y, (size_t)T * row);
        gpu_test_download(s, o->d_y_expert, d_y_expert, (size_t)cap * row);
        gpu_test_download(s, o->d_x, d_x, (size_t)T * row);
        gpu_test_download(s, o->d_topk_probs, d_topk_probs, (size_t)(T * K) * 4);
    }
    CK(cudaStreamSynchronize(s));
    void *bufs[] = {recv_x, recv_probs, y, d_y_expert, d_x, d_topk_probs};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) CK(cudaFree(bufs[i]));
    return ok;
}

void gpu_dispatch_compare(const gpu_test_rank_env *env, const gpu_dispatch_case *cs, const gpu_dispatch_step *d,
                          const gpu_dispatch_step *g, gpu_dispatch_row *row)
{
    const int64_t El = cs->experts / env->world;
    const size_t rowb = (size_t)d->H * d->es;
    int64_t layout_diffs = 0;
    for (int64_t l = 0; l < El; l++) layout_diffs += g->tokens_per_expert[l] != d->tokens_per_expert[l];
    /* the rows that hold data bit for bit, and the rows past them (up to capacity and 2 more) untouched */
    int64_t disp =
        gpu_test_bytes_differ(g->recv_x, d->recv_x, (size_t)d->nrecv * rowb) +
        gpu_test_bytes_differ(g->recv_probs, d->recv_probs, (size_t)d->nrecv * 4) +
        !gpu_test_all_poison((const char *)g->recv_x + (size_t)d->nrecv * rowb, (size_t)(d->cap - d->nrecv + 2) * rowb);
    int64_t comb_bytes = gpu_test_bytes_differ(g->y, d->y, (size_t)d->T * rowb);
    double comb_err = gpu_test_rel_error(g->y, d->y, cs->dtype, d->T * d->H);
    int64_t cb = gpu_test_bytes_differ(g->d_y_expert, d->d_y_expert, (size_t)d->nrecv * rowb);
    int64_t dx_bytes = gpu_test_bytes_differ(g->d_x, d->d_x, (size_t)d->T * rowb);
    double dx_err = gpu_test_rel_error(g->d_x, d->d_x, cs->dtype, d->T * d->H);
    int64_t dp = gpu_test_bytes_differ(g->d_topk_probs, d->d_topk_probs, (size_t)(d->T * d->K) * 4);
    pthread_mutex_lock(&gpu_dispatch_table_lock);
    row->layout_diffs += layout_diffs;
    row->dispatch_diffs += disp;
    row->combine_bytes += comb_bytes;
    if (!(comb_err <= row->combine_err)) row->combine_err = comb_err;
    row->cb_diffs += cb;
    row->dx_bytes += dx_bytes;
    if (!(dx_err <= row->dx_err)) row->dx_err = dx_err;
    row->dprobs_diffs += dp;
    pthread_mutex_unlock(&gpu_dispatch_table_lock);
    if (layout_diffs || disp || cb || dp || !(comb_err <= row->tol) || !(dx_err <= row->tol))
        gpu_test_failure("%s %s: layout %lld, dispatch %lld bytes differ, combine error %.3g, combine_backward %lld, "
                         "d_x error %.3g, d_topk_probs %lld (tolerance %.3g)",
                         env->where, cs->name, (long long)layout_diffs, (long long)disp, comb_err, (long long)cb,
                         dx_err, (long long)dp, row->tol);
}

void gpu_dispatch_run_case(const gpu_dispatch_plugin *plugin, const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                           int ci, gpu_dispatch_row *row)
{
    const int W = env->world, rank = env->rank;
    gpu_dispatch_step d;
    memset(&d, 0, sizeof d);
    d.T = cs->empty_first && rank == 0 ? 0 : cs->tokens + 5 * rank;
    d.H = cs->hidden;
    d.K = cs->topk;
    d.es = moert_dtype_size(cs->dtype);
    moert_layer_info layer =
        test_layer(d.H, 8, cs->experts, d.K, cs->tokens + 5 * plugin->max_world, W, rank, cs->dtype);
    moert_layer_info gpu_layer = layer;
    gpu_layer.device = gpu_test_rank_device(env);
    char where[128];
    snprintf(where, sizeof where, "%s %s", env->where, cs->name);
    char options[160]; /* the case's options with timeout_ms */
    if (plugin->no_timeout_option)
        snprintf(options, sizeof options, "%s", cs->options);
    else
        snprintf(options, sizeof options, "{\"timeout_ms\": " GPU_DISPATCH_CASE_TIMEOUT "%s%s",
                 strlen(cs->options) > 2 ? ", " : "", cs->options + 1);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\" %s: open", W, cs->name, options);

    test_instance cpu, gpu;
    figure_sink figures = {.plugin = plugin};
    moert_result rc =
        test_instance_open(&cpu, MOERT_KIND_DISPATCHER, plugin->name, options, &layer, env->comm, rank, W);
    if (rc != MOERT_OK) gpu_test_failure("%s: CPU dispatcher: %s", where, moert_error_message());
    moert_result rc2 =
        test_instance_open_metrics(&gpu, MOERT_KIND_DISPATCHER, plugin->name, options, &gpu_layer, env->comm, rank, W,
                                   env->pool, env->nccl, (moert_stream)env->stream, figure_metric, &figures);
    if (rc2 != MOERT_OK) gpu_test_failure("%s: CUDA dispatcher: %s", where, moert_error_message());
    if (rc != MOERT_OK || rc2 != MOERT_OK) {
        test_instance_close(&cpu);
        test_instance_close(&gpu);
        return;
    }
    const moert_dispatcher_v1 *vt = (const moert_dispatcher_v1 *)cpu.plugin.header;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(ci + 1) + 1000003ull * (uint64_t)(rank + 1);
    d.idx = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(int32_t));
    gpu_dispatch_make_routing(cs, W, d.T, &rng, d.idx);
    const size_t rowb = (size_t)d.H * d.es;
    d.x = gpu_test_host_alloc((size_t)d.T * rowb);
    d.d_y = gpu_test_host_alloc((size_t)d.T * rowb);
    d.d_x0 = gpu_test_host_alloc((size_t)d.T * rowb);
    d.probs = gpu_test_host_alloc((size_t)(d.T * d.K) * sizeof(float));
    gpu_test_fill_random(d.x, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_y, cs->dtype, d.T * d.H, &rng, 1.0);
    gpu_test_fill_random(d.d_x0, cs->dtype, d.T * d.H, &rng, 1.0);
    for (int64_t i = 0; i < d.T * d.K; i++) d.probs[i] = (float)((test_uniform(&rng) + 1) / 2);

    /* the CPU reference */
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": CPU reference", W, cs->name);
    moert_tensor idx = moert_tensor_2d(d.idx, moert_cpu(), MOERT_I32, d.T, d.K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};
    bool ok = CALL(&cpu, vt->prepare(cpu.ctx, NULL, &idx, &layout), where);
    if (ok) {
        d.cap = layout.capacity;
        plugin->read_cpu_layout(&layout, cs->experts / W, &d);
        d.y_expert = gpu_test_host_alloc((size_t)d.cap * rowb);
        d.d_recv_x = gpu_test_host_alloc((size_t)d.cap * rowb);
        d.d_recv_probs = gpu_test_host_alloc((size_t)d.cap * sizeof(float));
        gpu_test_fill_random(d.y_expert, cs->dtype, d.cap * d.H, &rng, 1.0);
        gpu_test_fill_random(d.d_recv_x, cs->dtype, d.cap * d.H, &rng, 1.0);
        gpu_test_fill_random(d.d_recv_probs, MOERT_F32, d.cap, &rng, 1.0);
        gpu_dispatch_outputs_alloc(&d, &d);
        memset(d.recv_x, 0xFF, (size_t)(d.cap + 2) * rowb);
        memcpy(d.d_x, d.d_x0, (size_t)d.T * rowb);
        ok = gpu_dispatch_run_calls(&cpu, NULL, moert_cpu(), cs->dtype, &d, d.x, d.probs, d.recv_x, d.recv_probs,
                                    d.y_expert, d.y, d.d_y, d.d_y_expert, d.d_recv_x, d.d_recv_probs, d.d_x,
                                    d.d_topk_probs, where);
    }
    if (!ok) gpu_test_failure("%s: the CPU reference failed; the CUDA steps still run so no peer waits", where);
    if (!d.y_expert) { /* keep the collective sequence: the CUDA steps need capacity-sized inputs */
        d.y_expert = gpu_test_host_alloc(64);
        d.d_recv_x = gpu_test_host_alloc(64);
        d.d_recv_probs = gpu_test_host_alloc(64);
        gpu_dispatch_outputs_alloc(&d, &d);
    }
    const cudaStream_t s = env->stream;
    void *in[7] = {gpu_test_device_copy(s, d.idx, (size_t)(d.T * d.K) * 4),
                   gpu_test_device_copy(s, d.x, (size_t)d.T * rowb),
                   gpu_test_device_copy(s, d.probs, (size_t)(d.T * d.K) * 4),
                   gpu_test_device_copy(s, d.y_expert, (size_t)d.cap * rowb),
                   gpu_test_device_copy(s, d.d_y, (size_t)d.T * rowb),
                   gpu_test_device_copy(s, d.d_recv_x, (size_t)d.cap * rowb),
                   gpu_test_device_copy(s, d.d_recv_probs, (size_t)d.cap * 4)};
    gpu_dispatch_step g1 = d, g2 = d;
    gpu_dispatch_outputs_alloc(&g1, &d);
    gpu_dispatch_outputs_alloc(&g2, &d);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": CUDA step 1", W, cs->name);
    bool ok1 = gpu_dispatch_cuda_step(plugin, env, &gpu, cs, &d, in, &g1);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": CUDA step 2", W, cs->name);
    moert_cuda_pool_stats before, after;
    moert_cuda_pool_get_stats(env->pool, &before);
    bool ok2 = ok1 && gpu_dispatch_cuda_step(plugin, env, &gpu, cs, &d, in, &g2);
    moert_cuda_pool_get_stats(env->pool, &after);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": compare", W, cs->name);
    if (ok && ok1) gpu_dispatch_compare(env, cs, &d, &g1, row);
    if (ok && ok2) {
        gpu_dispatch_compare(env, cs, &d, &g2, row);
        int64_t rep = gpu_test_bytes_differ(g1.recv_x, g2.recv_x, (size_t)d.nrecv * rowb) +
                      gpu_test_bytes_differ(g1.y, g2.y, (size_t)d.T * rowb) +
                      gpu_test_bytes_differ(g1.d_x, g2.d_x, (size_t)d.T * rowb) +
                      gpu_test_bytes_differ(g1.d_y_expert, g2.d_y_expert, (size_t)d.nrecv * rowb);
        const int64_t mallocs =
            plugin->count_step2_mallocs ? (int64_t)(after.cuda_malloc_count - before.cuda_malloc_count) : 0;
        pthread_mutex_lock(&gpu_dispatch_table_lock);
        row->repeat_diffs += rep;
        row->recv_rows += d.nrecv;
        row->step2_mallocs += mallocs;
        for (int i = 0; i < 2; i++) row->figures[i] += figures.value[i];
        pthread_mutex_unlock(&gpu_dispatch_table_lock);
        if (rep) gpu_test_failure("%s: the second step differs in %lld bytes", where, (long long)rep);
        if (mallocs) gpu_test_failure("%s: the second step made %lld cudaMalloc calls", where, (long long)mallocs);
    }
    CK(cudaStreamSynchronize(s));
    for (int i = 0; i < 7; i++) CK(cudaFree(in[i]));
    gpu_dispatch_outputs_free(&g1);
    gpu_dispatch_outputs_free(&g2);
    gpu_dispatch_outputs_free(&d);
    void *hb[] = {d.idx, d.x, d.d_y, d.d_x0, d.probs, d.y_expert, d.d_recv_x, d.d_recv_probs};
    for (size_t i = 0; i < sizeof hb / sizeof hb[0]; i++) free(hb[i]);
    test_instance_close(&cpu);
    test_instance_close(&gpu);
    if (rank == 0) gpu_test_progress("world %d, case \"%s\": done", W, cs->name);
}

void gpu_dispatch_rows_init(gpu_dispatch_row *rows, int world, const gpu_dispatch_case *cases, int count)
{
    for (int ci = 0; ci < count; ci++) {
        gpu_dispatch_row *r = &rows[ci];
        r->world = world;
        r->name = cases[ci].name;
        r->tol = cases[ci].dtype == MOERT_BF16 ? 1e-2 : 2e-6;
        r->ran = true;
    }
}

void gpu_dispatch_print_rows(const gpu_dispatch_plugin *plugin, const gpu_dispatch_row *rows, int count)
{
    printf("\n%s dispatcher, CUDA vs CPU (diffs: bytes that differ; err: relative Frobenius error)\n", plugin->name);
    printf("%-5s  %-34s  %7s  %6s  %8s  %9s  %7s  %8s  %9s  %7s  %7s  %6s  ", "world", "case", "recv", "layout",
           "dispatch", "combine", "(bytes)", "comb_bwd", "d_x", "(bytes)", "d_probs", "repeat");
    if (plugin->count_step2_mallocs) printf("%6s  ", "malloc");
    for (int f = 0; f < 2; f++)
        if (plugin->figures[f]) printf("%10s  ", plugin->figure_labels[f]);
    printf("ok\n");
    for (int i = 0; i < count; i++) {
        const gpu_dispatch_row *r = &rows[i];
        if (!r->ran) continue;
        bool ok = !r->layout_diffs && !r->dispatch_diffs && !r->cb_diffs && !r->dprobs_diffs && !r->repeat_diffs &&
                  !r->step2_mallocs && r->combine_err <= r->tol && r->dx_err <= r->tol;
        printf("%-5d  %-34s  %7lld  %6lld  %8lld  %9.2e  %7lld  %8lld  %9.2e  %7lld  %7lld  %6lld  ", r->world, r->name,
               (long long)r->recv_rows, (long long)r->layout_diffs, (long long)r->dispatch_diffs, r->combine_err,
               (long long)r->combine_bytes, (long long)r->cb_diffs, r->dx_err, (long long)r->dx_bytes,
               (long long)r->dprobs_diffs, (long long)r->repeat_diffs);
        if (plugin->count_step2_mallocs) printf("%6lld  ", (long long)r->step2_mallocs);
        for (int f = 0; f < 2; f++)
            if (plugin->figures[f]) printf("%10.0f  ", r->figures[f]);
        printf("%s\n", ok ? "ok" : "FAIL");
    }
}
