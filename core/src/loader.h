/* SPDX-License-Identifier: Apache-2.0 */
/* Loader: finds plugin .so files by name or path, dlopens them, and checks their vtable header. */
#ifndef MOERT_CORE_LOADER_H
#define MOERT_CORE_LOADER_H

#include "moert/moert.h"

typedef struct moert_plugin {
    void *dl;                          /* dlopen handle */
    const moert_plugin_header *header; /* the vtable; cast by kind */
    moert_plugin_kind kind;
    char path[1024]; /* the file that was loaded */
} moert_plugin;

/* "router" -> "router", MOERT_KIND_DISPATCHER -> "dispatch" (file prefix), and readable names. */
const char *moert_kind_name(moert_plugin_kind kind);      /* "router", "dispatcher", "precision", "memory_policy" */
const char *moert_kind_file_part(moert_plugin_kind kind); /* "router", "dispatch", "precision", "memory" */

/*
 * Loads a plugin of `kind`. `spec` is a name ("alltoall" -> libmoert-dispatch-alltoall.so, looked up along
 * MOERT_PLUGIN_PATH, the build tree and the install dir) or a path (contains '/').
 * Errors: MOERT_ERR_NOT_FOUND listing every path tried (and dlerror of files that failed to load);
 * MOERT_ERR_ABI_MISMATCH naming both versions, or both kinds, or both struct sizes.
 */
moert_result moert_plugin_load(moert_plugin_kind kind, const char *spec, moert_plugin *out);
void moert_plugin_unload(moert_plugin *p);

/* Calls the plugin's init / finalize whatever its kind (every vtable has them right after its header).
 * A failing init's message (host->set_error) is returned through moert_error, prefixed with the plugin name. */
moert_result moert_plugin_init(const moert_plugin *p, void **ctx, moert_host *host, const moert_layer_info *layer);
void moert_plugin_finalize(const moert_plugin *p, void *ctx);

/* Calls fn for every plugin file found along the search path (any kind), loaded and checked; a file that
 * fails to load is reported with its error. Returns the number of files seen. */
typedef void (*moert_plugin_visit_fn)(void *user, const moert_plugin *p, const char *path, moert_result rc,
                                      const char *error);
int moert_plugin_scan(moert_plugin_visit_fn fn, void *user);

/* Opens and checks one file as a plugin of kind, labelled as `moert plugins` lists it (no init). */
moert_result moert_plugin_open_file(moert_plugin_kind kind, const char *path, moert_plugin *out);

/* What a loaded plugin's header declares, as moert_plugin_describe gives it (out->struct_size: the caller's, down to
 * the size before agreement_rtol). */
moert_result moert_plugin_description_of(const moert_plugin *p, moert_plugin_description *out);

/* moert_plugin_guard_crashes, moert_plugin_list_files, moert_plugin_search_path, moert_plugin_describe and
 * moert_plugin_list_options are public (moert/moert.h). */

#endif
