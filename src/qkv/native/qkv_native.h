/* qkv's native CPU code: what every C file shares. Plain C11, no torch ABI: Python calls
 * these functions through ctypes on tensors' memory (qkv/native/__init__.py builds and
 * loads the library). */
#ifndef QKV_NATIVE_H
#define QKV_NATIVE_H

#include <stdint.h>

/* One task, run by nth threads at once: thread ith (0..nth-1) does its share. */
typedef void (*qkv_task)(void *arg, int ith, int nth);

/* fn(arg, ith, nth) on nth threads (the caller's is thread 0), returning when all are done.
 * The workers are kept between calls, spinning a little before they sleep, so that calls a
 * few microseconds apart (a decoding step's products) cost no thread start or wake-up. */
void qkv_parallel(qkv_task fn, void *arg, int nth);
/* a decoder starts (1) or ends (-1): the workers spin longer between its tasks (pool.c) */
int qkv_pool_linger(int delta);

/* Several matrices' panels in one task of the pool (quant.c's and quant_k.c's run_many):
 * matrix i's are [first[i], first[i + 1]) of them all, cut into nth runs, one a thread;
 * thread ith's of matrix i are [*a, *b), none where *a >= *b. */
static inline void qkv_share(const int64_t *first, int count, int i, int ith, int nth,
                             int64_t *a, int64_t *b) {
    const int64_t total = first[count];
    const int64_t from = total * ith / nth, to = total * (ith + 1) / nth;
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
