/* SPDX-License-Identifier: Apache-2.0 */
/* The embedding API (moert/layers.h): the MoE layers of one rank on the caller's tensors and stream.
 *
 * A moert_layers is one rank's stack (core/src/stack.c) whose parameters are bound to the caller's tensors and whose
 * layers give MoE(x) without the residual. On GPUs the layers keep their own compute stream (the executor, the
 * memory pool and the plugins order their work on it); each call makes it wait for the caller's stream on entry and
 * the caller's stream wait for it on return, so the work is ordered as if it ran on the caller's stream.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "error.h"
#include "executor.h"
#include "host.h"
#include "loader.h"
#include "memory_estimate.h"
#include "overlap.h"
#include "stack.h"
#include "tensor_ops.h"

_Static_assert(MOERT_LAYER_STAGES == MOERT_STAGE_COUNT, "public stage count");
_Static_assert(MOERT_LAYER_BACKWARD_PARTS == MOERT_BWD_PART_COUNT, "public backward part count");
_Static_assert(MOERT_LAYER_ACTIVATIONS == MOERT_ACT_COUNT, "public activation count");
_Static_assert(MOERT_LAYER_ACTIVATIONS + MOERT_LAYER_SHARED_ACTIVATIONS == MOERT_STORE_SLOTS,
               "public shared activations");
#ifdef MOERT_HAVE_CUDA
#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#endif

#define DISPATCHER(L) ((const moert_dispatcher_v1 *)(L)->dispatcher.plugin->header)
#define ROUTER(L)     ((const moert_router_v1 *)(L)->router.plugin->header)
#define PRECISION(L)  ((const moert_precision_v1 *)(L)->precision.plugin->header)

/* One call of layer L's dispatcher; a failure names the plugin, the call, the layer and the rank. */
#define DISPATCHER_CALL(name, call)                                                                                    \
    do {                                                                                                               \
        rc = (call);                                                                                                   \
        if (rc != MOERT_OK) {                                                                                          \
            rc = moert_layer_plugin_failed(L, &L->dispatcher, name, rc);                                               \
            goto fail;                                                                                                 \
        }                                                                                                              \
    } while (0)

MOERT_API int moert_api_version(void) { return MOERT_API_VERSION; }

/* ---- communicators ---- */

typedef enum comm_kind { COMM_THREADS = 0, COMM_TABLE = 1, COMM_NCCL_ID = 2 } comm_kind;

struct moert_comm {
    comm_kind kind;
    int world;
    double timeout_s;
    moert_comm_group *group;             /* threads and table: host-memory collectives */
    pthread_mutex_t lock;                /* threads: guards nccl_group */
    struct moert_nccl_group *nccl_group; /* threads on GPUs: made by the first rank that needs it */
    unsigned char nccl_id[MOERT_NCCL_ID_BYTES];
    /* each rank's NCCL communicator, shared by every moert_layers of that rank on this communicator (made by the
     * first, freed by the last on its own thread); guarded by lock */
    struct moert_nccl_comm **nccl;   /* [world] */
    int *nccl_users;                 /* [world] */
    struct moert_dist_env *dist_env; /* moert_comm_create_launcher: the NCCL id comes over TCP from rank 0 */
};

static moert_result comm_new(comm_kind kind, int world_size, double timeout_s, moert_comm **out)
{
    if (!out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_comm_create: out is NULL");
    *out = NULL;
    if (world_size < 1 || world_size > 4096)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_comm_create: world_size %d, expected 1 .. 4096",
                           world_size);
    if (!(timeout_s > 0) || timeout_s > 86400.0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_comm_create: timeout_s %g, expected > 0 and <= 86400",
                           timeout_s);
    moert_comm *c = calloc(1, sizeof *c);
    if (!c) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_comm_create: out of memory");
    c->kind = kind;
    c->world = world_size;
    c->timeout_s = timeout_s;
    c->nccl = calloc((size_t)world_size, sizeof *c->nccl);
    c->nccl_users = calloc((size_t)world_size, sizeof *c->nccl_users);
    if (!c->nccl || !c->nccl_users) {
        free(c->nccl);
        free(c->nccl_users);
        free(c);
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_comm_create: out of memory");
    }
    pthread_mutex_init(&c->lock, NULL);
    *out = c;
    return MOERT_OK;
}

MOERT_API moert_result moert_comm_create_threads(int world_size, double timeout_s, moert_comm **out)
{
    moert_result rc = comm_new(COMM_THREADS, world_size, timeout_s, out);
    if (rc != MOERT_OK) return rc;
    rc = moert_comm_group_create(world_size, timeout_s, &(*out)->group);
    if (rc != MOERT_OK) {
        moert_comm_destroy(*out);
        *out = NULL;
    }
    return rc;
}

MOERT_API moert_result moert_comm_create_collectives(int world_size, const moert_collectives *table, moert_comm **out)
{
    moert_result rc = comm_new(COMM_TABLE, world_size, 1.0, out);
    if (rc != MOERT_OK) return rc;
    rc = moert_comm_group_create_table(world_size, table, &(*out)->group);
    if (rc != MOERT_OK) {
        moert_comm_destroy(*out);
        *out = NULL;
    }
    return rc;
}

MOERT_API moert_result moert_nccl_unique_id(unsigned char id[MOERT_NCCL_ID_BYTES])
{
    if (!id) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_nccl_unique_id: id is NULL");
#ifdef MOERT_HAVE_CUDA
    return moert_nccl_unique_id_make(id, MOERT_NCCL_ID_BYTES);
#else
    return moert_error(MOERT_ERR_UNSUPPORTED, "moert_nccl_unique_id: this build of moert has no CUDA/NCCL");
#endif
}

MOERT_API moert_result moert_comm_create_nccl(const unsigned char id[MOERT_NCCL_ID_BYTES], int world_size,
                                              double timeout_s, moert_comm **out)
{
#ifdef MOERT_HAVE_CUDA
    if (!id) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_comm_create_nccl: id is NULL");
    moert_result rc = comm_new(COMM_NCCL_ID, world_size, timeout_s, out);
    if (rc == MOERT_OK) memcpy((*out)->nccl_id, id, MOERT_NCCL_ID_BYTES);
    return rc;
#else
    (void)id;
    (void)world_size;
    (void)timeout_s;
    if (out) *out = NULL;
    return moert_error(MOERT_ERR_UNSUPPORTED, "moert_comm_create_nccl: this build of moert has no CUDA/NCCL");
#endif
}

MOERT_API moert_result moert_comm_create_launcher(double timeout_s, moert_launcher_env *env, moert_comm **out)
{
    if (out) *out = NULL;
    if (!env || !out || env->struct_size < sizeof *env)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "moert_comm_create_launcher: env or out is NULL, or env->struct_size is not %zu",
                           sizeof *env);
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    moert_dist_env *d = calloc(1, sizeof *d);
    MOERT_CHECK_ALLOC(d);
    MOERT_CHECK(moert_dist_env_read(d));
    MOERT_CHECK(comm_new(COMM_NCCL_ID, d->world_size, timeout_s, out));
    (*out)->dist_env = d;
    env->rank = d->rank;
    env->world_size = d->world_size;
    env->local_rank = d->local_rank;
    return MOERT_OK;
fail:
    free(d);
    return rc;
#else
    (void)timeout_s;
    return moert_error(MOERT_ERR_UNSUPPORTED, "moert_comm_create_launcher: this build of moert has no CUDA/NCCL");
#endif
}

MOERT_API void moert_comm_fail(moert_comm *comm, int rank, const char *why)
{
    if (!comm || rank < 0 || rank >= comm->world) return;
    if (comm->group && comm->world > 1) moert_comm_abort(comm->group, rank, why ? why : "failed");
#ifdef MOERT_HAVE_CUDA
    pthread_mutex_lock(&comm->lock);
    struct moert_nccl_comm *nccl = comm->nccl[rank];
    pthread_mutex_unlock(&comm->lock);
    if (nccl) moert_nccl_comm_abort(nccl, why ? why : "failed");
#endif
}

MOERT_API void moert_comm_destroy(moert_comm *comm)
{
    if (!comm) return;
#ifdef MOERT_HAVE_CUDA
    if (comm->nccl_group) moert_nccl_group_free(comm->nccl_group);
#endif
    free(comm->dist_env);
    if (comm->group) moert_comm_group_free(comm->group);
    pthread_mutex_destroy(&comm->lock);
    free(comm->nccl);
    free(comm->nccl_users);
    free(comm);
}

/* ---- the layers of one rank ---- */

/* One forward's saved activations: a token naming the layer whose executor state holds them. */
struct moert_saved {
    moert_layers *owner;
    int layer;
    int slot; /* the layer's slot holding it: 0 .. the slots made ($.parallel.forwards_in_flight, overlap.h) */
    int64_t tokens;
    bool experts; /* a moert_experts_forward's (tokens: its rows) */
};

struct moert_dispatch {
    moert_layers *owner;
    int layer;
    int slot; /* the layer's slot whose dispatcher instance holds it (as moert_saved.slot) */
    int64_t tokens;
    moert_tensor topk_idx; /* borrowed from prepare's caller */
    moert_dispatch_layout layout;
    bool ran;
};

struct moert_layers {
    moert_config *cfg; /* a private copy: sections borrow its JSON */
    moert_plugin plugins[MOERT_SLOT_COUNT];
    moert_comm *comm;
    int rank, world;
    int etp, edp; /* the expert layout (docs/parallel.md) */
    moert_device device;
    int64_t max_tokens;
    bool residual;       /* MOERT_LAUNCH_RESIDUAL */
    bool graph_backward; /* a backward ran while capturing: the graph being captured writes the gradients */
    struct moert_cuda_pool *pool;
    struct moert_nccl_comm *nccl;
    moert_stream stream;                  /* CUDA: the layers' own compute stream */
    moert_event enter_event, leave_event; /* CUDA: ordering against the caller's stream */
    /* CUDA under the overlap with $.parallel.overlap_comm_sms > 0: the SM-yield words (moert_comm_stream.sm_yield) */
    int32_t *sm_yield;
    moert_stack stack;
    bool stack_made;
    bool (*bound)[MOERT_PARAM_COUNT]; /* [num_layers] */
    /* [num_layers x MOERT_OVERLAP_MAX_SLOTS] the forward in flight of each layer's slots (saved_ref) */
    moert_saved **saved;
    /* $.parallel.forwards_in_flight and overlap_micro_batches: the slots past the first of every layer */
    moert_overlap overlap;
    unsigned char *last_slot;     /* [num_layers] the slot of the layer's last forward (tokens per expert) */
    unsigned char *last_bwd_slot; /* [num_layers] the slot of its last backward (figures, spans) */
    moert_dispatch **dispatch;    /* [num_layers x MOERT_OVERLAP_MAX_SLOTS] the dispatch in flight of each slot */
};

/* Where slot `slot` of `layer` keeps its forward in flight. */
static moert_saved **saved_ref(const moert_layers *m, int layer, int slot)
{
    return &m->saved[(size_t)layer * MOERT_OVERLAP_MAX_SLOTS + (size_t)slot];
}

/* Where slot `slot` of `layer` keeps its dispatch in flight (the dispatcher alone). */
static moert_dispatch **dispatch_ref(const moert_layers *m, int layer, int slot)
{
    return &m->dispatch[(size_t)layer * MOERT_OVERLAP_MAX_SLOTS + (size_t)slot];
}

/* ---- live handles ----
 * A moert_saved or moert_dispatch is live while a live moert_layers' table holds it. A caller may pass one that is
 * not (consumed by its backward, freed, or freed with its layers: a garbage collector's order): it is found by address
 * in these tables, never by reading it, so a stale handle is refused (or, to a free, ignored) instead of read. */
static pthread_mutex_t live_lock = PTHREAD_MUTEX_INITIALIZER;
static moert_layers **live_layers;
static int live_count, live_capacity;

