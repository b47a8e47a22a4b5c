/* The W8A8 linear of scheme.py on x86 vectors, for the cpu backend (quasar_deploy/cpu/int8_linear.py builds and
 * probes this file in four builds; cpu/linears.py offers it as the "quasar" int8 kernel).
 *
 * Why its own kernel: at verify sizes (1-16 rows) a linear is a pass over its weights, and the library kernels read
 * int8 weights more slowly than their bf16 kernels read twice the bytes, so a W8A8 step gained less than its bytes
 * promise (`quasar-deploy bench kernels --int8-kernels quasar,onednn-vnni,fbgemm-vnni` times them against each
 * other and the float kernel; its record is on docs/benchmarks.md). Here each thread streams one contiguous run of
 * packed weights.
 *
 * What it computes, bit for bit as scheme.reference_linear: per-token (or the calibrated static) activation scale
 * max|x| / 127 (at least 1e-12); codes rint(x / scale) clamped to [-127, 127]; the exact int32 sum of code x weight
 * over k; then y = float(acc) * scale * weight_scale (+ bias), in that order, with no fused multiply-add
 * (-ffp-contract=off). Integer sums are exact, so a row's result depends on nothing but that row: not on the rows
 * beside it, nor on which thread computed which columns.
 *
 * The builds (int8_linear.py's BUILDS) differ only in how they sum:
 * - AVX-512 VNNI (the default) and AVX-VNNI (-DQUASAR_YMM -DQUASAR_AVXVNNI: 256-bit vpdpbusd, Intel's client CPUs and
 *   Zen 5) take unsigned activations: codes + 128, and 128 x the weight row's sum is taken off after.
 * - AVX2 (-DQUASAR_YMM alone) has no 32-bit dot product. vpmaddubsw multiplies u8 by s8 and sums pairs into
 *   saturating 16 bits, which codes + 128 (up to 255 x 127 x 2) would overflow; so the activation's sign moves onto
 *   the weight (vpsignb: w x sgn(x)) and |x| <= 127 goes in unsigned: a pair is at most 2 x 127 x 127 = 32258, exact,
 *   and vpmaddwd widens pairs of pairs into the int32 sums. The codes stay signed there (CODE_SHIFT 0).
 *
 * Weights are packed once, zero-padded to whole 64-column blocks: the 512-bit builds lay a block out as
 * [k / 4][64][4], so one 64-byte load holds 4 values of k for 16 output columns; the 256-bit builds as two spans of
 * 32 columns one after the other, each [k / 4][32][4] (a 32-byte load: 4 values of k for 8 columns), so that the
 * span their four vectors cover streams as one contiguous run. A block of 64 columns is one contiguous run in all.
 *
 * Built with -DQUASAR_AMX (and the AMX flags), a call of more than one row goes through AMX tiles instead, in groups
 * of 16 rows (the last padded with zero codes), where k is whole 64-byte tile rows: a tile of 16 groups of k x 16
 * columns. There each 4 kB of a block (16 groups) holds its four column tiles whole, one kilobyte after another
 * (tiled_layout), which the tiles load faster than 16 rows 256 bytes apart; the vector loop, which a single row still
 * takes, reads its four vectors of a group a kilobyte apart. TDPBUSD sums u8 x s8 products exactly into int32 as
 * VPDPBUSD does: the same bits. The tiles stream weights from memory faster than the
 * vector loop at a verify step's 6 rows, and do a 48-row batched serving step's arithmetic several times faster.
 * With more rows (a prompt's) the tile loads, not the products, bound a call: the weights are taken in panels that
 * stay in L2 while every group of rows passes over them, and two groups at a time share each load of weights.
 * Linux hands out AMX state only to a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM):
 * quasar_int8_enable_amx asks; without it the first tile instruction faults (what a program built with -march=native
 * meets on CPUs that list the AMX flags).
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64 /* output columns per packed block: a thread's share is whole blocks */
#define GROUP 4  /* values of k per dot-product lane */
#ifdef QUASAR_YMM
#define LANES 8 /* int32 lanes per vector */
#ifdef QUASAR_AVXVNNI
#define ROWS 3 /* rows per pass: 3 x 4 accumulators and a row's codes in registers, the weights as memory operands */
#define CODE_SHIFT 128
#else
#define ROWS 2 /* rows per pass: 2 x 4 accumulators, 4 weights, a row's codes and their magnitudes, the ones */
#define CODE_SHIFT 0
#endif
#else
#define LANES 16
#define ROWS 6 /* rows per pass: 6 x 4 accumulators, the rest of the 32 vector registers hold weights */
#define CODE_SHIFT 128
#endif
#define SPAN (4 * LANES) /* output columns one pass of block_rows covers: four vectors; a block is whole spans */
/* from this many input values (rows x k) a shared call's threads quantize side by side: below it (a serving step's 48
 * rows of the narrower linears) a second parallel region costs about what halving the division saves */
