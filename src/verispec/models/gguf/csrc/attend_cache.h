/* Attention over one key / value cache element type: attention.h includes this file twice, for float32 caches
 * (KV_T float) and for half-precision ones (KV_T uint16_t, IEEE binary16 bits, as llama.cpp's default cache keeps
 * them). Before including, define:
 *   KV_T                 a cache element
 *   KV_NAME(x)           the name of this copy's functions
 *   KV_LOAD16(p)         16 elements at p as a __m512 of floats (AVX-512 path)
 *   KV_COLUMN(p, buf, n) n elements at p as floats: p itself, or buf once they are converted into it
 *   KV_RUN_FLOATS(p, buf, n)  the same for n contiguous elements, n a multiple of 16 (AVX-512 path)
 *   KV_CONVERTS          1 where KV_RUN_FLOATS converts into buf, 0 where it gives p
 * A half converts to exactly one float, so both copies run the same float operations on the values they read.
 * The file undefines these at its end, ready for the next copy. */

/* One query's attention for the G query heads that share one key/value head (grouped-query attention).
 * qg (G, dim); K, V: that head's first key / value, column c at + c * stride; cols (m): the attended
 * columns in order; score (G, m), total (G) and column (dim) scratch; og (G, dim) out. Per head: score_j =
 * dot16(q, k_j) * scale, then e^(score - max) and their sum (exp_and_sum), then o = sum_j p_j v_j in column order
 * (fmaf), o / total. A column is read (and, from a half cache, converted) once for all G heads; each head's sums
 * still run over the columns in order. */
static void KV_NAME(attend_group_generic)(const float *qg, int G, int dim, const KV_T *K, const KV_T *V,
                                          int64_t stride, const int32_t *cols, int64_t m, float scale, float cap,
                                          float *score, float *total, float *column, float *og) {
    for (int64_t j = 0; j < m; j++) {
        const float *k = KV_COLUMN(K + cols[j] * stride, column, dim);
        for (int g = 0; g < G; g++) score[g * m + j] = dot16(qg + g * dim, k, dim) * scale;
    }
    for (int g = 0; g < G; g++) {
        float *sg = score + g * m, top = -INFINITY;
        soft_cap(sg, m, cap);
        for (int64_t j = 0; j < m; j++) top = sg[j] > top ? sg[j] : top;
        total[g] = exp_and_sum(sg, m, top);
    }
    for (int k = 0; k < G * dim; k++) og[k] = 0.0f;
    for (int64_t j = 0; j < m; j++) {
        const float *v = KV_COLUMN(V + cols[j] * stride, column, dim);
        for (int g = 0; g < G; g++) axpy(og + g * dim, score[g * m + j], v, dim);
    }
    for (int g = 0; g < G; g++)
        for (int k = 0; k < dim; k++) og[g * dim + k] = og[g * dim + k] / total[g];
}

#ifdef VS_X86
/* One head's scores over 16 columns: 16 independent chains of fused multiply-adds (one per column, in the
 * dimension's order, as dot16 runs them), then reduce16. */
VS_INLINE VS_AVX512 __m512 KV_NAME(scores16)(const float *qh, int dim, const KV_T *K, int64_t stride, const int32_t *cols) {
    __m512 acc[16];
    const KV_T *k[16];
    for (int c = 0; c < 16; c++) {
        acc[c] = _mm512_setzero_ps();
        k[c] = K + cols[c] * stride;
    }
    for (int d0 = 0; d0 < dim; d0 += 16) {
        __m512 qv = _mm512_loadu_ps(qh + d0);
        for (int c = 0; c < 16; c++) acc[c] = _mm512_fmadd_ps(qv, KV_LOAD16(k[c] + d0), acc[c]);
    }
    return reduce16(acc);
}

/* scores16 over 16 consecutive columns of a head-major cache (stride D, the head's size, a constant at each call):
 * one base pointer and constant offsets, where the 16 column pointers spilled to the stack and were reloaded for
 * every product. The same operations in the same order. */
VS_INLINE VS_AVX512 __m512 KV_NAME(scores16_run)(const float *qh, const int D, const KV_T *k0) {
    __m512 acc[16];
    for (int c = 0; c < 16; c++) acc[c] = _mm512_setzero_ps();
    for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 qv = _mm512_loadu_ps(qh + d0);
        for (int c = 0; c < 16; c++) acc[c] = _mm512_fmadd_ps(qv, KV_LOAD16(k0 + c * D + d0), acc[c]);
    }
    return reduce16(acc);
}

