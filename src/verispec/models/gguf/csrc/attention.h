/* One part of kernels.c, which includes the parts in order as one translation unit (see there). Attention of queries
 * over their rows' key / value caches (portable, AVX-512, and AVX2 in attend_avx2.h), with Gemma 2's soft-cap. */

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

/* Bytes of one cache element: an IEEE half with kv_half, else a float. */
static inline int64_t kv_bytes(int kv_half) { return kv_half ? (int64_t)sizeof(uint16_t) : (int64_t)sizeof(float); }

/* n half-precision values (IEEE binary16 bits) to floats: exact, so any instruction that converts them gives
 * these bits; cloned per CPU so that the F16C build converts 8 or 16 at a time. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static void half_row_to_float(const uint16_t *h, float *out, int64_t n) {
#ifdef __FLT16_MAX__
    const _Float16 *v = (const _Float16 *)h;
    for (int64_t i = 0; i < n; i++) out[i] = (float)v[i];
#else
    for (int64_t i = 0; i < n; i++) out[i] = half_to_float(h[i]);
#endif
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

/* Columns whose values are weighed for every head before the next ones are read: 32 columns of a 128-float head
 * are 16 KB, which stay in the L1 cache while each head reads them. */
enum { WEIGH_BLOCK = 32 };

/* How many columns ahead the keys being scored and the values being weighed are asked into L2. The requests are
 * spread among the arithmetic (a slice of a block's key lines before each head's scores, a value column's lines with
 * each column weighed): asked all at once before a block, they had stalled the core behind its full fill buffers.
 * A one-token pass of the default target (half cache, 2 threads, a 2-core Xeon with AMX): attention over 1,500 /
 * 4,000 / 8,000 cached tokens 3.1-3.3 / 7.4-7.6 / 14.5-14.9 -> 2.3-2.5 / 5.9-6.5 / 12.5-13.0 ms with the requests
 * spread 16 and 32 columns ahead; 32 and 64 measured 11.7-12.4 ms at 8,000 and 64 and 128 alike (kept: 32, 64). */
enum { KEYS_AHEAD = 32, VALUES_AHEAD = 64 };

