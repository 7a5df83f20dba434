/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The AVX2 kernel
 * (half a group, 8 rows, at a time). */

#ifdef VS_X86
/* ------------------------------------------------------------------ quantized matmul: AVX2 */
/* The same lanes as the AVX-512 path, 8 rows (half a group) at a time in 256-bit registers. Without AVX-VNNI there is
 * no vpdpbusd: vpmaddubsw (u8 x s8 pairs to s16), the pairs added as int16 over a few slots, then vpmaddwd (by 1 or
 * by the scale) computes the same dots, exactly while the int16 sums fit (see scaled_slots in avx2_tile.h). Q8_0's
 * 8-bit values are split into nibbles, dot = 16 dot(high) + dot(low). Integer sums are exact and the float
 * epilogue is the same fma sequence, so the results are the AVX-512 path's bits. */
#define VS_AVX2 __attribute__((target("avx2,fma,f16c")))

/* A sub-block's 8 slots of 8 rows (o: the half's byte offset in each 64-byte line) as bytes. hi16 (4-bit K-quants,
 * the AVX-VNNI copy only): slots 4-7 are left as 16 times their values, as in the AVX-512 kernel (the caller divides
 * those slots' dot by 16); vpmaddubsw would saturate on them. */
VS_INLINE VS_AVX2 void unpack8_avx2(const uint8_t *pl, const int bits, const int lut, const int o, __m256i v[8],
                                    const int hi16) {
    if (bits == 8) {
        for (int i = 0; i < 8; i++) v[i] = _mm256_loadu_si256((const __m256i *)(pl + 64 * i + o));
        return;
    }
    if (bits <= 3) {
        const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
        for (int h = 0; h < 2; h++) {
            const __m256i p = _mm256_loadu_si256((const __m256i *)(pl + 64 * h + o));
            for (int s = 0; s < 4; s++) v[4 * h + s] = _mm256_and_si256(_mm256_srli_epi16(p, 2 * s), m3);
        }
        if (bits == 3) {
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(pl + 128 + o));
            for (int i = 0; i < 8; i++)
                v[i] = _mm256_or_si256(v[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, i), one), 2));
        }
        return;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F), h4 = _mm256_set1_epi8((char)0xF0);
    for (int t = 0; t < 4; t++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(pl + 64 * t + o));
        v[t] = _mm256_and_si256(p, m4);
        v[t + 4] = hi16 ? _mm256_and_si256(p, h4) : _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
    }
    if (lut) { /* indices to values (1..241: dot_slots takes them as 8-bit values) */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LUT));
        for (int i = 0; i < 8; i++) v[i] = _mm256_shuffle_epi8(table, v[i]);
    }
    /* The high bits are shifted straight onto bits 4 (and 5) of their byte (a 16-bit lane shift by at most 4 keeps
     * them there), then masked and or'ed: three operations a slot where shift, and, shift, or took four. */
    if (bits == 5) {
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        const __m256i h = _mm256_loadu_si256((const __m256i *)(pl + 256 + o));
        for (int i = 0; i < 8; i++) {
            const __m256i x = i < 4 ? _mm256_slli_epi16(h, 4 - i) : i == 4 ? h : _mm256_srli_epi16(h, i - 4);
            v[i] = _mm256_or_si256(v[i], _mm256_and_si256(x, bit4));
        }
    } else if (bits == 6) {
        const __m256i bits45 = _mm256_set1_epi8(0x30);
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(pl + 256 + o));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(pl + 320 + o));
        for (int i = 0; i < 8; i++) {
            const __m256i h = i < 4 ? h0 : h1;
            const int s = 2 * (i % 4); /* bits s, s + 1 onto 4, 5 */
            const __m256i x = s < 4 ? _mm256_slli_epi16(h, 4 - s) : s == 4 ? h : _mm256_srli_epi16(h, s - 4);
            v[i] = _mm256_or_si256(v[i], _mm256_and_si256(x, bits45));
        }
    }
}

VS_INLINE VS_AVX2 __m256i load_i8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Each 32-bit lane as an int16 pair: lo's lane (its low 16 bits) in the low half, hi's in the high half, for
 * vpmaddwd / vpdpwssd. */
VS_INLINE VS_AVX2 __m256i pack16_avx2(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

#define A2_TARGET VS_AVX2
#define A2_NAME(x) x##_avx2
#define A2_VNNI 0
#include "avx2_tile.h"
#if VS_HAVE_AVXVNNI
#define A2_TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
#define A2_NAME(x) x##_avxvnni
#define A2_VNNI 1
#include "avx2_tile.h"
#endif
#endif
