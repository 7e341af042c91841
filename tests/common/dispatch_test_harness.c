/* SPDX-License-Identifier: Apache-2.0 */
#include "dispatch_test_harness.h"

#include "error.h"

/* ---- a plugin instance whose host collects metrics ---- */

/* The host's metric callback: keeps the dispatch figures in the rank's result. */
static void metric_sink(void *user, const char *name, double value, const char *unit)
{
    dispatch_rank_result *r = user;
    if (strcmp(name, "dispatch.recv_tokens") == 0 && strcmp(unit, "tokens") == 0) {
        r->metric_recv_tokens = value;
        r->metric_recv_seen++;
    }
    if (strcmp(name, "dispatch.bytes_sent") == 0 && strcmp(unit, "bytes") == 0) {
        r->metric_bytes_sent = value;
        r->metric_bytes_seen++;
    }
}

/* Loads the plugin and opens an instance whose host collects the dispatch metrics into `metrics`
 * (test_instance_open drops metrics). comm may be NULL for one rank. */
static moert_result dispatch_test_open(test_instance *ti, const dispatch_test_plugin *plugin, const char *options,
                                       const moert_layer_info *layer, moert_comm_group *comm, int rank, int world,
                                       dispatch_rank_result *metrics)
{
    memset(ti, 0, sizeof *ti);
    moert_result rc = moert_plugin_load(MOERT_KIND_DISPATCHER, plugin->name, &ti->plugin);
    if (rc != MOERT_OK) return rc;
    json_error_t jerr;
    ti->options = json_loads(options ? options : "{}", 0, &jerr);
    if (!ti->options) return moert_error(MOERT_ERR_CONFIG, "test options: %s", jerr.text);
    ti->section = moert_section_create(ti->options, "$.dispatcher");
    moert_section_allow(ti->section, "plugin");
    char who[64];
    snprintf(who, sizeof who, "dispatcher[%s]", plugin->name);
    moert_host_setup setup = {.who = who,
                              .options = ti->section,
                              .comm = comm,
                              .rank = rank,
                              .world_size = world,
                              .device = layer->device,
                              .metric = metric_sink,
                              .metric_user = metrics};
    rc = moert_host_create(&setup, &ti->host);
    if (rc != MOERT_OK) return rc;
    rc = moert_plugin_init(&ti->plugin, &ti->ctx, ti->host, layer);
    if (rc != MOERT_OK) return rc;
    return moert_section_check_unknown(ti->section);
}

/* The dispatcher vtable of an open instance. */
static const moert_dispatcher_v1 *dispatch_vtable(const test_instance *ti)
{
    return (const moert_dispatcher_v1 *)ti->plugin.header;
}

/* ---- routing and data, made on the main thread so every rank's reference sees all of it ---- */

/* Tokens of rank r: T on every rank, or T + 3r; T = -1 stands for 0 tokens on rank 0 (then 3r). */
static int64_t rank_tokens(const dispatch_scenario *sc, int r)
{
    int64_t T = sc->T < 0 ? 0 : sc->T;
    return sc->same_T ? T : T + 3 * r;
}

/* ceil(T*K/E*capacity_factor), the per-source capacity of one expert. */
static int64_t per_source_capacity(const dispatch_scenario *sc, int64_t T)
{
    return (int64_t)ceil((double)T * (double)sc->K / (double)sc->E * sc->capacity_factor);
}

/* Fills topk_idx for one rank as the scenario's routing says. */
static void make_routing(dispatch_scenario *sc, int r, uint64_t *rng)
{
    dispatch_rank_data *d = &sc->rank[r];
    const int64_t K = sc->K, E = sc->E, El = E / sc->world;
    for (int64_t t = 0; t < d->T; t++) {
        int32_t *row = d->idx + t * K;
        for (int64_t k = 0; k < K; k++) {
            int32_t e;
            bool fresh;
            do { /* distinct experts within a token */
                if (sc->routing == ROUTE_AVOID_RANK0)
                    e = (int32_t)(El + (int64_t)((test_uniform(rng) + 1.0) * 0.5 * (double)(E - El)));
                else
                    e = (int32_t)((test_uniform(rng) + 1.0) * 0.5 * (double)E);
                fresh = true;
                for (int64_t j = 0; j < k; j++) fresh = fresh && row[j] != e;
            } while (!fresh);
            row[k] = e;
        }
        if (sc->routing == ROUTE_HOT) {
            row[0] = (int32_t)(E - 1);
            for (int64_t k = 1; k < K; k++) row[k] = -1;
        }
        if (sc->routing == ROUTE_RANDOM || sc->routing == ROUTE_SOME_DROPPED || sc->routing == ROUTE_AVOID_RANK0)
            for (int64_t k = 0; k < K; k++)
                if (test_uniform(rng) > 0.7) row[k] = -1; /* about 15% of copies dropped */
        if (sc->routing == ROUTE_SOME_DROPPED && t % 3 == 1)
            for (int64_t k = 0; k < K; k++) row[k] = -1;
    }
    if (sc->routing == ROUTE_CAPPED) { /* the router's "position" drop policy */
        int64_t cap = per_source_capacity(sc, d->T);
        int64_t count[64] = {0};
        for (int64_t i = 0; i < d->T * K; i++)
            if (d->idx[i] >= 0 && ++count[d->idx[i]] > cap) d->idx[i] = -1;
    }
    if (sc->routing == ROUTE_BAD_INDEX && r == 1) d->idx[2 * K + 1] = 99;
}

/* v after a round trip through dtype's storage. */
static double stored_value(double v, moert_dtype dtype)
{
    uint64_t cell = 0;
    moert_tensor t = moert_tensor_1d(&cell, moert_cpu(), dtype, 1);
    moert_store(&t, 0, v);
    return moert_load(&t, 0);
}

