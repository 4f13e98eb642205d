/* Products of a GGUF file's K-quant matrices (Q4_K, Q5_K, Q6_K) with 8-bit activations, as
 * llama.cpp computes them. Activations are rounded to Q8_K: per 256 inputs one float32 scale d
 * and 256 int8 values, with the sums of each 16 (bsums). A weight super-block of 256 columns
 * holds unsigned 4-, 5- or 6-bit integers q with one scale per sub-block (Q4_K, Q5_K: 32
 * columns, 6-bit scale sc and minimum m, value d*sc*q - dmin*m; Q6_K: 16 columns, int8 scale,
 * value d*sc*(q - 32)). Per super-block the integer sums are exact in 32 bits:
 *   Q4_K, Q5_K:  isum = sum_j sc_j * (sum of q*x over j),  summ = sum_j m_j * (sum of x over j)
 *                y += (d_w * d_x) * isum - (dmin_w * d_x) * summ
 *   Q6_K:        isum = sum_j sc_j * (sum of q*x over j - 32 * (sum of x over j))
 *                y += (d_w * d_x) * isum
 *
 * Bounds (|x| <= 127 by Q8_K's rounding; 128 below for margin): a sub-block's sum of q*x is at
 * most 32 * 31 * 128 = 126,976 (Q5_K; Q4_K less) or, for Q6_K's 16 columns less 32 * its sum
 * of x, 16 * 32 * 128 = 65,536; times a scale (63, or 128 for Q6_K's int8) and over 8 (16)
 * sub-blocks: at most 64 M (134 M) < 2^31. The minimums: 8 * 63 * 4,096 = 2 M. AVX2's
 * vpmaddubsw sums two byte products into 16 bits with saturation: 2 * 63 * 128 = 16,128 <
 * 32,767, so it never saturates; its sums over a sub-block's steps stay in 16 bits too, for
 * |x| <= 127 (quant_k_avx2.h), and every variant's integers are the same exact numbers.
 * Then each variant does the same float operations in the same order (the library is built
 * with -ffp-contract=off), so all agree bit for bit (tests/nn/test_native_quant_k.py).
 *
 * Panels: 16 rows' super-blocks repacked together, one region per (panel, super-block):
 *   low:    2048 bytes; for 64 columns g (0..3) and 4 columns s (0..7), 64 bytes = 16 rows x
 *           4 bytes: row r's byte t holds column 64g+4s+t in its low nibble and column
 *           64g+32+4s+t in its high one (one 64-byte load: one VNNI operand for 16 rows)
 *   high:   Q5_K 512 bytes (the fifth bits: for g and half e, 64 bytes, row r's byte t has
 *           bit s = column 64g+32e+4s+t's); Q6_K 1024 bytes (bits 5-6: for g and s/2, 64
 *           bytes, row r's byte t: bits 4(s%2)..+1 the low nibble's column, +2..+3 the high's)
 *   scales: one byte a sub-block a row, [sub-block][row] (Q6_K: int8, 16 sub-blocks)
 *   mins:   Q4_K, Q5_K: [pair of sub-blocks k][row][2] bytes, one vpmaddwd's operand
 *   d, dmin: 16 floats each (Q6_K: d only). Rows past N are zeros. */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qkv_native.h"

#if defined(QKV_X86)
#include <immintrin.h>
#endif

enum { Q4_K = 0, Q5_K = 1, Q6_K = 2, FORMATS = 3 };
#define QK_K 256  /* columns per super-block */
#define ROWS 16   /* rows per panel */
#define MTILE 32  /* activation rows per pass over a thread's panels (prefill) */
#define LOW_BYTES (ROWS * QK_K / 2)
/* AVX-VNNI's 256-bit code compiled with AVX-512 VNNI's encoding of the same instruction: the
 * tests run it on CPUs that have AVX-512 but not AVX-VNNI (Ice Lake, Zen 4) */
#define TWIN QKV_VARIANTS

int qkv_quant_variants(void); /* quant.c's: the variants this CPU runs */

