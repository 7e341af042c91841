/* SPDX-License-Identifier: Apache-2.0 */
/* The "default" memory policy plugin: a fixed action per saved activation, read from the config. */
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>

#include "moert/memory_policy.h"

typedef struct policy_ctx {
    const moert_host *host;
    moert_memory_action action[MOERT_ACT_COUNT]; /* by moert_activation */
    /* the shared expert's fc1 output and SwiGLU output (asked as fc1_out / swiglu_out with the shared-expert flag):
     * an action, or -1 for the answer of the routed activation of the same id */
    int shared_action[2];
    bool offload_last_layer; /* false: the stack's last layer keeps what the others offload */
    int32_t num_layers;
} policy_ctx;

/* Config names of the actions, in moert_memory_action order. */
static const char *const action_choices[] = {"keep", "recompute", "offload", NULL};
/* The shared expert's: the same, and "same" (index 3) for the answer of the routed activation of the same id. */
static const char *const shared_choices[] = {"keep", "recompute", "offload", "same", NULL};

/* Creates one instance: one option per activation, each keep|recompute|offload (keep by default), one per shared
 * expert activation (same as the routed one by default), and whether the last layer offloads too. */
static moert_result policy_init(void **out, const moert_host *host, const moert_layer_info *layer)
{
    static const char *const help[MOERT_ACT_COUNT] = {
        "tokens after dispatch (input of fc1): keep, recompute (dispatch again) or offload to pinned host memory",
        "fc1 output (input of SwiGLU): keep, recompute (fc1 again) or offload to pinned host memory",
        "SwiGLU output times prob (input of fc2): keep, recompute or offload to pinned host memory",
    };
    *out = NULL;
    policy_ctx *c = calloc(1, sizeof *c);
    if (!c) {
        host->set_error(host, "out of memory for the memory policy state");
        return MOERT_ERR_OUT_OF_MEMORY;
    }
    c->host = host;
    for (int a = 0; a < MOERT_ACT_COUNT; a++) {
        int choice = MOERT_MEMORY_KEEP;
        moert_result rc = host->option_enum(host, moert_activation_name((moert_activation)a), action_choices,
                                            MOERT_MEMORY_KEEP, help[a], &choice);
        if (rc != MOERT_OK) {
            free(c);
            return rc;
        }
        c->action[a] = (moert_memory_action)choice;
    }
    static const char *const shared_names[2] = {"shared_fc1_out", "shared_act"};
    static const char *const shared_help[2] = {
        "the shared expert's fc1 output: keep, recompute (its fc1 again), offload, or same (as fc1_out)",
        "the shared expert's SwiGLU output: keep, recompute, offload, or same (as swiglu_out)",
    };
    for (int i = 0; i < 2; i++) {
        int choice = 3;
        moert_result rc = host->option_enum(host, shared_names[i], shared_choices, 3, shared_help[i], &choice);
        if (rc != MOERT_OK) {
            free(c);
            return rc;
        }
        c->shared_action[i] = choice == 3 ? -1 : choice;
    }
    moert_result rc = host->option_bool(host, "offload_last_layer", true,
                                        "offload in the stack's last layer too; its backward follows its forward at "
                                        "once, so the copies there cannot hide behind other work (false: keep)",
                                        &c->offload_last_layer);
    if (rc != MOERT_OK) {
        free(c);
        return rc;
    }
    c->num_layers = layer ? layer->num_layers : 1;
    *out = c;
    return MOERT_OK;
}

static void policy_finalize(void *ctx) { free(ctx); }

/* The configured action for one saved activation. */
static moert_result policy_decide(void *ctx, const moert_activation_info *info, moert_memory_action *action)
{
    policy_ctx *c = ctx;
    if (!info || !action) {
        c->host->set_error(c->host, "decide(): %s is NULL", !info ? "info" : "action");
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    if (info->activation < 0 || info->activation >= MOERT_ACT_COUNT) {
        c->host->set_error(c->host,
                           "decide(): activation is %d, expected 0 (dispatched_x), 1 (fc1_out) or "
                           "2 (swiglu_out)",
                           (int)info->activation);
        return MOERT_ERR_INVALID_ARGUMENT;
    }
    *action = c->action[info->activation];
    /* the shared expert's activations (a flag appended to the info: read only where its struct_size covers it) */
    bool shared = info->struct_size >= offsetof(moert_activation_info, flags) + sizeof info->flags &&
                  (info->flags & MOERT_ACTIVATION_SHARED_EXPERT);
    if (shared && info->activation != MOERT_ACT_DISPATCHED_X) {
        int i = info->activation == MOERT_ACT_FC1_OUT ? 0 : 1;
        if (c->shared_action[i] >= 0) *action = (moert_memory_action)c->shared_action[i];
    }
    if (*action == MOERT_MEMORY_OFFLOAD && !c->offload_last_layer && info->layer_index == c->num_layers - 1)
        *action = MOERT_MEMORY_KEEP;
    return MOERT_OK;
}

/* The one exported symbol. Its name equals the vtable's typedef name, which C does not allow for an object in the
 * same scope, so the object gets a private C name and its linker name through an asm label. */
MOERT_MEMORY_POLICY_V1_EXPORT(policy_vtable) = {
    .header =
        {
            MOERT_MEMORY_POLICY_V1_HEADER,
            .name = "default",
            .version = "0.1.0",
            .description = "a fixed keep/recompute/offload action per saved activation, from the config",
            .devices = MOERT_CAP_DEVICE(MOERT_DEVICE_CPU) | MOERT_CAP_DEVICE(MOERT_DEVICE_CUDA),
            .dtypes = MOERT_CAP_DTYPE(MOERT_F32) | MOERT_CAP_DTYPE(MOERT_F64) | MOERT_CAP_DTYPE(MOERT_BF16) |
                      MOERT_CAP_DTYPE(MOERT_F16) | MOERT_CAP_DTYPE(MOERT_F8E4M3) | MOERT_CAP_DTYPE(MOERT_F8E5M2),
            .flags = MOERT_CAP_GRAPH_CAPTURABLE,
        },
    .init = policy_init,
    .finalize = policy_finalize,
    .decide = policy_decide,
};
