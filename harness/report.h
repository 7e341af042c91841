/* SPDX-License-Identifier: Apache-2.0 */
/* The run report's pieces shared with `moert ab` (harness/report.c writes the whole report). */
#ifndef MOERT_HARNESS_REPORT_H
#define MOERT_HARNESS_REPORT_H

#include <jansson.h>

#include "trainer.h"

/* One step's figures as a JSON object, as in the run report's "steps". */
json_t *moert_report_step_json(const moert_step_record *record);

#endif
