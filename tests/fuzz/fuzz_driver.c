/* SPDX-License-Identifier: Apache-2.0 */
/*
 * A deterministic driver for fuzz_config.c where libFuzzer is not available: runs every seed file given (files, or
 * every file of a folder), then mutates them for the given number of seconds (byte flips, deletions, duplications,
 * truncations, JSON tokens and extreme numbers inserted) with a fixed random seed, so a failure can be replayed.
 * Usage: fuzz_config_driver SECONDS SEED_FILE_OR_FOLDER...
 * A crash, or a sanitizer's report, ends the process; the input being run is then written to fuzz-crash.json (in
 * the current folder) first.
 */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Called by the sanitizers before they end the process (absent without them). */
void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

#define FUZZ_MAX_INPUT 65536
#define MAX_SEEDS      256

static uint8_t current[FUZZ_MAX_INPUT];
static size_t current_size;

/* Writes the input being run to fuzz-crash.json (async-signal-safe). */
static void save_current(void)
{
    int fd = open("fuzz-crash.json", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return;
    ssize_t ignored = write(fd, current, current_size);
    (void)ignored;
    close(fd);
    static const char msg[] = "fuzz_config_driver: the failing input is in fuzz-crash.json\n";
    ignored = write(2, msg, sizeof msg - 1);
}

static void on_signal(int sig)
{
    save_current();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void run(const uint8_t *data, size_t size)
{
    if (size > FUZZ_MAX_INPUT) size = FUZZ_MAX_INPUT;
    memcpy(current, data, size);
    current_size = size;
    LLVMFuzzerTestOneInput(current, size);
}

typedef struct seed {
    uint8_t *data;
    size_t size;
} seed;

static seed seeds[MAX_SEEDS];
static int nseeds;

static void add_seed_file(const char *path)
{
    if (nseeds == MAX_SEEDS) return;
    FILE *f = fopen(path, "rb");
    if (!f) return;
    uint8_t *buf = malloc(FUZZ_MAX_INPUT);
    size_t n = buf ? fread(buf, 1, FUZZ_MAX_INPUT, f) : 0;
    fclose(f);
    if (!buf) return;
    seeds[nseeds].data = buf;
    seeds[nseeds++].size = n;
}

static void add_seeds(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) {
        fprintf(stderr, "fuzz_config_driver: %s: no such file or folder\n", path);
        exit(2);
    }
    if (!S_ISDIR(st.st_mode)) {
        add_seed_file(path);
        return;
    }
    DIR *d = opendir(path);
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char file[4096];
        snprintf(file, sizeof file, "%s/%s", path, e->d_name);
        add_seed_file(file);
    }
    if (d) closedir(d);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint64_t next_random(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Tokens that reach the checks: structure, keys of the core's sections, extreme and odd numbers. */
static const char *const tokens[] = {
    "{",
    "}",
    "[",
    "]",
    "\"",
    ",",
    ":",
    "null",
    "true",
    "false",
    "0",
    "-1",
    "1e308",
    "-1e308",
    "1e19",
    "0.5",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551616",
    "2305843009213693953",
    "268435456",
    "65536",
    "16777216",
    "\"hidden\":",
    "\"ffn_hidden\":",
    "\"num_experts\":",
    "\"topk\":",
    "\"num_layers\":",
    "\"ranks\":",
    "\"timeout_s\":",
    "\"tokens_per_rank\":",
    "\"micro_batches\":",
    "\"plugin\":",
    "\"model\":",
    "\"parallel\":",
    "\"train\":",
    "\"router\":",
    "\\u0000",
    "\\ud800",
    "\"a\":1,\"a\":2",
    "NaN",
    "Infinity",
};

/* One mutation of buf (size in *n, room for FUZZ_MAX_INPUT). */
static void mutate(uint8_t *buf, size_t *n)
{
    size_t len = *n;
    switch (next_random() % 6) {
    case 0: /* flip a byte */
        if (len) buf[next_random() % len] ^= (uint8_t)(1u << (next_random() % 8));
        break;
    case 1: { /* delete a span */
        if (!len) break;
        size_t at = next_random() % len, span = 1 + next_random() % 16;
        if (at + span > len) span = len - at;
        memmove(buf + at, buf + at + span, len - at - span);
        len -= span;
        break;
    }
    case 2: { /* duplicate a span */
        if (!len) break;
        size_t at = next_random() % len, span = 1 + next_random() % 32;
        if (at + span > len) span = len - at;
        if (len + span > FUZZ_MAX_INPUT) break;
        size_t to = next_random() % (len + 1);
        uint8_t tmp[32];
        memcpy(tmp, buf + at, span);
        memmove(buf + to + span, buf + to, len - to);
        memcpy(buf + to, tmp, span);
        len += span;
        break;
    }
    case 3: /* truncate */
        if (len) len = next_random() % len;
        break;
    default: { /* insert a token, or replace a number with one */
        const char *t = tokens[next_random() % (sizeof tokens / sizeof tokens[0])];
        size_t tl = strlen(t);
        if (len + tl > FUZZ_MAX_INPUT) break;
        size_t to = next_random() % (len + 1);
        memmove(buf + to + tl, buf + to, len - to);
        memcpy(buf + to, t, tl);
        len += tl;
        break;
    }
    }
    *n = len;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: fuzz_config_driver SECONDS SEED_FILE_OR_FOLDER...\n");
        return 2;
    }
    double seconds = atof(argv[1]);
    for (int i = 2; i < argc; i++) add_seeds(argv[i]);
    if (nseeds == 0) {
        fprintf(stderr, "fuzz_config_driver: no seed files\n");
        return 2;
    }
    if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(save_current);
    signal(SIGSEGV, on_signal);
    signal(SIGABRT, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGFPE, on_signal);
    for (int i = 0; i < nseeds; i++) run(seeds[i].data, seeds[i].size);
    static uint8_t buf[FUZZ_MAX_INPUT];
    long runs = nseeds;
    double t0 = now_s();
    while (now_s() - t0 < seconds) {
        const seed *s = &seeds[next_random() % (uint64_t)nseeds];
        size_t n = s->size;
        memcpy(buf, s->data, n);
        int rounds = 1 + (int)(next_random() % 8);
        for (int r = 0; r < rounds; r++) mutate(buf, &n);
        run(buf, n);
        runs++;
    }
    printf("fuzz_config_driver: %ld inputs from %d seeds in %.1f s, none failed\n", runs, nseeds, now_s() - t0);
    for (int i = 0; i < nseeds; i++) free(seeds[i].data);
    return 0;
}
