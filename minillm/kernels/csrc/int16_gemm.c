/* Batched quantized linear layers on the CPU (prefill, decode batches of 3+ rows): y[M, N] = x[M, K] W[N, K]^T
   in 16-bit integer arithmetic. Both operands are quantized per chunk of 64 inputs to 13-bit codes: W once (Python,
   cpu_int16.pack) to codes q with a scale per (output column, chunk), x on every call (here) to codes p with a
   scale per (row, chunk):

     y[m, n] = sum_chunks sx[m, c] * sw[c, n] * sum_{k in c} p[m, k] q[n, k]

   Why this shape. With more than a few rows a layer is compute-bound, and vpmaddwd (16 int16 products summed in
   pairs into 8 int32 lanes) does twice the products of a float32 FMA per instruction (a Zen 3 core issues it half
   as often: there the peaks are equal and the gain is running nearer it); on AVX2 EPYCs it ran 1.2-5x torch's
   float32 linear on SmolLM2's shapes (most at 16-64 rows, where MKL's float GEMM is least efficient). The bits
   are split by what SmolLM2 needs: its weights (int4 groups of 32 from the GGUF) re-rounded to 8 bits per output
   channel moved some layers' outputs by up to 6 % (a few large weights set the row's step), hence scales per 64
   inputs; activations (outlier channels up to ~2000x the median) lost 5e-5 at 16 bits per 256 inputs but 4e-4-1e-3
   at 12 bits per 64 while 14-bit weights lost 1e-4, so both get 13 bits (SmolLM2's logits within 0.064 of the
   float product's, greedy tokens equal: tests/test_quant.py). The products stay inside int32 for a whole chunk:
   64 * 4095 * 4095 = 1.07e9 < 2^31, and each chunk's int32 sums are scaled into the float output.

   The GEMM is a 4 x 24 register tile (4 activation rows, 24 output columns = 3 vectors of 8 int32): per pair of
   inputs, 3 weight loads, 4 broadcasts of an activation pair, 12 vpmaddwd + 12 vpaddd into 12 accumulators. The
   weights are packed as int16 [N/24][K/2][24][2], so a tile's weights for one pair of inputs are 96 contiguous
   bytes. Threads (OpenMP, torch's count) split (64-row block, 24-column block) tasks. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#define W16_AVX2 1
#else
#define W16_AVX2 0
#endif

#define CHUNK 64
#define PMAX 4095.0f     /* activation codes: 13 bits */
#define TN 24
#define TM 4

int minillm_int16_simd(void) { return W16_AVX2; }

#if W16_AVX2
/* A whole chunk (64 floats) in registers: 8 vectors for the maximum and the NaN/inf check, then scale, round to
   nearest even (cvtps's default mode, as nearbyintf and torch.round), pack to int16. Returns 1 on NaN or inf. */
static int quantize_chunk64(const float *x, int16_t *p, float *sx) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)), big = _mm256_set1_ps(FLT_MAX);
    __m256 v[8], mx = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 8; i++) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        const __m256 a = _mm256_and_ps(v[i], absmask);
        mx = _mm256_max_ps(mx, a);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));    /* true for NaN and for |x| > FLT_MAX */
    }
    if (_mm256_movemask_ps(bad)) return 1;
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const float s = _mm_cvtss_f32(m4) / PMAX, inv = s > 0.0f ? 1.0f / s : 0.0f;
    const __m256 vi = _mm256_set1_ps(inv);
    for (int i = 0; i < 8; i += 2) {
        const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vi)),
                      b = _mm256_cvtps_epi32(_mm256_mul_ps(v[i + 1], vi));
        _mm256_storeu_si256((__m256i *)(p + 8 * i), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
    *sx = s;
    return 0;
}
#endif

/* One row x -> int16 codes p (K of them) and one scale per chunk. Returns 0, or 1 when the row holds NaN or inf.
   minillm_int16_gemm quantizes every row with it; the fused decode step (decode_step.c) its own share of rows. */