/* Makes every rank's tokens, routing and probs (normalised over kept copies). */
static void make_data(dispatch_scenario *sc)
{
    uint64_t rng = sc->seed;
    for (int r = 0; r < sc->world; r++) {
        dispatch_rank_data *d = &sc->rank[r];
        d->T = rank_tokens(sc, r);
        d->idx = calloc((size_t)(d->T * sc->K), sizeof(int32_t));
        d->probs = calloc((size_t)(d->T * sc->K), sizeof(double));
        d->x = calloc((size_t)(d->T * sc->H), moert_dtype_size(sc->dtype));
        make_routing(sc, r, &rng);
        moert_tensor xt = moert_tensor_2d(d->x, moert_cpu(), sc->dtype, d->T, sc->H);
        for (int64_t i = 0; i < d->T * sc->H; i++) moert_store(&xt, i, test_uniform(&rng));
        if (sc->dtype == MOERT_BF16) { /* odd bit patterns must cross unchanged: -0, a subnormal, the largest */
            uint16_t *bits = d->x;
            bits[0] = 0x8000u;
            bits[1] = 0x0001u;
            bits[2] = 0x7f7fu;
        }
        for (int64_t t = 0; t < d->T; t++) {
            double sum = 0;
            for (int64_t k = 0; k < sc->K; k++)
                if (d->idx[t * sc->K + k] >= 0) sum += d->probs[t * sc->K + k] = 0.2 + (test_uniform(&rng) + 1.0);
            for (int64_t k = 0; k < sc->K; k++)
                if (d->idx[t * sc->K + k] >= 0) d->probs[t * sc->K + k] /= sum;
        }
        /* probs as the router stores them, read back: the exact values every check expects */
        for (int64_t i = 0; i < d->T * sc->K; i++) d->probs[i] = stored_value(d->probs[i], sc->probs_dtype);
    }
}

/* Frees what make_data made. */
static void free_data(dispatch_scenario *sc)
{
    for (int r = 0; r < sc->world; r++) {
        free(sc->rank[r].idx);
        free(sc->rank[r].probs);
        free(sc->rank[r].x);
    }
}

/* ---- the reference, independent of the plugin: what rank r must receive, in order ---- */

/* Fills ref for rank r (the "alltoall" dispatcher's order); ref->rows is to be freed by the caller. */
static void make_reference(const dispatch_scenario *sc, int r, dispatch_reference *ref)
{
    const int64_t El = sc->E / sc->world, first = El * r;
    memset(ref, 0, sizeof *ref);
    int64_t total = 0;
    for (int s = 0; s < sc->world; s++) total += sc->rank[s].T * sc->K;
    ref->rows = calloc((size_t)total + 1, sizeof *ref->rows);
    int64_t T_max = 0;
    for (int s = 0; s < sc->world; s++) T_max = sc->rank[s].T > T_max ? sc->rank[s].T : T_max;
    for (int64_t l = 0; l < El; l++) {
        for (int s = 0; s < sc->world; s++)
            for (int64_t t = 0; t < sc->rank[s].T; t++)
                for (int64_t k = 0; k < sc->K; k++)
                    if (sc->rank[s].idx[t * sc->K + k] == first + l) {
                        ref->rows[ref->num_recv++] = (dispatch_ref_row){s, t, k};
                        ref->expert_rows[l]++;
                    }
        /* without padding the groups are compact */
        ref->group_rows[l] = sc->pad ? per_source_capacity(sc, T_max) * sc->world : ref->expert_rows[l];
        ref->group_start[l] = ref->capacity;
        ref->capacity += ref->group_rows[l];
    }
}

int64_t dispatch_check_compact_layout(const dispatch_scenario *sc, int r, const moert_dispatch_layout *layout,
                                      const dispatch_reference *ref)
{
    (void)r;
    const int64_t El = sc->E / sc->world;
    EXPECT_EQ_INT(layout->capacity, ref->capacity);
    EXPECT(layout->tokens_per_expert.dtype == MOERT_I64 && layout->tokens_per_expert.ndim == 1 &&
           layout->tokens_per_expert.shape[0] == El);
    EXPECT(layout->tokens_per_expert_host == layout->tokens_per_expert.data);
    for (int64_t l = 0; l < El && layout->tokens_per_expert_host; l++)
        EXPECT_EQ_INT(layout->tokens_per_expert_host[l], ref->group_rows[l]);
    return ref->capacity;
}

/* ---- one rank of a scenario ---- */

static double dot(const moert_tensor *a, const moert_tensor *b, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += moert_load(a, i) * moert_load(b, i);
    return s;
}

/* bytes_sent of a dispatch: rank r's rows and probs (alltoall) or rows and metadata (peer buffers) to the others. */
static void check_bytes_sent(const dispatch_scenario *sc, int r, size_t row_bytes)
{
    const dispatch_rank_data *d = &sc->rank[r];
    const dispatch_rank_result *res = &sc->result[r];
    const int64_t K = sc->K, El = sc->E / sc->world;
    if (!sc->plugin->peer_buffers) {
        double bytes_expected = 0;
        for (int dst = 0; dst < sc->world; dst++) {
            if (dst == r) continue;
            for (int64_t i = 0; i < d->T * K; i++)
                if (d->idx[i] >= 0 && d->idx[i] / El == dst) bytes_expected += (double)row_bytes + sizeof(double);
        }
        EXPECT_EQ_INT(res->metric_bytes_seen, 1);
        EXPECT_NEAR(res->metric_bytes_sent, bytes_expected, 0, 0);
        return;
    }
    /* every token crosses once per other rank holding one of its experts: its row (bf16, or E4M3 and one fp32
     * scale per 128 values) and a metadata entry of at most 16 + 12 K bytes */
    double tokens_out = 0;
    for (int dst = 0; dst < sc->world; dst++) {
        if (dst == r) continue;
        for (int64_t t = 0; t < d->T; t++) {
            bool any = false;
            for (int64_t k = 0; k < K; k++) any = any || (d->idx[t * K + k] >= 0 && d->idx[t * K + k] / El == dst);
            tokens_out += any;
        }
    }
    const double wire_row = sc->fp8 ? (double)sc->H + (double)(sc->H / 128) * 4 : (double)row_bytes;
    EXPECT_EQ_INT(res->metric_bytes_seen, 2); /* two dispatches */
    EXPECT(res->metric_bytes_sent >= tokens_out * wire_row &&
           res->metric_bytes_sent <= tokens_out * (wire_row + 16 + 12 * (double)K));
}

