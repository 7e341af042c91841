/* SPDX-License-Identifier: Apache-2.0 */
/* The statistics of `moert ab` (tools/ab_stats.c) on synthetic timings, written as JSON: each case's timings, seed,
 * resamples and level with the ratio, interval and verdict the C code gives, and the run orders. moert.ab (Python)
 * must give the same from the same inputs: python/tests/test_ab.py reads this output (this driver in the build tree,
 * else the fixture python/tests/ab_stats_fixture.json it wrote).
 *
 *   ab_stats_driver              prints the JSON
 *   ab_stats_driver FIXTURE      exits 1 unless FIXTURE holds exactly what it prints (the fixture is current) */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../tools/ab_stats.h"

/* A step time: 10 ms with 3% gaussian noise and, one step in twenty, a 30% stall (as tests/unit/test_ab_stats.c). */
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

static void number(FILE *f, double v)
{
    if (isfinite(v))
        fprintf(f, "%.17g", v);
    else
        fprintf(f, "null");
}

static void array(FILE *f, const double *v, int n)
{
    fprintf(f, "[");
    for (int i = 0; i < n; i++) {
        if (i) fprintf(f, ", ");
        number(f, v[i]);
    }
    fprintf(f, "]");
}

/* One case: B = A's generator scaled by `scale` (1: an A/A), n pairs, then the interval the C code gives. */
static void write_case(FILE *f, bool first, uint64_t data_seed, int n, double scale, uint64_t seed, int resamples,
                       double level)
{
    double a[64], b[64];
    uint64_t s = data_seed;
    for (int i = 0; i < n; i++) a[i] = step_time(&s, 1.0), b[i] = step_time(&s, scale);
    ab_interval iv;
    int rc = ab_ratio_interval(a, b, n, seed, resamples, level, &iv);
    char verdict[160], noise[96];
    ab_verdict_text(&iv, verdict, sizeof verdict);
    ab_noise_text(&iv, noise, sizeof noise);
    fprintf(f, "%s\n  {\"a\": ", first ? "" : ",");
    array(f, a, n);
    fprintf(f, ",\n   \"b\": ");
    array(f, b, n);
    fprintf(f, ",\n   \"seed\": %llu, \"resamples\": %d, \"level\": ", (unsigned long long)seed, resamples);
    number(f, level);
    fprintf(f, ", \"rc\": %d, \"ratio\": ", rc);
    number(f, iv.ratio);
    fprintf(f, ", \"ci_low\": ");
    number(f, iv.low);
    fprintf(f, ", \"ci_high\": ");
    number(f, iv.high);
    fprintf(f, ",\n   \"verdict\": \"%s\", \"noise\": \"%s\"}", verdict, noise);
}

static void write_all(FILE *f)
{
    fprintf(f, "{\"cases\": [");
    write_case(f, true, 7, 40, 1.05, 1, 2000, 0.95);                    /* planted 5% slower */
    write_case(f, false, 8, 40, 0.95, 2, 2000, 0.95);                   /* planted 5% faster */
    write_case(f, false, 1000, 30, 1.0, 3, 1000, 0.95);                 /* an A/A */
    write_case(f, false, 11, 9, 1.02, 20261126, 2000, 0.9);             /* few steps, odd count, another level */
    write_case(f, false, 12, 2, 1.0, 0xfffffffffffffff0ull, 500, 0.95); /* two steps, a seed that wraps */
    write_case(f, false, 13, 1, 1.0, 5, 2000, 0.95);                    /* too few steps: no interval */
    fprintf(f, "],\n \"orders\": {\"2\": [");
    for (int64_t step = 1; step <= 12; step++) {
        int order[3];
        ab_step_order(step, 2, order);
        fprintf(f, "%s[%d, %d]", step > 1 ? ", " : "", order[0], order[1]);
    }
    fprintf(f, "], \"3\": [");
    for (int64_t step = 1; step <= 12; step++) {
        int order[3];
        ab_step_order(step, 3, order);
        fprintf(f, "%s[%d, %d, %d]", step > 1 ? ", " : "", order[0], order[1], order[2]);
    }
    fprintf(f, "]}}\n");
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        write_all(stdout);
        return 0;
    }
    char *mine = NULL, *theirs = NULL;
    size_t mine_size = 0;
    FILE *m = open_memstream(&mine, &mine_size);
    if (!m) return 2;
    write_all(m);
    fclose(m);
    FILE *f = fopen(argv[1], "rb");
    int rc = 1;
    if (!f) {
        fprintf(stderr, "ab_stats_driver: cannot read %s\n", argv[1]);
        goto exit;
    }
    theirs = calloc(1, mine_size + 2);
    size_t got = theirs ? fread(theirs, 1, mine_size + 1, f) : 0;
    fclose(f);
    if (theirs && got == mine_size && memcmp(mine, theirs, mine_size) == 0) {
        printf("ab_stats_driver: %s is current\n", argv[1]);
        rc = 0;
    } else {
        fprintf(stderr,
                "ab_stats_driver: %s differs from what tools/ab_stats.c gives now; if the statistics changed "
                "on purpose (and moert.ab with them), rewrite it: ab_stats_driver > %s\n",
                argv[1], argv[1]);
    }
exit:
    free(mine);
    free(theirs);
    return rc;
}
