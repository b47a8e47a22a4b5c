/* Causal attention of new rows over each sequence's own cache, for ONNX Runtime's layer graphs on the CPU
 * (quasar_deploy/cpu/decoder_ops.py builds and probes this file; onnx_layered.py calls it).
 *
 * Why its own kernel: ORT's GroupQueryAttention multiplies head by head through a general GEMM that packs the whole
 * cache for every query head of every call, so at verify sizes (6 rows over a few hundred positions) a call costs
 * about as much as reading the cache ten times. Here the rows of one kv head's group share every load of its keys
 * and values, and one call serves every sequence of a step.
 *
 * Every value of a row depends on that row's query, its position and the cache below it, and on nothing else: each
 * score is one chain of fused multiply-adds over the head dimension in order; the softmax's sum and the weighted sum
 * of values run over the row's keys in order, lane by lane, and keys past the row's length enter as exact zeros. So a
 * row gives the same bits alone, in a block of any size, beside any other sequences and on any thread.
 *
 * Layout, per sequence and layer: keys [kv_heads][capacity / TILE][dim][TILE] (a score step reads W keys' d-th
 * components as one vector, and a tile is contiguous), values [kv_heads][capacity][dim]; capacity a multiple of TILE.
 * Built with W = 16 (AVX-512) or W = 8 (AVX2), whichever runs on the CPU (the caller probes by running it).
 *
 * For the torch decoder the kernel also does a layer's row-wise work around its linears (quasar_rows: RMSNorm, the
 * MLP's SiLU gate; the q/k norms and rotary inside quasar_attend, see struct projection): in torch these are some forty
 * small ops a layer, each a dispatch and a pass over a few kilobytes, which cost a verify step about a quarter of its
 * time. Each is a function of its row alone, so the independence of a row's bits holds for them too.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef W
#error "W (floats per vector) must be defined"
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef float vfu __attribute__((vector_size(W * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

#define TILE 16
/* Register blocking, sized to the vector registers (32 with AVX-512, 16 with AVX2): the scores of up to ROWS rows
 * (12: 6 verify rows of a group of 2 query heads) take ROWS x KEYS accumulators, a pass over the values PV_ROWS x 4. */
#if W == 16
#define KEYS 2
#define PV_ROWS 6
#else
#define KEYS 1
#define PV_ROWS 2
#endif
#define ROWS 12
#define FEW 4 /* at most this many rows (a decode step's group) take a narrower pass: no work on spare rows */
#define INLINE static inline __attribute__((always_inline))

static inline vf load(const float *p) { return *(const vfu *)p; }
static inline void store(float *p, vf x) { *(vfu *)p = x; }
static inline vf splat(float x) { return __builtin_shuffle((vf){x}, (vi){0}); }

