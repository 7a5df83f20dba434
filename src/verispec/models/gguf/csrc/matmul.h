/* One part of kernels.c, which includes the parts in order as one translation unit (see there). vs_matmul: which
 * kernel takes which tokens of a quantized matmul, split over the threads. */

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
    (void)prefetch_one(); /* the CPU's default settled here, before the threads read it */
    if (L.lut && L.scsub) /* IQ4_XS: signed scales over values up to 241 fit neither tile kernel's split */
        path = path == PATH_AMX ? PATH_AVX512 : path == PATH_AMX_EMULATED ? PATH_GENERIC : path;
    const int amx_min = amx_min_tokens(type);
    if (path == PATH_AMX && (amx_min == 0 || n < amx_min)) path = PATH_AVX512; /* too few tokens for the tiles to pay */
    const int amx = path == PATH_AMX || path == PATH_AMX_EMULATED;
    const int tile = amx ? AMX_TOKENS : path == PATH_AVX512 ? vs_avx512_tile()
                   : path == PATH_AVX2 || path == PATH_AVX_VNNI ? vs_avx2_tile() : TILE;
    int32_t *pairs = NULL; /* the tile kernel's sub-block sum pairs of each token and super-block */
    if (path != PATH_GENERIC && L.scsub && n > 0) { /* every SIMD kernel takes its min terms from them */
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
            /* but on AMX, tiles of equal size within one token: on AVX2 (tiles of 8) 9 tokens are 4 + 5, not 8 + 1
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
#if VS_HAVE_AVXVNNI
                else if (path == PATH_AVX_VNNI) group_avxvnni(type, grp, nsb, tok, T);
#endif
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
