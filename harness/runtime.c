/* SPDX-License-Identifier: Apache-2.0 */
/* moert's own trainer: creates each rank's layers through the public API, one thread per rank (harness/ranks.h), and
 * trains them on the synthetic task with its own loss and optimizer (harness/optim.h). Part of the harness
 * (harness/trainer.h), not of libmoert: a client of moert/moert.h like any training framework (docs/api.md, "moert's
 * own trainer"). */
#include "runtime.h"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "kernel_trace.h"
#include "optim.h"
#include "ranks.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda_ops.h"
#endif

/* Calls a function returning a moert_result; on failure keeps its message and jumps to fail with rc set. */
#define CHECK(call)                                                                                                    \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) goto fail;                                                                                 \
    } while (0)

/* The pinned host memory of the rank's layers' device: page-locked on GPUs, plain on the CPU. */
static moert_device pinned_device(const moert_rank *r)
{
    return (moert_device){r->rt->device_type == MOERT_DEVICE_CUDA ? MOERT_DEVICE_CUDA_HOST : MOERT_DEVICE_CPU, 0};
}

/* bytes from src to dst (host or the rank's device), queued on the rank's stream (at once on the CPU). */
static moert_result rank_copy(moert_rank *r, void *dst, const void *src, size_t bytes)
{
#ifdef MOERT_HAVE_CUDA
    if (r->rt->device_type == MOERT_DEVICE_CUDA) return trainer_cuda_copy(dst, src, bytes, r->stream);
#endif
    if (bytes) memmove(dst, src, bytes);
    return MOERT_OK;
}

/* Waits for the rank's stream. */
static moert_result rank_sync(moert_rank *r)
{
#ifdef MOERT_HAVE_CUDA
    if (r->rt->device_type == MOERT_DEVICE_CUDA) return trainer_cuda_sync(r->stream);
#endif
    (void)r;
    return MOERT_OK;
}

/* ---- creation ---- */

/* The config's integer (or boolean) at key, which moert resolved (every key the trainer reads has a default). */
static moert_result get_int(const moert_config *cfg, const char *key, int64_t *out)
{
    return moert_config_get_int(cfg, key, out);
}

/* Reads the trainer's settings from the config as moert resolved it. */
static moert_result read_settings(const moert_config *cfg, trainer_settings *s)
{
    moert_result rc = MOERT_OK;
    char text[64];
    int64_t flag = 0;
    memset(s, 0, sizeof *s);
    CHECK(moert_config_get_string(cfg, "name", s->name, sizeof s->name));
    CHECK(get_int(cfg, "model.num_layers", &s->num_layers));
    CHECK(get_int(cfg, "model.hidden", &s->hidden));
    CHECK(get_int(cfg, "model.ffn_hidden", &s->ffn_hidden));
    CHECK(get_int(cfg, "model.num_experts", &s->num_experts));
    CHECK(get_int(cfg, "model.topk", &s->topk));
    CHECK(moert_config_get_string(cfg, "model.dtype", text, sizeof text));
    s->dtype = MOERT_DTYPE_COUNT;
    for (int d = 0; d < MOERT_DTYPE_COUNT; d++)
        if (strcmp(text, moert_dtype_name((moert_dtype)d)) == 0) s->dtype = (moert_dtype)d;
    if (s->dtype == MOERT_DTYPE_COUNT)
        return moert_set_last_error(MOERT_ERR_CONFIG, "config error at $.model.dtype: \"%s\" is not a dtype", text);
    CHECK(get_int(cfg, "model.shared_expert_ffn_hidden", &s->shared_expert_ffn_hidden));
    CHECK(get_int(cfg, "model.shared_expert_gate", &flag));
    s->shared_expert_gate = flag != 0;
    CHECK(get_int(cfg, "parallel.ranks", &s->ranks));
    CHECK(get_int(cfg, "parallel.expert_tensor_parallel", &s->expert_tensor_parallel));
    CHECK(get_int(cfg, "parallel.expert_data_parallel", &s->expert_data_parallel));
    CHECK(moert_config_get_string(cfg, "parallel.device", text, sizeof text));
    s->device = strcmp(text, "cpu") == 0    ? TRAINER_DEVICE_CPU
                : strcmp(text, "cuda") == 0 ? TRAINER_DEVICE_CUDA
                                            : TRAINER_DEVICE_AUTO;
    CHECK(moert_config_get_double(cfg, "parallel.timeout_s", &s->timeout_s));
    CHECK(moert_config_get_string(cfg, "parallel.cuda_graph", text, sizeof text));
    s->cuda_graph = strcmp(text, "off") == 0  ? TRAINER_GRAPH_OFF
                    : strcmp(text, "on") == 0 ? TRAINER_GRAPH_ON
                                              : TRAINER_GRAPH_AUTO;
    CHECK(get_int(cfg, "train.steps", &s->steps));
    CHECK(get_int(cfg, "train.tokens_per_rank", &s->tokens_per_rank));
    /* a micro-batch of this trainer holds whole sequences (a per-sequence aux loss needs them: refused here, at
     * start-up, rather than by the router at the first forward) */
    int64_t seq_length = 0;
    CHECK(get_int(cfg, "train.seq_length", &seq_length));
    if (seq_length > 0 && s->tokens_per_rank % seq_length != 0)
        return moert_set_last_error(MOERT_ERR_CONFIG,
                                    "config error at $.train.seq_length: got %lld, expected a divisor of "
                                    "$.train.tokens_per_rank (%lld): a rank's micro-batch holds whole sequences",
                                    (long long)seq_length, (long long)s->tokens_per_rank);
    CHECK(get_int(cfg, "train.micro_batches", &s->micro_batches));
    CHECK(get_int(cfg, "train.seed", &s->seed));
    CHECK(get_int(cfg, "train.log_every", &s->log_every));
    CHECK(moert_config_get_double(cfg, "train.lr", &s->lr));
    CHECK(moert_config_get_double(cfg, "train.weight_decay", &s->weight_decay));
    CHECK(moert_config_get_double(cfg, "train.teacher_scale", &s->teacher_scale));
    CHECK(moert_config_get_double(cfg, "train.input_shift", &s->input_shift));
    CHECK(moert_config_get_string(cfg, "train.data", text, sizeof text));
    s->repeat_batch = strcmp(text, "repeat") == 0;
    CHECK(moert_config_get_string(cfg, "train.optimizer", text, sizeof text));
    s->sgd = strcmp(text, "sgd") == 0;
fail:
    return rc;
}

/*
 * A launcher (torchrun, or srun with the variables exported) started one process per GPU when RANK and
 * WORLD_SIZE are set: this process is then one rank, on GPU LOCAL_RANK, and NCCL is bootstrapped from
 * MASTER_ADDR/MASTER_PORT (moert_comm_create_launcher). Without them, one process runs every rank as a thread.
 */
static moert_result detect_processes(moert_runtime *rt)
{
    if (!getenv("WORLD_SIZE") || !getenv("RANK")) return MOERT_OK;
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    rt->env.struct_size = sizeof rt->env;
    CHECK(moert_comm_create_launcher(rt->set.timeout_s, &rt->env, &rt->comm));
    if (rt->env.world_size != rt->world)
        return moert_set_last_error(MOERT_ERR_CONFIG,
                                    "config error at $.parallel.ranks: %d ranks, but the launcher started %d "
                                    "processes (WORLD_SIZE)",
                                    rt->world, rt->env.world_size);
    if (rt->set.device == TRAINER_DEVICE_CPU)
        return moert_set_last_error(MOERT_ERR_CONFIG,
                                    "config error at $.parallel.device: \"cpu\", but the launcher started a "
                                    "process per rank (RANK, WORLD_SIZE set); on the CPU run moert without a launcher "
                                    "(ranks as threads)");
    rt->processes = true;
fail:
    return rc;
#else
    return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                "launched as a process per rank (WORLD_SIZE=%s), but this build has "
                                "no CUDA/NCCL; run moert without a launcher (ranks as threads)",
                                getenv("WORLD_SIZE"));
#endif
}

