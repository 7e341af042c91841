/* SPDX-License-Identifier: Apache-2.0 */
/* Host services: every member set, CPU memory, streams, options, errors, logging, metrics, collectives. */
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

#include "error.h"
#include "test_util.h"

typedef struct metric_record {
    int count;
    char name[64], unit[16];
    double value;
} metric_record;

static void sink(void *user, const char *name, double value, const char *unit)
{
    metric_record *m = user;
    m->count++;
    snprintf(m->name, sizeof m->name, "%s", name);
    snprintf(m->unit, sizeof m->unit, "%s", unit);
    m->value = value;
}

static moert_host *make_host(moert_section *options, moert_comm_group *comm, int rank, int world, moert_device dev,
                             metric_record *metrics)
{
    moert_host_setup setup = {.who = "router[test] layer 0 rank 0",
                              .options = options,
                              .comm = comm,
                              .rank = rank,
                              .world_size = world,
                              .device = dev,
                              .metric = metrics ? sink : NULL,
                              .metric_user = metrics};
    moert_host *h = NULL;
    EXPECT_OK(moert_host_create(&setup, &h));
    return h;
}

/* Every member of the table is set; sizes and versions are the current ones. */
static void test_table(void)
{
    moert_host *h = make_host(NULL, NULL, 0, 1, moert_cpu(), NULL);
    if (!h) return;
    EXPECT_EQ_INT(h->struct_size, sizeof(moert_host));
    EXPECT_EQ_INT(h->abi_version, MOERT_ABI_CURRENT);
    EXPECT(h->impl != NULL);
    EXPECT_EQ_INT(h->rank, 0);
    EXPECT_EQ_INT(h->world_size, 1);
    /* all function pointers after the data members */
    const size_t first_fn = offsetof(moert_host, log);
    for (size_t off = first_fn; off < sizeof(moert_host); off += sizeof(void (*)(void))) {
        void (*fn)(void);
        memcpy(&fn, (const char *)h + off, sizeof fn);
        if (!fn) {
            fprintf(stderr, "host member at offset %zu is NULL\n", off);
            test_failures++;
        }
    }
    /* instance flags: the header's until the plugin declares its own */
    EXPECT_EQ_INT(moert_host_instance_flags(h, MOERT_CAP_NEEDS_HOST_SYNC), MOERT_CAP_NEEDS_HOST_SYNC);
    h->set_flags(h, MOERT_CAP_GRAPH_CAPTURABLE);
    EXPECT_EQ_INT(moert_host_instance_flags(h, MOERT_CAP_NEEDS_HOST_SYNC), MOERT_CAP_GRAPH_CAPTURABLE);
    h->set_flags(h, 0);
    EXPECT_EQ_INT(moert_host_instance_flags(h, MOERT_CAP_GRAPH_CAPTURABLE), 0);
    moert_host_free(h);

    moert_host_setup bad = {.who = "x", .rank = 0, .world_size = 2, .device = moert_cpu()};
    EXPECT_EQ_INT(moert_host_create(&bad, &h), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "host: a world of 2 ranks needs a communicator") == 0);
    bad.world_size = 1;
    bad.rank = 1;
    EXPECT_EQ_INT(moert_host_create(&bad, &h), MOERT_ERR_INVALID_ARGUMENT);
    EXPECT(strcmp(moert_error_message(), "host: rank 1 of world 1") == 0);
}

