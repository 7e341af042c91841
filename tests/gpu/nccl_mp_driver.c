/* SPDX-License-Identifier: Apache-2.0 */
/* One rank of the multi-process NCCL test (tests/gpu/test_nccl_multiprocess.sh): joins the group described by
 * RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, then checks against host-computed values an allreduce,
 * writes into every peer's buffer through CUDA IPC mappings, and an uneven alltoallv.
 *   nccl_mp_driver [--timeout S]   run as one rank; exit 0 when every check passed, 1 otherwise; errors on stderr
 *   nccl_mp_driver --count         print the number of usable CUDA devices (0 without a driver)
 *   nccl_mp_driver --free-port     print a TCP port that is free now */
#include <arpa/inet.h>
#include <cuda_runtime_api.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cuda/comm_nccl.h"
#include "cuda/device.h"
#include "cuda/pool.h"
#include "error.h"

static int failures = 0;
static int my_rank = -1;

#define CHECK(cond)                                                                                                    \
    do {                                                                                                               \
        if (!(cond)) {                                                                                                 \
            fprintf(stderr, "rank %d: %s:%d: expected %s\n", my_rank, __FILE__, __LINE__, #cond);                      \
            failures++;                                                                                                \
        }                                                                                                              \
    } while (0)

/* A moert call that must succeed; the run stops at the first failure (later steps depend on it). */
#define MUST(call)                                                                                                     \
    do {                                                                                                               \
        moert_result _r = (call);                                                                                      \
        if (_r != MOERT_OK) {                                                                                          \
            fprintf(stderr, "rank %d: %s failed (%s): %s\n", my_rank, #call, moert_result_name(_r),                    \
                    moert_error_message());                                                                            \
            failures++;                                                                                                \
            goto exit;                                                                                                 \
        }                                                                                                              \
    } while (0)

/* Elements rank `from` sends to rank `to`: uneven, zero for some pairs. */
static size_t a2a_count(int from, int to) { return (size_t)(((from * 7 + to * 3) % 5) * 777 + (from == to ? 3 : 0)); }

static int32_t a2a_value(int from, int to, size_t j) { return (int32_t)(from * 10000000 + to * 100000 + (int)j); }

/* Binds port 0 and prints the port the kernel chose. */
static int print_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof sa;
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 ||
        getsockname(fd, (struct sockaddr *)&sa, &len) != 0) {
        perror("free port");
        return 1;
    }
    printf("%d\n", ntohs(sa.sin_port));
    close(fd);
    return 0;
}

