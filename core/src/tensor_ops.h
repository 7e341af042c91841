/* SPDX-License-Identifier: Apache-2.0 */
/* Element-wise work the executor does itself: SwiGLU, residual adds, the shared expert's gate, initial values. */
#ifndef MOERT_CORE_TENSOR_OPS_H
#define MOERT_CORE_TENSOR_OPS_H

#include "moert/moert.h"

/* out[r, j] = silu(in[r, j]) * in[r, F + j] * prob[r] for the first `rows` rows; in is [rows, 2F]. */
moert_result moert_swiglu_forward(moert_stream s, const moert_tensor *in, const moert_tensor *prob, int64_t rows,
                                  moert_tensor *out);
/* Gradients of the above: d_in [rows, 2F] overwritten, d_prob [rows] overwritten. */
moert_result moert_swiglu_backward(moert_stream s, const moert_tensor *d_out, const moert_tensor *in,
                                   const moert_tensor *prob, int64_t rows, moert_tensor *d_in, moert_tensor *d_prob);
/* y = a + b, element-wise (same shape; y may alias a). */
moert_result moert_add(moert_stream s, const moert_tensor *a, const moert_tensor *b, moert_tensor *y);
/* dst = src, converting dtype if they differ. */
moert_result moert_copy(moert_stream s, const moert_tensor *src, moert_tensor *dst);
moert_result moert_zero(moert_stream s, moert_tensor *t);
/* t[i] = value. */
moert_result moert_fill(moert_stream s, moert_tensor *t, double value);
/* The shared expert's gate: prob[r] = sigmoid(x[r] . gate) for x [T,H], gate [1,H] (fp32 on CUDA), prob [T]. */
moert_result moert_gate_forward(moert_stream s, const moert_tensor *x, const moert_tensor *gate, moert_tensor *prob);
/* Its backward: with d_logit[r] = d_prob[r] * prob[r] * (1 - prob[r]), d_x[r] += d_logit[r] * gate and
 * d_gate += sum_r d_logit[r] * x[r] (both accumulated into). */
moert_result moert_gate_backward(moert_stream s, const moert_tensor *x, const moert_tensor *gate,
                                 const moert_tensor *prob, const moert_tensor *d_prob, moert_tensor *d_x,
                                 moert_tensor *d_gate);
/* t[i] = std * normal(seed, stream, first + i) (random.h), on the tensor's device: parameter initialisation. */
moert_result moert_fill_normal_on(moert_stream s, moert_tensor *t, uint64_t seed, uint64_t stream, uint64_t first,
                                  double std);
#endif
