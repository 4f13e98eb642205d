/* Decode attention over a long cache ("flash decoding"): one query per head, over the keys
 * and values of every cached token, read from a float16 cache (or an 8-bit one with a float
 * scale per token and head).
 *
 * Split-K: the positions [start, length) are cut into chunks; each (batch, kv-head, chunk) is
 * one task, which reads its chunk's keys and values once for all the query heads that share
 * them (grouped-query attention) and leaves, per query head, a partial: the largest score m,
 * the sum of exp(score - m) l, and the sum of exp(score - m) * value. The partials are then
 * combined exactly (the log-sum-exp trick: each chunk's sums are multiplied by exp(m_c - M)
 * for the overall largest M), so the result does not depend on where the chunks were cut,
 * beyond float32's rounding. The tasks run on the kept thread pool (qkv_parallel).
 *
 * Outputs: out (B, H, D) and lse (B, H), the log of each query's softmax denominator, so that
 * any weight can be recomputed as exp(scale * q . k - lse) (qkv/attention/native_decode.py).
 * A query that may see no key (every position masked, or an empty window) gets out = 0 and
 * lse = -inf, never NaN: attend's rule for a query with no key.
 *
 * Variants: scalar (libm's expf) and AVX2 + F16C (a polynomial exp, fused multiply-adds);
 * they agree to float32's rounding, not bit for bit. The AVX-VNNI and AVX-512 VNNI indices run
 * the AVX2 code: VNNI has nothing for floats, and a 512-bit version of this file measured no
 * faster on an AVX-512 Xeon (0.56 against 0.55 ms for SmolLM2's heads over 4,096 tokens, one
 * thread: the loop waits on memory and on the exps, not on the width of the products). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qkv_native.h"
#include "qkv_simd.h"

#if defined(QKV_X86)
#include <immintrin.h>
#endif

enum { CACHE_F16 = 0, CACHE_I8 = 1 };
#define CHUNK_MIN 64  /* positions per chunk at the least (auto), ... */
#define CHUNK_MAX 512 /* ... and at the most: a chunk's scores stay in the first-level cache */

typedef struct {
    int fmt;
    const float *q;                /* (B, H, D) */
    const void *keys, *values;     /* (B, Hkv, cap, D): uint16 halves or int8 */
    const float *kscale, *vscale;  /* (B, Hkv, cap): the 8-bit cache's scales; else NULL */
    const uint8_t *mask;           /* (B, cap): nonzero where a key may be seen; or NULL */
    int64_t B, H, Hkv, cap, D, G;  /* G = H / Hkv query heads per kv-head */
    int64_t start, length, chunk, nchunks;
    float scale;
    float *partials; /* (B, Hkv, nchunks, G, D + 2): m, l, then the D sums */
    float *scratch;  /* per thread: G * chunk scores, then 4 rows of D floats */
    int64_t scratch_floats;
} decode;

/* ---- what differs between variants: a row to floats, a dot product, acc += p * row, the
 * exps of a chunk's scores -------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}

/* row t of kv-head (b, kvh) of `cache` as floats (the 8-bit cache's times its scale) */
static inline const void *row_at(const decode *w, const void *cache, int64_t b, int64_t kvh,
                                 int64_t t) {
    const int64_t at = ((b * w->Hkv + kvh) * w->cap + t) * w->D;
    return w->fmt == CACHE_F16 ? (const void *)((const uint16_t *)cache + at)
                               : (const void *)((const int8_t *)cache + at);
}

static inline float scale_at(const float *scales, const decode *w, int64_t b, int64_t kvh,
                             int64_t t) {
    return scales ? scales[(b * w->Hkv + kvh) * w->cap + t] : 1.0f;
}

static void row_scalar(int fmt, const void *src, float s, float *row, int64_t D) {
    if (fmt == CACHE_F16)
        for (int64_t d = 0; d < D; d++) row[d] = half_to_float(((const uint16_t *)src)[d]);
    else
        for (int64_t d = 0; d < D; d++) row[d] = s * (float)((const int8_t *)src)[d];
}

