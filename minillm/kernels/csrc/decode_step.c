/* A whole decode step of a Llama decoder with quantized linear layers, in one call from Python.

   At batch 1 the layers' arithmetic is small (a 576-wide model streams ~3 MB of int4 weights per layer) and the
   Python around it is not: ~12 torch ops and ctypes calls per layer, each 5-40 us, cost more than the matmuls.
   This file runs the same sequence of operations the Python layers run (models/llama.py), per layer:

     h = rms_norm(x) * w_in;  qkv = h W_qkv^T;  rotate q and k (RoPE, rotate-half form);  write k, v to the pool;
     a = paged attention(q, pool);  x += a W_o^T;  h = rms_norm(x) * w_post;  [g, u] = h W_gu^T;
     x += (silu(g) * u) W_down^T

   and then the final norm. The matmuls are the same minillm_qgemm (qgemm.c) and the attention the same
   minillm_paged_decode (paged_decode.c) the layers call, so they give the same numbers; the norms, RoPE and SiLU are
   plain loops that differ from torch's only in float rounding (tests/test_decode_step.py states by how much).

   The Python side (kernels/cpu_decode.py) decides when this applies (decode-only steps of a few rows, every linear
   quantized, float32, one rank, the C attention kernel) and falls back to the layers otherwise. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int minillm_qgemm(int kind, const float *x, int64_t M, int64_t K, int64_t x_stride, const void *w,
                  const uint16_t *scales, const uint16_t *mins, int64_t N, int64_t G, float *y, int64_t y_stride,
                  int nthreads);
void minillm_paged_decode(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                          int64_t num_seqs, const float *k, const float *v, const int64_t *block_tables,
                          const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t max_blocks, int64_t block_size, float scale, float *out,
                          int64_t out_row_stride, int64_t out_head_stride, int num_threads);

/* A quantized [n, k] matrix as minillm.quant.formats.QuantizedWeight holds it (kind 0 int8, 1 int4). */
typedef struct {
    int64_t kind, group, n, k;
    const void *w;
    const uint16_t *scales, *mins;
} mll_qlinear;

typedef struct {
    const float *input_norm, *post_norm;   /* RMSNorm weights [hidden] */
    mll_qlinear qkv, o, gate_up, down;
} mll_layer;

typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;
} mll_dims;

static int matmul(const mll_qlinear *l, const float *x, int64_t M, float *y, int nthreads) {
    return minillm_qgemm((int)l->kind, x, M, l->k, l->k, l->w, l->scales, l->mins, l->n, l->group, y, l->n, nthreads);
}

static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* x = [x1, x2] (halves of head_dim) -> x * cos + [-x2, x1] * sin, cos/sin of the row's position. */
static void rotate(float *x, const float *cos, const float *sin, int64_t d) {
    const int64_t h = d / 2;
    for (int64_t i = 0; i < h; i++) {
        const float a = x[i], b = x[i + h];
        x[i] = a * cos[i] - b * sin[i];
        x[i + h] = b * cos[i + h] + a * sin[i + h];
    }
}

/* x: [M, hidden] residual stream in, final-normed hidden states out (in place). cos/sin: [M, head_dim].
   k_pool/v_pool: this step's layers' pools, [L][num_kv_heads][num_slots][head_dim]. Row m is sequence m: its new
   K/V go to slot_mapping[m], it attends over seq_lens[m] positions through block_tables[m]. Returns 0, or -1 when
   scratch memory cannot be allocated (x is then unspecified). */
int minillm_decode_step(float *x, int64_t M, const mll_layer *layers, int64_t L, const mll_dims *dims,
                        const float *final_norm, const float *cos, const float *sin, float *k_pool, float *v_pool,
                        int64_t num_slots, const int64_t *slot_mapping, const int64_t *block_tables,
                        int64_t max_blocks, const int64_t *seq_lens, int64_t block_size, int nthreads) {
    const int64_t E = dims->hidden, I = dims->intermediate, H = dims->num_heads, KV = dims->num_kv_heads,
                  D = dims->head_dim, NQKV = (H + 2 * KV) * D;
    const int64_t widest = NQKV > 2 * I ? NQKV : 2 * I;
    float *h = malloc(sizeof(float) * (size_t)(M * E));
    float *big = malloc(sizeof(float) * (size_t)(M * widest));      /* qkv, then gate|up */
    float *mid = malloc(sizeof(float) * (size_t)(M * (H * D > I ? H * D : I)));  /* attention out, then silu*up */
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)M);
    int rc = (h && big && mid && rows) ? 0 : -1;
    for (int64_t m = 0; m < M; m++) if (rows) rows[m] = m;
    const int64_t layer_floats = KV * num_slots * D;

    for (int64_t l = 0; l < L && rc == 0; l++) {
        const mll_layer *ly = layers + l;
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * E, ly->input_norm, E, dims->eps, h + m * E);
        if ((rc = matmul(&ly->qkv, h, M, big, nthreads)) != 0) break;
        float *kl = k_pool + l * layer_floats, *vl = v_pool + l * layer_floats;
        for (int64_t m = 0; m < M; m++) {
            float *row = big + m * NQKV;
            for (int64_t j = 0; j < H + KV; j++) rotate(row + j * D, cos + m * D, sin + m * D, D);
            for (int64_t j = 0; j < KV; j++) {
                const int64_t at = (j * num_slots + slot_mapping[m]) * D;
                memcpy(kl + at, row + (H + j) * D, sizeof(float) * (size_t)D);
                memcpy(vl + at, row + (H + KV + j) * D, sizeof(float) * (size_t)D);
            }
        }
        minillm_paged_decode(big, NQKV, D, rows, M, kl, vl, block_tables, seq_lens, H, KV, D, num_slots, max_blocks,
                             block_size, dims->scale, mid, H * D, D, nthreads);
        if ((rc = matmul(&ly->o, mid, M, h, nthreads)) != 0) break;
        for (int64_t i = 0; i < M * E; i++) x[i] += h[i];

        for (int64_t m = 0; m < M; m++) rms_norm(x + m * E, ly->post_norm, E, dims->eps, h + m * E);
        if ((rc = matmul(&ly->gate_up, h, M, big, nthreads)) != 0) break;
        for (int64_t m = 0; m < M; m++) {
            const float *g = big + m * 2 * I, *u = g + I;
            for (int64_t i = 0; i < I; i++) mid[m * I + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        if ((rc = matmul(&ly->down, mid, M, h, nthreads)) != 0) break;
        for (int64_t i = 0; i < M * E; i++) x[i] += h[i];
    }
    if (rc == 0 && final_norm)
        for (int64_t m = 0; m < M; m++) {
            rms_norm(x + m * E, final_norm, E, dims->eps, h + m * E);
            memcpy(x + m * E, h + m * E, sizeof(float) * (size_t)E);
        }
    free(h); free(big); free(mid); free(rows);
    return rc;
}
