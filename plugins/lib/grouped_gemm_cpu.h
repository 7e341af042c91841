/* SPDX-License-Identifier: Apache-2.0 */
/* The bf16 precision recipe's CPU reference: grouped GEMMs emulating a bf16 tensor-core GEMM (or fp32, fp64). */
#ifndef MOERT_PRECISION_BF16_CPU_H
#define MOERT_PRECISION_BF16_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grouped_gemm_args.h"
#include "moert/precision.h"

/* How the GEMMs compute: the option "mode" after "auto" was resolved. */
typedef enum bf16_mode {
    BF16_MODE_BF16 = 0, /* operands rounded to bf16, products accumulated in fp32 */
    BF16_MODE_FP32 = 1, /* operands as fp32, fp32 accumulation */
    BF16_MODE_FP64 = 2  /* everything in fp64 */
} bf16_mode;

/* Work buffers reused across calls (grown on demand); 8-byte elements so both float and double fit. */
typedef struct bf16_scratch {
    double *a, *b, *c;
    size_t a_elems, b_elems, c_elems;
} bf16_scratch;

/* The shape of one grouped GEMM, checked by the caller (plugins/lib/grouped_gemm_args.h). */
typedef moert_gemm_shape bf16_gemm_shape;

/* The mode "auto" resolves to for activations of dtype: bf16 for bf16, fp64 for fp64, fp32 otherwise. */
bf16_mode bf16_mode_for_dtype(moert_dtype dtype);

/* Runs args->pass for every expert. Returns MOERT_ERR_OUT_OF_MEMORY if scratch cannot grow, else MOERT_OK. */
moert_result bf16_cpu_grouped_gemm(const moert_grouped_gemm_args *args, const bf16_gemm_shape *shape, bf16_mode mode,
                                   bf16_scratch *scratch);

/* Grows the three blocks to hold at least a_elems, b_elems and c_elems 8-byte elements; false when out of memory. */
bool bf16_scratch_reserve(bf16_scratch *scratch, size_t a_elems, size_t b_elems, size_t c_elems);
void bf16_scratch_free(bf16_scratch *scratch);

/* Copies rows x cols of a row-major tensor (flat offset `base`) into dst as double, transposed when asked (the CPU
 * references' operand blocks, of this recipe and of fp8's). */
void cpu_load_block_double(const moert_tensor *t, int64_t base, int64_t rows, int64_t cols, bool transpose,
                           double *dst);
/* c[m,n] = a[m,kk] @ b[kk,n] in double, summing over kk in order. */
void cpu_matmul_double(const double *restrict a, const double *restrict b, int64_t m, int64_t kk, int64_t n,
                       double *restrict c);

#endif
