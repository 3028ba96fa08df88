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
 *
 * Sinks (one logit per query row, as gpt-oss learns one per head) join each row's softmax as one more score whose
 * value is zero: they add exp(sink - maximum) to the row's exp-sum when the pieces combine.
 *
 * Two entry points: `decode_attention` reads a dense cache ([batch, heads, length, size] by strides), and
 * `paged_decode_attention` a paged one in place, each sequence's tokens at the slots its list names (transformers'
 * continuous-batching cache), instead of a copy gathered per layer.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "build with -DHEAD_DIM=<the heads' size>"
#endif
/* latent attention's values are of another size than its queries and keys: -DVALUE_DIM=<size> */
#ifndef VALUE_DIM
#define VALUE_DIM HEAD_DIM
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
    const float *query; /* the piece's first row; rows query_row apart */
    int64_t query_row;
    /* the first token of the piece's first key/value head; tokens *_token, heads *_head apart. A piece's rows go by
     * groups of `group` rows, one group per key/value head: a dense call's piece has one head, a paged call's all of
     * them (a token's heads lie side by side there, so that a piece then reads whole tokens) */
    const cache_t *key, *value;
    int64_t key_token, value_token, key_head, value_head, group;
    /* paged: the sequence's token t lies at slot slots[t] of the key and value views (of slot_count slots), not at t */
    const int64_t *slots;
    int64_t slot_count;
    /* the mask, additive or boolean (nonzero: may attend) or neither: the first row's first token; rows mask_row,
     * tokens mask_token apart */
    const float *additive;
    const uint8_t *allowed;
    int64_t mask_row, mask_token;
    int64_t rows;
    float scale;
} Head;

/* One piece: `rows` query rows against tokens [start, stop). `scores` holds rows x (stop - start) floats. Writes
 * the rows' exp-weighted value sums (rows x VALUE_DIM), their score maxima and their exp-sums. Returns 0, or 2 when
 * a slot lies outside the views (nothing is read there). */