/* "auto": the GPUs when this build has CUDA and enough of them answer, else the CPU. */
static moert_result choose_device(moert_runtime *rt)
{
    trainer_device_choice want = rt->set.device;
    int gpus = 0;
#ifdef MOERT_HAVE_CUDA
    char name[256];
    if (want != TRAINER_DEVICE_CPU && trainer_cuda_device_count(&gpus) != MOERT_OK) gpus = 0;
    if (rt->processes) {
        int device = rt->env.local_rank;
        if (gpus <= device)
            return moert_set_last_error(MOERT_ERR_UNSUPPORTED,
                                        "rank %d: LOCAL_RANK %d but %d GPU%s answer on this host", rt->env.rank, device,
                                        gpus, gpus == 1 ? "" : "s");
        rt->device_type = MOERT_DEVICE_CUDA;
        if (trainer_cuda_device_name(device, name, sizeof name) != MOERT_OK) snprintf(name, sizeof name, "GPU");
        snprintf(rt->device_name, sizeof rt->device_name, "cuda (%d x %s, a process per GPU)", rt->world, name);
        return MOERT_OK;
    }
#endif
    if (want == TRAINER_DEVICE_CUDA && gpus == 0)
        return moert_set_last_error(
            MOERT_ERR_UNSUPPORTED,
            "config error at $.parallel.device: \"cuda\" asked for, but %s; use \"cpu\" or \"auto\"",
#ifdef MOERT_HAVE_CUDA
            "no GPU answers on this machine"
#else
            "this build has no CUDA (configure with -Dcuda=enabled)"
#endif
        );
    if (want == TRAINER_DEVICE_CUDA && gpus < rt->world)
        return moert_set_last_error(MOERT_ERR_CONFIG,
                                    "config error at $.parallel.ranks: %d ranks on \"cuda\" need %d GPUs, "
                                    "this machine has %d",
                                    rt->world, rt->world, gpus);
    if (gpus >= rt->world && want != TRAINER_DEVICE_CPU) {
        rt->device_type = MOERT_DEVICE_CUDA;
#ifdef MOERT_HAVE_CUDA
        if (trainer_cuda_device_name(0, name, sizeof name) == MOERT_OK)
            snprintf(rt->device_name, sizeof rt->device_name, "cuda (%d x %s, a thread per GPU)", rt->world, name);
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

/* Memory from the rank's layers (their pool on GPUs) into t, a [rows, cols] tensor of dtype on `device`. */
static moert_result rank_alloc(moert_rank *r, moert_tensor *t, moert_device device, moert_dtype dtype, int64_t rows,
                               int64_t cols)
{
    *t = moert_tensor_2d(NULL, device, dtype, rows, cols);
    return moert_layers_alloc(r->layers, device, moert_tensor_bytes(t), &t->data);
}

/* Creates this rank's layers (one instance of every plugin per layer) and its step buffers. */
static moert_result rank_init(moert_rank *r, void *arg)
{
    (void)arg;
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const trainer_settings *set = &rt->set;
    int nl = (int)set->num_layers;
    moert_device device = {rt->device_type, rt->device_type == MOERT_DEVICE_CUDA ? r->device : 0};
    moert_launch launch = {.struct_size = sizeof launch,
                           .rank = r->rank,
                           .world_size = rt->world,
                           .device = device,
                           .comm = rt->comm,
                           .max_tokens = set->tokens_per_rank,
                           .expert_tensor_parallel = (int32_t)set->expert_tensor_parallel,
                           .expert_data_parallel = (int32_t)set->expert_data_parallel,
                           .flags = MOERT_LAUNCH_RESIDUAL,
                           .micro_batches = (int32_t)set->micro_batches};
    CHECK(moert_layers_create(rt->cfg, &launch, &r->layers));
    r->info.struct_size = sizeof r->info;
    CHECK(moert_layers_get_info(r->layers, &r->info));
    /* whether the second slot is there; on the CPU the merged halves then run one after the other unless a test asks
     * them to take turns (moert_runtime_overlap_set_interleave); on CUDA they always take turns: that is the overlap */
    r->overlap = r->info.slots > 1;
    /* the layers' own high-priority stream: the trainer's work queues there, ordered with theirs */
    r->stream = r->info.stream;
    void *work = NULL;
    CHECK(moert_layers_alloc(r->layers, device, TRAINER_LOSS_WORKSPACE_BYTES, &work));
    r->workspace = work;
    r->acts = calloc((size_t)nl + 1, sizeof *r->acts);
    r->params = calloc((size_t)nl, sizeof *r->params);
    r->saved = calloc((size_t)nl, sizeof *r->saved);
    r->saved1 = calloc((size_t)nl, sizeof *r->saved1);
    r->router_losses = calloc((size_t)nl, sizeof *r->router_losses);
    if (!r->acts || !r->params || !r->saved || !r->saved1 || !r->router_losses)
        return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the rank's buffers: out of memory");
    /* Pinned, so the small device-to-host copies of the step never wait behind an offload copy of
     * the copy engines as pageable copies do (the host thread would block and the GPU idle). */
    const size_t counts_bytes = (size_t)nl * (size_t)set->num_experts * sizeof *r->counts;
    int64_t **counts[2] = {&r->counts, &r->micro_counts};
    for (int i = 0; i < 2; i++) {
        void *p = NULL;
        CHECK(moert_layers_alloc(r->layers, pinned_device(r), counts_bytes, &p));
        *counts[i] = p;
        memset(p, 0, counts_bytes);
    }
    void *loss = NULL;
    CHECK(moert_layers_alloc(r->layers, pinned_device(r), sizeof *r->loss_result, &loss));
    r->loss_result = loss;
fail:
    return rc;
}

/* Gives a tensor's memory back to the rank's layers. */
static void rank_free(moert_rank *r, moert_tensor *t)
{
    if (t->data) moert_layers_free(r->layers, t->device, t->data);
    t->data = NULL;
}

static moert_result rank_finalize(moert_rank *r, void *arg)
{
    (void)arg;
    moert_runtime *rt = r->rt;
    int nl = (int)rt->set.num_layers;
    if (r->layers) {
        if (rank_sync(r) != MOERT_OK) moert_set_last_error(MOERT_OK, "%s", "");
        for (int form = 0; form < 2; form++) {
            moert_graph_destroy(r->graph_forward[form]);
            moert_graph_destroy(r->graph_backward[form]);
            r->graph_forward[form] = r->graph_backward[form] = NULL;
        }
        for (int l = 0; r->saved && l < nl; l++) moert_saved_free(r->saved[l]);
        for (int l = 0; r->saved1 && l < nl; l++) moert_saved_free(r->saved1[l]);
        /* the device the rank's buffers were allocated on */
        moert_device device = {rt->device_type, rt->device_type == MOERT_DEVICE_CUDA ? r->device : 0};
        for (int l = 0; r->params && l < nl; l++)
            for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
                trainer_param *tp = &r->params[l][p];
                moert_tensor *ts[4] = {&tp->value, &tp->grad, &tp->m, &tp->v};
                for (int k = 0; k < 4; k++) rank_free(r, ts[k]);
            }
        for (int l = 0; r->acts && l <= nl; l++) rank_free(r, &r->acts[l]);
        for (int l = 0; r->acts1 && l <= nl; l++) rank_free(r, &r->acts1[l]);
        moert_tensor *bufs[4] = {&r->grad_a, &r->grad_b, &r->target, &r->target1};
        for (int i = 0; i < 4; i++) rank_free(r, bufs[i]);
        if (r->workspace) moert_layers_free(r->layers, device, r->workspace);
        if (r->counts) moert_layers_free(r->layers, pinned_device(r), r->counts);
        if (r->micro_counts) moert_layers_free(r->layers, pinned_device(r), r->micro_counts);
        if (r->loss_result) moert_layers_free(r->layers, pinned_device(r), r->loss_result);
        moert_layers_destroy(r->layers);
        r->layers = NULL;
    }
    r->workspace = NULL;
    r->counts = r->micro_counts = NULL;
    r->loss_result = NULL;
    free(r->x_host.data);
    free(r->target_host.data);
    moert_trace_clear(&r->trace);
    free(r->acts);
    free(r->params);
    free(r->saved);
    free(r->saved1);
    free(r->acts1);
    free(r->router_losses);
    r->acts = r->acts1 = NULL;
    r->params = NULL;
    r->saved = r->saved1 = NULL;
    r->router_losses = NULL;
    return MOERT_OK;
}

/* Names, versions and files of the plugins rank 0's layers loaded, for reports. */
static moert_result describe_plugins(moert_runtime *rt)
{
    static const moert_plugin_kind kinds[4] = {MOERT_KIND_ROUTER, MOERT_KIND_DISPATCHER, MOERT_KIND_PRECISION,
                                               MOERT_KIND_MEMORY_POLICY};
    moert_result rc = MOERT_OK;
    for (int s = 0; s < 4; s++) {
        rt->plugins[s].struct_size = sizeof rt->plugins[s];
        CHECK(moert_layers_plugin(rt->ranks[0].layers, kinds[s], &rt->plugins[s]));
    }
fail:
    return rc;
}

/* Whether rank r's layer step can be captured in a CUDA graph; where not, why into why. */
static bool graph_capturable(const moert_rank *r, char *why, size_t size)
{
    if (r->rt->device_type != MOERT_DEVICE_CUDA) {
        snprintf(why, size, "the ranks run on the CPU");
        return false;
    }
    return moert_layers_graph_capturable(r->layers, why, size);
}

/* $.parallel.cuda_graph "on" where the step cannot be captured: the config error, at start-up (moert check says it
 * too) rather than at the first step. */
static moert_result graph_on_refused(const char *why)
{
    return moert_set_last_error(MOERT_ERR_CONFIG,
                                "config error at $.parallel.cuda_graph: \"on\" needs a layer step that can be captured "
                                "in a CUDA graph, but %s (use \"auto\" to run without graphs then)",
                                why);
}

moert_result moert_runtime_create(const moert_config *cfg, moert_runtime **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    moert_runtime *rt = calloc(1, sizeof *rt);
    if (!rt) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "moert_runtime_create: out of memory");
    rt->cfg = cfg;
    CHECK(read_settings(cfg, &rt->set));
    rt->world = (int)rt->set.ranks;
    CHECK(detect_processes(rt));
    CHECK(choose_device(rt));
    /* refuse what cannot fit before any plugin starts or any rank allocates */
    CHECK(moert_config_memory_estimate(cfg, rt->world, rt->device_type, rt->memory_line, sizeof rt->memory_line));
    /* ranks as threads: one communicator shared by them (host memory, and NCCL on GPUs) */
    if (rt->world > 1 && !rt->processes) CHECK(moert_comm_create_threads(rt->world, rt->set.timeout_s, &rt->comm));
    rt->nlocal = rt->processes ? 1 : rt->world;
    rt->ranks = calloc((size_t)rt->nlocal, sizeof *rt->ranks);
    if (!rt->ranks) {
        rc = moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "moert_runtime_create: out of memory");
        goto fail;
    }
    for (int i = 0; i < rt->nlocal; i++) {
        rt->ranks[i].rt = rt;
        rt->ranks[i].rank = i;
        rt->ranks[i].device = i;
    }
    if (rt->processes) {
        rt->ranks[0].rank = rt->env.rank;
        rt->ranks[0].device = rt->env.local_rank;
    }
    CHECK(trainer_run_on_ranks(rt, rank_init, NULL));
    CHECK(describe_plugins(rt));
    if (rt->set.cuda_graph == TRAINER_GRAPH_ON) {
        char why[256] = "";
        if (!graph_capturable(&rt->ranks[0], why, sizeof why)) CHECK(graph_on_refused(why));
    }
    *out = rt;
    return MOERT_OK;
