/* SPDX-License-Identifier: Apache-2.0 */
/* CPU implementations of the executor's element-wise work (the reference; CUDA kernels follow them). */
#include "tensor_ops.h"

#include <math.h>

#include "error.h"
#include "random.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#include "cuda/kernels.h"
#endif

static moert_result require_cpu(const moert_tensor *t, const char *what)
{
    if (t->device.type != MOERT_DEVICE_CPU && t->device.type != MOERT_DEVICE_CUDA_HOST)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s: tensor on device type %d; this build runs it on the CPU only",
                           what, (int)t->device.type);
    return MOERT_OK;
}

#ifdef MOERT_HAVE_CUDA
static bool on_cuda(const moert_tensor *t) { return t->device.type == MOERT_DEVICE_CUDA; }

/* The CUDA kernels take fp32 routing probs and fp32 optimizer state. */
static moert_result require_f32(const moert_tensor *t, const char *what)
{
    if (t->dtype != MOERT_F32)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s on CUDA: %s tensor given, the kernels take fp32", what,
                           moert_dtype_name(t->dtype));
    return MOERT_OK;
}
#endif

static double silu(double a) { return a / (1.0 + exp(-a)); }

moert_result moert_swiglu_forward(moert_stream s, const moert_tensor *in, const moert_tensor *prob, int64_t rows,
                                  moert_tensor *out)
{
    int64_t f = out->shape[1];
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(in)) {
        moert_result rc = require_f32(prob, "swiglu_forward");
        if (rc != MOERT_OK) return rc;
        return moert_cuda_swiglu_forward(s, in->dtype, rows, f, in->data, prob->data, out->data);
    }
#endif
    moert_result rc = require_cpu(in, "swiglu_forward");
    if (rc != MOERT_OK) return rc;
    if (in->shape[1] != 2 * f)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT, "swiglu_forward: input has %lld columns, expected 2*%lld",
                           (long long)in->shape[1], (long long)f);
    for (int64_t r = 0; r < rows; r++) {
        double p = moert_load(prob, r);
        for (int64_t j = 0; j < f; j++) {
            double a = moert_load(in, r * 2 * f + j), g = moert_load(in, r * 2 * f + f + j);
            moert_store(out, r * f + j, silu(a) * g * p);
        }
    }
    return MOERT_OK;
}

moert_result moert_swiglu_backward(moert_stream s, const moert_tensor *d_out, const moert_tensor *in,
                                   const moert_tensor *prob, int64_t rows, moert_tensor *d_in, moert_tensor *d_prob)
{
    int64_t f = d_out->shape[1];
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(in)) {
        moert_result rc = require_f32(prob, "swiglu_backward");
        if (rc == MOERT_OK) rc = require_f32(d_prob, "swiglu_backward");
        if (rc != MOERT_OK) return rc;
        return moert_cuda_swiglu_backward(s, in->dtype, rows, f, in->data, prob->data, d_out->data, d_in->data,
                                          d_prob->data);
    }
#endif
    moert_result rc = require_cpu(in, "swiglu_backward");
    if (rc != MOERT_OK) return rc;
    for (int64_t r = 0; r < rows; r++) {
        double p = moert_load(prob, r), dp = 0.0;
        for (int64_t j = 0; j < f; j++) {
            double a = moert_load(in, r * 2 * f + j), g = moert_load(in, r * 2 * f + f + j);
            double dy = moert_load(d_out, r * f + j);
            double sig = 1.0 / (1.0 + exp(-a));
            double sa = a * sig;
            dp += dy * sa * g;
            double dsilu = sig * (1.0 + a * (1.0 - sig));
            moert_store(d_in, r * 2 * f + j, dy * p * g * dsilu);
            moert_store(d_in, r * 2 * f + f + j, dy * p * sa);
        }
        moert_store(d_prob, r, dp);
    }
    return MOERT_OK;
}

moert_result moert_add(moert_stream s, const moert_tensor *a, const moert_tensor *b, moert_tensor *y)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(y)) {
        int64_t n = moert_tensor_numel(y);
        moert_result rc = MOERT_OK;
        if (y->data != a->data) rc = moert_copy(s, a, y);
        if (rc == MOERT_OK) rc = moert_cuda_axpy(s, n, 1.0, b->dtype, b->data, y->dtype, y->data);
        return rc;
    }
#endif
    moert_result rc = require_cpu(y, "add");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(y);
    for (int64_t i = 0; i < n; i++) moert_store(y, i, moert_load(a, i) + moert_load(b, i));
    return MOERT_OK;
}

moert_result moert_copy(moert_stream s, const moert_tensor *src, moert_tensor *dst)
{
    int64_t n = moert_tensor_numel(dst);
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(dst)) {
        if (src->dtype == dst->dtype) return moert_cuda_memcpy_async(dst->data, src->data, moert_tensor_bytes(dst), s);
        return moert_cuda_convert(s, n, src->dtype, src->data, dst->dtype, dst->data);
    }
