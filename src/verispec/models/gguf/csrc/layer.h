/* One part of kernels.c, which includes the parts in order as one translation unit (see there). A whole decoder layer
 * in one call, and the MoE FFN. */

/* ------------------------------------------------------------------ one whole layer */
/* A decoder layer in one call: the same kernels, in the same order, as the runner's per-op path
 * (NativeRunner(fused=False)), so the same bits; only ~20 Python-level calls a layer are saved (about
 * 3 ms of a 37 ms one-token pass for the 28-layer target). Structures mirror native.py's ctypes ones. */
typedef struct {
    int64_t qtype;
    const uint8_t *data; /* packed (quantized types) or the rows as stored (float types) */
    int64_t rows, cols;
} vs_weight_t;

typedef struct {
    const float *attn_norm, *ffn_norm, *q_bias, *k_bias, *v_bias; /* biases may be NULL; norms too (OLMo 2: no
                                                                       norm before a sublayer) */
    const float *q_norm, *k_norm; /* (head_dim,) RMSNorm of each query / key head before RoPE (Qwen3), or NULL */
    const float *attn_post_norm, *ffn_post_norm; /* (hidden,) RMSNorm of a sublayer's output before the residual add
                                                    (Gemma), or NULL */
    vs_weight_t q, k, v, out, gate, up, down;
} vs_layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, ffn, neox, gelu; /* gelu: GeGLU (vs_gelu_mul), else SwiGLU */
    int64_t whole_qk_norm; /* q_norm / k_norm RMS-norm each token's whole q / k (OLMo 2), not each head */
    int64_t rope_dim; /* RoPE turns the first rope_dim values of each head (even, <= head_dim) */
    double eps, scale; /* passed on as float, as the per-op path's ctypes floats are */
    double residual_scale; /* each sublayer's output times this before its residual add (Granite; 1 or 0: none, as
                              llama.cpp reads an unset scale) */
    double attn_softcap; /* scores soft-capped before the softmax (Gemma 2; 0: none) */
    int64_t kv_half; /* the caches hold IEEE halves (half_from_float), else floats */
} vs_dims_t;

typedef struct {
    const float *x;
    int64_t n, k;
    int8_t *q[2];
    float *d[2];
    int32_t *bsum[2];
} act_t; /* an input and its int8 versions for activation blocks of 32 ([0]) and 256 ([1]) */

static int act_matmul(const vs_weight_t *w, act_t *a, float *out) {
    if (w->qtype == T_F32 || w->qtype == T_F16 || w->qtype == T_BF16)
        return vs_matmul_float((int)w->qtype, w->data, w->rows, w->cols, a->n, a->x, out);
    layout_t L;
    if (get_layout((int)w->qtype, &L)) return VS_EINVAL;
    int j = L.q == 32 ? 0 : 1;
    if (!a->q[j]) {
        a->q[j] = malloc((size_t)(a->n * a->k));
        a->d[j] = malloc(sizeof(float) * (size_t)(a->n * a->k / L.q));
        a->bsum[j] = malloc(sizeof(int32_t) * (size_t)(a->n * a->k / 16));
        if (!a->q[j] || !a->d[j] || !a->bsum[j]) {
            free(a->q[j]); free(a->d[j]); free(a->bsum[j]);
            a->q[j] = NULL; a->d[j] = NULL; a->bsum[j] = NULL;
            return VS_ENOMEM;
        }
        double t0 = profile_now();
        int status = vs_quantize_rows(a->x, a->n, a->k, L.q, a->q[j], a->d[j], a->bsum[j]);
        profile_add(PROFILE_QUANTIZE, t0);
        if (status) return status;
    }
    return vs_matmul((int)w->qtype, w->data, w->rows, w->cols, a->n, a->q[j], a->d[j], a->bsum[j], out);
}

static void act_free(act_t *a) { /* idempotent: the pointers are cleared */
    for (int j = 0; j < 2; j++) {
        free(a->q[j]); free(a->d[j]); free(a->bsum[j]);
        a->q[j] = NULL; a->d[j] = NULL; a->bsum[j] = NULL;
    }
}

void scale_rows(float *x, int64_t n, float s) { /* x *= s, one float32 product a value (as ggml_scale) */
    for (int64_t i = 0; i < n; i++) x[i] = x[i] * s;
}

static void add_rows(float *y, const float *b, int64_t n, int64_t width) { /* y[i] += b, b one row or n rows */
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < width; j++) y[i * width + j] = y[i * width + j] + b[j];
}

/* x's IEEE half bits, rounded to nearest, ties to even (round_to_half), as numpy's float32 -> float16 cast writes the
 * per-op path's cache: from 65520 on inf, a NaN a NaN with the float's sign and top payload bits. */
