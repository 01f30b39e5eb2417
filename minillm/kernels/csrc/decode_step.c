/* A whole decode step of a Llama decoder with quantized linear layers, in one call from Python.

   At batch 1 the layers' arithmetic is small (a 576-wide model streams ~3 MB of int4 weights per layer) and the
   Python around it is not: ~12 torch ops and ctypes calls per layer, each 5-40 us, cost more than the matmuls.
   This file runs the same sequence of operations the Python layers run (models/llama.py), per layer:

     h = rms_norm(x) * w_in;  qkv = h W_qkv^T;  rotate q and k (RoPE, rotate-half form);  write k, v to the pool;
     a = paged attention(q, pool);  x += a W_o^T;  h = rms_norm(x) * w_post;  [g, u] = h W_gu^T;
     x += (silu(g) * u) W_down^T

   and then the final norm. The matmuls are the same qgemm.c tiles and the attention the same paged_decode.c task
   the layers call, so they give the same numbers; the norms, RoPE and SiLU are plain loops that differ from torch's
   only in float rounding (tests/test_decode_step.py states by how much).

   Threads: one OpenMP team for the whole step, not one per matmul. A step is ~150 small parallel pieces (four
   matmuls and the attention per layer, 30-100 us each at batch 1); entering an OpenMP region for each let the
   workers fall asleep between pieces (measured: OMP_WAIT_POLICY=passive 20 ms a token, active 9, default 11-14:
   wake-ups, not arithmetic). Here the team enters once and meets at a spinning barrier between pieces (nine per
   layer). Every thread keeps its own copy of the residual stream (bitwise equal: the same code on the same
   inputs). The team splits the rows' 32-column blocks evenly for the norms, SiLU and quantization (each piece
   normed and quantized in one pass, into codes every thread reads after a barrier) and each matmul's 24-column
   blocks; attention splits its (sequence, kv head) tasks, and a task rotates and stores the q/k/v heads it owns,
   so no barrier separates RoPE from attention.

   The matmuls run on qgemm.c's tiles at any number of rows, so a verification's k + 1 rows and a batch's rows get
   the arithmetic a plain step of them would. At 48 rows on SmolLM2 the step went from ~195 ms through the layers
   to ~125 ms (the difference was the ~12 torch ops per layer between the matmuls). Until 2026-11-29 steps of 1-2
   rows ran qgemm.c's row kernel instead, each thread quantizing every input itself; the tiles, with their sums in
   registers, made a batch-1 step ~25 % faster (4.3-4.9 -> 3.2-3.5 ms).

   The Python side (kernels/cpu_decode.py) decides when this applies (decode-only steps, every linear quantized,
   float32, one rank, the C attention kernel) and falls back to the layers otherwise. */
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
void minillm_dequant_row(int kind, const void *restrict w_row, const uint16_t *restrict scales_row,
                         const uint16_t *restrict mins_row, int64_t K, int64_t G, float *restrict o);
void minillm_paged_decode_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, const int64_t *rows,
                               const float *k, const float *v, const int64_t *block_tables, const int64_t *seq_lens,
                               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                               int64_t max_blocks, int64_t block_size, float scale, float *out,
                               int64_t out_row_stride, int64_t out_head_stride, int64_t task);
void minillm_paged_decode_rows_task(const float *q, int64_t q_row_stride, int64_t q_head_stride, int64_t r0, int R,
                                    const float *k, const float *v, const int64_t *table, const int64_t *lens,
                                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                    int64_t block_size, float scale, float *out, int64_t out_row_stride,
                                    int64_t out_head_stride, int64_t h);
int minillm_paged_decode_rows_max(int64_t group, int64_t head_dim);
int64_t minillm_paged_decode_pieces(int64_t S, const int64_t *rows, const int64_t *block_tables, int64_t max_blocks,
                                    int rows_max, int64_t num_kv_heads, int num_threads, int64_t *first, int *count);

