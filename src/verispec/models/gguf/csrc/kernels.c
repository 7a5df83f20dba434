/* verispec's CPU kernels for GGUF models: repacked quantized matmuls over int8 activations, and the
 * per-row ops of a Llama / Qwen2 forward (RMSNorm, RoPE, attention over a KV cache, SwiGLU).
 *
 * Batch invariance is the rule every function here keeps: a token's outputs are computed with the same
 * sequence of operations whatever else is in the call (how many tokens, which thread, which tile).
 * Integer dot products are exact, and the float epilogues use explicit fmaf in one fixed order, so the
 * AVX-512 VNNI path and the portable path give the same bits (the tests check it).
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
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* only so that Python can import this file (and find it); the functions use ctypes */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define VS_X86 1
#endif

static struct PyModuleDef vs_module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, NULL, NULL, NULL, NULL, NULL};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&vs_module); }

/* Status codes of the int-returning functions; the Python side (native.py, `check`) turns them into a
 * VerispecError or a MemoryError. Nothing here divides by a size it was given without checking it first. */
enum { VS_OK = 0, VS_EINVAL = -1, VS_ERANGE = -2, VS_ENOMEM = -3 };

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q2_K = 10, T_Q3_K = 11, T_Q4_K = 12,
       T_Q5_K = 13, T_Q6_K = 14,
       T_IQ4_NL = 20, T_IQ4_XS = 23, T_BF16 = 30 };
/* TILE: the most tokens one AVX2 / generic tile kernel call takes; TILE_AVX512 the most the AVX-512 one can take,
 * vs_avx512_tile() the most it is given on this CPU (its per-token operations do not depend on the tile, so any
 * tiling gives the same bits). */
enum { GROUP = 16, TILE = 4, TILE_AVX512 = 16 };
/* AMX_PAIRS: a token's unit sum pairs kept per super-block (amx_sum_pairs; 4 used for Q4_K / Q5_K, 8 for Q6_K), read
 * by the AVX-512 and AMX kernels' min terms */
enum { AMX_PAIRS = 8 };
enum { PATH_GENERIC = 0, PATH_AVX512 = 1, PATH_AVX2 = 2, PATH_AMX = 3, PATH_AMX_EMULATED = 4 };

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

/* ------------------------------------------------------------------ CPU features and path */

static int vs_path = -1;
static int vs_threads = 1;

int vs_cpu_features(void) {
    /* bit 0 avx2, 1 fma, 2 avx512f, 3 avx512bw, 4 avx512vl, 5 avx512vnni, 6 f16c, 7 amx-tile, 8 amx-int8 */
    int f = 0;
#ifdef VS_X86
    __builtin_cpu_init();
    f |= __builtin_cpu_supports("avx2") ? 1 : 0;
    f |= __builtin_cpu_supports("fma") ? 2 : 0;
    f |= __builtin_cpu_supports("avx512f") ? 4 : 0;
    f |= __builtin_cpu_supports("avx512bw") ? 8 : 0;
    f |= __builtin_cpu_supports("avx512vl") ? 16 : 0;
    f |= __builtin_cpu_supports("avx512vnni") ? 32 : 0;
    f |= __builtin_cpu_supports("f16c") ? 64 : 0;
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) f |= (d >> 24 & 1 ? 128 : 0) | (d >> 25 & 1 ? 256 : 0);
#endif
    return f;
}

/* AMX needs the CPU's tiles and the kernel's leave to use them: Linux asks each process to request the tile
 * state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) before the first tile instruction, which would
 * otherwise fault. Asked once; 1 granted, 0 not (no AMX, or refused: vs_amx_status says which). */
static int amx_status = -1; /* 0 usable, 1 no AMX on this CPU, 2 no AVX-512 beside it, 3 the kernel refused */

int vs_amx_status(void) {
    if (amx_status < 0) {
        int f = vs_cpu_features();
        amx_status = (f & 0x180) != 0x180 ? 1 : (f & 0x7E) != 0x7E ? 2 : 0;
#ifdef VS_X86
        if (amx_status == 0 && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0)
            amx_status = 3;
#else
        amx_status = 1;
#endif
    }
    return amx_status;
}

static int path_supported(int path) {
    int f = vs_cpu_features();
    if (path == PATH_AVX512) return (f & 0x7E) == 0x7E;
    if (path == PATH_AVX2) return (f & 0x43) == 0x43; /* avx2, fma, f16c */
    if (path == PATH_AMX) return vs_amx_status() == 0;
    return path == PATH_GENERIC || path == PATH_AMX_EMULATED;
}

static int best_path(void) {
    return path_supported(PATH_AMX) ? PATH_AMX : path_supported(PATH_AVX512) ? PATH_AVX512
         : path_supported(PATH_AVX2) ? PATH_AVX2 : PATH_GENERIC;
}

int vs_get_path(void) {
    if (vs_path < 0) vs_path = best_path();
    return vs_path;
}

/* Force a path (tests compare them); returns the path in force (a path this CPU lacks is refused). */
int vs_set_path(int path) {
    vs_path = path_supported(path) ? path : PATH_GENERIC;
    return vs_path;
}

void vs_set_threads(int n) { vs_threads = n > 0 ? n : 1; }

/* The AVX-512 kernel's widest tile, chosen per CPU: 16 on Intel, 6 on AMD (on a Zen 4 a tile of 8 was slower than
 * 4 + 4: registers spill; 6 beat 4 + 2). On Intel a tile past 8 spills its sums too, but a token's spilled sum costs a
 * load and a store a sub-block, where a second tile unpacks every weight again: on a 2-core Xeon with AMX (family 6
 * model 167) a pass's matmuls over 9 tokens took 82.5 ms in tiles of 4 + 5 and 64.6 ms as one tile of 9 (8 tokens:
 * 61.6), 10 tokens 82.8 -> 67.4, 12 tokens 94.4 -> 77.5, 14 tokens 96.5 -> 85.9, 1 to 8 tokens alike
 * (`benchmarks/kernel_rates.py --against`, taking turns); before, tiles of 8 had beaten 6 on a Xeon of model 207 (7
 * tokens 71.2 -> 63.8 ms). vs_set_avx512_tile forces one (tests run several), 0 restores the CPU's choice; returns
 * the tile in force. */
static int vs_tile512 = 0;

int vs_avx512_tile(void) {
    if (vs_tile512 == 0) {
        vs_tile512 = 16;
#ifdef VS_X86
        unsigned a, b, c, d;
        if (__get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541 /* "Auth" of AuthenticAMD */) vs_tile512 = 6;
#endif
    }
    return vs_tile512;
}

int vs_set_avx512_tile(int tile) {
    vs_tile512 = tile <= 0 ? 0 : tile < TILE_AVX512 ? tile : TILE_AVX512;
    return vs_avx512_tile();
}

/* ------------------------------------------------------------------ profile */

/* Where a pass's time goes (benchmarks/pass_costs.py --profile): wall seconds, summed between vs_profile_start and
 * vs_profile_stop, of the quantized matmuls inside layers by weight type (slot PROFILE_TYPES + type), the float
 * matmuls, the matmuls outside any layer (the output head), the activations' quantization, attention, and whole
 * layers (vs_layer_forward: the rest of a layer is its row ops).
 * Only calls made outside any parallel region are timed (all of them, from the runner); off, a branch per call. */
enum { PROFILE_QUANTIZE = 0, PROFILE_ATTENTION = 1, PROFILE_LAYER = 2, PROFILE_FLOAT = 3, PROFILE_OUTSIDE = 4,
       PROFILE_TYPES = 8,
       PROFILE_SLOTS = PROFILE_TYPES + 32 };
static int vs_profiling = 0, vs_in_layer = 0;
static double vs_profile_s[PROFILE_SLOTS];