static moert_result live_add(moert_layers *m)
{
    pthread_mutex_lock(&live_lock);
    if (live_count == live_capacity) {
        const int capacity = live_capacity ? 2 * live_capacity : 16;
        moert_layers **grown = realloc(live_layers, (size_t)capacity * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&live_lock);
            return moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_layers_create: out of memory");
        }
        live_layers = grown;
        live_capacity = capacity;
    }
    live_layers[live_count++] = m;
    pthread_mutex_unlock(&live_lock);
    return MOERT_OK;
}

static void live_remove(const moert_layers *m)
{
    pthread_mutex_lock(&live_lock);
    for (int i = 0; i < live_count; i++)
        if (live_layers[i] == m) {
            live_layers[i] = live_layers[--live_count];
            break;
        }
    pthread_mutex_unlock(&live_lock);
}

/* Every write to the tables of forwards and dispatches in flight goes through these, under live_lock, which
 * live_owner holds while it looks a handle up in every live layers' tables from any thread. */
static void set_saved(moert_layers *m, int layer, int slot, moert_saved *saved)
{
    pthread_mutex_lock(&live_lock);
    *saved_ref(m, layer, slot) = saved;
    pthread_mutex_unlock(&live_lock);
}

static void set_dispatch(moert_layers *m, int layer, int slot, moert_dispatch *d)
{
    pthread_mutex_lock(&live_lock);
    *dispatch_ref(m, layer, slot) = d;
    pthread_mutex_unlock(&live_lock);
}

/* The live layers whose saved (or, with dispatch, dispatch) table holds h, compared by address; NULL when none. */
static moert_layers *live_owner(const void *h, bool dispatch)
{
    moert_layers *owner = NULL;
    if (!h) return NULL;
    pthread_mutex_lock(&live_lock);
    for (int i = 0; i < live_count && !owner; i++) {
        moert_layers *m = live_layers[i];
        const int n = m->stack.num_layers * MOERT_OVERLAP_MAX_SLOTS;
        for (int k = 0; k < n && !owner; k++)
            if (dispatch ? (m->dispatch && (const void *)m->dispatch[k] == h)
                         : (m->saved && (const void *)m->saved[k] == h))
                owner = m;
    }
    pthread_mutex_unlock(&live_lock);
    return owner;
}

/* The forwards `layer` holds in flight, over its slots. */
static int forwards_in_flight(const moert_layers *m, int layer)
{
    int n = 0;
    for (int slot = 0; slot < MOERT_OVERLAP_MAX_SLOTS; slot++) n += *saved_ref(m, layer, slot) != NULL;
    return n;
}

/* The dispatches `layer` holds in flight, over its slots. */
static int dispatches_in_flight(const moert_layers *m, int layer)
{
    int n = 0;
    for (int slot = 0; slot < MOERT_OVERLAP_MAX_SLOTS; slot++) n += *dispatch_ref(m, layer, slot) != NULL;
    return n;
}

/* The slots of every layer (1 before moert_overlap_init or without more). */
static int slot_count(const moert_layers *m) { return m->overlap.slots > 1 ? m->overlap.slots : 1; }

static moert_result check_layer(const moert_layers *m, int layer, const char *fn)
{
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers is NULL", fn);
    if (layer < 0 || layer >= m->stack.num_layers)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layer %d, expected 0 .. %d", fn, layer,
                           m->stack.num_layers - 1);
    return MOERT_OK;
}

static const char *device_text(moert_device d, char *buf, size_t size)
{
    if (d.type == MOERT_DEVICE_CPU)
        snprintf(buf, size, "cpu");
    else if (d.type == MOERT_DEVICE_CUDA)
        snprintf(buf, size, "cuda:%d", d.id);
    else if (d.type == MOERT_DEVICE_CUDA_HOST)
        snprintf(buf, size, "cuda_host");
    else
        snprintf(buf, size, "device type %d", d.type);
    return buf;
}

/* Checks a caller's tensor: present, dtype, device, contiguous, and the shape `want` (a negative entry: any size up to
 * its negation, e.g. -max_tokens rows). `name` is the argument's name in the message. */
static moert_result check_tensor(const char *fn, const char *name, const moert_tensor *t, moert_dtype dtype,
                                 moert_device dev, int ndim, const int64_t *want)
{
    char a[32], b[32];
    if (!t) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);
    if (t->ndim != ndim)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has %d dimensions, expected %d", fn, name, t->ndim,
                           ndim);
    for (int i = 0; i < ndim; i++) {
        bool ok = want[i] >= 0 ? t->shape[i] == want[i] : (t->shape[i] >= 1 && t->shape[i] <= -want[i]);
        if (!ok) {
            if (want[i] >= 0)
                return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has size %lld in dimension %d, expected %lld",
                                   fn, name, (long long)t->shape[i], i, (long long)want[i]);
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has size %lld in dimension %d, expected 1 .. %lld",
                               fn, name, (long long)t->shape[i], i, (long long)-want[i]);
        }
    }
    if (t->dtype != dtype)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is %s, expected %s", fn, name,
                           moert_dtype_name(t->dtype), moert_dtype_name(dtype));
    if (t->device.type != dev.type || (dev.type == MOERT_DEVICE_CUDA && t->device.id != dev.id))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is on %s, expected %s", fn, name,
                           device_text(t->device, a, sizeof a), device_text(dev, b, sizeof b));
    if (!moert_tensor_is_contiguous(t))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is not contiguous (row-major, unit inner stride)", fn,
                           name);
    if (!t->data && moert_tensor_numel(t) > 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has no data", fn, name);
    return MOERT_OK;
}

/* Checks a caller's tensor of any shape: 0 to MOERT_MAX_DIMS dimensions, sizes >= 0, and a byte count that fits. */
static moert_result check_any_shape(const char *fn, const char *name, const moert_tensor *t)
{
    if (t->ndim < 0 || t->ndim > MOERT_MAX_DIMS)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has %d dimensions, expected 0 .. %d", fn, name, t->ndim,
                           MOERT_MAX_DIMS);
    int64_t bytes = (int64_t)moert_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has size %lld in dimension %d, expected >= 0", fn,
                               name, (long long)t->shape[i], i);
        if (__builtin_mul_overflow(bytes, t->shape[i], &bytes))
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is too large (its byte count overflows)", fn, name);
    }
    return MOERT_OK;
}

/* Whether two contiguous tensors' bytes overlap (on the same device): an output over an input the layer keeps for its
 * backward would corrupt it. */
static bool memory_overlaps(const moert_tensor *a, const moert_tensor *b)
{
    if (a->device.type != b->device.type || a->device.id != b->device.id) return false;
    const uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
    const uintptr_t a1 = a0 + (uintptr_t)moert_tensor_bytes(a), b1 = b0 + (uintptr_t)moert_tensor_bytes(b);
    return a0 < b1 && b0 < a1;
}

/* A copy to or from host memory the caller can touch: the host side is plain CPU memory. */
static bool on_host(moert_device d) { return d.type == MOERT_DEVICE_CPU || d.type == MOERT_DEVICE_CUDA_HOST; }

/* The layers' stream waits for the work the caller queued on `stream` so far (CUDA; nothing on the CPU). */
static moert_result enter(moert_layers *m, moert_stream stream)
{
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    if (m->device.type != MOERT_DEVICE_CUDA) return MOERT_OK;
    MOERT_CHECK(moert_cuda_set_device(m->device.id));
    if (stream == m->stream) return MOERT_OK; /* the caller works on the layers' own stream */
    MOERT_CHECK(moert_cuda_event_record(m->enter_event, stream));
    MOERT_CHECK(moert_cuda_stream_wait_event(m->stream, m->enter_event));
fail:
    return rc;
#else
    (void)m;
    (void)stream;
    return MOERT_OK;
#endif
}

/* The caller's stream waits for what the layers queued (CUDA; nothing on the CPU). */
static moert_result leave(moert_layers *m, moert_stream stream)
{
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    if (m->device.type != MOERT_DEVICE_CUDA || stream == m->stream) return MOERT_OK;
    MOERT_CHECK(moert_cuda_event_record(m->leave_event, m->stream));
    MOERT_CHECK(moert_cuda_stream_wait_event(stream, m->leave_event));
fail:
    return rc;
#else
    (void)m;
    (void)stream;
    return MOERT_OK;
#endif
}

/* Around a call on slot `slot`'s instances made outside moert_overlap_forward / _backward (the dispatcher or the
 * experts alone): the layers' stream waits for the caller's, the slot's for the layers' (and back after the call),
 * so the call is ordered as if on the caller's stream. */
static moert_result slot_enter(moert_layers *m, int slot, moert_stream stream)
{
    moert_result rc = enter(m, stream);
    return rc == MOERT_OK ? moert_overlap_fork(&m->overlap, slot) : rc;
}

static moert_result slot_leave(moert_layers *m, int slot, moert_stream stream)
{
    moert_result rc = moert_overlap_join(&m->overlap, slot);
    return rc == MOERT_OK ? leave(m, stream) : rc;
}

/* Waits for the layers' stream (for copies into host memory the caller reads on return). */
static moert_result finish(moert_layers *m)
{
    const moert_host *h = m->stack.core_host;
    if (h->stream_synchronize(h, m->stream) != MOERT_OK)
        return moert_error(MOERT_ERR_CUDA, "%s", moert_host_take_error(m->stack.core_host));
    return MOERT_OK;
}

/* Copies bytes between the caller's tensor and moert's on the layers' stream; waits when the destination is host. */
static moert_result copy_tensor(moert_layers *m, const moert_tensor *src, moert_tensor *dst)
{
    const moert_host *h = m->stack.core_host;
    moert_result rc =
        h->memcpy_async(h, dst->data, dst->device, src->data, src->device, moert_tensor_bytes(src), m->stream);
    if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(m->stack.core_host));
    if (on_host(dst->device)) return finish(m);
    return MOERT_OK;
}

/* Copies one of moert's tensors into the caller's, ordered on the caller's stream (waits when dst is host memory). */
static moert_result copy_out(moert_layers *m, const moert_tensor *src, moert_tensor *dst, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    MOERT_CHECK(enter(m, stream));
    MOERT_CHECK(copy_tensor(m, src, dst));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

/* The size of moert_launch in API version 1 (up to max_tokens), which callers built against it still pass. */
#define LAUNCH_V1_SIZE (offsetof(moert_launch, max_tokens) + sizeof(int64_t))

/* The expert layout a launch asks for (docs/parallel.md): 1 and 1 from a version 1 struct, or for 0. */
static void launch_layout(const moert_launch *launch, int *etp, int *edp)
{
    bool v2 = launch->struct_size >= offsetof(moert_launch, expert_data_parallel) + sizeof(int32_t);
    *etp = v2 && launch->expert_tensor_parallel > 1 ? launch->expert_tensor_parallel : 1;
    *edp = v2 && launch->expert_data_parallel > 1 ? launch->expert_data_parallel : 1;
}

/* The expert layout against the world and the model: EP x ETP x EDP ranks, experts split over EP, their width over
 * ETP. */
static moert_result check_launch_layout(const moert_config *cfg, const moert_launch *launch)
{
    const char *fn = "moert_layers_create";
    int etp = 1, edp = 1;
    launch_layout(launch, &etp, &edp);
    if (launch->struct_size >= offsetof(moert_launch, expert_data_parallel) + sizeof(int32_t) &&
        (launch->expert_tensor_parallel < 0 || launch->expert_data_parallel < 0))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: launch->expert_tensor_parallel %d and "
                           "expert_data_parallel %d, expected >= 0 (0: 1)",
                           fn, launch->expert_tensor_parallel, launch->expert_data_parallel);
    if (etp > launch->world_size || edp > launch->world_size || launch->world_size % (etp * edp) != 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: launch->expert_tensor_parallel %d x "
                           "launch->expert_data_parallel %d does not divide world_size %d: expert parallel x expert "
                           "tensor parallel x expert data parallel must be the world",
                           fn, etp, edp, launch->world_size);
    const int ep = launch->world_size / (etp * edp);
    if (cfg->model.num_experts % ep != 0) {
        if (etp == 1 && edp == 1)
            return moert_error(MOERT_ERR_CONFIG,
                               "config error at $.model.num_experts: %lld experts do not split over "
                               "%d ranks",
                               (long long)cfg->model.num_experts, launch->world_size);
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.model.num_experts: %lld experts do not split over %d "
                           "expert-parallel ranks (world_size %d / (expert_tensor_parallel %d x expert_data_parallel "
                           "%d))",
                           (long long)cfg->model.num_experts, ep, launch->world_size, etp, edp);
    }
    if (cfg->model.ffn_hidden % etp != 0)
        return moert_error(MOERT_ERR_CONFIG,
                           "config error at $.model.ffn_hidden: %lld does not split over "
                           "launch->expert_tensor_parallel %d ranks",
                           (long long)cfg->model.ffn_hidden, etp);
    return MOERT_OK;
}

