/* SPDX-License-Identifier: Apache-2.0 */
/* moert embedded: the MoE layers of one rank, run forward and backward on the caller's tensors and stream.
 *
 * A training framework (a PyTorch module, a Megatron dispatcher backend, a C program) creates the layers of its rank
 * from a config and a launch description, binds its own parameter and gradient tensors, and calls forward and
 * backward per layer and micro-batch. Nothing here prints or exits: every failure is a result code, and
 * moert_last_error() gives its message on the calling thread. docs/api.md says who owns what, and when each call may
 * be made. The API is append-only like the plugin ABI: structs start with struct_size, MOERT_API_VERSION grows.
 */
#ifndef MOERT_LAYERS_H
#define MOERT_LAYERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/plugin.h"
#include "moert/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Version of the embedding API below: 1 is the first. Appended functions and struct members raise it. 2: the expert
 * layout in moert_launch and moert_layers_info (MoE Parallel Folding, docs/parallel.md). 3: the shared expert's saved
 * activations in moert_layer_figures. 4: the experts alone (moert_experts_forward / _backward). 5: moert_random_normal,
 * and in moert.h moert_set_last_error, the config getters, plugin listing and the environment tables. 6: what a
 * training loop around the layers needs (docs/api.md, "moert's own trainer"): moert_launch.flags (the residual),
 * moert_layers_info.stream, moert_layer_figures.device_pool_calls, the launcher's communicator, moert_comm_fail,
 * memory from the layers' pool, collectives over the layers' groups, the offload boundary, tokens per expert of the
 * last forward, trace spans, CUDA graph capture, two forwards in flight per layer with
 * $.parallel.overlap_micro_batches and moert_moe_forward_backward, and in moert.h moert_config_memory_estimate and
 * moert_plugin_description.agreement_rtol. 7: moert_layers_info.slots. 8: the dispatcher calls' own spans in
 * moert_layers_spans (MOERT_LAYERS_MAX_SPANS grew by MOERT_LAYER_DISPATCHER_CALLS). 9: up to
 * $.parallel.forwards_in_flight forwards in flight per layer, and a gradient rebound while forwards are in flight. 10:
 * the host's spans (stream "host": how long the host took to issue each stage, backward part and dispatcher call) in
 * moert_layers_spans, MOERT_LAYERS_MAX_SPANS doubled. 11: moert_config_set_many. */
#define MOERT_API_VERSION 11
MOERT_API int moert_api_version(void);

typedef struct moert_config moert_config;

/* ---- communicators: how the ranks of one expert-parallel group reach each other ---- */

typedef struct moert_comm moert_comm;

/* Ranks as threads of this process: one communicator shared by the `world_size` threads, each creating its layers
 * with its own rank. A collective waits at most timeout_s for every rank (MOERT_ERR_TIMEOUT names the late one). On
 * GPUs (a thread per GPU) the threads also share one NCCL group, created when the first rank needs it. Destroy it
 * after every rank's layers are destroyed. */
MOERT_API moert_result moert_comm_create_threads(int world_size, double timeout_s, moert_comm **out);

/*
 * Collectives the caller implements, e.g. over a PyTorch process group (gloo on CPUs), MPI or a test harness. One
 * table per rank (the process's own). Every function works on host memory, is called by every rank in the same order,
 * and returns 0 on success; on failure it returns non-zero and may write a message into error (error_size bytes).
 * A call must not block for ever: bound it with the caller's own timeout. moert never calls them from two threads
 * at once for one rank. Peer buffers are not offered through a table: the NVLink dispatchers' CPU paths need the
 * threads communicator, their CUDA paths NCCL.
 */
typedef struct moert_collectives {
    uint32_t struct_size; /* sizeof(moert_collectives) */
    void *user;           /* passed back to every call */
    /* recv gets every rank's `bytes` of send, rank-major (world_size * bytes). */
    int (*allgather)(void *user, const void *send, void *recv, size_t bytes, char *error, size_t error_size);
    /* Element-wise sum over ranks, in place; dtype is MOERT_F32, MOERT_F64 or MOERT_I64. */
    int (*allreduce_sum)(void *user, void *buf, size_t count, moert_dtype dtype, char *error, size_t error_size);
    /* Sends send_bytes[r] bytes at send + send_offsets[r] to rank r and receives recv_bytes[r] bytes from rank r at
     * recv + recv_offsets[r]; the arrays have world_size entries, in bytes. */
    int (*alltoallv)(void *user, const void *send, const size_t *send_bytes, const size_t *send_offsets, void *recv,
                     const size_t *recv_bytes, const size_t *recv_offsets, char *error, size_t error_size);
    int (*barrier)(void *user, char *error, size_t error_size);
} moert_collectives;