static int64_t high_bytes(int fmt) { return fmt == Q4_K ? 0 : fmt == Q5_K ? 512 : 1024; }
static int64_t scale_bytes(int fmt) { return fmt == Q6_K ? 16 * ROWS : 8 * ROWS; }
static int64_t min_bytes(int fmt) { return fmt == Q6_K ? 0 : 8 * ROWS; }
static int64_t float_bytes(int fmt) { return (fmt == Q6_K ? 1 : 2) * ROWS * 4; }
static int64_t raw_block_bytes(int fmt) { return fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210; }

static int64_t panel_block_bytes(int fmt) {
    return LOW_BYTES + high_bytes(fmt) + scale_bytes(fmt) + min_bytes(fmt) + float_bytes(fmt);
}

/* bytes of qkv_quantk_repack's `panels` for N rows of K columns (-1: no such format) */
int64_t qkv_quantk_panel_bytes(int fmt, int64_t N, int64_t K) {
    if (fmt < 0 || fmt >= FORMATS) return -1;
    return (N + ROWS - 1) / ROWS * (K / QK_K) * panel_block_bytes(fmt);
}

static float half_to_float(const uint8_t *at) {
    _Float16 f;
    memcpy(&f, at, 2);
    return (float)f;
}

/* ---- repacking ----------------------------------------------------------------------- */

/* One super-block as the file holds it -> its 256 unsigned integers, its sub-blocks' scales
 * (and minimums), d (and dmin). */
static void decode(int fmt, const uint8_t *blk, uint8_t *q, int *sc, int *mn, float *d,
                   float *dmin) {
    if (fmt == Q6_K) { /* ql 128, qh 64, scales 16 int8, d f16 */
        const uint8_t *ql = blk, *qh = blk + 128;
        for (int n = 0; n < 2; n++)
            for (int l = 0; l < 32; l++) {
                const uint8_t *lo = ql + 64 * n, h = qh[32 * n + l];
                q[128 * n + l] = (lo[l] & 15) | (h & 3) << 4;
                q[128 * n + l + 32] = (lo[l + 32] & 15) | (h >> 2 & 3) << 4;
                q[128 * n + l + 64] = (lo[l] >> 4) | (h >> 4 & 3) << 4;
                q[128 * n + l + 96] = (lo[l + 32] >> 4) | (h >> 6 & 3) << 4;
            }
        for (int j = 0; j < 16; j++) sc[j] = (int8_t)blk[192 + j];
        *d = half_to_float(blk + 208);
        *dmin = 0.0f;
        return;
    }
    /* Q4_K: d, dmin f16, 12 bytes of 6-bit scales and minimums, 128 bytes of nibbles;
     * Q5_K: the same with 32 bytes of fifth bits (qh) before the nibbles */
    *d = half_to_float(blk);
    *dmin = half_to_float(blk + 2);
    const uint8_t *s = blk + 4;
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = s[j] & 63;
            mn[j] = s[j + 4] & 63;
        } else {
            sc[j] = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
            mn[j] = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
        }
    }
    const uint8_t *qh = blk + 16, *qs = blk + (fmt == Q5_K ? 48 : 16);
    for (int g = 0; g < 4; g++)
        for (int l = 0; l < 32; l++) {
            q[64 * g + l] = qs[32 * g + l] & 15;
            q[64 * g + 32 + l] = qs[32 * g + l] >> 4;
            if (fmt == Q5_K) {
                q[64 * g + l] |= (qh[l] >> (2 * g) & 1) << 4;
                q[64 * g + 32 + l] |= (qh[l] >> (2 * g + 1) & 1) << 4;
            }
        }
}

/* raw: N rows of K/256 super-blocks as the file holds them (Q4_K 144 bytes, Q5_K 176, Q6_K
 * 210); panels: qkv_quantk_panel_bytes(fmt, N, K). */
