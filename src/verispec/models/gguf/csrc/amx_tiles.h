/* AMX tiles for amx_group.h: the configuration both copies load, and the software emulation of the five tile
 * operations the kernel uses, with the instructions' semantics (Intel SDM, "Intel AMX Instruction Set
 * Reference"): a tile is up to 16 rows of up to 64 bytes, shaped by the configuration; a load or store moves
 * `rows` rows of `colsb` bytes, `stride` bytes apart; tdpbsud adds to C[m][n] (an int32) the products of A's row m
 * (signed bytes) with B's column n, four unsigned bytes per dword: sum over k < colsb(A) / 4, j < 4 of
 * A[m][4k + j] B[k][4n + j], wrapping modulo 2^32. */

enum { AMX_TOKENS = 16 }; /* a tile holds 16 rows: the tokens of one tile product */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* Tile 0: A (T tokens, K bytes of activations); 1, 5: B (K / 4 rows of 64 bytes); 2, 3, 4, 6: C (T rows of 16
 * int32); 7: group_wide's second A. K: a product's depth, 64 (two sub-blocks), 32 for types without scales, 16 for
 * Q6_K's units. */
/* A tile product's depth for `group` and `group_wide` (bytes of A a token, K / 4 rows of B): 64, two sub-blocks, for
 * types with scales a sub-block; 32, one block, for the others. The tile-major activations group_wide reads are
 * laid out by it too. */
static int amx_depth(const layout_t *L) { return L->scsub == 32 ? 64 : 32; }

static void amx_configure(amx_config_t *c, int T, int K) {
    memset(c, 0, sizeof *c);
    c->palette = 1;
    c->rows[0] = (uint8_t)T, c->colsb[0] = (uint16_t)K;
    for (int i = 1; i < 8; i++) {
        int b = i == 1 || i == 5;
        c->rows[i] = (uint8_t)(b ? K / 4 : T), c->colsb[i] = 64;
    }
    c->colsb[7] = (uint16_t)K;
}

typedef struct {
    uint8_t b[16][64];
} emu_tile_t;

static __thread emu_tile_t emu_tile[8]; /* tile registers are per thread, as on the CPU */
static __thread amx_config_t emu_cfg;

static void emu_config(const amx_config_t *c) {
    emu_cfg = *c;
    memset(emu_tile, 0, sizeof emu_tile); /* ldtilecfg zeroes every tile */
}
static void emu_zero(int t) { memset(&emu_tile[t], 0, sizeof emu_tile[t]); }
static void emu_load(int t, const void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++) memcpy(emu_tile[t].b[r], (const uint8_t *)p + r * stride, emu_cfg.colsb[t]);
}
static void emu_store(int t, void *p, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++) memcpy((uint8_t *)p + r * stride, emu_tile[t].b[r], emu_cfg.colsb[t]);
}
static void emu_dpbsud(int c, int a, int b) {
    for (int m = 0; m < emu_cfg.rows[c]; m++)
        for (int n = 0; n < emu_cfg.colsb[c] / 4; n++) {
            uint32_t acc;
            memcpy(&acc, emu_tile[c].b[m] + 4 * n, 4);
            for (int k = 0; k < emu_cfg.colsb[a] / 4; k++)
                for (int j = 0; j < 4; j++)
                    acc += (uint32_t)((int32_t)(int8_t)emu_tile[a].b[m][4 * k + j] * (int32_t)emu_tile[b].b[k][4 * n + j]);
            memcpy(emu_tile[c].b[m] + 4 * n, &acc, 4);
        }
}

/* A super-block's B operands, in slots (sub-block u at 512 u, slot i at 64 i, row r's 4 bytes at 4 r): with
 * scales, hi = (sc >> 3) q and lo = (sc & 7) q; without (or lo NULL: Q6_K's units), hi = q. Portable; the AVX-512
 * copy is in matmul_amx.h. */
