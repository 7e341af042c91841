/* SPDX-License-Identifier: Apache-2.0 */
/*
 * How the blockwise FP8 wgmma kernel (fp8_block_gemm.cu) runs: the fp8 plugin's "block_*" options, read per instance
 * by precision_fp8.c and handed to the kernel's context. A plain C header with no CUDA types, so the CPU-only build
 * reads and checks the same options (they change nothing there).
 */
#ifndef MOERT_FP8_BLOCK_TUNING_H
#define MOERT_FP8_BLOCK_TUNING_H

typedef struct moert_fp8_block_tuning {
    int tile_n;    /* the forward form's output tile with bf16 D: 128 or 256 columns ("block_tile_n", 256) */
    int stages;    /* at most this many stages in the operand ring, >= 2; 0: as many as fit ("block_stages", 0) */
    int pairs;     /* forward form main loop: 0 one k-block at a time, 1 pairs, 2 pairs with the second warpgroup
                      one block out of step ("block_pairs", 2) */
    int pair_rows; /* wide tiles in CTA pairs: 1 pairs of row blocks share B, 0 pairs of column blocks share A
                      ("block_pair_rows", true) */
    int cluster;   /* 2: CTA pairs sharing a tile by TMA multicast; 1: single CTAs; 0: 2 where a pair fits on the
                      GPU, else 1 ("block_cluster", 0) */
    int clusters;  /* at most this many resident clusters (CTAs when cluster is 1); 0: as many as fit
                      ("block_clusters", 0) */
} moert_fp8_block_tuning;

/* The defaults above: what a context runs when nobody tunes it. */
static inline moert_fp8_block_tuning moert_fp8_block_tuning_default(void)
{
    moert_fp8_block_tuning t = {256, 0, 2, 1, 0, 0};
    return t;
}

#endif