void qkv_quantk_repack(int fmt, const uint8_t *raw, int64_t N, int64_t K, uint8_t *panels) {
    const int64_t nsb = K / QK_K, pbb = panel_block_bytes(fmt), rbb = raw_block_bytes(fmt);
    memset(panels, 0, (size_t)qkv_quantk_panel_bytes(fmt, N, K));
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = n / ROWS, r = n % ROWS;
        for (int64_t b = 0; b < nsb; b++) {
            uint8_t q[QK_K];
            int sc[16], mn[8];
            float d, dmin;
            decode(fmt, raw + (n * nsb + b) * rbb, q, sc, mn, &d, &dmin);
            uint8_t *low = panels + (p * nsb + b) * pbb, *high = low + LOW_BYTES;
            uint8_t *scales = high + high_bytes(fmt), *mins = scales + scale_bytes(fmt);
            float *ds = (float *)(mins + min_bytes(fmt));
            for (int g = 0; g < 4; g++)
                for (int s = 0; s < 8; s++)
                    for (int t = 0; t < 4; t++) {
                        const uint8_t a = q[64 * g + 4 * s + t], c = q[64 * g + 32 + 4 * s + t];
                        low[((g * 8 + s) * ROWS + r) * 4 + t] = (a & 15) | (c & 15) << 4;
                        if (fmt == Q5_K) {
                            high[((g * 2 + 0) * ROWS + r) * 4 + t] |= (a >> 4) << s;
                            high[((g * 2 + 1) * ROWS + r) * 4 + t] |= (c >> 4) << s;
                        } else if (fmt == Q6_K) {
                            high[((g * 4 + s / 2) * ROWS + r) * 4 + t] |=
                                ((a >> 4) | (c >> 4) << 2) << (4 * (s % 2));
                        }
                    }
            for (int j = 0; j < (fmt == Q6_K ? 16 : 8); j++) scales[j * ROWS + r] = (uint8_t)sc[j];
            if (fmt != Q6_K)
                for (int j = 0; j < 8; j++) mins[(j / 2 * ROWS + r) * 2 + j % 2] = (uint8_t)mn[j];
            ds[r] = d;
            if (fmt != Q6_K) ds[ROWS + r] = dmin;
        }
    }
}

/* ---- activations: llama.cpp's Q8_K ------------------------------------------------------- */

