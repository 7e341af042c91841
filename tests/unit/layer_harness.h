/* SPDX-License-Identifier: Apache-2.0 */
/* One MoE layer on one rank driven straight through the executor (no runtime), on the CPU or on a CUDA device:
 * for tests that read the layer's own state and figures (memory actions, pinned buffers).
 * Header-only (static functions); include after test_util.h. */
#ifndef MOERT_TEST_LAYER_HARNESS_H
#define MOERT_TEST_LAYER_HARNESS_H

#include "executor.h"
#include "tensor_ops.h"
#ifdef MOERT_HAVE_CUDA
#include "cuda/device.h"
#include "cuda/pool.h"
#endif

typedef struct layer_harness {
    moert_device device;
    struct moert_cuda_pool *pool; /* CUDA only */
    moert_stream stream;          /* CUDA only */
    json_t *empty_options;
    moert_section *core_section;
    moert_host *core_host;
    test_instance inst[MOERT_SLOT_COUNT]; /* router, dispatcher, precision, memory policy */
    moert_layer L;
    moert_tensor x, y, d_y, d_x; /* [T, H] on the device */
} layer_harness;

/* Copies n bytes between host memory and the harness device, waiting for the copy. */
static moert_result harness_copy(layer_harness *hz, void *dst, moert_device dst_dev, const void *src,
                                 moert_device src_dev, size_t bytes)
{
    moert_result rc = hz->core_host->memcpy_async(hz->core_host, dst, dst_dev, src, src_dev, bytes, hz->stream);
    if (rc == MOERT_OK) rc = hz->core_host->stream_synchronize(hz->core_host, hz->stream);
    if (rc != MOERT_OK) return moert_error(rc, "harness copy: %s", moert_host_take_error(hz->core_host));
    return MOERT_OK;
}

/* A [rows, cols] tensor of dtype on the device, filled with uniform values in [-scale, scale) from seed. */
static moert_result harness_tensor(layer_harness *hz, moert_tensor *t, moert_dtype dtype, int64_t rows, int64_t cols,
                                   uint64_t seed, double scale)
{
    *t = moert_tensor_2d(NULL, hz->device, dtype, rows, cols);
    size_t bytes = moert_tensor_bytes(t);
    moert_result rc = hz->core_host->alloc(hz->core_host, hz->device, bytes, &t->data);
    if (rc != MOERT_OK) return moert_error(rc, "harness alloc: %s", moert_host_take_error(hz->core_host));
    moert_tensor staged = *t;
    staged.device = moert_cpu();
    staged.data = calloc(1, bytes + 64);
    if (!staged.data) return moert_error(MOERT_ERR_OUT_OF_MEMORY, "harness staging");
    uint64_t rng = seed;
    for (int64_t i = 0; i < rows * cols; i++) moert_store(&staged, i, scale * test_uniform(&rng));
    rc = harness_copy(hz, t->data, t->device, staged.data, staged.device, bytes);
    free(staged.data);
    return rc;
}

/* Opens a layer of H, F, E experts, top-K, T tokens with activations of dtype on `device` (cpu or cuda:0), the
 * default plugins (router "topk", dispatcher "alltoall", precision "bf16"; memory policy "default" with
 * `memory_json` as its options) and `optimizer`. */
