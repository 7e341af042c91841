/* SPDX-License-Identifier: Apache-2.0 */
/* Stack: the MoE layers of one rank with their plugin instances and host services, made from a config. Shared by
 * the embedding API (core/src/layers.c) and the runtime's trainer (harness/runtime.c). */
#ifndef MOERT_CORE_STACK_H
#define MOERT_CORE_STACK_H

#include "executor.h"
#include "expert_layout.h"
#include "host.h"

/* What the layers of one rank run on. */
typedef struct moert_stack_setup {
    const moert_config *cfg;
    const moert_plugin *plugins; /* [MOERT_SLOT_COUNT], loaded; borrowed */
    int rank, world;
    moert_device device;
    int64_t max_tokens;     /* tokens per forward on this rank, an upper bound */
    moert_comm_group *comm; /* host-memory collectives of the world; NULL for a world of one or NCCL alone */
    /* the MoE layers' grid over the world (docs/parallel.md): expert tensor and expert data parallel sizes (0 or 1:
     * none); expert parallel is world / (etp x edp) */
    int etp, edp;
    struct moert_cuda_pool *pool; /* CUDA ranks (NULL on the CPU) */
    struct moert_nccl_comm *nccl; /* CUDA ranks */
    moert_stream stream;          /* CUDA ranks: the compute stream */
    /* a second slot of every layer (core/src/overlap.h): the stack whose plugin instances this one's are twins of
     * (moert_layer_info.twin); NULL for the first */
    const struct moert_stack *twin_of;
    int slot; /* with twin_of: which slot of the layers this stack is (1 ..) */
    /* the layers run with the micro-batch overlap (both slots): MOERT_LAYER_OVERLAPPED in their plugins' layer info */
    bool overlapped;
    /* CUDA ranks under the overlap with $.parallel.overlap_comm_sms > 0: the rank's SM-yield words (moert_comm_stream;
     * borrowed), whose first is every layer info's sm_yield in both slots; NULL otherwise */
    int32_t *sm_yield;
} moert_stack_setup;

typedef struct moert_stack {
    int slot; /* 0, or the slot a twin (twin_of) is, 1 .. */
    int num_layers;
    json_t *empty_options;
    moert_section *core_section;
    moert_host *core_host;    /* the rank's own services */
    moert_layer *layers;      /* [num_layers] */
    moert_section **sections; /* [num_layers * MOERT_SLOT_COUNT] */
    moert_host **hosts;       /* [num_layers * MOERT_SLOT_COUNT] */
    /* the shared expert's precision instance of each layer (NULL entries without a shared expert) */
    moert_section **shared_sections; /* [num_layers] */
    moert_host **shared_hosts;       /* [num_layers] */
    /* the rank's expert groups (docs/parallel.md): the world's communicator itself when a group is every rank, a
     * subgroup view of it (owned) when smaller, NULL when the group is this rank alone */
    moert_expert_layout layout;
    moert_expert_coords coords;
    moert_comm_group *group[3]; /* [moert_expert_axis] */
    bool group_owned[3];
    /* CUDA ranks: each group's NCCL communicator, the same way (split from the world's when smaller, owned) */
    struct moert_nccl_comm *group_nccl[3];
    bool group_nccl_owned[3];
    /* each group of more than one rank: core services over it (collectives on host or device memory), else NULL */
    moert_host *group_host[3];
} moert_stack;

/* Creates the rank's core services and one instance of every plugin per layer; on failure what was made is kept for
 * moert_stack_finalize. Parameters are not allocated here (moert_layer_init_params, or bound by the caller). */
moert_result moert_stack_init(moert_stack *s, const moert_stack_setup *setup);
/* Sums t (a tensor on the rank's device, e.g. a gradient) over the rank's group along axis a, on `stream` (every member
 * calls it at the same point); a group of one rank leaves it as it is. */
moert_result moert_stack_group_sum(moert_stack *s, moert_expert_axis a, moert_tensor *t, moert_stream stream);
/* Frees the layers (moert_layer_free), finalizes the plugin instances and frees the services. */
void moert_stack_finalize(moert_stack *s);

#endif
