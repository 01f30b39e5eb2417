/* PagedAttention decode on the CPU, one (piece of rows reading one block table, kv head) task at a time.

   The numba kernel beside this file runs the same algorithm but reaches only ~11 GB/s even with the KV
   in cache: its per-row dot products end in horizontal reductions and its V accumulator round-trips
   memory. Here the inner loops work on 8-float vectors (GCC vector extensions, so the file builds for any
   target gcc knows; it is compiled with -march=native on the machine that runs it) and the V accumulator
   for 8 vectors of a head lives in registers across a chunk of rows.

   One pass over the block table with online softmax: a chunk of up to CHUNK rows of K is scored, the
   running max and sum are updated, and the same rows of V are read while they are fresh.

   Layouts (all float32): q [T, H, D] with row and head strides (d contiguous), so a view into the fused
   QK projection needs no copy; out [T, H, D] likewise; k, v [KVH, num_slots, D]; block_tables
   [S, max_blocks] and seq_lens [S], rows [S] int64 (sequence s reads q[rows[s]] and writes out[rows[s]]). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8f_unaligned __attribute__((vector_size(32), aligned(4), may_alias)); /* rows are 4-aligned */

#define CHUNK 16
#define MAX_GROUP 32
#define MAX_VECS 512 /* G * head_dim / 8: the query and accumulator vectors of one task */

