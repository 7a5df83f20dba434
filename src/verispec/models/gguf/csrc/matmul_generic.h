/* One part of kernels.c, which includes the parts in order as one translation unit (see there). A token's view of
 * a matmul's activations, and the portable kernel every SIMD path is tested against. */

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
