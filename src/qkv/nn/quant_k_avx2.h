/* quant_k.c's AVX2 panel function. A panel's 16 rows go as two registers of 8 rows (4 bytes a
 * row) side by side, so that each broadcast of 4 inputs serves all 16. vpmaddubsw sums two
 * byte products into 16 bits; those sums wait in 16 bits over the steps of a sub-block, then
 * one vpmaddwd by the sub-block's scale (each row's scale in its two 16-bit lanes) widens and
 * scales them at once. Exact in 16 bits, with |x| <= 127 (Q8_K's rounding: the largest value
 * is -127 and none is past it):
 *   Q4_K: a step's lane at most 2 * 15 * 127 = 3,810; the sub-block's 8 steps 30,480.
 *   Q5_K: 2 * 31 * 127 = 7,874 a step; widened every 4 steps (31,496).
 *   Q6_K: (q - 32) x, q - 32 in -32..31: each step's 2 * 63 * 127 = 16,002 less the same
 *         inputs times 32 (vpmaddubsw of 32s, 8,128 at most, computed once for 16 rows): at
 *         most 8,128 in magnitude; the sub-block's 4 steps 32,512 < 32,767.
 * The integers are those of the other variants (isum = sum_j sc_j sum (q x) [- 32 sc_j
 * bsum_j]), and the float operations FINISH_SCALAR's, lane by lane: all agree bit for bit. */

__attribute__((always_inline, target("avx2,fma"))) static inline __m256i scale_pairs_avx2(
    const uint8_t *scales, const int is_signed) {
    /* 8 rows' one-byte scales -> 16 lanes of 16 bits, each row's scale twice */
    const __m128i s = _mm_loadl_epi64((const __m128i *)scales);
    const __m128i twice = _mm_unpacklo_epi8(s, s);
    return is_signed ? _mm256_cvtepi8_epi16(twice) : _mm256_cvtepu8_epi16(twice);
}

