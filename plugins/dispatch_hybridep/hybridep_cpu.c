/* The "hybridep" dispatcher's CPU reference: layout, notify, plan, and send/receive through peer buffers with flags. */
#include "hybridep_cpu.h"

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* A flat view of n elements of dtype at data, for moert_load / moert_store. */
static moert_tensor flat_view(const void *data, moert_dtype dtype, int64_t n)
{
    return moert_tensor_1d((void *)data, moert_cpu(), dtype, n);
}

int64_t hybridep_layout(hybridep_plan *plan, const int32_t *topk_idx)
{
    const int W = plan->world;
    const int64_t T = plan->num_tokens, K = plan->topk, E = plan->num_experts, El = plan->num_local_experts;
    int64_t bad = -1;
    memset(plan->counts, 0, (size_t)E * sizeof(int64_t));
    memset(plan->tokens_to, 0, (size_t)W * sizeof(int64_t));
    for (int d = 0; d < W; d++) plan->excl[(int64_t)d * (T + 1)] = 0;
    for (int64_t t = 0; t < T; t++) {
        unsigned ranks = 0; /* bit d: the token has a copy on rank d */
        for (int64_t k = 0; k < K; k++) {
            const int32_t e = topk_idx[t * K + k];
            if (e < -1 || e >= E) {
                if (bad < 0) bad = t * K + k;
                plan->copy_index[t * K + k] = -1;
                continue;
            }
            if (e == -1) {
                plan->copy_index[t * K + k] = -1;
                continue;
            }
            plan->copy_index[t * K + k] = plan->counts[e]++;
            ranks |= 1u << (e / El);
        }
        for (int d = 0; d < W; d++) {
            const int64_t has = (ranks >> d) & 1u;
            plan->tokens_to[d] += has;
            plan->excl[(int64_t)d * (T + 1) + t + 1] = plan->excl[(int64_t)d * (T + 1) + t] + has;
        }
    }
    return bad;
}

void hybridep_plan_sizes(hybridep_plan *plan)
{
    const int W = plan->world;
    const int64_t E = plan->num_experts, El = plan->num_local_experts;
    plan->num_recv = 0;
    for (int64_t l = 0; l < El; l++) {
        int64_t rows = 0;
        for (int s = 0; s < W; s++) rows += plan->all_counts[(int64_t)s * E + (int64_t)plan->rank * El + l];
        plan->tokens_per_expert[l] = rows;
        plan->num_recv += rows;
    }
    /* expert e on rank d = e / El: its group starts after the groups of d's earlier experts; inside it, the copies of
     * lower source ranks come first */
    for (int d = 0; d < W; d++) {
        int64_t start = 0;
        for (int64_t l = 0; l < El; l++) {
            const int64_t e = (int64_t)d * El + l;
            int64_t before = 0, total = 0;
            for (int s = 0; s < W; s++) {
                if (s < plan->rank) before += plan->all_counts[(int64_t)s * E + e];
                total += plan->all_counts[(int64_t)s * E + e];
            }
            plan->base[e] = start + before;
            start += total;
        }
    }
}

/* Waits until *p >= target (acquire), at most timeout_ms. */
static bool wait_at_least(const int64_t *p, int64_t target, int64_t timeout_ms)
{
    if (__atomic_load_n(p, __ATOMIC_ACQUIRE) >= target) return true;
    struct timespec t0, now;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (unsigned spins = 1;; spins++) {
        if (__atomic_load_n(p, __ATOMIC_ACQUIRE) >= target) return true;
        if ((spins & 63) == 0) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            double ms = (double)(now.tv_sec - t0.tv_sec) * 1e3 + (double)(now.tv_nsec - t0.tv_nsec) * 1e-6;
            if (ms > (double)timeout_ms) return __atomic_load_n(p, __ATOMIC_ACQUIRE) >= target;
        }
        sched_yield();
    }
}

static hybridep_header *header_of(void *buf) { return (hybridep_header *)buf; }

