/* SPDX-License-Identifier: Apache-2.0 */
/* Argument checks shared by the dispatcher plugins (and the layer device check by the precision plugins): one tensor
 * argument, an args struct's size, and the text of devices and shapes for messages. Compiled into each plugin
 * (plugins do not link libmoert). */
#ifndef MOERT_PLUGIN_TENSOR_ARGS_H
#define MOERT_PLUGIN_TENSOR_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/plugin.h"

/* "cuda:1", "cpu", "cuda_host" for messages. */
const char *moert_arg_device_text(moert_device dev, char *buf, size_t size);
/* "[12, 64]" for messages. */
const char *moert_arg_shape_text(const moert_tensor *t, char *buf, size_t size);

/*
 * Checks one tensor argument of `call`: present, on `device`, contiguous, a float dtype (fp32, fp64, bf16, fp16;
 * or exactly `need_dtype` when >= 0), ndim dims, shape[0] == rows (>= rows when rows_at_least), shape[1] == cols
 * when ndim is 2. `rows_what` says where the expected row count comes from. Errors go to host->set_error.
 */
moert_result moert_arg_check_tensor(const moert_host *host, moert_device device, const char *call, const char *name,
                                    const moert_tensor *t, int ndim, int64_t rows, bool rows_at_least, int64_t cols,
                                    const char *rows_what, int need_dtype);

/*
 * Refuses a layer on a device the plugin has no path for: the CPU and CUDA devices are served, CUDA only in a build
 * with CUDA (MOERT_HAVE_CUDA, set for the whole build). `what` names the plugin for the message, e.g. "the bf16
 * precision plugin". Errors go to host->set_error.
 */
moert_result moert_arg_check_layer_device(const moert_host *host, moert_device device, const char *what);

/*
 * The layer checks every dispatcher's init makes: layer info present; a CPU or CUDA device (CUDA only in a CUDA
 * build); positive sizes; at most max_ranks ranks (0: no limit); experts split evenly, rank r owning
 * [r*E/world, (r+1)*E/world). `name` is the plugin's, for messages. Errors go to host->set_error.
 */
moert_result moert_arg_check_dispatch_layer(const moert_host *host, const moert_layer_info *layer, const char *name,
                                            int max_ranks);

/* An args struct's struct_size must be at least the size the plugin reads. */
moert_result moert_arg_check_struct_size(const moert_host *host, const char *call, const char *what, uint32_t got,
                                         size_t need);

#endif