#define SHARED_QUANTIZE_VALUES (1 << 17)
#define INLINE static inline __attribute__((always_inline))
#define AMX_DEPTH 64  /* bytes of k per tile row of codes: 16 groups of 4 */
#define TILE_ROW 64   /* bytes of one group of k for 16 columns: a tile row of weights, one vector */
#define TILE_BYTES (16 * TILE_ROW) /* a tile of weights: 16 groups x 16 columns, stored whole where tiled_layout */

#ifdef QUASAR_AMX
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16  /* rows of codes per tile; a call's last group is padded with zero codes */
#define PANEL_BYTES (256 << 10) /* packed weights per panel of blocks (tiles_linear): a share of L2 */
#define PAIRED_ROWS 48            /* rows past which tiles_linear pairs row tiles over panels */

/* Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), once per process: 0 when granted. */
int quasar_int8_enable_amx(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : 1; }

/* Tiles 0-3: 16 rows x 16 int32 sums (64 columns); 4: 16 rows x 64 bytes of codes; 5, 6: 16 groups of k x 16 columns. */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}

/* AMX_ROWS rows of codes against one packed block: their int32 sums into acc [AMX_ROWS][BLOCK]. */
static void block_tiles(const uint8_t *codes, size_t k4, const int8_t *block, int32_t (*acc)[SPAN]) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t j = 0; j < k4; j += AMX_DEPTH) {
        const int8_t *w = block + j * BLOCK; /* the 16 groups from j / 4 of the block: four tiles, one after another */
        _tile_loadd(4, codes + j, k4);
        _tile_loadd(5, w, TILE_ROW);
        _tile_dpbusd(0, 4, 5);
        _tile_loadd(6, w + TILE_BYTES, TILE_ROW);
        _tile_dpbusd(1, 4, 6);
        _tile_loadd(5, w + 2 * TILE_BYTES, TILE_ROW);
        _tile_dpbusd(2, 4, 5);
        _tile_loadd(6, w + 3 * TILE_BYTES, TILE_ROW);
        _tile_dpbusd(3, 4, 6);
    }
    _tile_stored(0, acc[0], BLOCK * sizeof(int32_t));
    _tile_stored(1, acc[0] + 16, BLOCK * sizeof(int32_t));
    _tile_stored(2, acc[0] + 32, BLOCK * sizeof(int32_t));
    _tile_stored(3, acc[0] + 48, BLOCK * sizeof(int32_t));
}
/* 2 x AMX_ROWS rows of codes against half a packed block (32 columns from half): their int32 sums into acc [32][BLOCK]
 * from column col. Two row tiles by two column tiles: four products per four tile loads, where block_tiles makes four
 * per five, and the rows' codes are read once per two column tiles. */
static void pair_tiles(const uint8_t *codes, size_t k4, const int8_t *half, int32_t (*acc)[SPAN], int col) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (size_t j = 0; j < k4; j += AMX_DEPTH) {
        const int8_t *w = half + j * BLOCK;
        _tile_loadd(4, codes + j, k4);
        _tile_loadd(6, w, TILE_ROW);
        _tile_dpbusd(0, 4, 6);
        _tile_loadd(7, w + TILE_BYTES, TILE_ROW);
        _tile_dpbusd(1, 4, 7);
        _tile_loadd(5, codes + AMX_ROWS * k4 + j, k4);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, acc[0] + col, BLOCK * sizeof(int32_t));
    _tile_stored(1, acc[0] + col + 16, BLOCK * sizeof(int32_t));
    _tile_stored(2, acc[AMX_ROWS] + col, BLOCK * sizeof(int32_t));
    _tile_stored(3, acc[AMX_ROWS] + col + 16, BLOCK * sizeof(int32_t));
}
#endif

