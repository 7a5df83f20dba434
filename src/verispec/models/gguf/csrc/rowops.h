/* One part of kernels.c, which includes the parts in order as one translation unit (see there). The float ops of a
 * forward outside the quantized matmuls and attention: float-weight matmuls, RMSNorm, RoPE,
 * SwiGLU / GeGLU, in one fixed order each. */

/* ------------------------------------------------------------------ float helpers (one fixed order) */

/* sum_i a[i] b[i] in 16 lanes (lane l takes i = l mod 16), then a fixed halving tree. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static float dot16(const float *a, const float *b, int64_t n) {
    float lane[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int l = 0; i + l < n; l++) lane[l] = fmaf(a[i + l], b[i + l], lane[l]);
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

static void to_float_row(int type, const uint8_t *src, int64_t cols, float *dst) {
    if (type == T_F32) memcpy(dst, src, sizeof(float) * (size_t)cols);
    else if (type == T_F16) for (int64_t k = 0; k < cols; k++) dst[k] = half_to_float(rd16(src + 2 * k));
    else for (int64_t k = 0; k < cols; k++) dst[k] = bf16_to_float(rd16(src + 2 * k));
}

/* out (n, rows) = x (n, cols) W^T for float weights (F32 / F16 / BF16, GGUF's row-major layout). */
static int matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t n, const float *x, float *out) {
    if (type != T_F32 && type != T_F16 && type != T_BF16) return VS_EINVAL;
    if (rows < 0 || cols <= 0 || n < 0) return VS_EINVAL;
    const int64_t row_bytes = cols * (type == T_F32 ? 4 : 2);
    int failed = 0;
#pragma omp parallel num_threads(vs_threads)
    {
        float *row = malloc(sizeof(float) * (size_t)cols);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue; /* every thread still reaches the loop's barrier */
            to_float_row(type, w + r * row_bytes, cols, row);
            for (int64_t i = 0; i < n; i++) out[i * rows + r] = dot16(row, x + i * cols, cols);
        }
        free(row);
    }
    return failed ? VS_ENOMEM : VS_OK;
}

int vs_matmul_float(int type, const uint8_t *w, int64_t rows, int64_t cols, int64_t n, const float *x, float *out) {
    double t0 = profile_now();
    int status = matmul_float(type, w, rows, cols, n, x, out);
    profile_add(vs_in_layer ? PROFILE_FLOAT : PROFILE_OUTSIDE, t0);
    return status;
}

int vs_float_rows(int type, const uint8_t *w, int64_t rows, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    if ((type != T_F32 && type != T_F16 && type != T_BF16) || cols < 0) return VS_EINVAL;
    const int64_t row_bytes = cols * (type == T_F32 ? 4 : 2);
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= rows) return VS_ERANGE;
        to_float_row(type, w + ids[i] * row_bytes, cols, out + i * cols);
    }
    return 0;
}

/* ------------------------------------------------------------------ per-row ops */

/* out = x / sqrt(mean(x^2) + eps) * w, row by row. */
void vs_rmsnorm(const float *x, int64_t n, int64_t e, const float *w, float eps, float *out) {
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * e;
        float mean = dot16(xi, xi, e) / (float)e;
        float scale = 1.0f / sqrtf(mean + eps);
        for (int64_t k = 0; k < e; k++) out[i * e + k] = (xi[k] * scale) * w[k];
    }
}

/* RoPE's cos / sin per position: table (n, dim/2, 2) for pair j at pos[i]: angle = pos * theta^(-2j/dim),
 * computed in double once per pass (every layer, q and k use it). */
void vs_rope_table(const int64_t *pos, int64_t n, int dim, double theta, const float *factors, float *table) {
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < dim / 2; j++) {
            /* factors (dim / 2, or NULL: all 1): pair j's frequency divided by factors[j] (Llama 3's scaling, which
             * its GGUF files carry as the tensor rope_freqs.weight, as llama.cpp applies it) */
            double angle = (double)pos[i] * pow(theta, -2.0 * j / dim) / (factors ? (double)factors[j] : 1.0);
            table[(i * (dim / 2) + j) * 2] = (float)cos(angle);
            table[(i * (dim / 2) + j) * 2 + 1] = (float)sin(angle);
        }
}

