/* SPDX-License-Identifier: Apache-2.0 */
/* The statistics of `moert ab`: the ratio B/A of a figure over paired steps, with a bootstrap confidence interval,
 * and the one-line verdict a reader can trust ("B faster by 4.1% (95% CI 3.2-5.0%)"). */
#ifndef MOERT_TOOLS_AB_STATS_H
#define MOERT_TOOLS_AB_STATS_H

#include <stddef.h>
#include <stdint.h>

typedef struct ab_interval {
    double ratio;     /* median(B) / median(A) over the paired steps */
    double low, high; /* the percentile bootstrap interval of that ratio */
    double level;     /* e.g. 0.95 */
    int64_t pairs;    /* steps with both figures */
} ab_interval;

/* The ratio of medians B/A over n paired steps and its `level` interval: `resamples` bootstrap resamples of the step
 * indices (pairs kept together, so a slow moment of the machine weighs on both sides), drawn from `seed`. Returns -1
 * when there are fewer than 2 pairs or A's median is 0 (out->ratio is NAN then). */
int ab_ratio_interval(const double *a, const double *b, int64_t n, uint64_t seed, int resamples, double level,
                      ab_interval *out);

/* The verdict of a timing interval: "B faster by 4.1% (95% CI 3.2% to 5.0%)", "B slower by ...", or "no difference
 * detected (95% CI -1.1% to +0.8%)"; for a figure where lower is better (times). */
void ab_verdict_text(const ab_interval *iv, char *out, size_t size);

/* The order of a step's two runs: 0 when A runs first. ABBA over pairs of steps (A,B then B,A), so neither side
 * always runs first after the other's work. */
int ab_b_first(int64_t step);

/* The order of a step's runs of nsides sides (2: A, B; 3: A, B and A', a second copy of A for an A/A beside the A/B):
 * order[k] is the side (0 A, 1 B, 2 A') that runs k-th. Two sides: ABBA as ab_b_first. Three: the six orders of the
 * three in turn (A B A', B A' A, A' A B, A A' B, B A A', A' B A), so over 6 steps every side runs in every place,
 * right after every other side, and before each other side, equally often. */
void ab_step_order(int64_t step, int nsides, int order[3]);

/* The A/A's interval written beside a B/A verdict, the machine's noise floor: "A'/A 95% CI -0.8% to +1.2%", or
 * "A'/A not enough steps". */
void ab_noise_text(const ab_interval *aa, char *out, size_t size);

#endif