static uint16_t half_from_float(float x) {
    uint32_t f;
    memcpy(&f, &x, 4);
    const uint16_t sign = (uint16_t)((f >> 16) & 0x8000);
    if (x != x) {
        const uint16_t payload = (uint16_t)((f & 0x7FFFFF) >> 13);
        return sign | 0x7C00 | (payload ? payload : 1);
    }
    const float r = round_to_half(x);
    return isinf(r) ? sign | 0x7C00 : half_bits(r);
}

/* x (n) as the half caches store them (half_from_float); the tests compare it with numpy's cast. */
int vs_to_half(const float *x, int64_t n, uint16_t *out) {
    if (n < 0) return VS_EINVAL;
    for (int64_t i = 0; i < n; i++) out[i] = half_from_float(x[i]);
    return VS_OK;
}

/* The n values at src into a cache column at dst: copied, or as halves. */
static void cache_write(void *dst, const float *src, int64_t n, int half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *h = dst;
    for (int64_t i = 0; i < n; i++) h[i] = half_from_float(src[i]);
}

/* x (n, hidden) in place; query i writes its key and value to column columns[i] of its row's cache and attends as
 * vs_attention says. A row's cache is head-major: layer l's keys at kbase0[i] + l * layer_bytes[i], kv_heads blocks
 * of layer_bytes[i] / kv_heads bytes, head h's column c at + h * that + c * stride elements (values likewise; floats, or halves with kv_half). */
