/* SPDX-License-Identifier: Apache-2.0 */
/* moert's own trainer: loads the configured plugins, runs one thread per rank, and trains the layer stack on the
 * synthetic task. Part of the harness (harness/trainer.h), not of libmoert; the step loop still drives the core's
 * stack, executor and activation store directly (docs/api.md, "moert's own trainer", lists what it reaches). */
#include "runtime.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "host.h"
#include "log.h"
#include "overlap.h"
#include "tensor_ops.h"
#include "trace.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#endif

/* Everything one rank owns. */
struct moert_rank {
    moert_runtime *rt;
    int rank;                            /* in the expert-parallel group */
    int device;                          /* CUDA ordinal on this host */
    moert_stack stack;                   /* the layers, their plugin instances and services */
    moert_host *core_host;               /* stack.core_host */
    moert_layer *layers;                 /* stack.layers: [num_layers] */
    moert_tensor *acts;                  /* [num_layers + 1] residual stream; acts[0] is the input */
    moert_tensor grad_a, grad_b, target; /* [T,H] on the device */
    moert_tensor x_host, target_host;    /* [T,H] on the host, fp64 */
    void *workspace;                     /* MOERT_SQUARED_ERROR_WORKSPACE_BYTES on the device */
    moert_stream stream;                 /* the rank's compute stream (NULL on the CPU) */
    struct moert_cuda_pool *pool;        /* CUDA ranks */
    struct moert_nccl_comm *nccl;        /* CUDA ranks */
    bool batch_loaded;                   /* train.data "repeat": the one batch is on the device */
    /* per step (summed over its micro-batches) */
    double mse_sum, router_loss;
    int64_t *counts;       /* [num_layers * E] tokens per expert, pinned (all-reduced through the stream) */
    int64_t *micro_counts; /* [num_layers * E], pinned: one micro-batch's, copied into while copy
                                            streams are busy */
    double stage_seconds[MOERT_STAGE_COUNT]; /* summed over layers and micro-batches */
    double backward_part_seconds[MOERT_BWD_PART_COUNT];
    float *loss_result; /* pinned: the loss sum comes back through it */
    moert_trace trace;  /* the stage spans of this rank's streams, when the run is traced */
    /* CUDA graphs ($.parallel.cuda_graph): the stack's forward and backward, captured once, then replayed; one pair
     * per form: [0] a step's first micro-batch (its WGRADs overwrite the expert gradients), [1] the later ones */
    void *graph_forward[2], *graph_backward[2]; /* moert_cuda_graph */
    int64_t eager_steps;                        /* forward+backward passes run without graphs */
    /* $.parallel.overlap_micro_batches (rank_forward_backward_overlapped): slot 1 of every layer and the input,
     * residual stream and target of the micro-batch it holds (slot 0's are acts and target) */
    moert_overlap overlap;
    moert_tensor *acts1, target1;
    bool batch_loaded1;
    /* outcome of the phase running on this rank */
    moert_result rc;
    int fail_order;
    char error[2048];
};

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- running a phase on every rank ---- */

typedef moert_result (*rank_phase_fn)(moert_rank *r, void *arg);

typedef struct phase_run phase_run;

typedef struct phase_call {
    moert_rank *r;
    rank_phase_fn fn;
    void *arg;
    atomic_int *fail_counter;
    phase_run *run; /* NULL when the caller's thread runs the only rank */
} phase_call;

/* One run_on_ranks call with rank threads: heap-allocated, so that a rank thread abandoned after a stall (it may
 * still wake up and finish) never touches freed memory; it is then left allocated on purpose. */
struct phase_run {
    pthread_mutex_t lock;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
    int running;         /* rank threads not finished */
    bool finished[64];
    atomic_int fail_counter;
    phase_call calls[64];
    pthread_t threads[64];
};

/* Once a rank failed (a peer stalled past $.parallel.timeout_s, or any error), the other ranks get this long to
 * return before they are abandoned: between 1 and 5 s, timeout_s where it is shorter. */
static double stall_grace_s(const moert_runtime *rt)
{
    double t = rt->cfg->parallel.timeout_s;
    return t < 1.0 ? 1.0 : t > 5.0 ? 5.0 : t;
}

static void *phase_main(void *p)
{
    phase_call *c = p;
    moert_rank *r = c->r;
    moert_error_clear();
#ifdef MOERT_HAVE_CUDA
    if (r->rt->device_type == MOERT_DEVICE_CUDA) {
        r->rc = moert_cuda_set_device(r->device);
        if (r->rc == MOERT_OK) r->rc = c->fn(r, c->arg);
    } else {
        r->rc = c->fn(r, c->arg);
    }
#else
    r->rc = c->fn(r, c->arg);
#endif
    if (r->rc != MOERT_OK) {
        r->fail_order = atomic_fetch_add(c->fail_counter, 1);
        snprintf(r->error, sizeof r->error, "%s", moert_error_message());
        /* release peers waiting for this rank in a collective */
        if (r->rt->comm) moert_comm_abort(r->rt->comm, r->rank, r->error);
#ifdef MOERT_HAVE_CUDA
        if (r->nccl) moert_nccl_comm_abort(r->nccl, r->error);
#endif
    }
    if (c->run) {
        pthread_mutex_lock(&c->run->lock);
        c->run->finished[c - c->run->calls] = true;
        c->run->running--;
        pthread_cond_broadcast(&c->run->cond);
        pthread_mutex_unlock(&c->run->lock);
    }
    return NULL;
}

/* The monotonic time `seconds` from now. */
static struct timespec monotonic_after(double seconds)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long nanos = t.tv_nsec + (long long)(seconds * 1e9);
    t.tv_sec += (time_t)(nanos / 1000000000LL);
    t.tv_nsec = (long)(nanos % 1000000000LL);
    return t;
}

/* Waits for the rank threads of run; once one failed, waits at most the stall grace more. Returns the number of
 * threads that did not finish (then left running, detached). The caller holds no lock. */
static int wait_for_ranks(moert_runtime *rt, phase_run *run)
{
    bool failing = false;
    struct timespec deadline = {0, 0};
    pthread_mutex_lock(&run->lock);
    while (run->running > 0) {
        if (!failing && atomic_load(&run->fail_counter) > 0) {
            failing = true;
            deadline = monotonic_after(stall_grace_s(rt));
        }
        /* a rank failing does not signal the condition: look again every 100 ms */
        struct timespec wake = monotonic_after(0.1);
        if (failing &&
            (deadline.tv_sec < wake.tv_sec || (deadline.tv_sec == wake.tv_sec && deadline.tv_nsec < wake.tv_nsec)))
            wake = deadline;
        int w = pthread_cond_timedwait(&run->cond, &run->lock, &wake);
        if (failing && w == ETIMEDOUT && wake.tv_sec == deadline.tv_sec && wake.tv_nsec == deadline.tv_nsec) break;
    }
    int left = run->running;
    pthread_mutex_unlock(&run->lock);
    return left;
}

/* Runs fn on every rank, one thread each; the first rank to fail gives the error. A rank that has not returned
 * within the stall grace after another failed (a stalled rank its peers timed out on) is abandoned: the call returns
 * MOERT_ERR_TIMEOUT naming it, and the runtime can only be destroyed (which then frees nothing the rank may use). */
static moert_result run_on_ranks(moert_runtime *rt, rank_phase_fn fn, void *arg)
{
    if (rt->abandoned_ranks > 0)
        return moert_error(MOERT_ERR_TIMEOUT, "%d rank%s of this runtime stalled and %s abandoned: destroy it",
                           rt->abandoned_ranks, rt->abandoned_ranks == 1 ? "" : "s",
                           rt->abandoned_ranks == 1 ? "was" : "were");
    for (int i = 0; i < rt->nlocal; i++) {
        rt->ranks[i].rc = MOERT_OK;
        rt->ranks[i].fail_order = -1;
    }
    if (rt->nlocal == 1) {
        atomic_int fail_counter = 0;
        phase_call call = {&rt->ranks[0], fn, arg, &fail_counter, NULL};
        phase_main(&call);
    } else {
        phase_run *run = calloc(1, sizeof *run);
        if (!run) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "run_on_ranks: out of memory");
        pthread_mutex_init(&run->lock, NULL);
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&run->cond, &attr);
        pthread_condattr_destroy(&attr);
        for (int i = 0; i < rt->nlocal; i++)
            run->calls[i] = (phase_call){&rt->ranks[i], fn, arg, &run->fail_counter, run};
        int started = 0;
        int err = 0;
        pthread_mutex_lock(&run->lock);
        while (started < rt->nlocal &&
               (err = pthread_create(&run->threads[started], NULL, phase_main, &run->calls[started])) == 0) {
            started++;
            run->running++;
        }
        pthread_mutex_unlock(&run->lock);
        char why[160] = "";
        if (started < rt->nlocal) {
            /* the ranks already started use run and the runtime: fail the group so that none waits for the
             * missing rank in a collective, and wait for them before returning */
            snprintf(why, sizeof why, "pthread_create for rank %d failed: %s", rt->ranks[started].rank, strerror(err));
            if (rt->comm) moert_comm_abort(rt->comm, rt->ranks[started].rank, why);
            atomic_fetch_add(&run->fail_counter, 1);
        }
        int left = wait_for_ranks(rt, run);
        char stalled[256] = "";
        for (int i = 0; i < started; i++) {
            if (run->finished[i]) {
                pthread_join(run->threads[i], NULL);
            } else { /* stuck: left running, with run, the ranks and the runtime left allocated */
                pthread_detach(run->threads[i]);
                size_t used = strlen(stalled);
                snprintf(stalled + used, sizeof stalled - used, "%s%d", used ? ", " : "", rt->ranks[i].rank);
            }
        }
        if (left > 0) {
            rt->abandoned_ranks = left;
            char first[2400] = "";
            for (int i = 0; i < rt->nlocal; i++)
                if (rt->ranks[i].fail_order == 0 && run->finished[i])
                    snprintf(first, sizeof first, "rank %d: %s", rt->ranks[i].rank, rt->ranks[i].error);
            return moert_error(MOERT_ERR_TIMEOUT, "%s%s%s %s still running %.1f s later and abandoned (stalled)",
                               first[0] ? first : why, first[0] || why[0] ? "; " : "", left == 1 ? "rank" : "ranks",
                               stalled, stall_grace_s(rt));
        }
        pthread_cond_destroy(&run->cond);
        pthread_mutex_destroy(&run->lock);
        free(run);
        if (why[0]) return moert_error(MOERT_ERR_INTERNAL, "%s", why);
    }
    for (int i = 0; i < rt->nlocal; i++)
        if (rt->ranks[i].fail_order == 0) {
            /* a config error reads the same on every rank: no rank prefix */
            if (rt->world == 1 || rt->ranks[i].rc == MOERT_ERR_CONFIG)
                return moert_error(rt->ranks[i].rc, "%s", rt->ranks[i].error);
            return moert_error(rt->ranks[i].rc, "rank %d: %s", rt->ranks[i].rank, rt->ranks[i].error);
        }
    return MOERT_OK;
}