/* A communicator of one rank over the caller's collectives; the table is copied, `user` must outlive it. */
MOERT_API moert_result moert_comm_create_collectives(int world_size, const moert_collectives *table, moert_comm **out);

/* NCCL, one process per GPU, bootstrapped by the caller: rank 0 makes an id with moert_nccl_unique_id, the caller
 * sends those bytes to every rank (a torch process group broadcast, MPI_Bcast, ...), and each rank creates its
 * communicator from them; the NCCL communicator itself is initialised when the layers are created (on their
 * device). No port or environment variable is needed. Builds without CUDA answer MOERT_ERR_UNSUPPORTED. */
#define MOERT_NCCL_ID_BYTES 128
MOERT_API moert_result moert_nccl_unique_id(unsigned char id[MOERT_NCCL_ID_BYTES]);
MOERT_API moert_result moert_comm_create_nccl(const unsigned char id[MOERT_NCCL_ID_BYTES], int world_size,
                                              double timeout_s, moert_comm **out);

MOERT_API void moert_comm_destroy(moert_comm *comm);

/* API version 6: NCCL, one process per GPU, bootstrapped from a launcher's environment (torchrun, or srun with the
 * variables exported): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (rank 0 serves the NCCL id to the
 * others over TCP there). env gets what the launcher said; create the layers with env->rank and env->world_size on
 * GPU env->local_rank. MOERT_ERR_CONFIG names a missing or malformed variable; builds without CUDA answer
 * MOERT_ERR_UNSUPPORTED. */
typedef struct moert_launcher_env {
    uint32_t struct_size; /* sizeof(moert_launcher_env) */
    int32_t rank, world_size, local_rank;
} moert_launcher_env;
MOERT_API moert_result moert_comm_create_launcher(double timeout_s, moert_launcher_env *env, moert_comm **out);

/* API version 6: marks rank `rank`'s part of the communicator failed with `why`, so that its peers waiting in a
 * collective (host or NCCL) return at once with an error instead of waiting out the timeout: for a rank that fails
 * between collectives. Every later collective of the communicator fails. */
MOERT_API void moert_comm_fail(moert_comm *comm, int rank, const char *why);

/* ---- the layers of one rank ---- */

/* Where and as what this process runs one rank. */
typedef struct moert_launch {
    uint32_t struct_size; /* sizeof(moert_launch); the size of API version 1 (up to max_tokens) is accepted too */
    int32_t rank;         /* in the world, 0 .. world_size-1 */
    int32_t world_size;   /* every rank of the layers ($.parallel.ranks is ignored); with the default layout the
                              expert-parallel group, and $.model.num_experts must divide by it */
    moert_device device;  /* moert_cpu(), or {MOERT_DEVICE_CUDA, ordinal} */
    moert_comm *comm;     /* the world's; NULL only when world_size is 1; borrowed, must outlive the layers */
    int64_t max_tokens;   /* tokens per forward on this rank, an upper bound; 0: $.train.tokens_per_rank */
    /* API version 2: the MoE layers' own grid over the world (MoE Parallel Folding, docs/parallel.md), in Megatron's
     * expert rank order: rank = etp + ETP * (ep + EP * edp), EP = world_size / (ETP x EDP). 0 or 1: none. Each rank
     * holds E/EP experts, each a shard of F/ETP of their width; experts are replicated over the EDP ranks. The
     * config's $.parallel.expert_* keys are ignored, as $.parallel.ranks is. CPU and CUDA ranks alike. */
    int32_t expert_tensor_parallel;
    int32_t expert_data_parallel;
    /* API version 6: MOERT_LAUNCH_* bits (0: none). */
    uint32_t flags;
    /* API version 6: the micro-batches the caller runs per optimizer step, when it knows them (0: unknown). With
     * $.parallel.overlap_micro_batches "on" the layers make the second slot of moert_moe_forward_backward unless this
     * is 1; "auto" makes it only where this is 2 or more and the overlap was measured faster (docs/executor.md). */
    int32_t micro_batches;
} moert_launch;

/* The layers are residual blocks: moert_moe_forward gives y = x + MoE(x) (the shared expert's output added last), and
 * moert_moe_backward dx = dy + the MoE branch's gradient, in one pass each (no add of the caller's). */
#define MOERT_LAUNCH_RESIDUAL (1u << 0)

typedef struct moert_layers moert_layers;