static float dot_scalar(const float *a, const float *b, int64_t D) {
    float sum = 0.0f;
    for (int64_t d = 0; d < D; d++) sum += a[d] * b[d];
    return sum;
}

static void axpy_scalar(float *acc, float p, const float *row, int64_t D) {
    for (int64_t d = 0; d < D; d++) acc[d] += p * row[d];
}

/* four keys' rows (4, D) at once: their dot products with q, and acc += sum_j p[j] * row j */
static void dot4_scalar(const float *q, const float *rows, int64_t D, float *out) {
    for (int j = 0; j < 4; j++) out[j] = dot_scalar(q, rows + j * D, D);
}

static void axpy4_scalar(float *acc, const float *p, const float *rows, int64_t D) {
    for (int j = 0; j < 4; j++) axpy_scalar(acc, p[j], rows + j * D, D);
}

/* s[i] <- exp(s[i] - m) (0 for a hidden key's -inf); returns their sum */
static float exps_scalar(float *s, int64_t n, float m) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        s[i] = s[i] == -INFINITY ? 0.0f : expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

#if defined(QKV_X86)
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static float sum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static void row_avx2(int fmt, const void *src, float s, float *row, int64_t D) {
    int64_t d = 0;
    if (fmt == CACHE_F16) {
        const uint16_t *h = src;
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(row + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
    } else {
        const int8_t *c = src;
        const __m256 sv = _mm256_set1_ps(s);
        for (; d + 8 <= D; d += 8) {
            const __m128i b8 = _mm_loadl_epi64((const __m128i *)(c + d));
            _mm256_storeu_ps(row + d, _mm256_mul_ps(sv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8))));
        }
    }
    if (d < D) row_scalar(fmt, fmt == CACHE_F16 ? (const void *)((const uint16_t *)src + d)
                                                : (const void *)((const int8_t *)src + d),
                          s, row + d, D - d);
}

AVX2 static float dot_avx2(const float *a, const float *b, int64_t D) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    for (; d + 8 <= D; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    float sum = sum_avx2(_mm256_add_ps(s0, s1));
    for (; d < D; d++) sum += a[d] * b[d];
    return sum;
}

AVX2 static void axpy_avx2(float *acc, float p, const float *row, int64_t D) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(row + d), _mm256_loadu_ps(acc + d)));
    for (; d < D; d++) acc[d] += p * row[d];
}

/* four sums of 8 lanes each, as one vector of 4 */
AVX2 static inline __m128 sums4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

AVX2 static void dot4_avx2(const float *q, const float *rows, int64_t D, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + D + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows + 3 * D + d), a3);
    }
    _mm_storeu_ps(out, sums4_avx2(a0, a1, a2, a3));
    for (; d < D; d++)
        for (int j = 0; j < 4; j++) out[j] += q[d] * rows[j * D + d];
}

AVX2 static void axpy4_avx2(float *acc, const float *p, const float *rows, int64_t D) {
    const __m256 p0 = _mm256_set1_ps(p[0]), p1 = _mm256_set1_ps(p[1]);
    const __m256 p2 = _mm256_set1_ps(p[2]), p3 = _mm256_set1_ps(p[3]);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        a = _mm256_fmadd_ps(p0, _mm256_loadu_ps(rows + d), a);
        a = _mm256_fmadd_ps(p1, _mm256_loadu_ps(rows + D + d), a);
        a = _mm256_fmadd_ps(p2, _mm256_loadu_ps(rows + 2 * D + d), a);
        a = _mm256_fmadd_ps(p3, _mm256_loadu_ps(rows + 3 * D + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
    for (; d < D; d++)
        for (int j = 0; j < 4; j++) acc[d] += p[j] * rows[j * D + d];
}

AVX2 static float exps_avx2(float *s, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m), hidden = _mm256_set1_ps(-INFINITY);
    __m256 total = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(s + i);
        /* a hidden key's -inf minus m is -inf, which exp_avx2 already makes 0 */
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, hidden, _CMP_EQ_OQ),
                                          qkv_exp_avx2(_mm256_sub_ps(x, mv)));
        _mm256_storeu_ps(s + i, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = sum_avx2(total);
    for (; i < n; i++) {
        s[i] = s[i] == -INFINITY ? 0.0f : expf(s[i] - m);
        sum += s[i];
    }
    return sum;
}

