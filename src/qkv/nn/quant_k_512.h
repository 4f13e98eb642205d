/* quant_k.c's AVX-512 VNNI panel function: a panel's 16 rows in the 16 lanes of one register,
 * each step one 64-byte load of weights and one vpdpbusd per half and row of x (two rows of x
 * at a time where there are two: a prompt's rows share each weight's unpacking); the float
 * operations are FINISH_SCALAR's, lane by lane. The loops are unrolled whole (a rolled s loop
 * kept Q6_K's sums, indexed by s / 4, on the stack) and the super-block AHEAD on is prefetched
 * as in quant_k_avx2.h: on a Zen 4 a 30 MB Q6_K head streamed at 17 GB/s without, 30-38 with. */
#define TARGET512 "avx512f,avx512bw,avx512vl,avx512vnni"

__attribute__((always_inline, target(TARGET512))) static inline void panel_avx512_body(
    const product *pr, int64_t p, int64_t m, const int fmt, const int R) {
    const int64_t nsb = pr->K / QK_K;
    const __m512i nibble = _mm512_set1_epi8(15), bit4 = _mm512_set1_epi8(0x10);
    const __m512i bits45 = _mm512_set1_epi8(0x30), zero = _mm512_setzero_si512();
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* [row m + c] */
    for (int64_t b = 0; b < nsb; b++) {
        const parts at = parts_of(pr, p, b);
        { /* the super-block AHEAD blocks on (quant_k_avx2.h's) */
            const char *ahead = (const char *)at.low + AHEAD * panel_block_bytes(fmt);
            for (int64_t c = 0; c < panel_block_bytes(fmt); c += 64)
                _mm_prefetch(ahead + c, _MM_HINT_T0);
        }
        const int8_t *x[2];
        int64_t i[2];
        _Pragma("GCC unroll 8")
        for (int c = 0; c < R; c++) {
            x[c] = pr->xq + (m + c) * pr->K + b * QK_K;
            i[c] = (m + c) * nsb + b;
        }
        __m512i isum[2] = {zero, zero};
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 4; g++) {
            __m512i sum[2][2][2] = {{{zero, zero}, {zero, zero}}, {{zero, zero}, {zero, zero}}};
            _Pragma("GCC unroll 8")
            for (int s = 0; s < 8; s++) { /* the weights unpacked once for R rows of x */
                const __m512i v = _mm512_loadu_si512(at.low + (g * 8 + s) * 64);
                __m512i u[2] = {_mm512_and_si512(v, nibble),
                                _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
                if (fmt == Q5_K) {
                    _Pragma("GCC unroll 8")
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
                _Pragma("GCC unroll 8")
                for (int c = 0; c < R; c++)
                    _Pragma("GCC unroll 8")
                    for (int e = 0; e < 2; e++)
                        sum[c][e][k] = _mm512_dpbusd_epi32(
                            sum[c][e][k], u[e],
                            _mm512_set1_epi32(four(x[c] + 64 * g + 32 * e + 4 * s)));
            }
            _Pragma("GCC unroll 8")
            for (int e = 0; e < 2; e++) {
                if (fmt == Q6_K) {
                    _Pragma("GCC unroll 8")
                    for (int k = 0; k < 2; k++) {
                        const int j = 4 * g + 2 * e + k;
                        const __m512i sc = _mm512_cvtepi8_epi32(
                            _mm_loadu_si128((const __m128i *)(at.scales + j * ROWS)));
                        _Pragma("GCC unroll 8")
                        for (int c = 0; c < R; c++) {
                            const int16_t *bs = pr->bsums + i[c] * 16;
                            const __m512i q_less_32 =
                                _mm512_sub_epi32(sum[c][e][k], _mm512_set1_epi32(32 * bs[j]));
                            isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(q_less_32, sc));
                        }
                    }
                } else {
                    const int j = 2 * g + e;
                    const __m512i sc = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(at.scales + j * ROWS)));
                    _Pragma("GCC unroll 8")
                    for (int c = 0; c < R; c++)
                        isum[c] = _mm512_add_epi32(isum[c], _mm512_mullo_epi32(sum[c][e][0], sc));
                }
            }
        }
        for (int c = 0; c < R; c++) {
            const __m512 xd = _mm512_set1_ps(pr->xd[i[c]]);
            const __m512 dd = _mm512_mul_ps(_mm512_loadu_ps(at.d), xd);
            acc[c] = _mm512_add_ps(acc[c], _mm512_mul_ps(dd, _mm512_cvtepi32_ps(isum[c])));
            if (fmt != Q6_K) {
                __m512i summ = zero;
                for (int k = 0; k < 4; k++) {
                    const __m512i mins = _mm512_cvtepu8_epi16(
                        _mm256_loadu_si256((const __m256i *)(at.mins + k * ROWS * 2)));
                    summ = _mm512_add_epi32(
                        summ, _mm512_madd_epi16(mins, _mm512_set1_epi32(pr->pairs[i[c] * 4 + k])));
                }
                const __m512 dm = _mm512_mul_ps(_mm512_loadu_ps(at.dmin), xd);
                acc[c] = _mm512_sub_ps(acc[c], _mm512_mul_ps(dm, _mm512_cvtepi32_ps(summ)));
            }
        }
    }
    for (int c = 0; c < R; c++) {
        float out[ROWS];
        _mm512_storeu_ps(out, acc[c]);
        store(pr, p, m + c, out);
    }
}

/* rows m0..m1-1 of x, two at a time (each weight unpacked once for both), one per format */
__attribute__((target(TARGET512))) static void panel_avx512_vnni(const product *pr, int64_t p,
                                                                  int64_t m0, int64_t m1) {
    int64_t m = m0;
    for (; m + 2 <= m1; m += 2) {
        switch (pr->fmt) {
        case Q4_K: panel_avx512_body(pr, p, m, Q4_K, 2); break;
        case Q5_K: panel_avx512_body(pr, p, m, Q5_K, 2); break;
        default: panel_avx512_body(pr, p, m, Q6_K, 2); break;
        }
    }
    if (m < m1) {
        switch (pr->fmt) {
        case Q4_K: panel_avx512_body(pr, p, m, Q4_K, 1); break;
        case Q5_K: panel_avx512_body(pr, p, m, Q5_K, 1); break;
        default: panel_avx512_body(pr, p, m, Q6_K, 1); break;
        }
    }
}

#undef TARGET512
