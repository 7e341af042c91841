/* Executor: the sequence of one MoE layer's forward and backward; plugins each own one stage. */
#include "executor.h"

#include <math.h>
#include <stdlib.h>
#include <time.h>

#include "error.h"
#include "host.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#endif
#include "task.h"
#include "tensor_ops.h"

const char *moert_stage_name(moert_stage s)
{
    static const char *const names[MOERT_STAGE_COUNT] = {"router", "permute", "dispatch", "fc1",
                                                         "act",    "fc2",     "combine",  "backward"};
    return (s >= 0 && s < MOERT_STAGE_COUNT) ? names[s] : "unknown";
}

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Marks: 0 forward start, 1..7 after router, permute, dispatch, fc1, act, fc2, combine; 8 and 9 backward. */
enum { MARK_BACKWARD_START = MOERT_STAGE_COUNT, MARK_BACKWARD_END = MOERT_STAGE_COUNT + 1, MARK_COUNT };

static moert_result stage_mark(moert_layer *L, int mark)
{
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        if (!L->mark_events[mark]) {
            moert_result rc = moert_cuda_event_create(L->info.device.id, true, &L->mark_events[mark]);
            if (rc != MOERT_OK) return rc;
        }
        return moert_cuda_event_record(L->mark_events[mark], L->stream);
    }
#endif
    L->mark_seconds[mark] = now_seconds();
    return MOERT_OK;
}

/* Seconds between two marks. */
static moert_result mark_interval(moert_layer *L, int from, int to, double *out)
{
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) {
        float ms = 0.0f;
        moert_result rc = moert_cuda_event_elapsed_ms(L->mark_events[from], L->mark_events[to], &ms);
        *out = 1e-3 * ms;
        return rc;
    }
#endif
    *out = L->mark_seconds[to] - L->mark_seconds[from];
    return MOERT_OK;
}

moert_result moert_layer_collect_times(moert_layer *L)
{
    moert_result rc = MOERT_OK;
#ifdef MOERT_HAVE_CUDA
    if (L->info.device.type == MOERT_DEVICE_CUDA) MOERT_CHECK(moert_cuda_event_synchronize(L->mark_events[MARK_BACKWARD_END]));
#endif
    for (int s = 0; s < MOERT_STAGE_COUNT - 1; s++) MOERT_CHECK(mark_interval(L, s, s + 1, &L->stage_seconds[s]));
    MOERT_CHECK(mark_interval(L, MARK_BACKWARD_START, MARK_BACKWARD_END, &L->stage_seconds[MOERT_STAGE_BACKWARD]));
fail:
    return rc;
}

/* Turns a plugin's failure into a core error naming the plugin, the call, the layer and the rank. */
static moert_result plugin_failed(const moert_layer *L, const moert_instance *inst, const char *fn, moert_result rc)
{
    const char *msg = moert_host_take_error(inst->host);
    return moert_error(rc, "%s \"%s\" %s failed (layer %d, rank %d): %s%s%s", moert_kind_name(inst->plugin->kind),
                       inst->plugin->header->name, fn, L->info.layer_index, L->core_host->rank,
                       moert_result_name(rc), *msg ? ": " : "", msg);
}

#define PLUGIN_CALL(inst, fn, call)                                                                           \
    do {                                                                                                      \
        rc = (call);                                                                                          \
        if (rc != MOERT_OK) {                                                                                 \
            rc = plugin_failed(L, &(inst), fn, rc);                                                           \
            goto fail;                                                                                        \
        }                                                                                                     \
    } while (0)

#define ROUTER(L) ((const moert_router_v1 *)(L)->router.plugin->header)
#define DISPATCHER(L) ((const moert_dispatcher_v1 *)(L)->dispatcher.plugin->header)
#define PRECISION(L) ((const moert_precision_v1 *)(L)->precision.plugin->header)
#define MEMORY(L) ((const moert_memory_policy_v1 *)(L)->memory.plugin->header)

/* A zeroed tensor on the layer's device. */
static moert_result tensor_alloc(moert_layer *L, moert_tensor *t, moert_dtype dtype, int ndim, int64_t d0, int64_t d1,
                                 int64_t d2)
{
    int64_t shape[3] = {d0, d1, d2};
    *t = moert_tensor_make(NULL, L->info.device, dtype, ndim, shape);
    size_t bytes = moert_tensor_bytes(t);
    void *p = NULL;
    moert_result rc = L->core_host->alloc(L->core_host, L->info.device, bytes ? bytes : 1, &p);
    if (rc != MOERT_OK) return moert_error(rc, "allocating %zu bytes for layer %d: %s", bytes, L->info.layer_index,
                                           moert_host_take_error((moert_host *)L->core_host));
    t->data = p;
    return MOERT_OK;
}