static inline vf pick(vi mask, vf a, vf b) { /* mask ? a : b, lane by lane: C has no vector conditional */
    vi ia, ib, r;
    vf out;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    r = (mask & ia) | (~mask & ib);
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp for x <= 0 (scores less their maximum): Cephes' expf, a reduction by ln 2 and a degree-5 polynomial; 0 below
 * -87.3. */
static inline vf vexp(vf x) {
    const vf lo = splat(-87.33654f);
    vi small = x < lo;
    x = pick(small, lo, x);
    vf t = x * 1.44269504088896341f + 0.5f;
    vf fn = __builtin_convertvector(__builtin_convertvector(t, vi), vf);
    fn = pick(fn > t, fn - 1.0f, fn); /* floor */
    vi n = __builtin_convertvector(fn, vi);
    vf r = x - fn * 0.693359375f;
    r = r - fn * -2.12194440e-4f;
    vf p = splat(1.9875691500E-4f);
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    vi bits = (n + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return pick(small, splat(0.0f), p * scale);
}

static inline float hsum(vf x) { /* lanes in order */
    float s = 0.0f;
    for (int i = 0; i < W; i++) s += x[i];
    return s;
}

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < W; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float *key_at(float *keys, int position, int d, int dim) {
    return keys + ((size_t)(position / TILE) * dim + d) * TILE + position % TILE;
}

/* The scores of R rows (R and C constants where inlined; rows <= R of them stored) for keys [j * W, (j + C) * W),
 * C <= KEYS, into scratch (row i at i * stride). */
INLINE void scores(int R, int C, int rows, const float *const *q, float *keys, int j, int dim, float scale,
                   float *scratch, int stride) {
    vf acc[ROWS][KEYS];
    for (int i = 0; i < R; i++)
        for (int c = 0; c < C; c++) acc[i][c] = (vf){0};
    for (int d = 0; d < dim; d++) {
        vf k[KEYS];
        for (int c = 0; c < C; c++) k[c] = load(key_at(keys, (j + c) * W, d, dim));
        for (int i = 0; i < R; i++) {
            vf qd = splat(q[i][d]);
            for (int c = 0; c < C; c++) acc[i][c] += qd * k[c];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < C; c++) store(scratch + (size_t)i * stride + (size_t)(j + c) * W, acc[i][c] * scale);
}

/* out_i[c .. c + V * W) = inv_i * sum over t < last of weights_i[t] V[t][c ..], for R rows (R and V constants where
 * inlined; rows <= R of them stored). Past a row's own length its weights are exact zeros. */
INLINE void weigh_chunk(int R, int V, int rows, const float *const *p, int last, float *const *out, const float *values,
                        int dim, int c, const float *inv) {
    vf acc[PV_ROWS][4];
    for (int i = 0; i < R; i++)
        for (int e = 0; e < V; e++) acc[i][e] = (vf){0};
    const float *v = values + c;
    for (int t = 0; t < last; t++, v += dim) {
        vf vv[4];
        for (int e = 0; e < V; e++) vv[e] = load(v + e * W);
        for (int i = 0; i < R; i++) {
            vf pt = splat(p[i][t]);
            for (int e = 0; e < V; e++) acc[i][e] += pt * vv[e];
        }
    }
    for (int i = 0; i < rows; i++)
        for (int e = 0; e < V; e++) store(out[i] + c + e * W, acc[i][e] * inv[i]);
}

/* out_i = inv_i * sum over t < len_i of weights_i[t] V[t], for R rows (a constant where inlined; rows <= R stored). */
INLINE void weigh_values(int R, int rows, const float *weights, int stride, const int *len, float *const *out,
                         const float *values, int dim, const float *inv) {
    const float *p[PV_ROWS];
    int last = 0;
    for (int i = 0; i < R; i++) {
        int row = i < rows ? i : rows - 1;
        p[i] = weights + (size_t)row * stride;
        last = len[row] > last ? len[row] : last;
    }
    int c = 0;
    for (; c + 4 * W <= dim; c += 4 * W) weigh_chunk(R, 4, rows, p, last, out, values, dim, c, inv);
    switch ((dim - c) / W) {
    case 3: weigh_chunk(R, 3, rows, p, last, out, values, dim, c, inv); break;
    case 2: weigh_chunk(R, 2, rows, p, last, out, values, dim, c, inv); break;
    case 1: weigh_chunk(R, 1, rows, p, last, out, values, dim, c, inv); break;
    }
}

/* Up to ROWS query rows over one kv head: out_i = softmax(scale * q_i . K[:len_i]) V[:len_i]. */
static void attend_rows(int rows, const float *const *q, const int *len, float *const *out, float *keys,
                        const float *values, int dim, float scale, float *scratch) {
    int longest = 0;
    for (int i = 0; i < rows; i++) longest = len[i] > longest ? len[i] : longest;
    int blocks = (longest + W - 1) / W, stride = blocks * W;
    const float *qq[ROWS];
    for (int i = 0; i < ROWS; i++) qq[i] = q[i < rows ? i : rows - 1]; /* spare rows repeat the last, unstored */
    int j = 0;
    if (rows <= FEW) {
        for (; j + KEYS <= blocks; j += KEYS) scores(FEW, KEYS, rows, qq, keys, j, dim, scale, scratch, stride);
        for (; j < blocks; j++) scores(FEW, 1, rows, qq, keys, j, dim, scale, scratch, stride);
    } else {
        for (; j + KEYS <= blocks; j += KEYS) scores(ROWS, KEYS, rows, qq, keys, j, dim, scale, scratch, stride);
        for (; j < blocks; j++) scores(ROWS, 1, rows, qq, keys, j, dim, scale, scratch, stride);
    }
    float inv[ROWS];
    vi lane;
    for (int l = 0; l < W; l++) lane[l] = l;
    for (int i = 0; i < rows; i++) {
        float *s = scratch + (size_t)i * stride;
        int whole = len[i] / W; /* vectors wholly within the row's keys; the next one holds its tail */
        if (whole < blocks) store(s + whole * W, pick(lane < len[i] - whole * W, load(s + whole * W), splat(-3.0e38f)));
        for (int b = whole + 1; b < blocks; b++) store(s + b * W, splat(-3.0e38f));
        vf m = load(s);
        for (int b = 1; b < blocks; b++) m = pick(load(s + b * W) > m, load(s + b * W), m);
        vf top = splat(hmax(m)), total = {0};
        for (int b = 0; b < blocks; b++) {
            vf e = vexp(load(s + b * W) - top);
            store(s + b * W, e);
            total += e;
        }
        inv[i] = 1.0f / hsum(total);
    }
    for (int i0 = 0; i0 < rows;) {
        if (rows - i0 <= 2) {
            weigh_values(2, rows - i0, scratch + (size_t)i0 * stride, stride, len + i0, out + i0, values, dim, inv + i0);
            i0 = rows;
        } else {
            int here = rows - i0 < PV_ROWS ? rows - i0 : PV_ROWS;
            weigh_values(PV_ROWS, here, scratch + (size_t)i0 * stride, stride, len + i0, out + i0, values, dim, inv + i0);
            i0 += here;
        }
    }
}

/* How a call's q, k and v rows arrive. NULL (ONNX Runtime's layer graphs): q [rows][heads * dim], k and v [rows][kv_heads
 * * dim], normed and rotated already. Else (the torch decoder) q, k and v are the columns of one projection [rows][stride]
 * (q's heads, then k's, then v's), and the kernel applies q_norm / k_norm (RMSNorm over a head, where given) and the
 * rotary embedding (cos, sin: [rows][dim], rotate-half) itself: a row's rotated q waits in its out row, which only its
 * own attention overwrites, after reading it. */
struct projection {
    const float *cos, *sin, *q_norm, *k_norm;
    float eps;
    int stride;
};

/* 1 / sqrt(mean of x^2 + eps) over n floats: W lanes, then the lanes in order. */
static float inverse_rms(const float *x, int n, float eps) {
    vf acc = {0};
    int i = 0;
    for (; i + W <= n; i += W) acc += load(x + i) * load(x + i);
    float sum = hsum(acc);
    for (; i < n; i++) sum += x[i] * x[i];
    return 1.0f / sqrtf(sum / (float)n + eps);
}

/* One row: out = weight * (x * inverse_rms(x)), torch's RMSNorm in float32 (quasar_rows' RMS_NORM, and a q/k norm). */
static void rms_norm_row(int dim, const float *x, const float *weight, float eps, float *out) {
    float inv = inverse_rms(x, dim, eps);
    int d = 0;
    for (; d + W <= dim; d += W) store(out + d, load(weight + d) * (load(x + d) * inv));
    for (; d < dim; d++) out[d] = weight[d] * (x[d] * inv);
}

/* One head's vector x: RMSNorm with weight (where given), then rotate-half rotary at this row's cos and sin, into y. */
static void norm_rotate(const float *x, const float *weight, float eps, const float *cos, const float *sin, int dim,
                        float *y) {
    float normed[dim];
    if (weight) rms_norm_row(dim, x, weight, eps, normed);
    else memcpy(normed, x, dim * sizeof(float));
    int half = dim / 2, d = 0;
    for (; d + W <= half; d += W) {
        vf low = load(normed + d), high = load(normed + d + half);
        store(y + d, low * load(cos + d) - high * load(sin + d));
        store(y + d + half, high * load(cos + d + half) + low * load(sin + d + half));
    }
    for (; d < half; d++) {
        y[d] = normed[d] * cos[d] - normed[d + half] * sin[d];
        y[d + half] = normed[d + half] * cos[d + half] + normed[d] * sin[d + half];
    }
}

/* Items [begin, end) of the (sequence, kv head) pairs, sequence-major. For each: write the sequence's new rows' keys
 * and values for that head into its cache at past .. past + count - 1, then attend each of its rows for each query
 * head of the group. q and out: [rows][heads * dim]; k and v: [rows][kv_heads * dim]; a sequence's rows are
 * row_start .. row_start + count - 1. scratch: ROWS * round_up(longest length, W) floats. */
void quasar_attend(int begin, int end, const float *q, const float *k, const float *v, float *out,
                   const int64_t *key_caches, const int64_t *value_caches, const int32_t *capacities,
                   const int32_t *pasts, const int32_t *row_start, const int32_t *row_count, int heads, int kv_heads,
                   int dim, float scale, const struct projection *projection, float *scratch) {
    int group = heads / kv_heads;
    size_t q_stride = projection ? (size_t)projection->stride : (size_t)heads * dim;
    size_t kv_stride = projection ? (size_t)projection->stride : (size_t)kv_heads * dim;
    for (int item = begin; item < end; item++) {
        int s = item / kv_heads, h = item % kv_heads;
        int capacity = capacities[s], past = pasts[s], r0 = row_start[s], n = row_count[s];
        float *keys = (float *)(intptr_t)key_caches[s] + (size_t)h * dim * capacity;
        float *values = (float *)(intptr_t)value_caches[s] + (size_t)h * capacity * dim;
        for (int r = 0; r < n; r++) {
            const float *kr = k + (size_t)(r0 + r) * kv_stride + (size_t)h * dim;
            float rotated[dim];
            if (projection) {
                const struct projection *p = projection;
                size_t at = (size_t)(r0 + r) * dim;
                norm_rotate(kr, p->k_norm, p->eps, p->cos + at, p->sin + at, dim, rotated);
                kr = rotated;
                for (int g = 0; g < group; g++) { /* this head group's q rows, rotated into their out rows */
                    size_t head = (size_t)(h * group + g) * dim;
                    norm_rotate(q + (size_t)(r0 + r) * q_stride + head, p->q_norm, p->eps, p->cos + at, p->sin + at,
                                dim, out + (size_t)(r0 + r) * heads * dim + head);
                }
            }
            for (int d = 0; d < dim; d++) *key_at(keys, past + r, d, dim) = kr[d];
            memcpy(values + (size_t)(past + r) * dim, v + (size_t)(r0 + r) * kv_stride + (size_t)h * dim,
                   dim * sizeof(float));
        }
        for (int i0 = 0; i0 < n * group; i0 += ROWS) { /* rows in order, each with its group's heads */
            int rows = n * group - i0 < ROWS ? n * group - i0 : ROWS;
            const float *qs[ROWS];
            float *outs[ROWS];
            int lens[ROWS];
            for (int i = 0; i < rows; i++) {
                int r = (i0 + i) / group;
                size_t head = (size_t)(h * group + (i0 + i) % group) * dim;
                outs[i] = out + (size_t)(r0 + r) * heads * dim + head;
                qs[i] = projection ? outs[i] : q + (size_t)(r0 + r) * q_stride + head;
                lens[i] = past + r + 1;
            }
            attend_rows(rows, qs, lens, outs, keys, values, dim, scale, scratch);
        }
    }
}

/* Sharing a step's items among the threads of the caller's OpenMP pool (torch's, for the torch decoder): GOMP_parallel,
 * omp_get_thread_num and omp_get_num_threads of the runtime the process has loaded, handed in by decoder_ops.py as
 * int8_linear.c takes them. Its workers are torch's own, often still spinning from its last op, so a share costs a few
 * microseconds to hand over where a thread of ours costs a wake-up, and no third thread contends for two cores. */
typedef void (*parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*count_fn)(void);
static parallel_fn omp_parallel;
static count_fn omp_thread, omp_threads;

void quasar_attend_use_openmp(void *parallel, void *thread_num, void *num_threads) {
    omp_parallel = (parallel_fn)parallel;
    omp_thread = (count_fn)thread_num;
    omp_threads = (count_fn)num_threads;
}

struct shared_call {
    const float *q, *k, *v;
    float *out;
    const int64_t *key_caches, *value_caches;
    const int32_t *capacities, *pasts, *row_start, *row_count, *edges;
    int heads, kv_heads, dim, shares;
    float scale;
    const struct projection *projection;
    float *scratch;
    size_t scratch_floats;
};

static void run_shares(void *data) {
    const struct shared_call *c = data;
    for (int s = omp_thread(); s < c->shares; s += omp_threads()) /* every share runs, however many threads came */
        quasar_attend(c->edges[s], c->edges[s + 1], c->q, c->k, c->v, c->out, c->key_caches, c->value_caches,
                      c->capacities, c->pasts, c->row_start, c->row_count, c->heads, c->kv_heads, c->dim, c->scale,
                      c->projection, c->scratch + (size_t)s * c->scratch_floats);
}

/* quasar_attend over shares of items [edges[s], edges[s + 1]), s < shares, side by side in the OpenMP pool; 1 where no
 * runtime was handed in (the caller then shares them itself), else 0. scratch: shares x scratch_floats. */
int quasar_attend_shared(const int32_t *edges, int shares, const float *q, const float *k, const float *v, float *out,
                         const int64_t *key_caches, const int64_t *value_caches, const int32_t *capacities,
                         const int32_t *pasts, const int32_t *row_start, const int32_t *row_count, int heads,
                         int kv_heads, int dim, float scale, const struct projection *projection, float *scratch,
                         size_t scratch_floats) {
    if (!omp_parallel) return 1;
    struct shared_call call = {q,         k,         v,     out,   key_caches, value_caches, capacities, pasts,
                               row_start, row_count, edges, heads, kv_heads,   dim,          shares,     scale,
                               projection, scratch,  scratch_floats};
    omp_parallel(run_shares, &call, (unsigned)shares, 0);
    return 0;
}

/* The row-wise ops of quasar_rows. */
enum { RMS_NORM = 0, SILU_GATE = 1 };

/* One row: x [2 * dim] holds gate then up; out [dim] = silu(gate) * up, silu(g) = g / (1 + exp(-g)) computed with
 * vexp's argument at most 0 on either side of 0. */
static void silu_gate_row(int dim, const float *x, float *out) {
    const float *gate = x, *up = x + dim;
    int d = 0;
    for (; d + W <= dim; d += W) {
        vf g = load(gate + d);
        vi negative = g < 0.0f;
        vf e = vexp(pick(negative, g, -g)); /* exp(-|g|) */
        vf sigmoid = pick(negative, e, splat(1.0f)) / (1.0f + e);
        store(out + d, g * sigmoid * load(up + d));
    }
    for (; d < dim; d++) {
        float g = gate[d], e = expf(-fabsf(g));
        out[d] = g * ((g < 0.0f ? e : 1.0f) / (1.0f + e)) * up[d];
    }
}

/* bf16 <-> float32: a bf16 value is the top half of a float32's bits; narrowing rounds to nearest, ties to even (as
 * torch's conversion does for finite values). */
static void widen(const uint16_t *in, int n, float *out) {
    for (int i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)in[i] << 16;
        memcpy(out + i, &bits, sizeof bits);
    }
}

static void narrow(const float *in, int n, uint16_t *out) {
    for (int i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, in + i, sizeof bits);
        out[i] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
}

/* Rows [begin, end): in float32, x and out float32 or (bf16) bf16, a row widened in and its result narrowed out. */
static void rows_op(int op, int begin, int end, int dim, const void *x, const float *weight, float eps, void *out,
                    int bf16) {
    int width = op == SILU_GATE ? 2 * dim : dim;
    float row[bf16 ? width : 1], result[bf16 ? dim : 1];
    for (int r = begin; r < end; r++) {
        const float *xr = bf16 ? row : (const float *)x + (size_t)r * width;
        float *o = bf16 ? result : (float *)out + (size_t)r * dim;
        if (bf16) widen((const uint16_t *)x + (size_t)r * width, width, row);
        if (op == RMS_NORM) rms_norm_row(dim, xr, weight, eps, o);
        else silu_gate_row(dim, xr, o);
        if (bf16) narrow(result, dim, (uint16_t *)out + (size_t)r * dim);
    }
}

struct rows_call {
    int op, rows, dim, shares, bf16;
    const void *x;
    const float *weight;
    float eps;
    void *out;
};

static void run_row_shares(void *data) {
    const struct rows_call *c = data;
    for (int s = omp_thread(); s < c->shares; s += omp_threads())
        rows_op(c->op, (int)((long)c->rows * s / c->shares), (int)((long)c->rows * (s + 1) / c->shares), c->dim, c->x,
                c->weight, c->eps, c->out, c->bf16);
}

/* Op RMS_NORM (x, out [rows][dim]; weight [dim], float32) or SILU_GATE (x [rows][2 * dim], out [rows][dim]) over all
 * rows, x and out float32 or, with bf16, both bf16 (a bf16 decoder's, computed in float32 all the same), in `shares`
 * pieces of about equal rows side by side in the OpenMP pool where one was handed in (a prompt's hundreds of rows),
 * else here. */
void quasar_rows(int op, int rows, int dim, const void *x, const float *weight, float eps, void *out, int bf16,
                 int shares) {
    if (shares > 1 && omp_parallel) {
        struct rows_call call = {op, rows, dim, shares, bf16, x, weight, eps, out};
        omp_parallel(run_row_shares, &call, (unsigned)shares, 0);
    } else {
        rows_op(op, 0, rows, dim, x, weight, eps, out, bf16);
    }
}

/* Rows of scratch a call needs, each as long as its longest row's keys rounded up to a vector. */
int quasar_scratch_rows(void) { return ROWS; }

/* A pseudo-random float in [-1, 1) from `state` (a variable of the caller). */
#define NEXT() ((state = state * 1103515245u + 12345u) >> 9) * (1.0f / 8388608.0f) - 1.0f

/* The projection path against the plain one: q and k normed and rotated here (in double), then attended as given. */
static int probe_projection(void) {
    enum { HEADS = 4, KV = 2, DIM = 2 * W, CAP = 32, N = 3, STRIDE = (HEADS + 2 * KV) * DIM };
    static float qkv[N * STRIDE], q[N * HEADS * DIM], k[N * KV * DIM], v[N * KV * DIM], cs[N * DIM], sn[N * DIM];
    static float qn[DIM], kn[DIM], out[N * HEADS * DIM], plain[N * HEADS * DIM], scratch[ROWS * CAP];
    static float caches[2][2][KV * CAP * DIM];
    unsigned state = 777;
    for (int i = 0; i < N * STRIDE; i++) qkv[i] = NEXT();
    for (int i = 0; i < N * DIM; i++) {
        cs[i] = NEXT();
        sn[i] = NEXT();
    }
    for (int d = 0; d < DIM; d++) {
        qn[d] = 1.0f + NEXT() / 4;
        kn[d] = 1.0f + NEXT() / 4;
    }
    const float eps = 1e-6f;
    for (int r = 0; r < N; r++)
        for (int head = 0; head < HEADS + KV; head++) {
            const float *x = qkv + r * STRIDE + head * DIM, *weight = head < HEADS ? qn : kn;
            float *y = head < HEADS ? q + (r * HEADS + head) * DIM : k + (r * KV + head - HEADS) * DIM;
            double sum = 0, normed[DIM];
            for (int d = 0; d < DIM; d++) sum += (double)x[d] * x[d];
            for (int d = 0; d < DIM; d++) normed[d] = weight[d] * x[d] / sqrt(sum / DIM + eps);
            for (int d = 0; d < DIM; d++)
                y[d] = (float)(normed[d] * cs[r * DIM + d] +
                               (d < DIM / 2 ? -normed[d + DIM / 2] : normed[d - DIM / 2]) * sn[r * DIM + d]);
        }
    for (int r = 0; r < N; r++)
        memcpy(v + r * KV * DIM, qkv + r * STRIDE + (HEADS + KV) * DIM, KV * DIM * sizeof(float));
    int64_t kc[2], vc[2];
    for (int c = 0; c < 2; c++) {
        kc[c] = (int64_t)(intptr_t)caches[c][0];
        vc[c] = (int64_t)(intptr_t)caches[c][1];
    }
    int32_t cap = CAP, past = 0, start = 0, count = N;
    struct projection projection = {cs, sn, qn, kn, eps, STRIDE};
    quasar_attend(0, KV, qkv, qkv + HEADS * DIM, qkv + (HEADS + KV) * DIM, out, &kc[0], &vc[0], &cap, &past, &start,
                  &count, HEADS, KV, DIM, 0.25f, &projection, scratch);
    quasar_attend(0, KV, q, k, v, plain, &kc[1], &vc[1], &cap, &past, &start, &count, HEADS, KV, DIM, 0.25f, NULL,
                  scratch);
    for (int i = 0; i < N * HEADS * DIM; i++)
        if (fabsf(out[i] - plain[i]) > 1e-5f) return 1;
    return 0;
}

/* The row ops against double precision, over a width with a tail past the last whole vector. */
static int probe_rows(void) {
    enum { ROWS_ = 3, DIM = 2 * W + 3 };
    static float x[ROWS_ * 2 * DIM], weight[DIM], out[ROWS_ * 2 * DIM];
    unsigned state = 4242;
    for (int i = 0; i < ROWS_ * 2 * DIM; i++) x[i] = 12.0f * NEXT();
    for (int d = 0; d < DIM; d++) weight[d] = NEXT();
    quasar_rows(RMS_NORM, ROWS_, DIM, x, weight, 1e-6f, out, 0, 1);
    for (int r = 0; r < ROWS_; r++) {
        double sum = 0;
        for (int d = 0; d < DIM; d++) sum += (double)x[r * DIM + d] * x[r * DIM + d];
        for (int d = 0; d < DIM; d++) {
            double want = weight[d] * x[r * DIM + d] / sqrt(sum / DIM + 1e-6);
            if (fabs(out[r * DIM + d] - want) > 1e-5 * (1 + fabs(want))) return 1;
        }
    }
    quasar_rows(SILU_GATE, ROWS_, DIM, x, NULL, 0.0f, out, 0, 1);
    for (int r = 0; r < ROWS_; r++)
        for (int d = 0; d < DIM; d++) {
            double g = x[r * 2 * DIM + d], want = g / (1 + exp(-g)) * x[r * 2 * DIM + DIM + d];
            if (fabs(out[r * DIM + d] - want) > 1e-5 * (1 + fabs(want))) return 1;
        }
    /* bf16 rows: the float32 result of the widened row, rounded once */
    static uint16_t half_in[ROWS_ * DIM], half_out[ROWS_ * DIM], want[ROWS_ * DIM];
    narrow(x, ROWS_ * DIM, half_in);
    widen(half_in, ROWS_ * DIM, x);
    quasar_rows(RMS_NORM, ROWS_, DIM, x, weight, 1e-6f, out, 0, 1);
    narrow(out, ROWS_ * DIM, want);
    quasar_rows(RMS_NORM, ROWS_, DIM, half_in, weight, 1e-6f, half_out, 1, 1);
    return memcmp(half_out, want, sizeof want) != 0;
}

/* Runs the kernel on a small case against a plain double-precision reference: 0 when they agree. Called in a child
 * process, so a CPU without this build's instructions fails the probe instead of the caller. */
int quasar_probe(void) {
    enum { HEADS = 4, KV = 2, DIM = 2 * W + W, CAP = 64, PAST = 21, N = 3 };
    static float keys[KV * CAP * DIM], values[KV * CAP * DIM], q[N * HEADS * DIM], k[N * KV * DIM], v[N * KV * DIM];
    static float out[N * HEADS * DIM], scratch[ROWS * CAP];
    unsigned state = 12345;
    float kp[KV][CAP][DIM];
    for (int h = 0; h < KV; h++)
        for (int t = 0; t < PAST; t++)
            for (int d = 0; d < DIM; d++) {
                kp[h][t][d] = NEXT();
                *key_at(keys + (size_t)h * DIM * CAP, t, d, DIM) = kp[h][t][d];
                values[((size_t)h * CAP + t) * DIM + d] = NEXT();
            }
    for (int i = 0; i < N * HEADS * DIM; i++) q[i] = NEXT();
    for (int i = 0; i < N * KV * DIM; i++) {
        k[i] = NEXT();
        v[i] = NEXT();
    }
    int64_t kc = (int64_t)(intptr_t)keys, vc = (int64_t)(intptr_t)values;
    int32_t cap = CAP, past = PAST, start = 0, count = N;
    float scale = 0.125f;
    quasar_attend(0, KV, q, k, v, out, &kc, &vc, &cap, &past, &start, &count, HEADS, KV, DIM, scale, NULL, scratch);
    for (int r = 0; r < N; r++)
        for (int hq = 0; hq < HEADS; hq++) {
            int h = hq / (HEADS / KV), len = PAST + r + 1;
            double s[CAP], top = -1e300, total = 0;
            for (int t = 0; t < len; t++) {
                const float *kt = t < PAST ? kp[h][t] : k + (size_t)(t - PAST) * KV * DIM + h * DIM;
                s[t] = 0;
                for (int d = 0; d < DIM; d++) s[t] += (double)q[(r * HEADS + hq) * DIM + d] * kt[d];
                s[t] *= scale;
                top = s[t] > top ? s[t] : top;
            }
            for (int t = 0; t < len; t++) total += (s[t] = exp(s[t] - top));
            for (int d = 0; d < DIM; d++) {
                double o = 0;
                for (int t = 0; t < len; t++)
                    o += s[t] * (t < PAST ? values[((size_t)h * CAP + t) * DIM + d] : v[(t - PAST) * KV * DIM + h * DIM + d]);
                if (fabs(o / total - out[(r * HEADS + hq) * DIM + d]) > 1e-5) return 1;
            }
        }
    return probe_projection() || probe_rows();
}
