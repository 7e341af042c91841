/* SPDX-License-Identifier: Apache-2.0 */
/* Stack: the MoE layers of one rank, their plugin instances and host services. */
#include "stack.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "log.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/comm_nccl.h"
#endif

/* The layer description plugins of layer `layer` get: the experts of the rank's expert-parallel rank, each of the
 * width of its expert-tensor-parallel shard. */
static moert_layer_info layer_info_of(const moert_stack *s, const moert_stack_setup *setup, int layer)
{
    const moert_model_config *m = &setup->cfg->model;
    int64_t local = m->num_experts / s->layout.ep;
    moert_layer_info info = {.struct_size = sizeof info,
                             .layer_index = layer,
                             .num_layers = (int32_t)m->num_layers,
                             .hidden = m->hidden,
                             .ffn_hidden = m->ffn_hidden / s->layout.etp,
                             .num_experts = m->num_experts,
                             .topk = m->topk,
                             .num_local_experts = local,
                             .first_local_expert = local * s->coords.ep,
                             .max_tokens = setup->max_tokens,
                             .dtype = m->dtype,
                             .device = setup->device,
                             .flags = setup->overlapped ? MOERT_LAYER_OVERLAPPED : 0u,
                             .sm_yield = setup->sm_yield};
    return info;
}

/* The rank's place in the ETP x EP x EDP grid and its three groups (docs/parallel.md): views of the world's host
 * communicator and, on CUDA ranks, NCCL communicators split from the world's (every rank splits in the same order:
 * ETP, EP, EDP). The layout was checked against the model by the config or moert_layers_create. */
static moert_result expert_groups_init(moert_stack *s, const moert_stack_setup *setup)
{
    moert_result rc = MOERT_OK;
    int *members = NULL;
    const int etp = setup->etp > 1 ? setup->etp : 1, edp = setup->edp > 1 ? setup->edp : 1;
    if (setup->world % (etp * edp) != 0)
        return moert_error(MOERT_ERR_INVALID_ARGUMENT,
                           "expert layout: expert tensor parallel %d x expert data "
                           "parallel %d does not divide the %d ranks",
                           etp, edp, setup->world);
    s->layout = (moert_expert_layout){.etp = etp, .ep = setup->world / (etp * edp), .edp = edp};
    s->coords = moert_expert_coords_of(s->layout, setup->rank);
    members = malloc((size_t)setup->world * sizeof *members);
    MOERT_CHECK_ALLOC(members);
    for (int a = 0; a < 3; a++) {
        int size = moert_expert_axis_size(s->layout, (moert_expert_axis)a);
        if (size == 1) continue; /* this rank alone: no communicator */
        if (size == setup->world) {
            s->group[a] = setup->comm;
            s->group_nccl[a] = setup->nccl;
            continue;
        }
        moert_expert_group_members(s->layout, setup->rank, (moert_expert_axis)a, members);
        if (setup->comm || !setup->nccl) {
            MOERT_CHECK(moert_comm_subgroup_create(setup->comm, setup->rank, members, size, &s->group[a]));
            s->group_owned[a] = true;
        }
#ifdef MOERT_HAVE_CUDA
        if (setup->nccl) { /* the group's first world rank names it; ranks in it by their place on the axis */
            const int key = a == MOERT_AXIS_ETP ? s->coords.etp : a == MOERT_AXIS_EP ? s->coords.ep : s->coords.edp;
            MOERT_CHECK(moert_nccl_comm_split(setup->nccl, members[0], key, &s->group_nccl[a]));
            s->group_nccl_owned[a] = true;
        }
#endif
    }
fail:
    free(members);
    return rc;
}