static double profile_now(void) {
    if (!vs_profiling) return -1.0;
#ifdef _OPENMP
    if (omp_in_parallel()) return -1.0;
#endif
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void profile_add(int slot, double t0) {
    if (t0 < 0 || slot < 0 || slot >= PROFILE_SLOTS) return;
    vs_profile_s[slot] += profile_now() - t0;
}

void vs_profile_start(void) {
    memset(vs_profile_s, 0, sizeof(vs_profile_s));
    vs_profiling = 1;
}

/* Stop; copy up to n slots' seconds to out; returns the number of slots. */
int vs_profile_stop(double *out, int n) {
    vs_profiling = 0;
    for (int i = 0; i < n && i < PROFILE_SLOTS; i++) out[i] = vs_profile_s[i];
    return PROFILE_SLOTS;
}

/* ------------------------------------------------------------------ repacking */

static void scale_min_k4(int j, const uint8_t *q, int8_t *sc, int8_t *m) {
    if (j < 4) { *sc = q[j] & 63; *m = q[j + 4] & 63; }
    else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

static uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* One GGUF block -> unsigned values q[Q], scales, mins, d and (stored) dmin as fp16 bits. */
static void decode_block(int type, const uint8_t *b, uint8_t *q, int8_t *sc, int8_t *m, uint16_t *d, uint16_t *dmin) {
    *d = 0;
    *dmin = 0;
    switch (type) {
        case T_Q4_0:
            *d = rd16(b);
            for (int l = 0; l < 16; l++) { q[l] = b[2 + l] & 0xF; q[l + 16] = b[2 + l] >> 4; }
            break;
        case T_Q4_1:
            *d = rd16(b);
            *dmin = rd16(b + 2) ^ 0x8000; /* dmin = -min: the sign flip is exact */
            for (int l = 0; l < 16; l++) { q[l] = b[4 + l] & 0xF; q[l + 16] = b[4 + l] >> 4; }
            break;
        case T_Q5_0:
        case T_Q5_1: {
            const int o = type == T_Q5_0 ? 2 : 4; /* qh's offset */
            uint32_t qh;
            memcpy(&qh, b + o, 4);
            *d = rd16(b);
            if (type == T_Q5_1) *dmin = rd16(b + 2) ^ 0x8000;
            for (int l = 0; l < 16; l++) {
                q[l] = (b[o + 4 + l] & 0xF) | (((qh >> l) & 1) << 4);
                q[l + 16] = (b[o + 4 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4);
            }
            break;
        }
        case T_Q8_0:
            *d = rd16(b);
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)((int)(int8_t)b[2 + l] + 128);
            break;
        case T_Q2_K: { /* scales (4-bit sc | 4-bit m << 4 a unit of 16), qs (2 bits), d, dmin */
            *d = rd16(b + 80); *dmin = rd16(b + 82);
            for (int j = 0; j < 16; j++) { sc[j] = (int8_t)(b[j] & 0xF); m[j] = (int8_t)(b[j] >> 4); }
            for (int k = 0; k < 256; k++) /* weight k: bits 2j of qs[32n + l], n = k / 128, j = k % 128 / 32 */
                q[k] = (b[16 + 32 * (k / 128) + k % 32] >> (2 * (k % 128 / 32))) & 3;
            break;
        }
        case T_Q3_K: { /* hmask (bit 4n + j: the third bit), qs (2 bits, as Q2_K's), 12 bytes of 6-bit scales, d */
            const uint8_t *hm = b, *qs = b + 32, *s12 = b + 96;
            *d = rd16(b + 108);
            for (int j = 0; j < 16; j++) { /* ggml's unpacking of the scales: low 4 bits, then 2 high bits */
                const int low = j < 8 ? s12[j] & 0xF : s12[j - 8] >> 4, high = (s12[8 + j % 4] >> (2 * (j / 4))) & 3;
                sc[j] = (int8_t)((low | (high << 4)) - 32);
            }
            for (int k = 0; k < 256; k++) {
                const int n = k / 128, j = k % 128 / 32, l = k % 32;
                q[k] = (uint8_t)(((qs[32 * n + l] >> (2 * j)) & 3) | (((hm[l] >> (4 * n + j)) & 1) << 2));
            }
            break;
        }
        case T_IQ4_NL: /* indices: the low nibbles are weights 0-15, the high 16-31 */
            *d = rd16(b);
            for (int l = 0; l < 16; l++) { q[l] = b[2 + l] & 0xF; q[l + 16] = b[2 + l] >> 4; }
            break;
        case T_IQ4_XS: { /* d, scales_h (2 bits a sub-block), scales_l (4), then 16 bytes of indices a sub-block */
            *d = rd16(b);
            const uint16_t sh = rd16(b + 2);
            const uint8_t *sl = b + 4, *qs = b + 8;
            for (int j = 0; j < 8; j++) {
                sc[j] = (int8_t)((((sl[j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32);
                for (int l = 0; l < 16; l++) { q[32 * j + l] = qs[16 * j + l] & 0xF; q[32 * j + 16 + l] = qs[16 * j + l] >> 4; }
            }
            break;
        }
        case T_Q4_K: {
            *d = rd16(b); *dmin = rd16(b + 2);
            const uint8_t *scales = b + 4, *qs = b + 16;
            for (int j = 0; j < 8; j++) scale_min_k4(j, scales, &sc[j], &m[j]);
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 32; l++) { q[64 * c + l] = qs[32 * c + l] & 0xF; q[64 * c + 32 + l] = qs[32 * c + l] >> 4; }
            break;
        }
        case T_Q5_K: {
            *d = rd16(b); *dmin = rd16(b + 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 48;
            for (int j = 0; j < 8; j++) scale_min_k4(j, scales, &sc[j], &m[j]);
            for (int c = 0; c < 4; c++) {
                uint8_t u1 = (uint8_t)(1u << (2 * c)), u2 = (uint8_t)(2u << (2 * c));
                for (int l = 0; l < 32; l++) {
                    q[64 * c + l] = (qs[32 * c + l] & 0xF) + ((qh[l] & u1) ? 16 : 0);
                    q[64 * c + 32 + l] = (qs[32 * c + l] >> 4) + ((qh[l] & u2) ? 16 : 0);
                }
            }
            break;
        }
        case T_Q6_K: {
            const uint8_t *ql = b, *qh = b + 128;
            for (int j = 0; j < 16; j++) sc[j] = (int8_t)b[192 + j];
            *d = rd16(b + 208);
            for (int n = 0; n < 2; n++) {
                const uint8_t *l4 = ql + 64 * n, *h2 = qh + 32 * n;
                uint8_t *y = q + 128 * n;
                for (int l = 0; l < 32; l++) {
                    y[l] = (l4[l] & 0xF) | ((h2[l] & 3) << 4);
                    y[l + 32] = (l4[l + 32] & 0xF) | (((h2[l] >> 2) & 3) << 4);
                    y[l + 64] = (l4[l] >> 4) | (((h2[l] >> 4) & 3) << 4);
                    y[l + 96] = (l4[l + 32] >> 4) | (((h2[l] >> 6) & 3) << 4);
                }
            }
            break;
        }
    }
}

/* Lane r of one sub-block's planes <- q[0..31] of row r. */
static void write_planes(uint8_t *pl, int bits, int r, const uint8_t *q) {
    for (int k = 0; k < 32; k++) {
        int slot = k / 4, byte = 4 * r + (k % 4), v = q[k];
        if (bits == 8) { pl[64 * slot + byte] = (uint8_t)v; continue; }
        if (bits <= 3) {
            pl[64 * (slot / 4) + byte] |= (uint8_t)((v & 3) << (2 * (slot % 4)));
            if (bits == 3) pl[128 + byte] |= (uint8_t)(((v >> 2) & 1) << slot);
            continue;
        }
        pl[64 * (slot % 4) + byte] |= (uint8_t)((v & 0xF) << (4 * (slot / 4)));
        if (bits == 5) pl[256 + byte] |= (uint8_t)(((v >> 4) & 1) << slot);
        if (bits == 6) pl[256 + 64 * (slot / 4) + byte] |= (uint8_t)(((v >> 4) & 3) << (2 * (slot % 4)));
    }
}

int64_t vs_packed_bytes(int type, int64_t rows, int64_t cols) {
    layout_t L;
    if (get_layout(type, &L) || rows < 0 || cols < 0 || cols % L.q) return VS_EINVAL;
    return (rows + GROUP - 1) / GROUP * (cols / L.q) * sb_bytes(&L);
}

/* GGUF rows (rows x cols weights, row-major blocks) -> the lane-interleaved layout. Rows past the
 * last one (up to a multiple of 16) are zero. Returns 0, or -1 for an unknown type or shape. */
int vs_repack(int type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    layout_t L;
    if (get_layout(type, &L) || rows < 0 || cols < 0 || cols % L.q) return VS_EINVAL;
    const int64_t nsb = cols / L.q, SB = sb_bytes(&L), ngroups = (rows + GROUP - 1) / GROUP;
    const int64_t row_bytes = nsb * L.src_bytes;
    const int nsc = nscales(&L);
    memset(dst, 0, (size_t)(ngroups * nsb * SB));
#pragma omp parallel for schedule(static) num_threads(vs_threads)
    for (int64_t g = 0; g < ngroups; g++) {
        uint8_t q[256];
        int8_t sc[16], m[16];
        uint16_t d, dmin;
        for (int64_t s = 0; s < nsb; s++) {
            uint8_t *sb = dst + (g * nsb + s) * SB;
            for (int r = 0; r < GROUP; r++) {
                int64_t row = g * GROUP + r;
                if (row >= rows) break;
                decode_block(type, src + row * row_bytes + s * L.src_bytes, q, sc, m, &d, &dmin);
                memcpy(sb + 2 * r, &d, 2);
                if (!L.dmin_kind) memcpy(sb + 32 + 2 * r, &dmin, 2);
                for (int j = 0; j < nsc; j++) {
                    ((int8_t *)sb)[header_bytes(&L) + j * GROUP + r] = sc[j];
                    if (L.has_m) ((int8_t *)sb)[header_bytes(&L) + (nsc + j) * GROUP + r] = m[j];
                }
                for (int u = 0; u < L.q / 32; u++)
                    write_planes(sb + planes_offset(&L) + u * plane_bytes(L.bits), L.bits, r, q + 32 * u);
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ reading the packed layout */

static int unpack_value(const uint8_t *pl, int bits, int r, int k) {
    int slot = k / 4, byte = 4 * r + (k % 4);
    if (bits == 8) return pl[64 * slot + byte];
    if (bits <= 3)
        return ((pl[64 * (slot / 4) + byte] >> (2 * (slot % 4))) & 3) | (bits == 3 ? ((pl[128 + byte] >> slot) & 1) << 2 : 0);
    int v = (pl[64 * (slot % 4) + byte] >> (4 * (slot / 4))) & 0xF;
    if (bits == 5) v |= ((pl[256 + byte] >> slot) & 1) << 4;
    if (bits == 6) v |= ((pl[256 + 64 * (slot / 4) + byte] >> (2 * (slot % 4))) & 3) << 4;
    return v;
}

/* The value vpdpbusd multiplies at weight k of row r (unpack_value, through IQ4_LUT for the lut types). */
static int unpack_weight(const layout_t *L, const uint8_t *pl, int r, int k) {
    const int v = unpack_value(pl, L->bits, r, k);
    return L->lut ? IQ4_LUT[v] : v;
}
static float sb_d(const uint8_t *sb, int r) { return half_to_float(rd16(sb + 2 * r)); }
static float sb_dmin(const layout_t *L, const uint8_t *sb, int r) {
    return L->dmin_kind ? sb_d(sb, r) * (float)L->dmin_kind : half_to_float(rd16(sb + 32 + 2 * r));
}
static int sb_sc(const layout_t *L, const uint8_t *sb, int j, int r) {
    return L->scsub ? ((const int8_t *)sb)[header_bytes(L) + j * GROUP + r] : 1;
}
static int sb_m(const layout_t *L, const uint8_t *sb, int j, int r) {
    if (!L->scsub) return 1;
    return L->has_m ? ((const int8_t *)sb)[header_bytes(L) + (nscales(L) + j) * GROUP + r] : sb_sc(L, sb, j, r);
}

/* Rows of a packed weight back to float32: (d sc) q - dmin m (a row of the token embedding). */
int vs_dequantize_rows(int type, const uint8_t *packed, int64_t rows, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    layout_t L;
    if (get_layout(type, &L) || rows < 0 || cols < 0 || cols % L.q) return VS_EINVAL;
    const int64_t nsb = cols / L.q, SB = sb_bytes(&L);
    for (int64_t i = 0; i < n; i++) {
        int64_t row = ids[i];
        if (row < 0 || row >= rows) return VS_ERANGE;
        const uint8_t *grp = packed + (row / GROUP) * nsb * SB;
        int r = (int)(row % GROUP);
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *sb = grp + s * SB;
            float d = sb_d(sb, r), dmin = sb_dmin(&L, sb, r);
            for (int k = 0; k < L.q; k++) {
                int j = L.scsub ? k / L.scsub : 0;
                int v = unpack_weight(&L, sb + planes_offset(&L) + (k / 32) * plane_bytes(L.bits), r, k % 32);
                out[i * cols + s * L.q + k] = d * (float)sb_sc(&L, sb, j, r) * (float)v - dmin * (float)sb_m(&L, sb, j, r);
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ activations */

/* x rounded to IEEE half precision (nearest, ties to even; past 65504 inf; below 2^-14 to multiples of 2^-24), as a
 * float: what llama.cpp's FP32_TO_FP16 keeps of a value (F16C's vcvtps2ph), in plain float and integer operations. */
static inline float round_to_half(float x) {
    float a = fabsf(x);
    if (!(a < 65520.0f)) return a != a ? x : copysignf(INFINITY, x); /* NaN stays; 65520 and up round past 65504 */
    if (a < 6.103515625e-05f) { /* half's subnormals: multiples of 2^-24 (x 2^24 is exact and below 2^10) */
        float v = (a * 16777216.0f + 12582912.0f) - 12582912.0f;
        return copysignf(v / 16777216.0f, x);
    }
    uint32_t bits;
    memcpy(&bits, &a, 4);
    bits += 0x0FFFu + ((bits >> 13) & 1u); /* 10 mantissa bits kept, the rest rounded to nearest, ties to even */
    bits &= ~0x1FFFu;
    float r;
    memcpy(&r, &bits, 4);
    return copysignf(r, x);
}

/* One block (a multiple of 16 values) to int8: amax = max |x| (exact in any order), inv = 127 / amax,
 * q = round half to even (x inv), clamped to +-127; returns d = amax / 127, rounded to half precision for blocks
 * of 32 (llama.cpp's block_q8_0 keeps its scale as a half, its block_q8_K as a float; its x86 code quantizes
 * with 127 / amax and rounds to even as here), so that a pass's arithmetic is llama.cpp's for every weight type.
 * Written in 16 lanes so that the compiler vectorises every loop. */
static inline float quantize_block(const float *xb, int block, int8_t *qb) {
    float lane[16] = {0};
    for (int l0 = 0; l0 < block; l0 += 16)
        for (int l = 0; l < 16; l++) {
            float a = fabsf(xb[l0 + l]);
            lane[l] = a > lane[l] ? a : lane[l];
        }
    float amax = 0.0f;
    for (int l = 0; l < 16; l++) amax = lane[l] > amax ? lane[l] : amax;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    if (isinf(inv)) inv = 0.0f; /* amax below 127 / FLT_MAX: the block quantizes to zeros */
    for (int l = 0; l < block; l++) {
        /* round half to even: |x inv| <= 127 < 2^22, so adding and removing 1.5 * 2^23 rounds it
         * exactly as nearbyintf does (which the compiler does not vectorise) */
        float v = (xb[l] * inv + 12582912.0f) - 12582912.0f;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        qb[l] = (int8_t)(int32_t)v;
    }
    return block == 32 ? round_to_half(amax / 127.0f) : amax / 127.0f;
}

/* x (n, k) float32 -> q (n, k) int8, d (n, k / block) float32, bsum (n, k / 16) int32. The arithmetic is
 * the contract that verispec.models.gguf.reference.quantize_activations states. block: a positive multiple
 * of 16 that divides k (else VS_EINVAL). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int vs_quantize_rows(const float *x, int64_t n, int64_t k, int block, int8_t *q, float *d, int32_t *bsum) {
    if (block <= 0 || block % 16 || n < 0 || k < 0 || k % block) return VS_EINVAL;
    /* rows are independent: several tokens split over the threads (each row's bits are its own) */
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b0 = 0; b0 < k; b0 += block)
            d[i * (k / block) + b0 / block] = quantize_block(x + i * k + b0, block, q + i * k + b0);
        for (int64_t j = 0; j < k / 16; j++) {
            int32_t sum = 0;
            for (int l = 0; l < 16; l++) sum += q[i * k + 16 * j + l];
            bsum[i * (k / 16) + j] = sum;
        }
    }
    return VS_OK;
}

/* ------------------------------------------------------------------ quantized matmul: portable path */

typedef struct {
    const int8_t *q;     /* this token's activations (k) */
    const float *d;      /* its scales (k / q) */
    const int32_t *bsum; /* its sums over 16 (k / 16) */
    float *out;          /* its 16 outputs of this group */
    const int32_t *pairs; /* unit sum pairs, AMX_PAIRS a super-block (amx_sum_pairs; AVX-512 and AMX paths), or NULL */
} token_t;

/* One group, any number of tokens: exactly the arithmetic of the SIMD path (integers exact; the float
 * epilogue in the same fmaf order). */
static void group_generic(const layout_t *L, const uint8_t *grp, int64_t nsb, const token_t *tok, int T) {
    const int64_t SB = sb_bytes(L);
    for (int t = 0; t < T; t++) {
        float acc[GROUP] = {0};
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *sb = grp + s * SB;
            int32_t isum[GROUP] = {0}, imin[GROUP] = {0};
            for (int u = 0; u < L->q / 32; u++) {
                const uint8_t *pl = sb + planes_offset(L) + u * plane_bytes(L->bits);
                const int8_t *a = tok[t].q + s * L->q + 32 * u;
                const int32_t *bs = tok[t].bsum + (s * L->q + 32 * u) / 16;
                for (int r = 0; r < GROUP; r++) {
                    int32_t dot[2] = {0, 0};
                    for (int k = 0; k < 32; k++) dot[k / 16] += unpack_weight(L, pl, r, k) * (int32_t)a[k];
                    if (L->scsub == 16) {
                        for (int h = 0; h < 2; h++) {
                            int sc = sb_sc(L, sb, 2 * u + h, r);
                            isum[r] += sc * dot[h];
                            imin[r] += sb_m(L, sb, 2 * u + h, r) * bs[h];
                        }
                    } else {
                        int j = L->scsub ? u : 0;
                        isum[r] += sb_sc(L, sb, j, r) * (dot[0] + dot[1]);
                        imin[r] += sb_m(L, sb, j, r) * (bs[0] + bs[1]);
                    }
                }
            }
            float da = tok[t].d[s];
            for (int r = 0; r < GROUP; r++) {
                float dd = sb_d(sb, r) * da, dm = sb_dmin(L, sb, r) * da;
                if (L->dmin_kind) { /* dmin = kind d: the offset taken off in integers, one product (see EPILOGUE) */
                    acc[r] = fmaf(dd, (float)(isum[r] - L->dmin_kind * imin[r]), acc[r]);
                    continue;
                }
                acc[r] = fmaf(dd, (float)isum[r], acc[r]);
                acc[r] = fmaf(-dm, (float)imin[r], acc[r]);
            }
        }
        memcpy(tok[t].out, acc, sizeof acc);
    }
}

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
    if (bits == 5) {
        const __m512i one = _mm512_set1_epi8(1);
        __m512i h = _mm512_loadu_si512(pl + 256);
        for (int i = 0; i < 8; i++)
            v[i] = _mm512_or_si512(v[i], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, i), one), 4));
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
 * 16 KB or L1 at 1 KB measured alike). A prefetch changes no result. */
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

/* One group, a tile of T <= TILE_AVX512 tokens; each token's operations do not depend on T. Six: on a 2-core
 * Zen 4 (1536 x 8960 Q4_K, weights in L3, one thread) a tile of 5 cost 0.455 ms against 0.472 as 4 + 1, 6 0.520
 * against 0.550; a tile of 8 was slower than 4 + 4 (0.745 against 0.710 ms: registers spill).
 * Per sub-block and token: two vpdpbusd chains of 4 (slots 0-3, 4-7); for the K-quants the min terms once per
 * super-block in vpdpwssd over the token's unit sum pairs (tok.pairs), not a multiply per sub-block. */
VS_INLINE VS_AVX512 void group_tile_avx512(const int type, const int T, const uint8_t *grp, int64_t nsb, const token_t *tok) {
    layout_t L;
    get_layout(type, &L);
    const int64_t SB = sb_bytes(&L), poff = planes_offset(&L);
    const int hdr = header_bytes(&L), nsc = nscales(&L), pb = plane_bytes(L.bits), hi16 = L.bits == 4 && !L.lut;
    const int kind_shift = L.dmin_kind ? __builtin_ctz((unsigned)L.dmin_kind) : -1; /* kinds are powers of two */
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
            prefetch_share(sb, SB, u, L.q / 32);
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

/* The fewest tokens for which the AMX tile kernels beat the AVX-512 VNNI kernel on one matmul (the same bits either
 * way), per weight type; 0: never, the VNNI kernel takes every width. Measured on a 2-core Xeon with AMX (family 6
 * model 167, 2026-11-29; both kernels prefetching), 2 threads, the paths taking turns, AMX time over VNNI time with
 * every tile on the tiles: the default target's Q4_K matmuls streamed 1.09 at 9 tokens, 1.02 at 12 and 14, 0.91 at
 * 16, 0.84 at 32 and 48; its Q6_K matmuls 1.06-1.24 at every width to 48 (its output head 1.08-1.24); eight
 * 8960 x 1536 matrices of a type: Q5_K 0.92 at 12, 0.85 at 16, 0.80 at 48, Q8_0 1.10-1.24 from 16 to 48, and
 * before the VNNI kernel's last prefetching change the scale-free types and IQ4_NL 1.16-1.88 at every width to 32,
 * Q2_K / Q3_K 1.08-1.64. The tiles' operands are built per super-block for every tile of tokens, and that costs
 * about what the VNNI kernel's per-token work saves (from two whole tiles on, group_wide builds them once for all the
 * tiles: these minimums are from before it and were not measured again). (Against earlier VNNI kernels the tiles
 * paid from 5 tokens, 10 for Q6_K.) A matmul over fewer tokens runs on the VNNI kernel whole; over more, tiles of 16
 * and a remainder of at least the minimum go to the tiles, a smaller remainder to the VNNI kernel. vs_set_amx_min
 * forces one minimum for every type (1: every tile through the tile kernels where the CPU has them, as the tests run
 * them); 0 restores the table. */
static int vs_amx_min = 0;

static int amx_min_tokens(int type) {
    if (vs_amx_min > 0) return vs_amx_min;
    return type == T_Q4_K ? 16 : type == T_Q5_K ? 12 : 0;
}

int vs_set_amx_min(int n) {
    vs_amx_min = n > 0 ? n : 0;
    return vs_amx_min;
}

_Static_assert((int)TILE_AVX512 <= (int)AMX_TOKENS, "a thread's token slots (tok, spill) hold one tile of either kernel");

/* out (n, rows) = x (n, cols) W^T with x given quantized (vs_quantize_rows with block = the type's Q). */
static int matmul_quantized(int type, const uint8_t *packed, int64_t rows, int64_t cols, int64_t n, const int8_t *q,
                            const float *d, const int32_t *bsum, float *out) {
    layout_t L;
    if (get_layout(type, &L) || rows < 0 || cols < 0 || cols % L.q) return VS_EINVAL;
    const int64_t nsb = cols / L.q, SB = sb_bytes(&L), ngroups = (rows + GROUP - 1) / GROUP;
    int path = vs_get_path();
    if (L.lut && L.scsub) /* IQ4_XS: signed scales over values up to 241 fit neither tile kernel's split */
        path = path == PATH_AMX ? PATH_AVX512 : path == PATH_AMX_EMULATED ? PATH_GENERIC : path;
    const int amx_min = amx_min_tokens(type);
    if (path == PATH_AMX && (amx_min == 0 || n < amx_min)) path = PATH_AVX512; /* too few tokens for the tiles to pay */
    const int amx = path == PATH_AMX || path == PATH_AMX_EMULATED;
    const int tile = amx ? AMX_TOKENS : path == PATH_AVX512 ? vs_avx512_tile() : TILE;
    int32_t *pairs = NULL; /* the tile kernel's sub-block sum pairs of each token and super-block */
    if ((amx || path == PATH_AVX512) && L.scsub && n > 0) {
        if (!(pairs = malloc(sizeof(int32_t) * AMX_PAIRS * (size_t)(n * nsb)))) return VS_ENOMEM;
        for (int64_t i = 0; i < n * nsb; i++) amx_sum_pairs(&L, bsum + i * (L.q / 16), pairs + AMX_PAIRS * i);
    }
    /* Two tiles of tokens or more (a prompt's chunk): the whole tiles through group_wide, which builds each
     * super-block's operands once for all of them (group builds them once a tile: a Q4_K matmul over 128 tokens
     * 1.4-1.7x faster so, the same bits), with the activations copied tile-major so that a tile's rows are one run of
     * memory; the rest of the tokens as below. Not Q6_K's units (group_units). */
    const int64_t nwide = amx && L.scsub != 16 && nsb > 0 && n >= 2 * AMX_TOKENS ? n / AMX_TOKENS * AMX_TOKENS : 0;
    int8_t *qa = NULL;
    float *wacc = NULL; /* group_wide's sums: (nwide, GROUP) for each thread */
    if (nwide) {
        const int64_t K = amx_depth(&L); /* group_wide's layout: (tile, K-chunk, 16 tokens, K bytes) */
        qa = aligned_alloc(64, (size_t)(nwide * cols + 63) / 64 * 64);
        wacc = malloc(sizeof(float) * GROUP * (size_t)(nwide * vs_threads));
        if (!qa || !wacc) {
            free(qa), free(wacc), free(pairs);
            return VS_ENOMEM;
        }
#pragma omp parallel for schedule(static) num_threads(vs_threads) /* tokens apart: 256 x 1536 over 128 tokens 1.25x */
        for (int64_t i = 0; i < nwide; i++)
            for (int64_t c = 0; c < cols / K; c++)
                memcpy(qa + ((i / AMX_TOKENS) * (cols / K) + c) * AMX_TOKENS * K + (i % AMX_TOKENS) * K, q + i * cols + c * K,
                       (size_t)K);
    }
#pragma omp parallel num_threads(vs_threads)
    {
        token_t tok[AMX_TOKENS];
        float spill[AMX_TOKENS][GROUP];
        int configured = -1; /* this thread's tile shape (another library may have changed it between calls) */
#ifdef _OPENMP
        float(*acc)[GROUP] = nwide ? (float(*)[GROUP])(wacc + (size_t)omp_get_thread_num() * GROUP * (size_t)nwide) : NULL;
#else
        float(*acc)[GROUP] = (float(*)[GROUP])wacc;
#endif
        /* guided: a thread the OS parks for a while leaves its groups to the others (a group's result does not
         * depend on which thread computes it), and the chunks shrink towards the end, so the threads finish
         * together: fixed chunks of 8 groups left one thread a whole chunk (up to 27 us on a 8960-column matrix)
         * after the other had stopped, 6% of a one-token pass's matmuls on a 2-core Xeon */
#pragma omp for schedule(guided, 2)
        for (int64_t g = 0; g < ngroups; g++) {
            const uint8_t *grp = packed + g * nsb * SB;
            int full = (g + 1) * GROUP <= rows;
            /* but on AMX, tiles of equal size within one token: on AVX2 (tiles of 4) 5 tokens are 2 + 3, not 4 + 1
             * (a whole unpacking of the weights for one token) */
            const int64_t ntiles = (n + tile - 1) / tile;
            if (nwide) {
                if (path == PATH_AMX_EMULATED)
                    group_wide_amx_emulated(&L, grp, nsb, qa, d, bsum, pairs, nwide / AMX_TOKENS, cols, acc, &configured);
#ifdef VS_X86
                else
                    group_wide_amx(&L, grp, nsb, qa, d, bsum, pairs, nwide / AMX_TOKENS, cols, acc, &configured);
#endif
                for (int64_t i = 0; i < nwide; i++)
                    memcpy(out + i * rows + g * GROUP, acc[i], sizeof(float) * (size_t)(full ? GROUP : rows - g * GROUP));
            }
            for (int64_t k = nwide / tile, t0 = nwide; k < ntiles; k++, t0 += tile) {
                if (!amx) t0 = n * k / ntiles;
                int T = (int)(amx ? (n - t0 < tile ? n - t0 : tile) : n * (k + 1) / ntiles - t0);
                for (int t = 0; t < T; t++) {
                    int64_t i = t0 + t;
                    tok[t] = (token_t){q + i * cols, d + i * (cols / L.q), bsum + i * (cols / 16),
                                       full ? out + i * rows + g * GROUP : spill[t], pairs ? pairs + AMX_PAIRS * i * nsb : NULL};
                }
                if (path == PATH_AMX_EMULATED && L.scsub == 16) group_units_amx_emulated(&L, grp, nsb, tok, T, cols, &configured);
                else if (path == PATH_AMX_EMULATED) group_amx_emulated(&L, grp, nsb, tok, T, cols, &configured);
#ifdef VS_X86
                else if (path == PATH_AMX && T >= amx_min && L.scsub == 16) group_units_amx(&L, grp, nsb, tok, T, cols, &configured);
                else if (path == PATH_AMX && T >= amx_min) group_amx(&L, grp, nsb, tok, T, cols, &configured);
                else if (path == PATH_AMX) { /* the last tokens, too few for the tiles: the AVX-512 kernel's tiles, split
                                              * evenly as on its own path */
                    const int parts = (T + vs_avx512_tile() - 1) / vs_avx512_tile();
                    for (int p = 0; p < parts; p++)
                        group_avx512(type, grp, nsb, tok + T * p / parts, T * (p + 1) / parts - T * p / parts);
                }
                else if (path == PATH_AVX512) group_avx512(type, grp, nsb, tok, T);
                else if (path == PATH_AVX2) group_avx2(type, grp, nsb, tok, T);
#endif
                else
                    group_generic(&L, grp, nsb, tok, T);
                if (!full)
                    for (int t = 0; t < T; t++)
                        memcpy(out + (t0 + t) * rows + g * GROUP, spill[t], sizeof(float) * (size_t)(rows - g * GROUP));
            }
        }
    }
    free(qa);
    free(wacc);
    free(pairs);
    (void)path;
    return 0;
}

int vs_matmul(int type, const uint8_t *packed, int64_t rows, int64_t cols, int64_t n, const int8_t *q, const float *d,
              const int32_t *bsum, float *out) {
    double t0 = profile_now();
    int status = matmul_quantized(type, packed, rows, cols, n, q, d, bsum, out);
    profile_add(vs_in_layer ? PROFILE_TYPES + type : PROFILE_OUTSIDE, t0);
    return status;
}

/* ------------------------------------------------------------------ float helpers (one fixed order) */

/* sum_i a[i] b[i] in 16 lanes (lane l takes i = l mod 16), then a fixed halving tree. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static float dot16(const float *a, const float *b, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int l = 0; i + l < n; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

static void to_float_row(int type, const uint8_t *src, int64_t cols, float *dst) {
    if (type == T_F32) memcpy(dst, src, sizeof(float) * (size_t)cols);
    else if (type == T_F16) for (int64_t k = 0; k < cols; k++) dst[k] = half_to_float(rd16(src + 2 * k));
    else for (int64_t k = 0; k < cols; k++) dst[k] = bf16_to_float(rd16(src + 2 * k));
}

/* out (n, rows) = x (n, cols) W^T for float weights (F32 / F16 / BF16, GGUF's row-major layout). */
static int matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t n, const float *x, float *out) {
    if (type != T_F32 && type != T_F16 && type != T_BF16) return VS_EINVAL;
    if (rows < 0 || cols <= 0 || n < 0) return VS_EINVAL;
    const int64_t row_bytes = cols * (type == T_F32 ? 4 : 2);
    int failed = 0;
#pragma omp parallel num_threads(vs_threads)
    {
        float *row = malloc(sizeof(float) * (size_t)cols);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue; /* every thread still reaches the loop's barrier */
            to_float_row(type, w + r * row_bytes, cols, row);
            for (int64_t i = 0; i < n; i++) out[i * rows + r] = dot16(row, x + i * cols, cols);
        }
        free(row);
    }
    return failed ? VS_ENOMEM : VS_OK;
}

int vs_matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t n, const float *x, float *out) {
    double t0 = profile_now();
    int status = matmul_float(type, w, rows, cols, n, x, out);
    profile_add(vs_in_layer ? PROFILE_FLOAT : PROFILE_OUTSIDE, t0);
    return status;
}

int vs_float_rows(int type, const uint8_t *w, int64_t rows, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    if ((type != T_F32 && type != T_F16 && type != T_BF16) || cols < 0) return VS_EINVAL;
    const int64_t row_bytes = cols * (type == T_F32 ? 4 : 2);
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= rows) return VS_ERANGE;
        to_float_row(type, w + ids[i] * row_bytes, cols, out + i * cols);
    }
    return 0;
}

/* ------------------------------------------------------------------ per-row ops */

/* out = x / sqrt(mean(x^2) + eps) * w, row by row. */
void vs_rmsnorm(const float *x, int64_t n, int64_t e, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * e;
        float mean = dot16(xi, xi, e) / (float)e;
        float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t k = 0; k < e; k++) out[i * e + k] = (xi[k] * scale) * w[k];
    }
}

