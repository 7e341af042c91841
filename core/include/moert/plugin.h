/* SPDX-License-Identifier: Apache-2.0 */
/* What every moert plugin shares: ABI version, vtable header, result codes, host services. */
#ifndef MOERT_PLUGIN_H
#define MOERT_PLUGIN_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "moert/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the functions libmoert exports (the public API); everything else in it is hidden. */
#ifndef MOERT_API
#if defined(__GNUC__)
#define MOERT_API __attribute__((visibility("default")))
#else
#define MOERT_API
#endif
#endif

/* ABI version: major changes break plugins, minor ones only append. */
#define MOERT_ABI_MAJOR                 1
#define MOERT_ABI_MINOR                 2
#define MOERT_ABI_VERSION(major, minor) ((uint32_t)(((uint32_t)(major) << 16) | ((uint32_t)(minor)&0xffffu)))
#define MOERT_ABI_VERSION_MAJOR(v)      ((uint32_t)(v) >> 16)
#define MOERT_ABI_VERSION_MINOR(v)      ((uint32_t)(v)&0xffffu)
#define MOERT_ABI_CURRENT               MOERT_ABI_VERSION(MOERT_ABI_MAJOR, MOERT_ABI_MINOR)

/* Every plugin and core call returns one of these; the message is set through host->set_error. */
typedef enum moert_result {
    MOERT_OK = 0,
    MOERT_ERR_INVALID_ARGUMENT = 1, /* a caller passed bad shapes, dtypes or pointers */
    MOERT_ERR_CONFIG = 2,           /* a config value is missing, mistyped or out of range */
    MOERT_ERR_UNSUPPORTED = 3,      /* a valid request this plugin or build cannot serve (device, dtype) */
    MOERT_ERR_OUT_OF_MEMORY = 4,    /* an allocation failed */
    MOERT_ERR_NOT_FOUND = 5,        /* a file, plugin or symbol was not found */
    MOERT_ERR_ABI_MISMATCH = 6,     /* a plugin was built for another ABI major, kind or struct size */
    MOERT_ERR_CUDA = 7,             /* a CUDA runtime, driver or cuBLASLt call failed */
    MOERT_ERR_NCCL = 8,             /* an NCCL call failed */
    MOERT_ERR_TIMEOUT = 9,          /* a peer did not answer in time (a stalled rank) */
    MOERT_ERR_IO = 10,              /* reading or writing a file failed */
    MOERT_ERR_INTERNAL = 11,        /* a bug: an invariant did not hold */
    MOERT_RESULT_COUNT
} moert_result;

/* A short fixed name for a result code, e.g. "invalid argument". */
MOERT_API const char *moert_result_name(moert_result r);

typedef enum moert_plugin_kind {
    MOERT_KIND_ROUTER = 1,
    MOERT_KIND_DISPATCHER = 2,
    MOERT_KIND_PRECISION = 3,
    MOERT_KIND_MEMORY_POLICY = 4
} moert_plugin_kind;

typedef enum moert_log_level {
    MOERT_LOG_ERROR = 0,
    MOERT_LOG_WARN = 1,
    MOERT_LOG_INFO = 2,
    MOERT_LOG_DEBUG = 3
} moert_log_level;

/* Capability bits. */
#define MOERT_CAP_DEVICE(type)     (1u << (type))  /* e.g. MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA) */
#define MOERT_CAP_DTYPE(dtype)     (1u << (dtype)) /* activation dtypes the plugin accepts */
#define MOERT_CAP_GRAPH_CAPTURABLE (1u << 0)       /* no host sync, no allocation in a step */
#define MOERT_CAP_NEEDS_HOST_SYNC  (1u << 1)       /* reads device data on the host in a step */
#define MOERT_CAP_WGRAD_OVERWRITE  (1u << 2)       /* precision: honours overwrite_grad_weight */
/* dispatcher: takes few SMs when its layer runs beside another micro-batch's work (MOERT_LAYER_OVERLAPPED), where the
 * micro-batch overlap was measured faster: $.parallel.overlap_micro_batches "auto" may turn the overlap on for it */