/* Core services over each group of more than one rank: the executor's ETP exchanges, the trainer's EDP sums. */
static moert_result group_hosts_init(moert_stack *s, const moert_stack_setup *setup)
{
    moert_result rc = MOERT_OK;
    static const char *const names[3] = {"expert tensor parallel", "expert parallel", "expert data parallel"};
    const int rank_on[3] = {s->coords.etp, s->coords.ep, s->coords.edp};
    for (int a = 0; a < 3; a++) {
        int size = moert_expert_axis_size(s->layout, (moert_expert_axis)a);
        if (size == 1) continue;
        char who[256];
        snprintf(who, sizeof who, "core (rank %d, its %s group)", setup->rank, names[a]);
        moert_host_setup hs = {.who = who,
                               .comm = s->group[a],
                               .rank = rank_on[a],
                               .world_size = size,
                               .device = setup->device,
                               .cuda_pool = setup->pool,
                               .nccl = s->group_nccl[a],
                               .stream = setup->stream};
        MOERT_CHECK(moert_host_create(&hs, &s->group_host[a]));
    }
fail:
    return rc;
}

moert_result moert_stack_group_sum(moert_stack *s, moert_expert_axis a, moert_tensor *t, moert_stream stream)
{
    moert_host *h = s->group_host[a];
    if (!h) return MOERT_OK;
    moert_result rc = h->allreduce_sum(h, t->data, (size_t)moert_tensor_numel(t), t->dtype, t->device, stream);
    if (rc != MOERT_OK) return moert_error(rc, "%s", moert_host_take_error(h));
    return MOERT_OK;
}

static moert_instance *slot_instance(moert_layer *L, moert_slot s)
{
    switch (s) {
    case MOERT_SLOT_ROUTER: return &L->router;
    case MOERT_SLOT_DISPATCHER: return &L->dispatcher;
    case MOERT_SLOT_PRECISION: return &L->precision;
    default: return &L->memory;
    }
}

/* The shared expert of layer l: the precision plugin again, with the precision options, for one expert of width
 * $.model.shared_expert_ffn_hidden that every token goes to. */
/* The host services of one plugin instance of layer L: named `who`, reading `sec`, over the whole group. */
static moert_host_setup host_setup_of(const moert_stack_setup *setup, const moert_layer *L, const char *who,
                                      moert_section *sec)
{
    return (moert_host_setup){.who = who,
                              .options = sec,
                              .comm = setup->comm,
                              .rank = setup->rank,
                              .world_size = setup->world,
                              .device = L->info.device,
                              .cuda_pool = setup->pool,
                              .nccl = setup->nccl,
                              .stream = setup->stream};
}

static moert_result shared_expert_init(moert_stack *s, const moert_stack_setup *setup, int l)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = setup->cfg;
    const moert_plugin *plugin = &setup->plugins[MOERT_SLOT_PRECISION];
    moert_layer *L = &s->layers[l];
    char who[256];
    L->shared_ffn = cfg->model.shared_expert_ffn_hidden;
    L->shared_gate = cfg->model.shared_expert_gate;
    L->shared_overlap = cfg->parallel.shared_expert_overlap;
    moert_layer_info info = L->info;
    info.num_experts = info.num_local_experts = 1;
    info.first_local_expert = 0;
    info.topk = 1;
    info.ffn_hidden = L->shared_ffn;
    if (setup->twin_of) info.twin = setup->twin_of->layers[l].shared_precision.ctx;
    moert_section *sec = moert_section_create(json_object_get(cfg->root, "precision"), "$.precision");
    MOERT_CHECK_ALLOC(sec);
    s->shared_sections[l] = sec;
    moert_section_allow(sec, "plugin");
    snprintf(who, sizeof who, "precision \"%s\" (shared expert, layer %d, rank %d)", plugin->header->name, l,
             setup->rank);
    moert_host_setup hs = host_setup_of(setup, L, who, sec);
    MOERT_CHECK(moert_host_create(&hs, &s->shared_hosts[l]));
    L->shared_precision.plugin = plugin;
    L->shared_precision.host = s->shared_hosts[l];
    MOERT_CHECK(moert_plugin_init(plugin, &L->shared_precision.ctx, L->shared_precision.host, &info));
fail:
    return rc;
}

