/* SPDX-License-Identifier: Apache-2.0 */
/* Executor: one MoE layer on one rank, forward and backward, calling each plugin for its stage. */
#ifndef MOERT_CORE_EXECUTOR_H
#define MOERT_CORE_EXECUTOR_H

#include "activation_store.h"
#include "comm.h"
#include "config.h"
#include "loader.h"
#include "moert/moert.h"

/* The stages timed in every step; their names are in moert_stage_name(). */
typedef enum moert_stage {
    MOERT_STAGE_ROUTER = 0,
    MOERT_STAGE_PERMUTE, /* dispatcher.prepare: layout and count exchange */
    MOERT_STAGE_DISPATCH,
    MOERT_STAGE_FC1,
    MOERT_STAGE_ACT,
    MOERT_STAGE_FC2,
    MOERT_STAGE_COMBINE,
    MOERT_STAGE_BACKWARD,
    MOERT_STAGE_COUNT
} moert_stage;

const char *moert_stage_name(moert_stage s);

/* The parts of the backward stage, each timed in every step (names in moert_backward_part_name()). A part that did not
 * run (recompute without a dropped activation) times 0. With overlap_wgrad the two wgrad parts run on the layer's second
 * stream, timed there, beside dispatch_bwd and router_bwd; wgrad_wait is what the compute stream then still waits for
 * them, so the backward stage is not the parts' sum. */
typedef enum moert_backward_part {
    MOERT_BWD_RECOMPUTE = 0, /* activations the memory policy dropped, computed again */
    MOERT_BWD_COMBINE,       /* dispatcher.combine_backward: output gradients back to the experts' rows */
    MOERT_BWD_FC2_DGRAD,
    MOERT_BWD_FC2_WGRAD,
    MOERT_BWD_ACT, /* SwiGLU backward, with the routing probabilities' gradient */
    MOERT_BWD_FC1_DGRAD,
    MOERT_BWD_FC1_WGRAD,
    MOERT_BWD_DISPATCH, /* dispatcher.dispatch_backward: row gradients back to the tokens, and the residual */
    MOERT_BWD_ROUTER,
    MOERT_BWD_WGRAD_WAIT, /* overlap_wgrad: the compute stream waiting for the second stream */
    MOERT_BWD_PART_COUNT
} moert_backward_part;

const char *moert_backward_part_name(moert_backward_part p);

/* Time marks of a layer: forward start, the end of each forward stage, backward start and end, then a begin and an
 * end mark per backward part. */
/* The dispatcher's calls that take a stream: prepare, dispatch, combine, combine_backward, dispatch_backward. */
#define MOERT_DISPATCHER_CALLS 5
#define MOERT_LAYER_MARKS      (MOERT_STAGE_COUNT + 2 + 2 * MOERT_BWD_PART_COUNT + 2 * MOERT_DISPATCHER_CALLS)

/* Micro-batch overlap on GPUs (core/src/overlap.c): the rank's one communication stream, on which the dispatcher calls
 * of both slots are issued, and one slot's pair of events fencing it with that slot's compute stream. */
typedef struct moert_comm_stream {
    moert_stream stream;
    moert_event enter; /* recorded on the compute stream before a call; the communication stream waits for it */
    moert_event leave; /* recorded on the communication stream after the call; the compute stream waits for it */
    /* $.parallel.overlap_comm_sms > 0: the rank's SM-yield words in device memory (moert_cuda_sm_yield_create; owned
     * by whoever made the stack): [MOERT_SM_YIELD_WORD] is what the GEMMs read (moert_layer_info.sm_yield), set to
     * sm_yield_sms ([MOERT_SM_YIELD_SMS]) before each dispatcher call and to 0 ([MOERT_SM_YIELD_ZERO]) after it; NULL:
     * not set */
    int32_t *sm_yield;
    int32_t sm_yield_sms;
} moert_comm_stream;

/* The three int32 of the SM-yield words: the word, 0 and $.parallel.overlap_comm_sms. */
enum { MOERT_SM_YIELD_WORD = 0, MOERT_SM_YIELD_ZERO = 1, MOERT_SM_YIELD_SMS = 2 };

/* One plugin instance of a layer: vtable, context and its host table. */
typedef struct moert_instance {
    const moert_plugin *plugin;
    void *ctx;
    moert_host *host;
} moert_instance;

/* A parameter with its gradient, on the layer's device (the optimizer and its state are the caller's). */
typedef struct moert_param {
    moert_tensor value, grad;
} moert_param;

