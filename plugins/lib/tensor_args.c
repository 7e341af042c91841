/* SPDX-License-Identifier: Apache-2.0 */
/* Argument checks shared by the dispatcher plugins (see tensor_args.h). */
#include "tensor_args.h"

#include <stdio.h>

const char *moert_arg_device_text(moert_device dev, char *buf, size_t size)
{
    const char *type = dev.type == MOERT_DEVICE_CPU         ? "cpu"
                       : dev.type == MOERT_DEVICE_CUDA      ? "cuda"
                       : dev.type == MOERT_DEVICE_CUDA_HOST ? "cuda_host"
                                                            : "unknown";
    if (dev.type == MOERT_DEVICE_CUDA)
        snprintf(buf, size, "%s:%d", type, (int)dev.id);
    else
        snprintf(buf, size, "%s", type);
    return buf;
}

const char *moert_arg_shape_text(const moert_tensor *t, char *buf, size_t size)
{
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < t->ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)t->shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

static bool is_float_dtype(moert_dtype t)
{
    return t == MOERT_F32 || t == MOERT_F64 || t == MOERT_BF16 || t == MOERT_F16;
}

moert_result moert_arg_check_tensor(const moert_host *h, moert_device device, const char *call, const char *name,
                                    const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least, int64_t cols,
                                    const char *rows_what, int need_dtype)
{
    char a[64], b[64];
    if (!t) {
        h->set_error(h, "%s: %s is NULL", call, name);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (t->device.type != device.type || (t->device.type == MOERT_DEVICE_CUDA && t->device.id != device.id)) {
        h->set_error(h, "%s: %s is on %s, but the layer is on %s", call, name,
                     moert_arg_device_text(t->device, a, sizeof a), moert_arg_device_text(device, b, sizeof b));
        return MOERT_ERR_UNSUPPORTED;
    }
    if (need_dtype >= 0 && t->dtype != (moert_dtype)need_dtype) {
        h->set_error(h, "%s: %s has dtype %s, expected %s", call, name, moert_dtype_name(t->dtype),
                     moert_dtype_name((moert_dtype)need_dtype));
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (need_dtype < 0 && !is_float_dtype(t->dtype)) {
        h->set_error(h, "%s: %s has dtype %s, expected fp32, fp64, bf16 or fp16", call, name,
                     moert_dtype_name(t->dtype));
        return MOERT_ERR_UNSUPPORTED;
    }
    bool shape_ok = t->ndim == ndim && (rows_at_least ? t->shape[0] >= rows : t->shape[0] == rows) &&
                    (ndim == 1 || t->shape[1] == cols);
    if (!shape_ok) {
        if (ndim == 1)
            snprintf(b, sizeof b, "[%s%lld]", rows_at_least ? ">= " : "", (long long)rows);
        else
            snprintf(b, sizeof b, "[%s%lld, %lld]", rows_at_least ? ">= " : "", (long long)rows, (long long)cols);
        h->set_error(h, "%s: %s has shape %s, expected %s (%s)", call, name, moert_arg_shape_text(t, a, sizeof a), b,
                     rows_what);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (!moert_tensor_is_contiguous(t)) {
        h->set_error(h, "%s: %s must be contiguous (row-major)", call, name);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (!t->data && moert_tensor_numel(t) > 0) {
        h->set_error(h, "%s: %s has shape %s but no data", call, name, moert_arg_shape_text(t, a, sizeof a));
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    return MOERT_OK;
}

moert_result moert_arg_check_struct_size(const moert_host *h, const char *call, const char *what, uint32_t got,
                                         size_t need)
{
    if (got >= need) return MOERT_OK;
    h->set_error(h, "%s: %s.struct_size is %u, expected at least %zu (set it to sizeof the struct)", call, what, got,
                 need);
    return MOERT_ERR_INVALID_ARGUMENT;
}

moert_result moert_arg_check_layer_device(const moert_host *host, moert_device device, const char *what)
{
    char dev[32];
    if (device.type != MOERT_DEVICE_CPU && device.type != MOERT_DEVICE_CUDA) {
        host->set_error(host, "%s runs on the CPU or a CUDA device, not on %s", what,
                        moert_arg_device_text(device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
#ifndef MOERT_HAVE_CUDA
    if (device.type == MOERT_DEVICE_CUDA) {
        host->set_error(host, "%s has only a CPU path in this build (built without CUDA); the layer is on %s", what,
                        moert_arg_device_text(device, dev, sizeof dev));
        return MOERT_ERR_UNSUPPORTED;
    }
#endif
    return MOERT_OK;
}

moert_result moert_arg_check_dispatch_layer(const moert_host *host, const moert_layer_info *layer, const char *name,
                                            int max_ranks)
{
    /* an older core's shorter struct is fine: plugins copy it with moert_layer_info_copy */
    if (!layer || layer->struct_size < MOERT_LAYER_INFO_BASE_SIZE) {
        host->set_error(host, "the %s dispatcher: layer info %s (struct_size %u, expected at least %zu)", name,
                        layer ? "too small" : "missing", layer ? (unsigned)layer->struct_size : 0u,
                        (size_t)MOERT_LAYER_INFO_BASE_SIZE);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    char what[64];
    snprintf(what, sizeof what, "the %s dispatcher", name);
    moert_result rc = moert_arg_check_layer_device(host, layer->device, what);
    if (rc != MOERT_OK) return rc;
    if (layer->num_experts <= 0 || layer->topk <= 0 || layer->hidden <= 0 || host->world_size <= 0) {
        host->set_error(host, "bad layer: num_experts %lld, topk %lld, hidden %lld, world_size %d",
                        (long long)layer->num_experts, (long long)layer->topk, (long long)layer->hidden,
                        (int)host->world_size);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (max_ranks > 0 && host->world_size > max_ranks) {
        host->set_error(host, "the %s dispatcher serves at most %d ranks (one NVLink domain), the group has %d", name,
                        max_ranks, (int)host->world_size);
        return MOERT_ERR_UNSUPPORTED;
    }
    if (layer->num_experts % host->world_size != 0 ||
        layer->num_local_experts != layer->num_experts / host->world_size ||
        layer->first_local_expert != layer->num_local_experts * host->rank) {
        host->set_error(host,
                        "the %s dispatcher needs num_experts (%lld) divisible by world_size (%d), with rank r "
                        "owning experts [r*E/world, (r+1)*E/world); got num_local_experts %lld, first_local_expert "
                        "%lld on rank %d",
                        name, (long long)layer->num_experts, (int)host->world_size, (long long)layer->num_local_experts,
                        (long long)layer->first_local_expert, (int)host->rank);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    return MOERT_OK;
}
