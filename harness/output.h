/* SPDX-License-Identifier: Apache-2.0 */
/* Output files (reports, tables, plots): checked before a run starts and written atomically. */
#ifndef MOERT_HARNESS_OUTPUT_H
#define MOERT_HARNESS_OUTPUT_H

#include <stdio.h>

#include "moert/moert.h"

/*
 * Checks, before any work starts, that `path` can take an output: it is not one of the `ninputs` input files (the
 * same file, whatever the spelling), not a symbolic link, not something other than a regular file, and its folder
 * is writable. `what` names the option in messages ("--report"). MOERT_ERR_IO with a message naming the path.
 */
moert_result moert_output_check(const char *what, const char *path, const char *const *inputs, int ninputs);

/* Writes the content of one output: returns 0 on success, nonzero (errno set where known) on failure. */
typedef int (*moert_output_writer)(FILE *f, void *user);

/*
 * Writes `path` atomically: `write` fills a temporary file in the same folder, which is flushed to disk and then
 * renamed over `path`. A failure leaves whatever was at `path` as it was and removes the temporary file.
 */
moert_result moert_output_write(const char *path, moert_output_writer write, void *user);

#endif