int minillm_qgemm_finite(const float *x, int64_t K);
void minillm_exp_nonpositive(float *x, int64_t n);
void minillm_qgemm_tiles_blocks(int kind, const int16_t *aq, const float *ad, const float *as, int64_t m0, int64_t m1,
                                int64_t K, int64_t G, const uint8_t *wt, const uint16_t *d, const uint16_t *mn,
                                int64_t nb0, int64_t nb1, float *y, int64_t ldy);

/* A quantized [n, k] matrix as minillm.quant.formats.QuantizedWeight holds it (kind 0 int8, 1 int4): the
   embedding, whose rows the step dequantizes. */
typedef struct {
    int64_t kind, group, n, k;
    const void *w;
    const uint16_t *scales, *mins;
} mll_qlinear;

typedef struct {
    const float *input_norm, *post_norm;   /* RMSNorm weights [hidden] */
} mll_layer;

typedef struct {
    int64_t hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, scale;
} mll_dims;

/* The same matrix in qgemm.c's tiles (cpu_qgemm.PackedTiles): its own codes reordered, n_pad = n rounded up to 24
   columns; mins NULL for int8. */
typedef struct {
    int64_t kind, group, n_pad;
    const uint8_t *tiles;
    const uint16_t *scales, *mins;
} mll_tiles;

typedef struct {
    mll_tiles qkv, o, gate_up, down;
} mll_layer_tiles;

#define TN 24
#define PAD_TN(n) (((n) + TN - 1) / TN * TN)


/* Columns [k0, k1) of rms_norm(x) * w (n wide) into out[0, k1 - k0). */
static const float *norm_part(const float *x, const float *w, int64_t n, float eps, int64_t k0, int64_t k1,
                              float *out) {
    float acc[16] = {0}, ss = 0.0f;      /* 16 running sums (vector lanes), not one dependent add per value */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j] * x[i + j];
    for (int j = 0; j < 16; j++) ss += acc[j];
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = k0; i < k1; i++) out[i - k0] = x[i] * r * w[i];
    return out;
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

/* What every thread of the step reads: the step's shapes, its shared buffers and the team's barrier. */
typedef struct {
    int64_t M, E, I, H, KV, D, G, num_slots, max_blocks, block_size, layer_floats;
    float eps, scale;
    const mll_layer *layers;
    const mll_layer_tiles *tiles;        /* the layers' matmuls in qgemm.c's tiles */
    const float *cos, *sin;
    float *k_pool, *v_pool;
    const int64_t *slot_mapping, *block_tables, *seq_lens, *rows;
    float *big, *mid, *out;              /* qkv then gate|up; attention out (then silu*up); the o and down outputs */
    int64_t ldq, ldg, lde;               /* row strides of big holding qkv, big holding gate|up, out */
    int16_t *taq;                        /* the activation codes [M, kmax] all threads share, their ... */
    float *tad, *tas, *tgs;              /* ... block scales, scaled block sums and group sums [M, kmax / 32] */
    int rows_share;                      /* rows of one sequence (a verification's k + 1): store all, then attend */
    int64_t npieces;                     /* with rows_share: runs of rows reading one block table, attended ... */
    const int64_t *piece_first;          /* ... together (piece p: rows piece_first[p] .. + piece_rows[p]) */
    const int *piece_rows;
    atomic_long next_task, next_attend;
    atomic_int bad;                      /* an activation was NaN or inf */
    spin_barrier bar;
} step_ctx;

/* Row s's part of task (s, kv head h) before attending: rotate its query heads of kv head h and its key head h,
   store k and v in the pool. */