static size_t round_up(size_t a, size_t b) { return (a + b - 1) / b * b; }

/* The arguments the entry points take, as int8_linear.py calls them: a new number whenever they change, so a library
 * prebuilt from another version's source ($QUASAR_KERNELS) is refused rather than called wrongly. */
int quasar_int8_interface(void) { return 2; }

#ifndef QUASAR_YMM
/* Whether a linear of k4 bytes of k keeps its blocks in the tiles' layout: the AMX build, where k is whole tile rows
 * (use_tiles). Each 4 kB of a block (16 groups of k) then holds its four column tiles one after another, 1 kB each,
 * where the vector layout interleaves them 64 bytes at a time: a tile loads from one contiguous kilobyte. */
static int tiled_layout(size_t k4) {
#ifdef QUASAR_AMX
    return k4 % AMX_DEPTH == 0;
#else
    (void)k4;
    return 0;
#endif
}
#endif

/* Where the 4 bytes of group g (of k / 4) for column c lie in a packed block of k4 bytes of k: c x 4 within the
 * group's 256 bytes; with tiled_layout, in column tile c / 16 of the 4 kB holding groups g / 16 x 16 onwards; in the
 * 256-bit builds, in span c / 32 (k4 x 32 bytes), c % 32 x 4 within the group's 128 bytes there. A group's part plus a
 * column's part (packed_offset(g, 0, k4) + packed_offset(0, c, k4)), so loops take each once. */
INLINE size_t packed_offset(size_t g, int c, size_t k4) {
#ifdef QUASAR_YMM
    return (size_t)(c / SPAN) * SPAN * k4 + g * SPAN * GROUP + (size_t)(c % SPAN) * GROUP;
#else
    if (!tiled_layout(k4)) return g * BLOCK * GROUP + (size_t)c * GROUP;
    return g / 16 * 4 * TILE_BYTES + (size_t)(c / 16) * TILE_BYTES + g % 16 * TILE_ROW + (size_t)(c % 16) * GROUP;
#endif
}

size_t quasar_int8_packed_bytes(int n, int k) { return round_up((size_t)n, BLOCK) * round_up((size_t)k, GROUP); }

/* w [n][k] int8 -> packed (quasar_int8_packed_bytes(n, k) bytes) and row sums wsum [n]. Written 4 bytes at a time in
 * order (in the tiled layout, in order within each 4 kB; in the 256-bit builds, within each span), from 64 rows read
 * side by side: an 8B model's 7 GB pack in seconds. */
void quasar_int8_pack(const int8_t *w, int n, int k, int8_t *packed, int32_t *wsum) {
    size_t k4 = round_up((size_t)k, GROUP), whole = (size_t)k / GROUP * GROUP;
    size_t column[BLOCK];
    for (int c = 0; c < BLOCK; c++) column[c] = packed_offset(0, c, k4);
    memset(packed, 0, round_up((size_t)n, BLOCK) * k4);
    for (int first = 0; first < n; first += BLOCK) {
        int rows = n - first < BLOCK ? n - first : BLOCK;
        int8_t *block = packed + (size_t)first * k4;
        for (size_t j = 0; j < whole; j += GROUP) {
            int8_t *group = block + packed_offset(j / GROUP, 0, k4);
            for (int c = 0; c < rows; c++) memcpy(group + column[c], w + (size_t)(first + c) * k + j, GROUP);
        }
        int8_t *last = block + packed_offset(whole / GROUP, 0, k4); /* k's last values, past its whole groups */
        for (int c = 0; c < rows; c++)
            for (size_t j = whole; j < (size_t)k; j++) last[column[c] + j - whole] = w[(size_t)(first + c) * k + j];
    }
    for (int c = 0; c < n; c++) {
        int32_t sum = 0;
        for (int j = 0; j < k; j++) sum += w[(size_t)c * k + j];
        wsum[c] = sum;
    }
}

