/* SPDX-License-Identifier: Apache-2.0 */
/* The harness shared by the GPU tests of the dispatchers (the peer-buffer ones, tests/gpu/test_gpu_deepep.c and
 * test_gpu_hybridep.c, and the host-collective ones, test_gpu_plugins.c's alltoall, test_gpu_allgather.c and
 * test_gpu_hierarchical.c; CUDA builds only): a case (shape, routing, options), one step's host data, the four calls
 * after prepare(), a CUDA step with poisoned outputs, its comparison with the CPU path (the reference) into a table
 * row, a whole case on one rank (CPU once, CUDA twice), and the table. A test describes its dispatcher with a
 * gpu_dispatch_plugin and keeps its own cases and its plugin-specific runs (stalled peers, graphs). */
#ifndef MOERT_GPU_DISPATCH_TEST_HARNESS_H
#define MOERT_GPU_DISPATCH_TEST_HARNESS_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu_test_util.h"
#include "moert/dispatcher.h"

#define GPU_DISPATCH_CASE_TIMEOUT "5000" /* timeout_ms of every case's instances */

/* One case: the layer's shape, the routing, the plugin's options. */
typedef struct gpu_dispatch_case {
    const char *name;
    moert_dtype dtype;
    int64_t hidden, experts, topk, tokens; /* rank r has tokens + 5*r tokens */
    double drop;                           /* probability that a copy is dropped (-1) */
    double hot;                            /* probability that a copy goes to expert 0 */
    bool starve_last;                      /* the last rank's experts receive nothing (world > 1) */
    bool empty_first;                      /* rank 0 has no tokens */
    bool drop_whole;                       /* every fourth token has all its copies dropped */
    const char *options;
} gpu_dispatch_case;

/* A case's figures in one world, summed (diffs, bytes) or the largest (errors) over its ranks and steps. */
typedef struct gpu_dispatch_row {
    int world;
    const char *name;
    int64_t recv_rows, layout_diffs, dispatch_diffs, combine_bytes, cb_diffs, dx_bytes, dprobs_diffs, repeat_diffs;
    double combine_err, dx_err, tol;
    bool ran;
    int64_t step2_mallocs; /* cudaMalloc calls of the pool during the second CUDA step (count_step2_mallocs) */
    double figures[2];     /* the plugin's figures of the second CUDA step, summed over ranks */
} gpu_dispatch_row;

/* The stalled-peer run of one world: what rank 0 saw, and when. */
typedef struct gpu_dispatch_stall_row {
    int world;
    bool ran, ok;
    double seconds;
    char message[200];
} gpu_dispatch_stall_row;

/* Guards the table rows, written by every rank thread: take it to update a row. */
extern pthread_mutex_t gpu_dispatch_table_lock;

/* Inputs and outputs of one step on one rank (host copies). */
typedef struct gpu_dispatch_step {
    int64_t T, H, K, cap;
    int64_t nrecv; /* rows of recv_x (and of d_y_expert) that hold data, from the CPU's layout */
    size_t es;
    int32_t *idx;
    void *x, *d_y, *d_x0, *y_expert, *d_recv_x;
    float *probs, *d_recv_probs;
    int64_t tokens_per_expert[256];
    void *recv_x, *y, *d_y_expert, *d_x; /* recv_x with 2 rows past capacity */
    float *recv_probs, *d_topk_probs;
    int64_t num_recv; /* the CPU layout's num_recv (gpu_dispatch_read_host_cpu_layout) */
} gpu_dispatch_step;

