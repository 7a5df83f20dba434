/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The AVX-512 VNNI
 * kernel (tiles of up to 16 tokens a group of 16 rows) and the helpers the AMX kernels share with it. */

/* ------------------------------------------------------------------ quantized matmul: AVX-512 VNNI */
#ifdef VS_X86
#define VS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
#define VS_INLINE static inline __attribute__((always_inline))

/* A sub-block's 8 slots (see the layout above) as bytes. hi16 (4-bit types only): slots 4-7 are left as 16 times
 * their values (the high nibble in place, one and instead of a shift and an and); the caller divides those slots'
 * dot by 16 (exact: 16 divides it). Bits 4-5 of the 6-bit values: h shifted so they land on bits 4-5 of each
 * byte (16-bit lane shifts by at most 4 keep them within their byte), masked, and merged in one ternary op. */
VS_INLINE VS_AVX512 void unpack8_as(const uint8_t *pl, const int bits, const int lut, __m512i v[8], const int hi16) {
    if (bits == 8) {
        for (int i = 0; i < 8; i++) v[i] = _mm512_loadu_si512(pl + 64 * i);
        return;
    }
    if (bits <= 3) { /* 2-bit fields of two planes, then the third bits from H (16-bit shifts keep within bytes) */
        const __m512i m3 = _mm512_set1_epi8(3);
        for (int h = 0; h < 2; h++) {
            const __m512i p = _mm512_loadu_si512(pl + 64 * h);
            for (int s = 0; s < 4; s++) v[4 * h + s] = _mm512_and_si512(s ? _mm512_srli_epi16(p, 2 * s) : p, m3);
        }
        if (bits == 3) {
            const __m512i hb = _mm512_loadu_si512(pl + 128), four = _mm512_set1_epi8(4);
            for (int i = 0; i < 8; i++) /* (h shifted so bit i lands on bit 2) & 4, or'ed in: ternlog 0xF8 = A | (B & C) */
                v[i] = _mm512_ternarylogic_epi32(v[i], i < 2 ? _mm512_slli_epi16(hb, 2 - i) : i == 2 ? hb : _mm512_srli_epi16(hb, i - 2), four, 0xF8);
        }
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (bits == 4 && hi16) {
        const __m512i h4 = _mm512_set1_epi8((char)0xF0);
        for (int t = 0; t < 4; t++) {
            __m512i p = _mm512_loadu_si512(pl + 64 * t);
            v[t] = _mm512_and_si512(p, m4);
            v[t + 4] = _mm512_and_si512(p, h4);
        }
        return;
    }
    if (bits == 6) { /* v = low4 | (h bits 2s, 2s + 1 at bits 4-5): (low4 & 0x0F) | x, as ternlog 0xEA = (A & B) | C */
        const __m512i m30 = _mm512_set1_epi8(0x30);
        const __m512i h0 = _mm512_loadu_si512(pl + 256), h1 = _mm512_loadu_si512(pl + 320);
        for (int t = 0; t < 4; t++) {
            __m512i p = _mm512_loadu_si512(pl + 64 * t);
            __m512i x0 = t == 2 ? h0 : t < 2 ? _mm512_slli_epi16(h0, 4 - 2 * t) : _mm512_srli_epi16(h0, 2);
            __m512i x1 = t == 2 ? h1 : t < 2 ? _mm512_slli_epi16(h1, 4 - 2 * t) : _mm512_srli_epi16(h1, 2);
            v[t] = _mm512_ternarylogic_epi32(p, m4, _mm512_and_si512(x0, m30), 0xEA);
            v[t + 4] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(p, 4), m4, _mm512_and_si512(x1, m30), 0xEA);
        }
        return;
    }
    for (int t = 0; t < 4; t++) {
        __m512i p = _mm512_loadu_si512(pl + 64 * t);
        v[t] = _mm512_and_si512(p, m4);
        v[t + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    }
    if (lut) { /* indices to values: one byte shuffle each (the 16 entries repeated in every 128-bit lane) */
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_LUT));
        for (int i = 0; i < 8; i++) v[i] = _mm512_shuffle_epi8(table, v[i]);
    }
    if (bits == 5) { /* bit i of H onto bit 4 (a 16-bit lane shift by at most 4 keeps it in its byte), masked and or'ed
                      * in one ternary op (0xF8 = A | (B & C)): two operations a slot where shift, and, shift, or took four */
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        const __m512i h = _mm512_loadu_si512(pl + 256);
        for (int i = 0; i < 8; i++)
            v[i] = _mm512_ternarylogic_epi32(v[i], i < 4 ? _mm512_slli_epi16(h, 4 - i) : i == 4 ? h : _mm512_srli_epi16(h, i - 4),
                                             bit4, 0xF8);
    }
}
VS_INLINE VS_AVX512 void unpack8(const uint8_t *pl, const int bits, const int lut, __m512i v[8]) { unpack8_as(pl, bits, lut, v, 0); }

