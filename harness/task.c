/* SPDX-License-Identifier: Apache-2.0 */
/* The synthetic task of the trainer: reproducible inputs and the teacher function they are regressed onto. */
#include "task.h"

#include <math.h>
#include <stdlib.h>

#include "harness.h"

moert_result moert_teacher_create(int64_t hidden, uint64_t seed, double scale, double input_shift, moert_teacher **out)
{
    moert_result rc = MOERT_OK;
    moert_teacher *t = calloc(1, sizeof *t);
    HARNESS_CHECK_ALLOC(t);
    t->hidden = hidden;
    t->width = 2 * hidden < 128 ? 2 * hidden : 128; /* a narrow teacher: cheap on the CPU for big H */
    t->scale = scale;
    t->a = malloc(sizeof(double) * (size_t)(hidden * 2 * t->width));
    t->b = malloc(sizeof(double) * (size_t)(t->width * hidden));
    HARNESS_CHECK_ALLOC(t->a);
    HARNESS_CHECK_ALLOC(t->b);
    t->input_mean = malloc(sizeof(double) * (size_t)hidden);
    HARNESS_CHECK_ALLOC(t->input_mean);
    for (int64_t i = 0; i < hidden; i++)
        t->input_mean[i] = input_shift * moert_random_normal(seed, MOERT_STREAM_TEACHER + 2, (uint64_t)i);
    for (int64_t i = 0; i < hidden * 2 * t->width; i++)
        t->a[i] = moert_random_normal(seed, MOERT_STREAM_TEACHER, (uint64_t)i) / sqrt((double)hidden);
    for (int64_t i = 0; i < t->width * hidden; i++)
        t->b[i] = moert_random_normal(seed, MOERT_STREAM_TEACHER + 1, (uint64_t)i) / sqrt((double)t->width);
    *out = t;
    return MOERT_OK;
fail:
    moert_teacher_free(t);
    return rc;
}

void moert_teacher_free(moert_teacher *t)
{
    if (!t) return;
    free(t->a);
    free(t->b);
    free(t->input_mean);
    free(t);
}

void moert_teacher_sample_inputs(const moert_teacher *t, moert_tensor *x, uint64_t seed, uint64_t first_index)
{
    int64_t n = moert_tensor_numel(x);
    for (int64_t i = 0; i < n; i++)
        moert_store(x, i,
                    t->input_mean[i % t->hidden] +
                        moert_random_normal(seed, MOERT_STREAM_INPUT, first_index + (uint64_t)i));
}

void moert_teacher_apply(const moert_teacher *t, const moert_tensor *x, moert_tensor *target)
{
    int64_t h = t->hidden, w = t->width, rows = x->shape[0];
    double *xr = malloc(sizeof(double) * (size_t)h), *act = malloc(sizeof(double) * (size_t)w);
    double *u = malloc(sizeof(double) * (size_t)(2 * w));
    if (!xr || !act || !u) goto exit;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < h; i++) xr[i] = moert_load(x, r * h + i);
        for (int64_t j = 0; j < 2 * w; j++) u[j] = 0.0;
        for (int64_t i = 0; i < h; i++)
            for (int64_t j = 0; j < 2 * w; j++) u[j] += xr[i] * t->a[i * 2 * w + j];
        for (int64_t j = 0; j < w; j++) act[j] = u[j] / (1.0 + exp(-u[j])) * u[w + j];
        for (int64_t i = 0; i < h; i++) {
            double acc = 0.0;
            for (int64_t j = 0; j < w; j++) acc += act[j] * t->b[j * h + i];
            moert_store(target, r * h + i, xr[i] + t->scale * acc);
        }
    }
exit:
    free(xr);
    free(act);
    free(u);
}