#define MOERT_CAP_AUTO_OVERLAP (1u << 3)
/* dispatcher: prepare() launches no kernel that waits on a peer's and no collective on its stream (it exchanges the
 * counts through the host's collectives), so under the micro-batch overlap the core may call it on the slot's compute
 * stream rather than the communication stream, where it would wait behind the other slot's all-to-all */
#define MOERT_CAP_PREPARE_OWN_STREAM (1u << 4)
/* dispatcher: holds every rank's tokens of its expert-parallel group (Megatron's allgather dispatcher): the tokens
 * gathered in the activation dtype and two partial sums of them in fp32 (fp64 on the CPU), which the core's memory
 * estimate counts where they outweigh the routed rows it counts for any dispatcher */
#define MOERT_CAP_GATHERS_TOKENS (1u << 5)

/* The first member of every vtable. */
typedef struct moert_plugin_header {
    uint32_t abi_version;    /* MOERT_ABI_CURRENT when built */
    uint32_t struct_size;    /* sizeof the whole vtable, for append-only growth */
    uint32_t kind;           /* moert_plugin_kind */
    const char *name;        /* short name, e.g. "alltoall" */
    const char *version;     /* the plugin's own version, e.g. "0.1.0" */
    const char *description; /* one line */
    uint32_t devices;        /* MOERT_CAP_DEVICE bits */
    uint32_t dtypes;         /* MOERT_CAP_DTYPE bits */
    uint32_t flags;          /* MOERT_CAP_GRAPH_CAPTURABLE, MOERT_CAP_NEEDS_HOST_SYNC, MOERT_CAP_WGRAD_OVERWRITE,
                                MOERT_CAP_AUTO_OVERLAP, MOERT_CAP_PREPARE_OWN_STREAM, MOERT_CAP_GATHERS_TOKENS */
} moert_plugin_header;

/* Marks the one symbol a plugin exports (plugins build with -fvisibility=hidden). */
#if defined(__GNUC__)
#define MOERT_PLUGIN_EXPORT __attribute__((visibility("default")))
#else
#define MOERT_PLUGIN_EXPORT
#endif

/* The fields every vtable's header starts with, for a plugin of this build's ABI:
 *   .header = {MOERT_PLUGIN_HEADER(moert_router_v1, MOERT_KIND_ROUTER), .name = "x", .version = "1.0.0", ...}
 * (each kind's header has its own shorthand, e.g. MOERT_ROUTER_V1_HEADER). */
#define MOERT_PLUGIN_HEADER(vtable_type, kind_value)                                                                   \
    .abi_version = MOERT_ABI_CURRENT, .struct_size = sizeof(vtable_type), .kind = (kind_value)

/* Opaque stream and event handles: a cudaStream_t / cudaEvent_t on CUDA, NULL on the CPU (synchronous). */
typedef void *moert_stream;
typedef void *moert_event;

/* What a plugin instance serves: one MoE layer on one rank. */
typedef struct moert_layer_info {
    uint32_t struct_size;
    int32_t layer_index; /* 0 .. num_layers-1 */
    int32_t num_layers;
    int64_t hidden;            /* H */
    int64_t ffn_hidden;        /* F, per expert */
    int64_t num_experts;       /* E, over all ranks */
    int64_t topk;              /* K */
    int64_t num_local_experts; /* E / world_size */
    int64_t first_local_expert;
    int64_t max_tokens;  /* T: tokens per rank per step, an upper bound */
    moert_dtype dtype;   /* activation storage dtype */
    moert_device device; /* where this rank's tensors live */
    /* appended (check struct_size): with $.parallel.overlap_micro_batches a layer has a second instance of each plugin
     * (slot 1) so that two micro-batches' forwards can be in flight; `twin` is then the ctx of the slot-0 instance of
     * the same plugin and layer (NULL for slot 0). Per-forward state stays per instance; state a forward carries over
     * to later forwards of the step (token counts, an expert bias, a noise counter) should be the twin's, so both
     * slots see the forwards in the order they ran. The core calls end_step on slot 0's router only. */
    void *twin;
    /* appended (check MOERT_LAYER_INFO_HAS_FLAGS): MOERT_LAYER_* bits, how the core runs this layer */
    uint32_t flags;
    /* appended (check MOERT_LAYER_INFO_HAS_SM_YIELD): a device pointer, set only on CUDA layers under the micro-batch
     * overlap (MOERT_LAYER_OVERLAPPED) when $.parallel.overlap_comm_sms > 0, else NULL. The core writes it on its
     * communication stream: the SMs a dispatcher call needs just before each call of either micro-batch, 0 just
     * after. A plugin's persistent kernels read it (volatile) between work units, and their CTAs numbered
     * >= gridDim.x - value stop taking units, so that the call's kernels find SMs; work already taken is finished,
     * the rest goes to the other CTAs. */
    const int32_t *sm_yield;
} moert_layer_info;

