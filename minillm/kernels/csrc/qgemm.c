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

   Work is split over output rows with an OpenMP team (torch's own pool, see cpu_native.py); each thread
   runs every activation row against its weight rows, four activation rows per pass over a weight row so one
   expansion of the nibbles serves four dot products. Without AVX2 (or with MINILLM_QGEMM_SCALAR defined) a
   plain C loop computes the same sums. */
#include <math.h>
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

/* x row -> int8 codes, scale per block, and scale * sum of codes per block. Round half to even, like
   torch.round, so minillm.quant.formats.quantize_activations gives the same codes. */
static void quantize_row(const float *x, int64_t K, int16_t *q, float *d, float *s) {
    for (int64_t b = 0; b < K / QB; b++) {
        const float *xb = x + b * QB;
        float amax = 0.0f;
        for (int i = 0; i < QB; i++) amax = fmaxf(amax, fabsf(xb[i]));
        float db = amax / 32767.0f, inv = db > 0.0f ? 1.0f / db : 0.0f;
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
}

#if QG_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The dot product of a block: 32 16-bit weights (two registers, elements 0..15 and 16..31) with 32 16-bit
   activations, as 8 float partial sums. */
static inline __m256 dot_block(__m256i w0, __m256i w1, const int16_t *a) {
    __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)a)),
                                 _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(a + 16))));
    return _mm256_cvtepi32_ps(p);
}
#endif

/* One weight row against R (1..4) activation rows. Groups outside, blocks inside: a group's scale is converted
   once and no block index is divided by the group length. The minimum's term needs no work per block: it is
   sum_g min_g * (sum of the activations in group g), and those group sums (`gs`, per activation row) are computed
   once per call for all weight rows. Two accumulators per row (even and odd blocks) halve the FMA chain. */
static void row_q4(const uint8_t *w, const uint16_t *sc, const uint16_t *mn, int64_t K, int64_t G,
                   const int16_t *aq, const float *ad, const float *gs, int64_t R, float *out) {
    const int64_t nb = K / QB, per_group = G / QB, ng = K / G;
#if QG_AVX2
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi16(0x0F);
    if (R == 1) {   /* batch 1, the decode case: accumulators in registers, no loop over rows */
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            const __m256 dw = _mm256_set1_ps(half_to_float(sc[g]));
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
                const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + b * (QB / 2))));
                const __m256 p = _mm256_mul_ps(dot_block(_mm256_and_si256(v, low), _mm256_srli_epi16(v, 4),
                                                         aq + b * QB), _mm256_broadcast_ss(ad + b));
                if (b & 1) a1 = _mm256_fmadd_ps(p, dw, a1); else a0 = _mm256_fmadd_ps(p, dw, a0);
            }
        }
        acc[0][0] = a0;
        acc[0][1] = a1;
    } else
    for (int64_t g = 0; g < ng; g++) {
        const __m256 dw = _mm256_set1_ps(half_to_float(sc[g]));
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            /* bytes zero-extended to 16 bits: the low nibble is element i, the high nibble element i + 16 */
            const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + b * (QB / 2))));
            const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_srli_epi16(v, 4);
            for (int64_t r = 0; r < R; r++) {
                const __m256 p = _mm256_mul_ps(dot_block(w0, w1, aq + r * K + b * QB),
                                               _mm256_broadcast_ss(ad + r * nb + b));
                acc[r][b & 1] = _mm256_fmadd_ps(p, dw, acc[r][b & 1]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float *gr = gs + r * ng;
        __m256 m = _mm256_setzero_ps();
        int64_t g = 0;
        for (; g + 8 <= ng; g += 8)
            m = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + g))), _mm256_loadu_ps(gr + g), m);
        float tail = 0.0f;
        for (; g < ng; g++) tail += half_to_float(mn[g]) * gr[g];
        out[r] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), m)) + tail;
    }
#else
    for (int64_t r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < ng; g++) {
            const float dw = half_to_float(sc[g]);
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
                const uint8_t *wb = w + b * (QB / 2);
                const int16_t *a = aq + r * K + b * QB;
                int32_t dot = 0;
                for (int i = 0; i < QB / 2; i++) dot += (wb[i] & 0x0F) * a[i] + (wb[i] >> 4) * a[i + QB / 2];
                total += dw * ad[r * nb + b] * (float)dot;
            }
            total += half_to_float(mn[g]) * gs[r * ng + g];
        }
        out[r] = total;
    }
#endif
}

