/* `moert ab --plot`: draws step time and loss of both sides into an RGB buffer and writes it as a PNG.
 * The PNG encoder is the smallest valid one: zlib "stored" (uncompressed) deflate blocks, CRC-32 and
 * Adler-32 computed here, so the plot needs no library and always works. */
#include "ab_plot.h"

#include "moert/moert.h"
#include "output.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- PNG ---- */

/* CRC-32 (ISO-HDLC, as PNG chunks use) of buf, continuing from crc (start with 0). */
static uint32_t crc32_update(uint32_t crc, const uint8_t *buf, size_t len)
{
    static uint32_t table[256];
    static int table_ready = 0;
    if (!table_ready) {
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t c = n;
            for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
            table[n] = c;
        }
        table_ready = 1;
    }
    crc = ~crc;
    for (size_t i = 0; i < len; i++) crc = table[(crc ^ buf[i]) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* Adler-32 of buf: the checksum that ends a zlib stream. */
static uint32_t adler32(const uint8_t *buf, size_t len)
{
    uint32_t a = 1, b = 0;
    for (size_t i = 0; i < len; i++) {
        a = (a + buf[i]) % 65521u;
        b = (b + a) % 65521u;
    }
    return (b << 16) | a;
}

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* Writes one chunk: length, type, data, CRC of type and data. */
static int write_chunk(FILE *f, const char type[4], const uint8_t *data, uint32_t len)
{
    uint8_t head[8], tail[4];
    put_be32(head, len);
    memcpy(head + 4, type, 4);
    uint32_t crc = crc32_update(0, head + 4, 4);
    crc = crc32_update(crc, data, len);
    put_be32(tail, crc);
    if (fwrite(head, 1, 8, f) != 8) return -1;
    if (len && fwrite(data, 1, len, f) != len) return -1;
    return fwrite(tail, 1, 4, f) == 4 ? 0 : -1;
}

/* The PNG's bytes, for moert_output_write. */
typedef struct png_parts {
    const uint8_t *signature, *ihdr, *z;
    uint32_t z_size;
} png_parts;

static int write_png_parts(FILE *f, void *user)
{
    const png_parts *p = user;
    if (fwrite(p->signature, 1, 8, f) != 8 || write_chunk(f, "IHDR", p->ihdr, 13) != 0 ||
        write_chunk(f, "IDAT", p->z, p->z_size) != 0 || write_chunk(f, "IEND", NULL, 0) != 0)
        return -1;
    return 0;
}

int moert_png_write_rgb(const char *path, const uint8_t *rgb, int width, int height)
{
    static const uint8_t signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
    size_t row = 1 + 3 * (size_t)width; /* filter byte 0 ("none"), then the pixels */
    size_t raw_size = row * (size_t)height;
    size_t blocks = (raw_size + 65534) / 65535;
    size_t z_size = 2 + raw_size + 5 * blocks + 4;
    uint8_t *raw = malloc(raw_size), *z = malloc(z_size);
    int rc = -1;
    if (!raw || !z) {
        errno = ENOMEM;
        goto exit;
    }
    for (int y = 0; y < height; y++) {
        raw[y * row] = 0;
        memcpy(raw + y * row + 1, rgb + (size_t)y * 3 * (size_t)width, 3 * (size_t)width);
    }
    /* zlib stream: header (deflate, 32K window, no preset dictionary), stored blocks, Adler-32 */
    size_t at = 0;
    z[at++] = 0x78;
    z[at++] = 0x01;
    for (size_t done = 0; done < raw_size;) {
        size_t len = raw_size - done < 65535 ? raw_size - done : 65535;
        z[at++] = done + len == raw_size ? 1 : 0; /* BFINAL on the last block, BTYPE 00 (stored) */
        z[at++] = (uint8_t)(len & 0xFF);
        z[at++] = (uint8_t)(len >> 8);
        z[at++] = (uint8_t)(~len & 0xFF);
        z[at++] = (uint8_t)((~len >> 8) & 0xFF);
        memcpy(z + at, raw + done, len);
        at += len;
        done += len;
    }
    put_be32(z + at, adler32(raw, raw_size));
    at += 4;

    uint8_t ihdr[13];
    put_be32(ihdr, (uint32_t)width);
    put_be32(ihdr + 4, (uint32_t)height);
    ihdr[8] = 8;  /* bits per channel */
    ihdr[9] = 2;  /* colour type: RGB */
    ihdr[10] = 0; /* compression: deflate */
    ihdr[11] = 0; /* filter method 0 */
    ihdr[12] = 0; /* no interlace */
    /* written atomically: a failed write leaves the previous plot in place */
    png_parts parts = {signature, ihdr, z, (uint32_t)at};
    if (moert_output_write(path, write_png_parts, &parts) != MOERT_OK) {
        errno = EIO;
        goto exit;
    }
    rc = 0;
exit:
    free(raw);
    free(z);
    return rc;
}

/* ---- drawing ---- */

typedef struct canvas {
    int w, h;
    uint8_t *rgb;
} canvas;

typedef struct color {
    uint8_t r, g, b;
} color;

static const color BLACK = {0, 0, 0}, GRID = {225, 225, 225}, SHADE = {242, 242, 242},
                   TEXT_GRAY = {110, 110, 110};
static const color SIDE_COLOR[2] = {{31, 119, 180}, {255, 127, 14}}; /* A blue, B orange */

static void put_pixel(canvas *c, int x, int y, color col)
{
    if (x < 0 || y < 0 || x >= c->w || y >= c->h) return;
    uint8_t *p = c->rgb + 3 * ((size_t)y * (size_t)c->w + (size_t)x);
    p[0] = col.r;
    p[1] = col.g;
    p[2] = col.b;
}

static void fill_rect(canvas *c, int x0, int y0, int x1, int y1, color col)
{
    for (int y = y0; y <= y1; y++)
        for (int x = x0; x <= x1; x++) put_pixel(c, x, y, col);
}

/* Bresenham's line, `width` pixels thick (a square brush). */
static void draw_line(canvas *c, int x0, int y0, int x1, int y1, int width, color col)
{
    int dx = abs(x1 - x0), dy = -abs(y1 - y0), sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1, e = dx + dy;
    int lo = -(width - 1) / 2, hi = width / 2;
    for (;;) {
        fill_rect(c, x0 + lo, y0 + lo, x0 + hi, y0 + hi, col);
        if (x0 == x1 && y0 == y1) break;
        int e2 = 2 * e;
        if (e2 >= dy) {
            e += dy;
            x0 += sx;
        }
        if (e2 <= dx) {
            e += dx;
            y0 += sy;
        }
    }
}

/* A 5x7 font: each glyph is 7 rows, the low 5 bits of a row are its pixels (bit 4 leftmost). Lower case
 * letters are drawn as upper case; characters not listed are drawn as blanks. */
typedef struct glyph {
    char ch;
    uint8_t rows[7];
} glyph;

static const glyph FONT[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}}, {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}}, {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}}, {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}}, {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}}, {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'A', {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11}}, {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}}, {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}}, {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}}, {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}}, {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}}, {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
    {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}}, {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
    {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
    {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}}, {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
    {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}}, {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}}, {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}}, {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
    {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}}, {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}}, {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
    {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}}, {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}}, {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}}, {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}}, {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}}, {'"', {0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00, 0x00}},
};

