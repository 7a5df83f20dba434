/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The weight types,
 * their repacked layout, and the scalar conversions every part uses.
 *
 * Repacked layout ("lane-interleaved"). Output rows are taken 16 at a time (a group); lane r of a
 * 512-bit register belongs to row r of the group. A group's data is its super-blocks (Q weights of each
 * of its 16 rows: 256 for K-quants, 32 for Q4_0 / Q4_1 / Q8_0), one after the other along K:
 *
 *   super-block = [d: 16 x fp16][dmin: 16 x fp16, if stored][sc: nsc x 16 x int8][m: nsc x 16 x int8]
 *                 [planes of sub-block 0 (32 weights)][planes of sub-block 1] ...
 *
 *   A "slot" is 4 consecutive weights k..k+3 of all 16 rows, 64 bytes: byte 4r + j = q(row r, k + j).
 *   Sub-block planes hold its 8 slots (weights 0-3, 4-7, ..., 28-31):
 *     4 bits: P0..P3 (4 x 64 B); slot t is the low nibbles of P[t], slot t + 4 the high nibbles.
 *     5 bits: + H (64 B): bit t of H's byte is the fifth bit of slot t.
 *     6 bits: + H0, H1 (2 x 64 B): bits 2s, 2s+1 of Hh are bits 4-5 of slot 4h + s.
 *     8 bits: S0..S7 (8 x 64 B), the values themselves.
 *     2 bits: P0, P1 (2 x 64 B); bits 2s, 2s + 1 of Pp are slot 4p + s.   3 bits: + H (64 B), bit t the third bit of slot t.
 *
 *   A row's weight is  d * sc * q - dmin * m  with q >= 0 (unsigned: vpdpbusd multiplies u8 x s8);
 *   sc, m per sub-block of 32 (Q4_K, Q5_K) or 16 (Q6_K, where m = sc and dmin = 32 d; Q3_K, m = sc - 32 signed and
 *   dmin = 4 d; Q2_K, sc and m stored); Q4_0: sc = m = 1,
 *   dmin = 8 d; Q5_0: dmin = 16 d; Q8_0: q + 128 stored, dmin = 128 d; Q4_1, Q5_1: dmin = -min.
 *   IQ4_NL and IQ4_XS (lut): the 4-bit planes hold indices into ggml's 16 non-linear values (kvalues_iq4nl); the
 *   value q is IQ4_LUT[index] = that value + 128 (1..241, unsigned), looked up as the planes are unpacked, and
 *   dmin = 128 d as for Q8_0. IQ4_NL has Q4_0's shape (32 a block, no scales); IQ4_XS Q6_K's with a scale per 32
 *   (sc = its 6-bit scale - 32, signed; m = sc).
 *
 * With int8 activations a (scale da per super-block, bsum = sums of a over 16), a token's output is
 *   acc += (d da) * float(sum_j sc_j dot_j)  -  (dmin da) * float(sum_j m_j bsum_j)   per super-block,
 * or, where dmin = kind d (Q4_0, Q5_0, Q8_0, Q6_K: the offset that makes q unsigned), in one product of the signed
 * integer sum, as llama.cpp computes it (EPILOGUE):
 *   acc += (d da) * float(sum_j sc_j dot_j - kind sum_j m_j bsum_j)
 * (two large float terms of opposite sign lost the low bits of Q8_0's dots: its offset is 128),
 * each dot_j a vpdpbusd chain: the unpacked weights of a sub-block are reused by every token of a tile.
 */

/* Status codes of the int-returning functions; the Python side (native.py, `check`) turns them into a
 * VerispecError or a MemoryError. Nothing here divides by a size it was given without checking it first. */
enum { VS_OK = 0, VS_EINVAL = -1, VS_ERANGE = -2, VS_ENOMEM = -3 };

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30 };
/* TILE: the most tokens one generic tile kernel call takes; TILE_AVX2 the AVX2 kernel's (either copy); TILE_AVX512
 * the most the AVX-512 one can take, vs_avx512_tile() the most it is given on this CPU (each kernel's per-token
 * operations do not depend on the tile, so any tiling gives the same bits). Eight on AVX2: its sums spill past 4
 * (16 registers), but a second tile unpacks every weight again; forced on a 2-core Xeon with AMX, a pass's matmuls
 * over 5 / 8 tokens took 125.4 / 161.1 ms in tiles of 2 + 3 / 4 + 4 and 101.3 / 148.6 as one tile (with AVX-VNNI
 * 95.3 / 111.9 -> 77.2 / 92.5), 4 tokens alike (`benchmarks/kernel_rates.py --paths avx2 --against`). */