static void tensor_release(moert_layer *L, moert_tensor *t)
{
    if (t->data) L->core_host->free(L->core_host, t->device, t->data);
    t->data = NULL;
}

/* Fills a parameter from the counter-based generator; element indices are global over experts. */
static moert_result fill_param(moert_layer *L, moert_tensor *t, uint64_t seed, uint64_t stream, uint64_t first,
                               double std)
{
    moert_result rc = MOERT_OK;
    size_t bytes = moert_tensor_bytes(t);
    moert_tensor host = *t;
    host.device = moert_cpu();
    host.data = malloc(bytes);
    MOERT_CHECK_ALLOC(host.data);
    moert_fill_normal(&host, seed, stream, first, std);
    rc = L->core_host->memcpy_async(L->core_host, t->data, t->device, host.data, host.device, bytes, L->stream);
    if (rc == MOERT_OK) rc = L->core_host->stream_synchronize(L->core_host, L->stream);
    if (rc != MOERT_OK) rc = moert_error(rc, "copying parameters to the device: %s",
                                         moert_host_take_error((moert_host *)L->core_host));
fail:
    free(host.data);
    return rc;
}

moert_result moert_layer_init_params(moert_layer *L, uint64_t seed)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    int64_t shapes[MOERT_PARAM_COUNT][3] = {{in->num_experts, in->hidden, 0},
                                            {in->num_local_experts, in->hidden, 2 * in->ffn_hidden},
                                            {in->num_local_experts, in->ffn_hidden, in->hidden}};
    int ndims[MOERT_PARAM_COUNT] = {2, 3, 3};
    double stds[MOERT_PARAM_COUNT] = {1.0 / sqrt((double)in->hidden), 1.0 / sqrt((double)in->hidden),
                                      0.5 / sqrt((double)in->ffn_hidden)};
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        moert_param *pr = &L->params[p];
        MOERT_CHECK(tensor_alloc(L, &pr->value, L->param_dtype, ndims[p], shapes[p][0], shapes[p][1], shapes[p][2]));
        MOERT_CHECK(tensor_alloc(L, &pr->grad, L->param_dtype, ndims[p], shapes[p][0], shapes[p][1], shapes[p][2]));
        MOERT_CHECK(tensor_alloc(L, &pr->m, L->param_dtype, ndims[p], shapes[p][0], shapes[p][1], shapes[p][2]));
        MOERT_CHECK(tensor_alloc(L, &pr->v, L->param_dtype, ndims[p], shapes[p][0], shapes[p][1], shapes[p][2]));
        /* expert weights start at the first local expert's global offset */
        uint64_t first = p == MOERT_PARAM_ROUTER ? 0
                                                 : (uint64_t)(in->first_local_expert * shapes[p][1] * shapes[p][2]);
        MOERT_CHECK(fill_param(L, &pr->value, seed, MOERT_STREAM_PARAM + 4 * (uint64_t)in->layer_index + (uint64_t)p,
                               first, stds[p]));
    }
    return MOERT_OK;
fail:
    return rc;
}

static void release_saved(moert_layer *L)
{
    tensor_release(L, &L->topk_idx);
    tensor_release(L, &L->topk_probs);
    tensor_release(L, &L->tokens_per_expert);
    tensor_release(L, &L->recv_probs);
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        tensor_release(L, &L->saved[a]);
        if (L->offloaded[a]) L->core_host->free_pinned(L->core_host, L->offloaded[a]);
        L->offloaded[a] = NULL;
    }
}

void moert_layer_free(moert_layer *L)
{
    release_saved(L);
#ifdef MOERT_HAVE_CUDA
    for (int m = 0; m < MARK_COUNT; m++)
        if (L->mark_events[m]) moert_cuda_event_destroy(L->mark_events[m]);
#endif
    memset(L->mark_events, 0, sizeof L->mark_events);
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        tensor_release(L, &L->params[p].value);
        tensor_release(L, &L->params[p].grad);
        tensor_release(L, &L->params[p].m);
        tensor_release(L, &L->params[p].v);
    }
}

moert_result moert_layer_zero_grad(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) MOERT_CHECK(moert_zero(L->stream, &L->params[p].grad));
fail:
    return rc;
}

/* Rows the grouped GEMMs cover: the sum of tokens_per_expert (padding included). */
static int64_t used_rows(const moert_layer *L)
{
    if (!L->layout.tokens_per_expert_host) return L->layout.capacity;
    int64_t rows = 0;
    for (int64_t e = 0; e < L->info.num_local_experts; e++) rows += L->layout.tokens_per_expert_host[e];
    return rows;
}