moert_result moert_stack_init(moert_stack *s, const moert_stack_setup *setup)
{
    moert_result rc = MOERT_OK;
    const moert_config *cfg = setup->cfg;
    int nl = (int)cfg->model.num_layers;
    char who[256];

    memset(s, 0, sizeof *s);
    s->slot = setup->twin_of ? (setup->slot > 0 ? setup->slot : 1) : 0;
    MOERT_CHECK(expert_groups_init(s, setup));
    s->empty_options = json_object();
    MOERT_CHECK_ALLOC(s->empty_options);
    s->core_section = moert_section_create(s->empty_options, "$");
    MOERT_CHECK_ALLOC(s->core_section);
    if (s->slot)
        snprintf(who, sizeof who, "core (rank %d, slot %d)", setup->rank, s->slot);
    else
        snprintf(who, sizeof who, "core (rank %d)", setup->rank);
    moert_host_setup core_setup = {.who = who,
                                   .options = s->core_section,
                                   .comm = setup->comm,
                                   .rank = setup->rank,
                                   .world_size = setup->world,
                                   .device = setup->device,
                                   .cuda_pool = setup->pool,
                                   .nccl = setup->nccl,
                                   .stream = setup->stream};
    MOERT_CHECK(moert_host_create(&core_setup, &s->core_host));
    MOERT_CHECK(group_hosts_init(s, setup));

    s->layers = calloc((size_t)nl, sizeof *s->layers);
    s->sections = calloc((size_t)nl * MOERT_SLOT_COUNT, sizeof *s->sections);
    s->hosts = calloc((size_t)nl * MOERT_SLOT_COUNT, sizeof *s->hosts);
    MOERT_CHECK_ALLOC(s->layers);
    MOERT_CHECK_ALLOC(s->sections);
    MOERT_CHECK_ALLOC(s->hosts);
    s->shared_sections = calloc((size_t)nl, sizeof *s->shared_sections);
    s->shared_hosts = calloc((size_t)nl, sizeof *s->shared_hosts);
    MOERT_CHECK_ALLOC(s->shared_sections);
    MOERT_CHECK_ALLOC(s->shared_hosts);
    s->num_layers = nl;

    /* a start-up warning said by every layer's plugin on every rank is written once for the world */
    moert_log_startup_begin(setup->comm ? moert_comm_log_seen : NULL, setup->comm,
                            setup->comm && moert_comm_group_local_ranks(setup->comm) > 1);
    for (int l = 0; l < nl; l++) {
        moert_layer *L = &s->layers[l];
        L->info = layer_info_of(s, setup, l);
        L->ep_rank = s->coords.ep;
        L->ep_size = s->layout.ep;
        L->etp_rank = s->coords.etp;
        L->etp_size = s->layout.etp;
        L->edp_rank = s->coords.edp;
        L->edp_size = s->layout.edp;
        L->etp_host = s->group_host[MOERT_AXIS_ETP];
        L->core_host = s->core_host;
        L->stream = setup->stream;
        moert_act_store_init(&L->acts, s->core_host, setup->stream, L->info.device, l);
        L->overlap_wgrad = cfg->parallel.overlap_wgrad;
        L->wgrad_owner = setup->twin_of ? &setup->twin_of->layers[l] : NULL;
        L->defer_wgrad_join = cfg->parallel.defer_wgrad_join;
        L->overlap_dgrad_first = cfg->parallel.overlap_dgrad_first;
        L->overlap_prepare_after_dgrads = cfg->parallel.overlap_prepare_after_dgrads;
        L->overlap_prepare_own_stream = cfg->parallel.overlap_prepare_own_stream;
        L->param_dtype = cfg->model.dtype == MOERT_F64 ? MOERT_F64 : MOERT_F32;
        L->seq_length = cfg->train.seq_length;
        for (int k = 0; k < MOERT_SLOT_COUNT; k++) {
            const char *key = moert_slot_key((moert_slot)k);
            char path[64];
            snprintf(path, sizeof path, "$.%s", key);
            moert_section *sec = moert_section_create(json_object_get(cfg->root, key), path);
            MOERT_CHECK_ALLOC(sec);
            s->sections[l * MOERT_SLOT_COUNT + k] = sec;
            moert_section_allow(sec, "plugin");
            char slot_text[24] = "";
            if (s->slot) snprintf(slot_text, sizeof slot_text, ", slot %d", s->slot);
            snprintf(who, sizeof who, "%s \"%s\" (layer %d, rank %d%s)", moert_kind_name(setup->plugins[k].kind),
                     setup->plugins[k].header->name, l, setup->rank, slot_text);
            moert_host_setup hs = host_setup_of(setup, L, who, sec);
            if (k == MOERT_SLOT_DISPATCHER) { /* the dispatcher works over the expert-parallel group alone */
                hs.comm = s->group[MOERT_AXIS_EP];
                hs.nccl = s->layout.ep == setup->world ? setup->nccl : s->group_nccl[MOERT_AXIS_EP];
                hs.rank = s->coords.ep;
                hs.world_size = s->layout.ep;
            }
            MOERT_CHECK(moert_host_create(&hs, &s->hosts[l * MOERT_SLOT_COUNT + k]));
            moert_instance *inst = slot_instance(L, (moert_slot)k);
            inst->plugin = &setup->plugins[k];
            inst->host = s->hosts[l * MOERT_SLOT_COUNT + k];
            moert_layer_info info = L->info;
            if (setup->twin_of) info.twin = slot_instance(&setup->twin_of->layers[l], (moert_slot)k)->ctx;
            MOERT_CHECK(moert_plugin_init(inst->plugin, &inst->ctx, inst->host, &info));
            /* options are the same for every layer and rank: checking the first instance is enough */
            if (l == 0) MOERT_CHECK(moert_section_check_unknown(sec));
        }
        if (cfg->model.shared_expert_ffn_hidden > 0) MOERT_CHECK(shared_expert_init(s, setup, l));
    }
fail:
    moert_log_startup_end();
    return rc;
}