/* RoPE's cos / sin per position: table (n, dim/2, 2) for pair j at pos[i]: angle = pos * theta^(-2j/dim),
 * computed in double once per pass (every layer, q and k use it). */
void vs_rope_table(const int64_t *pos, int64_t n, int dim, double theta, const float *factors, float *table) {
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < dim / 2; j++) {
            /* factors (dim / 2, or NULL: all 1): pair j's frequency divided by factors[j] (Llama 3's scaling, which
             * its GGUF files carry as the tensor rope_freqs.weight, as llama.cpp applies it) */
            double angle = (double)pos[i] * pow(theta, -2.0 * j / dim) / (factors ? (double)factors[j] : 1.0);
            table[(i * (dim / 2) + j) * 2] = (float)cos(angle);
            table[(i * (dim / 2) + j) * 2 + 1] = (float)sin(angle);
        }
}

/* Rotary embedding in place on x (n, heads, dim) with a vs_rope_table of `rot` dimensions: the first rot values of
 * each head turn in pairs (2j, 2j+1) ("norm", Llama GGUFs, whose Q and K rows llama.cpp's converter permuted) or
 * (j, j + rot/2) ("neox", Qwen2); the others are left as they are (partial RoPE, Phi-4-mini's: rot < dim). */
void vs_rope(float *x, int64_t n, int heads, int dim, int rot, const float *table, int neox) {
    const int half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = table + i * half * 2;
        for (int h = 0; h < heads; h++) {
            float *v = x + (i * heads + h) * dim;
            for (int j = 0; j < half; j++) {
                int a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
                float c = cs[2 * j], sn = cs[2 * j + 1], x0 = v[a], x1 = v[b];
                v[a] = x0 * c - x1 * sn;
                v[b] = x0 * sn + x1 * c;
            }
        }
    }
}

