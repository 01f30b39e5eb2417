/* A whole decode step of a Llama decoder with quantized linear layers, in one call from Python.

   At batch 1 the layers' arithmetic is small (a 576-wide model streams ~3 MB of int4 weights per layer) and the
   Python around it is not: ~12 torch ops and ctypes calls per layer, each 5-40 us, cost more than the matmuls.
   This file runs the same sequence of operations the Python layers run (models/llama.py), per layer:

     h = rms_norm(x) * w_in;  qkv = h W_qkv^T;  rotate q and k (RoPE, rotate-half form);  write k, v to the pool;
     a = paged attention(q, pool);  x += a W_o^T;  h = rms_norm(x) * w_post;  [g, u] = h W_gu^T;
     x += (silu(g) * u) W_down^T

   and then the final norm. The matmuls are the same qgemm.c row loops and the attention the same paged_decode.c
   task the layers call, so they give the same numbers; the norms, RoPE and SiLU are plain loops that differ from
   torch's only in float rounding (tests/test_decode_step.py states by how much).

   Threads: one OpenMP team for the whole step, not one per matmul. A step is ~150 small parallel pieces (four
   matmuls and the attention per layer, 30-100 us each at batch 1); entering an OpenMP region for each let the
   workers fall asleep between pieces (measured: OMP_WAIT_POLICY=passive 20 ms a token, active 9, default 11-14:
   wake-ups, not arithmetic). Here the team enters once and meets at a spinning barrier between pieces (six per
   layer). Every thread keeps its own copy of the residual stream and quantizes each matmul's input itself (a few
   microseconds, cheaper than another barrier): the copies are bitwise equal, being the same code on the same
   inputs. Each matmul splits its weight rows evenly over the team; attention splits its (sequence, kv head) tasks,
   and a task rotates and stores the q/k/v heads it owns, so no barrier separates RoPE from attention.

   The Python side (kernels/cpu_decode.py) decides when this applies (decode-only steps of a few rows, every linear
   quantized, float32, one rank, the C attention kernel) and falls back to the layers otherwise. */
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

void minillm_qgemm_quantize(const float *x, int64_t M, int64_t K, int64_t x_stride, int64_t G, int16_t *aq,
                            float *ad, float *as, float *gs);
void minillm_qgemm_rows(int kind, int64_t M, int64_t K, const void *w, const uint16_t *scales, const uint16_t *mins,
                        int64_t G, const int16_t *aq, const float *ad, const float *gs, int64_t n0, int64_t n1,
                        float *y, int64_t y_stride);
void minillm_dequant_row(int kind, const void *restrict w_row, const uint16_t *restrict scales_row,
                         const uint16_t *restrict mins_row, int64_t K, int64_t G, float *restrict o);
void minillm_paged_decode_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                               const float *k, const float *v, const int64_t *block_tables, const int64_t *seq_lens,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t max_blocks, int64_t block_size, float scale, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int64_t task);

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

/* A sense-reversing barrier for the step's team. It spins: the team meets every 10-100 us. After ~20k spins it
   yields, so a machine with fewer free cores than threads still makes progress. */
typedef struct {
    atomic_int arrived, sense;
    int n;
} spin_barrier;

static void barrier(spin_barrier *b, int *mine) {
    const int s = !*mine;
    *mine = s;
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->n - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->sense, s, memory_order_release);
        return;
    }
    for (long spins = 0; atomic_load_explicit(&b->sense, memory_order_acquire) != s; spins++) {
        if (spins < 20000) CPU_RELAX();
        else sched_yield();
    }
}

/* One thread's buffers: its copy of the residual stream, the normed input of the next matmul, and that input
   quantized (qgemm.c's int16 codes, block scales, group sums). */
typedef struct {
    float *x, *hn, *ad, *as, *gs;
    int16_t *aq;
} scratch;

static void quantize_in(const mll_qlinear *l, const float *in, int64_t M, scratch *sc) {
    minillm_qgemm_quantize(in, M, l->k, l->k, l->group, sc->aq, sc->ad, sc->as, sc->gs);
}