static moert_result check_launch(const moert_config *cfg, const moert_launch *launch)
{
    const char *fn = "moert_layers_create";
    if (!cfg) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: cfg is NULL", fn);
    if (!launch) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: launch is NULL", fn);
    if (launch->struct_size < LAUNCH_V1_SIZE)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: launch->struct_size %u, expected %zu (or %zu, API version "
                           "1)",
                           fn, launch->struct_size, sizeof *launch, (size_t)LAUNCH_V1_SIZE);
    if (launch->world_size < 1 || launch->rank < 0 || launch->rank >= launch->world_size)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: rank %d of world_size %d, expected 0 <= rank < world_size",
                           fn, launch->rank, launch->world_size);
    if (launch->world_size > 1 && !launch->comm)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: world_size %d needs a communicator (launch->comm)", fn,
                           launch->world_size);
    const moert_comm *c = launch->comm;
    if (c && c->world != launch->world_size)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: the communicator has %d ranks, launch->world_size is %d",
                           fn, c->world, launch->world_size);
    moert_result rc = check_launch_layout(cfg, launch);
    if (rc != MOERT_OK) return rc;
    if (launch->max_tokens < 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: launch->max_tokens %lld, expected >= 0 (0: the config's)",
                           fn, (long long)launch->max_tokens);
    moert_device d = launch->device;
    if (d.type == MOERT_DEVICE_CPU) {
        if (c && c->kind == COMM_NCCL_ID)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                               "%s: a CPU rank cannot use NCCL; use the threads "
                               "communicator or a collectives table",
                               fn);
        return MOERT_OK;
    }
    if (d.type != MOERT_DEVICE_CUDA)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: launch->device type %d, expected MOERT_DEVICE_CPU or "
                           "MOERT_DEVICE_CUDA",
                           fn, d.type);
#ifdef MOERT_HAVE_CUDA
    if (c && c->kind == COMM_TABLE)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: a CUDA rank needs NCCL (moert_comm_create_nccl) or the "
                           "threads communicator (a thread per GPU), not a collectives table",
                           fn);
    int gpus = 0;
    if (moert_cuda_device_count(&gpus) != MOERT_OK) gpus = 0;
    if (d.id < 0 || d.id >= gpus)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: CUDA device %d asked for, %d answer on this machine", fn,
                           d.id, gpus);
    return MOERT_OK;
#else
    return moert_error(MOERT_ERR_UNSUPPORTED, "%s: a CUDA device asked for, but this build of moert has no CUDA", fn);
#endif
}

#ifdef MOERT_HAVE_CUDA
/* The rank's CUDA resources: memory pool, compute stream, ordering events and the NCCL communicator. */
static moert_result cuda_setup(moert_layers *m, double timeout_s)
{
    moert_result rc = MOERT_OK;
    int dev = m->device.id;
    MOERT_CHECK(moert_cuda_set_device(dev));
    MOERT_CHECK(moert_cuda_pool_create(dev, &m->pool));
    MOERT_CHECK(moert_cuda_stream_create_high_priority(dev, &m->stream));
    MOERT_CHECK(moert_cuda_event_create(dev, false, &m->enter_event));
    MOERT_CHECK(moert_cuda_event_create(dev, false, &m->leave_event));
    moert_comm *c = m->comm;
    if (!c || m->world == 1) return MOERT_OK;
    /* a later moert_layers of this rank shares the NCCL communicator the first made */
    pthread_mutex_lock(&c->lock);
    if (c->nccl[m->rank]) {
        int other = moert_nccl_comm_device(c->nccl[m->rank]);
        if (other == dev) {
            m->nccl = c->nccl[m->rank];
            c->nccl_users[m->rank]++;
        }
        pthread_mutex_unlock(&c->lock);
        if (other != dev)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                               "moert_layers_create: rank %d's communicator runs on CUDA "
                               "device %d, these layers on device %d",
                               m->rank, other, dev);
        return MOERT_OK;
    }
    if (c->kind == COMM_THREADS && !c->nccl_group) rc = moert_nccl_group_create(c->world, timeout_s, &c->nccl_group);
    pthread_mutex_unlock(&c->lock);
    if (rc != MOERT_OK) return rc;
    if (c->dist_env)
        MOERT_CHECK(moert_nccl_comm_init_env(c->dist_env, dev, c->timeout_s, &m->nccl));
    else if (c->kind == COMM_NCCL_ID)
        MOERT_CHECK(
            moert_nccl_comm_init_id(c->nccl_id, sizeof c->nccl_id, m->rank, m->world, dev, c->timeout_s, &m->nccl));
    else
        MOERT_CHECK(moert_nccl_comm_init_thread(c->nccl_group, m->rank, dev, &m->nccl));
    pthread_mutex_lock(&c->lock);
    c->nccl[m->rank] = m->nccl;
    c->nccl_users[m->rank] = 1;
    pthread_mutex_unlock(&c->lock);
fail:
    return rc;
}

/* Lets go of the rank's NCCL communicator: the last moert_layers using it frees it. */
static void nccl_release(moert_layers *m)
{
    moert_comm *c = m->comm;
    bool last = true;
    if (c) {
        pthread_mutex_lock(&c->lock);
        if (c->nccl[m->rank] == m->nccl) {
            last = --c->nccl_users[m->rank] == 0;
            if (last) c->nccl[m->rank] = NULL;
        }
        pthread_mutex_unlock(&c->lock);
    }
    if (last) moert_nccl_comm_free(m->nccl);
    m->nccl = NULL;
}
#endif

/* A private copy of the config (the plugins' option sections keep pointing into its JSON). */
static moert_result copy_config(const moert_config *cfg, moert_config **out)
{
    char *text = json_dumps(cfg->root, JSON_COMPACT);
    if (!text) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "moert_layers_create: copying the config");
    moert_result rc = moert_config_load_string(text, cfg->name, out);
    free(text);
    /* plugin paths as the original resolved them (a relative path is taken from the config file's folder) */
    if (rc == MOERT_OK) memcpy((*out)->plugin, cfg->plugin, sizeof cfg->plugin);
    return rc;
}

MOERT_API moert_result moert_layers_create(const moert_config *cfg, const moert_launch *launch, moert_layers **out)
{
    moert_result rc = MOERT_OK;
    moert_layers *m = NULL;
    if (!out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_create: out is NULL");
    *out = NULL;
    MOERT_CHECK(check_launch(cfg, launch));
    m = calloc(1, sizeof *m);
    MOERT_CHECK_ALLOC(m);
    m->comm = launch->comm;
    m->rank = launch->rank;
    m->world = launch->world_size;
    launch_layout(launch, &m->etp, &m->edp);
    m->residual = launch->struct_size >= offsetof(moert_launch, flags) + sizeof(uint32_t) &&
                  (launch->flags & MOERT_LAUNCH_RESIDUAL);
    m->device = launch->device;
    if (m->device.type == MOERT_DEVICE_CPU) m->device.id = 0;
    m->max_tokens = launch->max_tokens > 0 ? launch->max_tokens : cfg->train.tokens_per_rank;
    MOERT_CHECK(copy_config(cfg, &m->cfg));
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) {
        rc = moert_plugin_load(moert_slot_kind((moert_slot)s), m->cfg->plugin[s], &m->plugins[s]);
        if (rc != MOERT_OK) {
            moert_error_prefix("config error at $.%s.plugin", moert_slot_key((moert_slot)s));
            goto fail;
        }
    }
#ifdef MOERT_HAVE_CUDA
    if (m->device.type == MOERT_DEVICE_CUDA) MOERT_CHECK(cuda_setup(m, m->cfg->parallel.timeout_s));
#endif
    moert_comm_group *group = m->comm && m->comm->kind != COMM_NCCL_ID && m->world > 1 ? m->comm->group : NULL;
    const int64_t micro_batches =
        launch->struct_size >= offsetof(moert_launch, micro_batches) + sizeof(int32_t) ? launch->micro_batches : -1;
    /* "on" with one micro-batch a step (as the launch says) would hold a slot that never runs; "auto" needs the
     * caller to say it runs several */
    const bool overlap = moert_overlap_enabled(m->cfg, m->device.type, m->world / (m->etp * m->edp), m->etp,
                                               micro_batches, m->plugins[MOERT_SLOT_DISPATCHER].header->flags);
#ifdef MOERT_HAVE_CUDA
    /* the word the GEMMs read to leave SMs to the dispatcher calls beside them, one for both slots */
    if (overlap && m->device.type == MOERT_DEVICE_CUDA && m->cfg->parallel.overlap_comm_sms > 0)
        MOERT_CHECK(moert_cuda_sm_yield_create(m->device.id, (int32_t)m->cfg->parallel.overlap_comm_sms, &m->sm_yield));
#endif
    moert_stack_setup setup = {.cfg = m->cfg,
                               .plugins = m->plugins,
                               .rank = m->rank,
                               .world = m->world,
                               .device = m->device,
                               .max_tokens = m->max_tokens,
                               .comm = group,
                               .etp = m->etp,
                               .edp = m->edp,
                               .pool = m->pool,
                               .nccl = m->nccl,
                               .stream = m->stream,
                               .overlapped = overlap,
                               .sm_yield = m->sm_yield};
    m->stack_made = true;
    MOERT_CHECK(moert_stack_init(&m->stack, &setup));
    int nl = m->stack.num_layers;
    m->bound = calloc((size_t)nl, sizeof *m->bound);
    m->saved = calloc((size_t)nl * MOERT_OVERLAP_MAX_SLOTS, sizeof *m->saved);
    m->last_slot = calloc((size_t)nl, sizeof *m->last_slot);
    m->last_bwd_slot = calloc((size_t)nl, sizeof *m->last_bwd_slot);
    m->dispatch = calloc((size_t)nl * MOERT_OVERLAP_MAX_SLOTS, sizeof *m->dispatch);
    MOERT_CHECK_ALLOC(m->bound);
    MOERT_CHECK_ALLOC(m->saved);
    MOERT_CHECK_ALLOC(m->last_slot);
    MOERT_CHECK_ALLOC(m->last_bwd_slot);
    MOERT_CHECK_ALLOC(m->dispatch);
    for (int l = 0; l < nl; l++) {
        moert_layer *L = &m->stack.layers[l];
        L->params_borrowed = true;
        L->no_residual = !m->residual;
        /* offloaded activations give their device copies back at a later layer boundary, once the copy is done
         * (see forward and backward below), so the compute stream never waits for a D2H copy */
        L->acts.defer_release = true;
        /* $.parallel.offload_defer_start: a layer's offload copies start at the next layer's forward (the last
         * layer's at once), docs/executor.md "Deferred start" */
        L->acts.defer_start = l + 1 < nl && m->cfg->parallel.offload_defer_start;
    }
    /* more slots of every layer, so that several micro-batches' forwards can be in flight: as many as
     * $.parallel.forwards_in_flight says, at least two under the overlap */
    m->overlap.primary = &m->stack;
    m->overlap.slots = 1;
    int slots = (int)m->cfg->parallel.forwards_in_flight;
    if (overlap && slots < 2) slots = 2;
    if (slots > 1) {
        MOERT_CHECK(moert_overlap_init(&m->overlap, &m->stack, &setup, slots, overlap));
        for (int slot = 1; slot < slots; slot++)
            for (int l = 0; l < nl; l++) {
                m->overlap.twins[slot - 1].layers[l].acts.defer_release = true;
                m->overlap.twins[slot - 1].layers[l].acts.defer_start = m->stack.layers[l].acts.defer_start;
            }
    }
    MOERT_CHECK(live_add(m));
    *out = m;
    return MOERT_OK;
fail:
    if (m) {
        char saved[MOERT_ERROR_MAX];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        if (m->world > 1 && m->comm && m->comm->group) moert_comm_abort(m->comm->group, m->rank, saved);
#ifdef MOERT_HAVE_CUDA
        /* peers waiting on this rank's communicator return now, unless other layers of this rank use it */
        bool sole = true;
        if (m->nccl && m->comm) {
            pthread_mutex_lock(&m->comm->lock);
            sole = m->comm->nccl_users[m->rank] <= 1;
            pthread_mutex_unlock(&m->comm->lock);
        }
        if (m->nccl && sole) moert_nccl_comm_abort(m->nccl, saved);
#endif
        moert_layers_destroy(m);
        moert_error(rc, "%s", saved);
    }
    return rc;
}

