/* SPDX-License-Identifier: Apache-2.0 */
/* `moert ab --plot`: the figure's data as JSON beside the PNG, drawn by tools/ab_plot.py (python3, matplotlib). */
#ifndef MOERT_AB_PLOT_H
#define MOERT_AB_PLOT_H

#include <stddef.h>
#include <stdint.h>

#include "ab_stats.h"

/* What the plot shows: n steps (1..n) of each side; the first `warmup` are marked as warm-up. */
typedef struct moert_ab_plot_data {
    int64_t n, warmup;
    int nsides;                /* 2 (A, B), or 3 with --aa (A' last); 0 reads as 2 */
    const double *step_ms[3];  /* [n] per side: A, B, A' */
    const double *loss[3];     /* [n] per side */
    const char *label[3];      /* legend text per side */
    const char *const *header; /* moert ab's header lines (may be NULL): the title, and its "differs: ..." lines say
                                  in the legend what B changes */
    int header_count;
    /* the step time's B/A over the measured steps with its interval, and with --aa A'/A's (NULL: none) */
    const ab_interval *step_ratio, *step_noise;
} moert_ab_plot_data;

/* Writes the data to the JSON file beside path (FILE.png -> FILE.plot.json) and draws it into path with
 * `python3 ab_plot.py DATA.json path`. Returns 0, or -1 with a message in err naming what is missing (python3,
 * matplotlib, the script) and where the data is. */
int moert_ab_plot_png(const char *path, const moert_ab_plot_data *data, char *err, size_t err_size);

/* The data file of a plot path: FILE.png -> FILE.plot.json, any other name gets ".plot.json" appended. Its first
 * member is MOERT_AB_PLOT_DATA_MARKER, by which moert ab knows a data file it wrote (and overwrites only those). */
#define MOERT_AB_PLOT_DATA_MARKER "\"format\": \"moert ab plot data\""
void moert_ab_plot_data_path(const char *png_path, char *out, size_t size);

#endif