/* Loads the config's plugins and creates one instance of each per layer ($.model.num_layers) for this rank. Collective:
 * every rank of the group calls it (plugins may exchange buffers at init). The config may be freed afterwards. */
MOERT_API moert_result moert_layers_create(const moert_config *cfg, const moert_launch *launch, moert_layers **out);
/* Frees the layers (any outstanding moert_saved too). Not collective, but on GPUs wait for the work queued. */
MOERT_API void moert_layers_destroy(moert_layers *layers);

/* The model's sizes as this rank sees them. */
typedef struct moert_layers_info {
    uint32_t struct_size; /* sizeof(moert_layers_info), or the size of API version 1 (up to expert_bias_dtype) */
    int32_t num_layers;
    int32_t rank, world_size;
    int64_t hidden, ffn_hidden, num_experts, topk;
    int64_t num_local_experts, first_local_expert;
    int64_t max_tokens;
    moert_dtype dtype;       /* activations x, y, dy, dx */
    moert_dtype param_dtype; /* parameters and their gradients: fp32 (fp64 when dtype is fp64) */
    moert_device device;
    moert_dtype expert_bias_dtype; /* the dtype the router keeps its expert bias in; MOERT_DTYPE_COUNT: it keeps none */
    /* API version 2: the rank's place in the expert grid (docs/parallel.md) and its experts' width here. ffn_hidden
     * above is the model's F; the fc1 and fc2 shards are local_ffn_hidden = F / etp_size wide. */
    int32_t ep_rank, ep_size, etp_rank, etp_size, edp_rank, edp_size;
    int64_t local_ffn_hidden;
    /* API version 6: the layers' own compute stream (a cudaStream_t of high priority; NULL on the CPU). Work the
     * caller queues on it is ordered with moert's without the events a call on another stream costs. */
    moert_stream stream;
    /* API version 7: the forwards each layer can hold in flight: $.parallel.forwards_in_flight (API version 9), at
     * least 2 where $.parallel.overlap_micro_batches made the second slot (moert_moe_forward_backward then runs its
     * halves beside each other on CUDA). */
    int32_t slots;
} moert_layers_info;
MOERT_API moert_result moert_layers_get_info(const moert_layers *layers, moert_layers_info *out);

/* ---- parameters: the caller's tensors ---- */

typedef enum moert_param_id {
    MOERT_PARAM_ROUTER = 0, /* router weight [E, H], replicated on every rank */
    MOERT_PARAM_FC1 = 1,    /* the local experts' fc1 [E_local, H, 2F] (gate and up halves of SwiGLU) */
    MOERT_PARAM_FC2 = 2,    /* the local experts' fc2 [E_local, F, H] */
    /* the shared expert ($.model.shared_expert_ffn_hidden Fs > 0), replicated on every rank like the router */
    MOERT_PARAM_SHARED_FC1 = 3,  /* [1, H, 2Fs] */
    MOERT_PARAM_SHARED_FC2 = 4,  /* [1, Fs, H] */
    MOERT_PARAM_SHARED_GATE = 5, /* [1, H], with $.model.shared_expert_gate */
    MOERT_PARAM_COUNT
} moert_param_id;

/* The shape, dtype and device a parameter (and its gradient) must have; desc->data is NULL. A parameter the config
 * does not have (the shared expert's, without one) answers MOERT_ERR_UNSUPPORTED, and needs no binding. */
MOERT_API moert_result moert_layers_param_desc(const moert_layers *layers, int layer, moert_param_id which,
                                               moert_tensor *desc);
/* Binds the caller's value and gradient tensors of one parameter (contiguous, as param_desc says). moert reads value
 * and writes grad in backward; it never frees them. Rebind after the caller reallocates them. Every parameter of a
 * layer must be bound before its first forward. While the layer has a forward in flight only the gradient may be
 * rebound (value the same tensor; another value is refused): a backward writes the gradient bound when it is called,
 * so a schedule holding several forwards ($.parallel.forwards_in_flight) may bind each micro-batch's own gradient
 * before its backward. */
MOERT_API moert_result moert_layers_bind_param(moert_layers *layers, int layer, moert_param_id which,
                                               const moert_tensor *value, const moert_tensor *grad);
/* Writes moert's initial values into the bound parameters of every layer (normal, std 1/sqrt(H) for the router and fc1,
 * 0.5/sqrt(F) for fc2, from seed; the same values for any split over ranks), ordered on stream. Optional. */
MOERT_API moert_result moert_layers_init_params(moert_layers *layers, uint64_t seed, moert_stream stream);