static void amx_operands_portable(const layout_t *L, const uint8_t *sb, uint8_t *hi, uint8_t *lo) {
    const int64_t poff = planes_offset(L);
    const int pb = plane_bytes(L->bits), hdr = header_bytes(L);
    for (int u = 0; u < L->q / 32; u++)
        for (int r = 0; r < GROUP; r++) {
            const int sc = L->scsub ? ((const int8_t *)sb)[hdr + u * GROUP + r] : 0;
            for (int k = 0; k < 32; k++) {
                const int i = 512 * u + 64 * (k / 4) + 4 * r + k % 4, q = unpack_weight(L, sb + poff + u * pb, r, k);
                if (L->scsub && lo) {
                    hi[i] = (uint8_t)((sc >> 3) * q), lo[i] = (uint8_t)((sc & 7) * q);
                } else {
                    hi[i] = (uint8_t)q;
                }
            }
        }
}

/* A super-block's d and dmin per row, as the other paths compute them. */
static void amx_scales_portable(const layout_t *L, const uint8_t *sb, float *d, float *dmin) {
    for (int r = 0; r < GROUP; r++) d[r] = sb_d(sb, r), dmin[r] = sb_dmin(L, sb, r);
}

/* A super-block's min factors as int16 pairs per row, pair[j][r] = f[2j][r] | f[2j + 1][r] << 16 (the operand of
 * vpdpwssd; |f| < 128): f = m of the 8 sub-blocks of Q4_K / Q5_K (4 pairs), or the 16 scales of Q6_K (8 pairs). */
typedef struct {
    int32_t pair[8][GROUP] __attribute__((aligned(64)));
} amx_mins_t;

static int amx_npairs(const layout_t *L) { return nscales(L) / 2; }

static void amx_mins_portable(const layout_t *L, const uint8_t *sb, amx_mins_t *mins) {
    const int8_t *f = (const int8_t *)sb + header_bytes(L) + (L->has_m ? nscales(L) * GROUP : 0); /* f[u][r] */
    for (int j = 0; j < amx_npairs(L); j++)
        for (int r = 0; r < GROUP; r++)
            mins->pair[j][r] = (int32_t)((uint32_t)(uint16_t)f[2 * j * GROUP + r] | (uint32_t)(uint16_t)f[(2 * j + 1) * GROUP + r] << 16);
}

/* A token's unit sums of one super-block (bs: its sums over 16) as the pairs vpdpwssd multiplies with the
 * super-block's min pairs: pairs[j] = sum of unit 2j | sum of unit 2j + 1 << 16 (units of 32, or 16 for Q6_K;
 * |sum| < 2^12: int16). They depend on the token only, so vs_matmul makes them once a call, not once a group. */
static void amx_sum_pairs(const layout_t *L, const int32_t *bs, int32_t *pairs) {
    for (int j = 0; j < amx_npairs(L); j++) {
        const int32_t u0 = L->scsub == 16 ? bs[2 * j] : bs[4 * j] + bs[4 * j + 1];
        const int32_t u1 = L->scsub == 16 ? bs[2 * j + 1] : bs[4 * j + 2] + bs[4 * j + 3];
        pairs[j] = (int32_t)((uint32_t)(uint16_t)u0 | (uint32_t)(uint16_t)u1 << 16);
    }
}

/* imin[r] = sum_u f[u][r] (the token's sum over unit u), from the n pairs. */
static void amx_imin_portable(const amx_mins_t *mins, int n, const int32_t *pairs, int32_t *imin) {
    for (int r = 0; r < GROUP; r++) {
        int32_t sum = 0;
        for (int j = 0; j < n; j++) {
            const int32_t p = mins->pair[j][r];
            sum += (int32_t)(int16_t)(p & 0xFFFF) * (int32_t)(int16_t)(pairs[j] & 0xFFFF);
            sum += (int32_t)(int16_t)(p >> 16) * (int32_t)(int16_t)(pairs[j] >> 16);
        }
        imin[r] = sum;
    }
}

/* isum[r] += sum_i sc[i][r] dots[i][t][r] over 4 units (sc: their int8 scales, GROUP apart): the per-unit epilogue
 * of Q6_K's tile kernel, for token t. */
static void amx_scale_add4_portable(int32_t *isum, const int8_t *sc, int32_t (*dots)[AMX_TOKENS][GROUP], int t) {
    for (int i = 0; i < 4; i++)
        for (int r = 0; r < GROUP; r++) isum[r] += (int32_t)sc[i * GROUP + r] * dots[i][t][r];
}
