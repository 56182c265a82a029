/* Quantization codes on CPU in one pass (docs/method.md §2, "Codes in one pass").
 *
 * The C twin of fake_quant.quantization_codes and restore_compact, value for value (a row's codes: native_codes.h).
 * The torch formula makes five full-size float passes and a conversion; this reads the input once and writes one
 * byte per element (and, when asked, the fake-quantized value codes * s + m). A range is one value per row (stride 1
 * along rows), per column (stride 1 along columns) or one for the tensor (both strides 0). Also the float32 result
 * of a product on codes from its sums (integer_matmul.code_matmul's scales and rank-one terms) in one pass, and the
 * centred float32 operands of a product on codes through the float32 GEMM with their integer sums. Rows are split
 * over threads (native_threads.h); no result depends on the thread count.
 */
#include <math.h>
#include <stdint.h>

#include "native_codes.h"
#include "native_threads.h"
#include "native_vectors.h"

/* A thread start costs more than a memory-bound pass over less. */
#define MIN_ELEMENTS_PER_THREAD (1 << 22)

typedef struct {
    const float *source;
    const uint8_t *codes_in;
    uint8_t *codes;
    float *values;
    const float *minimum, *scale;
    int64_t row_stride, column_stride, columns;
    float top;
} codes_args;

static int quantize_rows(const void *args, int64_t first_row, int64_t last_row) {
    const codes_args *a = (const codes_args *)args;
    for (int64_t row = first_row; row < last_row; row++) {
        const int64_t at = row * a->columns;
        const float *m = a->minimum + row * a->row_stride, *s = a->scale + row * a->row_stride;
        float *values = a->values ? a->values + at : 0;
        if (a->column_stride == 0 && values)
            quantize_row(a->source + at, a->codes + at, values, m, s, a->columns, a->top, 0, 1);
        else if (a->column_stride == 0)
            quantize_row(a->source + at, a->codes + at, 0, m, s, a->columns, a->top, 0, 0);
        else if (values)
            quantize_row(a->source + at, a->codes + at, values, m, s, a->columns, a->top, 1, 1);
        else
            quantize_row(a->source + at, a->codes + at, 0, m, s, a->columns, a->top, 1, 0);
    }
    return 0;
}

static int restore_rows(const void *args, int64_t first_row, int64_t last_row) {
    const codes_args *a = (const codes_args *)args;
    for (int64_t row = first_row; row < last_row; row++) {
        const uint8_t *restrict codes = a->codes_in + row * a->columns;
        float *restrict values = a->values + row * a->columns;
        const float *restrict m = a->minimum + row * a->row_stride;
        const float *restrict s = a->scale + row * a->row_stride;
        if (a->column_stride == 0) {
            const float minimum = m[0], scale = s[0];
            for (int64_t i = 0; i < a->columns; i++) values[i] = (float)codes[i] * scale + minimum;
        } else {
            for (int64_t i = 0; i < a->columns; i++) values[i] = (float)codes[i] * s[i] + m[i];
        }
    }
    return 0;
}

/* Codes of rows x columns float32 values (contiguous) over their ranges; values (may be null): codes * s + m. */
int hf_cpt_quantize_codes(const float *source, uint8_t *codes, float *values, const float *minimum,
                          const float *scale, int64_t row_stride, int64_t column_stride, int64_t rows,
                          int64_t columns, float top, int threads) {
    codes_args args = {source, 0, codes, values, minimum, scale, row_stride, column_stride, columns, top};
    return split_items(quantize_rows, &args, rows, rows * columns, MIN_ELEMENTS_PER_THREAD, threads);
}

/* codes * s + m for rows x columns uint8 codes (contiguous). */
int hf_cpt_restore_codes(const uint8_t *codes, float *values, const float *minimum, const float *scale,
                         int64_t row_stride, int64_t column_stride, int64_t rows, int64_t columns, int threads) {
    codes_args args = {0, codes, 0, values, minimum, scale, row_stride, column_stride, columns, 0.0f};
    return split_items(restore_rows, &args, rows, rows * columns, MIN_ELEMENTS_PER_THREAD, threads);
}

typedef struct {
    int32_t *products;                                      /* int32 sums in, float32 results out, in place */
    const float *row_scale, *row_sum, *row_zero;            /* one per row */
    const float *column_scale, *column_zero, *column_term;  /* one per column */
    const float *bias;                                      /* one per column, or null */
    int64_t columns;
    int float_sums;                                         /* the sums arrive as float32 (exact integers) */
} product_args;