/* ---- creation ---- */

/*
 * A launcher (torchrun, or srun with the variables exported) started one process per GPU when RANK and
 * WORLD_SIZE are set: this process is then one rank, on GPU LOCAL_RANK, and NCCL is bootstrapped from
 * MASTER_ADDR/MASTER_PORT (MOERT_BOOTSTRAP_PORT overrides the port). Without them, one process runs every rank
 * as a thread.
 */
static moert_result detect_processes(moert_runtime *rt)
{
    if (!getenv("WORLD_SIZE") || !getenv("RANK")) return MOERT_OK;
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    rt->dist_env = calloc(1, sizeof *rt->dist_env);
    MOERT_CHECK_ALLOC(rt->dist_env);
    MOERT_CHECK(moert_dist_env_read(rt->dist_env));
    if (rt->dist_env->world_size != rt->world)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.ranks: %d ranks, but the launcher started %d "
                           "processes (WORLD_SIZE)",
                           rt->world, rt->dist_env->world_size);
    if (rt->cfg->parallel.device == 1)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.device: \"cpu\", but the launcher started a "
                           "process per rank (RANK, WORLD_SIZE set); on the CPU run moert without a launcher (ranks "
                           "as threads)");
    rt->processes = true;
fail:
    return rc;
#else
    return moert_error(MOERT_ERR_UNSUPPORTED,
                       "launched as a process per rank (WORLD_SIZE=%s), but this build has "
                       "no CUDA/NCCL; run moert without a launcher (ranks as threads)",
                       getenv("WORLD_SIZE"));
#endif
}

/* "auto": the GPUs when this build has CUDA and enough of them answer, else the CPU. */
static moert_result choose_device(moert_runtime *rt)
{
    int want = rt->cfg->parallel.device; /* 0 auto, 1 cpu, 2 cuda */
    int gpus = 0;
#ifdef MOERT_HAVE_CUDA
    if (want != 1 && moert_cuda_device_count(&gpus) != MOERT_OK) gpus = 0;
    if (rt->processes) {
        int device = rt->dist_env->local_rank;
        moert_cuda_device_info info;
        if (gpus <= device)
            return moert_error(MOERT_ERR_UNSUPPORTED, "rank %d: LOCAL_RANK %d but %d GPU%s answer on this host",
                               rt->dist_env->rank, device, gpus, gpus == 1 ? "" : "s");
        rt->device_type = MOERT_DEVICE_CUDA;
        if (moert_cuda_device_info_get(device, &info) != MOERT_OK) snprintf(info.name, sizeof info.name, "GPU");
        snprintf(rt->device_name, sizeof rt->device_name, "cuda (%d x %s, a process per GPU)", rt->world, info.name);
        return MOERT_OK;
    }
#endif
    if (want == 2 && gpus == 0)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "config error at $.parallel.device: \"cuda\" asked for, but %s; use \"cpu\" or \"auto\"",
#ifdef MOERT_HAVE_CUDA
                           "no GPU answers on this machine"
#else
                           "this build has no CUDA (configure with -Dcuda=enabled)"
#endif
        );
    if (want == 2 && gpus < rt->world)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.parallel.ranks: %d ranks on \"cuda\" need %d GPUs, "
                           "this machine has %d",
                           rt->world, rt->world, gpus);
    if (gpus >= rt->world && want != 1) {
        rt->device_type = MOERT_DEVICE_CUDA;
#ifdef MOERT_HAVE_CUDA
        moert_cuda_device_info info;
        if (moert_cuda_device_info_get(0, &info) == MOERT_OK)
            snprintf(rt->device_name, sizeof rt->device_name, "cuda (%d x %s, a thread per GPU)", rt->world, info.name);
        else
#endif
            snprintf(rt->device_name, sizeof rt->device_name, "cuda (%d GPUs, a thread per GPU)", rt->world);
        return MOERT_OK;
    }
    rt->device_type = MOERT_DEVICE_CPU;
    snprintf(rt->device_name, sizeof rt->device_name, "cpu (%d rank%s as threads%s)", rt->world,
             rt->world > 1 ? "s" : "", gpus > 0 ? "; fewer GPUs than ranks" : "");
    return MOERT_OK;
}

/* $.parallel.overlap_micro_batches: slot 1 of the layers, its buffers, and the overlapped step (defined below) */
static moert_result overlap_init(moert_rank *r, const moert_stack_setup *setup);
static void overlap_finalize(moert_rank *r, moert_device device);
static moert_result rank_forward_backward_overlapped(moert_rank *r, int64_t step);
static const moert_layer *overlap_last_layer(const moert_rank *r, int l);

