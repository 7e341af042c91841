/* SPDX-License-Identifier: Apache-2.0 */
/* The benchmarks' comma-separated selections (MOERT_BENCH_VARIANTS, MOERT_BENCH_PASSES). */
#ifndef MOERT_BENCH_LIST_H
#define MOERT_BENCH_LIST_H

#include <string.h>

/* Whether the comma-separated `list` (unset or empty: all) names `name`. */
static inline int bench_list_names(const char *list, const char *name)
{
    if (!list || !*list) return 1;
    const size_t len = strlen(name);
    for (const char *p = list; (p = strstr(p, name)) != NULL; p += len)
        if ((p == list || p[-1] == ',') && (p[len] == ',' || p[len] == 0)) return 1;
    return 0;
}

#endif
