/* Decoding steps of a plain Llama-like decoder in one call: the fed-back token's vector (or a
 * prompt's M vectors, each a token at its own position) through every block (RMSNorm, q k v,
 * rotary, the float16 cache's append, attention over the cache, the output projection, the
 * residual sum, RMSNorm, the SiLU-gated MLP, the residual sum) and the final norm, with the
 * file's own quantized matrices (qkv/nn/quant.c, and quant_k.c's K-quants) and the split-K
 * decode attention
 * (qkv/attention/decode.c).
 *
 * Python makes one call a token, and one for a short prompt (qkv/generate/native_step.py
 * checks every size first and refuses what this file does not compute): a prompt's products
 * take its M rows at once (each block unpacked once for up to 4 rows, a K-quant's for 2), its
 * attention one row at a time over the cache so far, as M decoding steps would. The products
 * and the attention run on the kept thread pool: its workers wait between them, spinning, for
 * the next task of the same call, so a step costs no thread start and no Python between its
 * operations. The small operations between products (norms, rotary, the append, the gate) run
 * on the calling thread: on SmolLM2 they are a few thousand floats a layer and row.
 *
 * The arithmetic is FastStep's (qkv/generate/fast_step.py), its reference: the same products
 * bit for bit, x * cos + rotate_half(x) * sin as two products and a sum, silu(g) * u as
 * g / (1 + exp(-g)) * u; the norm's mean of squares summed in double; keys and values rounded
 * to float16 (nearest, ties to even) as they enter the cache, as llama.cpp's cache holds them.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qkv_native.h"
#include "qkv_simd.h"

enum { CACHE_F16 = 0 }; /* decode.c's float16 format */

typedef struct {
    const float *attn_norm, *mlp_norm; /* (C) RMSNorm weights */
    qkv_qmat q, k, v, o, gate, up, down;
    uint16_t *keys, *values; /* (Hkv, cap, D) float16 */
    int64_t window;          /* the positions a query sees at the most; 0: all */
    float scale;             /* on q . k */
} qkv_step_layer;

typedef struct {
    int variant, attn_variant, nth;
    int64_t L, C, H, Hkv, D, F, cap;
    float eps, final_eps;
    const qkv_step_layer *layers;
    const float *final_norm;  /* (C), or NULL: the hidden vector as the last block left it */
    const float *cos, *sin;   /* (cap, D): each position's turn, rotate_half's layout */
} qkv_step_model;

/* The working memory of M rows, cut from one buffer of qkv_step_work_floats floats */
typedef struct {
    float *h, *q, *k, *v, *att, *lse, *gate, *up, *proj; /* (M, width) each */
    float *each;   /* the products of every part (2 rows a row) before they are summed */
    int8_t *xq;    /* 8-bit inputs: two parts of M of the widest rows */
    float *blocks; /* their d, s and sums */
    float *left;   /* (M, widest): what Q8_K's rounding leaves of a K-quant product's input */
    void *kwork;   /* quant_k.c's working memory for 2M of the widest rows (two parts) */
} scratch;

static int64_t widest(int64_t C, int64_t H, int64_t D, int64_t F) {
    const int64_t w = C > F ? C : F;
    return H * D > w ? H * D : w;
}

static scratch cut(float *work, int64_t M, int64_t C, int64_t H, int64_t Hkv, int64_t D,
                   int64_t F) {
    scratch w;
    const int64_t wide = widest(C, H, D, F);
    w.h = work;
    w.q = w.h + M * C;
    w.k = w.q + M * H * D;
    w.v = w.k + M * Hkv * D;
    w.att = w.v + M * Hkv * D;
    w.lse = w.att + M * H * D;
    w.gate = w.lse + M * H;
    w.up = w.gate + M * F;
    w.proj = w.up + M * F;
    w.each = w.proj + M * C;
    w.xq = (int8_t *)(w.each + 2 * M * (H * D + 2 * Hkv * D + C + 2 * F));
    w.blocks = (float *)(w.xq + 2 * M * wide);
    w.left = w.blocks + 3 * 2 * M * (wide / 32);
    w.kwork = w.left + M * wide;
    return w;
}

/* floats of the working memory of M rows (cut's, and 64 to spare); the caller aligns it to 64
 * bytes. wide is a multiple of 32 (the checked sizes), so the 8-bit rows keep the floats after
 * them aligned. */
int64_t qkv_step_work_floats(int64_t C, int64_t H, int64_t Hkv, int64_t D, int64_t F,
                             int64_t M) {
    const int64_t wide = widest(C, H, D, F);
    return M * (2 * C + 2 * H * D + 2 * Hkv * D + H + 2 * F +
                2 * (H * D + 2 * Hkv * D + C + 2 * F) + 2 * wide / 4 + 3 * 2 * (wide / 32) +
                wide) +
           (qkv_quantk_work_bytes(2 * M, wide) + 3) / 4 + 64;
}

/* x (heads, D) turned in place: out[i] = x[i] cos[i] - x[i + D/2] sin[i] for the first half,
 * x[i] cos[i] + x[i - D/2] sin[i] for the second */