void moert_stack_finalize(moert_stack *s)
{
    int nl = s->num_layers;
    if (s->layers) {
        for (int l = 0; l < nl; l++) {
            moert_layer *L = &s->layers[l];
            if (s->core_host) moert_layer_free(L);
            if (L->shared_precision.ctx) moert_plugin_finalize(L->shared_precision.plugin, L->shared_precision.ctx);
            L->shared_precision.ctx = NULL;
            for (int k = MOERT_SLOT_COUNT - 1; k >= 0; k--) {
                moert_instance *inst = slot_instance(L, (moert_slot)k);
                if (inst->ctx) moert_plugin_finalize(inst->plugin, inst->ctx);
                inst->ctx = NULL;
            }
        }
    }
    if (s->hosts)
        for (int i = 0; i < nl * MOERT_SLOT_COUNT; i++)
            if (s->hosts[i]) moert_host_free(s->hosts[i]);
    if (s->sections)
        for (int i = 0; i < nl * MOERT_SLOT_COUNT; i++)
            if (s->sections[i]) moert_section_free(s->sections[i]);
    for (int l = 0; s->shared_hosts && l < nl; l++)
        if (s->shared_hosts[l]) moert_host_free(s->shared_hosts[l]);
    for (int l = 0; s->shared_sections && l < nl; l++)
        if (s->shared_sections[l]) moert_section_free(s->shared_sections[l]);
    free(s->shared_hosts);
    free(s->shared_sections);
    if (s->core_host) moert_host_free(s->core_host);
    if (s->core_section) moert_section_free(s->core_section);
    if (s->empty_options) json_decref(s->empty_options);
    for (int a = 0; a < 3; a++) {
        if (s->group_host[a]) moert_host_free(s->group_host[a]);
        if (s->group_owned[a]) moert_comm_group_free(s->group[a]);
#ifdef MOERT_HAVE_CUDA
        if (s->group_nccl_owned[a]) moert_nccl_comm_free(s->group_nccl[a]);
#endif
    }
    free(s->layers);
    free(s->hosts);
    free(s->sections);
    memset(s, 0, sizeof *s);
}
