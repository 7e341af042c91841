/* SPDX-License-Identifier: Apache-2.0 */
/* Memory policy plugin ABI v1: what happens to each activation saved for backward. */
#ifndef MOERT_MEMORY_POLICY_H
#define MOERT_MEMORY_POLICY_H

#include "moert/plugin.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The activations one MoE layer saves for its backward. */
typedef enum moert_activation {
    MOERT_ACT_DISPATCHED_X = 0, /* recv_x: tokens after dispatch, input of fc1 */
    MOERT_ACT_FC1_OUT = 1,      /* fc1 output [N, 2F], input of SwiGLU */
    MOERT_ACT_SWIGLU_OUT = 2,   /* SwiGLU output times prob [N, F], input of fc2 */
    MOERT_ACT_COUNT
} moert_activation;

typedef enum moert_memory_action {
    MOERT_MEMORY_KEEP = 0,      /* keep on the device until backward */
    MOERT_MEMORY_RECOMPUTE = 1, /* discard after use, recompute before backward */
    MOERT_MEMORY_OFFLOAD = 2    /* copy to pinned host memory, bring back ahead of backward */
} moert_memory_action;

typedef struct moert_activation_info {
    uint32_t struct_size;
    int32_t layer_index;
    moert_activation activation;
    int64_t bytes; /* size of this step's tensor */
    moert_device device;
    /* Appended (read it only when struct_size covers it; absent means 0): MOERT_ACTIVATION_* flags. */
    uint32_t flags;
} moert_activation_info;

/* The activation belongs to the layer's shared expert ($.model.shared_expert_ffn_hidden): `activation` is then
 * MOERT_ACT_FC1_OUT for its fc1 output [T, 2Fs] and MOERT_ACT_SWIGLU_OUT for its SwiGLU output [T, Fs]. A policy that
 * ignores the flag answers for them what it answers for the routed experts' activations of the same id. */
#define MOERT_ACTIVATION_SHARED_EXPERT 0x1u

typedef struct moert_memory_policy_v1 {
    moert_plugin_header header; /* kind MOERT_KIND_MEMORY_POLICY */
    moert_result (*init)(void **ctx, const moert_host *host, const moert_layer_info *layer);
    void (*finalize)(void *ctx);
    /* Says what to do with one saved activation; the executor carries it out. */
    moert_result (*decide)(void *ctx, const moert_activation_info *info, moert_memory_action *action);
} moert_memory_policy_v1;

#define MOERT_MEMORY_POLICY_V1_SYMBOL "moert_memory_policy_v1"
/* The header fields of a memory policy vtable, and its one exported definition (the symbol gets its name through an asm label:
 * C cannot name an object like its type):
 *   MOERT_MEMORY_POLICY_V1_EXPORT(my_vtable) = {.header = {MOERT_MEMORY_POLICY_V1_HEADER, .name = "x", ...}, .init = ..., ...}; */
#define MOERT_MEMORY_POLICY_V1_HEADER MOERT_PLUGIN_HEADER(moert_memory_policy_v1, MOERT_KIND_MEMORY_POLICY)
#define MOERT_MEMORY_POLICY_V1_EXPORT(var)                                                                             \
    MOERT_PLUGIN_EXPORT const moert_memory_policy_v1 var __asm__(MOERT_MEMORY_POLICY_V1_SYMBOL)

/* Names used in configs and reports: "dispatched_x", "fc1_out", "swiglu_out"; "keep", "recompute", "offload". */
static inline const char *moert_activation_name(moert_activation a)
{
    static const char *const names[MOERT_ACT_COUNT] = {"dispatched_x", "fc1_out", "swiglu_out"};
    return (a >= 0 && a < MOERT_ACT_COUNT) ? names[a] : "unknown";
}

#ifdef __cplusplus
}
#endif
#endif
