/* SPDX-License-Identifier: Apache-2.0 */
/* The statistics of `moert ab` (ab_stats.h). */
#include "ab_stats.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int compare_doubles(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

/* The median of n values (sorted in place). */
static double median_of(double *v, int64_t n)
{
    qsort(v, (size_t)n, sizeof *v, compare_doubles);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* A small, seeded generator (splitmix64): the same seed gives the same intervals on every machine. */
static uint64_t next_random(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int ab_ratio_interval(const double *a, const double *b, int64_t n, uint64_t seed, int resamples, double level,
                      ab_interval *out)
{
    memset(out, 0, sizeof *out);
    out->ratio = out->low = out->high = NAN;
    out->level = level;
    out->pairs = n;
    if (n < 2 || resamples < 10) return -1;
    double *sa = malloc(sizeof(double) * (size_t)n), *sb = malloc(sizeof(double) * (size_t)n);
    double *ratios = malloc(sizeof(double) * (size_t)resamples);
    int rc = -1;
    if (!sa || !sb || !ratios) goto exit;
    memcpy(sa, a, sizeof(double) * (size_t)n);
    memcpy(sb, b, sizeof(double) * (size_t)n);
    double ma = median_of(sa, n), mb = median_of(sb, n);
    if (!(ma > 0.0)) goto exit;
    out->ratio = mb / ma;
    uint64_t state = seed;
    int kept = 0;
    for (int r = 0; r < resamples; r++) {
        for (int64_t i = 0; i < n; i++) {
            int64_t k = (int64_t)(next_random(&state) % (uint64_t)n);
            sa[i] = a[k];
            sb[i] = b[k];
        }
        double ra = median_of(sa, n), rb = median_of(sb, n);
        if (ra > 0.0) ratios[kept++] = rb / ra;
    }
    if (kept < 10) goto exit;
    qsort(ratios, (size_t)kept, sizeof *ratios, compare_doubles);
    double tail = 0.5 * (1.0 - level);
    int lo = (int)floor(tail * (kept - 1)), hi = (int)ceil((1.0 - tail) * (kept - 1));
    out->low = ratios[lo];
    out->high = ratios[hi];
    rc = 0;
exit:
    free(sa);
    free(sb);
    free(ratios);
    return rc;
}

void ab_verdict_text(const ab_interval *iv, char *out, size_t size)
{
    if (isnan(iv->ratio) || isnan(iv->low)) {
        snprintf(out, size, "not enough steps for an interval");
        return;
    }
    int pct = (int)lround(iv->level * 100.0);
    /* as changes of B against A: negative is faster */
    double c = 100.0 * (iv->ratio - 1.0), lo = 100.0 * (iv->low - 1.0), hi = 100.0 * (iv->high - 1.0);
    if (iv->high < 1.0)
        snprintf(out, size, "B faster by %.1f%% (%d%% CI %.1f%% to %.1f%%)", -c, pct, -hi, -lo);
    else if (iv->low > 1.0)
        snprintf(out, size, "B slower by %.1f%% (%d%% CI %.1f%% to %.1f%%)", c, pct, lo, hi);
    else
        snprintf(out, size, "no difference detected (%d%% CI %+.1f%% to %+.1f%%)", pct, lo, hi);
}

int ab_b_first(int64_t step) { return step % 2 == 0; }

void ab_step_order(int64_t step, int nsides, int order[3])
{
    static const int three[6][3] = {{0, 1, 2}, {1, 2, 0}, {2, 0, 1}, {0, 2, 1}, {1, 0, 2}, {2, 1, 0}};
    if (nsides == 3) {
        const int64_t p = (step - 1) % 6;
        for (int k = 0; k < 3; k++) order[k] = three[p][k];
        return;
    }
    order[0] = ab_b_first(step);
    order[1] = 1 - order[0];
    order[2] = -1;
}

void ab_noise_text(const ab_interval *aa, char *out, size_t size)
{
    if (isnan(aa->ratio) || isnan(aa->low)) {
        snprintf(out, size, "A'/A not enough steps");
        return;
    }
    snprintf(out, size, "A'/A %d%% CI %+.1f%% to %+.1f%%", (int)lround(aa->level * 100.0), 100.0 * (aa->low - 1.0),
             100.0 * (aa->high - 1.0));
}
