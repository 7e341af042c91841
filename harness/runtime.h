/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's internals (harness/runtime.c, harness/ranks.c): the layers of every rank this process hosts and the
 * step loop, and what tests reach into. A client of the public API alone (moert/moert.h): the layers, their memory pool, collectives
 * and CUDA graphs through moert_layers_*, the loss and optimizer its own (harness/optim.h). */
#ifndef MOERT_HARNESS_RUNTIME_H
#define MOERT_HARNESS_RUNTIME_H

#include "trace.h"
#include "trainer.h"

#include "task.h"

/* $.parallel.cuda_graph */
typedef enum trainer_graph_mode {
    TRAINER_GRAPH_AUTO = 0,
    TRAINER_GRAPH_OFF = 1,
    TRAINER_GRAPH_ON = 2
} trainer_graph_mode;
/* $.parallel.device */
typedef enum trainer_device_choice {
    TRAINER_DEVICE_AUTO = 0,
    TRAINER_DEVICE_CPU = 1,
    TRAINER_DEVICE_CUDA = 2
} trainer_device_choice;

/* The config's values the trainer reads (moert_config_get_*), once, at creation. */
typedef struct trainer_settings {
    char name[128];
    int64_t num_layers, hidden, ffn_hidden, num_experts, topk;
    moert_dtype dtype;
    int64_t shared_expert_ffn_hidden;
    bool shared_expert_gate;
    int64_t ranks, expert_tensor_parallel, expert_data_parallel;
    trainer_device_choice device;
    double timeout_s;
    trainer_graph_mode cuda_graph;
    int64_t steps, tokens_per_rank, micro_batches, seed, log_every;
    double lr, weight_decay, teacher_scale, input_shift;
    bool repeat_batch; /* $.train.data "repeat" */
    bool sgd;          /* $.train.optimizer "sgd" (else Adam) */
} trainer_settings;

typedef struct moert_rank moert_rank;

struct moert_runtime {
    const moert_config *cfg;
    trainer_settings set;
    int world;
    moert_device_type device_type;
    char device_name[400];
    moert_plugin_description plugins[4]; /* router, dispatcher, precision, memory_policy, as rank 0's layers loaded */
    moert_comm *comm;                    /* the ranks' communicator: threads of this process, or the launcher's */
    moert_rank *ranks;                   /* the ranks this process hosts: all of them, or one per process */
    int nlocal;                          /* how many: world with threads, 1 with a process per GPU */
    bool processes;                      /* launched as a process per GPU (RANK, WORLD_SIZE, ... set) */
    moert_launcher_env env;              /* the launcher's ranks, in process mode */
    moert_teacher *teacher;
    bool params_ready;

    /* the last run */
    moert_step_record *records;
    int64_t record_count;
    int64_t *final_counts; /* [num_layers, num_experts] tokens per expert of the last step, all ranks */
    double *final_bias;    /* [num_layers, num_experts] expert bias after the run, or NULL */
    double *bias_start;    /* [num_layers, num_experts] expert bias before the run, or NULL */
    int64_t activation_bytes[MOERT_LAYER_ACTIVATIONS]; /* rank 0, summed over layers, last step */
    int64_t kept_bytes;        /* rank 0, activations held from forward to backward, summed over layers */
    int64_t device_peak_bytes; /* CUDA: rank 0's memory pool, peak bytes in use since creation; 0 on the CPU */
    int64_t device_pool_calls; /* CUDA: rank 0's pool, cudaMalloc + cudaFree calls in the last step (0 once warm) */
    int64_t device_pool_calls_total; /* the same since creation (what the last step's figure is taken from) */
    double total_seconds;
    /* CUDA graphs ($.parallel.cuda_graph): set by rank 0 */
    int64_t graph_captured_step;   /* the step whose forward and backward were captured (then replayed); 0: none */
    int64_t graph_replays;         /* steps run by replaying the graphs */
    double graph_capture_seconds;  /* wall time of the capturing step's forward and backward */
    bool graph_failed;             /* a capture failed: the run stops with its error */
    char graph_reason[256];        /* why the steps ran without graphs */
    int abandoned_ranks;           /* rank threads left running after a stall: the runtime can only be destroyed, which
                                     then frees nothing (docs/config.md, $.parallel.timeout_s) */
    moert_step_record step_record; /* moert_runtime_step's, filled by rank 0 */
    bool tracing;                  /* moert_train_options.trace_path: each rank records its stage spans */
    double trace_origin;           /* the run's start on the host clock, time 0 of the trace */
    char memory_line[512];         /* per rank, estimated before the plugins start (moert check prints it) */
};