/* A second dispatch of the same step (as a recompute does) gives the same bytes as the first in recv_x and
 * recv_probs (rows rows each). */
static void check_second_dispatch(const dispatch_scenario *sc, test_instance *ti, const moert_dispatch_args *first,
                                  const unsigned char *recv_x, const double *recv_probs, int64_t rows)
{
    const moert_dispatcher_v1 *vt = dispatch_vtable(ti);
    const size_t row_bytes = (size_t)sc->H * moert_dtype_size(sc->dtype);
    unsigned char *recv_again = malloc((size_t)rows * row_bytes);
    memset(recv_again, 0x5a, (size_t)rows * row_bytes);
    double *probs_again = calloc((size_t)rows, sizeof(double));
    for (int64_t i = 0; i < rows; i++) probs_again[i] = -7.0;
    moert_tensor rx2 = moert_tensor_2d(recv_again, moert_cpu(), sc->dtype, rows, sc->H);
    moert_tensor rp2 = moert_tensor_1d(probs_again, moert_cpu(), MOERT_F64, rows);
    moert_dispatch_args dargs2 = *first;
    dargs2.recv_x = &rx2;
    dargs2.recv_probs = &rp2;
    EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, &dargs2));
    EXPECT(memcmp(recv_again, recv_x, (size_t)rows * row_bytes) == 0);
    EXPECT(memcmp(probs_again, recv_probs, (size_t)rows * sizeof(double)) == 0);
    free(recv_again);
    free(probs_again);
}