typedef struct moert_layer {
    moert_layer_info info; /* as the plugins see it: num_local_experts E/EP, ffn_hidden F/ETP (the shard) */
    /* the rank's place in the MoE layers' grid (docs/parallel.md) and its expert-tensor-parallel group (ETP > 1: core
     * services over the group, host memory through its view, device memory through its NCCL communicator; the executor
     * gathers the experts' rows over it) */
    int ep_rank, ep_size, etp_rank, etp_size, edp_rank, edp_size;
    moert_host *etp_host;
    /* ETP > 1, from the last forward: rows per ETP rank and local expert ([etp_size x E_local]) as each rank's
     * dispatcher received them, their sums per local expert (host memory; `expert_counts` is the same as a tensor),
     * and the rows the experts compute on (their total) */
    int64_t *etp_counts;
    int64_t *etp_rank_major, *etp_expert_major; /* [etp_size x E_local] each block's first row: ranks one after the
                                                   other (as exchanged), and grouped by local expert (as computed) */
    int64_t *expert_counts_host;
    moert_tensor expert_counts; /* on the device on GPUs (allocated once) */
    int64_t expert_rows;
    const moert_host *core_host; /* the rank's own services: allocation, streams */
    moert_stream stream;         /* the rank's compute stream (NULL on the CPU) */
    moert_instance router, dispatcher, precision, memory;
    moert_param
        params[MOERT_PARAM_COUNT]; /* router [E,H], fc1 [El,H,2F], fc2 [El,F,H], the shared expert's (or empty) */
    moert_dtype param_dtype;       /* fp32, or fp64 in fp64 mode */
    int64_t seq_length;            /* tokens per sequence (batch-major), 0 = one sequence */
    /* the embedding API: parameter values and gradients are the caller's tensors (never freed here), and forward
     * gives MoE(x) alone, without the residual x (backward then passes no d_y through to d_x) */
    bool params_borrowed;
    bool no_residual;
    /* the next forward is an inference one (no backward follows): the router draws no training noise */
    bool inference;
    /* fc1 / fc2 weight gradients zeroed lazily: zero_grad leaves them as they are when the precision plugin
     * declares MOERT_CAP_WGRAD_OVERWRITE, and the first WGRAD overwrites them; backward zeroes any left */
    bool grad_unwritten[2];
    /* the runtime is capturing this layer's work into a CUDA graph: stage marks become graph nodes */
    bool capturing;
    /* $.parallel.overlap_wgrad: backward runs the wgrad GEMMs on wgrad_stream (created at the first backward on a GPU,
     * with its fork and join events) beside dispatch_backward and the router's backward */
    bool overlap_wgrad;
    moert_stream wgrad_stream;
    moert_event wgrad_fork_event, wgrad_join_event;
    /* another slot's layer (forwards_in_flight, the micro-batch overlap): slot 0's layer of the same index, whose
     * wgrad stream it shares, so the slots' WGRADs into the same gradients run in the order they were issued */
    struct moert_layer *wgrad_owner;
    /* $.parallel.defer_wgrad_join: in a merged call's backward (in_merged_call, set around it by the overlap) the
     * compute stream does not wait for the WGRADs at the end (their inputs go back to the pool on the wgrad stream);
     * wgrad_pending until a compute stream has waited for them */
    bool defer_wgrad_join;
    /* $.parallel.overlap_dgrad_first: a merged call's backward does not hand the turn to the forward after combine_bwd,
     * so its expert GEMMs are issued before the forward's routing and prepare wait on the host */
    bool overlap_dgrad_first;
    /* $.parallel.overlap_prepare_after_dgrads: a merged call's forward hands the turn over after its routing rather
     * than after its prepare, so the backward's expert GEMMs are issued before the prepare's host wait */
    bool overlap_prepare_after_dgrads;
    /* $.parallel.overlap_prepare_own_stream: prepare() of a dispatcher declaring MOERT_CAP_PREPARE_OWN_STREAM runs on
     * the compute stream under the overlap (call_dispatcher) */
    bool overlap_prepare_own_stream;
    bool in_merged_call;
    bool wgrad_pending;

    /* the shared expert ($.model.shared_expert_ffn_hidden > 0): a dense SwiGLU over every token added to the output,
     * its GEMMs through `shared_precision`, the precision plugin instantiated for one expert of width shared_ffn
     * (ctx NULL without a shared expert) */
    moert_instance shared_precision;
    int64_t shared_ffn;
    bool shared_gate;
    bool shared_grad_unwritten[2]; /* as grad_unwritten, for the shared fc1 / fc2 */
    int64_t shared_rows_host;      /* T of the last forward: the shared expert's one group of rows */
    moert_tensor shared_rows;      /* [1] int64 on the device, = shared_rows_host */
    moert_tensor shared_prob;      /* saved: [T] (1, or the gate); its fc1 and SwiGLU outputs are in `acts`, slots
                                         MOERT_STORE_SHARED_FC1_OUT and _ACT, as the memory policy answers */
    moert_tensor shared_out;       /* forward: its output until the compute stream adds it */
    moert_tensor shared_dx, shared_dprob; /* backward: its share of d_x and the gate's input, until added */
    /* $.parallel.shared_expert_overlap on a GPU: its work on a second stream (made at the first use) beside the
     * routing, dispatch, routed experts and combine, joined where its result is added */
    bool shared_overlap;
    moert_stream shared_stream;
    moert_event shared_fork_event, shared_join_event;

    /* the experts alone (moert_layer_experts_forward): set from that forward to its backward, the grouped GEMMs then
     * take the caller's rows per local expert, on the device and, when the caller gave them there, on the host
     * (experts_counts_host; NULL otherwise) */
    bool experts_only;
    moert_tensor experts_counts;
    int64_t *experts_counts_host_buf; /* [E_local], kept across calls */
    const int64_t *experts_counts_host;
    bool experts_padded; /* rows past the counts' sum, or a sum the host does not know: zero-filled */

    /* saved by forward for backward */
    moert_tensor x; /* borrowed: the layer input */
    moert_tensor topk_idx, topk_probs, tokens_per_expert;
    moert_dispatch_layout layout;
    moert_tensor recv_probs;
    moert_router_losses losses;

    /* dispatched_x, fc1_out and swiglu_out (and the shared expert's two) from forward to backward: kept, dropped or
     * offloaded as the memory policy answers, with their memory figures (activation_store.h) */
    moert_activation_store acts;

    /* micro-batch overlap on GPUs (core/src/overlap.c): the dispatcher's calls run on this communication stream,
     * fenced with `stream`, except while capturing; NULL: on `stream` */
    const moert_comm_stream *comm;

    /* a merged forward and backward (core/src/overlap.c): called between stages, where the other half may issue */
    void (*yield)(void *ctx);
    void *yield_ctx;

    /* figures of the last step: stage boundaries are marked with CUDA events on GPUs (read by
     * moert_layer_collect_times once the step's work is done), and with the host's clock where the host reaches them
     * (on the CPU the stages' times, on GPUs the time the host spent issuing each stage: the "host" spans) */
    double mark_seconds[MOERT_LAYER_MARKS];
    moert_event mark_events[MOERT_LAYER_MARKS];
    bool host_marks_valid; /* mark_seconds are the last forward's and backward's (not a capture's, not replayed) */
    double stage_seconds[MOERT_STAGE_COUNT];
    double backward_part_seconds[MOERT_BWD_PART_COUNT];
    bool backward_part_ran[MOERT_BWD_PART_COUNT];
    bool backward_part_on_side[MOERT_BWD_PART_COUNT];       /* ran on wgrad_stream, not the compute stream */
    double dispatcher_call_seconds[MOERT_DISPATCHER_CALLS]; /* each call's own time on the stream it ran on */
    bool dispatcher_call_ran[MOERT_DISPATCHER_CALLS];       /* since the last forward started */
} moert_layer;

