/* Quantized linear layers on the CPU: y[M, N] = x[M, K] W[N, K]^T with W in int8 or int4 (formats in
   minillm/quant/formats.py).

   At small batch a linear layer is bound by the bytes of W it streams, so W stays packed and is expanded only
   in registers. The activations are quantized first, per row and per block of 32, to int16 with a float scale
   (dynamic quantization): then a block's dot product is 32 integer multiply-adds (AVX2 vpmaddwd on 16-bit
   lanes), scaled once per block in float:

     int8:  sum_k w x = sum_blocks  dw * dx * sum_i qw_i qx_i
     int4:  sum_k w x = sum_blocks (dw * dx * sum_i qw_i qx_i + mw * dx * sum_i qx_i)

   Why 16-bit activations, when llama.cpp uses 8 (its Q8 blocks, with vpmaddubsw)? SmolLM2's hidden states have
   a few channels hundreds of times larger than the rest; an int8 step sized for such an outlier rounds the other
   31 values of its block to almost nothing, and the logits moved by ~1 (greedy answers changed on the first
   token). With int16 the step is 256x finer and the logits stay within ~1e-2 of the float matmul, for about
   1.5x the instructions of the byte version -- still far below what streaming the weights costs at batch 1.
   The pair sums fit int32 with room to spare (2 * 127 * 32767).

   Work is split over output rows with an OpenMP team (torch's own pool, see cpu_native.py). One activation row
   runs against the thread's share of the weight rows four weight rows at a time (so a block of activations is
   loaded once for four dot products, and four FMA chains are in flight); two or more rows share each widened
   weight block instead (row_many), with the same sums in the same order. Without AVX2 (or with
   MINILLM_QGEMM_SCALAR defined) a plain C loop computes the same sums.

   What made it fast (SmolLM2's 576-wide layers, 1 thread, Zen 3; 53M int4 weights: 10 ms -> 2.6 ms): no integer
   division per block (the group index is counted, not divided), accumulators in named variables (an indexed
   array of them was kept in memory), and the per-row work -- factors, reductions, the minimum's term -- shared by
   four rows, since a row of a 576-wide matrix is only 18 blocks. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__) && !defined(MINILLM_QGEMM_SCALAR)
#include <immintrin.h>
#define QG_AVX2 1
#else
#define QG_AVX2 0
#endif

#define QB 32

static inline float half_to_float(uint16_t h) {
#if QG_AVX2
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (man << 13);
    } else {
        bits = sign | ((exp - 15 + 127) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* A block whose step is below this (its largest value under ~1e-34) gets codes 0: 1 / step would overflow to inf
   and the codes to garbage. formats.quantize_activations holds the same rule. */
#define FLT_MIN_STEP 3.0e-39f     /* 1 / 3e-39 = 3.3e38 < FLT_MAX */

/* x row -> int16 codes, scale per block, and scale * sum of codes per block. Round half to even, like
   torch.round, so minillm.quant.formats.quantize_activations gives the same codes. */
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d, float *s) {
#if QG_AVX2
    /* the same codes 8 lanes at a time (cvtps rounds half to even, as nearbyintf): a batched step quantizes every
       matmul input of every row, and the scalar loop took ~7 % of a 16-row decode step */
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i hi = _mm256_set1_epi32(32767), lo = _mm256_set1_epi32(-32767);
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        const float db = _mm_cvtss_f32(m4) / 32767.0f, inv = db > FLT_MIN_STEP ? 1.0f / db : 0.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        __m256i c[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            c[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi)), lo), hi);
            sum = _mm256_add_epi32(sum, c[i]);
        }
        _mm256_storeu_si256((__m256i *)(q + b * QB), _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8));
        _mm256_storeu_si256((__m256i *)(q + b * QB + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        d[b] = db;
        s[b] = db * (float)_mm_cvtsi128_si32(s4);
    }
#else
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 32767.0f, inv = db > FLT_MIN_STEP ? 1.0f / db : 0.0f;
        int sum = 0;
        for (int i = 0; i < QB; i++) {
            float v = nearbyintf(xb[i] * inv);
            v = v > 32767.0f ? 32767.0f : (v < -32767.0f ? -32767.0f : v);
            q[b * QB + i] = (int16_t)v;
            sum += (int)v;
        }
        d[b] = db;
        s[b] = db * (float)sum;
    }
#endif
}

#if QG_AVX2
/* The integer dot product of a block: 32 16-bit weights (two registers, elements 0..15 and 16..31) with 32 16-bit
   activations (x0, x1), as 8 int32 partial sums converted to float. */
static inline __m256 dot_block(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1)));
}

