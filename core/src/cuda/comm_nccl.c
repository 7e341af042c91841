/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL communicator of the expert-parallel group: bootstrap, nonblocking init, bounded waits, collectives
 * and peer-buffer exchange (see comm_nccl.h). */
#include "comm_nccl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cuda_check.h"
#include "device.h"
#include "env.h"
#include "log.h"

#define BOOTSTRAP_MAGIC    0x4d4f4552u /* "MOER" */
#define BOOTSTRAP_PROTOCOL 1u

/* Status codes of the bootstrap reply. */
enum { BOOT_OK = 0, BOOT_WORLD_MISMATCH = 1, BOOT_BAD_RANK = 2, BOOT_DUPLICATE_RANK = 3 };

struct moert_nccl_group {
    int world;
    double timeout_s;
    ncclUniqueId id;
    pthread_mutex_t mutex;
    bool *joined;       /* rank r has called init_thread */
    atomic_int aborted; /* set by the first rank that aborts */
    char abort_reason[512];
};

/* An IPC mapping of a peer's allocation opened in this process. */
typedef struct ipc_mapping {
    int rank;
    cudaIpcMemHandle_t handle;
    void *base;
} ipc_mapping;

struct moert_nccl_comm {
    ncclComm_t comm;
    moert_nccl_mode mode;
    int rank, world, device;
    double timeout_s;
    moert_nccl_group *group; /* thread mode only */
    cudaStream_t internal;   /* barrier and exchange traffic */
    void *scratch;           /* device, scratch_bytes */
    void *staging;           /* pinned host, scratch_bytes */
    size_t scratch_bytes;
    bool aborted;
    moert_result abort_code;
    char abort_reason[512];
    ipc_mapping *mappings;
    int mapping_count, mapping_capacity;
};

/* What each rank publishes in a peer-buffer exchange. */
typedef struct peer_record {
    uint64_t ptr;    /* the buffer as the owner sees it */
    uint64_t offset; /* from the base of its allocation (for IPC) */
    uint64_t bytes;
    int32_t device;
    int32_t pid;
    cudaIpcMemHandle_t handle; /* of the allocation's base; processes mode only */
} peer_record;

/* ---- time ---- */

static double now_seconds(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The pace of a host wait polling the device (a stream, an NCCL call in progress). The host usually waits on work it
 * queued a layer or so ahead, and the device idles from the moment that work ends until the host wakes and queues
 * more. So the first POLL_SPIN_S are polled back to back (yielding the core between queries), as a CUDA stream
 * synchronize spins by default; then the pause grows from 10 us to POLL_PAUSE_MAX_US, and to 1 ms only after
 * POLL_SLOW_AFTER_S, when a peer is late and the timeout matters more than the wake-up. A pause doubling up to 1 ms
 * from the start woke a 2 ms wait up to 1 ms late, and the device idled that long at every host sync. */
#define POLL_SPIN_S       0.005
#define POLL_PAUSE_MAX_US 100L
#define POLL_SLOW_AFTER_S 1.0

typedef struct {
    double start;
    long pause_us;
} poll_pace;

static poll_pace poll_begin(void) { return (poll_pace){now_seconds(), 10}; }

/* Waits before the next poll: a yield while spinning, else a pause that grows by half each time up to its cap. */
static void poll_pause(poll_pace *p)
{
    double waited = now_seconds() - p->start;
    if (waited < POLL_SPIN_S) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, p->pause_us * 1000L};
    nanosleep(&ts, NULL);
    long cap = waited < POLL_SLOW_AFTER_S ? POLL_PAUSE_MAX_US : 1000L;
    p->pause_us += p->pause_us / 2;
    if (p->pause_us > cap) p->pause_us = cap;
}

static double effective_timeout(double timeout_s) { return timeout_s > 0 ? timeout_s : MOERT_NCCL_DEFAULT_TIMEOUT_S; }

/* ---- process-wide NCCL setup ---- */

static pthread_once_t nccl_env_once = PTHREAD_ONCE_INIT;

/* NVLink multicast (NVLS) stays off unless the user set NCCL_NVLS_ENABLE explicitly. This is the library's one
 * setenv, kept on purpose: NCCL reads NVLS_ENABLE from the process environment when it starts and ncclConfig_t has
 * no member that turns multicast off per communicator, so without it NCCL would take NVLS on NVSwitch hosts (its
 * buffers, other collective algorithms) and the GPU paths would change. It only fills an unset variable, before the
 * first communicator, and says so in the log; `moert env` and docs/config.md list it. */
static void set_nccl_environment(void)
{
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    if (!nvls) {
        setenv("NCCL_NVLS_ENABLE", "0", 0);
        moert_log(MOERT_LOG_INFO, "environment: NCCL_NVLS_ENABLE unset, set to 0 (no NVLink multicast)");
    } else if (strcmp(nvls, "0") != 0)
        moert_log(MOERT_LOG_WARN, "NCCL_NVLS_ENABLE=%s was set by the user: NVLink multicast may be used", nvls);
}