/* Draws text with its top-left corner at (x, y); each font pixel becomes a scale x scale square. */
static void draw_text(canvas *c, int x, int y, const char *text, int scale, color col)
{
    for (; *text; text++, x += 6 * scale) {
        char ch = (*text >= 'a' && *text <= 'z') ? (char)(*text - 'a' + 'A') : *text;
        for (size_t g = 0; g < sizeof FONT / sizeof FONT[0]; g++) {
            if (FONT[g].ch != ch) continue;
            for (int row = 0; row < 7; row++)
                for (int bit = 0; bit < 5; bit++)
                    if (FONT[g].rows[row] & (0x10 >> bit))
                        fill_rect(c, x + bit * scale, y + row * scale, x + bit * scale + scale - 1,
                                  y + row * scale + scale - 1, col);
            break;
        }
    }
}

static int text_width(const char *text, int scale)
{
    return (int)strlen(text) * 6 * scale;
}

/* One panel: a frame with y grid lines and labels, the warm-up steps shaded, and a line per side. With
 * measured_range, the y range covers the measured steps only (a first step that includes start-up costs would
 * flatten the rest); warm-up points outside it are drawn at the edge. */
static void draw_panel(canvas *c, int x0, int y0, int w, int h, const char *title, const moert_ab_plot_data *d,
                       const double *const series[2], bool measured_range)
{
    double lo = INFINITY, hi = -INFINITY;
    int64_t first = measured_range && d->warmup < d->n ? d->warmup : 0;
    for (int s = 0; s < 2; s++)
        for (int64_t i = first; i < d->n; i++)
            if (isfinite(series[s][i])) {
                if (series[s][i] < lo) lo = series[s][i];
                if (series[s][i] > hi) hi = series[s][i];
            }
    if (!(lo <= hi)) lo = 0, hi = 1;
    double pad = hi > lo ? 0.05 * (hi - lo) : (fabs(hi) > 0 ? 0.05 * fabs(hi) : 1.0);
    lo -= pad;
    hi += pad;

    draw_text(c, x0, y0 - 22, title, 2, BLACK);
    /* x of step i (1-based) and y of value v */
#define PX(i) (d->n > 1 ? x0 + (int)lround((double)((i) - 1) * (w - 1) / (double)(d->n - 1)) : x0 + w / 2)
#define PY(v) (y0 + h - 1 - (int)lround(fmin(fmax(((v) - lo) / (hi - lo), 0.0), 1.0) * (h - 1)))
    if (d->warmup > 0 && d->n > 1) {
        int xw = d->warmup < d->n ? (PX(d->warmup) + PX(d->warmup + 1)) / 2 : x0 + w - 1;
        fill_rect(c, x0, y0, xw, y0 + h - 1, SHADE);
        draw_text(c, x0 + 4, y0 + h - 12, "warm-up", 1, TEXT_GRAY);
    }
    char label[64];
    for (int t = 0; t <= 4; t++) {
        double v = lo + (hi - lo) * t / 4.0;
        int y = PY(v);
        for (int x = x0; x < x0 + w; x += 2) put_pixel(c, x, y, GRID);
        snprintf(label, sizeof label, "%.4g", v);
        draw_text(c, x0 - 8 - text_width(label, 1), y - 3, label, 1, BLACK);
    }
    for (int t = 0; t <= 4 && d->n > 0; t++) {
        int64_t step = 1 + (int64_t)lround((double)(d->n - 1) * t / 4.0);
        if (t > 0 && step == 1 + (int64_t)lround((double)(d->n - 1) * (t - 1) / 4.0)) continue;
        int x = PX(step);
        draw_line(c, x, y0 + h, x, y0 + h + 4, 1, BLACK);
        snprintf(label, sizeof label, "%lld", (long long)step);
        draw_text(c, x - text_width(label, 1) / 2, y0 + h + 8, label, 1, BLACK);
    }
    /* A thick, B thin on top: where the two agree, both stay visible */
    for (int s = 0; s < 2; s++) {
        int width = s == 0 ? 4 : 2;
        for (int64_t i = 1; i <= d->n; i++) {
            if (!isfinite(series[s][i - 1])) continue;
            int x = PX(i), y = PY(series[s][i - 1]);
            if (d->n <= 60) fill_rect(c, x - width, y - width, x + width, y + width, SIDE_COLOR[s]);
            if (i > 1 && isfinite(series[s][i - 2])) draw_line(c, PX(i - 1), PY(series[s][i - 2]), x, y, width, SIDE_COLOR[s]);
        }
    }
#undef PX
#undef PY
    draw_line(c, x0 - 1, y0 - 1, x0 + w, y0 - 1, 1, BLACK);
    draw_line(c, x0 - 1, y0 + h, x0 + w, y0 + h, 1, BLACK);
    draw_line(c, x0 - 1, y0 - 1, x0 - 1, y0 + h, 1, BLACK);
    draw_line(c, x0 + w, y0 - 1, x0 + w, y0 + h, 1, BLACK);
}