fail:
    if (rt) {
        char saved[MOERT_ERROR_MAX];
        snprintf(saved, sizeof saved, "%s", moert_last_error());
        moert_runtime_destroy(rt);
        moert_set_last_error(rc, "%s", saved);
    }
    return rc;
}

void moert_runtime_destroy(moert_runtime *rt)
{
    if (!rt) return;
    /* a stalled rank left running may still use all of it (its rank, the communicator, the layers): nothing is freed */
    if (rt->abandoned_ranks > 0) return;
    if (rt->ranks) {
        /* finalize on one thread per rank too: a plugin may tie resources to its rank's thread */
        trainer_run_on_ranks(rt, rank_finalize, NULL);
    }
    moert_comm_destroy(rt->comm);
    moert_teacher_free(rt->teacher);
    free(rt->ranks);
    free(rt->records);
    free(rt->final_counts);
    free(rt->final_bias);
    free(rt->bias_start);
    free(rt);
}

/* ---- the training step ---- */

/* Parameters (bound to the layers, with moert's initial values), optimizer state and step buffers of one rank. */
static moert_result rank_prepare(moert_rank *r, void *arg)
{
    (void)arg;
    moert_result rc = MOERT_OK;
    const trainer_settings *set = &r->rt->set;
    int64_t t = set->tokens_per_rank, h = set->hidden;
    const moert_device dev = r->info.device;
    for (int l = 0; l < set->num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            moert_tensor desc;
            if (moert_layers_param_desc(r->layers, l, (moert_param_id)p, &desc) == MOERT_ERR_UNSUPPORTED) {
                moert_set_last_error(MOERT_OK, "%s", ""); /* the config has no such parameter */
                continue;
            }
            trainer_param *tp = &r->params[l][p];
            moert_tensor *ts[4] = {&tp->value, &tp->grad, &tp->m, &tp->v};
            for (int k = 0; k < (set->sgd ? 2 : 4); k++) {
                *ts[k] = desc;
                ts[k]->device = dev;
                CHECK(moert_layers_alloc(r->layers, dev, moert_tensor_bytes(&desc), &ts[k]->data));
            }
            /* Adam's moments start at zero */
            for (int k = 2; k < (set->sgd ? 2 : 4); k++) {
#ifdef MOERT_HAVE_CUDA
                if (dev.type == MOERT_DEVICE_CUDA) {
                    CHECK(trainer_cuda_zero(ts[k]->data, moert_tensor_bytes(ts[k]), r->stream));
                    continue;
                }
#endif
                memset(ts[k]->data, 0, moert_tensor_bytes(ts[k]));
            }
            CHECK(moert_layers_bind_param(r->layers, l, (moert_param_id)p, &tp->value, &tp->grad));
        }
    CHECK(moert_layers_init_params(r->layers, (uint64_t)set->seed, r->stream));
    for (int l = 0; l <= set->num_layers; l++) CHECK(rank_alloc(r, &r->acts[l], dev, set->dtype, t, h));
    CHECK(rank_alloc(r, &r->grad_a, dev, set->dtype, t, h));
    CHECK(rank_alloc(r, &r->grad_b, dev, set->dtype, t, h));
    CHECK(rank_alloc(r, &r->target, dev, set->dtype, t, h));
    r->x_host = moert_tensor_2d(calloc((size_t)(t * h), sizeof(double)), moert_cpu(), MOERT_F64, t, h);
    r->target_host = moert_tensor_2d(calloc((size_t)(t * h), sizeof(double)), moert_cpu(), MOERT_F64, t, h);
    if (!r->x_host.data || !r->target_host.data)
        return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the rank's batch: out of memory");
fail:
    return rc;
}

static moert_result ensure_params(moert_runtime *rt)
{
    if (rt->params_ready) return MOERT_OK;
    /* what fits was checked by moert_runtime_create (moert_config_memory_estimate) */
    moert_result rc = moert_teacher_create(rt->set.hidden, (uint64_t)rt->set.seed + 7777, rt->set.teacher_scale,
                                           rt->set.input_shift, &rt->teacher);
    if (rc != MOERT_OK) return rc;
    rc = trainer_run_on_ranks(rt, rank_prepare, NULL);
    if (rc == MOERT_OK) rt->params_ready = true;
    return rc;
}

/* Micro-batch data: this rank's slice of the micro-batch's global tokens, and the teacher's targets. Micro-batch m
 * of step s is batch s * micro_batches + m of the data stream, so on one rank the micro-batches of a step hold the
 * tokens that one batch of micro_batches times as many tokens would (and with one micro-batch, batch s). */