/* The size of moert_layer_info before `twin` was appended: the smallest a core passes. */
#define MOERT_LAYER_INFO_BASE_SIZE offsetof(moert_layer_info, twin)
/* Whether a moert_layer_info has `twin` (an older core passes a shorter struct). */
#define MOERT_LAYER_INFO_HAS_TWIN(info) ((info)->struct_size >= offsetof(moert_layer_info, twin) + sizeof(void *))
/* Whether a moert_layer_info has `flags`, and its flags (0 from a core that passes none). */
#define MOERT_LAYER_INFO_HAS_FLAGS(info) ((info)->struct_size >= offsetof(moert_layer_info, flags) + sizeof(uint32_t))
#define MOERT_LAYER_INFO_FLAGS(info)     (MOERT_LAYER_INFO_HAS_FLAGS(info) ? (info)->flags : 0u)
/* Whether a moert_layer_info has `sm_yield`, and its pointer (NULL from a core that passes none). */
#define MOERT_LAYER_INFO_HAS_SM_YIELD(info)                                                                            \
    ((info)->struct_size >= offsetof(moert_layer_info, sm_yield) + sizeof(const int32_t *))
#define MOERT_LAYER_INFO_SM_YIELD(info) (MOERT_LAYER_INFO_HAS_SM_YIELD(info) ? (info)->sm_yield : (const int32_t *)NULL)

/* Copies a layer info without reading past an older core's shorter struct: rest 0, struct_size the bytes copied. */
static inline void moert_layer_info_copy(moert_layer_info *dst, const moert_layer_info *src)
{
    size_t copied = src->struct_size < sizeof *dst ? (size_t)src->struct_size : sizeof *dst;
    memset(dst, 0, sizeof *dst);
    memcpy(dst, src, copied);
    dst->struct_size = (uint32_t)copied;
}

/* The layer's calls run beside another micro-batch's work on other streams ($.parallel.overlap_micro_batches on, both
 * slots): a dispatcher left to choose its SMs should take few, since a kernel waits for the SMs the other half's GEMMs
 * hold. Set alike on every rank. */
#define MOERT_LAYER_OVERLAPPED (1u << 0)

typedef struct moert_host moert_host;

/*
 * Services the core hands each plugin instance. Append-only: check struct_size before using a member
 * added after the one you were built against. All members are set by the core.
 */
struct moert_host {
    uint32_t struct_size;
    uint32_t abi_version;
    void *impl;   /* the core's private state for this instance */
    int32_t rank; /* this instance's rank in the expert-parallel group */
    int32_t world_size;

