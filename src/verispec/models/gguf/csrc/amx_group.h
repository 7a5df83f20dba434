/* One group of 16 weight rows against a tile of up to 16 tokens with AMX tile products. matmul_amx.h includes
 * this file twice: once with the tile operations defined as the AMX instructions (run where the CPU has them), once as
 * their software emulation (amx_tiles.h), so that the tile layout, the packing and the epilogue are tested bit for
 * bit on every machine. Before including, define:
 *   AMX_NAME(x)        the name of this copy's functions
 *   AMX_ATTR           its function attributes
 *   AMX_CONFIG(cfg)    load a tile configuration (an amx_config_t *)
 *   AMX_ZERO(t)        tile t = 0
 *   AMX_LOAD(t, p, s)  tile t <- rows at p, s bytes apart
 *   AMX_STORE(t, p, s) rows at p, s bytes apart <- tile t
 *   AMX_DPBSUD(c, a, b)  c += a (signed bytes) x b (unsigned bytes, four to a dword): the tdpbsud instruction
 *   AMX_OPERANDS(L, sb, hi, lo)  a super-block's B operands (amx_tiles.h, amx_operands_portable)
 *   AMX_MINS(L, sb, mins)  a super-block's min factors in pairs (amx_tiles.h, amx_mins_portable)
 *   AMX_IMIN(mins, n, pairs, imin)  a token's min sums (amx_tiles.h, amx_imin_portable)
 *   AMX_SCALE_ADD4(isum, sc, dots, t)  isum += sum_i sc_i dots[i][t] over 4 units (amx_scale_add4_portable)
 *   AMX_SCALES(L, sb, d, dmin)        its rows' d and dmin as floats (the values the VNNI path converts)
 *
 * Roles: A = the tokens' int8 activations (a row per token, read in place from the call's activation matrix,
 * `stride` bytes apart); B = weights built from the super-block, "slots" of 64 bytes (slot i of a sub-block: its
 * weights 4i..4i+3 of the 16 rows, byte 4r + j for row r), which is the layout a B tile reads; C = int32, a row
 * per token and a dword per weight row.
 *
 * The VNNI path computes, per super-block, isum = sum_u sc_u dot_u and imin = sum_u m_u bsum_u over its sub-blocks
 * u (32 weights each). Here the scales go into B instead, so that a whole super-block is two tile sums with no
 * per-sub-block work per token: with sc = 8 hi + lo (hi, lo < 8; sc < 64 for Q4_K / Q5_K),
 *   C_hi = A x (hi q),  C_lo = A x (lo q)   (every B byte <= 7 x 31: unsigned bytes),   isum = 8 C_hi + C_lo,
 * and imin, 8 products a token, in 4 vpdpwssd over pairs of sub-blocks (m < 64, |bsum of 32| < 2^12: int16),
 * the very integers of the VNNI path (integer sums are exact), so the same float epilogue (d da and dmin da
 * products, two fmaf in the same order) gives the same bits. Types without scales (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0:
 * one sub-block a super-block) take isum = A x q and imin = bsum. Q6_K's scales are signed 8-bit: they do not
 * fit this split (five tile sums measured slower than VNNI), so its kernel (group_units, below) takes a tile
 * product per unit of 16 weights and scales each token's dots, as the VNNI kernel does, without its dot work.
 */

/* Tiles shaped for T tokens and products K deep. configured: the shape this thread's tiles were last configured for
 * in this call (-1: none), so that the costly ldtilecfg runs once per call and thread and shape, not once per group
 * (it was an eighth of the kernel's time). */
static inline AMX_ATTR void AMX_NAME(configure)(int T, int K, int *configured) {
    if (*configured != T * 256 + K) {
        amx_config_t cfg;
        amx_configure(&cfg, T, K);
        AMX_CONFIG(&cfg);
        *configured = T * 256 + K;
    }
}