/* o[h][d] += sum_j p[h][j] v_j[d] over columns j0 .. j1-1, for NH heads from head g and NC 16-float chunks of the
 * dimension from d0, in column order (one fused multiply-add per column and element, as axpy runs them); NH * NC
 * chains in registers, the running sums kept in og between blocks of columns (a float stored and loaded is the same
 * float). score (G, m), og (G, dim): all the heads'. The first heads' calls (g 0) also ask for each column's part of
 * the value VALUES_AHEAD columns on into L2; later heads read the same lines. */
VS_INLINE VS_AVX512 void KV_NAME(weigh_values)(const int NH, const int NC, int g, const float *score, int64_t m,
                                               const KV_T *V, int64_t stride, const int32_t *cols, int64_t j0,
                                               int64_t j1, int d0, int dim, float *og) {
    const int ask = g == 0;
    score += g * m;
    og += g * dim;
    __m512 acc[24];
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++)
            acc[h * NC + c] = j0 ? _mm512_loadu_ps(og + h * dim + d0 + 16 * c) : _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        const KV_T *v = V + cols[j] * stride + d0;
        if (ask && j + VALUES_AHEAD < m) {
            const char *p = (const char *)(V + cols[j + VALUES_AHEAD] * stride + d0);
            for (int o = 0; o < NC * 16 * (int)sizeof(KV_T); o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
        }
        for (int c = 0; c < NC; c++) {
            __m512 vc = KV_LOAD16(v + 16 * c);
            for (int h = 0; h < NH; h++)
                acc[h * NC + c] = _mm512_fmadd_ps(_mm512_set1_ps(score[h * m + j]), vc, acc[h * NC + c]);
        }
    }
    for (int h = 0; h < NH; h++)
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(og + h * dim + d0 + 16 * c, acc[h * NC + c]);
}

/* A prefetch of columns a .. b-1's keys (to L1) and values (to L2, read after the scores). */
VS_INLINE VS_AVX512 void KV_NAME(prefetch_columns)(const KV_T *K, const KV_T *V, int64_t stride, const int32_t *cols, int64_t a,
                                          int64_t b, int dim) {
    for (; a < b; a++) {
        const char *kp = (const char *)(K + cols[a] * stride), *vp = (const char *)(V + cols[a] * stride);
        for (int o = 0; o < dim * (int)sizeof(KV_T); o += 64) {
            _mm_prefetch(kp + o, _MM_HINT_T0);
            _mm_prefetch(vp + o, _MM_HINT_T1);
        }
    }
}

/* Columns a .. b-1 (those below m) of a key or value head into L2, ahead of their reading. */
VS_INLINE VS_AVX512 void KV_NAME(prefetch_l2)(const KV_T *X, int64_t stride, const int32_t *cols, int64_t a, int64_t b,
                                              int64_t m, int dim) {
    for (b = b < m ? b : m; a < b; a++) {
        const char *p = (const char *)(X + cols[a] * stride);
        for (int o = 0; o < dim * (int)sizeof(KV_T); o += 64) _mm_prefetch(p + o, _MM_HINT_T1);
    }
}

/* One query's G heads' scores over its columns j0 .. j1-1 (j0 a multiple of 16): whole blocks of 16 by scores16,
 * the rest one by one with _mm512_reduce_add_ps, which halves as dot16 does. score (G, m). */
