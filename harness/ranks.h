/* SPDX-License-Identifier: Apache-2.0 */
/* Running a phase of the trainer on every rank this process hosts (harness/ranks.c). */
#ifndef MOERT_HARNESS_RANKS_H
#define MOERT_HARNESS_RANKS_H

#include "runtime.h"

/* One rank's part of a phase, on that rank's thread with its GPU current. */
typedef moert_result (*rank_phase_fn)(moert_rank *r, void *arg);

/* Runs fn on every rank, one thread each; the first rank to fail gives the error. A rank that has not returned
 * within the stall grace after another failed (a stalled rank its peers timed out on) is abandoned: the call returns
 * MOERT_ERR_TIMEOUT naming it, and the runtime can only be destroyed (which then frees nothing the rank may use). */
moert_result trainer_run_on_ranks(moert_runtime *rt, rank_phase_fn fn, void *arg);

#endif