/* One row: out = p s_a s_b + (u z_b + z_a w) (+ bias), with u = s_a (a' 1) and w = s_b (1 b') + K z_b: the terms of
 * integer_matmul.code_matmul, in this order. */
static inline __attribute__((always_inline)) void product_row(
    int32_t *p, const float sa, const float u, const float za, const float *restrict sb, const float *restrict zb,
    const float *restrict w, const float *restrict bias, int64_t columns, const int with_bias, const int float_sums) {
    float *out = (float *)(void *)p; /* each sum is read, then overwritten by its float32 result */
    for (int64_t j = 0; j < columns; j++) {
        const float sum = float_sums ? out[j] : (float)p[j];
        const float v = sum * sa * sb[j] + (u * zb[j] + za * w[j]);
        out[j] = with_bias ? v + bias[j] : v;
    }
}

static int product_rows(const void *args, int64_t first_row, int64_t last_row) {
    const product_args *a = (const product_args *)args;
    for (int64_t row = first_row; row < last_row; row++) {
        int32_t *p = a->products + row * a->columns;
        const float sa = a->row_scale[row], u = a->row_sum[row], za = a->row_zero[row];
        const float *sb = a->column_scale, *zb = a->column_zero, *w = a->column_term;
        if (a->float_sums && a->bias)
            product_row(p, sa, u, za, sb, zb, w, a->bias, a->columns, 1, 1);
        else if (a->float_sums)
            product_row(p, sa, u, za, sb, zb, w, 0, a->columns, 0, 1);
        else if (a->bias)
            product_row(p, sa, u, za, sb, zb, w, a->bias, a->columns, 1, 0);
        else
            product_row(p, sa, u, za, sb, zb, w, 0, a->columns, 0, 0);
    }
    return 0;
}

/* The float32 result of a product on codes from its sums, in place: rows x columns (contiguous); the sums are int32,
 * or with float_sums float32 holding the same integers exactly. */
int hf_cpt_code_product(int32_t *products, const float *row_scale, const float *row_sum, const float *row_zero,
                        const float *column_scale, const float *column_zero, const float *column_term,
                        const float *bias, int64_t rows, int64_t columns, int float_sums, int threads) {
    product_args args = {products, row_scale, row_sum, row_zero, column_scale, column_zero, column_term, bias,
                         columns, float_sums};
    return split_items(product_rows, &args, rows, rows * columns, MIN_ELEMENTS_PER_THREAD, threads);
}

typedef struct {
    const float *source;
    float *minimum, *maximum;
    int64_t rows, columns;
} ranges_args;

/* Each row's min and max (torch's amin / amax: a row holding a NaN gets NaN for both). */
static int row_ranges(const void *args, int64_t first_row, int64_t last_row) {
    const ranges_args *a = (const ranges_args *)args;
    const int64_t n = a->columns;
    for (int64_t row = first_row; row < last_row; row++) {
        float low, high;
        const int nan = row_bounds(a->source + row * n, n, 0, &low, &high);
        a->minimum[row] = nan ? NAN : low;
        a->maximum[row] = nan ? NAN : high;
    }
    return 0;
}

/* Per-column passes split their columns into blocks of COLUMN_BLOCK (the items a thread takes): each block's columns
 * stay in registers or cache while the pass walks down the rows. */
#define COLUMN_BLOCK 256
#define COLUMN_BLOCKS(columns) (((columns) + COLUMN_BLOCK - 1) / COLUMN_BLOCK)

/* The first column of block and how many columns it holds (the last block may be narrower). */
static inline int64_t column_block(int64_t block, int64_t columns, int64_t *first) {
    *first = block * COLUMN_BLOCK;
    return columns - *first < COLUMN_BLOCK ? columns - *first : COLUMN_BLOCK;
}

