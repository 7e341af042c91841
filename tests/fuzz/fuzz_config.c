/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Config fuzz target: any bytes as a config's JSON text. Loading must either succeed or fail with a message, never
 * crash, leak or overflow; a config that loads is also taken through what its sizes feed before any plugin starts
 * (the memory estimate), its plugin sections' typed options, and an override chosen from the input's last bytes.
 * Built as a libFuzzer target with -Dfuzzer=true (clang), else driven by fuzz_driver.c (a deterministic mutator).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "memory_estimate.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Reads a plugin section the way plugins do, through the typed accessors, then checks for unknown keys. */
static void read_section(json_t *root, const char *key)
{
    char path[64];
    snprintf(path, sizeof path, "$.%s", key);
    moert_section *sec = moert_section_create(json_object_get(root, key), path);
    if (!sec) return;
    moert_section_set_describe(sec, true);
    moert_section_allow(sec, "plugin");
    int64_t i = 0;
    double x = 0;
    bool b = false;
    const char *s = NULL;
    int e = 0;
    static const char *const choices[] = {"softmax", "sigmoid", NULL};
    moert_section_int(sec, "num_sms", 24, 1, 132, "an int", &i);
    moert_section_float(sec, "capacity_factor", 0.0, 0.0, 1e6, "a float", &x);
    moert_section_bool(sec, "expert_bias", false, "a bool", &b);
    moert_section_string(sec, "recipe", "auto", "a string", &s);
    moert_section_enum(sec, "score_function", choices, 0, "an enum", &e);
    moert_section_check_unknown(sec);
    moert_section_free(sec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const char *const keys[] = {"model.hidden",       "model.num_experts",
                                       "parallel.timeout_s", "train.tokens_per_rank",
                                       "router.plugin",      "model",
                                       "train.lr",           "x.y.z"};
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    moert_config *cfg = NULL;
    if (moert_config_load_string(text, "fuzz.json", &cfg) == MOERT_OK) {
        moert_memory_estimate est;
        moert_memory_estimate_config(cfg, (int)cfg->parallel.ranks, MOERT_DEVICE_CPU, &est);
        char line[768];
        moert_memory_estimate_line(&est, line, sizeof line);
        for (int s = 0; s < MOERT_SLOT_COUNT; s++) read_section(cfg->root, moert_slot_key((moert_slot)s));
        if (size >= 2) {
            /* an override: a key chosen by the last byte, the value the input's first bytes (up to 32) */
            const char *key = keys[data[size - 1] % (sizeof keys / sizeof keys[0])];
            char value[33];
            size_t n = size - 1 < 32 ? size - 1 : 32;
            memcpy(value, data, n);
            value[n] = '\0';
            moert_config_set(cfg, key, value);
        }
    }
    moert_config_free(cfg);
    free(text);
    return 0;
}
