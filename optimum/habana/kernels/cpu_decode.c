/*
 * A decode step's attention on CPU: a few query rows per head against a long cache, each cached key and value read
 * once, and every thread reading an equal share of the context (see cpu_decode.py for why and when it runs).
 *
 * Built by cpu_decode.py with -DHEAD_DIM=<size>: with the head size known to the compiler, the dot products and the
 * weighted sums over it are vector code of fixed trip counts (a run-time size measured 1.5x slower on one thread),
 * in blocks held in registers (see "Register blocking" below). The cache's keys and values are float32, or bfloat16
 * with -DCACHE_BF16 (widened to float32 as they are read); the query rows, the mask and the output are float32, and
 * so is all arithmetic.
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
#if defined(CACHE_BF16) && defined(__AVX2__)
#include <immintrin.h>
#endif

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
     * them (a token's heads lie side by side there, so that a piece covers whole tokens) */
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

/*
 * Register blocking. A group's rows all read the same keys and values, so the arithmetic per byte of cache grows
 * with the group (gpt-oss: 8 rows a key/value head, SmolLM2 3). Computed a row and a key at a time, each dot product
 * ended in its own sum across the vector's lanes, and each row's weighted sum was loaded and stored again for every
 * value: that work, not reading the cache, bounded gpt-oss's geometry (15.5 GB/s of cache against SmolLM2's 24).
 *
 * - The dot products go KEYS keys at a time: a row's KEYS partial sums stay in registers over the head (each query
 *   vector loaded once for the KEYS keys), and one transposing tree of pairwise sums turns them into one vector of
 *   KEYS scores, stored at once (`sum_lanes`: 7 additions where summing each alone takes 3 each).
 * - The weighted sums go up to VALUE_ROWS rows x VALUE_VECTORS(rows) vectors of the head at a time: that block of
 *   sums stays in registers over TOKEN_BLOCK values, each value vector loaded once for all the block's rows, while
 *   the block's values stay in the first-level cache for the blocks of rows and of the head that pass over them.
 *
 * The blocks are vectors of the GNU C vector extension (GCC and Clang lower them to the target's vectors, several
 * registers each where a vector is narrower than LANES floats): written as loops over plain arrays, GCC 12 kept the
 * blocks in memory, which is the load and store traffic this removes. 8 sums of each block and the operands in
 * flight fit AVX2's 16 vector registers. Measured on an AMD EPYC (Zen 3) against the kernel a row and a key at a
 * time: one core, the cache in its L2, gpt-oss's geometry 8.5 -> 11.5 GB/s, SmolLM2's 19.4 -> 22.5; two cores, the
 * cache in memory, gpt-oss's 15 -> 20-21 GB/s, SmolLM2's 1.2x, Llama-3's 0.98-1.07x, MiMo-V2-Flash's (16 rows a
 * head of 192) 1.8x (docs/benchmarks.md, issue 42).
 */
#define LANES 8
#define KEYS LANES /* one row's dot products with KEYS keys: one tree makes them one vector of scores */
#define VALUE_ROWS 4
/* Vectors of the head per block of the weighted sums, by the block's rows: 8 sums or more in flight. Each sum waits
 * for its previous multiply-add (4 cycles on Zen 3, whose two FMA units 8 keep busy): one row's 2 vectors made
 * Kimi's geometry (one row a head) slower than the old kernel. */
#define VALUE_VECTORS(rows) ((rows) == 1 ? 8 : (rows) == 2 ? 4 : (rows) == 3 ? 3 : 2)
#define MAX_VALUE_VECTORS 8
/* Values per block. The blocks of the head's vectors read the block's values a cache line of each, values apart;
 * with the cache in memory and two threads, 4 values a block measured fastest (SmolLM2's and gpt-oss's geometry:
 * 1.2x and 1.3x the old kernel's speed, where 16 measured 1.0x and 1.1x, and 8 slower still on Llama-3's 512-byte
 * values), though with the cache in L3 16 computes faster. */
#define TOKEN_BLOCK 4
/* Each block's keys and values are asked for before they are used (KEYS_AHEAD blocks of keys, VALUES_AHEAD blocks
 * of values ahead: a few KiB): the arithmetic between two blocks leaves the CPU's own prefetchers behind, and the
 * weighted sums' order of reading is not one they follow. Measured with the cache in memory: SmolLM2's values alone
 * 1.7x faster on one core; on two, gpt-oss's geometry 1.1-1.2x (further ahead measured no better). */