/* All of one rank's checks; run on the rank's thread by test_run_ranks. */
static void run_rank(int r, void *user)
{
    dispatch_scenario *sc = user;
    const int64_t H = sc->H, K = sc->K, El = sc->E / sc->world;
    const dispatch_rank_data *d = &sc->rank[r];
    const size_t row_bytes = (size_t)H * moert_dtype_size(sc->dtype);
    dispatch_rank_result *res = &sc->result[r];
    uint64_t rng = sc->seed * 31 + (uint64_t)r;

    /* max_tokens sizes the peer buffers; below T, prepare() must grow them (on every rank together) or refuse */
    moert_layer_info layer = test_layer(H, 16, sc->E, K, sc->small_buffer ? d->T / 3 : d->T, sc->world, r, sc->dtype);
    test_instance ti;
    moert_result rc =
        dispatch_test_open(&ti, sc->plugin, sc->options, &layer, sc->world > 1 ? sc->comm : NULL, r, sc->world, res);
    if (rc != MOERT_OK) {
        fprintf(stderr, "%s rank %d: open failed: %s\n", sc->name, r, moert_error_message());
        test_failures++;
        test_instance_close(&ti);
        return;
    }
    const moert_dispatcher_v1 *vt = dispatch_vtable(&ti);
    moert_tensor idx = moert_tensor_2d(d->idx, moert_cpu(), MOERT_I32, d->T, K);
    moert_dispatch_layout layout = {.struct_size = sizeof layout};

    if (sc->stall_prepare) { /* rank 1 never sends its counts: rank 0's prepare() gives up naming it */
        if (r == 0)
            EXPECT_CALL_FAILS(&ti, vt->prepare(ti.ctx, NULL, &idx, &layout), MOERT_ERR_TIMEOUT,
                              "prepare() on rank 0: rank 1 did not send its counts within 200 ms (timeout_ms)");
        pthread_barrier_wait(&sc->barrier); /* peers keep their buffers until rank 0 is done writing into them */
        test_instance_close(&ti);
        return;
    }
    if (sc->prepare_error) {
        const char *needle = (r == 1 && sc->prepare_error_r1) ? sc->prepare_error_r1 : sc->prepare_error;
        EXPECT_CALL_FAILS(&ti, vt->prepare(ti.ctx, NULL, &idx, &layout), MOERT_ERR_INVALID_ARGUMENT, needle);
        test_instance_close(&ti);
        return;
    }
    EXPECT_CALL_OK(&ti, vt->prepare(ti.ctx, NULL, &idx, &layout));

    dispatch_reference ref;
    make_reference(sc, r, &ref);
    EXPECT_EQ_INT(layout.num_recv, ref.num_recv);
    if (sc->routing == ROUTE_AVOID_RANK0 && r == 0) EXPECT_EQ_INT(ref.num_recv, 0); /* the case is really there */
    const int64_t cap = sc->plugin->check_layout(sc, r, &layout, &ref);
    EXPECT_EQ_INT(res->metric_recv_seen, 1);
    EXPECT_EQ_INT(res->metric_recv_tokens, ref.num_recv);
    const int64_t filled = ref.capacity; /* rows the reference fills (received and padding); up to cap */

    /* dispatch: the rows past the filled ones (up to capacity and two more) must stay untouched */
    const int64_t extra = 2;
    unsigned char *recv_x = malloc((size_t)(cap + extra) * row_bytes);
    memset(recv_x, 0x5a, (size_t)(cap + extra) * row_bytes);
    double *recv_probs = calloc((size_t)(cap + extra), sizeof(double));
    for (int64_t i = 0; i < cap + extra; i++) recv_probs[i] = -7.0;
    moert_tensor x = moert_tensor_2d(d->x, moert_cpu(), sc->dtype, d->T, H);
    void *probs_stored = calloc((size_t)(d->T * K), 8);
    moert_tensor probs = moert_tensor_2d(probs_stored, moert_cpu(), sc->probs_dtype, d->T, K);
    for (int64_t i = 0; i < d->T * K; i++) moert_store(&probs, i, d->probs[i]);
    moert_tensor rx = moert_tensor_2d(recv_x, moert_cpu(), sc->dtype, cap + extra, H);
    moert_tensor rp = moert_tensor_1d(recv_probs, moert_cpu(), MOERT_F64, cap + extra);
    moert_dispatch_args dargs = {
        .struct_size = sizeof dargs, .x = &x, .topk_probs = &probs, .recv_x = &rx, .recv_probs = &rp};
    if (sc->stall) { /* rank 1 never sends: rank 0 must give up after timeout_ms, naming rank 1 */
        if (r == 0) {
            EXPECT_CALL_FAILS(&ti, vt->dispatch(ti.ctx, NULL, &dargs), MOERT_ERR_TIMEOUT,
                              "dispatch() on rank 0: rank 1 did not deliver its rows within 200 ms (timeout_ms)");
            EXPECT_CALL_FAILS(&ti, vt->dispatch(ti.ctx, NULL, &dargs), MOERT_ERR_TIMEOUT, "cannot be used again");
        }
        pthread_barrier_wait(&sc->barrier); /* peers keep their buffers until rank 0 is done writing into them */
        goto exit;
    }
    EXPECT_CALL_OK(&ti, vt->dispatch(ti.ctx, NULL, &dargs));
    if (sc->plugin->peer_buffers) check_second_dispatch(sc, &ti, &dargs, recv_x, recv_probs, cap + extra);
    uint16_t *want_fp8 = sc->fp8 ? calloc((size_t)H, sizeof(uint16_t)) : NULL;
    double fp8_worst = 0;

    /* (a) exactly the reference rows, byte for byte, with their probs; zero padding */
    int64_t i_ref = 0;
    int bad_rows = 0, bad_probs = 0, bad_pad = 0;
    for (int64_t l = 0; l < El; l++) {
        for (int64_t j = 0; j < ref.group_rows[l]; j++) {
            int64_t row = ref.group_start[l] + j;
            const unsigned char *got = recv_x + (size_t)row * row_bytes;
            if (j < ref.expert_rows[l]) {
                dispatch_ref_row want = ref.rows[i_ref++];
                const unsigned char *src =
                    (const unsigned char *)sc->rank[want.source].x + (size_t)want.token * row_bytes;
                if (sc->fp8) { /* the quantize-dequantize of the source row, bit for bit, and close to it */
                    sc->plugin->fp8_round_trip((const uint16_t *)src, H, want_fp8);
                    if (memcmp(got, want_fp8, row_bytes) != 0) bad_rows++;
                    for (int64_t h = 0; h < H; h++) {
                        double a = moert_bf16_to_float(((const uint16_t *)got)[h]);
                        double b = moert_bf16_to_float(((const uint16_t *)src)[h]);
                        if (fabs(a - b) > fp8_worst && h >= 128) fp8_worst = fabs(a - b); /* block 0 has odd bits */
                    }
                } else if (memcmp(got, src, row_bytes) != 0) {
                    bad_rows++;
                }
                if (recv_probs[row] != sc->rank[want.source].probs[want.token * K + want.k]) bad_probs++;
            } else {
                for (size_t b = 0; b < row_bytes; b++) bad_pad += got[b] != 0;
                bad_pad += recv_probs[row] != 0.0;
            }
        }
    }
    EXPECT_EQ_INT(bad_rows, 0);
    EXPECT_EQ_INT(bad_probs, 0);
    if (sc->fp8) EXPECT(fp8_worst > 0 && fp8_worst <= 1.0 / 16); /* really quantized, within E4M3's step of |x| < 1 */
    free(want_fp8);
    EXPECT_EQ_INT(bad_pad, 0);
    int bad_sentinel = 0;
    for (size_t b = (size_t)filled * row_bytes; b < (size_t)(cap + extra) * row_bytes; b++)
        bad_sentinel += recv_x[b] != 0x5a;
    for (int64_t i = filled; i < cap + extra; i++) bad_sentinel += recv_probs[i] != -7.0;
    EXPECT_EQ_INT(bad_sentinel, 0);
    check_bytes_sent(sc, r, row_bytes);

    /* (b) rows times their prob, combined, give sum_k p[t,k] x[t] (= x[t] where the kept probs sum to 1) */
    double *y_expert = calloc((size_t)(cap + 1), (size_t)H * sizeof(double));
    for (int64_t i = 0; i < filled; i++)
        for (int64_t h = 0; h < H; h++) y_expert[i * H + h] = moert_load(&rx, i * H + h) * recv_probs[i];
    for (int64_t i = filled; i <= cap; i++) /* rows past the filled ones and past capacity: must not be read */
        for (int64_t h = 0; h < H; h++) y_expert[i * H + h] = 1e300;
    double *y = calloc((size_t)d->T * (size_t)H, sizeof(double));
    for (int64_t i = 0; i < d->T * H; i++) y[i] = 99.0; /* overwritten, not accumulated */
    moert_tensor ye = moert_tensor_2d(y_expert, moert_cpu(), MOERT_F64, cap + 1, H);
    moert_tensor yt = moert_tensor_2d(y, moert_cpu(), MOERT_F64, d->T, H);
    moert_combine_args cargs = {.struct_size = sizeof cargs, .y_expert = &ye, .y = &yt};
    EXPECT_CALL_OK(&ti, vt->combine(ti.ctx, NULL, &cargs));
    int bad_y = 0, bad_identity = 0;
    for (int64_t t = 0; t < d->T; t++) {
        double psum = 0;
        for (int64_t k = 0; k < K; k++) psum += d->idx[t * K + k] >= 0 ? d->probs[t * K + k] : 0.0;
        for (int64_t h = 0; h < H; h++) {
            double xv = moert_load(&x, t * H + h), got = y[t * H + h];
            if (!(fabs(got - psum * xv) <= 1e-12 * (1 + fabs(xv)))) bad_y++;
            if (psum > 0 && sc->probs_dtype == MOERT_F64 && !(fabs(got - xv) <= 1e-12 * (1 + fabs(xv)))) bad_identity++;
            if (psum == 0 && got != 0.0) bad_y++;
        }
    }
    if (!sc->fp8) {
        EXPECT_EQ_INT(bad_y, 0);
        EXPECT_EQ_INT(bad_identity, 0);
    }

    /* (e) combine of the received rows themselves, in the rows' dtype: y[t] = (kept copies) * x[t], exact */
    if (sc->dtype == MOERT_BF16 && !sc->fp8) {
        uint16_t *y16 = calloc((size_t)(d->T * H), sizeof(uint16_t));
        moert_tensor y16t = moert_tensor_2d(y16, moert_cpu(), MOERT_BF16, d->T, H);
        moert_tensor rx_cap = moert_tensor_2d(recv_x, moert_cpu(), MOERT_BF16, cap, H);
        moert_combine_args c16 = {.struct_size = sizeof c16, .y_expert = &rx_cap, .y = &y16t};
        EXPECT_CALL_OK(&ti, vt->combine(ti.ctx, NULL, &c16));
        int bad16 = 0;
        for (int64_t t = 0; t < d->T; t++) {
            int kept = 0;
            for (int64_t k = 0; k < K; k++) kept += d->idx[t * K + k] >= 0;
            for (int64_t h = 0; h < H; h++) {
                double want = kept * moert_load(&x, t * H + h);
                uint16_t want_bits = moert_bf16_from_float((float)want);
                if (kept == 1) want_bits = ((const uint16_t *)d->x)[t * H + h]; /* the very bits, -0 included */
                if (kept == 0) want_bits = 0;
                bad16 += y16[t * H + h] != want_bits;
            }
        }
        EXPECT_EQ_INT(bad16, 0);
        free(y16);
    }

    /* (c) adjointness: <combine(a), b> vs <a, combine_backward(b)> */
    double *a = calloc((size_t)(cap + 1) * (size_t)H, sizeof(double));
    double *b = calloc((size_t)d->T * (size_t)H, sizeof(double));
    double *ya = calloc((size_t)d->T * (size_t)H, sizeof(double));
    double *cb = calloc((size_t)(cap + 1) * (size_t)H, sizeof(double));
    for (int64_t i = 0; i < cap * H; i++) a[i] = test_uniform(&rng);
    for (int64_t i = 0; i < d->T * H; i++) b[i] = test_uniform(&rng);
    for (int64_t i = 0; i < (cap + 1) * H; i++) cb[i] = 5.0; /* padding rows must become 0 */
    moert_tensor at = moert_tensor_2d(a, moert_cpu(), MOERT_F64, cap, H);
    moert_tensor bt = moert_tensor_2d(b, moert_cpu(), MOERT_F64, d->T, H);
    moert_tensor yat = moert_tensor_2d(ya, moert_cpu(), MOERT_F64, d->T, H);
    moert_tensor cbt = moert_tensor_2d(cb, moert_cpu(), MOERT_F64, cap, H);
    moert_combine_args ca = {.struct_size = sizeof ca, .y_expert = &at, .y = &yat};
    moert_combine_backward_args cba = {.struct_size = sizeof cba, .d_y = &bt, .d_y_expert = &cbt};
    EXPECT_CALL_OK(&ti, vt->combine(ti.ctx, NULL, &ca));
    EXPECT_CALL_OK(&ti, vt->combine_backward(ti.ctx, NULL, &cba));
    res->combine_lhs = dot(&yat, &bt, d->T * H);
    res->combine_rhs = dot(&at, &cbt, filled * H); /* rows past the filled ones are not data */
    int bad_cb_pad = 0;
    for (int64_t l = 0; l < El; l++)
        for (int64_t j = ref.expert_rows[l]; j < ref.group_rows[l]; j++)
            for (int64_t h = 0; h < H; h++) bad_cb_pad += cb[(ref.group_start[l] + j) * H + h] != 0.0;
    EXPECT_EQ_INT(bad_cb_pad, 0);

    /* (c) adjointness: <dispatch(x), r> vs <x, dispatch_backward(r)>, rows and probs separately;
     * d_x is accumulated into, so it starts at c0 and c0 is taken off again */
    double *r_x = calloc((size_t)(cap + 1) * (size_t)H, sizeof(double));
    double *r_p = calloc((size_t)(cap + 1), sizeof(double));
    double *c0 = calloc((size_t)d->T * (size_t)H, sizeof(double));
    double *d_x = calloc((size_t)d->T * (size_t)H, sizeof(double));
    double *d_p = calloc((size_t)(d->T * K), sizeof(double));
    for (int64_t i = 0; i < cap * H; i++) r_x[i] = test_uniform(&rng);
    for (int64_t i = 0; i < cap; i++) r_p[i] = test_uniform(&rng);
    for (int64_t i = 0; i < d->T * H; i++) d_x[i] = c0[i] = test_uniform(&rng);
    for (int64_t i = 0; i < d->T * K; i++) d_p[i] = 42.0; /* overwritten */
    moert_tensor r_xt = moert_tensor_2d(r_x, moert_cpu(), MOERT_F64, cap, H);
    moert_tensor r_pt = moert_tensor_1d(r_p, moert_cpu(), MOERT_F64, cap);
    moert_tensor d_xt = moert_tensor_2d(d_x, moert_cpu(), MOERT_F64, d->T, H);
    moert_tensor d_pt = moert_tensor_2d(d_p, moert_cpu(), MOERT_F64, d->T, K);
    moert_dispatch_backward_args dba = {
        .struct_size = sizeof dba, .d_recv_x = &r_xt, .d_recv_probs = &r_pt, .d_x = &d_xt, .d_topk_probs = &d_pt};
    EXPECT_CALL_OK(&ti, vt->dispatch_backward(ti.ctx, NULL, &dba));
    moert_tensor rp_cap = moert_tensor_1d(recv_probs, moert_cpu(), MOERT_F64, cap);
    res->rows_lhs = 0;
    for (int64_t i = 0; i < filled * H; i++) res->rows_lhs += moert_load(&rx, i) * r_x[i];
    res->probs_lhs = dot(&rp_cap, &r_pt, filled);
    res->rows_rhs = 0;
    for (int64_t i = 0; i < d->T * H; i++) res->rows_rhs += moert_load(&x, i) * (d_x[i] - c0[i]);
    res->probs_rhs = 0;
    for (int64_t i = 0; i < d->T * K; i++) res->probs_rhs += d->probs[i] * d_p[i];
    int bad_dropped = 0;
    for (int64_t t = 0; t < d->T; t++) {
        int kept = 0;
        for (int64_t k = 0; k < K; k++) {
            if (d->idx[t * K + k] >= 0)
                kept++;
            else
                bad_dropped += d_p[t * K + k] != 0.0;
        }
        if (!kept)
            for (int64_t h = 0; h < H; h++) bad_dropped += d_x[t * H + h] != c0[t * H + h];
    }
    EXPECT_EQ_INT(bad_dropped, 0);

    free(y_expert);
    free(y);
    free(a);
    free(b);
    free(ya);
    free(cb);
    free(r_x);
    free(r_p);
    free(c0);
    free(d_x);
    free(d_p);
exit:
    free(recv_x);
    free(recv_probs);
    free(probs_stored);
    free(ref.rows);
    test_instance_close(&ti);
}