/* p += vpdpbusd(v, the 4 bytes at a in every lane), the 4 bytes read as the instruction's own {1to16} memory operand:
 * GCC does not fold a broadcast into vpdpbusd (its pattern is opaque), and a separate vpbroadcastd per product was
 * half the uops of a wide pass's inner loop. */
VS_INLINE VS_AVX512 void dpbusd_bcast(__m512i *p, __m512i v, const int8_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(*p) : "v"(v), "m"(*(const int32_t *)a));
}

/* sum over slots first..first+3 of vpdpbusd(v[i], 4 activation bytes): one chain of 4 (two chains per sub-block
 * run side by side; integer sums, so their order changes no bit). */
VS_INLINE VS_AVX512 __m512i dot_slots(const __m512i v[8], const int8_t *a, int first, int count) {
    __m512i p = _mm512_setzero_si512();
    for (int i = first; i < first + count; i++) dpbusd_bcast(&p, v[i], a + 4 * i);
    return p;
}

VS_INLINE VS_AVX512 __m512i load_i8x16(const uint8_t *p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* A super-block's 16 rows' d and dmin (dmin = d * dmin_kind, or stored). */
VS_INLINE VS_AVX512 void sb_scales_avx512(const layout_t *L, const uint8_t *sb, __m512 *d, __m512 *dmin) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sb));
    *dmin = L->dmin_kind ? _mm512_mul_ps(*d, _mm512_set1_ps((float)L->dmin_kind))
                         : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sb + 32)));
}

/* How far ahead of the super-block being read the kernels ask for the weights: into L1 2 KB on, into L2 8 KB on. A
 * 2-core Xeon (model 207) read a pass's 1 GB at 15.4 GB/s without prefetching, 22.8 with 2-8 KB into L1: the hardware
 * prefetcher alone left the cores waiting. On a Xeon with AMX (model 167) one core streamed only 10 GB/s so; the L2
 * requests further on keep more lines in flight (`benchmarks/kernel_rates.py --widths 1,8 --rounds 11 --against`,
 * one token: 1 thread 97.8 -> 91.2 ms, 2 threads 55.2 -> 51.8 ms; 8 tokens, bound by arithmetic, unchanged; L2 at
 * 16 KB or L1 at 1 KB measured alike). On AMD the one-token tiles ask for nothing (cpu.h, vs_set_prefetch_one). A
 * prefetch changes no result. */
enum { PF_L1_BYTES = 2048, PF_L2_BYTES = 8192 };
VS_INLINE void prefetch_ahead(const uint8_t *sb, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) {
        _mm_prefetch((const char *)sb + PF_L1_BYTES + o, _MM_HINT_T0);
        _mm_prefetch((const char *)sb + PF_L2_BYTES + o, _MM_HINT_T1);
    }
}

/* Sub-block u of `units`' share of a super-block's prefetches (SB bytes): the kernels spread them over the sub-blocks
 * rather than issue them at once (on the Xeon with AMX a super-block's 72 requests in one burst streamed 9-13% slower,
 * `kernel_rates.py --against`, one and four tokens). Shares are whole lines; the last takes the rest, which may be
 * none (the share before it may reach past the super-block: a prefetch there is harmless). */
VS_INLINE void prefetch_share(const uint8_t *sb, int64_t SB, int u, int units) {
    const int64_t part = (SB / units + 63) & ~(int64_t)63;
    prefetch_ahead(sb + u * part, u == units - 1 ? SB - u * part : part);
}

/* The min factors of a super-block as int16 pairs per row for vpdpwssd (m of Q4_K / Q5_K: 4 pairs; Q6_K's 16 scales:
 * 8). */
