/* What the package's C kernels share for their arithmetic: a 16-float vector type and the bounds of a row of floats
 * (how they split work over threads: native_threads.h).
 *
 * GCC / clang vector extensions: 16 floats are one AVX-512 register or two AVX2 ones, the compiler splits them
 * for the target; `lanes` is one register's width. Included by error_kernels.c, code_kernels.c and
 * rotation_kernels.c; native.py keys each built library on this file too, so a change here rebuilds them all.
 */
#ifndef HF_CPT_NATIVE_VECTORS_H
#define HF_CPT_NATIVE_VECTORS_H

#include <math.h>
#include <stdint.h>

typedef float vec __attribute__((vector_size(64)));
typedef float unaligned_vec __attribute__((vector_size(64), aligned(4)));
typedef int32_t mask __attribute__((vector_size(64)));

/* The target's own vector width, for loops that keep several sums in registers: there a 16-float vector on AVX2
 * (two registers each) spills, and a product ran six times slower than with 8-float vectors (docs/method.md §3,
 * "Rotation"). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes __attribute__((vector_size(LANES * 4)));
typedef float unaligned_lanes __attribute__((vector_size(LANES * 4), aligned(4)));

/* Lane-wise a < b ? a : b (and a > b ? a : b): b where a is NaN, as the scalar loops of row_bounds. */
static inline vec lower(vec a, vec b) {
    const mask m = a < b;
    return (vec)((m & (mask)a) | (~m & (mask)b));
}

static inline vec higher(vec a, vec b) {
    const mask m = a > b;
    return (vec)((m & (mask)a) | (~m & (mask)b));
}

static inline float magnitude(float v, int absolute) { return absolute ? fabsf(v) : v; }

/* The min and max of n >= 1 floats (of their magnitudes with `absolute`) into *low and *high; returns whether one
 * of them is NaN (torch's amin / amax then give NaN: the caller decides what that makes of its result). */
static inline int row_bounds(const float *x, int64_t n, int absolute, float *low, float *high) {
    const mask sign = (mask){0} + (absolute ? 0x7FFFFFFF : -1); /* clears the sign bit for magnitudes */
    float lo = magnitude(x[0], absolute), hi = lo;
    int nan = 0;
    int64_t i = 0;
    if (n >= 16) {
        vec lows = (vec)((mask)(*(const unaligned_vec *)x) & sign), highs = lows;
        mask nans = lows != lows;
        for (i = 16; i + 16 <= n; i += 16) {
            const vec v = (vec)((mask)(*(const unaligned_vec *)(x + i)) & sign);
            lows = lower(v, lows);
            highs = higher(v, highs);
            nans |= v != v;
        }
        for (int j = 0; j < 16; j++) {
            lo = lows[j] < lo ? lows[j] : lo;
            hi = highs[j] > hi ? highs[j] : hi;
            nan |= nans[j] != 0;
        }
    }
    for (; i < n; i++) {
        const float v = magnitude(x[i], absolute);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        nan |= v != v;
    }
    *low = lo;
    *high = hi;
    return nan;
}

#endif