#ifndef QUASAR_YMM
/* max |x| over a row of k values */
INLINE float row_max_abs(const float *row, int k) {
    __m512 top = _mm512_setzero_ps();
    for (int j = 0; j < k; j += 16) {
        __mmask16 lanes = k - j >= 16 ? 0xffff : (__mmask16)((1u << (k - j)) - 1);
        top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, row + j)));
    }
    return _mm512_reduce_max_ps(top);
}

/* A row's codes + CODE_SHIFT into out [k]. Vector lanes do what the reference does element by element: IEEE division,
 * round half to even, clamp. */
INLINE void row_codes(const float *row, int k, float scale, uint8_t *out) {
    const __m512 low = _mm512_set1_ps(-127.0f), high = _mm512_set1_ps(127.0f), divisor = _mm512_set1_ps(scale);
    const __m512i shift = _mm512_set1_epi32(CODE_SHIFT);
    for (int j = 0; j < k; j += 16) {
        __mmask16 lanes = k - j >= 16 ? 0xffff : (__mmask16)((1u << (k - j)) - 1);
        __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(lanes, row + j), divisor);
        q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm512_min_ps(_mm512_max_ps(q, low), high);
        _mm512_mask_cvtepi32_storeu_epi8(out + j, lanes, _mm512_add_epi32(_mm512_cvtps_epi32(q), shift));
    }
}

/* R rows of int32 sums acc [R][SPAN] of one span, from column on, to y = float(acc - 128 x wsum) * scale * w_scale
 * (+ bias) in out [R][n] (columns past n left alone) */
INLINE void finish(const int R, int32_t (*acc)[SPAN], const float *scales, const int32_t *wsum, const float *w_scale,
                   const float *bias, int column, int n, float *out) {
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

/* R rows of codes against one packed span of 64 output columns (a block), straight to y = float(acc) * scale *
 * w_scale (+ bias) in out [R][n] (columns past n left alone) */
INLINE void block_rows(const int R, const uint8_t *codes, size_t k4, const int8_t *block, const float *scales,
                       const int32_t *wsum, const float *w_scale, const float *bias, int column, int n, float *out) {
    __m512i sum[ROWS][4];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) sum[i][v] = _mm512_setzero_si512();
    const size_t vector = packed_offset(0, 16, k4); /* bytes from one 16-column vector of a group to the next */
    for (size_t g = 0; g < k4; g += GROUP) {
        const int8_t *w = block + packed_offset(g / GROUP, 0, k4);
        __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + vector);
        __m512i w2 = _mm512_loadu_si512(w + 2 * vector), w3 = _mm512_loadu_si512(w + 3 * vector);
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
    int32_t acc[ROWS][SPAN]; /* through memory: indexing the sums by a variable below would spill them in the loop */
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(acc[i] + 16 * v, sum[i][v]);
    finish(R, acc, scales, wsum, w_scale, bias, column, n, out);
}
#else
/* The first count of 8 lanes set, for AVX2's masked loads and stores. */
INLINE __m256i lanes_below(int count) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }

/* max |x| over a row of k values, 8 lanes at a time */
INLINE float row_max_abs(const float *row, int k) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 top = _mm256_setzero_ps();
    for (int j = 0; j < k; j += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_maskload_ps(row + j, lanes_below(k - j))));
    float lanes[8], most = 0.0f;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) most = fmaxf(most, lanes[i]);
    return most;
}

/* A row's codes (+ CODE_SHIFT) into out [k], as the 512-bit builds compute them, 8 lanes at a time. */
INLINE void row_codes(const float *row, int k, float scale, uint8_t *out) {
    const __m256 low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f), divisor = _mm256_set1_ps(scale);
    const __m256i shift = _mm256_set1_epi32(CODE_SHIFT);
    for (int j = 0; j < k; j += 8) {
        __m256 q = _mm256_div_ps(_mm256_maskload_ps(row + j, lanes_below(k - j)), divisor);
        q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q = _mm256_min_ps(_mm256_max_ps(q, low), high);
        __m256i i = _mm256_add_epi32(_mm256_cvtps_epi32(q), shift);
        __m128i pairs = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)); /* in order */
        __m128i bytes = CODE_SHIFT ? _mm_packus_epi16(pairs, pairs) : _mm_packs_epi16(pairs, pairs);
        if (k - j >= 8) _mm_storel_epi64((__m128i *)(out + j), bytes);
        else memcpy(out + j, &bytes, (size_t)(k - j));
    }
}