#endif

/* ---- one task: the partials of one (batch, kv-head, chunk) ------------------------------ */

typedef void (*row_fn)(int, const void *, float, float *, int64_t);
typedef float (*dot_fn)(const float *, const float *, int64_t);
typedef void (*axpy_fn)(float *, float, const float *, int64_t);
typedef void (*dot4_fn)(const float *, const float *, int64_t, float *);
typedef void (*axpy4_fn)(float *, const float *, const float *, int64_t);
typedef float (*exps_fn)(float *, int64_t, float);

typedef struct { /* one variant's helpers */
    row_fn row;
    dot_fn dot;
    axpy_fn axpy;
    dot4_fn dot4;
    axpy4_fn axpy4;
    exps_fn exps;
} helpers;

/* Written once, made once per variant (each variant's function inlines it with its own
 * helpers, so that no call goes through a pointer). Keys and values are read 4 rows at a
 * time (their products summed together: one reduction for 4 scores, one pass over a
 * query's sums for 4 values), the last few one by one. */
static inline __attribute__((always_inline)) void chunk_partials(const decode *w, int64_t task,
                                                                 float *scratch, helpers f) {
    const int64_t G = w->G, D = w->D, c = task % w->nchunks, bk = task / w->nchunks;
    const int64_t b = bk / w->Hkv, kvh = bk % w->Hkv;
    const int64_t t0 = w->start + c * w->chunk;
    const int64_t n = w->length - t0 < w->chunk ? w->length - t0 : w->chunk;
    const float *q = w->q + (b * w->H + kvh * G) * D; /* (G, D): this kv-head's queries */
    const uint8_t *mask = w->mask ? w->mask + b * w->cap + t0 : NULL;
    float *scores = scratch, *rows = scratch + G * w->chunk; /* (G, n), (4, D) */
    float *part = w->partials + task * G * (D + 2);          /* (G, D + 2) */
#define SEEN(i) (!mask || mask[i])
#define ROW(cache, scales, i, into)                                                          \
    f.row(w->fmt, row_at(w, cache, b, kvh, t0 + (i)), scale_at(scales, w, b, kvh, t0 + (i)), \
          into, D)
    /* the scores, each key read once for the G queries that share it */
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        if (!(SEEN(i) || SEEN(i + 1) || SEEN(i + 2) || SEEN(i + 3))) {
            for (int64_t g = 0; g < G; g++)
                for (int j = 0; j < 4; j++) scores[g * n + i + j] = -INFINITY;
            continue;
        }
        for (int j = 0; j < 4; j++) ROW(w->keys, w->kscale, i + j, rows + j * D);
        for (int64_t g = 0; g < G; g++) {
            float four[4];
            f.dot4(q + g * D, rows, D, four);
            for (int j = 0; j < 4; j++)
                scores[g * n + i + j] = SEEN(i + j) ? four[j] * w->scale : -INFINITY;
        }
    }
    for (; i < n; i++) {
        if (SEEN(i)) ROW(w->keys, w->kscale, i, rows);
        for (int64_t g = 0; g < G; g++)
            scores[g * n + i] = SEEN(i) ? f.dot(q + g * D, rows, D) * w->scale : -INFINITY;
    }
    /* exp(score - m), their sum, and the values they weigh */
    for (int64_t g = 0; g < G; g++) {
        float *p = part + g * (D + 2), m = -INFINITY;
        for (int64_t j = 0; j < n; j++) m = scores[g * n + j] > m ? scores[g * n + j] : m;
        p[0] = m;
        memset(p + 2, 0, (size_t)D * sizeof(float));
        p[1] = m == -INFINITY ? 0.0f : f.exps(scores + g * n, n, m);
    }
    for (i = 0; i + 4 <= n; i += 4) {
        if (!(SEEN(i) || SEEN(i + 1) || SEEN(i + 2) || SEEN(i + 3))) continue;
        for (int j = 0; j < 4; j++) ROW(w->values, w->vscale, i + j, rows + j * D);
        for (int64_t g = 0; g < G; g++) f.axpy4(part + g * (D + 2) + 2, scores + g * n + i, rows, D);
    }
    for (; i < n; i++) {
        if (!SEEN(i)) continue;
        ROW(w->values, w->vscale, i, rows);
        for (int64_t g = 0; g < G; g++) {
            const float weight = scores[g * n + i];
            if (weight != 0.0f) f.axpy(part + g * (D + 2) + 2, weight, rows, D);
        }
    }