/* A block of 32 weights widened to 16 bits: int4 bytes zero-extended (the low nibble is element i, the high nibble
   element i + 16), int8 sign-extended. */
static inline void widen(int q4, const uint8_t *w, __m256i *w0, __m256i *w1) {
    if (q4) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)w));
        *w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
        *w1 = _mm256_srli_epi16(v, 4);
    } else {
        *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w));
        *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + 16)));
    }
}

static inline __m256i load16(const int16_t *a) { return _mm256_loadu_si256((const __m256i *)a); }

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {   /* lane j = sum of the 8 lanes of the j-th */
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d), abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

/* Blocks are scaled in chunks of this many: a chunk's factors (weight scale x activation scale, per block) are
   computed up front into a small stack array, so the inner loop reads one float per block. */
#define CHUNK_BLOCKS 128

/* fac[i] = (scale of block c0 + i's group in this weight row) * (activation scale of that block), i < n. */
static void factors(const uint16_t *sc, const float *ad, int64_t c0, int64_t n, int64_t per_group, float *fac) {
    int64_t i = 0;
#if QG_AVX2
    if (per_group == 1)   /* G = 32: eight blocks per instruction */
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(fac + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + c0 + i))),
                                                    _mm256_loadu_ps(ad + c0 + i)));
#endif
    for (int64_t g = (c0 + i) / per_group, in_g = (c0 + i) % per_group; i < n; i++) {   /* no division per block */
        fac[i] = half_to_float(sc[g]) * ad[c0 + i];
        if (++in_g == per_group) { in_g = 0; g++; }
    }
}

/* int4's minimum term of one weight row: sum_g min_g * (sum of the activations in group g). */
static float min_term(const uint16_t *mn, const float *gs, int64_t ng) {
    float t = 0.0f;
    int64_t g = 0;
#if QG_AVX2
    __m256 v = _mm256_setzero_ps();
    for (; g + 8 <= ng; g += 8)
        v = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))), _mm256_loadu_ps(gs + g), v);
    t = hsum8(v);
#endif
    for (; g < ng; g++) t += half_to_float(mn[g]) * gs[g];
    return t;
}

/* One weight row (int4 when `mn` is given, else int8) against one activation row (codes aq, block scales ad, group
   sums gs); groups of G. */
static float one_row(const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t K, int64_t G, const int16_t *aq,
                     const float *ad, const float *gs) {
    const int64_t nb = K / QB, per_group = G / QB;
    const int q4 = mn != NULL;
    const int64_t wstride = q4 ? QB / 2 : QB;    /* bytes per block */
    float fac[CHUNK_BLOCKS];
#if QG_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#else
    float total = 0.0f;
#endif
    for (int64_t c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int64_t n = nb - c0 < CHUNK_BLOCKS ? nb - c0 : CHUNK_BLOCKS;
        factors(sc, ad, c0, n, per_group, fac);
#if QG_AVX2
        const uint8_t *q = w + c0 * wstride;
        const int16_t *a = aq + c0 * QB;
        __m256i w0, w1;
        int64_t i = 0;
#define STEP(ACC, J) \
        widen(q4, q + (i + J) * wstride, &w0, &w1); \
        ACC = _mm256_fmadd_ps(dot_block(w0, w1, load16(a + (i + J) * QB), load16(a + (i + J) * QB + 16)), \
                              _mm256_broadcast_ss(fac + i + J), ACC);
        for (; i + 4 <= n; i += 4) { STEP(a0, 0) STEP(a1, 1) STEP(a2, 2) STEP(a3, 3) }
        for (; i < n; i++) { STEP(a0, 0) }
#undef STEP
#else
        for (int64_t i = 0; i < n; i++) {
            const int64_t b = c0 + i;
            const int16_t *a = aq + b * QB;
            int32_t dot = 0;
            if (q4) {
                const uint8_t *qb = w + b * wstride;
                for (int j = 0; j < QB / 2; j++) dot += (qb[j] & 0x0F) * a[j] + (qb[j] >> 4) * a[j + QB / 2];
            } else {
                const int8_t *qb = (const int8_t *)w + b * wstride;
                for (int j = 0; j < QB; j++) dot += qb[j] * a[j];
            }
            total += (float)dot * fac[i];
        }
#endif
    }
#if QG_AVX2
    float total = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    return q4 ? total + min_term(mn, gs, K / G) : total;
}

#if QG_AVX2
/* Four consecutive weight rows against one activation row: a row of a 576-wide matrix is only 18 blocks, so the
   per-row work (factors, reductions) is shared by four rows; each block of activations is loaded once for the four,
   and one accumulator per row keeps four FMA chains in flight. Writes out[0..3]. */