/* R rows of int32 sums acc [R][SPAN] of one span, from column on, to y = float(acc - CODE_SHIFT x wsum) * scale *
 * w_scale (+ bias) in out [R][n] (columns past n left alone) */
INLINE void finish(const int R, int32_t (*acc)[SPAN], const float *scales, const int32_t *wsum, const float *w_scale,
                   const float *bias, int column, int n, float *out) {
    for (int v = 0; v < 4; v++) {
        int c = column + 8 * v;
        if (c >= n) break;
        __m256i lanes = lanes_below(n - c);
        __m256i shifted = _mm256_mullo_epi32(_mm256_maskload_epi32(wsum + c, lanes), _mm256_set1_epi32(CODE_SHIFT));
        __m256 ws = _mm256_maskload_ps(w_scale + c, lanes), b = _mm256_maskload_ps(bias ? bias + c : w_scale + c, lanes);
        for (int i = 0; i < R; i++) {
            __m256 y = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_loadu_si256((const __m256i *)(acc[i] + 8 * v)), shifted));
            y = _mm256_mul_ps(_mm256_mul_ps(y, _mm256_set1_ps(scales[i])), ws);
            if (bias) y = _mm256_add_ps(y, b);
            _mm256_maskstore_ps(out + (size_t)i * n + c, lanes, y);
        }
    }
}

/* R rows of codes against one packed span of 32 output columns, straight to y = float(acc) * scale * w_scale (+ bias)
 * in out [R][n] (columns past n left alone) */
INLINE void block_rows(const int R, const uint8_t *codes, size_t k4, const int8_t *span, const float *scales,
                       const int32_t *wsum, const float *w_scale, const float *bias, int column, int n, float *out) {
    __m256i sum[ROWS][4];
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) sum[i][v] = _mm256_setzero_si256();
#ifndef QUASAR_AVXVNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (size_t g = 0; g < k4; g += GROUP) {
        const __m256i *w = (const __m256i *)(span + g * SPAN); /* group g / 4: 4 vectors of 8 columns */
        __m256i w0 = _mm256_loadu_si256(w), w1 = _mm256_loadu_si256(w + 1);
        __m256i w2 = _mm256_loadu_si256(w + 2), w3 = _mm256_loadu_si256(w + 3);
        for (int i = 0; i < R; i++) {
            int32_t four;
            memcpy(&four, codes + (size_t)i * k4 + g, sizeof four);
            __m256i x = _mm256_set1_epi32(four);
#ifdef QUASAR_AVXVNNI
            sum[i][0] = _mm256_dpbusd_avx_epi32(sum[i][0], x, w0);
            sum[i][1] = _mm256_dpbusd_avx_epi32(sum[i][1], x, w1);
            sum[i][2] = _mm256_dpbusd_avx_epi32(sum[i][2], x, w2);
            sum[i][3] = _mm256_dpbusd_avx_epi32(sum[i][3], x, w3);
#else
            __m256i size = _mm256_abs_epi8(x); /* |x| x (w x sgn x) = x x w, each pair of products within 16 bits */
            sum[i][0] = _mm256_add_epi32(sum[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(w0, x)), ones));
            sum[i][1] = _mm256_add_epi32(sum[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(w1, x)), ones));
            sum[i][2] = _mm256_add_epi32(sum[i][2], _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(w2, x)), ones));
            sum[i][3] = _mm256_add_epi32(sum[i][3], _mm256_madd_epi16(_mm256_maddubs_epi16(size, _mm256_sign_epi8(w3, x)), ones));