    /* logging and errors */
    void (*log)(const moert_host *h, moert_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
        __attribute__((format(printf, 3, 4)))
#endif
        ;
    /* Sets the message that goes with the result code a plugin returns next. */
    void (*set_error)(const moert_host *h, const char *fmt, ...)
#if defined(__GNUC__)
        __attribute__((format(printf, 2, 3)))
#endif
        ;

    /*
     * Typed options from the plugin's own JSON object. A missing key gives the default; a wrong type or a
     * value out of range returns MOERT_ERR_CONFIG with the message already set (JSON path, value, expected).
     * The core notes each key read, reports unknown keys itself, and lists options for `moert plugins --options`.
     */
    moert_result (*option_int)(const moert_host *h, const char *key, int64_t def, int64_t min, int64_t max,
                               const char *help, int64_t *out);
    moert_result (*option_float)(const moert_host *h, const char *key, double def, double min, double max,
                                 const char *help, double *out);
    moert_result (*option_bool)(const moert_host *h, const char *key, bool def, const char *help, bool *out);
    moert_result (*option_string)(const moert_host *h, const char *key, const char *def, const char *help,
                                  const char **out);
    /* choices: NULL-terminated list; out gets the index of the one chosen. */
    moert_result (*option_enum)(const moert_host *h, const char *key, const char *const *choices, int def,
                                const char *help, int *out);

    /* memory: device (or host, for MOERT_DEVICE_CPU) and pinned host allocations, from the core's pool */
    moert_result (*alloc)(const moert_host *h, moert_device dev, size_t bytes, void **out);
    void (*free)(const moert_host *h, moert_device dev, void *ptr);
    moert_result (*alloc_pinned)(const moert_host *h, size_t bytes, void **out);
    void (*free_pinned)(const moert_host *h, void *ptr);
    moert_result (*memcpy_async)(const moert_host *h, void *dst, moert_device dst_dev, const void *src,
                                 moert_device src_dev, size_t bytes, moert_stream stream);

    /* streams and events (no-ops on the CPU, where work is synchronous) */
    moert_result (*stream_create)(const moert_host *h, moert_stream *out);
    void (*stream_destroy)(const moert_host *h, moert_stream s);
    moert_result (*event_create)(const moert_host *h, moert_event *out);
    void (*event_destroy)(const moert_host *h, moert_event e);
    moert_result (*event_record)(const moert_host *h, moert_event e, moert_stream s);
    moert_result (*stream_wait_event)(const moert_host *h, moert_stream s, moert_event e);
    moert_result (*stream_synchronize)(const moert_host *h, moert_stream s);

    /*
     * Communicator over the expert-parallel group (threads sharing memory on the CPU, NCCL on GPUs).
     * Collective: every rank calls it in the same order. A rank that does not arrive within the
     * configured timeout makes the call return MOERT_ERR_TIMEOUT with a message naming the rank.
     */
    moert_result (*allgather)(const moert_host *h, const void *send, void *recv, size_t bytes_per_rank,
                              moert_device dev, moert_stream s);
    /* Element-wise sum over ranks, in place. dtype: fp32, fp64 or int64. */
    moert_result (*allreduce_sum)(const moert_host *h, void *buf, size_t count, moert_dtype dtype, moert_device dev,
                                  moert_stream s);
    /* Sends send_bytes[r] bytes at send + send_offsets[r] to rank r; receives recv_bytes[r] at
     * recv + recv_offsets[r] from rank r. Arrays have world_size entries, on the host. */
    moert_result (*alltoallv)(const moert_host *h, const void *send, const size_t *send_bytes,
                              const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                              const size_t *recv_offsets, moert_device dev, moert_stream s);
    moert_result (*barrier)(const moert_host *h);
    /* Each rank offers `local` (bytes long, on dev); peers[r] gets a pointer this rank can write to rank
     * r's buffer through (shared memory on the CPU, peer access or CUDA IPC on GPUs). */
    moert_result (*exchange_peer_buffers)(const moert_host *h, void *local, size_t bytes, moert_device dev,
                                          void **peers);

    /* metrics: a named figure for this step's report, e.g. ("dispatch.recv_tokens", 812, "tokens") */
    void (*metric)(const moert_host *h, const char *name, double value, const char *unit);

    /* Appended in ABI 1.1 (check struct_size before use). Declares the capability flags of this instance
     * (MOERT_CAP_GRAPH_CAPTURABLE, MOERT_CAP_NEEDS_HOST_SYNC), replacing the header's for it, where options or
     * the device decide them (e.g. a recipe that syncs the host in one mode and not in another). Call from init. */
    void (*set_flags)(const moert_host *h, uint32_t flags);
};

#ifdef __cplusplus
}
#endif
#endif
