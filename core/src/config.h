/* SPDX-License-Identifier: Apache-2.0 */
/* Config: the parsed JSON file, typed sections with JSON-path errors and unknown-key checks. */
#ifndef MOERT_CORE_CONFIG_H
#define MOERT_CORE_CONFIG_H

#include <jansson.h>
#include <stdbool.h>

#include "moert/moert.h"

/* The four plugin slots of a config, in the order the executor calls them. */
typedef enum moert_slot {
    MOERT_SLOT_ROUTER = 0,
    MOERT_SLOT_DISPATCHER = 1,
    MOERT_SLOT_PRECISION = 2,
    MOERT_SLOT_MEMORY_POLICY = 3,
    MOERT_SLOT_COUNT
} moert_slot;

/* "router", "dispatcher", "precision", "memory_policy": the config key of each slot. */
const char *moert_slot_key(moert_slot slot);
moert_plugin_kind moert_slot_kind(moert_slot slot);

/* Plain values of the core's own sections, filled by moert_config_parse(). */
typedef struct moert_model_config {
    int64_t hidden, ffn_hidden, num_experts, topk, num_layers;
    moert_dtype dtype;                /* activation storage: fp32, bf16 or fp64 */
    int64_t shared_expert_ffn_hidden; /* width of the shared expert's SwiGLU, 0: none */
    bool shared_expert_gate;          /* the shared expert's output scaled by sigmoid(x . gate) (Qwen2-MoE) */
} moert_model_config;

/* $.parallel.cuda_graph */
typedef enum moert_cuda_graph_mode {
    MOERT_GRAPH_AUTO = 0,
    MOERT_GRAPH_OFF = 1,
    MOERT_GRAPH_ON = 2
} moert_cuda_graph_mode;

/* "auto", "off" or "on": the config's spelling of a mode. */
const char *moert_cuda_graph_mode_name(int mode);

/* $.parallel.overlap_micro_batches: the same three spellings as cuda_graph */
typedef enum moert_overlap_mode {
    MOERT_OVERLAP_AUTO = 0,
    MOERT_OVERLAP_OFF = 1,
    MOERT_OVERLAP_ON = 2
} moert_overlap_mode;

typedef struct moert_parallel_config {
    int64_t ranks; /* every rank: threads on the CPU, one per GPU on CUDA */
    /* the MoE layers' grid over the ranks (docs/parallel.md): expert_parallel x expert_tensor_parallel x
     * expert_data_parallel = ranks */
    int64_t expert_parallel, expert_tensor_parallel, expert_data_parallel;
    int device;                        /* 0 auto, 1 cpu, 2 cuda */
    double timeout_s;                  /* a collective waits this long for a stalled peer */
    int cuda_graph;                    /* moert_cuda_graph_mode */
    bool overlap_wgrad;                /* weight-gradient GEMMs on a second stream beside dispatch_backward */
    bool defer_wgrad_join;             /* under the overlap: a merged call's WGRADs run on past it (docs/executor.md) */
    bool overlap_dgrad_first;          /* under the overlap: a merged call's backward issues its expert GEMMs before the
                                   forward's routing (docs/executor.md) */
    bool overlap_prepare_after_dgrads; /* under the overlap: ... before the forward's prepare, after its routing */
    bool overlap_prepare_own_stream;   /* under the overlap: a host-exchange prepare on the slot's compute stream */
    bool shared_expert_overlap;        /* the shared expert on a second stream beside the routed experts (GPUs) */
    bool offload_defer_start;          /* an offloaded activation's copy starts after the next layer's forward */
    int overlap_micro_batches;         /* moert_overlap_mode: micro-batch i+1's forward merged with i's backward */
    /* under the overlap on CUDA: SMs the other half's persistent GEMMs leave free while a dispatcher call runs
     * (moert_layer_info.sm_yield); 0: the GEMMs keep every SM */
    int64_t overlap_comm_sms;
    /* forwards each layer may hold in flight before their backwards (pipeline schedules): a plugin instance per slot
     * and layer; at least 2 under the overlap */
    int64_t forwards_in_flight;
} moert_parallel_config;

/* Whether $.parallel.overlap_micro_batches turns the overlap on for layers on `device` (a moert_device_type) with `ep`
 * expert-parallel and `etp` expert-tensor-parallel ranks, run with `micro_batches` a step (0 or less: unknown): "on"
 * unless micro_batches is 1; "auto" with 2 or more where it was measured faster (MOERT_OVERLAP_AUTO_MAX_FFN), so a
 * caller that never merges calls pays neither the second slot nor a dispatcher on few SMs. */
bool moert_overlap_enabled(const moert_config *cfg, int device, int64_t ep, int64_t etp, int64_t micro_batches,
                           uint32_t dispatcher_flags);

/* "auto" turns the overlap on for CUDA layers with the "deepep" dispatcher, EP > 1 and experts at most this wide
 * (ffn_hidden / ETP): per routed row the GEMMs do 18 H F flops against 8 H bytes of all-to-all, so narrow experts
 * leave the most communication to hide (docs/executor.md measures qwen3-30b-a3b, deepseek-v3 and mixtral-8x7b). */
