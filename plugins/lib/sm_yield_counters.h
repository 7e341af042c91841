/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Work counters of the GEMM kernels that leave SMs to a dispatcher call (moert_layer_info's sm_yield, the micro-batch
 * overlap; docs/executor.md). Such a kernel hands its work units out through two device int32 instead of each CTA
 * taking every grid-th one, so that CTAs can stop early; a launch's last CTA zeroes them again for the next launch on
 * its stream. Two launches running at once need two pairs, so a layer keeps one pair per stream its GEMMs run on, up
 * to MOERT_YIELD_STREAMS (a further stream gets none: its GEMMs keep every SM). Used by the bf16 and fp8 precision
 * plugins.
 */
#ifndef MOERT_PLUGIN_LIB_SM_YIELD_COUNTERS_H
#define MOERT_PLUGIN_LIB_SM_YIELD_COUNTERS_H

#include <stdint.h>

#include "moert/plugin.h"

#define MOERT_YIELD_STREAMS 8

typedef struct moert_yield_counters {
    int32_t *pairs;                            /* device: a pair per stream, zeroed; NULL without sm_yield */
    moert_stream streams[MOERT_YIELD_STREAMS]; /* the stream each pair serves (NULL: free) */
} moert_yield_counters;

/* Allocates and zeroes the pairs on the layer's device where the layer has sm_yield (else leaves y empty); call with
 * that device current. MOERT_ERR_CUDA (message set through host) when zeroing fails. */
moert_result moert_yield_counters_init(moert_yield_counters *y, const moert_host *host, const moert_layer_info *layer);

/* The pair of `stream`, taken on its first use; NULL without sm_yield, on the legacy default stream (NULL), or when
 * every pair serves another stream. */
int32_t *moert_yield_counters_for(moert_yield_counters *y, moert_stream stream);

/* Frees the pairs (nothing when there are none). */
void moert_yield_counters_free(moert_yield_counters *y, const moert_host *host, const moert_layer_info *layer);

#endif