/* Prepares the environment and refuses a libnccl too old for nonblocking communicators. */
static moert_result nccl_prepare(void)
{
    pthread_once(&nccl_env_once, set_nccl_environment);
    int v = 0;
    if (ncclGetVersion(&v) != ncclSuccess)
        return moert_error(MOERT_ERR_NCCL,
                           "ncclGetVersion failed: the NCCL library cannot be used (built against %d.%d.%d)",
                           NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    if (v < MOERT_NCCL_MIN_VERSION_CODE)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "NCCL %s found at run time, moert needs 2.18 or newer (built against %d.%d.%d)",
                           moert_nccl_runtime_version(), NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
    return MOERT_OK;
}

/* ---- abort and bounded waits ---- */

/* Aborts c's NCCL communicator (once) and remembers why; later calls fail with the same message. */
static void abort_comm(moert_nccl_comm *c, moert_result code, const char *why)
{
    if (c->aborted) return;
    c->aborted = true;
    c->abort_code = code;
    snprintf(c->abort_reason, sizeof c->abort_reason, "%s", why);
    if (c->comm) {
        (void)ncclCommAbort(c->comm);
        c->comm = NULL;
    }
    if (c->group && atomic_exchange(&c->group->aborted, 1) == 0) {
        pthread_mutex_lock(&c->group->mutex);
        /* bounded so that the rank's prefix always fits */
        snprintf(c->group->abort_reason, sizeof c->group->abort_reason, "rank %d: %.*s", c->rank,
                 (int)sizeof c->group->abort_reason - 24, why);
        pthread_mutex_unlock(&c->group->mutex);
    }
}

/* Fails a call on an aborted communicator, or aborts this one if another rank of the group did. */
static moert_result check_alive(moert_nccl_comm *c, const char *what)
{
    if (c->group && !c->aborted && atomic_load(&c->group->aborted)) {
        char reason[600];
        pthread_mutex_lock(&c->group->mutex);
        snprintf(reason, sizeof reason, "another rank aborted the group (%s)", c->group->abort_reason);
        pthread_mutex_unlock(&c->group->mutex);
        abort_comm(c, MOERT_ERR_TIMEOUT, reason);
    }
    if (c->aborted)
        return moert_error(c->abort_code, "NCCL %s on rank %d of %d: the communicator was aborted: %s", what, c->rank,
                           c->world, c->abort_reason);
    return MOERT_OK;
}

/* Makes a timeout error (and aborts c) for `what` that did not finish within c's timeout. */
static moert_result timeout_error(moert_nccl_comm *c, const char *what)
{
    char why[512];
    snprintf(why, sizeof why,
             "%s did not complete within %.1f s on rank %d of %d (device %d): a peer rank stalled or died", what,
             c->timeout_s, c->rank, c->world, c->device);
    abort_comm(c, MOERT_ERR_TIMEOUT, why);
    return moert_error(MOERT_ERR_TIMEOUT, "NCCL %s; the communicator was aborted (NCCL %s)", why,
                       moert_nccl_runtime_version());
}

/* After an NCCL call on c: an error fails, ncclInProgress is polled until the communicator settles or the
 * timeout passes (then c is aborted). */
static moert_result nccl_settle(moert_nccl_comm *c, ncclResult_t r, const char *call, const char *file, int line)
{
    if (r == ncclSuccess) return MOERT_OK;
    if (r != ncclInProgress) return moert_nccl_fail(call, r, c->comm, file, line);
    double deadline = now_seconds() + c->timeout_s;
    poll_pace pace = poll_begin();
    for (;;) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(c->comm, &state);
        if (q != ncclSuccess) return moert_nccl_fail("ncclCommGetAsyncError", q, c->comm, file, line);
        if (state == ncclSuccess) return MOERT_OK;
        if (state != ncclInProgress) {
            moert_result failed = moert_nccl_fail(call, state, c->comm, file, line);
            abort_comm(c, failed, moert_error_message()); /* an asynchronous error leaves the comm unusable */
            return failed;
        }
        moert_result rc = check_alive(c, call);
        if (rc != MOERT_OK) return rc;
        if (now_seconds() > deadline) return timeout_error(c, call);
        poll_pause(&pace);
    }
}

/* An NCCL call on communicator c, settled (see nccl_settle); on failure jumps to fail with rc set. */
#define NCCL_COMM_CHECK(c, call)                                                                                       \
    do {                                                                                                               \
        rc = nccl_settle((c), (call), #call, __FILE__, __LINE__);                                                      \
        if (rc != MOERT_OK) goto fail;                                                                                 \
    } while (0)

moert_result moert_nccl_stream_wait(moert_nccl_comm *c, moert_stream s, const char *what)
{
    moert_result rc = MOERT_OK;
    double deadline = now_seconds() + c->timeout_s;
    poll_pace pace = poll_begin();
    for (;;) {
        cudaError_t err = cudaStreamQuery((cudaStream_t)s);
        if (err == cudaSuccess) return MOERT_OK;
        if (err != cudaErrorNotReady) MOERT_CUDA_CHECK(err);
        (void)cudaGetLastError();
        if (c->comm) {
            ncclResult_t state = ncclSuccess;
            ncclResult_t q = ncclCommGetAsyncError(c->comm, &state);
            if (q != ncclSuccess) return moert_nccl_fail("ncclCommGetAsyncError", q, c->comm, __FILE__, __LINE__);
            if (state != ncclSuccess && state != ncclInProgress) {
                rc = moert_nccl_fail(what, state, c->comm, __FILE__, __LINE__);
                abort_comm(c, MOERT_ERR_NCCL, moert_error_message());
                return rc;
            }
        }
        MOERT_CHECK(check_alive(c, what));
        if (now_seconds() > deadline) return timeout_error(c, what);
        poll_pause(&pace);
    }
fail:
    return rc;
}

/* ---- communicator creation (both modes) ---- */

/* Allocates c's internal stream and exchange buffers on c->device (current). */
static moert_result create_internal_resources(moert_nccl_comm *c)
{
    moert_result rc = MOERT_OK;
    c->scratch_bytes = (size_t)c->world * sizeof(peer_record);
    if (c->scratch_bytes < 256) c->scratch_bytes = 256;
    MOERT_CUDA_CHECK(cudaStreamCreateWithFlags(&c->internal, cudaStreamNonBlocking));
    MOERT_CUDA_CHECK(cudaMalloc(&c->scratch, c->scratch_bytes));
    MOERT_CUDA_CHECK(cudaMemset(c->scratch, 0, c->scratch_bytes));
    MOERT_CUDA_CHECK(cudaHostAlloc(&c->staging, c->scratch_bytes, cudaHostAllocPortable));
fail:
    return rc;
}

/* Creates rank `rank`'s nonblocking communicator with `id` on the current device and waits for it. */
static moert_result init_nccl_comm(moert_nccl_comm *c, ncclUniqueId id)
{
    moert_result rc = MOERT_OK;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = "moert-expert-parallel";
    const char *what = "ncclCommInitRankConfig";
    ncclResult_t r = ncclCommInitRankConfig(&c->comm, c->world, id, c->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        rc = moert_nccl_fail(what, r, NULL, __FILE__, __LINE__);
        goto fail;
    }
    rc = nccl_settle(c, r, what, __FILE__, __LINE__);
fail:
    if (rc == MOERT_ERR_TIMEOUT)
        moert_error_prefix("a peer did not join");
    else if (rc != MOERT_OK)
        moert_error_prefix("NCCL init of rank %d of %d (device %d)", c->rank, c->world, c->device);
    return rc;
}

/* A new, empty communicator record. */
static moert_result new_comm(int rank, int world, int device, double timeout_s, moert_nccl_mode mode,
                             moert_nccl_comm **out)
{
    moert_result rc = MOERT_OK;
    moert_nccl_comm *c = calloc(1, sizeof *c);
    MOERT_CHECK_ALLOC(c);
    c->rank = rank;
    c->world = world;
    c->device = device;
    c->timeout_s = effective_timeout(timeout_s);
    c->mode = mode;
    *out = c;
fail:
    return rc;
}

/* Checks that `device` is a visible CUDA device. */
static moert_result check_device(int device, const char *origin)
{
    moert_result rc = MOERT_OK;
    int count = 0;
    MOERT_CHECK(moert_cuda_device_count(&count));
    if (device < 0 || device >= count)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "%s: CUDA device %d does not exist (%d visible)", origin, device,
                           count);
fail:
    return rc;
}