/* o += s * v (elementwise fmaf: the same bits scalar or vectorized). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static void axpy(float *o, float s, const float *v, int64_t n) {
    for (int64_t k = 0; k < n; k++) o[k] = fmaf(s, v[k], o[k]);
}

/* out = silu(g) * u, elementwise. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void vs_silu_mul(const float *g, const float *u, int64_t n, float *out) {
    /* elementwise, so split over the threads when a pass has more than a token's worth (an element's bits are the
       same in any chunk: -ffp-contract=off) */
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n >= 16384)
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + vs_exp(-g[i])) * u[i];
}

/* GeGLU as llama.cpp's CPU backend computes it (ggml_vec_geglu_f32 with GGML_GELU_FP16): the gate rounded to half, its
 * tanh-approximated GELU taken from a table of halves (the float formula rounded to half), times up; 0 at and below
 * -10, the gate itself at and above 10. Gemma's feed-forward. */
static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * (1.0f + 0.044715f * x * x)));
}

/* The bits of a float that is a half's value (round_to_half's result, |x| < 65520): sign, 5-bit exponent, 10 bits. */
static uint16_t half_bits(float h) {
    uint32_t f;
    memcpy(&f, &h, 4);
    const uint16_t sign = (uint16_t)((f >> 16) & 0x8000);
    const float a = fabsf(h);
    if (a < 6.103515625e-05f) return sign | (uint16_t)(a * 16777216.0f); /* subnormal: a multiple of 2^-24 */
    return sign | (uint16_t)(((((f >> 23) & 0xFF) - 112) << 10) | ((f >> 13) & 0x3FF));
}