/* Turns a plugin's failure into a core error naming the plugin, the call, the layer and the rank. */
moert_result moert_layer_plugin_failed(const moert_layer *L, const moert_instance *inst, const char *fn,
                                       moert_result rc);

/* Whether the layer has parameter `which` (the shared expert's only with one). */
bool moert_layer_has_param(const moert_layer *L, moert_param_id which);
/* The shape, dtype and device of a parameter (data NULL). */
moert_tensor moert_layer_param_desc(const moert_layer *L, moert_param_id which);
/* Writes the initial parameter values (from the seed, the same for any rank split) into the layer's parameters,
 * allocated or bound by the caller. */
moert_result moert_layer_fill_params(moert_layer *L, uint64_t seed);
/* Allocates the parameters and their gradients (values from the seed, the same for any rank split): for tests that
 * drive one layer. */
moert_result moert_layer_init_params(moert_layer *L, uint64_t seed);
void moert_layer_free(moert_layer *L);

/* y = x + MoE(x); x must stay valid until backward. */
moert_result moert_layer_forward(moert_layer *L, const moert_tensor *x, moert_tensor *y);
/* From d_y computes d_x (overwritten) and adds parameter gradients; router losses enter with loss_scale. */
moert_result moert_layer_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x, double loss_scale);
/* `stream` waits for the WGRADs a deferred backward of L left running (defer_wgrad_join); nothing when none is. */
moert_result moert_layer_join_wgrads(moert_layer *L, moert_stream stream);
/* Between forward and backward a layer's saved activations are in L->acts: its callers run the layer boundaries of the
 * store (moert_act_store_start_offloads, _release_finished, _prefetch; activation_store.h). */