static void rotate_store(step_ctx *c, float *kl, float *vl, int64_t task) {
    const int64_t H = c->H, KV = c->KV, D = c->D, G = c->G, s = task / KV, h = task % KV;
    float *row = c->big + s * c->ldq;
    const float *cs = c->cos + s * D, *sn = c->sin + s * D;
    for (int64_t g = 0; g < G; g++) rotate(row + (h * G + g) * D, cs, sn, D);
    rotate(row + (H + h) * D, cs, sn, D);
    const int64_t at = (h * c->num_slots + c->slot_mapping[s]) * D;
    memcpy(kl + at, row + (H + h) * D, sizeof(float) * (size_t)D);
    memcpy(vl + at, row + (H + KV + h) * D, sizeof(float) * (size_t)D);
}

/* This layer's attention, tasks (row s, kv head h) from a shared counter (sequence lengths vary several-fold
   within a step). Each row is one sequence's decode token: a task rotates and stores its row's q/k/v heads and
   attends at once. When rows share a sequence (a verification step's k + 1 tokens: row j attends over the
   sequence's context and the rows before it, each its own seq_len), a row reads keys other tasks store: every
   task stores first, a barrier, then every task attends; there a task is (piece, kv head): a piece is rows reading
   one block table, attended together (paged_decode.c's minillm_paged_decode_pieces; one pass over the keys for all of them: at a 4,000-token
   context a 5-row verification step took 0.81x the time of one task per row, 2 threads, Zen 4; at 320 tokens,
   where the keys stay in cache, the same). Thread 0 resets the counters as each layer starts:
   every thread has left the previous layer's attention (barriers followed it), and none reaches this one before
   the barrier that ends the qkv matmul. */
static void attention(step_ctx *c, int64_t l, int *sense) {
    const int64_t KV = c->KV, D = c->D, tasks = c->M * KV;
    float *kl = c->k_pool + l * c->layer_floats, *vl = c->v_pool + l * c->layer_floats;
    for (int64_t task = atomic_fetch_add(&c->next_task, 1); task < tasks; task = atomic_fetch_add(&c->next_task, 1)) {
        rotate_store(c, kl, vl, task);
        if (!c->rows_share)
            minillm_paged_decode_task(c->big, c->ldq, D, c->rows, kl, vl, c->block_tables, c->seq_lens, c->H, KV,
                                      D, c->num_slots, c->max_blocks, c->block_size, c->scale, c->mid, c->H * D, D,
                                      task);
    }
    if (!c->rows_share) return;
    barrier(&c->bar, sense);
    const int64_t shared = c->npieces * KV;
    for (int64_t task = atomic_fetch_add(&c->next_attend, 1); task < shared;
         task = atomic_fetch_add(&c->next_attend, 1)) {
        const int64_t p = task / KV, first = c->piece_first[p];
        minillm_paged_decode_rows_task(c->big, c->ldq, D, first, c->piece_rows[p], kl, vl,
                                       c->block_tables + first * c->max_blocks, c->seq_lens + first, c->H, KV, D,
                                       c->num_slots, c->block_size, c->scale, c->mid, c->H * D, D, task % KV);
    }
}

static void add_rows(float *x, const float *y, int64_t M, int64_t E, int64_t ldy) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < E; i++) x[m * E + i] += y[m * ldy + i];
}

/* One matmul's input: the rows' 32-column blocks, in row order, split evenly over the team (a thread's share may
   start or end inside a row); `make` computes columns [k0, k1) of row m (into tmp where it is computed), which are
   quantized into the codes all threads share. Then the barrier, after which every thread sees whether any row was
   NaN/inf (returns 1: the whole team leaves the step together). Whole rows per thread left one thread idle at
   batch 1 (the SiLU of a batch-1 step, 0.24 of its ~3 ms, ran on thread 0 alone) and a 3/2 split at 5 rows. */
typedef const float *(*row_fn)(const step_ctx *c, int64_t l, int64_t m, int64_t k0, int64_t k1, const float *x_row,
                               float *tmp);