/* Creates this rank's services and one instance of every plugin per layer. */
static moert_result rank_init(moert_rank *r, void *arg)
{
    (void)arg;
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const moert_config *cfg = rt->cfg;
    int nl = (int)cfg->model.num_layers;
    moert_device device = {rt->device_type, rt->device_type == MOERT_DEVICE_CUDA ? r->device : 0};

#ifdef MOERT_HAVE_CUDA
    if (rt->device_type == MOERT_DEVICE_CUDA) {
        MOERT_CHECK(moert_cuda_pool_create(r->device, &r->pool));
        /* the compute stream outranks the plugins' and the executor's side streams: a dispatcher's kernels there take
         * SMs first when a side stream's GEMM runs beside them (docs/executor.md, "Backward overlap") */
        MOERT_CHECK(moert_cuda_stream_create_high_priority(r->device, &r->stream));
        if (rt->processes)
            MOERT_CHECK(moert_nccl_comm_init_env(rt->dist_env, r->device, cfg->parallel.timeout_s, &r->nccl));
        else
            MOERT_CHECK(moert_nccl_comm_init_thread(rt->nccl_group, r->rank, r->device, &r->nccl));
    }
#endif
    moert_stack_setup setup = {.cfg = cfg,
                               .plugins = rt->plugins,
                               .rank = r->rank,
                               .world = rt->world,
                               .device = device,
                               .max_tokens = cfg->train.tokens_per_rank,
                               .comm = rt->comm,
                               .etp = (int)cfg->parallel.expert_tensor_parallel,
                               .edp = (int)cfg->parallel.expert_data_parallel,
                               .pool = r->pool,
                               .nccl = r->nccl,
                               .stream = r->stream};
    rc = moert_stack_init(&r->stack, &setup);
    r->core_host = r->stack.core_host;
    r->layers = r->stack.layers;
    if (rc != MOERT_OK) goto fail;
    MOERT_CHECK(r->core_host->alloc(r->core_host, device, MOERT_SQUARED_ERROR_WORKSPACE_BYTES, &r->workspace));
    r->acts = calloc((size_t)nl + 1, sizeof *r->acts);
    MOERT_CHECK_ALLOC(r->acts);
    /* Pinned, so the small device-to-host copies of the step never wait behind an offload copy of
     * the copy engines as pageable copies do (the host thread would block and the GPU idle). */
    const size_t counts_bytes = (size_t)nl * (size_t)cfg->model.num_experts * sizeof *r->counts;
    int64_t **counts[2] = {&r->counts, &r->micro_counts};
    for (int i = 0; i < 2; i++) {
        MOERT_CHECK(r->core_host->alloc_pinned(r->core_host, counts_bytes, (void **)counts[i]) == MOERT_OK
                        ? MOERT_OK
                        : moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s", moert_host_take_error(r->core_host)));
        memset(*counts[i], 0, counts_bytes);
    }
    MOERT_CHECK(r->core_host->alloc_pinned(r->core_host, sizeof *r->loss_result, (void **)&r->loss_result) == MOERT_OK
                    ? MOERT_OK
                    : moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s", moert_host_take_error(r->core_host)));
    /* offload copies start as soon as an activation is produced; $.parallel.offload_defer_start starts them after the
     * next layer's forward instead (the last layer's at once): docs/executor.md, "Deferred start" */
    const bool defer_start = cfg->parallel.offload_defer_start;
    for (int l = 0; l < nl; l++) {
        moert_layer *L = &r->layers[l];
        L->acts.defer_release = true; /* released once their copies finish (rank_forward_backward) */
        L->acts.defer_start = l + 1 < cfg->model.num_layers && defer_start;
    }
    MOERT_CHECK(overlap_init(r, &setup));
    return MOERT_OK;
fail:
    return rc;
}

static moert_result rank_finalize(moert_rank *r, void *arg)
{
    (void)arg;
    moert_runtime *rt = r->rt;
    int nl = (int)rt->cfg->model.num_layers;
#ifdef MOERT_HAVE_CUDA
    if (r->stream) moert_cuda_stream_synchronize(r->stream);
    for (int form = 0; form < 2; form++) {
        moert_cuda_graph_destroy(r->graph_forward[form]);
        moert_cuda_graph_destroy(r->graph_backward[form]);
        r->graph_forward[form] = r->graph_backward[form] = NULL;
    }
#endif
    if (r->core_host) {
        /* the device the rank's buffers were allocated on (the layers' info may not be filled when init failed) */
        moert_device device = {rt->device_type, rt->device_type == MOERT_DEVICE_CUDA ? r->device : 0};
        overlap_finalize(r, device);
        /* the layers (and their parameters) go first, while the services they free through still exist */
        for (int l = 0; r->layers && l < nl; l++) moert_layer_free(&r->layers[l]);
        for (int l = 0; r->acts && l <= nl; l++)
            if (r->acts[l].data) r->core_host->free(r->core_host, r->acts[l].device, r->acts[l].data);
        moert_tensor *bufs[3] = {&r->grad_a, &r->grad_b, &r->target};
        for (int i = 0; i < 3; i++)
            if (bufs[i]->data) r->core_host->free(r->core_host, bufs[i]->device, bufs[i]->data);
        if (r->workspace) r->core_host->free(r->core_host, device, r->workspace);
        if (r->counts) r->core_host->free_pinned(r->core_host, r->counts);
        if (r->micro_counts) r->core_host->free_pinned(r->core_host, r->micro_counts);
        if (r->loss_result) r->core_host->free_pinned(r->core_host, r->loss_result);
    }
    free(r->x_host.data);
    free(r->target_host.data);
    moert_trace_clear(&r->trace);
    moert_stack_finalize(&r->stack);
    r->core_host = NULL;
    r->layers = NULL;
#ifdef MOERT_HAVE_CUDA
    if (r->stream) moert_cuda_stream_synchronize(r->stream);
    if (r->pool && moert_cuda_pool_reserve_release(r->pool) != MOERT_OK) moert_error_clear();
    if (r->pool) moert_cuda_pool_destroy(r->pool);
    if (r->stream) moert_cuda_stream_destroy(r->stream);
    if (r->nccl) moert_nccl_comm_free(r->nccl);
    r->pool = NULL;
    r->stream = NULL;
    r->nccl = NULL;
#endif
    free(r->acts);
    return MOERT_OK;
}

moert_result moert_runtime_create(const moert_config *cfg, moert_runtime **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    moert_runtime *rt = calloc(1, sizeof *rt);
    MOERT_CHECK_ALLOC(rt);
    rt->cfg = cfg;
    rt->world = (int)cfg->parallel.ranks;
    MOERT_CHECK(detect_processes(rt));
    MOERT_CHECK(choose_device(rt));
    /* refuse what cannot fit before any plugin starts or any rank allocates */
    moert_memory_estimate_config(cfg, rt->world, rt->device_type, &rt->memory);
    MOERT_CHECK(moert_memory_estimate_check(cfg, &rt->memory));
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) {
        rc = moert_plugin_load(moert_slot_kind((moert_slot)s), cfg->plugin[s], &rt->plugins[s]);
        if (rc != MOERT_OK) {
            moert_error_prefix("config error at $.%s.plugin", moert_slot_key((moert_slot)s));
            goto fail;
        }
    }
    /* threads: a shared-memory group for host buffers and one NCCL group; processes: NCCL from the environment */
    if (rt->world > 1 && !rt->processes)
        MOERT_CHECK(moert_comm_group_create(rt->world, cfg->parallel.timeout_s, &rt->comm));
#ifdef MOERT_HAVE_CUDA
    if (rt->device_type == MOERT_DEVICE_CUDA && !rt->processes)
        MOERT_CHECK(moert_nccl_group_create(rt->world, cfg->parallel.timeout_s, &rt->nccl_group));
#endif
    rt->nlocal = rt->processes ? 1 : rt->world;
    rt->ranks = calloc((size_t)rt->nlocal, sizeof *rt->ranks);
    MOERT_CHECK_ALLOC(rt->ranks);
    for (int i = 0; i < rt->nlocal; i++) {
        rt->ranks[i].rt = rt;
        rt->ranks[i].rank = i;
        rt->ranks[i].device = i;
    }
#ifdef MOERT_HAVE_CUDA
    if (rt->processes) {
        rt->ranks[0].rank = rt->dist_env->rank;
        rt->ranks[0].device = rt->dist_env->local_rank;
    }
#endif
    MOERT_CHECK(run_on_ranks(rt, rank_init, NULL));
    *out = rt;
    return MOERT_OK;
fail:
    if (rt) {
        char saved[4096];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        moert_runtime_destroy(rt);
        moert_error(rc, "%s", saved);
    }
    return rc;
}

void moert_runtime_destroy(moert_runtime *rt)
{
    if (!rt) return;
    /* a stalled rank left running may still use all of it (its rank, the group, the plugins): nothing is freed */
    if (rt->abandoned_ranks > 0) return;
    if (rt->ranks) {
        /* finalize on one thread per rank too: a plugin may tie resources to its rank's thread */
        run_on_ranks(rt, rank_finalize, NULL);
    }
    if (rt->comm) moert_comm_group_free(rt->comm);
#ifdef MOERT_HAVE_CUDA
    if (rt->nccl_group) moert_nccl_group_free(rt->nccl_group);
#endif
    for (int s = 0; s < MOERT_SLOT_COUNT; s++)
        if (rt->plugins[s].dl) moert_plugin_unload(&rt->plugins[s]);
    moert_teacher_free(rt->teacher);
    free(rt->ranks);
    free(rt->dist_env);
    free(rt->records);
    free(rt->final_counts);
    free(rt->final_bias);
    free(rt->bias_start);
    free(rt);
}

/* ---- the training step ---- */

static moert_result rank_alloc_tensor(moert_rank *r, moert_tensor *t, moert_dtype dtype, int64_t rows, int64_t cols)
{
    moert_device dev = r->layers[0].info.device;
    *t = moert_tensor_2d(NULL, dev, dtype, rows, cols);
    moert_result rc = r->core_host->alloc(r->core_host, dev, moert_tensor_bytes(t), &t->data);
    if (rc != MOERT_OK) return moert_error(rc, "allocating activations: %s", moert_host_take_error(r->core_host));
    return MOERT_OK;
}

/* Parameters, optimizer state and step buffers of one rank. */
static moert_result rank_prepare(moert_rank *r, void *arg)
{
    (void)arg;
    moert_result rc = MOERT_OK;
    const moert_config *cfg = r->rt->cfg;
    int64_t t = cfg->train.tokens_per_rank, h = cfg->model.hidden;
    for (int l = 0; l < cfg->model.num_layers; l++)
        MOERT_CHECK(moert_layer_init_params(&r->layers[l], (uint64_t)cfg->train.seed));
    for (int l = 0; l <= cfg->model.num_layers; l++)
        MOERT_CHECK(rank_alloc_tensor(r, &r->acts[l], cfg->model.dtype, t, h));
    MOERT_CHECK(rank_alloc_tensor(r, &r->grad_a, cfg->model.dtype, t, h));
    MOERT_CHECK(rank_alloc_tensor(r, &r->grad_b, cfg->model.dtype, t, h));
    MOERT_CHECK(rank_alloc_tensor(r, &r->target, cfg->model.dtype, t, h));
    r->x_host = moert_tensor_2d(calloc((size_t)(t * h), sizeof(double)), moert_cpu(), MOERT_F64, t, h);
    r->target_host = moert_tensor_2d(calloc((size_t)(t * h), sizeof(double)), moert_cpu(), MOERT_F64, t, h);
    MOERT_CHECK_ALLOC(r->x_host.data);
    MOERT_CHECK_ALLOC(r->target_host.data);
fail:
    return rc;
}

static moert_result ensure_params(moert_runtime *rt)
{
    if (rt->params_ready) return MOERT_OK;
    /* what fits was checked by moert_runtime_create (core/src/memory_estimate.c) */
    moert_result rc = moert_teacher_create(rt->cfg->model.hidden, (uint64_t)rt->cfg->train.seed + 7777,
                                           rt->cfg->train.teacher_scale, rt->cfg->train.input_shift, &rt->teacher);
    if (rc != MOERT_OK) return rc;
    rc = run_on_ranks(rt, rank_prepare, NULL);
    if (rc == MOERT_OK) rt->params_ready = true;
    return rc;
}

/* Micro-batch data: this rank's slice of the micro-batch's global tokens, and the teacher's targets. Micro-batch m
 * of step s is batch s * micro_batches + m of the data stream, so on one rank the micro-batches of a step hold the
 * tokens that one batch of micro_batches times as many tokens would (and with one micro-batch, batch s). */
static moert_result load_batch(moert_rank *r, int64_t step, int64_t micro)
{
    const moert_config *cfg = r->rt->cfg;
    int64_t batch = step * cfg->train.micro_batches + micro;
    if (cfg->train.repeat_batch) {
        if (r->batch_loaded) return MOERT_OK;
        batch = 1;
        r->batch_loaded = true;
    }
    int64_t t = cfg->train.tokens_per_rank, h = cfg->model.hidden;
    uint64_t first =
        ((uint64_t)batch * (uint64_t)r->rt->world * (uint64_t)t + (uint64_t)r->rank * (uint64_t)t) * (uint64_t)h;
    moert_teacher_sample_inputs(r->rt->teacher, &r->x_host, (uint64_t)cfg->train.seed, first);
    moert_teacher_apply(r->rt->teacher, &r->x_host, &r->target_host);
    /* round through the storage dtype on the host, then copy */
    moert_result rc = MOERT_OK;
    moert_tensor src[2] = {r->x_host, r->target_host};
    moert_tensor *dst[2] = {&r->acts[0], &r->target};
    for (int i = 0; i < 2; i++) {
        moert_tensor staged = *dst[i];
        staged.device = moert_cpu();
        staged.data = malloc(moert_tensor_bytes(dst[i]));
        if (!staged.data) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "staging the batch");
        moert_copy(NULL, &src[i], &staged);
        rc = r->core_host->memcpy_async(r->core_host, dst[i]->data, dst[i]->device, staged.data, staged.device,
                                        moert_tensor_bytes(dst[i]), r->stream);
        /* the staging buffer is pageable: the copy must be done before it is freed */
        if (rc == MOERT_OK) rc = r->core_host->stream_synchronize(r->core_host, r->stream);
        free(staged.data);
        if (rc != MOERT_OK) return moert_error(rc, "copying the batch: %s", moert_host_take_error(r->core_host));
    }
    return MOERT_OK;
}

static moert_result allreduce(moert_rank *r, void *buf, size_t count, moert_dtype dtype)
{
    moert_result rc = r->core_host->allreduce_sum(r->core_host, buf, count, dtype, moert_cpu(), NULL);
    if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(r->core_host));
    return MOERT_OK;
}

/* ---- CUDA graphs ($.parallel.cuda_graph, docs/executor.md "CUDA graphs") ---- */

typedef enum graph_plan { GRAPH_EAGER = 0, GRAPH_CAPTURE = 1, GRAPH_REPLAY = 2 } graph_plan;

/* The graphs a micro-batch runs: a step's first (0) or a later one (1). */
static int graph_form(int64_t micro) { return micro == 0 ? 0 : 1; }

