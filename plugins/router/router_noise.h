/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Counter-based random numbers of the router (input jitter, force_load_balancing's random logits), shared by
 * the CPU path and the CUDA kernels so that both draw the same values: each value is a pure function of
 * (stream key, call, row, column), with no generator state to carry, split or keep in step between devices.
 * The key mixes the option "seed", the layer index, the rank and what the numbers are for.
 *
 * The mixing is splitmix64's finaliser (a bijection of 64-bit words with good avalanche); the uniform takes the
 * top 53 bits; the normal is Box-Muller's cosine branch, computed in double on both sides.
 */
#ifndef MOERT_ROUTER_NOISE_H
#define MOERT_ROUTER_NOISE_H

#include <math.h>
#include <stdint.h>

#if defined(__CUDACC__)
#define ROUTER_NOISE_FN static inline __host__ __device__
#else
#define ROUTER_NOISE_FN static inline
#endif

/* What a stream of numbers is for (part of its key). */
#define ROUTER_NOISE_JITTER        1u
#define ROUTER_NOISE_RANDOM_LOGITS 2u

/* splitmix64's output function: a well-mixed 64-bit word from any 64-bit word. */
ROUTER_NOISE_FN uint64_t router_noise_mix(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* The key of one instance's stream: the seed, the layer, the rank and the purpose (ROUTER_NOISE_*). */
ROUTER_NOISE_FN uint64_t router_noise_key(uint64_t seed, uint64_t layer, uint64_t rank, uint64_t purpose)
{
    return router_noise_mix(router_noise_mix(router_noise_mix(router_noise_mix(seed) ^ layer) ^ rank) ^ purpose);
}

/* A uniform number in [0, 1) for (call, row, col) of a stream. */
ROUTER_NOISE_FN double router_noise_uniform(uint64_t key, uint64_t call, uint64_t row, uint64_t col)
{
    uint64_t h = router_noise_mix(router_noise_mix(router_noise_mix(key ^ call) ^ row) ^ col);
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}

/* Input jitter: the factor uniform(1 - eps, 1 + eps) of x[row, col] in forward number `call`. */
ROUTER_NOISE_FN double router_noise_jitter(uint64_t key, uint64_t call, uint64_t row, uint64_t col, double eps)
{
    return 1.0 - eps + 2.0 * eps * router_noise_uniform(key, call, row, col);
}

/* A standard normal number for (call, row, col): Box-Muller on two uniforms of columns 2col and 2col+1. */
ROUTER_NOISE_FN double router_noise_normal(uint64_t key, uint64_t call, uint64_t row, uint64_t col)
{
    double u1 = 1.0 - router_noise_uniform(key, call, row, 2 * col); /* (0, 1]: log(u1) is finite */
    double u2 = router_noise_uniform(key, call, row, 2 * col + 1);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586476925 * u2);
}

#endif