/* half(gelu(h)) for every half h, as ggml's table: a pass's GeGLU then costs a lookup, not a tanhf, per value */
static float gelu_table[65536];
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;
static void gelu_fill(void) {
    for (int i = 0; i < 65536; i++) gelu_table[i] = round_to_half(gelu_tanh(half_to_float((uint16_t)i)));
}

void vs_gelu_mul(const float *g, const float *u, int64_t n, float *out) {
    pthread_once(&gelu_once, gelu_fill);
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n >= 16384)
    for (int64_t i = 0; i < n; i++)
        out[i] = g[i] <= -10.0f ? 0.0f : g[i] >= 10.0f ? g[i] * u[i] : gelu_table[half_bits(round_to_half(g[i]))] * u[i];
}

/* score[j] = e^(score[j] - top); returns their sum, in 16 lanes then a halving tree (one fixed order). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
/* Gemma 2's attention soft-cap on a head's scores, in place: cap tanh(s / cap), as llama.cpp takes it (a product
 * by the float 1 / cap, tanhf, a product by cap); 0: none. Elementwise, so every path and batch gives the same bits. */
static void soft_cap(float *score, int64_t m, float cap) {
    if (cap == 0.0f) return;
    const float inv = 1.0f / cap;
    for (int64_t j = 0; j < m; j++) score[j] = tanhf(score[j] * inv) * cap;
}

/* e^(s - top) in place and their sum in 16 lanes (lane l takes j = l mod 16), then a fixed halving tree. Cloned per
 * CPU like silu: vs_exp is the same float operations in a vector lane as in scalar code (-ffp-contract=off), and the
 * lanes are the sum's own, so the bits do not depend on the build's vector width (2^24 inputs, NaNs and infinities
 * among them, gave the same bits scalar at -O0 and in 512-bit lanes). Compiled for baseline x86-64 it was a fifth
 * of attention's samples while a 1,500-token prompt was read; a one-token pass's attention over 200 cached tokens
 * 1.4 -> 1.1-1.2 ms on a 2-core Xeon (over 1,500, where the cache's reading sets the pace, no clear change). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static float exp_and_sum(float *score, int64_t m, float top) {
    float lane[16] = {0};
    for (int64_t j = 0; j < m; j++) score[j] = vs_exp(score[j] - top);
    int64_t j = 0;
    for (; j + 16 <= m; j += 16)
        for (int l = 0; l < 16; l++) lane[l] += score[j + l];
    for (int l = 0; j + l < m; l++) lane[l] += score[j + l];
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* One query's attention for the G query heads that share one key/value head (grouped-query attention).
 * qg (G, dim); K, V: that head's first key / value, column c at + c * stride; cols (m): the attended
 * columns in order; score (G, m) scratch; og (G, dim) out. Per head: score_j = dot16(q, k_j) * scale, then
 * e^(score - max) and their sum (exp_and_sum), then o = sum_j p_j v_j in column order (fmaf), o / total. */
static void attend_group_generic(const float *qg, int G, int dim, const float *K, const float *V, int64_t stride,
                                 const int32_t *cols, int64_t m, float scale, float cap, float *score, float *og) {
    for (int g = 0; g < G; g++) {
        float *sg = score + g * m, top = -INFINITY;
        for (int64_t j = 0; j < m; j++) sg[j] = dot16(qg + g * dim, K + cols[j] * stride, dim) * scale;
        soft_cap(sg, m, cap);
        for (int64_t j = 0; j < m; j++) top = sg[j] > top ? sg[j] : top;
        float total = exp_and_sum(sg, m, top);
        float *o = og + g * dim;
        for (int k = 0; k < dim; k++) o[k] = 0.0f;
        for (int64_t j = 0; j < m; j++) axpy(o, sg[j], V + cols[j] * stride, dim);
        for (int k = 0; k < dim; k++) o[k] = o[k] / total;
    }
}

#ifdef VS_X86
/* Columns whose keys (to L1) and values (to L2) are prefetched before a head's scores start. A head's columns lie
 * one after another (the runner's caches are head-major) and the hardware prefetcher streams the rest. The kernel
 * also prefetched 16 columns ahead inside the loop while a column held every head; there that stalled on its own
 * prefetches (a third of the scores' samples; 28 layers, 2 threads, caches cold, on a 2-core Xeon with AMX: 4,000
 * columns 17.7 ms with it, 14.2 without), and head-major it changed nothing (12.1 / 12.1 ms). A prefetch changes
 * no result. */
enum { ATTEND_AHEAD = 16 };

/* Sixteen columns' 16-lane dot products reduced at once, each exactly as _mm512_reduce_add_ps (and dot16) reduces
 * one: lane l + lane l+8, then + 4, + 2, + 1. Each round pairs the registers and adds their halves in one add
 * (the same two operands per sum: float addition commutes bit for bit); lane c of the result is a[c]'s sum.
 * Reducing each column alone cost ~8 shuffle-port operations a column; this costs ~3. */
VS_INLINE VS_AVX512 __m512 reduce16(const __m512 a[16]) {
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) /* b[i] = (a[2i]'s 8 sums | a[2i+1]'s 8) */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++) /* c[i]: 128-bit lane k holds column 4i + k's 4 sums */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++) /* d[i]: lane k holds 2 sums of column 8i + k, then 2 of column 8i + 4 + k */
        d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* element 4k + p holds column 4p + k: put column c at element c */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}

/* One head's scores over 16 columns: 16 independent chains of fused multiply-adds (one per column, in the
 * dimension's order, as dot16 runs them), then reduce16. */
VS_INLINE VS_AVX512 __m512 scores16(const float *qh, int dim, const float *K, int64_t stride, const int32_t *cols) {
    __m512 acc[16];
    const float *k[16];
    for (int c = 0; c < 16; c++) {
        acc[c] = _mm512_setzero_ps();
        k[c] = K + cols[c] * stride;
    }
    for (int d0 = 0; d0 < dim; d0 += 16) {
        __m512 qv = _mm512_loadu_ps(qh + d0);
        for (int c = 0; c < 16; c++) acc[c] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[c] + d0), acc[c]);
    }
    return reduce16(acc);
}

