/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA devices for the core: counting them (0 without a driver), properties for reports, streams,
 * events, pinned host memory and async copies. Streams and events are moert_stream / moert_event
 * (a cudaStream_t / cudaEvent_t), so callers need no CUDA header. */
#ifndef MOERT_CORE_CUDA_DEVICE_H
#define MOERT_CORE_CUDA_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "moert/plugin.h"

/* Number of usable CUDA devices. No driver, a driver too old for this runtime, no device, or
 * CUDA_VISIBLE_DEVICES hiding them all give *out = 0 and MOERT_OK, quietly. Other failures are errors. */
moert_result moert_cuda_device_count(int *out);

/* What a report says about one device. */
typedef struct moert_cuda_device_info {
    int id;
    char name[256];
    int cc_major, cc_minor; /* compute capability, 9.0 on H100/H200 */
    int sm_count;
    size_t total_bytes; /* device memory */
    size_t free_bytes;  /* free now (cudaMemGetInfo) */
    int l2_bytes;
    size_t smem_per_block_optin; /* shared memory a block may opt in to */
    int pci_bus, pci_device;
    int driver_version, runtime_version; /* e.g. 13000 */
} moert_cuda_device_info;

moert_result moert_cuda_device_info_get(int device, moert_cuda_device_info *out);
/* Makes `device` current for this thread (thread-per-GPU ranks call this first). */
moert_result moert_cuda_set_device(int device);
/* Waits for all work on `device`. */
moert_result moert_cuda_device_synchronize(int device);

/* Streams: created non-blocking with respect to the legacy default stream, on `device`. */
moert_result moert_cuda_stream_create(int device, moert_stream *out);
/* A stream at the device's highest priority: its pending blocks are scheduled before other streams' ones. */
moert_result moert_cuda_stream_create_high_priority(int device, moert_stream *out);
void moert_cuda_stream_destroy(moert_stream s);
moert_result moert_cuda_stream_synchronize(moert_stream s);
/* *done = true when every piece of work queued on s so far has finished. */
moert_result moert_cuda_stream_query(moert_stream s, bool *done);

/* Events: timing ones (for elapsed_ms) or light ones for ordering only. */
moert_result moert_cuda_event_create(int device, bool timing, moert_event *out);
void moert_cuda_event_destroy(moert_event e);
moert_result moert_cuda_event_record(moert_event e, moert_stream s);
moert_result moert_cuda_stream_wait_event(moert_stream s, moert_event e);
moert_result moert_cuda_event_synchronize(moert_event e);
moert_result moert_cuda_event_query(moert_event e, bool *done);
moert_result moert_cuda_event_elapsed_ms(moert_event start, moert_event stop, float *ms);

/* CUDA graphs. A capture records the work queued on a stream (relaxed mode: the thread may still allocate) into a
 * graph, instantiated at the end; a replay launches it on a stream. */
typedef void *moert_cuda_graph; /* a cudaGraphExec_t */
moert_result moert_cuda_capture_begin(moert_stream s);
/* Ends the capture on s (always, even when the capture broke) and instantiates the graph into *out. `what` names the
 * captured work in the error message. */
moert_result moert_cuda_capture_end(moert_stream s, const char *what, moert_cuda_graph *out);
moert_result moert_cuda_graph_launch(moert_cuda_graph g, moert_stream s);
void moert_cuda_graph_destroy(moert_cuda_graph g);
/* Records e on s as a node of the graph being captured on s, so a replay records it too (timing events work). */
moert_result moert_cuda_event_record_captured(moert_event e, moert_stream s);

/* Pinned (page-locked) host memory, usable by every device; free with moert_cuda_host_free. */
moert_result moert_cuda_host_alloc(size_t bytes, void **out);
void moert_cuda_host_free(void *ptr);

/* Copies between any of host, pinned host and device memory (unified addressing works out the
 * direction), queued on stream s; asynchronous only when the host side is pinned. */
moert_result moert_cuda_memcpy_async(void *dst, const void *src, size_t bytes, moert_stream s);
moert_result moert_cuda_memset_async(void *dst, int value, size_t bytes, moert_stream s);

/* A driver API function found through the runtime (CUDA 12.0's version of it; no link against libcuda), or NULL where
 * the driver lacks it. */
void *moert_cuda_driver_symbol(const char *name);

/* Micro-batch overlap ($.parallel.overlap_comm_sms): three int32 in device memory on `device`, {0, 0, sms}: the SM-yield
 * word the GEMMs read (moert_layer_info.sm_yield), then its two values, copied from where the driver cannot write it
 * (moert_cuda_write_word_async). Free with moert_cuda_sm_yield_free once no stream uses it. */
moert_result moert_cuda_sm_yield_create(int device, int32_t sms, int32_t **out);
void moert_cuda_sm_yield_free(int32_t *words);
/* Writes `value` to the device word dst on s, in stream order, with a stream memory operation (cuStreamWriteValue32),
 * which needs no SM: it lands while a persistent kernel holds every SM, where a 4-byte device-to-device cudaMemcpyAsync
 * runs as a kernel and waits for one (seen on an H200). Where the driver has no stream memory operations it copies
 * the word at src (device memory holding `value`) instead. */
moert_result moert_cuda_write_word_async(int32_t *dst, int32_t value, const int32_t *src, moert_stream s);

/* The device whose memory ptr is (device or managed memory), or -1 for host memory, pinned or not. */
moert_result moert_cuda_pointer_device(const void *ptr, int *device_or_minus_one);

#endif