MOERT_API void moert_layers_destroy(moert_layers *m)
{
    if (!m) return;
    live_remove(m); /* its handles are stale from here: a later moert_saved_free of one is ignored */
    int nl = m->stack.num_layers;
    for (int i = 0; m->saved && i < nl * MOERT_OVERLAP_MAX_SLOTS; i++) free(m->saved[i]);
    for (int i = 0; m->dispatch && i < nl * MOERT_OVERLAP_MAX_SLOTS; i++) free(m->dispatch[i]);
#ifdef MOERT_HAVE_CUDA
    if (m->stream) moert_cuda_stream_synchronize(m->stream);
#endif
    moert_overlap_finalize(&m->overlap);
    if (m->stack_made) moert_stack_finalize(&m->stack);
#ifdef MOERT_HAVE_CUDA
    if (m->stream) moert_cuda_stream_synchronize(m->stream);
    /* every stream that ran a dispatcher call or a GEMM reading it is synchronized (the overlap's and the stack's) */
    moert_cuda_sm_yield_free(m->sm_yield);
    if (m->enter_event) moert_cuda_event_destroy(m->enter_event);
    if (m->leave_event) moert_cuda_event_destroy(m->leave_event);
    if (m->pool && moert_cuda_pool_reserve_release(m->pool) != MOERT_OK) moert_error_clear();
    if (m->pool) moert_cuda_pool_destroy(m->pool);
    if (m->stream) moert_cuda_stream_destroy(m->stream);
    if (m->nccl) nccl_release(m);
#endif
    for (int s = 0; s < MOERT_SLOT_COUNT; s++)
        if (m->plugins[s].dl) moert_plugin_unload(&m->plugins[s]);
    moert_config_free(m->cfg);
    free(m->bound);
    free(m->saved);
    free(m->last_slot);
    free(m->last_bwd_slot);
    free(m->dispatch);
    free(m);
}

/* The size of moert_layers_info in API version 1 (up to expert_bias_dtype). */
#define LAYERS_INFO_V1_SIZE (offsetof(moert_layers_info, expert_bias_dtype) + sizeof(moert_dtype))

MOERT_API moert_result moert_layers_get_info(const moert_layers *m, moert_layers_info *out)
{
    if (!m || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_get_info: a NULL argument");
    /* a caller built against version 1 gets its members only (0: the whole struct, as version 1 wrote it) */
    size_t size = out->struct_size == 0 || out->struct_size > sizeof *out ? sizeof *out : out->struct_size;
    if (size < LAYERS_INFO_V1_SIZE)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "moert_layers_get_info: out->struct_size %u, expected %zu (or "
                           "%zu, API version 1)",
                           out->struct_size, sizeof *out, (size_t)LAYERS_INFO_V1_SIZE);
    const moert_layer *L = &m->stack.layers[0];
    moert_layers_info info = {.struct_size = (uint32_t)size,
                              .num_layers = m->stack.num_layers,
                              .rank = m->rank,
                              .world_size = m->world,
                              .hidden = L->info.hidden,
                              .ffn_hidden = L->info.ffn_hidden * L->etp_size,
                              .num_experts = L->info.num_experts,
                              .topk = L->info.topk,
                              .num_local_experts = L->info.num_local_experts,
                              .first_local_expert = L->info.first_local_expert,
                              .max_tokens = m->max_tokens,
                              .dtype = L->info.dtype,
                              .param_dtype = L->param_dtype,
                              .device = m->device,
                              .expert_bias_dtype = MOERT_DTYPE_COUNT,
                              .ep_rank = L->ep_rank,
                              .ep_size = L->ep_size,
                              .etp_rank = L->etp_rank,
                              .etp_size = L->etp_size,
                              .edp_rank = L->edp_rank,
                              .edp_size = L->edp_size,
                              .local_ffn_hidden = L->info.ffn_hidden,
                              .stream = m->stream,
                              .slots = slot_count(m)};
    const moert_tensor *bias = ROUTER(L)->expert_bias ? ROUTER(L)->expert_bias(L->router.ctx) : NULL;
    if (bias) info.expert_bias_dtype = bias->dtype;
    memcpy(out, &info, size);
    return MOERT_OK;
}

/* ---- parameters ---- */

static const char *param_name(moert_param_id which)
{
    static const char *const names[MOERT_PARAM_COUNT] = {
        "router weight", "fc1", "fc2", "shared expert's fc1", "shared expert's fc2", "shared expert's gate"};
    return names[which];
}

static moert_result check_param(const moert_layers *m, int layer, moert_param_id which, const char *fn)
{
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    if ((int)which < 0 || which >= MOERT_PARAM_COUNT)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: parameter %d, expected 0 .. %d (moert_param_id)", fn,
                           (int)which, MOERT_PARAM_COUNT - 1);
    if (!moert_layer_has_param(&m->stack.layers[layer], which))
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "%s: the config has no %s (see $.model.shared_expert_ffn_hidden and "
                           "$.model.shared_expert_gate)",
                           fn, param_name(which));
    return MOERT_OK;
}

MOERT_API moert_result moert_layers_param_desc(const moert_layers *m, int layer, moert_param_id which,
                                               moert_tensor *desc)
{
    moert_result rc = check_param(m, layer, which, "moert_layers_param_desc");
    if (rc != MOERT_OK) return rc;
    if (!desc) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_param_desc: desc is NULL");
    *desc = moert_layer_param_desc(&m->stack.layers[layer], which);
    return MOERT_OK;
}

MOERT_API moert_result moert_layers_bind_param(moert_layers *m, int layer, moert_param_id which,
                                               const moert_tensor *value, const moert_tensor *grad)
{
    const char *fn = "moert_layers_bind_param";
    moert_result rc = check_param(m, layer, which, fn);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = &m->stack.layers[layer];
    /* with forwards in flight only the gradient may change (each backward writes the one bound when it runs) */
    const bool busy = forwards_in_flight(m, layer) || dispatches_in_flight(m, layer);
    if (busy && (!value || !m->bound[layer][which] || value->data != L->params[which].value.data))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: layer %d has a forward in flight: only the %s gradient can be rebound (with the same "
                           "value tensor) until its backward",
                           fn, layer, param_name(which));
    moert_tensor d = moert_layer_param_desc(L, which);
    char vname[64], gname[64];
    snprintf(vname, sizeof vname, "the %s value", param_name(which));
    snprintf(gname, sizeof gname, "the %s gradient", param_name(which));
    if ((rc = check_tensor(fn, vname, value, d.dtype, d.device, d.ndim, d.shape)) != MOERT_OK) return rc;
    if ((rc = check_tensor(fn, gname, grad, d.dtype, d.device, d.ndim, d.shape)) != MOERT_OK) return rc;
    if (value->data == grad->data)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: the %s value and gradient are the same memory", fn,
                           param_name(which));
    /* a merged call's WGRADs may still write the gradient bound before ($.parallel.defer_wgrad_join): the caller may
     * free it once it is rebound */
    if (m->bound[layer][which] && L->params[which].grad.data != grad->data)
        if ((rc = moert_overlap_wait_wgrads(&m->overlap, layer)) != MOERT_OK) return rc;
    L->params[which].value = *value;
    L->params[which].grad = *grad;
    m->bound[layer][which] = true;
    return MOERT_OK;
}

/* Every parameter of `layer` is bound, or an error naming the first that is not. */
static moert_result check_bound(const moert_layers *m, int layer, const char *fn)
{
    for (int p = 0; p < MOERT_PARAM_COUNT; p++)
        if (!m->bound[layer][p] && moert_layer_has_param(&m->stack.layers[layer], (moert_param_id)p))
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layer %d's %s is not bound (moert_layers_bind_param)",
                               fn, layer, param_name((moert_param_id)p));
    return MOERT_OK;
}

MOERT_API moert_result moert_layers_init_params(moert_layers *m, uint64_t seed, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_init_params: layers is NULL");
    for (int l = 0; l < m->stack.num_layers; l++) MOERT_CHECK(check_bound(m, l, "moert_layers_init_params"));
    MOERT_CHECK(enter(m, stream));
    for (int l = 0; l < m->stack.num_layers; l++) MOERT_CHECK(moert_layer_fill_params(&m->stack.layers[l], seed));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

/* Calls one per-step hook (end_step) of every layer's router or precision instance. */
static moert_result end_step_all(moert_layers *m, moert_stream stream, bool router)
{
    moert_result rc = MOERT_OK;
    if (!m)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_%s: layers is NULL",
                           router ? "update_expert_bias" : "weights_changed");
    MOERT_CHECK(enter(m, stream));
    for (int l = 0; l < m->stack.num_layers; l++) {
        moert_layer *L = &m->stack.layers[l];
        moert_instance *inst = router ? &L->router : &L->precision;
        rc = router ? ROUTER(L)->end_step(inst->ctx, m->stream) : PRECISION(L)->end_step(inst->ctx, m->stream);
        if (rc != MOERT_OK) {
            rc = moert_layer_plugin_failed(L, inst, "end_step", rc);
            goto fail;
        }
    }
    /* slot 1's precision instances keep weight copies of their own; its routers share slot 0's step state */
    if (!router) MOERT_CHECK(moert_overlap_precision_end_step(&m->overlap));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

MOERT_API moert_result moert_layers_weights_changed(moert_layers *m, moert_stream stream)
{
    return end_step_all(m, stream, false);
}

MOERT_API moert_result moert_layers_update_expert_bias(moert_layers *m, moert_stream stream)
{
    return end_step_all(m, stream, true);
}

/* The router's expert bias tensor of `layer`, or MOERT_ERR_UNSUPPORTED. */
static moert_result expert_bias_of(moert_layers *m, int layer, const char *fn, const moert_tensor **out)
{
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = &m->stack.layers[layer];
    *out = ROUTER(L)->expert_bias ? ROUTER(L)->expert_bias(L->router.ctx) : NULL;
    if (!*out)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s: router \"%s\" keeps no expert bias (set $.router.expert_bias)",
                           fn, L->router.plugin->header->name);
    return MOERT_OK;
}

/* Checks the caller's copy of an expert bias: [E] fp32, fp64 or bf16 (converted from or to the router's own dtype),
 * on the host or the layers' device. */
static moert_result check_bias_copy(const moert_layers *m, const char *fn, const char *name, const moert_tensor *t,
                                    const moert_tensor *bias)
{
    if (!t) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);
    moert_device dev = on_host(t->device) ? t->device : m->device;
    moert_dtype dtype =
        t->dtype == MOERT_F32 || t->dtype == MOERT_F64 || t->dtype == MOERT_BF16 ? t->dtype : bias->dtype;
    return check_tensor(fn, name, t, dtype, dev, 1, bias->shape);
}