#undef SEEN
#undef ROW
}

static void chunk_scalar(const decode *w, int64_t task, float *scratch) {
    chunk_partials(w, task, scratch, (helpers){row_scalar, dot_scalar, axpy_scalar, dot4_scalar,
                                               axpy4_scalar, exps_scalar});
}

#if defined(QKV_X86)
AVX2 static void chunk_avx2(const decode *w, int64_t task, float *scratch) {
    chunk_partials(w, task, scratch,
                   (helpers){row_avx2, dot_avx2, axpy_avx2, dot4_avx2, axpy4_avx2, exps_avx2});
}
#endif

typedef void (*chunk_fn)(const decode *, int64_t, float *);

typedef struct {
    const decode *w;
    chunk_fn fn;
    qkv_runs runs; /* the tasks, shared as a product's panels (qkv_native.h) */
} job;

/* thread ith's tasks: a run of them (a kv-head's chunks lie side by side), then what is left
 * of the others' */
static void run_job(void *arg, int ith, int nth) {
    (void)nth;
    job *jb = arg;
    float *scratch = jb->w->scratch + ith * jb->w->scratch_floats;
    int64_t from, to;
    for (int taken = 0; qkv_runs_next(&jb->runs, ith, taken, &from, &to); taken++)
        for (int64_t task = from; task < to; task++) jb->fn(jb->w, task, scratch);
}

/* The partials of every chunk, combined exactly: out = sum_c exp(m_c - M) acc_c / L, with
 * L = sum_c exp(m_c - M) l_c, lse = M + log L. */
static void combine(const decode *w, float *out, float *lse) {
    const int64_t G = w->G, D = w->D, nc = w->nchunks;
    for (int64_t b = 0; b < w->B; b++)
        for (int64_t h = 0; h < w->H; h++) {
            const int64_t kvh = h / G, g = h % G;
            const float *first = w->partials + (b * w->Hkv + kvh) * nc * G * (D + 2) + g * (D + 2);
            const int64_t step = G * (D + 2); /* from one chunk's partial to the next */
            float *o = out + (b * w->H + h) * D;
            float M = -INFINITY, L = 0.0f;
            for (int64_t c = 0; c < nc; c++)
                if (first[c * step + 1] > 0.0f && first[c * step] > M) M = first[c * step];
            memset(o, 0, (size_t)D * sizeof(float));
            if (M == -INFINITY) { /* no key to see: zeros, and a denominator of 0 */
                lse[b * w->H + h] = -INFINITY;
                continue;
            }
            for (int64_t c = 0; c < nc; c++) {
                const float *p = first + c * step;
                if (!(p[1] > 0.0f)) continue;
                const float f = expf(p[0] - M);
                L += f * p[1];
                for (int64_t d = 0; d < D; d++) o[d] += f * p[2 + d];
            }
            for (int64_t d = 0; d < D; d++) o[d] /= L;
            lse[b * w->H + h] = M + logf(L);
        }
}

