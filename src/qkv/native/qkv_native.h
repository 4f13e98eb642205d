/* qkv's native CPU code: what every C file shares. Plain C11, no torch ABI: Python calls
 * these functions through ctypes on tensors' memory (qkv/native/__init__.py builds and
 * loads the library). */
#ifndef QKV_NATIVE_H
#define QKV_NATIVE_H

#include <stdatomic.h>
#include <stdint.h>

/* One task, run by nth threads at once: thread ith (0..nth-1) does its share. */
typedef void (*qkv_task)(void *arg, int ith, int nth);

/* fn(arg, ith, nth) on nth threads (the caller's is thread 0), returning when all are done.
 * The workers are kept between calls, spinning a little before they sleep, so that calls a
 * few microseconds apart (a decoding step's products) cost no thread start or wake-up. */
void qkv_parallel(qkv_task fn, void *arg, int nth);
/* a decoder starts (1) or ends (-1): the workers spin longer between its tasks (pool.c) */
int qkv_pool_linger(int delta);

/* Several matrices' panels in one task of the pool (quant.c's and quant_k.c's run_many),
 * matrix i's [first[i], first[i + 1]) of them all. Each thread has a run of them, one stream
 * from memory, and takes it from its front a piece at a time; one that has finished its own
 * takes pieces from the backs of the others'. Equal runs alone left one thread waiting for
 * the other: on a Zen 4 VM a 30 MB Q6_K head took 1.25 ms in equal runs and 0.88 ms shared so,
 * a token of a Q4_K_M model 4.2-4.6 ms against 3.7-4.0 (Q6_K panels beside Q4_K ones are 1.5x
 * the bytes, and the machine slows one thread more than the other). Pieces dealt in turn, each
 * thread's stream cut into many, made the small products slower. A run is two 32-bit panel
 * numbers in one atomic word, in a cache line of its own; which thread computes a panel
 * changes nothing in its outputs. QKV_RUNS threads at the most have runs, those past it only
 * take from the backs; so do the threads of a pool that runs fewer than asked for. */
#define QKV_RUNS 64
#define QKV_PIECES 8 /* pieces in a run */
typedef struct {
    _Alignas(64) _Atomic uint64_t left; /* the panels [from, to) not yet taken: from | to << 32 */
} qkv_run;

typedef struct {
    qkv_run run[QKV_RUNS];
    int64_t piece, total; /* panels a piece, and in all */
    int n;                /* runs; 0: one thread takes all the panels at once */
} qkv_runs;

static inline uint64_t qkv_span(int64_t from, int64_t to) {
    return (uint64_t)from | (uint64_t)to << 32;
}

/* total panels for nth threads; *nth becomes 1 where there are more panels than 32 bits count
 * (2^36 rows, a terabyte of weights at the least), or fewer panels than threads */
static inline void qkv_runs_start(qkv_runs *r, int64_t total, int *nth) {
    if (*nth > total) *nth = (int)total;
    if (*nth < 1 || total > (int64_t)UINT32_MAX) *nth = 1;
    r->total = total;
    r->n = *nth == 1 ? 0 : *nth < QKV_RUNS ? *nth : QKV_RUNS;
    if (!r->n) return;
    const int64_t piece = total / ((int64_t)r->n * QKV_PIECES);
    r->piece = piece > 0 ? piece : 1;
    for (int t = 0; t < r->n; t++)
        atomic_init(&r->run[t].left, qkv_span(total * t / r->n, total * (t + 1) / r->n));
}

/* a piece of a run, [*from, *to): from its front (back 0) or its back (1); 0 when it is
 * empty */
static inline int qkv_take(qkv_run *run, int64_t piece, int back, int64_t *from, int64_t *to) {
    uint64_t was = atomic_load_explicit(&run->left, memory_order_relaxed);
    for (;;) {
        const int64_t f = (int64_t)(was & 0xffffffffu), t = (int64_t)(was >> 32);
        if (f >= t) return 0;
        const int64_t n = t - f < piece ? t - f : piece;
        *from = back ? t - n : f;
        *to = back ? t : f + n;
        const uint64_t now = back ? qkv_span(f, t - n) : qkv_span(f + n, t);
        if (atomic_compare_exchange_weak_explicit(&run->left, &was, now, memory_order_relaxed,
                                                  memory_order_relaxed))
            return 1;
    }
}

/* thread ith's next piece of panels, [*from, *to) of them all, after `taken` pieces: from its
 * own run's front, then from the backs of the others'; 0 when none is left */
