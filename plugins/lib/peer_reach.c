/* SPDX-License-Identifier: Apache-2.0 */
/* The peer-access check of the NVLink dispatchers over a reachability matrix (see peer_reach.h). */
#include "peer_reach.h"

#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

/* Appends to msg (size bytes) at *at; past the end, marks the cut with "..." once. */
static void append(char *msg, size_t size, size_t *at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *msg, size_t size, size_t *at, const char *fmt, ...)
{
    if (*at >= size) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg + *at, size - *at, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= size - *at) { /* cut: end the text with "..." */
        if (size >= 4) memcpy(msg + size - 4, "...", 4);
        *at = size;
        return;
    }
    *at += (size_t)n;
}

int peer_reach_unreachable(int world, const unsigned char *reach, const char *const *where, const char *dispatcher,
                           char *msg, size_t size)
{
    int missing = 0;
    for (int a = 0; a < world; a++)
        for (int b = 0; b < world; b++) missing += a != b && !reach[a * world + b];
    if (size) msg[0] = '\0';
    if (!missing || !size) return missing;

    size_t at = 0;
    append(msg, size, &at,
           "the %s dispatcher writes into every other rank's GPU memory by peer access (NVLink or PCIe "
           "P2P), but ",
           dispatcher);
    bool first_rank = true;
    for (int a = 0; a < world; a++) {
        int count = 0;
        for (int b = 0; b < world; b++) count += a != b && !reach[a * world + b];
        if (!count) continue;
        append(msg, size, &at, "%srank %d", first_rank ? "" : "; ", a);
        if (where && where[a]) append(msg, size, &at, " (%s)", where[a]);
        append(msg, size, &at, " cannot reach rank%s ", count == 1 ? "" : "s");
        bool first_peer = true;
        for (int b = 0; b < world; b++) {
            if (a == b || reach[a * world + b]) continue;
            append(msg, size, &at, "%s%d", first_peer ? "" : ", ", b);
            if (where && where[b]) append(msg, size, &at, " (%s)", where[b]);
            first_peer = false;
        }
        first_rank = false;
    }
    append(msg, size, &at,
           "; use the \"alltoall\" dispatcher, or \"hierarchical\" with ranks_per_node set to the ranks "
           "of one NVLink domain (both go through NCCL, which crosses hosts)");
    return missing;
}