/* rows m .. m + R - 1 of x (R 1 or 2: the two share each weight's unpacking) times panel p */
__attribute__((always_inline, target("avx2,fma"))) static inline void panel_avx2_body(
    const product *pr, int64_t p, int64_t m, const int fmt, const int R) {
    const int64_t nsb = pr->K / QK_K;
    const __m256i nibble = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(0x10);
    const __m256i bits45 = _mm256_set1_epi8(0x30), thirty_two = _mm256_set1_epi8(32);
    const __m256i zero = _mm256_setzero_si256();
    const int steps = fmt == Q4_K ? 8 : 4; /* steps summed in 16 bits before a widening */
    __m256 acc[2][2]; /* [row of x][half of the panel] */
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const parts at = parts_of(pr, p, b);
        { /* the super-block AHEAD blocks on, on its way from memory while this one is summed
           * (a prefetch past the panels' end is dropped, never a fault) */
            const char *ahead = (const char *)at.low + AHEAD * panel_block_bytes(fmt);
            for (int64_t c = 0; c < panel_block_bytes(fmt); c += 64)
                _mm_prefetch(ahead + c, _MM_HINT_T0);
        }
        const int8_t *x[2];
        int64_t i[2];
        __m256i isum[2][2];
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            x[r] = pr->xq + (m + r) * pr->K + b * QK_K;
            i[r] = (m + r) * nsb + b;
            isum[r][0] = isum[r][1] = zero;
        }
        _Pragma("GCC unroll 8")
        for (int g = 0; g < 4; g++) {
            _Pragma("GCC unroll 8")
            for (int e = 0; e < 2; e++) { /* columns 64g + 32e + 4s + t: few values live */
                __m256i sum[2][2]; /* [r][h], 16-bit lanes */
                _Pragma("GCC unroll 8")
                for (int r = 0; r < R; r++) sum[r][0] = sum[r][1] = zero;
                _Pragma("GCC unroll 8")
                for (int s = 0; s < 8; s++) {
                    __m256i xs[2], less[2];
                    _Pragma("GCC unroll 8")
                    for (int r = 0; r < R; r++) {
                        xs[r] = _mm256_set1_epi32(four(x[r] + 64 * g + 32 * e + 4 * s));
                        less[r] = fmt == Q6_K ? _mm256_maddubs_epi16(thirty_two, xs[r]) : zero;
                    }
                    _Pragma("GCC unroll 8")
                    for (int h = 0; h < 2; h++) {
                        const __m256i v = _mm256_loadu_si256(
                            (const __m256i *)(at.low + ((g * 8 + s) * ROWS + 8 * h) * 4));
                        __m256i u = _mm256_and_si256(e ? _mm256_srli_epi16(v, 4) : v, nibble);
                        if (fmt == Q5_K) {
                            const __m256i hb = _mm256_loadu_si256(
                                (const __m256i *)(at.high + ((g * 2 + e) * ROWS + 8 * h) * 4));
                            /* bit s to bit 4; a 16-bit shift's bits from the other byte miss it */
                            const __m256i moved = s < 4 ? _mm256_slli_epi16(hb, 4 - s)
                                                        : _mm256_srli_epi16(hb, s - 4);
                            u = _mm256_or_si256(u, _mm256_and_si256(moved, bit4));
                        } else if (fmt == Q6_K) {
                            const __m256i hb = _mm256_loadu_si256(
                                (const __m256i *)(at.high + ((g * 4 + s / 2) * ROWS + 8 * h) * 4));
                            /* bits 4(s%2) + 2e..+1 to bits 4..5 */
                            const int from = 4 * (s % 2) + 2 * e;
                            const __m256i moved = from < 4 ? _mm256_slli_epi16(hb, 4 - from)
                                                           : _mm256_srli_epi16(hb, from - 4);
                            u = _mm256_or_si256(u, _mm256_and_si256(moved, bits45));
                        }
                        _Pragma("GCC unroll 8")
                        for (int r = 0; r < R; r++) {
                            __m256i pairs = _mm256_maddubs_epi16(u, xs[r]);
                            if (fmt == Q6_K) pairs = _mm256_sub_epi16(pairs, less[r]);
                            sum[r][h] = _mm256_add_epi16(sum[r][h], pairs);
                        }
                    }
                    if (s % steps == steps - 1) { /* widen, scaled by the sub-block's scale */
                        const int j = fmt == Q6_K ? 4 * g + 2 * e + s / 4 : 2 * g + e;
                        _Pragma("GCC unroll 8")
                        for (int h = 0; h < 2; h++) {
                            const __m256i sc =
                                scale_pairs_avx2(at.scales + j * ROWS + 8 * h, fmt == Q6_K);
                            _Pragma("GCC unroll 8")
                            for (int r = 0; r < R; r++) {
                                isum[r][h] =
                                    _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(sum[r][h], sc));
                                sum[r][h] = zero;
                            }
                        }
                    }
                }
            }
        }
        _Pragma("GCC unroll 8")
        for (int r = 0; r < R; r++) {
            const __m256 xd = _mm256_set1_ps(pr->xd[i[r]]);
            _Pragma("GCC unroll 8")
            for (int h = 0; h < 2; h++) {
                const __m256 dd = _mm256_mul_ps(_mm256_loadu_ps(at.d + 8 * h), xd);
                acc[r][h] =
                    _mm256_add_ps(acc[r][h], _mm256_mul_ps(dd, _mm256_cvtepi32_ps(isum[r][h])));
                if (fmt != Q6_K) {
                    __m256i summ = zero;
                    _Pragma("GCC unroll 8")
                    for (int k = 0; k < 4; k++) {
                        const __m256i mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(
                            (const __m128i *)(at.mins + (k * ROWS + 8 * h) * 2)));
                        summ = _mm256_add_epi32(
                            summ,
                            _mm256_madd_epi16(mins, _mm256_set1_epi32(pr->pairs[i[r] * 4 + k])));
                    }
                    const __m256 dm = _mm256_mul_ps(_mm256_loadu_ps(at.dmin + 8 * h), xd);
                    acc[r][h] =
                        _mm256_sub_ps(acc[r][h], _mm256_mul_ps(dm, _mm256_cvtepi32_ps(summ)));
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int r = 0; r < R; r++) {
        float out[ROWS];
        _mm256_storeu_ps(out, acc[r][0]);
        _mm256_storeu_ps(out + 8, acc[r][1]);
        store(pr, p, m + r, out);
    }
}

#define AVX2_ROWS(F)                                                                           \
    do {                                                                                       \
        int64_t m = m0;                                                                        \
        for (; m + 2 <= m1; m += 2) panel_avx2_body(pr, p, m, F, 2);                           \
        if (m < m1) panel_avx2_body(pr, p, m, F, 1);                                           \
    } while (0)

/* one copy of the body per format and count of rows, the format a constant in each */
__attribute__((target("avx2,fma"))) static void panel_avx2(const product *pr, int64_t p,
                                                           int64_t m0, int64_t m1) {
    switch (pr->fmt) {
    case Q4_K: AVX2_ROWS(Q4_K); break;
    case Q5_K: AVX2_ROWS(Q5_K); break;
    default: AVX2_ROWS(Q6_K); break;
    }
}

#undef AVX2_ROWS
