/* SPDX-License-Identifier: Apache-2.0 */
/* Communicator of the expert-parallel group: ranks are threads of one process sharing memory.
 *
 * Every collective has the same shape: each rank posts what it offers in its slot, waits at a barrier,
 * reads what its peers posted, and waits at a second barrier so that no rank reuses its slot (or frees
 * the memory it offered) while a peer still reads it. The mutex taken by every barrier orders the writes
 * before it against the reads after it. The barrier counts generations, so it can be reused at once.
 * A rank that does not arrive within timeout_s, or a call to moert_comm_abort, fails the group: every
 * waiting rank returns at once with the same message, and so does every later collective.
 *
 * A group may instead be one rank's view of collectives the caller implements (moert_collectives, e.g. a PyTorch
 * process group across processes): every call then goes to the caller's table, and the rank argument is ignored.
 *
 * A group may also be one rank's view of a subgroup of such a group (moert_comm_subgroup_create, the expert groups of
 * docs/parallel.md): its collectives are the parent's all-to-all with zero sizes to non-members, so one design serves
 * the threads group and the caller's table alike.
 */
#include "comm.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "error.h"

/* What one rank offers in the current collective. */
typedef struct comm_slot {
    const void *send;
    const size_t *send_bytes;
    const size_t *send_offsets;
    void *pointer;
    const char *arrived_in; /* the collective this rank waits in at the barrier (its `what`) */
} comm_slot;

struct moert_comm_group {
    int world;
    double timeout_s;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    unsigned long generation; /* barriers completed */
    int arrived;              /* ranks waiting in the current barrier */
    bool *present;            /* [world] which ranks are in the current barrier */
    bool failed;
    moert_result failure_code;
    char failure[1024]; /* the message every rank returns once the group failed */
    comm_slot *slots;   /* [world] */
    bool has_table;     /* the caller's collectives carry every call (one rank's group) */
    moert_collectives table;
    /* a subgroup view: its collectives go through the parent (members[i] is subgroup rank i's rank there) */
    moert_comm_group *parent;
    int *members;     /* [world] */
    int member_index; /* this view's rank in the subgroup */
    int parent_rank;  /* and in the parent */
    /* start-up log lines already written by the world's ranks (moert_comm_log_seen), under fold_lock */
    pthread_mutex_t fold_lock;
    int fold_count;
    uint64_t fold[MOERT_COMM_LOG_FOLD_MAX];
};

/* A group of world ranks whose collectives wait at most timeout_s for a peer. */
moert_result moert_comm_group_create(int world, double timeout_s, moert_comm_group **out)
{
    moert_result rc = MOERT_OK;
    *out = NULL;
    if (world < 1) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: world size %d, expected >= 1", world);
    /* at most a day ($.parallel.timeout_s's bound): deadlines past it wrapped and made the waits spin */
    if (!(timeout_s > 0) || timeout_s > 86400.0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: timeout %g s, expected > 0 and <= 86400", timeout_s);
    moert_comm_group *g = calloc(1, sizeof *g);
    MOERT_CHECK_ALLOC(g);
    g->present = calloc((size_t)world, sizeof *g->present);
    g->slots = calloc((size_t)world, sizeof *g->slots);
    if (!g->present || !g->slots) {
        free(g->present);
        free(g->slots);
        free(g);
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "comm: out of memory for %d ranks", world);
    }
    g->world = world;
    g->timeout_s = timeout_s;
    pthread_mutex_init(&g->lock, NULL);
    pthread_mutex_init(&g->fold_lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cond, &attr);
    pthread_condattr_destroy(&attr);
    *out = g;
fail:
    return rc;
}

void moert_comm_group_free(moert_comm_group *g)
{
    if (!g) return;
    if (g->parent) { /* a view: no lock or slots of its own */
        free(g->members);
        free(g);
        return;
    }
    pthread_cond_destroy(&g->cond);
    pthread_mutex_destroy(&g->lock);
    pthread_mutex_destroy(&g->fold_lock);
    free(g->present);
    free(g->slots);
    free(g);
}

int moert_comm_group_size(const moert_comm_group *g) { return g->world; }

int moert_comm_group_local_ranks(const moert_comm_group *g)
{
    const moert_comm_group *root = g->parent ? g->parent : g;
    return root->has_table ? 1 : root->world;
}