static inline int qkv_runs_next(qkv_runs *r, int ith, int taken, int64_t *from, int64_t *to) {
    if (!r->n) {
        *from = 0;
        *to = r->total;
        return !taken;
    }
    if (ith < r->n && qkv_take(&r->run[ith], r->piece, 0, from, to)) return 1;
    for (int j = 1; j <= r->n; j++)
        if (qkv_take(&r->run[(ith + j) % r->n], r->piece, 1, from, to)) return 1;
    return 0;
}

/* matrix i's panels in [from, to) of them all: [*a, *b) of matrix i's, none where *a >= *b */
static inline void qkv_runs_part(const int64_t *first, int i, int64_t from, int64_t to,
                                 int64_t *a, int64_t *b) {
    *a = from > first[i] ? from : first[i];
    *b = to < first[i + 1] ? to : first[i + 1];
}

/* Instruction-set variants of the kernels, lowest first; each runs where the CPU has it. */
enum { QKV_SCALAR = 0, QKV_AVX2 = 1, QKV_AVX_VNNI = 2, QKV_AVX512_VNNI = 3, QKV_VARIANTS = 4 };

/* One quantized matrix as qkv/nn/quant.c's repacking left it (QuantLinear's buffers): fmt 0
 * Q4_0, 1 Q4_1, 2 Q8_0, 3 Q5_0, 4 Q5_1; or, for generate/step.c, QKV_FMT_K + quant_k.c's
 * format (Q4_K, Q5_K, Q6_K: panels only, scales and mins NULL); N rows of K columns; bias (N)
 * or NULL; parts: its inputs rounded to 8 bits once (1) or twice, the second time what the
 * first left (2). */
enum { QKV_FMT_K = 16 };
typedef struct {
    int fmt, parts;
    int64_t N, K;
    const uint8_t *panels;
    const float *scales, *mins, *bias;
} qkv_qmat;

/* Rows of 8-bit blocks (qkv_quant_activations' output): q (rows, K), d, s, sum (rows, K/32) */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *sum;
} qkv_q8;

/* quant.c: x (M, K) -> its 8-bit blocks (in one part or two); products of several matrices
 * with M quantized rows, the panels of all of them shared by nth threads (ys[i]: matrix i's
 * (M, N) outputs) */
void qkv_quant_activations(const float *x, int64_t M, int64_t K, int8_t *q, float *d, float *s,
                           int32_t *sums);
int qkv_quant_activations_variant(int variant, const float *x, int64_t M, int64_t K, int8_t *q,
                                  float *d, float *s, int32_t *sums);
void qkv_quant_activations_parts(const float *x, int64_t M, int64_t K, int parts, int8_t *q,
                                 float *d, float *s, int32_t *sums);
void qkv_quant_many(int variant, int count, const qkv_qmat *mats, float *const *ys,
                    const qkv_q8 *x, int64_t M, int nth);
int qkv_quant_variants(void);

/* nn/quant_k.c: K-quant products, the input rounded to Q8_K inside (work:
 * qkv_quantk_work_bytes(M, K) bytes); or rounded first, in one or two parts
 * (qkv_quantk_prepare: q (rows, K), d (rows, K/256), bsums (rows, K/16), pairs (rows, K/256,
 * 4)) for the products of several matrices in one task of the pool (qkv_quantk_many, as
 * qkv_quant_many) */
typedef struct {
    const int8_t *q;
    const float *d;
    const int16_t *bsums;
    const int32_t *pairs;
} qkv_q8k;
void qkv_quantk_prepare(const float *x, int64_t M, int64_t K, int parts, float *left, void *work,
                        qkv_q8k *out);
void qkv_quantk_many(int variant, int count, const qkv_qmat *mats, float *const *ys,
                     const qkv_q8k *x, int64_t M, int nth);
void qkv_quantk_activations(const float *x, int64_t M, int64_t K, int8_t *q, float *d,
                            int16_t *bsums);
int qkv_quantk_activations_variant(int variant, const float *x, int64_t M, int64_t K, int8_t *q,
                                   float *d, int16_t *bsums);
int qkv_quantk_matmul(int variant, int fmt, const uint8_t *panels, const float *bias, int64_t N,
                      int64_t K, const float *x, int64_t M, float *y, void *work, int nth);
int64_t qkv_quantk_work_bytes(int64_t M, int64_t K);

/* attention/decode.c: one query per head over a float16 or 8-bit cache */
int qkv_decode_attention(int variant, int fmt, const float *q, const void *keys,
                         const void *values, const float *kscale, const float *vscale,
                         const uint8_t *mask, int64_t B, int64_t H, int64_t Hkv, int64_t cap,
                         int64_t D, int64_t start, int64_t length, float scale, int64_t chunk,
                         float *out, float *lse, int nth);
int qkv_decode_variants(void);

#if defined(__x86_64__) || defined(_M_X64)
#define QKV_X86 1
#endif

#endif
