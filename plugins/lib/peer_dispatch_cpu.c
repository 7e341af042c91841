/* SPDX-License-Identifier: Apache-2.0 */
/* The NVLink dispatchers' shared CPU path (see peer_dispatch_cpu.h): plan sizes, and send/receive through peer
 * buffers with flags. */
#include "peer_dispatch_cpu.h"

#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fp8_convert.h"

/* A flat view of n elements of dtype at data, for moert_load / moert_store. */
static moert_tensor flat_view(const void *data, moert_dtype dtype, int64_t n)
{
    return moert_tensor_1d((void *)data, moert_cpu(), dtype, n);
}

int64_t peer_plan_sizes(int world, int rank, int64_t num_experts, int64_t num_local_experts, const int64_t *all_counts,
                        int64_t *tokens_per_expert, int64_t *group_start, int64_t *base)
{
    const int W = world;
    const int64_t E = num_experts, El = num_local_experts;
    int64_t num_recv = 0;
    for (int64_t l = 0; l < El; l++) {
        int64_t rows = 0;
        for (int s = 0; s < W; s++) rows += all_counts[(int64_t)s * E + (int64_t)rank * El + l];
        tokens_per_expert[l] = rows;
        if (group_start) group_start[l] = num_recv;
        num_recv += rows;
    }
    /* expert e on rank d = e / El: its group starts after the groups of d's earlier experts; inside it, the copies of
     * lower source ranks come first */
    for (int d = 0; d < W; d++) {
        int64_t start = 0;
        for (int64_t l = 0; l < El; l++) {
            const int64_t e = (int64_t)d * El + l;
            int64_t before = 0, total = 0;
            for (int s = 0; s < W; s++) {
                if (s < rank) before += all_counts[(int64_t)s * E + e];
                total += all_counts[(int64_t)s * E + e];
            }
            base[e] = start + before;
            start += total;
        }
    }
    return num_recv;
}

bool peer_cpu_wait_at_least(const int64_t *p, int64_t target, int64_t timeout_ms)
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

static peer_header *header_of(void *buf) { return (peer_header *)buf; }

int peer_cpu_wait_all_consumed(const peer_cpu_link *link)
{
    peer_header *mine = header_of(link->local);
    for (int d = 0; d < link->geo->world; d++)
        if (!peer_cpu_wait_at_least(&mine->consumed[d][0], link->seq - 1, link->timeout_ms)) {
            snprintf(link->error, link->error_size,
                     "rank %d did not read the rows of the previous call within %lld ms (timeout_ms)", d,
                     (long long)link->timeout_ms);
            return d + 1;
        }
    return 0;
}

/* Publishes this rank's rows [0, rows) in rank d's buffer for this call. */
static void publish(const peer_cpu_link *link, int d, int64_t rows)
{
    peer_flag *f = &header_of(link->peers[d])->arrived[link->rank][0];
    f->begin = 0;
    f->end = rows;
    __atomic_store_n(&f->seq, link->seq, __ATOMIC_RELEASE);
}

/* Waits for rank s's rows of this call; returns their count, or -1 after setting the message. */
static int64_t wait_arrival(const peer_cpu_link *link, int s)
{
    peer_flag *f = &header_of(link->local)->arrived[s][0];
    if (!peer_cpu_wait_at_least(&f->seq, link->seq, link->timeout_ms)) {
        snprintf(link->error, link->error_size, "rank %d did not deliver its rows within %lld ms (timeout_ms)", s,
                 (long long)link->timeout_ms);
        return -1;
    }
    return f->end - f->begin;
}

void peer_cpu_release(const peer_cpu_link *link, int s)
{
    __atomic_store_n(&header_of(link->peers[s])->consumed[link->rank][0], link->seq, __ATOMIC_RELEASE);
}

int peer_cpu_wait_released(void *local, int world, int64_t seq, int64_t timeout_ms)
{
    peer_header *mine = header_of(local);
    for (int d = 0; d < world; d++)
        if (!peer_cpu_wait_at_least(&mine->consumed[d][0], seq, timeout_ms)) return d;
    return -1;
}