bool moert_comm_log_seen(void *group, uint64_t hash)
{
    moert_comm_group *g = group;
    if (g->parent) g = g->parent; /* a subgroup's ranks fold with their world */
    bool seen = false;
    pthread_mutex_lock(&g->fold_lock);
    for (int i = 0; i < g->fold_count && !seen; i++) seen = g->fold[i] == hash;
    if (!seen && g->fold_count < MOERT_COMM_LOG_FOLD_MAX) g->fold[g->fold_count++] = hash;
    pthread_mutex_unlock(&g->fold_lock);
    return seen;
}

bool moert_comm_group_is_subgroup(const moert_comm_group *g) { return g->parent != NULL; }

int moert_comm_group_world_size(const moert_comm_group *g) { return g->parent ? g->parent->world : g->world; }

moert_result moert_comm_subgroup_create(moert_comm_group *parent, int parent_rank, const int *members, int count,
                                        moert_comm_group **out)
{
    moert_result rc = MOERT_OK;
    moert_comm_group *g = NULL;
    *out = NULL;
    if (!parent || parent->parent)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: a subgroup needs a parent group that is not a view");
    if (count < 1 || count > parent->world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: a subgroup of %d ranks in a group of %d", count,
                           parent->world);
    int index = -1;
    for (int i = 0; i < count; i++) {
        if (members[i] < 0 || members[i] >= parent->world)
            return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: subgroup member %d outside the group of %d",
                               members[i], parent->world);
        if (members[i] == parent_rank) index = i;
    }
    if (index < 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: rank %d is not a member of its subgroup", parent_rank);
    g = calloc(1, sizeof *g);
    MOERT_CHECK_ALLOC(g);
    g->members = malloc((size_t)count * sizeof *g->members);
    MOERT_CHECK_ALLOC(g->members);
    memcpy(g->members, members, (size_t)count * sizeof *g->members);
    g->world = count;
    g->timeout_s = parent->timeout_s;
    g->parent = parent;
    g->member_index = index;
    g->parent_rank = parent_rank;
    *out = g;
    return MOERT_OK;
fail:
    if (g) free(g->members);
    free(g);
    return rc;
}

static void fail_group_locked(moert_comm_group *g, moert_result code, const char *message);

moert_result moert_comm_group_create_table(int world, const moert_collectives *table, moert_comm_group **out)
{
    *out = NULL;
    if (!table || table->struct_size < sizeof *table)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "comm: the collectives table is %s (struct_size %u, expected %zu)",
                           table ? "too small" : "NULL", table ? table->struct_size : 0u, sizeof *table);
    const char *missing = !table->allgather       ? "allgather"
                          : !table->allreduce_sum ? "allreduce_sum"
                          : !table->alltoallv     ? "alltoallv"
                          : !table->barrier       ? "barrier"
                                                  : NULL;
    if (missing) return moert_error(MOERT_ERR_INVALID_ARGUMENT, "comm: the collectives table has no %s", missing);
    moert_result rc = moert_comm_group_create(world, 1.0, out);
    if (rc != MOERT_OK) return rc;
    (*out)->has_table = true;
    (*out)->table = *table;
    return MOERT_OK;
}

/* The outcome of one call into the caller's table: a non-zero answer becomes MOERT_ERR_INTERNAL naming the call,
 * and fails the group so that later collectives fail at once. */
static moert_result table_result(moert_comm_group *g, const char *call, int answer, const char *message)
{
    if (answer == 0) return MOERT_OK;
    char text[1024];
    snprintf(text, sizeof text, "the caller's %s failed (%d)%s%s", call, answer, message[0] ? ": " : "", message);
    pthread_mutex_lock(&g->lock);
    fail_group_locked(g, MOERT_ERR_INTERNAL, text);
    pthread_mutex_unlock(&g->lock);
    return moert_error(MOERT_ERR_INTERNAL, "%s", text);
}

/* One call into the caller's table (`call` may use `message`, the buffer its error text goes into), after a check that
 * the group has not failed already. Returns from the calling function. */
#define TABLE_CALL(g, name, call)                                                                                      \
    do {                                                                                                               \
        moert_result failed_rc_ = MOERT_OK;                                                                            \
        char message[512] = "";                                                                                        \
        if (table_failed((g), &failed_rc_)) return failed_rc_;                                                         \
        return table_result((g), (name), (call), message);                                                             \
    } while (0)