static const float *row_input_norm(const step_ctx *c, int64_t l, int64_t m, int64_t k0, int64_t k1,
                                   const float *x_row, float *tmp) {
    (void)m;
    return norm_part(x_row, c->layers[l].input_norm, c->E, c->eps, k0, k1, tmp);
}
static const float *row_post_norm(const step_ctx *c, int64_t l, int64_t m, int64_t k0, int64_t k1,
                                  const float *x_row, float *tmp) {
    (void)m;
    return norm_part(x_row, c->layers[l].post_norm, c->E, c->eps, k0, k1, tmp);
}
static const float *row_attn_out(const step_ctx *c, int64_t l, int64_t m, int64_t k0, int64_t k1,
                                 const float *x_row, float *tmp) {
    (void)l; (void)k1; (void)x_row; (void)tmp;
    return c->mid + m * c->H * c->D + k0;
}
/* silu(g) * u with sigmoid(g) from e = exp(-|g|) (1 / (1 + e) for g >= 0, e / (1 + e) below): exp of a
   non-positive argument only, 8 lanes at a time (paged_decode.c's), where a scalar expf per element took ~0.7 ms
   of a 5-row step. A NaN or inf g gives a NaN or inf product, which the finiteness check then sees. */
static const float *row_silu(const step_ctx *c, int64_t l, int64_t m, int64_t k0, int64_t k1, const float *x_row,
                             float *tmp) {
    (void)l; (void)x_row;
    const float *g = c->big + m * c->ldg + k0, *u = g + c->I;
    const int64_t n = k1 - k0;
    for (int64_t i = 0; i < n; i++) tmp[i] = -fabsf(g[i]);
    minillm_exp_nonpositive(tmp, n);
    for (int64_t i = 0; i < n; i++) {
        const float e = tmp[i];
        tmp[i] = g[i] * ((g[i] >= 0.0f ? 1.0f : e) / (1.0f + e)) * u[i];
    }
    return tmp;
}

static int quantize_shared(step_ctx *c, int64_t l, row_fn make, int64_t K, const float *xs, float *tmp, int t,
                           int nt, int *sense) {
    const int64_t nb = K / 32, total = c->M * nb, b1 = (t + 1) * total / nt;
    int bad = 0;
    for (int64_t b = t * total / nt; b < b1;) {
        const int64_t m = b / nb, k0 = b - m * nb, k1 = b1 - m * nb < nb ? b1 - m * nb : nb;
        const float *part = make(c, l, m, 32 * k0, 32 * k1, xs + m * c->E, tmp);
        bad |= !minillm_qgemm_finite(part, 32 * (k1 - k0));
        minillm_qgemm_quantize(part, 1, 32 * (k1 - k0), K, 32, c->taq + m * K + 32 * k0, c->tad + m * nb + k0,
                               c->tas + m * nb + k0, c->tgs + m * nb + k0);
        b = m * nb + k1;
    }
    if (bad) atomic_store(&c->bad, 1);
    barrier(&c->bar, sense);
    return atomic_load(&c->bad);
}

/* This thread's share of a matmul on tiles: an equal run of its 24-column blocks, all rows. */
static void gemm_tiles(const step_ctx *c, const mll_tiles *w, int64_t K, float *y, int64_t ldy, int t, int nt) {
    const int64_t nblocks = w->n_pad / TN;
    minillm_qgemm_tiles_blocks((int)w->kind, c->taq, c->tad, c->tas, 0, c->M, K, w->group, w->tiles, w->scales,
                               w->mins, t * nblocks / nt, (t + 1) * nblocks / nt, y, ldy);
}

/* One layer. The rows' 32-column blocks are split over the team for the norms, SiLU and quantization (each input
   quantized once, into codes all threads read), and each matmul's 24-column blocks. */