/* One parameter of one layer: the value and gradient bound to the layers, and Adam's moments (NULL data with SGD or
 * where the config has no such parameter). */
typedef struct trainer_param {
    moert_tensor value, grad, m, v;
} trainer_param;

/* Everything one rank owns. */
struct moert_rank {
    moert_runtime *rt;
    int rank;                                   /* in the world */
    int device;                                 /* CUDA ordinal on this host */
    moert_layers *layers;                       /* the rank's MoE layers */
    moert_layers_info info;                     /* their sizes, device and stream */
    trainer_param (*params)[MOERT_PARAM_COUNT]; /* [num_layers] */
    moert_saved **saved;                        /* [num_layers] the forward in flight */
    double *router_losses;                      /* [num_layers] of the last forward run on the host (a replay's too) */
    moert_tensor *acts;                         /* [num_layers + 1] residual stream; acts[0] is the input */
    moert_tensor grad_a, grad_b, target;        /* [T,H] on the device */
    moert_tensor x_host, target_host;           /* [T,H] on the host, fp64 */
    void *workspace;                            /* TRAINER_LOSS_WORKSPACE_BYTES on the device */
    moert_stream stream;                        /* the layers' compute stream (NULL on the CPU) */
    bool batch_loaded;                          /* train.data "repeat": the one batch is on the device */
    /* per step (summed over its micro-batches) */
    double mse_sum, router_loss;
    int64_t *counts;       /* [num_layers * E] tokens per expert, pinned (all-reduced through the stream) */
    int64_t *micro_counts; /* [num_layers * E], pinned: one micro-batch's */
    double stage_seconds[MOERT_LAYER_STAGES]; /* summed over layers and micro-batches */
    double backward_part_seconds[MOERT_LAYER_BACKWARD_PARTS];
    float *loss_result; /* pinned: the loss sum comes back through it */
    moert_trace trace;  /* the stage spans of this rank's streams, when the run is traced */
    /* CUDA graphs ($.parallel.cuda_graph): the layers' forward and backward, captured once, then replayed; one pair
     * per form: [0] a step's first micro-batch (its WGRADs overwrite the expert gradients), [1] the later ones */
    moert_graph *graph_forward[2], *graph_backward[2];
    int64_t eager_steps; /* forward+backward passes run without graphs */
    /* $.parallel.overlap_micro_batches: the layers hold a second slot, and the step merges micro-batch i's forward
     * with micro-batch i-1's backward; odd micro-batches use these buffers and saved activations */
    bool overlap;
    moert_saved **saved1;         /* [num_layers] */
    moert_tensor *acts1, target1; /* [num_layers + 1] and [T,H], made at the first overlapped step */
    bool batch_loaded1;
    /* outcome of the phase running on this rank */
    moert_result rc;
    int fail_order;
    char error[MOERT_ERROR_MAX];
};

/* Tests: whether the ranks hold slot 1 of their layers ($.parallel.overlap_micro_batches), and on the CPU, where a
 * merged forward and backward runs one then the other, `interleave` issues their stages in turn as on CUDA (the
 * same results; it runs the turn-taking in CI). */
bool moert_runtime_overlap_set_interleave(moert_runtime *rt, bool interleave);

/* The relative tolerance a precision recipe declares for the agreement of two runs (moert_precision_v1's
 * agreement_rtol), or MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL where its vtable predates the field or leaves it 0. */
double moert_precision_agreement_rtol(const moert_plugin_header *precision);
#endif
