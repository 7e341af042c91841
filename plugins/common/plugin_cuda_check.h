/* Error reporting shared by the plugins' CUDA files: a plugin never prints, it hands a message to its host
 * (host->set_error) and returns a result code. Header-only: plugins do not link libmoert. */
#ifndef MOERT_PLUGIN_CUDA_CHECK_H
#define MOERT_PLUGIN_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <stdarg.h>
#include <stdio.h>

#include "moert/plugin.h"

/* Formats a message and hands it to the host. Returns code. */
static inline moert_result report(const moert_host *host, moert_result code, const char *fmt, ...)
{
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (host && host->set_error) host->set_error(host, "%s", text);
    return code;
}

/* Checked CUDA runtime call: on failure reports the call, the CUDA message and the line, and returns. */
#define CUDA_CHECK(host, call)                                                                               \
    do {                                                                                                     \
        cudaError_t err_ = (call);                                                                           \
        if (err_ != cudaSuccess)                                                                             \
            return report((host), MOERT_ERR_CUDA, "%s failed: %s (%s:%d)", #call, cudaGetErrorString(err_),  \
                          __FILE__, __LINE__);                                                               \
    } while (0)

/* Checks the kernel launch just made, naming the kernel. */
#define LAUNCH_CHECK(host, name)                                                                             \
    do {                                                                                                     \
        cudaError_t err_ = cudaGetLastError();                                                               \
        if (err_ != cudaSuccess)                                                                             \
            return report((host), MOERT_ERR_CUDA, "launch of %s failed: %s (%s:%d)", name,                  \
                          cudaGetErrorString(err_), __FILE__, __LINE__);                                     \
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
#define MOK(call)                                                                                            \
    do {                                                                                                     \
        moert_result r_ = (call);                                                                            \
        if (r_ != MOERT_OK) return r_;                                                                       \
    } while (0)

#endif