/* round to nearest, ties to even, as llama.cpp's nearest_int (|f| < 2^22) */
static inline int nearest_int(float f) {
    const float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* One block of 256 inputs -> q, d, bsums, as llama.cpp's quantize_row_q8_K_ref: the scale is
 * -max/127 of the value largest in magnitude (the first such), so that value becomes -127 and d
 * carries its sign. A block holding a NaN or an infinity is zeros with d NaN, so that its
 * products are NaN (llama.cpp's are any number). */
static void q8_k_block(const float *v, int8_t *out, float *d, int16_t *bsums) {
    float max = 0.0f, amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < QK_K; j++) {
        const float ax = fabsf(v[j]);
        finite &= ax <= FLT_MAX; /* false for a NaN and an infinity */
        if (ax > amax) {
            amax = ax;
            max = v[j];
        }
    }
    if (amax == 0.0f || !finite) { /* a NaN or an infinity in: NaN out, as quant.c's */
        *d = finite ? 0.0f : NAN;
        memset(out, 0, QK_K);
        memset(bsums, 0, 16 * sizeof(int16_t));
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; j++) {
        const int r = nearest_int(iscale * v[j]); /* -127 at the least: the largest's */
        out[j] = (int8_t)(r < 127 ? r : 127);
    }
    for (int j = 0; j < 16; j++) {
        int sum = 0;
        for (int t = 0; t < 16; t++) sum += out[16 * j + t];
        bsums[j] = (int16_t)sum;
    }
    *d = 1.0f / iscale;
}

#if defined(QKV_X86)
/* q8_k_block in AVX2, the same bytes: the same largest magnitude (its first value found by a
 * compare of each magnitude with it), the same products iscale * v, and vcvtps2dq's rounding,
 * to nearest with ties to even as nearest_int's (MXCSR's default, which nothing in qkv
 * changes). The 16 sums of 16 are the int32 values' own, added in pairs. A block with a NaN, an
 * infinity or only zeros goes the scalar way. */
__attribute__((target("avx2,fma"))) static void q8_k_block_avx2(const float *v, int8_t *out,
                                                                 float *d, int16_t *bsums) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 amax = zero, finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int i = 0; i < QK_K / 8; i++) {
        const __m256 x = _mm256_loadu_ps(v + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, x));
        /* x * 0 is 0 for a finite x, NaN for an infinity or a NaN */
        finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_mul_ps(x, zero), zero, _CMP_EQ_OQ));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float largest = _mm_cvtss_f32(m4);
    if (_mm256_movemask_ps(finite) != 0xff || largest == 0.0f) {
        q8_k_block(v, out, d, bsums);
        return;
    }
    const __m256 top = _mm256_set1_ps(largest);
    float max = 0.0f;
    for (int i = 0; i < QK_K / 8; i++) {
        const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i));
        const int at = _mm256_movemask_ps(_mm256_cmp_ps(a, top, _CMP_EQ_OQ));
        if (at) {
            max = v[8 * i + __builtin_ctz((unsigned)at)];
            break;
        }
    }
    const float iscale = -127.0f / max;
    const __m256 scale = _mm256_set1_ps(iscale);
    const __m256i most = _mm256_set1_epi32(127);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < QK_K / 64; g++) { /* 64 inputs: 4 sums of 16 */
        __m256i r[8];
        for (int i = 0; i < 8; i++)
            r[i] = _mm256_min_epi32(
                _mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(v + 64 * g + 8 * i))),
                most);
        for (int h = 0; h < 2; h++) { /* 32 int32 -> 32 int8 in order (packs interleave lanes) */
            const __m256i packed =
                _mm256_packs_epi16(_mm256_packs_epi32(r[4 * h], r[4 * h + 1]),
                                   _mm256_packs_epi32(r[4 * h + 2], r[4 * h + 3]));
            _mm256_storeu_si256((__m256i *)(out + 64 * g + 32 * h),
                                _mm256_permutevar8x32_epi32(packed, order));
        }
        /* sums of 16: lanes of r[2j] + r[2j+1], added across by two hadds and the halves */
        const __m256i s = _mm256_hadd_epi32(
            _mm256_hadd_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3])),
            _mm256_hadd_epi32(_mm256_add_epi32(r[4], r[5]), _mm256_add_epi32(r[6], r[7])));
        const __m128i four =
            _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        _mm_storel_epi64((__m128i *)(bsums + 4 * g), _mm_packs_epi32(four, four));
    }
    *d = 1.0f / iscale;
}
#endif

/* x (M, K) float32 -> q (M, K) int8, d (M, K/256) float32, bsums (M, K/16) int16, each block of
 * 256 as q8_k_block, with the variant's code (every variant gives the same bytes;
 * tests/nn/test_native_quant_k.py holds them to a numpy reference of llama.cpp's). Returns 0,
 * or -1 for a variant this CPU does not run (nothing written). */
int qkv_quantk_activations_variant(int variant, const float *x, int64_t M, int64_t K, int8_t *q,
                                   float *d, int16_t *bsums) {
    if (variant < 0 || variant >= QKV_VARIANTS || !(qkv_quant_variants() >> variant & 1))
        return -1;
    void (*block)(const float *, int8_t *, float *, int16_t *) = q8_k_block;
#if defined(QKV_X86)
    if (variant >= QKV_AVX2) block = q8_k_block_avx2;
#endif
    for (int64_t i = 0; i < M * (K / QK_K); i++)
        block(x + i * QK_K, q + i * QK_K, d + i, bsums + i * 16);
    return 0;
}

/* qkv_quantk_activations_variant with the best variant this CPU runs */
void qkv_quantk_activations(const float *x, int64_t M, int64_t K, int8_t *q, float *d,
                            int16_t *bsums) {
    static int best = -1; /* AVX2's code where the CPU has it (AVX2's is every x86 one's) */
    if (best < 0) best = qkv_quant_variants() >> QKV_AVX2 & 1 ? QKV_AVX2 : QKV_SCALAR;
    qkv_quantk_activations_variant(best, x, M, K, q, d, bsums);
}

/* ---- the products ------------------------------------------------------------------------ */

