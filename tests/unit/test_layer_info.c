/* SPDX-License-Identifier: Apache-2.0 */
/* moert_layer_info_copy: a plugin's copy of the layer info reads no more than the struct_size the core passed. */
#include <stddef.h>
#include <stdint.h>

#include "test_util.h"

/* The size of an older core's layer info, before `twin` and `flags` were appended. */
#define LAYER_INFO_BEFORE_TWIN offsetof(moert_layer_info, twin)
/* The size of a core's layer info with `twin` but before `flags`. */
#define LAYER_INFO_BEFORE_FLAGS offsetof(moert_layer_info, flags)
/* The size of a core's layer info with `flags` but before `sm_yield`. */
#define LAYER_INFO_BEFORE_SM_YIELD offsetof(moert_layer_info, sm_yield)

static int twin_target;         /* any address, to tell a copied twin from NULL */
static int32_t sm_yield_target; /* likewise for sm_yield */

/* A layer info with every field set to a value a zeroed or garbage copy would not have. */
static moert_layer_info sample_layer(uint32_t struct_size)
{
    moert_layer_info info;
    memset(&info, 0, sizeof info);
    info.struct_size = struct_size;
    info.layer_index = 3;
    info.num_layers = 7;
    info.hidden = 64;
    info.ffn_hidden = 128;
    info.num_experts = 8;
    info.topk = 2;
    info.num_local_experts = 4;
    info.first_local_expert = 4;
    info.max_tokens = 256;
    info.dtype = MOERT_BF16;
    info.device = moert_cpu();
    info.twin = &twin_target;
    info.flags = MOERT_LAYER_OVERLAPPED;
    info.sm_yield = &sm_yield_target;
    return info;
}

/* The fields every core passes came over unchanged. */
static void expect_base_fields(const moert_layer_info *copy)
{
    moert_layer_info want = sample_layer(0);
    EXPECT_EQ_INT(copy->layer_index, want.layer_index);
    EXPECT_EQ_INT(copy->num_layers, want.num_layers);
    EXPECT_EQ_INT(copy->hidden, want.hidden);
    EXPECT_EQ_INT(copy->ffn_hidden, want.ffn_hidden);
    EXPECT_EQ_INT(copy->num_experts, want.num_experts);
    EXPECT_EQ_INT(copy->topk, want.topk);
    EXPECT_EQ_INT(copy->num_local_experts, want.num_local_experts);
    EXPECT_EQ_INT(copy->first_local_expert, want.first_local_expert);
    EXPECT_EQ_INT(copy->max_tokens, want.max_tokens);
    EXPECT_EQ_INT(copy->dtype, want.dtype);
    EXPECT_EQ_INT(copy->device.type, want.device.type);
    EXPECT_EQ_INT(copy->device.id, want.device.id);
}

/* Copies into a destination full of garbage, so that a field the helper leaves unset shows. */
static moert_layer_info copy_into_garbage(const moert_layer_info *src)
{
    moert_layer_info copy;
    memset(&copy, 0x5a, sizeof copy);
    moert_layer_info_copy(&copy, src);
    return copy;
}

/* An older core's struct, allocated to its exact size: the copy reads only those bytes (ASan reports an over-read
 * otherwise), has no twin and no flags, and says so through its struct_size. */
static void test_older_core_exact_allocation(void)
{
    const size_t older_size = LAYER_INFO_BEFORE_TWIN;
    moert_layer_info full = sample_layer((uint32_t)older_size);
    void *older = malloc(older_size);
    EXPECT(older != NULL);
    if (!older) return;
    memcpy(older, &full, older_size);

    moert_layer_info copy = copy_into_garbage((const moert_layer_info *)older);
    free(older);
    EXPECT_EQ_INT(copy.struct_size, older_size);
    expect_base_fields(&copy);
    EXPECT(!MOERT_LAYER_INFO_HAS_TWIN(&copy));
    EXPECT(!MOERT_LAYER_INFO_HAS_FLAGS(&copy));
    EXPECT(copy.twin == NULL);
    EXPECT_EQ_INT(copy.flags, 0);
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), 0);
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == NULL);
}

/* An older core's struct followed by other bytes (the caller's next data): those are not copied, even where reading
 * them would not trip ASan. */
static void test_older_core_bytes_after_ignored(void)
{
    unsigned char *buffer = malloc(sizeof(moert_layer_info));
    EXPECT(buffer != NULL);
    if (!buffer) return;
    memset(buffer, 0xa5, sizeof(moert_layer_info));
    moert_layer_info full = sample_layer((uint32_t)LAYER_INFO_BEFORE_TWIN);
    memcpy(buffer, &full, LAYER_INFO_BEFORE_TWIN);

    moert_layer_info copy = copy_into_garbage((const moert_layer_info *)buffer);
    free(buffer);
    EXPECT_EQ_INT(copy.struct_size, LAYER_INFO_BEFORE_TWIN);
    expect_base_fields(&copy);
    EXPECT(copy.twin == NULL);
    EXPECT_EQ_INT(copy.flags, 0);
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), 0);
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == NULL);
}

/* A core with `twin` but without `flags`: the twin comes over, the flags read 0. */
static void test_core_with_twin_only(void)
{
    const size_t twin_only_size = LAYER_INFO_BEFORE_FLAGS;
    moert_layer_info full = sample_layer((uint32_t)twin_only_size);
    void *twin_only = malloc(twin_only_size);
    EXPECT(twin_only != NULL);
    if (!twin_only) return;
    memcpy(twin_only, &full, twin_only_size);

    moert_layer_info copy = copy_into_garbage((const moert_layer_info *)twin_only);
    free(twin_only);
    EXPECT_EQ_INT(copy.struct_size, twin_only_size);
    expect_base_fields(&copy);
    EXPECT(MOERT_LAYER_INFO_HAS_TWIN(&copy));
    EXPECT(copy.twin == &twin_target);
    EXPECT(!MOERT_LAYER_INFO_HAS_FLAGS(&copy));
    EXPECT_EQ_INT(copy.flags, 0);
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), 0);
    EXPECT(!MOERT_LAYER_INFO_HAS_SM_YIELD(&copy));
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == NULL);
}