#define KEYS_AHEAD 2
#define VALUES_AHEAD 2

typedef float lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t lane_indices __attribute__((vector_size(LANES * sizeof(int32_t))));

/* LANES floats from anywhere (no alignment assumed); cache elements widened to float32 */
static inline lanes load_floats(const float *from) {
    lanes loaded;
    memcpy(&loaded, from, sizeof loaded);
    return loaded;
}

static inline lanes load_cache(const cache_t *from) {
#if defined(CACHE_BF16) && defined(__AVX2__)
    /* one widening instruction: GCC 12 lowers the vector extension's conversion of 8 uint16 in two 128-bit halves
     * and a merge (5 instructions for each key and value vector, which made bfloat16 caches 2x float32's time) */
    const __m256i widened = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)from)), 16);
    lanes loaded;
    memcpy(&loaded, &widened, sizeof loaded); /* the same bits as float32 */
    return loaded;
#elif defined(CACHE_BF16)
    uint16_t halves __attribute__((vector_size(LANES * sizeof(uint16_t))));
    memcpy(&halves, from, sizeof halves);
    typedef uint32_t words __attribute__((vector_size(LANES * sizeof(uint32_t))));
    const words widened = __builtin_convertvector(halves, words) << 16;
    lanes loaded;
    memcpy(&loaded, &widened, sizeof loaded); /* the same bits as float32 */
    return loaded;
#else
    return load_floats(from);
#endif
}

static inline void store_floats(float *to, lanes from) { memcpy(to, &from, sizeof from); }

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (lane_indices){__VA_ARGS__})
#endif

/* LANES (8) vectors to one: lane i the sum of vector i's lanes. Three levels of pairwise sums (shuffles within
 * 128-bit halves, then across), 7 additions for 8 sums where summing each vector alone takes 3 each. */