/* How this micro-batch runs on this rank: replay when the graphs of its form exist; capture after one eager pass when
 * the mode allows and every layer can be captured; else eager (rank 0 notes why for the report). Mode "on" fails
 * when it cannot. */
static moert_result graph_plan_of(moert_rank *r, int form, graph_plan *plan)
{
    moert_runtime *rt = r->rt;
    int mode = rt->cfg->parallel.cuda_graph;
    *plan = GRAPH_EAGER;
    if (r->graph_forward[form]) {
        *plan = GRAPH_REPLAY;
        return MOERT_OK;
    }
    if (mode == MOERT_GRAPH_OFF || rt->graph_failed) {
        if (r->rank == 0 && !rt->graph_reason[0])
            snprintf(rt->graph_reason, sizeof rt->graph_reason, "$.parallel.cuda_graph is \"off\"");
        return MOERT_OK;
    }
    char why[256] = "";
    bool ok = true;
    if (rt->device_type != MOERT_DEVICE_CUDA) {
        snprintf(why, sizeof why, "the ranks run on the CPU");
        ok = false;
    }
    for (int l = 0; ok && l < rt->cfg->model.num_layers; l++)
        ok = moert_layer_graph_capturable(&r->layers[l], why, sizeof why);
    if (!ok) {
        if (mode == MOERT_GRAPH_ON)
            return moert_error(MOERT_ERR_CONFIG,
                               "config error at $.parallel.cuda_graph: \"on\" needs a layer step that "
                               "can be captured in a CUDA graph, but %s (use \"auto\" to run without graphs then)",
                               why);
        if (r->rank == 0) snprintf(rt->graph_reason, sizeof rt->graph_reason, "%s", why);
        return MOERT_OK;
    }
    /* one eager pass first: plugins set themselves up and the pool holds every block the step needs */
    if (r->eager_steps >= 1) *plan = GRAPH_CAPTURE;
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
/* Starts capturing the rank's stream into a graph, its allocations kept for the graph (the pool's reservation, which
 * the graphs of both forms share: they run one after the other on this stream). */
static moert_result capture_begin(moert_rank *r, bool first)
{
    moert_result rc = MOERT_OK;
    if (first) MOERT_CHECK(moert_cuda_pool_reserve_resume(r->pool, r->stream));
    MOERT_CHECK(moert_cuda_capture_begin(r->stream));
    for (int l = 0; l < r->rt->cfg->model.num_layers; l++) r->layers[l].capturing = true;
fail:
    return rc;
}

/* Ends the capture (also after a failure inside it, rc_inside), instantiates it and launches it once. */
static moert_result capture_end(moert_rank *r, moert_result rc_inside, const char *what, bool last, void **graph)
{
    moert_result rc = MOERT_OK;
    for (int l = 0; l < r->rt->cfg->model.num_layers; l++) r->layers[l].capturing = false;
    char inside[1024] = "";
    if (rc_inside != MOERT_OK) snprintf(inside, sizeof inside, "%s", moert_error_message());
    rc = moert_cuda_capture_end(r->stream, what, (moert_cuda_graph *)graph);
    if (last || rc != MOERT_OK || rc_inside != MOERT_OK) moert_cuda_pool_reserve_end(r->pool);
    if (rc_inside != MOERT_OK)
        return moert_error(rc_inside,
                           "while capturing %s into a CUDA graph: %s (set $.parallel.cuda_graph to \"off\" "
                           "to run it without graphs)",
                           what, inside);
    if (rc != MOERT_OK) return rc;
    return moert_cuda_graph_launch(*graph, r->stream);
}
#endif

/* Forward of the stack: eager, captured into r->graph_forward[form] (and run), or its replay. A step's first
 * micro-batch (form 0) zeroes the gradients first; the others add to them. */
static moert_result stack_forward(moert_rank *r, graph_plan plan, int form)
{
    moert_result rc = MOERT_OK;
    int nl = (int)r->rt->cfg->model.num_layers;
    if (plan != GRAPH_EAGER) {
        for (int l = 0; l < nl && form == 0; l++) MOERT_CHECK(moert_layer_zero_grad(&r->layers[l], true));
#ifdef MOERT_HAVE_CUDA
        if (plan == GRAPH_REPLAY) return moert_cuda_graph_launch(r->graph_forward[form], r->stream);
        MOERT_CHECK(capture_begin(r, true));
        moert_result inside = MOERT_OK;
        for (int l = 0; l < nl && inside == MOERT_OK; l++)
            inside = moert_layer_forward(&r->layers[l], &r->acts[l], &r->acts[l + 1]);
        MOERT_CHECK(capture_end(r, inside, "the layers' forward", false, &r->graph_forward[form]));
#endif
        goto fail;
    }
    for (int l = 0; l < nl; l++) {
        if (form == 0) MOERT_CHECK(moert_layer_zero_grad(&r->layers[l], true));
        MOERT_CHECK(moert_layer_forward(&r->layers[l], &r->acts[l], &r->acts[l + 1]));
        /* the layer below's offload copies start now that this layer's dispatcher has synced on its counts: a copy
         * engine serves copies in issue order, so issued earlier they would have held that small copy back */
        if (l > 0) MOERT_CHECK(moert_act_store_start_offloads(&r->layers[l - 1].acts));
        /* offload copies of the layers below that have finished by now give their device buffers back; a copy
         * still running keeps its buffer until a later boundary (or its reload), so the compute never waits */
        for (int below = 0; below < l; below++) MOERT_CHECK(moert_act_store_release_finished(&r->layers[below].acts));
    }
    MOERT_CHECK(moert_act_store_start_offloads(&r->layers[nl - 1].acts));
fail:
    return rc;
}

/* Backward of the stack from r->grad_a, the same three ways; the router losses enter with loss_scale. */
static moert_result stack_backward(moert_rank *r, graph_plan plan, int form, double loss_scale)
{
    moert_result rc = MOERT_OK, inside = MOERT_OK;
    int nl = (int)r->rt->cfg->model.num_layers;
    moert_tensor *d_y = &r->grad_a, *d_x = &r->grad_b;
#ifdef MOERT_HAVE_CUDA
    if (plan == GRAPH_REPLAY) {
        /* the replayed WGRADs wrote the expert gradients: a later capture must add to them */
        for (int l = 0; l < nl; l++) moert_layer_mark_grads_written(&r->layers[l]);
        return moert_cuda_graph_launch(r->graph_backward[form], r->stream);
    }
    if (plan == GRAPH_CAPTURE) MOERT_CHECK(capture_begin(r, false));
#endif
    for (int l = nl - 1; l >= 0 && inside == MOERT_OK; l--) {
        if (plan == GRAPH_EAGER) {
            /* the layer below's offloaded activations come back while this layer's backward runs */
            for (int below = 0; below + 1 < l; below++)
                MOERT_CHECK(moert_act_store_release_finished(&r->layers[below].acts));
            if (l > 0) MOERT_CHECK(moert_act_store_prefetch(&r->layers[l - 1].acts));
        }
        inside = moert_layer_backward(&r->layers[l], d_y, d_x, loss_scale);
        moert_tensor *tmp = d_y;
        d_y = d_x;
        d_x = tmp;
    }
#ifdef MOERT_HAVE_CUDA
    if (plan == GRAPH_CAPTURE) return capture_end(r, inside, "the layers' backward", true, &r->graph_backward[form]);
#endif
    rc = inside;
fail:
    return rc;
}

/* Appends the spans of every layer of this micro-batch to the rank's trace: placed on the run's clock by the
 * micro-batch's start on the host, and within it by the streams' own times (CUDA events on GPUs). */
static moert_result trace_micro_batch(moert_rank *r, int64_t step, int64_t micro, double started)
{
    moert_result rc = MOERT_OK;
    const double base_us = 1e6 * (started - r->rt->trace_origin);
    for (int l = 0; l < r->rt->cfg->model.num_layers; l++) {
        moert_layer_span spans[MOERT_LAYER_MAX_SPANS];
        int n = 0;
        MOERT_CHECK(moert_layer_spans(&r->layers[l], &r->layers[0], spans, &n));
        for (int i = 0; i < n; i++) {
            moert_trace_span span = {.name = spans[i].name,
                                     .stream = spans[i].stream,
                                     .rank = r->rank,
                                     .layer = l,
                                     .step = step,
                                     .micro = micro,
                                     .start_us = base_us + 1e6 * spans[i].start_s,
                                     .dur_us = 1e6 * spans[i].dur_s};
            MOERT_CHECK(moert_trace_add(&r->trace, &span));
        }
    }
fail:
    return rc;
}

/* One micro-batch's forward and backward on one rank: its squared error, router losses, tokens per expert and times
 * are added to the step's. The first micro-batch of a step zeroes the gradients; the others add to them. Each
 * micro-batch's losses enter as its share of the step's mean, so the gradients of a step are those of one batch of
 * all its tokens. */
static moert_result micro_batch(moert_rank *r, int64_t step, int64_t micro)
{
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const moert_config *cfg = rt->cfg;
    int nl = (int)cfg->model.num_layers;
    int64_t e = cfg->model.num_experts;
    const double micro_batches = (double)cfg->train.micro_batches;
    double step_elems =
        micro_batches * (double)rt->world * (double)cfg->train.tokens_per_rank * (double)cfg->model.hidden;
    graph_plan plan = GRAPH_EAGER;
    double t0 = now_seconds();

    MOERT_CHECK(load_batch(r, step, micro));
    const int form = graph_form(micro);
    MOERT_CHECK(graph_plan_of(r, form, &plan));
    rc = stack_forward(r, plan, form);
    if (rc != MOERT_OK) {
        if (plan == GRAPH_CAPTURE && r->rank == 0) rt->graph_failed = true;
        goto fail;
    }
    for (int l = 0; l < nl; l++) r->router_loss += r->layers[l].losses.total;
    MOERT_CHECK(r->core_host->stream_synchronize(r->core_host, r->stream) == MOERT_OK
                    ? MOERT_OK
                    : moert_error(MOERT_ERR_CUDA, "%s", moert_host_take_error(r->core_host)));
    if (plan == GRAPH_EAGER)
        for (int l = 0; l < nl; l++) MOERT_CHECK(moert_act_store_release_finished(&r->layers[l].acts));
    double mse_sum = 0.0;
    MOERT_CHECK(moert_squared_error(r->stream, &r->acts[nl], &r->target, 1.0 / step_elems, r->workspace, r->loss_result,
                                    &mse_sum, &r->grad_a));
    r->mse_sum += mse_sum;
    MOERT_CHECK(stack_backward(r, plan, form, 1.0 / (micro_batches * rt->world)));
    if (plan == GRAPH_EAGER) r->eager_steps++;
    if (r->rank == 0 && plan == GRAPH_CAPTURE) {
        rt->graph_captured_step = step;
        rt->graph_capture_seconds = now_seconds() - t0;
    }
    if (r->rank == 0 && plan == GRAPH_REPLAY) rt->graph_replays++;
    /* tokens per expert for the report: the router's counts to the host, after the backward (a small copy issued
     * during the forward would wait on the copy engine behind the offload copies) */
    for (int l = 0; l < nl; l++) {
        moert_tensor *c = &r->layers[l].tokens_per_expert;
        rc = r->core_host->memcpy_async(r->core_host, r->micro_counts + (size_t)l * (size_t)e, moert_cpu(), c->data,
                                        c->device, (size_t)e * sizeof(int64_t), r->stream);
        if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(r->core_host));
    }
    for (int l = 0; l < nl; l++) {
        MOERT_CHECK(moert_layer_collect_times(&r->layers[l])); /* waits for the layer's backward */
        for (int s = 0; s < MOERT_STAGE_COUNT; s++) r->stage_seconds[s] += r->layers[l].stage_seconds[s];
        for (int p = 0; p < MOERT_BWD_PART_COUNT; p++)
            r->backward_part_seconds[p] += r->layers[l].backward_part_seconds[p];
    }
    if (rt->tracing) MOERT_CHECK(trace_micro_batch(r, step, micro, t0));
    MOERT_CHECK(r->core_host->stream_synchronize(r->core_host, r->stream) == MOERT_OK /* the counts have landed */
                    ? MOERT_OK
                    : moert_error(MOERT_ERR_CUDA, "%s", moert_host_take_error(r->core_host)));
    for (size_t i = 0; i < (size_t)nl * (size_t)e; i++) r->counts[i] += r->micro_counts[i];
fail:
    return rc;
}

