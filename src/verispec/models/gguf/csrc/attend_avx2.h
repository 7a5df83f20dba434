/* Attention over a float or half cache in 256-bit registers, for the CPUs whose matmuls run the AVX2 kernels (no
 * AVX-512): attention.h includes this file. The portable path it replaces there called dot16 and axpy once per
 * column and head (target clones, so no inlining): a one-token pass of the default target over 4,000 cached tokens
 * spent 35 ms in attention on the AVX-VNNI path of a 2-core Xeon, where the AVX-512 kernel spends ~7.
 *
 * The same float operations as attend_group_generic, in the same order: a score is dot16's 16 lanes (two registers
 * of 8: lanes 0-7 and 8-15), halved as dot16 halves them (lane l + lane l + 8, then + 4, + 2, + 1), times the scale;
 * the softmax is the portable one's (soft_cap, a maximum, exp_and_sum); a head's weighed sum is one fused
 * multiply-add per column and element in column order, as axpy runs it, then a division by the total. A column's
 * key or value is read (and from a half cache converted, exactly) once into a block of floats that every query head
 * then reads from L1, and where a chain's queries share their cache's prefix, once for all of them. */

#ifdef VS_X86
/* Columns a block holds: 32 columns of 128 floats are 16 KB, which stay in L1 while the heads read them. */
enum { ATTEND_BLOCK_AVX2 = 32 };

/* Columns cols[0 .. cnt-1] of one key or value head as float pointers: a float cache's own columns, a half cache's
 * converted into buf (cnt x dim). dim a multiple of 8. Each column also asks for the one a block on (of the `left`
 * columns from cols[0]) into L2, so that the next block's reading does not wait on memory. */
static VS_AVX2 void columns_as_floats_avx2(const void *X, int kv_half, int64_t stride, const int32_t *cols, int cnt,
                                           int64_t left, int dim, float *buf, const float **out) {
    const int64_t bytes = dim * kv_bytes(kv_half);
    for (int c = 0; c < cnt; c++) {
        if (c + ATTEND_BLOCK_AVX2 < left) {
            const char *next = (const char *)X + cols[c + ATTEND_BLOCK_AVX2] * stride * kv_bytes(kv_half);
            for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
        }
        if (!kv_half) {
            out[c] = (const float *)X + cols[c] * stride;
            continue;
        }
        const uint16_t *h = (const uint16_t *)X + cols[c] * stride;
        float *f = buf + (int64_t)c * dim;
        for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(f + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + d))));
        out[c] = f;
    }
}

/* A block of one key or value head's columns as floats: buf (ATTEND_BLOCK_AVX2, dim) holds a half cache's converted
 * columns; p their pointers. A block inside the queries' shared prefix is the same for every query: the first to
 * fetch it converts it and the others reuse it (first: its first column, or -1 where it is not such a block). */
typedef struct {
    float *buf;
    const float *p[ATTEND_BLOCK_AVX2];
    int64_t first;
    int cnt;
} float_block_t;

/* b = query columns cols[j .. j+cnt-1] (of m), unless b already holds them. */
static VS_AVX2 void fetch_block_avx2(float_block_t *b, const void *X, int kv_half, int64_t stride, const int32_t *cols,
                                     int64_t j, int cnt, int64_t m, int64_t shared, int dim) {
    if (b->first != j || b->cnt != cnt)
        columns_as_floats_avx2(X, kv_half, stride, cols + j, cnt, m - j, dim, b->buf, b->p);
    b->first = j + cnt <= shared ? j : -1, b->cnt = cnt;
}

/* dot16's halving of its 16 lanes (lo: 0-7, hi: 8-15): lane l + lane l + 8, then + 4, + 2, + 1. */
VS_INLINE VS_AVX2 float halve16_avx2(__m256 lo, __m256 hi) {
    const __m256 r = _mm256_add_ps(lo, hi);
    const __m128 y = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
    const __m128 z = _mm_add_ps(y, _mm_movehl_ps(y, y));
    return _mm_cvtss_f32(_mm_add_ss(z, _mm_shuffle_ps(z, z, 1)));
}

/* score[g * m + c] = dot16(q_g, k_c) * scale for the G heads and the block's cnt columns (kp: their floats), four
 * columns side by side (eight chains of fused multiply-adds). */
static VS_AVX2 void score_block_avx2(const float *qg, int G, int dim, const float *const *kp, int cnt, float scale,
                                     float *score, int64_t m) {
    for (int g = 0; g < G; g++) {
        const float *qh = qg + (int64_t)g * dim;
        int c = 0;
        for (; c + 4 <= cnt; c += 4) {
            __m256 lo[4], hi[4];
            for (int k = 0; k < 4; k++) lo[k] = hi[k] = _mm256_setzero_ps();
            for (int d0 = 0; d0 < dim; d0 += 16) {
                const __m256 ql = _mm256_loadu_ps(qh + d0), qu = _mm256_loadu_ps(qh + d0 + 8);
                for (int k = 0; k < 4; k++) {
                    lo[k] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kp[c + k] + d0), lo[k]);
                    hi[k] = _mm256_fmadd_ps(qu, _mm256_loadu_ps(kp[c + k] + d0 + 8), hi[k]);
                }
            }
            for (int k = 0; k < 4; k++) score[g * m + c + k] = halve16_avx2(lo[k], hi[k]) * scale;
        }
        for (; c < cnt; c++) {
            __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
            for (int d0 = 0; d0 < dim; d0 += 16) {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d0), _mm256_loadu_ps(kp[c] + d0), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d0 + 8), _mm256_loadu_ps(kp[c] + d0 + 8), hi);
            }
            score[g * m + c] = halve16_avx2(lo, hi) * scale;
        }
    }
}

