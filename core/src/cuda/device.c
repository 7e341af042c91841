/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA devices, streams, events, pinned memory and copies (see device.h). */
#include "device.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_check.h"
#include "kernels.h"
#include "log.h"

/* Whether a cudaGetDeviceCount answer means "this machine has no usable GPU" rather than a fault. */
static bool means_no_gpu(cudaError_t err)
{
    switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemNotReady:
    case cudaErrorCallRequiresNewerDriver: return true;
    default: return false;
    }
}

moert_result moert_cuda_device_count(int *out)
{
    moert_result rc = MOERT_OK;
    int n = 0;
    *out = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        if (means_no_gpu(err)) return MOERT_OK;
        MOERT_CUDA_CHECK(err);
    }
    *out = n;
fail:
    return rc;
}

/* Makes `device` current, remembering the previous one in *prev for restore_device. */
static moert_result enter_device(int device, int *prev)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaGetDevice(prev));
    if (*prev != device) MOERT_CUDA_CHECK(cudaSetDevice(device));
fail:
    return rc;
}

static void restore_device(int device, int prev)
{
    if (prev != device) (void)cudaSetDevice(prev);
}

moert_result moert_cuda_device_info_get(int device, moert_cuda_device_info *out)
{
    moert_result rc = MOERT_OK;
    struct cudaDeviceProp prop;
    int prev = device;
    memset(out, 0, sizeof *out);
    MOERT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    out->id = device;
    snprintf(out->name, sizeof out->name, "%s", prop.name);
    out->cc_major = prop.major;
    out->cc_minor = prop.minor;
    out->sm_count = prop.multiProcessorCount;
    out->total_bytes = prop.totalGlobalMem;
    out->l2_bytes = prop.l2CacheSize;
    out->smem_per_block_optin = prop.sharedMemPerBlockOptin;
    out->pci_bus = prop.pciBusID;
    out->pci_device = prop.pciDeviceID;
    MOERT_CUDA_CHECK(cudaDriverGetVersion(&out->driver_version));
    MOERT_CUDA_CHECK(cudaRuntimeGetVersion(&out->runtime_version));
    MOERT_CHECK(enter_device(device, &prev));
    size_t free_bytes = 0, total_bytes = 0;
    cudaError_t err = cudaMemGetInfo(&free_bytes, &total_bytes);
    restore_device(device, prev);
    MOERT_CUDA_CHECK(err);
    out->free_bytes = free_bytes;
fail:
    return rc;
}

moert_result moert_cuda_set_device(int device)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaSetDevice(device));
fail:
    return rc;
}

moert_result moert_cuda_device_synchronize(int device)
{
    moert_result rc = MOERT_OK;
    int prev = device;
    MOERT_CHECK(enter_device(device, &prev));
    cudaError_t err = cudaDeviceSynchronize();
    restore_device(device, prev);
    MOERT_CUDA_CHECK(err);
fail:
    return rc;
}

static moert_result stream_create_at(int device, bool high_priority, moert_stream *out)
{
    moert_result rc = MOERT_OK;
    cudaStream_t s = NULL;
    int prev = device, least = 0, greatest = 0;
    *out = NULL;
    MOERT_CHECK(enter_device(device, &prev));
    const char *call = "cudaDeviceGetStreamPriorityRange";
    cudaError_t err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (err == cudaSuccess) {
        call = "cudaStreamCreateWithPriority";
        err = cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, high_priority ? greatest : least);
    }
    restore_device(device, prev);
    if (err != cudaSuccess) {
        rc = moert_cuda_fail(call, err, __FILE__, __LINE__);
        goto fail;
    }
    *out = (moert_stream)s;
fail:
    return rc;
}

moert_result moert_cuda_stream_create(int device, moert_stream *out) { return stream_create_at(device, false, out); }

moert_result moert_cuda_stream_create_high_priority(int device, moert_stream *out)
{
    return stream_create_at(device, true, out);
}

void moert_cuda_stream_destroy(moert_stream s)
{
    if (s) (void)cudaStreamDestroy((cudaStream_t)s);
}

moert_result moert_cuda_stream_synchronize(moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_cuda_stream_query(moert_stream s, bool *done)
{
    moert_result rc = MOERT_OK;
    cudaError_t err = cudaStreamQuery((cudaStream_t)s);
    *done = (err == cudaSuccess);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        err = cudaSuccess;
    }
    MOERT_CUDA_CHECK(err);
fail:
    return rc;
}

