/* SPDX-License-Identifier: Apache-2.0 */
/* Running a phase of the trainer on every rank this process hosts: a thread per rank (the caller's own thread when it
 * hosts one), the rank's GPU made current, the first failure's message, peers released through moert_comm_fail, and
 * ranks that stall past $.parallel.timeout_s abandoned (docs/config.md). */
#include "ranks.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef MOERT_HAVE_CUDA
#include "cuda_ops.h"
#endif

typedef struct phase_run phase_run;

typedef struct phase_call {
    moert_rank *r;
    rank_phase_fn fn;
    void *arg;
    atomic_int *fail_counter;
    phase_run *run; /* NULL when the caller's thread runs the only rank */
} phase_call;

/* One trainer_run_on_ranks call with rank threads: heap-allocated, so that a rank thread abandoned after a stall (it may
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
    double t = rt->set.timeout_s;
    return t < 1.0 ? 1.0 : t > 5.0 ? 5.0 : t;
}

static void *phase_main(void *p)
{
    phase_call *c = p;
    moert_rank *r = c->r;
    moert_set_last_error(MOERT_OK, "%s", "");
#ifdef MOERT_HAVE_CUDA
    if (r->rt->device_type == MOERT_DEVICE_CUDA) {
        r->rc = trainer_cuda_set_device(r->device);
        if (r->rc == MOERT_OK) r->rc = c->fn(r, c->arg);
    } else {
        r->rc = c->fn(r, c->arg);
    }
#else
    r->rc = c->fn(r, c->arg);
#endif
    if (r->rc != MOERT_OK) {
        r->fail_order = atomic_fetch_add(c->fail_counter, 1);
        snprintf(r->error, sizeof r->error, "%s", moert_last_error());
        /* release peers waiting for this rank in a collective */
        if (r->rt->comm) moert_comm_fail(r->rt->comm, r->rank, r->error);
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
moert_result trainer_run_on_ranks(moert_runtime *rt, rank_phase_fn fn, void *arg)
{
    if (rt->abandoned_ranks > 0)
        return moert_set_last_error(MOERT_ERR_TIMEOUT, "%d rank%s of this runtime stalled and %s abandoned: destroy it",
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
        if (!run) return moert_set_last_error(MOERT_ERR_OUT_OF_MEMORY, "run_on_ranks: out of memory");
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
            if (rt->comm) moert_comm_fail(rt->comm, rt->ranks[started].rank, why);
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
            /* the first rank's failure, where one failed, is the cause (out of memory, say) and gives the code: the
             * others still running are its consequence; with none, the stall itself */
            char first[MOERT_ERROR_MAX + 32] = "";
            moert_result code = MOERT_ERR_TIMEOUT;
            for (int i = 0; i < rt->nlocal; i++)
                if (rt->ranks[i].fail_order == 0 && run->finished[i]) {
                    snprintf(first, sizeof first, "rank %d: %s", rt->ranks[i].rank, rt->ranks[i].error);
                    if (rt->ranks[i].rc != MOERT_OK) code = rt->ranks[i].rc;
                }
            return moert_set_last_error(code, "%s%s%s %s still running %.1f s later and abandoned (stalled)",
                                        first[0] ? first : why, first[0] || why[0] ? "; " : "",
                                        left == 1 ? "rank" : "ranks", stalled, stall_grace_s(rt));
        }
        pthread_cond_destroy(&run->cond);
        pthread_mutex_destroy(&run->lock);
        free(run);
        if (why[0]) return moert_set_last_error(MOERT_ERR_INTERNAL, "%s", why);
    }
    for (int i = 0; i < rt->nlocal; i++)
        if (rt->ranks[i].fail_order == 0) {
            /* a config error reads the same on every rank: no rank prefix */
            if (rt->world == 1 || rt->ranks[i].rc == MOERT_ERR_CONFIG ||
                strncmp(rt->ranks[i].error, "config error", 12) == 0)
                return moert_set_last_error(rt->ranks[i].rc, "%s", rt->ranks[i].error);
            return moert_set_last_error(rt->ranks[i].rc, "rank %d: %s", rt->ranks[i].rank, rt->ranks[i].error);
        }
    return MOERT_OK;
}