static AMX_ATTR void AMX_NAME(group)(const layout_t *L, const uint8_t *grp, int64_t nsb, const token_t *tok, int T,
                                     int64_t stride, int *configured) {
    const int64_t SB = sb_bytes(L);
    const int scaled = L->scsub == 32, K = amx_depth(L), chunks = L->q / K;
    AMX_NAME(configure)(T, K, configured);
    /* Two of each buffer, pipelined: super-block s + 1's operands are built (vector stores) while s's products
     * run, and s's sums are read after that, so no tile load waits for the stores just before it, and no vector
     * load for a tile store (neither is forwarded) */
    uint8_t ops[2][2][256 * GROUP] __attribute__((aligned(64))); /* hi, lo */
    int32_t sums[2][2][AMX_TOKENS][GROUP] __attribute__((aligned(64))); /* C_hi, C_lo */
    amx_mins_t mins;
    float acc[AMX_TOKENS][GROUP];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < GROUP; r++) acc[t][r] = 0.0f;
    if (nsb > 0) AMX_OPERANDS(L, grp, ops[0][0], ops[0][1]);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB;
        AMX_PREFETCH(sb, SB);
        uint8_t(*op)[256 * GROUP] = ops[s & 1];
        int32_t(*c)[AMX_TOKENS][GROUP] = sums[s & 1];
        const int8_t *a = tok[0].q + s * L->q; /* token t's activations at a + t stride */
        AMX_ZERO(2);
        if (scaled) AMX_ZERO(3);
        for (int k = 0; k < chunks; k++) {
            AMX_LOAD(0, a + K * k, stride);
            AMX_LOAD(1, op[0] + 16 * K * k, 64);
            AMX_DPBSUD(2, 0, 1);
            if (scaled) {
                AMX_LOAD(5, op[1] + 16 * K * k, 64);
                AMX_DPBSUD(3, 0, 5);
            }
        }
        AMX_STORE(2, c[0], 4 * GROUP);
        if (scaled) AMX_STORE(3, c[1], 4 * GROUP);
        if (s + 1 < nsb) AMX_OPERANDS(L, sb + SB, ops[(s + 1) & 1][0], ops[(s + 1) & 1][1]);
        if (scaled) AMX_MINS(L, sb, &mins);
        float d[GROUP], dmin[GROUP];
        AMX_SCALES(L, sb, d, dmin);
        for (int t = 0; t < T; t++) {
            const float da = tok[t].d[s];
            const int32_t *bs = tok[t].bsum + s * L->q / 16;
            int32_t isum[GROUP], imin[GROUP];
            if (scaled) AMX_IMIN(&mins, 4, tok[t].pairs + AMX_PAIRS * s, imin);
            for (int r = 0; r < GROUP; r++) {
                isum[r] = scaled ? 8 * c[0][t][r] + c[1][t][r] : c[0][t][r];
                if (!scaled) imin[r] = bs[0] + bs[1];
            }
            for (int r = 0; r < GROUP; r++) {
                if (L->dmin_kind) { /* the offset taken off in integers, one product (layout.h's EPILOGUE) */
                    acc[t][r] = fmaf(d[r] * da, (float)(isum[r] - L->dmin_kind * imin[r]), acc[t][r]);
                    continue;
                }
                acc[t][r] = fmaf(d[r] * da, (float)isum[r], acc[t][r]);
                acc[t][r] = fmaf(-(dmin[r] * da), (float)imin[r], acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; t++) memcpy(tok[t].out, acc[t], sizeof acc[t]);
}

/* Q6_K: a tile product per unit of 16 weights (K = 16: A the unit's 16 activations of each token, B its 4 slots),
 * four units in flight (C tiles 2, 3, 4, 6), each batch's dots read one batch after their store; then
 * isum = sum_u sc_u dot_u per token, and imin = sum_u sc_u bsum_u in 8 vpdpwssd: the VNNI kernel's integers. */
static AMX_ATTR void AMX_NAME(group_units)(const layout_t *L, const uint8_t *grp, int64_t nsb, const token_t *tok,
                                           int T, int64_t stride, int *configured) {
    const int64_t SB = sb_bytes(L);
    const int hdr = header_bytes(L), units = L->q / 16;
    AMX_NAME(configure)(T, 16, configured);
    uint8_t slots[2][256 * GROUP] __attribute__((aligned(64))); /* super-blocks s and s + 1, unpacked */
    int32_t dots[2][4][AMX_TOKENS][GROUP] __attribute__((aligned(64))); /* two batches of 4 units */
    int32_t isum[AMX_TOKENS][GROUP];
    amx_mins_t mins;
    float acc[AMX_TOKENS][GROUP];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < GROUP; r++) acc[t][r] = 0.0f;
    if (nsb > 0) AMX_OPERANDS(L, grp, slots[0], NULL);
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB, *sl = slots[s & 1];
        AMX_PREFETCH(sb, SB);
        const int8_t *a = tok[0].q + s * L->q; /* token t's activations at a + t stride */
        for (int t = 0; t < T; t++)
            for (int r = 0; r < GROUP; r++) isum[t][r] = 0;
        for (int b = 0; b <= units / 4; b++) {
            if (b < units / 4) { /* the products of units 4b .. 4b + 3 */
                const int j = 4 * b;
                int32_t(*out)[AMX_TOKENS][GROUP] = dots[b & 1];
                AMX_ZERO(2);
                AMX_LOAD(0, a + 16 * j, stride);
                AMX_LOAD(1, sl + 256 * j, 64);
                AMX_DPBSUD(2, 0, 1);
                AMX_ZERO(3);
                AMX_LOAD(0, a + 16 * (j + 1), stride);
                AMX_LOAD(5, sl + 256 * (j + 1), 64);
                AMX_DPBSUD(3, 0, 5);
                AMX_ZERO(4);
                AMX_LOAD(0, a + 16 * (j + 2), stride);
                AMX_LOAD(1, sl + 256 * (j + 2), 64);
                AMX_DPBSUD(4, 0, 1);
                AMX_ZERO(6);
                AMX_LOAD(0, a + 16 * (j + 3), stride);
                AMX_LOAD(5, sl + 256 * (j + 3), 64);
                AMX_DPBSUD(6, 0, 5);
                AMX_STORE(2, out[0], 4 * GROUP);
                AMX_STORE(3, out[1], 4 * GROUP);
                AMX_STORE(4, out[2], 4 * GROUP);
                AMX_STORE(6, out[3], 4 * GROUP);
            }
            if (b == 0 && s + 1 < nsb) AMX_OPERANDS(L, sb + SB, slots[(s + 1) & 1], NULL);
            if (b == units / 4) AMX_MINS(L, sb, &mins); /* work between the last batch's store and its reading */
            if (b > 0) { /* the batch before: its dots were stored one batch ago */
                const int j = 4 * (b - 1);
                int32_t(*in)[AMX_TOKENS][GROUP] = dots[(b - 1) & 1];
                for (int t = 0; t < T; t++) AMX_SCALE_ADD4(isum[t], (const int8_t *)sb + hdr + j * GROUP, in, t);
            }
        }
        float d[GROUP], dmin[GROUP];
        AMX_SCALES(L, sb, d, dmin);
        for (int t = 0; t < T; t++) {
            const float da = tok[t].d[s];
            int32_t imin[GROUP];
            AMX_IMIN(&mins, 8, tok[t].pairs + AMX_PAIRS * s, imin);
            for (int r = 0; r < GROUP; r++) {
                if (L->dmin_kind) { /* the offset taken off in integers, one product (layout.h's EPILOGUE) */
                    acc[t][r] = fmaf(d[r] * da, (float)(isum[t][r] - L->dmin_kind * imin[r]), acc[t][r]);
                    continue;
                }
                acc[t][r] = fmaf(d[r] * da, (float)isum[t][r], acc[t][r]);
                acc[t][r] = fmaf(-(dmin[r] * da), (float)imin[r], acc[t][r]);
            }
        }
    }
    for (int t = 0; t < T; t++) memcpy(tok[t].out, acc[t], sizeof acc[t]);
}