moert_result moert_cuda_event_create(int device, bool timing, moert_event *out)
{
    moert_result rc = MOERT_OK;
    cudaEvent_t e = NULL;
    int prev = device;
    *out = NULL;
    MOERT_CHECK(enter_device(device, &prev));
    cudaError_t err = cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming);
    restore_device(device, prev);
    MOERT_CUDA_CHECK(err);
    *out = (moert_event)e;
fail:
    return rc;
}

void moert_cuda_event_destroy(moert_event e)
{
    if (e) (void)cudaEventDestroy((cudaEvent_t)e);
}

moert_result moert_cuda_event_record(moert_event e, moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_cuda_capture_begin(moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaStreamBeginCapture((cudaStream_t)s, cudaStreamCaptureModeRelaxed));
fail:
    return rc;
}

moert_result moert_cuda_capture_end(moert_stream s, const char *what, moert_cuda_graph *out)
{
    moert_result rc = MOERT_OK;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    *out = NULL;
    cudaError_t err = cudaStreamEndCapture((cudaStream_t)s, &graph);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        rc = moert_error(MOERT_ERR_CUDA,
                         "capturing %s into a CUDA graph failed at cudaStreamEndCapture: %s (some work in it cannot "
                         "be captured: a host synchronisation, a blocking copy or an allocation on the stream)",
                         what, cudaGetErrorString(err));
        goto fail;
    }
    err = cudaGraphInstantiate(&exec, graph, 0);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        rc = moert_error(MOERT_ERR_CUDA, "cudaGraphInstantiate of the graph of %s failed: %s", what,
                         cudaGetErrorString(err));
        goto fail;
    }
    *out = exec;
fail:
    if (graph) (void)cudaGraphDestroy(graph);
    return rc;
}

moert_result moert_cuda_graph_launch(moert_cuda_graph g, moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaGraphLaunch((cudaGraphExec_t)g, (cudaStream_t)s));
fail:
    return rc;
}

void moert_cuda_graph_destroy(moert_cuda_graph g)
{
    if (g) (void)cudaGraphExecDestroy((cudaGraphExec_t)g);
}

moert_result moert_cuda_event_record_captured(moert_event e, moert_stream s)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaEventRecordWithFlags((cudaEvent_t)e, (cudaStream_t)s, cudaEventRecordExternal));
fail:
    return rc;
}

moert_result moert_cuda_stream_wait_event(moert_stream s, moert_event e)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)e, 0));
fail:
    return rc;
}

moert_result moert_cuda_event_synchronize(moert_event e)
{
    moert_result rc = MOERT_OK;
    MOERT_CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)e));
fail:
    return rc;
}

moert_result moert_cuda_event_query(moert_event e, bool *done)
{
    moert_result rc = MOERT_OK;
    cudaError_t err = cudaEventQuery((cudaEvent_t)e);
    *done = (err == cudaSuccess);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        err = cudaSuccess;
    }
    MOERT_CUDA_CHECK(err);
fail:
    return rc;
}

moert_result moert_cuda_event_elapsed_ms(moert_event start, moert_event stop, float *ms)
{
    moert_result rc = MOERT_OK;
    *ms = 0.0f;
    MOERT_CUDA_CHECK(cudaEventElapsedTime(ms, (cudaEvent_t)start, (cudaEvent_t)stop));
fail:
    return rc;
}

moert_result moert_cuda_host_alloc(size_t bytes, void **out)
{
    moert_result rc = MOERT_OK;
    void *p = NULL;
    *out = NULL;
    MOERT_CUDA_CHECK(cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable));
    *out = p;
fail:
    return rc;
}

void moert_cuda_host_free(void *ptr)
{
    if (ptr) (void)cudaFreeHost(ptr);
}

/* Where the device sees `p`: its device pointer when it is memory of the current device (*on_device true) or pinned
 * host memory (false); NULL for pageable host memory, another device's memory, or an unknown pointer. */
static void *device_view(const void *p, int device, bool *on_device)
{
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    *on_device = a.type == cudaMemoryTypeDevice;
    if (a.type == cudaMemoryTypeDevice && a.device == device) return a.devicePointer;
    if (a.type == cudaMemoryTypeHost) return a.devicePointer;
    return NULL;
}