int moert_ab_plot_png(const char *path, const moert_ab_plot_data *d, char *err, size_t err_size)
{
    const int width = 900, height = 640, left = 90, plot_w = width - left - 30, panel_h = 210;
    canvas c = {width, height, malloc((size_t)width * height * 3)};
    if (!c.rgb) {
        snprintf(err, err_size, "out of memory drawing the plot");
        return -1;
    }
    memset(c.rgb, 255, (size_t)width * height * 3);
    /* legend */
    for (int s = 0; s < 2; s++) {
        int y = 12 + 22 * s;
        fill_rect(&c, left, y + 4, left + 30, y + 8, SIDE_COLOR[s]);
        char text[160];
        snprintf(text, sizeof text, "%s: %s", s == 0 ? "A" : "B", d->label[s] ? d->label[s] : "");
        draw_text(&c, left + 40, y, text, 2, BLACK);
    }
    const double *times[2] = {d->step_ms[0], d->step_ms[1]}, *losses[2] = {d->loss[0], d->loss[1]};
    draw_panel(&c, left, 90, plot_w, panel_h, "step time (ms)", d, times, true);
    draw_panel(&c, left, 90 + panel_h + 70, plot_w, panel_h, "loss", d, losses, false);
    draw_text(&c, left + plot_w / 2 - text_width("step", 2) / 2, height - 26, "step", 2, BLACK);
    int rc = moert_png_write_rgb(path, c.rgb, width, height);
    if (rc != 0 && errno == ENOMEM)
        snprintf(err, err_size, "writing %s: %s", path, strerror(errno));
    else if (rc != 0)
        snprintf(err, err_size, "%s", moert_last_error());
    free(c.rgb);
    return rc;
}