float peer_fp8_quantize_block(const float *v, uint8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < PEER_FP8_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
    float scale = (amax > 0.0f && isfinite(amax)) ? PEER_FP8_MAX / amax : 1.0f;
    for (int i = 0; i < PEER_FP8_BLOCK; i++) q[i] = fp8_from_float(v[i] * scale, FP8_E4M3);
    return 1.0f / scale;
}

int peer_cpu_dispatch(const peer_cpu_link *link, const peer_cpu_route *route, int64_t hidden, bool fp8, const void *x,
                      moert_dtype x_dtype, const void *probs, moert_dtype probs_dtype, void *out, moert_dtype out_dtype,
                      void *out_probs, moert_dtype out_probs_dtype)
{
    const peer_geometry *g = link->geo;
    const int W = g->world, me = link->rank;
    const int64_t T = route->num_tokens, K = route->topk, El = route->num_local_experts, H = hidden;
    const size_t row_bytes = (size_t)H * moert_dtype_size(x_dtype);
    const moert_tensor xv = flat_view(x, x_dtype, T * H), pv = flat_view(probs, probs_dtype, T * K);
    int stalled = peer_cpu_wait_all_consumed(link);
    if (stalled) return stalled;

    float *vals = fp8 ? malloc((size_t)H * sizeof(float)) : NULL;
    if (fp8 && !vals) {
        snprintf(link->error, link->error_size, "out of host memory for %lld floats", (long long)H);
        return -1;
    }
    for (int64_t t = 0; t < T; t++) {
        if (fp8)
            for (int64_t h = 0; h < H; h++) vals[h] = (float)moert_load(&xv, t * H + h);
        for (int d = 0; d < W; d++) {
            const int64_t *excl = route->excl + (int64_t)d * (T + 1);
            if (excl[t + 1] == excl[t]) continue; /* no copy of token t on rank d */
            char *row = peer_row(g, link->peers[d], me, excl[t]);
            char *meta = peer_meta(g, link->peers[d], me, excl[t]);
            int32_t *dst = (int32_t *)meta;
            double *pr = (double *)(meta + g->meta_prob_offset);
            /* the copies of token t whose expert is on rank d: their final rows there */
            for (int64_t k = 0; k < K; k++) {
                const int64_t c = t * K + k;
                const bool here = route->copy_dst[c] >= 0 && route->topk_idx[c] / El == d;
                dst[k] = here ? (int32_t)route->copy_dst[c] : -1;
                pr[k] = (here && probs) ? moert_load(&pv, c) : 0.0;
            }
            if (!fp8) {
                memcpy(row, (const char *)x + (size_t)t * row_bytes, row_bytes);
            } else {
                float *scales = (float *)(row + H);
                for (int64_t b = 0; b < H / PEER_FP8_BLOCK; b++)
                    scales[b] = peer_fp8_quantize_block(vals + b * PEER_FP8_BLOCK, (uint8_t *)row + b * PEER_FP8_BLOCK);
            }
        }
    }
    free(vals);
    for (int d = 0; d < W; d++) publish(link, d, route->tokens_to[d]);

    const size_t out_row = (size_t)H * moert_dtype_size(out_dtype);
    moert_tensor ov = flat_view(out, out_dtype, route->num_recv * H);
    moert_tensor opv = flat_view(out_probs, out_probs_dtype, route->num_recv);
    for (int s = 0; s < W; s++) {
        const int64_t n = wait_arrival(link, s);
        if (n < 0) return s + 1;
        link->recv_rows[s] = n;
        for (int64_t i = 0; i < n; i++) {
            const char *row = peer_row(g, link->local, s, i);
            const char *meta = peer_meta(g, link->local, s, i);
            const int32_t *dst = (const int32_t *)meta;
            const double *pr = (const double *)(meta + g->meta_prob_offset);
            int64_t *saved = link->recv_meta + ((int64_t)s * g->rows_cap + i) * K;
            for (int64_t k = 0; k < K; k++) {
                const int64_t r = dst[k];
                saved[k] = r;
                if (r < 0) continue;
                if (out_probs) moert_store(&opv, r, pr[k]);
                if (!fp8) {
                    memcpy((char *)out + (size_t)r * out_row, row, out_row);
                } else {
                    const float *scales = (const float *)(row + H);
                    for (int64_t h = 0; h < H; h++)
                        moert_store(&ov, r * H + h,
                                    fp8_to_float((uint8_t)row[h], FP8_E4M3) * scales[h / PEER_FP8_BLOCK]);
                }
            }
        }
        peer_cpu_release(link, s);
    }
    return 0;
}