static int layer_tiles(step_ctx *c, int64_t l, float *xs, float *tmp, int t, int nt, int *sense) {
    const mll_layer_tiles *pk = c->tiles + l;
    const int64_t M = c->M, E = c->E;
    if (quantize_shared(c, l, row_input_norm, E, xs, tmp, t, nt, sense)) return 1;
    gemm_tiles(c, &pk->qkv, E, c->big, c->ldq, t, nt);
    barrier(&c->bar, sense);
    attention(c, l, sense);
    barrier(&c->bar, sense);
    if (quantize_shared(c, l, row_attn_out, c->H * c->D, xs, tmp, t, nt, sense)) return 1;
    gemm_tiles(c, &pk->o, c->H * c->D, c->out, c->lde, t, nt);
    barrier(&c->bar, sense);
    add_rows(xs, c->out, M, E, c->lde);
    if (quantize_shared(c, l, row_post_norm, E, xs, tmp, t, nt, sense)) return 1;
    gemm_tiles(c, &pk->gate_up, E, c->big, c->ldg, t, nt);
    barrier(&c->bar, sense);
    if (quantize_shared(c, l, row_silu, c->I, xs, tmp, t, nt, sense)) return 1;
    gemm_tiles(c, &pk->down, c->I, c->out, c->lde, t, nt);
    barrier(&c->bar, sense);
    add_rows(xs, c->out, M, E, c->lde);
    return 0;
}

/* x: [M, hidden] out: the final-normed hidden states (and, when `embed` is NULL, in: the embedded tokens; else the
   step looks ids[m] up in the quantized embedding itself). cos/sin: [M, head_dim]. k_pool/v_pool: this step's
   layers' pools, [L][num_kv_heads][num_slots][head_dim]. Row m is one token: its new K/V go to slot_mapping[m], it
   attends over seq_lens[m] positions through block_tables[m]; rows_share: some rows are tokens of one sequence
   (each with its own seq_len: causal), so all are stored before any attends. `tiles`: the layers' matmuls in
   qgemm.c's tiles, one set per layer. Returns 0; -1 when scratch memory cannot be allocated; check_rows' codes for
   rows outside the pool (nothing is written then); -6 when an activation is NaN or inf (the pool slots of this
   step's rows may have been written: the caller runs the layers, which write them again, and whose float fallback
   propagates the NaN). */