/* Thread t's share of a matmul: an equal run of whole groups of four weight rows (qgemm.c's step). */
static void rows_part(const mll_qlinear *l, int64_t M, const scratch *sc, float *y, int t, int nt) {
    const int64_t quads = (l->n + 3) / 4, per = (quads + nt - 1) / nt;
    const int64_t lo = t * per * 4, hi = (t + 1) * per * 4;
    const int64_t n0 = lo < l->n ? lo : l->n, n1 = hi < l->n ? hi : l->n;
    if (n0 < n1)
        minillm_qgemm_rows((int)l->kind, M, l->k, l->w, l->scales, l->mins, l->group, sc->aq, sc->ad, sc->gs, n0, n1, y,
                           l->n);
}

/* Rows outside what the pool holds would make the kernels read or write foreign memory: checked before anything is
   written. 0, or -2 a slot outside the pool, -3 a sequence length outside 1..table width x block_size, -4 a block
   table entry (of the blocks a sequence uses) outside the pool, -5 a token id outside the embedding. */
static int check_rows(int64_t M, const int64_t *ids, int64_t vocab, int64_t num_slots, const int64_t *slot_mapping,
                      const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t block_size) {
    for (int64_t m = 0; m < M; m++) {
        if (slot_mapping[m] < 0 || slot_mapping[m] >= num_slots) return -2;
        if (seq_lens[m] < 1 || seq_lens[m] > max_blocks * block_size) return -3;
        for (int64_t b = 0; b < (seq_lens[m] + block_size - 1) / block_size; b++) {
            const int64_t blk = block_tables[m * max_blocks + b];
            if (blk < 0 || blk >= num_slots / block_size) return -4;
        }
        if (ids && (ids[m] < 0 || ids[m] >= vocab)) return -5;
    }
    return 0;
}

/* x: [M, hidden] out: the final-normed hidden states (and, when `embed` is NULL, in: the embedded tokens; else the
   step looks ids[m] up in the quantized embedding itself). cos/sin: [M, head_dim]. k_pool/v_pool: this step's
   layers' pools, [L][num_kv_heads][num_slots][head_dim]. Row m is sequence m: its new K/V go to slot_mapping[m], it
   attends over seq_lens[m] positions through block_tables[m]. Returns 0; -1 when scratch memory cannot be
   allocated; check_rows' codes for rows outside the pool (nothing is written then). */
