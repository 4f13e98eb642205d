/* Products of a GGUF file's quantized matrices with 8-bit activations, as llama.cpp computes
 * them: each block of 32 inputs rounded to bytes with one scale (Q8_0 / Q8_1), the bytes
 * multiplied by the weights' own 4-, 5- or 8-bit integers and summed exactly in 32 bits, then
 * scaled: y = sum over blocks of (d_w * d_x) * isum (+ m_w * s_x for Q4_1 and Q5_1). Q4_0's
 * and Q5_0's integers are unsigned less 8 or 16: isum = sum(q x) - 8 (16) sum(x), the same
 * integer as llama.cpp's sum((q - 8) x).
 *
 * Weights are repacked once into panels of 16 rows: for each block of 32 columns, 16 rows'
 * integers lie so that one 64-byte load holds 4 consecutive columns of each of the 16 rows,
 * the operand of one VNNI instruction (vpdpbusd: 16 lanes, each summing 4 byte products).
 * Every variant (scalar, AVX2, AVX-VNNI, AVX-512 VNNI) does the same integer sums and then
 * the same float operations in the same order (no fused multiply-add), so they agree bit for
 * bit; tests/nn/test_native_quant.py holds each to a float64 reference. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qkv_native.h"

#if defined(QKV_X86)
#include <immintrin.h>
#endif

enum { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q5_0 = 3, Q5_1 = 4 };
#define QK 32   /* columns per block */
#define ROWS 16 /* rows per panel */
#define MTILE 32 /* activation rows per pass over a thread's panels (prefill) */

/* Q4_0 and Q4_1 panels hold two integers a byte; Q8_0's one signed byte a weight; Q5_0's and
 * Q5_1's the low four bits as Q4_0's, then a plane of the fifth bits (FIFTHS) */
static int64_t panel_block_bytes(int fmt) {
    return fmt == Q8_0 ? ROWS * QK : fmt >= Q5_0 ? ROWS * QK / 2 + ROWS * QK / 8 : ROWS * QK / 2;
}

/* A Q5 panel block's fifth bits: 64 bytes after its 256 of nibbles, byte 4r + j of row r
 * holding, in bits 2s and 2s + 1, the fifth bits of the columns whose low bits are in the low
 * and the high nibble of step s's byte 4r + j (columns 4s + j and 16 + 4s + j). One 64-byte
 * load serves the block's 4 steps: step s's are shifted to bit 4 of each byte. */
#define FIFTHS (ROWS * QK / 2)

/* what each unsigned integer stands for less: Q4_0's 8, Q5_0's 16 */
static int32_t offset_of(int fmt) { return fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0; }

static int has_min(int fmt) { return fmt == Q4_1 || fmt == Q5_1; }

static float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

static float rounded_to_half(float x) { return (float)(_Float16)x; }

/* ---- repacking ----------------------------------------------------------------------- */

/* raw: N rows of K/32 blocks as the file holds them (Q4_0: d f16, 16 bytes; Q4_1: d, m f16,
 * 16 bytes; Q8_0: d f16, 32 int8; Q5_0: d f16, 4 bytes of fifth bits (bit j: column j's),
 * 16 bytes of nibbles as Q4_0's; Q5_1: d, m f16, then as Q5_0). panels: ceil(N/16) * (K/32)
 * * panel_block_bytes; scales, mins: ceil(N/16) * (K/32) * 16 floats (rows past N: zeros). */
void qkv_quant_repack(int fmt, const uint8_t *raw, int64_t N, int64_t K, uint8_t *panels,
                      float *scales, float *mins) {
    const int64_t nb = K / QK, np = (N + ROWS - 1) / ROWS;
    static const int64_t raw_bytes[] = {18, 20, 34, 22, 24}; /* by format */
    const int64_t raw_block = raw_bytes[fmt];
    const int64_t pbb = panel_block_bytes(fmt);
    memset(panels, 0, (size_t)(np * nb * pbb));
    memset(scales, 0, (size_t)(np * nb * ROWS) * sizeof(float));
    memset(mins, 0, (size_t)(np * nb * ROWS) * sizeof(float));
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / ROWS, r = n % ROWS;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = raw + (n * nb + b) * raw_block;
            uint16_t d, m = 0;
            memcpy(&d, blk, 2);
            if (has_min(fmt)) memcpy(&m, blk + 2, 2);
            const uint8_t *qs = blk + (has_min(fmt) ? 4 : 2);
            const int64_t at = (p * nb + b) * ROWS + r;
            scales[at] = half_to_float(d);
            mins[at] = has_min(fmt) ? half_to_float(m) : 0.0f;
            uint8_t *out = panels + (p * nb + b) * pbb;
            /* step s holds columns 4s..4s+3 of every row: 64 bytes, row r's at 4r */
            if (fmt == Q8_0) {
                for (int s = 0; s < 8; s++) memcpy(out + s * 64 + r * 4, qs + 4 * s, 4);
            } else if (fmt >= Q5_0) { /* the 4 bytes of fifth bits, then Q4_0's nibbles */
                const uint32_t high = (uint32_t)qs[0] | (uint32_t)qs[1] << 8 |
                                      (uint32_t)qs[2] << 16 | (uint32_t)qs[3] << 24;
                for (int s = 0; s < 4; s++) {
                    memcpy(out + s * 64 + r * 4, qs + 4 + 4 * s, 4);
                    for (int j = 0; j < 4; j++)
                        out[FIFTHS + r * 4 + j] |= (uint8_t)((high >> (4 * s + j) & 1) << (2 * s) |
                                                             (high >> (16 + 4 * s + j) & 1)
                                                                 << (2 * s + 1));
                }
            } else { /* a byte's low nibble is column 4s+j, its high one column 16+4s+j */
                for (int s = 0; s < 4; s++) memcpy(out + s * 64 + r * 4, qs + 4 * s, 4);
            }
        }
    }
}

