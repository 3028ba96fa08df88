/*
 * A decode step's attention on CPU: a few query rows per head against a long cache, each cached key and value read
 * once, and every thread reading an equal share of the context (see cpu_decode.py for why and when it runs).
 *
 * Built by cpu_decode.py with -DHEAD_DIM=<size>: with the head size known to the compiler, the dot products and the
 * weighted sums over it are unrolled vector code (a run-time size measured 1.5x slower on one thread). The cache's
 * keys and values are float32, or bfloat16 with -DCACHE_BF16 (widened to float32 as they are read); the query rows,
 * the mask and the output are float32, and so is all arithmetic.
 *
 * The context is cut into chunks. Each (sequence, head, chunk) is one piece of work: the scores of its keys, their
 * maximum and exp-sum, and the exp-weighted sum of its values. The pieces of a (sequence, head) then combine
 * exactly, each weighted by exp(its maximum - the overall maximum) (flash-decoding).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=<the heads' size>"
#endif

#ifdef CACHE_BF16
typedef uint16_t cache_t;
/* bfloat16 is float32's upper half: widening is a shift, which vectorises */
static inline float widen(cache_t element) {
    union {
        uint32_t bits;
        float value;
    } widened = {.bits = (uint32_t)element << 16};
    return widened.value;
}
#else
typedef float cache_t;
static inline float widen(cache_t element) { return element; }
#endif

/* exp(x) for x <= 0 as plain arithmetic the compiler vectorises (libm's expf is not, without -ffast-math, which
 * would also assume no infinities: masked scores are -inf). x = n ln2 + r, exp(r) by a polynomial of degree
 * 7 (Cephes' expf), 2^n built in the exponent bits; exactly 0 below -87, where expf underflows anyway. */
static inline float exp_nonpositive(float x) {
    const float clamped = x < -87.f ? -87.f : x;
    const float n = __builtin_roundf(clamped * 1.44269504088896341f);
    const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union {
        int32_t bits;
        float value;
    } power = {.bits = ((int32_t)n + 127) << 23};
    return x < -87.f ? 0.f : p * power.value;
}

typedef struct {
    const float *query; /* the (sequence, head)'s first row; rows query_row apart */
    int64_t query_row;
    const cache_t *key, *value; /* the (sequence, head)'s first token; tokens *_token apart */
    int64_t key_token, value_token;
    /* the mask, additive or boolean (nonzero: may attend) or neither: the first row's first token; rows mask_row,
     * tokens mask_token apart */
    const float *additive;
    const uint8_t *allowed;
    int64_t mask_row, mask_token;
    int64_t rows;
    float scale;
} Head;

/* One piece: `rows` query rows against tokens [start, stop). `scores` holds rows x (stop - start) floats. Writes
 * the rows' exp-weighted value sums (rows x HEAD_DIM), their score maxima and their exp-sums. */
static void attend_piece(const Head *head, int64_t start, int64_t stop, float *restrict scores,
                         float *restrict sums, float *restrict maxima, float *restrict totals) {
    const int64_t width = stop - start;
    for (int64_t token = start; token < stop; token++) {
        const cache_t *key = head->key + token * head->key_token;
        for (int64_t row = 0; row < head->rows; row++) {
            const float *query = head->query + row * head->query_row;
            float dot = 0.f;
            for (int d = 0; d < HEAD_DIM; d++) dot += query[d] * widen(key[d]);
            float score = dot * head->scale;
            const int64_t at = row * head->mask_row + token * head->mask_token;
            if (head->additive) score += head->additive[at];
            if (head->allowed && !head->allowed[at]) score = -INFINITY;
            scores[row * width + token - start] = score;
        }
    }
    for (int64_t row = 0; row < head->rows; row++) {
        float *row_scores = scores + row * width;
        float maximum = -INFINITY;
#pragma omp simd reduction(max : maximum)
        for (int64_t i = 0; i < width; i++) maximum = row_scores[i] > maximum ? row_scores[i] : maximum;
        float total = 0.f;
        if (maximum == -INFINITY) { /* every key of the piece masked: it weighs nothing */
            memset(row_scores, 0, sizeof(float) * width);
        } else {
#pragma omp simd reduction(+ : total)
            for (int64_t i = 0; i < width; i++) {
                row_scores[i] = exp_nonpositive(row_scores[i] - maximum);
                total += row_scores[i];
            }
        }
        maxima[row] = maximum;
        totals[row] = total;
        memset(sums + row * HEAD_DIM, 0, sizeof(float) * HEAD_DIM);
    }
    for (int64_t token = start; token < stop; token++) {
        const cache_t *value = head->value + token * head->value_token;
        for (int64_t row = 0; row < head->rows; row++) {
            const float weight = scores[row * width + token - start];
            float *row_sum = sums + row * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) row_sum[d] += weight * widen(value[d]);
        }
    }
}