/* dst = src converting the dtype where they differ, through host copies (expert biases are small). */
static moert_result copy_converting(moert_layers *m, const moert_tensor *src, moert_tensor *dst)
{
    moert_result rc = MOERT_OK;
    if (src->dtype == dst->dtype) return copy_tensor(m, src, dst);
    moert_tensor a = *src, b = *dst;
    a.device = b.device = moert_cpu();
    a.data = malloc(moert_tensor_bytes(src) + 1);
    b.data = malloc(moert_tensor_bytes(dst) + 1);
    if (!a.data || !b.data) {
        rc = moert_error(MOERT_ERR_OUT_OF_MEMORY, "converting an expert bias");
        goto fail;
    }
    MOERT_CHECK(copy_tensor(m, src, &a)); /* waits: a is on the host */
    for (int64_t i = 0; i < moert_tensor_numel(src); i++) moert_store(&b, i, moert_load(&a, i));
    MOERT_CHECK(copy_tensor(m, &b, dst));
    MOERT_CHECK(finish(m)); /* b is freed below */
fail:
    free(a.data);
    free(b.data);
    return rc;
}

MOERT_API moert_result moert_layers_get_expert_bias(moert_layers *m, int layer, moert_tensor *dst, moert_stream stream)
{
    const char *fn = "moert_layers_get_expert_bias";
    moert_result rc = MOERT_OK;
    const moert_tensor *bias = NULL;
    MOERT_CHECK(expert_bias_of(m, layer, fn, &bias));
    MOERT_CHECK(check_bias_copy(m, fn, "dst", dst, bias));
    MOERT_CHECK(enter(m, stream));
    MOERT_CHECK(copy_converting(m, bias, dst));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

MOERT_API moert_result moert_layers_set_expert_bias(moert_layers *m, int layer, const moert_tensor *src,
                                                    moert_stream stream)
{
    const char *fn = "moert_layers_set_expert_bias";
    moert_result rc = MOERT_OK;
    const moert_tensor *bias = NULL;
    MOERT_CHECK(expert_bias_of(m, layer, fn, &bias));
    MOERT_CHECK(check_bias_copy(m, fn, "src", src, bias));
    MOERT_CHECK(enter(m, stream));
    moert_tensor target = *bias; /* the router's own buffer: written in place, as a checkpoint restores it */
    MOERT_CHECK(copy_converting(m, src, &target));
    if (on_host(src->device)) MOERT_CHECK(finish(m)); /* the caller may reuse src on return */
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

/* ---- forward and backward ---- */

/* Drops what a failed forward or backward left saved, keeping the failure's message; returns rc. */
static moert_result release_after_failure(moert_layer *L, moert_result rc)
{
    char message[MOERT_ERROR_MAX];
    snprintf(message, sizeof message, "%s", moert_error_message());
    (void)moert_layer_release_saved(L);
    return moert_error(rc, "%s", message);
}

/* A free slot of `layer` for a forward or a dispatch (one holding neither), other than `avoid` when it can (-1: none);
 * -1 and an error when none. */
static int free_slot(const moert_layers *m, int layer, int avoid, const char *fn)
{
    const int slots = slot_count(m);
    int found = -1;
    for (int s = 0; s < slots; s++)
        if (!*saved_ref(m, layer, s) && !*dispatch_ref(m, layer, s) && (found < 0 || found == avoid)) found = s;
    if (found >= 0) return found;
    const int dispatches = dispatches_in_flight(m, layer);
    moert_error(MOERT_ERR_INVALID_ARGUMENT,
                "%s: layer %d holds %d forward%s and %d dispatch%s in flight: run a backward, moert_saved_free or "
                "moert_dispatch_free first (%d micro-batch%s in flight per layer; $.parallel.forwards_in_flight "
                "allows up to %d)",
                fn, layer, slots - dispatches, slots - dispatches == 1 ? "" : "s", dispatches,
                dispatches == 1 ? "" : "es", slots, slots > 1 ? "es" : "", MOERT_OVERLAP_MAX_SLOTS);
    return -1;
}

/* While the layers capture a CUDA graph only the first slot runs: the graphs keep the pool blocks of the layers' stream
 * alone, and a captured first slot runs its dispatcher on that stream (call_dispatcher, core/src/executor.c); the
 * second slot's work, on streams of its own, would be captured with blocks the pool hands out again. Refused before
 * anything is queued, so the capture stays usable. */
static moert_result check_capture_slot(const moert_layers *m, int slot, const char *fn)
{
    if (slot > 0 && m->stack.layers[0].capturing)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "%s: the layer's slot %d ($.parallel.overlap_micro_batches, forwards_in_flight) while "
                           "capturing a CUDA graph: capture only micro-batches that run in the first slot (one forward "
                           "in flight per layer)",
                           fn, slot);
    return MOERT_OK;
}

/* The checks of a forward's arguments. */
static moert_result check_forward(moert_layers *m, int layer, const moert_tensor *x, const moert_tensor *y,
                                  const moert_moe_stats *stats, const char *fn)
{
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    const moert_layer *L = &m->stack.layers[layer];
    if ((rc = check_bound(m, layer, fn)) != MOERT_OK) return rc;
    const int64_t rows_max[2] = {-m->max_tokens, L->info.hidden};
    if ((rc = check_tensor(fn, "x", x, L->info.dtype, m->device, 2, rows_max)) != MOERT_OK) return rc;
    const int64_t same[2] = {x->shape[0], L->info.hidden};
    if ((rc = check_tensor(fn, "y", y, L->info.dtype, m->device, 2, same)) != MOERT_OK) return rc;
    if (memory_overlaps(x, y)) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: y may not be x's memory", fn);
    if (stats && stats->struct_size < sizeof *stats)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: stats->struct_size %u, expected %zu", fn,
                           stats->struct_size, sizeof *stats);
    return MOERT_OK;
}

static void fill_stats(const moert_layer *L, moert_moe_stats *stats)
{
    if (!stats) return;
    stats->router_loss = L->losses.total;
    stats->aux_loss = L->losses.aux_loss;
    stats->z_loss = L->losses.z_loss;
    stats->dispatched_rows = moert_layer_used_rows(L);
}

/* Offload copies of the layers below `layer` that have finished by now give their device buffers back. */
static moert_result release_below(moert_layers *m, int layer)
{
    moert_result rc = MOERT_OK;
    for (int below = 0; below < layer; below++) {
        MOERT_CHECK(moert_act_store_release_finished(&m->stack.layers[below].acts));
        for (int slot = 1; slot < m->overlap.slots; slot++)
            MOERT_CHECK(moert_act_store_release_finished(&m->overlap.twins[slot - 1].layers[below].acts));
    }
fail:
    return rc;
}

MOERT_API moert_result moert_moe_forward(moert_layers *m, int layer, const moert_tensor *x, moert_tensor *y,
                                         moert_stream stream, moert_saved **saved, moert_moe_stats *stats)
{
    const char *fn = "moert_moe_forward";
    if (saved) *saved = NULL;
    moert_result rc = check_forward(m, layer, x, y, stats, fn);
    if (rc != MOERT_OK) return rc;
    const int slot = free_slot(m, layer, -1, fn);
    if (slot < 0) return MOERT_ERR_INVALID_ARGUMENT;
    if ((rc = check_capture_slot(m, slot, fn)) != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    moert_saved *token = NULL;
    if (saved) {
        token = calloc(1, sizeof *token);
        if (!token) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        *token = (moert_saved){.owner = m, .layer = layer, .slot = slot, .tokens = x->shape[0]};
    }
    MOERT_CHECK(enter(m, stream));
    L->inference = saved == NULL; /* no saved activations: no backward follows */
    MOERT_CHECK(moert_overlap_forward(&m->overlap, layer, slot, x, y));
    m->last_slot[layer] = (unsigned char)slot;
    fill_stats(L, stats);
    if (!saved) MOERT_CHECK(moert_layer_release_saved(L));
    MOERT_CHECK(release_below(m, layer));
    /* the layer below's deferred offload copies (this micro-batch's slot) start now that this layer's dispatcher has
     * synced on its counts: a copy engine serves copies in issue order, so issued earlier they would have held that
     * small copy back */
    if (layer > 0)
        MOERT_CHECK(moert_act_store_start_offloads(&moert_overlap_layer(&m->overlap, layer - 1, slot)->acts));
    MOERT_CHECK(leave(m, stream));
    if (saved) {
        set_saved(m, layer, slot, token);
        *saved = token;
    }
    return MOERT_OK;
fail:
    free(token);
    return release_after_failure(L, rc);
}

/* Whether `saved` is one of these layers' forwards in flight, found by address before anything reads it: a handle a
 * backward already consumed (freed) is refused, not read. */
static bool in_flight(const moert_layers *m, const moert_saved *saved)
{
    for (int i = 0; saved && i < m->stack.num_layers * MOERT_OVERLAP_MAX_SLOTS; i++)
        if (m->saved[i] == saved) return true;
    return false;
}

/* The checks of a backward's arguments; *scale and *accumulate from opts. */
static moert_result check_backward(moert_layers *m, const moert_saved *saved, const moert_tensor *dy,
                                   const moert_tensor *dx, const moert_backward_options *opts, const char *fn,
                                   double *scale, bool *accumulate)
{
    moert_result rc = MOERT_OK;
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers is NULL", fn);
    if (!in_flight(m, saved))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is not a forward in flight of these layers", fn);
    if (saved->experts)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: saved is moert_experts_forward's: run moert_experts_backward", fn);
    if (opts && opts->struct_size < sizeof *opts)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: opts->struct_size %u, expected %zu", fn, opts->struct_size,
                           sizeof *opts);
    *scale = opts ? opts->router_loss_scale : 1.0;
    *accumulate = opts ? opts->accumulate : true;
    const moert_layer *L = &m->stack.layers[saved->layer];
    const int64_t shape[2] = {saved->tokens, L->info.hidden};
    if ((rc = check_tensor(fn, "dy", dy, L->info.dtype, m->device, 2, shape)) != MOERT_OK) return rc;
    if ((rc = check_tensor(fn, "dx", dx, L->info.dtype, m->device, 2, shape)) != MOERT_OK) return rc;
    if (memory_overlaps(dx, dy)) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: dx may not be dy's memory", fn);
    return MOERT_OK;
}

/* Before the backward of `layer` on `slot`: finished offload copies below give their buffers back, the layer below's
 * offloaded activations (of the same slot) start coming back, and the gradients are zeroed unless accumulating. */
static moert_result before_backward(moert_layers *m, int layer, int slot, bool accumulate)
{
    moert_result rc = MOERT_OK;
    MOERT_CHECK(release_below(m, layer > 0 ? layer - 1 : 0));
    if (layer > 0 && *saved_ref(m, layer - 1, slot))
        MOERT_CHECK(moert_act_store_prefetch(&moert_overlap_layer(&m->overlap, layer - 1, slot)->acts));
    if (!accumulate) MOERT_CHECK(moert_layer_zero_grad(&m->stack.layers[layer], true));
fail:
    return rc;
}

MOERT_API moert_result moert_moe_backward(moert_layers *m, moert_saved *saved, const moert_tensor *dy, moert_tensor *dx,
                                          const moert_backward_options *opts, moert_stream stream)
{
    const char *fn = "moert_moe_backward";
    double scale = 1.0;
    bool accumulate = true;
    moert_result rc = check_backward(m, saved, dy, dx, opts, fn, &scale, &accumulate);
    if (rc != MOERT_OK) return rc;
    if ((rc = check_capture_slot(m, saved->slot, fn)) != MOERT_OK) return rc;
    const int layer = saved->layer, slot = saved->slot;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    /* the activations go with this call, whatever its outcome */
    set_saved(m, layer, slot, NULL);
    free(saved);
    MOERT_CHECK(enter(m, stream));
    MOERT_CHECK(before_backward(m, layer, slot, accumulate));
    MOERT_CHECK(moert_overlap_backward(&m->overlap, layer, slot, dy, dx, scale));
    m->last_bwd_slot[layer] = (unsigned char)slot;
    if (L->capturing) m->graph_backward = true;
    MOERT_CHECK(leave(m, stream));
    return MOERT_OK;
fail:
    return release_after_failure(L, rc);
}