static inline v8f load8(const float *p) { return *(const v8f_unaligned *)p; }
static inline void store8(float *p, v8f x) { *(v8f_unaligned *)p = x; }
static inline v8f splat(float a) { return (v8f){a, a, a, a, a, a, a, a}; }
static inline float hsum(v8f x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
static inline v8f select8(v8i mask, v8f a, v8f b) { return (v8f)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* exp for x <= 0 (scores minus their running max): Cody-Waite reduction to r in [-ln2/2, ln2/2], a
   degree-6 polynomial for e^r, then the power of two put into the exponent bits. Inputs below -87 give 0. */
static inline v8f exp8(v8f x) {
    const v8f lo = splat(-87.0f);
    v8i under = x < lo;
    x = select8(under, lo, x);
    v8f t = x * splat(1.44269504088896341f);
    v8i n = __builtin_convertvector(t - splat(0.5f), v8i); /* truncation toward 0 rounds t <= 0 to nearest */
    v8f nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * splat(0.693359375f) + nf * splat(2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8f scale = (v8f)((n + 127) << 23);
    return select8(under, splat(0.0f), p * scale);
}

/* x[i] = e^x[i] in place for x[i] <= 0, 8 at a time: the fused decode step's SiLU (decode_step.c) builds its
   sigmoid on it. */
void minillm_exp_nonpositive(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(x + i, exp8(load8(x + i)));
    if (i < n) {
        float rest[8] = {0};
        for (int64_t j = i; j < n; j++) rest[j - i] = x[j];
        const v8f e = exp8(load8(rest));
        for (int64_t j = i; j < n; j++) x[j] = e[j - i];
    }
}

/* Lane i of the result is the sum of the lanes of x_i (four horizontal sums in one reduction tree). */
static inline v8f hsum4(v8f x0, v8f x1, v8f x2, v8f x3) {
    v8f a = __builtin_shufflevector(x0, x1, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x0, x1, 2, 3, 10, 11, 6, 7, 14, 15);
    v8f b = __builtin_shufflevector(x2, x3, 0, 1, 8, 9, 4, 5, 12, 13) + __builtin_shufflevector(x2, x3, 2, 3, 10, 11, 6, 7, 14, 15);
    v8f c = __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
    return c + __builtin_shufflevector(c, c, 4, 5, 6, 7, 0, 1, 2, 3);  /* lanes 0..3 hold the four sums */
}

/* One key's score for one query head, as score_chunk scores the keys past the last whole four. */
static inline float score_one(const v8f *qg, int nv, const float *kr) {
    v8f a0 = splat(0.0f);
    for (int c = 0; c < nv; c++) a0 += qg[c] * load8(kr + 8 * c);
    return hsum(a0);
}

/* Scores of one chunk of rows for the group's G query heads: s[g * CHUNK + j] = q_g . k_j, four rows at a
   time so each query vector is loaded once per four rows and four dot products are in flight. Lanes past
   n are set to -inf (they drop out of the max and get probability 0). */
static void score_chunk(const v8f *qv, int G, int nv, const float *krows, int n, int D, float *s) {
    for (int g = 0; g < G; g++) {
        const v8f *qg = qv + g * nv;
        float *sg = s + g * CHUNK;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            const float *k0 = krows + (int64_t)j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            v8f a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
            for (int c = 0; c < nv; c++) {
                v8f qc = qg[c];
                a0 += qc * load8(k0 + 8 * c); a1 += qc * load8(k1 + 8 * c);
                a2 += qc * load8(k2 + 8 * c); a3 += qc * load8(k3 + 8 * c);
            }
            v8f r = hsum4(a0, a1, a2, a3);
            sg[j] = r[0]; sg[j + 1] = r[1]; sg[j + 2] = r[2]; sg[j + 3] = r[3];
        }
        for (; j < n; j++) sg[j] = score_one(qg, nv, krows + (int64_t)j * D);
        for (; j < CHUNK; j++) sg[j] = -INFINITY;
    }
}

/* acc_g += sum_j p[g, j] * v_j for the chunk's rows; 8 vectors of the head at a time stay in registers. */
static void accumulate_chunk(v8f *acc, const float *p, int G, int nv, const float *vrows, int n, int D) {
    for (int g = 0; g < G; g++) {
        v8f *ag = acc + g * nv;
        const float *pg = p + g * CHUNK;
        int c = 0;
        for (; c + 8 <= nv; c += 8) {
            v8f r0 = ag[c], r1 = ag[c + 1], r2 = ag[c + 2], r3 = ag[c + 3];
            v8f r4 = ag[c + 4], r5 = ag[c + 5], r6 = ag[c + 6], r7 = ag[c + 7];
            for (int j = 0; j < n; j++) {
                const float *vr = vrows + (int64_t)j * D + 8 * c;
                v8f w = splat(pg[j]);
                r0 += w * load8(vr);      r1 += w * load8(vr + 8);
                r2 += w * load8(vr + 16); r3 += w * load8(vr + 24);
                r4 += w * load8(vr + 32); r5 += w * load8(vr + 40);
                r6 += w * load8(vr + 48); r7 += w * load8(vr + 56);
            }
            ag[c] = r0; ag[c + 1] = r1; ag[c + 2] = r2; ag[c + 3] = r3;
            ag[c + 4] = r4; ag[c + 5] = r5; ag[c + 6] = r6; ag[c + 7] = r7;
        }
        for (; c < nv; c++) {
            v8f r0 = ag[c];
            for (int j = 0; j < n; j++) r0 += splat(pg[j]) * load8(vrows + (int64_t)j * D + 8 * c);
            ag[c] = r0;
        }
    }
}

/* Online softmax update for one chunk: turns s (scores) into p (unnormalised probabilities against the new
   running max), rescales the accumulator when the max moved. */
static void softmax_chunk(float *s, int G, int nv, float *m, float *l, v8f *acc) {
    for (int g = 0; g < G; g++) {
        float *sg = s + g * CHUNK;
        v8f s0 = load8(sg), s1 = load8(sg + 8);
        v8f mx = select8(s0 > s1, s0, s1);
        float bm = mx[0];
        for (int i = 1; i < 8; i++) bm = mx[i] > bm ? mx[i] : bm;
        if (bm > m[g]) {
            float corr = isinf(m[g]) ? 0.0f : expf(m[g] - bm);
            l[g] *= corr;
            for (int c = 0; c < nv; c++) acc[g * nv + c] *= splat(corr);
            m[g] = bm;
        }
        v8f e0 = exp8(s0 - splat(m[g])), e1 = exp8(s1 - splat(m[g]));  /* -inf lanes give 0 */
        store8(sg, e0);
        store8(sg + 8, e1);
        l[g] += hsum(e0 + e1);
    }
}

/* R rows that read one block table, each over its own length lens[r] (R = 1: a decode row, decode_task below; more:
   a verification step's k + 1 tokens of a sequence, each attending over the context and the rows before it),
   against kv head h, in one pass over the keys and values: the R x G query heads are scored as one group, so each
   chunk of K and V is read once for all of them instead of once per row. Row r is q[r0 + r]; positions at or past
   lens[r] score -inf (probability 0: they add exact zeros). A row's sums are those it gets alone, chunk for chunk,
   bit for bit: in its last partial chunk the keys the four-key path took past its own last whole four are scored
   again one by one, as alone (another order of additions there let speculative greedy decoding part from plain at
   a near-tie). R * G <= MAX_GROUP (minillm_paged_decode_rows_max). */
void minillm_paged_decode_rows_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t r0, int R,
                                    const float *k, const float *v, const int64_t *table, const int64_t *lens,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                    int64_t block_size, float scale, float *out, int64_t out_row_stride,
                                    int64_t out_head_stride, int64_t h) {
    const int G = (int)(num_heads / num_kv_heads), D = (int)head_dim, nv = D / 8, GR = G * R;
    v8f qv[MAX_VECS], acc[MAX_VECS];
    float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP * CHUNK];
    int64_t length = 0;
    for (int r = 0; r < R; r++) {
        length = lens[r] > length ? lens[r] : length;
        for (int g = 0; g < G; g++) {
            const float *qg = q + (r0 + r) * q_row_stride + (h * G + g) * q_head_stride;
            const int at = r * G + g;
            for (int c = 0; c < nv; c++) {
                qv[at * nv + c] = load8(qg + 8 * c) * splat(scale);
                acc[at * nv + c] = splat(0.0f);
            }
            m[at] = -INFINITY;
            l[at] = 0.0f;
        }
    }
    const float *kh = k + h * num_slots * D, *vh = v + h * num_slots * D;
    for (int64_t t0 = 0; t0 < length; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size;
        const int64_t in_block = length - t0 < block_size ? length - t0 : block_size;
        if (t0 + block_size < length) {
            const int64_t next = table[t0 / block_size + 1] * block_size;
            const int64_t rows_next = length - t0 - block_size < block_size ? length - t0 - block_size : block_size;
            const char *kn = (const char *)(kh + next * D), *vn = (const char *)(vh + next * D);
            for (int64_t off = 0; off < rows_next * D * 4; off += 64) {
                __builtin_prefetch(kn + off, 0, 3);
                __builtin_prefetch(vn + off, 0, 3);
            }
        }
        for (int64_t c0 = 0; c0 < in_block; c0 += CHUNK) {
            const int n = (int)(in_block - c0 < CHUNK ? in_block - c0 : CHUNK);
            const int64_t slot = base + c0, pos = t0 + c0;
            score_chunk(qv, GR, nv, kh + slot * D, n, D, sc);
            for (int r = 0; r < R; r++) {          /* a row's positions past its own length: not its context */
                const int64_t valid = lens[r] - pos;
                if (valid >= n) continue;
                for (int g = 0; g < G; g++) {
                    float *sr = sc + (r * G + g) * CHUNK;
                    for (int j = valid > 0 ? (int)valid : 0; j < n; j++) sr[j] = -INFINITY;
                    /* alone, this chunk would end at valid: its keys past the last whole four scored one by one */
                    for (int j = valid > 0 ? (int)(valid & ~(int64_t)3) : 0; j < valid; j++)
                        sr[j] = score_one(qv + (r * G + g) * nv, nv, kh + (slot + j) * D);
                }
            }
            softmax_chunk(sc, GR, nv, m, l, acc);
            accumulate_chunk(acc, sc, GR, nv, vh + slot * D, n, D);
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < G; g++) {
            float *og = out + (r0 + r) * out_row_stride + (h * G + g) * out_head_stride;
            const int at = r * G + g;
            v8f inv = splat(1.0f / l[at]);
            for (int c = 0; c < nv; c++) store8(og + 8 * c, acc[at * nv + c] * inv);
        }
}

/* Task (sequence s, kv head h): one row, its own block table and length. */
static void decode_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                        const float *k, const float *v, const int64_t *block_tables, const int64_t *seq_lens,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                        int64_t max_blocks, int64_t block_size, float scale, float *out,
                        int64_t out_row_stride, int64_t out_head_stride, int64_t task) {
    const int64_t s = task / num_kv_heads;
    minillm_paged_decode_rows_task(q, q_row_stride, q_head_stride, rows[s], 1, k, v, block_tables + s * max_blocks,
                                   seq_lens + s, num_heads, num_kv_heads, head_dim, num_slots, block_size, scale, out,
                                   out_row_stride, out_head_stride, task % num_kv_heads);
}