/* query [batch, heads, rows, HEAD_DIM], key and value [batch, heads, length, HEAD_DIM], the mask (additive or
 * boolean, or both NULL) broadcast to [batch, heads, rows, length]: each given by its strides in elements, the head
 * size contiguous. output: a contiguous [batch, heads, rows, HEAD_DIM]. A row no key may be attended by is zeros.
 * Returns 0, or 1 when out of memory. */
int decode_attention(const float *query, int64_t query_batch, int64_t query_head, int64_t query_row,
                     const cache_t *key, int64_t key_batch, int64_t key_head, int64_t key_token,
                     const cache_t *value, int64_t value_batch, int64_t value_head, int64_t value_token,
                     const float *additive, const uint8_t *allowed, int64_t mask_batch, int64_t mask_head,
                     int64_t mask_row, int64_t mask_token, float *output, int64_t batch, int64_t heads, int64_t rows,
                     int64_t length, float scale, int64_t chunk, int threads) {
    const int64_t chunks = (length + chunk - 1) / chunk;
    const int64_t pieces = batch * heads * chunks;
    const int64_t piece_floats = rows * (HEAD_DIM + 2); /* value sums, maxima, exp-sums */
    float *partial = malloc(sizeof(float) * pieces * piece_floats);
    if (!partial) return 1;
    int out_of_memory = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * rows * chunk);
        if (!scores) {
#pragma omp atomic write
            out_of_memory = 1;
        }
#pragma omp for schedule(static)
        for (int64_t piece = 0; piece < pieces; piece++) {
            if (!scores) continue;
            const int64_t part = piece % chunks, sequence = piece / chunks / heads, h = piece / chunks % heads;
            const Head head = {
                .query = query + sequence * query_batch + h * query_head,
                .query_row = query_row,
                .key = key + sequence * key_batch + h * key_head,
                .value = value + sequence * value_batch + h * value_head,
                .key_token = key_token,
                .value_token = value_token,
                .additive = additive ? additive + sequence * mask_batch + h * mask_head : NULL,
                .allowed = allowed ? allowed + sequence * mask_batch + h * mask_head : NULL,
                .mask_row = mask_row,
                .mask_token = mask_token,
                .rows = rows,
                .scale = scale,
            };
            const int64_t start = part * chunk, stop = start + chunk < length ? start + chunk : length;
            float *sums = partial + piece * piece_floats;
            attend_piece(&head, start, stop, scores, sums, sums + rows * HEAD_DIM, sums + rows * (HEAD_DIM + 1));
        }
        free(scores);
    }
    if (out_of_memory) {
        free(partial);
        return 1;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t sequence_head = 0; sequence_head < batch * heads; sequence_head++) {
        const float *first = partial + sequence_head * chunks * piece_floats;
        for (int64_t row = 0; row < rows; row++) {
            float *out = output + (sequence_head * rows + row) * HEAD_DIM;
            float maximum = -INFINITY;
            for (int64_t part = 0; part < chunks; part++) {
                const float piece_maximum = first[part * piece_floats + rows * HEAD_DIM + row];
                maximum = piece_maximum > maximum ? piece_maximum : maximum;
            }
            memset(out, 0, sizeof(float) * HEAD_DIM);
            if (maximum == -INFINITY) continue; /* no key this row may attend to */
            float total = 0.f;
            for (int64_t part = 0; part < chunks; part++) {
                const float *sums = first + part * piece_floats;
                const float weight = exp_nonpositive(sums[rows * HEAD_DIM + row] - maximum);
                total += weight * sums[rows * (HEAD_DIM + 1) + row];
                for (int d = 0; d < HEAD_DIM; d++) out[d] += weight * sums[row * HEAD_DIM + d];
            }
            for (int d = 0; d < HEAD_DIM; d++) out[d] /= total;
        }
    }
    free(partial);
    return 0;
}