int minillm_decode_step(float *x, int64_t M, const int64_t *ids, const mll_qlinear *embed, const mll_layer *layers,
                        int64_t L, const mll_dims *dims, const float *final_norm, const float *cos, const float *sin,
                        float *k_pool, float *v_pool, int64_t num_slots, const int64_t *slot_mapping,
                        const int64_t *block_tables, int64_t max_blocks, const int64_t *seq_lens, int64_t block_size,
                        int nthreads) {
    const int bad = check_rows(M, embed ? ids : NULL, embed ? embed->n : 0, num_slots, slot_mapping, block_tables,
                               max_blocks, seq_lens, block_size);
    if (bad) return bad;
    const int64_t E = dims->hidden, I = dims->intermediate, H = dims->num_heads, KV = dims->num_kv_heads,
                  D = dims->head_dim, NQKV = (H + 2 * KV) * D, G = H / KV;
    const int64_t widest = NQKV > 2 * I ? NQKV : 2 * I, mid_w = H * D > I ? H * D : I;
    const int64_t kmax = E > mid_w ? E : mid_w, nb = kmax / 32;
    if (nthreads < 1) nthreads = 1;
    /* shared: qkv then gate|up; attention out then silu*up; the o and down outputs; row indices */
    float *big = malloc(sizeof(float) * (size_t)(M * widest));
    float *mid = malloc(sizeof(float) * (size_t)(M * mid_w));
    float *out = malloc(sizeof(float) * (size_t)(M * E));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)M);
    const size_t floats_per_thread = (size_t)(2 * M * E + 3 * M * nb);
    float *fbuf = malloc(sizeof(float) * floats_per_thread * (size_t)nthreads);
    int16_t *qbuf = malloc(sizeof(int16_t) * (size_t)(M * kmax) * (size_t)nthreads);
    if (!big || !mid || !out || !rows || !fbuf || !qbuf) {
        free(big); free(mid); free(out); free(rows); free(fbuf); free(qbuf);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) rows[m] = m;
    const int64_t layer_floats = KV * num_slots * D;
    spin_barrier bar;
    atomic_init(&bar.arrived, 0);
    atomic_init(&bar.sense, 0);
    bar.n = 1;

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        bar.n = omp_get_num_threads();    /* the team may be smaller than asked; the single's barrier publishes n */
        const int t = omp_get_thread_num(), nt = bar.n;
        int sense = 0;
        float *f = fbuf + (size_t)t * floats_per_thread;
        scratch sc = {f, f + M * E, f + 2 * M * E, f + 2 * M * E + M * nb, f + 2 * M * E + 2 * M * nb,
                      qbuf + (size_t)t * (size_t)(M * kmax)};
        if (embed) {    /* each thread dequantizes the rows into its own copy (M x hidden values: cheap) */
            const int64_t row_bytes = embed->kind == 1 ? E / 2 : E, ng = E / embed->group;
            for (int64_t m = 0; m < M; m++)
                minillm_dequant_row((int)embed->kind, (const uint8_t *)embed->w + ids[m] * row_bytes,
                                    embed->scales + ids[m] * ng, embed->kind == 1 ? embed->mins + ids[m] * ng : NULL,
                                    E, embed->group, sc.x + m * E);
        } else {
            memcpy(sc.x, x, sizeof(float) * (size_t)(M * E));
        }

        for (int64_t l = 0; l < L; l++) {
            const mll_layer *ly = layers + l;
            float *kl = k_pool + l * layer_floats, *vl = v_pool + l * layer_floats;
            for (int64_t m = 0; m < M; m++) rms_norm(sc.x + m * E, ly->input_norm, E, dims->eps, sc.hn + m * E);
            quantize_in(&ly->qkv, sc.hn, M, &sc);
            rows_part(&ly->qkv, M, &sc, big, t, nt);
            barrier(&bar, &sense);

            /* task (s, h): rotate sequence s's query heads of kv head h and its key head h, store k and v, attend */
            for (int64_t task = t; task < M * KV; task += nt) {
                const int64_t s = task / KV, h = task % KV;
                float *row = big + s * NQKV;
                for (int64_t g = 0; g < G; g++) rotate(row + (h * G + g) * D, cos + s * D, sin + s * D, D);
                rotate(row + (H + h) * D, cos + s * D, sin + s * D, D);
                const int64_t at = (h * num_slots + slot_mapping[s]) * D;
                memcpy(kl + at, row + (H + h) * D, sizeof(float) * (size_t)D);
                memcpy(vl + at, row + (H + KV + h) * D, sizeof(float) * (size_t)D);
                minillm_paged_decode_task(big, NQKV, D, rows, kl, vl, block_tables, seq_lens, H, KV, D, num_slots,
                                          max_blocks, block_size, dims->scale, mid, H * D, D, task);
            }
            barrier(&bar, &sense);

            quantize_in(&ly->o, mid, M, &sc);
            rows_part(&ly->o, M, &sc, out, t, nt);
            barrier(&bar, &sense);

            for (int64_t i = 0; i < M * E; i++) sc.x[i] += out[i];
            for (int64_t m = 0; m < M; m++) rms_norm(sc.x + m * E, ly->post_norm, E, dims->eps, sc.hn + m * E);
            quantize_in(&ly->gate_up, sc.hn, M, &sc);
            rows_part(&ly->gate_up, M, &sc, big, t, nt);
            barrier(&bar, &sense);

            const int64_t per = (M * I + nt - 1) / nt;
            for (int64_t e = t * per; e < (t + 1) * per && e < M * I; e++) {
                const int64_t m = e / I, i = e % I;
                const float gv = big[m * 2 * I + i], u = big[m * 2 * I + I + i];
                mid[e] = gv / (1.0f + expf(-gv)) * u;
            }
            barrier(&bar, &sense);

            quantize_in(&ly->down, mid, M, &sc);
            rows_part(&ly->down, M, &sc, out, t, nt);
            barrier(&bar, &sense);
            for (int64_t i = 0; i < M * E; i++) sc.x[i] += out[i];
        }
        if (t == 0) {
            if (final_norm)
                for (int64_t m = 0; m < M; m++) rms_norm(sc.x + m * E, final_norm, E, dims->eps, x + m * E);
            else
                memcpy(x, sc.x, sizeof(float) * (size_t)(M * E));
        }
    }
    free(big); free(mid); free(out); free(rows); free(fbuf); free(qbuf);
    return 0;
}
