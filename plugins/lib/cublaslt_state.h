/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What the precision plugins' cuBLASLt paths (the bf16 engine in precision_bf16_cuda.cu, the fp8 plugin's plans) keep
 * between calls, and their checked-call macro: a matrix layout and the matmul preference's pointer alignments, each
 * attribute written only when it changes, since a per-expert loop would otherwise set every one of them for every
 * expert of every call. Header-only, for .cu files; a failure names the call (report, plugin_report.h).
 */
#ifndef MOERT_PLUGIN_LIB_CUBLASLT_STATE_H
#define MOERT_PLUGIN_LIB_CUBLASLT_STATE_H

#include <cublasLt.h>
#include <stdint.h>

#include "plugin_report.h"

/* Checked cuBLASLt / cuBLAS call: returns MOERT_ERR_CUDA naming the call. */
#define CUBLAS_CHECK(host, call)                                                                                       \
    REPORT_STATUS_CHECK(host, cublasStatus_t, CUBLAS_STATUS_SUCCESS, cublasLtGetStatusString, call, #call)

/* A matrix layout and the attributes last written into it. */
typedef struct moert_lt_layout {
    cublasLtMatrixLayout_t layout;
    int32_t type; /* the cudaDataType_t written, where the caller changes it (moert_lt_layout_fit's type >= 0) */
    int64_t rows, cols, ld;
} moert_lt_layout;

/* Makes s describe rows x cols with leading dimension ld (and, for type >= 0, that data type), writing only the
 * attributes that changed. */
static inline moert_result moert_lt_layout_fit(const moert_host *host, moert_lt_layout *s, int32_t type, int64_t rows,
                                               int64_t cols, int64_t ld)
{
    if (type >= 0 && s->type != type) {
        CUBLAS_CHECK(host,
                     cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_TYPE, &type, sizeof type));
        s->type = type;
    }
    if (s->rows != rows) {
        uint64_t v = (uint64_t)rows;
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &v, sizeof v));
        s->rows = rows;
    }
    if (s->cols != cols) {
        uint64_t v = (uint64_t)cols;
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_COLS, &v, sizeof v));
        s->cols = cols;
    }
    if (s->ld != ld) {
        CUBLAS_CHECK(host, cublasLtMatrixLayoutSetAttribute(s->layout, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld));
        s->ld = ld;
    }
    return MOERT_OK;
}

/* Writes the minimum pointer alignments want (A, B, and C, which D shares) into pref, those that differ from have
 * (the values last written; 0: none), and updates have. */
static inline moert_result moert_lt_pref_align_set(const moert_host *host, cublasLtMatmulPreference_t pref,
                                                   int32_t have[3], const int32_t want[3])
{
    static const cublasLtMatmulPreferenceAttributes_t attr[3] = {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                                 CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES};
    for (int i = 0; i < 3; i++) {
        if (have[i] == want[i]) continue;
        have[i] = 0;
        uint32_t v = (uint32_t)want[i];
        CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(pref, attr[i], &v, sizeof v));
        if (i == 2)
            CUBLAS_CHECK(host, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                                    &v, sizeof v));
        have[i] = want[i];
    }
    return MOERT_OK;
}

#endif