/* The host's monotonic clock in seconds: the layers' host marks, and the merged halves' polling for their turn. */
double moert_layer_now_seconds(void);

/* Fills stage_seconds and backward_part_seconds from the last forward and backward (waits for their work on GPUs). */
moert_result moert_layer_collect_times(moert_layer *L);

/* One span of the layer's last forward or backward: a forward stage or a backward part, on the stream it ran on,
 * starting start_s seconds after the forward start of a chosen origin layer. */
typedef struct moert_layer_span {
    const char *name;   /* moert_stage_name / moert_backward_part_name / "dispatcher.<call>" */
    const char *stream; /* "compute", "wgrad" for the wgrad parts moved to the second stream (overlap_wgrad),
                           "dispatcher" for the dispatcher's calls themselves, or "host" for the time the host spent
                           issuing a stage, part or call (its waits included) */
    double start_s, dur_s;
} moert_layer_span;
#define MOERT_LAYER_DEVICE_SPANS (MOERT_STAGE_COUNT - 1 + MOERT_BWD_PART_COUNT + MOERT_DISPATCHER_CALLS)
#define MOERT_LAYER_MAX_SPANS    (2 * MOERT_LAYER_DEVICE_SPANS)
/* The spans of the last forward and backward (after moert_layer_collect_times), placed against the forward start of
 * `origin` (a layer of the same rank whose marks are of the same micro-batch, e.g. the first layer): for the trace.
 * After the streams' spans, the host's ("host"), placed against origin's forward start on the host's clock, where the
 * host reached the marks of the last forward and backward (none after a CUDA graph's capture or replay). */
moert_result moert_layer_spans(const moert_layer *L, const moert_layer *origin, moert_layer_span *out, int *count);
/* Whether the layer's forward and backward can be captured in a CUDA graph and replayed: a CUDA layer whose four
 * plugin instances declare MOERT_CAP_GRAPH_CAPTURABLE (header flags, or host->set_flags) and whose last forward kept
 * every activation on the device (offload and recompute have host-side steps). When not, writes why into `why`. */
bool moert_layer_graph_capturable(const moert_layer *L, char *why, size_t why_size);
/* Frees the activations the last forward saved for its backward (a forward that will get no backward). */
moert_result moert_layer_release_saved(moert_layer *L);
/* Rows the experts of the last forward received (the layout's count where the dispatcher knows it on the host, else
 * its capacity). */
int64_t moert_layer_used_rows(const moert_layer *L);
/* The routed experts alone on rows already grouped by local expert (the embedding API's moert_experts_forward):
 * y = fc2(SwiGLU(fc1(x)) * probs) per local expert, x and y [rows, H], counts [E_local] int64 (host or device memory,
 * summing to at most rows; rows past the sum are padding and come out zero), probs [rows] in the param dtype or NULL
 * (1). fc1_out and swiglu_out are kept for the backward (the memory policy is not asked: a framework driving the
 * experts alone recomputes on its own), x is borrowed until then. */
moert_result moert_layer_experts_forward(moert_layer *L, const moert_tensor *x, const moert_tensor *counts,
                                         const moert_tensor *probs, moert_tensor *y);
/* Its backward from d_y: d_x (overwritten), d_probs ([rows], overwritten; NULL: not wanted) and the fc1 and fc2 weight
 * gradients (added, or written when `overwrite`). */
moert_result moert_layer_experts_backward(moert_layer *L, const moert_tensor *d_y, moert_tensor *d_x,
                                          moert_tensor *d_probs, bool overwrite);
/* Zeroes the parameter gradients. With allow_lazy, when the precision plugin declares MOERT_CAP_WGRAD_OVERWRITE,
 * the expert weights' gradients are left for the next backward's WGRADs to overwrite instead (no memset); without
 * it every gradient is zeroed now and every WGRAD adds. */
moert_result moert_layer_zero_grad(moert_layer *L, bool allow_lazy);
/* After a replayed CUDA graph's backward: its WGRADs wrote the expert gradients (what run_gemm notes when it runs). */
void moert_layer_mark_grads_written(moert_layer *L);
#endif