void dispatch_run_scenario(const dispatch_test_plugin *plugin, dispatch_scenario sc)
{
    int failures_before = test_failures;
    sc.plugin = plugin;
    if (sc.E == 0) sc.E = 8;
    if (sc.H == 0) sc.H = 5;
    if (sc.K == 0) sc.K = 2;
    if (sc.T == 0) sc.T = 11;
    if (sc.capacity_factor == 0) sc.capacity_factor = 1.0;
    if (!sc.seed) sc.seed = 1234 + (uint64_t)sc.world;
    make_data(&sc);
    if (sc.world > 1 && moert_comm_group_create(sc.world, 30.0, &sc.comm) != MOERT_OK) {
        fprintf(stderr, "%s: comm group: %s\n", sc.name, moert_error_message());
        test_failures++;
        free_data(&sc);
        return;
    }
    const bool stalls = sc.stall || sc.stall_prepare;
    if (stalls) pthread_barrier_init(&sc.barrier, NULL, (unsigned)sc.world);
    test_run_ranks(sc.world, run_rank, &sc);
    if (stalls) pthread_barrier_destroy(&sc.barrier);
    if (!sc.prepare_error && !stalls) {
        double c_l = 0, c_r = 0, x_l = 0, x_r = 0, p_l = 0, p_r = 0;
        for (int r = 0; r < sc.world; r++) {
            c_l += sc.result[r].combine_lhs;
            c_r += sc.result[r].combine_rhs;
            x_l += sc.result[r].rows_lhs;
            x_r += sc.result[r].rows_rhs;
            p_l += sc.result[r].probs_lhs;
            p_r += sc.result[r].probs_rhs;
        }
        EXPECT_NEAR(c_l, c_r, 1e-12, 1e-12);
        if (!sc.fp8) EXPECT_NEAR(x_l, x_r, 1e-12, 1e-12); /* quantized rows are not the adjoint's */
        EXPECT_NEAR(p_l, p_r, 1e-12, 1e-12);
        EXPECT(fabs(c_l) > 1e-3 || sc.routing == ROUTE_HOT); /* the identities compare real sums */
    }
    if (sc.comm) moert_comm_group_free(sc.comm);
    free_data(&sc);
    fprintf(stderr, "%-40s world %d: %s\n", sc.name, sc.world, test_failures == failures_before ? "ok" : "FAILED");
}