/* Copies between device memory and pinned host memory of at most this many bytes go through a kernel instead of
 * the copy engine: a copy engine serves the copies of all streams in the order they were issued, so a few-KB copy
 * a dispatcher waits on (token counts) would otherwise queue behind an offload's hundreds of MB on another
 * stream. */
#define SMALL_COPY_BYTES (256u << 10)

moert_result moert_cuda_memcpy_async(void *dst, const void *src, size_t bytes, moert_stream s)
{
    moert_result rc = MOERT_OK;
    if (bytes == 0) return MOERT_OK;
    if (bytes <= SMALL_COPY_BYTES) {
        int device = -1;
        bool dst_dev = false, src_dev = false;
        MOERT_CUDA_CHECK(cudaGetDevice(&device));
        void *d = device_view(dst, device, &dst_dev);
        const void *v = device_view(src, device, &src_dev);
        if (d && v && dst_dev != src_dev) return moert_cuda_copy_kernel((cudaStream_t)s, d, v, bytes);
    }
    MOERT_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_cuda_memset_async(void *dst, int value, size_t bytes, moert_stream s)
{
    moert_result rc = MOERT_OK;
    if (bytes == 0) return MOERT_OK;
    MOERT_CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, (cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_cuda_sm_yield_create(int device, int32_t sms, int32_t **out)
{
    moert_result rc = MOERT_OK;
    const int32_t init[3] = {0, 0, sms};
    int32_t *words = NULL;
    int prev = device;
    *out = NULL;
    MOERT_CHECK(enter_device(device, &prev));
    MOERT_CUDA_CHECK(cudaMalloc((void **)&words, sizeof init));
    MOERT_CUDA_CHECK(cudaMemcpy(words, init, sizeof init, cudaMemcpyHostToDevice));
    *out = words;
    words = NULL;
fail:
    if (words) (void)cudaFree(words);
    restore_device(device, prev);
    return rc;
}

void moert_cuda_sm_yield_free(int32_t *words)
{
    if (words) (void)cudaFree(words);
}

/* cuStreamWriteValue32, found through the runtime (no link against libcuda); NULL where the driver lacks it. */
typedef int (*write_value32_fn)(cudaStream_t stream, unsigned long long addr, uint32_t value, unsigned int flags);
static write_value32_fn write_value32;
static pthread_once_t write_value32_once = PTHREAD_ONCE_INIT;

void *moert_cuda_driver_symbol(const char *name)
{
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
        fn = NULL;
    (void)cudaGetLastError();
    return fn;
}

static void load_write_value32(void)
{
    write_value32 = (write_value32_fn)moert_cuda_driver_symbol("cuStreamWriteValue32");
    if (!write_value32)
        moert_log(MOERT_LOG_WARN,
                  "the CUDA driver has no cuStreamWriteValue32: the micro-batch overlap's SM-yield word "
                  "is copied with cudaMemcpyAsync, which waits for an SM (the GEMMs then leave none "
                  "in time)");
}

#define CUDA_ERROR_NOT_SUPPORTED_CODE 801 /* CUDA_ERROR_NOT_SUPPORTED: stream memory operations off */

moert_result moert_cuda_write_word_async(int32_t *dst, int32_t value, const int32_t *src, moert_stream s)
{
    moert_result rc = MOERT_OK;
    pthread_once(&write_value32_once, load_write_value32);
    if (write_value32) {
        int err = write_value32((cudaStream_t)s, (unsigned long long)(uintptr_t)dst, (uint32_t)value, 0);
        if (err == 0) return MOERT_OK;
        if (err != CUDA_ERROR_NOT_SUPPORTED_CODE)
            return moert_error(MOERT_ERR_CUDA, "cuStreamWriteValue32(s, %p, %d, 0) failed: CUresult %d", (void *)dst,
                               (int)value, err);
    }
    /* no stream memory operations: a copy, which runs once an SM is free */
    MOERT_CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof *dst, cudaMemcpyDeviceToDevice, (cudaStream_t)s));
fail:
    return rc;
}

moert_result moert_cuda_pointer_device(const void *ptr, int *device_or_minus_one)
{
    moert_result rc = MOERT_OK;
    struct cudaPointerAttributes attr;
    *device_or_minus_one = -1;
    MOERT_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
    if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) *device_or_minus_one = attr.device;
fail:
    return rc;
}
