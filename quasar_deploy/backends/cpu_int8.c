/* The W8A8 linear of scheme.py on AVX-512 VNNI, for the cpu backend (quasar_deploy/backends/cpu_int8.py builds and
 * probes this file; kernels.py offers it as the "quasar-vnni" int8 kernel).
 *
 * Why its own kernel: at verify sizes (1-16 rows) a linear is a pass over its weights, and the library kernels read
 * int8 weights more slowly than their bf16 kernels read twice the bytes, so a W8A8 step gained less than its bytes
 * promise (`quasar-deploy bench kernels --int8-kernels quasar-vnni,onednn-vnni,fbgemm-vnni` times them against each
 * other and the float kernel; its record is on docs/benchmarks.md). Here each thread streams one contiguous run of
 * packed weights.
 *
 * What it computes, bit for bit as scheme.reference_linear: per-token (or the calibrated static) activation scale
 * max|x| / 127 (at least 1e-12); codes rint(x / scale) clamped to [-127, 127]; the exact int32 sum of code x weight
 * over k (vpdpbusd takes unsigned activations: codes + 128, and 128 x the weight row's sum is taken off after);
 * then y = float(acc) * scale * weight_scale (+ bias), in that order, with no fused multiply-add (-ffp-contract=off).
 * Integer sums are exact, so a row's result depends on nothing but that row: not on the rows beside it, nor on which
 * thread computed which columns.
 *
 * Weights are packed once: [n / 64][k / 4][64][4], zero-padded to whole blocks, so one 64-byte load holds 4 values of
 * k for 16 output columns, and a block of 64 columns is one contiguous run.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64 /* output columns per packed block: 4 vectors of 16 int32 */
#define GROUP 4  /* values of k per dot-product lane */
#define ROWS 6   /* rows per pass: 6 x 4 accumulators, the rest of the 32 vector registers hold weights */
#define INLINE static inline __attribute__((always_inline))

static size_t round_up(size_t a, size_t b) { return (a + b - 1) / b * b; }

size_t quasar_int8_packed_bytes(int n, int k) { return round_up((size_t)n, BLOCK) * round_up((size_t)k, GROUP); }

/* w [n][k] int8 -> packed (quasar_int8_packed_bytes(n, k) bytes) and row sums wsum [n]. Written in order, 4 bytes
 * at a time, from 64 rows read side by side: an 8B model's 7 GB pack in seconds. */
void quasar_int8_pack(const int8_t *w, int n, int k, int8_t *packed, int32_t *wsum) {
    size_t k4 = round_up((size_t)k, GROUP), whole = (size_t)k / GROUP * GROUP;
    memset(packed, 0, round_up((size_t)n, BLOCK) * k4);
    for (int first = 0; first < n; first += BLOCK) {
        int rows = n - first < BLOCK ? n - first : BLOCK;
        int8_t *out = packed + (size_t)first * k4;
        for (size_t j = 0; j < whole; j += GROUP, out += BLOCK * GROUP)
            for (int c = 0; c < rows; c++) memcpy(out + c * GROUP, w + (size_t)(first + c) * k + j, GROUP);
        for (int c = 0; c < rows; c++)
            for (size_t j = whole; j < (size_t)k; j++) out[c * GROUP + j - whole] = w[(size_t)(first + c) * k + j];
    }
    for (int c = 0; c < n; c++) {
        int32_t sum = 0;
        for (int j = 0; j < k; j++) sum += w[(size_t)c * k + j];
        wsum[c] = sum;
    }
}

/* codes + 128 of m rows of x [m][k] into codes [m][k4] (zero-padded), their scales into scales [m]. Vector lanes
 * do what the reference does element by element: IEEE division, round half to even, clamp. */