static void rotate(float *x, int64_t heads, int64_t D, const float *cos, const float *sin) {
    const int64_t half = D / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *v = x + h * D;
        for (int64_t i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] + (-b) * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

#if defined(QKV_X86)
QKV_AVX2_FN static int64_t to_half_avx2(const float *x, uint16_t *h, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(h + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

QKV_AVX2_FN static int64_t silu_gate_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = qkv_exp_avx2(_mm256_or_ps(g, sign)); /* exp(-|g|) */
        const __m256 top = _mm256_blendv_ps(e, one, _mm256_cmp_ps(g, zero, _CMP_GE_OQ));
        const __m256 sig = _mm256_div_ps(top, _mm256_add_ps(one, e));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_loadu_ps(up + i)));
    }
    return i;
}

/* x's squares summed in double, 8 lanes in two sums (each square of a float exact in double,
 * so only the order of the sum is not the scalar loop's); *done: the elements summed */
QKV_AVX2_FN static double squares_avx2(const float *x, int64_t n, int64_t *done) {
    __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256d lo = _mm256_cvtps_pd(_mm_loadu_ps(x + i));
        const __m256d hi = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        a = _mm256_add_pd(a, _mm256_mul_pd(lo, lo));
        b = _mm256_add_pd(b, _mm256_mul_pd(hi, hi));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(a, b));
    *done = i;
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* out[i] = (x[i] * r) * w[i], 8 at a time */
QKV_AVX2_FN static int64_t scaled_avx2(const float *x, const float *w, float r, int64_t n,
                                       float *out) {
    const __m256 rr = _mm256_set1_ps(r);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rr),
                                                _mm256_loadu_ps(w + i)));
    return i;
}
#endif

/* RMSNorm: the mean of x's squares summed in double (on a Zen 4 the scalar loop's chain of
 * double sums took 3.6 us for 768 floats, the AVX2 one 0.8; its eight lanes sum in another
 * order than the scalar loop's, as torch's does, the float result alike but for a tie now and
 * then) */
static void rms_norm(const float *x, const float *w, float eps, int64_t n, float *out,
                     int simd) {
    double squares = 0.0;
    int64_t i = 0;
#if defined(QKV_X86)
    if (simd) squares = squares_avx2(x, n, &i);
#endif
    for (; i < n; i++) squares += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    i = 0;
#if defined(QKV_X86)
    if (simd) i = scaled_avx2(x, w, r, n, out);
#endif
    for (; i < n; i++) out[i] = (x[i] * r) * w[i];
}

/* x rounded to float16, nearest and ties to even (F16C's conversion is the same rounding) */
static void to_half(const float *x, uint16_t *h, int64_t n, int simd) {
    int64_t i = 0;
#if defined(QKV_X86)
    if (simd) i = to_half_avx2(x, h, n);
#endif
    for (; i < n; i++) {
        const _Float16 f = (_Float16)x[i];
        memcpy(h + i, &f, 2);
    }
}

/* gate = silu(gate) * up, silu(g) = g * sigmoid(g) with sigmoid from e = exp(-|g|): 1 / (1 + e)
 * for g >= 0, e / (1 + e) below (no exp of a large number, which overflows and is slow) */
static void silu_gate(float *gate, const float *up, int64_t n, int simd) {
    int64_t i = 0;
#if defined(QKV_X86)
    if (simd) i = silu_gate_avx2(gate, up, n);
#endif
    for (; i < n; i++) {
        const float g = gate[i], e = expf(-fabsf(g));
        gate[i] = g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e)) * up[i];
    }
}

#define MANY 8 /* quant.c's most matrices a call */

/* ys[i] (M, N_i) = x @ mats[i]^T (+ bias), x (M, K) rounded to 8 bits in mats[0].parts parts
 * (the matrices of one call take the same), as QuantLinear does: the K-quant matrices in one
 * task of the pool (qkv_quantk_many, x rounded to Q8_K), the rest in another (qkv_quant_many,
 * 8-bit blocks of 32); in two parts, each the product of both parts' rows at once (quant.c's
 * rows 2r and 2r + 1 are row r's parts, quant_k.c's rows r and M + r), then the parts summed in
 * order and the bias added. Returns 0 (the callers have checked the variant and sizes). */