MOERT_API moert_result moert_moe_forward_backward(moert_layers *m, int layer, const moert_tensor *x, moert_tensor *y,
                                                  moert_saved **saved, moert_moe_stats *stats, moert_saved *bwd_saved,
                                                  const moert_tensor *dy, moert_tensor *dx,
                                                  const moert_backward_options *opts, moert_stream stream)
{
    const char *fn = "moert_moe_forward_backward";
    double scale = 1.0;
    bool accumulate = true;
    if (saved) *saved = NULL;
    moert_result rc = check_backward(m, bwd_saved, dy, dx, opts, fn, &scale, &accumulate);
    if (rc != MOERT_OK) return rc;
    if ((rc = check_forward(m, layer, x, y, stats, fn)) != MOERT_OK) return rc;
    if (!saved) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is NULL (the forward is a training one)", fn);
    const int bl = bwd_saved->layer, bslot = bwd_saved->slot;
    /* a free slot of the forward's layer, the other slot than the backward's where it can (its own stream on CUDA) */
    const int slot = free_slot(m, layer, bslot, fn);
    if (slot < 0) return MOERT_ERR_INVALID_ARGUMENT;
    if ((rc = check_capture_slot(m, slot, fn)) != MOERT_OK || (rc = check_capture_slot(m, bslot, fn)) != MOERT_OK)
        return rc;
    moert_layer *F = moert_overlap_layer(&m->overlap, layer, slot), *B = moert_overlap_layer(&m->overlap, bl, bslot);
    moert_saved *token = calloc(1, sizeof *token);
    if (!token) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    *token = (moert_saved){.owner = m, .layer = layer, .slot = slot, .tokens = x->shape[0]};
    set_saved(m, bl, bslot, NULL);
    free(bwd_saved);
    MOERT_CHECK(enter(m, stream));
    MOERT_CHECK(before_backward(m, bl, bslot, accumulate));
    F->inference = false;
    MOERT_CHECK(moert_overlap_forward_backward(&m->overlap, layer, slot, x, y, bl, bslot, dy, dx, scale));
    m->last_slot[layer] = (unsigned char)slot;
    m->last_bwd_slot[bl] = (unsigned char)bslot;
    fill_stats(F, stats);
    MOERT_CHECK(release_below(m, layer));
    if (layer > 0)
        MOERT_CHECK(moert_act_store_start_offloads(&moert_overlap_layer(&m->overlap, layer - 1, slot)->acts));
    if (B->capturing) m->graph_backward = true;
    MOERT_CHECK(leave(m, stream));
    set_saved(m, layer, slot, token);
    *saved = token;
    return MOERT_OK;
fail:
    free(token);
    (void)moert_layer_release_saved(B);
    return release_after_failure(F, rc);
}

MOERT_API bool moert_layers_overlap_interleave(moert_layers *m, bool interleave)
{
    if (!m) return false;
    /* on CUDA the halves are always issued in turn (that is the overlap); the choice is the CPU's */
    if (m->device.type != MOERT_DEVICE_CUDA) m->overlap.interleave = interleave && m->overlap.merge;
    return m->overlap.merge;
}

MOERT_API moert_result moert_saved_tokens_per_expert(const moert_saved *saved, moert_tensor *dst, moert_stream stream)
{
    const char *fn = "moert_saved_tokens_per_expert";
    moert_result rc = MOERT_OK;
    moert_layers *m = live_owner(saved, false);
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is not a forward in flight", fn);
    if (saved->experts) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is an experts forward's", fn);
    moert_layer *L = moert_overlap_layer(&m->overlap, saved->layer, saved->slot);
    const int64_t shape[1] = {L->info.num_experts};
    MOERT_CHECK(
        check_tensor(fn, "dst", dst, MOERT_I64, dst && on_host(dst->device) ? dst->device : m->device, 1, shape));
    MOERT_CHECK(copy_out(m, &L->tokens_per_expert, dst, stream));
fail:
    return rc;
}

MOERT_API void moert_saved_free(moert_saved *saved)
{
    moert_layers *m = live_owner(saved, false);
    if (!m) return; /* NULL, or stale: consumed by its backward, freed already, or freed with its layers */
    set_saved(m, saved->layer, saved->slot, NULL);
    if (moert_layer_release_saved(moert_overlap_layer(&m->overlap, saved->layer, saved->slot)) != MOERT_OK)
        moert_error_clear();
    free(saved);
}

/* ---- figures ---- */

MOERT_API moert_result moert_layers_figures(moert_layers *m, int layer, moert_layer_figures *out)
{
    const char *fn = "moert_layers_figures";
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    const size_t v2_size = offsetof(moert_layer_figures, shared_saved_bytes); /* before API version 3 */
    const size_t v3_size = offsetof(moert_layer_figures, device_pool_calls);  /* before API version 6 */
    if (!out || out->struct_size < v2_size)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: out is NULL or its struct_size is not %zu", fn,
                           sizeof *out);
    /* the slot whose backward ran last: with two slots, the micro-batch whose forward and backward are both done */
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, m->last_bwd_slot[layer]);
    MOERT_CHECK(moert_layer_collect_times(L));
    for (int i = 0; i < MOERT_LAYER_STAGES && i < MOERT_STAGE_COUNT; i++) out->stage_ms[i] = 1e3 * L->stage_seconds[i];
    for (int i = 0; i < MOERT_LAYER_BACKWARD_PARTS && i < MOERT_BWD_PART_COUNT; i++)
        out->backward_part_ms[i] = 1e3 * L->backward_part_seconds[i];
    for (int a = 0; a < MOERT_LAYER_ACTIVATIONS && a < MOERT_ACT_COUNT; a++)
        out->saved_bytes[a] = L->acts.saved_bytes[a];
    /* every slot's held bytes, and those of offloads cancelled at reload (their device copy was kept) */
    out->held_bytes = L->acts.kept_bytes_peak;
    if (out->struct_size >= v3_size)
        for (int a = 0; a < MOERT_LAYER_SHARED_ACTIVATIONS; a++)
            out->shared_saved_bytes[a] = L->acts.saved_bytes[MOERT_STORE_SHARED_FC1_OUT + a];
    out->recompute_saved_bytes = L->acts.recompute_saved_bytes;
    out->offload_saved_bytes = L->acts.offload_saved_bytes;
    out->pinned_bytes = L->acts.pinned_bytes;
    out->device_peak_bytes = 0;
    if (out->struct_size >= sizeof *out) out->device_pool_calls = 0;
#ifdef MOERT_HAVE_CUDA
    if (m->pool) {
        moert_cuda_pool_stats stats;
        moert_cuda_pool_get_stats(m->pool, &stats);
        out->device_peak_bytes = (int64_t)stats.peak_bytes_in_use;
        if (out->struct_size >= sizeof *out)
            out->device_pool_calls = (int64_t)(stats.cuda_malloc_count + stats.cuda_free_count);
    }
#endif
fail:
    return rc;
}

MOERT_API const char *moert_layer_stage_name(int stage)
{
    return stage >= 0 && stage < MOERT_STAGE_COUNT ? moert_stage_name((moert_stage)stage) : NULL;
}

MOERT_API const char *moert_layer_backward_part_name(int part)
{
    return part >= 0 && part < MOERT_BWD_PART_COUNT ? moert_backward_part_name((moert_backward_part)part) : NULL;
}

MOERT_API const char *moert_layer_activation_name(int activation)
{
    return activation >= 0 && activation < MOERT_STORE_SLOTS ? moert_act_store_slot_name(activation) : NULL;
}

/* ---- the dispatcher alone ---- */

/* Whether `d` is a dispatch in flight of live layers, found by address before anything reads it. */
static bool dispatch_in_flight(const moert_dispatch *d) { return live_owner(d, true) != NULL; }

static moert_result check_dispatch(const moert_dispatch *d, const char *fn, bool need_run)
{
    if (!dispatch_in_flight(d))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: not a dispatch in flight (prepared and not freed)", fn);
    if (need_run && !d->ran)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: moert_dispatch_run has not run for this dispatch", fn);
    return MOERT_OK;
}

MOERT_API moert_result moert_dispatch_prepare(moert_layers *m, int layer, const moert_tensor *topk_idx,
                                              moert_stream stream, moert_dispatch **out, int64_t *recv_rows)
{
    const char *fn = "moert_dispatch_prepare";
    moert_result rc = check_layer(m, layer, fn);
    moert_dispatch *d = NULL;
    if (rc != MOERT_OK) return rc;
    if (!out || !recv_rows) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: out or recv_rows is NULL", fn);
    *out = NULL;
    const int slot = free_slot(m, layer, -1, fn);
    if (slot < 0) return MOERT_ERR_INVALID_ARGUMENT;
    if ((rc = check_capture_slot(m, slot, fn)) != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    const int64_t shape[2] = {-m->max_tokens, L->info.topk};
    MOERT_CHECK(check_tensor(fn, "topk_idx", topk_idx, MOERT_I32, m->device, 2, shape));
    d = calloc(1, sizeof *d);
    MOERT_CHECK_ALLOC(d);
    *d =
        (moert_dispatch){.owner = m, .layer = layer, .slot = slot, .tokens = topk_idx->shape[0], .topk_idx = *topk_idx};
    d->layout.struct_size = sizeof d->layout;
    MOERT_CHECK(slot_enter(d->owner, d->slot, stream));
    DISPATCHER_CALL("prepare", DISPATCHER(L)->prepare(L->dispatcher.ctx, L->stream, &d->topk_idx, &d->layout));
    MOERT_CHECK(slot_leave(d->owner, d->slot, stream));
    set_dispatch(m, layer, slot, d);
    *out = d;
    *recv_rows = d->layout.capacity;
    return MOERT_OK;
fail:
    free(d);
    return rc;
}

MOERT_API moert_result moert_dispatch_tokens_per_expert(const moert_dispatch *d, moert_tensor *dst, moert_stream stream)
{
    const char *fn = "moert_dispatch_tokens_per_expert";
    moert_result rc = check_dispatch(d, fn, false);
    if (rc != MOERT_OK) return rc;
    moert_layers *m = d->owner;
    const int64_t shape[1] = {m->stack.layers[d->layer].info.num_local_experts};
    MOERT_CHECK(
        check_tensor(fn, "dst", dst, MOERT_I64, dst && on_host(dst->device) ? dst->device : m->device, 1, shape));
    MOERT_CHECK(copy_out(m, &d->layout.tokens_per_expert, dst, stream));
fail:
    return rc;
}

/* Checks a [tokens or rows, H] activation of a dispatch (dtype of the layers). */
static moert_result check_rows(const moert_dispatch *d, const char *fn, const char *name, const moert_tensor *t,
                               int64_t rows)
{
    const moert_layer *L = &d->owner->stack.layers[d->layer];
    const int64_t shape[2] = {rows, L->info.hidden};
    return check_tensor(fn, name, t, L->info.dtype, d->owner->device, 2, shape);
}

/* Checks a [tokens, K] or [rows] routing-weight tensor (the parameters' dtype). */
static moert_result check_weights(const moert_dispatch *d, const char *fn, const char *name, const moert_tensor *t,
                                  bool per_token)
{
    const moert_layer *L = &d->owner->stack.layers[d->layer];
    const int64_t shape[2] = {per_token ? d->tokens : d->layout.capacity, L->info.topk};
    return check_tensor(fn, name, t, L->param_dtype, d->owner->device, per_token ? 2 : 1, shape);
}

MOERT_API moert_result moert_dispatch_run(moert_dispatch *d, const moert_tensor *x, const moert_tensor *topk_weights,
                                          moert_tensor *recv_x, moert_tensor *recv_weights, moert_stream stream)
{
    const char *fn = "moert_dispatch_run";
    moert_result rc = check_dispatch(d, fn, false);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&d->owner->overlap, d->layer, d->slot);
    MOERT_CHECK(check_rows(d, fn, "x", x, d->tokens));
    MOERT_CHECK(check_weights(d, fn, "topk_weights", topk_weights, true));
    MOERT_CHECK(check_rows(d, fn, "recv_x", recv_x, d->layout.capacity));
    MOERT_CHECK(check_weights(d, fn, "recv_weights", recv_weights, false));
    MOERT_CHECK(slot_enter(d->owner, d->slot, stream));
    moert_dispatch_args a = {
        .struct_size = sizeof a, .x = x, .topk_probs = topk_weights, .recv_x = recv_x, .recv_probs = recv_weights};
    DISPATCHER_CALL("dispatch", DISPATCHER(L)->dispatch(L->dispatcher.ctx, L->stream, &a));
    d->ran = true;
    MOERT_CHECK(slot_leave(d->owner, d->slot, stream));
fail:
    return rc;
}