static void quantize(const float *x, int m, int k, const float *static_scale, uint8_t *codes, float *scales) {
    size_t k4 = round_up((size_t)k, GROUP);
    const __m512 low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f);
    const __m512i shift = _mm512_set1_epi32(128);
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * k;
        float scale;
        if (static_scale) {
            scale = *static_scale;
        } else {
            __m512 top = _mm512_setzero_ps();
            for (int j = 0; j < k; j += 16) {
                __mmask16 lanes = k - j >= 16 ? 0xffff : (__mmask16)((1u << (k - j)) - 1);
                top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, row + j)));
            }
            scale = fmaxf(_mm512_reduce_max_ps(top) / 127.0f, 1e-12f);
        }
        scales[r] = scale;
        const __m512 divisor = _mm512_set1_ps(scale);
        uint8_t *out = codes + (size_t)r * k4;
        memset(out, 0, k4);
        for (int j = 0; j < k; j += 16) {
            __mmask16 lanes = k - j >= 16 ? 0xffff : (__mmask16)((1u << (k - j)) - 1);
            __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(lanes, row + j), divisor);
            q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, low), high);
            _mm512_mask_cvtepi32_storeu_epi8(out + j, lanes, _mm512_add_epi32(_mm512_cvtps_epi32(q), shift));
        }
    }
}

/* R rows of codes against one packed block of 64 output columns, straight to y = float(acc) * scale * w_scale
 * (+ bias) in out [R][n] (columns past n left alone) */
INLINE void block_rows(const int R, const uint8_t *codes, size_t k4, const int8_t *block, const float *scales,
                       const int32_t *wsum, const float *w_scale, const float *bias, int column, int n, float *out) {
    __m512i sum[ROWS][4];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) sum[i][v] = _mm512_setzero_si512();
    const int8_t *w = block;
    for (size_t g = 0; g < k4; g += GROUP, w += BLOCK * GROUP) {
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
        __m512i w2 = _mm512_loadu_si512(w + 128), w3 = _mm512_loadu_si512(w + 192);
        for (int i = 0; i < R; i++) {
            int32_t four;
            memcpy(&four, codes + (size_t)i * k4 + g, sizeof four);
            __m512i x = _mm512_set1_epi32(four);
            sum[i][0] = _mm512_dpbusd_epi32(sum[i][0], x, w0);
            sum[i][1] = _mm512_dpbusd_epi32(sum[i][1], x, w1);
            sum[i][2] = _mm512_dpbusd_epi32(sum[i][2], x, w2);
            sum[i][3] = _mm512_dpbusd_epi32(sum[i][3], x, w3);
        }
    }
    int32_t acc[ROWS][BLOCK]; /* through memory: indexing the sums by a variable below would spill them in the loop */
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(acc[i] + 16 * v, sum[i][v]);
    for (int v = 0; v < 4; v++) {
        int c = column + 16 * v;
        if (c >= n) break;
        __mmask16 lanes = n - c >= 16 ? 0xffff : (__mmask16)((1u << (n - c)) - 1);
        __m512i shifted = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(lanes, wsum + c), 7); /* 128 x the row sums */
        __m512 ws = _mm512_maskz_loadu_ps(lanes, w_scale + c), b = _mm512_maskz_loadu_ps(lanes, bias ? bias + c : w_scale + c);
        for (int i = 0; i < R; i++) {
            __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(acc[i] + 16 * v), shifted));
            y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(scales[i])), ws);
            if (bias) y = _mm512_add_ps(y, b);
            _mm512_mask_storeu_ps(out + (size_t)i * n + c, lanes, y);
        }
    }
}

/* Scratch bytes one call needs for m rows of k: the codes, then the scales. */
size_t quasar_int8_scratch_bytes(int m, int k) { return round_up((size_t)m * round_up((size_t)k, GROUP), 64) + (size_t)m * sizeof(float); }

/* out [m][n] = the scheme's linear of x [m][k], for the output columns of packed blocks [first, last). Each caller
 * quantizes the rows itself into its own scratch (microseconds), so threads share nothing but read-only input. */