/* ---- bad calls at world 1 ---- */

/* Opens the fixture's instance and checks that dispatch() before prepare() is refused. */
static void dispatch_error_fixture_open(dispatch_error_fixture *f, const dispatch_test_plugin *plugin, int64_t capacity)
{
    memset(f, 0, sizeof *f);
    f->plugin = plugin;
    f->capacity = capacity;
    f->layer = test_layer(4, 8, 4, 2, 3, 1, 0, MOERT_F64);
    EXPECT_OK(dispatch_test_open(&f->ti, plugin, "{}", &f->layer, NULL, 0, 1, &f->metrics));
    f->vt = dispatch_vtable(&f->ti);

    const int32_t idx[6] = {0, 1, 2, -1, 3, 0};
    memcpy(f->idx, idx, sizeof idx);
    f->xt = moert_tensor_2d(f->x, moert_cpu(), MOERT_F64, 3, 4);
    f->pt = moert_tensor_2d(f->probs, moert_cpu(), MOERT_F64, 3, 2);
    f->rxt = moert_tensor_2d(f->recv_x, moert_cpu(), MOERT_F64, capacity, 4);
    f->rpt = moert_tensor_1d(f->recv_probs, moert_cpu(), MOERT_F64, capacity);
    f->it = moert_tensor_2d(f->idx, moert_cpu(), MOERT_I32, 3, 2);
    f->yt = moert_tensor_2d(f->y, moert_cpu(), MOERT_F64, 3, 4);
    f->da = (moert_dispatch_args){
        .struct_size = sizeof f->da, .x = &f->xt, .topk_probs = &f->pt, .recv_x = &f->rxt, .recv_probs = &f->rpt};
    f->ca = (moert_combine_args){.struct_size = sizeof f->ca, .y_expert = &f->rxt, .y = &f->yt};
    f->layout = (moert_dispatch_layout){.struct_size = sizeof f->layout};
    EXPECT_CALL_FAILS(&f->ti, f->vt->dispatch(f->ti.ctx, NULL, &f->da), MOERT_ERR_INVALID_ARGUMENT,
                      "dispatch(): called before a successful prepare()");
}