static moert_result run_gemm(moert_layer *L, moert_gemm_weight which, moert_gemm_pass pass, const moert_tensor *input,
                             const moert_tensor *grad_output, moert_tensor *output, moert_tensor *grad_input)
{
    moert_result rc = MOERT_OK;
    moert_param *w = &L->params[which == MOERT_GEMM_FC1 ? MOERT_PARAM_FC1 : MOERT_PARAM_FC2];
    moert_grouped_gemm_args a = {
        .struct_size = sizeof a, .which = which, .pass = pass,
        .tokens_per_expert = &L->layout.tokens_per_expert,
        .tokens_per_expert_host = L->layout.tokens_per_expert_host,
        .input = input, .weight = &w->value, .grad_output = grad_output,
        .output = output, .grad_input = grad_input, .grad_weight = &w->grad};
    static const char *const names[3] = {"grouped_gemm(forward)", "grouped_gemm(dgrad)", "grouped_gemm(wgrad)"};
    PLUGIN_CALL(L->precision, names[pass], PRECISION(L)->grouped_gemm(L->precision.ctx, L->stream, &a));
fail:
    return rc;
}

static moert_result run_dispatch(moert_layer *L)
{
    moert_result rc = MOERT_OK;
    moert_dispatch_args d = {.struct_size = sizeof d, .x = &L->x, .topk_probs = &L->topk_probs,
                             .recv_x = &L->saved[MOERT_ACT_DISPATCHED_X], .recv_probs = &L->recv_probs};
    PLUGIN_CALL(L->dispatcher, "dispatch", DISPATCHER(L)->dispatch(L->dispatcher.ctx, L->stream, &d));
fail:
    return rc;
}

static moert_result run_fc1(moert_layer *L)
{
    return run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_FORWARD, &L->saved[MOERT_ACT_DISPATCHED_X], NULL,
                    &L->saved[MOERT_ACT_FC1_OUT], NULL);
}

static moert_result run_act(moert_layer *L)
{
    return moert_swiglu_forward(L->stream, &L->saved[MOERT_ACT_FC1_OUT], &L->recv_probs, used_rows(L),
                                &L->saved[MOERT_ACT_SWIGLU_OUT]);
}

/* Allocates saved activation a for this step's capacity. */
static moert_result alloc_activation(moert_layer *L, moert_activation a)
{
    int64_t cols[MOERT_ACT_COUNT] = {L->info.hidden, 2 * L->info.ffn_hidden, L->info.ffn_hidden};
    return tensor_alloc(L, &L->saved[a], L->info.dtype, 2, L->layout.capacity, cols[a], 0);
}

/* After its last forward use, an activation is kept, dropped (recompute) or copied to pinned memory. */
static moert_result apply_policy(moert_layer *L, moert_activation a)
{
    moert_result rc = MOERT_OK;
    moert_tensor *t = &L->saved[a];
    L->saved_bytes[a] = (int64_t)moert_tensor_bytes(t);
    moert_activation_info info = {.struct_size = sizeof info, .layer_index = L->info.layer_index, .activation = a,
                                  .bytes = L->saved_bytes[a], .device = L->info.device};
    PLUGIN_CALL(L->memory, "decide", MEMORY(L)->decide(L->memory.ctx, &info, &L->action[a]));
    switch (L->action[a]) {
    case MOERT_MEMORY_KEEP:
        break;
    case MOERT_MEMORY_RECOMPUTE:
        tensor_release(L, t);
        break;
    case MOERT_MEMORY_OFFLOAD: {
        size_t bytes = moert_tensor_bytes(t);
        rc = L->core_host->alloc_pinned(L->core_host, bytes ? bytes : 1, &L->offloaded[a]);
        if (rc == MOERT_OK)
            rc = L->core_host->memcpy_async(L->core_host, L->offloaded[a], moert_cpu(), t->data, t->device, bytes,
                                            L->stream);
        if (rc == MOERT_OK) rc = L->core_host->stream_synchronize(L->core_host, L->stream);
        if (rc != MOERT_OK) {
            rc = moert_error(rc, "offloading %s of layer %d: %s", moert_activation_name(a), L->info.layer_index,
                             moert_host_take_error((moert_host *)L->core_host));
            goto fail;
        }
        tensor_release(L, t);
        break;
    }
    default:
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "memory policy \"%s\" answered action %d for %s",
                         L->memory.plugin->header->name, (int)L->action[a], moert_activation_name(a));
        goto fail;
    }
fail:
    return rc;
}