static int products(const qkv_step_model *m, const scratch *w, int count, const qkv_qmat *all,
                    float *const *all_ys, const float *x, int64_t M, int64_t K) {
    const int parts = all[0].parts;
    qkv_qmat mats[MANY], kmats[MANY];
    float *ys[MANY], *kys[MANY], *at = w->each;
    int plain = 0, kquant = 0;
    for (int i = 0; i < count; i++) {
        qkv_qmat mat = all[i];
        float *y = all_ys[i];
        if (parts == 2) { /* both parts' outputs, summed below */
            mat.bias = NULL;
            y = at;
            at += 2 * M * mat.N;
        }
        if (mat.fmt >= QKV_FMT_K) {
            kmats[kquant] = mat;
            kys[kquant++] = y;
        } else {
            mats[plain] = mat;
            ys[plain++] = y;
        }
    }
    if (kquant) {
        qkv_q8k xk;
        qkv_quantk_prepare(x, M, K, parts, w->left, w->kwork, &xk);
        qkv_quantk_many(m->variant, kquant, kmats, kys, &xk, parts * M, m->nth);
    }
    if (plain) {
        const int64_t nb = M * K / 32;
        float *d = w->blocks, *s = d + parts * nb;
        int32_t *sum = (int32_t *)(s + parts * nb);
        qkv_quant_activations_parts(x, M, K, parts, w->xq, d, s, sum);
        const qkv_q8 xq = {w->xq, d, s, sum};
        qkv_quant_many(m->variant, plain, mats, ys, &xq, parts * M, m->nth);
    }
    if (parts == 1) return 0;
    at = w->each;
    for (int i = 0; i < count; i++) {
        const int64_t N = all[i].N;
        const float *bias = all[i].bias;
        const int k = all[i].fmt >= QKV_FMT_K;
        for (int64_t r = 0; r < M; r++) {
            const float *first = at + (k ? r : 2 * r) * N, *second = at + (k ? M + r : 2 * r + 1) * N;
            for (int64_t n = 0; n < N; n++) {
                const float t = first[n] + second[n];
                all_ys[i][r * N + n] = bias ? t + bias[n] : t;
            }
        }
        at += 2 * M * N;
    }
    return 0;
}

/* x (M, C): the vectors of M tokens at positions at .. at + M - 1 in, the final norm's outputs
 * (or the last residual sums) out; the caller has checked at + M <= cap. Each row's keys and
 * values enter the cache before its attention, which reads the cache up to its own position
 * (a prompt's rows, causally, each as one decoding step would). work: qkv_step_work_floats(...,
 * M) floats, 64-byte aligned. Returns 0, or the products' or the decode attention's error (-1:
 * a variant this CPU lacks, -2: out of memory). */
int qkv_step(const qkv_step_model *m, float *x, int64_t M, int64_t at, float *work) {
    const int64_t C = m->C, H = m->H, Hkv = m->Hkv, D = m->D, F = m->F;
    const scratch w = cut(work, M, C, H, Hkv, D, F);
    const int simd = m->attn_variant != QKV_SCALAR; /* AVX2 with F16C, as decode.c's */
    for (int64_t l = 0; l < m->L; l++) {
        const qkv_step_layer *layer = &m->layers[l];
        for (int64_t r = 0; r < M; r++)
            rms_norm(x + r * C, layer->attn_norm, m->eps, C, w.h + r * C, simd);
        const qkv_qmat qkv_mats[3] = {layer->q, layer->k, layer->v};
        float *const qkv_out[3] = {w.q, w.k, w.v};
        if (products(m, &w, 3, qkv_mats, qkv_out, w.h, M, C)) return -1;
        for (int64_t r = 0; r < M; r++) {
            const int64_t pos = at + r;
            float *q = w.q + r * H * D, *k = w.k + r * Hkv * D, *v = w.v + r * Hkv * D;
            rotate(q, H, D, m->cos + pos * D, m->sin + pos * D);
            rotate(k, Hkv, D, m->cos + pos * D, m->sin + pos * D);
            for (int64_t j = 0; j < Hkv; j++) {
                to_half(k + j * D, layer->keys + (j * m->cap + pos) * D, D, simd);
                to_half(v + j * D, layer->values + (j * m->cap + pos) * D, D, simd);
            }
        }
        for (int64_t r = 0; r < M; r++) {
            const int64_t length = at + r + 1;
            const int64_t start =
                layer->window > 0 && length > layer->window ? length - layer->window : 0;
            const int failed = qkv_decode_attention(
                m->attn_variant, CACHE_F16, w.q + r * H * D, layer->keys, layer->values, NULL,
                NULL, NULL, 1, H, Hkv, m->cap, D, start, length, layer->scale, 0,
                w.att + r * H * D, w.lse + r * H, m->nth);
            if (failed) return failed;
        }
        float *const proj[1] = {w.proj};
        if (products(m, &w, 1, &layer->o, proj, w.att, M, H * D)) return -1;
        for (int64_t i = 0; i < M * C; i++) x[i] = x[i] + w.proj[i];
        for (int64_t r = 0; r < M; r++)
            rms_norm(x + r * C, layer->mlp_norm, m->eps, C, w.h + r * C, simd);
        const qkv_qmat gu_mats[2] = {layer->gate, layer->up};
        float *const gu_out[2] = {w.gate, w.up};
        if (products(m, &w, 2, gu_mats, gu_out, w.h, M, C)) return -1;
        silu_gate(w.gate, w.up, M * F, simd);
        if (products(m, &w, 1, &layer->down, proj, w.gate, M, F)) return -1;
        for (int64_t i = 0; i < M * C; i++) x[i] = x[i] + w.proj[i];
    }
    if (m->final_norm)
        for (int64_t r = 0; r < M; r++) {
            rms_norm(x + r * C, m->final_norm, m->final_eps, C, w.h, simd);
            memcpy(x + r * C, w.h, (size_t)C * sizeof(float));
        }
    return 0;
}
