/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the files of the fp8 plugin's CUDA path share, and nothing else includes (C++; .cu files only):
 *   precision_fp8_cuda.cu   the handle: create/destroy, device buffers, settings, the cuBLASLt handle
 *   fp8_quantize.cu         the host side of quantization: activation operands, the FP8 weight cache
 *   fp8_quant_kernels.cu    the quantization kernels (amax, per-tensor scales, casts, 1x128 rows, transposes)
 *   fp8_weight_kernels.cu   the weights' 128x128 tile scales and both layouts in one read, the delayed recipe's
 *                           step amax and history
 *   fp8_matmul_plans.cu     the cuBLASLt matmuls: descriptors, layouts, cached plans, the lanes they run on
 *   fp8_grouped_gemm.cu     the grouped GEMM of a pass (cuBLASLt or the wgmma kernel), end_step
 *   fp8_block_gemm.cu       moert's wgmma kernel for the blockwise GEMMs (fp8_block_gemm.h)
 * The kernels are launched through the fp8_launch_* functions below (the kernel's name, its launch shape, then its
 * arguments; bf16: the source is bf16, else fp32), so each kernel stays in its own file; launch errors are checked
 * by the caller (LAUNCH_CHECK). Internal functions shared across files are named fp8_cuda_*.
 */
#ifndef MOERT_PRECISION_FP8_CUDA_INTERNAL_H
#define MOERT_PRECISION_FP8_CUDA_INTERNAL_H

#include "precision_fp8_cuda.h"

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "../lib/cublaslt_state.h"
#include "../lib/plugin_cuda_check.h"
#include "fp8_block_gemm.h"

#define TILE        128 /* block edge of the blockwise recipe */
#define CT_COLS     64  /* columns of a cast_transpose_kernel tile (the host counts its tiles) */
#define TABLE_MAX   64  /* matrices per kernel launch (the table goes by value) */
#define PLAN_SLOTS  2048
#define PLAN_PROBES 8
#define MAX_DESCS   16
#define E4M3_MAX    448.0f
#define E5M2_MAX    57344.0f

enum { OP_INPUT = 0, OP_WEIGHT = 1, OP_GRAD = 2 };
enum { SCALE_TENSOR = 0, SCALE_ALONG_ROWS = 1, SCALE_TILE2D = 2 };
/* Blockwise FORWARD/DGRAD operand order. WEIGHT_A: A = weight (BLK128x128), B = activation (VEC128), D as the
 * caller's output. WEIGHT_B: A = activation (VEC128), B = weight (BLK128x128), D = the output transposed (written to
 * a scratch buffer, then transposed back); the only order NVIDIA's sample uses, and cuBLAS 13.0 on H100 refused
 * WEIGHT_A. Chosen once per handle by asking the heuristic (WEIGHT_A first: no transpose). */
enum { BLK_ORDER_UNKNOWN = -1, BLK_ORDER_WEIGHT_A = 0, BLK_ORDER_WEIGHT_B = 1 };
/* Which of an expert matmul's m, n, k is the expert's row count. */
enum { ROW_N = 0, ROW_K = 1, ROW_M = 2 };

/* Integer helpers for sizes. */
static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static inline int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

/* ---- the kernels' matrix table ---- */

/* The matrices one launch works on (by value): matrix i is `rows` rows of the source starting at row src_row0,
 * written at byte dst_off (with leading dimension dst_ld where transposed; for block_rows_kernel dst_ld is the
 * padded row count); its scale factors start at scale_off. */
struct mat_table {
    int32_t count;
    int32_t expert[TABLE_MAX];
    int32_t rows[TABLE_MAX];
    int32_t dst_ld[TABLE_MAX];
    int32_t tile_start[TABLE_MAX + 1]; /* cast_transpose_kernel: first tile of each matrix */
    int64_t src_row0[TABLE_MAX];
    int64_t dst_off[TABLE_MAX];
    int64_t scale_off[TABLE_MAX];
    int64_t row_start[TABLE_MAX + 1]; /* block_rows_kernel: first padded row of each matrix in the launch */
};

/* ---- the handle ---- */

/* A device buffer that grows. */
typedef struct dev_buf {
    void *p;
    size_t cap;
} dev_buf;

