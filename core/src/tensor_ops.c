/* CPU implementations of the executor's element-wise work (the reference; CUDA kernels follow them). */
#include "tensor_ops.h"

#include <math.h>

#include "error.h"

static moert_result require_cpu(const moert_tensor *t, const char *what)
{
    if (t->device.type != MOERT_DEVICE_CPU && t->device.type != MOERT_DEVICE_CUDA_HOST)
        return moert_error(MOERT_ERR_UNSUPPORTED, "%s: tensor on device type %d; this build runs it on the CPU only",
                           what, (int)t->device.type);
    return MOERT_OK;
}

static double silu(double a) { return a / (1.0 + exp(-a)); }

moert_result moert_swiglu_forward(moert_stream s, const moert_tensor *in, const moert_tensor *prob, int64_t rows,
                                  moert_tensor *out)
{
    (void)s;
    moert_result rc = require_cpu(in, "swiglu_forward");
    if (rc != MOERT_OK) return rc;
    int64_t f = out->shape[1];
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
                                   const moert_tensor *prob, int64_t rows, moert_tensor *d_in,
                                   moert_tensor *d_prob)
{
    (void)s;
    moert_result rc = require_cpu(in, "swiglu_backward");
    if (rc != MOERT_OK) return rc;
    int64_t f = d_out->shape[1];
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
    (void)s;
    moert_result rc = require_cpu(y, "add");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(y);
    for (int64_t i = 0; i < n; i++) moert_store(y, i, moert_load(a, i) + moert_load(b, i));
    return MOERT_OK;
}

moert_result moert_copy(moert_stream s, const moert_tensor *src, moert_tensor *dst)
{
    (void)s;
    moert_result rc = require_cpu(dst, "copy");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(dst);
    if (src->dtype == dst->dtype) {
        memmove(dst->data, src->data, (size_t)n * moert_dtype_size(dst->dtype));
        return MOERT_OK;
    }
    for (int64_t i = 0; i < n; i++) moert_store(dst, i, moert_load(src, i));
    return MOERT_OK;
}

moert_result moert_zero(moert_stream s, moert_tensor *t)
{
    (void)s;
    moert_result rc = require_cpu(t, "zero");
    if (rc != MOERT_OK) return rc;
    memset(t->data, 0, moert_tensor_bytes(t));
    return MOERT_OK;
}

moert_result moert_squared_error(moert_stream s, const moert_tensor *pred, const moert_tensor *target, double scale,
                                 double *sum, moert_tensor *grad)
{
    (void)s;
    moert_result rc = require_cpu(pred, "squared_error");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(pred);
    double acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = moert_load(pred, i) - moert_load(target, i);
        acc += d * d;
        if (grad) moert_store(grad, i, scale * 2.0 * d);
    }
    *sum = acc;
    return MOERT_OK;
}

moert_result moert_adam_update(moert_stream s, const moert_adam *opt, moert_tensor *param, const moert_tensor *grad,
                               moert_tensor *m, moert_tensor *v)
{
    (void)s;
    moert_result rc = require_cpu(param, "adam_update");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(param);
    double c1 = 1.0 - pow(opt->beta1, (double)opt->step), c2 = 1.0 - pow(opt->beta2, (double)opt->step);
    for (int64_t i = 0; i < n; i++) {
        double g = moert_load(grad, i);
        double mi = opt->beta1 * moert_load(m, i) + (1.0 - opt->beta1) * g;
        double vi = opt->beta2 * moert_load(v, i) + (1.0 - opt->beta2) * g * g;
        moert_store(m, i, mi);
        moert_store(v, i, vi);
        double p = moert_load(param, i);
        p -= opt->lr * ((mi / c1) / (sqrt(vi / c2) + opt->eps) + opt->weight_decay * p);
        moert_store(param, i, p);
    }
    return MOERT_OK;
}