#define MOERT_OVERLAP_AUTO_MAX_FFN 1024

/* $.parallel.overlap_comm_sms: the default is deepep's SMs under the overlap (DEEPEP_OVERLAP_SMS); the bound is above
 * any GPU's SM count. */
#define MOERT_OVERLAP_COMM_SMS_DEFAULT 24
#define MOERT_OVERLAP_COMM_SMS_MAX     1024

/* $.parallel.forwards_in_flight: at most this many slots per layer (overlap.h). */
#define MOERT_MAX_FORWARDS_IN_FLIGHT 32

/* $.train.optimizer: Adam keeps two moment buffers per parameter; plain SGD keeps none. */
typedef enum moert_optimizer { MOERT_OPTIMIZER_ADAM = 0, MOERT_OPTIMIZER_SGD = 1 } moert_optimizer;

#define MOERT_MAX_MICRO_BATCHES 65536 /* $.train.micro_batches */

/* Upper bounds of the size keys (docs/config.md). Each is far above any real model, and with them no product of
 * sizes the core or a plugin computes can wrap an int64; moert_config_parse also refuses a config whose largest
 * per-rank buffer would exceed MOERT_MAX_BUFFER_BYTES, more than any device holds. */
#define MOERT_MAX_HIDDEN          65536              /* $.model.hidden */
#define MOERT_MAX_FFN_HIDDEN      262144             /* $.model.ffn_hidden */
#define MOERT_MAX_EXPERTS         16384              /* $.model.num_experts */
#define MOERT_MAX_TOKENS_PER_RANK 16777216           /* $.train.tokens_per_rank and $.train.seq_length */
#define MOERT_MAX_BUFFER_BYTES    ((int64_t)1 << 44) /* 16 TiB */
#define MOERT_MAX_TIMEOUT_S       86400.0            /* $.parallel.timeout_s: a day */
#define MOERT_MAX_STEPS           100000000 /* $.train.steps (the CLI's MOERT_CLI_MAX_STEPS): a record a step */

typedef struct moert_train_config {
    int64_t steps, tokens_per_rank, seq_length, seed, log_every;
    int64_t micro_batches; /* forward+backward passes per optimizer step, tokens_per_rank tokens each (gradient
                              accumulation) */
    double lr, weight_decay;
    double teacher_scale;      /* size of the teacher's output relative to its input */
    double input_shift;        /* inputs are N(input_shift * m, I), m ~ N(0, I) fixed: how unevenly routing starts */
    bool repeat_batch;         /* "data": "repeat": draw one batch and reuse it every step (benchmarks) */
    moert_optimizer optimizer; /* "adam" (default) or "sgd" */
} moert_train_config;

struct moert_config {
    json_t *root;
    char source[512];  /* file name or the name given to load_string */
    char name[128];    /* $.name, or the file's base name */
    char folder[1024]; /* the config file's folder, absolute ("" for a config from a string): relative
                                  plugin paths are taken from it */
    moert_model_config model;
    moert_parallel_config parallel;
    moert_train_config train;
    char plugin[MOERT_SLOT_COUNT][1600]; /* $.<slot>.plugin, a name or a path (a relative path made absolute from
                                            the config's folder) */
};

/* Fills the typed fields from root; every error names the JSON path. Called by the load functions. */
moert_result moert_config_parse(moert_config *cfg);

/* ---- sections: one JSON object read through typed accessors ---- */

typedef struct moert_option_desc {
    char key[64];
    char type[16];   /* "int", "float", "bool", "string", "enum" */
    char def[64];    /* the default, as text */
    char range[192]; /* "[min, max]" or "a|b|c" */
    char help[192];
} moert_option_desc;

typedef struct moert_section moert_section;

/* Opens object `obj` (borrowed; may be NULL for "all defaults") whose JSON path is `path`, e.g. "$.router". */
moert_section *moert_section_create(json_t *obj, const char *path);
void moert_section_free(moert_section *sec);
/* Marks a key as known without reading it (e.g. "plugin"). */
void moert_section_allow(moert_section *sec, const char *key);
/* In describe mode the accessors also record each option (key, type, default, range, help). */
void moert_section_set_describe(moert_section *sec, bool on);
int moert_section_option_count(const moert_section *sec);
const moert_option_desc *moert_section_option(const moert_section *sec, int i);

moert_result moert_section_int(moert_section *sec, const char *key, int64_t def, int64_t min, int64_t max,
                               const char *help, int64_t *out);
moert_result moert_section_float(moert_section *sec, const char *key, double def, double min, double max,
                                 const char *help, double *out);
moert_result moert_section_bool(moert_section *sec, const char *key, bool def, const char *help, bool *out);
moert_result moert_section_string(moert_section *sec, const char *key, const char *def, const char *help,
                                  const char **out);
moert_result moert_section_enum(moert_section *sec, const char *key, const char *const *choices, int def,
                                const char *help, int *out);
/* Fails on the first key never read nor allowed, naming its path and the nearest known key. */
moert_result moert_section_check_unknown(const moert_section *sec);

/* The nearest of `known` to `word` by edit distance, or NULL if none is close. */
const char *moert_nearest_name(const char *word, const char *const *known, int count);

#endif