static void four_rows(const uint8_t *w, int64_t row_bytes, const uint16_t *sc, const uint16_t *mn, int64_t K,
                      int64_t G, const int16_t *aq, const float *ad, const float *gs, float *out) {
    const int64_t nb = K / QB, per_group = G / QB, ng = K / G;
    const int q4 = mn != NULL;
    const int64_t wstride = q4 ? QB / 2 : QB;
    float fac[4 * CHUNK_BLOCKS];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;   /* named, so they stay in registers */
    for (int64_t c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int64_t n = nb - c0 < CHUNK_BLOCKS ? nb - c0 : CHUNK_BLOCKS;
        for (int j = 0; j < 4; j++) factors(sc + j * ng, ad, c0, n, per_group, fac + j * CHUNK_BLOCKS);
        const uint8_t *q = w + c0 * wstride;
        for (int64_t i = 0; i < n; i++, q += wstride) {
            const __m256i x0 = load16(aq + (c0 + i) * QB), x1 = load16(aq + (c0 + i) * QB + 16);
            __m256i w0, w1;
#define ROW(ACC, J) \
            widen(q4, q + J * row_bytes, &w0, &w1); \
            ACC = _mm256_fmadd_ps(dot_block(w0, w1, x0, x1), _mm256_broadcast_ss(fac + J * CHUNK_BLOCKS + i), ACC);
            ROW(a0, 0) ROW(a1, 1) ROW(a2, 2) ROW(a3, 3)
#undef ROW
            /* the thread's next four rows, a cache line at a time, while these compute: int8 rows (2x the bytes per
               block of int4) ran at half the bandwidth without it (49152x576 LM head, 1 thread: 4.4 -> 2.1 ms) */
            if (((i * wstride) & 63) == 0)
                for (int j = 4; j < 8; j++) _mm_prefetch((const char *)(q + j * row_bytes), _MM_HINT_T0);
        }
    }
    __m128 sums = hsum4x8(a0, a1, a2, a3);
    if (q4) {
        float m[4];
        for (int j = 0; j < 4; j++) m[j] = min_term(mn + j * ng, gs, ng);
        sums = _mm_add_ps(sums, _mm_loadu_ps(m));
    }
    _mm_storeu_ps(out, sums);
}
#endif

#if QG_AVX2
/* One weight row against R activation rows (1 <= R <= MR): each block of weights is widened once for all R rows.
   Every (weight row, activation row) pair keeps one accumulator over the blocks in order and is reduced in
   hsum4x8's order, so each output equals what four_rows gives that activation row alone, bit for bit: a
   verification's rows, or a small batch, decode exactly as the rows would one at a time. One weight row, not four:
   four rows x R activation rows of accumulators spilled AVX2's 16 registers (the measurement in minillm_qgemm);
   here R accumulators, two widened halves and a product fit. R is a constant in each instance (row_many_r). */
#define MR 8
static inline __attribute__((always_inline)) void row_many(
        const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t K, int64_t G, const int R, const int16_t *aq,
        const float *ad, const float *gs, float *y, int64_t y_stride, int64_t prefetch_bytes) {
    const int64_t nb = K / QB, per_group = G / QB, ng = K / G;
    const int q4 = mn != NULL;
    const int64_t wstride = q4 ? QB / 2 : QB;
    float fac[MR * CHUNK_BLOCKS];
    __m256 acc[MR];
    for (int m = 0; m < R; m++) acc[m] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < nb; c0 += CHUNK_BLOCKS) {
        const int64_t n = nb - c0 < CHUNK_BLOCKS ? nb - c0 : CHUNK_BLOCKS;
        for (int m = 0; m < R; m++) factors(sc, ad + m * nb, c0, n, per_group, fac + m * CHUNK_BLOCKS);
        const uint8_t *q = w + c0 * wstride;
        for (int64_t i = 0; i < n; i++, q += wstride) {
            __m256i w0, w1;
            widen(q4, q, &w0, &w1);
            for (int m = 0; m < R; m++) {
                const int16_t *a = aq + m * K + (c0 + i) * QB;
                acc[m] = _mm256_fmadd_ps(dot_block(w0, w1, load16(a), load16(a + 16)),
                                         _mm256_broadcast_ss(fac + m * CHUNK_BLOCKS + i), acc[m]);
            }
            if (((i * wstride) & 63) == 0) _mm_prefetch((const char *)(q + prefetch_bytes), _MM_HINT_T0);
        }
    }
    for (int m = 0; m < R; m += 4) {
        const __m256 z = _mm256_setzero_ps();
        float s[4];
        _mm_storeu_ps(s, hsum4x8(acc[m], m + 1 < R ? acc[m + 1] : z, m + 2 < R ? acc[m + 2] : z,
                                 m + 3 < R ? acc[m + 3] : z));
        for (int j = 0; j < 4 && m + j < R; j++)
            y[(m + j) * y_stride] = q4 ? s[j] + min_term(mn, gs + (m + j) * ng, ng) : s[j];
    }
}

