/* A float32 linear over weights kept in 16 bits (bf16 or float16), for CPUs that compute float32 because they have no
 * native bf16 (quasar_deploy/cpu/half_linear.py builds and probes this file; cpu/linears.py offers it for every float
 * linear whose weight is stored narrower than it computes: a real model's lm_head or tied table above all).
 *
 * Why its own kernel: at verify sizes a linear is a pass over its weights, and a library float32 kernel needs its
 * weights in float32: a bf16 checkpoint's lm_head at Qwen3-0.6B's shape (151,936 x 1,024) is then 622 MB read each
 * step, more than the whole int8 body. Kept as stored it is 311 MB; widening a 16-bit value to float32 is exact
 * (bf16: its bits shifted left by 16; float16: vcvtph2ps), so the products are the ones the float32 kernel makes.
 *
 * What it computes: out[r][c] = sum over j of x[r][j] * w[c][j] in float32, one fused multiply-add after another in
 * order of j (the scalar reference: acc = fmaf(x, w, acc) from acc = 0), then + bias[c]. A row's result depends on
 * nothing but that row: not on the rows beside it, nor on which thread computed which columns (the row-invariance
 * batched serving and lossless verification need). The sums differ from oneDNN's float32 kernel only in order.
 *
 * Weights are packed once into blocks of 16 output columns (the last zero-padded), each [k][16]: one 32-byte load
 * holds one value of k for 16 columns, widened into two vectors of 8 floats; each row's x[j] is broadcast against
 * them. A pass takes up to ROWS rows (2 x ROWS accumulators); the rest of a call's rows pass over the same block,
 * which stays in L1/L2 meanwhile: the weights are read from memory once per call.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define COLS 16 /* output columns per packed block: a thread's share is whole blocks */
#define ROWS 6  /* rows per pass: 12 accumulators, 2 weight vectors and a broadcast in the 16 registers */
#define PREFETCH 1024 /* bytes ahead of the weights being read that a pass asks for (a line every other step of k) */

int quasar_half_interface(void) { return 1; }

size_t quasar_half_packed_bytes(int n, int k) { return (size_t)((n + COLS - 1) / COLS) * COLS * (size_t)k * 2; }

/* w [n][k] (16-bit values, either format: packing moves bits) -> packed blocks [n / COLS][k][COLS]. */
void quasar_half_pack(const uint16_t *w, int n, int k, uint16_t *packed) {
    int blocks = (n + COLS - 1) / COLS;
    for (int b = 0; b < blocks; b++) {
        uint16_t *block = packed + (size_t)b * COLS * k;
        for (int j = 0; j < k; j++)
            for (int c = 0; c < COLS; c++) {
                int col = b * COLS + c;
                block[(size_t)j * COLS + c] = col < n ? w[(size_t)col * k + j] : 0;
            }
    }
}

