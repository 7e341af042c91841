/* SPDX-License-Identifier: Apache-2.0 */
/* Error reporting shared by the plugins' CUDA code: checked CUDA calls and launches, reported through
 * plugin_report.h's report(). Header-only: plugins do not link libmoert. */
#ifndef MOERT_PLUGIN_CUDA_CHECK_H
#define MOERT_PLUGIN_CUDA_CHECK_H

#include <cuda_runtime.h>

#include "plugin_report.h"

/* Checked CUDA runtime call: on failure reports the call, the CUDA message and the line, and returns. */
#define CUDA_CHECK(host, call) REPORT_STATUS_CHECK(host, cudaError_t, cudaSuccess, cudaGetErrorString, call, #call)

/* Checks the kernel launch just made, naming the kernel. */
#define LAUNCH_CHECK(host, name)                                                                                       \
    do {                                                                                                               \
        cudaError_t err_ = cudaGetLastError();                                                                         \
        if (err_ != cudaSuccess)                                                                                       \
            return report((host), MOERT_ERR_CUDA, "launch of %s failed: %s (%s:%d)", name, cudaGetErrorString(err_),   \
                          __FILE__, __LINE__);                                                                         \
    } while (0)

/* MOERT_OK when this process sees CUDA device `id` (a layer's device, named `dev` in the message); else reports
 * how many devices it sees (and why none, when cudaGetDeviceCount failed) and that only a CPU path can run here. */
static inline moert_result check_cuda_device_visible(const moert_host *host, int id, const char *dev)
{
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        count = 0;
    }
    if (id >= 0 && id < count) return MOERT_OK;
    return report(host, MOERT_ERR_UNSUPPORTED,
                  "the layer is on %s, but this process sees %d CUDA device%s (%s): only a CPU path can run here", dev,
                  count, count == 1 ? "" : "s", err == cudaSuccess ? "cudaGetDeviceCount" : cudaGetErrorString(err));
}

/* Checked internal call returning moert_result: a failure returns it (its message already handed over). */
#define MOK(call)                                                                                                      \
    do {                                                                                                               \
        moert_result r_ = (call);                                                                                      \
        if (r_ != MOERT_OK) return r_;                                                                                 \
    } while (0)

#endif
