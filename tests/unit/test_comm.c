/* SPDX-License-Identifier: Apache-2.0 */
/* Thread communicator: collectives against hand-computed results, reuse, timeouts naming the rank, abort. */
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "test_util.h"

#define WORLD 4

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Failures counted from rank threads (test_failures is not atomic). */
static pthread_mutex_t failures_lock = PTHREAD_MUTEX_INITIALIZER;
static void rank_fail(int rank, const char *what, const char *detail)
{
    pthread_mutex_lock(&failures_lock);
    fprintf(stderr, "rank %d: %s %s\n", rank, what, detail ? detail : "");
    test_failures++;
    pthread_mutex_unlock(&failures_lock);
}
#define RANK_CHECK(rank, cond)                                                                                         \
    do {                                                                                                               \
        if (!(cond)) rank_fail(rank, "expected", #cond);                                                               \
    } while (0)
#define RANK_OK(rank, call)                                                                                            \
    do {                                                                                                               \
        if ((call) != MOERT_OK) rank_fail(rank, #call, moert_error_message());                                         \
    } while (0)

typedef struct collectives_run {
    moert_comm_group *group;
    int iterations;
    double f64_sum[WORLD][5];
    float f32_sum[WORLD][5];
} collectives_run;

/* A value that differs per rank, element and iteration, with fractions that make summation order visible. */
static double rank_value(int rank, int i, int iter)
{
    return (rank + 1) * 0.1 + i * 1e-7 + iter * 3.3e-3 + 1e8 * (i == 2) * (rank == 0 ? 1 : -1);
}

/* Every collective many times in a row, checked each time. */
static void collectives_rank(int rank, void *user)
{
    collectives_run *run = user;
    moert_comm_group *g = run->group;
    for (int iter = 0; iter < run->iterations; iter++) {
        /* allgather: rank r sends 3 ints r*10+iter+k */
        int32_t send[3], recv[WORLD * 3];
        for (int k = 0; k < 3; k++) send[k] = rank * 10 + iter + k;
        RANK_OK(rank, moert_comm_allgather(g, rank, send, recv, sizeof send));
        for (int r = 0; r < WORLD; r++)
            for (int k = 0; k < 3; k++) RANK_CHECK(rank, recv[r * 3 + k] == r * 10 + iter + k);

        /* allreduce_sum in three dtypes */
        int64_t ints[4];
        double f64[5];
        float f32[5];
        for (int i = 0; i < 4; i++) ints[i] = (int64_t)(rank + 1) * (i + 1) * 1000000007LL + iter;
        for (int i = 0; i < 5; i++) f64[i] = rank_value(rank, i, iter);
        for (int i = 0; i < 5; i++) f32[i] = (float)rank_value(rank, i, iter);
        RANK_OK(rank, moert_comm_allreduce_sum(g, rank, ints, 4, MOERT_I64));
        RANK_OK(rank, moert_comm_allreduce_sum(g, rank, f64, 5, MOERT_F64));
        RANK_OK(rank, moert_comm_allreduce_sum(g, rank, f32, 5, MOERT_F32));
        for (int i = 0; i < 4; i++) RANK_CHECK(rank, ints[i] == (int64_t)10 * (i + 1) * 1000000007LL + WORLD * iter);
        for (int i = 0; i < 5; i++) {
            double expected = 0.0; /* rank order */
            for (int r = 0; r < WORLD; r++) expected += rank_value(r, i, iter);
            RANK_CHECK(rank, f64[i] == expected);
            double expected32 = 0.0;
            for (int r = 0; r < WORLD; r++) expected32 += (float)rank_value(r, i, iter);
            RANK_CHECK(rank, f32[i] == (float)expected32);
        }
        if (iter == run->iterations - 1) {
            memcpy(run->f64_sum[rank], f64, sizeof f64);
            memcpy(run->f32_sum[rank], f32, sizeof f32);
        }

        /* alltoallv: rank s sends (s + d + iter) % 3 bytes, valued s*16+d, to rank d, in destination order */
        uint8_t out[WORLD * 2], in[WORLD * 2];
        size_t send_bytes[WORLD], send_offsets[WORLD], recv_bytes[WORLD], recv_offsets[WORLD];
        size_t off = 0;
        for (int d = 0; d < WORLD; d++) {
            send_bytes[d] = (size_t)((rank + d + iter) % 3);
            send_offsets[d] = off;
            for (size_t b = 0; b < send_bytes[d]; b++) out[off + b] = (uint8_t)(rank * 16 + d);
            off += send_bytes[d];
        }
        off = 0;
        for (int s = 0; s < WORLD; s++) {
            recv_bytes[s] = (size_t)((s + rank + iter) % 3);
            recv_offsets[s] = off;
            off += recv_bytes[s];
        }
        memset(in, 0xff, sizeof in);
        RANK_OK(rank, moert_comm_alltoallv(g, rank, out, send_bytes, send_offsets, in, recv_bytes, recv_offsets));
        for (int s = 0; s < WORLD; s++)
            for (size_t b = 0; b < recv_bytes[s]; b++) RANK_CHECK(rank, in[recv_offsets[s] + b] == s * 16 + rank);
        RANK_CHECK(rank, off == sizeof in || in[off] == 0xff); /* nothing written past the received bytes */

        /* exchange_pointers: each rank offers its own buffer; writes through peers land in the owner's memory */
        int64_t mine[WORLD];
        memset(mine, 0, sizeof mine);
        void *peers[WORLD];
        RANK_OK(rank, moert_comm_exchange_pointers(g, rank, mine, peers));
        for (int r = 0; r < WORLD; r++) ((int64_t *)peers[r])[rank] = rank + 1 + iter;
        RANK_OK(rank, moert_comm_barrier(g, rank, "test"));
        for (int r = 0; r < WORLD; r++) RANK_CHECK(rank, mine[r] == r + 1 + iter);
        RANK_OK(rank, moert_comm_barrier(g, rank, "test")); /* no one writes into `mine` after this */
    }
}

static void test_collectives(void)
{
    collectives_run run = {.iterations = 200};
    EXPECT_OK(moert_comm_group_create(WORLD, 30.0, &run.group));
    EXPECT_EQ_INT(moert_comm_group_size(run.group), WORLD);
    test_run_ranks(WORLD, collectives_rank, &run);
    /* bit-identical sums on every rank */
    for (int r = 1; r < WORLD; r++) {
        EXPECT(memcmp(run.f64_sum[r], run.f64_sum[0], sizeof run.f64_sum[0]) == 0);
        EXPECT(memcmp(run.f32_sum[r], run.f32_sum[0], sizeof run.f32_sum[0]) == 0);
    }
    moert_comm_group_free(run.group);
}

/* A world of one: every collective is a copy. */
static void test_world_of_one(void)
{
    moert_comm_group *g = NULL;
    EXPECT_OK(moert_comm_group_create(1, 1.0, &g));
    int a = 7, b = 0;
    EXPECT_OK(moert_comm_allgather(g, 0, &a, &b, sizeof a));
    EXPECT_EQ_INT(b, 7);
    double d[2] = {1.5, -2};
    EXPECT_OK(moert_comm_allreduce_sum(g, 0, d, 2, MOERT_F64));
    EXPECT(d[0] == 1.5 && d[1] == -2);
    EXPECT_EQ_INT(moert_comm_allreduce_sum(g, 0, d, 2, MOERT_BF16), MOERT_ERR_UNSUPPORTED);
    EXPECT(strcmp(moert_error_message(), "allreduce_sum: dtype bf16, expected fp32, fp64 or int64") == 0);
    EXPECT_OK(moert_comm_barrier(g, 0, "x")); /* still usable after a refused call */
    EXPECT_EQ_INT(moert_comm_barrier(g, 1, "x"), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "x: rank 1 outside the group of 1") == 0);
    EXPECT_EQ_INT(moert_comm_allgather(g, 3, &a, &b, sizeof a), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "allgather: rank 3 outside the group of 1") == 0);
    EXPECT_EQ_INT(moert_comm_alltoallv(g, -1, &a, NULL, NULL, &b, NULL, NULL), MOERT_ERR_INVALID_ARGUMENT);
    moert_comm_group_free(g);
    EXPECT_EQ_INT(moert_comm_group_create(0, 1.0, &g), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_EQ_INT(moert_comm_group_create(2, 0.0, &g), MOERT_ERR_INVALID_ARGUMENT);
}

typedef struct stall_run {
    moert_comm_group *group;
    int stalled; /* this rank never arrives (-1: none) */
    moert_result rc[WORLD];
    char message[WORLD][512];
    double elapsed[WORLD];
} stall_run;

/* Ranks other than the stalled ones call alltoallv; each records what it got and how long it waited. */
static void stall_rank(int rank, void *user)
{
    stall_run *run = user;
    if (rank == run->stalled || (run->stalled == -2 && rank >= 2)) return;
    size_t zeros[WORLD] = {0};
    char buf[1];
    double start = now_s();
    run->rc[rank] = moert_comm_alltoallv(run->group, rank, buf, zeros, zeros, buf, zeros, zeros);
    run->elapsed[rank] = now_s() - start;
    snprintf(run->message[rank], sizeof run->message[rank], "%s", moert_error_message());
}

/* A rank that never arrives: the others fail after the timeout with a message naming it; no hang. */
static void test_timeout(void)
{
    stall_run run = {.stalled = 2};
    /* timeouts of a second: thread start-up on a loaded 2-core CI machine must not look like a stall */
    EXPECT_OK(moert_comm_group_create(WORLD, 1.0, &run.group));
    double start = now_s();
    test_run_ranks(WORLD, stall_rank, &run);
    EXPECT(now_s() - start < 10.0);
    for (int r = 0; r < WORLD; r++) {
        if (r == 2) continue;
        EXPECT_EQ_INT(run.rc[r], MOERT_ERR_TIMEOUT);
        EXPECT(strcmp(run.message[r], "alltoallv: rank 2 did not arrive within 1.0 s") == 0);
        EXPECT(run.elapsed[r] >= 0.95);
    }
    /* the late rank, and any later collective, fails at once with the same message */
    size_t zeros[WORLD] = {0};
    char buf[1];
    double t0 = now_s();
    EXPECT_EQ_INT(moert_comm_alltoallv(run.group, 2, buf, zeros, zeros, buf, zeros, zeros), MOERT_ERR_TIMEOUT);
    EXPECT(strcmp(moert_error_message(), "alltoallv: rank 2 did not arrive within 1.0 s") == 0);
    EXPECT_EQ_INT(moert_comm_barrier(run.group, 0, "barrier"), MOERT_ERR_TIMEOUT);
    EXPECT(now_s() - t0 < 0.2);
    moert_comm_group_free(run.group);

    /* two ranks missing: both named */
    stall_run two = {.stalled = -2};
    EXPECT_OK(moert_comm_group_create(WORLD, 1.0, &two.group));
    test_run_ranks(WORLD, stall_rank, &two);
    EXPECT_EQ_INT(two.rc[0], MOERT_ERR_TIMEOUT);
    EXPECT(strcmp(two.message[0], "alltoallv: ranks 2, 3 did not arrive within 1.0 s") == 0);
    EXPECT(strcmp(two.message[1], "alltoallv: ranks 2, 3 did not arrive within 1.0 s") == 0);
    moert_comm_group_free(two.group);
}

typedef struct abort_run {
    moert_comm_group *group;
    moert_result rc[2];
    char message[2][512];
    double elapsed;
} abort_run;

/* Rank 0 waits in a barrier with a long timeout; rank 1 aborts instead of arriving. */
static void abort_rank(int rank, void *user)
{
    abort_run *run = user;
    if (rank == 1) {
        usleep(50 * 1000);
        moert_comm_abort(run->group, 1, "router forward failed");
        return;
    }
    double start = now_s();
    run->rc[0] = moert_comm_barrier(run->group, 0, "allgather");
    run->elapsed = now_s() - start;
    snprintf(run->message[0], sizeof run->message[0], "%s", moert_error_message());
}

static void test_abort(void)
{
    abort_run run = {0};
    EXPECT_OK(moert_comm_group_create(2, 30.0, &run.group));
    test_run_ranks(2, abort_rank, &run);
    EXPECT_EQ_INT(run.rc[0], MOERT_ERR_TIMEOUT);
    EXPECT(strcmp(run.message[0], "allgather: rank 1 aborted the group: router forward failed") == 0);
    EXPECT(run.elapsed < 5.0);
    /* the first failure is the one every later call reports */
    moert_comm_abort(run.group, 0, "second reason");
    EXPECT_EQ_INT(moert_comm_barrier(run.group, 1, "barrier"), MOERT_ERR_TIMEOUT);
    EXPECT(strcmp(moert_error_message(), "barrier: rank 1 aborted the group: router forward failed") == 0);
    moert_comm_group_free(run.group);
}

typedef struct mismatch_run {
    moert_comm_group *group;
    moert_result rc[2];
    char message[2][512];
    moert_result after[2];
} mismatch_run;

/* Rank 0 sends 4 bytes to rank 1, which expects 2: rank 1 says so; the group stays usable. */
static void mismatch_rank(int rank, void *user)
{
    mismatch_run *run = user;
    char out[8] = {1, 2, 3, 4, 5, 6, 7, 8}, in[8] = {0};
    size_t send_bytes[2] = {0, rank == 0 ? 4 : 0}, offsets[2] = {0, 0};
    size_t recv_bytes[2] = {rank == 1 ? 2 : 0, 0};
    run->rc[rank] = moert_comm_alltoallv(run->group, rank, out, send_bytes, offsets, in, recv_bytes, offsets);
    snprintf(run->message[rank], sizeof run->message[rank], "%s", moert_error_message());
    run->after[rank] = moert_comm_barrier(run->group, rank, "barrier");
}

static void test_mismatch(void)
{
    mismatch_run run = {0};
    EXPECT_OK(moert_comm_group_create(2, 10.0, &run.group));
    test_run_ranks(2, mismatch_rank, &run);
    EXPECT_EQ_INT(run.rc[0], MOERT_OK);
    EXPECT_EQ_INT(run.rc[1], MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(run.message[1], "alltoallv: rank 0 sends 4 bytes to rank 1, which expects 2") == 0);
    EXPECT_EQ_INT(run.after[0], MOERT_OK);
    EXPECT_EQ_INT(run.after[1], MOERT_OK);
    moert_comm_group_free(run.group);
}

typedef struct misuse_run {
    moert_comm_group *group;
    bool same_rank; /* both threads call as rank 0; else rank 0 is in an allgather and rank 1 in a barrier */
    moert_result rc[2];
    char message[2][512];
} misuse_run;

static void misuse_rank(int rank, void *user)
{
    misuse_run *run = user;
    int64_t mine = rank, all[2] = {0, 0};
    if (run->same_rank)
        run->rc[rank] = moert_comm_barrier(run->group, 0, "barrier");
    else if (rank == 0)
        run->rc[rank] = moert_comm_allgather(run->group, 0, &mine, all, sizeof mine);
    else
        run->rc[rank] = moert_comm_barrier(run->group, 1, "barrier");
    snprintf(run->message[rank], sizeof run->message[rank], "%s", moert_error_message());
}

/* Misuse of the threads communicator fails the group with a message, instead of a collective reading a slot that
 * was never filled (it crashed): two threads as one rank, and ranks in different collectives. */
static void test_misuse(void)
{
    misuse_run twice = {.same_rank = true};
    EXPECT_OK(moert_comm_group_create(2, 10.0, &twice.group));
    test_run_ranks(2, misuse_rank, &twice);
    for (int r = 0; r < 2; r++) {
        EXPECT_EQ_INT(twice.rc[r], MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(twice.message[r], "rank 0 arrived twice (two threads with the same rank") != NULL);
    }
    moert_comm_group_free(twice.group);
    misuse_run other = {.same_rank = false};
    EXPECT_OK(moert_comm_group_create(2, 10.0, &other.group));
    test_run_ranks(2, misuse_rank, &other);
    for (int r = 0; r < 2; r++) {
        EXPECT_EQ_INT(other.rc[r], MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(other.message[r], " is in allgather while rank ") != NULL ||
               strstr(other.message[r], " is in barrier while rank ") != NULL);
        EXPECT(strstr(other.message[r], "every rank must make the same collective calls in the same order") != NULL);
    }
    moert_comm_group_free(other.group);
}

/* Timeouts beyond a day are refused (1e19 s wrapped the deadline: the first collective spun for ever). */
static void test_timeout_bounds(void)
{
    moert_comm_group *g = NULL;
    EXPECT(moert_comm_group_create(2, 1e19, &g) == MOERT_ERR_INVALID_ARGUMENT && g == NULL);
    EXPECT(strcmp(moert_error_message(), "comm: timeout 1e+19 s, expected > 0 and <= 86400") == 0);
    EXPECT(moert_comm_group_create(2, 0.0, &g) == MOERT_ERR_INVALID_ARGUMENT && g == NULL);
    EXPECT_OK(moert_comm_group_create(2, 86400.0, &g));
    moert_comm_group_free(g);
}

int main(void)
{
    test_timeout_bounds();
    test_misuse();
    test_collectives();
    test_world_of_one();
    test_timeout();
    test_abort();
    test_mismatch();
    return test_finish("test_comm");
}
