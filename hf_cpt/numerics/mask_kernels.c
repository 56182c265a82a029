/* An error zeroed where a mask is set, on CPU: one pass (docs/method.md §2, "ReLU masks"). The mask is a bool
 * tensor's bytes (`hf_cpt_masked`) or one bit per element (`hf_cpt_pack_nonpositive`, `hf_cpt_masked_bits`).
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

/* Bit-packed masks: bit k (least significant first) of byte j stands for element 8j + k; the last byte's bits past
 * the end are 0. Work is split over bytes, so each thread writes whole bytes. A byte's 8 elements are one vector
 * (GCC / clang vector extensions: the compiler picks the target's instructions). */

typedef float floats8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t ints8 __attribute__((vector_size(32), aligned(4)));
static const ints8 PLACES = {1, 2, 4, 8, 16, 32, 64, 128};
typedef int16_t shorts8 __attribute__((vector_size(16), aligned(2))); /* 8 half-precision values' bits */
static const shorts8 SHORT_PLACES = {1, 2, 4, 8, 16, 32, 64, 128};

/* What a packing kernel reads (float32 values, or a bool tensor's bytes) and writes. */
typedef struct {
    const void *source;
    uint8_t *bits;
    int64_t count;
} pack_args;

static int pack_bytes(const void *arguments, int64_t first, int64_t last) {
    const pack_args *args = (const pack_args *)arguments;
    const float *output = (const float *)args->source;
    const int64_t whole = args->count / 8; /* bytes whose 8 elements all exist */
    int64_t j = first;
    for (; j < last && j < whole; j++) {
        const ints8 set = (*(const floats8 *)(output + 8 * j) <= 0.0f) & PLACES; /* false at NaN, true at -0.0 */
        args->bits[j] = (uint8_t)(set[0] | set[1] | set[2] | set[3] | set[4] | set[5] | set[6] | set[7]);
    }
    for (; j < last; j++) { /* the last, partial byte */
        uint8_t byte = 0;
        for (int64_t i = 8 * j; i < args->count; i++) byte |= (uint8_t)(output[i] <= 0.0f) << (i - 8 * j);
        args->bits[j] = byte;
    }
    return 0;
}

/* bits of `output <= 0` (false for NaN, true for -0.0, as torch compares) over `count` float32 elements, into
 * (count + 7) / 8 bytes. */
int hf_cpt_pack_nonpositive(const float *output, uint8_t *bits, int64_t count, int threads) {
    pack_args args = {output, bits, count};
    const int64_t bytes = (count + 7) / 8;
    return split_items(pack_bytes, &args, bytes, count, MIN_ELEMENTS_PER_THREAD, threads);
}

typedef struct {
    const void *error;
    const uint8_t *bits;
    void *out;
    int64_t count;
    int width;
} mask_bits_args;

/* Elements first..last of `out` from `error` and the bits, one element at a time (any width). */
#define MASK_BITS_SCALAR(type, first, last)                                                                          \
    for (int64_t i = (first); i < (last); i++)                                                                       \
        out[i] = error[i] & (type)((type)((args->bits[i / 8] >> (i % 8)) & 1) - 1);

static int mask_bits_bytes(const void *arguments, int64_t first, int64_t last) {
    const mask_bits_args *args = (const mask_bits_args *)arguments;
    const int64_t end = 8 * last < args->count ? 8 * last : args->count;
    switch (args->width) {
    case 2: { /* 8 elements a byte, as one vector: all bits kept where the element's bit is clear, none where set */
        const int16_t *error = (const int16_t *)args->error;
        int16_t *out = (int16_t *)args->out;
        int64_t j = first;
        for (; j < last && 8 * j + 8 <= args->count; j++) {
            const shorts8 kept = (((shorts8){0} + args->bits[j]) & SHORT_PLACES) == 0;
            *(shorts8 *)(out + 8 * j) = *(const shorts8 *)(error + 8 * j) & kept;
        }
        MASK_BITS_SCALAR(int16_t, 8 * j, end)
        return 0;
    }
    case 4: { /* as case 2, with 32-bit elements */
        const int32_t *error = (const int32_t *)args->error;
        int32_t *out = (int32_t *)args->out;
        int64_t j = first;
        for (; j < last && 8 * j + 8 <= args->count; j++) {
            const ints8 kept = (((ints8){0} + args->bits[j]) & PLACES) == 0;
            *(ints8 *)(out + 8 * j) = *(const ints8 *)(error + 8 * j) & kept;
        }
        MASK_BITS_SCALAR(int32_t, 8 * j, end)
        return 0;
    }
    case 8: {
        const int64_t *error = (const int64_t *)args->error;
        int64_t *out = (int64_t *)args->out;
        MASK_BITS_SCALAR(int64_t, 8 * first, end)
        return 0;
    }
    default:
        return 1;
    }
}