int minillm_int16_quantize_row(const float *x, int64_t K, int16_t *p, float *sx) {
    for (int64_t c0 = 0, c = 0; c0 < K; c0 += CHUNK, c++) {
        const int64_t c1 = c0 + CHUNK < K ? c0 + CHUNK : K;
#if W16_AVX2
        if (c1 - c0 == 64) {
            if (quantize_chunk64(x + c0, p + c0, sx + c)) return 1;
            continue;
        }
#endif
        float amax = 0.0f;
        int bad = 0;
        for (int64_t k = c0; k < c1; k++) {
            const float a = fabsf(x[k]);
            bad |= !(a <= FLT_MAX);             /* NaN fails every comparison; fmaxf would skip it */
            amax = a > amax ? a : amax;
        }
        if (bad) return 1;
        const float s = amax / PMAX, inv = s > 0.0f ? 1.0f / s : 0.0f;
        for (int64_t k = c0; k < c1; k++) p[k] = (int16_t)nearbyintf(x[k] * inv);
        sx[c] = s;
    }
    return 0;
}

#if W16_AVX2
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* the multiply-add and the sum in one instruction; as asm because gcc 12, given the intrinsic, copied every
   accumulator to a second register and back on each pass of the loop (24 extra moves per 12 multiply-adds) */
#define DP(a, b, w) __asm__("vpdpwssd %2, %1, %0" : "+v"(a) : "v"(b), "v"(w))
#elif defined(__AVXVNNI__)
#define DP(a, b, w) a = _mm256_dpwssd_avx_epi32(a, b, w)
#else
#define DP(a, b, w) a = _mm256_add_epi32(a, _mm256_madd_epi16(b, w))
#endif
/* The three weight vectors are loaded once per input pair and used by four rows. Left to itself gcc folds each
   load into the multiply-adds that read it: 12 loads + 4 broadcasts a pair, more than the two 256-bit loads a cycle
   a Zen 4 core issues for its two multiply-adds a cycle (the kernel ran at 60 % of the instruction's peak). The
   empty asm makes them registers: 3 loads + 4 broadcasts a pair. */
#define IN_REGISTERS(a, b, c) __asm__("" : "+x"(a), "+x"(b), "+x"(c))
/* One input pair j of a 4 x 24 tile: rows x0..x3 (int32 views of int16 pairs), weights at w, into a0..a11. */
#define PAIR_4X24(j, w) {                                                                                          \
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w)), w1 = _mm256_loadu_si256((const __m256i *)((w) + 16)), \
                w2 = _mm256_loadu_si256((const __m256i *)((w) + 32));                                            \
        IN_REGISTERS(w0, w1, w2);                                                                                  \
        __m256i b;                                                                                                 \
        b = _mm256_set1_epi32(x0[j]); DP(a0, b, w0); DP(a1, b, w1); DP(a2, b, w2);                                 \
        b = _mm256_set1_epi32(x1[j]); DP(a3, b, w0); DP(a4, b, w1); DP(a5, b, w2);                                 \
        b = _mm256_set1_epi32(x2[j]); DP(a6, b, w0); DP(a7, b, w1); DP(a8, b, w2);                                 \
        b = _mm256_set1_epi32(x3[j]); DP(a9, b, w0); DP(a10, b, w1); DP(a11, b, w2);                               \
    }
#if defined(__AVX512VL__)
/* y[m0..m0+4, nb*24 .. +24] = sum over chunks of sx * sw * (the chunk's int32 sums), one 24-column block; sw
   points at the block's first column of chunk 0 (chunk c's scales are N floats further per chunk); y's rows are
   ldy floats apart. With AVX-512's 32 vector registers the 12 int32 sums and the 12 float outputs all stay in
   registers over the whole K loop: no store and reload of the sums per chunk (the AVX2 version below). The float
   arithmetic is the same, in the same order. */
static void tile(const int16_t *p, int64_t K, int64_t nchunks, const float *sx, const int16_t *wb, const float *sw,
                 int64_t N, float *y, int64_t ldy) {
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0, f8 = f0,
           f9 = f0, f10 = f0, f11 = f0;
    const int32_t *x0 = (const int32_t *)p, *x1 = (const int32_t *)(p + K), *x2 = (const int32_t *)(p + 2 * K),
                  *x3 = (const int32_t *)(p + 3 * K);
    const int16_t *w = wb;
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t j0 = c * CHUNK / 2, j1 = (c * CHUNK + CHUNK < K ? c * CHUNK + CHUNK : K) / 2;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
                a8 = a0, a9 = a0, a10 = a0, a11 = a0;
        for (int64_t j = j0; j < j1; j++, w += 2 * TN) PAIR_4X24(j, w)
        const float *s = sw + c * N;
        const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8), s2 = _mm256_loadu_ps(s + 16);
        __m256 g;