/* ---- (a) thread per GPU ---- */

moert_result moert_nccl_group_create(int world, double timeout_s, moert_nccl_group **out)
{
    moert_result rc = MOERT_OK;
    moert_nccl_group *g = NULL;
    *out = NULL;
    if (world < 1)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_nccl_group_create: world size %d, expected >= 1", world);
    MOERT_CHECK(nccl_prepare());
    g = calloc(1, sizeof *g);
    MOERT_CHECK_ALLOC(g);
    g->joined = calloc((size_t)world, sizeof *g->joined);
    MOERT_CHECK_ALLOC(g->joined);
    g->world = world;
    g->timeout_s = effective_timeout(timeout_s);
    pthread_mutex_init(&g->mutex, NULL);
    atomic_init(&g->aborted, 0);
    MOERT_NCCL_CHECK(ncclGetUniqueId(&g->id));
    *out = g;
    return MOERT_OK;
fail:
    if (g) {
        free(g->joined);
        free(g);
    }
    return rc;
}

void moert_nccl_group_free(moert_nccl_group *g)
{
    if (!g) return;
    pthread_mutex_destroy(&g->mutex);
    free(g->joined);
    free(g);
}

moert_result moert_nccl_comm_init_thread(moert_nccl_group *g, int rank, int device, moert_nccl_comm **out)
{
    moert_result rc = MOERT_OK;
    moert_nccl_comm *c = NULL;
    bool marked = false;
    *out = NULL;
    if (rank < 0 || rank >= g->world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "moert_nccl_comm_init_thread: rank %d out of range for a group of %d", rank, g->world);
    MOERT_CHECK(check_device(device, "moert_nccl_comm_init_thread"));
    pthread_mutex_lock(&g->mutex);
    bool already = g->joined[rank];
    g->joined[rank] = true;
    pthread_mutex_unlock(&g->mutex);
    if (already)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "moert_nccl_comm_init_thread: rank %d joined the group twice",
                           rank);
    marked = true;
    MOERT_CHECK(new_comm(rank, g->world, device, g->timeout_s, MOERT_NCCL_THREADS, &c));
    c->group = g;
    MOERT_CUDA_CHECK(cudaSetDevice(device));
    MOERT_CHECK(create_internal_resources(c));
    MOERT_CHECK(init_nccl_comm(c, g->id));
    *out = c;
    return MOERT_OK;
fail:
    if (c) {
        if (!c->aborted) abort_comm(c, rc, moert_error_message()); /* lets the other ranks' waits end now */
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        moert_nccl_comm_free(c);
        moert_error(rc, "%s", saved);
    } else if (marked) {
        atomic_store(&g->aborted, 1);
    }
    return rc;
}

/* ---- (b) process per GPU: environment ---- */

/* Reads environment variable `name` as an integer in [min, max]. */
static moert_result env_int(const char *name, long min, long max, int *out)
{
    const char *text = getenv(name);
    if (!text || !text[0])
        return moert_error(
            MOERT_ERR_CONFIG,
            "environment variable %s is not set (one process per GPU needs RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT, as torchrun sets them)",
            name);
    char *end = NULL;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end != '\0')
        return moert_error(MOERT_ERR_CONFIG, "environment variable %s='%s' is not an integer", name, text);
    if (v < min || v > max)
        return moert_error(MOERT_ERR_CONFIG, "environment variable %s=%ld is out of range [%ld, %ld]", name, v, min,
                           max);
    *out = (int)v;
    return MOERT_OK;
}