/* ---- activations ----------------------------------------------------------------------- */

/* One block of 32 inputs -> its bytes q, d (the scale, rounded to float16 as llama.cpp stores
 * it), s = float16(d_unrounded * sum q) (Q8_1's) and sum q (an integer). */
static void quantize_block(const float *v, int8_t *q, float *d, float *s, int32_t *sum) {
    float amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < QK; j++) {
        amax = fmaxf(amax, fabsf(v[j]));
        finite &= isfinite(v[j]) != 0;
    }
    if (!finite) { /* NaN or infinity in: NaN out (NaN * 0), never a cast of NaN to int */
        memset(q, 0, QK);
        *d = *s = NAN;
        *sum = 0;
        return;
    }
    const float scale = amax / 127.0f;
    const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    int total = 0;
    for (int j = 0; j < QK; j++) {
        const int r = (int)roundf(v[j] * inverse);
        q[j] = (int8_t)r;
        total += r;
    }
    *d = rounded_to_half(scale);
    *s = rounded_to_half(scale * (float)total);
    *sum = total;
}

#if defined(QKV_X86)
/* quantize_block in AVX2, the same numbers: the largest magnitude and the products v * inverse
 * are the same IEEE operations, and roundf's halves away from zero are made by hand (the
 * instruction's own rounding takes halves to even): t = trunc(|p|), plus 1 where |p| - t (exact)
 * is at least a half, then p's sign. */
/* float16's rounding of x (nearest, ties to even: the cast's) in one instruction each way,
 * where the cast calls a library routine */
__attribute__((target("f16c"))) static inline float rounded_to_half_f16c(float x) {
    return _cvtsh_ss(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("avx2,fma,f16c"))) static void quantize_block_avx2(const float *v,
                                                                         int8_t *q, float *d,
                                                                         float *s, int32_t *sum) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 x[4], amax = zero, finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x[i]));
        /* x * 0 is 0 for a finite x, NaN for an infinity or a NaN */
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_mul_ps(x[i], zero), zero, _CMP_EQ_OQ));
    }
    if (_mm256_movemask_ps(finite) != 0xff) {
        quantize_block(v, q, d, s, sum); /* NaN or infinity: the scalar path's NaN out */
        return;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f;
    const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 inv = _mm256_set1_ps(inverse), half = _mm256_set1_ps(0.5f);
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256i r[4], total = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        const __m256 p = _mm256_mul_ps(x[i], inv);
        const __m256 a = _mm256_andnot_ps(sign, p);
        const __m256 t = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 up = _mm256_and_ps(one, _mm256_cmp_ps(_mm256_sub_ps(a, t), half, _CMP_GE_OQ));
        const __m256 rounded = _mm256_or_ps(_mm256_add_ps(t, up), _mm256_and_ps(sign, p));
        r[i] = _mm256_cvtps_epi32(rounded); /* an integer already: exact */
        total = _mm256_add_epi32(total, r[i]);
    }
    /* 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permute mends it */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]),
                                              _mm256_packs_epi32(r[2], r[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(
                                          packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
    const int32_t sum_q = _mm_cvtsi128_si32(t4);
    *d = rounded_to_half_f16c(scale);
    *s = rounded_to_half_f16c(scale * (float)sum_q);
    *sum = sum_q;
}

/* one block's remainder after its first rounding: left = v - d q, as the scalar loop */
__attribute__((target("avx2,fma"))) static void remainder_avx2(const float *v, const int8_t *q,
                                                               float d, float *left) {
    const __m256 dd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; i++) {
        const __m256 qf = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i))));
        _mm256_storeu_ps(left + 8 * i,
                         _mm256_sub_ps(_mm256_loadu_ps(v + 8 * i), _mm256_mul_ps(dd, qf)));
    }
}
#endif