/* The FP8 copies of one weight and their scales. */
typedef struct weight_cache {
    const void *source; /* the weight they were made from; NULL: none */
    moert_dtype dtype;
    int64_t k, n;
    int scales_valid, fwd_valid, dgrad_valid;
    dev_buf fwd, dgrad;                     /* [E][N][K] and [E][K][N] bytes */
    dev_buf scale, inv;                     /* per-tensor: [4E] each */
    dev_buf amax;                           /* [E] bits */
    dev_buf tile_scale, inv_fwd, inv_dgrad; /* blockwise */
    int64_t tile_stride, blk_stride;
} weight_cache;

typedef struct plan_key {
    int32_t a_type, b_type, d_type, a_mode, b_mode, beta1, exact, pad;
    int32_t align_a, align_b, align_d, pad2;
    int64_t m, n, k;
} plan_key;

typedef struct plan_entry {
    int valid;
    plan_key key;
    cublasLtMatmulAlgo_t algo;
} plan_entry;

typedef struct desc_entry {
    int32_t a_type, b_type, a_mode, b_mode;
    cublasLtMatmulDesc_t desc;
} desc_entry;

typedef moert_lt_layout layout_state;

struct moert_fp8_cuda {
    const moert_host *host;
    moert_device device;
    moert_fp8_cuda_config cfg;
    int vec_layout, blk_layout;
    int quantize_only;                   /* benchmarks: no matmuls */
    moert_fp8_block_tuning block_tuning; /* how the wgmma kernel runs (moert_fp8_cuda_set_block_tuning) */
    int64_t wgrad_align;                 /* blockwise WGRAD: rows padded to 16 or 128 (0: not asked yet) */
    int64_t worst_rows; /* the current GEMM's most padded rows (capacity + (align - 1) * E); 0: capacity unknown */
    int blk_order;      /* blockwise FORWARD/DGRAD: BLK_ORDER_* (see choose_blk_order) */
    moert_fp8_block_ctx *block; /* blockwise GEMMs on the wgmma kernel (fp8_block_gemm.cu); NULL: cuBLASLt */
    int block_wgrad;            /* with block: the kernel serves every WGRAD (set_block_kernel 1); 0: the
                                   accumulating ones only, those overwriting grad_weight go to cuBLASLt (2) */
    cublasLtHandle_t lt;
    cublasLtMatmulPreference_t pref;
    int32_t pref_align[3];
    desc_entry descs[MAX_DESCS];
    int desc_count;
    layout_state layout[3]; /* A, B, C=D */
    plan_entry *plans;
    moert_fp8_cuda_stats stats;
    int streams;
    dev_buf workspace;
    cudaStream_t lane_stream[MOERT_FP8_CUDA_MAX_STREAMS];
    cudaEvent_t join_event[MOERT_FP8_CUDA_MAX_STREAMS];
    cudaEvent_t fork_event;
    /* activation operands of the current GEMM */
    dev_buf act_a, act_b;                   /* FP8 bytes */
    dev_buf a_scale, a_inv, b_scale, b_inv; /* per-tensor [4E] */
    dev_buf a_blk, b_blk;                   /* blockwise factors */
    dev_buf amax;                           /* [E] bits, current recipe */
    dev_buf dscratch;                       /* BLK_ORDER_WEIGHT_B: the experts' outputs, transposed */
    weight_cache weights[2];
    /* delayed recipe (slots [which][operand][expert]) */
    dev_buf slot_scale, slot_amax, slot_seen, history, next, filled;
    /* the handle whose delayed slots this one uses: itself, or its slot-0 twin's (moert_fp8_cuda_share_delayed) */
    struct moert_fp8_cuda *delayed_owner;
    /* the handle whose FP8 weight copies this one reads while they are of its weight and have the layout it needs:
     * itself, or its slot-0 twin's (moert_fp8_cuda_share_weights) */
    struct moert_fp8_cuda *weight_owner;
    /* host scratch, [E] each */
    int64_t *row0, *rows16, *prow0, *a_off, *b_off, *a_soff, *b_soff;
    int32_t *active; /* non-empty experts */
    int64_t active_count;
    /* what the last GEMM used */
    moert_fp8_cuda_operands last;
};