/* The variants this CPU runs for decode attention: a mask of 1 << QKV_SCALAR, ... as
 * qkv_quant_variants, with F16C besides for every SIMD one (the halves' conversion). */
int qkv_decode_variants(void) {
    int mask = 1 << QKV_SCALAR;
#if defined(QKV_X86)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        mask |= 1 << QKV_AVX2;
        if (__builtin_cpu_supports("avxvnni")) mask |= 1 << QKV_AVX_VNNI;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            mask |= 1 << QKV_AVX512_VNNI;
    }
#endif
    return mask;
}

/* the chunk length the kernel takes when asked for 0: enough tasks for nth threads to share
 * (four each), each CHUNK_MIN..CHUNK_MAX positions, a multiple of 16 */
int64_t qkv_decode_chunk(int64_t B, int64_t Hkv, int64_t n, int nth) {
    if (n <= CHUNK_MIN) return n > 0 ? n : 1;
    const int64_t heads = B * Hkv, wanted = 4 * (int64_t)(nth > 0 ? nth : 1);
    const int64_t per_head = (wanted + heads - 1) / heads;
    int64_t chunk = (n + per_head - 1) / per_head;
    chunk = (chunk + 15) / 16 * 16;
    return chunk < CHUNK_MIN ? CHUNK_MIN : chunk > CHUNK_MAX ? CHUNK_MAX : chunk;
}

/* out (B, H, D), lse (B, H) of q (B, H, D) over positions [start, length) of the cache.
 * fmt: 0 float16 (keys, values as uint16 halves; kscale, vscale NULL), 1 int8 (each row times
 * its float scale in kscale, vscale (B, Hkv, cap)). mask (B, cap) bytes or NULL; chunk: the
 * positions per chunk (0: qkv_decode_chunk's). The caller has checked every size (H a
 * multiple of Hkv, 0 <= start <= length <= cap, D >= 1); nothing here reads past them.
 * Returns 0; -1 when the variant is not one this CPU runs, -2 when memory ran out (nothing
 * is written then). */
int qkv_decode_attention(int variant, int fmt, const float *q, const void *keys,
                         const void *values, const float *kscale, const float *vscale,
                         const uint8_t *mask, int64_t B, int64_t H, int64_t Hkv, int64_t cap,
                         int64_t D, int64_t start, int64_t length, float scale, int64_t chunk,
                         float *out, float *lse, int nth) {
    if (variant < 0 || variant >= QKV_VARIANTS || !(qkv_decode_variants() >> variant & 1))
        return -1;
    const int64_t n = length - start;
    if (nth < 1) nth = 1;
    if (chunk <= 0) chunk = qkv_decode_chunk(B, Hkv, n, nth);
    if (chunk > n) chunk = n > 0 ? n : 1;
    decode w = {fmt, q, keys, values, kscale, vscale, mask, B, H, Hkv, cap, D, H / Hkv,
                start, length, chunk, (n + chunk - 1) / chunk, scale, NULL, NULL, 0};
    const int64_t tasks = B * Hkv * w.nchunks;
    job jb; /* not zeroed: its 4 KB of runs are set for the threads there are */
    jb.w = &w;
    qkv_runs_start(&jb.runs, tasks, &nth); /* nth no more than the tasks */
    w.scratch_floats = (w.G * chunk + 4 * D + 15) / 16 * 16;
    float *memory = malloc((size_t)(tasks * w.G * (D + 2) + nth * w.scratch_floats) * sizeof(float));
    if (!memory) return -2;
    w.partials = memory;
    w.scratch = memory + tasks * w.G * (D + 2);
    chunk_fn fn = chunk_scalar;
#if defined(QKV_X86)
    if (variant != QKV_SCALAR) fn = chunk_avx2;
#endif
    jb.fn = fn;
    if (tasks > 0) qkv_parallel(run_job, &jb, nth);
    combine(&w, out, lse);
    free(memory);
    return 0;
}