/* ---- micro-batch overlap ($.parallel.overlap_micro_batches, docs/executor.md "Micro-batch overlap") ---- */

/* Slot 1 of every layer when the overlap is on for this run (memory and plugin instances are unchanged when off). */
static moert_result overlap_init(moert_rank *r, const moert_stack_setup *setup)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = r->rt->cfg;
    if (cfg->train.micro_batches < 2 ||
        !moert_overlap_enabled(&cfg->parallel, r->rt->device_type, r->rt->world, cfg->train.micro_batches))
        return MOERT_OK;
    MOERT_CHECK(moert_overlap_init(&r->overlap, &r->stack, setup));
    for (int l = 0; l < cfg->model.num_layers; l++) {
        moert_layer *T = &r->overlap.twin.layers[l];
        T->acts.defer_release = true;
        T->acts.defer_start = r->layers[l].acts.defer_start;
    }
fail:
    return rc;
}

static void overlap_finalize(moert_rank *r, moert_device device)
{
    for (int l = 0; r->acts1 && l <= r->rt->cfg->model.num_layers; l++)
        if (r->acts1[l].data) r->core_host->free(r->core_host, device, r->acts1[l].data);
    if (r->target1.data) r->core_host->free(r->core_host, device, r->target1.data);
    free(r->acts1);
    r->acts1 = NULL;
    r->target1.data = NULL;
    moert_overlap_finalize(&r->overlap);
}

/* Layer l of the slot that ran a step's last micro-batch (slot 0 without the overlap): its figures are the step's. */
static const moert_layer *overlap_last_layer(const moert_rank *r, int l)
{
    const int64_t m = r->rt->cfg->train.micro_batches;
    return r->overlap.made && m >= 2 && (m - 1) % 2 == 1 ? &r->overlap.twin.layers[l] : &r->layers[l];
}

/* Slot 1's input, residual stream and target, made at the first overlapped step. */
static moert_result overlap_buffers(moert_rank *r)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = r->rt->cfg;
    const int nl = (int)cfg->model.num_layers;
    if (r->acts1) return MOERT_OK;
    r->acts1 = calloc((size_t)nl + 1, sizeof *r->acts1);
    MOERT_CHECK_ALLOC(r->acts1);
    for (int l = 0; l <= nl; l++)
        MOERT_CHECK(
            rank_alloc_tensor(r, &r->acts1[l], cfg->model.dtype, cfg->train.tokens_per_rank, cfg->model.hidden));
    MOERT_CHECK(rank_alloc_tensor(r, &r->target1, cfg->model.dtype, cfg->train.tokens_per_rank, cfg->model.hidden));
fail:
    return rc;
}

/* Micro-batch `micro`'s data into the buffers of `slot`. */
static moert_result overlap_load(moert_rank *r, int slot, int64_t step, int64_t micro)
{
    if (slot == 0) return load_batch(r, step, micro);
    moert_tensor *acts = r->acts, target = r->target;
    bool loaded = r->batch_loaded;
    r->acts = r->acts1;
    r->target = r->target1;
    r->batch_loaded = r->batch_loaded1;
    moert_result rc = load_batch(r, step, micro);
    r->batch_loaded1 = r->batch_loaded;
    r->acts = acts;
    r->target = target;
    r->batch_loaded = loaded;
    return rc;
}

/* The stage times and trace spans of the micro-batch whose forward and backward slot `slot`'s layers ran last. */
static moert_result overlap_collect(moert_rank *r, int slot, int64_t step, int64_t micro, double started)
{
    moert_result rc = MOERT_OK;
    const int nl = (int)r->rt->cfg->model.num_layers;
    const double base_us = 1e6 * (started - r->rt->trace_origin);
    moert_layer *origin = moert_overlap_layer(&r->overlap, 0, slot);
    for (int l = 0; l < nl; l++) {
        moert_layer *L = moert_overlap_layer(&r->overlap, l, slot);
        MOERT_CHECK(moert_layer_collect_times(L));
        for (int s = 0; s < MOERT_STAGE_COUNT; s++) r->stage_seconds[s] += L->stage_seconds[s];
        for (int p = 0; p < MOERT_BWD_PART_COUNT; p++) r->backward_part_seconds[p] += L->backward_part_seconds[p];
        if (!r->rt->tracing) continue;
        moert_layer_span spans[MOERT_LAYER_MAX_SPANS];
        int n = 0;
        MOERT_CHECK(moert_layer_spans(L, origin, spans, &n));
        for (int i = 0; i < n; i++) {
            const bool compute = !strcmp(spans[i].stream, "compute");
            moert_trace_span span = {.name = spans[i].name,
                                     .stream = slot == 0 ? spans[i].stream
                                               : compute ? "compute.1"
                                                         : "wgrad.1",
                                     .rank = r->rank,
                                     .layer = l,
                                     .step = step,
                                     .micro = micro,
                                     .start_us = base_us + 1e6 * spans[i].start_s,
                                     .dur_us = 1e6 * spans[i].dur_s};
            MOERT_CHECK(moert_trace_add(&r->trace, &span));
        }
    }
fail:
    return rc;
}

/* After micro-batch forward of layer l on `slot`: its router losses, its token counts (copied on the rank's stream,
 * summed on the host after the next synchronisation), and the activation store's layer boundaries. */
static moert_result overlap_after_forward(moert_rank *r, int slot, int l)
{
    moert_result rc = MOERT_OK;
    const int nl = (int)r->rt->cfg->model.num_layers;
    const int64_t e = r->rt->cfg->model.num_experts;
    moert_layer *L = moert_overlap_layer(&r->overlap, l, slot);
    r->router_loss += L->losses.total;
    rc = r->core_host->memcpy_async(r->core_host, r->micro_counts + (size_t)l * (size_t)e, moert_cpu(),
                                    L->tokens_per_expert.data, L->tokens_per_expert.device, (size_t)e * sizeof(int64_t),
                                    r->stream);
    if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(r->core_host));
    if (l > 0) MOERT_CHECK(moert_act_store_start_offloads(&moert_overlap_layer(&r->overlap, l - 1, slot)->acts));
    if (l == nl - 1) MOERT_CHECK(moert_act_store_start_offloads(&L->acts));
    for (int below = 0; below < l; below++)
        MOERT_CHECK(moert_act_store_release_finished(&moert_overlap_layer(&r->overlap, below, slot)->acts));
fail:
    return rc;
}

/* The step with micro-batch i+1's forward merged with micro-batch i's backward, layer by layer: F0 of every layer;
 * then for i = 1 .. M-1 and k = 0 .. L-1, F_i(layer k) with B_{i-1}(layer L-1-k), and the loss of micro-batch i once
 * its forward is done; then B_{M-1} of every layer. Micro-batch i holds slot i % 2 of every layer. The gradients
 * accumulate in the order of the sequential schedule (one backward at a time, micro-batch by micro-batch), so the
 * results are the same bit for bit. */