/* o[h][d] += sum_j p[h][j] v_j[d] over columns j0 .. j1-1, for NH heads and NC 16-float chunks of the dimension
 * from d0, in column order (one fused multiply-add per column and element, as axpy runs them); NH * NC chains in
 * registers, the running sums kept in og between blocks of columns (a float stored and loaded is the same float). */
VS_INLINE VS_AVX512 void weigh_values(const int NH, const int NC, const float *score, int64_t m, const float *V,
                                      int64_t stride, const int32_t *cols, int64_t j0, int64_t j1, int d0, int dim,
                                      float *og) {
    __m512 acc[24];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++)
            acc[h * NC + c] = j0 ? _mm512_loadu_ps(og + h * dim + d0 + 16 * c) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const float *v = V + cols[j] * stride + d0;
        for (int c = 0; c < NC; c++) {
            __m512 vc = _mm512_loadu_ps(v + 16 * c);
            for (int h = 0; h < NH; h++)
                acc[h * NC + c] = _mm512_fmadd_ps(_mm512_set1_ps(score[h * m + j]), vc, acc[h * NC + c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(og + h * dim + d0 + 16 * c, acc[h * NC + c]);
}

/* Columns whose values are weighed for every head before the next ones are read: 32 columns of a 128-float head
 * are 16 KB, which stay in the L1 cache while each head reads them. */
enum { WEIGH_BLOCK = 32 };

/* A prefetch of columns a .. b-1's keys (to L1) and values (to L2, read after the scores). */
VS_INLINE VS_AVX512 void prefetch_columns(const float *K, const float *V, int64_t stride, const int32_t *cols, int64_t a,
                                          int64_t b, int dim) {
    for (; a < b; a++) {
        const char *kp = (const char *)(K + cols[a] * stride), *vp = (const char *)(V + cols[a] * stride);
        for (int o = 0; o < dim * (int)sizeof(float); o += 64) {
            _mm_prefetch(kp + o, _MM_HINT_T0);
            _mm_prefetch(vp + o, _MM_HINT_T1);
        }
    }
}

/* One query's G heads' scores over its columns j0 .. j1-1 (j0 a multiple of 16): whole blocks of 16 by scores16,
 * the rest one by one with _mm512_reduce_add_ps, which halves as dot16 does. score (G, m). */
static VS_AVX512 void score_columns(const float *qg, int G, int dim, const float *K, int64_t stride,
                                    const int32_t *cols, int64_t m, int64_t j0, int64_t j1, float scale, float *score) {
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16) {
        for (int g = 0; g < G; g++)
            _mm512_storeu_ps(score + g * m + j, _mm512_mul_ps(scores16(qg + g * dim, dim, K, stride, cols + j), _mm512_set1_ps(scale)));
    }
    for (; j < j1; j++) {
        const float *k = K + cols[j] * stride;
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d0 = 0; d0 < dim; d0 += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + g * dim + d0), _mm512_loadu_ps(k + d0), acc);
            score[g * m + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/* One query's G heads' weighed sums over columns j0 .. j1-1 added to og (zeros first where j0 is 0): short heads
 * 8 / chunks side by side (chunks 1, 2 or 4); heads of 8 chunks or a multiple (128, 256 floats) three or two at a
 * time, 8 chunks of each, so that a value vector loaded once serves them all (6 query heads a key/value head, 1,500
 * columns, caches cold: 4.8 -> 4.4 ms over 28 layers with three at a time, 4.6 with two, on a 2-core Xeon); the
 * rest alone in chunks of 8, 4 and 1. Each (head, chunk) sum runs over the columns in order whatever its company. */
static VS_AVX512 void weigh_columns(int G, int dim, const float *V, int64_t stride, const int32_t *cols, int64_t m,
                                    int64_t j0, int64_t j1, const float *score, float *og) {
    const int chunks = dim / 16;
    const int NH = chunks == 1 ? 8 : chunks == 2 ? 4 : chunks == 4 ? 2 : 1;
    int g = 0;
    for (; NH > 1 && g + NH <= G; g += NH) {
        const float *s = score + g * m;
        float *o = og + g * dim;
        if (chunks == 1) weigh_values(8, 1, s, m, V, stride, cols, j0, j1, 0, dim, o);
        else if (chunks == 2) weigh_values(4, 2, s, m, V, stride, cols, j0, j1, 0, dim, o);
        else weigh_values(2, 4, s, m, V, stride, cols, j0, j1, 0, dim, o);
    }
    if (chunks % 8 == 0) {
        const int most = G % 3 == 0 ? 3 : 2;
        for (; g + most <= G; g += most)
            for (int d0 = 0; d0 < dim; d0 += 128) {
                if (most == 3) weigh_values(3, 8, score + g * m, m, V, stride, cols, j0, j1, d0, dim, og + g * dim);
                else weigh_values(2, 8, score + g * m, m, V, stride, cols, j0, j1, d0, dim, og + g * dim);
            }
    }
    for (; g < G; g++) {
        int d0 = 0;
        for (; d0 + 128 <= dim; d0 += 128) weigh_values(1, 8, score + g * m, m, V, stride, cols, j0, j1, d0, dim, og + g * dim);
        for (; d0 + 64 <= dim; d0 += 64) weigh_values(1, 4, score + g * m, m, V, stride, cols, j0, j1, d0, dim, og + g * dim);
        for (; d0 < dim; d0 += 16) weigh_values(1, 1, score + g * m, m, V, stride, cols, j0, j1, d0, dim, og + g * dim);
    }
}

/* e^(score - max) and the sums of one query's G heads (the maximum in 16 lanes: a maximum is the same whatever
 * the order, and with a NaN among the scores the sum is NaN whatever the maximum, as in the generic path). */
static VS_AVX512 void softmax_heads(int G, int64_t m, float *score, float *total, float cap) {
    for (int g = 0; g < G; g++) {
        float *sg = score + g * m;
        soft_cap(sg, m, cap);
        __m512 most = _mm512_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 16 <= m; i += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(sg + i));
        float top = _mm512_reduce_max_ps(most);
        for (; i < m; i++) top = sg[i] > top ? sg[i] : top;
        total[g] = exp_and_sum(sg, m, top);
    }
}

/* The same operations as attend_group_generic in 512-bit registers (dim a multiple of 16), for nq queries of one
 * key/value head whose first `shared` columns are the same (a row's chain queries share its cache's prefix): each
 * block of those columns' keys and values is read once from memory for all the queries, which then go on alone
 * over their own columns. A query's scores, softmax and weighed sum are the same operations in the same order
 * whatever queries share its call. q[i] (G, dim), cols[i] (m[i]), score[i] (G, m[i]) and total (nq, G) scratch,
 * og[i] (G, dim) out. */
static VS_AVX512 void attend_queries_avx512(int nq, const float *const *q, int G, int dim, const float *K,
                                            const float *V, int64_t stride, int32_t *const *cols, const int64_t *m,
                                            int64_t shared, float scale, float cap, float *const *score,
                                            float *total, float *const *og) {
    prefetch_columns(K, V, stride, cols[0], 0, m[0] < ATTEND_AHEAD ? m[0] : ATTEND_AHEAD, dim);
    const int64_t scored = shared / 16 * 16, weighed = shared / WEIGH_BLOCK * WEIGH_BLOCK;
    for (int64_t j = 0; j < scored; j += 16)
        for (int i = 0; i < nq; i++)
            score_columns(q[i], G, dim, K, stride, cols[i], m[i], j, j + 16, scale, score[i]);
    for (int i = 0; i < nq; i++) {
        score_columns(q[i], G, dim, K, stride, cols[i], m[i], scored, m[i], scale, score[i]);
        softmax_heads(G, m[i], score[i], total + i * G, cap);
    }
    for (int64_t j = 0; j < weighed; j += WEIGH_BLOCK)
        for (int i = 0; i < nq; i++) weigh_columns(G, dim, V, stride, cols[i], m[i], j, j + WEIGH_BLOCK, score[i], og[i]);
    for (int i = 0; i < nq; i++) {
        if (m[i] == 0) /* no column: 0 / 0, as the generic path gives */
            for (int k = 0; k < G * dim; k++) og[i][k] = 0.0f;
        for (int64_t j = weighed; j < m[i]; j += WEIGH_BLOCK)
            weigh_columns(G, dim, V, stride, cols[i], m[i], j, j + WEIGH_BLOCK < m[i] ? j + WEIGH_BLOCK : m[i], score[i], og[i]);
        for (int g = 0; g < G; g++)
            for (int d0 = 0; d0 < dim; d0 += 16)
                _mm512_storeu_ps(og[i] + g * dim + d0, _mm512_div_ps(_mm512_loadu_ps(og[i] + g * dim + d0), _mm512_set1_ps(total[i * G + g])));
    }
}
#endif

/* Attention of n queries over their rows' caches.
 * q (n, hq, dim); for query i: key/value head h's key in cache column c at kbase[i] + h * head_stride[i] +
 * c * stride (floats), its value likewise from vbase[i]. It attends to columns 0 .. prefix[i]-1, then to the columns
 * extra[extra_off[i] .. extra_off[i+1]-1] (increasing). out (n, hq, dim).
 * Scores, softmax and the weighted sum run over the attended columns in order: a query's result is the
 * same whatever other queries the call has, and a tree node's equals the chain's over the same entries.
 * Work is split by key/value head and by runs of consecutive queries on one cache (at most `span` of them, fewer
 * where the threads would otherwise idle); the AVX-512 path reads a run's shared prefix once for all of it.
 * The runner's caches are head-major (stride dim, head_stride a row's capacity times dim), so a thread streams its
 * head's keys and values from contiguous memory; a column holding every head (stride hkv * dim, head_stride dim), as
 * the caches were laid out before, gives the same bits. There a thread read every other run of dim floats (2
 * key/value heads), which the hardware prefetcher streamed poorly: a one-token pass of the default target (2 threads,
 * a 2-core Xeon with AMX) spent 1.03 / 7.2 / 19.6 ms in attention over 200 / 1,500 / 4,000 cached tokens; head-major,
 * without the prefetches inside the loop and weighing heads three at a time, 0.91 / 5.6 / 13.35. */
int vs_attention_capped(const float *q, int64_t n, int hq, int hkv, int dim, float scale, const int64_t *kbase,
                        const int64_t *vbase, int64_t stride, const int64_t *head_stride, const int32_t *prefix,
                        const int32_t *extra_off, const int32_t *extra, float *out, float cap) {
    if (n < 0 || hq <= 0 || hkv <= 0 || hq % hkv || dim <= 0) return VS_EINVAL; /* G = hq / hkv below */
    if (n == 0) return VS_OK;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t c = prefix[i] + extra_off[i + 1] - extra_off[i];
        most = c > most ? c : most;
    }
    const int G = hq / hkv;
    const int simd = (vs_get_path() == PATH_AVX512 || vs_get_path() == PATH_AMX) && dim % 16 == 0 && G <= 64;
    enum { SPAN = 16 };
    int64_t span = 1;
    if (simd) {
        int64_t per_head = (vs_threads + hkv - 1) / hkv; /* runs wanted per head for every thread to have work */
        span = (n + per_head - 1) / per_head;
        span = span < 1 ? 1 : span > SPAN ? SPAN : span;
    }
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(n + 1)), runs = 0;
    if (!first) return VS_ENOMEM;
    for (int64_t i = 0; i < n; i++) /* a run starts at a new cache or where the last one is full */
        if (!runs || kbase[i] != kbase[i - 1] || vbase[i] != vbase[i - 1] || head_stride[i] != head_stride[i - 1] ||
            i - first[runs - 1] == span)
            first[runs++] = i;
    first[runs] = n;
    int failed = 0;