/* combine (rows -> tokens) or its adjoint (tokens -> rows): the same checks and order, the plugin's call for each. */
static moert_result combine_pass(moert_dispatch *d, bool backward, const char *in_name, const moert_tensor *in,
                                 const char *out_name, moert_tensor *out, moert_stream stream)
{
    const char *fn = backward ? "moert_dispatch_combine_backward" : "moert_dispatch_combine";
    moert_result rc = check_dispatch(d, fn, true);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&d->owner->overlap, d->layer, d->slot);
    const int64_t rows = d->layout.capacity, tokens = d->tokens;
    MOERT_CHECK(check_rows(d, fn, in_name, in, backward ? tokens : rows));
    MOERT_CHECK(check_rows(d, fn, out_name, out, backward ? rows : tokens));
    MOERT_CHECK(slot_enter(d->owner, d->slot, stream));
    if (backward) {
        moert_combine_backward_args a = {.struct_size = sizeof a, .d_y = in, .d_y_expert = out};
        DISPATCHER_CALL("combine_backward", DISPATCHER(L)->combine_backward(L->dispatcher.ctx, L->stream, &a));
    } else {
        moert_combine_args a = {.struct_size = sizeof a, .y_expert = in, .y = out};
        DISPATCHER_CALL("combine", DISPATCHER(L)->combine(L->dispatcher.ctx, L->stream, &a));
    }
    MOERT_CHECK(slot_leave(d->owner, d->slot, stream));
fail:
    return rc;
}

MOERT_API moert_result moert_dispatch_combine(moert_dispatch *d, const moert_tensor *y_expert, moert_tensor *y,
                                              moert_stream stream)
{
    return combine_pass(d, false, "y_expert", y_expert, "y", y, stream);
}

MOERT_API moert_result moert_dispatch_combine_backward(moert_dispatch *d, const moert_tensor *dy,
                                                       moert_tensor *dy_expert, moert_stream stream)
{
    return combine_pass(d, true, "dy", dy, "dy_expert", dy_expert, stream);
}

MOERT_API moert_result moert_dispatch_backward(moert_dispatch *d, const moert_tensor *d_recv_x,
                                               const moert_tensor *d_recv_weights, moert_tensor *dx,
                                               moert_tensor *d_topk_weights, moert_stream stream)
{
    const char *fn = "moert_dispatch_backward";
    moert_result rc = check_dispatch(d, fn, true);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&d->owner->overlap, d->layer, d->slot);
    MOERT_CHECK(check_rows(d, fn, "d_recv_x", d_recv_x, d->layout.capacity));
    MOERT_CHECK(check_weights(d, fn, "d_recv_weights", d_recv_weights, false));
    MOERT_CHECK(check_rows(d, fn, "dx", dx, d->tokens));
    MOERT_CHECK(check_weights(d, fn, "d_topk_weights", d_topk_weights, true));
    MOERT_CHECK(slot_enter(d->owner, d->slot, stream));
    MOERT_CHECK(moert_zero(L->stream, dx)); /* the plugin adds the rows into it */
    moert_dispatch_backward_args a = {.struct_size = sizeof a,
                                      .d_recv_x = d_recv_x,
                                      .d_recv_probs = d_recv_weights,
                                      .d_x = dx,
                                      .d_topk_probs = d_topk_weights};
    DISPATCHER_CALL("dispatch_backward", DISPATCHER(L)->dispatch_backward(L->dispatcher.ctx, L->stream, &a));
    MOERT_CHECK(slot_leave(d->owner, d->slot, stream));
fail:
    return rc;
}

MOERT_API void moert_dispatch_free(moert_dispatch *d)
{
    if (!dispatch_in_flight(d)) return; /* NULL, or stale: freed already, or with its layers */
    set_dispatch(d->owner, d->layer, d->slot, NULL);
    free(d);
}

/* ---- the experts alone ---- */

/* fc1 and fc2 of `layer` are bound (the experts need no other parameter), or an error naming the first that is not. */
static moert_result check_experts_bound(const moert_layers *m, int layer, const char *fn)
{
    const moert_param_id need[2] = {MOERT_PARAM_FC1, MOERT_PARAM_FC2};
    for (int i = 0; i < 2; i++)
        if (!m->bound[layer][need[i]])
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layer %d's %s is not bound (moert_layers_bind_param)",
                               fn, layer, param_name(need[i]));
    return MOERT_OK;
}

/* The last error's message again, prefixed with the public function's name. */
static moert_result prefixed_error(const char *fn, moert_result rc)
{
    char message[MOERT_ERROR_MAX];
    snprintf(message, sizeof message, "%s", moert_error_message());
    return moert_error(rc, "%s: %s", fn, message);
}

/* A [rows, cols] tensor of the caller's with any number of rows (0 too), or an error naming it. */
static moert_result check_rows_tensor(const char *fn, const char *name, const moert_tensor *t, moert_dtype dtype,
                                      moert_device dev, int ndim, int64_t rows, int64_t cols)
{
    if (!t) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s is NULL", fn, name);
    const int64_t want[2] = {rows >= 0 ? rows : (t->ndim >= 1 ? t->shape[0] : 0), cols};
    if (want[0] < 0) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: %s has a negative size", fn, name);
    return check_tensor(fn, name, t, dtype, dev, ndim, want);
}

MOERT_API moert_result moert_experts_forward(moert_layers *m, int layer, const moert_tensor *x_rows,
                                             const moert_tensor *tokens_per_expert, const moert_tensor *probs,
                                             moert_tensor *y_rows, moert_stream stream, moert_saved **saved)
{
    const char *fn = "moert_experts_forward";
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    if (saved) *saved = NULL;
    if ((rc = check_experts_bound(m, layer, fn)) != MOERT_OK) return rc;
    const int slot = free_slot(m, layer, -1, fn);
    if (slot < 0) return MOERT_ERR_INVALID_ARGUMENT;
    if ((rc = check_capture_slot(m, slot, fn)) != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    if (L->etp_size > 1)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "%s: the experts alone with expert tensor parallelism (ETP %d) are "
                           "not supported",
                           fn, L->etp_size);
    if ((rc = check_rows_tensor(fn, "x_rows", x_rows, L->info.dtype, m->device, 2, -1, L->info.hidden)) != MOERT_OK)
        return rc;
    const int64_t rows = x_rows->shape[0];
    if ((rc = check_rows_tensor(fn, "y_rows", y_rows, L->info.dtype, m->device, 2, rows, L->info.hidden)) != MOERT_OK)
        return rc;
    if (rows > 0 && memory_overlaps(x_rows, y_rows))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: y_rows may not be x_rows's memory", fn);
    /* the rows' activations (x, fc1's output, SwiGLU's, in at most 8 bytes an element) must fit a device: the sizes
     * made from rows then never overflow */
    const int64_t row_bytes = 8 * (L->info.hidden + 3 * L->info.ffn_hidden);
    if (rows > MOERT_MAX_BUFFER_BYTES / row_bytes)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "%s: x_rows has %lld rows, more than any device holds (at most %lld)", fn, (long long)rows,
                           (long long)(MOERT_MAX_BUFFER_BYTES / row_bytes));
    const int64_t el[1] = {L->info.num_local_experts};
    if ((rc = check_tensor(
             fn, "tokens_per_expert", tokens_per_expert, MOERT_I64,
             tokens_per_expert && on_host(tokens_per_expert->device) ? tokens_per_expert->device : m->device, 1, el)) !=
        MOERT_OK)
        return rc;
    if (probs && (rc = check_rows_tensor(fn, "probs", probs, L->param_dtype, m->device, 1, rows, 0)) != MOERT_OK)
        return rc;
    moert_saved *token = NULL;
    if (saved) {
        token = calloc(1, sizeof *token);
        if (!token) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
        *token = (moert_saved){.owner = m, .layer = layer, .slot = slot, .tokens = rows, .experts = true};
    }
    MOERT_CHECK(slot_enter(m, slot, stream));
    rc = moert_layer_experts_forward(L, x_rows, tokens_per_expert, probs, y_rows);
    if (rc != MOERT_OK) {
        rc = prefixed_error(fn, rc);
        goto fail;
    }
    if (!saved) MOERT_CHECK(moert_layer_release_saved(L));
    MOERT_CHECK(slot_leave(m, slot, stream));
    if (saved) {
        set_saved(m, layer, slot, token);
        *saved = token;
    }
    return MOERT_OK;
fail:
    free(token);
    return release_after_failure(L, rc);
}

MOERT_API moert_result moert_experts_backward(moert_layers *m, moert_saved *saved, const moert_tensor *dy_rows,
                                              moert_tensor *dx_rows, moert_tensor *d_probs,
                                              const moert_backward_options *opts, moert_stream stream)
{
    const char *fn = "moert_experts_backward";
    moert_result rc = MOERT_OK;
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers is NULL", fn);
    if (!in_flight(m, saved))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is not a forward in flight of these layers", fn);
    if (!saved->experts)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: saved is moert_moe_forward's: run moert_moe_backward", fn);
    if (opts && opts->struct_size < sizeof *opts)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: opts->struct_size %u, expected %zu", fn, opts->struct_size,
                           sizeof *opts);
    bool accumulate = opts ? opts->accumulate : true;
    const int layer = saved->layer, slot = saved->slot;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    const int64_t rows = saved->tokens, h = L->info.hidden;
    if ((rc = check_rows_tensor(fn, "dy_rows", dy_rows, L->info.dtype, m->device, 2, rows, h)) != MOERT_OK) return rc;
    if ((rc = check_rows_tensor(fn, "dx_rows", dx_rows, L->info.dtype, m->device, 2, rows, h)) != MOERT_OK) return rc;
    if (rows > 0 && memory_overlaps(dx_rows, dy_rows))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: dx_rows may not be dy_rows's memory", fn);
    if (d_probs && (rc = check_rows_tensor(fn, "d_probs", d_probs, L->param_dtype, m->device, 1, rows, 0)) != MOERT_OK)
        return rc;
    /* the activations go with this call, whatever its outcome */
    set_saved(m, layer, slot, NULL);
    free(saved);
    MOERT_CHECK(slot_enter(m, slot, stream));
    rc = moert_layer_experts_backward(L, dy_rows, dx_rows, d_probs, !accumulate);
    moert_overlap_sync_back(&m->overlap, layer, slot);
    if (rc != MOERT_OK) {
        rc = prefixed_error(fn, rc);
        goto fail;
    }
    MOERT_CHECK(slot_leave(m, slot, stream));
    return MOERT_OK;
fail:
    return release_after_failure(L, rc);
}

/* ---- around the layers: memory, collectives, offload boundaries, spans ---- */

/* Whether `device` is one the layers allocate on: theirs, pinned host memory or the CPU. */
static moert_result check_alloc_device(const moert_layers *m, moert_device device, const char *fn)
{
    char a[32], b[32];
    if (device.type == MOERT_DEVICE_CPU || device.type == MOERT_DEVICE_CUDA_HOST) return MOERT_OK;
    if (device.type == m->device.type && device.id == m->device.id) return MOERT_OK;
    return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: device %s, expected the layers' (%s), cuda_host or cpu", fn,
                       device_text(device, a, sizeof a), device_text(m->device, b, sizeof b));
}

