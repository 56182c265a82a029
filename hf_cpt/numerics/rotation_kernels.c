/* Rotations on CPU of the last axis, one row at a time, and of a matrix's first axis, a block of columns at a time
 * (docs/method.md §3, "Rotation").
 *
 * R = diag(s) (A ⊗ H_P / sqrt(P)): random signs s, an optional leading factor A of order n (Paley or dense,
 * orthonormal), and the Sylvester-Hadamard part of order P = d / n (the Kronecker product of rotation.py's
 * Sylvester factors is H_P itself). A row of d values is viewed as n blocks of P: the signs, a fast Walsh-Hadamard
 * transform of each block (log2 P butterfly stages instead of a P x P product), then A across the blocks. The
 * transpose R^T = (A^T ⊗ H_P / sqrt(P)) diag(s) runs the steps backwards. Each row stays in cache through every
 * step; rows are split over threads (native_threads.h), and no result depends on the thread count. The values equal
 * rotation.py's factor-by-factor products up to float32 rounding (a different order of the same sums). With
 * quantization (hf_cpt_rotate_codes), each rotated row is quantized over its own range while still in cache.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_codes.h"
#include "native_threads.h"
#include "native_vectors.h"

typedef struct {
    const float *x;
    float *y;
    const float *signs, *lead; /* lead: n x n row-major, or null */
    int64_t lead_size, power;
    int transpose;
} rotate_args;

/* One butterfly stage of distance h inside each vector: (a, b) -> (a + b, a - b) as swap(v) + v * (+1 | -1). */
#define STAGE(v, sign, ...) (__builtin_shufflevector(v, v, __VA_ARGS__) + (v) * (sign))

/* The butterfly stages of distance h, 2h, ... across registers of the `count` registers at `v`: (a, b) -> (a + b,
 * a - b) between register j and register j + h. */