int peer_cpu_combine(const peer_cpu_link *link, const peer_cpu_route *route, int64_t hidden, const void *rows,
                     moert_dtype rows_dtype, const void *row_probs, moert_dtype row_probs_dtype, void *out,
                     moert_dtype out_dtype, bool accumulate, void *out_probs, moert_dtype out_probs_dtype)
{
    const peer_geometry *g = link->geo;
    const int W = g->world, me = link->rank;
    const int64_t T = route->num_tokens, K = route->topk, El = route->num_local_experts, H = hidden;
    const int64_t *excl_all = route->excl;
    const bool wide = rows_dtype == MOERT_F64; /* fp64 rows sum in fp64, the others in fp32 */
    const moert_tensor rv = flat_view(rows, rows_dtype, route->num_recv * H);
    const moert_tensor rpv = flat_view(row_probs, row_probs_dtype, route->num_recv);
    int stalled = peer_cpu_wait_all_consumed(link);
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
            char *row = peer_row(g, link->peers[s], me, i);
            char *meta = peer_meta(g, link->peers[s], me, i);
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
            for (int64_t k = 0; k < K; k++) pr[k] = (row_probs && saved[k] >= 0) ? moert_load(&rpv, saved[k]) : 0.0;
        }
        publish(link, s, n);
    }

    /* token side: the partials of every rank, summed in rank order straight into out[t] */
    for (int d = 0; d < W; d++)
        if (wait_arrival(link, d) < 0) {
            free(acc);
            return d + 1;
        }
    moert_tensor ov = flat_view(out, out_dtype, T * H);
    moert_tensor opv = flat_view(out_probs, out_probs_dtype, T * K);
    for (int64_t t = 0; t < T; t++) {
        int kept = 0;
        for (int d = 0; d < W; d++) kept += excl_all[(int64_t)d * (T + 1) + t + 1] > excl_all[(int64_t)d * (T + 1) + t];
        if (kept) {
            for (int64_t h = 0; h < H; h++) {
                if (wide) {
                    double a = accumulate ? moert_load(&ov, t * H + h) : -0.0;
                    for (int d = 0; d < W; d++) {
                        const int64_t *excl = excl_all + (int64_t)d * (T + 1);
                        if (excl[t + 1] == excl[t]) continue;
                        moert_tensor pv = flat_view(peer_row(g, link->local, d, excl[t]), rows_dtype, H);
                        a += moert_load(&pv, h);
                    }
                    acc[h] = a;
                } else {
                    float a = accumulate ? (float)moert_load(&ov, t * H + h) : -0.0f;
                    for (int d = 0; d < W; d++) {
                        const int64_t *excl = excl_all + (int64_t)d * (T + 1);
                        if (excl[t + 1] == excl[t]) continue;
                        moert_tensor pv = flat_view(peer_row(g, link->local, d, excl[t]), rows_dtype, H);
                        a += (float)moert_load(&pv, h);
                    }
                    acc[h] = a;
                }
            }
            for (int64_t h = 0; h < H; h++) moert_store(&ov, t * H + h, acc[h]);
        } else if (!accumulate) {
            for (int64_t h = 0; h < H; h++) moert_store(&ov, t * H + h, 0.0);
        }
        if (out_probs)
            for (int64_t k = 0; k < K; k++) {
                double v = 0.0;
                if (route->copy_dst[t * K + k] >= 0) {
                    const int d = (int)(route->topk_idx[t * K + k] / El);
                    const char *meta = peer_meta(g, link->local, d, excl_all[(int64_t)d * (T + 1) + t]);
                    v = ((const double *)(meta + g->meta_prob_offset))[k];
                }
                moert_store(&opv, t * K + k, v);
            }
    }
    free(acc);
    for (int d = 0; d < W; d++) peer_cpu_release(link, d);
    return 0;
}
