/* SPDX-License-Identifier: Apache-2.0 */
/* Gradient accumulation ($.train.micro_batches): a step of M micro-batches of T tokens per rank gives the loss,
 * gradients, tokens per expert and training curve of one step of M*T tokens (the same tokens: micro-batch m of
 * step s is batch s*M + m of the data stream), on one rank and across ranks; the first micro-batch's WGRAD
 * overwrites the expert gradients and the later ones add (a wrong zeroing or scale changes every expert
 * gradient). fp64 storage, so only the summation order differs. The router's z-loss (a mean over tokens) and its
 * expert-bias update (counts summed over the step's forwards) are on: both are the same over M micro-batches and
 * over one batch of their tokens. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "runtime.h"
#include "test_util.h"

static const char *config_text =
    "{\"model\": {\"hidden\": 32, \"ffn_hidden\": 24, \"num_experts\": 8, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\"},"
    " \"parallel\": {\"ranks\": %d}, \"train\": {\"tokens_per_rank\": %d, \"micro_batches\": %d, \"seed\": 3,"
    " \"lr\": 0.003, \"data\": \"%s\"},"
    " \"router\": {\"score_function\": \"sigmoid\", \"z_loss_coeff\": 0.01, \"expert_bias\": true,"
    " \"bias_update_rate\": 0.01}, \"precision\": {\"plugin\": \"%s\"}}";

static moert_runtime *make(int ranks, int tokens, int micro, const char *data, const char *precision,
                           moert_config **cfg)
{
    char json[1024];
    snprintf(json, sizeof json, config_text, ranks, tokens, micro, data, precision);
    moert_runtime *rt = NULL;
    *cfg = NULL;
    EXPECT_OK(moert_config_load_string(json, "micro-batches-test", cfg));
    if (*cfg) EXPECT_OK(moert_runtime_create(*cfg, &rt));
    return rt;
}

/* The largest difference between a and b of every parameter's gradient (grads) or value of layers from..to-1, and
 * in *largest the largest of a's; INFINITY when one cannot be read. */
static double param_difference(moert_runtime *a, moert_runtime *b, int from, int to, bool grads, double *largest)
{
    double diff = 0.0;
    *largest = 0.0;
    for (int l = from; l < to; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            const int64_t n = moert_runtime_param_numel(a, (moert_param_id)p);
            for (int64_t i = 0; i < n; i++) {
                double va = 0, ga = 0, vb = 0, gb = 0;
                if (moert_runtime_param(a, l, (moert_param_id)p, i, MOERT_PARAM_READ, &va, &ga) != MOERT_OK ||
                    moert_runtime_param(b, l, (moert_param_id)p, i, MOERT_PARAM_READ, &vb, &gb) != MOERT_OK)
                    return INFINITY;
                const double x = grads ? ga : va, y = grads ? gb : vb;
                if (fabs(x - y) > diff) diff = fabs(x - y);
                if (fabs(x) > *largest) *largest = fabs(x);
            }
        }
    return diff;
}

/* The largest difference of every parameter's gradient between a and b, relative to the largest gradient. */
static double gradient_difference(moert_runtime *a, moert_runtime *b, int layers)
{
    double largest = 0.0;
    const double diff = param_difference(a, b, 0, layers, true, &largest);
    return largest > 0 ? diff / largest : INFINITY;
}

/* M micro-batches of T tokens against one batch of M*T, on `ranks` ranks: the first step's loss and gradients, then
 * a few Adam steps' losses, tokens per expert and parameters. */
static void compare(int ranks, int tokens, int micro)
{
    moert_config *ca = NULL, *cb = NULL;
    moert_runtime *split = make(ranks, tokens, micro, "fresh", "bf16", &ca);
    moert_runtime *whole = make(ranks, tokens * micro, 1, "fresh", "bf16", &cb);
    if (!split || !whole) {
        test_failures++;
        goto done;
    }
    double loss_split = 0, loss_whole = 0;
    EXPECT_OK(moert_runtime_forward_backward(split, 1, &loss_split));
    EXPECT_OK(moert_runtime_forward_backward(whole, 1, &loss_whole));
    const double grad_diff = gradient_difference(split, whole, 2);
    printf("%d rank(s), %d micro-batches of %d tokens vs one of %d: loss %.15f / %.15f, gradients differ by %.2e "
           "(relative to the largest)\n",
           ranks, micro, tokens, tokens * micro, loss_split, loss_whole, grad_diff);
    EXPECT_NEAR(loss_split, loss_whole, 0, 1e-12);
    EXPECT(grad_diff < 1e-11);
    /* the check can fail: one micro-batch alone (the second's gradients lost) is far off */
    moert_config *cc = NULL;
    moert_runtime *half = make(ranks, tokens, 1, "fresh", "bf16", &cc);
    if (half) {
        double loss_half = 0;
        EXPECT_OK(moert_runtime_forward_backward(half, 1, &loss_half));
        EXPECT(gradient_difference(half, whole, 2) > 1e-3);
    }
    moert_runtime_destroy(half);
    moert_config_free(cc);

    for (int64_t step = 1; step <= 4; step++) {
        moert_step_record ra, rb;
        EXPECT_OK(moert_runtime_step(split, step, &ra));
        EXPECT_OK(moert_runtime_step(whole, step, &rb));
        EXPECT_NEAR(ra.loss, rb.loss, 0, 1e-9);
        EXPECT_NEAR(ra.router_loss, rb.router_loss, 0, 1e-9);
        EXPECT_NEAR(ra.imbalance, rb.imbalance, 0, 1e-12); /* the tokens per expert of the whole step */
    }
    double largest = 0.0;
    const double value_diff = param_difference(split, whole, 1, 2, false, &largest); /* the second layer */
    printf("  after 4 Adam steps the parameters differ by at most %.2e\n", value_diff);
    EXPECT(value_diff < 1e-9);
done:
    moert_runtime_destroy(split);
    moert_runtime_destroy(whole);
    moert_config_free(ca);
    moert_config_free(cb);
}

/* Every precision plugin that overwrites grad_weight in its first WGRAD: the fp8 plugin (CPU emulation) with
 * micro-batches of repeated data gives twice the gradient of one micro-batch (the same data twice, each at half
 * weight: equal), which fails if the second WGRAD overwrote instead of adding. */
static void fp8_accumulates(void)
{
    moert_config *ca = NULL, *cb = NULL;
    moert_runtime *twice = make(1, 64, 2, "repeat", "fp8", &ca);
    moert_runtime *once = make(1, 64, 1, "repeat", "fp8", &cb);
    if (!twice || !once) {
        test_failures++;
    } else {
        double la = 0, lb = 0;
        EXPECT_OK(moert_runtime_forward_backward(twice, 1, &la));
        EXPECT_OK(moert_runtime_forward_backward(once, 1, &lb));
        const double diff = gradient_difference(twice, once, 2);
        printf("fp8: two micro-batches of the same data against one: loss %.12f / %.12f, gradients differ by %.2e\n",
               la, lb, diff);
        EXPECT_NEAR(la, lb, 0, 1e-12);
        EXPECT(diff < 1e-12);
    }
    moert_runtime_destroy(twice);
    moert_runtime_destroy(once);
    moert_config_free(ca);
    moert_config_free(cb);
}

int main(void)
{
    compare(1, 32, 2);
    compare(1, 16, 4);
    compare(2, 32, 3);
    fp8_accumulates();
    return test_finish("micro_batches");
}