/* Brings activation a back for backward: from pinned memory, or by recomputing it. */
static moert_result restore_activation(moert_layer *L, moert_activation a)
{
    moert_result rc = MOERT_OK;
    if (L->action[a] == MOERT_MEMORY_KEEP) return MOERT_OK;
    MOERT_CHECK(alloc_activation(L, a));
    if (L->action[a] == MOERT_MEMORY_OFFLOAD) {
        moert_tensor *t = &L->saved[a];
        rc = L->core_host->memcpy_async(L->core_host, t->data, t->device, L->offloaded[a], moert_cpu(),
                                        moert_tensor_bytes(t), L->stream);
        if (rc != MOERT_OK) {
            rc = moert_error(rc, "reloading %s of layer %d: %s", moert_activation_name(a), L->info.layer_index,
                             moert_host_take_error((moert_host *)L->core_host));
            goto fail;
        }
        L->core_host->free_pinned(L->core_host, L->offloaded[a]);
        L->offloaded[a] = NULL;
        return MOERT_OK;
    }
    switch (a) {
    case MOERT_ACT_DISPATCHED_X: MOERT_CHECK(run_dispatch(L)); break;
    case MOERT_ACT_FC1_OUT: MOERT_CHECK(run_fc1(L)); break;
    case MOERT_ACT_SWIGLU_OUT: MOERT_CHECK(run_act(L)); break;
    default: break;
    }
fail:
    return rc;
}

moert_result moert_layer_forward(moert_layer *L, const moert_tensor *x, moert_tensor *y)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    int64_t t = x->shape[0];
    moert_tensor y_expert = {0}, moe_out = {0};
    release_saved(L);
    L->x = *x;
    MOERT_CHECK(stage_mark(L, 0));
    MOERT_CHECK(tensor_alloc(L, &L->topk_idx, MOERT_I32, 2, t, in->topk, 0));
    MOERT_CHECK(tensor_alloc(L, &L->topk_probs, L->param_dtype, 2, t, in->topk, 0));
    MOERT_CHECK(tensor_alloc(L, &L->tokens_per_expert, MOERT_I64, 1, in->num_experts, 0, 0));
    memset(&L->losses, 0, sizeof L->losses);
    moert_router_forward_args ra = {.struct_size = sizeof ra, .x = x, .weight = &L->params[MOERT_PARAM_ROUTER].value,
                                    .topk_idx = &L->topk_idx, .topk_probs = &L->topk_probs,
                                    .tokens_per_expert = &L->tokens_per_expert, .losses = &L->losses,
                                    .seq_length = L->seq_length};
    PLUGIN_CALL(L->router, "forward", ROUTER(L)->forward(L->router.ctx, L->stream, &ra));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_ROUTER));

    memset(&L->layout, 0, sizeof L->layout);
    L->layout.struct_size = sizeof L->layout;
    PLUGIN_CALL(L->dispatcher, "prepare", DISPATCHER(L)->prepare(L->dispatcher.ctx, L->stream, &L->topk_idx, &L->layout));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_PERMUTE));

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_DISPATCHED_X));
    MOERT_CHECK(tensor_alloc(L, &L->recv_probs, L->param_dtype, 1, L->layout.capacity, 0, 0));
    MOERT_CHECK(run_dispatch(L));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_DISPATCH));

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_FC1_OUT));
    MOERT_CHECK(run_fc1(L));
    MOERT_CHECK(apply_policy(L, MOERT_ACT_DISPATCHED_X));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_FC1));

    MOERT_CHECK(alloc_activation(L, MOERT_ACT_SWIGLU_OUT));
    MOERT_CHECK(run_act(L));
    MOERT_CHECK(apply_policy(L, MOERT_ACT_FC1_OUT));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_ACT));

    MOERT_CHECK(tensor_alloc(L, &y_expert, in->dtype, 2, L->layout.capacity, in->hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_FORWARD, &L->saved[MOERT_ACT_SWIGLU_OUT], NULL, &y_expert, NULL));
    MOERT_CHECK(apply_policy(L, MOERT_ACT_SWIGLU_OUT));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_FC2));

    MOERT_CHECK(tensor_alloc(L, &moe_out, in->dtype, 2, t, in->hidden, 0));
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &y_expert, .y = &moe_out};
    PLUGIN_CALL(L->dispatcher, "combine", DISPATCHER(L)->combine(L->dispatcher.ctx, L->stream, &ca));
    MOERT_CHECK(moert_add(L->stream, x, &moe_out, y));
    MOERT_CHECK(stage_mark(L, 1 + MOERT_STAGE_COMBINE));

    int64_t kept = 0;
    for (int a = 0; a < MOERT_ACT_COUNT; a++)
        if (L->action[a] == MOERT_MEMORY_KEEP) kept += L->saved_bytes[a];
    L->kept_bytes_peak = kept;