static VS_AVX512 void KV_NAME(score_columns)(const float *qg, int G, int dim, const KV_T *K, int64_t stride,
                                    const int32_t *cols, int64_t m, int64_t j0, int64_t j1, float scale, float *score,
                                    int readers, float *block, const KV_T **held) {
    int64_t j = j0;
    for (; j + 16 <= j1; j += 16) {
        /* columns increase, so 15 apart over 16 is a run; head sizes of 64, 128 and 256 take scores16_run */
        const int run = stride == dim && cols[j + 15] - cols[j] == 15 ? dim : 0;
        const KV_T *k0 = K + cols[j] * stride;
        const int fresh = k0 != *held; /* not the block the last call converted and asked ahead for */
        const int64_t a = j + KEYS_AHEAD;
        /* the 16 keys KEYS_AHEAD columns on, into L2 (once a block, however many queries score it): where they
         * are a run, a slice of their lines before each head's scores; else all at once */
        const char *ahead = fresh && a + 16 <= m && stride == dim && cols[a + 15] - cols[a] == 15
                                ? (const char *)(K + cols[a] * stride) : NULL;
        const int lines = 16 * dim * (int)sizeof(KV_T) / 64;
        if (fresh && !ahead) KV_NAME(prefetch_l2)(K, stride, cols, a, a + 16, m, dim);
        /* a run's keys as floats once for all G heads (KV_RUN_FLOATS: converted from halves only where several
         * heads read them; each conversion is exact, so the products are the same). The conversions had been
         * repeated per head, on the ports the products need: hot, 4,000 columns of a half cache, 6 query heads a
         * key/value head, 238 -> 190 us a layer on a 2-core Xeon with AMX. */
        const int wide = run == 64 || run == 128 || run == 256;
        const float *kf = NULL;
        if (wide && readers > 1) {
            kf = fresh ? KV_RUN_FLOATS(k0, block, 16 * dim) : KV_CONVERTS ? block : (const float *)(const void *)k0;
            *held = k0;
        }
        for (int g = 0; g < G; g++) {
            if (ahead)
                for (int l = g * lines / G; l < (g + 1) * lines / G; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
            const float *qh = qg + g * dim;
            const __m512 s = kf && run == 128 ? scores16_run_f32(qh, 128, kf)
                             : kf && run == 64 ? scores16_run_f32(qh, 64, kf)
                             : kf ? scores16_run_f32(qh, 256, kf)
                             : run == 128 ? KV_NAME(scores16_run)(qh, 128, k0)
                             : run == 64 ? KV_NAME(scores16_run)(qh, 64, k0)
                             : run == 256 ? KV_NAME(scores16_run)(qh, 256, k0)
                             : KV_NAME(scores16)(qh, dim, K, stride, cols + j);
            _mm512_storeu_ps(score + g * m + j, _mm512_mul_ps(s, _mm512_set1_ps(scale)));
        }
    }
    for (; j < j1; j++) {
        const KV_T *k = K + cols[j] * stride;
        for (int g = 0; g < G; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int d0 = 0; d0 < dim; d0 += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + g * dim + d0), KV_LOAD16(k + d0), acc);
            score[g * m + j] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
}

/* One query's G heads' weighed sums over columns j0 .. j1-1 added to og (zeros first where j0 is 0), several heads
 * side by side so that a value vector loaded (and, from a half cache, converted) once serves them all: heads of 64
 * floats or a multiple six, then four at a time, 4 chunks of 16 floats each; then short heads 8 / chunks at a time
 * (chunks 1, 2 or 4); heads of 128 or 256 floats three or two at a time, 8 chunks each; the rest alone in chunks of
 * 8, 4 and 1. Measured on a 2-core Xeon with AMX, 6 query heads a key/value head: three at a time against one, caches
 * cold, 1,500 columns over 28 layers 4.8 -> 4.4 ms (4.6 with two); six at a time against three, a half cache of
 * 4,000 columns, hot, 190 -> 167 us a layer (the heads' 512-bit products are most of that time, and the conversions
 * compete with them for the same ports). Each (head, chunk) sum runs over the columns in order whatever its company. */
static VS_AVX512 void KV_NAME(weigh_columns)(int G, int dim, const KV_T *V, int64_t stride, const int32_t *cols, int64_t m,
                                    int64_t j0, int64_t j1, const float *score, float *og) {
    const int chunks = dim / 16;
    int g = 0;
    /* six, then four heads side by side, 4 chunks of each: a value chunk converted (from a half) once for them */
    for (; chunks % 4 == 0 && g + 6 <= G; g += 6)
        for (int d0 = 0; d0 < dim; d0 += 64) KV_NAME(weigh_values)(6, 4, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
    for (; chunks % 4 == 0 && g + 4 <= G; g += 4)
        for (int d0 = 0; d0 < dim; d0 += 64) KV_NAME(weigh_values)(4, 4, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
    const int NH = chunks == 1 ? 8 : chunks == 2 ? 4 : chunks == 4 ? 2 : 1;
    for (; NH > 1 && g + NH <= G; g += NH) {
        if (chunks == 1) KV_NAME(weigh_values)(8, 1, g, score, m, V, stride, cols, j0, j1, 0, dim, og);
        else if (chunks == 2) KV_NAME(weigh_values)(4, 2, g, score, m, V, stride, cols, j0, j1, 0, dim, og);
        else KV_NAME(weigh_values)(2, 4, g, score, m, V, stride, cols, j0, j1, 0, dim, og);
    }
    if (chunks % 8 == 0) {
        const int most = G % 3 == 0 ? 3 : 2;
        for (; g + most <= G; g += most)
            for (int d0 = 0; d0 < dim; d0 += 128) {
                if (most == 3) KV_NAME(weigh_values)(3, 8, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
                else KV_NAME(weigh_values)(2, 8, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
            }
    }
    for (; g < G; g++) {
        int d0 = 0;
        for (; d0 + 128 <= dim; d0 += 128) KV_NAME(weigh_values)(1, 8, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
        for (; d0 + 64 <= dim; d0 += 64) KV_NAME(weigh_values)(1, 4, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
        for (; d0 < dim; d0 += 16) KV_NAME(weigh_values)(1, 1, g, score, m, V, stride, cols, j0, j1, d0, dim, og);
    }
}

/* The same operations as attend_group_generic in 512-bit registers (dim a multiple of 16), for nq queries of one
 * key/value head whose first `shared` columns are the same (a row's chain queries share its cache's prefix): each
 * block of those columns' keys and values is read once from memory for all the queries, which then go on alone
 * over their own columns. A query's scores, softmax and weighed sum are the same operations in the same order
 * whatever queries share its call. q[i] (G, dim), cols[i] (m[i]), score[i] (G, m[i]) and total (nq, G) scratch,
 * og[i] (G, dim) out. */
static VS_AVX512 void KV_NAME(attend_queries_avx512)(int nq, const float *const *q, int G, int dim, const KV_T *K,
                                            const KV_T *V, int64_t stride, int32_t *const *cols, const int64_t *m,
                                            int64_t shared, float scale, float cap, float *const *score,
                                            float *total, float *const *og) {
    KV_NAME(prefetch_columns)(K, V, stride, cols[0], 0, m[0] < ATTEND_AHEAD ? m[0] : ATTEND_AHEAD, dim);
    /* the last run of 16 keys converted to floats (from a half cache), kept while the queries score it */
    float block[16 * 256] __attribute__((aligned(64)));
    const KV_T *held = NULL;
    const int64_t scored = shared / 16 * 16, weighed = shared / WEIGH_BLOCK * WEIGH_BLOCK;
    for (int64_t j = 0; j < scored; j += 16)
        for (int i = 0; i < nq; i++)
            KV_NAME(score_columns)(q[i], G, dim, K, stride, cols[i], m[i], j, j + 16, scale, score[i], G * nq, block, &held);
    for (int i = 0; i < nq; i++) {
        KV_NAME(score_columns)(q[i], G, dim, K, stride, cols[i], m[i], scored, m[i], scale, score[i], G, block, &held);
        softmax_heads(G, m[i], score[i], total + i * G, cap);
    }
    for (int64_t j = 0; j < weighed; j += WEIGH_BLOCK)
        for (int i = 0; i < nq; i++) KV_NAME(weigh_columns)(G, dim, V, stride, cols[i], m[i], j, j + WEIGH_BLOCK, score[i], og[i]);
    for (int i = 0; i < nq; i++) {
        if (m[i] == 0) /* no column: 0 / 0, as the generic path gives */
            for (int k = 0; k < G * dim; k++) og[i][k] = 0.0f;
        for (int64_t j = weighed; j < m[i]; j += WEIGH_BLOCK)
            KV_NAME(weigh_columns)(G, dim, V, stride, cols[i], m[i], j, j + WEIGH_BLOCK < m[i] ? j + WEIGH_BLOCK : m[i], score[i], og[i]);
        for (int g = 0; g < G; g++)
            for (int d0 = 0; d0 < dim; d0 += 16)
                _mm512_storeu_ps(og[i] + g * dim + d0, _mm512_div_ps(_mm512_loadu_ps(og[i] + g * dim + d0), _mm512_set1_ps(total[i * G + g])));
    }
}
#endif

#undef KV_T
#undef KV_NAME
#undef KV_LOAD16
#undef KV_COLUMN
#undef KV_RUN_FLOATS
#undef KV_CONVERTS
