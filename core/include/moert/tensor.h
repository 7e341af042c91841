/* SPDX-License-Identifier: Apache-2.0 */
/* moert tensor descriptor: DLPack-shaped view of memory owned by someone else. */
#ifndef MOERT_TENSOR_H
#define MOERT_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Device types use DLPack's codes so a DLTensor converts field by field. */
typedef enum moert_device_type {
    MOERT_DEVICE_CPU = 1,
    MOERT_DEVICE_CUDA = 2,
    MOERT_DEVICE_CUDA_HOST = 3 /* pinned host memory */
} moert_device_type;

typedef struct moert_device {
    int32_t type; /* moert_device_type */
    int32_t id;   /* CUDA ordinal; 0 for the CPU */
} moert_device;

typedef enum moert_dtype {
    MOERT_F32 = 0,
    MOERT_F64 = 1,
    MOERT_BF16 = 2,
    MOERT_F16 = 3,
    MOERT_F8E4M3 = 4,
    MOERT_F8E5M2 = 5,
    MOERT_I32 = 6,
    MOERT_I64 = 7,
    MOERT_DTYPE_COUNT
} moert_dtype;

#define MOERT_MAX_DIMS 4

/* A strided view. Strides are in elements; most plugins require contiguous rows. */
typedef struct moert_tensor {
    void *data;
    moert_device device;
    moert_dtype dtype;
    int32_t ndim;
    int64_t shape[MOERT_MAX_DIMS];
    int64_t strides[MOERT_MAX_DIMS];
} moert_tensor;

static inline moert_device moert_cpu(void)
{
    moert_device d = {MOERT_DEVICE_CPU, 0};
    return d;
}

static inline size_t moert_dtype_size(moert_dtype t)
{
    switch (t) {
    case MOERT_F32:
    case MOERT_I32: return 4;
    case MOERT_F64:
    case MOERT_I64: return 8;
    case MOERT_BF16:
    case MOERT_F16: return 2;
    case MOERT_F8E4M3:
    case MOERT_F8E5M2: return 1;
    default: return 0;
    }
}

static inline const char *moert_dtype_name(moert_dtype t)
{
    static const char *const names[MOERT_DTYPE_COUNT] = {"fp32",     "fp64",     "bf16",  "fp16",
                                                         "fp8_e4m3", "fp8_e5m2", "int32", "int64"};
    return (t >= 0 && t < MOERT_DTYPE_COUNT) ? names[t] : "unknown";
}

/* Elements of t. Multiplied unsigned, so an absurd shape (refused by the size checks) wraps instead of being
 * undefined behaviour. */
static inline int64_t moert_tensor_numel(const moert_tensor *t)
{
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= (uint64_t)t->shape[i];
    return (int64_t)n;
}

static inline size_t moert_tensor_bytes(const moert_tensor *t)
{
    return (size_t)moert_tensor_numel(t) * moert_dtype_size(t->dtype);
}

/* A contiguous row-major view of `data` with up to 4 dimensions (unused ones < 0 are ignored). */
static inline moert_tensor moert_tensor_make(void *data, moert_device dev, moert_dtype dtype, int32_t ndim,
                                             const int64_t *shape)
{
    moert_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.device = dev;
    t.dtype = dtype;
    t.ndim = ndim;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t.shape[i] = shape[i];
        t.strides[i] = stride;
        /* unsigned: an absurd shape wraps (moert_tensor_is_contiguous refuses it) instead of being undefined */
        stride = (int64_t)((uint64_t)stride * (uint64_t)shape[i]);
    }
    return t;
}

static inline moert_tensor moert_tensor_1d(void *data, moert_device dev, moert_dtype dtype, int64_t n0)
{
    int64_t s[1] = {n0};
    return moert_tensor_make(data, dev, dtype, 1, s);
}

static inline moert_tensor moert_tensor_2d(void *data, moert_device dev, moert_dtype dtype, int64_t n0, int64_t n1)
{
    int64_t s[2] = {n0, n1};
    return moert_tensor_make(data, dev, dtype, 2, s);
}

static inline moert_tensor moert_tensor_3d(void *data, moert_device dev, moert_dtype dtype, int64_t n0, int64_t n1,
                                           int64_t n2)
{
    int64_t s[3] = {n0, n1, n2};
    return moert_tensor_make(data, dev, dtype, 3, s);
}

static inline bool moert_tensor_is_contiguous(const moert_tensor *t)
{
    int64_t stride = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != stride) return false;
        if (i > 0 && __builtin_mul_overflow(stride, t->shape[i], &stride)) return false; /* no such layout exists */
    }
    return true;
}

/* ---- scalar conversions (host side; the CPU reference paths use these) ---- */

/* float -> bf16 with round-to-nearest-even; NaN stays NaN. */
static inline uint16_t moert_bf16_from_float(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float moert_bf16_to_float(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* float -> IEEE binary16 with round-to-nearest-even (subnormals, inf and NaN handled). */
static inline uint16_t moert_f16_from_float(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t absu = u & 0x7fffffffu;
    if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (absu < 0x38800000u) {                                   /* below the smallest normal half */
        if (absu < 0x33000000u) return (uint16_t)sign;          /* rounds to zero */
        uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
        int shift = 113 - (int)(absu >> 23) + 13; /* 126 - exp + 13 */
        uint32_t half = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1u))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = absu - 0x38000000u; /* rebias exponent 127 -> 15 */
    uint32_t half = r >> 13;
    uint32_t rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) half++;
    return (uint16_t)(sign | half);
}

static inline float moert_f16_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (mant << 13);
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element i (flat, contiguous) of a host tensor, widened to double. FP8 is read by the precision plugins. */
static inline double moert_load(const moert_tensor *t, int64_t i)
{
    switch (t->dtype) {
    case MOERT_F32: return ((const float *)t->data)[i];
    case MOERT_F64: return ((const double *)t->data)[i];
    case MOERT_BF16: return moert_bf16_to_float(((const uint16_t *)t->data)[i]);
    case MOERT_F16: return moert_f16_to_float(((const uint16_t *)t->data)[i]);
    case MOERT_I32: return ((const int32_t *)t->data)[i];
    case MOERT_I64: return (double)((const int64_t *)t->data)[i];
    default: return 0.0;
    }
}

/* Stores v into element i of a host tensor, rounding to the tensor's dtype. */
static inline void moert_store(moert_tensor *t, int64_t i, double v)
{
    switch (t->dtype) {
    case MOERT_F32: ((float *)t->data)[i] = (float)v; break;
    case MOERT_F64: ((double *)t->data)[i] = v; break;
    case MOERT_BF16: ((uint16_t *)t->data)[i] = moert_bf16_from_float((float)v); break;
    case MOERT_F16: ((uint16_t *)t->data)[i] = moert_f16_from_float((float)v); break;
    case MOERT_I32: ((int32_t *)t->data)[i] = (int32_t)v; break;
    case MOERT_I64: ((int64_t *)t->data)[i] = (int64_t)v; break;
    default: break;
    }
}

#ifdef __cplusplus
}
#endif
#endif
