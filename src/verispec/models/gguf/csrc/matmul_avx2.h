/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The AVX2 kernel
 * (half a group, 8 rows, at a time). */

#ifdef VS_X86
/* ------------------------------------------------------------------ quantized matmul: AVX2 */
/* The same lanes as the AVX-512 path, 8 rows (half a group) at a time in 256-bit registers. There is no
 * vpdpbusd: vpmaddubsw (u8 x s8 pairs to s16) then vpmaddwd by 1 (pairs to s32) computes the same 4-byte
 * dot per lane, exactly while a pair's sum fits 16 bits (values < 64: 63 * 127 * 2 < 32767). Q8_0's 8-bit
 * values are split into nibbles, dot = 16 dot(high) + dot(low). Integer sums are exact and the float
 * epilogue is the same fma sequence, so the results are the AVX-512 path's bits. */
#define VS_AVX2 __attribute__((target("avx2,fma,f16c")))

VS_INLINE VS_AVX2 void unpack8_avx2(const uint8_t *pl, const int bits, const int lut, const int o, __m256i v[8]) {
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
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; t++) {
        __m256i p = _mm256_loadu_si256((const __m256i *)(pl + 64 * t + o));
        v[t] = _mm256_and_si256(p, m4);
        v[t + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
    }
    if (lut) { /* indices to values (1..241: dot_slots_avx2 takes them as 8-bit values) */
        const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_LUT));
        for (int i = 0; i < 8; i++) v[i] = _mm256_shuffle_epi8(table, v[i]);
    }
    if (bits == 5) {
        const __m256i one = _mm256_set1_epi8(1);
        __m256i h = _mm256_loadu_si256((const __m256i *)(pl + 256 + o));
        for (int i = 0; i < 8; i++)
            v[i] = _mm256_or_si256(v[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, i), one), 4));
    } else if (bits == 6) {
        const __m256i three = _mm256_set1_epi8(3);
        __m256i h0 = _mm256_loadu_si256((const __m256i *)(pl + 256 + o));
        __m256i h1 = _mm256_loadu_si256((const __m256i *)(pl + 320 + o));
        for (int i = 0; i < 8; i++) {
            __m256i h = i < 4 ? h0 : h1;
            v[i] = _mm256_or_si256(v[i], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * (i % 4)), three), 4));
        }
    }
}

VS_INLINE VS_AVX2 __m256i dot4_avx2(__m256i w, __m256i a) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}

VS_INLINE VS_AVX2 __m256i dot_slots_avx2(const __m256i v[8], const int8_t *a, int first, int count, const int bits) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i p = _mm256_setzero_si256();
    for (int i = first; i < first + count; i++) {
        int32_t a4;
        memcpy(&a4, a + 4 * i, 4);
        __m256i av = _mm256_set1_epi32(a4);
        if (bits == 8) {
            p = _mm256_add_epi32(p, dot4_avx2(_mm256_and_si256(v[i], m4), av));
            p = _mm256_add_epi32(p, _mm256_slli_epi32(dot4_avx2(_mm256_and_si256(_mm256_srli_epi16(v[i], 4), m4), av), 4));
        } else {
            p = _mm256_add_epi32(p, dot4_avx2(v[i], av));
        }
    }
    return p;
}