#define ROW_MANY(R) \
static void row_many_##R(const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t K, int64_t G, \
                         const int16_t *aq, const float *ad, const float *gs, float *y, int64_t y_stride, \
                         int64_t pf) { \
    row_many(w, sc, mn, K, G, R, aq, ad, gs, y, y_stride, pf); \
}
ROW_MANY(2) ROW_MANY(3) ROW_MANY(4) ROW_MANY(5) ROW_MANY(6) ROW_MANY(7) ROW_MANY(8)
#undef ROW_MANY

typedef void (*row_many_fn)(const uint8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t, const int16_t *,
                            const float *, const float *, float *, int64_t, int64_t);
static const row_many_fn ROW_MANY_FNS[MR + 1] = {NULL, NULL, row_many_2, row_many_3, row_many_4, row_many_5,
                                                row_many_6, row_many_7, row_many_8};
#endif

/* Many rows (3 and more: batched decode, a verification's k + 1 tokens, prefill chunks up to TILES_MAX_ROWS in
   cpu_qgemm.py): the same arithmetic -- the activations' int16 codes per block of 32, the weights' own int4 / int8
   codes, exact integer sums per block, the scales applied per block in float -- with each weight block widened once
   for every row of a pass. The weights stay in their own bytes, reordered into tiles (cpu_qgemm.pack_tiles): per
   24-column block and block of 32 inputs (16 input pairs), entry [j][v][i] is column 8v + i/2, input i%2 of pair j;
   int4 keeps pair j in the low nibble and pair j + 8 in the high one (8 x 3 x 16 bytes), int8 one pair per entry
   (16 x 3 x 16 bytes). A step of a few rows is bound by the weight bytes it streams (0.56 per int4 weight here,
   where a 13-bit copy streams 2), and the outputs differ from the row kernel's only by the order of float
   additions.

   A pass is up to TR rows x 24 columns of int32 sums in registers (3 vectors a row). Each 16 bytes of codes are
   widened in a register and multiplied into every row of the pass right away: widening a block into a buffer first
   and summing 4 rows at a time from it (int16_gemm.c's tile) spent more time widening, storing and reloading than
   multiplying at 5 rows, and a 5th row cost a second pass over the block. With AVX-512's 32 vector registers a pass
   holds 7 rows (21 sums, 3 weight vectors, a broadcast, the nibble mask; at 8 rows gcc spilled, and a pass of 8 ran
   no faster than two of 4: every matmul of SmolLM2, 2 threads, Zen 4, 8 rows 10.1 vs 9.9 ms, 16 rows 18.2 vs 16.6
   as 6 + 5 + 5); AVX2's 16 hold 4 with VNNI and 3 without (the product takes a register: at 4 rows gcc spilled,
   and a build for AVX2 without VNNI ran 0.90-0.98x the buffered version at 5-64 rows, 0.94-1.04x with 3). */
#define TN 24
/* Tiles ahead that a pass asks the cache for: a thread's tiles lie in one run, so a 24-column block's first tiles
   follow the block before's last. Without it a decode step's loads waited on memory and its multiply-adds on the
   loads (the two nearly added up: 1 row 3.1 ms, 5 rows 5.8); with 16 tiles (6 KB of int4, 12 KB of int8) the fused
   step at 1-9 rows of SmolLM2 took 0.87-0.95x the time (4 and 32: between the two). */
#define PF_TILES 16
#define Q4_TILE_BYTES (8 * 3 * 16)
#define Q8_TILE_BYTES (16 * 3 * 16)

#if QG_AVX2
#if defined(__AVX512VL__)
#define TR 7
#elif defined(__AVXVNNI__)
#define TR 4
#else
#define TR 3     /* vpmaddwd then vpaddd: the product needs a register of its own */
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* the multiply-add and the sum in one instruction; as asm because gcc 12, given the intrinsic, shuffled the
   accumulators between registers on every pass of the loop (18 moves and 2 spills per 30 multiply-adds at 5 rows):
   the LM head's int8 tiles at 5-9 rows ran 0.74-0.88x the time with it */
