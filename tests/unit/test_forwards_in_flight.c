/* SPDX-License-Identifier: Apache-2.0 */
/* $.parallel.forwards_in_flight (API version 9): a pipeline schedule's order over the public API, three micro-batches'
 * forwards of every layer before the first backward (1F1B's warm-up on a first stage), then one forward and the
 * backwards in the order they come, gives every output, input gradient and per-micro-batch parameter gradient of the
 * plain forward-then-backward loop bit for bit, on 2 ranks as threads (EP2), fp64. Each micro-batch's backward writes
 * its own gradient buffers, bound (the gradient alone) just before it. Again with the micro-batch overlap on, two
 * forwards ahead, each next forward merged with the backward two micro-batches back (moert_moe_forward_backward on a
 * third slot). Also: a fourth forward of a layer holding three is refused, naming the option; rebinding a value while
 * forwards are in flight is refused; the layers report their slots. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert/layers.h"
#include "moert/moert.h"
#include "test_util.h"

#define H      8
#define T      6
#define LAYERS 2
#define MICRO  4
#define WORLD  2
#define RUNS   3 /* one forward in flight; three; three with the overlap */

static const char *config_text =
    "{\"model\": {\"hidden\": 8, \"ffn_hidden\": 6, \"num_experts\": 4, \"topk\": 2, \"num_layers\": 2,"
    " \"dtype\": \"fp64\"}, \"parallel\": {\"forwards_in_flight\": %d, \"overlap_micro_batches\": \"%s\"},"
    " \"train\": {\"tokens_per_rank\": 6}, \"router\": {\"z_loss_coeff\": 0.01}}";

typedef struct run {
    double y[MICRO][T * H], dx[MICRO][T * H];
    double *grad[MICRO][LAYERS][MOERT_PARAM_COUNT];
    int64_t numel[MOERT_PARAM_COUNT];
} run;

typedef struct rank_job {
    int rank;
    moert_comm *comm;
    moert_config *cfg[RUNS];
    run out[RUNS];
    moert_result rc;
} rank_job;

typedef struct state {
    moert_layers *m;
    void *value[LAYERS][MOERT_PARAM_COUNT];
    double *act[MICRO][LAYERS + 1], *d[MICRO][LAYERS + 1];
    moert_saved *saved[MICRO][LAYERS];
    run *out;
} state;

static moert_tensor t2(double *p) { return moert_tensor_2d(p, moert_cpu(), MOERT_F64, T, H); }

/* Binds micro-batch i's own gradient buffers of layer l (the values stay). */
static moert_result bind_grads(state *s, int i, int l)
{
    moert_result rc = MOERT_OK;
    for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
        moert_tensor desc;
        if (!s->value[l][p] || moert_layers_param_desc(s->m, l, (moert_param_id)p, &desc) != MOERT_OK) continue;
        moert_tensor v = desc, g = desc;
        v.data = s->value[l][p];
        g.data = s->out->grad[i][l][p];
        MOERT_CHECK(moert_layers_bind_param(s->m, l, (moert_param_id)p, &v, &g));
    }
fail:
    return rc;
}

static moert_result forward_all(state *s, int i)
{
    moert_result rc = MOERT_OK;
    for (int l = 0; l < LAYERS; l++) {
        moert_tensor a = t2(s->act[i][l]), b = t2(s->act[i][l + 1]);
        MOERT_CHECK(moert_moe_forward(s->m, l, &a, &b, NULL, &s->saved[i][l], NULL));
    }
fail:
    return rc;
}

static const moert_backward_options overwrite = {.struct_size = sizeof overwrite, .router_loss_scale = 0.5};

static moert_result backward_all(state *s, int i)
{
    moert_result rc = MOERT_OK;
    for (int l = LAYERS - 1; l >= 0; l--) {
        moert_tensor dy = t2(s->d[i][l + 1]), dx = t2(s->d[i][l]);
        MOERT_CHECK(bind_grads(s, i, l));
        MOERT_CHECK(moert_moe_backward(s->m, s->saved[i][l], &dy, &dx, &overwrite, NULL));
    }
fail:
    return rc;
}