/* CPU memory: aligned, zeroed, usable; pinned memory likewise; memcpy and streams are synchronous. */
static void test_memory_and_streams(void)
{
    moert_host *h = make_host(NULL, NULL, 0, 1, moert_cpu(), NULL);
    if (!h) return;
    for (size_t bytes = 0; bytes < 300; bytes += 37) {
        unsigned char *p = NULL;
        EXPECT_OK(h->alloc(h, moert_cpu(), bytes, (void **)&p));
        EXPECT(p != NULL && ((uintptr_t)p % 64) == 0);
        bool zero = true;
        for (size_t i = 0; i < bytes; i++) zero = zero && p[i] == 0;
        EXPECT(zero);
        memset(p, 0xab, bytes);
        h->free(h, moert_cpu(), p);
    }
    double *pinned = NULL;
    EXPECT_OK(h->alloc_pinned(h, 10 * sizeof(double), (void **)&pinned));
    EXPECT(pinned != NULL && ((uintptr_t)pinned % 64) == 0 && pinned[9] == 0.0);

    double src[10];
    for (int i = 0; i < 10; i++) src[i] = i * 1.25;
    moert_stream s = (moert_stream)1;
    EXPECT_OK(h->stream_create(h, &s));
    EXPECT(s == NULL);
    moert_event e = (moert_event)1;
    EXPECT_OK(h->event_create(h, &e));
    EXPECT(e == NULL);
    moert_device host_pinned = {MOERT_DEVICE_CUDA_HOST, 0};
    EXPECT_OK(h->memcpy_async(h, pinned, host_pinned, src, moert_cpu(), sizeof src, s));
    EXPECT_OK(h->event_record(h, e, s));
    EXPECT_OK(h->stream_wait_event(h, s, e));
    EXPECT_OK(h->stream_synchronize(h, s));
    EXPECT(memcmp(pinned, src, sizeof src) == 0);
    h->event_destroy(h, e);
    h->stream_destroy(h, s);
    h->free_pinned(h, pinned);

    /* a CUDA device is refused with a clear message, kept for the plugin too */
    moert_device gpu = {MOERT_DEVICE_CUDA, 1};
    void *p = (void *)1;
    EXPECT_EQ_INT(h->alloc(h, gpu, 16, &p), MOERT_ERR_UNSUPPORTED);
    EXPECT(p == NULL);
    EXPECT(strcmp(moert_error_message(), "alloc: cuda:1 is not supported by this host (CPU only)") == 0);
    EXPECT(strcmp(moert_host_take_error(h), "alloc: cuda:1 is not supported by this host (CPU only)") == 0);
    EXPECT(strcmp(moert_host_take_error(h), "") == 0);
    EXPECT_EQ_INT(h->memcpy_async(h, src, moert_cpu(), src, gpu, 8, NULL), MOERT_ERR_UNSUPPORTED);
    EXPECT_EQ_INT(h->allgather(h, src, src, 8, gpu, NULL), MOERT_ERR_UNSUPPORTED);
    EXPECT(strcmp(moert_error_message(), "allgather: cuda:1 is not supported by this host (CPU only)") == 0);
    moert_host_free(h);

    moert_host *gh = make_host(NULL, NULL, 0, 1, gpu, NULL);
    if (gh) {
        EXPECT_EQ_INT(gh->stream_create(gh, &s), MOERT_ERR_UNSUPPORTED);
        EXPECT(strcmp(moert_error_message(), "stream_create: cuda:1 is not supported by this host (CPU only)") == 0);
        moert_host_free(gh);
    }
}

/* Options go through the section: values, defaults, errors kept for the plugin, describe mode. */
static void test_options(void)
{
    json_error_t jerr;
    json_t *obj = json_loads("{\"plugin\": \"x\", \"n\": 5, \"f\": 0.5, \"b\": true, \"s\": \"hi\", \"e\": \"two\","
                             " \"bad\": \"oops\"}",
                             0, &jerr);
    moert_section *sec = moert_section_create(obj, "$.router");
    moert_section_allow(sec, "plugin");
    moert_section_set_describe(sec, true);
    moert_host *h = make_host(sec, NULL, 0, 1, moert_cpu(), NULL);
    if (!h) return;
    int64_t n = 0;
    double f = 0;
    bool b = false;
    const char *s = NULL;
    int e = -1;
    static const char *const choices[] = {"one", "two", NULL};
    EXPECT_OK(h->option_int(h, "n", 1, 0, 10, "an int", &n));
    EXPECT_OK(h->option_float(h, "f", 1.0, 0.0, 1.0, "a float", &f));
    EXPECT_OK(h->option_bool(h, "b", false, "a bool", &b));
    EXPECT_OK(h->option_string(h, "s", "d", "a string", &s));
    EXPECT_OK(h->option_enum(h, "e", choices, 0, "an enum", &e));
    EXPECT_EQ_INT(n, 5);
    EXPECT_NEAR(f, 0.5, 0, 0);
    EXPECT(b);
    EXPECT(s && strcmp(s, "hi") == 0);
    EXPECT_EQ_INT(e, 1);
    EXPECT_EQ_INT(moert_section_check_unknown(sec), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_error_message(), "config error at $.router.bad: unknown key (did you mean \"b\"?)") == 0);

    int64_t bad = 0;
    EXPECT_EQ_INT(h->option_int(h, "bad", 1, 0, 10, "a bad one", &bad), MOERT_ERR_CONFIG);
    EXPECT(strcmp(moert_host_take_error(h),
                  "config error at $.router.bad: got \"oops\", expected an integer in [0, 10]") == 0);
    EXPECT_OK(moert_section_check_unknown(sec));
    EXPECT_EQ_INT(moert_section_option_count(sec), 6);
    const moert_option_desc *d = moert_section_option(sec, 4);
    EXPECT(d && strcmp(d->key, "e") == 0 && strcmp(d->range, "one|two") == 0 && strcmp(d->help, "an enum") == 0);

    h->set_error(h, "custom %d", 42);
    EXPECT(strcmp(moert_host_take_error(h), "custom 42") == 0);
    moert_host_free(h);
    moert_section_free(sec);
    json_decref(obj);

    /* without a section every option takes its default */
    h = make_host(NULL, NULL, 0, 1, moert_cpu(), NULL);
    if (h) {
        EXPECT_OK(h->option_int(h, "n", 9, 0, 10, "", &n));
        EXPECT_EQ_INT(n, 9);
        moert_host_free(h);
    }
}