/* One (sequence, kv head) task of minillm_paged_decode below, for callers that spread the tasks over threads
   themselves (the fused decode step, decode_step.c). */
void minillm_paged_decode_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                               const float *k, const float *v, const int64_t *block_tables, const int64_t *seq_lens,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t max_blocks, int64_t block_size, float scale, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int64_t task) {
    decode_task(q, q_row_stride, q_head_stride, rows, k, v, block_tables, seq_lens, num_heads, num_kv_heads,
                head_dim, num_slots, max_blocks, block_size, scale, out, out_row_stride, out_head_stride, task);
}

/* The most rows minillm_paged_decode_rows_task takes at once for this shape (0: the shape is not supported). */
int minillm_paged_decode_rows_max(int64_t group, int64_t head_dim) {
    if (group < 1 || head_dim % 8) return 0;
    const int64_t by_heads = MAX_GROUP / group, by_vecs = MAX_VECS / (group * (head_dim / 8));
    return (int)(by_heads < by_vecs ? by_heads : by_vecs);
}

/* The shapes this kernel takes; the Python wrapper asks before calling and uses the numba kernel otherwise. */
int minillm_paged_decode_supports(int64_t group, int64_t head_dim) {
    return group >= 1 && group <= MAX_GROUP && head_dim % 8 == 0 && group * (head_dim / 8) <= MAX_VECS;
}