#define FL(fa, fb, fc, aa, ab, ac, r) g = _mm256_set1_ps(sx[(r) * nchunks + c]); \
        fa = _mm256_fmadd_ps(_mm256_cvtepi32_ps(aa), _mm256_mul_ps(s0, g), fa); \
        fb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ab), _mm256_mul_ps(s1, g), fb); \
        fc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ac), _mm256_mul_ps(s2, g), fc);
        FL(f0, f1, f2, a0, a1, a2, 0) FL(f3, f4, f5, a3, a4, a5, 1) FL(f6, f7, f8, a6, a7, a8, 2)
        FL(f9, f10, f11, a9, a10, a11, 3)
#undef FL
    }
#define SF(r, v, f) _mm256_storeu_ps(y + (r) * ldy + 8 * (v), f);
    SF(0, 0, f0) SF(0, 1, f1) SF(0, 2, f2) SF(1, 0, f3) SF(1, 1, f4) SF(1, 2, f5)
    SF(2, 0, f6) SF(2, 1, f7) SF(2, 2, f8) SF(3, 0, f9) SF(3, 1, f10) SF(3, 2, f11)
#undef SF
}
#else
/* One chunk of one tile: acc[r][0..24) = sum over the chunk's input pairs of p[r, k] q[col, k], as int32. noinline and
   results through memory: inlined into the chunk loop with the flush below, gcc spilled 8 of the 12 accumulators to
   the stack inside the hot loop (2.5x slower); alone it keeps all 12 in registers. */
__attribute__((noinline)) static void chunk(const int16_t *p, int64_t K, int64_t npairs, const int16_t *w,
                                            int32_t acc[TM][TN]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
    const int32_t *x0 = (const int32_t *)p, *x1 = (const int32_t *)(p + K), *x2 = (const int32_t *)(p + 2 * K),
                  *x3 = (const int32_t *)(p + 3 * K);
    for (int64_t j = 0; j < npairs; j++, w += 2 * TN) PAIR_4X24(j, w)
#define ST(r, v, a) _mm256_storeu_si256((__m256i *)(acc[r] + 8 * (v)), a);
    ST(0, 0, a0) ST(0, 1, a1) ST(0, 2, a2) ST(1, 0, a3) ST(1, 1, a4) ST(1, 2, a5)
    ST(2, 0, a6) ST(2, 1, a7) ST(2, 2, a8) ST(3, 0, a9) ST(3, 1, a10) ST(3, 2, a11)
}

/* y[m0..m0+4, nb*24 .. +24] = sum over chunks of sx * sw * (the chunk's int32 sums), one 24-column block; sw
   points at the block's first column of chunk 0 (chunk c's scales are N floats further per chunk); y's rows are
   ldy floats apart. */
static void tile(const int16_t *p, int64_t K, int64_t nchunks, const float *sx, const int16_t *wb, const float *sw,
                 int64_t N, float *y, int64_t ldy) {
    int32_t acc[TM][TN] __attribute__((aligned(32)));
    for (int64_t c = 0; c < nchunks; c++) {
        const int64_t k0 = c * CHUNK, k1 = k0 + CHUNK < K ? k0 + CHUNK : K;
        chunk(p + k0, K, (k1 - k0) / 2, wb + k0 * TN, acc);
        for (int r = 0; r < TM; r++) {
            const __m256 f = _mm256_set1_ps(sx[r * nchunks + c]);
            float *o = y + r * ldy;
            for (int v = 0; v < 3; v++) {
                const __m256 a = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(acc[r] + 8 * v)));
                const __m256 prev = c ? _mm256_loadu_ps(o + 8 * v) : _mm256_setzero_ps();
                const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(sw + c * N + 8 * v), f);
                _mm256_storeu_ps(o + 8 * v, _mm256_fmadd_ps(a, scale, prev));
            }
        }
    }
}

