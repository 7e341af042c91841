/* SPDX-License-Identifier: Apache-2.0 */
/* The fp8 precision recipes' CPU reference: scales (current, delayed, blockwise), quantization of dense
 * blocks to FP8 and back, and the grouped GEMMs computed in double from the dequantized operands. */
#ifndef MOERT_PRECISION_FP8_CPU_H
#define MOERT_PRECISION_FP8_CPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "../lib/fp8_convert.h"
#include "../lib/grouped_gemm_args.h"
#include "../lib/grouped_gemm_cpu.h"
#include "moert/precision.h"

/* The option "recipe": how scales are chosen. */
typedef enum fp8_recipe {
    FP8_RECIPE_CURRENT = 0,  /* one scale per operand tensor (per expert), from its own amax */
    FP8_RECIPE_DELAYED = 1,  /* one scale per operand tensor (per expert), from the amax history of past steps */
    FP8_RECIPE_BLOCKWISE = 2 /* 1x128 tiles (activations, gradients) and 128x128 tiles (weights), one scale each */
} fp8_recipe;

/* Which operand of a GEMM a block is: the delayed recipe keeps one history per weight x operand x expert. */
typedef enum fp8_operand {
    FP8_OPERAND_INPUT = 0,  /* input (FORWARD, WGRAD) */
    FP8_OPERAND_WEIGHT = 1, /* weight (FORWARD, DGRAD) */
    FP8_OPERAND_GRAD = 2    /* grad_output (DGRAD, WGRAD) */
} fp8_operand;

#define FP8_BLOCK 128 /* tile edge of the blockwise recipe */

/* The options after parsing. */
typedef struct fp8_settings {
    fp8_recipe recipe;
    bool hybrid;              /* format "hybrid": gradients in E5M2; "e4m3": everything E4M3 */
    bool power_of_2;          /* scales truncated to a power of two */
    int64_t amax_history_len; /* delayed */
    bool amax_most_recent;    /* delayed: "most_recent" instead of "max" over the history */
    int64_t margin;           /* delayed: scale = fp8_max * 2^-margin / amax */
} fp8_settings;

/* One delayed-scaling slot: the scale in force and the amax history (a ring of amax_history_len entries). */
typedef struct fp8_amax_slot {
    float scale;      /* used by this step's quantizations; starts at 1 */
    double step_amax; /* the largest amax seen in this step (when seen) */
    bool seen;        /* the slot was used since the last end_step */
    int64_t filled;   /* valid history entries */
    int64_t next;     /* ring position of the next entry */
    double *history;  /* [amax_history_len] */
} fp8_amax_slot;

/* The delayed recipe's state: slots indexed [which][operand][expert]. */
typedef struct fp8_delayed_state {
    int64_t num_experts;
    int64_t history_len;
    fp8_amax_slot *slots;  /* [2 * 3 * num_experts] */
    double *history_store; /* [2 * 3 * num_experts * history_len] */
} fp8_delayed_state;

/* Work buffers reused across calls (grown on demand): the CPU GEMM reference's (plugins/lib/grouped_gemm_cpu.h). */
typedef bf16_scratch fp8_scratch;

/* The shape of one grouped GEMM, checked by the caller (plugins/lib/grouped_gemm_args.h). */
typedef moert_gemm_shape fp8_gemm_shape;

/* The format an operand is quantized to: E4M3, or E5M2 for gradients under "hybrid". */
fp8_format fp8_operand_format(const fp8_settings *s, fp8_operand operand);

/*
 * The fp32 scale that maps amax to fp8_max * 2^-margin: fp8_max / 2^margin / amax in fp32, FLT_MAX where that
 * overflows, truncated to a power of two when asked. `fallback` when amax is 0, negative, inf or NaN.
 */
float fp8_scale_from_amax(double amax, double fp8_max, int64_t margin, bool power_of_2, float fallback);

/*
 * Quantizes the row-major block v[rows x cols] in place, tile by tile (tile_rows x tile_cols, smaller at the
 * edges): a tile's scale is fixed_scale when > 0, else fp8_scale_from_amax(tile amax, fallback 1); each value
 * becomes q = fp8(float(v) * scale) and then q * (1/scale in fp32), the value an FP8 GEMM multiplies.
 * Writes the tile scales (row-major over tiles) to `scales` and the bytes to `bytes` when they are not NULL.
 * Returns the block's amax (largest |v|; NaN if any value is NaN).
 */
double fp8_quantize_block(double *v, int64_t rows, int64_t cols, int64_t tile_rows, int64_t tile_cols,
                          fp8_format format, bool power_of_2, float fixed_scale, float *scales, uint8_t *bytes);

/* Delayed scaling: allocates the slots (scales 1, empty histories); false when out of memory. */
bool fp8_delayed_init(fp8_delayed_state *d, int64_t num_experts, int64_t history_len);
void fp8_delayed_free(fp8_delayed_state *d);
fp8_amax_slot *fp8_delayed_slot(fp8_delayed_state *d, moert_gemm_weight which, fp8_operand operand, int64_t expert);

/* End of a step: each slot used in the step appends its step amax to its history, and its scale becomes
 * fp8_scale_from_amax(max over the history, or the newest entry; margin; old scale as fallback). */
void fp8_delayed_end_step(fp8_delayed_state *d, const fp8_settings *s);

/* Runs args->pass for every expert (WGRAD adds into grad_weight, or overwrites it when args asks, experts with no
 * rows then zeroed: moert_gemm_overwrites_grad). Returns MOERT_ERR_OUT_OF_MEMORY if scratch cannot grow, else MOERT_OK. */
moert_result fp8_cpu_grouped_gemm(const moert_grouped_gemm_args *args, const fp8_gemm_shape *shape,
                                  const fp8_settings *settings, fp8_delayed_state *delayed, fp8_scratch *scratch);

void fp8_scratch_free(fp8_scratch *scratch);

#endif