int main(int argc, char **argv)
{
    double timeout_s = 60.0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--count") == 0) {
            int count = 0;
            if (moert_cuda_device_count(&count) != MOERT_OK) {
                fprintf(stderr, "%s\n", moert_error_message());
                return 1;
            }
            printf("%d\n", count);
            return 0;
        }
        if (strcmp(argv[i], "--free-port") == 0) return print_free_port();
        if (strcmp(argv[i], "--timeout") == 0 && i + 1 < argc) timeout_s = atof(argv[++i]);
    }

    moert_dist_env env;
    moert_nccl_comm *c = NULL;
    moert_cuda_pool *pool = NULL;
    moert_stream s = NULL;
    void *d_send = NULL, *d_recv = NULL, *d_big = NULL, *d_src = NULL;
    int32_t *h = NULL;
    if (moert_dist_env_read(&env) != MOERT_OK) {
        fprintf(stderr, "%s\n", moert_error_message());
        return 2;
    }
    my_rank = env.rank;
    int world = env.world_size;
    MUST(moert_nccl_comm_init_env(&env, -1, timeout_s, &c));
    int dev = moert_nccl_comm_device(c);
    CHECK(dev == env.local_rank);
    CHECK(moert_nccl_comm_mode(c) == MOERT_NCCL_PROCESSES);
    MUST(moert_cuda_pool_create(dev, &pool));
    MUST(moert_cuda_stream_create(dev, &s));
    const size_t cap = 64 * 1024; /* int32 elements per buffer */
    MUST(moert_cuda_pool_alloc(pool, cap * sizeof(int32_t), s, &d_send));
    MUST(moert_cuda_pool_alloc(pool, cap * sizeof(int32_t), s, &d_recv));
    MUST(moert_cuda_pool_alloc(pool, cap * sizeof(int32_t), s, &d_src));
    h = calloc(cap, sizeof *h);
    CHECK(h != NULL);
    if (!h) goto exit;

    /* allreduce of int64 */
    int64_t *h64 = (int64_t *)h;
    for (int i = 0; i < 1000; i++) h64[i] = ((int64_t)1 << 35) * (env.rank + 1) + i;
    MUST(moert_cuda_memcpy_async(d_send, h64, 1000 * sizeof(int64_t), s));
    MUST(moert_nccl_allreduce_sum(c, d_send, 1000, MOERT_I64, s));
    MUST(moert_cuda_memcpy_async(h64, d_send, 1000 * sizeof(int64_t), s));
    MUST(moert_nccl_stream_wait(c, s, "allreduce"));
    int bad = 0;
    for (int i = 0; i < 1000; i++) bad += h64[i] != ((int64_t)1 << 35) * world * (world + 1) / 2 + (int64_t)i * world;
    CHECK(bad == 0);

    /* IPC peer buffers: the offered buffer starts 4096 bytes into a larger pool block, so the mapping must add
     * the offset to the peer's allocation base */
    const size_t slot = 512; /* int32 per writer */
    MUST(moert_cuda_pool_alloc(pool, 4096 + slot * world * sizeof(int32_t) + 8192, s, &d_big));
    int32_t *mine = (int32_t *)((char *)d_big + 4096);
    MUST(moert_cuda_memset_async(d_big, 0, 4096 + slot * world * sizeof(int32_t) + 8192, s));
    for (int p = 0; p < world; p++)
        for (size_t k = 0; k < slot; k++) h[p * slot + k] = env.rank * 1000000 + p * 1000 + (int32_t)k;
    MUST(moert_cuda_memcpy_async(d_src, h, slot * world * sizeof(int32_t), s));
    MUST(moert_nccl_stream_wait(c, s, "peer buffer setup"));
    void *peers[64] = {0};
    CHECK(world <= 64);
    if (world > 64) goto exit;
    MUST(moert_nccl_exchange_peer_buffers(c, mine, slot * world * sizeof(int32_t), peers));
    CHECK(peers[env.rank] == mine);
    MUST(moert_nccl_barrier(c, "peer buffers zeroed"));
    for (int p = 0; p < world; p++) {
        CHECK(peers[p] != NULL);
        if (peers[p])
            MUST(moert_cuda_memcpy_async((int32_t *)peers[p] + env.rank * slot, (int32_t *)d_src + p * slot,
                                         slot * sizeof(int32_t), s));
    }
    MUST(moert_nccl_stream_wait(c, s, "peer writes"));
    MUST(moert_nccl_barrier(c, "peer writes done"));
    MUST(moert_cuda_memcpy_async(h, mine, slot * world * sizeof(int32_t), s));
    MUST(moert_nccl_stream_wait(c, s, "peer readback"));
    bad = 0;
    for (int w = 0; w < world; w++)
        for (size_t k = 0; k < slot; k++) bad += h[w * slot + k] != w * 1000000 + env.rank * 1000 + (int32_t)k;
    CHECK(bad == 0);
    /* a second exchange of the same allocation reuses the open mapping */
    void *again[64] = {0};
    MUST(moert_nccl_exchange_peer_buffers(c, mine, slot * world * sizeof(int32_t), again));
    for (int p = 0; p < world; p++) CHECK(again[p] == peers[p]);

    /* alltoallv with uneven splits */
    size_t send_bytes[64], send_off[64], recv_bytes[64], recv_off[64], so = 0, ro = 0;
    for (int p = 0; p < world; p++) {
        send_bytes[p] = a2a_count(env.rank, p) * sizeof(int32_t);
        recv_bytes[p] = a2a_count(p, env.rank) * sizeof(int32_t);
        send_off[p] = so;
        recv_off[p] = ro;
        so += send_bytes[p];
        ro += recv_bytes[p];
    }
    CHECK(so <= cap * sizeof(int32_t) && ro <= cap * sizeof(int32_t));
    if (so > cap * sizeof(int32_t) || ro > cap * sizeof(int32_t)) goto exit;
    for (int p = 0; p < world; p++)
        for (size_t j = 0; j < a2a_count(env.rank, p); j++) h[send_off[p] / 4 + j] = a2a_value(env.rank, p, j);
    MUST(moert_cuda_memcpy_async(d_send, h, so, s));
    MUST(moert_cuda_memset_async(d_recv, 0xff, ro, s));
    MUST(moert_nccl_alltoallv(c, d_send, send_bytes, send_off, d_recv, recv_bytes, recv_off, s));
    MUST(moert_cuda_memcpy_async(h, d_recv, ro, s));
    MUST(moert_nccl_stream_wait(c, s, "alltoallv"));
    bad = 0;
    for (int p = 0; p < world; p++)
        for (size_t j = 0; j < a2a_count(p, env.rank); j++) bad += h[recv_off[p] / 4 + j] != a2a_value(p, env.rank, j);
    CHECK(bad == 0);
    MUST(moert_nccl_barrier(c, "before teardown"));

exit:
    free(h);
    moert_nccl_comm_free(c); /* closes the IPC mappings before the peers free their blocks */
    if (pool) {
        moert_cuda_pool_free(pool, d_send, s);
        moert_cuda_pool_free(pool, d_recv, s);
        moert_cuda_pool_free(pool, d_src, s);
        moert_cuda_pool_free(pool, d_big, s);
        moert_cuda_pool_forget_stream(pool, s);
    }
    moert_cuda_stream_destroy(s);
    moert_cuda_pool_destroy(pool);
    if (failures) {
        fprintf(stderr, "rank %d: %d check(s) failed\n", my_rank, failures);
        return 1;
    }
    printf("rank %d of %d: all checks passed\n", my_rank, world);
    return 0;
}