/* Waits for every rank to have read what this rank wrote into it in the previous call. 0 or 1 + the rank. */
static int wait_all_consumed(const hybridep_cpu_link *link)
{
    hybridep_header *mine = header_of(link->local);
    for (int d = 0; d < link->geo->world; d++)
        if (!wait_at_least(&mine->consumed[d][0], link->seq - 1, link->timeout_ms)) {
            snprintf(link->error, link->error_size,
                     "rank %d did not read the rows of the previous call within %lld ms (timeout_ms)", d,
                     (long long)link->timeout_ms);
            return d + 1;
        }
    return 0;
}

/* Publishes this rank's rows [0, rows) in rank d's buffer for this call. */
static void publish(const hybridep_cpu_link *link, int me, int d, int64_t rows)
{
    hybridep_flag *f = &header_of(link->peers[d])->arrived[me][0];
    f->begin = 0;
    f->end = rows;
    __atomic_store_n(&f->seq, link->seq, __ATOMIC_RELEASE);
}

/* Waits for rank s's rows of this call; returns their count, or -1 after setting the message. */
static int64_t wait_arrival(const hybridep_cpu_link *link, int s)
{
    hybridep_flag *f = &header_of(link->local)->arrived[s][0];
    if (!wait_at_least(&f->seq, link->seq, link->timeout_ms)) {
        snprintf(link->error, link->error_size, "rank %d did not deliver its rows within %lld ms (timeout_ms)", s,
                 (long long)link->timeout_ms);
        return -1;
    }
    return f->end - f->begin;
}

/* Tells rank s that this rank has read what s wrote in this call. */
static void release_slot(const hybridep_cpu_link *link, int me, int s)
{
    __atomic_store_n(&header_of(link->peers[s])->consumed[me][0], link->seq, __ATOMIC_RELEASE);
}

int hybridep_cpu_wait_released(void *local, int world, int64_t seq, int64_t timeout_ms)
{
    hybridep_header *mine = header_of(local);
    for (int d = 0; d < world; d++)
        if (!wait_at_least(&mine->consumed[d][0], seq, timeout_ms)) return d;
    return -1;
}

/* The rank of this link's buffer among the peers. */
static int my_rank(const hybridep_cpu_link *link)
{
    for (int r = 0; r < link->geo->world; r++)
        if (link->peers[r] == link->local) return r;
    return 0;
}

int hybridep_cpu_notify(const hybridep_cpu_link *link, const int64_t *row, int64_t *rows)
{
    const hybridep_geometry *g = link->geo;
    const int W = g->world, me = my_rank(link);
    const size_t row_bytes = (size_t)(g->num_experts + HYBRIDEP_NOTIFY_EXTRA) * sizeof(int64_t);
    int stalled = wait_all_consumed(link);
    if (stalled) return stalled;
    for (int d = 0; d < W; d++) {
        memcpy(hybridep_notify_row(g, link->peers[d], me), row, row_bytes);
        __atomic_store_n(&header_of(link->peers[d])->notified[me], link->seq, __ATOMIC_RELEASE);
    }
    for (int s = 0; s < W; s++) {
        if (!wait_at_least(&header_of(link->local)->notified[s], link->seq, link->timeout_ms)) {
            snprintf(link->error, link->error_size, "rank %d did not send its counts within %lld ms (timeout_ms)", s,
                     (long long)link->timeout_ms);
            return s + 1;
        }
        memcpy((char *)rows + (size_t)s * row_bytes, hybridep_notify_row(g, link->local, s), row_bytes);
        release_slot(link, me, s);
    }
    return 0;
}