MOERT_API moert_result moert_layers_alloc(moert_layers *m, moert_device device, size_t bytes, void **out)
{
    const char *fn = "moert_layers_alloc";
    if (!m || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers or out is NULL", fn);
    *out = NULL;
    moert_result rc = check_alloc_device(m, device, fn);
    if (rc != MOERT_OK) return rc;
    const moert_host *h = m->stack.core_host;
    rc = device.type == MOERT_DEVICE_CUDA_HOST ? h->alloc_pinned(h, bytes, out) : h->alloc(h, device, bytes, out);
    if (rc != MOERT_OK) return moert_error(rc, "%s: %s", fn, moert_host_take_error(m->stack.core_host));
    return MOERT_OK;
}

MOERT_API void moert_layers_free(moert_layers *m, moert_device device, void *ptr)
{
    if (!m || !ptr || check_alloc_device(m, device, "moert_layers_free") != MOERT_OK) return;
    const moert_host *h = m->stack.core_host;
    if (device.type == MOERT_DEVICE_CUDA_HOST)
        h->free_pinned(h, ptr);
    else
        h->free(h, device, ptr);
}

MOERT_API moert_result moert_layers_allreduce_sum(moert_layers *m, moert_group group, moert_tensor *buf,
                                                  moert_stream stream)
{
    const char *fn = "moert_layers_allreduce_sum";
    moert_result rc = MOERT_OK;
    if (!m || !buf) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers or buf is NULL", fn);
    if (buf->dtype != MOERT_F32 && buf->dtype != MOERT_F64 && buf->dtype != MOERT_I64)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: buf is %s, expected fp32, fp64 or int64", fn,
                           moert_dtype_name(buf->dtype));
    MOERT_CHECK(check_any_shape(fn, "buf", buf));
    if (!moert_tensor_is_contiguous(buf) || (!buf->data && moert_tensor_numel(buf) > 0))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: buf is not contiguous or has no data", fn);
    const bool host = on_host(buf->device);
    if (!host && (buf->device.type != m->device.type || buf->device.id != m->device.id))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: buf is neither in host memory nor on the layers' device",
                           fn);
    const size_t count = (size_t)moert_tensor_numel(buf);
    if (group == MOERT_GROUP_WORLD) {
        const moert_host *h = m->stack.core_host;
        if (m->world == 1) return MOERT_OK;
        MOERT_CHECK(enter(m, stream));
        rc = h->allreduce_sum(h, buf->data, count, buf->dtype, host ? moert_cpu() : buf->device, m->stream);
        if (rc != MOERT_OK) return moert_error(rc, "%s: %s", fn, moert_host_take_error(m->stack.core_host));
        MOERT_CHECK(leave(m, stream));
        return MOERT_OK;
    }
    const moert_expert_axis axes[4] = {MOERT_AXIS_EP, MOERT_AXIS_EP, MOERT_AXIS_ETP, MOERT_AXIS_EDP};
    if ((int)group < 0 || (int)group > 3)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: group %d, expected a moert_group", fn, (int)group);
    const moert_expert_axis axis = axes[group];
    if (!m->stack.group_host[axis]) return MOERT_OK; /* this rank alone */
    /* the group's own core services: host memory, or the device through the group's NCCL communicator on GPUs */
    moert_tensor t = *buf;
    if (host) t.device = moert_cpu();
    MOERT_CHECK(enter(m, stream));
    MOERT_CHECK(moert_stack_group_sum(&m->stack, axis, &t, m->stream));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

MOERT_API moert_result moert_layers_barrier(moert_layers *m)
{
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_barrier: layers is NULL");
    const moert_host *h = m->stack.core_host;
    if (h->barrier(h) != MOERT_OK)
        return moert_error(MOERT_ERR_TIMEOUT, "moert_layers_barrier: %s", moert_host_take_error(m->stack.core_host));
    return MOERT_OK;
}

MOERT_API moert_result moert_layers_release_offloaded(moert_layers *m, moert_stream stream)
{
    moert_result rc = MOERT_OK;
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_layers_release_offloaded: layers is NULL");
    MOERT_CHECK(enter(m, stream));
    for (int l = 0; l < m->stack.num_layers; l++)
        MOERT_CHECK(moert_act_store_release_finished(&m->stack.layers[l].acts));
    MOERT_CHECK(leave(m, stream));
fail:
    return rc;
}

MOERT_API moert_result moert_layers_tokens_per_expert(moert_layers *m, int layer, moert_tensor *dst,
                                                      moert_stream stream)
{
    const char *fn = "moert_layers_tokens_per_expert";
    moert_result rc = check_layer(m, layer, fn);
    if (rc != MOERT_OK) return rc;
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, m->last_slot[layer]);
    const int64_t shape[1] = {L->info.num_experts};
    MOERT_CHECK(
        check_tensor(fn, "dst", dst, MOERT_I64, dst && on_host(dst->device) ? dst->device : m->device, 1, shape));
    if (!L->tokens_per_expert.data)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layer %d has not run a forward", fn, layer);
    MOERT_CHECK(copy_out(m, &L->tokens_per_expert, dst, stream));
fail:
    return rc;
}

_Static_assert(MOERT_LAYERS_MAX_SPANS == MOERT_LAYER_MAX_SPANS, "public span count");

MOERT_API moert_result moert_layers_spans(moert_layers *m, int layer, int origin, moert_span *out, int capacity,
                                          int *count)
{
    const char *fn = "moert_layers_spans";
    moert_result rc = check_layer(m, layer, fn);
    if (rc == MOERT_OK) rc = check_layer(m, origin, fn);
    if (rc != MOERT_OK) return rc;
    if (!count || (!out && capacity > 0))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: out or count is NULL", fn);
    if (capacity < 0) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: capacity %d, expected >= 0", fn, capacity);
    /* the slot whose backward of `layer` ran last: a micro-batch's forward and backward in one slot */
    const int slot = m->last_bwd_slot[layer];
    moert_layer *L = moert_overlap_layer(&m->overlap, layer, slot);
    moert_layer_span spans[MOERT_LAYER_MAX_SPANS];
    int n = 0;
    MOERT_CHECK(moert_layer_collect_times(L));
    MOERT_CHECK(moert_layer_spans(L, moert_overlap_layer(&m->overlap, origin, slot), spans, &n));
    *count = n < capacity ? n : capacity;
    for (int i = 0; i < *count; i++)
        out[i] = (moert_span){
            .name = spans[i].name, .stream = spans[i].stream, .start_s = spans[i].start_s, .dur_s = spans[i].dur_s};
fail:
    return rc;
}

/* ---- CUDA graphs ---- */

struct moert_graph {
    moert_layers *owner;
    void *exec;        /* a cudaGraphExec_t */
    bool writes_grads; /* it holds a backward: its WGRADs write the expert gradients */
};

MOERT_API bool moert_layers_graph_capturable(const moert_layers *m, char *why, size_t why_size)
{
    if (!m) {
        if (why && why_size) snprintf(why, why_size, "no layers");
        return false;
    }
    for (int l = 0; l < m->stack.num_layers; l++)
        if (!moert_layer_graph_capturable(&m->stack.layers[l], why, why_size)) return false;
    return true;
}

MOERT_API moert_result moert_layers_capture_begin(moert_layers *m, moert_stream stream)
{
    const char *fn = "moert_layers_capture_begin";
    if (!m) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers is NULL", fn);
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    if (m->device.type != MOERT_DEVICE_CUDA)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s: the layers run on the CPU", fn);
    MOERT_CHECK(moert_cuda_set_device(m->device.id));
    /* the layers allocate on their own stream: its blocks are kept for the graphs */
    MOERT_CHECK(moert_cuda_pool_reserve_resume(m->pool, m->stream));
    rc = moert_cuda_capture_begin(stream);
    if (rc != MOERT_OK) {
        moert_cuda_pool_reserve_end(m->pool);
        goto fail;
    }
    m->graph_backward = false;
    for (int l = 0; l < m->stack.num_layers; l++) m->stack.layers[l].capturing = true;
fail:
    return rc;
#else
    (void)stream;
    return moert_error(MOERT_ERR_UNSUPPORTED, "%s: this build of moert has no CUDA", fn);
#endif
}

MOERT_API moert_result moert_layers_capture_end(moert_layers *m, moert_stream stream, const char *what,
                                                moert_graph **out)
{
    const char *fn = "moert_layers_capture_end";
    if (!m || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers or out is NULL", fn);
    *out = NULL;
#ifdef MOERT_HAVE_CUDA
    moert_result rc = MOERT_OK;
    if (m->device.type != MOERT_DEVICE_CUDA)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s: the layers run on the CPU", fn);
    for (int l = 0; l < m->stack.num_layers; l++) m->stack.layers[l].capturing = false;
    moert_cuda_graph exec = NULL;
    rc = moert_cuda_capture_end(stream, what ? what : "the layers' work", &exec);
    moert_cuda_pool_reserve_end(m->pool);
    if (rc != MOERT_OK) return rc;
    moert_graph *g = calloc(1, sizeof *g);
    if (!g) {
        moert_cuda_graph_destroy(exec);
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
    }
    *g = (moert_graph){.owner = m, .exec = exec, .writes_grads = m->graph_backward};
    m->graph_backward = false;
    *out = g;
    return rc;
#else
    (void)stream;
    (void)what;
    return moert_error(MOERT_ERR_UNSUPPORTED, "%s: this build of moert has no CUDA", fn);
#endif
}

MOERT_API moert_result moert_graph_launch(moert_graph *g, moert_stream stream)
{
    if (!g) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_graph_launch: graph is NULL");
#ifdef MOERT_HAVE_CUDA
    moert_layers *m = g->owner;
    moert_result rc = moert_cuda_set_device(m->device.id);
    if (rc != MOERT_OK) return rc;
    /* the replayed WGRADs write the expert gradients: a later capture must add to them */
    if (g->writes_grads)
        for (int l = 0; l < m->stack.num_layers; l++) moert_layer_mark_grads_written(&m->stack.layers[l]);
    /* a replay runs no host code of the layers: they have no host spans until their next eager call */
    for (int l = 0; l < m->stack.num_layers; l++) m->stack.layers[l].host_marks_valid = false;
    return moert_cuda_graph_launch(g->exec, stream);
#else
    (void)stream;
    return moert_error(MOERT_ERR_UNSUPPORTED, "moert_graph_launch: this build of moert has no CUDA");
#endif
}

MOERT_API void moert_graph_destroy(moert_graph *g)
{
    if (!g) return;
#ifdef MOERT_HAVE_CUDA
    moert_cuda_graph_destroy(g->exec);
#endif
    free(g);
}

/* ---- plugins and memory ---- */

MOERT_API moert_result moert_layers_plugin(const moert_layers *m, moert_plugin_kind kind, moert_plugin_description *out)
{
    const char *fn = "moert_layers_plugin";
    if (!m || !out) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: layers or out is NULL", fn);
    for (int s = 0; s < MOERT_SLOT_COUNT; s++)
        if (moert_slot_kind((moert_slot)s) == kind) return moert_plugin_description_of(&m->plugins[s], out);
    return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: kind %d, expected a moert_plugin_kind", fn, (int)kind);
}

MOERT_API moert_result moert_config_memory_estimate(const moert_config *cfg, int world, moert_device_type device,
                                                    char *buf, size_t size)
{
    if (!cfg || world < 1 || (device != MOERT_DEVICE_CPU && device != MOERT_DEVICE_CUDA))
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "moert_config_memory_estimate: cfg NULL, world %d or device type %d not cpu or cuda", world,
                           (int)device);
    moert_memory_estimate est;
    moert_memory_estimate_config(cfg, world, device, &est);
    if (buf && size) {
        char line[1024];
        moert_memory_estimate_line(&est, line, sizeof line);
        const size_t need = strlen(line) + 1;
        if (need > size) /* as the config getters: the buffer left as it was, never a cut line */
            return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                               "moert_config_memory_estimate: buf has %zu bytes, the line needs %zu", size, need);
        memcpy(buf, line, need);
    }
    return moert_memory_estimate_check(cfg, &est);
}