static int layer_forward(const vs_dims_t *D, const vs_layer_t *L, float *x, int64_t n, const float *rope_table,
                         const int64_t *kbase0, const int64_t *vbase0, const int64_t *layer_bytes, int64_t layer,
                         int64_t stride, const int32_t *columns, const int32_t *prefix, const int32_t *extra_off,
                         const int32_t *extra, int32_t skip) {
    /* skip: bit 1 skips the attention sublayer (no keys or values written), bit 2 the MLP sublayer: the
       residual stream passes through unchanged (self-speculation's draft, verispec.drafters.self_draft). */
    if (!D || D->hidden <= 0 || D->heads <= 0 || D->kv_heads <= 0 || D->heads % D->kv_heads || D->head_dim <= 0 ||
        D->head_dim % 2 || D->ffn <= 0 || n < 0 || D->heads > INT32_MAX || D->head_dim > INT32_MAX ||
        D->rope_dim <= 0 || D->rope_dim % 2 || D->rope_dim > D->head_dim)
        return VS_EINVAL; /* the dimensions vs_attention and vs_rope divide by, checked once here */
    if (n == 0) return VS_OK;
    const int64_t E = D->hidden, QD = D->heads * D->head_dim, KD = D->kv_heads * D->head_dim, F = D->ffn;
    const float eps = (float)D->eps;
    int status = VS_OK;
    act_t a = {0}, a2 = {0}, a3 = {0}, a4 = {0};
    float *xn = malloc(sizeof(float) * (size_t)(n * E)), *q = malloc(sizeof(float) * (size_t)(n * QD));
    float *k = malloc(sizeof(float) * (size_t)(n * KD)), *v = malloc(sizeof(float) * (size_t)(n * KD));
    float *attn = malloc(sizeof(float) * (size_t)(n * QD)), *o = malloc(sizeof(float) * (size_t)(n * E));
    float *g = malloc(sizeof(float) * (size_t)(n * F)), *u = malloc(sizeof(float) * (size_t)(n * F));
    float *h = malloc(sizeof(float) * (size_t)(n * F));
    int64_t *kb = malloc(sizeof(int64_t) * (size_t)n), *vb = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *hs = malloc(sizeof(int64_t) * (size_t)n);
    if (!xn || !q || !k || !v || !attn || !o || !g || !u || !h || !kb || !vb || !hs) {
        status = VS_ENOMEM;
        goto done;
    }
    for (int64_t i = 0; i < n; i++) {
        kb[i] = kbase0[i] + layer * layer_bytes[i];
        vb[i] = vbase0[i] + layer * layer_bytes[i];
        hs[i] = layer_bytes[i] / kv_bytes((int)D->kv_half) / D->kv_heads;
    }

    if (skip & 1) goto mlp;
    if (L->attn_norm) vs_rmsnorm(x, n, E, L->attn_norm, eps, xn);
    a = (act_t){L->attn_norm ? xn : x, n, E, {0}, {0}, {0}};
    if ((status = act_matmul(&L->q, &a, q)) || (status = act_matmul(&L->k, &a, k)) || (status = act_matmul(&L->v, &a, v)))
        goto done;
    act_free(&a);
    if (L->q_bias) add_rows(q, L->q_bias, n, QD);
    if (L->k_bias) add_rows(k, L->k_bias, n, KD);
    if (L->v_bias) add_rows(v, L->v_bias, n, KD);
    if (L->q_norm) /* in place: a row's scale first */
        vs_rmsnorm(q, D->whole_qk_norm ? n : n * D->heads, D->whole_qk_norm ? QD : D->head_dim, L->q_norm, eps, q);
    if (L->k_norm) vs_rmsnorm(k, D->whole_qk_norm ? n : n * D->kv_heads, D->whole_qk_norm ? KD : D->head_dim, L->k_norm, eps, k);
    if (rope_table) { /* NULL: a layer without RoPE (SmolLM3's every fourth) */
        vs_rope(q, n, (int)D->heads, (int)D->head_dim, (int)D->rope_dim, rope_table, (int)D->neox);
        vs_rope(k, n, (int)D->kv_heads, (int)D->head_dim, (int)D->rope_dim, rope_table, (int)D->neox);
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t kvh = 0; kvh < D->kv_heads; kvh++) {
            const int64_t at = (kvh * hs[i] + columns[i] * stride) * kv_bytes((int)D->kv_half);
            cache_write((char *)(intptr_t)kb[i] + at, k + i * KD + kvh * D->head_dim, D->head_dim, (int)D->kv_half);
            cache_write((char *)(intptr_t)vb[i] + at, v + i * KD + kvh * D->head_dim, D->head_dim, (int)D->kv_half);
        }
    double t_attention = profile_now();
    status = vs_attention_cache(q, n, (int)D->heads, (int)D->kv_heads, (int)D->head_dim, (float)D->scale, kb, vb, stride,
                                hs, prefix, extra_off, extra, attn, (float)D->attn_softcap, (int)D->kv_half);
    profile_add(PROFILE_ATTENTION, t_attention);
    if (status) goto done;
    a2 = (act_t){attn, n, QD, {0}, {0}, {0}};
    if ((status = act_matmul(&L->out, &a2, o))) goto done;
    act_free(&a2);
    if (L->attn_post_norm) vs_rmsnorm(o, n, E, L->attn_post_norm, eps, o);
    if (D->residual_scale != 1.0 && D->residual_scale != 0.0) scale_rows(o, n * E, (float)D->residual_scale);
    for (int64_t i = 0; i < n * E; i++) x[i] = x[i] + o[i];

mlp:
    if (skip & 2) goto done;
    if (L->ffn_norm) vs_rmsnorm(x, n, E, L->ffn_norm, eps, xn);
    a3 = (act_t){L->ffn_norm ? xn : x, n, E, {0}, {0}, {0}};
    if ((status = act_matmul(&L->gate, &a3, g)) || (status = act_matmul(&L->up, &a3, u))) goto done;
    act_free(&a3);
    if (D->gelu) vs_gelu_mul(g, u, n * F, h);
    else vs_silu_mul(g, u, n * F, h);
    a4 = (act_t){h, n, F, {0}, {0}, {0}};
    if ((status = act_matmul(&L->down, &a4, o))) goto done;
    act_free(&a4);
    if (L->ffn_post_norm) vs_rmsnorm(o, n, E, L->ffn_post_norm, eps, o);
    if (D->residual_scale != 1.0 && D->residual_scale != 0.0) scale_rows(o, n * E, (float)D->residual_scale);
    for (int64_t i = 0; i < n * E; i++) x[i] = x[i] + o[i];

done:
    act_free(&a); act_free(&a2); act_free(&a3); act_free(&a4);
    free(xn); free(q); free(k); free(v); free(attn); free(o); free(g); free(u); free(h); free(kb); free(vb); free(hs);
    return status;
}

int vs_layer_forward(const vs_dims_t *D, const vs_layer_t *L, float *x, int64_t n, const float *rope_table,
                     const int64_t *kbase0, const int64_t *vbase0, const int64_t *layer_bytes, int64_t layer,
                     int64_t stride, const int32_t *columns, const int32_t *prefix, const int32_t *extra_off,
                     const int32_t *extra, int32_t skip) {
    double t0 = profile_now();
    vs_in_layer = 1;
    int status = layer_forward(D, L, x, n, rope_table, kbase0, vbase0, layer_bytes, layer, stride, columns, prefix,
                               extra_off, extra, skip);
    vs_in_layer = 0;
    profile_add(PROFILE_LAYER, t0);
    return status;
}