/* 1 where the CPU runs the AVX2 rounding of activations, checked once */
static int activations_in_avx2(void) {
    static int known = -1;
    if (known < 0) known = qkv_quant_variants() >> QKV_AVX2 & 1;
    return known;
}

typedef void (*block_fn)(const float *, int8_t *, float *, float *, int32_t *);

static block_fn block_of(int variant) {
#if defined(QKV_X86)
    if (variant >= QKV_AVX2) return quantize_block_avx2;
#endif
    (void)variant;
    return quantize_block;
}

/* x (M, K) float32 -> q (M, K) int8, and d, s, sum per block of 32 (quantize_block), with the
 * variant's code (every variant gives the same bytes; tests/nn/test_native_quant.py holds them
 * to a numpy reference). Returns 0, or -1 for a variant this CPU does not run. */
int qkv_quant_activations_variant(int variant, const float *x, int64_t M, int64_t K, int8_t *q,
                                  float *d, float *s, int32_t *sums) {
    if (variant < 0 || variant >= QKV_VARIANTS || !(qkv_quant_variants() >> variant & 1))
        return -1;
    const block_fn fn = block_of(variant);
    for (int64_t i = 0; i < M * (K / QK); i++) fn(x + i * QK, q + i * QK, d + i, s + i, sums + i);
    return 0;
}

void qkv_quant_activations(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                           int32_t *sums) {
    qkv_quant_activations_variant(activations_in_avx2(), x, M, K, q, d, s, sums);
}

/* x (M, K) as `parts` (1 or 2) rows of 8-bit blocks each, row i's part j at row i * parts + j:
 * part 0 as qkv_quant_activations makes it, part 1 what part 0 leaves of x (x - d q, with d as
 * rounded to float16), so that d0 q0 + d1 q1 holds x to about 15 bits. Each part's product is
 * llama.cpp's arithmetic; their sum is a product with inputs rounded 128 times finer. */
void qkv_quant_activations_parts(const float *x, int64_t M, int64_t K, int parts, int8_t *q,
                                 float *d, float *s, int32_t *sums) {
    if (parts == 1) {
        qkv_quant_activations(x, M, K, q, d, s, sums);
        return;
    }
    const int64_t nb = K / QK;
    const int simd = activations_in_avx2();
    const block_fn fn = block_of(simd);
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            const float *v = x + i * K + b * QK;
            const int64_t first = 2 * i * nb + b, second = first + nb;
            int8_t *q0 = q + first * QK;
            fn(v, q0, d + first, s + first, sums + first);
            float left[QK];
#if defined(QKV_X86)
            if (simd)
                remainder_avx2(v, q0, d[first], left);
            else
#endif
                for (int j = 0; j < QK; j++) left[j] = v[j] - d[first] * (float)q0[j];
            fn(left, q + second * QK, d + second, s + second, sums + second);
        }
}

/* y (M, N) = parts (M * parts, N) summed in order, then the bias */
static void sum_parts(const float *parts_y, int64_t M, int64_t N, int parts, const float *bias,
                      float *y) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t n = 0; n < N; n++) {
            float t = parts_y[(i * parts) * N + n];
            for (int j = 1; j < parts; j++) t = t + parts_y[(i * parts + j) * N + n];
            y[i * N + n] = bias ? t + bias[n] : t;
        }
}

/* ---- the products ------------------------------------------------------------------------ */

typedef struct {
    int fmt;
    const uint8_t *panels;
    const float *scales, *mins, *bias;
    int64_t N, K, M;
    const int8_t *xq;
    const float *xd, *xs;
    const int32_t *xsum;
    float *y;
} product;

/* One block's 16 integer sums -> the running float sums of 16 rows, the same operations in
 * every variant: acc += (d_w * d_x) * isum; Q4_0, Q5_0: isum - 8 (16) * sum(x) first; Q4_1,
 * Q5_1: + m_w * s_x. */
#define BLOCK_SCALAR(acc, isum, pr, at, i)                                                       \
    do {                                                                                         \
        for (int r = 0; r < ROWS; r++) {                                                         \
            int32_t v = isum[r];                                                                 \
            v -= offset_of(pr->fmt) * pr->xsum[i];                                               \
            acc[r] = acc[r] + (pr->scales[at + r] * pr->xd[i]) * (float)v;                       \
            if (has_min(pr->fmt)) acc[r] = acc[r] + pr->mins[at + r] * pr->xs[i];                \
        }                                                                                        \
    } while (0)