typedef struct {
    int fmt;
    const uint8_t *panels;
    const float *bias;
    int64_t N, K, M;
    const int8_t *xq;
    const float *xd;
    const int16_t *bsums; /* (M, K/16) */
    const int32_t *pairs; /* (M, K/256, 4): sums of x over sub-blocks 2k, 2k+1 as int16 pairs */
    float *y;
} product;

/* where the parts of panel p's super-block b lie */
typedef struct {
    const uint8_t *low, *high, *scales, *mins;
    const float *d, *dmin;
} parts;

static inline parts parts_of(const product *pr, int64_t p, int64_t b) {
    const int fmt = pr->fmt;
    const uint8_t *low = pr->panels + (p * (pr->K / QK_K) + b) * panel_block_bytes(fmt);
    parts at = {low, low + LOW_BYTES, 0, 0, 0, 0};
    at.scales = at.high + high_bytes(fmt);
    at.mins = at.scales + scale_bytes(fmt);
    at.d = (const float *)(at.mins + min_bytes(fmt));
    at.dmin = at.d + ROWS;
    return at;
}

/* the SIMD bodies prefetch the super-block AHEAD on of the one they sum (a prefetch past the
 * panels' end is dropped, never a fault): 2 to 16 measured alike on AVX2 and on a Zen 4 */
#ifndef AHEAD
#define AHEAD 4
#endif

static void store(const product *pr, int64_t p, int64_t m, const float *acc) {
    const int64_t n0 = p * ROWS, rows = pr->N - n0 < ROWS ? pr->N - n0 : ROWS;
    float *y = pr->y + m * pr->N + n0;
    for (int64_t r = 0; r < rows; r++) y[r] = pr->bias ? acc[r] + pr->bias[n0 + r] : acc[r];
}

/* The float operations of one super-block, the same in every variant, lane by lane. */
#define FINISH_SCALAR(acc, d, dmin, xd, isum, summ, fmt)                                       \
    do {                                                                                       \
        acc = acc + (d * xd) * (float)(isum);                                                  \
        if (fmt != Q6_K) acc = acc - (dmin * xd) * (float)(summ);                              \
    } while (0)

/* the integer of row r, column 64g + 32e + 4s + t (e: 0 the low nibble's half, 1 the high's) */
static inline int value_of(int fmt, const parts *at, int r, int g, int e, int s, int t) {
    const int byte = at->low[((g * 8 + s) * ROWS + r) * 4 + t];
    int v = e ? byte >> 4 : byte & 15;
    if (fmt == Q5_K) v |= (at->high[((g * 2 + e) * ROWS + r) * 4 + t] >> s & 1) << 4;
    if (fmt == Q6_K)
        v |= (at->high[((g * 4 + s / 2) * ROWS + r) * 4 + t] >> (4 * (s % 2) + 2 * e) & 3) << 4;
    return v;
}

static void panel_scalar_row(const product *pr, int64_t p, int64_t m) {
    const int fmt = pr->fmt;
    const int64_t nsb = pr->K / QK_K;
    float acc[ROWS] = {0};
    for (int64_t b = 0; b < nsb; b++) {
        const parts at = parts_of(pr, p, b);
        const int8_t *x = pr->xq + m * pr->K + b * QK_K;
        const int64_t i = m * nsb + b;
        const int16_t *bs = pr->bsums + i * 16;
        for (int r = 0; r < ROWS; r++) {
            int32_t isum = 0, summ = 0;
            for (int g = 0; g < 4; g++)
                for (int e = 0; e < 2; e++) {
                    /* Q4_K, Q5_K: sub-block 2g + e, 32 columns; Q6_K: 4g + 2e + (s >= 4) */
                    int32_t part[2] = {0, 0};
                    for (int s = 0; s < 8; s++)
                        for (int t = 0; t < 4; t++)
                            part[s / 4] += value_of(fmt, &at, r, g, e, s, t) *
                                           x[64 * g + 32 * e + 4 * s + t];
                    if (fmt == Q6_K) {
                        for (int h = 0; h < 2; h++) {
                            const int j = 4 * g + 2 * e + h;
                            isum += (int8_t)at.scales[j * ROWS + r] * (part[h] - 32 * bs[j]);
                        }
                    } else {
                        const int j = 2 * g + e;
                        isum += at.scales[j * ROWS + r] * (part[0] + part[1]);
                        summ += at.mins[(j / 2 * ROWS + r) * 2 + j % 2] *
                                (bs[2 * j] + bs[2 * j + 1]);
                    }
                }
            FINISH_SCALAR(acc[r], at.d[r], at.dmin[r], pr->xd[i], isum, summ, fmt);
        }
    }
    store(pr, p, m, acc);
}

