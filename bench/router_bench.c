/* SPDX-License-Identifier: Apache-2.0 */
/* The router plugin's CUDA kernels at the presets' router shapes (tokens x experts of one rank), each call alone on
 * one GPU: the forward's scores, top-k, probs and counts; the balancing loss's plain top-k counts, values and
 * gradient; the backward's d_logits; and a device copy of the logits beside them (the memory floor). CUDA events,
 * median of 20 rounds of 10 calls after warm-up.
 *
 *   router_bench [out.json]      environment: MOERT_BENCH_MACHINE, MOERT_BENCH_GIT
 */
#include <cuda_runtime_api.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_cuda_check.h"
#include "bench_host.h"
#include "bench_record.h"
#include "router_cuda.h"

typedef struct shape {
    const char *name;
    moert_router_cuda_params p;
    int with_bias;
} shape;

typedef struct buffers {
    float *logits, *bias, *probs, *d_probs, *scores, *d_logits, *copy;
    int32_t *idx;
    int64_t *counts, *aux_counts;
    double *f, *aux_scale, *workspace, *loss_out;
} buffers;

enum kernel_kind { K_FORWARD, K_AUX_COUNTS, K_LOSS_VALUES, K_LOSS_BACKWARD, K_BACKWARD, K_COPY, K_KINDS };
static const char *const kernel_names[K_KINDS] = {"forward",       "aux_counts", "loss_values",
                                                  "loss_backward", "backward",   "logits_copy"};

static void run_kernel(int kind, const shape *s, buffers *b, cudaStream_t st)
{
    const moert_router_cuda_params *p = &s->p;
    const moert_router_cuda_loss_params lp = {.tokens = p->tokens,
                                              .num_experts = p->num_experts,
                                              .topk = p->topk,
                                              .seq_length = p->tokens,
                                              .sigmoid = p->score == MOERT_ROUTER_CUDA_SIGMOID};
    const size_t n = (size_t)(p->tokens * p->num_experts);
    switch (kind) {
    case K_FORWARD:
        MOK(moert_router_cuda_forward(&bench_host, st, p, b->logits, s->with_bias ? b->bias : NULL, b->idx, b->probs,
                                      b->counts, b->scores));
        break;
    case K_AUX_COUNTS: MOK(moert_router_cuda_aux_counts(&bench_host, st, &lp, b->logits, b->aux_counts)); break;
    case K_LOSS_VALUES:
        MOK(moert_router_cuda_loss_values(&bench_host, st, &lp, b->logits, b->f, b->aux_scale, 1, b->workspace,
                                          b->loss_out));
        break;
    case K_LOSS_BACKWARD:
        MOK(moert_router_cuda_loss_backward(&bench_host, st, &lp, b->logits, b->f, b->aux_scale, 1e-3, 1e-6,
                                            b->d_logits));
        break;
    case K_BACKWARD:
        MOK(moert_router_cuda_backward(&bench_host, st, p, b->logits, b->idx, b->d_probs, b->d_logits, 0));
        break;
    default: CK(cudaMemcpyAsync(b->copy, b->logits, n * sizeof(float), cudaMemcpyDeviceToDevice, st)); break;
    }
}

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Median microseconds of one call: 20 rounds of 10 calls after 3 rounds of warm-up. */
static double time_kernel(int kind, const shape *s, buffers *b, cudaStream_t st)
{
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    float ms[20];
    for (int round = -3; round < 20; round++) {
        CK(cudaEventRecord(e0, st));
        for (int i = 0; i < 10; i++) run_kernel(kind, s, b, st);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        if (round >= 0) CK(cudaEventElapsedTime(&ms[round], e0, e1));
    }
    qsort(ms, 20, sizeof ms[0], cmp_float);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    return 0.5 * (ms[9] + ms[10]) * 1e3 / 10.0;
}

static void *device_alloc(size_t bytes)
{
    void *p = NULL;
    CK(cudaMalloc(&p, bytes));
    CK(cudaMemset(p, 0, bytes));
    return p;
}