/* n halves (a multiple of 16) to floats, 16 at a time: each conversion exact. */
static VS_AVX512 void halves_to_floats16(const uint16_t *h, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm512_store_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
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

#endif

#define KV_T float
#define KV_NAME(x) x##_f32
#define KV_LOAD16(p) _mm512_loadu_ps(p)
#define KV_COLUMN(p, buf, n) (p)
#define KV_RUN_FLOATS(p, buf, n) ((void)(buf), (p))
#define KV_CONVERTS 0
#include "attend_cache.h"
#define KV_T uint16_t
#define KV_NAME(x) x##_f16
#define KV_LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define KV_COLUMN(p, buf, n) (half_row_to_float((p), (buf), (n)), (const float *)(buf))
#define KV_RUN_FLOATS(p, buf, n) (halves_to_floats16((p), (buf), (n)), (const float *)(buf))
#define KV_CONVERTS 1
#include "attend_cache.h"
#include "attend_avx2.h"

/* Attention of n queries over their rows' caches.
 * q (n, hq, dim); for query i: key/value head h's key in cache column c at kbase[i] + h * head_stride[i] +
 * c * stride elements, its value likewise from vbase[i]; an element is a float, or with kv_half an IEEE half (the
 * runner's default cache: half the bytes to read, and llama.cpp's own cache type). It attends to columns 0 .. prefix[i]-1, then to the columns
 * extra[extra_off[i] .. extra_off[i+1]-1] (increasing). out (n, hq, dim).
 * Scores, softmax and the weighted sum run over the attended columns in order: a query's result is the
 * same whatever other queries the call has, and a tree node's equals the chain's over the same entries.
 * Work is split by key/value head and by runs of consecutive queries on one cache (at most `span` of them, fewer
 * where the threads would otherwise idle); the AVX-512 and AVX2 paths read a run's shared prefix once for all of it.
 * The runner's caches are head-major (stride dim, head_stride a row's capacity times dim), so a thread streams its
 * head's keys and values from contiguous memory; a column holding every head (stride hkv * dim, head_stride dim), as
 * the caches were laid out before, gives the same bits. There a thread read every other run of dim floats (2
 * key/value heads), which the hardware prefetcher streamed poorly: a one-token pass of the default target (2 threads,
 * a 2-core Xeon with AMX) spent 1.03 / 7.2 / 19.6 ms in attention over 200 / 1,500 / 4,000 cached tokens; head-major,
 * without the prefetches inside the loop and weighing heads three at a time, 0.91 / 5.6 / 13.35. */
int vs_attention_cache(const float *q, int64_t n, int hq, int hkv, int dim, float scale, const int64_t *kbase,
                       const int64_t *vbase, int64_t stride, const int64_t *head_stride, const int32_t *prefix,
                       const int32_t *extra_off, const int32_t *extra, float *out, float cap, int kv_half) {
    if (n < 0 || hq <= 0 || hkv <= 0 || hq % hkv || dim <= 0) return VS_EINVAL; /* G = hq / hkv below */
    if (n == 0) return VS_OK;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t c = prefix[i] + extra_off[i + 1] - extra_off[i];
        most = c > most ? c : most;
    }
    const int G = hq / hkv;
    const int simd = (vs_get_path() == PATH_AVX512 || vs_get_path() == PATH_AMX) && dim % 16 == 0 && G <= 64;
    const int simd2 = (vs_get_path() == PATH_AVX2 || vs_get_path() == PATH_AVX_VNNI) && dim % 16 == 0; /* 256-bit */
    enum { SPAN = 16 };
    int64_t span = 1;
    if (simd || simd2) {
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
        float *total = malloc(sizeof(float) * (size_t)(span * G)), *column = malloc(sizeof(float) * (size_t)dim);
        /* the AVX2 path's blocks of converted keys and values */
        float *blocks = simd2 ? malloc(sizeof(float) * 2 * ATTEND_BLOCK_AVX2 * (size_t)dim) : NULL;
        if (!score || !colbuf || !total || !column || (simd2 && !blocks)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t rh = 0; rh < runs * hkv; rh++) {
            if (!score || !colbuf || !total || !column || (simd2 && !blocks)) continue; /* every thread still reaches the loop's barrier */
            const int64_t r = rh / hkv, i0 = first[r], nq = first[r + 1] - first[r];
            const int kvh = (int)(rh % hkv);
            const size_t at = (size_t)(kvh * head_stride[i0] * kv_bytes(kv_half));
            const char *K = (const char *)(intptr_t)kbase[i0] + at, *V = (const char *)(intptr_t)vbase[i0] + at;
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
            if (simd && kv_half)
                attend_queries_avx512_f16((int)nq, qs, G, dim, (const uint16_t *)K, (const uint16_t *)V, stride, cs, ms,
                                          shared, scale, cap, ss, total, os);
            else if (simd)
                attend_queries_avx512_f32((int)nq, qs, G, dim, (const float *)K, (const float *)V, stride, cs, ms, shared,
                                          scale, cap, ss, total, os);
            else if (simd2)
                attend_queries_avx2((int)nq, qs, G, dim, K, V, kv_half, stride, cs, ms, shared, scale, cap, ss, total, os,
                                    blocks, blocks + ATTEND_BLOCK_AVX2 * dim);
            else
#endif
                for (int64_t t = 0; t < nq; t++)
                    if (kv_half)
                        attend_group_generic_f16(qs[t], G, dim, (const uint16_t *)K, (const uint16_t *)V, stride, cs[t],
                                                 ms[t], scale, cap, ss[t], total, column, os[t]);
                    else
                        attend_group_generic_f32(qs[t], G, dim, (const float *)K, (const float *)V, stride, cs[t], ms[t],
                                                 scale, cap, ss[t], total, column, os[t]);
        }
        free(score);
        free(colbuf);
        free(total);
        free(column);
        free(blocks);
    }
    free(first);
    (void)simd, (void)simd2;
    return failed ? VS_ENOMEM : VS_OK;
}

int vs_attention_capped(const float *q, int64_t n, int hq, int hkv, int dim, float scale, const int64_t *kbase,
                        const int64_t *vbase, int64_t stride, const int64_t *head_stride, const int32_t *prefix,
                        const int32_t *extra_off, const int32_t *extra, float *out, float cap) {
    return vs_attention_cache(q, n, hq, hkv, dim, scale, kbase, vbase, stride, head_stride, prefix, extra_off, extra,
                              out, cap, 0);
}

int vs_attention(const float *q, int64_t n, int hq, int hkv, int dim, float scale, const int64_t *kbase, const int64_t *vbase,
                 int64_t stride, const int64_t *head_stride, const int32_t *prefix, const int32_t *extra_off,
                 const int32_t *extra, float *out) {
    return vs_attention_capped(q, n, hq, hkv, dim, scale, kbase, vbase, stride, head_stride, prefix, extra_off, extra,
                               out, 0.0f);
}