/* A core with `flags` but without `sm_yield`: the flags come over, the SM-yield pointer reads NULL. */
static void test_core_with_flags_only(void)
{
    const size_t flags_only_size = LAYER_INFO_BEFORE_SM_YIELD;
    moert_layer_info full = sample_layer((uint32_t)flags_only_size);
    void *flags_only = malloc(flags_only_size);
    EXPECT(flags_only != NULL);
    if (!flags_only) return;
    memcpy(flags_only, &full, flags_only_size);

    moert_layer_info copy = copy_into_garbage((const moert_layer_info *)flags_only);
    free(flags_only);
    EXPECT_EQ_INT(copy.struct_size, flags_only_size);
    expect_base_fields(&copy);
    EXPECT(copy.twin == &twin_target);
    EXPECT(MOERT_LAYER_INFO_HAS_FLAGS(&copy));
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), MOERT_LAYER_OVERLAPPED);
    EXPECT(!MOERT_LAYER_INFO_HAS_SM_YIELD(&copy));
    EXPECT(copy.sm_yield == NULL);
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == NULL);
}

/* This build's full struct: every field comes over, twin, flags and sm_yield included. */
static void test_full_size(void)
{
    moert_layer_info *full = malloc(sizeof *full);
    EXPECT(full != NULL);
    if (!full) return;
    *full = sample_layer((uint32_t)sizeof *full);

    moert_layer_info copy = copy_into_garbage(full);
    free(full);
    EXPECT_EQ_INT(copy.struct_size, sizeof copy);
    expect_base_fields(&copy);
    EXPECT(MOERT_LAYER_INFO_HAS_TWIN(&copy));
    EXPECT(copy.twin == &twin_target);
    EXPECT(MOERT_LAYER_INFO_HAS_FLAGS(&copy));
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), MOERT_LAYER_OVERLAPPED);
    EXPECT(MOERT_LAYER_INFO_HAS_SM_YIELD(&copy));
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == &sm_yield_target);
}

/* A newer core's larger struct: only this build's fields are copied, and struct_size says this build's size. */
static void test_newer_core(void)
{
    const size_t newer_size = sizeof(moert_layer_info) + 16;
    unsigned char *newer = malloc(newer_size);
    EXPECT(newer != NULL);
    if (!newer) return;
    memset(newer, 0xa5, newer_size);
    moert_layer_info full = sample_layer((uint32_t)newer_size);
    memcpy(newer, &full, sizeof full);

    moert_layer_info copy = copy_into_garbage((const moert_layer_info *)newer);
    free(newer);
    EXPECT_EQ_INT(copy.struct_size, sizeof copy);
    expect_base_fields(&copy);
    EXPECT(copy.twin == &twin_target);
    EXPECT_EQ_INT(MOERT_LAYER_INFO_FLAGS(&copy), MOERT_LAYER_OVERLAPPED);
    EXPECT(MOERT_LAYER_INFO_SM_YIELD(&copy) == &sm_yield_target);
}

/* An older core's layer info, in a buffer of exactly its size, through a plugin's init: the alltoall dispatcher and
 * the bf16 recipe take it (no read past its end under ASan); one shorter than the first layer info is refused by the
 * dispatcher, naming both sizes. */
static void test_plugins_take_older_core(void)
{
    const moert_layer_info full = test_layer(16, 32, 4, 2, 8, 1, 0, MOERT_F32);
    moert_layer_info *older = malloc(MOERT_LAYER_INFO_BASE_SIZE);
    EXPECT(older != NULL);
    if (!older) return;
    memcpy(older, &full, MOERT_LAYER_INFO_BASE_SIZE);
    uint32_t size = (uint32_t)MOERT_LAYER_INFO_BASE_SIZE; /* struct_size, the first field (no whole-struct access) */
    memcpy(older, &size, sizeof size);
    static const struct {
        moert_plugin_kind kind;
        const char *spec;
    } plugins[] = {{MOERT_KIND_DISPATCHER, "alltoall"}, {MOERT_KIND_PRECISION, "bf16"}};
    for (size_t i = 0; i < sizeof plugins / sizeof plugins[0]; i++) {
        test_instance ti;
        const moert_result rc = test_instance_open(&ti, plugins[i].kind, plugins[i].spec, NULL, older, NULL, 0, 1);
        if (rc != MOERT_OK)
            fprintf(stderr, "%s with an older core's layer info: %s\n", plugins[i].spec, moert_error_message());
        EXPECT_EQ_INT(rc, MOERT_OK);
        test_instance_close(&ti);
    }
    size = (uint32_t)MOERT_LAYER_INFO_BASE_SIZE - 8;
    memcpy(older, &size, sizeof size);
    test_instance ti;
    EXPECT_EQ_INT(test_instance_open(&ti, MOERT_KIND_DISPATCHER, "alltoall", NULL, older, NULL, 0, 1),
                  MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strstr(moert_error_message(), "expected at least") != NULL);
    test_instance_close(&ti);
    free(older);
}

int main(void)
{
    test_plugins_take_older_core();
    test_older_core_exact_allocation();
    test_older_core_bytes_after_ignored();
    test_core_with_twin_only();
    test_core_with_flags_only();
    test_full_size();
    test_newer_core();
    return test_finish("test_layer_info");
}