#endif
#endif

/* Output rows [m0, m1) (multiples of 4, rows past the real ones with codes and scales 0) and columns
   [nb0 * 24, nb1 * 24), from quantized activations p / sx, into y (rows ldy apart). Loops 64-row blocks outside
   the column blocks so a block's activations (64 x K int16) and a column block's weights (24 x K) stay in L2 while
   its 16 tiles run. minillm_int16_gemm gives each task one (64-row, 24-column) block; the fused decode step
   (decode_step.c) gives each thread all rows and a run of column blocks. */
void minillm_int16_gemm_blocks(const int16_t *p, int64_t m0, int64_t m1, int64_t K, const float *sx,
                               const int16_t *wp, const float *sw, int64_t N, int64_t nb0, int64_t nb1, float *y,
                               int64_t ldy) {
#if W16_AVX2
    const int64_t nchunks = (K + CHUNK - 1) / CHUNK;
    for (int64_t mb = m0; mb < m1; mb += 64)
        for (int64_t nb = nb0; nb < nb1; nb++)
            for (int64_t m = mb; m < m1 && m < mb + 64; m += TM)
                tile(p + m * K, K, nchunks, sx + m * nchunks, wp + nb * K * TN, sw + nb * TN, N,
                     y + m * ldy + nb * TN, ldy);
#else
    (void)p; (void)m0; (void)m1; (void)K; (void)sx; (void)wp; (void)sw; (void)N; (void)nb0; (void)nb1; (void)y;
    (void)ldy;
#endif
}

/* x [M, K] float32 (rows x_stride apart), wp the packed int16 weights of N output columns (N a multiple of 24),
   sw [ceil(K/64), N]; y [Mp, N] float32 with Mp = ceil(M/4)*4 (the rows past M are scratch). K even.
   p [Mp, K] int16 and sx [Mp, ceil(K/64)] float32 are the caller's scratch (kept between calls: a fresh buffer of
   this size is a fresh mmap whose page faults cost more than the quantization). Returns 0; -2 when x holds NaN or
   inf (the caller then takes the float path, which propagates them); -3 when built without AVX2. */
int minillm_int16_gemm(const float *x, int64_t M, int64_t K, int64_t x_stride, const int16_t *wp, const float *sw,
                       int64_t N, float *y, int16_t *p, float *sx, int nthreads) {
#if W16_AVX2
    const int64_t Mp = (M + TM - 1) / TM * TM, nchunks = (K + CHUNK - 1) / CHUNK;
    memset(p + M * K, 0, sizeof(int16_t) * (size_t)((Mp - M) * K));
    memset(sx + M * nchunks, 0, sizeof(float) * (size_t)((Mp - M) * nchunks));
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) reduction(| : bad) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) bad |= minillm_int16_quantize_row(x + m * x_stride, K, p + m * K, sx + m * nchunks);
    if (bad) return -2;
    /* Column blocks outside: the static split then hands each thread a run of column blocks over all the rows. With
       the row blocks outside, a last short row block went whole to one thread while the other had the full blocks:
       a 65-row product ran on one thread, and a 65-token prefill of SmolLM2 took 97 ms against 61 ms at 64 tokens
       (2026-11-29; now 63). A column block's weights stay in L2 while its row blocks run. */
    const int64_t nblocks = N / TN, nmb = (Mp + 63) / 64;
#pragma omp parallel for schedule(static) collapse(2) num_threads(nthreads)
    for (int64_t nb = 0; nb < nblocks; nb++)
        for (int64_t mb = 0; mb < nmb; mb++)
            minillm_int16_gemm_blocks(p, mb * 64, (mb + 1) * 64 < Mp ? (mb + 1) * 64 : Mp, K, sx, wp, sw, N, nb,
                                      nb + 1, y, N);
    return 0;
#else
    (void)x; (void)M; (void)K; (void)x_stride; (void)wp; (void)sw; (void)N; (void)y; (void)p; (void)sx; (void)nthreads;
    return -3;
#endif
}