/* What the harness needs to know of the dispatcher under test. */
typedef struct gpu_dispatch_plugin {
    const char *name; /* the plugin's name, as "dispatcher": {"plugin": ...} gives it */
    int max_world;    /* the layers are sized for the largest rank of this world: tokens + 5 * max_world rows */
    /* From the CPU path's layout: d->nrecv and d->tokens_per_expert (local_experts of them). */
    void (*read_cpu_layout)(const moert_dispatch_layout *layout, int64_t local_experts, gpu_dispatch_step *d);
    /* From a CUDA step's layout and its counts downloaded from the device: o->tokens_per_expert (compared with the
     * CPU's) and the checks of the layout's host side. */
    void (*read_cuda_layout)(const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                             const moert_dispatch_layout *layout, const int64_t *device_counts, gpu_dispatch_step *o);
    /* The plugin has no timeout_ms option (the host-collective dispatchers: the communicator's timeout serves): the
     * case's options are given as they are. */
    bool no_timeout_option;
    /* The second CUDA step must make no cudaMalloc in the rank's pool (its buffers reused); a "malloc" column. */
    bool count_step2_mallocs;
    /* Up to two metrics of the CUDA instance (e.g. "dispatch.bytes_internode"), their last value in the second
     * step summed over ranks into the table under figure_labels; NULL: none. */
    const char *figures[2];
    const char *figure_labels[2];
} gpu_dispatch_plugin;

/* read_cpu_layout and read_cuda_layout of the dispatchers that sync with the host in prepare() (alltoall, allgather,
 * hierarchical): every row up to capacity is compared (padding rows are zeros on both paths); the CUDA layout must
 * have the CPU's num_recv, its counts on the rank's GPU and a host copy of them equal to the device's. */
void gpu_dispatch_read_host_cpu_layout(const moert_dispatch_layout *layout, int64_t local_experts,
                                       gpu_dispatch_step *d);
void gpu_dispatch_read_host_cuda_layout(const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                                        const moert_dispatch_layout *layout, const int64_t *device_counts,
                                        gpu_dispatch_step *o);

/* topk_idx [tokens, topk]: distinct experts per token, some dropped, optionally one hot expert, a starved rank,
 * dropped tokens. */
void gpu_dispatch_make_routing(const gpu_dispatch_case *cs, int world, int64_t tokens, uint64_t *rng, int32_t *idx);

/* Host buffers for the outputs of a step shaped as d (recv_x with 2 rows past capacity). */
void gpu_dispatch_outputs_alloc(gpu_dispatch_step *o, const gpu_dispatch_step *d);
void gpu_dispatch_outputs_free(gpu_dispatch_step *o);

/* The four calls after prepare() on tensors of `dev` (host pointers on the CPU, device pointers on the GPU), shaped
 * as d; counts a failure and returns false at the first call that fails. */
bool gpu_dispatch_run_calls(test_instance *ti, moert_stream stream, moert_device dev, moert_dtype dt,
                            const gpu_dispatch_step *d, void *x, void *probs, void *recv_x, void *recv_probs,
                            void *y_expert, void *y, void *d_y, void *d_y_expert, void *d_recv_x, void *d_recv_probs,
                            void *d_x, void *d_topk_probs, const char *where);

/* One CUDA step (prepare and the four calls) with poisoned outputs, downloaded into o. in: the device copies of
 * idx, x, probs, y_expert, d_y, d_recv_x and d_recv_probs of d. */
bool gpu_dispatch_cuda_step(const gpu_dispatch_plugin *plugin, const gpu_test_rank_env *env, test_instance *ti,
                            const gpu_dispatch_case *cs, const gpu_dispatch_step *d, void *const *in,
                            gpu_dispatch_step *o);

/* Compares the CUDA step g with the CPU reference d into row; counts a failure past the row's tolerance. */
void gpu_dispatch_compare(const gpu_test_rank_env *env, const gpu_dispatch_case *cs, const gpu_dispatch_step *d,
                          const gpu_dispatch_step *g, gpu_dispatch_row *row);

/* Case number ci on one rank: CPU once, CUDA twice, compared. Every rank makes the same collective calls in order. */
void gpu_dispatch_run_case(const gpu_dispatch_plugin *plugin, const gpu_test_rank_env *env, const gpu_dispatch_case *cs,
                           int ci, gpu_dispatch_row *row);

/* Readies the rows of `count` cases in one world for gpu_dispatch_print_rows. */
void gpu_dispatch_rows_init(gpu_dispatch_row *rows, int world, const gpu_dispatch_case *cases, int count);

/* Prints the table of the rows that ran, under a title naming the plugin. */
void gpu_dispatch_print_rows(const gpu_dispatch_plugin *plugin, const gpu_dispatch_row *rows, int count);

#endif