/* The counter-based generator moert_layers_init_params draws from: the index-th standard normal number of (seed,
 * stream), the same on any split over ranks and in any order. Layer l's parameter p takes stream 16 + 4 l + p (its
 * shared expert's 2^30 + 4 l + p - MOERT_PARAM_SHARED_FC1) and index (its global element, over all experts), scaled
 * by the std above: a caller can reproduce moert's initial weights, or draw reproducible data of its own from
 * streams below 16. */
MOERT_API double moert_random_normal(uint64_t seed, uint64_t stream, uint64_t index);

/* Tells moert that the caller's optimizer changed the weights (once per optimizer step): precision plugins drop what
 * they derived from them, such as FP8 weight copies. */
MOERT_API moert_result moert_layers_weights_changed(moert_layers *layers, moert_stream stream);
/* The router's once-per-step update, e.g. the aux-loss-free expert bias from the tokens counted since the last call
 * (collective where the router option reduces over ranks). Call after the backward of the step's last micro-batch. */
MOERT_API moert_result moert_layers_update_expert_bias(moert_layers *layers, moert_stream stream);
/* The router's expert bias ([E]): copied into dst (get) or from src (set, e.g. from a checkpoint), fp32, fp64 or bf16
 * on the host or the layers' device, converted from or to the router's own dtype. MOERT_ERR_UNSUPPORTED when the
 * router keeps none. Ordered on stream. */
MOERT_API moert_result moert_layers_get_expert_bias(moert_layers *layers, int layer, moert_tensor *dst,
                                                    moert_stream stream);
MOERT_API moert_result moert_layers_set_expert_bias(moert_layers *layers, int layer, const moert_tensor *src,
                                                    moert_stream stream);

/* ---- forward and backward ---- */

/* One micro-batch's saved activations of one layer, from its forward to its backward. The memory policy decides
 * which of them stay on the device, are recomputed, or are offloaded. The plugin ABI keeps one forward in flight per
 * instance, so a layer holds as many as it has slots: one by default (forward again only after its backward or
 * moert_saved_free). $.parallel.forwards_in_flight N (API version 9; pipeline schedules whose warm-up runs several
 * forwards of a layer before their backwards) makes N slots per layer, each with its own instance of every plugin
 * (parameters and gradients are shared); with $.parallel.overlap_micro_batches "on" (or "auto" where it turns on, see
 * moert_launch.micro_batches) there are at least two (API version 6). Backwards may run in any order. */
typedef struct moert_saved moert_saved;

/* What one forward produced besides y (host values, valid once moert_moe_forward returned). */
typedef struct moert_moe_stats {
    uint32_t struct_size;
    double router_loss; /* what enters the training loss: aux_loss + z_loss (coefficients applied) */
    double aux_loss;
    double z_loss;
    int64_t dispatched_rows; /* rows this rank's experts received */
} moert_moe_stats;

/*
 * y = MoE(x) for one layer: x and y are [T, H] in the layer's dtype on its device (T <= max_tokens, contiguous;
 * no residual is added). Work is queued on `stream` (a cudaStream_t, NULL for the default stream; ignored on the
 * CPU). Collective over the group. With `saved` non-NULL the activations the backward needs are kept, and x must stay
 * unchanged until that backward; with NULL nothing is kept (inference). stats may be NULL.
 */
MOERT_API moert_result moert_moe_forward(moert_layers *layers, int layer, const moert_tensor *x, moert_tensor *y,
                                         moert_stream stream, moert_saved **saved, moert_moe_stats *stats);

typedef struct moert_backward_options {
    uint32_t struct_size;
    /* d(loss)/d(router_loss): the weight the router's aux and z losses have in the caller's loss (often 1, or 1 /
     * micro-batches). */
    double router_loss_scale;
    /* true: gradients are added into the bound grad tensors (accumulation over micro-batches); false: overwritten. */
    bool accumulate;
} moert_backward_options;

/* dx = d(loss)/dx from dy = d(loss)/dy, and the parameter gradients (into the bound grad tensors; the router
 * weight's and the shared expert's are this rank's share: reduce them over every rank like any replicated parameter;
 * with expert data parallelism the experts' fc1 and fc2 are this replica's share: reduce them over the rank's EDP
 * group, docs/api.md). Consumes and frees saved.
 * dx may not alias dy. Collective. opts NULL: router_loss_scale 1, accumulate true. */
MOERT_API moert_result moert_moe_backward(moert_layers *layers, moert_saved *saved, const moert_tensor *dy,
                                          moert_tensor *dx, const moert_backward_options *opts, moert_stream stream);

