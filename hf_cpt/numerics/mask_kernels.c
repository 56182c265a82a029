/* An error zeroed where a bool mask is set, on CPU: one pass (docs/method.md §2, "ReLU masks").
 *
 * `zeroed` is a bool tensor's bytes, 1 where the error is to be zeroed and 0 where it passes. Each element of the
 * error is ANDed, as raw bits, with `zeroed - 1` widened to the element's width (0 -> all bits set, 1 -> none), so a
 * passed element keeps its bits (NaN, infinities and signed zeros included) and a zeroed one becomes +0.0, as a
 * ReLU's backward makes it. torch's masked_fill does the same in several times as long. Elements are split over
 * threads (native_threads.h); the result does not depend on the split.
 */
#include <stdint.h>

#include "native_threads.h"

#define MIN_ELEMENTS_PER_THREAD (1 << 22)

typedef struct {
    const void *error;
    const uint8_t *zeroed;
    void *out;
    int width;
} mask_args;

static int mask_elements(const void *arguments, int64_t first, int64_t last) {
    const mask_args *args = (const mask_args *)arguments;
    const uint8_t *zeroed = args->zeroed;
    switch (args->width) {
    case 2: {
        const int16_t *error = (const int16_t *)args->error;
        int16_t *out = (int16_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & (int16_t)((int16_t)zeroed[i] - 1);
        return 0;
    }
    case 4: {
        const int32_t *error = (const int32_t *)args->error;
        int32_t *out = (int32_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & ((int32_t)zeroed[i] - 1);
        return 0;
    }
    case 8: {
        const int64_t *error = (const int64_t *)args->error;
        int64_t *out = (int64_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & ((int64_t)zeroed[i] - 1);
        return 0;
    }
    default:
        return 1;
    }
}

/* out[i] = zeroed[i] ? +0 : error[i], bit for bit, over `count` elements of `width` bytes (2, 4 or 8); -1 for
 * another width. */
int hf_cpt_masked(const void *error, const uint8_t *zeroed, void *out, int64_t count, int width, int threads) {
    mask_args args = {error, zeroed, out, width};
    return split_items(mask_elements, &args, count, count, MIN_ELEMENTS_PER_THREAD, threads);
}
