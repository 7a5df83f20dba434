/* The AVX2 kernel's tile, for one instruction set: matmul_avx2.h includes this file twice, for AVX2 alone and for
 * AVX2 with AVX-VNNI (the 256-bit vpdpbusd of Intel's client cores since Alder Lake, which have no AVX-512). Before
 * including, define:
 *   A2_TARGET   the functions' target attribute
 *   A2_NAME(x)  the name of this copy's functions
 *   A2_VNNI     1 where the dots are vpdpbusd, 0 where vpmaddubsw then vpmaddwd
 * Both copies compute the same integer sums and run the same float epilogue, so they give the same bits. The file
 * undefines these at its end, ready for the next copy. */

/* dot_slots: sum over slots first..first+count-1 of the 4-byte dots of v[i] with the 4 activation bytes of slot i.
 * scaled_slots: each row's sum times `scale` (scale_operand's form of the row's sub-block scale).
 * With AVX-VNNI one vpdpbusd a slot (exact: 32-bit sums of four u8 x s8 products), in two chains (even and odd slots)
 * so that one token's products do not wait on each other's latency, then the scale's product (vpmulld). Without it
 * vpmaddubsw a slot, whose u8 x s8 pair sums are added as int16 over runs of slots, then one vpmaddwd a run by
 * `scale` (1 for dot_slots): a pair is at most 2 x 127 x the largest value, so a run of 8 slots fits 16 bits for
 * values below 16, 4 below 32, 2 below 64 (8 x 2 x 127 x 15 = 30,480 < 2^15); Q8_0's and the IQ4 tables' 8-bit values
 * split into nibbles, dot = 16 dot(high) + dot(low), both below 16. Integer sums, so any order and grouping gives the
 * same sum. */
#if A2_VNNI
VS_INLINE A2_TARGET __m256i A2_NAME(dot_slots)(const __m256i v[8], const int8_t *a, int first, int count, const int bits) {
    __m256i p = _mm256_setzero_si256(), p1 = _mm256_setzero_si256();
    for (int i = first; i < first + count; i++) {
        int32_t a4;
        memcpy(&a4, a + 4 * i, 4);
        const __m256i av = _mm256_set1_epi32(a4);
        if ((i - first) % 2) p1 = _mm256_dpbusd_avx_epi32(p1, v[i], av);
        else p = _mm256_dpbusd_avx_epi32(p, v[i], av);
    }
    (void)bits;
    return _mm256_add_epi32(p, p1);
}

VS_INLINE A2_TARGET __m256i A2_NAME(scaled_slots)(const __m256i v[8], const int8_t *a, int first, int count, const int bits,
                                                  __m256i scale) {
    return _mm256_mullo_epi32(scale, A2_NAME(dot_slots)(v, a, first, count, bits));
}

/* The rows' int8 scales (each sign-extended in its 32-bit lane, as load_i8x8 gives them) as scaled_slots takes them:
 * the vpmulld operand as they are with VNNI; without it in both int16 halves of the lane, for vpmaddwd. */
VS_INLINE A2_TARGET __m256i A2_NAME(scale_operand)(__m256i sc) { return sc; }
#else
VS_INLINE A2_TARGET __m256i A2_NAME(scaled_slots)(const __m256i v[8], const int8_t *a, int first, int count, const int bits,
                                                  __m256i scale) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const int run = bits == 6 ? 2 : bits == 5 ? 4 : 8;
    __m256i sum = _mm256_setzero_si256();
    for (int r = first; r < first + count; r += run) {
        __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
        for (int i = r; i < r + run && i < first + count; i++) {
            int32_t a4;
            memcpy(&a4, a + 4 * i, 4);
            const __m256i av = _mm256_set1_epi32(a4);
            if (bits == 8) {
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(v[i], m4), av));
                hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v[i], 4), m4), av));
            } else {
                lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(v[i], av));
            }
        }
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(lo, scale));
        if (bits == 8) sum = _mm256_add_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(hi, scale), 4));
    }
    return sum;
}

