/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 conversions written from the formats' definitions: the value is rounded on the format's grid (whose
 * spacing below the smallest normal stays that of the smallest binade, giving the subnormals), then
 * saturated and encoded. The results equal cuda_fp8.h's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, ...). */
#include "fp8_convert.h"

#include <math.h>

/* The constants of one format. */
typedef struct fp8_layout {
    int mantissa_bits;
    int exponent_bias;
    int min_exponent; /* of the smallest normal: 1 - bias */
    double max;
} fp8_layout;

static fp8_layout layout_of(fp8_format format)
{
    if (format == FP8_E4M3) return (fp8_layout){3, 7, -6, FP8_E4M3_MAX};
    return (fp8_layout){2, 15, -14, FP8_E5M2_MAX};
}

double fp8_max(fp8_format format) { return layout_of(format).max; }

const char *fp8_format_name(fp8_format format) { return format == FP8_E4M3 ? "e4m3" : "e5m2"; }

/* Rounds |x| (finite, > 0, in double: exact for any float) to the nearest multiple of the format's ulp at its
 * binade, ties to even; the binade is at least the smallest normal's, so tiny values land on subnormals. */
static double round_to_grid(double magnitude, const fp8_layout *f)
{
    int exponent;
    (void)frexp(magnitude, &exponent); /* magnitude = m * 2^exponent, m in [0.5, 1) */
    int binade = exponent - 1;
    if (binade < f->min_exponent) binade = f->min_exponent;
    const double ulp = ldexp(1.0, binade - f->mantissa_bits);
    /* magnitude / ulp is exact (a power-of-two scaling); nearbyint rounds half to even in the default mode */
    return nearbyint(magnitude / ulp) * ulp;
}

uint8_t fp8_from_float(float x, fp8_format format)
{
    const fp8_layout f = layout_of(format);
    if (isnan(x)) return 0x7f; /* CUDA makes every NaN the canonical positive one */
    const uint8_t sign = signbit(x) ? 0x80 : 0x00;
    double magnitude = fabs((double)x);
    if (magnitude == 0.0) return sign;
    double rounded = isinf(magnitude) ? INFINITY : round_to_grid(magnitude, &f);
    if (rounded > f.max) rounded = f.max; /* satfinite: overflow and inf become the largest finite value */
    if (rounded == 0.0) return sign;      /* at or below half the smallest subnormal */
    int exponent;
    (void)frexp(rounded, &exponent);
    int binade = exponent - 1;
    uint32_t exponent_field, mantissa_field;
    if (binade < f.min_exponent) { /* subnormal: exponent field 0, value = mantissa * 2^(min_exponent - bits) */
        exponent_field = 0;
        mantissa_field = (uint32_t)ldexp(rounded, f.mantissa_bits - f.min_exponent);
    } else {
        exponent_field = (uint32_t)(binade + f.exponent_bias);
        mantissa_field = (uint32_t)(ldexp(rounded, f.mantissa_bits - binade) - ldexp(1.0, f.mantissa_bits));
    }
    return (uint8_t)(sign | (exponent_field << f.mantissa_bits) | mantissa_field);
}

float fp8_to_float(uint8_t bits, fp8_format format)
{
    const fp8_layout f = layout_of(format);
    const int exponent_bits = 7 - f.mantissa_bits;
    const uint32_t mantissa_field = bits & ((1u << f.mantissa_bits) - 1u);
    const uint32_t exponent_field = (bits >> f.mantissa_bits) & ((1u << exponent_bits) - 1u);
    const double sign = (bits & 0x80) ? -1.0 : 1.0;
    if (format == FP8_E4M3 && (bits & 0x7f) == 0x7f) return NAN;
    if (format == FP8_E5M2 && exponent_field == 31) return mantissa_field ? NAN : (float)(sign * INFINITY);
    double value;
    if (exponent_field == 0)
        value = ldexp((double)mantissa_field, f.min_exponent - f.mantissa_bits);
    else
        value = ldexp((double)((1u << f.mantissa_bits) | mantissa_field),
                      (int)exponent_field - f.exponent_bias - f.mantissa_bits);
    return (float)(sign * value);
}