VS_INLINE VS_AVX512 void min_pairs_avx512(const layout_t *L, const uint8_t *sb, __m512i *pair) {
    const uint8_t *m = sb + header_bytes(L) + (L->has_m ? nscales(L) * GROUP : 0);
    for (int j = 0; j < nscales(L) / 2; j++)
        pair[j] = _mm512_or_si512(_mm512_and_si512(load_i8x16(m + 2 * j * GROUP), _mm512_set1_epi32(0xFFFF)),
                                  _mm512_slli_epi32(load_i8x16(m + (2 * j + 1) * GROUP), 16));
}

/* One group, a tile of T <= TILE_AVX512 tokens; each token's operations do not depend on T (the widest T given:
 * vs_avx512_tile, cpu.h).
 * Per sub-block and token: two vpdpbusd chains of 4 (slots 0-3, 4-7); for the K-quants the min terms once per
 * super-block in vpdpwssd over the token's unit sum pairs (tok.pairs), not a multiply per sub-block. */
VS_INLINE VS_AVX512 void group_tile_avx512(const int type, const int T, const uint8_t *grp, int64_t nsb, const token_t *tok) {
    layout_t L;
    get_layout(type, &L);
    const int64_t SB = sb_bytes(&L), poff = planes_offset(&L);
    const int hdr = header_bytes(&L), nsc = nscales(&L), pb = plane_bytes(L.bits), hi16 = L.bits == 4 && !L.lut;
    const int kind_shift = L.dmin_kind ? __builtin_ctz((unsigned)L.dmin_kind) : -1; /* kinds are powers of two */
    const int prefetch = T > 1 || prefetch_one(); /* cpu.h: off for one token on AMD */
    __m512 acc[TILE_AVX512];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB;
        __m512 d, dmin;
        sb_scales_avx512(&L, sb, &d, &dmin);
        __m512i isum[TILE_AVX512];
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        for (int u = 0; u < L.q / 32; u++) {
            __m512i v[8];
            if (prefetch) prefetch_share(sb, SB, u, L.q / 32);
            unpack8_as(sb + poff + u * pb, L.bits, L.lut, v, hi16);
            if (L.scsub == 16 && L.bits <= 3) {
                /* Q2_K / Q3_K: a unit's dot fits 16 bits (16 x 7 x 128 < 2^15), so a sub-block's two units go in one
                 * lane as an int16 pair and vpdpwssd multiplies them by (sc0, sc1): the same integer as two products */
                const __m512i low16 = _mm512_set1_epi32(0xFFFF);
                const __m512i sc01 = _mm512_ternarylogic_epi32(load_i8x16(sb + hdr + (2 * u) * GROUP), low16,
                                                               _mm512_slli_epi32(load_i8x16(sb + hdr + (2 * u + 1) * GROUP), 16), 0xEA);
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m512i p0 = dot_slots(v, a, 0, 4), p1 = dot_slots(v, a, 4, 4);
                    isum[t] = _mm512_dpwssd_epi32(isum[t], _mm512_ternarylogic_epi32(p0, low16, _mm512_slli_epi32(p1, 16), 0xEA), sc01);
                }
            } else if (L.scsub == 16) {
                __m512i sc0 = load_i8x16(sb + hdr + (2 * u) * GROUP), sc1 = load_i8x16(sb + hdr + (2 * u + 1) * GROUP);
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m512i p0 = dot_slots(v, a, 0, 4), p1 = dot_slots(v, a, 4, 4);
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sc0, p0));
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sc1, p1));
                }
            } else if (L.scsub == 32 && hi16) {
                /* 4-bit K-quants: each half's dot fits 16 bits (16 x 15 x 128 < 2^15), so both halves go in one
                 * lane as an int16 pair and vpdpwssd multiplies them by (sc, sc) and adds them to isum */
                const __m512i sc = load_i8x16(sb + hdr + u * GROUP), sc2 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));
                const __m512i low16 = _mm512_set1_epi32(0xFFFF);
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m512i p0 = dot_slots(v, a, 0, 4), p1 = dot_slots(v, a, 4, 4); /* p1: 16 times the dot */
                    __m512i both = _mm512_ternarylogic_epi32(p0, low16, _mm512_slli_epi32(p1, 12), 0xEA);
                    isum[t] = _mm512_dpwssd_epi32(isum[t], both, sc2);
                }
            } else {
                __m512i sc = L.scsub == 32 ? load_i8x16(sb + hdr + u * GROUP) : _mm512_setzero_si512();
                for (int t = 0; t < T; t++) {
                    const int8_t *a = tok[t].q + s * L.q + 32 * u;
                    __m512i p0 = dot_slots(v, a, 0, 4), p1 = dot_slots(v, a, 4, 4);
                    __m512i p = _mm512_add_epi32(p0, hi16 ? _mm512_srai_epi32(p1, 4) : p1);
                    isum[t] = L.scsub == 32 ? _mm512_add_epi32(isum[t], _mm512_mullo_epi32(sc, p)) : p;
                }
            }
        }
        __m512i pair[8];
        if (L.scsub) min_pairs_avx512(&L, sb, pair);
        for (int t = 0; t < T; t++) {
            __m512i imin;
            if (L.scsub) {
                const int32_t *tp = tok[t].pairs + AMX_PAIRS * s;
                imin = _mm512_setzero_si512();
                for (int j = 0; j < nsc / 2; j++) imin = _mm512_dpwssd_epi32(imin, pair[j], _mm512_set1_epi32(tp[j]));
            } else {
                const int32_t *bs = tok[t].bsum + (s * L.q) / 16;
                imin = _mm512_set1_epi32(bs[0] + bs[1]);
            }
            __m512 da = _mm512_set1_ps(tok[t].d[s]);
            if (kind_shift >= 0) { /* dmin = 2^shift d: the offset off in integers, one product */
                __m512i signed_sum = _mm512_sub_epi32(isum[t], _mm512_sll_epi32(imin, _mm_cvtsi32_si128(kind_shift)));
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(signed_sum), acc[t]);
            } else {
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(isum[t]), acc[t]);
                acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(imin), acc[t]);
            }
        }
    }
    for (int t = 0; t < T; t++) _mm512_storeu_ps(tok[t].out, acc[t]);
}