/* Rotary embedding in place on x (n, heads, dim) with a vs_rope_table of `rot` dimensions: the first rot values of
 * each head turn in pairs (2j, 2j+1) ("norm", Llama GGUFs, whose Q and K rows llama.cpp's converter permuted) or
 * (j, j + rot/2) ("neox", Qwen2); the others are left as they are (partial RoPE, Phi-4-mini's: rot < dim). */
void vs_rope(float *x, int64_t n, int heads, int dim, int rot, const float *table, int neox) {
    const int half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const float *cs = table + i * half * 2;
        for (int h = 0; h < heads; h++) {
            float *v = x + (i * heads + h) * dim;
            for (int j = 0; j < half; j++) {
                int a = neox ? j : 2 * j, b = neox ? j + half : 2 * j + 1;
                float c = cs[2 * j], sn = cs[2 * j + 1], x0 = v[a], x1 = v[b];
                v[a] = x0 * c - x1 * sn;
                v[b] = x0 * sn + x1 * c;
            }
        }
    }
}

/* o += s * v (elementwise fmaf: the same bits scalar or vectorized). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
static void axpy(float *o, float s, const float *v, int64_t n) {
    for (int64_t k = 0; k < n; k++) o[k] = fmaf(s, v[k], o[k]);
}

/* out = silu(g) * u, elementwise. */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void vs_silu_mul(const float *g, const float *u, int64_t n, float *out) {
    /* elementwise, so split over the threads when a pass has more than a token's worth (an element's bits are the
       same in any chunk: -ffp-contract=off) */
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n >= 16384)
    for (int64_t i = 0; i < n; i++) out[i] = g[i] / (1.0f + vs_exp(-g[i])) * u[i];
}

/* GeGLU as llama.cpp's CPU backend computes it (ggml_vec_geglu_f32 with GGML_GELU_FP16): the gate rounded to half, its
 * tanh-approximated GELU taken from a table of halves (the float formula rounded to half), times up; 0 at and below
 * -10, the gate itself at and above 10. Gemma's feed-forward. */
static float gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.79788456080286535587989211986876f * x * (1.0f + 0.044715f * x * x)));
}

/* The bits of a float that is a half's value (round_to_half's result, |x| < 65520): sign, 5-bit exponent, 10 bits. */
static uint16_t half_bits(float h) {
    uint32_t f;
    memcpy(&f, &h, 4);
    const uint16_t sign = (uint16_t)((f >> 16) & 0x8000);
    const float a = fabsf(h);
    if (a < 6.103515625e-05f) return sign | (uint16_t)(a * 16777216.0f); /* subnormal: a multiple of 2^-24 */
    return sign | (uint16_t)(((((f >> 23) & 0xFF) - 112) << 10) | ((f >> 13) & 0x3FF));
}

/* half(gelu(h)) for every half h, as ggml's table: a pass's GeGLU then costs a lookup, not a tanhf, per value */
static float gelu_table[65536];
static pthread_once_t gelu_once = PTHREAD_ONCE_INIT;
static void gelu_fill(void) {
    for (int i = 0; i < 65536; i++) gelu_table[i] = round_to_half(gelu_tanh(half_to_float((uint16_t)i)));
}

void vs_gelu_mul(const float *g, const float *u, int64_t n, float *out) {
    pthread_once(&gelu_once, gelu_fill);
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n >= 16384)
    for (int64_t i = 0; i < n; i++)
        out[i] = g[i] <= -10.0f ? 0.0f : g[i] >= 10.0f ? g[i] * u[i] : gelu_table[half_bits(round_to_half(g[i]))] * u[i];
}