/* The refusals while three forwards of every layer are in flight. */
static void check_refusals(state *s)
{
    moert_saved *extra = NULL;
    moert_tensor a = t2(s->act[3][0]), b = t2(s->act[3][1]);
    EXPECT(moert_moe_forward(s->m, 0, &a, &b, NULL, &extra, NULL) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("3 micro-batches in flight per layer; $.parallel.forwards_in_flight allows up to 32");
    EXPECT(extra == NULL);
    moert_tensor desc;
    EXPECT_OK(moert_layers_param_desc(s->m, 0, MOERT_PARAM_FC1, &desc));
    double *other = calloc((size_t)moert_tensor_numel(&desc), sizeof(double));
    moert_tensor v = desc, g = desc;
    v.data = other;
    g.data = s->out->grad[0][0][MOERT_PARAM_FC1];
    EXPECT(moert_layers_bind_param(s->m, 0, MOERT_PARAM_FC1, &v, &g) == MOERT_ERR_INVALID_ARGUMENT);
    EXPECT_ERROR_CONTAINS("only the fc1 gradient can be rebound");
    free(other);
}

static moert_result one_run(rank_job *job, int k)
{
    moert_result rc = MOERT_OK;
    moert_launch launch = {
        .struct_size = sizeof launch, .rank = job->rank, .world_size = WORLD, .device = moert_cpu(), .comm = job->comm};
    state s;
    memset(&s, 0, sizeof s);
    s.out = &job->out[k];
    if ((rc = moert_layers_create(job->cfg[k], &launch, &s.m)) != MOERT_OK) return rc;
    moert_layers_info info = {.struct_size = sizeof info};
    EXPECT_OK(moert_layers_get_info(s.m, &info));
    EXPECT_EQ_INT(info.slots, k ? 3 : 1);
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) {
            moert_tensor desc;
            if (moert_layers_param_desc(s.m, l, (moert_param_id)p, &desc) != MOERT_OK) continue;
            const int64_t n = moert_tensor_numel(&desc);
            s.value[l][p] = calloc((size_t)n, sizeof(double));
            s.out->numel[p] = n;
            for (int i = 0; i < MICRO; i++) s.out->grad[i][l][p] = calloc((size_t)n, sizeof(double));
            MOERT_CHECK(bind_grads(&s, 0, l));
        }
    MOERT_CHECK(moert_layers_init_params(s.m, 21, NULL));
    for (int i = 0; i < MICRO; i++)
        for (int l = 0; l <= LAYERS; l++) {
            s.act[i][l] = calloc(T * H, sizeof(double));
            s.d[i][l] = calloc(T * H, sizeof(double));
            for (int64_t e = 0; e < T * H; e++) {
                if (l == 0)
                    s.act[i][l][e] = moert_random_normal(100 + (uint64_t)(i * WORLD + job->rank), 1, (uint64_t)e);
                if (l == LAYERS)
                    s.d[i][l][e] = moert_random_normal(200 + (uint64_t)(i * WORLD + job->rank), 1, (uint64_t)e);
            }
        }
    if (k == 0) { /* one in flight: each micro-batch's forward, then its backward */
        for (int i = 0; i < MICRO; i++) {
            MOERT_CHECK(forward_all(&s, i));
            MOERT_CHECK(backward_all(&s, i));
        }
    } else if (k == 1) { /* a pipeline stage's order: F0 F1 F2, B0, F3, B1, B2, B3 */
        for (int i = 0; i < 3; i++) MOERT_CHECK(forward_all(&s, i));
        check_refusals(&s);
        MOERT_CHECK(backward_all(&s, 0));
        MOERT_CHECK(forward_all(&s, 3));
        for (int i = 1; i < MICRO; i++) MOERT_CHECK(backward_all(&s, i));
    } else { /* with the overlap: F0 F1, then F2 merged with B0 and F3 with B1 layer by layer, B2, B3 */
        for (int i = 0; i < 2; i++) MOERT_CHECK(forward_all(&s, i));
        for (int i = 2; i < MICRO; i++)
            for (int l = 0; l < LAYERS; l++) {
                const int bl = LAYERS - 1 - l;
                moert_tensor a = t2(s.act[i][l]), b = t2(s.act[i][l + 1]);
                moert_tensor dy = t2(s.d[i - 2][bl + 1]), dx = t2(s.d[i - 2][bl]);
                MOERT_CHECK(bind_grads(&s, i - 2, bl));
                MOERT_CHECK(moert_moe_forward_backward(s.m, l, &a, &b, &s.saved[i][l], NULL, s.saved[i - 2][bl], &dy,
                                                       &dx, &overwrite, NULL));
                if (i == 2 && l == 0) check_refusals(&s); /* layer 0 holds F0, F1 and F2 */
            }
        for (int i = 2; i < MICRO; i++) MOERT_CHECK(backward_all(&s, i));
    }
    for (int i = 0; i < MICRO; i++) {
        memcpy(s.out->y[i], s.act[i][LAYERS], sizeof s.out->y[i]);
        memcpy(s.out->dx[i], s.d[i][0], sizeof s.out->dx[i]);
    }
fail:
    if (rc != MOERT_OK) fprintf(stderr, "rank %d, run %d: %s\n", job->rank, k, moert_last_error());
    moert_layers_destroy(s.m);
    for (int l = 0; l < LAYERS; l++)
        for (int p = 0; p < MOERT_PARAM_COUNT; p++) free(s.value[l][p]);
    for (int i = 0; i < MICRO; i++)
        for (int l = 0; l <= LAYERS; l++) {
            free(s.act[i][l]);
            free(s.d[i][l]);
        }
    return rc;
}