VS_INLINE A2_TARGET __m256i A2_NAME(dot_slots)(const __m256i v[8], const int8_t *a, int first, int count, const int bits) {
    return A2_NAME(scaled_slots)(v, a, first, count, bits, _mm256_set1_epi16(1));
}

VS_INLINE A2_TARGET __m256i A2_NAME(scale_operand)(__m256i sc) { return pack16_avx2(sc, sc); }
#endif

/* acc + the products of a's and b's int16 pairs: vpdpwssd, or vpmaddwd then an add (the same int32 sum). */
VS_INLINE A2_TARGET __m256i A2_NAME(dpwssd)(__m256i acc, __m256i a, __m256i b) {
#if A2_VNNI
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* Rows 8 half .. 8 half + 7 of one group, a tile of T <= TILE_AVX2 tokens, as the AVX-512 kernel computes its 16: per
 * sub-block and token the dots of slots 0-3 and 4-7 times their scales (scaled_slots); with AVX-VNNI the 4-bit
 * K-quants' and Q2_K / Q3_K's two dots, each within 16 bits, packed as an int16 pair that one vpdpwssd multiplies by
 * the scales; the min terms once a super-block from the token's unit sum pairs (tok.pairs). */
VS_INLINE A2_TARGET void A2_NAME(half_tile)(const int type, const int T, const uint8_t *grp, int64_t nsb, const token_t *tok,
                                            const int half) {
    layout_t L;
    get_layout(type, &L);
    const int64_t SB = sb_bytes(&L), poff = planes_offset(&L);
    const int hdr = header_bytes(&L), nsc = nscales(&L), pb = plane_bytes(L.bits), r0 = 8 * half;
    const int vbits = L.lut ? 8 : L.bits; /* how dot_slots takes the unpacked values */
    const int hi16 = A2_VNNI && L.bits == 4 && !L.lut && L.scsub == 32;
    const int kind_shift = L.dmin_kind ? __builtin_ctz((unsigned)L.dmin_kind) : -1; /* kinds are powers of two */
    const __m256i low16 = _mm256_set1_epi32(0xFFFF);
    __m256 acc[TILE_AVX2];
    for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 2 * r0)));
        __m256 dmin = L.dmin_kind ? _mm256_mul_ps(d, _mm256_set1_ps((float)L.dmin_kind))
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 32 + 2 * r0)));
        __m256i isum[TILE_AVX2];
        for (int t = 0; t < T; t++) isum[t] = _mm256_setzero_si256();
        for (int u = 0; u < L.q / 32; u++) {
            __m256i v[8];
            /* spread as in the AVX-512 kernel (this path forced on the Xeon with AMX: a pass's matmuls 62.2 -> 57.0 ms
             * at one token, 105.4 -> 93.8 at four); the first half's reading brings the super-block in for the second */
            if (!half) prefetch_share(sb, SB, u, L.q / 32);
            unpack8_avx2(sb + poff + u * pb, L.bits, L.lut, 4 * r0, v, hi16);
            if (A2_VNNI && L.scsub == 16 && L.bits <= 3) { /* a unit's dot fits 16 bits (16 x 7 x 128 < 2^15) */
                const __m256i sc01 = pack16_avx2(load_i8x8(sb + hdr + (2 * u) * GROUP + r0),
                                                 load_i8x8(sb + hdr + (2 * u + 1) * GROUP + r0));
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m256i p0 = A2_NAME(dot_slots)(v, a, 0, 4, vbits), p1 = A2_NAME(dot_slots)(v, a, 4, 4, vbits);
                    isum[t] = A2_NAME(dpwssd)(isum[t], pack16_avx2(p0, p1), sc01);
                }
            } else if (L.scsub == 16) {
                const __m256i sc0 = A2_NAME(scale_operand)(load_i8x8(sb + hdr + (2 * u) * GROUP + r0)),
                              sc1 = A2_NAME(scale_operand)(load_i8x8(sb + hdr + (2 * u + 1) * GROUP + r0));
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    isum[t] = _mm256_add_epi32(isum[t], A2_NAME(scaled_slots)(v, a, 0, 4, vbits, sc0));
                    isum[t] = _mm256_add_epi32(isum[t], A2_NAME(scaled_slots)(v, a, 4, 4, vbits, sc1));
                }
            } else if (hi16) { /* each half's dot fits 16 bits (16 x 15 x 128 < 2^15); p1 is 16 times its dot */
                const __m256i sc = load_i8x8(sb + hdr + u * GROUP + r0), sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m256i p0 = A2_NAME(dot_slots)(v, a, 0, 4, vbits), p1 = A2_NAME(dot_slots)(v, a, 4, 4, vbits);
                    const __m256i both = _mm256_or_si256(_mm256_and_si256(p0, low16), _mm256_slli_epi32(p1, 12));
                    isum[t] = A2_NAME(dpwssd)(isum[t], both, sc2);
                }
            } else if (L.scsub == 32) {
                const __m256i sc = A2_NAME(scale_operand)(load_i8x8(sb + hdr + u * GROUP + r0));
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    isum[t] = _mm256_add_epi32(isum[t], A2_NAME(scaled_slots)(v, a, 0, 8, vbits, sc));
                }
            } else {
                for (int t = 0; t < T; t++) isum[t] = A2_NAME(dot_slots)(v, tok[t].q + s * L.q, 0, 8, vbits);
            }
        }
        __m256i pair[8]; /* the min factors (m, or sc where none is stored) of units 2j, 2j + 1 as int16 pairs */
        if (L.scsub) {
            const uint8_t *m = sb + hdr + (L.has_m ? nsc * GROUP : 0) + r0;
            for (int j = 0; j < nsc / 2; j++)
                pair[j] = pack16_avx2(load_i8x8(m + 2 * j * GROUP), load_i8x8(m + (2 * j + 1) * GROUP));
        }
        for (int t = 0; t < T; t++) {
            __m256i imin;
            if (L.scsub) {
                const int32_t *tp = tok[t].pairs + AMX_PAIRS * s;
                imin = _mm256_setzero_si256();
                for (int j = 0; j < nsc / 2; j++) imin = A2_NAME(dpwssd)(imin, pair[j], _mm256_set1_epi32(tp[j]));
            } else {
                const int32_t *bs = tok[t].bsum + (s * L.q) / 16;
                imin = _mm256_set1_epi32(bs[0] + bs[1]);
            }
            __m256 da = _mm256_set1_ps(tok[t].d[s]);
            if (kind_shift >= 0) { /* dmin = 2^shift d: the offset off in integers, one product */
                __m256i signed_sum = _mm256_sub_epi32(isum[t], _mm256_sll_epi32(imin, _mm_cvtsi32_si128(kind_shift)));
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(signed_sum), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(isum[t]), acc[t]);
                acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(imin), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm256_storeu_ps(tok[t].out + r0, acc[t]);
}

#define VS_HALF_TILES(TYPE)                                                               \
    for (int half = 0; half < 2; half++) switch (T) {                                   \
            case 1: A2_NAME(half_tile)(TYPE, 1, grp, nsb, tok, half); break;              \
            case 2: A2_NAME(half_tile)(TYPE, 2, grp, nsb, tok, half); break;              \
            case 3: A2_NAME(half_tile)(TYPE, 3, grp, nsb, tok, half); break;              \
            case 4: A2_NAME(half_tile)(TYPE, 4, grp, nsb, tok, half); break;              \
            case 5: A2_NAME(half_tile)(TYPE, 5, grp, nsb, tok, half); break;              \
            case 6: A2_NAME(half_tile)(TYPE, 6, grp, nsb, tok, half); break;              \
            case 7: A2_NAME(half_tile)(TYPE, 7, grp, nsb, tok, half); break;              \
            default: A2_NAME(half_tile)(TYPE, 8, grp, nsb, tok, half); break;             \
        }

static A2_TARGET void A2_NAME(group)(int type, const uint8_t *grp, int64_t nsb, const token_t *tok, int T) {
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
#undef VS_HALF_TILES
#undef A2_TARGET
#undef A2_NAME
#undef A2_VNNI