int minillm_decode_step(float *x, int64_t M, const int64_t *ids, const mll_qlinear *embed, const mll_layer *layers,
                        const mll_layer_tiles *tiles, int64_t L, const mll_dims *dims, const float *final_norm,
                        const float *cos, const float *sin, float *k_pool, float *v_pool, int64_t num_slots,
                        const int64_t *slot_mapping, const int64_t *block_tables, int64_t max_blocks,
                        const int64_t *seq_lens, int64_t block_size, int nthreads, int rows_share) {
    const int bad = check_rows(M, embed ? ids : NULL, embed ? embed->n : 0, num_slots, slot_mapping, block_tables,
                               max_blocks, seq_lens, block_size);
    if (bad) return bad;
    const int64_t E = dims->hidden, I = dims->intermediate, H = dims->num_heads, KV = dims->num_kv_heads,
                  D = dims->head_dim, NQKV = (H + 2 * KV) * D;
    const int64_t ldq = PAD_TN(NQKV), ldg = PAD_TN(2 * I), lde = PAD_TN(E);   /* tiles write whole 24-column blocks */
    const int64_t widest = ldq > ldg ? ldq : ldg, mid_w = H * D > I ? H * D : I;
    const int64_t kmax = E > mid_w ? E : mid_w, nb = kmax / 32;
    if (nthreads < 1) nthreads = 1;
    float *big = malloc(sizeof(float) * (size_t)(M * widest));
    float *mid = malloc(sizeof(float) * (size_t)(M * mid_w));
    float *out = malloc(sizeof(float) * (size_t)(M * lde));
    int64_t *rows = malloc(sizeof(int64_t) * (size_t)M), *piece_first = malloc(sizeof(int64_t) * (size_t)M);
    int *piece_rows = malloc(sizeof(int) * (size_t)M);
    /* per thread: its residual copy and a row of the next matmul's input */
    const size_t floats_per_thread = (size_t)(M * E + kmax);
    float *fbuf = malloc(sizeof(float) * floats_per_thread * (size_t)nthreads);
    int16_t *taq = malloc(sizeof(int16_t) * (size_t)(M * kmax));
    float *tsc = malloc(sizeof(float) * (size_t)(3 * M * nb));      /* tad, tas, tgs */
    if (!big || !mid || !out || !rows || !piece_first || !piece_rows || !fbuf || !taq || !tsc) {
        free(big); free(mid); free(out); free(rows); free(piece_first); free(piece_rows); free(fbuf); free(taq);
        free(tsc);
        return -1;
    }
    for (int64_t m = 0; m < M; m++) rows[m] = m;
    step_ctx c = {.M = M, .E = E, .I = I, .H = H, .KV = KV, .D = D, .G = H / KV,
                  .num_slots = num_slots, .max_blocks = max_blocks, .block_size = block_size,
                  .layer_floats = KV * num_slots * D, .eps = dims->eps, .scale = dims->scale, .layers = layers,
                  .tiles = tiles, .cos = cos, .sin = sin, .k_pool = k_pool, .v_pool = v_pool,
                  .slot_mapping = slot_mapping, .block_tables = block_tables, .seq_lens = seq_lens, .rows = rows,
                  .big = big, .mid = mid, .out = out, .ldq = ldq, .ldg = ldg, .lde = lde, .taq = taq, .tad = tsc,
                  .tas = tsc + M * nb, .tgs = tsc + 2 * M * nb};
    c.rows_share = rows_share;
    if (rows_share)
        c.npieces = minillm_paged_decode_pieces(M, rows, block_tables, max_blocks,
                                                minillm_paged_decode_rows_max(H / KV, D), KV, nthreads, piece_first,
                                                piece_rows);
    c.piece_first = piece_first;
    c.piece_rows = piece_rows;
    atomic_init(&c.next_task, 0);
    atomic_init(&c.next_attend, 0);
    atomic_init(&c.bad, 0);
    atomic_init(&c.bar.arrived, 0);
    atomic_init(&c.bar.sense, 0);
    c.bar.n = 1;

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        c.bar.n = omp_get_num_threads();    /* the team may be smaller than asked; the single's barrier publishes n */
        const int t = omp_get_thread_num(), nt = c.bar.n;
        int sense = 0;
        float *xs = fbuf + (size_t)t * floats_per_thread, *tmp = xs + M * E;
        if (embed) {    /* each thread dequantizes the rows into its own copy (M x hidden values: cheap) */
            const int64_t row_bytes = embed->kind == 1 ? E / 2 : E, ng = E / embed->group;
            for (int64_t m = 0; m < M; m++)
                minillm_dequant_row((int)embed->kind, (const uint8_t *)embed->w + ids[m] * row_bytes,
                                    embed->scales + ids[m] * ng, embed->kind == 1 ? embed->mins + ids[m] * ng : NULL,
                                    E, embed->group, xs + m * E);
        } else {
            memcpy(xs, x, sizeof(float) * (size_t)(M * E));
        }

        int stopped = 0;
        for (int64_t l = 0; l < L && !stopped; l++) {
            if (t == 0) {                                    /* see attention() */
                atomic_store(&c.next_task, 0);
                atomic_store(&c.next_attend, 0);
            }
            stopped = layer_tiles(&c, l, xs, tmp, t, nt, &sense);
        }
        if (t == 0 && !stopped) {
            if (final_norm)
                for (int64_t m = 0; m < M; m++) norm_part(xs + m * E, final_norm, E, dims->eps, 0, E, x + m * E);
            else
                memcpy(x, xs, sizeof(float) * (size_t)(M * E));
        }
    }
    free(big); free(mid); free(out); free(rows); free(piece_first); free(piece_rows); free(fbuf); free(taq);
    free(tsc);
    return atomic_load(&c.bad) ? -6 : 0;
}