/* A group whose table already failed answers every later call with that failure. */
static bool table_failed(moert_comm_group *g, moert_result *rc)
{
    pthread_mutex_lock(&g->lock);
    bool failed = g->failed;
    if (failed) *rc = moert_error(g->failure_code, "%s", g->failure);
    pthread_mutex_unlock(&g->lock);
    return failed;
}

/* Marks the group failed with message (the lock is held) and wakes every waiting rank. */
static void fail_group_locked(moert_comm_group *g, moert_result code, const char *message)
{
    if (g->failed) return; /* the first failure is the one reported */
    g->failed = true;
    g->failure_code = code;
    snprintf(g->failure, sizeof g->failure, "%s", message);
    pthread_cond_broadcast(&g->cond);
}

/* Makes every waiting peer (and every later collective) fail with why. */
void moert_comm_abort(moert_comm_group *g, int rank, const char *why)
{
    if (!g) return;
    if (g->parent) {
        moert_comm_abort(g->parent, g->parent_rank, why);
        return;
    }
    char message[1024];
    snprintf(message, sizeof message, "rank %d aborted the group: %s", rank, why ? why : "(no reason given)");
    pthread_mutex_lock(&g->lock);
    fail_group_locked(g, MOERT_ERR_TIMEOUT, message);
    pthread_mutex_unlock(&g->lock);
}

/* "rank 2" or "ranks 1, 3": the ranks not yet in the current barrier (the lock is held). */
static void missing_ranks_locked(const moert_comm_group *g, char *buf, size_t size)
{
    int missing = 0;
    for (int r = 0; r < g->world; r++) missing += !g->present[r];
    snprintf(buf, size, "%s", missing == 1 ? "rank " : "ranks ");
    bool first = true;
    for (int r = 0; r < g->world; r++) {
        if (g->present[r]) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, size - used, "%s%d", first ? "" : ", ", r);
        first = false;
    }
}

/* The deadline timeout_s from now on the monotonic clock. */
static struct timespec deadline_after(double seconds)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long long whole = (long long)seconds;
    long long nanos = t.tv_nsec + (long long)((seconds - (double)whole) * 1e9);
    t.tv_sec += (time_t)whole + (time_t)(nanos / 1000000000LL);
    t.tv_nsec = (long)(nanos % 1000000000LL);
    return t;
}

/* ---- subgroup views: collectives over the parent's all-to-all ---- */

/* A view's collective is called with its rank in the subgroup. */
static moert_result check_view_rank(const moert_comm_group *g, int rank, const char *what)
{
    if (rank != g->member_index)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: rank %d on the view of subgroup rank %d", what, rank,
                           g->member_index);
    return MOERT_OK;
}

/* The parent's all-to-all for a subgroup exchange: sizes and offsets per subgroup rank (NULL sizes: none) spread over
 * the parent's ranks, zero for the ranks outside the subgroup. */
static moert_result subgroup_exchange(moert_comm_group *g, const void *send, const size_t *send_bytes,
                                      const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                      const size_t *recv_offsets)
{
    moert_result rc = MOERT_OK;
    const int world = g->parent->world;
    size_t *sizes = calloc(4 * (size_t)world, sizeof *sizes);
    if (!sizes) {
        moert_comm_abort(g, g->member_index, "a subgroup collective: out of memory");
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "comm: out of memory for a subgroup collective");
    }
    size_t *sb = sizes, *so = sizes + world, *rb = sizes + 2 * world, *ro = sizes + 3 * world;
    for (int i = 0; i < g->world; i++) {
        int p = g->members[i];
        sb[p] = send_bytes[i];
        so[p] = send_offsets[i];
        rb[p] = recv_bytes[i];
        ro[p] = recv_offsets[i];
    }
    rc = moert_comm_alltoallv(g->parent, g->parent_rank, send, sb, so, recv, rb, ro);
    free(sizes);
    return rc;
}