/* One expert's matmul, column-major: D[m x n] (+)= A^T B with A [k x m] (ld lda), B [k x n] (ld ldb). */
typedef struct expert_mm {
    cudaDataType_t a_type, b_type, d_type;
    int32_t a_mode, b_mode; /* cublasLtMatmulMatrixScale_t */
    int beta1;
    int row_dim;                    /* ROW_N (FORWARD/DGRAD), ROW_K (WGRAD), ROW_M (BLK_ORDER_WEIGHT_B) */
    int64_t m, n, k, lda, ldb, ldd; /* ROW_M: ldd is round_up(m, 16) */
    const void *a, *b;
    void *d;
    const float *a_scale, *b_scale;
    int64_t expert;
    void *copy_to; /* blockwise, weight as A: D went to a padded scratch; its first copy_bytes go here after */
    size_t copy_bytes;
} expert_mm;

/* Which per-tensor scale arrays an activation operand uses. */
typedef struct act_target {
    dev_buf *bytes, *scale, *inv, *blk;
    int64_t *soff; /* host: per-expert float offsets of block factors */
} act_target;

/* ---- small helpers of the recipe ---- */

/* Whether the recipe is blockwise. */
static inline int is_blockwise(const moert_fp8_cuda *g) { return g->cfg.recipe == MOERT_FP8_CUDA_BLOCKWISE; }

/* The format of an operand: E5M2 for grad_output under hybrid, else E4M3 (0 E4M3, 1 E5M2). */
static inline int operand_format(const moert_fp8_cuda *g, int operand) { return g->cfg.hybrid && operand == OP_GRAD; }
/* The largest finite value of a format. */
static inline float format_max(int fmt) { return fmt ? E5M2_MAX : E4M3_MAX; }

/* Slot index of (which, operand, expert 0): slots are [which][operand][expert]. */
static inline int64_t slot_base(const moert_fp8_cuda *g, int which, int operand)
{
    return ((int64_t)which * 3 + operand) * g->cfg.num_experts;
}

/* Whether the blockwise recipe's GEMMs of pass run on the wgmma kernel (else on cuBLASLt); overwrite: a WGRAD that
 * overwrites grad_weight. */
static inline int kernel_serves(const moert_fp8_cuda *g, moert_gemm_pass pass, int overwrite)
{
    return g->block && (pass != MOERT_GEMM_WGRAD || g->block_wgrad || !overwrite);
}

/* cuBLASLt's type of an FP8 format. */
static inline cudaDataType_t fp8_type(int fmt) { return fmt ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3; }

/* ---- precision_fp8_cuda.cu: device buffers ---- */

/* Grows b to at least bytes; slack: a quarter more, so activations whose counts vary do not regrow every step
 * (weights, whose size does not change, take none). */
moert_result fp8_cuda_buf_grow(moert_fp8_cuda *g, dev_buf *b, size_t bytes, int slack);
/* fp8_cuda_buf_grow with slack. */
moert_result fp8_cuda_buf_reserve(moert_fp8_cuda *g, dev_buf *b, size_t bytes);
/* An activation buffer: grown once to the worst case when that is known (worst >= bytes: the caller's row
 * capacity, see moert_fp8_cuda_gemm.capacity), else to bytes with slack. */
moert_result fp8_cuda_buf_reserve_worst(moert_fp8_cuda *g, dev_buf *b, size_t bytes, size_t worst);

/* ---- fp8_quantize.cu: operands and the weight cache ---- */

/* Quantizes an activation operand (input or grad_output, [rows, cols] in gm's act dtype) for the active experts
 * into tg: in its own layout (transposed 0: FORWARD, DGRAD; blockwise rows at their padded offsets prow0) or as
 * [cols][rows16] per expert (WGRAD). */
moert_result fp8_cuda_quantize_activation(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                          const void *src, int64_t cols, int operand, int transposed, act_target *tg);
/* Makes the scales and the asked layouts (fwd, dgrad) of cache c from its source. */
moert_result fp8_cuda_weight_make(moert_fp8_cuda *g, cudaStream_t stream, int which, weight_cache *c, int fwd,
                                  int dgrad);
/* The FP8 copy of gm's weight in the layout its pass needs: kept while the weight pointer and shape stay (until
 * end_step), else made now. */
moert_result fp8_cuda_weight_get(moert_fp8_cuda *g, cudaStream_t stream, const moert_fp8_cuda_gemm *gm,
                                 weight_cache **out);
