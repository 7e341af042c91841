/* SPDX-License-Identifier: Apache-2.0 */
/* The trainer's loss and optimizer: CPU reference loops, CUDA kernels from harness/cuda_ops.cu. */
#include "optim.h"

#include <math.h>

#ifdef MOERT_HAVE_CUDA
#include "cuda_ops.h"
#endif

#ifdef MOERT_HAVE_CUDA
static bool on_cuda(const moert_tensor *t) { return t->device.type == MOERT_DEVICE_CUDA; }
#endif

/* CPU work needs host memory. */
static moert_result require_host(const moert_tensor *t, const char *what)
{
    if (t->device.type == MOERT_DEVICE_CPU || t->device.type == MOERT_DEVICE_CUDA_HOST) return MOERT_OK;
    return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "%s: a tensor on device type %d in a build without CUDA", what,
                                (int)t->device.type);
}

moert_result trainer_squared_error(moert_stream s, const moert_tensor *pred, const moert_tensor *target, double scale,
                                   void *workspace, float *pinned_result, double *sum, moert_tensor *grad)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(pred))
        return trainer_cuda_squared_error(s, pred->dtype, moert_tensor_numel(pred), pred->data, target->data, scale,
                                          grad ? grad->dtype : pred->dtype, grad ? grad->data : NULL, workspace,
                                          pinned_result, sum);
#endif
    (void)s;
    (void)workspace;
    (void)pinned_result;
    moert_result rc = require_host(pred, "squared_error");
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

moert_result trainer_adam_update(moert_stream s, const trainer_adam *opt, moert_tensor *param, const moert_tensor *grad,
                                 moert_tensor *m, moert_tensor *v)
{
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(param)) {
        if (param->dtype != MOERT_F32 || m->dtype != MOERT_F32 || v->dtype != MOERT_F32)
            return moert_set_last_error(MOERT_ERR_UNSUPPORTED, "adam_update on CUDA: %s parameters, expected fp32",
                                        moert_dtype_name(param->dtype));
        return trainer_cuda_adam(s, moert_tensor_numel(param), opt->step, opt->lr, opt->beta1, opt->beta2, opt->eps,
                                 opt->weight_decay, param->data, grad->dtype, grad->data, m->data, v->data);
    }
#endif
    (void)s;
    moert_result rc = require_host(param, "adam_update");
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

moert_result trainer_sgd_update(moert_stream s, const trainer_sgd *opt, moert_tensor *param, const moert_tensor *grad)
{
    if (moert_tensor_numel(param) != moert_tensor_numel(grad))
        return moert_set_last_error(MOERT_ERR_INVALID_ARGUMENT,
                                    "sgd_update: parameter has %lld elements, gradient %lld",
                                    (long long)moert_tensor_numel(param), (long long)moert_tensor_numel(grad));
#ifdef MOERT_HAVE_CUDA
    if (on_cuda(param)) /* param = (1 - lr wd) param - lr grad */
        return trainer_cuda_axpby(s, moert_tensor_numel(param), -opt->lr, grad->dtype, grad->data,
                                  1.0 - opt->lr * opt->weight_decay, param->dtype, param->data);
#endif
    (void)s;
    moert_result rc = require_host(param, "sgd_update");
    if (rc != MOERT_OK) return rc;
    int64_t n = moert_tensor_numel(param);
    for (int64_t i = 0; i < n; i++) {
        double p = moert_load(param, i), g = moert_load(grad, i);
        if (opt->weight_decay != 0.0) g += opt->weight_decay * p;
        moert_store(param, i, p - opt->lr * g);
    }
    return MOERT_OK;
}