#if defined(QKV_X86)
static inline int32_t four(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, 4);
    return v;
}

#include "quant_k_avx2.h"

/* 256 bits, 8 rows at a time: AVX-VNNI (vpdpbusd), and the same code in AVX-512's encoding
 * (the twin) */
#define NAME panel_avx_vnni
#define TARGET "avx2,fma,avxvnni"
#define DOT(acc, u, x) _mm256_dpbusd_avx_epi32(acc, u, x)
#include "quant_k_256.h"

#define NAME panel_twin
#define TARGET "avx2,fma,avx512f,avx512vl,avx512vnni"
#define DOT(acc, u, x) _mm256_dpbusd_epi32(acc, u, x)
#include "quant_k_256.h"

#include "quant_k_512.h"
#endif

static void panel_scalar(const product *pr, int64_t p, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) panel_scalar_row(pr, p, m);
}

/* panel p's 16 outputs for the activation rows m0..m1-1 */
typedef void (*panel_fn)(const product *, int64_t, int64_t, int64_t);

static panel_fn panel_of(int variant) {
#if defined(QKV_X86)
    switch (variant) {
    case QKV_AVX2: return panel_avx2;
    case QKV_AVX_VNNI: return panel_avx_vnni;
    case QKV_AVX512_VNNI: return panel_avx512_vnni;
    case TWIN: return panel_twin;
    }
#endif
    (void)variant;
    return panel_scalar;
}

/* The variants this CPU runs, a bit mask as qkv_quant_variants's, with bit 4 for the twin
 * (AVX-VNNI's code in AVX-512's encoding; where AVX-512 VNNI is). */
int qkv_quantk_variants(void) {
    const int mask = qkv_quant_variants();
    return mask >> QKV_AVX512_VNNI & 1 ? mask | 1 << TWIN : mask;
}

/* bytes of qkv_quantk_matmul's `work` for M rows of K */
int64_t qkv_quantk_work_bytes(int64_t M, int64_t K) {
    const int64_t nsb = K / QK_K;
    return (M * K + 63) / 64 * 64 + M * nsb * (4 + 16 + 32 + 32);
}

/* Rows of x rounded to Q8_K in work (qkv_quantk_work_bytes(parts * M, K) bytes), with the
 * sums of sub-block pairs that the minimums take: what out then points at. parts 1: x's M
 * rows; 2: 2M rows, x's, then what their rounding left (x - q d in float32, written to left
 * (M, K)), each rounded in turn: a product's two parts are one product of 2M rows, each
 * weight unpacked once for a row and its remainder. */
void qkv_quantk_prepare(const float *x, int64_t M, int64_t K, int parts, float *left, void *work,
                        qkv_q8k *out) {
    const int64_t nsb = K / QK_K, rows = parts * M;
    int8_t *xq = work;
    float *xd = (float *)(xq + (rows * K + 63) / 64 * 64);
    int32_t *pairs = (int32_t *)(xd + rows * nsb);
    int16_t *bsums = (int16_t *)(pairs + rows * nsb * 4);
    qkv_quantk_activations(x, M, K, xq, xd, bsums);
    if (parts == 2) {
        for (int64_t i = 0; i < M * K; i++) left[i] = x[i] - (float)xq[i] * xd[i / QK_K];
        qkv_quantk_activations(left, M, K, xq + M * K, xd + M * nsb, bsums + M * nsb * 16);
    }
    for (int64_t i = 0; i < rows * nsb; i++)
        for (int k = 0; k < 4; k++) {
            const int16_t *bs = bsums + i * 16 + 4 * k;
            const uint32_t a = (uint16_t)(bs[0] + bs[1]), c = (uint16_t)(bs[2] + bs[3]);
            pairs[i * 4 + k] = (int32_t)(a | c << 16);
        }
    *out = (qkv_q8k){xq, xd, bsums, pairs};
}