int hybridep_cpu_dispatch(const hybridep_cpu_link *link, const hybridep_plan *plan, int64_t hidden,
                          const int32_t *topk_idx, const void *x, moert_dtype x_dtype, const void *probs,
                          moert_dtype probs_dtype, void *out, void *out_probs, moert_dtype out_probs_dtype)
{
    const hybridep_geometry *g = link->geo;
    const int W = plan->world, me = plan->rank;
    const int64_t T = plan->num_tokens, K = plan->topk, El = plan->num_local_experts, H = hidden;
    const size_t row_bytes = (size_t)H * moert_dtype_size(x_dtype);
    const moert_tensor pv = flat_view(probs, probs_dtype, T * K);
    int stalled = wait_all_consumed(link);
    if (stalled) return stalled;

    for (int64_t t = 0; t < T; t++) {
        for (int d = 0; d < W; d++) {
            const int64_t *excl = plan->excl + (int64_t)d * (T + 1);
            if (excl[t + 1] == excl[t]) continue; /* no copy of token t on rank d */
            char *meta = hybridep_meta(g, link->peers[d], me, excl[t]);
            int32_t *dst = (int32_t *)meta;
            double *pr = (double *)(meta + g->meta_prob_offset);
            /* the copies of token t whose expert is on rank d: their final rows there (fused permutation) */
            for (int64_t k = 0; k < K; k++) {
                const int64_t c = t * K + k;
                const int32_t e = topk_idx[c];
                const bool here = plan->copy_index[c] >= 0 && e / El == d;
                dst[k] = here ? (int32_t)(plan->base[e] + plan->copy_index[c]) : -1;
                pr[k] = (here && probs) ? moert_load(&pv, c) : 0.0;
            }
            memcpy(hybridep_row(g, link->peers[d], me, excl[t]), (const char *)x + (size_t)t * row_bytes, row_bytes);
        }
    }
    for (int d = 0; d < W; d++) publish(link, me, d, plan->tokens_to[d]);

    moert_tensor opv = flat_view(out_probs, out_probs_dtype, plan->num_recv);
    for (int s = 0; s < W; s++) {
        const int64_t n = wait_arrival(link, s);
        if (n < 0) return s + 1;
        link->recv_rows[s] = n;
        for (int64_t i = 0; i < n; i++) {
            const char *row = hybridep_row(g, link->local, s, i);
            const char *meta = hybridep_meta(g, link->local, s, i);
            const int32_t *dst = (const int32_t *)meta;
            const double *pr = (const double *)(meta + g->meta_prob_offset);
            int64_t *saved = link->recv_meta + ((int64_t)s * g->rows_cap + i) * K;
            for (int64_t k = 0; k < K; k++) {
                const int64_t r = dst[k];
                saved[k] = r;
                if (r < 0) continue;
                if (out_probs) moert_store(&opv, r, pr[k]);
                memcpy((char *)out + (size_t)r * row_bytes, row, row_bytes);
            }
        }
        release_slot(link, me, s);
    }
    return 0;
}