static moert_result load_batch_into(moert_rank *r, int64_t step, int64_t micro, moert_tensor *x, moert_tensor *target,
                                    bool *loaded)
{
    const trainer_settings *set = &r->rt->set;
    int64_t batch = step * set->micro_batches + micro;
    if (set->repeat_batch) {
        if (*loaded) return MOERT_OK;
        batch = 1;
        *loaded = true;
    }
    int64_t t = set->tokens_per_rank, h = set->hidden;
    uint64_t first =
        ((uint64_t)batch * (uint64_t)r->rt->world * (uint64_t)t + (uint64_t)r->rank * (uint64_t)t) * (uint64_t)h;
    moert_teacher_sample_inputs(r->rt->teacher, &r->x_host, (uint64_t)set->seed, first);
    moert_teacher_apply(r->rt->teacher, &r->x_host, &r->target_host);
    /* round through the storage dtype on the host, then copy */
    moert_result rc = MOERT_OK;
    moert_tensor src[2] = {r->x_host, r->target_host};
    moert_tensor *dst[2] = {x, target};
    for (int i = 0; i < 2; i++) {
        moert_tensor staged = *dst[i];
        staged.device = moert_cpu();
        staged.data = malloc(moert_tensor_bytes(dst[i]));
        if (!staged.data) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "staging the batch");
        for (int64_t k = 0; k < moert_tensor_numel(&staged); k++) moert_store(&staged, k, moert_load(&src[i], k));
        rc = rank_copy(r, dst[i]->data, staged.data, moert_tensor_bytes(dst[i]));
        /* the staging buffer is pageable: the copy must be done before it is freed */
        if (rc == MOERT_OK) rc = rank_sync(r);
        free(staged.data);
        if (rc != MOERT_OK) {
            char why[2048];
            snprintf(why, sizeof why, "%s", moert_last_error());
            return moert_set_last_error(rc, "copying the batch: %s", why);
        }
    }
    return MOERT_OK;
}

/* Micro-batch data into the rank's input and target (the even micro-batches' with micro-batch overlap). */
static moert_result load_batch(moert_rank *r, int64_t step, int64_t micro)
{
    return load_batch_into(r, step, micro, &r->acts[0], &r->target, &r->batch_loaded);
}

/* buf (count elements of dtype, host memory) summed over every rank, in place. */
static moert_result allreduce_host(moert_rank *r, void *buf, size_t count, moert_dtype dtype)
{
    moert_tensor t = moert_tensor_1d(buf, moert_cpu(), dtype, (int64_t)count);
    return moert_layers_allreduce_sum(r->layers, MOERT_GROUP_WORLD, &t, r->stream);
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
    trainer_graph_mode mode = rt->set.cuda_graph;
    *plan = GRAPH_EAGER;
    if (r->graph_forward[form]) {
        *plan = GRAPH_REPLAY;
        return MOERT_OK;
    }
    if (mode == TRAINER_GRAPH_OFF || rt->graph_failed) {
        if (r->rank == 0 && !rt->graph_reason[0])
            snprintf(rt->graph_reason, sizeof rt->graph_reason, "$.parallel.cuda_graph is \"off\"");
        return MOERT_OK;
    }
    char why[256] = "";
    if (!graph_capturable(r, why, sizeof why)) {
        if (mode == TRAINER_GRAPH_ON) return graph_on_refused(why);
        if (r->rank == 0) snprintf(rt->graph_reason, sizeof rt->graph_reason, "%s", why);
        return MOERT_OK;
    }
    /* one eager pass first: plugins set themselves up and the pool holds every block the step needs */
    if (r->eager_steps >= 1) *plan = GRAPH_CAPTURE;
    return MOERT_OK;
}

/* Ends a capture (also after a failure inside it, rc_inside) into *graph and launches it once. */
static moert_result capture_end(moert_rank *r, moert_result rc_inside, const char *what, moert_graph **graph)
{
    char inside[1024] = "";
    if (rc_inside != MOERT_OK) snprintf(inside, sizeof inside, "%s", moert_last_error());
    moert_result rc = moert_layers_capture_end(r->layers, r->stream, what, graph);
    if (rc_inside != MOERT_OK) {
        moert_graph_destroy(*graph);
        *graph = NULL;
        return moert_set_last_error(rc_inside,
                                    "while capturing %s into a CUDA graph: %s (set $.parallel.cuda_graph to \"off\" "
                                    "to run it without graphs)",
                                    what, inside);
    }
    if (rc != MOERT_OK) return rc;
    return moert_graph_launch(*graph, r->stream);
}

/* Forward of the layers on the residual stream: eager, captured into r->graph_forward[form] (and run), or its replay.
 * Each layer's router losses are kept (a replay's are those of the last forward run on the host). */
static moert_result stack_forward(moert_rank *r, graph_plan plan, int form)
{
    moert_result rc = MOERT_OK, inside = MOERT_OK;
    int nl = (int)r->rt->set.num_layers;
    if (plan == GRAPH_REPLAY) return moert_graph_launch(r->graph_forward[form], r->stream);
    if (plan == GRAPH_CAPTURE) CHECK(moert_layers_capture_begin(r->layers, r->stream));
    for (int l = 0; l < nl && inside == MOERT_OK; l++) {
        moert_moe_stats stats = {.struct_size = sizeof stats};
        inside = moert_moe_forward(r->layers, l, &r->acts[l], &r->acts[l + 1], r->stream, &r->saved[l], &stats);
        if (inside == MOERT_OK) r->router_losses[l] = stats.router_loss;
    }
    if (plan == GRAPH_CAPTURE) return capture_end(r, inside, "the layers' forward", &r->graph_forward[form]);
    rc = inside;
fail:
    return rc;
}

/* Backward of the layers from r->grad_a, the same three ways; the router losses enter with loss_scale. A step's first
 * micro-batch (form 0) overwrites the gradients; the others add to them. */
static moert_result stack_backward(moert_rank *r, graph_plan plan, int form, double loss_scale)
{
    moert_result rc = MOERT_OK, inside = MOERT_OK;
    int nl = (int)r->rt->set.num_layers;
    moert_tensor *d_y = &r->grad_a, *d_x = &r->grad_b;
    if (plan == GRAPH_REPLAY) return moert_graph_launch(r->graph_backward[form], r->stream);
    if (plan == GRAPH_CAPTURE) CHECK(moert_layers_capture_begin(r->layers, r->stream));
    const moert_backward_options opts = {
        .struct_size = sizeof opts, .router_loss_scale = loss_scale, .accumulate = form != 0};
    for (int l = nl - 1; l >= 0 && inside == MOERT_OK; l--) {
        moert_saved *saved = r->saved[l];
        r->saved[l] = NULL; /* consumed by the backward, whatever its outcome */
        inside = moert_moe_backward(r->layers, saved, d_y, d_x, &opts, r->stream);
        moert_tensor *tmp = d_y;
        d_y = d_x;
        d_x = tmp;
    }
    if (plan == GRAPH_CAPTURE) return capture_end(r, inside, "the layers' backward", &r->graph_backward[form]);
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
    for (int l = 0; l < r->rt->set.num_layers; l++) {
        moert_span spans[MOERT_LAYERS_MAX_SPANS];
        int n = 0;
        CHECK(moert_layers_spans(r->layers, l, 0, spans, MOERT_LAYERS_MAX_SPANS, &n));
        for (int i = 0; i < n; i++) {
            /* with micro-batch overlap the odd micro-batches run in the layers' second slot, on its own streams
             * (the dispatcher's calls of both slots share the rank's one communication stream) */
            const bool slot1 = r->overlap && micro % 2 == 1 && strcmp(spans[i].stream, "dispatcher") != 0;
            const char *stream = !slot1                                ? spans[i].stream
                                 : !strcmp(spans[i].stream, "compute") ? "compute.1"
                                 : !strcmp(spans[i].stream, "host")    ? "host.1"
                                                                       : "wgrad.1";
            moert_trace_span span = {.name = spans[i].name,
                                     .stream = stream,
                                     .rank = r->rank,
                                     .layer = l,
                                     .step = step,
                                     .micro = micro,
                                     .start_us = base_us + 1e6 * spans[i].start_s,
                                     .dur_us = 1e6 * spans[i].dur_s};
            CHECK(moert_trace_add(&r->trace, &span));
        }
    }
fail:
    return rc;
}

