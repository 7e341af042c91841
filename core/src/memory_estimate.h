/* SPDX-License-Identifier: Apache-2.0 */
/* What a config needs in memory on each rank, estimated before any plugin starts, and whether it fits the device. */
#ifndef MOERT_CORE_MEMORY_ESTIMATE_H
#define MOERT_CORE_MEMORY_ESTIMATE_H

#include <stddef.h>

#include "config.h"

/* Bytes one rank needs, by what holds them (docs/config.md, "Memory estimate"). */
typedef struct moert_memory_estimate {
    double parameters;     /* router [E,H] and this rank's experts' fc1 [H,2F] and fc2 [F,H], every layer */
    double gradients;      /* the same again */
    double optimizer;      /* Adam's two moments (none with SGD) */
    double activations;    /* saved from forward to backward, the residual stream, the batch */
    double dispatcher;     /* the routed rows sent and received, and their staging */
    double workspace;      /* backward transients, the router's and the GEMMs' scratch */
    double per_rank;       /* the sum */
    int ranks_sharing;     /* ranks that share one memory: every rank on the CPU (threads), 1 on GPUs */
    double capacity;       /* bytes of that memory: the machine's on the CPU, one GPU's */
    char memory_name[160]; /* "the CPU's memory", "cuda:0 (NVIDIA H100)" */
} moert_memory_estimate;

/* Estimates cfg on `world` ranks of device type `device` (MOERT_DEVICE_CPU or MOERT_DEVICE_CUDA). Rows dispatched
 * to a rank are counted as with balanced routing (tokens_per_rank x topk), so the estimate is a floor for routing
 * that starts uneven. */
void moert_memory_estimate_config(const moert_config *cfg, int world, int device, moert_memory_estimate *out);

/* Fills the capacity of the memory the ranks would use (device: MOERT_DEVICE_CPU or MOERT_DEVICE_CUDA, GPU 0). */
void moert_memory_estimate_capacity(int device, moert_memory_estimate *est);

/* MOERT_ERR_OUT_OF_MEMORY with the estimate in the message when it does not fit (more than 90% of the memory). */
moert_result moert_memory_estimate_check(const moert_config *cfg, const moert_memory_estimate *est);

/* "1.5 GiB", "320.0 MiB": bytes for people. */
void moert_format_bytes(double bytes, char *buf, size_t size);

/* One line: the estimate by category, the total and the memory it is measured against. */
void moert_memory_estimate_line(const moert_memory_estimate *est, char *buf, size_t size);

#endif
