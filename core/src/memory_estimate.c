/* SPDX-License-Identifier: Apache-2.0 */
/* The memory a config needs per rank, estimated from its sizes before any plugin starts (moert check prints it, and
 * moert_runtime_create refuses a config that cannot fit), so that a config too large for the machine is refused with
 * a figure instead of being killed by the kernel half-way through its first step. */
#include "memory_estimate.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "loader.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#endif

/* Only this share of a memory is planned for: the process, the plugins' code and the allocator need the rest. */
#define MEMORY_USABLE_SHARE 0.9

/* The configured dispatcher's header flags (what "auto" asks of it: MOERT_CAP_AUTO_OVERLAP), 0 where it cannot be
 * loaded (creating the layers then says why). */
static uint32_t dispatcher_flags(const moert_config *cfg)
{
    moert_plugin p;
    if (moert_plugin_load(MOERT_KIND_DISPATCHER, cfg->plugin[MOERT_SLOT_DISPATCHER], &p) != MOERT_OK) {
        moert_error_clear();
        return 0;
    }
    const uint32_t flags = p.header->flags;
    moert_plugin_unload(&p);
    return flags;
}

/* The rows padding adds where `section` (router or dispatcher) pads every expert to its capacity: its
 * capacity_factor (each expert gets ceil(T*K/E * factor) rows, the padding zero-weight), else 1. */
static double padding_factor(const moert_config *cfg, const char *section)
{
    const json_t *s = json_object_get(cfg->root, section);
    const json_t *pad = json_object_get(s, "pad_to_capacity"), *factor = json_object_get(s, "capacity_factor");
    if (!json_is_true(pad) || !json_is_number(factor)) return 1.0;
    const double f = json_number_value(factor);
    /* past the plugins' own bound (1e6) the plugin's range check, when it starts, names the key: not counted here */
    return f > 1.0 && f <= 1e6 ? f : 1.0;
}

void moert_memory_estimate_config(const moert_config *cfg, int world, int device, moert_memory_estimate *out)
{
    const moert_model_config *m = &cfg->model;
    memset(out, 0, sizeof *out);
    /* doubles: the sizes are bounded (config.c), and products of them stay exact enough in a double */
    const double h = (double)m->hidden, f = (double)m->ffn_hidden, e = (double)m->num_experts, k = (double)m->topk;
    const double t = (double)cfg->train.tokens_per_rank, layers = (double)m->num_layers;
    /* the MoE layers' grid (docs/parallel.md): a rank holds E/EP experts, each a shard of width F/ETP, and computes on
     * the rows of its ETP group */
    const int64_t etp = cfg->parallel.expert_tensor_parallel > 1 ? cfg->parallel.expert_tensor_parallel : 1;
    const int64_t edp = cfg->parallel.expert_data_parallel > 1 ? cfg->parallel.expert_data_parallel : 1;
    const int64_t ep = world / (etp * edp) > 0 ? world / (etp * edp) : 1;
    const double local_experts = (double)(m->num_experts / ep);
    /* rows padded to the experts' capacity count as rows: pad_to_capacity with a capacity_factor of 1000 holds a
     * thousand times the balanced rows */
    const double router_pad = padding_factor(cfg, "router"), dispatcher_pad = padding_factor(cfg, "dispatcher");
    const double pad = router_pad > dispatcher_pad ? router_pad : dispatcher_pad;
    const double fl = f / (double)etp, expert_rows = t * k * (double)etp * pad;
    const double act = (double)moert_dtype_size(m->dtype);  /* activation storage */
    const double param = m->dtype == MOERT_F64 ? 8.0 : 4.0; /* parameters are fp32 (fp64 with fp64 storage) */
    /* the CPU paths compute in double precision scratch; the CUDA paths in the storage dtype (or fp32) */
    const double scratch = device == MOERT_DEVICE_CUDA ? 4.0 : 8.0;
    const double rows = t * k * pad; /* rows dispatched to a rank, balanced routing (and padding) */

    const double fs = (double)m->shared_expert_ffn_hidden; /* the shared expert's width, 0 without one */
    const double params_per_layer =
        e * h + local_experts * 3.0 * h * fl + 3.0 * h * fs + (m->shared_expert_gate ? h : 0.0);
    out->parameters = layers * params_per_layer * param;
    out->gradients = out->parameters;
    out->optimizer = cfg->train.optimizer == MOERT_OPTIMIZER_SGD ? 0.0 : 2.0 * out->parameters;
    /* per layer: dispatched x [rows, H], fc1 output [rows, 2F], SwiGLU output [rows, F], probs, top-k, and the
     * operands the precision plugin keeps for its weight gradients (as many again); then the residual stream
     * [layers + 1] and grad/target [T, H] on the device, the batch and its targets in fp64 on the host. (Measured on
     * the CPU paths: 1.0x to 1.45x the peak resident memory of a step.) */
    out->activations = layers * (2.0 * expert_rows * (h + 3.0 * fl) * act + expert_rows * 8.0 + t * k * 12.0) +
                       (layers + 4.0) * t * h * act + 2.0 * t * h * 8.0;
    /* the shared expert: its fc1 and SwiGLU outputs [T, 3Fs] kept per layer, its output [T, H] until added */
    out->activations += layers * t * (3.0 * fs + h) * act;
    /* per layer: the permuted rows sent, the rows received and their combine, in scratch precision; a dispatcher that
     * gathers every rank's tokens (MOERT_CAP_GATHERS_TOKENS: allgather) holds them, [EP x T, H] in the activation
     * dtype, and two partial sums of that shape in scratch precision where that is more (fewer routed rows than
     * gathered ones: a small top-k on many ranks) */
    const uint32_t flags = dispatcher_flags(cfg);
    const double routed_rows = 2.0 * rows * h * scratch, gathered = (double)ep * t * h * (act + 2.0 * scratch);
    out->dispatcher = layers * ((flags & MOERT_CAP_GATHERS_TOKENS) && gathered > routed_rows ? gathered : routed_rows);
    /* one layer at a time: the backward's transients and the GEMMs' converted operands [rows, 3F + H] in scratch
     * precision; every layer: the router's scores and their gradients [T, 4E], its input and input gradient [T, 2H]
     * and weights [E, 2H] in double precision */
    out->workspace =
        expert_rows * (3.0 * fl + h) * scratch + layers * (t * (4.0 * e + 2.0 * h) + 2.0 * e * h) * 8.0 + 8192.0;
    /* $.parallel.forwards_in_flight (at least two under overlap_micro_batches): as many micro-batches in flight, and
     * every layer's slots past the first (their own plugin instances, router state and dispatcher buffers) */
    double slots = (double)cfg->parallel.forwards_in_flight;
    if (slots < 2.0 && moert_overlap_enabled(cfg, device, ep, etp, cfg->train.micro_batches, flags)) slots = 2.0;
    out->activations *= slots;
    out->dispatcher *= slots;
    out->workspace *= slots;
    out->per_rank =
        out->parameters + out->gradients + out->optimizer + out->activations + out->dispatcher + out->workspace;
    out->ranks_sharing = device == MOERT_DEVICE_CUDA ? 1 : world;
    moert_memory_estimate_capacity(device, out);
}

