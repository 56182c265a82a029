/* What the package's C kernels share for their arithmetic: vector types and the bounds of a row of floats (how
 * they split work over threads: native_threads.h).
 *
 * GCC / clang vector extensions: `lanes` is one register of the target, 16 floats with AVX-512, else 8. Included by
 * error_kernels.c, code_kernels.c and rotation_kernels.c; native.py keys each built library on this file too, so a
 * change here rebuilds them all.
 */
#ifndef HF_CPT_NATIVE_VECTORS_H
#define HF_CPT_NATIVE_VECTORS_H

#include <math.h>
#include <stdint.h>

/* The target's own vector width: a wider vector (16 floats on AVX2, two registers each) spills in loops that keep
 * several of them in registers, and GCC lowers a comparison of two into scalar code: a product and a row's bounds ran
 * several times slower with 16-float vectors on AVX2 than with 8-float ones (docs/method.md §2, "Codes in one pass",
 * and §3, "Rotation"). */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
typedef float lanes __attribute__((vector_size(LANES * 4)));
typedef float unaligned_lanes __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t lane_mask __attribute__((vector_size(LANES * 4)));

/* Lane-wise a < b ? a : b (and a > b ? a : b): b where a is NaN, as the scalar loops of row_bounds. */
static inline lanes lower(lanes a, lanes b) {
    const lane_mask m = a < b;
    return (lanes)((m & (lane_mask)a) | (~m & (lane_mask)b));
}

static inline lanes higher(lanes a, lanes b) {
    const lane_mask m = a > b;
    return (lanes)((m & (lane_mask)a) | (~m & (lane_mask)b));
}

static inline float magnitude(float v, int absolute) { return absolute ? fabsf(v) : v; }

/* The min and max of n >= 1 floats (of their magnitudes with `absolute`) into *low and *high; returns whether one
 * of them is NaN (torch's amin / amax then give NaN: the caller decides what that makes of its result). */
static inline int row_bounds(const float *x, int64_t n, int absolute, float *low, float *high) {
    const lane_mask sign = (lane_mask){0} + (absolute ? 0x7FFFFFFF : -1); /* clears the sign bit for magnitudes */
    float lo = magnitude(x[0], absolute), hi = lo;
    int nan = 0;
    int64_t i = 0;
    if (n >= LANES) {
        lanes lows = (lanes)((lane_mask)(*(const unaligned_lanes *)x) & sign), highs = lows;
        lane_mask nans = lows != lows;
        for (i = LANES; i + LANES <= n; i += LANES) {
            const lanes v = (lanes)((lane_mask)(*(const unaligned_lanes *)(x + i)) & sign);
            lows = lower(v, lows);
            highs = higher(v, highs);
            nans |= v != v;
        }
        for (int j = 0; j < LANES; j++) {
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
