/* SPDX-License-Identifier: Apache-2.0 */
/* moert_moe_forward_backward (API version 6): a 1F1B loop over the public API, with micro-batch i+1's forward of layer
 * k merged with micro-batch i's backward of layer L-1-k and two forwards in flight per layer
 * ($.parallel.overlap_micro_batches "on"), gives every output, input gradient and parameter gradient of the plain
 * forward-then-backward loop bit for bit, on 2 ranks as threads (EP2), fp64 and fp32, with the router's expert bias.
 * Once more with micro-batch 0 on slot 1 (a forward of every layer held on slot 0 meanwhile, in both loops): its backward
 * writes the lazily zeroed gradients through slot 1's layers, whose zeroing state must be slot 0's. Also: a third
 * forward of a layer holding two is refused. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/layers.h"
#include "moert/moert.h"
#include "test_util.h"

#define H      8
#define T      6
#define LAYERS 3
#define MICRO  3
#define WORLD  2

static const char *config_text =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 6, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 3,"
    " \"dtype\": \"%s\"}, \"parallel\": {\"overlap_micro_batches\": \"%s\"}, \"train\": {\"tokens_per_rank\": 6},"
    " \"router\": {\"score_function\": \"sigmoid\", \"expert_bias\": true, \"z_loss_coeff\": 0.01}}";

typedef struct run {
    double y[MICRO][T * H], dx[MICRO][T * H];
    double *grad[LAYERS][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
} run;

typedef struct rank_job {
    int rank;
    moert_comm *comm;
    moert_config *cfg[2]; /* off, on */
    moert_dtype dtype;
    /* a forward of every layer before micro-batch 0's, freed after it: micro-batch 0 then holds slot 1, and the
     * gradients' lazy zeroing (micro-batch 0's backward writes them) goes through slot 1's layers */
    bool shift;
    run out[2];
    moert_result rc;
} rank_job;

/* Fills a tensor of `dtype` from doubles (a test value per element). */
static void *make_data(moert_dtype dtype, int64_t n, uint64_t seed)
{
    void *p = calloc((size_t)n, 8);
    for (int64_t i = 0; i < n; i++) {
        double v = moert_random_normal(seed, 1, (uint64_t)i);
        if (dtype == MOERT_F64)
            ((double *)p)[i] = v;
        else
            ((float *)p)[i] = (float)v;
    }
    return p;
}

static double load(moert_dtype dtype, const void *p, int64_t i)
{
    return dtype == MOERT_F64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

static moert_tensor t2(void *p, moert_dtype dtype) { return moert_tensor_2d(p, moert_cpu(), dtype, T, H); }

static moert_result one_run(rank_job *job, int merged)
{
    moert_result rc = MOERT_OK;
    const moert_dtype dt = job->dtype;
    moert_launch launch = {
        .struct_size = sizeof launch, .rank = job->rank, .world_size = WORLD, .device = moert_cpu(), .comm = job->comm};
    moert_layers *m = NULL;
    void *scratch = calloc(T * H, 8);
    void *value[LAYERS][MOERT_PARAM_COUNT] = {{0}}, *grad[LAYERS][MOERT_PARAM_COUNT] = {{0}};
    void *act[MICRO][LAYERS + 1], *d[MICRO][LAYERS + 1];
    moert_saved *saved[MICRO][LAYERS] = {{0}};
    run *out = &job->out[merged];
    if ((rc = moert_layers_create(job->cfg[merged], &launch, &m)) != MOERT_OK) return rc;
    moert_layers_info info = {.struct_size = sizeof info};
    moert_layers_get_info(m, &info);
    /* API version 7: the merged run's layers hold the second slot, the sequential one's do not */
    EXPECT_EQ_INT(info.slots, merged ? 2 : 1);
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            moert_tensor desc;
            if (moert_layers_param_desc(m, l, (moert_param_id)p, &desc) != MOERT_OK) continue;
            const int64_t n = moert_tensor_numel(&desc);
            moert_tensor v = desc, g = desc;
            v.data = value[l][p] = calloc((size_t)n, 8);
            g.data = grad[l][p] = calloc((size_t)n, 8);
            out->numel[p] = n;
            MOERT_CHECK(moert_layers_bind_param(m, l, (moert_param_id)p, &v, &g));
        }
    MOERT_CHECK(moert_layers_init_params(m, 21, NULL));
    for (int i = 0; i < MICRO; i++) {
        act[i][0] = make_data(dt, T * H, 100 + (uint64_t)(i * WORLD + job->rank));
        d[i][LAYERS] = make_data(dt, T * H, 200 + (uint64_t)(i * WORLD + job->rank));
        for (int l = 1; l <= LAYERS; l++) act[i][l] = calloc(T * H, 8);
        for (int l = 0; l < LAYERS; l++) d[i][l] = calloc(T * H, 8);
    }
    moert_backward_options first = {.struct_size = sizeof first, .router_loss_scale = 0.5, .accumulate = false};
    moert_backward_options later = first;
    later.accumulate = true;
    moert_tensor sink = t2(scratch, dt);
    moert_saved *shifted[LAYERS] = {0};
    if (!merged) {
        for (int i = 0; i < MICRO; i++) {
            for (int l = 0; l < LAYERS; l++) {
                moert_tensor a = t2(act[i][l], dt), b = t2(act[i][l + 1], dt);
                if (job->shift && i == 0) {
                    MOERT_CHECK(moert_moe_forward(m, l, &a, &sink, NULL, &shifted[l], NULL));
                    moert_saved_free(shifted[l]);
                }
                MOERT_CHECK(moert_moe_forward(m, l, &a, &b, NULL, &saved[i][l], NULL));
            }
            for (int l = LAYERS - 1; l >= 0; l--) {
                moert_tensor dy = t2(d[i][l + 1], dt), dx = t2(d[i][l], dt);
                MOERT_CHECK(moert_moe_backward(m, saved[i][l], &dy, &dx, i ? &later : &first, NULL));
            }
        }
    } else {
        for (int l = 0; l < LAYERS; l++) {
            moert_tensor a = t2(act[0][l], dt), b = t2(act[0][l + 1], dt);
            if (job->shift) MOERT_CHECK(moert_moe_forward(m, l, &a, &sink, NULL, &shifted[l], NULL));
            MOERT_CHECK(moert_moe_forward(m, l, &a, &b, NULL, &saved[0][l], NULL));
        }
        for (int l = 0; l < LAYERS; l++) moert_saved_free(shifted[l]);
        /* a third forward of a layer holding two is refused */
        moert_saved *extra = NULL;
        moert_tensor a1 = t2(act[1][0], dt), b1 = t2(act[1][1], dt);
        MOERT_CHECK(moert_moe_forward(m, 0, &a1, &b1, NULL, &extra, NULL));
        moert_tensor a2 = t2(act[2][0], dt), b2 = t2(act[2][1], dt);
        moert_saved *refused = NULL;
        EXPECT(moert_moe_forward(m, 0, &a2, &b2, NULL, &refused, NULL) == MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(moert_last_error(),
                      "2 micro-batches in flight per layer; $.parallel.forwards_in_flight allows up to 32") != NULL);
        moert_saved_free(extra);
        for (int i = 1; i < MICRO; i++)
            for (int k = 0; k < LAYERS; k++) {
                const int bl = LAYERS - 1 - k;
                moert_tensor a = t2(act[i][k], dt), b = t2(act[i][k + 1], dt);
                moert_tensor dy = t2(d[i - 1][bl + 1], dt), dx = t2(d[i - 1][bl], dt);
                MOERT_CHECK(moert_moe_forward_backward(m, k, &a, &b, &saved[i][k], NULL, saved[i - 1][bl], &dy, &dx,
                                                       i - 1 ? &later : &first, NULL));
            }
        for (int l = LAYERS - 1; l >= 0; l--) {
            moert_tensor dy = t2(d[MICRO - 1][l + 1], dt), dx = t2(d[MICRO - 1][l], dt);
            MOERT_CHECK(moert_moe_backward(m, saved[MICRO - 1][l], &dy, &dx, &later, NULL));
        }
    }
    for (int i = 0; i < MICRO; i++)
        for (int64_t e = 0; e < T * H; e++) {
            out->y[i][e] = load(dt, act[i][LAYERS], e);
            out->dx[i][e] = load(dt, d[i][0], e);
        }
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            if (!grad[l][p]) continue;
            out->grad[l][p] = malloc((size_t)out->numel[p] * sizeof(double));
            for (int64_t e = 0; e < out->numel[p]; e++) out->grad[l][p][e] = load(info.param_dtype, grad[l][p], e);
        }