/* Rows that can be attended together (minillm_paged_decode_rows_task): runs of consecutive task rows s whose block
   table rows are equal and whose q rows follow one another (a verification's k + 1 tokens, a prefill chunk's tokens
   as rows), cut into pieces of at most rows_max; with too few pieces to keep the team busy (one run: KV tasks), a
   run is cut in two at least, so 3 kv heads x 2 pieces spread over 2 threads where 3 tasks would leave one idle
   half the time. Piece p is task rows first[p] .. first[p] + count[p]. Returns the number of pieces (at most S). */
int64_t minillm_paged_decode_pieces(int64_t S, const int64_t *rows, const int64_t *block_tables, int64_t max_blocks,
                                    int rows_max, int64_t num_kv_heads, int num_threads, int64_t *first, int *count) {
    const size_t row_bytes = sizeof(int64_t) * (size_t)max_blocks;
#define JOINS(s) (rows[s] == rows[(s) - 1] + 1 && \
                  !memcmp(block_tables + (s) * max_blocks, block_tables + ((s) - 1) * max_blocks, row_bytes))
    int64_t runs = 0;
    for (int64_t s = 0; s < S; s++) runs += !s || !JOINS(s);
    const int64_t at_least = runs * num_kv_heads < 2 * num_threads ? 2 : 1, cap = rows_max < 1 ? 1 : rows_max;
    int64_t n = 0;
    for (int64_t s = 0; s < S;) {
        int64_t end = s + 1;
        while (end < S && JOINS(end)) end++;
        int64_t parts = (end - s + cap - 1) / cap;
        if (parts < at_least && end - s >= at_least) parts = at_least;
        for (int64_t i = 0; i < parts; i++) {          /* split evenly: 9 rows in two as 5 + 4 */
            const int64_t take = (end - s + (parts - i) - 1) / (parts - i);
            first[n] = s;
            count[n++] = (int)take;
            s += take;
        }
    }
#undef JOINS
    return n;
}

/* All (piece, kv head) tasks (minillm_paged_decode_pieces: a decode batch's rows are pieces of one; a prefill chunk
   sent as rows, pieces of up to rows_max of its tokens, each chunk of keys read once for all of them), spread over
   an OpenMP team. Loaded into a process that has imported torch, this library's libgomp.so.1 is torch's own, so
   the team is torch's intra-op pool (its threads still spinning from the previous op): no second pool fights it.
   The caller passes torch.get_num_threads() as num_threads. */
void minillm_paged_decode(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                          int64_t num_seqs, const float *k, const float *v, const int64_t *block_tables,
                          const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale, float *out,
                          int64_t out_row_stride, int64_t out_head_stride, int num_threads) {
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(num_seqs ? num_seqs : 1));
    int *count = malloc(sizeof(int) * (size_t)(num_seqs ? num_seqs : 1));
    const int planned = first && count;      /* no memory for the plan: pieces of one row */
    const int64_t pieces = planned ? minillm_paged_decode_pieces(
        num_seqs, rows, block_tables, max_blocks, minillm_paged_decode_rows_max(num_heads / num_kv_heads, head_dim),
        num_kv_heads, num_threads, first, count) : num_seqs;
    /* dynamic: task costs follow sequence lengths, which vary several-fold within a step */
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < pieces * num_kv_heads; t++) {
        const int64_t p = t / num_kv_heads, s = planned ? first[p] : p;
        minillm_paged_decode_rows_task(q, q_row_stride, q_head_stride, rows[s], planned ? count[p] : 1, k, v,
                                       block_tables + s * max_blocks, seq_lens + s, num_heads, num_kv_heads, head_dim,
                                       num_slots, block_size, scale, out, out_row_stride, out_head_stride,
                                       t % num_kv_heads);
    }
    free(first);
    free(count);
}