/* out[i] = bit i of `bits` ? +0 : error[i], bit for bit, over `count` elements of `width` bytes (2, 4 or 8); -1 for
 * another width. */
int hf_cpt_masked_bits(const void *error, const uint8_t *bits, void *out, int64_t count, int width, int threads) {
    mask_bits_args args = {error, bits, out, count, width};
    const int64_t bytes = (count + 7) / 8;
    return split_items(mask_bits_bytes, &args, bytes, count, MIN_ELEMENTS_PER_THREAD, threads);
}

/* bits of a bool tensor's bytes (nonzero: set), into (count + 7) / 8 bytes. */
static int pack_flag_bytes(const void *arguments, int64_t first, int64_t last) {
    const pack_args *args = (const pack_args *)arguments;
    const uint8_t *flags = (const uint8_t *)args->source;
    for (int64_t j = first; j < last; j++) {
        const int64_t start = 8 * j, end = start + 8 < args->count ? start + 8 : args->count;
        uint8_t byte = 0;
        for (int64_t i = start; i < end; i++) byte |= (uint8_t)(flags[i] != 0) << (i - start);
        args->bits[j] = byte;
    }
    return 0;
}

int hf_cpt_pack_flags(const uint8_t *flags, uint8_t *bits, int64_t count, int threads) {
    pack_args args = {flags, bits, count};
    return split_items(pack_flag_bytes, &args, (count + 7) / 8, count, MIN_ELEMENTS_PER_THREAD, threads);
}

/* A dropout's backward from its packed mask: out[i] = grad[i] * (bit i set ? scale : 0), float32, the product
 * torch's native_dropout_backward forms (grad * mask * scale: a kept element's grad * scale, a dropped one's grad * 0,
 * which is -0 for a negative grad and NaN for NaN or infinity). */
typedef struct {
    const float *grad;
    const uint8_t *bits;
    float *out;
    int64_t count;
    float scale;
} dropout_bits_args;

static int dropout_bits_bytes(const void *arguments, int64_t first, int64_t last) {
    const dropout_bits_args *args = (const dropout_bits_args *)arguments;
    const int64_t end = 8 * last < args->count ? 8 * last : args->count;
    const ints8 scale = (ints8)((floats8){0} + args->scale);
    int64_t j = first;
    for (; j < last && 8 * j + 8 <= args->count; j++) { /* 8 elements a byte: each one's factor, scale or +0 */
        const ints8 kept = (((ints8){0} + args->bits[j]) & PLACES) != 0;
        *(floats8 *)(args->out + 8 * j) = *(const floats8 *)(args->grad + 8 * j) * (floats8)(kept & scale);
    }
    for (int64_t i = 8 * j; i < end; i++)
        args->out[i] = args->grad[i] * (((args->bits[i / 8] >> (i % 8)) & 1) ? args->scale : 0.0f);
    return 0;
}

int hf_cpt_dropout_bits_backward(const float *grad, const uint8_t *bits, float *out, int64_t count, float scale,
                                 int threads) {
    dropout_bits_args args = {grad, bits, out, count, scale};
    return split_items(dropout_bits_bytes, &args, (count + 7) / 8, count, MIN_ELEMENTS_PER_THREAD, threads);
}