/* One micro-batch's forward and backward on one rank: its squared error, router losses, tokens per expert and times
 * are added to the step's. The first micro-batch of a step overwrites the gradients; the others add to them. Each
 * micro-batch's losses enter as its share of the step's mean, so the gradients of a step are those of one batch of
 * all its tokens. */
static moert_result micro_batch(moert_rank *r, int64_t step, int64_t micro)
{
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const trainer_settings *set = &rt->set;
    int nl = (int)set->num_layers;
    int64_t e = set->num_experts;
    const double micro_batches = (double)set->micro_batches;
    double step_elems = micro_batches * (double)rt->world * (double)set->tokens_per_rank * (double)set->hidden;
    graph_plan plan = GRAPH_EAGER;
    double t0 = harness_seconds();

    CHECK(load_batch(r, step, micro));
    const int form = graph_form(micro);
    CHECK(graph_plan_of(r, form, &plan));
    rc = stack_forward(r, plan, form);
    if (rc != MOERT_OK) {
        if (plan == GRAPH_CAPTURE && r->rank == 0) rt->graph_failed = true;
        goto fail;
    }
    for (int l = 0; l < nl; l++) r->router_loss += r->router_losses[l];
    CHECK(rank_sync(r));
    /* offload copies that finished during the forward give their device buffers back before the backward */
    if (plan == GRAPH_EAGER) CHECK(moert_layers_release_offloaded(r->layers, r->stream));
    double mse_sum = 0.0;
    CHECK(trainer_squared_error(r->stream, &r->acts[nl], &r->target, 1.0 / step_elems, r->workspace, r->loss_result,
                                &mse_sum, &r->grad_a));
    r->mse_sum += mse_sum;
    CHECK(stack_backward(r, plan, form, 1.0 / (micro_batches * rt->world)));
    if (plan == GRAPH_EAGER) r->eager_steps++;
    if (r->rank == 0 && plan == GRAPH_CAPTURE) {
        rt->graph_captured_step = step;
        rt->graph_capture_seconds = harness_seconds() - t0;
    }
    if (r->rank == 0 && plan == GRAPH_REPLAY) rt->graph_replays++;
    /* tokens per expert for the report: the router's counts to the host, after the backward (a small copy issued
     * during the forward would wait on the copy engine behind the offload copies) */
    for (int l = 0; l < nl; l++) {
        moert_tensor c = moert_tensor_1d(r->micro_counts + (size_t)l * (size_t)e, pinned_device(r), MOERT_I64, e);
        CHECK(moert_layers_tokens_per_expert(r->layers, l, &c, r->stream));
    }
    for (int l = 0; l < nl; l++) {
        moert_layer_figures fig = {.struct_size = sizeof fig};
        CHECK(moert_layers_figures(r->layers, l, &fig)); /* waits for the layer's backward */
        for (int s = 0; s < MOERT_LAYER_STAGES; s++) r->stage_seconds[s] += 1e-3 * fig.stage_ms[s];
        for (int p = 0; p < MOERT_LAYER_BACKWARD_PARTS; p++)
            r->backward_part_seconds[p] += 1e-3 * fig.backward_part_ms[p];
    }
    if (rt->tracing) CHECK(trace_micro_batch(r, step, micro, t0));
    CHECK(rank_sync(r)); /* the counts have landed */
    for (size_t i = 0; i < (size_t)nl * (size_t)e; i++) r->counts[i] += r->micro_counts[i];
fail:
    return rc;
}

/* ---- micro-batch overlap ($.parallel.overlap_micro_batches, docs/executor.md "Micro-batch overlap") ---- */

/* Odd micro-batches' input, residual stream and target, made at the first overlapped step. */
static moert_result overlap_buffers(moert_rank *r)
{
    moert_result rc = MOERT_OK;
    const trainer_settings *set = &r->rt->set;
    const int nl = (int)set->num_layers;
    if (r->acts1) return MOERT_OK;
    r->acts1 = calloc((size_t)nl + 1, sizeof *r->acts1);
    if (!r->acts1) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the rank's buffers: out of memory");
    for (int l = 0; l <= nl; l++)
        CHECK(rank_alloc(r, &r->acts1[l], r->info.device, r->info.dtype, set->tokens_per_rank, set->hidden));
    CHECK(rank_alloc(r, &r->target1, r->info.device, r->info.dtype, set->tokens_per_rank, set->hidden));
fail:
    return rc;
}

/* Micro-batch `micro`'s data into the buffers of parity `odd`. */
static moert_result overlap_load(moert_rank *r, bool odd, int64_t step, int64_t micro)
{
    if (!odd) return load_batch(r, step, micro);
    return load_batch_into(r, step, micro, &r->acts1[0], &r->target1, &r->batch_loaded1);
}

/* After the forward of layer l of a micro-batch (alone or merged): its tokens per expert to the host (they land by
 * the next synchronisation). */
static moert_result overlap_after_forward(moert_rank *r, int l, const moert_moe_stats *stats)
{
    const int64_t e = r->rt->set.num_experts;
    r->router_loss += stats->router_loss;
    moert_tensor c = moert_tensor_1d(r->micro_counts + (size_t)l * (size_t)e, pinned_device(r), MOERT_I64, e);
    return moert_layers_tokens_per_expert(r->layers, l, &c, r->stream);
}

/* The figures and trace spans of micro-batch `micro`, whose backward has just finished in every layer. */
static moert_result overlap_collect(moert_rank *r, int64_t step, int64_t micro, double started)
{
    moert_result rc = MOERT_OK;
    const int nl = (int)r->rt->set.num_layers;
    for (int l = 0; l < nl; l++) {
        moert_layer_figures fig = {.struct_size = sizeof fig};
        CHECK(moert_layers_figures(r->layers, l, &fig));
        for (int s = 0; s < MOERT_LAYER_STAGES; s++) r->stage_seconds[s] += 1e-3 * fig.stage_ms[s];
        for (int p = 0; p < MOERT_LAYER_BACKWARD_PARTS; p++)
            r->backward_part_seconds[p] += 1e-3 * fig.backward_part_ms[p];
    }
    if (r->rt->tracing) CHECK(trace_micro_batch(r, step, micro, started));
fail:
    return rc;
}

/* The step with micro-batch i's forward merged with micro-batch i-1's backward, layer by layer: F0 of every layer;
 * then for i = 1 .. M-1 and k = 0 .. L-1, F_i(layer k) with B_{i-1}(layer L-1-k), and the loss of micro-batch i once
 * its forward is done; then B_{M-1} of every layer. Even micro-batches use acts and saved, odd ones acts1 and saved1
 * (the layers put them in their two slots). The gradients accumulate in the order of the sequential schedule, so the
 * results are those of micro_batch() bit for bit. */