/* One group against ntiles tiles of 16 tokens (a prompt's chunk): each super-block's operands built once for all
 * the tiles, where `group` builds them once a tile, and two tiles' products at a time (A in tiles 0 and 7, C in 2, 3
 * and 4, 6), an odd last tile alone. Token i's activations tile-major at q (tile, K-chunk, 16 tokens, K bytes: a
 * tile's A one run of memory), its scales at d0 + i (cols / q), its sum pairs at pairs + AMX_PAIRS i nsb (bsum +
 * i (cols / 16) for types without scales); acc (16 ntiles, GROUP) out. Per token the operations and their order are
 * `group`'s, so the bits are. Q4_K over 128 tokens, one thread, a 2-core Xeon with AMX: 1536 x 1536 0.81 -> 1.28 GB/s
 * of weights, 8960 x 1536 0.65 -> 1.12 (tiles in pairs and the tile-major copy together ~10% of that at 512 tokens);
 * half of what is left is this epilogue, half the tiles. The epilogue is `group`'s written out again: one inline
 * function for both measured 10-15% slower in each (16, 24 and 128 tokens). */
static AMX_ATTR void AMX_NAME(group_wide)(const layout_t *L, const uint8_t *grp, int64_t nsb, const int8_t *q,
                                          const float *d0, const int32_t *bsum, const int32_t *pairs, int64_t ntiles,
                                          int64_t cols, float (*acc)[GROUP], int *configured) {
    const int64_t SB = sb_bytes(L), n = AMX_TOKENS * ntiles, npairs = (ntiles + 1) / 2;
    const int scaled = L->scsub == 32, K = amx_depth(L), chunks = L->q / K;
    AMX_NAME(configure)(AMX_TOKENS, K, configured);
    uint8_t ops[2][256 * GROUP] __attribute__((aligned(64))); /* hi, lo */
    /* a pair's C_hi, C_lo of each tile; two pairs */
    int32_t sums[2][4][AMX_TOKENS][GROUP] __attribute__((aligned(64)));
    amx_mins_t mins;
    float d[GROUP], dmin[GROUP];
    for (int64_t i = 0; i < n; i++)
        for (int r = 0; r < GROUP; r++) acc[i][r] = 0.0f;
    for (int64_t s = 0; s < nsb; s++) {
        const uint8_t *sb = grp + s * SB;
        AMX_PREFETCH(sb, SB);
        AMX_OPERANDS(L, sb, ops[0], ops[1]);
        if (scaled) AMX_MINS(L, sb, &mins);
        AMX_SCALES(L, sb, d, dmin);
        for (int64_t p = 0; p <= npairs; p++) {
            if (p < npairs) { /* pair p's products; its sums read after pair p + 1's */
                const int64_t k = 2 * p;
                const int two = k + 1 < ntiles;
                const int8_t *a = q + (k * (cols / K) + s * chunks) * AMX_TOKENS * K; /* tile-major */
                const int8_t *a1 = a + (cols / K) * AMX_TOKENS * K;
                int32_t(*c)[AMX_TOKENS][GROUP] = sums[p & 1];
                AMX_ZERO(2);
                if (scaled) AMX_ZERO(3);
                if (two) AMX_ZERO(4);
                if (two && scaled) AMX_ZERO(6);
                for (int j = 0; j < chunks; j++) {
                    AMX_LOAD(0, a + AMX_TOKENS * K * j, K);
                    if (two) AMX_LOAD(7, a1 + AMX_TOKENS * K * j, K);
                    AMX_LOAD(1, ops[0] + 16 * K * j, 64);
                    AMX_DPBSUD(2, 0, 1);
                    if (two) AMX_DPBSUD(4, 7, 1);
                    if (scaled) {
                        AMX_LOAD(5, ops[1] + 16 * K * j, 64);
                        AMX_DPBSUD(3, 0, 5);
                        if (two) AMX_DPBSUD(6, 7, 5);
                    }
                }
                AMX_STORE(2, c[0], 4 * GROUP);
                if (scaled) AMX_STORE(3, c[1], 4 * GROUP);
                if (two) AMX_STORE(4, c[2], 4 * GROUP);
                if (two && scaled) AMX_STORE(6, c[3], 4 * GROUP);
            }
            if (p == 0) continue;
            int32_t(*c)[AMX_TOKENS][GROUP] = sums[(p - 1) & 1];
            const int64_t k0 = 2 * (p - 1), kn = k0 + 2 < ntiles ? k0 + 2 : ntiles;
            for (int64_t k = k0; k < kn; k++)
                for (int t = 0; t < AMX_TOKENS; t++) {
                    const int64_t i = AMX_TOKENS * k + t;
                    const int32_t *chi = c[2 * (k - k0)][t], *clo = c[2 * (k - k0) + 1][t];
                    const float da = d0[i * (cols / L->q) + s];
                    const int32_t *bs = bsum + i * (cols / 16) + s * L->q / 16;
                    int32_t isum[GROUP], imin[GROUP];
                    if (scaled) AMX_IMIN(&mins, 4, pairs + AMX_PAIRS * (i * nsb + s), imin);
                    for (int r = 0; r < GROUP; r++) {
                        isum[r] = scaled ? 8 * chi[r] + clo[r] : chi[r];
                        if (!scaled) imin[r] = bs[0] + bs[1];
                    }
                    for (int r = 0; r < GROUP; r++) {
                        if (L->dmin_kind) {
                            acc[i][r] = fmaf(d[r] * da, (float)(isum[r] - L->dmin_kind * imin[r]), acc[i][r]);
                            continue;
                        }
                        acc[i][r] = fmaf(d[r] * da, (float)isum[r], acc[i][r]);
                        acc[i][r] = fmaf(-(dmin[r] * da), (float)imin[r], acc[i][r]);
                    }
                }
        }
    }
}