/*
 * API version 6: the forward of one micro-batch on `layer` and the backward of another (bwd_saved, of any layer)
 * together, as a 1F1B schedule merges them (Megatron's --overlap-moe-expert-parallel-comm). The results are those of
 * moert_moe_forward(layer, x, y, saved, stats) followed by moert_moe_backward(bwd_saved, dy, dx, opts), bit for bit:
 * the gradients accumulate in the same order. On CUDA, with $.parallel.overlap_micro_batches on, the two run on the
 * layer slots' two streams, their stages issued in turn, so each one's all-to-all runs while the other computes (both
 * slots' dispatcher calls on the layers' one communication stream, in issue order: any dispatcher), and the
 * backward's weight gradients run after its dgrad path on its wgrad stream ($.parallel.overlap_wgrad), filling the
 * gaps; both are ordered after `stream` on entry and `stream` waits for both on return. On the CPU, or without the
 * second slot, they run one after the other. The forward takes a free slot of `layer` (the one the backward does not
 * hold, when it can); saved must not be NULL. Collective. docs/api.md shows a 1F1B loop.
 */
MOERT_API moert_result moert_moe_forward_backward(moert_layers *layers, int layer, const moert_tensor *x,
                                                  moert_tensor *y, moert_saved **saved, moert_moe_stats *stats,
                                                  moert_saved *bwd_saved, const moert_tensor *dy, moert_tensor *dx,
                                                  const moert_backward_options *opts, moert_stream stream);

/* API version 6: whether the layers hold a second slot per layer ($.parallel.overlap_micro_batches), and on the CPU,
 * where moert_moe_forward_backward runs one half then the other, interleave true issues their stages in turn as on
 * CUDA (tests: the results must not change). On CUDA the halves are always issued in turn, whatever interleave says. */
MOERT_API bool moert_layers_overlap_interleave(moert_layers *layers, bool interleave);

/* Tokens this rank routed to each expert in the forward that made saved ([E] int64, over all experts), copied into
 * dst (host or the layers' device), ordered on stream. */
MOERT_API moert_result moert_saved_tokens_per_expert(const moert_saved *saved, moert_tensor *dst, moert_stream stream);
/* Drops a forward's saved activations without a backward. A handle no longer in flight (consumed by its backward,
 * freed already, or freed with its layers by moert_layers_destroy) is ignored, as is NULL: a garbage collector may
 * free in any order. Handles are told apart by address, so one freed long ago whose address a new forward's handle
 * took is that new handle. The calls that take a saved handle refuse one no longer in flight, naming it. */
MOERT_API void moert_saved_free(moert_saved *saved);

/* ---- figures of the last forward and backward of a layer ---- */

#define MOERT_LAYER_STAGES 8 /* router, permute, dispatch, fc1, act, fc2, combine, backward */
#define MOERT_LAYER_BACKWARD_PARTS                                                                                     \
    10                                   /* recompute, combine_bwd, fc2_dgrad, fc2_wgrad, act_bwd, fc1_dgrad, fc1_wgrad,
                                         dispatch_bwd, router_bwd, wgrad_wait */
#define MOERT_LAYER_ACTIVATIONS        3 /* dispatched_x, fc1_out, swiglu_out */
#define MOERT_LAYER_SHARED_ACTIVATIONS 2 /* the shared expert's: shared_fc1_out, shared_act (API version 3) */

typedef struct moert_layer_figures {
    uint32_t struct_size;
    double stage_ms[MOERT_LAYER_STAGES]; /* time of each forward stage, and the whole backward */
    double backward_part_ms[MOERT_LAYER_BACKWARD_PARTS];
    int64_t saved_bytes[MOERT_LAYER_ACTIVATIONS]; /* size of each activation the forward saved */
    int64_t held_bytes; /* of those, held on the device from forward to backward (kept, not dropped/offloaded) */
    int64_t recompute_saved_bytes, offload_saved_bytes; /* not held because recomputed / offloaded */
    int64_t pinned_bytes;                               /* pinned host memory this layer's offload buffers hold */
    int64_t device_peak_bytes; /* CUDA: peak bytes in use of the layers' memory pool (all layers); 0 on the CPU */
    /* API version 3 (filled when struct_size covers it): the shared expert's saved activations, shared_fc1_out and
     * shared_act (0 without one). held_bytes, recompute_saved_bytes and offload_saved_bytes above count them too. */
    int64_t shared_saved_bytes[MOERT_LAYER_SHARED_ACTIVATIONS];
    /* API version 6: CUDA: cudaMalloc and cudaFree calls of the layers' memory pool since the layers were made (0
     * once the pool holds what a step needs); 0 on the CPU. */
    int64_t device_pool_calls;
} moert_layer_figures;