/* Bad topk_idx and a short layout struct refused by prepare(); then a good prepare() with 5 rows received. */
static void dispatch_check_prepare_errors(dispatch_error_fixture *f)
{
    test_instance *ti = &f->ti;
    const moert_dispatcher_v1 *vt = f->vt;
    f->idx[3] = 4; /* E = 4: out of range */
    EXPECT_CALL_FAILS(ti, vt->prepare(ti->ctx, NULL, &f->it, &f->layout), MOERT_ERR_INVALID_ARGUMENT,
                      "prepare(): topk_idx[1][1] is 4, expected an expert id in [0, 4) or -1 (dropped)");
    f->idx[3] = -2;
    EXPECT_CALL_FAILS(ti, vt->prepare(ti->ctx, NULL, &f->it, &f->layout), MOERT_ERR_INVALID_ARGUMENT,
                      "topk_idx[1][1] is -2");
    f->idx[3] = -1;
    moert_tensor it_wrong = moert_tensor_2d(f->idx, moert_cpu(), MOERT_I32, 2, 3);
    EXPECT_CALL_FAILS(ti, vt->prepare(ti->ctx, NULL, &it_wrong, &f->layout), MOERT_ERR_INVALID_ARGUMENT,
                      "prepare(): topk_idx has shape [2, 3], expected [T, 2]");
    moert_tensor it_i64 = moert_tensor_2d(f->idx, moert_cpu(), MOERT_I64, 3, 2);
    EXPECT_CALL_FAILS(ti, vt->prepare(ti->ctx, NULL, &it_i64, &f->layout), MOERT_ERR_INVALID_ARGUMENT,
                      "prepare(): topk_idx has dtype int64, expected int32");
    moert_dispatch_layout small = {.struct_size = 4};
    EXPECT_CALL_FAILS(ti, vt->prepare(ti->ctx, NULL, &f->it, &small), MOERT_ERR_INVALID_ARGUMENT,
                      "layout.struct_size is 4");

    EXPECT_CALL_OK(ti, vt->prepare(ti->ctx, NULL, &f->it, &f->layout));
    EXPECT_EQ_INT(f->layout.num_recv, 5);
}

/* Bad recv_x, x and recv_probs, and x on a GPU, refused by dispatch(); then a good dispatch(). */
static void dispatch_check_dispatch_errors(dispatch_error_fixture *f)
{
    test_instance *ti = &f->ti;
    const moert_dispatcher_v1 *vt = f->vt;
    moert_dispatch_args *da = &f->da;
    char too_few_rows[128];
    snprintf(too_few_rows, sizeof too_few_rows,
             "dispatch(): recv_x has shape [4, 4], expected [>= %lld, 4] (capacity from prepare(), hidden)",
             (long long)f->capacity);
    moert_tensor rx_small = moert_tensor_2d(f->recv_x, moert_cpu(), MOERT_F64, 4, 4);
    da->recv_x = &rx_small;
    EXPECT_CALL_FAILS(ti, vt->dispatch(ti->ctx, NULL, da), MOERT_ERR_INVALID_ARGUMENT, too_few_rows);
    moert_tensor rx_f32 = moert_tensor_2d(f->recv_x, moert_cpu(), MOERT_F32, f->capacity, 4);
    da->recv_x = &rx_f32;
    EXPECT_CALL_FAILS(ti, vt->dispatch(ti->ctx, NULL, da), MOERT_ERR_INVALID_ARGUMENT,
                      "dispatch(): recv_x has dtype fp32, expected fp64");
    da->recv_x = &f->rxt;
    moert_tensor x_wrong = moert_tensor_2d(f->x, moert_cpu(), MOERT_F64, 2, 4);
    da->x = &x_wrong;
    EXPECT_CALL_FAILS(ti, vt->dispatch(ti->ctx, NULL, da), MOERT_ERR_INVALID_ARGUMENT,
                      "dispatch(): x has shape [2, 4], expected [3, 4] (T from prepare(), hidden)");
    da->x = &f->xt;
    da->recv_probs = NULL;
    EXPECT_CALL_FAILS(ti, vt->dispatch(ti->ctx, NULL, da), MOERT_ERR_INVALID_ARGUMENT,
                      "topk_probs and recv_probs must be given together");
    da->recv_probs = &f->rpt;
    moert_tensor x_gpu = f->xt;
    x_gpu.device = (moert_device){MOERT_DEVICE_CUDA, 1};
    da->x = &x_gpu;
    EXPECT_CALL_FAILS(ti, vt->dispatch(ti->ctx, NULL, da), MOERT_ERR_UNSUPPORTED, "x is on cuda:1");
    da->x = &f->xt;
    EXPECT_CALL_OK(ti, vt->dispatch(ti->ctx, NULL, da));
}

/* combine() refuses an int32 y_expert; f->ca is left as it was. */
static void dispatch_check_combine_refuses_int32(dispatch_error_fixture *f)
{
    const moert_tensor *y_expert = f->ca.y_expert;
    moert_tensor ye_i32 = moert_tensor_2d(f->recv_x, moert_cpu(), MOERT_I32, f->capacity, 4);
    f->ca.y_expert = &ye_i32;
    EXPECT_CALL_FAILS(&f->ti, f->vt->combine(f->ti.ctx, NULL, &f->ca), MOERT_ERR_UNSUPPORTED,
                      "combine(): y_expert has dtype int32, expected fp32, fp64, bf16 or fp16");
    f->ca.y_expert = y_expert;
}

