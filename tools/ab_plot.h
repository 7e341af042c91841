/* `moert ab --plot`: a PNG of step time and loss over the steps for both sides, with no library beyond libc. */
#ifndef MOERT_AB_PLOT_H
#define MOERT_AB_PLOT_H

#include <stddef.h>
#include <stdint.h>

/* What the plot shows: n steps (1..n) of each side; the first `warmup` are marked as warm-up. */
typedef struct moert_ab_plot_data {
    int64_t n, warmup;
    const double *step_ms[2]; /* [n] per side: A, B */
    const double *loss[2];    /* [n] per side */
    const char *label[2];     /* legend text per side */
} moert_ab_plot_data;

/* Draws two panels (step time in ms, loss) into an RGB image and writes it as a PNG to path.
 * Returns 0, or -1 with a message in err. */
int moert_ab_plot_png(const char *path, const moert_ab_plot_data *data, char *err, size_t err_size);

/* Writes an 8-bit RGB image (rows top to bottom, 3 bytes a pixel) as a PNG. Returns 0, or -1 (errno set). */
int moert_png_write_rgb(const char *path, const uint8_t *rgb, int width, int height);

#endif
