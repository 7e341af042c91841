/* SPDX-License-Identifier: Apache-2.0 */
/* The MoE layers' own grid over the ranks (MoE Parallel Folding, docs/parallel.md): ETP x EP x EDP in Megatron's
 * expert rank order "tp-ep-dp", rank = etp + ETP * (ep + EP * edp). ETP groups are consecutive ranks, EP groups stride
 * ETP, EDP groups stride ETP * EP. */
#ifndef MOERT_CORE_EXPERT_LAYOUT_H
#define MOERT_CORE_EXPERT_LAYOUT_H

#include <stdbool.h>

/* The sizes of the three axes; their product is the world. */
typedef struct moert_expert_layout {
    int etp, ep, edp;
} moert_expert_layout;

/* A rank's place on the grid. */
typedef struct moert_expert_coords {
    int etp, ep, edp;
} moert_expert_coords;

typedef enum moert_expert_axis { MOERT_AXIS_ETP = 0, MOERT_AXIS_EP = 1, MOERT_AXIS_EDP = 2 } moert_expert_axis;

static inline int moert_expert_world(moert_expert_layout l) { return l.etp * l.ep * l.edp; }

static inline int moert_expert_rank_of(moert_expert_layout l, moert_expert_coords c)
{
    return c.etp + l.etp * (c.ep + l.ep * c.edp);
}

static inline moert_expert_coords moert_expert_coords_of(moert_expert_layout l, int rank)
{
    moert_expert_coords c = {.etp = rank % l.etp, .ep = (rank / l.etp) % l.ep, .edp = rank / (l.etp * l.ep)};
    return c;
}

static inline int moert_expert_axis_size(moert_expert_layout l, moert_expert_axis a)
{
    return a == MOERT_AXIS_ETP ? l.etp : a == MOERT_AXIS_EP ? l.ep : l.edp;
}

/* The ranks of `rank`'s group along axis a, in group rank order, into members[moert_expert_axis_size(l, a)]. */
static inline void moert_expert_group_members(moert_expert_layout l, int rank, moert_expert_axis a, int *members)
{
    moert_expert_coords c = moert_expert_coords_of(l, rank);
    for (int i = 0; i < moert_expert_axis_size(l, a); i++) {
        moert_expert_coords m = c;
        if (a == MOERT_AXIS_ETP)
            m.etp = i;
        else if (a == MOERT_AXIS_EP)
            m.ep = i;
        else
            m.edp = i;
        members[i] = moert_expert_rank_of(l, m);
    }
}

#endif
