/* SPDX-License-Identifier: Apache-2.0 */
/* Runtime internals: the layer stack on every rank, the training loop, and what tests reach into. */
#ifndef MOERT_CORE_RUNTIME_H
#define MOERT_CORE_RUNTIME_H

#include "comm.h"
#include "config.h"
#include "executor.h"
#include "loader.h"
#include "memory_estimate.h"
#include "stack.h"
#include "task.h"

/* What one step produced, for the progress line and the report. */
typedef struct moert_step_record {
    int64_t step;
    double loss;        /* mse + router losses */
    double mse;
    double router_loss; /* sum over layers, averaged over ranks */
    double imbalance;   /* max/mean of tokens per expert, averaged over layers */
    double imbalance_max; /* the worst layer's max/mean */
    double seconds;     /* wall time of the step on rank 0 */
    double stage_seconds[MOERT_STAGE_COUNT]; /* rank 0, summed over layers and micro-batches */
    double backward_part_seconds[MOERT_BWD_PART_COUNT]; /* rank 0, summed over layers and micro-batches */
} moert_step_record;

typedef struct moert_rank moert_rank;

struct moert_runtime {
    const moert_config *cfg;
    int world;
    moert_device_type device_type;
    char device_name[400];
    moert_plugin plugins[MOERT_SLOT_COUNT];
    moert_comm_group *comm;          /* host-memory collectives (ranks as threads) */
    struct moert_nccl_group *nccl_group; /* CUDA: device-memory collectives */
    moert_rank *ranks;               /* the ranks this process hosts: all of them, or one per process */
    int nlocal;                      /* how many: world with threads, 1 with a process per GPU */
    bool processes;                  /* launched as a process per GPU (RANK, WORLD_SIZE, ... set) */
    struct moert_dist_env *dist_env; /* the launcher's variables, in process mode */
    moert_teacher *teacher;
    bool params_ready;

    /* the last run */
    moert_step_record *records;
    int64_t record_count;
    int64_t *final_counts;  /* [num_layers, num_experts] tokens per expert of the last step, all ranks */
    double *final_bias;     /* [num_layers, num_experts] expert bias after the run, or NULL */
    double *bias_start;     /* [num_layers, num_experts] expert bias before the run, or NULL */
    int64_t activation_bytes[MOERT_ACT_COUNT]; /* rank 0, summed over layers, last step */
    int64_t kept_bytes;     /* rank 0, activations held from forward to backward, summed over layers */
    int64_t device_peak_bytes; /* CUDA: rank 0's memory pool, peak bytes in use since creation; 0 on the CPU */
    int64_t device_pool_calls; /* CUDA: rank 0's pool, cudaMalloc + cudaFree calls in the last step (0 once warm) */
    int64_t device_pool_calls_total; /* the same since creation (what the last step's figure is taken from) */
    double total_seconds;
    /* CUDA graphs ($.parallel.cuda_graph): set by rank 0 */
    int64_t graph_captured_step;  /* the step whose forward and backward were captured (then replayed); 0: none */
    int64_t graph_replays;        /* steps run by replaying the graphs */
    double graph_capture_seconds; /* wall time of the capturing step's forward and backward */
    bool graph_failed;            /* a capture failed: the run stops with its error */
    char graph_reason[256];       /* why the steps ran without graphs */
    int abandoned_ranks;          /* rank threads left running after a stall: the runtime can only be destroyed, which
                                     then frees nothing (docs/config.md, $.parallel.timeout_s) */
    moert_step_record step_record; /* moert_runtime_step's, filled by rank 0 */
    bool tracing;                  /* moert_train_options.trace_path: each rank records its stage spans */
    double trace_origin;           /* the run's start on the host clock, time 0 of the trace */
    moert_memory_estimate memory;  /* per rank, estimated before the plugins start (moert check prints it) */
};

/* One step's forward and backward on every rank without the optimizer, over all its micro-batches
 * ($.train.micro_batches: their gradients add up; parameter gradients are left in place, router gradients summed over
 * ranks). loss gets the global loss (the micro-batches' mean). For tests and `moert ab`. */
moert_result moert_runtime_forward_backward(moert_runtime *rt, int64_t step, double *loss);

/* One training step on every rank: forward and backward of each micro-batch, the optimizer (Adam step number `step`, >= 1) and the
 * plugins' end_step, as one step of moert_runtime_train. Fills *record (may be NULL) and the runtime's
 * activation figures (activation_bytes, kept_bytes, device_peak_bytes); rt->records is left alone. The step's
 * parameter gradients and output stay in place until the next step (moert_runtime_param, moert_runtime_output).
 * Step s draws the same data in every runtime of the same seed, so two runtimes can be stepped in turn. */
moert_result moert_runtime_step(moert_runtime *rt, int64_t step, moert_step_record *record);

/* Element `index` of the stack's output in the last step, over all ranks ([ranks * tokens_per_rank, hidden],
 * rank-major). CPU runs only. */
moert_result moert_runtime_output(const moert_runtime *rt, int64_t index, double *value);
int64_t moert_runtime_output_numel(const moert_runtime *rt);

/* Reading a step's results in bulk, on any device, to compare two runs (`moert ab`): the ranks this process hosts
 * (all of them with rank threads, one with a process per GPU), each rank's own copy of a tensor. After a step, until
 * the next one. */
int moert_runtime_local_ranks(const moert_runtime *rt);
/* Elements of a local rank's output of the stack ([tokens_per_rank, hidden]) and of its gradient of a parameter
 * (router [E,H] and the shared expert's replicated; fc1 [E_local,H,2F], fc2 [E_local,F,H] its own experts). */
int64_t moert_runtime_local_output_numel(const moert_runtime *rt);
int64_t moert_runtime_local_grad_numel(const moert_runtime *rt, int layer, moert_param_id which);
/* Elements [first, first + count) of every local rank's output (or gradient) as double: out[local * count + i].
 * Each rank copies its slice to the host through its host services (stream-ordered after the step's work on CUDA),
 * waits for the copy, then widens it. */
moert_result moert_runtime_read_output(moert_runtime *rt, int64_t first, int64_t count, double *out);
moert_result moert_runtime_read_grad(moert_runtime *rt, int layer, moert_param_id which, int64_t first, int64_t count,
                                     double *out);

/* The relative tolerance a precision recipe declares for the agreement of two runs (moert_precision_v1's
 * agreement_rtol), or MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL where its vtable predates the field or leaves it 0. */
double moert_precision_agreement_rtol(const moert_plugin_header *precision);
/* The same for the runtime's precision plugin. */
double moert_runtime_agreement_rtol(const moert_runtime *rt);

/* One line on the run's use of CUDA graphs: the step captured and the replays, or why there were none. */
void moert_runtime_graph_summary(const moert_runtime *rt, char *buf, size_t size);

/* One step's figures as a JSON object, as in the run report's "steps" (core/src/report.c). */
json_t *moert_report_step_json(const moert_step_record *record);

/* A parameter element by its global index (router [E,H], fc1 [E,H,2F], fc2 [E,F,H] over all experts):
 * reads value and gradient (from the rank owning it), or writes value (on every rank holding it). */
typedef enum moert_param_access { MOERT_PARAM_READ = 0, MOERT_PARAM_WRITE = 1 } moert_param_access;
moert_result moert_runtime_param(moert_runtime *rt, int layer, moert_param_id which, int64_t index,
                                 moert_param_access access, double *value, double *grad);
int64_t moert_runtime_param_numel(const moert_runtime *rt, moert_param_id which);

#endif