VS_INLINE VS_AVX2 __m256i load_i8x8(const uint8_t *p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Rows 8 half .. 8 half + 7 of one group, a tile of T <= 4 tokens. */
VS_INLINE VS_AVX2 void half_tile_avx2(const int type, const int T, const uint8_t *grp, int64_t nsb, const token_t *tok,
                                      const int half) {
    layout_t L;
    get_layout(type, &L);
    const int64_t SB = sb_bytes(&L), poff = planes_offset(&L);
    const int hdr = header_bytes(&L), nsc = nscales(&L), pb = plane_bytes(L.bits), r0 = 8 * half;
    const int vbits = L.lut ? 8 : L.bits; /* how dot_slots_avx2 takes the unpacked values */
    const int mrow = L.has_m ? nsc : 0; /* where the m factors start (m = sc where none are stored) */
    const int kind_shift = L.dmin_kind ? __builtin_ctz((unsigned)L.dmin_kind) : -1; /* kinds are powers of two */
    __m256 acc[TILE];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 2 * r0)));
        __m256 dmin = L.dmin_kind ? _mm256_mul_ps(d, _mm256_set1_ps((float)L.dmin_kind))
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + 2 * r0)));
        __m256i isum[TILE], imin[TILE];
        for (int t = 0; t < T; t++) { isum[t] = _mm256_setzero_si256(); imin[t] = _mm256_setzero_si256(); }
        for (int u = 0; u < L.q / 32; u++) {
            __m256i v[8];
            /* spread as in the AVX-512 kernel (this path forced on the Xeon with AMX: a pass's matmuls 62.2 -> 57.0 ms
             * at one token, 105.4 -> 93.8 at four); the first half's reading brings the super-block in for the second */
            if (!half) prefetch_share(sb, SB, u, L.q / 32);
            unpack8_avx2(sb + poff + u * pb, L.bits, L.lut, 4 * r0, v);
            if (L.scsub == 32) {
                __m256i sc = load_i8x8(sb + hdr + u * GROUP + r0), m = load_i8x8(sb + hdr + (mrow + u) * GROUP + r0);
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    const int32_t *bs = tok[t].bsum + (s * L.q + 32 * u) / 16;
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(sc, dot_slots_avx2(v, a, 0, 8, vbits)));
                    imin[t] = _mm256_add_epi32(imin[t], _mm256_mullo_epi32(m, _mm256_set1_epi32(bs[0] + bs[1])));
                }
            } else if (L.scsub == 16) {
                __m256i sc0 = load_i8x8(sb + hdr + (2 * u) * GROUP + r0), sc1 = load_i8x8(sb + hdr + (2 * u + 1) * GROUP + r0);
                __m256i m0 = load_i8x8(sb + hdr + (mrow + 2 * u) * GROUP + r0), m1 = load_i8x8(sb + hdr + (mrow + 2 * u + 1) * GROUP + r0);
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    const int32_t *bs = tok[t].bsum + (s * L.q + 32 * u) / 16;
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(sc0, dot_slots_avx2(v, a, 0, 4, vbits)));
                    isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(sc1, dot_slots_avx2(v, a, 4, 4, vbits)));
                    imin[t] = _mm256_add_epi32(imin[t], _mm256_mullo_epi32(m0, _mm256_set1_epi32(bs[0])));
                    imin[t] = _mm256_add_epi32(imin[t], _mm256_mullo_epi32(m1, _mm256_set1_epi32(bs[1])));
                }
            } else {
                for (int t = 0; t < T; t++) {
                    const int32_t *bs = tok[t].bsum + (s * L.q) / 16;
                    isum[t] = dot_slots_avx2(v, tok[t].q + s * L.q, 0, 8, vbits);
                    imin[t] = _mm256_set1_epi32(bs[0] + bs[1]);
                }
            }
        }
        for (int t = 0; t < T; t++) {
            __m256 da = _mm256_set1_ps(tok[t].d[s]);
            if (kind_shift >= 0) { /* dmin = 2^shift d: the offset off in integers, one product */
                __m256i signed_sum = _mm256_sub_epi32(isum[t], _mm256_sll_epi32(imin[t], _mm_cvtsi32_si128(kind_shift)));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(signed_sum), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(imin[t]), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(tok[t].out + r0, acc[t]);
}

#define VS_HALF_TILES(TYPE)                                                               \
    for (int half = 0; half < 2; half++) switch (T) {                                     \
            case 1: half_tile_avx2(TYPE, 1, grp, nsb, tok, half); break;                  \
            case 2: half_tile_avx2(TYPE, 2, grp, nsb, tok, half); break;                  \
            case 3: half_tile_avx2(TYPE, 3, grp, nsb, tok, half); break;                  \
            default: half_tile_avx2(TYPE, 4, grp, nsb, tok, half); break;                 \
        }

static VS_AVX2 void group_avx2(int type, const uint8_t *grp, int64_t nsb, const token_t *tok, int T) {
    switch (type) {
        case T_Q4_0: VS_HALF_TILES(T_Q4_0); break;
        case T_Q4_1: VS_HALF_TILES(T_Q4_1); break;
        case T_Q5_0: VS_HALF_TILES(T_Q5_0); break;
        case T_Q5_1: VS_HALF_TILES(T_Q5_1); break;
        case T_Q8_0: VS_HALF_TILES(T_Q8_0); break;
        case T_Q2_K: VS_HALF_TILES(T_Q2_K); break;
        case T_Q3_K: VS_HALF_TILES(T_Q3_K); break;
        case T_Q4_K: VS_HALF_TILES(T_Q4_K); break;
        case T_Q5_K: VS_HALF_TILES(T_Q5_K); break;
        case T_Q6_K: VS_HALF_TILES(T_Q6_K); break;
        case T_IQ4_NL: VS_HALF_TILES(T_IQ4_NL); break;
        case T_IQ4_XS: VS_HALF_TILES(T_IQ4_XS); break;
    }
}
#endif