static void store(const product *pr, int64_t p, int64_t m, const float *acc) {
    const int64_t n0 = p * ROWS, rows = pr->N - n0 < ROWS ? pr->N - n0 : ROWS;
    float *y = pr->y + m * pr->N + n0;
    for (int64_t r = 0; r < rows; r++) y[r] = pr->bias ? acc[r] + pr->bias[n0 + r] : acc[r];
}

static void panel_scalar(const product *pr, int64_t p, int64_t m) {
    const int64_t nb = pr->K / QK, pbb = panel_block_bytes(pr->fmt);
    float acc[ROWS] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = pr->panels + (p * nb + b) * pbb;
        const int8_t *x = pr->xq + m * pr->K + b * QK;
        int32_t isum[ROWS] = {0};
        for (int r = 0; r < ROWS; r++) {
            int32_t t = 0;
            if (pr->fmt == Q8_0) {
                for (int s = 0; s < 8; s++)
                    for (int j = 0; j < 4; j++) t += (int8_t)w[s * 64 + r * 4 + j] * x[4 * s + j];
            } else {
                const int five = pr->fmt >= Q5_0;
                for (int s = 0; s < 4; s++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = w[s * 64 + r * 4 + j];
                        const uint8_t bits = five ? w[FIFTHS + r * 4 + j] : 0;
                        const int lo = (byte & 15) | (bits >> (2 * s) & 1) << 4;
                        const int hi = (byte >> 4) | (bits >> (2 * s + 1) & 1) << 4;
                        t += lo * x[4 * s + j] + hi * x[16 + 4 * s + j];
                    }
            }
            isum[r] = t;
        }
        const int64_t at = (p * nb + b) * ROWS, i = m * nb + b;
        BLOCK_SCALAR(acc, isum, pr, at, i);
    }
    store(pr, p, m, acc);
}