#define DPW(a, b, w) __asm__("vpdpwssd %2, %1, %0" : "+v"(a) : "v"(b), "v"(w))
#elif defined(__AVXVNNI__)
#define DPW(a, b, w) a = _mm256_dpwssd_avx_epi32(a, b, w)
#else
#define DPW(a, b, w) a = _mm256_add_epi32(a, _mm256_madd_epi16(b, w))
#endif

/* Rows [0, R) of a pass (aq, ad, as and y at its first row) against one 24-column block's tiles wt (nb blocks of 32
   inputs), its scales d and int4's minimums mn (TN per group): y[r][0..24) = sum over blocks of (the block's integer
   sums) * weight scale * activation scale (+ int4's minimum * the block's scaled code sum). R and q4 are constants
   in each instance (tiles_pass_*): the loops over rows unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void tiles_pass(const int q4, const int R, const uint8_t *wt,
        const uint16_t *d, const uint16_t *mn, int64_t nb, int64_t per_group, const int16_t *aq, int64_t K,
        const float *ad, const float *as, float *y, int64_t ldy) {
    const int64_t bytes = q4 ? Q4_TILE_BYTES : Q8_TILE_BYTES, half = K / 2;
    const __m256i low = _mm256_set1_epi16(0x0F);
    for (int64_t b = 0, g = 0, in_g = 0; b < nb; b++) {
        const uint8_t *wb = wt + b * bytes;
        for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)(wb + PF_TILES * bytes + l), _MM_HINT_T0);
        const int32_t *x = (const int32_t *)(aq + QB * b);      /* row r's input pair j: x[r * half + j] */
        __m256i acc[TR][3];
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_si256();
        for (int j = 0; j < (q4 ? 8 : 16); j++) {
            __m256i w[3];
            for (int v = 0; v < 3; v++) {
                const __m256i t = q4 ? _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(wb + (3 * j + v) * 16)))
                                     : _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + (3 * j + v) * 16)));
                w[v] = q4 ? _mm256_and_si256(t, low) : t;
            }
            for (int r = 0; r < R; r++) {
                const __m256i bx = _mm256_set1_epi32(x[r * half + j]);
                DPW(acc[r][0], bx, w[0]); DPW(acc[r][1], bx, w[1]); DPW(acc[r][2], bx, w[2]);
            }
            if (q4) {                                           /* the high nibbles: pair j + 8 */
                for (int v = 0; v < 3; v++)
                    w[v] = _mm256_srli_epi16(_mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(wb + (3 * j + v) * 16))), 4);
                for (int r = 0; r < R; r++) {
                    const __m256i bx = _mm256_set1_epi32(x[r * half + j + 8]);
                    DPW(acc[r][0], bx, w[0]); DPW(acc[r][1], bx, w[1]); DPW(acc[r][2], bx, w[2]);
                }
            }
        }
        const int64_t at = g * TN;                              /* this block's group, in the column block */
        __m256 dv[3], mv[3];
        for (int v = 0; v < 3; v++) {
            dv[v] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + at + 8 * v)));
            mv[v] = q4 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + at + 8 * v))) : _mm256_setzero_ps();
        }
        for (int r = 0; r < R; r++) {
            const __m256 f = _mm256_set1_ps(ad[r * nb + b]), s = _mm256_set1_ps(as[r * nb + b]);
            float *o = y + r * ldy;
            for (int v = 0; v < 3; v++) {
                const __m256 prev = b ? _mm256_loadu_ps(o + 8 * v) : _mm256_setzero_ps();
                _mm256_storeu_ps(o + 8 * v, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][v]), _mm256_mul_ps(dv[v], f),
                                                             _mm256_fmadd_ps(mv[v], s, prev)));
            }
        }
        if (++in_g == per_group) { in_g = 0; g++; }             /* no division per block */
    }
}

typedef void (*tiles_pass_fn)(const uint8_t *, const uint16_t *, const uint16_t *, int64_t, int64_t,
                              const int16_t *, int64_t, const float *, const float *, float *, int64_t);
#define TILES_PASS(Q, R) \
__attribute__((noinline)) static void tiles_pass_##Q##_##R(const uint8_t *wt, const uint16_t *d, const uint16_t *mn, \
        int64_t nb, int64_t pg, const int16_t *aq, int64_t K, const float *ad, const float *as, float *y, \
        int64_t ldy) { tiles_pass(Q, R, wt, d, mn, nb, pg, aq, K, ad, as, y, ldy); }