/* Fills out for `layer` from its last backward and the forward that made it (waits for that work on GPUs). */
MOERT_API moert_result moert_layers_figures(moert_layers *layers, int layer, moert_layer_figures *out);
/* Names of the stages, backward parts and activations above ("router", "fc2_wgrad", "fc1_out"); NULL out of range.
 * Activations MOERT_LAYER_ACTIVATIONS and the one after it are the shared expert's ("shared_fc1_out", "shared_act"). */
MOERT_API const char *moert_layer_stage_name(int stage);
MOERT_API const char *moert_layer_backward_part_name(int part);
MOERT_API const char *moert_layer_activation_name(int activation);

/* API version 6: the spans of layer `layer`'s last forward and backward, for a trace: each forward stage and backward
 * part on the stream it ran on ("compute", or "wgrad" for the weight-gradient GEMMs on their own stream), placed in
 * seconds after the forward start of layer `origin` of the same micro-batch (the first layer, say). Waits for the
 * layer's work. *count gets how many were written (at most capacity; MOERT_LAYERS_MAX_SPANS always suffice).
 * API version 8: after those, each dispatcher call's own time ("dispatcher.prepare", "dispatcher.dispatch",
 * "dispatcher.combine", "dispatcher.combine_backward", "dispatcher.dispatch_backward") on stream "dispatcher": on the
 * communication stream under the micro-batch overlap (where a stage's span on "compute" also holds the wait for the
 * other slot's calls queued before it), else inside its stage on the compute stream. A caller built against an
 * older MOERT_LAYERS_MAX_SPANS passes that capacity and gets the spans it knew.
 * API version 10: after those, the host's spans on stream "host": for each forward stage, backward part and
 * dispatcher call, from the moment the host reached its start to the moment it reached its end, placed against
 * `origin`'s forward start on the host's clock: how long the host took to issue it, its waits included (on the CPU,
 * where the host runs the work, the same as the stages' spans). None after a CUDA graph's capture or replay. A caller
 * built before passes its smaller capacity and gets the streams' spans first, then as many of the host's as fit. */
#define MOERT_LAYER_DISPATCHER_CALLS 5
#define MOERT_LAYERS_MAX_SPANS                                                                                         \
    (2 * (MOERT_LAYER_STAGES - 1 + MOERT_LAYER_BACKWARD_PARTS + MOERT_LAYER_DISPATCHER_CALLS))
typedef struct moert_span {
    const char *name;   /* moert_layer_stage_name / moert_layer_backward_part_name / "dispatcher.<call>" (static) */
    const char *stream; /* "compute", "wgrad", "dispatcher" or "host" (static) */
    double start_s, dur_s;
} moert_span;
MOERT_API moert_result moert_layers_spans(moert_layers *layers, int layer, int origin, moert_span *out, int capacity,
                                          int *count);

/* ---- around the layers: memory, collectives, offload boundaries (API version 6) ----
 *
 * For a training loop that drives the layers of its rank and wants to share their memory pool, their communicator
 * and their stream rather than bring its own (moert's own trainer does, docs/api.md).
 */

/* bytes of memory on `device`: the layers' device (from their memory pool on GPUs), MOERT_DEVICE_CUDA_HOST (pinned
 * host memory) or the CPU. Free with moert_layers_free on the same device, before the layers are destroyed. */
MOERT_API moert_result moert_layers_alloc(moert_layers *layers, moert_device device, size_t bytes, void **out);
MOERT_API void moert_layers_free(moert_layers *layers, moert_device device, void *ptr);

/* The groups of ranks a collective of the layers runs over: every rank, or the rank's group of one axis of the expert
 * grid (docs/parallel.md). A group of this rank alone makes a collective return at once. */
typedef enum moert_group {
    MOERT_GROUP_WORLD = 0,
    MOERT_GROUP_EP = 1,  /* the ranks sharing this rank's etp_rank and edp_rank */
    MOERT_GROUP_ETP = 2, /* the ranks holding the other shards of this rank's experts */
    MOERT_GROUP_EDP = 3  /* the replicas of this rank's experts: reduce fc1 and fc2 gradients over it */
} moert_group;

/* buf = its sum over the ranks of `group`, in place: fp32, fp64 or int64, contiguous, on the host (then done on return)
 * or the layers' device (ordered on stream; NCCL on GPUs). Every rank of the layers calls it at the same point (the
 * groups of an axis run together). On GPUs the expert groups run over their own NCCL communicators (split from the
 * world's), so device memory works for every group. */
