/* SPDX-License-Identifier: Apache-2.0 */
/* The opening of a one-GPU benchmark's JSON record (l2_ceiling, router_bench): the command, the machine
 * (MOERT_BENCH_MACHINE), one GPU, the device's name, the git revision (MOERT_BENCH_GIT) and the UTC date, each line
 * ending in a comma for the benchmark's own keys after them. Header-only, for C and CUDA C++ alike. */
#ifndef MOERT_BENCH_RECORD_H
#define MOERT_BENCH_RECORD_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* Opens `path` for writing and writes the record's first keys; NULL (after perror) when it cannot be written. */
static FILE *bench_record_open(const char *path, const char *command, const char *device)
{
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        return NULL;
    }
    char date[16];
    const time_t now = time(NULL);
    strftime(date, sizeof date, "%Y-%m-%d", gmtime(&now));
    const char *machine = getenv("MOERT_BENCH_MACHINE"), *git = getenv("MOERT_BENCH_GIT");
    fprintf(f, "{\n \"command\": \"%s\",\n \"machine\": \"%s\",\n \"gpus\": 1,\n", command,
            machine ? machine : "unknown");
    fprintf(f, " \"device\": \"%s\",\n \"git\": \"%s\",\n \"date\": \"%s\",\n", device, git ? git : "unknown", date);
    return f;
}

#endif
