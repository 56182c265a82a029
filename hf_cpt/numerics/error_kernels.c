/* Stochastic rounding of errors on CPU: one pass over the tensor (docs/method.md §2, "The fused error kernel").
 *
 * The C twin of the hashed-noise formulas in error_kernels.py, value for value: the same lowbias32 hash of
 * (element index, seed) gives the noise, and the arithmetic runs in the same float32 order (built with
 * -ffp-contract=off, so no fused multiply-add changes a rounding). With one range per row, each row's grid
 * (offset, scale) is computed here, in the pass that quantizes the row; one grid for the tensor comes from the
 * caller. Each element is scaled, shifted by its noise, clamped and rounded half to even. Elements are split over
 * threads (native_threads.h); the noise depends only on the element index, so the result does not depend on the
 * thread count.
 */
#include <math.h>
#include <stdint.h>

#include "native_threads.h"
#include "native_vectors.h"

static inline float hashed_noise(uint32_t index, uint32_t seed) {
    uint32_t h = index ^ seed;
    h ^= h >> 16;
    h *= 0x7FEB352Du;
    h ^= h >> 15;
    h *= 0x846CA68Bu;
    h ^= h >> 16;
    return (float)((h >> 8) & 0xFFFFFFu) * (1.0f / 16777216.0f) - 0.5f;
}

typedef struct {
    const float *source;
    float *out;
    const float *offset, *scale; /* one for the tensor, or null: each row's own, computed here */
    int64_t columns;
    float top;
    uint32_t seed;
    int zero_centred;
} errors_args;

#define MIN_SCALE 1e-8f /* fake_quant.MIN_SCALE */

/* The grid of one row, as errors.grid computes it with torch: min/max grid: offset m, scale max((M - m) / L, 1e-8);
 * zero-centred grid: scale max(max|e| / L, 1e-8). A row holding a NaN gets a NaN grid, as torch's amin / amax give. */
static void row_grid(const float *x, int64_t n, float top, int zero_centred, float *offset, float *scale) {
    float low, high;
    const int nan = row_bounds(x, n, zero_centred, &low, &high);
    const float step = zero_centred ? high / top : (high - low) / top;
    *offset = nan ? NAN : (zero_centred ? 0.0f : low);
    *scale = nan ? NAN : (step < MIN_SCALE ? MIN_SCALE : step);
}

static int quantize_elements(const void *args, int64_t first, int64_t last) {
    const errors_args *job = (const errors_args *)args;
    const float top = job->top;
    for (int64_t start = first; start < last;) {
        const int64_t row = start / job->columns;
        const int64_t row_end = (row + 1) * job->columns;
        const int64_t end = row_end < last ? row_end : last;
        float row_offset, row_scale; /* computed here when the caller gave no grid */
        if (!job->scale)
            row_grid(job->source + row * job->columns, job->columns, top, job->zero_centred, &row_offset,
                     &row_scale);
        const float scale = job->scale ? job->scale[0] : row_scale;
        const float *x = job->source + start;
        float *out = job->out + start;
        const uint32_t base = (uint32_t)start;
        const int64_t n = end - start;
        if (job->zero_centred) {
            /* round(x / s + u), clamped to [-L, L], times s */
            for (int64_t i = 0; i < n; i++) {
                float code = rintf(x[i] / scale + hashed_noise(base + (uint32_t)i, job->seed));
                code = code < -top ? -top : code;
                code = code > top ? top : code;
                out[i] = code * scale;
            }
        } else {
            /* round(min(max((x - m) / s + u, 0), L)) * s + m */
            const float offset = job->scale ? job->offset[0] : row_offset;
            for (int64_t i = 0; i < n; i++) {
                float code = (x[i] - offset) / scale + hashed_noise(base + (uint32_t)i, job->seed);
                code = code < 0.0f ? 0.0f : code;
                code = code > top ? top : code;
                out[i] = rintf(code) * scale + offset;
            }
        }
        start = end;
    }
    return 0;
}

/* A thread start costs more than a pass over less. */
#define MIN_ELEMENTS_PER_THREAD 65536

/* Quantize rows x columns float32 values (contiguous) into out; returns the number of threads used. Offset and scale:
 * one grid for the tensor, or null for each row's own, computed here (one pass less over the tensor per bound). */
int hf_cpt_quantize_errors(const float *source, float *out, const float *offset, const float *scale, int64_t rows,
                           int64_t columns, float top, int32_t seed, int zero_centred, int threads) {
    const errors_args args = {source, out, offset, scale, columns, top, (uint32_t)seed, zero_centred};
    const int64_t total = rows * columns;
    return split_items(quantize_elements, &args, total, total, MIN_ELEMENTS_PER_THREAD, threads);
}
