/* One part of kernels.c, which includes the parts in order as one translation unit (see there). Attention of queries
 * over their rows' key / value caches (portable and AVX-512), with Gemma 2's soft-cap. */

/* Gemma 2's attention soft-cap on a head's scores, in place: cap tanh(s / cap), as llama.cpp takes it (a product
 * by the float 1 / cap, tanhf, a product by cap); 0: none. Elementwise, so every path and batch gives the same bits. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
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
