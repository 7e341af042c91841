/* SPDX-License-Identifier: Apache-2.0 */
/* Output files (reports, tables, plots): checked before a run starts and written atomically. */
#ifndef MOERT_HARNESS_OUTPUT_H
#define MOERT_HARNESS_OUTPUT_H

#include <stdbool.h>
#include <stdio.h>

#include "moert/moert.h"

/*
 * Checks, before any work starts, that `path` can take an output: it is not one of the `ninputs` input files (the
 * same file, whatever the spelling), not a symbolic link, not something other than a regular file, and its folder
 * is writable. `what` names the option in messages ("--report"). MOERT_ERR_IO with a message naming the path.
 */
moert_result moert_output_check(const char *what, const char *path, const char *const *inputs, int ninputs);

/* Whether paths a and b name the same file however they are spelt ("r.json" and "./r.json", a hard link): the same
 * existing file (device and inode), or, where either is not there yet, the same name in the same folder (folders
 * compared by their real paths). For outputs that must not land on each other. */
bool moert_output_same_file(const char *a, const char *b);

/* Checks an output whose name moert derives from another (`from`: the table beside a report, a plot's data): as
 * moert_output_check, and where it exists already it must hold `marker` in its first 256 bytes (moert wrote it),
 * else it is refused as a file the user wrote. */
moert_result moert_output_check_derived(const char *what, const char *path, const char *from, const char *marker,
                                        const char *const *inputs, int ninputs);

/* Writes the content of one output: returns 0 on success, nonzero (errno set where known) on failure. */
typedef int (*moert_output_writer)(FILE *f, void *user);

/*
 * Writes `path` atomically: `write` fills a temporary file in the same folder, which is flushed to disk and then
 * renamed over `path`. A failure leaves whatever was at `path` as it was and removes the temporary file.
 */
moert_result moert_output_write(const char *path, moert_output_writer write, void *user);

#endif