static moert_result rank_forward_backward_overlapped(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    moert_runtime *rt = r->rt;
    const trainer_settings *set = &rt->set;
    const int nl = (int)set->num_layers;
    const int64_t m = set->micro_batches, e = set->num_experts;
    const double micro_batches = (double)m;
    const double step_elems = micro_batches * (double)rt->world * (double)set->tokens_per_rank * (double)set->hidden;
    double started[2] = {0.0, 0.0};
    CHECK(overlap_buffers(r));
    if (r->rank == 0 && !rt->graph_reason[0])
        snprintf(rt->graph_reason, sizeof rt->graph_reason, "$.parallel.overlap_micro_batches is on");
    for (int64_t i = 0; i < m; i++) {
        const bool odd = i % 2 == 1;
        moert_tensor *acts = odd ? r->acts1 : r->acts;
        moert_saved **saved = odd ? r->saved1 : r->saved, **prev = odd ? r->saved : r->saved1;
        started[odd] = harness_seconds();
        CHECK(overlap_load(r, odd, step, i));
        moert_tensor *d_y = &r->grad_a, *d_x = &r->grad_b;
        /* micro-batch i-1's backward: the step's first overwrites the gradients */
        const moert_backward_options opts = {
            .struct_size = sizeof opts, .router_loss_scale = 1.0 / (micro_batches * rt->world), .accumulate = i > 1};
        for (int k = 0; k < nl; k++) {
            moert_moe_stats stats = {.struct_size = sizeof stats};
            if (i == 0) {
                CHECK(moert_moe_forward(r->layers, k, &acts[k], &acts[k + 1], r->stream, &saved[k], &stats));
            } else {
                const int bl = nl - 1 - k;
                moert_saved *b = prev[bl];
                prev[bl] = NULL; /* consumed by the call, whatever its outcome */
                CHECK(moert_moe_forward_backward(r->layers, k, &acts[k], &acts[k + 1], &saved[k], &stats, b, d_y, d_x,
                                                 &opts, r->stream));
                moert_tensor *tmp = d_y;
                d_y = d_x;
                d_x = tmp;
            }
            CHECK(overlap_after_forward(r, k, &stats));
        }
        /* micro-batch i's loss and output gradient (micro-batch i-1's backward is done: they share grad_a) */
        CHECK(rank_sync(r));
        for (size_t c = 0; c < (size_t)nl * (size_t)e; c++) r->counts[c] += r->micro_counts[c];
        double mse_sum = 0.0;
        CHECK(trainer_squared_error(r->stream, &acts[nl], odd ? &r->target1 : &r->target, 1.0 / step_elems,
                                    r->workspace, r->loss_result, &mse_sum, &r->grad_a));
        r->mse_sum += mse_sum;
        if (i > 0) CHECK(overlap_collect(r, step, i - 1, started[!odd]));
    }
    const bool last_odd = (m - 1) % 2 == 1;
    moert_saved **last = last_odd ? r->saved1 : r->saved;
    moert_tensor *d_y = &r->grad_a, *d_x = &r->grad_b;
    const moert_backward_options opts = {
        .struct_size = sizeof opts, .router_loss_scale = 1.0 / (micro_batches * rt->world), .accumulate = m > 1};
    for (int l = nl - 1; l >= 0; l--) {
        moert_saved *b = last[l];
        last[l] = NULL;
        CHECK(moert_moe_backward(r->layers, b, d_y, d_x, &opts, r->stream));
        moert_tensor *tmp = d_y;
        d_y = d_x;
        d_x = tmp;
    }
    CHECK(overlap_collect(r, step, m - 1, started[last_odd]));
    /* the layers' output is the last micro-batch's, where moert_runtime_read_output reads it */
    if (last_odd) CHECK(rank_copy(r, r->acts[nl].data, r->acts1[nl].data, moert_tensor_bytes(&r->acts[nl])));
    r->eager_steps++;
fail:
    return rc;
}

bool moert_runtime_overlap_set_interleave(moert_runtime *rt, bool interleave)
{
    bool made = rt->nlocal > 0;
    for (int i = 0; i < rt->nlocal; i++)
        made = moert_layers_overlap_interleave(rt->ranks[i].layers, interleave) && made;
    return made;
}

/* Forward and backward of the layers on one rank over the step's micro-batches; fills mse_sum, router_loss and
 * counts (over all ranks), the stage times (this rank's) and the gradients (the replicated ones summed over ranks). */
static moert_result rank_forward_backward(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    const trainer_settings *set = &r->rt->set;
    int nl = (int)set->num_layers;
    int64_t e = set->num_experts;
    r->mse_sum = r->router_loss = 0.0;
    memset(r->counts, 0, (size_t)nl * (size_t)e * sizeof *r->counts);
    memset(r->stage_seconds, 0, sizeof r->stage_seconds);
    memset(r->backward_part_seconds, 0, sizeof r->backward_part_seconds);
    if (r->overlap && set->micro_batches >= 2)
        CHECK(rank_forward_backward_overlapped(r, step));
    else
        for (int64_t micro = 0; micro < set->micro_batches; micro++) CHECK(micro_batch(r, step, micro));
    /* the router weight and the shared expert are replicated: their gradients are the sum of every rank's share */
    static const moert_param_id replicated[] = {MOERT_PARAM_ROUTER, MOERT_PARAM_SHARED_FC1, MOERT_PARAM_SHARED_FC2,
                                                MOERT_PARAM_SHARED_GATE};
    for (int l = 0; l < nl && r->rt->world > 1; l++)
        for (size_t k = 0; k < sizeof replicated / sizeof replicated[0]; k++) {
            moert_tensor *g = &r->params[l][replicated[k]].grad;
            if (g->data) CHECK(moert_layers_allreduce_sum(r->layers, MOERT_GROUP_WORLD, g, r->stream));
        }
    /* the experts are replicated over the expert-data-parallel group (docs/parallel.md): their gradients are the sum
     * of every replica's share */
    for (int l = 0; l < nl && r->info.edp_size > 1; l++)
        for (int k = MOERT_PARAM_FC1; k <= MOERT_PARAM_FC2; k++)
            CHECK(moert_layers_allreduce_sum(r->layers, MOERT_GROUP_EDP, &r->params[l][k].grad, r->stream));
    /* figures over all ranks (the router losses: the mean over ranks and micro-batches) */
    double sums[2] = {r->mse_sum, r->router_loss};
    CHECK(allreduce_host(r, sums, 2, MOERT_F64));
    r->mse_sum = sums[0];
    r->router_loss = sums[1] / ((double)r->rt->world * (double)set->micro_batches);
    CHECK(allreduce_host(r, r->counts, (size_t)nl * (size_t)e, MOERT_I64));
fail:
    return rc;
}

/* The optimizer step of every parameter of the rank (Adam step number `step`, or SGD), then the layers' once-per-step
 * hooks: the router's (e.g. the expert bias) and the precision's (weights changed). */
static moert_result rank_optimizer_step(moert_rank *r, int64_t step)
{
    moert_result rc = MOERT_OK;
    const trainer_settings *set = &r->rt->set;
    const trainer_adam adam = {
        .lr = set->lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = set->weight_decay, .step = step};
    const trainer_sgd sgd = {.lr = set->lr, .weight_decay = set->weight_decay};
    for (int l = 0; l < set->num_layers; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            trainer_param *tp = &r->params[l][p];
            if (!tp->value.data) continue;
            if (set->sgd)
                CHECK(trainer_sgd_update(r->stream, &sgd, &tp->value, &tp->grad));
            else
                CHECK(trainer_adam_update(r->stream, &adam, &tp->value, &tp->grad, &tp->m, &tp->v));
        }
    CHECK(moert_layers_update_expert_bias(r->layers, r->stream));
    CHECK(moert_layers_weights_changed(r->layers, r->stream));
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
    const trainer_settings *set = &rt->set;
    int nl = (int)set->num_layers;
    int64_t e = set->num_experts;
    memset(rec, 0, sizeof *rec);
    rec->step = step;
    rec->mse = r0->mse_sum /
               ((double)set->micro_batches * (double)rt->world * (double)set->tokens_per_rank * (double)set->hidden);
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

static void print_progress(const moert_step_record *rec, int64_t steps, FILE *f)
{
    fprintf(f, "step %*lld/%lld  loss %.6f (mse %.6f, router %.2e)  load max/mean %.3f (worst layer %.3f)  %.1f ms\n",
            (int)snprintf(NULL, 0, "%lld", (long long)steps), (long long)rec->step, (long long)steps, rec->loss,
            rec->mse, rec->router_loss, rec->imbalance, rec->imbalance_max, rec->seconds * 1e3);
    fflush(f);
}

/* Copies the routers' expert biases ([layers, E]) to the host, or leaves *out NULL if the router keeps none. */
static moert_result snapshot_bias(moert_runtime *rt, double **out)
{
    moert_rank *r0 = &rt->ranks[0];
    const trainer_settings *set = &rt->set;
    int64_t e = set->num_experts;
    free(*out);
    *out = NULL;
    if (r0->info.expert_bias_dtype == MOERT_DTYPE_COUNT) return MOERT_OK;
    *out = calloc((size_t)(set->num_layers * e), sizeof(double));
    if (!*out) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "bias snapshot");
    for (int l = 0; l < set->num_layers; l++) {
        moert_tensor dst = moert_tensor_1d(*out + (size_t)l * (size_t)e, moert_cpu(), MOERT_F64, e);
        moert_result rc = moert_layers_get_expert_bias(r0->layers, l, &dst, r0->stream);
        if (rc != MOERT_OK) return rc;
    }
    return MOERT_OK;
}