/* Rank `rank` of test_run_ranks: its runs in order, stopping at the first failure. */
static void rank_main(int rank, void *jobs)
{
    rank_job *job = (rank_job *)jobs + rank;
    for (int k = 0; k < RUNS && job->rc == MOERT_OK; k++) job->rc = one_run(job, k);
}

int main(void)
{
    static rank_job jobs[WORLD];
    moert_comm *comm = NULL;
    EXPECT_OK(moert_comm_create_threads(WORLD, 20.0, &comm));
    for (int r = 0; r < WORLD; r++) {
        jobs[r].rank = r;
        jobs[r].comm = comm;
        for (int k = 0; k < RUNS; k++) {
            char json[1024];
            snprintf(json, sizeof json, config_text, k ? 3 : 1, k == 2 ? "on" : "off");
            EXPECT_OK(moert_config_load_string(json, "forwards-in-flight", &jobs[r].cfg[k]));
        }
    }
    test_run_ranks(WORLD, rank_main, jobs);
    for (int r = 0; r < WORLD; r++) {
        EXPECT_OK(jobs[r].rc);
        for (int k = 1; k < RUNS && jobs[r].rc == MOERT_OK; k++) {
            const run *a = &jobs[r].out[0], *b = &jobs[r].out[k];
            EXPECT(memcmp(a->y, b->y, sizeof a->y) == 0);
            EXPECT(memcmp(a->dx, b->dx, sizeof a->dx) == 0);
            int64_t differ = 0;
            for (int i = 0; i < MICRO; i++) {
                int64_t nonzero = 0;
                for (int l = 0; l < LAYERS; l++)
                    for (int p = 0; p < MOERT_PARAM_COUNT; p++)
                        for (int64_t e = 0; a->grad[i][l][p] && e < a->numel[p]; e++) {
                            differ += memcmp(&a->grad[i][l][p][e], &b->grad[i][l][p][e], sizeof(double)) != 0;
                            nonzero += b->grad[i][l][p][e] != 0;
                        }
                EXPECT(nonzero > 0); /* each micro-batch's backward wrote its own buffers */
            }
            EXPECT(differ == 0);
        }
        for (int k = 0; k < RUNS; k++) {
            moert_config_free(jobs[r].cfg[k]);
            for (int i = 0; i < MICRO; i++)
                for (int l = 0; l < LAYERS; l++)
                    for (int p = 0; p < MOERT_PARAM_COUNT; p++) free(jobs[r].out[k].grad[i][l][p]);
        }
    }
    moert_comm_destroy(comm);
    return test_finish("forwards_in_flight");
}