TILES_PASS(0, 1) TILES_PASS(0, 2) TILES_PASS(0, 3)
TILES_PASS(1, 1) TILES_PASS(1, 2) TILES_PASS(1, 3)
#if TR == 7
TILES_PASS(0, 4) TILES_PASS(0, 5) TILES_PASS(0, 6) TILES_PASS(0, 7)
TILES_PASS(1, 4) TILES_PASS(1, 5) TILES_PASS(1, 6) TILES_PASS(1, 7)
static const tiles_pass_fn TILES_PASS_FNS[2][TR + 1] = {
    {NULL, tiles_pass_0_1, tiles_pass_0_2, tiles_pass_0_3, tiles_pass_0_4, tiles_pass_0_5, tiles_pass_0_6,
     tiles_pass_0_7},
    {NULL, tiles_pass_1_1, tiles_pass_1_2, tiles_pass_1_3, tiles_pass_1_4, tiles_pass_1_5, tiles_pass_1_6,
     tiles_pass_1_7}};
#elif TR == 4
TILES_PASS(0, 4) TILES_PASS(1, 4)
static const tiles_pass_fn TILES_PASS_FNS[2][TR + 1] = {
    {NULL, tiles_pass_0_1, tiles_pass_0_2, tiles_pass_0_3, tiles_pass_0_4},
    {NULL, tiles_pass_1_1, tiles_pass_1_2, tiles_pass_1_3, tiles_pass_1_4}};
#else
static const tiles_pass_fn TILES_PASS_FNS[2][TR + 1] = {
    {NULL, tiles_pass_0_1, tiles_pass_0_2, tiles_pass_0_3},
    {NULL, tiles_pass_1_1, tiles_pass_1_2, tiles_pass_1_3}};
#endif
#undef TILES_PASS
#endif

int minillm_qgemm_tiles_available(void) { return QG_AVX2; }

/* Rows [m0, m1) and 24-column blocks [nb0, nb1) of y (rows ldy apart) from the activations' codes aq [M, K], block
   scales ad and scaled block sums as [M, K/32] (minillm_qgemm_quantize's) and the tiles wt with fp16 scales d (and
   int4's minimums mn) per (24-column block, group, column). kind 0 = int8, 1 = int4. */
void minillm_qgemm_tiles_blocks(int kind, const int16_t *aq, const float *ad, const float *as, int64_t m0, int64_t m1,
                                int64_t K, int64_t G, const uint8_t *wt, const uint16_t *d, const uint16_t *mn,
                                int64_t nb0, int64_t nb1, float *y, int64_t ldy) {
#if QG_AVX2
    const int64_t nb = K / QB, ng = K / G, per_group = G / QB, bytes = kind == 1 ? Q4_TILE_BYTES : Q8_TILE_BYTES;
    /* rows split evenly over the fewest passes: 9 rows as 5 + 4, not 8 + 1 (a pass of one row still widens every
       block, and its few multiply-adds leave the widening exposed) */
    const int64_t passes = (m1 - m0 + TR - 1) / TR;
    for (int64_t cb = nb0; cb < nb1; cb++)
        for (int64_t p = 0, m = m0; p < passes; p++) {
            const int R = (int)((m1 - m + (passes - p) - 1) / (passes - p));
            TILES_PASS_FNS[kind == 1][R](wt + cb * nb * bytes, d + cb * ng * TN, kind == 1 ? mn + cb * ng * TN : NULL,
                                        nb, per_group, aq + m * K, K, ad + m * nb, as + m * nb, y + m * ldy + cb * TN,
                                        ldy);
            m += R;
        }
#else
    (void)kind; (void)aq; (void)ad; (void)as; (void)m0; (void)m1; (void)K; (void)G; (void)wt; (void)d; (void)mn;
    (void)nb0; (void)nb1; (void)y; (void)ldy;
#endif
}

/* 1 when x[0..K) is all finite: a NaN or inf would quantize to garbage codes (fmaxf skips NaN), so a caller hands
   such rows to the float product, which propagates them. */
int minillm_qgemm_finite(const float *x, int64_t K) {
    /* an all-ones exponent field is NaN or inf; an OR over the lanes vectorizes, where a float sum of x * 0 was one
       dependent add per value (~1 ns each: a tenth of a 5-row decode step's SiLU) */
    uint32_t bad = 0;
    for (int64_t k = 0; k < K; k++) {
        uint32_t bits;
        memcpy(&bits, x + k, sizeof bits);
        bad |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    return !bad;
}

int minillm_qgemm_simd(void) { return QG_AVX2; }

/* The activations' side of a product, for rows x[0..M) (rows x_stride floats apart): int16 codes aq [M, K], block
   scales ad [M, K/32], and per group of G the scaled code sums gs [M, K/G] (what int4's minimums multiply). `as`
   is scratch of ad's size. Serial: the fused decode step (decode_step.c) calls it on each thread's own buffers. */
void minillm_qgemm_quantize(const float *x, int64_t M, int64_t K, int64_t x_stride, int64_t G, int16_t *aq,
                            float *ad, float *as, float *gs) {
    const int64_t nb = K / QB, ng = K / G, per_group = G / QB;
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * x_stride, K, aq + m * K, ad + m * nb, as + m * nb);
        for (int64_t g = 0; g < ng; g++) {
            float t = 0.0f;
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) t += as[m * nb + b];
            gs[m * ng + g] = t;
        }
    }
}