/* One training step on one rank: forward and backward, the optimizer, the layers' end of step. Rank 0 fills
 * *rec (its wall time included); the step's gradients and output stay in place until the next step. */
static moert_result rank_train_step(moert_rank *r, int64_t step, moert_step_record *rec)
{
    moert_result rc = MOERT_OK;
    /* every rank starts the step together: the step's figures then leave out the skew the last step's optimizer left
     * (the stage a rank waits in for its peers would otherwise count it) */
    if (moert_layers_barrier(r->layers) != MOERT_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", moert_last_error());
        return moert_set_last_error(MOERT_ERR_TIMEOUT, "the barrier at the start of step %lld: %s", (long long)step,
                                    why);
    }
    double t0 = harness_seconds();
    CHECK(rank_forward_backward(r, step));
    CHECK(rank_optimizer_step(r, step));
    /* the step ends when its optimizer has run: its time counts here, and another runtime stepped next (moert ab)
     * does not find its first stages sharing the GPU with this step's optimizer */
    CHECK(rank_sync(r));
    if (r->rank == 0) fill_record(r->rt, step, harness_seconds() - t0, rec);
fail:
    return rc;
}

static moert_result rank_train(moert_rank *r, void *arg)
{
    moert_result rc = MOERT_OK;
    train_arg *ta = arg;
    moert_runtime *rt = r->rt;
    int log_every = (int)(rt->set.log_every > 0 ? rt->set.log_every : 1);
    for (int64_t step = 1; step <= ta->steps; step++) {
        CHECK(rank_train_step(r, step, r->rank == 0 ? &rt->records[rt->record_count] : NULL));
        if (r->rank == 0) {
            moert_step_record *rec = &rt->records[rt->record_count++];
            if (ta->progress && (step % log_every == 0 || step == 1 || step == ta->steps))
                print_progress(rec, ta->steps, ta->progress);
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

/* Activation figures of the last step (rank 0, summed over layers) and, on GPUs, rank 0's pool peak and calls. */
static moert_result collect_memory(moert_runtime *rt)
{
    moert_result rc = MOERT_OK;
    int nl = (int)rt->set.num_layers;
    memset(rt->activation_bytes, 0, sizeof rt->activation_bytes);
    rt->kept_bytes = 0;
    rt->device_peak_bytes = 0;
    int64_t calls = 0;
    for (int l = 0; l < nl; l++) {
        moert_layer_figures fig = {.struct_size = sizeof fig};
        CHECK(moert_layers_figures(rt->ranks[0].layers, l, &fig));
        for (int a = 0; a < MOERT_LAYER_ACTIVATIONS; a++) rt->activation_bytes[a] += fig.saved_bytes[a];
        rt->kept_bytes += fig.held_bytes;
        rt->device_peak_bytes = fig.device_peak_bytes;
        calls = fig.device_pool_calls;
    }
    if (rt->device_type == MOERT_DEVICE_CUDA) {
        rt->device_pool_calls = calls - rt->device_pool_calls_total;
        rt->device_pool_calls_total = calls;
    }
fail:
    return rc;
}

moert_result moert_runtime_step(moert_runtime *rt, int64_t step, moert_step_record *record)
{
    if (step < 1)
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "moert_runtime_step: step %lld, expected >= 1",
                                    (long long)step);
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    /* the record lives in the runtime: rank 0 fills it, and an abandoned rank 0 may still do so later */
    step_arg sa = {.step = step, .rec = &rt->step_record};
    rc = trainer_run_on_ranks(rt, rank_train_step_phase, &sa);
    if (rc != MOERT_OK) return rc;
    rc = collect_memory(rt);
    if (rc != MOERT_OK) return rc;
    if (record) *record = rt->step_record;
    return MOERT_OK;
}

moert_result moert_runtime_output(const moert_runtime *rt, int64_t index, double *value)
{
    const trainer_settings *set = &rt->set;
    int64_t per_rank = set->tokens_per_rank * set->hidden;
    if (!rt->params_ready || rt->device_type != MOERT_DEVICE_CPU)
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "the stack's output is readable after a step of a CPU run");
    if (index < 0 || index >= per_rank * rt->world)
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "output element %lld does not exist", (long long)index);
    *value = moert_load(&rt->ranks[index / per_rank].acts[set->num_layers], index % per_rank);
    return MOERT_OK;
}

int64_t moert_runtime_output_numel(const moert_runtime *rt)
{
    return (int64_t)rt->world * rt->set.tokens_per_rank * rt->set.hidden;
}

/* ---- bulk reads for comparing runs ---- */

int moert_runtime_local_ranks(const moert_runtime *rt) { return rt->nlocal; }

int64_t moert_runtime_local_output_numel(const moert_runtime *rt) { return rt->set.tokens_per_rank * rt->set.hidden; }

int64_t moert_runtime_local_grad_numel(const moert_runtime *rt, int layer, moert_param_id which)
{
    if (!rt->params_ready || layer < 0 || layer >= rt->set.num_layers || (int)which < 0 ||
        (int)which >= MOERT_PARAM_COUNT)
        return 0;
    const moert_tensor *g = &rt->ranks[0].params[layer][which].grad;
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
    const moert_tensor *t = a->layer < 0 ? &r->acts[r->rt->set.num_layers] : &r->params[a->layer][a->which].grad;
    double *out = a->out + (size_t)(r - r->rt->ranks) * (size_t)a->count;
    if (a->first < 0 || a->count < 0 || a->first + a->count > moert_tensor_numel(t))
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "reading elements %lld..%lld of a tensor of %lld",
                                    (long long)a->first, (long long)(a->first + a->count),
                                    (long long)moert_tensor_numel(t));
    if (t->dtype != MOERT_F32 && t->dtype != MOERT_F64 && t->dtype != MOERT_BF16 && t->dtype != MOERT_F16)
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "reading a %s tensor as double", moert_dtype_name(t->dtype));
    moert_result rc = MOERT_OK;
    const size_t esize = moert_dtype_size(t->dtype);
    moert_tensor host = moert_tensor_2d(malloc((size_t)a->count * esize + 1), moert_cpu(), t->dtype, 1, a->count);
    if (!host.data) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "reading a tensor: out of memory");
    rc = rank_copy(r, host.data, (const char *)t->data + (size_t)a->first * esize, (size_t)a->count * esize);
    if (rc == MOERT_OK) rc = rank_sync(r);
    if (rc != MOERT_OK) {
        char why[2048];
        snprintf(why, sizeof why, "%s", moert_last_error());
        rc = moert_set_last_error(rc, "copying a tensor to the host: %s", why);
        goto fail;
    }
    for (int64_t i = 0; i < a->count; i++) out[i] = moert_load(&host, i);
fail:
    free(host.data);
    return rc;
}

moert_result moert_runtime_read_output(moert_runtime *rt, int64_t first, int64_t count, double *out)
{
    if (!rt->params_ready)
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "the stack's output is readable after a step");
    read_arg a = {.layer = -1, .first = first, .count = count, .out = out};
    return trainer_run_on_ranks(rt, rank_read, &a);
}

moert_result moert_runtime_read_grad(moert_runtime *rt, int layer, moert_param_id which, int64_t first, int64_t count,
                                     double *out)
{
    if (moert_runtime_local_grad_numel(rt, layer, which) == 0)
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT,
                                    "layer %d has no gradient of parameter %d (or no step ran)", layer, (int)which);
    read_arg a = {.layer = layer, .which = which, .first = first, .count = count, .out = out};
    return trainer_run_on_ranks(rt, rank_read, &a);
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
    /* the loaded plugin's declaration (0 where its vtable predates the field or leaves it 0) */
    const double rtol = rt->plugins[2].agreement_rtol;
    return rtol > 0.0 && isfinite(rtol) ? rtol : MOERT_PRECISION_DEFAULT_AGREEMENT_RTOL;
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
    rc = trainer_run_on_ranks(rt, rank_forward_backward_phase, &step);
    if (rc != MOERT_OK) return rc;
    moert_step_record rec;
    fill_record(rt, step, 0.0, &rec);
    *loss = rec.loss;
    return MOERT_OK;
}