static int attend_piece(const Head *head, int64_t start, int64_t stop, float *restrict scores,
                        float *restrict sums, float *restrict maxima, float *restrict totals) {
    const int64_t width = stop - start;
    if (head->slots) {
        for (int64_t token = start; token < stop; token++)
            if ((uint64_t)head->slots[token] >= (uint64_t)head->slot_count) return 2;
    }
    for (int64_t token = start; token < stop; token++) {
        const int64_t slot = head->slots ? head->slots[token] : token;
        const cache_t *key = head->key + slot * head->key_token;
        for (int64_t first_row = 0; first_row < head->rows; first_row += head->group, key += head->key_head) {
            for (int64_t row = first_row; row < first_row + head->group; row++) {
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
        memset(sums + row * VALUE_DIM, 0, sizeof(float) * VALUE_DIM);
    }
    for (int64_t token = start; token < stop; token++) {
        const int64_t slot = head->slots ? head->slots[token] : token;
        const cache_t *value = head->value + slot * head->value_token;
        for (int64_t first_row = 0; first_row < head->rows; first_row += head->group, value += head->value_head) {
            for (int64_t row = first_row; row < first_row + head->group; row++) {
                const float weight = scores[row * width + token - start];
                float *row_sum = sums + row * VALUE_DIM;
                for (int d = 0; d < VALUE_DIM; d++) row_sum[d] += weight * widen(value[d]);
            }
        }
    }
    return 0;
}

/* One call: `sequences` x `heads` (sequence, head) pairs of `rows` query rows each, every operand given by its
 * strides in elements, the head size contiguous; the rows go by groups of `group`, one per key/value head of the
 * pair (heads key_head apart). Dense: every sequence has `length` tokens, at key + s *
 * key_sequence + t * key_token. Paged: sequence s has lengths[s] tokens, its token t at slot slots[starts[s] + t] of
 * the key and value views. */
typedef struct {
    const float *query;
    int64_t query_sequence, query_head, query_row;
    const cache_t *key, *value;
    int64_t key_sequence, key_head, key_token, value_sequence, value_head, value_token;
    const int64_t *slots, *starts, *lengths;
    int64_t length, slot_count;
    const float *additive;
    const uint8_t *allowed;
    int64_t mask_sequence, mask_head, mask_row, mask_token;
    const float *sinks; /* or NULL: (sequence s, head h, row r)'s logit at sinks[s * sink_sequence + h * sink_head +
                         * r * sink_row] */
    int64_t sink_sequence, sink_head, sink_row;
    float *output;
    int64_t sequences, heads, rows, group, chunk;
    float scale;
    int threads;
} Call;

static int64_t length_of(const Call *call, int64_t sequence) {
    return call->lengths ? call->lengths[sequence] : call->length;
}

/* Cuts every (sequence, head) into chunks of call->chunk tokens, attends to the pieces on call->threads threads and
 * combines each (sequence, head)'s pieces into the contiguous output [sequences, heads, rows, HEAD_DIM]. A row no
 * key may be attended by is zeros. Returns 0, 1 when out of memory, or 2 when a slot lies outside the views. */
static int attend(const Call *call) {
    const int64_t chunk = call->chunk, rows = call->rows, heads = call->heads, sequences = call->sequences;
    /* first[s]: the pieces of the sequences before s; a sequence's pieces go head by head, chunk by chunk */
    int64_t *first = malloc(sizeof(int64_t) * (sequences + 1));
    if (!first) return 1;
    first[0] = 0;
    for (int64_t s = 0; s < sequences; s++) first[s + 1] = first[s] + heads * ((length_of(call, s) + chunk - 1) / chunk);
    const int64_t pieces = first[sequences];
    const int64_t piece_floats = rows * (VALUE_DIM + 2); /* value sums, maxima, exp-sums */
    float *partial = malloc(sizeof(float) * (pieces ? pieces : 1) * piece_floats);
    if (!partial) {
        free(first);
        return 1;
    }
    int failure = 0;
#pragma omp parallel num_threads(call->threads)
    {
        float *scores = malloc(sizeof(float) * rows * chunk);
        if (!scores) {
#pragma omp atomic write
            failure = 1;
        }
        int64_t sequence = 0;
#pragma omp for schedule(static)
        for (int64_t piece = 0; piece < pieces; piece++) {
            if (!scores) continue;
            while (first[sequence + 1] <= piece) sequence++; /* a thread's pieces come in order */
            while (first[sequence] > piece) sequence--;
            const int64_t length = length_of(call, sequence);
            const int64_t chunks = (length + chunk - 1) / chunk;
            const int64_t h = (piece - first[sequence]) / chunks, part = (piece - first[sequence]) % chunks;
            const int64_t mask_at = sequence * call->mask_sequence + h * call->mask_head;
            const Head head = {
                .query = call->query + sequence * call->query_sequence + h * call->query_head,
                .query_row = call->query_row,
                .key = call->key + sequence * call->key_sequence + h * call->key_head,
                .value = call->value + sequence * call->value_sequence + h * call->value_head,
                .key_token = call->key_token,
                .value_token = call->value_token,
                .key_head = call->key_head,
                .value_head = call->value_head,
                .group = call->group,
                .slots = call->slots ? call->slots + call->starts[sequence] : NULL,
                .slot_count = call->slot_count,
                .additive = call->additive ? call->additive + mask_at : NULL,
                .allowed = call->allowed ? call->allowed + mask_at : NULL,
                .mask_row = call->mask_row,
                .mask_token = call->mask_token,
                .rows = rows,
                .scale = call->scale,
            };
            const int64_t start = part * chunk, stop = start + chunk < length ? start + chunk : length;
            float *sums = partial + piece * piece_floats;
            if (attend_piece(&head, start, stop, scores, sums, sums + rows * VALUE_DIM, sums + rows * (VALUE_DIM + 1))) {
#pragma omp atomic write
                failure = 2;
            }
        }
        free(scores);
    }
    if (failure) {
        free(first);
        free(partial);
        return failure;
    }
#pragma omp parallel for num_threads(call->threads) schedule(static)
    for (int64_t sequence_head = 0; sequence_head < sequences * heads; sequence_head++) {
        const int64_t sequence = sequence_head / heads, h = sequence_head % heads;
        const int64_t chunks = (length_of(call, sequence) + chunk - 1) / chunk;
        const float *own = partial + (first[sequence] + h * chunks) * piece_floats;
        for (int64_t row = 0; row < rows; row++) {
            float *out = call->output + (sequence_head * rows + row) * VALUE_DIM;
            float maximum = -INFINITY;
            for (int64_t part = 0; part < chunks; part++) {
                const float piece_maximum = own[part * piece_floats + rows * VALUE_DIM + row];
                maximum = piece_maximum > maximum ? piece_maximum : maximum;
            }
            memset(out, 0, sizeof(float) * VALUE_DIM);
            if (maximum == -INFINITY) continue; /* no key this row may attend to (a sink alone weighs a zero value) */
            const float sink =
                call->sinks ? call->sinks[sequence * call->sink_sequence + h * call->sink_head + row * call->sink_row]
                            : -INFINITY;
            maximum = sink > maximum ? sink : maximum;
            float total = sink == -INFINITY ? 0.f : exp_nonpositive(sink - maximum);
            for (int64_t part = 0; part < chunks; part++) {
                const float *sums = own + part * piece_floats;
                const float weight = exp_nonpositive(sums[rows * VALUE_DIM + row] - maximum);
                total += weight * sums[rows * (VALUE_DIM + 1) + row];
                for (int d = 0; d < VALUE_DIM; d++) out[d] += weight * sums[row * VALUE_DIM + d];
            }
            for (int d = 0; d < VALUE_DIM; d++) out[d] /= total;
        }
    }
    free(first);
    free(partial);
    return 0;
}

/* query [batch, heads, rows, HEAD_DIM], key and value [batch, heads, length, HEAD_DIM], the mask (additive or
 * boolean, or both NULL) broadcast to [batch, heads, rows, length]: each given by its strides in elements, the head
 * size contiguous; value's head size VALUE_DIM. sinks: NULL, or a logit per (sequence, head, row) by its strides.
 * output: a contiguous [batch, heads, rows, VALUE_DIM]. Returns 0, or 1 when out of memory. */
int decode_attention(const float *query, int64_t query_batch, int64_t query_head, int64_t query_row,
                     const cache_t *key, int64_t key_batch, int64_t key_head, int64_t key_token,
                     const cache_t *value, int64_t value_batch, int64_t value_head, int64_t value_token,
                     const float *additive, const uint8_t *allowed, int64_t mask_batch, int64_t mask_head,
                     int64_t mask_row, int64_t mask_token, const float *sinks, int64_t sink_batch, int64_t sink_head,
                     int64_t sink_row,
                     float *output, int64_t batch, int64_t heads, int64_t rows, int64_t length, float scale,
                     int64_t chunk, int threads) {
    const Call call = {
        .query = query, .query_sequence = query_batch, .query_head = query_head, .query_row = query_row,
        .key = key, .key_sequence = key_batch, .key_head = key_head, .key_token = key_token,
        .value = value, .value_sequence = value_batch, .value_head = value_head, .value_token = value_token,
        .length = length,
        .additive = additive, .allowed = allowed,
        .mask_sequence = mask_batch, .mask_head = mask_head, .mask_row = mask_row, .mask_token = mask_token,
        .sinks = sinks, .sink_sequence = sink_batch, .sink_head = sink_head, .sink_row = sink_row,
        .output = output, .sequences = batch, .heads = heads, .rows = rows, .group = rows, .chunk = chunk,
        .scale = scale, .threads = threads,
    };
    return attend(&call);
}

/* A paged cache read where it lies: the key and value views [slot_count, kv_heads, HEAD_DIM] (slots key_slot and
 * value_slot apart, heads *_head apart); sequence s's tokens at slots[starts[s]], ..., slots[starts[s] + lengths[s]
 * - 1]. query [sequences, heads, HEAD_DIM] by its strides, one row per head, query head j attending with key/value
 * head j / (heads / kv_heads); output a contiguous [sequences, heads, HEAD_DIM]. No mask: every row attends to all
 * its sequence's tokens; sinks: NULL, or one logit per query head. Each piece reads all the heads of its tokens. Returns 0, 1 when
 * out of memory, or 2 when a slot lies outside the views. */
int paged_decode_attention(const float *query, int64_t query_sequence, int64_t query_head, const cache_t *key,
                           int64_t key_slot, int64_t key_head, const cache_t *value, int64_t value_slot,
                           int64_t value_head, int64_t slot_count, const int64_t *slots, const int64_t *starts,
                           const int64_t *lengths, const float *sinks, float *output, int64_t sequences,
                           int64_t heads, int64_t kv_heads, float scale, int64_t chunk, int threads) {
    const Call call = {
        .query = query, .query_sequence = query_sequence, .query_row = query_head,
        .key = key, .key_head = key_head, .key_token = key_slot,
        .value = value, .value_head = value_head, .value_token = value_slot,
        .slots = slots, .starts = starts, .lengths = lengths, .slot_count = slot_count,
        .sinks = sinks, .sink_head = 0, .sink_row = 1,
        .output = output, .sequences = sequences, .heads = 1, .rows = heads, .group = heads / kv_heads,
        .chunk = chunk, .scale = scale, .threads = threads,
    };
    return attend(&call);
}
