/* SPDX-License-Identifier: Apache-2.0 */
/* The statistics of `moert ab` on synthetic timings: a planted 5% effect is found with an interval that contains it,
 * an A/A gives an interval containing no difference in at least 90% of seeded trials, and the verdicts read right. */
#include <math.h>

#include "../../tools/ab_stats.h"
#include "test_util.h"

/* A step time: 10 ms with 3% gaussian noise and, one step in twenty, a 30% stall (a shared machine). */
static double step_time(uint64_t *s, double scale)
{
    double u[3];
    for (int i = 0; i < 3; i++) {
        *s = *s * 6364136223846793005ull + 1442695040888963407ull;
        u[i] = ((double)(*s >> 11) + 0.5) / 9007199254740992.0;
    }
    double g = sqrt(-2.0 * log(u[0])) * cos(2.0 * M_PI * u[1]);
    return scale * 10.0 * (1.0 + 0.03 * g) * (u[2] < 0.05 ? 1.3 : 1.0);
}

int main(void)
{
    double a[40], b[40];
    ab_interval iv;
    char text[160];
    /* B planted 5% slower */
    uint64_t s = 7;
    for (int i = 0; i < 40; i++) a[i] = step_time(&s, 1.0), b[i] = step_time(&s, 1.05);
    EXPECT(ab_ratio_interval(a, b, 40, 1, 2000, 0.95, &iv) == 0);
    EXPECT(iv.low <= 1.05 && iv.high >= 1.05 && iv.low > 1.0);
    EXPECT(iv.high - iv.low < 0.05);
    ab_verdict_text(&iv, text, sizeof text);
    EXPECT(strncmp(text, "B slower by", 11) == 0);
    printf("planted +5%%: ratio %.4f, 95%% CI %.4f-%.4f: %s\n", iv.ratio, iv.low, iv.high, text);
    /* B planted 5% faster: the verdict says faster, with the interval as savings */
    for (int i = 0; i < 40; i++) a[i] = step_time(&s, 1.0), b[i] = step_time(&s, 0.95);
    EXPECT(ab_ratio_interval(a, b, 40, 2, 2000, 0.95, &iv) == 0);
    ab_verdict_text(&iv, text, sizeof text);
    EXPECT(strncmp(text, "B faster by", 11) == 0 && iv.high < 1.0);
    printf("planted -5%%: %s\n", text);
    /* A/A: no difference detected in at least 90% of 200 seeded trials */
    int contains = 0;
    for (int trial = 0; trial < 200; trial++) {
        uint64_t t = 1000 + (uint64_t)trial;
        for (int i = 0; i < 30; i++) a[i] = step_time(&t, 1.0), b[i] = step_time(&t, 1.0);
        EXPECT(ab_ratio_interval(a, b, 30, (uint64_t)trial, 1000, 0.95, &iv) == 0);
        contains += iv.low <= 1.0 && iv.high >= 1.0;
    }
    printf("A/A: the interval contains 1 in %d of 200 trials\n", contains);
    EXPECT(contains >= 180);
    ab_verdict_text(&(ab_interval){.ratio = 1.001, .low = 0.99, .high = 1.012, .level = 0.95}, text, sizeof text);
    EXPECT(strcmp(text, "no difference detected (95% CI -1.0% to +1.2%)") == 0);
    /* too few steps, a zero median: no interval, said so */
    EXPECT(ab_ratio_interval(a, b, 1, 1, 1000, 0.95, &iv) == -1 && isnan(iv.ratio));
    ab_verdict_text(&iv, text, sizeof text);
    EXPECT(strcmp(text, "not enough steps for an interval") == 0);
    /* ABBA: A first on odd steps, B first on even ones */
    EXPECT(!ab_b_first(1) && ab_b_first(2) && !ab_b_first(3) && ab_b_first(4));
    int order[3];
    for (int64_t step = 1; step <= 4; step++) {
        ab_step_order(step, 2, order);
        EXPECT(order[0] == ab_b_first(step) && order[1] == 1 - order[0]);
    }
    /* --aa, A B A' over 6 steps: each side once in each place, after each other side once, before B in half */
    int place[3][3] = {{0}}, after[3][3] = {{0}}, a_before_b = 0, aprime_before_a = 0;
    for (int64_t step = 7; step <= 12; step++) { /* the second cycle: the same as the first */
        ab_step_order(step, 3, order);
        int seen = 0;
        for (int k = 0; k < 3; k++) {
            place[order[k]][k]++;
            seen |= 1 << order[k];
            if (k > 0) after[order[k]][order[k - 1]]++;
        }
        EXPECT(seen == 7);
        int pos[3];
        for (int k = 0; k < 3; k++) pos[order[k]] = k;
        a_before_b += pos[0] < pos[1];
        aprime_before_a += pos[2] < pos[0];
    }
    for (int x = 0; x < 3; x++)
        for (int y = 0; y < 3; y++) {
            EXPECT_EQ_INT(place[x][y], 2);
            EXPECT_EQ_INT(after[x][y], x == y ? 0 : 2);
        }
    EXPECT(a_before_b == 3 && aprime_before_a == 3);
    ab_step_order(1, 3, order);
    EXPECT(order[0] == 0 && order[1] == 1 && order[2] == 2);
    /* the noise floor beside a verdict */
    ab_noise_text(&(ab_interval){.ratio = 1.001, .low = 0.992, .high = 1.006, .level = 0.95}, text, sizeof text);
    EXPECT(strcmp(text, "A'/A 95% CI -0.8% to +0.6%") == 0);
    ab_noise_text(&iv, text, sizeof text);
    EXPECT(strcmp(text, "A'/A not enough steps") == 0);
    return test_finish("ab_stats");
}