#endif
        }
    }
    int32_t acc[ROWS][SPAN]; /* through memory: indexing the sums by a variable below would spill them in the loop */
    for (int i = 0; i < R; i++)
        for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(acc[i] + 8 * v), sum[i][v]);
    finish(R, acc, scales, wsum, w_scale, bias, column, n, out);
}
#endif

/* codes (+ CODE_SHIFT) of m rows of x [m][k] into codes [m][k4] (zero-padded), their scales into scales [m]: the
 * per-token scale max|x| / 127 (at least 1e-12), or the static one. */
static void quantize(const float *x, int m, int k, const float *static_scale, uint8_t *codes, float *scales) {
    size_t k4 = round_up((size_t)k, GROUP);
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * k;
        scales[r] = static_scale ? *static_scale : fmaxf(row_max_abs(row, k) / 127.0f, 1e-12f);
        uint8_t *out = codes + (size_t)r * k4;
        memset(out, 0, k4);
        row_codes(row, k, scales[r], out);
    }
}

/* Rows of codes a call of m rows keeps: with the tiles, whole groups of 16 (the last padded with zero codes). */
static size_t code_rows(int m) {
#ifdef QUASAR_AMX
    return round_up((size_t)m, AMX_ROWS);
#else
    return (size_t)m;
#endif
}

/* Scratch bytes one call needs for m rows of k: the codes, then the scales. */
size_t quasar_int8_scratch_bytes(int m, int k) { return round_up(code_rows(m) * round_up((size_t)k, GROUP), 64) + (size_t)m * sizeof(float); }

#ifdef QUASAR_AMX
/* Blocks [first, last) of the rows' codes through the tiles, codes padded with zero rows to whole tiles. Past
 * PAIRED_ROWS rows (a prompt's) the weights go in panels that stay in L2 while every group of rows passes over them (from
 * memory once, for the first group), rows two tiles at a time (pair_tiles) where two remain; up to it (a serving step's
 * 8 x 6 rows) block by block, a group of rows at a time, each block's weights hot for the next group (bench batched-step
 * timed that order faster there). */
static void tiles_linear(const uint8_t *codes, const float *scales, int m, size_t k4, const int8_t *packed,
                         const int32_t *wsum, const float *w_scale, const float *bias, int n, int first, int last,
                         float *out) {
    amx_configure();
    int panel = (int)(PANEL_BYTES / (BLOCK * k4));
    int pairs = m > PAIRED_ROWS;
    panel = panel < 1 || !pairs ? 1 : panel;
    for (int p = first; p < last; p += panel) {
        int end = p + panel < last ? p + panel : last;
        for (int r = 0; r < m; r += pairs ? 2 * AMX_ROWS : AMX_ROWS) {
            const uint8_t *c = codes + (size_t)r * k4;
            float *y = out + (size_t)r * n;
            for (int b = p; b < end; b++) {
                const int8_t *block = packed + (size_t)b * BLOCK * k4;
                int32_t acc[2 * AMX_ROWS][SPAN];
                if (!pairs || m - r <= AMX_ROWS) {
                    block_tiles(c, k4, block, acc);
                    finish(m - r < AMX_ROWS ? m - r : AMX_ROWS, acc, scales + r, wsum, w_scale, bias, b * BLOCK, n, y);
                    continue;
                }
                pair_tiles(c, k4, block, acc, 0);
                pair_tiles(c, k4, block + 2 * TILE_BYTES, acc, 2 * AMX_ROWS);
                int second = m - r - AMX_ROWS < AMX_ROWS ? m - r - AMX_ROWS : AMX_ROWS;
                finish(AMX_ROWS, acc, scales + r, wsum, w_scale, bias, b * BLOCK, n, y);
                finish(second, acc + AMX_ROWS, scales + r + AMX_ROWS, wsum, w_scale, bias, b * BLOCK, n, y + (size_t)AMX_ROWS * n);
            }
        }
    }
    _tile_release();
}
#endif

/* Blocks [first, last) of the rows' codes on the vectors, span by span (a block in the 512-bit builds, half of one in
 * the 256-bit ones, each a contiguous run of k4 x SPAN bytes), ROWS rows a pass over a span. */