static moert_result rank_forward_backward_overlapped(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const moert_config *cfg = rt->cfg;
    moert_overlap *o = &r->overlap;
    const int nl = (int)cfg->model.num_layers;
    const int64_t m = cfg->train.micro_batches, e = cfg->model.num_experts;
    const double scale = 1.0 / ((double)m * rt->world);
    const double step_elems =
        (double)m * (double)rt->world * (double)cfg->train.tokens_per_rank * (double)cfg->model.hidden;
    double started[2] = {0.0, 0.0};
    moert_tensor *d_y = &r->grad_a, *d_x = &r->grad_b, *tmp = NULL;
    MOERT_CHECK(overlap_buffers(r));
    if (r->rank == 0 && !rt->graph_reason[0])
        snprintf(rt->graph_reason, sizeof rt->graph_reason, "$.parallel.overlap_micro_batches is on");
    for (int64_t i = 0; i < m; i++) {
        const int slot = (int)(i % 2), prev = 1 - slot;
        moert_tensor *acts = slot ? r->acts1 : r->acts;
        started[slot] = now_seconds();
        MOERT_CHECK(overlap_load(r, slot, step, i));
        d_y = &r->grad_a;
        d_x = &r->grad_b;
        for (int k = 0; k < nl; k++) {
            if (i == 0) {
                MOERT_CHECK(moert_layer_zero_grad(&r->layers[k], true));
                MOERT_CHECK(moert_overlap_forward(o, k, slot, &acts[k], &acts[k + 1]));
            } else {
                const int bl = nl - 1 - k;
                if (bl > 0) MOERT_CHECK(moert_act_store_prefetch(&moert_overlap_layer(o, bl - 1, prev)->acts));
                MOERT_CHECK(
                    moert_overlap_forward_backward(o, k, slot, &acts[k], &acts[k + 1], bl, prev, d_y, d_x, scale));
                tmp = d_y;
                d_y = d_x;
                d_x = tmp;
            }
            MOERT_CHECK(overlap_after_forward(r, slot, k));
        }
        /* micro-batch i's loss and output gradient (micro-batch i-1's backward is done: they share grad_a) */
        MOERT_CHECK(r->core_host->stream_synchronize(r->core_host, r->stream) == MOERT_OK
                        ? MOERT_OK
                        : moert_error(MOERT_ERR_CUDA, "%s", moert_host_take_error(r->core_host)));
        for (size_t c = 0; c < (size_t)nl * (size_t)e; c++) r->counts[c] += r->micro_counts[c];
        double mse_sum = 0.0;
        MOERT_CHECK(moert_squared_error(r->stream, &acts[nl], slot ? &r->target1 : &r->target, 1.0 / step_elems,
                                        r->workspace, r->loss_result, &mse_sum, &r->grad_a));
        r->mse_sum += mse_sum;
        if (i > 0) MOERT_CHECK(overlap_collect(r, prev, step, i - 1, started[prev]));
    }
    const int last = (int)((m - 1) % 2);
    d_y = &r->grad_a;
    d_x = &r->grad_b;
    for (int l = nl - 1; l >= 0; l--) {
        if (l > 0) MOERT_CHECK(moert_act_store_prefetch(&moert_overlap_layer(o, l - 1, last)->acts));
        MOERT_CHECK(moert_overlap_backward(o, l, last, d_y, d_x, scale));
        tmp = d_y;
        d_y = d_x;
        d_x = tmp;
    }
    MOERT_CHECK(overlap_collect(r, last, step, m - 1, started[last]));
    /* the stack's output is the last micro-batch's, where moert_runtime_read_output reads it */
    if (last == 1) MOERT_CHECK(moert_copy(r->stream, &r->acts1[nl], &r->acts[nl]));
    r->eager_steps++;
fail:
    return rc;
}

bool moert_runtime_overlap_set_interleave(moert_runtime *rt, bool interleave)
{
    bool made = rt->nlocal > 0;
    for (int i = 0; i < rt->nlocal; i++) {
        rt->ranks[i].overlap.interleave = interleave && rt->ranks[i].overlap.made;
        made = made && rt->ranks[i].overlap.made;
    }
    return made;
}

/* Forward and backward of the stack on one rank over the step's micro-batches; fills mse_sum, router_loss and
 * counts (over all ranks), the stage times (this rank's) and the gradients (the router's summed over ranks). */
static moert_result rank_forward_backward(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = r->rt->cfg;
    int nl = (int)cfg->model.num_layers;
    int64_t e = cfg->model.num_experts;
    r->mse_sum = r->router_loss = 0.0;
    memset(r->counts, 0, (size_t)nl * (size_t)e * sizeof *r->counts);
    memset(r->stage_seconds, 0, sizeof r->stage_seconds);
    memset(r->backward_part_seconds, 0, sizeof r->backward_part_seconds);
    if (r->overlap.made && cfg->train.micro_batches >= 2)
        MOERT_CHECK(rank_forward_backward_overlapped(r, step));
    else
        for (int64_t micro = 0; micro < cfg->train.micro_batches; micro++) MOERT_CHECK(micro_batch(r, step, micro));
    /* the router weight and the shared expert are replicated: their gradients are the sum of every rank's share */
    static const moert_param_id replicated[] = {MOERT_PARAM_ROUTER, MOERT_PARAM_SHARED_FC1, MOERT_PARAM_SHARED_FC2,
                                                MOERT_PARAM_SHARED_GATE};
    for (int l = 0; l < nl && r->rt->world > 1; l++)
        for (size_t k = 0; k < sizeof replicated / sizeof replicated[0]; k++) {
            if (!moert_layer_has_param(&r->layers[l], replicated[k])) continue;
            moert_tensor *g = &r->layers[l].params[replicated[k]].grad;
            rc = r->core_host->allreduce_sum(r->core_host, g->data, (size_t)moert_tensor_numel(g), g->dtype, g->device,
                                             r->stream);
            if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(r->core_host));
        }
    /* the experts are replicated over the expert-data-parallel group (docs/parallel.md): their gradients are the sum
     * of every replica's share */
    moert_comm_group *edp = r->stack.group[MOERT_AXIS_EDP];
    for (int l = 0; l < nl && edp; l++)
        for (int k = MOERT_PARAM_FC1; k <= MOERT_PARAM_FC2; k++) {
            moert_tensor *g = &r->layers[l].params[k].grad;
            MOERT_CHECK(
                moert_comm_allreduce_sum(edp, r->stack.coords.edp, g->data, (size_t)moert_tensor_numel(g), g->dtype));
        }
    /* figures over all ranks (the router losses: the mean over ranks and micro-batches) */
    double sums[2] = {r->mse_sum, r->router_loss};
    MOERT_CHECK(allreduce(r, sums, 2, MOERT_F64));
    r->mse_sum = sums[0];
    r->router_loss = sums[1] / ((double)r->rt->world * (double)cfg->train.micro_batches);
    MOERT_CHECK(allreduce(r, r->counts, (size_t)nl * (size_t)e, MOERT_I64));
fail:
    return rc;
}

static moert_result rank_optimizer_step(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = r->rt->cfg;
    for (int l = 0; l < cfg->model.num_layers; l++) {
        moert_layer *L = &r->layers[l];
        MOERT_CHECK(moert_layer_optimizer_step(L, &cfg->train, step));
        const moert_router_v1 *router = (const moert_router_v1 *)L->router.plugin->header;
        rc = router->end_step(L->router.ctx, L->stream);
        if (rc != MOERT_OK)
            return moert_error(rc, "router \"%s\" end_step failed (layer %d): %s", router->header.name, l,
                               moert_host_take_error(L->router.host));
        const moert_precision_v1 *prec = (const moert_precision_v1 *)L->precision.plugin->header;
        rc = prec->end_step(L->precision.ctx, L->stream);
        if (rc != MOERT_OK)
            return moert_error(rc, "precision \"%s\" end_step failed (layer %d): %s", prec->header.name, l,
                               moert_host_take_error(L->precision.host));
    }
    /* slot 1's precision instances keep weight copies of their own (its router shares slot 0's step state) */
    MOERT_CHECK(moert_overlap_precision_end_step(&r->overlap));
fail:
    return rc;
}

/* max/mean of tokens per expert for one layer's all-rank counts. */
static double imbalance_of(const int64_t *counts, int64_t e)
{
    int64_t max = 0, sum = 0;
    for (int64_t i = 0; i < e; i++) {
        sum += counts[i];
        if (counts[i] > max) max = counts[i];
    }
    return sum > 0 ? (double)max * (double)e / (double)sum : 0.0;
}

static void fill_record(moert_runtime *rt, int64_t step, double seconds, moert_step_record *rec)
{
    moert_rank *r0 = &rt->ranks[0];
    const moert_config *cfg = rt->cfg;
    int nl = (int)cfg->model.num_layers;
    int64_t e = cfg->model.num_experts;
    memset(rec, 0, sizeof *rec);
    rec->step = step;
    rec->mse = r0->mse_sum / ((double)cfg->train.micro_batches * (double)rt->world *
                              (double)cfg->train.tokens_per_rank * (double)cfg->model.hidden);
    rec->router_loss = r0->router_loss;
    rec->loss = rec->mse + rec->router_loss;
    for (int l = 0; l < nl; l++) {
        double imb = imbalance_of(r0->counts + (size_t)l * (size_t)e, e);
        rec->imbalance += imb / nl;
        if (imb > rec->imbalance_max) rec->imbalance_max = imb;
    }
    memcpy(rec->stage_seconds, r0->stage_seconds, sizeof rec->stage_seconds);
    memcpy(rec->backward_part_seconds, r0->backward_part_seconds, sizeof rec->backward_part_seconds);
    rec->seconds = seconds;
}

typedef struct train_arg {
    int64_t steps;
    FILE *progress;
} train_arg;

static void print_progress(moert_runtime *rt, const moert_step_record *rec, int64_t steps, FILE *f)
{
    fprintf(f, "step %*lld/%lld  loss %.6f (mse %.6f, router %.2e)  load max/mean %.3f (worst layer %.3f)  %.1f ms\n",
            (int)snprintf(NULL, 0, "%lld", (long long)steps), (long long)rec->step, (long long)steps, rec->loss,
            rec->mse, rec->router_loss, rec->imbalance, rec->imbalance_max, rec->seconds * 1e3);
    fflush(f);
    (void)rt;
}

/* Copies the routers' expert biases ([layers, E]) to the host, or leaves *out NULL if the router keeps none. */
static moert_result snapshot_bias(moert_runtime *rt, double **out)
{
    moert_rank *r0 = &rt->ranks[0];
    const moert_config *cfg = rt->cfg;
    int64_t e = cfg->model.num_experts;
    free(*out);
    *out = NULL;
    for (int l = 0; l < cfg->model.num_layers; l++) {
        moert_layer *L = &r0->layers[l];
        const moert_router_v1 *router = (const moert_router_v1 *)L->router.plugin->header;
        const moert_tensor *b = router->expert_bias ? router->expert_bias(L->router.ctx) : NULL;
        if (!b) return MOERT_OK;
        if (!*out) *out = calloc((size_t)(cfg->model.num_layers * e), sizeof(double));
        if (!*out) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "bias snapshot");
        moert_tensor host = *b;
        host.device = moert_cpu();
        host.data = malloc(moert_tensor_bytes(b));
        if (!host.data) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "bias snapshot");
        moert_result rc = r0->core_host->memcpy_async(r0->core_host, host.data, host.device, b->data, b->device,
                                                      moert_tensor_bytes(b), r0->stream);
        if (rc == MOERT_OK) rc = r0->core_host->stream_synchronize(r0->core_host, r0->stream);
        for (int64_t i = 0; i < e && rc == MOERT_OK; i++) (*out)[l * e + i] = moert_load(&host, i);
        free(host.data);
        if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(r0->core_host));
    }
    return MOERT_OK;
}