moert_result moert_dist_env_read(moert_dist_env *out)
{
    moert_result rc = MOERT_OK;
    memset(out, 0, sizeof *out);
    MOERT_CHECK(env_int("WORLD_SIZE", 1, 1 << 20, &out->world_size));
    MOERT_CHECK(env_int("RANK", 0, 1 << 20, &out->rank));
    if (out->rank >= out->world_size)
        return moert_error(MOERT_ERR_CONFIG, "environment variable RANK=%d is out of range for WORLD_SIZE=%d",
                           out->rank, out->world_size);
    MOERT_CHECK(env_int("LOCAL_RANK", 0, 1 << 20, &out->local_rank));
    const char *addr = getenv("MASTER_ADDR");
    if (!addr || !addr[0])
        return moert_error(MOERT_ERR_CONFIG,
                           "environment variable MASTER_ADDR is not set (one process per GPU needs RANK, WORLD_SIZE, "
                           "LOCAL_RANK, MASTER_ADDR and MASTER_PORT, as torchrun sets them)");
    if (strlen(addr) >= sizeof out->master_addr)
        return moert_error(MOERT_ERR_CONFIG, "environment variable MASTER_ADDR is too long (%zu characters)",
                           strlen(addr));
    snprintf(out->master_addr, sizeof out->master_addr, "%s", addr);
    MOERT_CHECK(env_int("MASTER_PORT", 1, 65535, &out->master_port));
    out->bootstrap_port = out->master_port;
    const char *boot = moert_env_get(MOERT_ENV_BOOTSTRAP_PORT);
    if (boot && boot[0]) MOERT_CHECK(env_int("MOERT_BOOTSTRAP_PORT", 1, 65535, &out->bootstrap_port));
fail:
    return rc;
}

/* ---- (b) process per GPU: TCP bootstrap of the ncclUniqueId ---- */

/* Waits until fd is ready for `events` or the deadline passes; false on timeout or error. */
static bool wait_fd(int fd, short events, double deadline)
{
    for (;;) {
        double left = deadline - now_seconds();
        if (left <= 0) return false;
        struct pollfd p = {fd, events, 0};
        int n = poll(&p, 1, (int)(left * 1000.0) + 1);
        if (n > 0) return true;
        if (n < 0 && errno != EINTR) return false;
    }
}

/* Reads or writes exactly len bytes before the deadline. */
static bool transfer_full(int fd, void *buf, size_t len, bool writing, double deadline)
{
    char *p = buf;
    while (len > 0) {
        if (!wait_fd(fd, writing ? POLLOUT : POLLIN, deadline)) return false;
        ssize_t n = writing ? send(fd, p, len, MSG_NOSIGNAL) : recv(fd, p, len, 0);
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (n <= 0) return false;
        p += n;
        len -= (size_t)n;
    }
    return true;
}

typedef struct boot_hello {
    uint32_t magic, protocol;
    int32_t rank, world;
} boot_hello;

typedef struct boot_reply {
    uint32_t magic;
    int32_t status, world;
    ncclUniqueId id;
} boot_reply;

static void hello_to_wire(boot_hello *h)
{
    h->magic = htonl(h->magic);
    h->protocol = htonl(h->protocol);
    h->rank = (int32_t)htonl((uint32_t)h->rank);
    h->world = (int32_t)htonl((uint32_t)h->world);
}

static void reply_to_wire(boot_reply *r)
{
    r->magic = htonl(r->magic);
    r->status = (int32_t)htonl((uint32_t)r->status);
    r->world = (int32_t)htonl((uint32_t)r->world);
}

/* Rank 0: listens on the bootstrap port and hands `id` to every other rank, until all have come or the
 * deadline passes. */
static moert_result serve_unique_id(const moert_dist_env *env, const ncclUniqueId *id, double deadline)
{
    moert_result rc = MOERT_OK;
    int lfd = -1;
    int served = 0, wanted = env->world_size - 1;
    bool *seen = calloc((size_t)env->world_size, sizeof *seen);
    MOERT_CHECK_ALLOC(seen);
    if (wanted == 0) goto exit;
    lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0) {
        rc = moert_error(MOERT_ERR_IO, "NCCL bootstrap: socket() failed: %s", strerror(errno));
        goto fail;
    }
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)env->bootstrap_port);
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int e = errno;
        rc = moert_error(MOERT_ERR_IO, "NCCL bootstrap: rank 0 cannot listen on port %d: %s%s", env->bootstrap_port,
                         strerror(e),
                         e == EADDRINUSE ? " (under torchrun MASTER_PORT is taken by its own store: set "
                                           "MOERT_BOOTSTRAP_PORT to a free port on every rank)"
                                         : "");
        goto fail;
    }
    if (listen(lfd, env->world_size) != 0) {
        rc = moert_error(MOERT_ERR_IO, "NCCL bootstrap: listen() on port %d failed: %s", env->bootstrap_port,
                         strerror(errno));
        goto fail;
    }
    while (served < wanted) {
        if (!wait_fd(lfd, POLLIN, deadline)) break;
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        boot_hello hello;
        boot_reply reply;
        memset(&reply, 0, sizeof reply);
        if (!transfer_full(fd, &hello, sizeof hello, false, deadline)) {
            close(fd);
            continue;
        }
        if (ntohl(hello.magic) != BOOTSTRAP_MAGIC || ntohl(hello.protocol) != BOOTSTRAP_PROTOCOL) {
            close(fd); /* a stranger on the port */
            continue;
        }
        int rank = (int32_t)ntohl((uint32_t)hello.rank), world = (int32_t)ntohl((uint32_t)hello.world);
        reply.magic = BOOTSTRAP_MAGIC;
        reply.world = env->world_size;
        if (world != env->world_size)
            reply.status = BOOT_WORLD_MISMATCH;
        else if (rank <= 0 || rank >= env->world_size)
            reply.status = BOOT_BAD_RANK;
        else if (seen[rank])
            reply.status = BOOT_DUPLICATE_RANK;
        else
            reply.status = BOOT_OK;
        memcpy(&reply.id, id, sizeof *id);
        int status = reply.status;
        reply_to_wire(&reply);
        bool sent = transfer_full(fd, &reply, sizeof reply, true, deadline);
        close(fd);
        if (sent && status == BOOT_OK) {
            seen[rank] = true;
            served++;
        } else if (status != BOOT_OK) {
            moert_log(MOERT_LOG_WARN, "NCCL bootstrap: refused rank %d with WORLD_SIZE=%d (status %d)", rank, world,
                      status);
        }
    }
    if (served < wanted) {
        char missing[256] = "";
        size_t len = 0;
        for (int r = 1; r < env->world_size && len + 16 < sizeof missing; r++)
            if (!seen[r]) len += (size_t)snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", r);
        rc = moert_error(MOERT_ERR_TIMEOUT,
                         "NCCL bootstrap: rank(s) %s did not fetch the NCCL id from rank 0 (port %d) in time", missing,
                         env->bootstrap_port);
        goto fail;
    }