/* Adds every kernel CUPTI recorded to the trace of the rank whose device ran it, on the run's clock. */
static moert_result trace_kernels_of_ranks(moert_runtime *rt, moert_kernel_trace *kernels)
{
    moert_result rc = MOERT_OK;
    const moert_kernel_record *k = NULL;
    int64_t count = 0;
    CHECK(moert_kernel_trace_stop(kernels, &k, &count));
    for (int64_t i = 0; i < count; i++) {
        for (int j = 0; j < rt->nlocal; j++) {
            moert_rank *r = &rt->ranks[j];
            if (r->device != k[i].device) continue;
            moert_trace_span span = {.name = k[i].short_name,
                                     .rank = r->rank,
                                     .layer = -1,
                                     .step = -1,
                                     .micro = -1,
                                     .start_us = 1e6 * (k[i].start_s - rt->trace_origin),
                                     .dur_us = 1e6 * (k[i].end_s - k[i].start_s),
                                     .kernel = k[i].name,
                                     .cuda_stream = k[i].stream,
                                     .grid = k[i].grid};
            CHECK(moert_trace_add(&r->trace, &span));
            break;
        }
    }
fail:
    return rc;
}

/* Writes the traces of the ranks this process hosts: all of them to `path` with ranks as threads; with a process per
 * GPU, rank 0's to `path` and rank N's to `path`.rankN. */
static moert_result write_trace(moert_runtime *rt, const char *path, const char *note)
{
    moert_trace *traces = calloc((size_t)rt->nlocal, sizeof *traces);
    if (!traces) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "the trace");
    for (int i = 0; i < rt->nlocal; i++) traces[i] = rt->ranks[i].trace;
    char ranked[4096];
    const int rank = rt->ranks[0].rank;
    if (rt->processes && rank != 0) snprintf(ranked, sizeof ranked, "%s.rank%d", path, rank);
    moert_result rc =
        moert_trace_write(traces, rt->nlocal, rt->set.name, note, rt->processes && rank != 0 ? ranked : path);
    free(traces);
    return rc;
}

moert_result moert_runtime_train(moert_runtime *rt, const moert_train_options *opts)
{
    moert_result rc = ensure_params(rt);
    if (rc != MOERT_OK) return rc;
    const trainer_settings *set = &rt->set;
    train_arg ta = {.steps = opts && opts->steps > 0 ? opts->steps : set->steps,
                    .progress = opts ? opts->progress : NULL};
    free(rt->records);
    rt->records = calloc((size_t)(ta.steps > 0 ? ta.steps : 1), sizeof *rt->records);
    rt->record_count = 0;
    if (!rt->records) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "step records");
    /* with a process per GPU, rank 0's process speaks for all */
    if (rt->ranks[0].rank != 0) ta.progress = NULL;
    char micro[64] = "";
    if (set->micro_batches > 1)
        snprintf(micro, sizeof micro, " x %lld micro-batches per step", (long long)set->micro_batches);
    if (ta.progress)
        fprintf(ta.progress,
                "moert %s: \"%s\" on %s; %lld layer%s, H=%lld F=%lld E=%lld K=%lld, %lld tokens per rank%s, "
                "%s storage; router %s, dispatcher %s, precision %s, memory policy %s\n",
                MOERT_VERSION_STRING, set->name, rt->device_name, (long long)set->num_layers,
                set->num_layers > 1 ? "s" : "", (long long)set->hidden, (long long)set->ffn_hidden,
                (long long)set->num_experts, (long long)set->topk, (long long)set->tokens_per_rank, micro,
                moert_dtype_name(set->dtype), rt->plugins[0].name, rt->plugins[1].name, rt->plugins[2].name,
                rt->plugins[3].name);
    rc = snapshot_bias(rt, &rt->bias_start);
    if (rc != MOERT_OK) return rc;
    const char *trace_path = opts && opts->struct_size >= offsetof(moert_train_options, trace_path) + sizeof(char *)
                                 ? opts->trace_path
                                 : NULL;
    const bool trace_kernels =
        opts && opts->struct_size >= offsetof(moert_train_options, trace_kernels) + sizeof(bool) && opts->trace_kernels;
    if (trace_kernels && (!trace_path || rt->device_type != MOERT_DEVICE_CUDA))
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT,
                                    !trace_path ? "--trace-kernels adds CUDA kernels to a trace: it needs --trace FILE"
                                                : "--trace-kernels records CUDA kernels, and this run is on the CPU "
                                                  "($.parallel.device)");
    rt->tracing = trace_path != NULL;
    for (int i = 0; i < rt->nlocal; i++) rt->ranks[i].trace.count = 0;
    moert_kernel_trace *kernels = NULL;
    if (trace_kernels) {
        rc = moert_kernel_trace_start(&kernels);
        if (rc != MOERT_OK) return rc;
    }
    double t0 = harness_seconds();
    rt->trace_origin = t0;
    rc = trainer_run_on_ranks(rt, rank_train, &ta);
    rt->total_seconds = harness_seconds() - t0;
    char note[160] = "";
    if (rc == MOERT_OK && kernels) {
        rc = trace_kernels_of_ranks(rt, kernels);
        const moert_kernel_trace_stats ks = moert_kernel_trace_stats_of(kernels);
        snprintf(note, sizeof note, "%lld kernels recorded by CUPTI in %lld buffers, %.1f ms in its buffer callbacks",
                 (long long)ks.kernels, (long long)ks.buffers, 1e3 * ks.callback_s);
    }
    if (rc == MOERT_OK && trace_path) rc = write_trace(rt, trace_path, note[0] ? note : NULL);
    moert_kernel_trace_destroy(kernels); /* after writing: the spans point at its names */
    if (rc != MOERT_OK) return rc;

    int nl = (int)set->num_layers;
    int64_t e = set->num_experts;
    free(rt->final_counts);
    rt->final_counts = malloc(sizeof(int64_t) * (size_t)(nl * e));
    if (!rt->final_counts) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "report");
    memcpy(rt->final_counts, rt->ranks[0].counts, sizeof(int64_t) * (size_t)(nl * e));
    rc = collect_memory(rt);
    if (rc != MOERT_OK) return rc;
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
                 (long long)rt->graph_captured_step, (long long)rt->set.num_layers, rt->set.num_layers > 1 ? "s" : "",
                 rt->set.micro_batches > 1 ? "; a step's first micro-batch and the later ones" : "",
                 (long long)rt->graph_replays, rt->set.micro_batches > 1 ? "micro-batch" : "step",
                 rt->graph_replays == 1      ? ""
                 : rt->set.micro_batches > 1 ? "es"
                                             : "s");
    else if (rt->graph_reason[0])
        snprintf(buf, size, "not used: %s", rt->graph_reason);
    else
        snprintf(buf, size, "not used: no step after the first (the capture follows one eager step)");
}

bool moert_runtime_overlapped(const moert_runtime *rt) { return rt->nlocal > 0 && rt->ranks && rt->ranks[0].overlap; }

/* ---- parameter access for tests ---- */

int64_t moert_runtime_param_numel(const moert_runtime *rt, moert_param_id which)
{
    const trainer_settings *m = &rt->set;
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
    const moert_layers_info *L = &r->info;
    const int64_t h = L->hidden, fl = L->local_ffn_hidden, f = fl * L->etp_size;
    const int64_t first = L->first_local_expert, el = L->num_local_experts;
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
    if (layer < 0 || layer >= rt->set.num_layers || index < 0 || index >= moert_runtime_param_numel(rt, which))
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT, "parameter %d[%lld] of layer %d does not exist",
                                    (int)which, (long long)index, layer);
    if (rt->device_type != MOERT_DEVICE_CPU)
        return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "parameter access is for CPU runs");
    for (int i = 0; i < rt->world; i++) {
        trainer_param *p = &rt->ranks[i].params[layer][which];
        if (!p->value.data) break; /* the config has no such parameter */
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
    for (int s = 0; s < 4; s++) {
        const moert_plugin_description *p = &rt->plugins[s];
        out->plugins[s] =
            (moert_run_plugin){.kind = p->kind_name, .name = p->name, .version = p->version, .path = p->path};
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
    snprintf(buf, size, "%s", rt->memory_line);
}