void quasar_int8_linear(const float *x, int m, int k, const int8_t *packed, const int32_t *wsum, const float *w_scale,
                        const float *bias, const float *static_scale, int n, int first, int last, float *out,
                        uint8_t *scratch) {
    size_t k4 = round_up((size_t)k, GROUP);
    uint8_t *codes = scratch;
    float *scales = (float *)(scratch + round_up((size_t)m * k4, 64));
    quantize(x, m, k, static_scale, codes, scales);
    for (int b = first; b < last; b++) {
        const int8_t *block = packed + (size_t)b * BLOCK * k4;
        for (int r = 0; r < m; r += ROWS) {
            const uint8_t *c = codes + (size_t)r * k4;
            float *y = out + (size_t)r * n;
            switch (m - r < ROWS ? m - r : ROWS) { /* constant row counts: each unrolled, its sums in registers */
            case 1: block_rows(1, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            case 2: block_rows(2, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            case 3: block_rows(3, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            case 4: block_rows(4, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            case 5: block_rows(5, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            default: block_rows(6, c, k4, block, scales + r, wsum, w_scale, bias, b * BLOCK, n, y); break;
            }
        }
    }
}

/* Sharing a call's blocks among the threads of the caller's OpenMP pool (torch's): GOMP_parallel, omp_get_thread_num
 * and omp_get_num_threads of the runtime the process has loaded, handed in by cpu_int8.py (libgomp and Intel's runtime
 * both export them). Its workers are the ones torch's own ops use, often still spinning from the last of them: no
 * hand-off to a thread of ours, and no third thread contending with them for two cores. */
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*count_fn)(void);
static parallel_fn omp_parallel;
static count_fn omp_thread, omp_threads;

void quasar_int8_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_parallel = (parallel_fn)parallel;
    omp_thread = (count_fn)thread_num;
    omp_threads = (count_fn)num_threads;
}

struct shared_call {
    const float *x, *w_scale, *bias, *static_scale;
    const int8_t *packed;
    const int32_t *wsum, *edges;
    float *out;
    uint8_t *scratch;
    size_t scratch_bytes;
    int m, k, n, shares;
};

static void run_shares(void *data) {
    const struct shared_call *c = data;
    for (int s = omp_thread(); s < c->shares; s += omp_threads()) /* every share runs, however many threads came */
        quasar_int8_linear(c->x, c->m, c->k, c->packed, c->wsum, c->w_scale, c->bias, c->static_scale, c->n, c->edges[s],
                           c->edges[s + 1], c->out, c->scratch + (size_t)s * c->scratch_bytes);
}

/* quasar_int8_linear over shares of blocks [edges[s], edges[s + 1]), s < shares, side by side in the OpenMP pool; 1 where
 * no runtime was handed in (the caller then shares them itself), else 0. scratch: shares x scratch_bytes. */
int quasar_int8_linear_shared(const float *x, int m, int k, const int8_t *packed, const int32_t *wsum, const float *w_scale,
                              const float *bias, const float *static_scale, int n, const int32_t *edges, int shares,
                              float *out, uint8_t *scratch, size_t scratch_bytes) {
    if (!omp_parallel) return 1;
    struct shared_call call = {x, w_scale, bias, static_scale, packed, wsum, edges, out, scratch, scratch_bytes, m, k, n, shares};
    omp_parallel(run_shares, &call, (unsigned)shares, 0);
    return 0;
}

/* Self-check, run in a child process before first use (an instruction this CPU lacks kills the child, not the
 * caller): codes at the extremes (255 x +-127, the sums 16-bit lanes would saturate) and odd shapes, against a
 * scalar sum. 0 when every value matches. */
int quasar_probe(void) {
    enum { M = 8, K = 203, N = 70 };
    static int8_t w[N * K], packed[((N + BLOCK - 1) / BLOCK) * BLOCK * ((K + 3) / 4 * 4)];
    static float x[M * K], out[M * N], ones[N];
    static uint8_t scratch[M * ((K + 3) / 4 * 4) + M * 4 + 64];
    int32_t wsum[N];
    unsigned state = 12345;
    for (int i = 0; i < N * K; i++) {
        state = state * 1103515245u + 12345u;
        w[i] = (int8_t)((int)(state >> 16) % 255 - 127);
    }
    for (int i = 0; i < N * K; i++)
        if (i % 7 == 0) w[i] = (i / 7) % 2 ? 127 : -127;
    for (int i = 0; i < M * K; i++) {
        state = state * 1103515245u + 12345u;
        x[i] = i % 5 == 0 ? 127.0f : (float)((int)(state >> 16) % 255 - 127);
    }
    for (int c = 0; c < N; c++) ones[c] = 1.0f;
    float unit = 1.0f;
    quasar_int8_pack(w, N, K, packed, wsum);
    quasar_int8_linear(x, M, K, packed, wsum, ones, NULL, &unit, N, 0, (N + BLOCK - 1) / BLOCK, out, scratch);
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) {
            int64_t sum = 0;
            for (int j = 0; j < K; j++) sum += (int64_t)x[r * K + j] * w[c * K + j];
            if ((float)sum != out[r * N + c]) return 1;
        }
    return 0;
}
