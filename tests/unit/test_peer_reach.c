/* SPDX-License-Identifier: Apache-2.0 */
/* The NVLink dispatchers' peer-access check (plugins/lib/peer_reach.c) over reachability matrices: a full group
 * passes; two hosts of two GPUs each, one GPU without a peer path, and a one-way path are refused with a message
 * naming each rank, the ranks it cannot reach and the dispatchers that can serve the group; a long message is cut. */
#include "test_util.h"

#include "peer_reach.h"

/* Expects `needle` in msg. */
static void expect_has(const char *msg, const char *needle)
{
    if (strstr(msg, needle)) return;
    fprintf(stderr, "message \"%s\" lacks \"%s\"\n", msg, needle);
    test_failures++;
}

/* A matrix of world ranks where a and b reach each other when group[a] == group[b]. */
static void grouped(int world, const int *group, unsigned char *reach)
{
    for (int a = 0; a < world; a++)
        for (int b = 0; b < world; b++) reach[a * world + b] = group[a] == group[b];
}

int main(void)
{
    unsigned char reach[64];
    char msg[1024];

    /* every pair reaches (the diagonal is not read) */
    memset(reach, 1, sizeof reach);
    reach[0] = 0;
    EXPECT_EQ_INT(peer_reach_unreachable(4, reach, NULL, "deepep", msg, sizeof msg), 0);
    EXPECT_EQ_INT(msg[0], 0);

    /* two hosts of two GPUs */
    const int hosts[4] = {0, 0, 1, 1};
    const char *where[4] = {"node-a cuda:0", "node-a cuda:1", "node-b cuda:0", "node-b cuda:1"};
    grouped(4, hosts, reach);
    EXPECT_EQ_INT(peer_reach_unreachable(4, reach, where, "deepep", msg, sizeof msg), 8);
    expect_has(msg, "the deepep dispatcher writes into every other rank's GPU memory by peer access");
    expect_has(msg, "rank 0 (node-a cuda:0) cannot reach ranks 2 (node-b cuda:0), 3 (node-b cuda:1)");
    expect_has(msg, "; rank 3 (node-b cuda:1) cannot reach ranks 0 (node-a cuda:0), 1 (node-a cuda:1)");
    expect_has(msg, "use the \"alltoall\" dispatcher, or \"hierarchical\" with ranks_per_node");

    /* one GPU without a peer path to the others, no labels */
    const int islands[3] = {0, 0, 1};
    grouped(3, islands, reach);
    EXPECT_EQ_INT(peer_reach_unreachable(3, reach, NULL, "hybridep", msg, sizeof msg), 4);
    expect_has(msg, "the hybridep dispatcher");
    expect_has(msg, "rank 0 cannot reach rank 2; rank 1 cannot reach rank 2; rank 2 cannot reach ranks 0, 1;");

    /* a one-way path: only rank 1 is refused */
    memset(reach, 1, sizeof reach);
    reach[1 * 2 + 0] = 0;
    EXPECT_EQ_INT(peer_reach_unreachable(2, reach, NULL, "deepep", msg, sizeof msg), 1);
    expect_has(msg, "but rank 1 cannot reach rank 0;");
    EXPECT(!strstr(msg, "rank 0 cannot"));

    /* a message longer than its buffer ends in "..." within the buffer */
    const int alone[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    grouped(8, alone, reach);
    char small[120];
    memset(small, 'x', sizeof small);
    EXPECT_EQ_INT(peer_reach_unreachable(8, reach, NULL, "deepep", small, sizeof small), 56);
    EXPECT_EQ_INT((int)strlen(small), (int)sizeof small - 1);
    EXPECT(strcmp(small + sizeof small - 4, "...") == 0);
    return test_finish("test_peer_reach");
}