#define MANY 8 /* matrices in one qkv_quantk_many call at the most (quant.c's too) */

typedef struct {
    product pr[MANY];
    int64_t first[MANY + 1]; /* matrix i's panels are [first[i], first[i + 1]) of them all */
    int count;
    panel_fn fn;
    qkv_runs runs;
} many_job;

/* thread ith's pieces of the panels of every matrix (qkv_runs), for every row of x: MTILE rows
 * at a time, so that a piece's panels stay in the cache while the rows pass */
static void run_many(void *arg, int ith, int nth) {
    (void)nth;
    many_job *jb = arg;
    int64_t from, to;
    for (int taken = 0; qkv_runs_next(&jb->runs, ith, taken, &from, &to); taken++)
        for (int i = 0; i < jb->count; i++) {
            const product *pr = &jb->pr[i];
            int64_t a, b;
            qkv_runs_part(jb->first, i, from, to, &a, &b);
            for (int64_t m0 = 0; m0 < pr->M && a < b; m0 += MTILE) {
                const int64_t m1 = m0 + MTILE < pr->M ? m0 + MTILE : pr->M;
                for (int64_t p = a; p < b; p++) jb->fn(pr, p - jb->first[i], m0, m1);
            }
        }
}

/* ys[i] (M, N_i) = x @ mats[i]^T (+ bias) for M rows of x already rounded
 * (qkv_quantk_prepare), every matrix a K-quant one (fmt QKV_FMT_K + quant_k.c's) with x's K
 * columns: the panels of all of them shared by nth threads (qkv_runs), one task of the pool.
 * The caller (qkv/generate/step.c, qkv_quantk_matmul) has checked the variant, the sizes and
 * count <= MANY. */
void qkv_quantk_many(int variant, int count, const qkv_qmat *mats, float *const *ys,
                     const qkv_q8k *x, int64_t M, int nth) {
    many_job jb; /* not zeroed (80 calls a token): what is read is set below */
    jb.count = count;
    jb.fn = panel_of(variant);
    jb.first[0] = 0;
    for (int i = 0; i < count; i++) {
        const qkv_qmat *w = &mats[i];
        jb.pr[i] = (product){w->fmt - QKV_FMT_K, w->panels, w->bias, w->N, w->K, M,
                             x->q, x->d, x->bsums, x->pairs, ys[i]};
        jb.first[i + 1] = jb.first[i] + (w->N + ROWS - 1) / ROWS;
    }
    qkv_runs_start(&jb.runs, jb.first[count], &nth);
    qkv_parallel(run_many, &jb, nth);
}

/* y (M, N) = x (M, K) @ W.T (+ bias): W as qkv_quantk_repack made it, x rounded to Q8_K
 * (work: qkv_quantk_work_bytes(M, K)). Returns 0, or -1 when the format is none or the
 * variant is not one this CPU runs (nothing is written then). Only y's M * N floats are
 * written: a last panel's rows past N are computed and dropped. */
int qkv_quantk_matmul(int variant, int fmt, const uint8_t *panels, const float *bias, int64_t N,
                      int64_t K, const float *x, int64_t M, float *y, void *work, int nth) {
    if (fmt < 0 || fmt >= FORMATS || variant < 0 || variant > TWIN ||
        !(qkv_quantk_variants() >> variant & 1))
        return -1;
    qkv_q8k xq;
    qkv_quantk_prepare(x, M, K, 1, NULL, work, &xq);
    const qkv_qmat mat = {QKV_FMT_K + fmt, 1, N, K, panels, NULL, NULL, bias};
    float *const ys[1] = {y};
    qkv_quantk_many(variant, 1, &mat, ys, &xq, M, nth);
    return 0;
}