fail:
    if (rc != MOERT_OK) fprintf(stderr, "rank %d: %s\n", job->rank, moert_last_error());
    free(scratch);
    moert_layers_destroy(m);
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            free(value[l][p]);
            free(grad[l][p]);
        }
    for (int i = 0; i < MICRO; i++) {
        for (int l = 0; l <= LAYERS; l++) {
            free(act[i][l]);
            free(d[i][l]);
        }
    }
    return rc;
}

static void *rank_main(void *arg)
{
    rank_job *job = arg;
    job->rc = one_run(job, 0);
    if (job->rc == MOERT_OK) job->rc = one_run(job, 1);
    return NULL;
}

static void compare(moert_dtype dtype, bool shift)
{
    char json[1024];
    const char *dname = dtype == MOERT_F64 ? "fp64" : "fp32";
    static rank_job jobs[WORLD];
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(WORLD, 20.0, &comm));
    for (int i = 0; i < WORLD; i++) {
        memset(&jobs[i], 0, sizeof jobs[i]);
        jobs[i].rank = i;
        jobs[i].comm = comm;
        jobs[i].dtype = dtype;
        jobs[i].shift = shift;
        for (int k = 0; k < 2; k++) {
            snprintf(json, sizeof json, config_text, dname, k ? "on" : "off");
            EXPECT_OK(moert_config_load_string(json, "overlap-api", &jobs[i].cfg[k]));
        }
    }
    pthread_t th[WORLD];
    for (int i = 0; i < WORLD; i++) pthread_create(&th[i], NULL, rank_main, &jobs[i]);
    for (int i = 0; i < WORLD; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < WORLD; i++) {
        EXPECT_OK(jobs[i].rc);
        run *a = &jobs[i].out[0], *b = &jobs[i].out[1];
        if (jobs[i].rc == MOERT_OK) {
            EXPECT(memcmp(a->y, b->y, sizeof a->y) == 0);
            EXPECT(memcmp(a->dx, b->dx, sizeof a->dx) == 0);
            for (int l = 0; l < LAYERS; l++)
                for (int p = 0; p < MOERT_PARAM_COUNT; p++)
                    if (a->grad[l][p] && b->grad[l][p])
                        EXPECT(memcmp(a->grad[l][p], b->grad[l][p], (size_t)a->numel[p] * sizeof(double)) == 0);
        }
        for (int k = 0; k < 2; k++) {
            moert_config_free(jobs[i].cfg[k]);
            for (int l = 0; l < LAYERS; l++)
                for (int p = 0; p < MOERT_PARAM_COUNT; p++) free(jobs[i].out[k].grad[l][p]);
        }
    }
    moert_comm_destroy(comm);
}

int main(void)
{
    compare(MOERT_F64, false);
    compare(MOERT_F32, false);
    compare(MOERT_F64, true);
    return test_finish("overlap_api");
}
