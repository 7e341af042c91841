/* SPDX-License-Identifier: Apache-2.0 */
/* The work counters of GEMMs that leave SMs to a dispatcher call: see sm_yield_counters.h. */
#include "sm_yield_counters.h"

#include <string.h>

#ifdef MOERT_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#include "plugin_report.h"

moert_result moert_yield_counters_init(moert_yield_counters *y, const moert_host *host, const moert_layer_info *layer)
{
    memset(y, 0, sizeof *y);
#ifdef MOERT_HAVE_CUDA
    if (!MOERT_LAYER_INFO_SM_YIELD(layer)) return MOERT_OK;
    const size_t bytes = 2 * MOERT_YIELD_STREAMS * sizeof(int32_t);
    moert_result rc = host->alloc(host, layer->device, bytes, (void **)&y->pairs);
    if (rc != MOERT_OK) return rc;
    const cudaError_t err = cudaMemset(y->pairs, 0, bytes);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        host->free(host, layer->device, y->pairs);
        y->pairs = NULL;
        return report(host, MOERT_ERR_CUDA, "cudaMemset(work counters, %zu bytes) failed: %s", bytes,
                      cudaGetErrorString(err));
    }
#else
    (void)host;
    (void)layer;
#endif
    return MOERT_OK;
}

int32_t *moert_yield_counters_for(moert_yield_counters *y, moert_stream stream)
{
    if (!y->pairs || !stream) return NULL;
    for (int i = 0; i < MOERT_YIELD_STREAMS; i++) {
        if (!y->streams[i]) y->streams[i] = stream;
        if (y->streams[i] == stream) return y->pairs + 2 * i;
    }
    return NULL;
}

void moert_yield_counters_free(moert_yield_counters *y, const moert_host *host, const moert_layer_info *layer)
{
    if (y->pairs) host->free(host, layer->device, y->pairs);
    memset(y, 0, sizeof *y);
}