/* log lines go to stderr as "moert[level] who: message", filtered by MOERT_LOG (warn here). */
static void test_log_and_metrics(void)
{
    char path[] = "/tmp/moert-test-host-log-XXXXXX";
    int fd = mkstemp(path);
    EXPECT(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    metric_record m = {0};
    moert_host *h = make_host(NULL, NULL, 0, 1, moert_cpu(), &m);
    if (h) {
        h->log(h, MOERT_LOG_WARN, "capacity %d is small", 3);
        h->log(h, MOERT_LOG_INFO, "not shown at warn");
        h->log(h, MOERT_LOG_ERROR, "bad thing\n");
        h->metric(h, "dispatch.recv_tokens", 812, "tokens");
    }
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char text[1024] = "";
    lseek(fd, 0, SEEK_SET);
    ssize_t n = read(fd, text, sizeof text - 1);
    text[n > 0 ? n : 0] = '\0';
    close(fd);
    unlink(path);
    const char *expected = "moert[warn] router[test] layer 0 rank 0: capacity 3 is small\n"
                           "moert[error] router[test] layer 0 rank 0: bad thing\n";
    if (strcmp(text, expected) != 0) {
        fprintf(stderr, "log:\n%s\nexpected:\n%s\n", text, expected);
        test_failures++;
    }
    EXPECT_EQ_INT(m.count, 1);
    EXPECT(strcmp(m.name, "dispatch.recv_tokens") == 0 && strcmp(m.unit, "tokens") == 0 && m.value == 812);
    moert_host_free(h);
}

/* A world of one without a group: collectives are copies. */
static void test_world_of_one(void)
{
    moert_host *h = make_host(NULL, NULL, 0, 1, moert_cpu(), NULL);
    if (!h) return;
    float a[3] = {1, 2, 3}, b[3] = {0};
    EXPECT_OK(h->allgather(h, a, b, sizeof a, moert_cpu(), NULL));
    EXPECT(memcmp(a, b, sizeof a) == 0);
    EXPECT_OK(h->allreduce_sum(h, a, 3, MOERT_F32, moert_cpu(), NULL));
    EXPECT(a[0] == 1 && a[2] == 3);
    EXPECT_EQ_INT(h->allreduce_sum(h, a, 3, MOERT_I32, moert_cpu(), NULL), MOERT_ERR_UNSUPPORTED);
    char out[6] = "abcde", in[6] = "-----";
    size_t bytes[1] = {3}, send_off[1] = {1}, recv_off[1] = {2};
    EXPECT_OK(h->alltoallv(h, out, bytes, send_off, in, bytes, recv_off, moert_cpu(), NULL));
    EXPECT(strcmp(in, "--bcd") == 0);
    EXPECT_OK(h->barrier(h));
    void *peers[1] = {NULL};
    EXPECT_OK(h->exchange_peer_buffers(h, out, sizeof out, moert_cpu(), peers));
    EXPECT(peers[0] == out);
    moert_host_free(h);
}

typedef struct pair_run {
    moert_comm_group *group;
    int64_t sums[2][2];
    char peer_message[2][256];
} pair_run;

/* Two ranks through their host tables: allreduce and the group's timeout message kept by the host. */
static void pair_rank(int rank, void *user)
{
    pair_run *run = user;
    moert_host_setup setup = {.who = "x", .comm = run->group, .rank = rank, .world_size = 2, .device = moert_cpu()};
    moert_host *h = NULL;
    if (moert_host_create(&setup, &h) != MOERT_OK) return;
    int64_t v[2] = {rank + 1, 10 * (rank + 1)};
    if (h->allreduce_sum(h, v, 2, MOERT_I64, moert_cpu(), NULL) == MOERT_OK) memcpy(run->sums[rank], v, sizeof v);
    if (rank == 0 && h->barrier(h) != MOERT_OK)
        snprintf(run->peer_message[0], sizeof run->peer_message[0], "%s", moert_host_take_error(h));
    moert_host_free(h);
}

static void test_two_ranks(void)
{
    pair_run run = {0};
    EXPECT_OK(moert_comm_group_create(2, 0.2, &run.group));
    test_run_ranks(2, pair_rank, &run);
    for (int r = 0; r < 2; r++) EXPECT(run.sums[r][0] == 3 && run.sums[r][1] == 30);
    EXPECT(strcmp(run.peer_message[0], "barrier: rank 1 did not arrive within 0.2 s") == 0);
    moert_comm_group_free(run.group);
}

int main(void)
{
    setenv("MOERT_LOG", "warn", 1);
    test_table();
    test_memory_and_streams();
    test_options();
    test_log_and_metrics();
    test_world_of_one();
    test_two_ranks();
    return test_finish("test_host");
}