/* One training step on one rank: forward and backward, the optimizer, the plugins' end_step. Rank 0 fills
 * *rec (its wall time included); the step's gradients and output stay in place until the next step. */
static moert_result rank_train_step(moert_rank *r, int64_t step, moert_step_record *rec)
{
    moert_result rc = MOERT_OK;
    /* every rank starts the step together: the step's figures then leave out the skew the last step's optimizer left
     * (the stage a rank waits in for its peers would otherwise count it) */
    if (r->core_host->barrier(r->core_host) != MOERT_OK)
        return moert_error(MOERT_ERR_TIMEOUT, "the barrier at the start of step %lld: %s", (long long)step,
                           moert_host_take_error(r->core_host));
    double t0 = now_seconds();
    MOERT_CHECK(rank_forward_backward(r, step));
    MOERT_CHECK(rank_optimizer_step(r, step));
    /* the step ends when its optimizer has run: its time counts here, and another runtime stepped next (moert ab)
     * does not find its first stages sharing the GPU with this step's optimizer */
    MOERT_CHECK(r->core_host->stream_synchronize(r->core_host, r->stream) == MOERT_OK
                    ? MOERT_OK
                    : moert_error(MOERT_ERR_CUDA, "%s", moert_host_take_error(r->core_host)));
    if (r->rank == 0) fill_record(r->rt, step, now_seconds() - t0, rec);
fail:
    return rc;
}

static moert_result rank_train(moert_rank *r, void *arg)
{
    moert_result rc = MOERT_OK;
    train_arg *ta = arg;
    moert_runtime *rt = r->rt;
    int log_every = (int)(rt->cfg->train.log_every > 0 ? rt->cfg->train.log_every : 1);
    for (int64_t step = 1; step <= ta->steps; step++) {
        MOERT_CHECK(rank_train_step(r, step, r->rank == 0 ? &rt->records[rt->record_count] : NULL));
        if (r->rank == 0) {
            moert_step_record *rec = &rt->records[rt->record_count++];
            if (ta->progress && (step % log_every == 0 || step == 1 || step == ta->steps))
                print_progress(rt, rec, ta->steps, ta->progress);
        }
    }
fail:
    return rc;
}

typedef struct step_arg {
    int64_t step;
    moert_step_record *rec;
} step_arg;

static moert_result rank_train_step_phase(moert_rank *r, void *arg)
{
    step_arg *sa = arg;
    return rank_train_step(r, sa->step, sa->rec);
}

/* Activation figures of the last step (rank 0, summed over layers) and, on GPUs, rank 0's pool peak. */
static void collect_memory(moert_runtime *rt)
{
    int nl = (int)rt->cfg->model.num_layers;
    memset(rt->activation_bytes, 0, sizeof rt->activation_bytes);
    rt->kept_bytes = 0;
    for (int l = 0; l < nl; l++) {
        const moert_layer *L = overlap_last_layer(&rt->ranks[0], l);
        for (int a = 0; a < MOERT_ACT_COUNT; a++) rt->activation_bytes[a] += L->acts.saved_bytes[a];
        rt->kept_bytes += L->acts.kept_bytes_peak;
    }
    rt->device_peak_bytes = 0;
#ifdef MOERT_HAVE_CUDA
    if (rt->ranks[0].pool) {
        moert_cuda_pool_stats stats;
        moert_cuda_pool_get_stats(rt->ranks[0].pool, &stats);
        rt->device_peak_bytes = (int64_t)stats.peak_bytes_in_use;
        const int64_t calls = (int64_t)(stats.cuda_malloc_count + stats.cuda_free_count);
        rt->device_pool_calls = calls - rt->device_pool_calls_total;
        rt->device_pool_calls_total = calls;
    }
#endif
}

moert_result moert_runtime_step(moert_runtime *rt, int64_t step, moert_step_record *record)
{
    if (step < 1)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_runtime_step: step %lld, expected >= 1", (long long)step);
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    /* the record lives in the runtime: rank 0 fills it, and an abandoned rank 0 may still do so later */
    step_arg sa = {.step = step, .rec = &rt->step_record};
    rc = run_on_ranks(rt, rank_train_step_phase, &sa);
    if (rc != MOERT_OK) return rc;
    collect_memory(rt);
    if (record) *record = rt->step_record;
    return MOERT_OK;
}

moert_result moert_runtime_output(const moert_runtime *rt, int64_t index, double *value)
{
    const moert_config *cfg = rt->cfg;
    int64_t per_rank = cfg->train.tokens_per_rank * cfg->model.hidden;
    if (!rt->params_ready || rt->device_type != MOERT_DEVICE_CPU)
        return moert_error(MOERT_ERR_UNSUPPORTED, "the stack's output is readable after a step of a CPU run");
    if (index < 0 || index >= per_rank * rt->world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "output element %lld does not exist", (long long)index);
    *value = moert_load(&rt->ranks[index / per_rank].acts[cfg->model.num_layers], index % per_rank);
    return MOERT_OK;
}

int64_t moert_runtime_output_numel(const moert_runtime *rt)
{
    return (int64_t)rt->world * rt->cfg->train.tokens_per_rank * rt->cfg->model.hidden;
}

/* ---- bulk reads for comparing runs ---- */

int moert_runtime_local_ranks(const moert_runtime *rt) { return rt->nlocal; }

int64_t moert_runtime_local_output_numel(const moert_runtime *rt)
{
    return rt->cfg->train.tokens_per_rank * rt->cfg->model.hidden;
}

int64_t moert_runtime_local_grad_numel(const moert_runtime *rt, int layer, moert_param_id which)
{
    if (!rt->params_ready || layer < 0 || layer >= rt->cfg->model.num_layers || (int)which < 0 ||
        (int)which >= MOERT_PARAM_COUNT)
        return 0;
    const moert_tensor *g = &rt->ranks[0].layers[layer].params[which].grad;
    return g->data ? moert_tensor_numel(g) : 0;
}

/* What one bulk read copies: the output (layer < 0) or a gradient, elements [first, first + count) of each rank. */
typedef struct read_arg {
    int layer;
    moert_param_id which;
    int64_t first, count;
    double *out;
} read_arg;

/* On a rank's thread (its device current): copies its slice to a host buffer on its stream, waits, widens it. */
static moert_result rank_read(moert_rank *r, void *arg)
{
    const read_arg *a = arg;
    const moert_config *cfg = r->rt->cfg;
    const moert_tensor *t = a->layer < 0 ? &r->acts[cfg->model.num_layers] : &r->layers[a->layer].params[a->which].grad;
    double *out = a->out + (size_t)(r - r->rt->ranks) * (size_t)a->count;
    if (a->first < 0 || a->count < 0 || a->first + a->count > moert_tensor_numel(t))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "reading elements %lld..%lld of a tensor of %lld",
                           (long long)a->first, (long long)(a->first + a->count), (long long)moert_tensor_numel(t));
    if (t->dtype != MOERT_F32 && t->dtype != MOERT_F64 && t->dtype != MOERT_BF16 && t->dtype != MOERT_F16)
        return moert_error(MOERT_ERR_UNSUPPORTED, "reading a %s tensor as double", moert_dtype_name(t->dtype));
    moert_result rc = MOERT_OK;
    const size_t esize = moert_dtype_size(t->dtype);
    moert_tensor host = moert_tensor_2d(malloc((size_t)a->count * esize + 1), moert_cpu(), t->dtype, 1, a->count);
    MOERT_CHECK_ALLOC(host.data);
    rc = r->core_host->memcpy_async(r->core_host, host.data, host.device,
                                    (const char *)t->data + (size_t)a->first * esize, t->device,
                                    (size_t)a->count * esize, r->stream);
    if (rc == MOERT_OK) rc = r->core_host->stream_synchronize(r->core_host, r->stream);
    if (rc != MOERT_OK) {
        rc = moert_error(rc, "copying a tensor to the host: %s", moert_host_take_error(r->core_host));
        goto fail;
    }
    for (int64_t i = 0; i < a->count; i++) out[i] = moert_load(&host, i);
fail:
    free(host.data);
    return rc;
}

moert_result moert_runtime_read_output(moert_runtime *rt, int64_t first, int64_t count, double *out)
{
    if (!rt->params_ready) return moert_error(MOERT_ERR_UNSUPPORTED, "the stack's output is readable after a step");
    read_arg a = {.layer = -1, .first = first, .count = count, .out = out};
    return run_on_ranks(rt, rank_read, &a);
}

moert_result moert_runtime_read_grad(moert_runtime *rt, int layer, moert_param_id which, int64_t first, int64_t count,
                                     double *out)
{
    if (moert_runtime_local_grad_numel(rt, layer, which) == 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "layer %d has no gradient of parameter %d (or no step ran)",
                           layer, (int)which);
    read_arg a = {.layer = layer, .which = which, .first = first, .count = count, .out = out};
    return run_on_ranks(rt, rank_read, &a);
}

double moert_precision_agreement_rtol(const moert_plugin_header *precision)
{
    const size_t end = offsetof(moert_precision_v1, agreement_rtol) + sizeof(double);
    if (!precision || precision->kind != MOERT_KIND_PRECISION || precision->struct_size < end)
        return MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL;
    const double rtol = ((const moert_precision_v1 *)precision)->agreement_rtol;
    return rtol > 0.0 && isfinite(rtol) ? rtol : MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL;
}

double moert_runtime_agreement_rtol(const moert_runtime *rt)
{
    return moert_precision_agreement_rtol(rt->plugins[MOERT_SLOT_PRECISION].header);
}

static moert_result rank_forward_backward_phase(moert_rank *r, void *arg)
{
    return rank_forward_backward(r, *(int64_t *)arg);
}

int moert_runtime_rank(const moert_runtime *rt) { return rt->ranks[0].rank; }

moert_result moert_runtime_forward_backward(moert_runtime *rt, int64_t step, double *loss)
{
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    rc = run_on_ranks(rt, rank_forward_backward_phase, &step);
    if (rc != MOERT_OK) return rc;
    moert_step_record rec;
    fill_record(rt, step, 0.0, &rec);
    *loss = rec.loss;
    return MOERT_OK;
}

