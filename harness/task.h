/* SPDX-License-Identifier: Apache-2.0 */
/* The synthetic training task: reproducible random data and a fixed random teacher to regress onto. */
#ifndef MOERT_HARNESS_TASK_H
#define MOERT_HARNESS_TASK_H

#include "moert/moert.h"

/* Random streams of the task (moert_random_normal), below the streams of moert's initial parameters (16 and up), so
 * parameters and data never share numbers. */
enum {
    MOERT_STREAM_INPUT = 1,
    MOERT_STREAM_TEACHER = 2 /* 2, 3 and 4: the teacher's A, B and input mean */
};

/* target = x + scale * (silu(x A1) * (x A2)) B: a dense SwiGLU MLP with a residual, fixed by the seed. */
typedef struct moert_teacher {
    int64_t hidden, width;
    double scale;
    double *a;          /* [H, 2W] */
    double *b;          /* [W, H] */
    double *input_mean; /* [H]: inputs are N(input_mean, I), so routing starts systematically unbalanced */
} moert_teacher;

moert_result moert_teacher_create(int64_t hidden, uint64_t seed, double scale, double input_shift, moert_teacher **out);
void moert_teacher_free(moert_teacher *t);
/* Fills x [T,H] with N(input_mean, I) samples; element i takes counter first_index + i. */
void moert_teacher_sample_inputs(const moert_teacher *t, moert_tensor *x, uint64_t seed, uint64_t first_index);
/* x and target are host tensors [T, H] of any float dtype. */
void moert_teacher_apply(const moert_teacher *t, const moert_tensor *x, moert_tensor *target);

#endif
