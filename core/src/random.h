/* SPDX-License-Identifier: Apache-2.0 */
/* Counter-based normal random numbers: value i of a stream depends only on (seed, stream, i), so any slice of
 * a tensor can be filled on its own, on the CPU (task.c) or on a GPU (cuda/kernels.cu), in any order. */
#ifndef MOERT_CORE_RANDOM_H
#define MOERT_CORE_RANDOM_H

#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define MOERT_HOST_DEVICE __host__ __device__
#else
#define MOERT_HOST_DEVICE
#endif

/* splitmix64 finaliser: a good 64-bit mix of a counter. */
static inline MOERT_HOST_DEVICE uint64_t moert_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A double in (0, 1) from 53 of the bits. */
static inline MOERT_HOST_DEVICE double moert_uniform_open(uint64_t bits)
{
    return ((double)(bits >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* The index-th standard normal number of (seed, stream), by Box-Muller. The GPU's log and cos may differ from
 * the C library's in the last bit of a double, so a GPU fill agrees with a CPU fill to about 1e-15. */
static inline MOERT_HOST_DEVICE double moert_normal_at(uint64_t seed, uint64_t stream, uint64_t index)
{
    uint64_t key = moert_mix64(seed * 0x9e3779b97f4a7c15ull + stream);
    uint64_t h1 = moert_mix64(key ^ moert_mix64(2 * index + 1));
    uint64_t h2 = moert_mix64(key + moert_mix64(2 * index + 2));
    double u1 = moert_uniform_open(h1), u2 = moert_uniform_open(h2);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* The random streams of moert's initial parameters (moert_layers_init_params): layer l's parameter p draws from
 * MOERT_STREAM_PARAM + 4 l + p, its shared expert's from MOERT_STREAM_SHARED_PARAM + 4 l + (p - MOERT_PARAM_SHARED_FC1).
 * Streams below 16 are left to the callers' own data (moert's trainer draws its synthetic task from 1 to 4). */
enum { MOERT_STREAM_PARAM = 16, MOERT_STREAM_SHARED_PARAM = 1 << 30 };

#endif