/* Weight rows [n0, n1) of the product for every activation row, from quantized activations: y[m, n] for n in the
   range. n0 is a multiple of 4 (the AVX2 loop's step); rows past the last whole group of four run one at a time. */
void minillm_qgemm_rows(int kind, int64_t M, int64_t K, const void *w, const uint16_t *scales, const uint16_t *mins,
                        int64_t G, const int16_t *aq, const float *ad, const float *gs, int64_t n0, int64_t n1,
                        float *y, int64_t y_stride) {
    const int64_t nb = K / QB, ng = K / G, row_bytes = kind == 1 ? K / 2 : K;
    const uint8_t *wb = (const uint8_t *)w;
#if QG_AVX2
    /* Two or more activation rows: up to MR of them share each widened weight block (row_many); the rows past the
       last whole group of four weight rows still run one at a time below, as they do for a single row. */
    const int64_t whole = n0 + (n1 - n0) / 4 * 4;
    if (M >= 2 && whole > n0) {
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int64_t R = M - m0 < MR ? M - m0 : MR;
            const int64_t at = m0 * K, sat = m0 * nb, gat = m0 * ng;
            for (int64_t n = n0; n < whole; n += R == 1 ? 4 : 1) {
                float *out = y + m0 * y_stride + n;
                const uint8_t *wr = wb + n * row_bytes;
                const uint16_t *mr = kind == 1 ? mins + n * ng : NULL;
                if (R == 1)
                    four_rows(wr, row_bytes, scales + n * ng, mr, K, G, aq + at, ad + sat, gs + gat, out);
                else
                    ROW_MANY_FNS[R](wr, scales + n * ng, mr, K, G, aq + at, ad + sat, gs + gat, out, y_stride,
                                    4 * row_bytes);
            }
        }
        n0 = whole;
    }
#endif
    for (int64_t m = 0; m < M; m++) {
        const int16_t *a = aq + m * K;
        const float *d = ad + m * nb, *s = gs + m * ng;
        int64_t n = n0;
#if QG_AVX2
        for (; n + 4 <= n1; n += 4)
            four_rows(wb + n * row_bytes, row_bytes, scales + n * ng, kind == 1 ? mins + n * ng : NULL, K, G, a, d, s,
                      y + m * y_stride + n);
#endif
        for (; n < n1; n++)
            y[m * y_stride + n] = one_row(wb + n * row_bytes, scales + n * ng, kind == 1 ? mins + n * ng : NULL, K, G,
                                          a, d, s);
    }
}

/* kind 0 = int8 (w: int8 [N, K]), 1 = int4 (w: uint8 [N, K/2], mins used). x rows are `x_stride` floats
   apart, y rows `y_stride`. K and G are multiples of 32 (checked in Python). Returns 0, or -1 when the
   scratch for the quantized activations cannot be allocated. */
int minillm_qgemm(int kind, const float *x, int64_t M, int64_t K, int64_t x_stride, const void *w,
                  const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t G, float *y, int64_t y_stride,
                  int nthreads) {
    const int64_t nb = K / QB, ng = K / G;
    int16_t *aq = malloc(sizeof(int16_t) * (size_t)(M * K));
    float *ad = malloc(sizeof(float) * (size_t)(M * nb)), *as = malloc(sizeof(float) * (size_t)(M * nb));
    float *gs = malloc(sizeof(float) * (size_t)(M * ng));
    if (!aq || !ad || !as || !gs) {
        free(aq); free(ad); free(as); free(gs);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++)
        minillm_qgemm_quantize(x + m * x_stride, 1, K, x_stride, G, aq + m * K, ad + m * nb, as + m * nb, gs + m * ng);
    /* Each thread takes an equal share of whole groups of four weight rows (minillm_qgemm_rows). Measured on
       SmolLM2's shapes (2 threads, Zen 4, 2026-11-29): one widening per weight block for all rows took 2 rows from
       1.45x one row's time to 1.23-1.33x, 5 rows from 2.95x to 2.3x; a decode step of 2 sequences from 6.8 to
       5.4 ms. Since 2026-11-29 the layers run the tiles at every row count where they are built, and this
       kernel where they are not (cpu_qgemm.qlinear). */
    const int64_t quads = (N + 3) / 4;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num(), per = (quads + nt - 1) / nt;
        const int64_t n0 = t * per * 4 < N ? t * per * 4 : N, n1 = (t + 1) * per * 4 < N ? (t + 1) * per * 4 : N;
        minillm_qgemm_rows(kind, M, K, w, scales, mins, G, aq, ad, gs, n0, n1, y, y_stride);
    }
    free(aq); free(ad); free(as); free(gs);
    return 0;
}

