/* The decode-attention cache's writer: one step's keys and values appended to a float16 or
 * 8-bit cache (the caches qkv/attention/decode.c reads), as qkv/attention/native_decode.py's
 * `append` calls it. */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { CACHE_F16 = 0, CACHE_I8 = 1 }; /* decode.c's formats */

/* One step's keys and values, k and v (B, Hkv, D) float32, written into row `at` of the
 * caches (B, Hkv, cap, D): float16 (rounded to nearest, ties to even, as torch's .half()), or
 * int8 with scale amax / 127 per row (q = round-half-even(x / scale); a row of zeros: scale 0).
 * The caller has checked 0 <= at < cap. */
void qkv_cache_append(int fmt, const float *k, const float *v, void *keys, void *values,
                      float *kscale, float *vscale, int64_t B, int64_t Hkv, int64_t cap,
                      int64_t D, int64_t at) {
    for (int which = 0; which < 2; which++) {
        const float *src = which ? v : k;
        void *cache = which ? values : keys;
        float *scales = which ? vscale : kscale;
        for (int64_t bk = 0; bk < B * Hkv; bk++) {
            const float *x = src + bk * D;
            const int64_t row = (bk * cap + at) * D;
            if (fmt == CACHE_F16) {
                uint16_t *h = (uint16_t *)cache + row;
                for (int64_t d = 0; d < D; d++) {
                    const _Float16 f = (_Float16)x[d];
                    memcpy(h + d, &f, 2);
                }
                continue;
            }
            float amax = 0.0f;
            for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(x[d]));
            const float s = amax / 127.0f;
            int8_t *c = (int8_t *)cache + row;
            for (int64_t d = 0; d < D; d++) c[d] = s != 0.0f ? (int8_t)rintf(x[d] / s) : 0;
            scales[bk * cap + at] = s;
        }
    }
}
