/* SPDX-License-Identifier: Apache-2.0 */
/*
 * moert's own trainer: the configured MoE layer stack on every rank of this process, trained on the synthetic task
 * (harness/task.h) with its own loss and optimizer, for `moert run`, `moert ab` and the tests. It is a client of
 * libmoert, not a part of it: nothing here is exported by libmoert.so, and the `moert` command and the tests link
 * it from the harness library (harness/meson.build). docs/api.md, "moert's own trainer".
 */
#ifndef MOERT_HARNESS_TRAINER_H
#define MOERT_HARNESS_TRAINER_H

#include <stdbool.h>
#include <stdio.h>

#include "moert/moert.h"

typedef struct moert_runtime moert_runtime;

/* Loads every plugin, checks all options, and initialises one instance per layer and rank. */
moert_result moert_runtime_create(const moert_config *cfg, moert_runtime **out);
void moert_runtime_destroy(moert_runtime *rt);

typedef struct moert_train_options {
    uint32_t struct_size;
    FILE *progress; /* a line per step goes here; NULL for quiet */
    int64_t steps;  /* 0: the config's train.steps */
    /* a Chrome trace (JSON; Perfetto, chrome://tracing) of the stage spans of every rank's streams over the run, or
     * NULL. With ranks as threads one file holds every rank; with a process per GPU rank N (N > 0) writes
     * trace_path.rankN. */
    const char *trace_path;
    /* with trace_path: every CUDA kernel the ranks ran as well, on its own stream's row (CUPTI; `moert run
     * --trace-kernels`) */
    bool trace_kernels;
} moert_train_options;

/* The first rank this process runs: 0 when one process runs every rank as a thread; RANK when a launcher
 * (torchrun, srun) started a process per GPU. Rank 0's process prints progress and writes reports. */
int moert_runtime_rank(const moert_runtime *rt);

/* Trains the layer stack on the config's synthetic task. */
moert_result moert_runtime_train(moert_runtime *rt, const moert_train_options *opts);
/* Writes every figure of the last run as JSON (harness/report.c). */
moert_result moert_runtime_write_report(const moert_runtime *rt, const char *path);

/* What one step produced, for the progress line and the report. */
typedef struct moert_step_record {
    int64_t step;
    double loss; /* mse + router losses */
    double mse;
    double router_loss;                                       /* sum over layers, averaged over ranks */
    double imbalance;                                         /* max/mean of tokens per expert, averaged over layers */
    double imbalance_max;                                     /* the worst layer's max/mean */
    double seconds;                                           /* wall time of the step on rank 0 */
    double stage_seconds[MOERT_LAYER_STAGES];                 /* rank 0, summed over layers and micro-batches */
    double backward_part_seconds[MOERT_LAYER_BACKWARD_PARTS]; /* rank 0, summed over layers and micro-batches */
} moert_step_record;

/* One plugin of the run, as loaded. */
typedef struct moert_run_plugin {
    const char *kind; /* "router", "dispatcher", "precision", "memory_policy" */
    const char *name, *version, *path;
} moert_run_plugin;

/* The figures of the runtime and its last run (train or step), for reports and comparisons; pointers stay valid
 * until the next run or the runtime's destruction. */
typedef struct moert_run_summary {
    const moert_config *cfg; /* read with moert_config_get_* */
    int world;               /* every rank */
    moert_device_type device_type;
    const char *device_name;          /* e.g. "cpu (4 ranks as threads)" */
    moert_run_plugin plugins[4];      /* router, dispatcher, precision, memory_policy */
    const moert_step_record *records; /* moert_runtime_train's steps */
    int64_t record_count;
    const int64_t *final_counts;           /* [num_layers, num_experts] tokens per expert of the last step, or NULL */
    const double *final_bias, *bias_start; /* [num_layers, num_experts] expert bias after and before, or NULL */
    int64_t activation_bytes[MOERT_LAYER_ACTIVATIONS]; /* rank 0, summed over layers, last step */
    int64_t kept_bytes;        /* rank 0, activations held from forward to backward, summed over layers */
    int64_t device_peak_bytes; /* CUDA: rank 0's memory pool, peak bytes in use; 0 on the CPU */
    int64_t device_pool_calls; /* CUDA: rank 0's pool, cudaMalloc + cudaFree calls in the last step */
    double total_seconds;      /* the last moert_runtime_train */
    int64_t graph_captured_step, graph_replays; /* CUDA graphs ($.parallel.cuda_graph): 0 when none */
    double graph_capture_seconds;
} moert_run_summary;
void moert_runtime_summary(const moert_runtime *rt, moert_run_summary *out);

/* The memory the config needs per rank, estimated before the plugins start (`moert check` prints it). */
void moert_runtime_memory_line(const moert_runtime *rt, char *buf, size_t size);

/* One step's forward and backward on every rank without the optimizer, over all its micro-batches
 * ($.train.micro_batches: their gradients add up; parameter gradients are left in place, router gradients summed over
 * ranks). loss gets the global loss (the micro-batches' mean). For tests and `moert ab`. */
moert_result moert_runtime_forward_backward(moert_runtime *rt, int64_t step, double *loss);

/* One training step on every rank: forward and backward of each micro-batch, the optimizer (Adam step number `step`,
 * >= 1) and the plugins' end_step, as one step of moert_runtime_train. Fills *record (may be NULL) and the runtime's
 * activation figures; the summary's records are left alone. The step's parameter gradients and output stay in place
 * until the next step (moert_runtime_param, moert_runtime_output). Step s draws the same data in every runtime of the
 * same seed, so two runtimes can be stepped in turn. */
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
 * Each rank copies its slice to the host (stream-ordered after the step's work on CUDA), waits for the copy, then
 * widens it. */
moert_result moert_runtime_read_output(moert_runtime *rt, int64_t first, int64_t count, double *out);
moert_result moert_runtime_read_grad(moert_runtime *rt, int layer, moert_param_id which, int64_t first, int64_t count,
                                     double *out);

/* The relative tolerance the runtime's precision plugin declares for the agreement of two runs. */
double moert_runtime_agreement_rtol(const moert_runtime *rt);

/* One line on the run's use of CUDA graphs: the step captured and the replays, or why there were none. */
void moert_runtime_graph_summary(const moert_runtime *rt, char *buf, size_t size);

/* Whether the run's steps merge two micro-batches' halves ($.parallel.overlap_micro_batches took effect). */
bool moert_runtime_overlapped(const moert_runtime *rt);

/* A parameter element by its global index (router [E,H], fc1 [E,H,2F], fc2 [E,F,H] over all experts):
 * reads value and gradient (from the rank owning it), or writes value (on every rank holding it). CPU runs. */
typedef enum moert_param_access { MOERT_PARAM_READ = 0, MOERT_PARAM_WRITE = 1 } moert_param_access;
moert_result moert_runtime_param(moert_runtime *rt, int layer, moert_param_id which, int64_t index,
                                 moert_param_access access, double *value, double *grad);
int64_t moert_runtime_param_numel(const moert_runtime *rt, moert_param_id which);

#endif