#pragma omp parallel num_threads(vs_threads) if (runs * hkv > 1)
    {
        float *score = malloc(sizeof(float) * (size_t)(span * G) * (size_t)(most + 1));
        int32_t *colbuf = malloc(sizeof(int32_t) * (size_t)span * (size_t)(most + 1));
        float *total = malloc(sizeof(float) * (size_t)(span * G));
        if (!score || !colbuf || !total) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t rh = 0; rh < runs * hkv; rh++) {
            if (!score || !colbuf || !total) continue; /* every thread still reaches the loop's barrier */
            const int64_t r = rh / hkv, i0 = first[r], nq = first[r + 1] - first[r];
            const int kvh = (int)(rh % hkv);
            const float *K = (const float *)(intptr_t)kbase[i0] + kvh * head_stride[i0];
            const float *V = (const float *)(intptr_t)vbase[i0] + kvh * head_stride[i0];
            const float *qs[SPAN];
            float *os[SPAN], *ss[SPAN];
            int32_t *cs[SPAN];
            int64_t ms[SPAN], shared = prefix[i0];
            for (int64_t t = 0; t < nq; t++) {
                const int64_t i = i0 + t;
                int32_t *cols = colbuf + t * (most + 1);
                int64_t m = 0;
                for (int32_t c = 0; c < prefix[i]; c++) cols[m++] = c;
                for (int32_t e = extra_off[i]; e < extra_off[i + 1]; e++) cols[m++] = extra[e];
                qs[t] = q + (i * hq + kvh * G) * dim;
                os[t] = out + (i * hq + kvh * G) * dim;
                ss[t] = score + t * G * (most + 1);
                cs[t] = cols;
                ms[t] = m;
                shared = prefix[i] < shared ? prefix[i] : shared;
            }
#ifdef VS_X86
            if (simd) attend_queries_avx512((int)nq, qs, G, dim, K, V, stride, cs, ms, shared, scale, cap, ss, total, os);
            else
#endif
                for (int64_t t = 0; t < nq; t++)
                    attend_group_generic(qs[t], G, dim, K, V, stride, cs[t], ms[t], scale, cap, ss[t], os[t]);
        }
        free(score);
        free(colbuf);
        free(total);
    }
    free(first);
    (void)simd;
    return failed ? VS_ENOMEM : VS_OK;
}

int vs_attention(const float *q, int64_t n, int hq, int hkv, int dim, float scale, const int64_t *kbase, const int64_t *vbase,
                 int64_t stride, const int64_t *head_stride, const int32_t *prefix, const int32_t *extra_off,
                 const int32_t *extra, float *out) {
    return vs_attention_capped(q, n, hq, hkv, dim, scale, kbase, vbase, stride, head_stride, prefix, extra_off, extra,
                               out, 0.0f);
}

/* ------------------------------------------------------------------ one whole layer */
/* A decoder layer in one call: the same kernels, in the same order, as the runner's per-op path
 * (NativeRunner(fused=False)), so the same bits; only ~20 Python-level calls a layer are saved (about
 * 3 ms of a 37 ms one-token pass for the 28-layer target). Structures mirror native.py's ctypes ones. */
typedef struct {
    int64_t qtype;
    const uint8_t *data; /* packed (quantized types) or the rows as stored (float types) */
    int64_t rows, cols;
} vs_weight_t;

typedef struct {
    const float *attn_norm, *ffn_norm, *q_bias, *k_bias, *v_bias; /* biases may be NULL; norms too (OLMo 2: no
                                                                       norm before a sublayer) */
    const float *q_norm, *k_norm; /* (head_dim,) RMSNorm of each query / key head before RoPE (Qwen3), or NULL */
    const float *attn_post_norm, *ffn_post_norm; /* (hidden,) RMSNorm of a sublayer's output before the residual add
                                                    (Gemma), or NULL */
    vs_weight_t q, k, v, out, gate, up, down;
} vs_layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, neox, gelu; /* gelu: GeGLU (vs_gelu_mul), else SwiGLU */
    int64_t whole_qk_norm; /* q_norm / k_norm RMS-norm each token's whole q / k (OLMo 2), not each head */
    int64_t rope_dim; /* RoPE turns the first rope_dim values of each head (even, <= head_dim) */
    double eps, scale; /* passed on as float, as the per-op path's ctypes floats are */
    double residual_scale; /* each sublayer's output times this before its residual add (Granite; 1 or 0: none, as
                              llama.cpp reads an unset scale) */
    double attn_softcap; /* scores soft-capped before the softmax (Gemma 2; 0: none) */
} vs_dims_t;

typedef struct {
    const float *x;
    int64_t n, k;
    int8_t *q[2];
    float *d[2];
    int32_t *bsum[2];
} act_t; /* an input and its int8 versions for activation blocks of 32 ([0]) and 256 ([1]) */

static int act_matmul(const vs_weight_t *w, act_t *a, float *out) {
    if (w->qtype == T_F32 || w->qtype == T_F16 || w->qtype == T_BF16)
        return vs_matmul_float((int)w->qtype, w->data, w->rows, w->cols, a->n, a->x, out);
    layout_t L;
    if (get_layout((int)w->qtype, &L)) return VS_EINVAL;
    int j = L.q == 32 ? 0 : 1;
    if (!a->q[j]) {
        a->q[j] = malloc((size_t)(a->n * a->k));
        a->d[j] = malloc(sizeof(float) * (size_t)(a->n * a->k / L.q));
        a->bsum[j] = malloc(sizeof(int32_t) * (size_t)(a->n * a->k / 16));
        if (!a->q[j] || !a->d[j] || !a->bsum[j]) {
            free(a->q[j]); free(a->d[j]); free(a->bsum[j]);
            a->q[j] = NULL; a->d[j] = NULL; a->bsum[j] = NULL;
            return VS_ENOMEM;
        }
        double t0 = profile_now();
        int status = vs_quantize_rows(a->x, a->n, a->k, L.q, a->q[j], a->d[j], a->bsum[j]);
        profile_add(PROFILE_QUANTIZE, t0);
        if (status) return status;
    }
    return vs_matmul((int)w->qtype, w->data, w->rows, w->cols, a->n, a->q[j], a->d[j], a->bsum[j], out);
}

static void act_free(act_t *a) { /* idempotent: the pointers are cleared */
    for (int j = 0; j < 2; j++) {
        free(a->q[j]); free(a->d[j]); free(a->bsum[j]);
        a->q[j] = NULL; a->d[j] = NULL; a->bsum[j] = NULL;
    }
}

void scale_rows(float *x, int64_t n, float s) { /* x *= s, one float32 product a value (as ggml_scale) */
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * s;
}

static void add_rows(float *y, const float *b, int64_t n, int64_t width) { /* y[i] += b, b one row or n rows */
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < width; j++) y[i * width + j] = y[i * width + j] + b[j];
}

/* x (n, hidden) in place; query i writes its key and value to column columns[i] of its row's cache and attends as
 * vs_attention says. A row's cache is head-major: layer l's keys at kbase0[i] + l * layer_bytes[i], kv_heads blocks
 * of layer_bytes[i] / kv_heads bytes, head h's column c at + h * that + c * stride floats (values likewise). */
