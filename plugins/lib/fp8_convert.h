/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 (E4M3 and E5M2) conversions with the semantics of CUDA's cuda_fp8.h under __NV_SATFINITE: round to
 * nearest even, subnormals kept, finite overflow (and +-inf) saturated to +-max, any NaN to 0x7f. */
#ifndef MOERT_FP8_CONVERT_H
#define MOERT_FP8_CONVERT_H

#include <stdint.h>

typedef enum fp8_format {
    FP8_E4M3 = 0, /* 4 exponent bits (bias 7), 3 mantissa bits; max 448, no inf, NaN 0x7f/0xff */
    FP8_E5M2 = 1  /* 5 exponent bits (bias 15), 2 mantissa bits; max 57344, inf 0x7c/0xfc, NaN 0x7d..0x7f */
} fp8_format;

#define FP8_E4M3_MAX 448.0
#define FP8_E5M2_MAX 57344.0

/* The largest finite value of the format (448 or 57344). */
double fp8_max(fp8_format format);

/* "e4m3" or "e5m2". */
const char *fp8_format_name(fp8_format format);

/* x rounded to the format (nearest, ties to even), saturating to +-max; NaN gives 0x7f. */
uint8_t fp8_from_float(float x, fp8_format format);

/* The exact value of one FP8 byte (NaN for NaN encodings, +-inf for E5M2's inf). */
float fp8_to_float(uint8_t bits, fp8_format format);

#endif