int main(int argc, char **argv)
{
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "router_bench: no CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    /* the presets' routers on one rank: tokens_per_rank x num_experts (configs/) */
    const shape shapes[] = {
        {"qwen3-30b-a3b (8192 tokens, 128 experts, top-8, softmax)",
         {.tokens = 8192, .num_experts = 128, .topk = 8, .score = MOERT_ROUTER_CUDA_SOFTMAX_PRE, .normalize = 1},
         0},
        {"deepseek-v3 (4096 tokens, 256 experts, top-8, sigmoid + bias, 8 groups top-4)",
         {.tokens = 4096,
          .num_experts = 256,
          .topk = 8,
          .score = MOERT_ROUTER_CUDA_SIGMOID,
          .num_groups = 8,
          .group_topk = 4,
          .normalize = 1,
          .scaling_factor = 2.5},
         1},
        {"mixtral-8x7b (8192 tokens, 8 experts, top-2, softmax)",
         {.tokens = 8192, .num_experts = 8, .topk = 2, .score = MOERT_ROUTER_CUDA_SOFTMAX_POST},
         0},
    };
    const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);
    double us[3][K_KINDS];
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    printf("device: %s; median microseconds of one call\n", prop.name);
    for (int si = 0; si < nshapes; si++) {
        const shape *s = &shapes[si];
        const int64_t T = s->p.tokens, E = s->p.num_experts, K = s->p.topk;
        const size_t n = (size_t)(T * E);
        buffers b = {0};
        b.logits = device_alloc(n * sizeof(float));
        b.scores = device_alloc(n * sizeof(float));
        b.d_logits = device_alloc(n * sizeof(float));
        b.copy = device_alloc(n * sizeof(float));
        b.bias = device_alloc((size_t)E * sizeof(float));
        b.probs = device_alloc((size_t)(T * K) * sizeof(float));
        b.d_probs = device_alloc((size_t)(T * K) * sizeof(float));
        b.idx = device_alloc((size_t)(T * K) * sizeof(int32_t));
        b.counts = device_alloc((size_t)E * sizeof(int64_t));
        b.aux_counts = device_alloc((size_t)(E + 1) * sizeof(int64_t));
        b.f = device_alloc((size_t)E * sizeof(double));
        b.aux_scale = device_alloc(sizeof(double));
        b.workspace = device_alloc(MOERT_ROUTER_CUDA_LOSS_WORKSPACE_DOUBLES * sizeof(double));
        b.loss_out = device_alloc(2 * sizeof(double));
        /* logits and the other inputs: a fixed pseudo-random draw (the times do not depend on the values) */
        float *h = malloc(n * sizeof(float));
        uint64_t x = 0x9e3779b97f4a7c15ull;
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            h[i] = (float)((double)(x >> 11) / 9007199254740992.0 * 4.0 - 2.0);
        }
        CK(cudaMemcpy(b.logits, h, n * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b.d_probs, h, (size_t)(T * K) * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(b.bias, h, (size_t)E * sizeof(float), cudaMemcpyHostToDevice));
        free(h);
        run_kernel(K_FORWARD, s, &b, st); /* the ids the backward reads */
        CK(cudaStreamSynchronize(st));
        printf("%s\n", s->name);
        for (int k = 0; k < K_KINDS; k++) {
            us[si][k] = time_kernel(k, s, &b, st);
            printf("  %-14s %8.2f us\n", kernel_names[k], us[si][k]);
        }
        CK(cudaFree(b.logits));
        CK(cudaFree(b.scores));
        CK(cudaFree(b.d_logits));
        CK(cudaFree(b.copy));
        CK(cudaFree(b.bias));
        CK(cudaFree(b.probs));
        CK(cudaFree(b.d_probs));
        CK(cudaFree(b.idx));
        CK(cudaFree(b.counts));
        CK(cudaFree(b.aux_counts));
        CK(cudaFree(b.f));
        CK(cudaFree(b.aux_scale));
        CK(cudaFree(b.workspace));
        CK(cudaFree(b.loss_out));
    }
    if (argc > 1) {
        FILE *f = bench_record_open(argv[1], "build-gpu/bench/router_bench OUT.json", prop.name);
        if (!f) return 1;
        fprintf(f, " \"unit\": \"us\",\n \"results\": [\n");
        for (int si = 0; si < nshapes; si++) {
            fprintf(f, "  {\"shape\": \"%s\"", shapes[si].name);
            for (int k = 0; k < K_KINDS; k++) fprintf(f, ", \"%s\": %.2f", kernel_names[k], us[si][k]);
            fprintf(f, "}%s\n", si + 1 < nshapes ? "," : "");
        }
        fprintf(f, " ]\n}\n");
        fclose(f);
    }
    CK(cudaStreamDestroy(st));
    return 0;
}