static inline __attribute__((always_inline)) __m256 widen(const uint16_t *p, int bf16) {
    __m128i bits = _mm_loadu_si128((const __m128i *)p);
    if (bf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    return _mm256_cvtph_ps(bits);
}

/* The 8 weights of step j, half `high` or low: widened from 16 bits (narrow) or read from a widened copy. */
static inline __attribute__((always_inline)) __m256 weights(const void *block, int j, int high, int narrow, int bf16) {
    if (narrow) return widen((const uint16_t *)block + (size_t)j * COLS + 8 * high, bf16);
    return _mm256_load_ps((const float *)block + (size_t)j * COLS + 8 * high);
}

/* A row's two accumulators, + bias, into the block's columns of out. */
static inline __attribute__((always_inline)) void finish(__m256 low, __m256 high, const float *bias, int cols, float *out) {
    float sums[COLS];
    _mm256_storeu_ps(sums, low);
    _mm256_storeu_ps(sums + 8, high);
    for (int c = 0; c < cols; c++) out[c] = bias ? sums[c] + bias[c] : sums[c];
}

/* Rows [0, R) of x (row stride k) against one block, R a constant where it is called; out's row stride n; `ahead`:
 * packed weights to ask the memory for meanwhile, as far ahead of this pass's own as the pass reads (or NULL). The
 * accumulators are named one by one, not an array: GCC kept an array of them in memory too, storing each after every
 * product. */
static inline __attribute__((always_inline)) void pass(const float *x, int k, const void *block, int narrow, int bf16,
                                                       int R, const char *ahead, const float *bias, int cols, float *out,
                                                       int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0, e0 = a0, e1 = a0,
           f0 = a0, f1 = a0, v;
    for (int j = 0; j < k; j++) {
        if (ahead && !(j & 1)) _mm_prefetch(ahead + (size_t)j * COLS * 2, _MM_HINT_T0); /* a line every other step */
        __m256 w0 = weights(block, j, 0, narrow, bf16), w1 = weights(block, j, 1, narrow, bf16);
#define ROW(acc0, acc1, index)                                                                                         \
    if (R > index) {                                                                                                   \
        v = _mm256_broadcast_ss(x + (size_t)(index) * k + j);                                                          \
        acc0 = _mm256_fmadd_ps(v, w0, acc0);                                                                           \
        acc1 = _mm256_fmadd_ps(v, w1, acc1);                                                                           \
    }
        ROW(a0, a1, 0)
        ROW(b0, b1, 1)
        ROW(c0, c1, 2)
        ROW(d0, d1, 3)
        ROW(e0, e1, 4)
        ROW(f0, f1, 5)
#undef ROW
    }
    finish(a0, a1, bias, cols, out);
    if (R > 1) finish(b0, b1, bias, cols, out + n);
    if (R > 2) finish(c0, c1, bias, cols, out + 2 * (size_t)n);
    if (R > 3) finish(d0, d1, bias, cols, out + 3 * (size_t)n);
    if (R > 4) finish(e0, e1, bias, cols, out + 4 * (size_t)n);
    if (R > 5) finish(f0, f1, bias, cols, out + 5 * (size_t)n);
}

/* one pass of `rows` (1..ROWS) rows: each count, source and format its own unrolled copy of pass */
static inline __attribute__((always_inline)) void passes(const float *x, int k, const void *block, int narrow, int bf16,
                                                         int rows, const char *ahead, const float *bias, int cols,
                                                         float *out, int n) {
    switch (rows) {
    case 6: pass(x, k, block, narrow, bf16, 6, ahead, bias, cols, out, n); break;
    case 5: pass(x, k, block, narrow, bf16, 5, ahead, bias, cols, out, n); break;
    case 4: pass(x, k, block, narrow, bf16, 4, ahead, bias, cols, out, n); break;
    case 3: pass(x, k, block, narrow, bf16, 3, ahead, bias, cols, out, n); break;
    case 2: pass(x, k, block, narrow, bf16, 2, ahead, bias, cols, out, n); break;
    default: pass(x, k, block, narrow, bf16, 1, ahead, bias, cols, out, n); break;
    }
}

size_t quasar_half_scratch_bytes(int m, int k) { return m > ROWS ? (size_t)COLS * k * sizeof(float) : 0; }

/* x [m][k] float32 against blocks [first, last) of packed (n columns in all; bf16 where bf16, else float16):
 * out [m][n]'s columns of those blocks. With more rows than one pass takes, each block is first widened into
 * `scratch` (quasar_half_scratch_bytes, 32-byte aligned; 64 kB at k = 1024, in L2) for all their passes: the products
 * then have the vector units to themselves. Widening is exact, so a row's sums are the same either way. */
void quasar_half_linear(const float *x, int m, int k, const uint16_t *packed, const float *bias, int n, int bf16,
                        int first, int last, float *out, float *scratch) {
    for (int b = first; b < last; b++) {
        const uint16_t *block = packed + (size_t)b * COLS * k;
        int cols = n - b * COLS < COLS ? n - b * COLS : COLS;
        const float *block_bias = bias ? bias + (size_t)b * COLS : NULL;
        if (m > ROWS)
            for (size_t i = 0; i < (size_t)COLS * k; i += 8) _mm256_store_ps(scratch + i, widen(block + i, bf16));
        for (int r0 = 0; r0 < m; r0 += ROWS) {
            int rows = m - r0 < ROWS ? m - r0 : ROWS;
            const float *xr = x + (size_t)r0 * k;
            float *o = out + (size_t)r0 * n + (size_t)b * COLS;
            /* a pass over the 16-bit block asks for what lies PREFETCH bytes ahead of it; the first pass over a widened
             * block, for the next block, which the widening then finds in cache */
            const char *ahead = m <= ROWS ? (const char *)block + PREFETCH : r0 == 0 && b + 1 < last ? (const char *)(block + (size_t)COLS * k) : NULL;
            if (m > ROWS) passes(xr, k, scratch, 0, 0, rows, ahead, block_bias, cols, o, n); /* format a constant in each copy */
            else if (bf16) passes(xr, k, block, 1, 1, rows, ahead, block_bias, cols, o, n);
            else passes(xr, k, block, 1, 0, rows, ahead, block_bias, cols, o, n);
        }
    }
}

/* Sharing a call's blocks among the threads of the caller's OpenMP pool (torch's), as int8_linear.c does: GOMP_parallel,
 * omp_get_thread_num and omp_get_num_threads of the runtime the process has loaded, handed in by half_linear.py. */
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*count_fn)(void);
static parallel_fn omp_parallel;
static count_fn omp_thread, omp_threads;