static int layer_forward(const vs_dims_t *D, const vs_layer_t *L, float *x, int64_t n, const float *rope_table,
                         const int64_t *kbase0, const int64_t *vbase0, const int64_t *layer_bytes, int64_t layer,
                         int64_t stride, const int32_t *columns, const int32_t *prefix, const int32_t *extra_off,
                         const int32_t *extra, int32_t skip) {
    /* skip: bit 1 skips the attention sublayer (no keys or values written), bit 2 the MLP sublayer: the
       residual stream passes through unchanged (self-speculation's draft, verispec.drafters.self_draft). */
    if (!D || D->hidden <= 0 || D->heads <= 0 || D->kv_heads <= 0 || D->heads % D->kv_heads || D->head_dim <= 0 ||
        D->head_dim % 2 || D->ffn <= 0 || n < 0 || D->heads > INT32_MAX || D->head_dim > INT32_MAX ||
        D->rope_dim <= 0 || D->rope_dim % 2 || D->rope_dim > D->head_dim)
        return VS_EINVAL; /* the dimensions vs_attention and vs_rope divide by, checked once here */
    if (n == 0) return VS_OK;
    const int64_t E = D->hidden, QD = D->heads * D->head_dim, KD = D->kv_heads * D->head_dim, F = D->ffn;
    const float eps = (float)D->eps;
    int status = VS_OK;
    act_t a = {0}, a2 = {0}, a3 = {0}, a4 = {0};
    float *xn = malloc(sizeof(float) * (size_t)(n * E)), *q = malloc(sizeof(float) * (size_t)(n * QD));
    float *k = malloc(sizeof(float) * (size_t)(n * KD)), *v = malloc(sizeof(float) * (size_t)(n * KD));
    float *attn = malloc(sizeof(float) * (size_t)(n * QD)), *o = malloc(sizeof(float) * (size_t)(n * E));
    float *g = malloc(sizeof(float) * (size_t)(n * F)), *u = malloc(sizeof(float) * (size_t)(n * F));
    float *h = malloc(sizeof(float) * (size_t)(n * F));
    int64_t *kb = malloc(sizeof(int64_t) * (size_t)n), *vb = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *hs = malloc(sizeof(int64_t) * (size_t)n);
    if (!xn || !q || !k || !v || !attn || !o || !g || !u || !h || !kb || !vb || !hs) {
        status = VS_ENOMEM;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        kb[i] = kbase0[i] + layer * layer_bytes[i];
        vb[i] = vbase0[i] + layer * layer_bytes[i];
        hs[i] = layer_bytes[i] / (int64_t)sizeof(float) / D->kv_heads;
    }

    if (skip & 1) goto mlp;
    if (L->attn_norm) vs_rmsnorm(x, n, E, L->attn_norm, eps, xn);
    a = (act_t){L->attn_norm ? xn : x, n, E, {0}, {0}, {0}};
    if ((status = act_matmul(&L->q, &a, q)) || (status = act_matmul(&L->k, &a, k)) || (status = act_matmul(&L->v, &a, v)))
        goto done;
    act_free(&a);
    if (L->q_bias) add_rows(q, L->q_bias, n, QD);
    if (L->k_bias) add_rows(k, L->k_bias, n, KD);
    if (L->v_bias) add_rows(v, L->v_bias, n, KD);
    if (L->q_norm) /* in place: a row's scale first */
        vs_rmsnorm(q, D->whole_qk_norm ? n : n * D->heads, D->whole_qk_norm ? QD : D->head_dim, L->q_norm, eps, q);
    if (L->k_norm) vs_rmsnorm(k, D->whole_qk_norm ? n : n * D->kv_heads, D->whole_qk_norm ? KD : D->head_dim, L->k_norm, eps, k);
    if (rope_table) { /* NULL: a layer without RoPE (SmolLM3's every fourth) */
        vs_rope(q, n, (int)D->heads, (int)D->head_dim, (int)D->rope_dim, rope_table, (int)D->neox);
        vs_rope(k, n, (int)D->kv_heads, (int)D->head_dim, (int)D->rope_dim, rope_table, (int)D->neox);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t kvh = 0; kvh < D->kv_heads; kvh++) {
            const int64_t at = kvh * hs[i] + columns[i] * stride;
            memcpy((float *)(intptr_t)kb[i] + at, k + i * KD + kvh * D->head_dim, sizeof(float) * (size_t)D->head_dim);
            memcpy((float *)(intptr_t)vb[i] + at, v + i * KD + kvh * D->head_dim, sizeof(float) * (size_t)D->head_dim);
        }
    double t_attention = profile_now();
    status = vs_attention_capped(q, n, (int)D->heads, (int)D->kv_heads, (int)D->head_dim, (float)D->scale, kb, vb, stride,
                                 hs, prefix, extra_off, extra, attn, (float)D->attn_softcap);
    profile_add(PROFILE_ATTENTION, t_attention);
    if (status) goto done;
    a2 = (act_t){attn, n, QD, {0}, {0}, {0}};
    if ((status = act_matmul(&L->out, &a2, o))) goto done;
    act_free(&a2);
    if (L->attn_post_norm) vs_rmsnorm(o, n, E, L->attn_post_norm, eps, o);
    if (D->residual_scale != 1.0 && D->residual_scale != 0.0) scale_rows(o, n * E, (float)D->residual_scale);
    for (int64_t i = 0; i < n * E; i++) x[i] = x[i] + o[i];

mlp:
    if (skip & 2) goto done;
    if (L->ffn_norm) vs_rmsnorm(x, n, E, L->ffn_norm, eps, xn);
    a3 = (act_t){L->ffn_norm ? xn : x, n, E, {0}, {0}, {0}};
    if ((status = act_matmul(&L->gate, &a3, g)) || (status = act_matmul(&L->up, &a3, u))) goto done;
    act_free(&a3);
    if (D->gelu) vs_gelu_mul(g, u, n * F, h);
    else vs_silu_mul(g, u, n * F, h);
    a4 = (act_t){h, n, F, {0}, {0}, {0}};
    if ((status = act_matmul(&L->down, &a4, o))) goto done;
    act_free(&a4);
    if (L->ffn_post_norm) vs_rmsnorm(o, n, E, L->ffn_post_norm, eps, o);
    if (D->residual_scale != 1.0 && D->residual_scale != 0.0) scale_rows(o, n * E, (float)D->residual_scale);
    for (int64_t i = 0; i < n * E; i++) x[i] = x[i] + o[i];

done:
    act_free(&a); act_free(&a2); act_free(&a3); act_free(&a4);
    free(xn); free(q); free(k); free(v); free(attn); free(o); free(g); free(u); free(h); free(kb); free(vb); free(hs);
    return status;
}

int vs_layer_forward(const vs_dims_t *D, const vs_layer_t *L, float *x, int64_t n, const float *rope_table,
                     const int64_t *kbase0, const int64_t *vbase0, const int64_t *layer_bytes, int64_t layer,
                     int64_t stride, const int32_t *columns, const int32_t *prefix, const int32_t *extra_off,
                     const int32_t *extra, int32_t skip) {
    double t0 = profile_now();
    vs_in_layer = 1;
    int status = layer_forward(D, L, x, n, rope_table, kbase0, vbase0, layer_bytes, layer, stride, columns, prefix,
                               extra_off, extra, skip);
    vs_in_layer = 0;
    profile_add(PROFILE_LAYER, t0);
    return status;
}

/* A mixture of experts' feed-forward (Qwen3's MoE, Mixtral) once the tokens are routed: x (n, hidden) the normed
 * inputs, token i's j-th pick picks[i * used + j] (an expert below `experts`, distinct within a token) weighted by
 * weights[i * used + j]; out (n, hidden) = sum over j, in pick order from 0.0f, of weight * down(silu(gate(x_i)) *
 * up(x_i)) of that expert (gate[e], up[e] (width, hidden), down[e] (hidden, width)). Each picked expert runs once over
 * the tokens that picked it (in increasing order), with the same kernels, activations quantized per row, as the per-op
 * path (verispec.models.gguf.experts.experts_reference), so a token's bits are its own in any pass. The threads take
 * whole experts (an expert's matrices are small: split over the threads in turn, each matrix's stream was too short
 * to keep both pulling memory); the kernels inside run on the one thread that took the expert (a nested parallel
 * region is a team of one), and a row's bits do not depend on the thread that computes it. One call a layer instead
 * of six a picked expert from Python. */
int vs_moe_ffn(const vs_weight_t *gate, const vs_weight_t *up, const vs_weight_t *down, int64_t experts, int64_t width,
               const float *x, int64_t n, int64_t hidden, int64_t used, const int32_t *picks, const float *weights,
               float *out) {
    if (experts <= 0 || width <= 0 || hidden <= 0 || n < 0 || used <= 0 || used > experts) return VS_EINVAL;
    for (int64_t i = 0; i < n * used; i++)
        if (picks[i] < 0 || picks[i] >= experts) return VS_ERANGE;
    if (n == 0) return VS_OK;
    int status = VS_OK;
    float *ys = malloc(sizeof(float) * (size_t)(n * used * hidden)); /* (n, used, hidden): each pick's output */
    int64_t *count = calloc((size_t)experts, sizeof(int64_t)), *picked = malloc(sizeof(int64_t) * (size_t)experts);
    if (!ys || !count || !picked) {
        free(ys); free(count); free(picked);
        return VS_ENOMEM;
    }
    int64_t npicked = 0; /* the experts any token picked, in increasing order */
    for (int64_t i = 0; i < n * used; i++) count[picks[i]]++;
    for (int64_t e = 0; e < experts; e++)
        if (count[e]) picked[npicked++] = e;
#pragma omp parallel num_threads(vs_threads) if (npicked > 1)
    {
        act_t a = {0}, a2 = {0};
        float *xs = malloc(sizeof(float) * (size_t)(n * hidden)), *g = malloc(sizeof(float) * (size_t)(n * width));
        float *u = malloc(sizeof(float) * (size_t)(n * width)), *h = malloc(sizeof(float) * (size_t)(n * width));
        float *y = malloc(sizeof(float) * (size_t)(n * hidden));
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)n); /* the tokens that picked the expert: their pick's index */
        int mine = (xs && g && u && h && y && slot) ? VS_OK : VS_ENOMEM;
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < npicked; p++) {
            if (mine) continue;
            const int64_t e = picked[p];
            int64_t m = 0;
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < used; j++)
                    if (picks[i * used + j] == e) {
                        memcpy(xs + m * hidden, x + i * hidden, sizeof(float) * (size_t)hidden);
                        slot[m++] = i * used + j;
                    }
            a = (act_t){xs, m, hidden, {0}, {0}, {0}};
            if ((mine = act_matmul(&gate[e], &a, g)) || (mine = act_matmul(&up[e], &a, u))) continue;
            act_free(&a);
            vs_silu_mul(g, u, m * width, h);
            a2 = (act_t){h, m, width, {0}, {0}, {0}};
            if ((mine = act_matmul(&down[e], &a2, y))) continue;
            act_free(&a2);
            for (int64_t r = 0; r < m; r++) memcpy(ys + slot[r] * hidden, y + r * hidden, sizeof(float) * (size_t)hidden);
        }
        if (mine) {
#pragma omp critical
            status = mine;
        }
        act_free(&a); act_free(&a2);
        free(xs); free(g); free(u); free(h); free(y); free(slot);
    }
    if (status == VS_OK)
        for (int64_t i = 0; i < n; i++) {
            float *o = out + i * hidden;
            for (int64_t k = 0; k < hidden; k++) o[k] = 0.0f;
            for (int64_t j = 0; j < used; j++) {
                const float w = weights[i * used + j], *v = ys + (i * used + j) * hidden;
                for (int64_t k = 0; k < hidden; k++) o[k] = o[k] + v[k] * w;
            }
        }
    free(ys); free(count); free(picked);
    return status;
}