MOERT_API moert_result moert_layers_allreduce_sum(moert_layers *layers, moert_group group, moert_tensor *buf,
                                                  moert_stream stream);
/* Returns when every rank of the layers has arrived (bounded by the communicator's timeout). */
MOERT_API moert_result moert_layers_barrier(moert_layers *layers);

/* A layer boundary of the offloaded activations: every layer's device copies whose copy to the host has finished are
 * given back, without waiting for any copy still running. The forwards and backwards do this at each layer; call it
 * where the caller waits anyway (after reading the loss, say) to free that memory before the backward starts. */
MOERT_API moert_result moert_layers_release_offloaded(moert_layers *layers, moert_stream stream);

/* Tokens this rank routed to each expert in layer `layer`'s last forward, replays of a CUDA graph included ([E] int64,
 * over all experts), copied into dst (host or the layers' device), ordered on stream. */
MOERT_API moert_result moert_layers_tokens_per_expert(moert_layers *layers, int layer, moert_tensor *dst,
                                                      moert_stream stream);

/* ---- CUDA graphs (API version 6) ----
 *
 * The forwards and backwards of the layers can be captured into CUDA graphs and replayed: capture_begin, the calls
 * (forwards, or backwards), capture_end, then moert_graph_launch for each later micro-batch of the same shapes and
 * tensors. Run one micro-batch without capture first, so plugins set themselves up and the layers' memory pool holds
 * what the step needs. A replay skips the host: it makes no stats and no moert_saved handles (a caller adding up the
 * router losses takes, for a replayed forward, those of the last forward it ran on the host). */
typedef struct moert_graph moert_graph;

/* Whether every layer's forward and backward can be captured (CUDA layers whose plugins declare
 * MOERT_CAP_GRAPH_CAPTURABLE and whose last forward kept every activation on the device); when not, why. */
MOERT_API bool moert_layers_graph_capturable(const moert_layers *layers, char *why, size_t why_size);
/* Starts capturing `stream` (relaxed mode). Every block the layers allocate for their work from here on, and every
 * block freed by it, stays the graphs' for as long as the layers live (one reservation shared by all their graphs:
 * they run one after the other). With $.parallel.overlap_micro_batches only the first slot is captured: a forward or
 * backward that needs the second slot is refused (MOERT_ERR_UNSUPPORTED) until capture_end. */
MOERT_API moert_result moert_layers_capture_begin(moert_layers *layers, moert_stream stream);
/* Ends the capture started on stream (also after a failure inside it) and makes the graph; `what` names the captured
 * work in messages. */
MOERT_API moert_result moert_layers_capture_end(moert_layers *layers, moert_stream stream, const char *what,
                                                moert_graph **out);
/* Replays a graph on stream. A captured backward overwrites or adds to the gradients as it did when captured. */
MOERT_API moert_result moert_graph_launch(moert_graph *graph, moert_stream stream);
/* Frees a graph (its layers must still exist); NULL is ignored. */
MOERT_API void moert_graph_destroy(moert_graph *graph);

/* ---- the dispatcher alone: DeepEP-shaped dispatch and combine on the caller's tensors ----
 *
 * For a framework that routes and runs its experts itself (e.g. a Megatron token-dispatcher backend): layer `layer`'s
 * dispatcher moves each token's top-k copies to the ranks owning their experts and back. The calls of one dispatch
 * come in this order: prepare (collective: counts are exchanged), run (collective), then combine, and for training
 * combine_backward and backward (collectives), then free. A layer's dispatches and forwards in flight together take
 * at most its slots ($.parallel.forwards_in_flight), each on a slot's own dispatcher instance.
 */
typedef struct moert_dispatch moert_dispatch;

/* Computes the layout of topk_idx ([T, K] int32 expert ids over all experts, -1 for a dropped copy) and gives the
 * rows this rank receives: *recv_rows is what recv_x must hold (its capacity; rows past the sum of tokens per local
 * expert are padding). */
MOERT_API moert_result moert_dispatch_prepare(moert_layers *layers, int layer, const moert_tensor *topk_idx,
                                              moert_stream stream, moert_dispatch **out, int64_t *recv_rows);
/* Rows per local expert ([E_local] int64) copied into dst (host or device). */
MOERT_API moert_result moert_dispatch_tokens_per_expert(const moert_dispatch *d, moert_tensor *dst,
                                                        moert_stream stream);