enum { GROUP = 16, TILE = 4, TILE_AVX2 = 8, TILE_AVX512 = 16 };
/* AMX_PAIRS: a token's unit sum pairs kept per super-block (amx_sum_pairs; 4 used for Q4_K / Q5_K, 8 for Q6_K), read
 * by the AVX-512 and AMX kernels' min terms */
enum { AMX_PAIRS = 8 };
enum { PATH_GENERIC = 0, PATH_AVX512 = 1, PATH_AVX2 = 2, PATH_AMX = 3, PATH_AMX_EMULATED = 4, PATH_AVX_VNNI = 5 };

typedef struct {
    int q;          /* weights per super-block */
    int bits;       /* bits per stored value */
    int scsub;      /* weights per scale (0: no scales, sc = m = 1) */
    int has_m;      /* an m array is stored (else m = sc, or 1) */
    int dmin_kind;  /* 0: stored; else dmin = d * dmin_kind */
    int src_bytes;  /* bytes of one GGUF block */
    int lut;        /* the planes hold 4-bit indices into IQ4_LUT, not the values */
} layout_t;

/* ggml's kvalues_iq4nl (-127, -104, ..., 113) + 128: the unsigned values vpdpbusd multiplies, indexed by the 4 bits */
static const uint8_t IQ4_LUT[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

static int get_layout(int type, layout_t *L) {
    switch (type) {
        case T_Q4_0: *L = (layout_t){32, 4, 0, 0, 8, 18}; return 0;
        case T_Q4_1: *L = (layout_t){32, 4, 0, 0, 0, 20}; return 0;
        case T_Q5_0: *L = (layout_t){32, 5, 0, 0, 16, 22}; return 0;
        case T_Q5_1: *L = (layout_t){32, 5, 0, 0, 0, 24}; return 0;
        case T_Q8_0: *L = (layout_t){32, 8, 0, 0, 128, 34}; return 0;
        case T_Q2_K: *L = (layout_t){256, 2, 16, 1, 0, 84}; return 0;
        case T_Q3_K: *L = (layout_t){256, 3, 16, 0, 4, 110}; return 0;
        case T_Q4_K: *L = (layout_t){256, 4, 32, 1, 0, 144}; return 0;
        case T_Q5_K: *L = (layout_t){256, 5, 32, 1, 0, 176}; return 0;
        case T_Q6_K: *L = (layout_t){256, 6, 16, 0, 32, 210}; return 0;
        case T_IQ4_NL: *L = (layout_t){32, 4, 0, 0, 128, 18, 1}; return 0;
        case T_IQ4_XS: *L = (layout_t){256, 4, 32, 0, 128, 136, 1}; return 0;
        default: return -1;
    }
}

static int plane_bytes(int bits) { return 64 * bits; } /* a slot of 16 rows x 4 weights is 64 bytes a bit */
static int header_bytes(const layout_t *L) { return L->dmin_kind ? 32 : 64; }
static int nscales(const layout_t *L) { return L->scsub ? L->q / L->scsub : 0; }
static int64_t sb_bytes(const layout_t *L) {
    return header_bytes(L) + (int64_t)nscales(L) * GROUP * (1 + L->has_m) + (int64_t)(L->q / 32) * plane_bytes(L->bits);
}
static int64_t planes_offset(const layout_t *L) { return header_bytes(L) + (int64_t)nscales(L) * GROUP * (1 + L->has_m); }

/* ------------------------------------------------------------------ fp16 / bf16 */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else { /* subnormal: value = mant * 2^-24, exact in float */
            float f = (float)mant * 5.9604644775390625e-08f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) { bits = sign | 0x7F800000u | (mant << 13); }
    else { bits = sign | ((exp + 112) << 23) | (mant << 13); }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

static float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* e^x from IEEE operations only (no libm): Cody-Waite reduction x = n ln2 + r, a degree-6 polynomial for
 * e^r, and 2^n put into the exponent. The compiler vectorises it, and a lane computes exactly what the
 * scalar code computes (-ffp-contract=off), so results never depend on where an element falls in a vector.
 * Relative error about 2e-7 on [-87, 88]; below -87 it returns 0. */
static inline float vs_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f + 12582912.0f; /* round(x / ln2) by the 1.5 * 2^23 trick */
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;  /* ln2's high part: n * it is exact */
    r = r - n * -2.12194440e-4f;      /* its low part */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}