int hybridep_cpu_combine(const hybridep_cpu_link *link, const hybridep_plan *plan, int64_t hidden,
                         const int32_t *topk_idx, const void *rows, moert_dtype rows_dtype, const void *row_probs,
                         moert_dtype row_probs_dtype, void *out, moert_dtype out_dtype, bool accumulate,
                         void *out_probs, moert_dtype out_probs_dtype)
{
    const hybridep_geometry *g = link->geo;
    const int W = plan->world, me = plan->rank;
    const int64_t T = plan->num_tokens, K = plan->topk, El = plan->num_local_experts, H = hidden;
    const bool wide = rows_dtype == MOERT_F64; /* fp64 rows sum in fp64, the others in fp32 */
    int64_t max_row = 0;
    for (int s = 0; s < W; s++)
        for (int64_t i = 0; i < link->recv_rows[s] * K; i++) {
            const int64_t r = link->recv_meta[(int64_t)s * g->rows_cap * K + i];
            if (r + 1 > max_row) max_row = r + 1;
        }
    const moert_tensor rv = flat_view(rows, rows_dtype, max_row * H);
    const moert_tensor rpv = flat_view(row_probs, row_probs_dtype, max_row);
    int stalled = wait_all_consumed(link);
    if (stalled) return stalled;
    double *acc = malloc((size_t)(H + 1) * sizeof(double));
    if (!acc) {
        snprintf(link->error, link->error_size, "out of host memory for %lld doubles", (long long)H);
        return -1;
    }

    /* expert side: one partial row per (source rank, received token), back into the source's slot for this rank */
    for (int s = 0; s < W; s++) {
        const int64_t n = link->recv_rows[s];
        for (int64_t i = 0; i < n; i++) {
            const int64_t *saved = link->recv_meta + ((int64_t)s * g->rows_cap + i) * K;
            char *row = hybridep_row(g, link->peers[s], me, i);
            char *meta = hybridep_meta(g, link->peers[s], me, i);
            double *pr = (double *)(meta + g->meta_prob_offset);
            moert_tensor pv = flat_view(row, rows_dtype, H);
            for (int64_t h = 0; h < H; h++) {
                if (wide) {
                    double a = -0.0;
                    for (int64_t k = 0; k < K; k++)
                        if (saved[k] >= 0) a += moert_load(&rv, saved[k] * H + h);
                    moert_store(&pv, h, a);
                } else {
                    float a = -0.0f;
                    for (int64_t k = 0; k < K; k++)
                        if (saved[k] >= 0) a += (float)moert_load(&rv, saved[k] * H + h);
                    moert_store(&pv, h, a);
                }
            }
            for (int64_t k = 0; k < K; k++)
                pr[k] = (row_probs && saved[k] >= 0) ? moert_load(&rpv, saved[k]) : 0.0;
        }
        publish(link, me, s, n);
    }

    /* token side: the partials of every rank, summed in rank order (fused unpermutation: straight into y[t]) */
    for (int d = 0; d < W; d++)
        if (wait_arrival(link, d) < 0) {
            free(acc);
            return d + 1;
        }
    moert_tensor ov = flat_view(out, out_dtype, T * H);
    moert_tensor opv = flat_view(out_probs, out_probs_dtype, T * K);
    for (int64_t t = 0; t < T; t++) {
        int kept = 0;
        for (int d = 0; d < W; d++)
            kept += plan->excl[(int64_t)d * (T + 1) + t + 1] > plan->excl[(int64_t)d * (T + 1) + t];
        if (kept) {
            for (int64_t h = 0; h < H; h++) {
                double aw = accumulate ? moert_load(&ov, t * H + h) : -0.0;
                float af = accumulate ? (float)moert_load(&ov, t * H + h) : -0.0f;
                for (int d = 0; d < W; d++) {
                    const int64_t *excl = plan->excl + (int64_t)d * (T + 1);
                    if (excl[t + 1] == excl[t]) continue;
                    moert_tensor pv = flat_view(hybridep_row(g, link->local, d, excl[t]), rows_dtype, H);
                    if (wide) aw += moert_load(&pv, h);
                    else af += (float)moert_load(&pv, h);
                }
                acc[h] = wide ? aw : (double)af;
            }
            for (int64_t h = 0; h < H; h++) moert_store(&ov, t * H + h, acc[h]);
        } else if (!accumulate) {
            for (int64_t h = 0; h < H; h++) moert_store(&ov, t * H + h, 0.0);
        }
        if (out_probs)
            for (int64_t k = 0; k < K; k++) {
                const int32_t e = topk_idx[t * K + k];
                double v = 0.0;
                if (plan->copy_index[t * K + k] >= 0) {
                    const int d = (int)(e / El);
                    const char *meta = hybridep_meta(g, link->local, d, plan->excl[(int64_t)d * (T + 1) + t]);
                    v = ((const double *)(meta + g->meta_prob_offset))[k];
                }
                moert_store(&opv, t * K + k, v);
            }
    }
    free(acc);
    for (int d = 0; d < W; d++) release_slot(link, me, d);
    return 0;
}