/* Writes the traces of the ranks this process hosts: all of them to `path` with ranks as threads; with a process per
 * GPU, rank 0's to `path` and rank N's to `path`.rankN. */
static moert_result write_trace(moert_runtime *rt, const char *path)
{
    moert_trace *traces = calloc((size_t)rt->nlocal, sizeof *traces);
    if (!traces) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "the trace");
    for (int i = 0; i < rt->nlocal; i++) traces[i] = rt->ranks[i].trace;
    char ranked[4096];
    const int rank = rt->ranks[0].rank;
    if (rt->processes && rank != 0) snprintf(ranked, sizeof ranked, "%s.rank%d", path, rank);
    moert_result rc = moert_trace_write(traces, rt->nlocal, rt->cfg->name, rt->processes && rank != 0 ? ranked : path);
    free(traces);
    return rc;
}

moert_result moert_runtime_train(moert_runtime *rt, const moert_train_options *opts)
{
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    const moert_config *cfg = rt->cfg;
    train_arg ta = {.steps = opts && opts->steps > 0 ? opts->steps : cfg->train.steps,
                    .progress = opts ? opts->progress : NULL};
    free(rt->records);
    rt->records = calloc((size_t)(ta.steps > 0 ? ta.steps : 1), sizeof *rt->records);
    rt->record_count = 0;
    if (!rt->records) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "step records");
    /* with a process per GPU, rank 0's process speaks for all */
    if (rt->ranks[0].rank != 0) ta.progress = NULL;
    char micro[64] = "";
    if (cfg->train.micro_batches > 1)
        snprintf(micro, sizeof micro, " x %lld micro-batches per step", (long long)cfg->train.micro_batches);
    if (ta.progress)
        fprintf(ta.progress,
                "moert %s: \"%s\" on %s; %lld layer%s, H=%lld F=%lld E=%lld K=%lld, %lld tokens per rank%s, "
                "%s storage; router %s, dispatcher %s, precision %s, memory policy %s\n",
                MOERT_VERSION_STRING, cfg->name, rt->device_name, (long long)cfg->model.num_layers,
                cfg->model.num_layers > 1 ? "s" : "", (long long)cfg->model.hidden, (long long)cfg->model.ffn_hidden,
                (long long)cfg->model.num_experts, (long long)cfg->model.topk, (long long)cfg->train.tokens_per_rank,
                micro, moert_dtype_name(cfg->model.dtype), rt->plugins[0].header->name, rt->plugins[1].header->name,
                rt->plugins[2].header->name, rt->plugins[3].header->name);
    rc = snapshot_bias(rt, &rt->bias_start);
    if (rc != MOERT_OK) return rc;
    const char *trace_path = opts && opts->struct_size >= offsetof(moert_train_options, trace_path) + sizeof(char *)
                                 ? opts->trace_path
                                 : NULL;
    rt->tracing = trace_path != NULL;
    for (int i = 0; i < rt->nlocal; i++) rt->ranks[i].trace.count = 0;
    double t0 = now_seconds();
    rt->trace_origin = t0;
    rc = run_on_ranks(rt, rank_train, &ta);
    rt->total_seconds = now_seconds() - t0;
    if (rc == MOERT_OK && trace_path) rc = write_trace(rt, trace_path);
    if (rc != MOERT_OK) return rc;

    int nl = (int)cfg->model.num_layers;
    int64_t e = cfg->model.num_experts;
    free(rt->final_counts);
    rt->final_counts = malloc(sizeof(int64_t) * (size_t)(nl * e));
    if (!rt->final_counts) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "report");
    memcpy(rt->final_counts, rt->ranks[0].counts, sizeof(int64_t) * (size_t)(nl * e));
    collect_memory(rt);
    rc = snapshot_bias(rt, &rt->final_bias);
    if (rc != MOERT_OK) return rc;
    if (ta.progress && rt->record_count > 0) {
        const moert_step_record *first = &rt->records[0], *last = &rt->records[rt->record_count - 1];
        fprintf(ta.progress,
                "done: %lld steps in %.2f s; loss %.6f -> %.6f (%.1f%% lower); load max/mean %.3f -> %.3f\n",
                (long long)rt->record_count, rt->total_seconds, first->loss, last->loss,
                first->loss > 0 ? 100.0 * (first->loss - last->loss) / first->loss : 0.0, first->imbalance,
                last->imbalance);
    }
    if (ta.progress && rt->device_type == MOERT_DEVICE_CUDA) {
        char line[512];
        moert_runtime_graph_summary(rt, line, sizeof line);
        fprintf(ta.progress, "cuda graph: %s\n", line);
    }
    return MOERT_OK;
}

void moert_runtime_graph_summary(const moert_runtime *rt, char *buf, size_t size)
{
    if (rt->graph_captured_step > 0)
        snprintf(buf, size, "captured at step %lld (forward and backward of %lld layer%s%s), replayed in %lld %s%s",
                 (long long)rt->graph_captured_step, (long long)rt->cfg->model.num_layers,
                 rt->cfg->model.num_layers > 1 ? "s" : "",
                 rt->cfg->train.micro_batches > 1 ? "; a step's first micro-batch and the later ones" : "",
                 (long long)rt->graph_replays, rt->cfg->train.micro_batches > 1 ? "micro-batch" : "step",
                 rt->graph_replays == 1             ? ""
                 : rt->cfg->train.micro_batches > 1 ? "es"
                                                    : "s");
    else if (rt->graph_reason[0])
        snprintf(buf, size, "not used: %s", rt->graph_reason);
    else
        snprintf(buf, size, "not used: no step after the first (the capture follows one eager step)");
}

/* ---- parameter access for tests ---- */

int64_t moert_runtime_param_numel(const moert_runtime *rt, moert_param_id which)
{
    const moert_model_config *m = &rt->cfg->model;
    switch (which) {
    case MOERT_PARAM_ROUTER: return m->num_experts * m->hidden;
    case MOERT_PARAM_FC1: return m->num_experts * m->hidden * 2 * m->ffn_hidden;
    case MOERT_PARAM_FC2: return m->num_experts * m->ffn_hidden * m->hidden;
    case MOERT_PARAM_SHARED_FC1: return m->hidden * 2 * m->shared_expert_ffn_hidden;
    case MOERT_PARAM_SHARED_FC2: return m->shared_expert_ffn_hidden * m->hidden;
    case MOERT_PARAM_SHARED_GATE: return m->shared_expert_gate ? m->hidden : 0;
    default: return 0;
    }
}

/* Whether rank r holds element `index` of the global expert weight `which` (fc1 [E,H,2F] or fc2 [E,F,H]), and where
 * in its shard ([El,H,2F/ETP] with the gate columns of its range, then the up columns; [El,F/ETP,H]). */
static bool expert_element_local(const moert_rank *r, moert_param_id which, int64_t index, int64_t *local)
{
    const moert_layer *L = &r->layers[0];
    const int64_t h = L->info.hidden, fl = L->info.ffn_hidden, f = fl * L->etp_size;
    const int64_t first = L->info.first_local_expert, el = L->info.num_local_experts;
    const int64_t per_expert = h * f * (which == MOERT_PARAM_FC1 ? 2 : 1), e = index / per_expert - first;
    const int64_t rest = index % per_expert;
    if (e < 0 || e >= el) return false;
    if (which == MOERT_PARAM_FC2) {
        const int64_t row = rest / h;
        if (row / fl != L->etp_rank) return false;
        *local = (e * fl + row % fl) * h + rest % h;
        return true;
    }
    const int64_t row = rest / (2 * f), col = rest % (2 * f), up = col >= f, in_half = col - up * f;
    if (in_half / fl != L->etp_rank) return false;
    *local = (e * h + row) * 2 * fl + up * fl + in_half % fl;
    return true;
}

moert_result moert_runtime_param(moert_runtime *rt, int layer, moert_param_id which, int64_t index,
                                 moert_param_access access, double *value, double *grad)
{
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    if (layer < 0 || layer >= rt->cfg->model.num_layers || index < 0 || index >= moert_runtime_param_numel(rt, which))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "parameter %d[%lld] of layer %d does not exist", (int)which,
                           (long long)index, layer);
    if (rt->device_type != MOERT_DEVICE_CPU)
        return moert_error(MOERT_ERR_UNSUPPORTED, "parameter access is for CPU runs");
    for (int i = 0; i < rt->world; i++) {
        moert_param *p = &rt->ranks[i].layers[layer].params[which];
        int64_t local = index;
        /* the experts are split over EP and ETP ranks (replicated over EDP ranks); the rest is replicated */
        if ((which == MOERT_PARAM_FC1 || which == MOERT_PARAM_FC2) &&
            !expert_element_local(&rt->ranks[i], which, index, &local))
            continue;
        if (access == MOERT_PARAM_WRITE) {
            moert_store(&p->value, local, *value);
        } else {
            if (value) *value = moert_load(&p->value, local);
            if (grad) *grad = moert_load(&p->grad, local);
            break;
        }
    }
    return MOERT_OK;
}

/* ---- figures for reports and comparisons ---- */

void moert_runtime_summary(const moert_runtime *rt, moert_run_summary *out)
{
    memset(out, 0, sizeof *out);
    out->cfg = rt->cfg;
    out->world = rt->world;
    out->device_type = rt->device_type;
    out->device_name = rt->device_name;
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) {
        const moert_plugin *p = &rt->plugins[s];
        out->plugins[s] = (moert_run_plugin){.kind = moert_kind_name(p->kind),
                                             .name = p->header->name,
                                             .version = p->header->version ? p->header->version : "",
                                             .path = p->path};
    }
    out->records = rt->records;
    out->record_count = rt->record_count;
    out->final_counts = rt->final_counts;
    out->final_bias = rt->final_bias;
    out->bias_start = rt->bias_start;
    memcpy(out->activation_bytes, rt->activation_bytes, sizeof out->activation_bytes);
    out->kept_bytes = rt->kept_bytes;
    out->device_peak_bytes = rt->device_peak_bytes;
    out->device_pool_calls = rt->device_pool_calls;
    out->total_seconds = rt->total_seconds;
    out->graph_captured_step = rt->graph_captured_step;
    out->graph_replays = rt->graph_replays;
    out->graph_capture_seconds = rt->graph_capture_seconds;
}

void moert_runtime_memory_line(const moert_runtime *rt, char *buf, size_t size)
{
    moert_memory_estimate_line(&rt->memory, buf, size);
}