/* ---------------------------------------------------------------------------------------------------------------
   The same decode over an int8 pool (kv/int8.py): K and V rows are int8 [KVH, num_slots, D], and every row has a
   float16 scale in k_scale / v_scale [KVH, num_slots] (IEEE half, passed as raw bits). A row reads as q * scale, so
   the scale factors out of each dot product: score_j = scale_k[j] * (q . k_j), and V's weight becomes
   p_j * scale_v[j]. The float kernel above is left as it is (its callers depend on its speed and signature). */

/* 8 int8 values as 8 floats. gcc 12 lowers __builtin_convertvector from an 8-byte vector one byte at a time
   (~6x slower than the float kernel), so on AVX2 this is the two instructions it should be (vpmovsxbd from memory,
   vcvtdq2ps); the generic form stays for other targets. */
#if defined(__AVX2__) && !defined(MINILLM_PAGED_DECODE_PORTABLE)
#include <immintrin.h>
static inline v8f load8_i8(const int8_t *p) {
    return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
typedef int8_t v8c __attribute__((vector_size(8)));
static inline v8f load8_i8(const int8_t *p) {
    int64_t bits;
    __builtin_memcpy(&bits, p, 8);
    return __builtin_convertvector(__builtin_convertvector((v8c)bits, v8i), v8f);
}
#endif

/* IEEE half bits -> float, for the per-row scales (normal, subnormal, zero; scales are never inf or NaN). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } bits;
    if (exp == 0) {                                      /* zero or subnormal: mant * 2^-24 */
        float x = (float)mant * 5.9604644775390625e-8f;
        return sign ? -x : x;
    }
    bits.u = sign | ((exp + 112u) << 23) | (mant << 13);  /* rebias 15 -> 127; exp 31 (inf/NaN) is not expected */
    return bits.f;
}

static void score_chunk_i8(const v8f *qv, int G, int nv, const int8_t *krows, const uint16_t *kscale, int n, int D,
                           float *s) {
    float ks[CHUNK];
    for (int j = 0; j < n; j++) ks[j] = half_to_float(kscale[j]);
    for (int g = 0; g < G; g++) {
        const v8f *qg = qv + g * nv;
        float *sg = s + g * CHUNK;
        int j = 0;
        for (; j + 4 <= n; j += 4) {
            const int8_t *k0 = krows + (int64_t)j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
            v8f a0 = splat(0.0f), a1 = splat(0.0f), a2 = splat(0.0f), a3 = splat(0.0f);
            for (int c = 0; c < nv; c++) {
                v8f qc = qg[c];
                a0 += qc * load8_i8(k0 + 8 * c); a1 += qc * load8_i8(k1 + 8 * c);
                a2 += qc * load8_i8(k2 + 8 * c); a3 += qc * load8_i8(k3 + 8 * c);
            }
            v8f r = hsum4(a0, a1, a2, a3);
            sg[j] = r[0] * ks[j];         sg[j + 1] = r[1] * ks[j + 1];
            sg[j + 2] = r[2] * ks[j + 2]; sg[j + 3] = r[3] * ks[j + 3];
        }
        for (; j < n; j++) {
            const int8_t *kr = krows + (int64_t)j * D;
            v8f a0 = splat(0.0f);
            for (int c = 0; c < nv; c++) a0 += qg[c] * load8_i8(kr + 8 * c);
            sg[j] = hsum(a0) * ks[j];
        }
        for (; j < CHUNK; j++) sg[j] = -INFINITY;
    }
}

static void accumulate_chunk_i8(v8f *acc, const float *p, int G, int nv, const int8_t *vrows, const uint16_t *vscale,
                                int n, int D) {
    float vs[CHUNK];
    for (int j = 0; j < n; j++) vs[j] = half_to_float(vscale[j]);
    for (int g = 0; g < G; g++) {
        v8f *ag = acc + g * nv;
        const float *pg = p + g * CHUNK;
        int c = 0;
        for (; c + 8 <= nv; c += 8) {
            v8f r0 = ag[c], r1 = ag[c + 1], r2 = ag[c + 2], r3 = ag[c + 3];
            v8f r4 = ag[c + 4], r5 = ag[c + 5], r6 = ag[c + 6], r7 = ag[c + 7];
            for (int j = 0; j < n; j++) {
                const int8_t *vr = vrows + (int64_t)j * D + 8 * c;
                v8f w = splat(pg[j] * vs[j]);
                r0 += w * load8_i8(vr);      r1 += w * load8_i8(vr + 8);
                r2 += w * load8_i8(vr + 16); r3 += w * load8_i8(vr + 24);
                r4 += w * load8_i8(vr + 32); r5 += w * load8_i8(vr + 40);
                r6 += w * load8_i8(vr + 48); r7 += w * load8_i8(vr + 56);
            }
            ag[c] = r0; ag[c + 1] = r1; ag[c + 2] = r2; ag[c + 3] = r3;
            ag[c + 4] = r4; ag[c + 5] = r5; ag[c + 6] = r6; ag[c + 7] = r7;
        }
        for (; c < nv; c++) {
            v8f r0 = ag[c];
            for (int j = 0; j < n; j++) r0 += splat(pg[j] * vs[j]) * load8_i8(vrows + (int64_t)j * D + 8 * c);
            ag[c] = r0;
        }
    }
}