#if defined(QKV_X86)
static inline int32_t four(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

/* bit b of each byte of a Q5 fifths plane, moved to bit 4 (then masked): shifts of 16-bit
 * lanes by at most 4, so no byte's bit 4 comes from the byte beside it */
__attribute__((target("avx2"), always_inline)) static inline __m256i fifth_at(__m256i v, int b) {
    switch (b) {
    case 0: return _mm256_slli_epi16(v, 4);
    case 1: return _mm256_slli_epi16(v, 3);
    case 2: return _mm256_slli_epi16(v, 2);
    case 3: return _mm256_slli_epi16(v, 1);
    case 4: return v;
    case 5: return _mm256_srli_epi16(v, 1);
    case 6: return _mm256_srli_epi16(v, 2);
    default: return _mm256_srli_epi16(v, 3);
    }
}

/* AVX2: a panel as two halves of 8 rows; byte products summed in pairs (vpmaddubsw: 15 * 128
 * * 2 fits 16 bits, Q5's 31 * 128 * 2 too; Q8_0's signed weights go as |w| and x with w's
 * sign, which fits too).
 * R activation rows (1..4) at once: each panel block's integers are unpacked once for
 * all of them (a prompt's rows, or an input in two parts). Row by row, the same operations in
 * the same order as the other variants' (BLOCK_SCALAR's), so the same numbers bit for bit. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192
#endif

/* the block AHEAD_BYTES of panels past the one at w (block index `at`), with its scales and
 * minimums: on their way from memory while this block is summed (a prefetch past the end is
 * dropped, never a fault) */
__attribute__((always_inline)) static inline void prefetch_ahead(const product *pr,
                                                                 const uint8_t *w, int64_t at,
                                                                 int64_t pbb, int F) {
    const int64_t ahead = AHEAD_BYTES / pbb;
    _Pragma("GCC unroll 16")
    for (int64_t c = 0; c < pbb; c += 64)
        _mm_prefetch((const char *)w + ahead * pbb + c, _MM_HINT_T0);
    _mm_prefetch((const char *)(pr->scales + at + ahead * ROWS), _MM_HINT_T0);
    if (has_min(F)) _mm_prefetch((const char *)(pr->mins + at + ahead * ROWS), _MM_HINT_T0);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void rows_avx2(
    const product *pr, int64_t p, int64_t m0, const int R, const int F) {
    const int64_t nb = pr->K / QK, pbb = panel_block_bytes(F);
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i bit4 = _mm256_set1_epi8(16);
    __m256 acc[4][2];
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = pr->panels + (p * nb + b) * pbb;
        const int64_t at = (p * nb + b) * ROWS;
        prefetch_ahead(pr, w, at, pbb, F);
        const int8_t *x[4];
        int64_t i[4];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            x[r] = pr->xq + (m0 + r) * pr->K + b * QK;
            i[r] = (m0 + r) * nb + b;
        }
        /* both halves of each step at once, so that each input broadcast serves 16 rows */
        __m256i isum[4][2];
        if (F == Q8_0) {
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int s = 0; s < 8; s++) {
                __m256i v[2], magnitude[2];
                _Pragma("GCC unroll 8")
                for (int h = 0; h < 2; h++) {
                    v[h] = _mm256_loadu_si256((const __m256i *)(w + s * 64 + h * 32));
                    magnitude[h] = _mm256_abs_epi8(v[h]);
                }
                _Pragma("GCC unroll 8")
                for (int r = 0; r < R; r++) {
                    const __m256i xs = _mm256_set1_epi32(four(x[r] + 4 * s));
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs =
                            _mm256_maddubs_epi16(magnitude[h], _mm256_sign_epi8(xs, v[h]));
                        isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(pairs, ones));
                    }
                }
            }
        } else {
            /* nibbles (Q5: with their fifth bits, FIFTHS, shifted to bit 4). Q4's 16-bit sums
             * wait over the block's 4 steps: each lane adds 16 products of a nibble (<= 15)
             * and a byte (|x| <= 127), at most 30480, exact, then widened. Q5's two products
             * of a step (5-bit integers, <= 31) reach 15,748, so each step's are widened. */
            const int five = F >= Q5_0;
            __m256i fifths[2], sums16[4][2];
            _Pragma("GCC unroll 8")
            for (int h = 0; h < 2; h++)
                fifths[h] = five ? _mm256_loadu_si256((const __m256i *)(w + FIFTHS + h * 32))
                                 : _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++)
                sums16[r][0] = sums16[r][1] = isum[r][0] = isum[r][1] = _mm256_setzero_si256();
            _Pragma("GCC unroll 8")
            for (int s = 0; s < 4; s++) {
                __m256i lo[2], hi[2];
                _Pragma("GCC unroll 8")
                for (int h = 0; h < 2; h++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + s * 64 + h * 32));
                    lo[h] = _mm256_and_si256(v, low);
                    hi[h] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (five) {
                        lo[h] = _mm256_or_si256(
                            lo[h], _mm256_and_si256(fifth_at(fifths[h], 2 * s), bit4));
                        hi[h] = _mm256_or_si256(
                            hi[h], _mm256_and_si256(fifth_at(fifths[h], 2 * s + 1), bit4));
                    }
                }
                _Pragma("GCC unroll 8")
                for (int r = 0; r < R; r++) {
                    const __m256i xl = _mm256_set1_epi32(four(x[r] + 4 * s));
                    const __m256i xh = _mm256_set1_epi32(four(x[r] + 16 + 4 * s));
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; h++) {
                        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], xl),
                                                               _mm256_maddubs_epi16(hi[h], xh));
                        if (five)
                            isum[r][h] = _mm256_add_epi32(isum[r][h],
                                                          _mm256_madd_epi16(pairs, ones));
                        else
                            sums16[r][h] = _mm256_add_epi16(sums16[r][h], pairs);
                    }
                }
            }
            if (!five) {
                _Pragma("GCC unroll 8")
                for (int r = 0; r < R; r++)
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; h++) isum[r][h] = _mm256_madd_epi16(sums16[r][h], ones);
            }
        }
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; h++) {
            const __m256 scales = _mm256_loadu_ps(pr->scales + at + 8 * h);
            /* the minimums are read only where the format has them: Q8_0's LM head would
             * read 4 bytes of zeros for each 34 of its own */
            const __m256 mins = has_min(F) ? _mm256_loadu_ps(pr->mins + at + 8 * h)
                                                 : _mm256_setzero_ps();
            _Pragma("GCC unroll 8")
            for (int r = 0; r < R; r++) {
                __m256i t = isum[r][h];
                if (offset_of(F))
                    t = _mm256_sub_epi32(t, _mm256_set1_epi32(offset_of(F) * pr->xsum[i[r]]));
                const __m256 dd = _mm256_mul_ps(scales, _mm256_set1_ps(pr->xd[i[r]]));
                acc[r][h] = _mm256_add_ps(acc[r][h], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(t)));
                if (has_min(F))
                    acc[r][h] = _mm256_add_ps(acc[r][h],
                                              _mm256_mul_ps(mins, _mm256_set1_ps(pr->xs[i[r]])));
            }
        }
    }
    const int64_t n0 = p * ROWS;
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) {
        if (pr->N - n0 < ROWS) { /* the last panel's rows past N are not stored */
            float out[ROWS];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            store(pr, p, m0 + r, out);
            continue;
        }
        float *y = pr->y + (m0 + r) * pr->N + n0; /* store's y = acc + bias, in vectors */
        _Pragma("GCC unroll 8")
        for (int h = 0; h < 2; h++) {
            __m256 out = acc[r][h];
            if (pr->bias) out = _mm256_add_ps(out, _mm256_loadu_ps(pr->bias + n0 + 8 * h));
            _mm256_storeu_ps(y + 8 * h, out);
        }
    }
}