/* A mixture of experts' feed-forward (Qwen3's MoE, Mixtral) once the tokens are routed: x (n, hidden) the normed
 * inputs, token i's j-th pick picks[i * used + j] (an expert below `experts`, distinct within a token) weighted by
 * weights[i * used + j]; out (n, hidden) = sum over j, in pick order from 0.0f, of weight * down(silu(gate(x_i)) *
 * up(x_i)) of that expert (gate[e], up[e] (width, hidden), down[e] (hidden, width)). Each picked expert runs once over
 * the tokens that picked it (in increasing order), with the same kernels, activations quantized per row, as the per-op
 * path (verispec.models.gguf.experts.experts_reference), so a token's bits are its own in any pass. The threads take
 * whole experts (an expert's matrices are small: split over the threads in turn, each matrix's stream was too short
 * to keep both pulling memory); the kernels inside run on the one thread that took the expert (a nested parallel
 * region is a team of one), and a row's bits do not depend on the thread that computes it. One call a layer instead
 * of six a picked expert from Python. */
int vs_moe_ffn(const vs_weight_t *gate, const vs_weight_t *up, const vs_weight_t *down, int64_t experts, int64_t width,
               const float *x, int64_t n, int64_t hidden, int64_t used, const int32_t *picks, const float *weights,
               float *out) {
    if (experts <= 0 || width <= 0 || hidden <= 0 || n < 0 || used <= 0 || used > experts) return VS_EINVAL;
    for (int64_t i = 0; i < n * used; i++)
        if (picks[i] < 0 || picks[i] >= experts) return VS_ERANGE;
    if (n == 0) return VS_OK;
    int status = VS_OK;
    float *ys = malloc(sizeof(float) * (size_t)(n * used * hidden)); /* (n, used, hidden): each pick's output */
    int64_t *count = calloc((size_t)experts, sizeof(int64_t)), *picked = malloc(sizeof(int64_t) * (size_t)experts);
    if (!ys || !count || !picked) {
        free(ys); free(count); free(picked);
        return VS_ENOMEM;
    }
    int64_t npicked = 0; /* the experts any token picked, in increasing order */
    for (int64_t i = 0; i < n * used; i++) count[picks[i]]++;
    for (int64_t e = 0; e < experts; e++)
        if (count[e]) picked[npicked++] = e;
#pragma omp parallel num_threads(vs_threads) if (npicked > 1)
    {
        act_t a = {0}, a2 = {0};
        float *xs = malloc(sizeof(float) * (size_t)(n * hidden)), *g = malloc(sizeof(float) * (size_t)(n * width));
        float *u = malloc(sizeof(float) * (size_t)(n * width)), *h = malloc(sizeof(float) * (size_t)(n * width));
        float *y = malloc(sizeof(float) * (size_t)(n * hidden));
        int64_t *slot = malloc(sizeof(int64_t) * (size_t)n); /* the tokens that picked the expert: their pick's index */
        int mine = (xs && g && u && h && y && slot) ? VS_OK : VS_ENOMEM;
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < npicked; p++) {
            if (mine) continue;
            const int64_t e = picked[p];
            int64_t m = 0;
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < used; j++)
                    if (picks[i * used + j] == e) {
                        memcpy(xs + m * hidden, x + i * hidden, sizeof(float) * (size_t)hidden);
                        slot[m++] = i * used + j;
                    }
            a = (act_t){xs, m, hidden, {0}, {0}, {0}};
            if ((mine = act_matmul(&gate[e], &a, g)) || (mine = act_matmul(&up[e], &a, u))) continue;
            act_free(&a);
            vs_silu_mul(g, u, m * width, h);
            a2 = (act_t){h, m, width, {0}, {0}, {0}};
            if ((mine = act_matmul(&down[e], &a2, y))) continue;
            act_free(&a2);
            for (int64_t r = 0; r < m; r++) memcpy(ys + slot[r] * hidden, y + r * hidden, sizeof(float) * (size_t)hidden);
        }
        if (mine) {
#pragma omp critical
            status = mine;
        }
        act_free(&a); act_free(&a2);
        free(xs); free(g); free(u); free(h); free(y); free(slot);
    }
    if (status == VS_OK)
        for (int64_t i = 0; i < n; i++) {
            float *o = out + i * hidden;
            for (int64_t k = 0; k < hidden; k++) o[k] = 0.0f;
            for (int64_t j = 0; j < used; j++) {
                const float w = weights[i * used + j], *v = ys + (i * used + j) * hidden;
                for (int64_t k = 0; k < hidden; k++) o[k] = o[k] + v[k] * w;
            }
        }
    free(ys); free(count); free(picked);
    return status;
}