/* Gathers every member's `bytes` (the same on every member) into recv, in subgroup rank order. */
static moert_result subgroup_allgather(moert_comm_group *g, int rank, const void *send, void *recv, size_t bytes)
{
    moert_result rc = MOERT_OK;
    size_t *sizes = NULL;
    MOERT_CHECK(check_view_rank(g, rank, "allgather"));
    sizes = calloc(4 * (size_t)g->world, sizeof *sizes);
    MOERT_CHECK_ALLOC(sizes);
    size_t *sb = sizes, *so = sizes + g->world, *rb = sizes + 2 * g->world, *ro = sizes + 3 * g->world;
    for (int i = 0; i < g->world; i++) {
        sb[i] = rb[i] = bytes;
        so[i] = 0; /* the same block goes to every member */
        ro[i] = (size_t)i * bytes;
    }
    rc = subgroup_exchange(g, send, sb, so, recv, rb, ro);
fail:
    free(sizes);
    return rc;
}

/* Sums element i of the `n` buffers of `count` elements laid one after the other in `parts`, in buffer order (fp32
 * through a double, as the threads group sums), into out. */
static void sum_parts_in_order(const void *parts, int n, size_t count, moert_dtype dtype, void *out)
{
    for (size_t i = 0; i < count; i++) {
        if (dtype == MOERT_I64) {
            int64_t s = 0;
            for (int r = 0; r < n; r++) s += ((const int64_t *)parts)[(size_t)r * count + i];
            ((int64_t *)out)[i] = s;
        } else if (dtype == MOERT_F64) {
            double s = 0.0;
            for (int r = 0; r < n; r++) s += ((const double *)parts)[(size_t)r * count + i];
            ((double *)out)[i] = s;
        } else {
            double s = 0.0;
            for (int r = 0; r < n; r++) s += ((const float *)parts)[(size_t)r * count + i];
            ((float *)out)[i] = (float)s;
        }
    }
}

/* The sum over the members in subgroup rank order (every member gets the same bits): an allgather, then the sum. */
static moert_result subgroup_allreduce_sum(moert_comm_group *g, int rank, void *buf, size_t count, moert_dtype dtype)
{
    moert_result rc = MOERT_OK;
    void *parts = NULL;
    MOERT_CHECK(check_view_rank(g, rank, "allreduce_sum"));
    if (dtype != MOERT_F32 && dtype != MOERT_F64 && dtype != MOERT_I64)
        return moert_error(MOERT_ERR_UNSUPPORTED, "allreduce_sum: dtype %s, expected fp32, fp64 or int64",
                           moert_dtype_name(dtype));
    size_t bytes = count * moert_dtype_size(dtype);
    parts = malloc((size_t)g->world * bytes + 1);
    if (!parts) {
        moert_comm_abort(g, rank, "allreduce_sum: out of memory");
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "allreduce_sum: out of memory for %zu bytes",
                           (size_t)g->world * bytes);
    }
    MOERT_CHECK(subgroup_allgather(g, rank, buf, parts, bytes));
    sum_parts_in_order(parts, g->world, count, dtype, buf);
fail:
    free(parts);
    return rc;
}