/* rows m0..m0+count-1 of panel p: four at a time, then what is left; each format's code
 * apart (F a constant: no format test left in the block loop, 5-10% of a Q4_1 product's
 * time where the five formats' code shared one loop) */
#define ROWS_AVX2(F)                                                                             \
    do {                                                                                         \
        for (; m + 4 <= m0 + count; m += 4) rows_avx2(pr, p, m, 4, F);                           \
        switch (m0 + count - m) {                                                                \
        case 3: rows_avx2(pr, p, m, 3, F); break;                                                \
        case 2: rows_avx2(pr, p, m, 2, F); break;                                                \
        case 1: rows_avx2(pr, p, m, 1, F); break;                                                \
        }                                                                                        \
    } while (0)

__attribute__((target("avx2,fma"))) static void panels_avx2(const product *pr, int64_t p,
                                                             int64_t m0, int64_t count) {
    int64_t m = m0;
    switch (pr->fmt) {
    case Q4_0: ROWS_AVX2(Q4_0); break;
    case Q4_1: ROWS_AVX2(Q4_1); break;
    case Q8_0: ROWS_AVX2(Q8_0); break;
    case Q5_0: ROWS_AVX2(Q5_0); break;
    default: ROWS_AVX2(Q5_1); break;
    }
}

/* AVX-VNNI (256 bits): as AVX2, four byte products summed into 32 bits by one vpdpbusd. */
__attribute__((target("avx2,fma,avxvnni"))) static void panel_avx_vnni(const product *pr,
                                                                       int64_t p, int64_t m) {
    const int64_t nb = pr->K / QK, pbb = panel_block_bytes(pr->fmt);
    const __m256i low = _mm256_set1_epi8(15);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = pr->panels + (p * nb + b) * pbb;
        const int8_t *x = pr->xq + m * pr->K + b * QK;
        const int64_t at = (p * nb + b) * ROWS, i = m * nb + b;
        for (int h = 0; h < 2; h++) {
            __m256i isum = _mm256_setzero_si256(), other = _mm256_setzero_si256();
            if (pr->fmt == Q8_0) {
                for (int s = 0; s < 8; s++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + s * 64 + h * 32));
                    const __m256i xs = _mm256_set1_epi32(four(x + 4 * s));
                    isum = _mm256_dpbusd_avx_epi32(isum, _mm256_abs_epi8(v),
                                                   _mm256_sign_epi8(xs, v));
                }
            } else { /* nibbles, and Q5's fifth bits (FIFTHS) shifted to bit 4 */
                const int five = pr->fmt >= Q5_0;
                const __m256i bit4 = _mm256_set1_epi8(16);
                const __m256i fifths =
                    five ? _mm256_loadu_si256((const __m256i *)(w + FIFTHS + h * 32))
                         : _mm256_setzero_si256();
                for (int s = 0; s < 4; s++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(w + s * 64 + h * 32));
                    __m256i lo = _mm256_and_si256(v, low);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    if (five) {
                        lo = _mm256_or_si256(lo, _mm256_and_si256(fifth_at(fifths, 2 * s), bit4));
                        hi = _mm256_or_si256(hi,
                                             _mm256_and_si256(fifth_at(fifths, 2 * s + 1), bit4));
                    }
                    isum = _mm256_dpbusd_avx_epi32(isum, lo, _mm256_set1_epi32(four(x + 4 * s)));
                    other = _mm256_dpbusd_avx_epi32(other, hi,
                                                    _mm256_set1_epi32(four(x + 16 + 4 * s)));
                }
                isum = _mm256_add_epi32(isum, other);
            }
            if (offset_of(pr->fmt))
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(offset_of(pr->fmt) * pr->xsum[i]));
            const __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(pr->scales + at + 8 * h),
                                            _mm256_set1_ps(pr->xd[i]));
            acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
            if (has_min(pr->fmt))
                acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_loadu_ps(pr->mins + at + 8 * h),
                                                             _mm256_set1_ps(pr->xs[i])));
        }
    }
    float out[ROWS];
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
    store(pr, p, m, out);
}

/* fifth_at in 512 bits */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i fifth_at512(
    __m512i v, int b) {
    return b <= 4 ? _mm512_slli_epi16(v, (unsigned)(4 - b)) : _mm512_srli_epi16(v, (unsigned)(b - 4));
}