static void decode_task_i8(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                           const int8_t *k, const int8_t *v, const uint16_t *k_scale, const uint16_t *v_scale,
                           const int64_t *block_tables, const int64_t *seq_lens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, int64_t max_blocks,
                           int64_t block_size, float scale, float *out, int64_t out_row_stride,
                           int64_t out_head_stride, int64_t task) {
    const int G = (int)(num_heads / num_kv_heads), D = (int)head_dim, nv = D / 8;
    const int64_t s = task / num_kv_heads, h = task % num_kv_heads, r = rows[s], length = seq_lens[s];
    v8f qv[MAX_VECS], acc[MAX_VECS];
    float m[MAX_GROUP], l[MAX_GROUP], sc[MAX_GROUP * CHUNK];
    for (int g = 0; g < G; g++) {
        const float *qg = q + r * q_row_stride + (h * G + g) * q_head_stride;
        for (int c = 0; c < nv; c++) {
            qv[g * nv + c] = load8(qg + 8 * c) * splat(scale);
            acc[g * nv + c] = splat(0.0f);
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int8_t *kh = k + h * num_slots * D, *vh = v + h * num_slots * D;
    const uint16_t *ksh = k_scale + h * num_slots, *vsh = v_scale + h * num_slots;
    const int64_t *table = block_tables + s * max_blocks;
    for (int64_t t0 = 0; t0 < length; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size;
        const int64_t in_block = length - t0 < block_size ? length - t0 : block_size;
        if (t0 + block_size < length) {  /* blocks are scattered: start the next one's loads early */
            const int64_t next = table[t0 / block_size + 1] * block_size;
            const int64_t rows_next = length - t0 - block_size < block_size ? length - t0 - block_size : block_size;
            const char *kn = (const char *)(kh + next * D), *vn = (const char *)(vh + next * D);
            for (int64_t off = 0; off < rows_next * D; off += 64) {
                __builtin_prefetch(kn + off, 0, 3);
                __builtin_prefetch(vn + off, 0, 3);
            }
        }
        for (int64_t c0 = 0; c0 < in_block; c0 += CHUNK) {
            const int n = (int)(in_block - c0 < CHUNK ? in_block - c0 : CHUNK);
            const int64_t slot = base + c0;
            score_chunk_i8(qv, G, nv, kh + slot * D, ksh + slot, n, D, sc);
            softmax_chunk(sc, G, nv, m, l, acc);
            accumulate_chunk_i8(acc, sc, G, nv, vh + slot * D, vsh + slot, n, D);
        }
    }
    for (int g = 0; g < G; g++) {
        float *og = out + r * out_row_stride + (h * G + g) * out_head_stride;
        v8f inv = splat(1.0f / l[g]);
        for (int c = 0; c < nv; c++) store8(og + 8 * c, acc[g * nv + c] * inv);
    }
}

/* minillm_paged_decode over an int8 pool: the same arguments, with k and v int8 and their scales after them. The
   shapes it takes are minillm_paged_decode_supports'. */
void minillm_paged_decode_int8(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                               int64_t num_seqs, const int8_t *k, const int8_t *v, const uint16_t *k_scale,
                               const uint16_t *v_scale, const int64_t *block_tables, const int64_t *seq_lens,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t max_blocks, int64_t block_size, float scale, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int num_threads) {
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_seqs * num_kv_heads; t++)
        decode_task_i8(q, q_row_stride, q_head_stride, rows, k, v, k_scale, v_scale, block_tables, seq_lens,
                       num_heads, num_kv_heads, head_dim, num_slots, max_blocks, block_size, scale, out,
                       out_row_stride, out_head_stride, t);
}