static void register_stages(unaligned_lanes *v, int64_t count, int64_t h) {
    for (; h < count; h <<= 1) {
        for (int64_t i = 0; i < count; i += h << 1) {
            for (int64_t j = i; j < i + h; j++) {
                const lanes a = v[j], b = v[j + h];
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
    }
}

#if LANES == 16
static const lanes SIGN1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
static const lanes SIGN2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
static const lanes SIGN4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
static const lanes SIGN8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};

/* The unnormalized fast Walsh-Hadamard transform of `power` (a multiple of 16) values of `source`, each times
 * `signs` first when given, into `target` (which may be `source`): four stages inside each 16-float register, the
 * rest across registers. */
static void walsh_hadamard(const float *source, const float *signs, float *target, int64_t power) {
    const unaligned_lanes *s = (const unaligned_lanes *)source;
    const unaligned_lanes *sign = (const unaligned_lanes *)signs;
    unaligned_lanes *v = (unaligned_lanes *)target;
    const int64_t count = power / 16;
    for (int64_t i = 0; i < count; i++) {
        lanes w = signs ? s[i] * sign[i] : s[i];
        w = STAGE(w, SIGN1, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
        w = STAGE(w, SIGN2, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
        w = STAGE(w, SIGN4, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
        w = STAGE(w, SIGN8, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
        v[i] = w;
    }
    register_stages(v, count, 1);
}
#else
static const lanes SIGN1 = {1, -1, 1, -1, 1, -1, 1, -1};
static const lanes SIGN2 = {1, 1, -1, -1, 1, 1, -1, -1};
static const lanes SIGN4 = {1, 1, 1, 1, -1, -1, -1, -1};

static inline lanes in_register_stages(lanes w) {
    w = STAGE(w, SIGN1, 1, 0, 3, 2, 5, 4, 7, 6);
    w = STAGE(w, SIGN2, 2, 3, 0, 1, 6, 7, 4, 5);
    return STAGE(w, SIGN4, 4, 5, 6, 7, 0, 1, 2, 3);
}

/* As above with 8-float registers (AVX2): three stages inside each register, the fourth between a pair of them,
 * then across registers two stages a pass while two remain, and the last one alone (the same additions in the same
 * order: the same values as the 16-float form, about twice as fast on AVX2 as that form split by the compiler). */
static void walsh_hadamard(const float *source, const float *signs, float *target, int64_t power) {
    const unaligned_lanes *s = (const unaligned_lanes *)source;
    const unaligned_lanes *sign = (const unaligned_lanes *)signs;
    unaligned_lanes *v = (unaligned_lanes *)target;
    const int64_t count = power / 8;
    for (int64_t i = 0; i < count; i += 2) {
        const lanes a = in_register_stages(signs ? s[i] * sign[i] : s[i]);
        const lanes b = in_register_stages(signs ? s[i + 1] * sign[i + 1] : s[i + 1]);
        v[i] = a + b;
        v[i + 1] = a - b;
    }
    int64_t h = 2;
    for (; h * 2 < count; h <<= 2) {
        for (int64_t i = 0; i < count; i += h << 2) {
            for (int64_t j = i; j < i + h; j++) {
                const lanes a = v[j], b = v[j + h], c = v[j + 2 * h], d = v[j + 3 * h];
                const lanes sum_ab = a + b, difference_ab = a - b, sum_cd = c + d, difference_cd = c - d;
                v[j] = sum_ab + sum_cd;
                v[j + h] = difference_ab + difference_cd;
                v[j + 2 * h] = sum_ab - sum_cd;
                v[j + 3 * h] = difference_ab - difference_cd;
            }
        }
    }
    register_stages(v, count, h);
}
#endif

/* y = (t (C ⊗ I_power)) * norm (times `signs` after, when given), C = A or A^T as row-major n x n `coefficients`
 * (C[in][out]): one register's width of columns at a time (`lanes`), four output blocks' sums in registers
 * (independent sums keep the adder busy while each waits for its last). Per value the same operations in the same
 * order as a plain loop: 0, + c * t for each input block in turn, * norm, * sign. */
static void lead_product(const float *t, float *y, const float *coefficients, int64_t n, int64_t power, float norm,
                         const float *signs) {
    for (int64_t j = 0; j < power; j += LANES) {
        int64_t out = 0;
        for (; out + 4 <= n; out += 4) {
            lanes s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int64_t in = 0; in < n; in++) {
                const lanes v = *(const unaligned_lanes *)(t + in * power + j);
                const float *c = coefficients + in * n + out;
                s0 = s0 + c[0] * v;
                s1 = s1 + c[1] * v;
                s2 = s2 + c[2] * v;
                s3 = s3 + c[3] * v;
            }
            const lanes sums[4] = {s0, s1, s2, s3};
            for (int k = 0; k < 4; k++) {
                lanes value = sums[k] * norm;
                if (signs) value = value * *(const unaligned_lanes *)(signs + (out + k) * power + j);
                *(unaligned_lanes *)(y + (out + k) * power + j) = value;
            }
        }
        for (; out < n; out++) {
            lanes sum = {0};
            for (int64_t in = 0; in < n; in++)
                sum = sum + coefficients[in * n + out] * *(const unaligned_lanes *)(t + in * power + j);
            sum = sum * norm;
            if (signs) sum = sum * *(const unaligned_lanes *)(signs + out * power + j);
            *(unaligned_lanes *)(y + out * power + j) = sum;
        }
    }
}

/* What a thread rotates its rows with: a scratch row (aligned: every vector load stays within a cache line) and
 * C[in][out] = A, or A^T for the transpose, so that lead_product reads both the same way; `row` (with `rotated_row`): a
 * second scratch row that holds each rotated row of a rotation with quantization. */
typedef struct {
    float *t, *coefficients, *row;
} workspace;

static void free_workspace(workspace *w) {
    free(w->t);
    free(w->coefficients);
    free(w->row);
}

/* 0, or 1 when out of memory. */
static int make_workspace(const rotate_args *a, int rotated_row, workspace *w) {
    const int64_t n = a->lead_size, d = n * a->power;
    *w = (workspace){0, 0, 0};
    if (rotated_row && !(w->row = (float *)aligned_alloc(64, sizeof(float) * (size_t)d))) return 1;
    if (!a->lead) return 0;
    w->t = (float *)aligned_alloc(64, sizeof(float) * (size_t)d);
    w->coefficients = (float *)malloc(sizeof(float) * (size_t)(n * n));
    if (!w->t || !w->coefficients) {
        free_workspace(w);
        return 1;
    }
    for (int64_t in = 0; in < n; in++)
        for (int64_t out = 0; out < n; out++)
            w->coefficients[in * n + out] = a->transpose ? a->lead[out * n + in] : a->lead[in * n + out];
    return 0;
}

/* y = x R (x R^T with transpose) for one row x of lead_size * power values. */
static void rotate_row(const rotate_args *a, const workspace *w, const float *x, float *y) {
    const int64_t n = a->lead_size, power = a->power, d = n * power;
    const float norm = (float)(1.0 / sqrt((double)power));
    /* R = diag(s) (A ⊗ H) / sqrt(P): forward the signs first, the transpose last. */
    const float *before = a->transpose ? 0 : a->signs, *after = a->transpose ? a->signs : 0;
    float *h = a->lead ? w->t : y; /* the transformed blocks: a scratch row when A still follows */
    for (int64_t i = 0; i < n; i++)
        walsh_hadamard(x + i * power, before ? before + i * power : 0, h + i * power, power);
    if (a->lead) {
        lead_product(w->t, y, w->coefficients, n, power, norm, after);
    } else {
        const unaligned_lanes *sign = (const unaligned_lanes *)after;
        unaligned_lanes *v = (unaligned_lanes *)y;
        for (int64_t k = 0; k < d / LANES; k++) v[k] = after ? v[k] * norm * sign[k] : v[k] * norm;
    }
}

static int rotate_rows(const void *args, int64_t first_row, int64_t last_row) {
    const rotate_args *a = (const rotate_args *)args;
    const int64_t d = a->lead_size * a->power;
    workspace w;
    if (make_workspace(a, 0, &w)) return 1;
    for (int64_t row = first_row; row < last_row; row++) rotate_row(a, &w, a->x + row * d, a->y + row * d);
    free_workspace(&w);
    return 0;
}

/* A thread start costs more than rotating less. */
#define MIN_ELEMENTS_PER_THREAD (1 << 20)

/* y = x R (x R^T with transpose) for rows x (lead_size * power) float32 values (contiguous); the number of threads
 * used, or -1 when out of memory. */
int hf_cpt_rotate(const float *x, float *y, const float *signs, const float *lead, int64_t lead_size, int64_t power,
                  int64_t rows, int transpose, int threads) {
    const rotate_args args = {x, y, signs, lead, lead_size, power, transpose};
    return split_items(rotate_rows, &args, rows, rows * lead_size * power, MIN_ELEMENTS_PER_THREAD, threads);
}

/* Columns rotated together by hf_cpt_rotate_columns: d x 32 floats stay in cache through every step. */
#define COLUMN_BLOCK 32
#define BLOCK_LANES (COLUMN_BLOCK / LANES)

typedef struct {
    rotate_args rotation;
    int64_t columns;
} rotate_columns_args;

/* Blocks [first, last) of COLUMN_BLOCK columns, each column rotated as rotate_row rotates a row, by the same
 * operations in the same order (so the values of the row kernel on the transpose, bit for bit): the signs, the
 * butterfly stages of distance 1, 2, 4, ... within each block of `power` rows, then A across the blocks (0, + c * t
 * for each input block in turn, * norm, * sign), each operation on a row's segment of the block's columns at once. */
static int rotate_column_blocks(const void *args, int64_t first, int64_t last) {
    const rotate_columns_args *a = (const rotate_columns_args *)args;
    const rotate_args *r = &a->rotation;
    const int64_t n = r->lead_size, power = r->power, d = n * power, m = a->columns;
    /* A block of `power` rows of the segment a row longer: blocks a power of two apart would share cache sets. */
    const int64_t stride = (power + 1) * BLOCK_LANES;
    const float norm = (float)(1.0 / sqrt((double)power));
    const float *before = r->transpose ? 0 : r->signs, *after = r->transpose ? r->signs : 0;
    workspace w;
    if (make_workspace(r, 0, &w)) return 1;
    lanes *t = (lanes *)aligned_alloc(64, sizeof(lanes) * (size_t)(n * stride));
    if (!t) {
        free_workspace(&w);
        return 1;
    }
    for (int64_t block = first; block < last; block++) {
        const int64_t c0 = block * COLUMN_BLOCK, width = m - c0 < COLUMN_BLOCK ? m - c0 : COLUMN_BLOCK;
        for (int64_t i = 0; i < d; i++) {
            const float *source = r->x + i * m + c0;
            lanes *segment = t + (i / power) * stride + (i % power) * BLOCK_LANES;
            if (width == COLUMN_BLOCK) {
                for (int64_t k = 0; k < BLOCK_LANES; k++) {
                    const lanes v = *(const unaligned_lanes *)(source + k * LANES);
                    segment[k] = before ? v * before[i] : v;
                }
            } else {
                for (int64_t k = 0; k < COLUMN_BLOCK; k++)
                    ((float *)segment)[k] = k >= width ? 0.0f : before ? source[k] * before[i] : source[k];
            }
        }
        for (int64_t b = 0; b < n; b++) {
            lanes *rows = t + b * stride;
            for (int64_t h = 1; h < power; h <<= 1)
                for (int64_t i = 0; i < power; i += h << 1)
                    for (int64_t j = i; j < i + h; j++)
                        for (int64_t k = 0; k < BLOCK_LANES; k++) {
                            const lanes x0 = rows[j * BLOCK_LANES + k], x1 = rows[(j + h) * BLOCK_LANES + k];
                            rows[j * BLOCK_LANES + k] = x0 + x1;
                            rows[(j + h) * BLOCK_LANES + k] = x0 - x1;
                        }
        }
        for (int64_t p = 0; p < power; p++) {
            for (int64_t k = 0; k < BLOCK_LANES; k++) {
                lanes sums[4];
                for (int64_t out = 0; out < n; out += 4) {
                    const int64_t outputs = n - out < 4 ? n - out : 4;
                    if (r->lead) {
                        for (int q = 0; q < 4; q++) sums[q] = (lanes){0};
                        for (int64_t in = 0; in < n; in++) {
                            const lanes v = t[in * stride + p * BLOCK_LANES + k];
                            const float *c = w.coefficients + in * n + out;
                            for (int q = 0; q < outputs; q++) sums[q] = sums[q] + c[q] * v;
                        }
                    } else {
                        sums[0] = t[p * BLOCK_LANES + k];
                    }
                    for (int q = 0; q < outputs; q++) {
                        const int64_t row = (out + q) * power + p;
                        lanes value = sums[q] * norm;
                        if (after) value = value * after[row];
                        float *target = r->y + row * m + c0 + k * LANES;
                        if (width == COLUMN_BLOCK) {
                            *(unaligned_lanes *)target = value;
                        } else {
                            for (int64_t lane = 0; lane < LANES && k * LANES + lane < width; lane++)
                                target[lane] = value[lane];
                        }
                    }
                }
            }
        }
    }
    free(t);
    free_workspace(&w);
    return 0;
}

/* y = R^T x (R x with transpose) for x of (lead_size * power) rows and `columns` columns (contiguous): the rotation
 * of the first axis (a GPT-2 Conv1D's weight), each column's values those of hf_cpt_rotate on the transpose. The
 * number of threads used, or -1 when out of memory. */
int hf_cpt_rotate_columns(const float *x, float *y, const float *signs, const float *lead, int64_t lead_size,
                          int64_t power, int64_t columns, int transpose, int threads) {
    const rotate_columns_args args = {{x, y, signs, lead, lead_size, power, transpose}, columns};
    const int64_t blocks = (columns + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
    return split_items(rotate_column_blocks, &args, blocks, columns * lead_size * power, MIN_ELEMENTS_PER_THREAD,
                       threads);
}

typedef struct {
    rotate_args rotation;
    uint8_t *codes;
    float *values, *minimum, *maximum, *scale; /* values: may be null */
    float top, min_scale;
} rotate_codes_args;

/* Each row rotated into a scratch row that stays in cache, then its range, scale and codes (and values). */
static int rotate_codes_rows(const void *args, int64_t first_row, int64_t last_row) {
    const rotate_codes_args *a = (const rotate_codes_args *)args;
    const int64_t d = a->rotation.lead_size * a->rotation.power;
    workspace w;
    if (make_workspace(&a->rotation, 1, &w)) return 1;
    for (int64_t row = first_row; row < last_row; row++) {
        rotate_row(&a->rotation, &w, a->rotation.x + row * d, w.row);
        float low, high;
        if (row_bounds(w.row, d, 0, &low, &high)) low = high = NAN; /* as torch's amin / amax */
        const float scale = quantization_scale(low, high, a->top, a->min_scale);
        a->minimum[row] = low;
        a->maximum[row] = high;
        a->scale[row] = scale;
        if (a->values)
            quantize_row(w.row, a->codes + row * d, a->values + row * d, &low, &scale, d, a->top, 0, 1);
        else
            quantize_row(w.row, a->codes + row * d, 0, &low, &scale, d, a->top, 0, 0);
    }
    free_workspace(&w);
    return 0;
}

/* Each row of x R (not formed) quantized over its own range in one pass: its min, max and scale (max((max - min) /
 * top, min_scale)), its uint8 codes, and, when values is given, codes * scale + min: the values of rotating, then
 * code_kernels.c's ranges and codes, bit for bit, without writing or reading x R. The number of threads used, or -1
 * when out of memory. */
int hf_cpt_rotate_codes(const float *x, const float *signs, const float *lead, int64_t lead_size, int64_t power,
                        int64_t rows, float top, float min_scale, uint8_t *codes, float *values, float *minimum,
                        float *maximum, float *scale, int threads) {
    const rotate_codes_args args = {{x, 0, signs, lead, lead_size, power, 0}, codes, values, minimum, maximum, scale,
                                    top, min_scale};
    return split_items(rotate_codes_rows, &args, rows, rows * lead_size * power, MIN_ELEMENTS_PER_THREAD, threads);
}