/* y [M, N_pad] = x [M, K] times the tiles (minillm_qgemm_tiles_blocks; N_pad a multiple of 24). Returns 0; -1 when
   the activation scratch cannot be allocated; -2 when x holds NaN or inf (the caller's float product propagates
   them); -3 without AVX2. */
int minillm_qgemm_tiles(int kind, const float *x, int64_t M, int64_t K, int64_t x_stride, const uint8_t *wt,
                        const uint16_t *d, const uint16_t *mn, int64_t G, int64_t N_pad, float *y, int nthreads) {
    if (!QG_AVX2) return -3;
    const int64_t nb = K / QB;
    int16_t *aq = malloc(sizeof(int16_t) * (size_t)(M * K));
    float *ad = malloc(sizeof(float) * (size_t)(M * nb)), *as = malloc(sizeof(float) * (size_t)(M * nb));
    float *gs = malloc(sizeof(float) * (size_t)(M * nb));
    int rc = !aq || !ad || !as || !gs ? -1 : 0;
    for (int64_t m = 0; m < M && rc == 0; m++)
        if (!minillm_qgemm_finite(x + m * x_stride, K)) rc = -2;
    if (rc == 0) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
        for (int64_t m = 0; m < M; m++)
            minillm_qgemm_quantize(x + m * x_stride, 1, K, x_stride, QB, aq + m * K, ad + m * nb, as + m * nb,
                                   gs + m * nb);
        const int64_t nblocks = N_pad / TN;
#pragma omp parallel num_threads(nthreads)
        {
            const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
            minillm_qgemm_tiles_blocks(kind, aq, ad, as, 0, M, K, G, wt, d, mn, t * nblocks / nt,
                                       (t + 1) * nblocks / nt, y, N_pad);
        }
    }
    free(aq); free(ad); free(as); free(gs);
    return rc;
}

/* One row of a quantized matrix back to floats: w_row, scales_row, mins_row point at the row's codes and its groups'
   scale / minimum (mins_row NULL for int8). Also the embedding lookup of the fused decode step. `restrict`: without
   it gcc 12 versions the vectorized loops for every possible overlap of the byte codes with the output and took 90 s
   to compile this file (1 s with it). */
void minillm_dequant_row(int kind, const void *restrict w_row, const uint16_t *restrict scales_row,
                         const uint16_t *restrict mins_row, int64_t K, int64_t G, float *restrict o) {
    for (int64_t g = 0; g < K / G; g++) {
        const float d = half_to_float(scales_row[g]);
        if (kind == 1) {
            const float m = half_to_float(mins_row[g]);
            const uint8_t *q = (const uint8_t *)w_row + g * (G / 2);
            for (int64_t b = 0; b < G / QB; b++) {
                const uint8_t *qb = q + b * (QB / 2);
                float *ob = o + g * G + b * QB;
                for (int i = 0; i < QB / 2; i++) {
                    ob[i] = d * (float)(qb[i] & 0x0F) + m;
                    ob[i + QB / 2] = d * (float)(qb[i] >> 4) + m;
                }
            }
        } else {
            const int8_t *q = (const int8_t *)w_row + g * G;
            for (int64_t i = 0; i < G; i++) o[g * G + i] = d * (float)q[i];
        }
    }
}

/* The float matrix back (for many activation rows, where a float GEMM beats the integer dot products): w[N, K]
   float32 = scale * q (+ minimum), row-major. Plain loops; the compiler vectorizes them. */
void minillm_dequant(int kind, const void *w, const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t K,
                     int64_t G, float *out, int nthreads) {
    const int64_t ng = K / G, row_bytes = kind == 1 ? K / 2 : K;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++)
        minillm_dequant_row(kind, (const uint8_t *)w + n * row_bytes, scales + n * ng, kind == 1 ? mins + n * ng : NULL,
                            K, G, out + n * K);
}