void quasar_half_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_parallel = (parallel_fn)parallel;
    omp_thread = (count_fn)thread_num;
    omp_threads = (count_fn)num_threads;
}

struct shared_call {
    const float *x, *bias;
    const uint16_t *packed;
    const int32_t *edges;
    float *out, *scratch;
    size_t scratch_floats;
    int m, k, n, bf16, shares;
};

static void run_shares(void *data) {
    const struct shared_call *c = data;
    for (int s = omp_thread(); s < c->shares; s += omp_threads()) /* every share runs, however many threads came */
        quasar_half_linear(c->x, c->m, c->k, c->packed, c->bias, c->n, c->bf16, c->edges[s], c->edges[s + 1], c->out,
                           c->scratch + c->scratch_floats * (size_t)omp_thread());
}

/* quasar_half_linear over shares of blocks [edges[s], edges[s + 1]), s < shares, side by side in the OpenMP pool, each
 * thread t widening into scratch + t x quasar_half_scratch_bytes (shares of them); 1 where no runtime was handed in
 * (the caller then computes alone), else 0. */
int quasar_half_linear_shared(const float *x, int m, int k, const uint16_t *packed, const float *bias, int n, int bf16,
                              const int32_t *edges, int shares, float *out, float *scratch) {
    if (!omp_parallel) return 1;
    struct shared_call call = {x, bias, packed, edges, out, scratch, quasar_half_scratch_bytes(m, k) / sizeof(float),
                               m, k, n, bf16, shares};
    omp_parallel(run_shares, &call, (unsigned)shares, 0);
    return 0;
}

/* One self-check shape in one format: m rows of k against n columns, against the scalar reference (fmaf in order of
 * k), bit for bit. 0 when every value matches. */
static int check(int m, int k, int n, int bf16) {
    static uint16_t w[40 * 70], packed[48 * 70];
    static float x[13 * 70], out[13 * 40], bias[40], scratch[COLS * 70] __attribute__((aligned(32)));
    unsigned state = 12345;
    for (int i = 0; i < n * k; i++) {
        state = state * 1103515245u + 12345u;
        float value = (float)((int)(state >> 16) % 2001 - 1000) / 997.0f;
        if (bf16) {
            uint32_t bits;
            memcpy(&bits, &value, 4);
            w[i] = (uint16_t)(bits >> 16);
        } else {
            w[i] = (uint16_t)_cvtss_sh(value, 0);
        }
    }
    for (int i = 0; i < m * k; i++) {
        state = state * 1103515245u + 12345u;
        x[i] = (float)((int)(state >> 16) % 2001 - 1000) / 331.0f;
    }
    for (int c = 0; c < n; c++) bias[c] = (float)c / 7.0f;
    quasar_half_pack(w, n, k, packed);
    quasar_half_linear(x, m, k, packed, bias, n, bf16, 0, (n + COLS - 1) / COLS, out, scratch);
    for (int r = 0; r < m; r++)
        for (int c = 0; c < n; c++) {
            float acc = 0.0f;
            for (int j = 0; j < k; j++) {
                uint16_t h = w[c * k + j];
                float wide;
                if (bf16) {
                    uint32_t bits = (uint32_t)h << 16;
                    memcpy(&wide, &bits, 4);
                } else {
                    wide = _cvtsh_ss(h);
                }
                acc = fmaf(x[r * k + j], wide, acc);
            }
            if (acc + bias[c] != out[r * n + c]) return 1;
        }
    return 0;
}

/* Self-check, run in a child process before first use (an instruction this CPU lacks kills the child, not the
 * caller): both formats, every pass size (13 rows: two full passes and a lone row), a partial block. */
int quasar_probe(void) {
    for (int bf16 = 0; bf16 <= 1; bf16++)
        if (check(13, 70, 40, bf16) || check(5, 33, 17, bf16) || check(1, 70, 40, bf16)) return 1 + bf16;
    return 0;
}