static moert_result harness_open(layer_harness *hz, moert_device device, int64_t H, int64_t F, int64_t E, int64_t K,
                                 int64_t T, moert_dtype dtype, const char *memory_json)
{
    moert_result rc = MOERT_OK;
    memset(hz, 0, sizeof *hz);
    hz->device = device;
#ifdef MOERT_HAVE_CUDA
    if (device.type == MOERT_DEVICE_CUDA) {
        MOERT_CHECK(moert_cuda_set_device(device.id));
        MOERT_CHECK(moert_cuda_pool_create(device.id, &hz->pool));
        MOERT_CHECK(moert_cuda_stream_create(device.id, &hz->stream));
    }
#endif
    hz->empty_options = json_object();
    hz->core_section = moert_section_create(hz->empty_options, "$");
    moert_host_setup setup = {.who = "core (test)",
                              .options = hz->core_section,
                              .rank = 0,
                              .world_size = 1,
                              .device = device,
                              .cuda_pool = hz->pool,
                              .stream = hz->stream};
    MOERT_CHECK(moert_host_create(&setup, &hz->core_host));

    moert_layer *L = &hz->L;
    L->info = test_layer(H, F, E, K, T, 1, 0, dtype);
    L->info.device = device;
    L->core_host = hz->core_host;
    L->stream = hz->stream;
    moert_act_store_init(&L->acts, hz->core_host, hz->stream, device, 0);
    L->param_dtype = MOERT_F32;
    static const char *const specs[MOERT_SLOT_COUNT] = {"topk", "alltoall", "bf16", "default"};
    moert_instance *slots[MOERT_SLOT_COUNT] = {&L->router, &L->dispatcher, &L->precision, &L->memory};
    for (int s = 0; s < MOERT_SLOT_COUNT; s++) {
        const char *options = s == MOERT_SLOT_MEMORY_POLICY ? memory_json : "{}";
        MOERT_CHECK(test_instance_open_cuda(&hz->inst[s], moert_slot_kind((moert_slot)s), specs[s], options, &L->info,
                                            NULL, 0, 1, hz->pool, NULL, hz->stream));
        slots[s]->plugin = &hz->inst[s].plugin;
        slots[s]->ctx = hz->inst[s].ctx;
        slots[s]->host = hz->inst[s].host;
    }
    MOERT_CHECK(moert_layer_init_params(L, 11));
    MOERT_CHECK(harness_tensor(hz, &hz->x, dtype, T, H, 101, 1.0));
    MOERT_CHECK(harness_tensor(hz, &hz->d_y, dtype, T, H, 202, 0.1));
    MOERT_CHECK(harness_tensor(hz, &hz->y, dtype, T, H, 303, 0.0));
    MOERT_CHECK(harness_tensor(hz, &hz->d_x, dtype, T, H, 404, 0.0));
fail:
    return rc;
}

/* One forward and backward (gradients zeroed first); with prefetch, moert_layer_prefetch is called between them
 * as the runtime does one layer ahead. Waits for the work. */
static moert_result harness_step(layer_harness *hz, bool prefetch)
{
    moert_result rc = MOERT_OK;
    moert_layer *L = &hz->L;
    MOERT_CHECK(moert_layer_zero_grad(L, true));
    MOERT_CHECK(moert_layer_forward(L, &hz->x, &hz->y));
    if (prefetch) MOERT_CHECK(moert_act_store_prefetch(&L->acts));
    MOERT_CHECK(moert_layer_backward(L, &hz->d_y, &hz->d_x, 1.0));
    MOERT_CHECK(moert_layer_collect_times(L));
    rc = hz->core_host->stream_synchronize(hz->core_host, hz->stream);
    if (rc != MOERT_OK) rc = moert_error(rc, "%s", moert_host_take_error(hz->core_host));
fail:
    return rc;
}

/* The raw bytes of a device tensor (malloc'd; free it). */
static void *harness_download(layer_harness *hz, const moert_tensor *t)
{
    size_t bytes = moert_tensor_bytes(t);
    void *buf = calloc(1, bytes + 64);
    if (!buf) return NULL;
    if (harness_copy(hz, buf, moert_cpu(), t->data, t->device, bytes) != MOERT_OK) {
        free(buf);
        return NULL;
    }
    return buf;
}

static void harness_close(layer_harness *hz)
{
    if (hz->core_host) {
        moert_layer_free(&hz->L);
        moert_tensor *ts[4] = {&hz->x, &hz->y, &hz->d_y, &hz->d_x};
        for (int i = 0; i < 4; i++)
            if (ts[i]->data) hz->core_host->free(hz->core_host, ts[i]->device, ts[i]->data);
    }
    for (int s = MOERT_SLOT_COUNT - 1; s >= 0; s--) test_instance_close(&hz->inst[s]);
    if (hz->core_host) moert_host_free(hz->core_host);
    moert_section_free(hz->core_section);
    if (hz->empty_options) json_decref(hz->empty_options);
#ifdef MOERT_HAVE_CUDA
    if (hz->stream) {
        (void)moert_cuda_stream_synchronize(hz->stream);
        moert_cuda_pool_forget_stream(hz->pool, hz->stream);
        moert_cuda_stream_destroy(hz->stream);
    }
    if (hz->pool) moert_cuda_pool_destroy(hz->pool);
#endif
    memset(hz, 0, sizeof *hz);
}

#endif
