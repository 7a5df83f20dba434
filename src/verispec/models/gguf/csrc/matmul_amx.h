/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The AMX tile
 * kernels, compiled twice from amx_group.h: on the tile instructions, and on their portable
 * emulation (amx_tiles.h). */

/* ------------------------------------------------------------------ quantized matmul: AMX tiles */
#include "amx_tiles.h"

/* The emulated copy: portable C, on every machine (the tests run it against the other paths). */
#define AMX_NAME(x) x##_amx_emulated
#define AMX_ATTR
#define AMX_CONFIG(cfg) emu_config(cfg)
#define AMX_ZERO(t) emu_zero(t)
#define AMX_LOAD(t, p, s) emu_load(t, p, s)
#define AMX_STORE(t, p, s) emu_store(t, p, s)
#define AMX_DPBSUD(c, a, b) emu_dpbsud(c, a, b)
#define AMX_OPERANDS(L, sb, hi, lo) amx_operands_portable(L, sb, hi, lo)
#define AMX_IMIN(mins, n, pairs, imin) amx_imin_portable(mins, n, pairs, imin)
#define AMX_SCALE_ADD4(isum, sc, dots, t) amx_scale_add4_portable(isum, sc, dots, t)
#define AMX_MINS(L, sb, mins) amx_mins_portable(L, sb, mins)
#define AMX_SCALES(L, sb, d, dmin) amx_scales_portable(L, sb, d, dmin)
#define AMX_PREFETCH(sb, bytes) ((void)0)
#include "amx_group.h"
#undef AMX_NAME
#undef AMX_ATTR
#undef AMX_CONFIG
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_DPBSUD
#undef AMX_OPERANDS
#undef AMX_SCALES
#undef AMX_IMIN
#undef AMX_SCALE_ADD4
#undef AMX_MINS
#undef AMX_PREFETCH

#ifdef VS_X86
/* The real copy: the AMX instructions, the operands built with AVX-512 (amx_operands_portable's bytes). */
#define VS_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))
/* v's bytes times a factor s16 holds in every 16-bit lane, in one vpmullw: a lane is e + 256 o (bytes e, o < 32)
 * and its product e s + 256 o s (mod 2^16), where e s, o s < 256 (s < 8) leave no carry into the other byte. */
VS_INLINE VS_AMX __m512i bytes_times(__m512i v, __m512i s16) { return _mm512_mullo_epi16(v, s16); }
VS_INLINE VS_AMX void amx_operands_avx512(const layout_t *L, const uint8_t *sb, uint8_t *hi, uint8_t *lo) {
    const int64_t poff = planes_offset(L);
    const int pb = plane_bytes(L->bits), hdr = header_bytes(L);
    for (int u = 0; u < L->q / 32; u++) {
        __m512i v[8];
        unpack8(sb + poff + u * pb, L->bits, L->lut, v);
        if (!L->scsub || !lo) {
            for (int i = 0; i < 8; i++) _mm512_store_si512(hi + 512 * u + 64 * i, v[i]);
            continue;
        }
        const __m512i sc = load_i8x16(sb + hdr + u * GROUP);
        const __m512i h = _mm512_srli_epi32(sc, 3), l = _mm512_and_si512(sc, _mm512_set1_epi32(7));
        const __m512i h16 = _mm512_or_si512(h, _mm512_slli_epi32(h, 16)), l16 = _mm512_or_si512(l, _mm512_slli_epi32(l, 16));
        for (int i = 0; i < 8; i++) {
            _mm512_store_si512(hi + 512 * u + 64 * i, bytes_times(v[i], h16));
            _mm512_store_si512(lo + 512 * u + 64 * i, bytes_times(v[i], l16));
        }
    }
}
VS_INLINE VS_AMX void amx_imin_avx512(const amx_mins_t *mins, int n, const int32_t *pairs, int32_t *imin) {
    __m512i sum = _mm512_setzero_si512();
    for (int j = 0; j < n; j++) sum = _mm512_dpwssd_epi32(sum, _mm512_load_si512(mins->pair[j]), _mm512_set1_epi32(pairs[j]));
    _mm512_storeu_si512(imin, sum);
}
VS_INLINE VS_AMX void amx_scale_add4_avx512(int32_t *isum, const int8_t *sc, int32_t (*dots)[AMX_TOKENS][GROUP], int t) {
    __m512i acc = _mm512_loadu_si512(isum);
    for (int i = 0; i < 4; i++)
        acc = _mm512_add_epi32(acc, _mm512_mullo_epi32(load_i8x16((const uint8_t *)sc + i * GROUP), _mm512_load_si512(dots[i][t])));
    _mm512_storeu_si512(isum, acc);
}
VS_INLINE VS_AMX void amx_mins_avx512(const layout_t *L, const uint8_t *sb, amx_mins_t *mins) {
    __m512i pair[8];
    min_pairs_avx512(L, sb, pair); /* the VNNI kernel's min pairs, kept for the tile kernel's tokens */
    for (int j = 0; j < amx_npairs(L); j++) _mm512_store_si512(mins->pair[j], pair[j]);
}
VS_INLINE VS_AMX void amx_scales_avx512(const layout_t *L, const uint8_t *sb, float *d, float *dmin) {
    __m512 dv, dminv;
    sb_scales_avx512(L, sb, &dv, &dminv);
    _mm512_storeu_ps(d, dv);
    _mm512_storeu_ps(dmin, dminv);
}
#define AMX_NAME(x) x##_amx
#define AMX_ATTR VS_AMX
#define AMX_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define AMX_OPERANDS(L, sb, hi, lo) amx_operands_avx512(L, sb, hi, lo)
#define AMX_IMIN(mins, n, pairs, imin) amx_imin_avx512(mins, n, pairs, imin)
#define AMX_SCALE_ADD4(isum, sc, dots, t) amx_scale_add4_avx512(isum, sc, dots, t)
#define AMX_MINS(L, sb, mins) amx_mins_avx512(L, sb, mins)
#define AMX_SCALES(L, sb, d, dmin) amx_scales_avx512(L, sb, d, dmin)
#define AMX_PREFETCH(sb, bytes) prefetch_ahead(sb, bytes)
#include "amx_group.h"
#endif
