/* quant_k.c's AVX-512 VNNI panel function: a panel's 16 rows in the 16 lanes of one register,
 * each step one 64-byte load of weights and one vpdpbusd per half; the float operations are
 * FINISH_SCALAR's, lane by lane. */
#define TARGET512 "avx512f,avx512bw,avx512vl,avx512vnni"

__attribute__((always_inline, target(TARGET512))) static inline void panel_avx512_body(
    const product *pr, int64_t p, int64_t m, const int fmt) {
    const int64_t nsb = pr->K / QK_K;
    const __m512i nibble = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10);
    const __m512i bits45 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const parts at = parts_of(pr, p, b);
        const int8_t *x = pr->xq + m * pr->K + b * QK_K;
        const int64_t i = m * nsb + b;
        const int16_t *bs = pr->bsums + i * 16;
        const __m512 xd = _mm512_set1_ps(pr->xd[i]);
        __m512i isum = zero;
        for (int g = 0; g < 4; g++) {
            __m512i sum[2][2] = {{zero, zero}, {zero, zero}}; /* [e][Q6_K: s / 4] */
            for (int s = 0; s < 8; s++) {
                const __m512i v = _mm512_loadu_si512(at.low + (g * 8 + s) * 64);
                __m512i u[2] = {_mm512_and_si512(v, nibble),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
                if (fmt == Q5_K) {
                    for (int e = 0; e < 2; e++) {
                        const __m512i hb = _mm512_loadu_si512(at.high + (g * 2 + e) * 64);
                        const __m512i moved = s < 4 ? _mm512_slli_epi16(hb, 4 - s)
                                                    : _mm512_srli_epi16(hb, s - 4);
                        u[e] = _mm512_or_si512(u[e], _mm512_and_si512(moved, bit4));
                    }
                } else if (fmt == Q6_K) {
                    const __m512i hb = _mm512_loadu_si512(at.high + (g * 4 + s / 2) * 64);
                    const __m512i a = s % 2 ? hb : _mm512_slli_epi16(hb, 4);
                    const __m512i c = s % 2 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
                    u[0] = _mm512_or_si512(u[0], _mm512_and_si512(a, bits45));
                    u[1] = _mm512_or_si512(u[1], _mm512_and_si512(c, bits45));
                }
                const int k = fmt == Q6_K ? s / 4 : 0;
                for (int e = 0; e < 2; e++)
                    sum[e][k] = _mm512_dpbusd_epi32(
                        sum[e][k], u[e], _mm512_set1_epi32(four(x + 64 * g + 32 * e + 4 * s)));
            }
            for (int e = 0; e < 2; e++) {
                if (fmt == Q6_K) {
                    for (int k = 0; k < 2; k++) {
                        const int j = 4 * g + 2 * e + k;
                        const __m512i q_less_32 =
                            _mm512_sub_epi32(sum[e][k], _mm512_set1_epi32(32 * bs[j]));
                        const __m512i sc = _mm512_cvtepi8_epi32(
                            _mm_loadu_si128((const __m128i *)(at.scales + j * ROWS)));
                        isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(q_less_32, sc));
                    }
                } else {
                    const int j = 2 * g + e;
                    const __m512i sc = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(at.scales + j * ROWS)));
                    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(sum[e][0], sc));
                }
            }
        }
        const __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(at.d), xd);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum)));
        if (fmt != Q6_K) {
            __m512i summ = zero;
            for (int k = 0; k < 4; k++) {
                const __m512i mins = _mm512_cvtepu8_epi16(
                    _mm256_loadu_si256((const __m256i *)(at.mins + k * ROWS * 2)));
                summ = _mm512_add_epi32(
                    summ, _mm512_madd_epi16(mins, _mm512_set1_epi32(pr->pairs[i * 4 + k])));
            }
            const __m512 dm = _mm512_mul_ps(_mm512_loadu_ps(at.dmin), xd);
            acc = _mm512_sub_ps(acc, _mm512_mul_ps(dm, _mm512_cvtepi32_ps(summ)));
        }
    }
    float out[ROWS];
    _mm512_storeu_ps(out, acc);
    store(pr, p, m, out);
}

__attribute__((target(TARGET512))) static void panel_avx512_vnni(const product *pr, int64_t p,
                                                                  int64_t m) {
    switch (pr->fmt) {
    case Q4_K: panel_avx512_body(pr, p, m, Q4_K); break;
    case Q5_K: panel_avx512_body(pr, p, m, Q5_K); break;
    default: panel_avx512_body(pr, p, m, Q6_K); break;
    }
}

#undef TARGET512
