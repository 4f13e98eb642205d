/* One 256-bit VNNI panel function of quant_k.c (AVX2's own is quant_k_avx2.h), included
 * once per variant with NAME, TARGET and DOT(acc, u, x) defined: acc's 8 int32 lanes plus
 * the sums of 4 products of u's unsigned bytes by x's signed ones. A panel's 16 rows go as
 * two halves of 8 rows; per super-block, each sub-block's sums are scaled by its scale
 * (vpmulld), then the float operations are FINISH_SCALAR's, lane by lane. Unrolled as
 * quant_k_512.h (a rolled s loop keeps Q6_K's sums on the stack): in AVX-512's encoding on a
 * Zen 4, Q6_K 768 x 2048 from memory 64-71 -> 53-59 us. Not prefetched: these two passes over a
 * super-block (a half each) ran 1.3-1.6x slower with quant_k_512.h's prefetch there. */
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

__attribute__((always_inline, target(TARGET))) static inline void CAT(NAME, _body)(
    const product *pr, int64_t p, int64_t m, const int fmt) {
    const int64_t nsb = pr->K / QK_K;
    const __m256i nibble = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(0x10);
    const __m256i bits45 = _mm256_set1_epi8(0x30), zero = _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nsb; b++) {
        const parts at = parts_of(pr, p, b);
        const int8_t *x = pr->xq + m * pr->K + b * QK_K;
        const int64_t i = m * nsb + b;
        const int16_t *bs = pr->bsums + i * 16;
        const __m256 xd = _mm256_set1_ps(pr->xd[i]);
        for (int h = 0; h < 2; h++) {
            __m256i isum = zero;
            _Pragma("GCC unroll 8")
            for (int g = 0; g < 4; g++) {
                __m256i sum[2][2] = {{zero, zero}, {zero, zero}}; /* [e][Q6_K: s / 4] */
                _Pragma("GCC unroll 8")
                for (int s = 0; s < 8; s++) {
                    const __m256i v = _mm256_loadu_si256(
                        (const __m256i *)(at.low + ((g * 8 + s) * ROWS + 8 * h) * 4));
                    __m256i u[2] = {_mm256_and_si256(v, nibble),
                                    _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble)};
                    if (fmt == Q5_K) {
                        _Pragma("GCC unroll 8")
                        for (int e = 0; e < 2; e++) {
                            const __m256i hb = _mm256_loadu_si256(
                                (const __m256i *)(at.high + ((g * 2 + e) * ROWS + 8 * h) * 4));
                            /* bit s to bit 4; a 16-bit shift's bits from the other byte miss it */
                            const __m256i moved = s < 4 ? _mm256_slli_epi16(hb, 4 - s)
                                                        : _mm256_srli_epi16(hb, s - 4);
                            u[e] = _mm256_or_si256(u[e], _mm256_and_si256(moved, bit4));
                        }
                    } else if (fmt == Q6_K) {
                        const __m256i hb = _mm256_loadu_si256(
                            (const __m256i *)(at.high + ((g * 4 + s / 2) * ROWS + 8 * h) * 4));
                        /* bits 4(s%2)..+1 (the low nibble's) and +2..+3 (the high's) to 4..5 */
                        const __m256i a = s % 2 ? hb : _mm256_slli_epi16(hb, 4);
                        const __m256i c = s % 2 ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
                        u[0] = _mm256_or_si256(u[0], _mm256_and_si256(a, bits45));
                        u[1] = _mm256_or_si256(u[1], _mm256_and_si256(c, bits45));
                    }
                    const int k = fmt == Q6_K ? s / 4 : 0;
                    _Pragma("GCC unroll 8")
                    for (int e = 0; e < 2; e++)
                        sum[e][k] =
                            DOT(sum[e][k], u[e], _mm256_set1_epi32(four(x + 64 * g + 32 * e + 4 * s)));
                }
                _Pragma("GCC unroll 8")
                for (int e = 0; e < 2; e++) {
                    if (fmt == Q6_K) {
                        _Pragma("GCC unroll 8")
                        for (int k = 0; k < 2; k++) {
                            const int j = 4 * g + 2 * e + k;
                            const __m256i q_less_32 =
                                _mm256_sub_epi32(sum[e][k], _mm256_set1_epi32(32 * bs[j]));
                            const __m256i sc = _mm256_cvtepi8_epi32(
                                _mm_loadl_epi64((const __m128i *)(at.scales + j * ROWS + 8 * h)));
                            isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(q_less_32, sc));
                        }
                    } else {
                        const int j = 2 * g + e;
                        const __m256i sc = _mm256_cvtepu8_epi32(
                            _mm_loadl_epi64((const __m128i *)(at.scales + j * ROWS + 8 * h)));
                        isum = _mm256_add_epi32(isum, _mm256_mullo_epi32(sum[e][0], sc));
                    }
                }
            }
            const __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(at.d + 8 * h), xd);
            acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum)));
            if (fmt != Q6_K) {
                __m256i summ = zero;
                for (int k = 0; k < 4; k++) {
                    const __m256i mins = _mm256_cvtepu8_epi16(
                        _mm_loadu_si128((const __m128i *)(at.mins + (k * ROWS + 8 * h) * 2)));
                    summ = _mm256_add_epi32(
                        summ, _mm256_madd_epi16(mins, _mm256_set1_epi32(pr->pairs[i * 4 + k])));
                }
                const __m256 dm = _mm256_mul_ps(_mm256_loadu_ps(at.dmin + 8 * h), xd);
                acc[h] = _mm256_sub_ps(acc[h], _mm256_mul_ps(dm, _mm256_cvtepi32_ps(summ)));
            }
        }
    }
    float out[ROWS];
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
    store(pr, p, m, out);
}

/* one copy of the body per format, the format a constant in each */
__attribute__((target(TARGET))) static void NAME(const product *pr, int64_t p, int64_t m0,
                                                 int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
        switch (pr->fmt) {
        case Q4_K: CAT(NAME, _body)(pr, p, m, Q4_K); break;
        case Q5_K: CAT(NAME, _body)(pr, p, m, Q5_K); break;
        default: CAT(NAME, _body)(pr, p, m, Q6_K); break;
        }
    }
}

#undef NAME
#undef TARGET
#undef DOT