/* Each option text bad_options[i][0] is refused at init with a message naming bad_options[i][1]. */
static void dispatch_check_bad_options(const dispatch_test_plugin *plugin, const moert_layer_info *layer,
                                       const char *const bad_options[][2], size_t count)
{
    dispatch_rank_result metrics = {0};
    for (size_t i = 0; i < count; i++) {
        test_instance ti;
        EXPECT(dispatch_test_open(&ti, plugin, bad_options[i][0], layer, NULL, 0, 1, &metrics) == MOERT_ERR_CONFIG);
        EXPECT_ERROR_CONTAINS(bad_options[i][1]);
        test_instance_close(&ti);
    }
}

/* init() refuses a layer on a GPU (a CPU path only) and E not divisible by the world. */
static void dispatch_check_init_refusals(const dispatch_test_plugin *plugin, const moert_layer_info *layer)
{
    moert_plugin loaded;
    EXPECT_OK(moert_plugin_load(MOERT_KIND_DISPATCHER, plugin->name, &loaded));
    json_t *opts = json_object();
    moert_section *sec = moert_section_create(opts, "$.dispatcher");
    moert_host *host = NULL;
    char who[64];
    snprintf(who, sizeof who, "dispatcher[%s]", plugin->name);
    moert_host_setup setup = {
        .who = who, .options = sec, .comm = NULL, .rank = 0, .world_size = 1, .device = moert_cpu()};
    EXPECT_OK(moert_host_create(&setup, &host));
    if (host) {
        const moert_dispatcher_v1 *pv = (const moert_dispatcher_v1 *)loaded.header;
        moert_layer_info gpu_layer = *layer;
        gpu_layer.device = (moert_device){MOERT_DEVICE_CUDA, 0};
        void *ctx = NULL;
        EXPECT_EQ_INT(pv->init(&ctx, host, &gpu_layer), MOERT_ERR_UNSUPPORTED);
        const char *m = moert_host_take_error(host);
        if (!(strstr(m, "only a CPU path") && strstr(m, "cuda:0"))) fprintf(stderr, "init on cuda:0 said: %s\n", m);
        EXPECT(strstr(m, "only a CPU path") && strstr(m, "cuda:0"));
        moert_layer_info odd = test_layer(4, 8, 5, 2, 3, 1, 0, MOERT_F64);
        odd.num_local_experts = 2; /* as if 5 experts were split over 2 ranks */
        EXPECT_EQ_INT(pv->init(&ctx, host, &odd), MOERT_ERR_INVALID_ARGUMENT);
        EXPECT(strstr(moert_host_take_error(host), "num_experts (5) divisible by world_size (1)") != NULL);
        moert_host_free(host);
    }
    moert_section_free(sec);
    json_decref(opts);
    moert_plugin_unload(&loaded);
}

void dispatch_check_errors(const dispatch_test_plugin *plugin, const char *const bad_options[][2], size_t count)
{
    dispatch_error_fixture f;
    dispatch_error_fixture_open(&f, plugin, plugin->error_capacity);
    dispatch_check_prepare_errors(&f);
    if (plugin->check_after_prepare) plugin->check_after_prepare(&f);
    if (plugin->combine_needs_dispatch)
        EXPECT_CALL_FAILS(&f.ti, f.vt->combine(f.ti.ctx, NULL, &f.ca), MOERT_ERR_INVALID_ARGUMENT,
                          "combine(): called before dispatch() or combine_backward() of this step");
    dispatch_check_dispatch_errors(&f);
    dispatch_check_combine_refuses_int32(&f);
    if (plugin->combine_needs_dispatch) EXPECT_CALL_OK(&f.ti, f.vt->combine(f.ti.ctx, NULL, &f.ca));
    test_instance_close(&f.ti);

    dispatch_check_bad_options(plugin, &f.layer, bad_options, count);
    dispatch_check_init_refusals(plugin, &f.layer);
    fprintf(stderr, "%-40s world 1: %s\n", "errors", "done");
}

void dispatch_run_common_scenarios(const dispatch_test_plugin *plugin, int world)
{
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "random fp64",
                                                      .world = world,
                                                      .dtype = MOERT_F64,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_RANDOM});
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "random fp32, fp32 probs",
                                                      .world = world,
                                                      .dtype = MOERT_F32,
                                                      .probs_dtype = MOERT_F32,
                                                      .routing = ROUTE_RANDOM,
                                                      .seed = 77});
    dispatch_run_scenario(
        plugin,
        (dispatch_scenario){
            .name = "hot expert", .world = world, .dtype = MOERT_F64, .probs_dtype = MOERT_F64, .routing = ROUTE_HOT});
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "tokens with every copy dropped",
                                                      .world = world,
                                                      .dtype = MOERT_F64,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_SOME_DROPPED});
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "bf16 rows, bit-exact",
                                                      .world = world,
                                                      .dtype = MOERT_BF16,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_RANDOM,
                                                      .H = 8});
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "K=1, E=4 (one expert per rank at 4)",
                                                      .world = world,
                                                      .dtype = MOERT_F64,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_RANDOM,
                                                      .E = 4,
                                                      .K = 1,
                                                      .seed = 99});
    if (world == 1) return;
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "rank 0 has no tokens",
                                                      .world = world,
                                                      .dtype = MOERT_F64,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_RANDOM,
                                                      .T = -1});
    dispatch_run_scenario(plugin, (dispatch_scenario){.name = "rank 0 receives nothing",
                                                      .world = world,
                                                      .dtype = MOERT_F64,
                                                      .probs_dtype = MOERT_F64,
                                                      .routing = ROUTE_AVOID_RANK0});
    dispatch_run_scenario(
        plugin, (dispatch_scenario){.name = "bad expert id on rank 1",
                                    .world = world,
                                    .dtype = MOERT_F64,
                                    .probs_dtype = MOERT_F64,
                                    .routing = ROUTE_BAD_INDEX,
                                    .prepare_error = "rank 1 failed its prepare()",
                                    .prepare_error_r1 = "topk_idx[2][1] is 99, expected an expert id in [0, 8)"});
}