static moert_result subgroup_alltoallv(moert_comm_group *g, int rank, const void *send, const size_t *send_bytes,
                                       const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                       const size_t *recv_offsets)
{
    moert_result rc = check_view_rank(g, rank, "alltoallv");
    if (rc != MOERT_OK) return rc;
    return subgroup_exchange(g, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
}

/* Waits until every rank arrived; fails the whole group if one does not within the timeout. */
moert_result moert_comm_barrier(moert_comm_group *g, int rank, const char *what)
{
    if (g->parent) return moert_comm_barrier(g->parent, g->parent_rank, what);
    if (g->has_table) TABLE_CALL(g, "barrier", g->table.barrier(g->table.user, message, sizeof message));
    if (rank < 0 || rank >= g->world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: rank %d outside the group of %d", what, rank, g->world);
    pthread_mutex_lock(&g->lock);
    if (g->failed) goto failed;
    unsigned long generation = g->generation;
    if (g->present[rank]) { /* two threads calling as one rank: the count would complete with a rank missing */
        char message[256];
        snprintf(message, sizeof message,
                 "%s: rank %d arrived twice (two threads with the same rank: each thread needs its own)", what, rank);
        fail_group_locked(g, MOERT_ERR_INVALID_ARGUMENT, message);
        goto failed;
    }
    g->present[rank] = true;
    g->slots[rank].arrived_in = what;
    g->arrived++;
    if (g->arrived == g->world) {
        /* every rank must be in the same collective: one in another would read slots it never filled */
        for (int r = 0; r < g->world; r++)
            if (strcmp(g->slots[r].arrived_in, what) != 0) {
                char message[512];
                snprintf(message, sizeof message,
                         "rank %d is in %s while rank %d is in %s: every rank must make the same collective calls in "
                         "the same order",
                         r, g->slots[r].arrived_in, rank, what);
                fail_group_locked(g, MOERT_ERR_INVALID_ARGUMENT, message);
                goto failed;
            }
        g->arrived = 0;
        memset(g->present, 0, (size_t)g->world * sizeof *g->present);
        g->generation++;
        pthread_cond_broadcast(&g->cond);
        pthread_mutex_unlock(&g->lock);
        return MOERT_OK;
    }
    struct timespec deadline = deadline_after(g->timeout_s);
    while (g->generation == generation && !g->failed) {
        int wait = pthread_cond_timedwait(&g->cond, &g->lock, &deadline);
        if (wait == ETIMEDOUT && g->generation == generation && !g->failed) {
            char missing[512], message[1024];
            missing_ranks_locked(g, missing, sizeof missing);
            snprintf(message, sizeof message, "%s: %s did not arrive within %.1f s", what, missing, g->timeout_s);
            fail_group_locked(g, MOERT_ERR_TIMEOUT, message);
        }
    }
    if (g->generation != generation) { /* completed, even if the group failed just after */
        pthread_mutex_unlock(&g->lock);
        return MOERT_OK;
    }
failed:;
    char message[1024];
    moert_result code = g->failure_code;
    snprintf(message, sizeof message, "%s", g->failure);
    pthread_mutex_unlock(&g->lock);
    if (strncmp(message, "rank ", 5) == 0) return moert_error(code, "%s: %s", what, message);
    return moert_error(code, "%s", message);
}

/* Refuses a rank outside the group before it touches a slot. */
static moert_result check_rank(const moert_comm_group *g, int rank, const char *what)
{
    if (rank < 0 || rank >= g->world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: rank %d outside the group of %d", what, rank, g->world);
    return MOERT_OK;
}

/* Every rank gets every rank's `bytes` bytes, in rank order. */
moert_result moert_comm_allgather(moert_comm_group *g, int rank, const void *send, void *recv, size_t bytes)
{
    if (g->parent) return subgroup_allgather(g, rank, send, recv, bytes);
    if (g->has_table)
        TABLE_CALL(g, "allgather", g->table.allgather(g->table.user, send, recv, bytes, message, sizeof message));
    moert_result rc;
    MOERT_CHECK(check_rank(g, rank, "allgather"));
    g->slots[rank].send = send;
    MOERT_CHECK(moert_comm_barrier(g, rank, "allgather"));
    for (int r = 0; r < g->world; r++)
        if (bytes) memcpy((char *)recv + (size_t)r * bytes, g->slots[r].send, bytes);
    MOERT_CHECK(moert_comm_barrier(g, rank, "allgather"));
fail:
    return rc;
}

/* Sums element i of every rank's buffer in rank order (so every rank gets the same bits) into out. */
static void sum_in_rank_order(const moert_comm_group *g, size_t count, moert_dtype dtype, void *out)
{
    for (size_t i = 0; i < count; i++) {
        if (dtype == MOERT_I64) {
            int64_t s = 0;
            for (int r = 0; r < g->world; r++) s += ((const int64_t *)g->slots[r].pointer)[i];
            ((int64_t *)out)[i] = s;
        } else if (dtype == MOERT_F64) {
            double s = 0.0;
            for (int r = 0; r < g->world; r++) s += ((const double *)g->slots[r].pointer)[i];
            ((double *)out)[i] = s;
        } else {
            double s = 0.0;
            for (int r = 0; r < g->world; r++) s += ((const float *)g->slots[r].pointer)[i];
            ((float *)out)[i] = (float)s;
        }
    }
}

/* In-place element-wise sum over ranks (fp32, fp64, int64). */
moert_result moert_comm_allreduce_sum(moert_comm_group *g, int rank, void *buf, size_t count, moert_dtype dtype)
{
    if (g->parent) return subgroup_allreduce_sum(g, rank, buf, count, dtype);
    if (g->has_table)
        TABLE_CALL(g, "allreduce_sum",
                   g->table.allreduce_sum(g->table.user, buf, count, dtype, message, sizeof message));
    moert_result rc = MOERT_OK;
    void *sum = NULL;
    MOERT_CHECK(check_rank(g, rank, "allreduce_sum"));
    if (dtype != MOERT_F32 && dtype != MOERT_F64 && dtype != MOERT_I64) {
        /* every rank makes the same call, so every rank fails here alike: the group stays usable */
        return moert_error(MOERT_ERR_UNSUPPORTED, "allreduce_sum: dtype %s, expected fp32, fp64 or int64",
                           moert_dtype_name(dtype));
    }
    size_t bytes = count * moert_dtype_size(dtype);
    sum = malloc(bytes ? bytes : 1);
    if (!sum) {
        moert_comm_abort(g, rank, "allreduce_sum: out of memory");
        return moert_error(MOERT_ERR_OUT_OF_MEMORY, "allreduce_sum: out of memory for %zu bytes", bytes);
    }
    g->slots[rank].pointer = buf;
    MOERT_CHECK(moert_comm_barrier(g, rank, "allreduce_sum"));
    sum_in_rank_order(g, count, dtype, sum);
    MOERT_CHECK(moert_comm_barrier(g, rank, "allreduce_sum"));
    if (bytes) memcpy(buf, sum, bytes);
fail:
    free(sum);
    return rc;
}

/* Each rank copies what every peer sends it; sizes must agree on both sides. */
moert_result moert_comm_alltoallv(moert_comm_group *g, int rank, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets)
{
    if (g->parent) return subgroup_alltoallv(g, rank, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets);
    if (g->has_table)
        TABLE_CALL(g, "alltoallv",
                   g->table.alltoallv(g->table.user, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets,
                                      message, sizeof message));
    moert_result rc = MOERT_OK;
    MOERT_CHECK(check_rank(g, rank, "alltoallv"));
    g->slots[rank].send = send;
    g->slots[rank].send_bytes = send_bytes;
    g->slots[rank].send_offsets = send_offsets;
    MOERT_CHECK(moert_comm_barrier(g, rank, "alltoallv"));
    int bad_peer = -1;
    for (int p = 0; p < g->world; p++) {
        const comm_slot *s = &g->slots[p];
        size_t n = s->send_bytes[rank];
        if (n != recv_bytes[p]) {
            if (bad_peer < 0) bad_peer = p;
            continue;
        }
        if (n) memcpy((char *)recv + recv_offsets[p], (const char *)s->send + s->send_offsets[rank], n);
    }
    size_t sent = bad_peer >= 0 ? g->slots[bad_peer].send_bytes[rank] : 0; /* read before peers may move on */
    MOERT_CHECK(moert_comm_barrier(g, rank, "alltoallv"));
    if (bad_peer >= 0)
        rc = moert_error(MOERT_ERR_INVALID_ARGUMENT, "alltoallv: rank %d sends %zu bytes to rank %d, which expects %zu",
                         bad_peer, sent, rank, recv_bytes[bad_peer]);
fail:
    return rc;
}

/* peers[r] = the pointer rank r offered. */
moert_result moert_comm_exchange_pointers(moert_comm_group *g, int rank, void *local, void **peers)
{
    if (g->parent)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "peer buffers on CPU ranks need an expert-parallel group of every rank; this one "
                           "has %d of the %d ranks ($.parallel.expert_parallel): the NVLink dispatchers (deepep, "
                           "hybridep) run in a smaller group on GPUs only (over its NCCL communicator), use "
                           "\"alltoall\" or \"allgather\" here",
                           g->world, g->parent->world);
    if (g->has_table)
        return moert_error(MOERT_ERR_UNSUPPORTED, "peer buffers need ranks as threads of one process (the threads "
                                                  "communicator) or NCCL; the caller's collectives table offers none");
    moert_result rc;
    MOERT_CHECK(check_rank(g, rank, "exchange_pointers"));
    g->slots[rank].pointer = local;
    MOERT_CHECK(moert_comm_barrier(g, rank, "exchange_pointers"));
    for (int r = 0; r < g->world; r++) peers[r] = g->slots[r].pointer;
    MOERT_CHECK(moert_comm_barrier(g, rank, "exchange_pointers"));
fail:
    return rc;
}
