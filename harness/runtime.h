/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's internals (harness/runtime.c): the layer stack on every rank and the step loop, and what tests reach
 * into. The one part of the harness that still includes core-internal headers: the step loop drives the core's
 * stack, executor and activation store directly where the public API has no call yet (docs/api.md, "moert's own
 * trainer"; tests/cli/test_tool_includes.sh names it). */
#ifndef MOERT_HARNESS_RUNTIME_H
#define MOERT_HARNESS_RUNTIME_H

#include "trainer.h"

#include "comm.h"
#include "config.h"
#include "executor.h"
#include "loader.h"
#include "memory_estimate.h"
#include "stack.h"
#include "task.h"

typedef struct moert_rank moert_rank;

struct moert_runtime {
    const moert_config *cfg;
    int world;
    moert_device_type device_type;
    char device_name[400];
    moert_plugin plugins[MOERT_SLOT_COUNT];
    moert_comm_group *comm;              /* host-memory collectives (ranks as threads) */
    struct moert_nccl_group *nccl_group; /* CUDA: device-memory collectives */
    moert_rank *ranks;                   /* the ranks this process hosts: all of them, or one per process */
    int nlocal;                          /* how many: world with threads, 1 with a process per GPU */
    bool processes;                      /* launched as a process per GPU (RANK, WORLD_SIZE, ... set) */
    struct moert_dist_env *dist_env;     /* the launcher's variables, in process mode */
    moert_teacher *teacher;
    bool params_ready;

    /* the last run */
    moert_step_record *records;
    int64_t record_count;
    int64_t *final_counts; /* [num_layers, num_experts] tokens per expert of the last step, all ranks */
    double *final_bias;    /* [num_layers, num_experts] expert bias after the run, or NULL */
    double *bias_start;    /* [num_layers, num_experts] expert bias before the run, or NULL */
    int64_t activation_bytes[MOERT_ACT_COUNT]; /* rank 0, summed over layers, last step */
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
    moert_memory_estimate memory;  /* per rank, estimated before the plugins start (moert check prints it) */
};

/* Tests: whether the ranks hold slot 1 of their layers ($.parallel.overlap_micro_batches), and on the CPU, where a
 * merged forward and backward runs one then the other, `interleave` issues their stages in turn as on CUDA (the
 * same results; it runs the turn-taking in CI). */
bool moert_runtime_overlap_set_interleave(moert_runtime *rt, bool interleave);

/* The relative tolerance a precision recipe declares for the agreement of two runs (moert_precision_v1's
 * agreement_rtol), or MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL where its vtable predates the field or leaves it 0. */
double moert_precision_agreement_rtol(const moert_plugin_header *precision);
#endif