static inline lanes sum_lanes(const lanes v[LANES]) {
    lanes pairs[4], quads[2];
    for (int i = 0; i < 4; i++)
        pairs[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
                   SHUFFLE(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        quads[i] = SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    /* quads[0]: v0..v3's sums over lanes 0-3 then over lanes 4-7; quads[1] v4..v7's */
    return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* The dot products of one query row with KEYS keys, lane t key t's. Not unrolled: unrolled, GCC reassociates the
 * sums (-fassociative-math) into trees that keep more vectors live than there are registers, and spills. */
static inline lanes dot_block(const float *query, const cache_t *const key[KEYS]) {
    lanes partial[KEYS] = {0};
#pragma GCC unroll 1
    for (int d = 0; d + LANES <= HEAD_DIM; d += LANES) {
        const lanes row = load_floats(query + d);
        for (int t = 0; t < KEYS; t++) partial[t] += row * load_cache(key[t] + d);
    }
    lanes dots = sum_lanes(partial);
    for (int d = HEAD_DIM / LANES * LANES; d < HEAD_DIM; d++) /* a head size not a multiple of LANES */
        for (int t = 0; t < KEYS; t++) dots[t] += query[d] * widen(key[t][d]);
    return dots;
}

/* The same dot products a key at a time, for groups of one row (Llama-2's, DeepSeek's and Kimi's heads): there a
 * row shares nothing with another, and reading the block's keys in the order they lie in memory (each key's floats
 * before the next key's) measured faster with the cache in memory than the keys side by side (two threads, Kimi's
 * heads of 192: about the old kernel's speed, where side by side 0.9x). Two sums per key, so that each waits on half
 * the multiply-adds. */
static inline lanes dot_block_sequential(const float *query, const cache_t *const key[KEYS]) {
    lanes partial[KEYS];
#pragma GCC unroll 1
    for (int t = 0; t < KEYS; t++) {
        lanes even = {0}, odd = {0};
        int d = 0;
        for (; d + 2 * LANES <= HEAD_DIM; d += 2 * LANES) {
            even += load_floats(query + d) * load_cache(key[t] + d);
            odd += load_floats(query + d + LANES) * load_cache(key[t] + d + LANES);
        }
        for (; d + LANES <= HEAD_DIM; d += LANES) even += load_floats(query + d) * load_cache(key[t] + d);
        partial[t] = even + odd;
    }
    lanes dots = sum_lanes(partial);
    for (int d = HEAD_DIM / LANES * LANES; d < HEAD_DIM; d++) /* a head size not a multiple of LANES */
        for (int t = 0; t < KEYS; t++) dots[t] += query[d] * widen(key[t][d]);
    return dots;
}

/* sums[r][from, from + vectors * LANES) += sum over `count` tokens of weights[r][t] * value[t][same lanes], for
 * `rows` rows: the block's sums in registers over the tokens, each value vector loaded once for all the rows.
 * `rows` and `vectors` are constants where it is called: each call compiles to its own loop. */
static inline __attribute__((always_inline)) void weighted_sum(const int rows, const int vectors,
                                                               const float *const weights[VALUE_ROWS],
                                                               float *const sums[VALUE_ROWS],
                                                               const cache_t *const value[TOKEN_BLOCK],
                                                               int64_t count, int from) {
    lanes block[VALUE_ROWS][MAX_VALUE_VECTORS];
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) block[r][v] = load_floats(sums[r] + from + v * LANES);
    for (int64_t t = 0; t < count; t++) {
        lanes values[MAX_VALUE_VECTORS];
        for (int v = 0; v < vectors; v++) values[v] = load_cache(value[t] + from + v * LANES);
        for (int r = 0; r < rows; r++) {
            const float weight = weights[r][t];
            for (int v = 0; v < vectors; v++) block[r][v] += weight * values[v];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int v = 0; v < vectors; v++) store_floats(sums[r] + from + v * LANES, block[r][v]);
}

/* The weighted sums of `rows` (a constant where it is called, at most VALUE_ROWS) rows over `count` values, all
 * VALUE_DIM of them: blocks of VALUE_VECTORS(rows) vectors, then of one, then the floats left over. */
static inline __attribute__((always_inline)) void weigh_values(const int rows, const float *const weights[VALUE_ROWS],
                                                               float *const sums[VALUE_ROWS],
                                                               const cache_t *const value[TOKEN_BLOCK],
                                                               int64_t count) {
    int d = 0;
    for (; d + VALUE_VECTORS(rows) * LANES <= VALUE_DIM; d += VALUE_VECTORS(rows) * LANES)
        weighted_sum(rows, VALUE_VECTORS(rows), weights, sums, value, count, d);
    for (; d + LANES <= VALUE_DIM; d += LANES) weighted_sum(rows, 1, weights, sums, value, count, d);
    for (; d < VALUE_DIM; d++) /* a value size not a multiple of LANES */
        for (int r = 0; r < rows; r++)
            for (int64_t t = 0; t < count; t++) sums[r][d] += weights[r][t] * widen(value[t][d]);
}

/* the floats between two rows' scores in a piece of `width` tokens: whole blocks of KEYS */
static inline int64_t scores_stride(int64_t width) { return (width + KEYS - 1) / KEYS * KEYS; }

/* Asks the memory for one token's key or value head (`size` elements), every 64-byte line of it, before it is used */
static inline void prefetch_head(const cache_t *head, int size) {
    for (int byte = 0; byte < size * (int)sizeof(cache_t); byte += 64) __builtin_prefetch((const char *)head + byte);
}

/* the address of token `token`'s key or value head 0 (paged: at its slot) */
static inline int64_t token_at(const Head *head, int64_t token) { return head->slots ? head->slots[token] : token; }

/* One piece: `rows` query rows against tokens [start, stop). `scores` holds rows x scores_stride(stop - start)
 * floats. Writes the rows' exp-weighted value sums (rows x VALUE_DIM), their score maxima and their exp-sums. Returns
 * 0, or 2 when a slot lies outside the views (nothing is read there). */
static int attend_piece(const Head *head, int64_t start, int64_t stop, float *restrict scores,
                        float *restrict sums, float *restrict maxima, float *restrict totals) {
    const int64_t width = stop - start, stride = scores_stride(width), group = head->group, rows = head->rows;
    if (head->slots) {
        for (int64_t token = start; token < stop; token++)
            if ((uint64_t)head->slots[token] >= (uint64_t)head->slot_count) return 2;
    }
    /* The dot products, a key/value head at a time (a dense piece has one; a paged piece all of them, which lie side
     * by side in each token: a block's tokens with all their heads measured the paged entry at 0.8x the old kernel's
     * speed on SmolLM2's geometry, a head at a time 0.9x, and 1.2-1.4x on gpt-oss's and Llama-3's), KEYS tokens at a
     * time. A block short of keys repeats its last key: rows are `stride` floats apart in `scores`, width rounded up
     * to KEYS, so that a block's scores are one store. */
    const float scale = head->scale;
    for (int64_t first_row = 0, kv = 0; first_row < rows; first_row += group, kv++) {
        for (int64_t first = start; first < stop; first += KEYS) {
            int64_t at[KEYS];
            for (int t = 0; t < KEYS; t++) at[t] = token_at(head, first + t < stop ? first + t : stop - 1);
            const int64_t ahead = first + KEYS * KEYS_AHEAD;
            for (int64_t t = ahead; t < ahead + KEYS && t < stop; t++)
                prefetch_head(head->key + token_at(head, t) * head->key_token + kv * head->key_head, HEAD_DIM);
            const cache_t *key[KEYS];
            for (int t = 0; t < KEYS; t++) key[t] = head->key + at[t] * head->key_token + kv * head->key_head;
            for (int64_t row = first_row; row < first_row + group; row++) {
                const float *query = head->query + row * head->query_row;
                const lanes dots = group == 1 ? dot_block_sequential(query, key) : dot_block(query, key);
                store_floats(scores + row * stride + first - start, dots * scale); /* scaled as it is stored */
            }
        }
    }
    /* Each row's scores masked (the same arithmetic as a score at a time: score * scale, + the additive mask, -inf
     * where the boolean mask forbids), then their maximum, exp and sum, each a loop over the row's tokens */
    for (int64_t row = 0; row < rows; row++) {
        float *row_scores = scores + row * stride;
        const int64_t mask_at = row * head->mask_row + start * head->mask_token, step = head->mask_token;
        if (head->additive) {
            const float *additive = head->additive + mask_at;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) row_scores[i] += additive[i * step];
        }
        if (head->allowed) {
            const uint8_t *allowed = head->allowed + mask_at;
#pragma omp simd
            for (int64_t i = 0; i < width; i++) row_scores[i] = allowed[i * step] ? row_scores[i] : -INFINITY;
        }
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
    /* The weighted sums of the values, a head at a time again, TOKEN_BLOCK tokens at a time, VALUE_ROWS rows at a
     * time (a group's last block may have fewer: a loop of its own for each count) */
    for (int64_t first_row = 0, kv = 0; first_row < rows; first_row += group, kv++) {
        for (int64_t first = start; first < stop; first += TOKEN_BLOCK) {
            const int64_t count = stop - first < TOKEN_BLOCK ? stop - first : TOKEN_BLOCK;
            const int64_t ahead = first + TOKEN_BLOCK * VALUES_AHEAD;
            for (int64_t t = ahead; t < ahead + TOKEN_BLOCK && t < stop; t++)
                prefetch_head(head->value + token_at(head, t) * head->value_token + kv * head->value_head, VALUE_DIM);
            const cache_t *value[TOKEN_BLOCK];
            for (int64_t t = 0; t < count; t++)
                value[t] = head->value + token_at(head, first + t) * head->value_token + kv * head->value_head;
            for (int64_t row = first_row; row < first_row + group; row += VALUE_ROWS) {
                const int64_t left = first_row + group - row;
                const int block_rows = left < VALUE_ROWS ? (int)left : VALUE_ROWS;
                const float *weights[VALUE_ROWS];
                float *row_sums[VALUE_ROWS];
                for (int r = 0; r < block_rows; r++) {
                    weights[r] = scores + (row + r) * stride + first - start;
                    row_sums[r] = sums + (row + r) * VALUE_DIM;
                }
                switch (block_rows) {
                case 1: weigh_values(1, weights, row_sums, value, count); break;
                case 2: weigh_values(2, weights, row_sums, value, count); break;
                case 3: weigh_values(3, weights, row_sums, value, count); break;
                default: weigh_values(VALUE_ROWS, weights, row_sums, value, count); break;
                }
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
        float *scores = malloc(sizeof(float) * rows * scores_stride(chunk));
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
