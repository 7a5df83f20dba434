/* One part of kernels.c, which includes the parts in order as one translation unit (see there). Which kernel path
 * runs (the CPU's features, or the one a test forces), the threads, the AVX-512 tile height,
 * and the profile of where a pass's time goes. */

/* ------------------------------------------------------------------ CPU features and path */

/* The compiler can build the AVX-VNNI kernel (the avxvnni target: GCC 11, Clang 12); an older one leaves the path out. */
#if defined(VS_X86) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define VS_HAVE_AVXVNNI 1
#else
#define VS_HAVE_AVXVNNI 0
#endif

static int vs_path = -1;
static int vs_threads = 1;

int vs_cpu_features(void) {
    /* bit 0 avx2, 1 fma, 2 avx512f, 3 avx512bw, 4 avx512vl, 5 avx512vnni, 6 f16c, 7 amx-tile, 8 amx-int8, 9 avx-vnni */
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
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f |= a >> 4 & 1 ? 512 : 0;
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
    if (path == PATH_AVX_VNNI) return VS_HAVE_AVXVNNI && (f & 0x243) == 0x243; /* and avx-vnni */
    if (path == PATH_AMX) return vs_amx_status() == 0;
    return path == PATH_GENERIC || path == PATH_AMX_EMULATED;
}

static int best_path(void) {
    return path_supported(PATH_AMX) ? PATH_AMX : path_supported(PATH_AVX512) ? PATH_AVX512
         : path_supported(PATH_AVX_VNNI) ? PATH_AVX_VNNI : path_supported(PATH_AVX2) ? PATH_AVX2 : PATH_GENERIC;
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

/* The AVX-512 kernel's widest tile: 16 (native runners set the one measured on their machine, tiles.py). A tile past
 * 8 spills its sums, but a token's spilled sum costs a load and a store a sub-block, where a second tile unpacks every
 * weight again: on a 2-core Xeon with AMX (family 6 model 167) a pass's matmuls over 9 tokens took 82.5 ms in tiles of
 * 4 + 5 and 64.6 ms as one tile of 9 (8 tokens: 61.6), 10 tokens 82.8 -> 67.4, 12 tokens 94.4 -> 77.5, 14 tokens
 * 96.5 -> 85.9, 1 to 8 tokens alike (`benchmarks/kernel_rates.py --against`, taking turns). AMD had 6 (a Zen 4 with
 * earlier kernels measured 8 slower than 4 + 4); with today's the same Zen 4 (family 25 model 17) streams a pass's
 * matmuls over 7, 8, 9 tokens in 42.4, 46.6, 53.4 ms as one tile against 47.8, 52.3, 58.7 in tiles of up to 6, and
 * no width slower (`kernel_rates.py --tiles 6,16`). vs_set_avx512_tile forces one (tests run several), 0 restores
 * 16; returns the tile in force. */
static int vs_tile512 = 0;

int vs_avx512_tile(void) { return vs_tile512 ? vs_tile512 : TILE_AVX512; }

int vs_set_avx512_tile(int tile) {
    vs_tile512 = tile <= 0 ? 0 : tile < TILE_AVX512 ? tile : TILE_AVX512;
    return vs_avx512_tile();
}

/* The AVX2 kernel's widest tile (either copy): TILE_AVX2 unless set (1 to TILE_AVX2; 0 restores it). Native runners
 * set the tiles measured on their machine (verispec/models/gguf/tiles.py): the kernels' own choices were measured on
 * a few CPUs only. Returns the tile in force. */
static int vs_tile256 = TILE_AVX2;

int vs_avx2_tile(void) { return vs_tile256; }

int vs_set_avx2_tile(int tile) {
    vs_tile256 = tile <= 0 ? TILE_AVX2 : tile < TILE_AVX2 ? tile : TILE_AVX2;
    return vs_tile256;
}

/* Whether the AVX-512 kernel's one-token tiles ask for their weights ahead (prefetch_share, matmul_avx512.h; wider
 * tiles always do). Off on AMD: there the one-token tile, which does the least arithmetic a byte, streamed faster on
 * the hardware prefetchers alone (a 2-core Zen 4, family 25 model 17: a pass's matmuls over one token 31.2 ms against
 * 34.1, medians of six rounds taking turns, every round faster; with the prefetches off at every width four tokens
 * took 44 ms against 30); on Intel the one-token tile needs them (a 2-core Xeon streamed 15.4 GB/s without, 22.8
 * with). vs_set_prefetch_one forces it (1 on, 0 off; -1 restores the CPU's default) and returns the setting in force;
 * `kernel_rates.py --prefetch-one on,off` times both on a machine. A prefetch changes no result. */
static int vs_prefetch_one = -1;

static int prefetch_one_default(void) {
#ifdef VS_X86
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) return !(b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u); /* "AuthenticAMD" */
#endif
    return 1;
}

int vs_set_prefetch_one(int on) {
    vs_prefetch_one = on < 0 ? prefetch_one_default() : on > 0;
    return vs_prefetch_one;
}

static int prefetch_one(void) { return vs_prefetch_one < 0 ? vs_set_prefetch_one(-1) : vs_prefetch_one; }

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