/* AVX-512 VNNI: a whole panel, 16 rows in the 16 lanes of one register. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static void panel_avx512_vnni(
    const product *pr, int64_t p, int64_t m) {
    const int64_t nb = pr->K / QK, pbb = panel_block_bytes(pr->fmt);
    const __m512i low = _mm512_set1_epi8(15), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *w = pr->panels + (p * nb + b) * pbb;
        const int8_t *x = pr->xq + m * pr->K + b * QK;
        const int64_t at = (p * nb + b) * ROWS, i = m * nb + b;
        prefetch_ahead(pr, w, at, pbb, pr->fmt);
        __m512i isum = _mm512_setzero_si512(), other = _mm512_setzero_si512();
        if (pr->fmt == Q8_0) {
            for (int s = 0; s < 8; s += 2) {
                const __m512i v = _mm512_loadu_si512(w + s * 64);
                const __m512i u = _mm512_loadu_si512(w + s * 64 + 64);
                const __m512i xv = _mm512_set1_epi32(four(x + 4 * s));
                const __m512i xu = _mm512_set1_epi32(four(x + 4 * s + 4));
                /* |w| times x carrying w's sign: x negated where w < 0 */
                isum = _mm512_dpbusd_epi32(isum, _mm512_abs_epi8(v),
                                           _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(v), zero, xv));
                other = _mm512_dpbusd_epi32(other, _mm512_abs_epi8(u),
                                            _mm512_mask_sub_epi8(xu, _mm512_movepi8_mask(u), zero, xu));
            }
        } else { /* nibbles, and Q5's fifth bits (FIFTHS) shifted to bit 4 */
            const int five = pr->fmt >= Q5_0;
            const __m512i bit4 = _mm512_set1_epi8(16);
            const __m512i fifths = five ? _mm512_loadu_si512(w + FIFTHS) : _mm512_setzero_si512();
            for (int s = 0; s < 4; s++) {
                const __m512i v = _mm512_loadu_si512(w + s * 64);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                if (five) {
                    lo = _mm512_or_si512(lo, _mm512_and_si512(fifth_at512(fifths, 2 * s), bit4));
                    hi = _mm512_or_si512(hi,
                                         _mm512_and_si512(fifth_at512(fifths, 2 * s + 1), bit4));
                }
                isum = _mm512_dpbusd_epi32(isum, lo, _mm512_set1_epi32(four(x + 4 * s)));
                other = _mm512_dpbusd_epi32(other, hi, _mm512_set1_epi32(four(x + 16 + 4 * s)));
            }
        }
        isum = _mm512_add_epi32(isum, other);
        if (offset_of(pr->fmt))
            isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset_of(pr->fmt) * pr->xsum[i]));
        const __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(pr->scales + at), _mm512_set1_ps(pr->xd[i]));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum)));
        if (has_min(pr->fmt))
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(pr->mins + at),
                                                   _mm512_set1_ps(pr->xs[i])));
    }
    float out[ROWS];
    _mm512_storeu_ps(out, acc);
    store(pr, p, m, out);
}
#endif

typedef void (*panels_fn)(const product *, int64_t, int64_t, int64_t);

/* rows m0..m0+count-1 of panel p, one at a time (the variants without a kernel of several) */
#define ROW_BY_ROW(name, one)                                                                    \
    static void name(const product *pr, int64_t p, int64_t m0, int64_t count) {                  \
        for (int64_t m = m0; m < m0 + count; m++) one(pr, p, m);                                 \
    }
ROW_BY_ROW(panels_scalar, panel_scalar)
#if defined(QKV_X86)
ROW_BY_ROW(panels_avx_vnni, panel_avx_vnni)
ROW_BY_ROW(panels_avx512_vnni, panel_avx512_vnni)
#endif

static panels_fn panel_of(int variant) {
#if defined(QKV_X86)
    switch (variant) {
    case QKV_AVX2: return panels_avx2;
    case QKV_AVX_VNNI: return panels_avx_vnni;
    case QKV_AVX512_VNNI: return panels_avx512_vnni;
    }
#endif
    (void)variant;
    return panels_scalar;
}

typedef struct {
    const product *pr;
    panels_fn fn;
    qkv_runs runs;
} job;

/* thread ith's pieces of the panels (qkv_runs), for every activation row, MTILE rows at a
 * time so that a piece's panels stay in its cache while the rows pass */
static void run_job(void *arg, int ith, int nth) {
    (void)nth;
    job *jb = arg;
    const product *pr = jb->pr;
    int64_t from, to;
    for (int taken = 0; qkv_runs_next(&jb->runs, ith, taken, &from, &to); taken++)
        for (int64_t m0 = 0; m0 < pr->M; m0 += MTILE) {
            const int64_t m1 = m0 + MTILE < pr->M ? m0 + MTILE : pr->M;
            for (int64_t p = from; p < to; p++) jb->fn(pr, p, m0, m1 - m0);
        }
}

/* The variants this CPU runs: a bit mask of 1 << QKV_SCALAR, 1 << QKV_AVX2, ... (the OS's
 * support for the registers included, as GCC's __builtin_cpu_supports checks it). */
