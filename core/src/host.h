/* SPDX-License-Identifier: Apache-2.0 */
/* Host services: builds the moert_host table handed to one plugin instance. */
#ifndef MOERT_CORE_HOST_H
#define MOERT_CORE_HOST_H

#include "comm.h"
#include "config.h"
#include "moert/moert.h"

/* Receives the metrics a plugin reports (per instance); NULL to drop them. */
typedef void (*moert_metric_sink)(void *user, const char *name, double value, const char *unit);

typedef struct moert_host_setup {
    const char *who;        /* "router[topk] layer 0 rank 1", prefixes log lines and errors */
    moert_section *options; /* the plugin's JSON object; borrowed */
    moert_comm_group *comm; /* may be NULL for a world of one */
    int rank, world_size;
    moert_device device;
    moert_metric_sink metric;
    void *metric_user;
    /* CUDA ranks only (NULL on the CPU): the rank's memory pool, its NCCL communicator for device buffers
     * (host buffers still go through `comm`), and the stream allocations are ordered on. */
    struct moert_cuda_pool *cuda_pool;
    struct moert_nccl_comm *nccl;
    moert_stream stream;
} moert_host_setup;

/* A host table for one instance; free with moert_host_free. */
moert_result moert_host_create(const moert_host_setup *setup, moert_host **out);
void moert_host_free(moert_host *h);
/* The message a plugin set with host->set_error since the last call ("" if none); clears it. */
const char *moert_host_take_error(moert_host *h);
/* A failed call of the core's own host services (h) for layer `layer` as a core error: "what[ activation] of layer L
 * (rank R): the service's message"; activation may be NULL. */
moert_result moert_host_call_failed(const moert_host *h, moert_result rc, const char *what, const char *activation,
                                    int layer);
/* The instance's capability flags: what the plugin declared through host->set_flags, else header_flags. */
uint32_t moert_host_instance_flags(const moert_host *h, uint32_t header_flags);
/* Makes `stream` the one this instance's allocations and frees are ordered on (the pool hands a block freed on it at
 * once only to that stream); returns the one before. The executor sets its second stream while a plugin works on it. */
moert_stream moert_host_use_stream(moert_host *h, moert_stream stream);

#endif