static void vector_linear(const uint8_t *codes, const float *scales, int m, size_t k4, const int8_t *packed,
                          const int32_t *wsum, const float *w_scale, const float *bias, int n, int first, int last,
                          float *out) {
    for (int column = first * BLOCK; column < last * BLOCK && column < n; column += SPAN) {
        const int8_t *span = packed + (size_t)column * k4;
        for (int r = 0; r < m; r += ROWS) {
            const uint8_t *c = codes + (size_t)r * k4;
            float *y = out + (size_t)r * n;
            switch (m - r < ROWS ? m - r : ROWS) { /* constant row counts: each unrolled, its sums in registers */
            case 1: block_rows(1, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
#if ROWS > 2
            case 2: block_rows(2, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
            case 3: block_rows(3, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
#endif
#if ROWS > 4
            case 4: block_rows(4, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
            case 5: block_rows(5, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
#endif
            default: block_rows(ROWS, c, k4, span, scales + r, wsum, w_scale, bias, column, n, y); break;
            }
        }
    }
}

/* Whether m rows of k go through the tiles: where k is whole tile rows, every call but a single row's (a 16-row tile
 * costs no more time than the vectors' 6 rows while the weights stream from memory, and a lone row is as fast on the
 * vectors). */
static int use_tiles(int m, size_t k4) {
#ifdef QUASAR_AMX
    return m > 1 && k4 % AMX_DEPTH == 0;
#else
    (void)m, (void)k4;
    return 0;
#endif
}

/* Blocks [first, last) of out from m rows of codes and scales (quantize's; with the tiles, padded to whole tiles). */
static void linear_from_codes(const uint8_t *codes, const float *scales, int m, size_t k4, const int8_t *packed,
                              const int32_t *wsum, const float *w_scale, const float *bias, int n, int first, int last,
                              float *out) {
#ifdef QUASAR_AMX
    if (use_tiles(m, k4)) {
        tiles_linear(codes, scales, m, k4, packed, wsum, w_scale, bias, n, first, last, out);
        return;
    }
#endif
    vector_linear(codes, scales, m, k4, packed, wsum, w_scale, bias, n, first, last, out);
}

/* Where a call's codes and scales lie in its scratch (quasar_int8_scratch_bytes), and the tiles' zero rows past m. */
static float *scales_in(uint8_t *scratch, int m, size_t k4) { return (float *)(scratch + round_up(code_rows(m) * k4, 64)); }

static void pad_codes(uint8_t *codes, int m, size_t k4) {
    if (use_tiles(m, k4)) memset(codes + (size_t)m * k4, 0, (code_rows(m) - (size_t)m) * k4);
}

/* out [m][n] = the scheme's linear of x [m][k], for the output columns of packed blocks [first, last). This caller
 * quantizes the rows itself into its own scratch, so threads calling it share nothing but read-only input. */
void quasar_int8_linear(const float *x, int m, int k, const int8_t *packed, const int32_t *wsum, const float *w_scale,
                        const float *bias, const float *static_scale, int n, int first, int last, float *out,
                        uint8_t *scratch) {
    size_t k4 = round_up((size_t)k, GROUP);
    float *scales = scales_in(scratch, m, k4);
    quantize(x, m, k, static_scale, scratch, scales);
    pad_codes(scratch, m, k4);
    linear_from_codes(scratch, scales, m, k4, packed, wsum, w_scale, bias, n, first, last, out);
}

/* Sharing a call's blocks among the threads of the caller's OpenMP pool (torch's): GOMP_parallel, omp_get_thread_num
 * and omp_get_num_threads of the runtime the process has loaded, handed in by int8_linear.py (libgomp and Intel's runtime
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
    float *out, *scales;
    uint8_t *codes;
    size_t k4;
    int m, k, n, shares;
};

static void run_quantize(void *data) { /* each thread its rows' codes, in the one buffer every share reads */
    const struct shared_call *c = data;
    int t = omp_thread(), threads = omp_threads();
    int begin = (int)((long)c->m * t / threads), end = (int)((long)c->m * (t + 1) / threads);
    quantize(c->x + (size_t)begin * c->k, end - begin, c->k, c->static_scale, c->codes + (size_t)begin * c->k4, c->scales + begin);
}

static void run_shares(void *data) {
    const struct shared_call *c = data;
    for (int s = omp_thread(); s < c->shares; s += omp_threads()) /* every share runs, however many threads came */
        linear_from_codes(c->codes, c->scales, c->m, c->k4, c->packed, c->wsum, c->w_scale, c->bias, c->n, c->edges[s],
                          c->edges[s + 1], c->out);
}

/* quasar_int8_linear over shares of blocks [edges[s], edges[s + 1]), s < shares, side by side in the OpenMP pool; 1 where
 * no runtime was handed in (the caller then shares them itself), else 0. The rows are quantized once, into scratch
 * (quasar_int8_scratch_bytes, one call's), by the pool's threads side by side from SHARED_QUANTIZE_VALUES values (a
 * division per value: a prompt's hundreds of rows make it a sizeable part of a call) and by this thread below: the same
 * codes either way, a row's depending on that row alone. */
int quasar_int8_linear_shared(const float *x, int m, int k, const int8_t *packed, const int32_t *wsum, const float *w_scale,
                              const float *bias, const float *static_scale, int n, const int32_t *edges, int shares,
                              float *out, uint8_t *scratch) {
    if (!omp_parallel) return 1;
    size_t k4 = round_up((size_t)k, GROUP);
    struct shared_call call = {x, w_scale, bias, static_scale, packed, wsum, edges, out, scales_in(scratch, m, k4), scratch, k4, m, k, n, shares};
    if ((size_t)m * k >= SHARED_QUANTIZE_VALUES) omp_parallel(run_quantize, &call, (unsigned)shares, 0);
    else quantize(x, m, k, static_scale, scratch, call.scales);
    pad_codes(scratch, m, k4);
    omp_parallel(run_shares, &call, (unsigned)shares, 0);
    return 0;
}

/* One self-check shape: m rows of k against n columns, codes at the extremes (255 x +-127, the sums 16-bit lanes would
 * saturate), against a scalar sum. 0 when every value matches. */
static int check(int m, int k, int n) {
    static int8_t w[70 * 256], packed[128 * 256];
    static float x[40 * 256], out[40 * 70], ones[70];
    static uint8_t scratch[48 * 256 + 40 * 4 + 64];
    int32_t wsum[70];
    unsigned state = 12345;
    for (int i = 0; i < n * k; i++) {
        state = state * 1103515245u + 12345u;
        w[i] = (int8_t)((int)(state >> 16) % 255 - 127);
    }
    for (int i = 0; i < n * k; i++)
        if (i % 7 == 0) w[i] = (i / 7) % 2 ? 127 : -127;
    for (int i = 0; i < m * k; i++) {
        state = state * 1103515245u + 12345u;
        x[i] = i % 5 == 0 ? 127.0f : (float)((int)(state >> 16) % 255 - 127);
    }
    for (int c = 0; c < n; c++) ones[c] = 1.0f;
    float unit = 1.0f;
    quasar_int8_pack(w, n, k, packed, wsum);
    quasar_int8_linear(x, m, k, packed, wsum, ones, NULL, &unit, n, 0, (n + BLOCK - 1) / BLOCK, out, scratch);
    for (int r = 0; r < m; r++)
        for (int c = 0; c < n; c++) {
            int64_t sum = 0;
            for (int j = 0; j < k; j++) sum += (int64_t)x[r * k + j] * w[c * k + j];
            if ((float)sum != out[r * n + c]) return 1;
        }
    return 0;
}

/* Self-check, run in a child process before first use (an instruction this CPU lacks kills the child, not the
 * caller): odd shapes and a lone row on the vector path, rows off its passes; with the tiles, 40 rows (the last group
 * padded) and a lone row beside. */
int quasar_probe(void) {
    if (check(8, 203, 70)) return 1;
#ifdef QUASAR_AMX
    if (quasar_int8_enable_amx()) return 2;
    if (check(40, 256, 70) || check(1, 256, 70)) return 3;
#else
    if (check(13, 256, 70) || check(1, 256, 70)) return 3;
#endif
    return 0;
}