int qkv_quant_variants(void) {
    int mask = 1 << QKV_SCALAR;
#if defined(QKV_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) { /* F16C: the activations' scales rounded to float16 */
        mask |= 1 << QKV_AVX2;
        if (__builtin_cpu_supports("avxvnni")) mask |= 1 << QKV_AVX_VNNI;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            mask |= 1 << QKV_AVX512_VNNI;
    }
#endif
    return mask;
}

/* y (M, N) = x (M, K) @ W.T (+ bias): W as qkv_quant_repack made it, x rounded to 8 bits per
 * block in `parts` (1, or 2: qkv_quant_activations_parts) (work: qkv_quant_work_bytes). Returns
 * 0, or -1 when the variant is not one this CPU runs (nothing is written then). */
int qkv_quant_matmul(int variant, int fmt, const uint8_t *panels, const float *scales,
                     const float *mins, const float *bias, int64_t N, int64_t K, const float *x,
                     int64_t M, int parts, float *y, void *work, int nth) {
    if (variant < 0 || variant >= QKV_VARIANTS || !(qkv_quant_variants() >> variant & 1))
        return -1;
    const int64_t nb = K / QK, rows = M * parts;
    int8_t *xq = work;
    float *xd = (float *)(xq + ((rows * K + 63) / 64) * 64);
    float *xs = xd + rows * nb;
    int32_t *xsum = (int32_t *)(xs + rows * nb);
    float *each = parts > 1 ? (float *)(xsum + rows * nb) : y; /* every part's products */
    qkv_quant_activations_parts(x, M, K, parts, xq, xd, xs, xsum);
    product pr = {fmt, panels, scales, mins, parts > 1 ? NULL : bias, N, K, rows, xq, xd, xs,
                  xsum, each};
    job jb; /* not zeroed: its 4 KB of runs are set for the threads there are */
    jb.pr = &pr;
    jb.fn = panel_of(variant);
    qkv_runs_start(&jb.runs, (N + ROWS - 1) / ROWS, &nth);
    qkv_parallel(run_job, &jb, nth);
    if (parts > 1) sum_parts(each, M, N, parts, bias, y);
    return 0;
}

/* bytes of qkv_quant_matmul's `work` for M rows of K in `parts`, N outputs */
int64_t qkv_quant_work_bytes(int64_t M, int64_t K, int64_t N, int parts) {
    const int64_t rows = M * parts;
    return ((rows * K + 63) / 64) * 64 + 3 * rows * (K / QK) * 4 + (parts > 1 ? rows * N * 4 : 0);
}

#define MANY 8 /* matrices in one qkv_quant_many call at the most */

typedef struct {
    product pr[MANY];
    int64_t first[MANY + 1]; /* matrix i's panels are [first[i], first[i + 1]) of them all */
    int count;
    panels_fn fn;
    qkv_runs runs;
} many_job;

/* thread ith's pieces of the panels of every matrix (qkv_runs) */
static void run_many(void *arg, int ith, int nth) {
    (void)nth;
    many_job *jb = arg;
    int64_t from, to;
    for (int taken = 0; qkv_runs_next(&jb->runs, ith, taken, &from, &to); taken++)
        for (int i = 0; i < jb->count; i++) {
            int64_t a, b;
            qkv_runs_part(jb->first, i, from, to, &a, &b);
            for (int64_t p = a; p < b; p++)
                jb->fn(&jb->pr[i], p - jb->first[i], 0, jb->pr[i].M);
        }
}

/* ys[i] (M, N_i) = mats[i] @ x (+ bias) for M rows x already rounded to 8-bit blocks
 * (qkv_quant_activations), every matrix with x's K columns: the panels of all of them
 * shared by nth threads (qkv_runs), so that a step's q, k and v (or gate and up) are one task
 * of the pool. The caller (qkv/generate/step.c) has checked the variant, the sizes and
 * count <= MANY. */
void qkv_quant_many(int variant, int count, const qkv_qmat *mats, float *const *ys,
                    const qkv_q8 *x, int64_t M, int nth) {
    many_job jb; /* not zeroed (80 calls a token): what is read is set below */
    jb.count = count;
    jb.fn = panel_of(variant);
    jb.first[0] = 0;
    for (int i = 0; i < count; i++) {
        const qkv_qmat *w = &mats[i];
        jb.pr[i] = (product){w->fmt, w->panels, w->scales, w->mins, w->bias, w->N, w->K, M,
                             x->q, x->d, x->s, x->sum, ys[i]};
        jb.first[i + 1] = jb.first[i] + (w->N + ROWS - 1) / ROWS;
    }
    qkv_runs_start(&jb.runs, jb.first[count], &nth);
    qkv_parallel(run_many, &jb, nth);
}