static void row_q8(const int8_t *w, const uint16_t *sc, int64_t K, int64_t G, const int16_t *aq, const float *ad,
                   int64_t R, float *out) {
    const int64_t nb = K / QB, per_group = G / QB, ng = K / G;
#if QG_AVX2
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    if (R == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int64_t g = 0; g < ng; g++) {
            const __m256 dw = _mm256_set1_ps(half_to_float(sc[g]));
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
                const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QB)));
                const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QB + 16)));
                const __m256 p = _mm256_mul_ps(dot_block(w0, w1, aq + b * QB), _mm256_broadcast_ss(ad + b));
                if (b & 1) a1 = _mm256_fmadd_ps(p, dw, a1); else a0 = _mm256_fmadd_ps(p, dw, a0);
            }
        }
        acc[0][0] = a0;
        acc[0][1] = a1;
    } else
    for (int64_t g = 0; g < ng; g++) {
        const __m256 dw = _mm256_set1_ps(half_to_float(sc[g]));
        for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
            const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QB)));
            const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + b * QB + 16)));
            for (int64_t r = 0; r < R; r++) {
                const __m256 p = _mm256_mul_ps(dot_block(w0, w1, aq + r * K + b * QB),
                                               _mm256_broadcast_ss(ad + r * nb + b));
                acc[r][b & 1] = _mm256_fmadd_ps(p, dw, acc[r][b & 1]);
            }
        }
    }
    for (int64_t r = 0; r < R; r++) out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
    for (int64_t r = 0; r < R; r++) {
        float total = 0.0f;
        for (int64_t g = 0; g < ng; g++) {
            const float dw = half_to_float(sc[g]);
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) {
                const int8_t *wb = w + b * QB;
                const int16_t *a = aq + r * K + b * QB;
                int32_t dot = 0;
                for (int i = 0; i < QB; i++) dot += wb[i] * a[i];
                total += dw * ad[r * nb + b] * (float)dot;
            }
        }
        out[r] = total;
    }
#endif
}

int minillm_qgemm_simd(void) { return QG_AVX2; }

/* kind 0 = int8 (w: int8 [N, K]), 1 = int4 (w: uint8 [N, K/2], mins used). x rows are `x_stride` floats
   apart, y rows `y_stride`. K and G are multiples of 32 (checked in Python). Returns 0, or -1 when the
   scratch for the quantized activations cannot be allocated. */
int minillm_qgemm(int kind, const float *x, int64_t M, int64_t K, int64_t x_stride, const void *w,
                  const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t G, float *y, int64_t y_stride,
                  int nthreads) {
    const int64_t nb = K / QB, ng = K / G, per_group = G / QB;
    int16_t *aq = malloc(sizeof(int16_t) * (size_t)(M * K));
    float *ad = malloc(sizeof(float) * (size_t)(M * nb)), *as = malloc(sizeof(float) * (size_t)(M * nb));
    float *gs = malloc(sizeof(float) * (size_t)(M * ng));
    if (!aq || !ad || !as || !gs) {
        free(aq); free(ad); free(as); free(gs);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        quantize_row(x + m * x_stride, K, aq + m * K, ad + m * nb, as + m * nb);
        for (int64_t g = 0; g < ng; g++) {   /* what int4's minimums multiply: the group's activation sum */
            float t = 0.0f;
            for (int64_t b = g * per_group; b < (g + 1) * per_group; b++) t += as[m * nb + b];
            gs[m * ng + g] = t;
        }
    }

#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float out[4];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t R = M - m0 < 4 ? M - m0 : 4;
            if (kind == 1)
                row_q4((const uint8_t *)w + n * (K / 2), scales + n * ng, mins + n * ng, K, G, aq + m0 * K,
                       ad + m0 * nb, gs + m0 * ng, R, out);
            else
                row_q8((const int8_t *)w + n * K, scales + n * ng, K, G, aq + m0 * K, ad + m0 * nb, R, out);
            for (int64_t r = 0; r < R; r++) y[(m0 + r) * y_stride + n] = out[r];
        }
    }
    free(aq); free(ad); free(as); free(gs);
    return 0;
}

/* The float matrix back (for many activation rows, where a float GEMM beats the integer dot products): w[N, K]
   float32 = scale * q (+ minimum), row-major. Plain loops; the compiler vectorizes them. */
void minillm_dequant(int kind, const void *w, const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t K,
                     int64_t G, float *out, int nthreads) {
    const int64_t ng = K / G;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t n = 0; n < N; n++) {
        float *o = out + n * K;
        for (int64_t g = 0; g < ng; g++) {
            const float d = half_to_float(scales[n * ng + g]);
            if (kind == 1) {
                const float m = half_to_float(mins[n * ng + g]);
                const uint8_t *q = (const uint8_t *)w + n * (K / 2) + g * (G / 2);
                for (int64_t b = 0; b < G / QB; b++) {
                    const uint8_t *qb = q + b * (QB / 2);
                    float *ob = o + g * G + b * QB;
                    for (int i = 0; i < QB / 2; i++) {
                        ob[i] = d * (float)(qb[i] & 0x0F) + m;
                        ob[i + QB / 2] = d * (float)(qb[i] >> 4) + m;
                    }
                }
            } else {
                const int8_t *q = (const int8_t *)w + n * K + g * G;
                for (int64_t i = 0; i < G; i++) o[g * G + i] = d * (float)q[i];
            }
        }
    }
}
