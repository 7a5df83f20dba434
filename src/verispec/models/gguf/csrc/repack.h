/* One part of kernels.c, which includes the parts in order as one translation unit (see there). GGUF blocks to the
 * lane-interleaved layout (layout.h), and reading it back value by value (the portable path
 * and the dequantized rows). */

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
