/* An error passed through a one-byte mask on CPU: one pass (docs/method.md §2, "ReLU masks").
 *
 * The mask is 0 where the error is to be zeroed and -1 (all bits set) where it passes; each element of the error is
 * ANDed, as raw bits, with its mask byte widened to the element's width, so a passed element keeps its bits (NaN,
 * infinities and signed zeros included) and a zeroed one becomes +0.0. torch's bitwise_and would first copy the
 * int8 mask to the error's width, a full-size temporary per call. Elements are split over threads
 * (native_threads.h); the result does not depend on the split.
 */
#include <stdint.h>

#include "native_threads.h"

#define MIN_ELEMENTS_PER_THREAD (1 << 22)

typedef struct {
    const void *error;
    const int8_t *mask;
    void *out;
    int width;
} mask_args;

static int mask_elements(const void *arguments, int64_t first, int64_t last) {
    const mask_args *args = (const mask_args *)arguments;
    const int8_t *mask = args->mask;
    switch (args->width) {
    case 2: {
        const int16_t *error = (const int16_t *)args->error;
        int16_t *out = (int16_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & (int16_t)mask[i];
        return 0;
    }
    case 4: {
        const int32_t *error = (const int32_t *)args->error;
        int32_t *out = (int32_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & (int32_t)mask[i];
        return 0;
    }
    case 8: {
        const int64_t *error = (const int64_t *)args->error;
        int64_t *out = (int64_t *)args->out;
        for (int64_t i = first; i < last; i++) out[i] = error[i] & (int64_t)mask[i];
        return 0;
    }
    default:
        return 1;
    }
}

/* out[i] = error[i] & mask[i] over `count` elements of `width` bytes (2, 4 or 8); -1 for another width. */
int hf_cpt_masked(const void *error, const int8_t *mask, void *out, int64_t count, int width, int threads) {
    mask_args args = {error, mask, out, width};
    return split_items(mask_elements, &args, count, count, MIN_ELEMENTS_PER_THREAD, threads);
}