#endif
    moert_result rc = require_cpu(dst, "copy");
    if (rc != MOERT_OK) return rc;
    if (src->dtype == dst->dtype) {
        memmove(dst->data, src->data, (size_t)n * moert_dtype_size(dst->dtype));
        return MOERT_OK;
    }
    for (int64_t i = 0; i < n; i++) moert_store(dst, i, moert_load(src, i));
    return MOERT_OK;
}

moert_result moert_zero(moert_stream s, moert_tensor *t)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(t)) return moert_cuda_memset_async(t->data, 0, moert_tensor_bytes(t), s);
#endif
    moert_result rc = require_cpu(t, "zero");
    if (rc != MOERT_OK) return rc;
    memset(t->data, 0, moert_tensor_bytes(t));
    return MOERT_OK;
}

moert_result moert_fill(moert_stream s, moert_tensor *t, double value)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(t)) return moert_cuda_fill(s, t->dtype, moert_tensor_numel(t), value, t->data);
#endif
    moert_result rc = require_cpu(t, "fill");
    if (rc != MOERT_OK) return rc;
    for (int64_t i = 0; i < moert_tensor_numel(t); i++) moert_store(t, i, value);
    return MOERT_OK;
}

moert_result moert_gate_forward(moert_stream s, const moert_tensor *x, const moert_tensor *gate, moert_tensor *prob)
{
    const int64_t t = x->shape[0], h = x->shape[1];
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(x)) {
        moert_result rc = require_f32(prob, "gate_forward");
        if (rc == MOERT_OK) rc = require_f32(gate, "gate_forward");
        if (rc != MOERT_OK) return rc;
        return moert_cuda_gate_forward(s, x->dtype, t, h, x->data, gate->data, prob->data);
    }
#endif
    moert_result rc = require_cpu(x, "gate_forward");
    if (rc != MOERT_OK) return rc;
    for (int64_t r = 0; r < t; r++) {
        double acc = 0.0;
        for (int64_t j = 0; j < h; j++) acc += moert_load(x, r * h + j) * moert_load(gate, j);
        moert_store(prob, r, 1.0 / (1.0 + exp(-acc)));
    }
    return MOERT_OK;
}

moert_result moert_gate_backward(moert_stream s, const moert_tensor *x, const moert_tensor *gate,
                                 const moert_tensor *prob, const moert_tensor *d_prob, moert_tensor *d_x,
                                 moert_tensor *d_gate)
{
    const int64_t t = x->shape[0], h = x->shape[1];
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(x)) {
        moert_result rc = require_f32(prob, "gate_backward");
        if (rc == MOERT_OK) rc = require_f32(d_gate, "gate_backward");
        if (rc != MOERT_OK) return rc;
        return moert_cuda_gate_backward(s, x->dtype, t, h, x->data, gate->data, prob->data, d_prob->data, d_x->data,
                                        d_gate->data);
    }
#endif
    moert_result rc = require_cpu(x, "gate_backward");
    if (rc != MOERT_OK) return rc;
    for (int64_t r = 0; r < t; r++) {
        const double p = moert_load(prob, r), d_logit = moert_load(d_prob, r) * p * (1.0 - p);
        for (int64_t j = 0; j < h; j++) {
            moert_store(d_x, r * h + j, moert_load(d_x, r * h + j) + d_logit * moert_load(gate, j));
            moert_store(d_gate, j, moert_load(d_gate, j) + d_logit * moert_load(x, r * h + j));
        }
    }
    return MOERT_OK;
}

MOERT_API double moert_random_normal(uint64_t seed, uint64_t stream, uint64_t index)
{
    return moert_normal_at(seed, stream, index);
}

/* Fills a host tensor with std * N(0,1), element i taking index first_index + i. */
static void fill_normal_host(moert_tensor *t, uint64_t seed, uint64_t stream, uint64_t first_index, double std)
{
    int64_t n = moert_tensor_numel(t);
    for (int64_t i = 0; i < n; i++) moert_store(t, i, std * moert_normal_at(seed, stream, first_index + (uint64_t)i));
}

moert_result moert_fill_normal_on(moert_stream s, moert_tensor *t, uint64_t seed, uint64_t stream, uint64_t first,
                                  double std)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(t))
        return moert_cuda_fill_normal(s, t->dtype, moert_tensor_numel(t), seed, stream, first, std, t->data);
#endif
    moert_result rc = require_cpu(t, "fill_normal");
    if (rc != MOERT_OK) return rc;
    fill_normal_host(t, seed, stream, first, std);
    return MOERT_OK;
}
