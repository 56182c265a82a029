/* The codes of a row of floats over its range (docs/method.md §2, "Codes in one pass"): what code_kernels.c's
 * quantization and rotation_kernels.c's rotation with quantization share, so that both give the same codes and values
 * bit for bit (native.py keys each built library on this file too).
 *
 * The C twin of fake_quant.quantization_codes and restore_compact: each element is shifted by its range's minimum,
 * divided by its scale, clamped to [0, top] and rounded half to even, in the same float32 order (built with
 * -ffp-contract=off, so no fused multiply-add changes a rounding).
 */
#ifndef HF_CPT_NATIVE_CODES_H
#define HF_CPT_NATIVE_CODES_H

#include <math.h>
#include <stdint.h>

/* One row; `per_column` and `keep_values` are constants at each call, so each variant is its own vector loop. values
 * (with keep_values): codes * s + m. */
static inline __attribute__((always_inline)) void quantize_row(
    const float *restrict x, uint8_t *restrict codes, float *restrict values, const float *restrict m,
    const float *restrict s, int64_t columns, float top, const int per_column, const int keep_values) {
    for (int64_t i = 0; i < columns; i++) {
        const float minimum = per_column ? m[i] : m[0], scale = per_column ? s[i] : s[0];
        float code = (x[i] - minimum) / scale;
        code = code < 0.0f ? 0.0f : code;
        code = rintf(code > top ? top : code);
        codes[i] = (uint8_t)code;
        if (keep_values) values[i] = code * scale + minimum;
    }
}

/* fake_quant.quantization_scale of one range: max((high - low) / top, min_scale), NaN where the range is NaN. */
static inline float quantization_scale(float low, float high, float top, float min_scale) {
    const float step = (high - low) / top;
    return step < min_scale ? min_scale : step;
}

#endif