void moert_memory_estimate_capacity(int device, moert_memory_estimate *est)
{
#ifdef MOERT_HAVE_CUDA
    if (device == MOERT_DEVICE_CUDA) {
        moert_cuda_device_info info;
        if (moert_cuda_device_info_get(0, &info) == MOERT_OK) {
            est->capacity = (double)info.total_bytes;
            snprintf(est->memory_name, sizeof est->memory_name, "one GPU's memory (cuda:0, %.96s)", info.name);
            return;
        }
    }
#endif
    (void)device;
    est->capacity = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    snprintf(est->memory_name, sizeof est->memory_name, "this machine's memory, shared by the %d rank thread%s",
             est->ranks_sharing, est->ranks_sharing == 1 ? "" : "s");
}

void moert_format_bytes(double bytes, char *buf, size_t size)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    while (bytes >= 1024.0 && u < 5) {
        bytes /= 1024.0;
        u++;
    }
    snprintf(buf, size, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
}

/* "parameters 1.0 MiB, gradients ..., workspace 8.0 KiB; 3.0 MiB per rank": the categories and their sum. */
static void categories_text(const moert_memory_estimate *est, char *buf, size_t size)
{
    char p[32], g[32], o[32], a[32], d[32], w[32], total[32];
    moert_format_bytes(est->parameters, p, sizeof p);
    moert_format_bytes(est->gradients, g, sizeof g);
    moert_format_bytes(est->optimizer, o, sizeof o);
    moert_format_bytes(est->activations, a, sizeof a);
    moert_format_bytes(est->dispatcher, d, sizeof d);
    moert_format_bytes(est->workspace, w, sizeof w);
    moert_format_bytes(est->per_rank, total, sizeof total);
    snprintf(
        buf, size,
        "parameters %s, gradients %s, optimizer %s, activations %s, dispatcher buffers %s, workspace %s; %s per rank",
        p, g, o, a, d, w, total);
}

void moert_memory_estimate_line(const moert_memory_estimate *est, char *buf, size_t size)
{
    char categories[512], all[32], cap[32], shared[96] = "";
    categories_text(est, categories, sizeof categories);
    moert_format_bytes(est->per_rank * est->ranks_sharing, all, sizeof all);
    moert_format_bytes(est->capacity, cap, sizeof cap);
    if (est->ranks_sharing > 1) snprintf(shared, sizeof shared, " x %d ranks = %s", est->ranks_sharing, all);
    snprintf(buf, size, "%s%s, of %s (%s)", categories, shared, est->memory_name, cap);
}

moert_result moert_memory_estimate_check(const moert_config *cfg, const moert_memory_estimate *est)
{
    const double need = est->per_rank * est->ranks_sharing;
    if (est->capacity <= 0 || need <= MEMORY_USABLE_SHARE * est->capacity) return MOERT_OK;
    char categories[512], need_text[32], cap[32];
    categories_text(est, categories, sizeof categories);
    moert_format_bytes(need, need_text, sizeof need_text);
    moert_format_bytes(est->capacity, cap, sizeof cap);
    return moert_error(MOERT_ERR_OUT_OF_MEMORY,
                       "config \"%s\" does not fit: it needs an estimated %s, more than %.0f%% of %s (%s); %s. "
                       "Shrink $.model or $.train.tokens_per_rank, use more ranks%s",
                       cfg->name, need_text, 100.0 * MEMORY_USABLE_SHARE, est->memory_name, cap, categories,
                       est->ranks_sharing > 1 ? ", or run it on GPUs ($.parallel.device \"cuda\")" : "");
}