#define VS_TILES(TYPE)                                                   \
    switch (T) {                                                         \
        case 1: group_tile_avx512(TYPE, 1, grp, nsb, tok); break;         \
        case 2: group_tile_avx512(TYPE, 2, grp, nsb, tok); break;         \
        case 3: group_tile_avx512(TYPE, 3, grp, nsb, tok); break;         \
        case 4: group_tile_avx512(TYPE, 4, grp, nsb, tok); break;         \
        case 5: group_tile_avx512(TYPE, 5, grp, nsb, tok); break;         \
        case 6: group_tile_avx512(TYPE, 6, grp, nsb, tok); break;         \
        case 7: group_tile_avx512(TYPE, 7, grp, nsb, tok); break;         \
        case 8: group_tile_avx512(TYPE, 8, grp, nsb, tok); break;         \
        case 9: group_tile_avx512(TYPE, 9, grp, nsb, tok); break;         \
        case 10: group_tile_avx512(TYPE, 10, grp, nsb, tok); break;       \
        case 11: group_tile_avx512(TYPE, 11, grp, nsb, tok); break;       \
        case 12: group_tile_avx512(TYPE, 12, grp, nsb, tok); break;       \
        case 13: group_tile_avx512(TYPE, 13, grp, nsb, tok); break;       \
        case 14: group_tile_avx512(TYPE, 14, grp, nsb, tok); break;       \
        case 15: group_tile_avx512(TYPE, 15, grp, nsb, tok); break;       \
        default: group_tile_avx512(TYPE, 16, grp, nsb, tok); break;       \
    }

static VS_AVX512 void group_avx512(int type, const uint8_t *grp, int64_t nsb, const token_t *tok, int T) {
    switch (type) {
        case T_Q4_0: VS_TILES(T_Q4_0); break;
        case T_Q4_1: VS_TILES(T_Q4_1); break;
        case T_Q5_0: VS_TILES(T_Q5_0); break;
        case T_Q5_1: VS_TILES(T_Q5_1); break;
        case T_Q8_0: VS_TILES(T_Q8_0); break;
        case T_Q2_K: VS_TILES(T_Q2_K); break;
        case T_Q3_K: VS_TILES(T_Q3_K); break;
        case T_Q4_K: VS_TILES(T_Q4_K); break;
        case T_Q5_K: VS_TILES(T_Q5_K); break;
        case T_Q6_K: VS_TILES(T_Q6_K); break;
        case T_IQ4_NL: VS_TILES(T_IQ4_NL); break;
        case T_IQ4_XS: VS_TILES(T_IQ4_XS); break;
    }
}
#endif