exit:
fail:
    if (lfd >= 0) close(lfd);
    free(seen);
    return rc;
}

/* Connects to one address before the deadline (nonblocking connect); the socket, or -1 with errno set. */
static int connect_before(const struct addrinfo *ai, double deadline)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) return -1;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        if (errno != EINPROGRESS) goto fail;
        double attempt_deadline = now_seconds() + 2.0;
        if (attempt_deadline > deadline) attempt_deadline = deadline;
        if (!wait_fd(fd, POLLOUT, attempt_deadline)) {
            errno = ETIMEDOUT;
            goto fail;
        }
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err) {
            errno = err;
            goto fail;
        }
    }
    return fd;
fail:;
    int saved = errno;
    close(fd);
    errno = saved;
    return -1;
}

/* Ranks > 0: fetch the id from rank 0, retrying the connection until the deadline. */
static moert_result fetch_unique_id(const moert_dist_env *env, ncclUniqueId *id, double deadline)
{
    moert_result rc = MOERT_OK;
    char port[16];
    snprintf(port, sizeof port, "%d", env->bootstrap_port);
    struct addrinfo hints, *list = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int fd = -1, last_errno = 0;
    const char *last_gai = NULL;
    while (fd < 0 && now_seconds() < deadline) {
        int g = getaddrinfo(env->master_addr, port, &hints, &list);
        if (g != 0) {
            last_gai = gai_strerror(g);
            list = NULL;
        } else {
            last_gai = NULL;
            for (struct addrinfo *ai = list; ai && fd < 0; ai = ai->ai_next) {
                fd = connect_before(ai, deadline);
                if (fd < 0) last_errno = errno;
            }
            freeaddrinfo(list);
            list = NULL;
        }
        if (fd < 0) {
            struct timespec ts = {0, 200 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    if (fd < 0) {
        rc = moert_error(MOERT_ERR_TIMEOUT, "NCCL bootstrap: rank %d could not reach rank 0 at %s:%d in time (%s%s)",
                         env->rank, env->master_addr, env->bootstrap_port,
                         last_gai ? "cannot resolve the address: " : "last error: ",
                         last_gai ? last_gai : (last_errno ? strerror(last_errno) : "none"));
        goto fail;
    }
    boot_hello hello = {BOOTSTRAP_MAGIC, BOOTSTRAP_PROTOCOL, env->rank, env->world_size};
    hello_to_wire(&hello);
    boot_reply reply;
    if (!transfer_full(fd, &hello, sizeof hello, true, deadline) ||
        !transfer_full(fd, &reply, sizeof reply, false, deadline)) {
        rc = moert_error(MOERT_ERR_TIMEOUT, "NCCL bootstrap: rank %d connected to %s:%d but got no NCCL id in time",
                         env->rank, env->master_addr, env->bootstrap_port);
        goto fail;
    }
    reply.magic = ntohl(reply.magic);
    int status = (int32_t)ntohl((uint32_t)reply.status), world = (int32_t)ntohl((uint32_t)reply.world);
    if (reply.magic != BOOTSTRAP_MAGIC) {
        rc = moert_error(MOERT_ERR_IO, "NCCL bootstrap: %s:%d is not a moert rank 0 (bad reply)", env->master_addr,
                         env->bootstrap_port);
        goto fail;
    }
    if (status != BOOT_OK) {
        rc = moert_error(MOERT_ERR_CONFIG, "NCCL bootstrap: rank 0 at %s:%d refused rank %d: %s", env->master_addr,
                         env->bootstrap_port, env->rank,
                         status == BOOT_WORLD_MISMATCH   ? "WORLD_SIZE differs"
                         : status == BOOT_DUPLICATE_RANK ? "another process already has this RANK"
                                                         : "RANK out of range");
        if (status == BOOT_WORLD_MISMATCH)
            moert_error_prefix("WORLD_SIZE=%d here, %d on rank 0", env->world_size, world);
        goto fail;
    }
    memcpy(id, &reply.id, sizeof *id);
fail:
    if (fd >= 0) close(fd);
    return rc;
}

moert_result moert_nccl_unique_id_make(unsigned char *id, size_t bytes)
{
    moert_result rc = MOERT_OK;
    ncclUniqueId uid;
    if (bytes != sizeof uid)
        return moert_error(MOERT_ERR_INTERNAL, "an NCCL unique id is %zu bytes, not %zu", sizeof uid, bytes);
    MOERT_CHECK(nccl_prepare());
    MOERT_NCCL_CHECK(ncclGetUniqueId(&uid));
    memcpy(id, &uid, sizeof uid);
fail:
    return rc;
}

moert_result moert_nccl_comm_init_id(const unsigned char *id, size_t id_bytes, int rank, int world, int device,
                                     double timeout_s, moert_nccl_comm **out)
{
    moert_result rc = MOERT_OK;
    moert_nccl_comm *c = NULL;
    ncclUniqueId uid;
    *out = NULL;
    if (id_bytes != sizeof uid)
        return moert_error(MOERT_ERR_INTERNAL, "an NCCL unique id is %zu bytes, not %zu", sizeof uid, id_bytes);
    if (rank < 0 || rank >= world)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "NCCL: rank %d out of range for a group of %d", rank, world);
    memcpy(&uid, id, sizeof uid);
    MOERT_CHECK(nccl_prepare());
    MOERT_CHECK(check_device(device, "moert_nccl_comm_init_id"));
    MOERT_CHECK(new_comm(rank, world, device, timeout_s, MOERT_NCCL_PROCESSES, &c));
    MOERT_CUDA_CHECK(cudaSetDevice(device));
    MOERT_CHECK(create_internal_resources(c));
    MOERT_CHECK(init_nccl_comm(c, uid));
    *out = c;
    return MOERT_OK;
fail:
    if (c) {
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        abort_comm(c, rc, saved); /* a half-made communicator is not finalized, only aborted */
        moert_nccl_comm_free(c);
        moert_error(rc, "%s", saved);
    }
    return rc;
}

moert_result moert_nccl_comm_init_env(const moert_dist_env *env, int device, double timeout_s, moert_nccl_comm **out)
{
    moert_result rc = MOERT_OK;
    ncclUniqueId id;
    *out = NULL;
    if (device < 0) device = env->local_rank;
    MOERT_CHECK(nccl_prepare());
    {
        int count = 0;
        MOERT_CHECK(moert_cuda_device_count(&count));
        if (device >= count)
            return moert_error(MOERT_ERR_CONFIG, "rank %d: CUDA device %d (LOCAL_RANK=%d) does not exist: %d visible",
                               env->rank, device, env->local_rank, count);
    }
    double deadline = now_seconds() + effective_timeout(timeout_s);
    if (env->rank == 0) {
        MOERT_NCCL_CHECK(ncclGetUniqueId(&id));
        MOERT_CHECK(serve_unique_id(env, &id, deadline));
    } else {
        MOERT_CHECK(fetch_unique_id(env, &id, deadline));
    }
    MOERT_CHECK(moert_nccl_comm_init_id((const unsigned char *)&id, sizeof id, env->rank, env->world_size, device,
                                        timeout_s, out));
fail:
    return rc;
}

/* ---- subgroups ---- */

/* A nonblocking split runs in the background and writes the child's handle when it is done: waits for it (bounded by
 * the parent's timeout; an error of the parent's fails at once). */
static moert_result split_wait(moert_nccl_comm *parent, ncclComm_t *child)
{
    moert_result rc = MOERT_OK;
    double deadline = now_seconds() + parent->timeout_s;
    poll_pace pace = poll_begin();
    while (!__atomic_load_n(child, __ATOMIC_ACQUIRE)) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t q = ncclCommGetAsyncError(parent->comm, &state);
        if (q != ncclSuccess) return moert_nccl_fail("ncclCommGetAsyncError", q, parent->comm, __FILE__, __LINE__);
        if (state != ncclSuccess && state != ncclInProgress) {
            rc = moert_nccl_fail("ncclCommSplit", state, parent->comm, __FILE__, __LINE__);
            abort_comm(parent, rc, moert_error_message());
            return rc;
        }
        MOERT_CHECK(check_alive(parent, "ncclCommSplit"));
        if (now_seconds() > deadline) return timeout_error(parent, "ncclCommSplit");
        poll_pause(&pace);
    }
fail:
    return rc;
}

moert_result moert_nccl_comm_split(moert_nccl_comm *parent, int color, int key, moert_nccl_comm **out)
{
    moert_result rc = MOERT_OK;
    moert_nccl_comm *c = NULL;
    int prev = -1, rank = -1, world = 0;
    bool pending = false; /* the background split may still write the child's handle into c */
    *out = NULL;
    MOERT_CHECK(check_alive(parent, "ncclCommSplit"));
    MOERT_CUDA_CHECK(cudaGetDevice(&prev));
    MOERT_CUDA_CHECK(cudaSetDevice(parent->device));
    MOERT_CHECK(new_comm(0, 1, parent->device, parent->timeout_s, parent->mode, &c));
    c->group = parent->group;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = "moert-expert-group";
    ncclResult_t r = ncclCommSplit(parent->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &c->comm, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        rc = moert_nccl_fail("ncclCommSplit", r, parent->comm, __FILE__, __LINE__);
        goto fail;
    }
    pending = r == ncclInProgress;
    /* the split runs on the parent's side and ends in the child: both settle */
    MOERT_CHECK(nccl_settle(parent, r, "ncclCommSplit", __FILE__, __LINE__));
    if (color < 0) { /* left out (NOCOLOR): no communicator */
        free(c);
        c = NULL;
        goto exit;
    }
    MOERT_CHECK(split_wait(parent, &c->comm));
    pending = false;
    MOERT_CHECK(nccl_settle(c, r, "ncclCommSplit", __FILE__, __LINE__));
    NCCL_COMM_CHECK(c, ncclCommUserRank(c->comm, &rank));
    NCCL_COMM_CHECK(c, ncclCommCount(c->comm, &world));
    c->rank = rank;
    c->world = world;
    MOERT_CHECK(create_internal_resources(c));
    *out = c;
    c = NULL;
exit:
fail:
    if (c && pending) { /* never finished: left allocated, its handle may still arrive */
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        moert_error(rc, "%s", saved);
        moert_error_prefix("splitting NCCL communicator rank %d of %d (color %d)", parent->rank, parent->world, color);
    } else if (c) {
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", moert_error_message());
        if (!c->aborted) abort_comm(c, rc, saved); /* thread mode: the other ranks' waits end now */
        moert_nccl_comm_free(c);
        moert_error(rc, "%s", saved);
        moert_error_prefix("splitting NCCL communicator rank %d of %d (color %d)", parent->rank, parent->world, color);
    }
    if (prev >= 0 && prev != parent->device) (void)cudaSetDevice(prev);
    return rc;
}

/* ---- teardown and accessors ---- */

void moert_nccl_comm_free(moert_nccl_comm *c)
{
    if (!c) return;
    int prev = -1;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(c->device);
    if (c->internal && c->comm) (void)moert_nccl_stream_wait(c, (moert_stream)c->internal, "teardown");
    for (int i = 0; i < c->mapping_count; i++) (void)cudaIpcCloseMemHandle(c->mappings[i].base);
    free(c->mappings);
    if (c->comm) {
        /* Flush and leave politely, bounded: a peer that never finalizes gets this rank aborted. */
        moert_result rc = nccl_settle(c, ncclCommFinalize(c->comm), "ncclCommFinalize", __FILE__, __LINE__);
        if (rc == MOERT_OK && c->comm) {
            (void)ncclCommDestroy(c->comm);
            c->comm = NULL;
        } else if (c->comm) {
            (void)ncclCommAbort(c->comm);
            c->comm = NULL;
        }
    }
    if (c->staging) (void)cudaFreeHost(c->staging);
    if (c->scratch) (void)cudaFree(c->scratch);
    if (c->internal) (void)cudaStreamDestroy(c->internal);
    (void)cudaGetLastError();
    if (prev >= 0 && prev != c->device) (void)cudaSetDevice(prev);
    free(c);
}

int moert_nccl_comm_rank(const moert_nccl_comm *c) { return c->rank; }
int moert_nccl_comm_size(const moert_nccl_comm *c) { return c->world; }
int moert_nccl_comm_device(const moert_nccl_comm *c) { return c->device; }
moert_nccl_mode moert_nccl_comm_mode(const moert_nccl_comm *c) { return c->mode; }

void moert_nccl_comm_abort(moert_nccl_comm *c, const char *why)
{
    abort_comm(c, MOERT_ERR_NCCL, why ? why : "aborted by the caller");
}

/* ---- collectives ---- */

moert_result moert_nccl_allgather(moert_nccl_comm *c, const void *send, void *recv, size_t bytes_per_rank,
                                  moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CHECK(check_alive(c, "allgather"));
    NCCL_COMM_CHECK(c, ncclAllGather(send, recv, bytes_per_rank, ncclUint8, c->comm, (cudaStream_t)s));
fail:
    return rc;
}

/* The NCCL type of a moert dtype for sums; false if NCCL cannot sum it. */
static bool nccl_type_of(moert_dtype dtype, ncclDataType_t *out)
{
    switch (dtype) {
    case MOERT_F32: *out = ncclFloat32; return true;
    case MOERT_F64: *out = ncclFloat64; return true;
    case MOERT_I64: *out = ncclInt64; return true;
    case MOERT_I32: *out = ncclInt32; return true;
    case MOERT_BF16: *out = ncclBfloat16; return true;
    case MOERT_F16: *out = ncclFloat16; return true;
    default: return false;
    }
}

moert_result moert_nccl_allreduce_sum(moert_nccl_comm *c, void *buf, size_t count, moert_dtype dtype, moert_stream s)
{
    moert_result rc = MOERT_OK;
    ncclDataType_t type;
    if (!nccl_type_of(dtype, &type))
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "NCCL allreduce_sum: dtype %s is not supported (fp32, fp64, int64, "
                           "int32, bf16, fp16 are)",
                           moert_dtype_name(dtype));
    MOERT_CHECK(check_alive(c, "allreduce_sum"));
    NCCL_COMM_CHECK(c, ncclAllReduce(buf, buf, count, type, ncclSum, c->comm, (cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_nccl_alltoallv(moert_nccl_comm *c, const void *send, const size_t *send_bytes,
                                  const size_t *send_offsets, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_offsets, moert_stream s)
{
    moert_result rc = MOERT_OK;
    bool in_group = false;
    const char *sendp = send;
    char *recvp = recv;
    if (send_bytes[c->rank] != recv_bytes[c->rank])
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "NCCL alltoallv on rank %d: sends %zu bytes to itself but expects to receive %zu", c->rank,
                           send_bytes[c->rank], recv_bytes[c->rank]);
    MOERT_CHECK(check_alive(c, "alltoallv"));
    if (send_bytes[c->rank] > 0)
        MOERT_CUDA_CHECK(cudaMemcpyAsync(recvp + recv_offsets[c->rank], sendp + send_offsets[c->rank],
                                         send_bytes[c->rank], cudaMemcpyDeviceToDevice, (cudaStream_t)s));
    NCCL_COMM_CHECK(c, ncclGroupStart());
    in_group = true;
    for (int r = 0; r < c->world; r++) {
        if (r == c->rank) continue;
        if (send_bytes[r] > 0)
            NCCL_COMM_CHECK(c,
                            ncclSend(sendp + send_offsets[r], send_bytes[r], ncclUint8, r, c->comm, (cudaStream_t)s));
        if (recv_bytes[r] > 0)
            NCCL_COMM_CHECK(c,
                            ncclRecv(recvp + recv_offsets[r], recv_bytes[r], ncclUint8, r, c->comm, (cudaStream_t)s));
    }
    in_group = false;
    NCCL_COMM_CHECK(c, ncclGroupEnd());
fail:
    if (in_group) (void)ncclGroupEnd();
    return rc;
}

moert_result moert_nccl_barrier(moert_nccl_comm *c, const char *what)
{
    moert_result rc = MOERT_OK;
    char label[160];
    snprintf(label, sizeof label, "barrier (%s)", what ? what : "barrier");
    MOERT_CHECK(check_alive(c, label));
    NCCL_COMM_CHECK(c, ncclAllReduce(c->scratch, c->scratch, 1, ncclFloat32, ncclSum, c->comm, c->internal));
    MOERT_CHECK(moert_nccl_stream_wait(c, (moert_stream)c->internal, label));
fail:
    return rc;
}

/* ---- peer buffers ---- */

typedef int (*address_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);
static address_range_fn address_range;
static pthread_once_t address_range_once = PTHREAD_ONCE_INIT;

/* Finds cuMemGetAddressRange through the runtime (no link against libcuda). */
static void load_address_range(void)
{
    address_range = (address_range_fn)moert_cuda_driver_symbol("cuMemGetAddressRange");
}

/* The base and size of the cudaMalloc allocation that holds ptr (IPC handles name whole allocations). */
static moert_result allocation_of(const void *ptr, char **base, size_t *size)
{
    pthread_once(&address_range_once, load_address_range);
    if (!address_range)
        return moert_error(MOERT_ERR_CUDA, "peer buffers: cuMemGetAddressRange is not available from the driver");
    unsigned long long b = 0;
    int err = address_range(&b, size, (unsigned long long)(uintptr_t)ptr);
    if (err != 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "peer buffers: %p is not device memory from cudaMalloc (cuMemGetAddressRange error %d)", ptr,
                           err);
    *base = (char *)(uintptr_t)b;
    return MOERT_OK;
}

/* The local mapping of rank `rank`'s allocation named by `handle`, opening it on first use. */
static moert_result open_peer_allocation(moert_nccl_comm *c, int rank, const cudaIpcMemHandle_t *handle, char **base)
{
    moert_result rc = MOERT_OK;
    for (int i = 0; i < c->mapping_count; i++) {
        if (c->mappings[i].rank == rank && memcmp(&c->mappings[i].handle, handle, sizeof *handle) == 0) {
            *base = c->mappings[i].base;
            return MOERT_OK;
        }
    }
    if (c->mapping_count == c->mapping_capacity) {
        int cap = c->mapping_capacity ? 2 * c->mapping_capacity : 8;
        ipc_mapping *grown = realloc(c->mappings, (size_t)cap * sizeof *grown);
        MOERT_CHECK_ALLOC(grown);
        c->mappings = grown;
        c->mapping_capacity = cap;
    }
    void *p = NULL;
    MOERT_CUDA_CHECK(cudaIpcOpenMemHandle(&p, *handle, cudaIpcMemLazyEnablePeerAccess));
    c->mappings[c->mapping_count].rank = rank;
    c->mappings[c->mapping_count].handle = *handle;
    c->mappings[c->mapping_count].base = p;
    c->mapping_count++;
    *base = p;
fail:
    return rc;
}

/* Lets this thread's device (c->device) read and write memory of `peer_device`. */
static moert_result enable_peer_access(moert_nccl_comm *c, int peer_device)
{
    moert_result rc = MOERT_OK;
    int can = 0;
    if (peer_device == c->device) return MOERT_OK;
    MOERT_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, c->device, peer_device));
    if (!can)
        return moert_error(MOERT_ERR_UNSUPPORTED,
                           "peer buffers: device %d cannot access device %d directly (no NVLink or PCIe peer path)",
                           c->device, peer_device);
    cudaError_t err = cudaDeviceEnablePeerAccess(peer_device, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();
        err = cudaSuccess;
    }
    MOERT_CUDA_CHECK(err);
fail:
    return rc;
}

moert_result moert_nccl_exchange_peer_buffers(moert_nccl_comm *c, void *local, size_t bytes, void **peers)
{
    moert_result rc = MOERT_OK;
    int prev = -1;
    peer_record mine;
    memset(&mine, 0, sizeof mine);
    MOERT_CHECK(check_alive(c, "exchange_peer_buffers"));
    MOERT_CUDA_CHECK(cudaGetDevice(&prev));
    MOERT_CUDA_CHECK(cudaSetDevice(c->device));

    mine.ptr = (uint64_t)(uintptr_t)local;
    mine.bytes = bytes;
    mine.device = c->device;
    mine.pid = (int32_t)getpid();
    if (c->mode == MOERT_NCCL_PROCESSES && local) {
        char *base = NULL;
        size_t size = 0;
        MOERT_CHECK(allocation_of(local, &base, &size));
        if ((size_t)((char *)local - base) + bytes > size) {
            rc = moert_error(MOERT_ERR_INVALID_ARGUMENT,
                             "peer buffers: %zu bytes at %p run past the end of their allocation (%zu bytes at %p)",
                             bytes, local, size, (void *)base);
            goto fail;
        }
        mine.offset = (uint64_t)((char *)local - base);
        MOERT_CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, base));
    }

    /* allgather of the records through the device scratch buffer, on the internal stream */
    peer_record *host = c->staging;
    char *dev = c->scratch;
    memcpy(&host[c->rank], &mine, sizeof mine);
    MOERT_CUDA_CHECK(cudaMemcpyAsync(dev + (size_t)c->rank * sizeof mine, &host[c->rank], sizeof mine,
                                     cudaMemcpyHostToDevice, c->internal));
    NCCL_COMM_CHECK(
        c, ncclAllGather(dev + (size_t)c->rank * sizeof mine, dev, sizeof mine, ncclUint8, c->comm, c->internal));
    MOERT_CUDA_CHECK(cudaMemcpyAsync(host, dev, (size_t)c->world * sizeof mine, cudaMemcpyDeviceToHost, c->internal));
    MOERT_CHECK(moert_nccl_stream_wait(c, (moert_stream)c->internal, "exchange_peer_buffers"));

    for (int r = 0; r < c->world; r++) {
        const peer_record *rec = &host[r];
        if (r == c->rank || rec->ptr == 0) {
            peers[r] = (r == c->rank) ? local : NULL;
            continue;
        }
        if (c->mode == MOERT_NCCL_THREADS) {
            MOERT_CHECK(enable_peer_access(c, rec->device));
            peers[r] = (void *)(uintptr_t)rec->ptr;
        } else {
            char *base = NULL;
            MOERT_CHECK(open_peer_allocation(c, r, &rec->handle, &base));
            peers[r] = base + rec->offset;
        }
    }
fail:
    if (prev >= 0 && prev != c->device) (void)cudaSetDevice(prev);
    if (rc != MOERT_OK) moert_error_prefix("exchange_peer_buffers on rank %d of %d", c->rank, c->world);
    return rc;
}