/* Delayed recipe: the cached weight's amaxes count for the experts of this GEMM. */
moert_result fp8_cuda_note_weight(moert_fp8_cuda *g, cudaStream_t stream, int which, const weight_cache *c);

/* ---- fp8_matmul_plans.cu: cuBLASLt ---- */

/* Blockwise: which operand carries the weight in FORWARD/DGRAD (BLK_ORDER_*), asked once. */
moert_result fp8_cuda_choose_blk_order(moert_fp8_cuda *g, int64_t K, int64_t N, moert_dtype act);
/* WGRAD's row padding: 16, or 128 for a blockwise cuBLASLt without reductions ending inside a 128-block. */
moert_result fp8_cuda_wgrad_row_align(moert_fp8_cuda *g, const moert_fp8_cuda_gemm *gm, int64_t *align);
/* Orders the matmuls by rows, largest first (ties: lower expert first). */
void fp8_cuda_sort_by_rows(expert_mm *mms, int64_t count, const int64_t *counts);
/* Issues the experts' matmuls over the handle's lanes (forked from and joined back into stream). */
moert_result fp8_cuda_run_matmuls(moert_fp8_cuda *g, cudaStream_t stream, expert_mm *mms, int64_t count,
                                  const int64_t *counts);

/* ---- fp8_quant_kernels.cu ---- */

void fp8_launch_amax_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const mat_table &t, const void *src,
                            int64_t cols, uint32_t *amax_bits);
void fp8_launch_scales_kernel(dim3 grid, dim3 block, cudaStream_t stream, int64_t n, const uint32_t *amax_bits,
                              const float *slot_scale, float fp8max, int pow2, float *scale, float *scale_inv);
void fp8_launch_cast_rows_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const mat_table &t,
                                 const void *src, int64_t cols, uint8_t *dst, int fmt, const float *scale,
                                 const float *tile_scale, int64_t tile_stride, int64_t cb, uint32_t *record_amax,
                                 int *record_seen);
void fp8_launch_block_rows_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const mat_table &t,
                                  const void *src, int64_t cols, uint8_t *dst, int fmt, float fp8max, int pow2,
                                  int layout, float *scale_inv);
void fp8_launch_block_rows_wide_kernel(dim3 grid, dim3 block, cudaStream_t stream, const mat_table &t,
                                       const __nv_bfloat16 *src, int64_t cols, uint8_t *dst, int fmt, float fp8max,
                                       int pow2, int layout, float *scale_inv);
void fp8_launch_cast_transpose_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const mat_table &t,
                                      const void *src, int64_t C, uint8_t *dst, int fmt, int mode, const float *scale,
                                      const float *tile_scale, int64_t tile_stride, int64_t cb_count, float fp8max,
                                      int pow2, int layout, float *scale_inv, uint32_t *record_amax, int *record_seen);

/* ---- fp8_weight_kernels.cu ---- */

void fp8_launch_weight_layouts_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const void *w, int64_t K,
                                      int64_t N, const float *scale, float fp8max, int pow2, int layout,
                                      float *tile_scale, int64_t tile_stride, float *inv_fwd, float *inv_dgrad,
                                      int64_t blk_stride, uint8_t *fwd, uint8_t *dgrad);
void fp8_launch_tile_scales_kernel(dim3 grid, dim3 block, cudaStream_t stream, int bf16, const void *w, int64_t K,
                                   int64_t N, float fp8max, int pow2, int layout, float *tile_scale,
                                   int64_t tile_stride, float *inv_fwd, float *inv_dgrad, int64_t blk_stride);
void fp8_launch_note_kernel(dim3 grid, dim3 block, cudaStream_t stream, const mat_table &t, const uint32_t *amax_bits,
                            uint32_t *slot_amax, int *slot_seen);
void fp8_launch_end_step_kernel(dim3 grid, dim3 block, cudaStream_t stream, int64_t slots, int64_t experts, int64_t len,
                                float *history, int32_t *next, int32_t *filled, float *scale, uint32_t *step_amax,
                                int *seen, int most_recent, int margin, int pow2, int hybrid);
void fp8_launch_fill_kernel(dim3 grid, dim3 block, cudaStream_t stream, float *p, int64_t n, float v);

#endif