/* Each column's min and max over every row, for the blocks of COLUMN_BLOCK columns first_block..last_block. */
static int column_ranges(const void *args, int64_t first_block, int64_t last_block) {
    const ranges_args *a = (const ranges_args *)args;
    const int64_t columns = a->columns;
    for (int64_t block = first_block; block < last_block; block++) {
        int64_t first;
        const int64_t width = column_block(block, columns, &first);
        float *restrict low = a->minimum + first, *restrict high = a->maximum + first;
        int nan[COLUMN_BLOCK];
        for (int64_t c = 0; c < width; c++) {
            low[c] = high[c] = a->source[first + c];
            nan[c] = 0;
        }
        for (int64_t row = 0; row < a->rows; row++) {
            const float *restrict x = a->source + row * columns + first;
            for (int64_t c = 0; c < width; c++) {
                low[c] = x[c] < low[c] ? x[c] : low[c];
                high[c] = x[c] > high[c] ? x[c] : high[c];
                nan[c] |= x[c] != x[c];
            }
        }
        for (int64_t c = 0; c < width; c++) {
            if (nan[c]) low[c] = high[c] = NAN;
        }
    }
    return 0;
}

/* The min and max of each row (per_column 0) or each column (per_column 1) of rows x columns float32 values. */
int hf_cpt_ranges(const float *source, float *minimum, float *maximum, int64_t rows, int64_t columns, int per_column,
                  int threads) {
    ranges_args args = {source, minimum, maximum, rows, columns};
    if (per_column) /* the items split over threads are blocks of columns */
        return split_items(column_ranges, &args, COLUMN_BLOCKS(columns), rows * columns, MIN_ELEMENTS_PER_THREAD,
                           threads);
    return split_items(row_ranges, &args, rows, rows * columns, MIN_ELEMENTS_PER_THREAD, threads);
}

typedef struct {
    const uint8_t *codes;
    float *values;
    int32_t *sums, *squares; /* one per row, or per column */
    int64_t rows, columns;
    int32_t middle;
} centred_args;

/* Each code less the middle code, as float32, with each row's sum and sum of squares: integers, exact (a row of at
 * most integer_matmul.MAX_REDUCED_SIZE codes keeps its sum of squares below 2^31). */
static int centred_rows(const void *args, int64_t first_row, int64_t last_row) {
    const centred_args *a = (const centred_args *)args;
    const int64_t n = a->columns;
    for (int64_t row = first_row; row < last_row; row++) {
        const uint8_t *restrict c = a->codes + row * n;
        float *restrict v = a->values + row * n;
        int32_t sum = 0, squares = 0;
        for (int64_t i = 0; i < n; i++) {
            const int32_t d = (int32_t)c[i] - a->middle;
            v[i] = (float)d;
            sum += d;
            squares += d * d;
        }
        a->sums[row] = sum;
        a->squares[row] = squares;
    }
    return 0;
}

/* The same with each column's sum and sum of squares, for the column blocks first_block..last_block. */
static int centred_columns(const void *args, int64_t first_block, int64_t last_block) {
    const centred_args *a = (const centred_args *)args;
    const int64_t columns = a->columns;
    for (int64_t block = first_block; block < last_block; block++) {
        int64_t first;
        const int64_t width = column_block(block, columns, &first);
        int32_t *restrict sum = a->sums + first, *restrict squares = a->squares + first;
        for (int64_t j = 0; j < width; j++)
            sum[j] = squares[j] = 0;
        for (int64_t row = 0; row < a->rows; row++) {
            const uint8_t *restrict c = a->codes + row * columns + first;
            float *restrict v = a->values + row * columns + first;
            for (int64_t j = 0; j < width; j++) {
                const int32_t d = (int32_t)c[j] - a->middle;
                v[j] = (float)d;
                sum[j] += d;
                squares[j] += d * d;
            }
        }
    }
    return 0;
}

/* Codes centred on the middle code as float32 values, and the sums and sums of squares along rows or columns, in one
 * pass: the operands of a product on codes through the float32 GEMM (integer_matmul._float_gemm_on_codes). */
int hf_cpt_centred_codes(const uint8_t *codes, float *values, int32_t *sums, int32_t *squares, int64_t rows,
                         int64_t columns, int32_t middle, int per_column, int threads) {
    centred_args args = {codes, values, sums, squares, rows, columns, middle};
    if (per_column) /* the items split over threads are blocks of columns */
        return split_items(centred_columns, &args, COLUMN_BLOCKS(columns), rows * columns, MIN_ELEMENTS_PER_THREAD,
                           threads);
    return split_items(centred_rows, &args, rows, rows * columns, MIN_ELEMENTS_PER_THREAD, threads);
}