/* recv_x [recv_rows, H] (the layers' dtype) gets the copies grouped by local expert, recv_weights [recv_rows]
 * (param dtype) their routing weights from topk_weights [T, K] (param dtype). x must stay unchanged until backward. */
MOERT_API moert_result moert_dispatch_run(moert_dispatch *d, const moert_tensor *x, const moert_tensor *topk_weights,
                                          moert_tensor *recv_x, moert_tensor *recv_weights, moert_stream stream);
/* y[t] = sum over token t's kept copies of y_expert[row] ([recv_rows, H] -> [T, H], y overwritten). The routing
 * weights are not applied here: scale the rows before, as moert's layer does inside SwiGLU. */
MOERT_API moert_result moert_dispatch_combine(moert_dispatch *d, const moert_tensor *y_expert, moert_tensor *y,
                                              moert_stream stream);
/* The adjoint of combine: dy_expert[row] = dy[token of row] ([T, H] -> [recv_rows, H]). */
MOERT_API moert_result moert_dispatch_combine_backward(moert_dispatch *d, const moert_tensor *dy,
                                                       moert_tensor *dy_expert, moert_stream stream);
/* The adjoint of run: dx ([T, H], overwritten) gets each token's copies' row gradients summed, d_topk_weights ([T, K],
 * overwritten; 0 for dropped copies) the weights' gradients from d_recv_weights. */
MOERT_API moert_result moert_dispatch_backward(moert_dispatch *d, const moert_tensor *d_recv_x,
                                               const moert_tensor *d_recv_weights, moert_tensor *dx,
                                               moert_tensor *d_topk_weights, moert_stream stream);
/* Frees a dispatch; one freed already, or with its layers, is ignored (as moert_saved_free's), and the dispatch calls
 * refuse it. */
MOERT_API void moert_dispatch_free(moert_dispatch *d);

/* ---- the experts alone: moert's grouped GEMMs on rows already dispatched (API version 4) ----
 *
 * For a framework that routes and dispatches itself and wants moert's experts (e.g. in place of Megatron's GroupedMLP):
 * layer `layer`'s local experts, fc1, SwiGLU times the routing prob and fc2, through the configured precision plugin,
 * on rows grouped by local expert. Only the layer's fc1 and fc2 need binding. Forwards in flight per layer as for
 * moert_moe_forward ($.parallel.forwards_in_flight, each on a slot of its own; the same moert_saved, which
 * moert_saved_free drops). Not with
 * expert tensor parallelism (ETP > 1). The memory policy is not asked: fc1's output and the SwiGLU output are kept.
 */

/* y_rows[r] = fc2_e(silu(a) * g * probs[r]) where [a | g] = x_rows[r] fc1_e and e is row r's local expert: x_rows and
 * y_rows [rows, H] in the layers' dtype (any rows, 0 too), grouped by local expert, tokens_per_expert[e] rows each
 * ([E_local] int64 on the host or the layers' device; on the host their sum is checked); rows past the sum are padding
 * and get 0. probs [rows] in the param dtype, multiplied in fp32 after the activation and before the cast, as
 * Megatron's experts do; NULL: 1 (the caller applied them, e.g. on the input). probs are copied; x_rows must stay
 * unchanged until the backward. saved NULL: nothing kept (inference). */
MOERT_API moert_result moert_experts_forward(moert_layers *layers, int layer, const moert_tensor *x_rows,
                                             const moert_tensor *tokens_per_expert, const moert_tensor *probs,
                                             moert_tensor *y_rows, moert_stream stream, moert_saved **saved);
/* From dy_rows [rows, H]: dx_rows [rows, H] (overwritten, 0 on padding), d_probs [rows] (param dtype, overwritten; NULL
 * when not wanted), and the fc1 and fc2 weight gradients into the bound grad tensors (opts->accumulate as for
 * moert_moe_backward; router_loss_scale is not used). Consumes saved. dx_rows may not alias dy_rows. */
MOERT_API moert_result moert_experts_backward(moert_layers *layers, moert_saved *saved, const moert_tensor *dy_rows,
                                              moert_tensor *dx_rows, moert_tensor *d_probs,
                                              const moert_backward_options *opts, moert_stream stream);

/* ---- logging ---- */

/* Where moert's log lines go (warnings by default, MOERT_LOG=info|debug for more): NULL restores stderr. */
typedef void (*moert_log_fn)(void *user, moert_log_level level, const char *line);
MOERT_API void moert_set_log_callback(moert_log_fn fn, void *user);

#ifdef __cplusplus
}
#endif
#endif
