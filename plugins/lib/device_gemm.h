/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A bf16 grouped GEMM kernel that reads the per-expert row counts on the device: no host sync, no allocation,
 * capturable in a CUDA graph. Two engines: tensor cores through mma.sync m16n8k16 (bf16 operands, fp32 accumulation),
 * ldmatrix and a cp.async shared-memory pipeline (every pass, any sm_80+ GPU), and on Hopper a persistent wgmma kernel
 * fed by TMA for FORWARD, DGRAD and WGRAD into an fp32 gradient (device_gemm_wgmma.h).
 *
 * Layouts (row-major, contiguous, rows grouped by expert as in moert/precision.h; expert e owns counts[e]
 * consecutive rows starting after the rows of experts < e; rows past the sum are neither read nor written):
 *   input       bf16 [capacity, k_in]              FORWARD, WGRAD
 *   weight      bf16 [E_local, k_in, n_out]        FORWARD, DGRAD
 *   grad_output bf16 [capacity, n_out]             DGRAD, WGRAD
 *   output      bf16 [capacity, n_out]   FORWARD: out[rows of e]  = in[rows of e] @ W[e]            (overwritten)
 *   grad_input  bf16 [capacity, k_in]    DGRAD:   d_in[rows of e] = d_out[rows of e] @ W[e]^T       (overwritten)
 *   grad_weight fp32 (or bf16) [E_local, k_in, n_out]
 *                                        WGRAD:   dW[e] (+)= in[rows of e]^T @ d_out[rows of e]
 *                                        (overwriting: an expert with no rows gets zeros)
 * The grid is sized on the host for the worst case (capacity rows); every block reads the device counts itself.
 * Counts are used as the kernel finds them: a negative count counts as 0, and rows past `capacity` (counts that sum
 * to more than the buffers hold) are dropped, never read or written.
 */
#ifndef MOERT_PRECISION_BF16_DEVICE_GEMM_H
#define MOERT_PRECISION_BF16_DEVICE_GEMM_H

#include <cuda_runtime.h>
#include <stdint.h>

#include "moert/precision.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most local experts one call takes (the per-expert prefix sums live in shared memory). */
#define BF16_DEVICE_GEMM_MAX_EXPERTS 1024

/* One grouped GEMM. Every pointer is device memory, 16-byte aligned; k_in and n_out are multiples of 8. */
typedef struct bf16_device_gemm_args {
    moert_gemm_pass pass;
    int64_t num_experts;          /* E_local, 1 .. BF16_DEVICE_GEMM_MAX_EXPERTS */
    const int64_t *counts_device; /* [E_local] int64 rows per expert, on the device; never read on the host */
    int64_t capacity;             /* rows of the activation buffers (what the grid is sized for) */
    int64_t k_in, n_out;
    const void *input;       /* FORWARD, WGRAD */
    const void *weight;      /* FORWARD, DGRAD */
    const void *grad_output; /* DGRAD, WGRAD */
    void *output;            /* FORWARD */
    void *grad_input;        /* DGRAD */
    void *grad_weight;       /* WGRAD */
    int grad_weight_bf16;    /* WGRAD: 0 grad_weight is fp32 (the usual master gradients), 1 it is bf16 */
    int accumulate;          /* WGRAD: 1 adds into grad_weight (beta 1), 0 overwrites it (beta 0) */
    int tile_n;              /* mma.sync output tile width: 0 picks (256 where a FORWARD/DGRAD output has >= 1024
                                      columns, else 128; WGRAD 128), or 128 / 256 (tests, benchmarks) */
    int engine;              /* BF16_DEVICE_GEMM_ENGINE_*: which kernel runs FORWARD/DGRAD */
    int max_sms;             /* wgmma engine: CTAs of its persistent grid at most (0: one per SM), so that kernels
                                on another stream (a dispatcher's) find SMs free beside it */
    int wgrad_cluster;  /* wgmma WGRAD ping-pong: CTAs of a cluster sharing operand tiles by TMA multicast, 4 (2 x 2
                                tiles), 2 (n_out tile pairs) or 1, each where the tile counts allow it, else the next
                                smaller (tests, benchmarks); 0: adding 4, overwriting 4 where quads keep as many SMs
                                busy as pairs, else 2, else 1. The cooperative schedule runs single CTAs. */
    int wgrad_schedule; /* BF16_WGMMA_WGRAD_*: the wgmma WGRAD's schedule (tests, benchmarks); 0 picks by the rows an
                           expert has on average */
    const int32_t *sm_yield; /* wgmma FORWARD/DGRAD: a device int32 read between work units (moert_layer_info's
                                sm_yield); while it is N > 0 the CTAs numbered >= grid - N (all but CTA 0) stop taking
                                units, leaving SMs to kernels beside the GEMM. NULL: every CTA works to the end */
    int32_t *work_counter;   /* with sm_yield: two device int32, zero before the first launch, through which the CTAs
                                take units; the kernel leaves them zero. One pair per stream: two GEMMs running at
                                once must not share one */
} bf16_device_gemm_args;

/* The wgmma WGRAD's schedules (device_gemm_wgmma.cu): AUTO the ping-pong below BF16_WGMMA_PINGPONG_ROWS rows an expert
 * on average, else the cooperative one; PINGPONG 128 x 128 tiles, one per consumer warpgroup; COOPERATIVE 128 x 256
 * tiles, both consumer warpgroups on each. */
enum {
    BF16_WGMMA_WGRAD_AUTO = 0,
    BF16_WGMMA_WGRAD_PINGPONG = 1,
    BF16_WGMMA_WGRAD_COOPERATIVE = 2,
};

/* The kernels behind FORWARD, DGRAD and WGRAD into fp32 (WGRAD into a bf16 gradient always runs on mma.sync):
 * AUTO: the wgmma engine (device_gemm_wgmma.h: TMA, wgmma m64n256k16, persistent) where the GPU has it (compute
 * capability 9.0), else mma.sync; MMA: always mma.sync; WGMMA: the wgmma engine or MOERT_ERR_UNSUPPORTED. */
enum {
    BF16_DEVICE_GEMM_ENGINE_AUTO = 0,
    BF16_DEVICE_GEMM_ENGINE_MMA = 1,
    BF16_DEVICE_GEMM_ENGINE_WGMMA = 2,
};

/*
 * Prepares the kernels on the current device (their shared-memory limit). Call once per device before the first
 * bf16_device_gemm, outside any stream capture (e.g. at create time). Errors go to host->set_error (host may be NULL).
 */
moert_result bf16_device_gemm_prepare(const moert_host *host);

/*
 * Checks the arguments (on the host: sizes, pointers, alignment; never the counts) and enqueues the GEMM on stream:
 * one kernel launch (the wgmma WGRAD: two, the GEMM and its L2 demotion), nothing else. Capturable. Errors: MOERT_ERR_INVALID_ARGUMENT with a message naming what was
 * expected, MOERT_ERR_CUDA when the launch fails.
 */
moert_result bf16_device_gemm(const moert_host *host, cudaStream_t stream, const bf16_device_gemm_args *a);

#ifdef __cplusplus
}
#endif
#endif