fail:
    tensor_release(L, &y_expert);
    tensor_release(L, &moe_out);
    return rc;
}

moert_result moert_layer_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x, double loss_scale)
{
    moert_result rc = MOERT_OK;
    const moert_layer_info *in = &L->info;
    int64_t t = d_y->shape[0], cap = L->layout.capacity;
    moert_tensor d_y_expert = {0}, d_act = {0}, d_fc1 = {0}, d_recv_probs = {0}, d_recv_x = {0}, d_probs = {0};
    MOERT_CHECK(stage_mark(L, MARK_BACKWARD_START));

    for (int a = 0; a < MOERT_ACT_COUNT; a++) MOERT_CHECK(restore_activation(L, (moert_activation)a));

    MOERT_CHECK(tensor_alloc(L, &d_y_expert, in->dtype, 2, cap, in->hidden, 0));
    moert_combine_backward_args cb = {.struct_size = sizeof cb, .d_y = d_y, .d_y_expert = &d_y_expert};
    PLUGIN_CALL(L->dispatcher, "combine_backward",
                DISPATCHER(L)->combine_backward(L->dispatcher.ctx, L->stream, &cb));

    MOERT_CHECK(tensor_alloc(L, &d_act, in->dtype, 2, cap, in->ffn_hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_DGRAD, NULL, &d_y_expert, NULL, &d_act));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC2, MOERT_GEMM_WGRAD, &L->saved[MOERT_ACT_SWIGLU_OUT], &d_y_expert, NULL, NULL));
    tensor_release(L, &d_y_expert);
    tensor_release(L, &L->saved[MOERT_ACT_SWIGLU_OUT]);

    MOERT_CHECK(tensor_alloc(L, &d_fc1, in->dtype, 2, cap, 2 * in->ffn_hidden, 0));
    MOERT_CHECK(tensor_alloc(L, &d_recv_probs, L->param_dtype, 1, cap, 0, 0));
    MOERT_CHECK(moert_swiglu_backward(L->stream, &d_act, &L->saved[MOERT_ACT_FC1_OUT], &L->recv_probs, used_rows(L),
                                      &d_fc1, &d_recv_probs));
    tensor_release(L, &d_act);
    tensor_release(L, &L->saved[MOERT_ACT_FC1_OUT]);

    MOERT_CHECK(tensor_alloc(L, &d_recv_x, in->dtype, 2, cap, in->hidden, 0));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_DGRAD, NULL, &d_fc1, NULL, &d_recv_x));
    MOERT_CHECK(run_gemm(L, MOERT_GEMM_FC1, MOERT_GEMM_WGRAD, &L->saved[MOERT_ACT_DISPATCHED_X], &d_fc1, NULL, NULL));
    tensor_release(L, &d_fc1);
    tensor_release(L, &L->saved[MOERT_ACT_DISPATCHED_X]);

    /* the residual passes d_y straight through; the MoE branch adds to it */
    MOERT_CHECK(moert_copy(L->stream, d_y, d_x));
    MOERT_CHECK(tensor_alloc(L, &d_probs, L->param_dtype, 2, t, in->topk, 0));
    moert_dispatch_backward_args db = {.struct_size = sizeof db, .d_recv_x = &d_recv_x, .d_recv_probs = &d_recv_probs,
                                       .d_x = d_x, .d_topk_probs = &d_probs};
    PLUGIN_CALL(L->dispatcher, "dispatch_backward",
                DISPATCHER(L)->dispatch_backward(L->dispatcher.ctx, L->stream, &db));

    moert_router_backward_args rb = {.struct_size = sizeof rb, .x = &L->x,
                                     .weight = &L->params[MOERT_PARAM_ROUTER].value, .d_topk_probs = &d_probs,
                                     .loss_scale = loss_scale, .d_x = d_x,
                                     .d_weight = &L->params[MOERT_PARAM_ROUTER].grad};
    PLUGIN_CALL(L->router, "backward", ROUTER(L)->backward(L->router.ctx, L->stream, &rb));
    MOERT_CHECK(stage_mark(L, MARK_BACKWARD_END));
fail:
    tensor_release(L, &d_y_expert);
    tensor_release(L, &d_act);
    tensor_release(L, &d_fc1);
    tensor_release(L, &d_recv_probs);
    tensor_release(L, &d_recv_x);
    tensor_release(L, &d_probs);
    return rc;
}