/* o[h][d] (og + h * dim + d0 + d) += p[h][c] v_c[d] over the block's cnt columns in order, for NH heads (p: their
 * scores at column 0 of the block, rows m apart) and NC 8-float chunks from d0; zeros first where first. */
VS_INLINE VS_AVX2 void weigh_block_avx2(const int NH, const int NC, const float *p, int64_t m, const float *const *vp,
                                        int cnt, int d0, int dim, float *og, int first) {
    __m256 acc[8];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++)
            acc[h * NC + c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(og + h * dim + d0 + 8 * c);
    for (int k = 0; k < cnt; k++) {
        __m256 s[2];
        for (int h = 0; h < NH; h++) s[h] = _mm256_set1_ps(p[h * m + k]);
        for (int c = 0; c < NC; c++) {
            const __m256 v = _mm256_loadu_ps(vp[k] + d0 + 8 * c);
            for (int h = 0; h < NH; h++) acc[h * NC + c] = _mm256_fmadd_ps(s[h], v, acc[h * NC + c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) _mm256_storeu_ps(og + h * dim + d0 + 8 * c, acc[h * NC + c]);
}

/* Every head's weighed sum over one block: heads two at a time, 4 chunks (32 floats) of each, or 2 where the head
 * size is not a multiple of 32. */
static VS_AVX2 void weigh_heads_avx2(int G, int dim, const float *score, int64_t m, const float *const *vp, int cnt,
                                     float *og, int first) {
    int g = 0;
    for (; g + 2 <= G; g += 2)
        for (int d0 = 0; d0 < dim; d0 += dim % 32 ? 16 : 32) {
            if (dim % 32) weigh_block_avx2(2, 2, score + g * m, m, vp, cnt, d0, dim, og + g * dim, first);
            else weigh_block_avx2(2, 4, score + g * m, m, vp, cnt, d0, dim, og + g * dim, first);
        }
    for (; g < G; g++)
        for (int d0 = 0; d0 < dim; d0 += dim % 32 ? 16 : 32) {
            if (dim % 32) weigh_block_avx2(1, 2, score + g * m, m, vp, cnt, d0, dim, og + g * dim, first);
            else weigh_block_avx2(1, 4, score + g * m, m, vp, cnt, d0, dim, og + g * dim, first);
        }
}

/* nq queries of one key/value head (dim a multiple of 16), as attend_queries_avx512 takes them: q[i] (G, dim),
 * cols[i] (m[i]), the first `shared` columns the same for all; score[i] (G, m[i]) and total (nq, G) scratch; og[i]
 * (G, dim) out; kbuf, vbuf (ATTEND_BLOCK_AVX2, dim) scratch for a half cache's converted columns. */
static VS_AVX2 void attend_queries_avx2(int nq, const float *const *q, int G, int dim, const void *K, const void *V,
                                        int kv_half, int64_t stride, int32_t *const *cols, const int64_t *m,
                                        int64_t shared, float scale, float cap, float *const *score, float *total,
                                        float *const *og, float *kbuf, float *vbuf) {
    enum { B = ATTEND_BLOCK_AVX2 };
    float_block_t keys = {.buf = kbuf, .first = -1}, values = {.buf = vbuf, .first = -1};
    int64_t most = 0;
    for (int i = 0; i < nq; i++) most = m[i] > most ? m[i] : most;
    for (int64_t j = 0; j < most; j += B)
        for (int i = 0; i < nq; i++) {
            if (j >= m[i]) continue;
            const int cnt = (int)(m[i] - j < B ? m[i] - j : B);
            fetch_block_avx2(&keys, K, kv_half, stride, cols[i], j, cnt, m[i], shared, dim);
            score_block_avx2(q[i], G, dim, keys.p, cnt, scale, score[i] + j, m[i]);
        }
    for (int i = 0; i < nq; i++)
        for (int g = 0; g < G; g++) {
            float *sg = score[i] + g * m[i];
            soft_cap(sg, m[i], cap);
            /* the maximum in 8 lanes (the same whatever the order; a NaN score is passed over as the portable loop
             * passes it, and makes the sum NaN whatever the maximum): one scalar chain had been a tenth of the time */
            __m256 peak = _mm256_set1_ps(-INFINITY);
            int64_t j = 0;
            for (; j + 8 <= m[i]; j += 8) peak = _mm256_max_ps(_mm256_loadu_ps(sg + j), peak);
            float lanes[8], top = -INFINITY;
            _mm256_storeu_ps(lanes, peak);
            for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
            for (; j < m[i]; j++) top = sg[j] > top ? sg[j] : top;
            total[i * G + g] = exp_and_sum(sg, m[i], top);
        }
    for (int64_t j = 0; j < most; j += B)
        for (int i = 0; i < nq; i++) {
            if (j >= m[i]) continue;
            const int cnt = (int)(m[i] - j < B ? m[i] - j : B);
            fetch_block_avx2(&values, V, kv_half, stride, cols[i], j, cnt, m[i], shared, dim);
            weigh_heads_avx2(G, dim, score[i] + j, m[i], values.p, cnt, og[i], j == 0);
        }
    for (int i = 0; i < nq; i++) {
        if (m[i] == 0) /* no column: 0 / 0, as the generic path gives */
            for (int k = 0; k < G * dim; k++) og[i][k] = 0.0f;
        for (int g = 0; g < G; g++)
            for (int d0 = 0; d0 < dim; d0 += 8)
                _mm256_storeu_ps(og[i] + g * dim + d0,
                                 _mm256_div_ps(_mm256_loadu_ps(og[i] + g * dim + d0), _mm256_set1_ps(total[i * G + g])));
    }
}
#endif
