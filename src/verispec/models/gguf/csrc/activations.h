/* One part of kernels.c, which includes the parts in order as one translation unit (see there). A row of float
 * activations to int8 blocks with their scales and sums, as llama.cpp quantizes them. */

/* ------------------------------------------------------------------ activations */

/* x rounded to IEEE half precision (nearest, ties to even; past 65504 inf; below 2^-14 to multiples of 2^-24), as a
 * float: what llama.cpp's FP32_TO_FP16 keeps of a value (F16C's vcvtps2ph), in plain float and integer operations. */
static inline float round_to_half(float x) {
    float a = fabsf(x);
    if (!(a < 65520.0f)) return a != a ? x : copysignf(INFINITY, x); /* NaN stays; 65520 and up round past 65504 */
    if (a < 6.103515625e-05f) { /* half's subnormals: multiples of 2^-24 (x 2^24 is exact and below 2^10) */
        float v = (a * 16777216.0f + 12582912.0f) - 12582912.0f;
        return copysignf(v / 16777216.0f, x);
    }
    uint32_t bits;
    memcpy(&bits, &a, 4);
    bits += 0x0FFFu + ((bits >> 13) & 1u); /* 10 mantissa bits kept, the rest rounded to nearest, ties to even */
    bits &= ~0x1FFFu;
    float r;
    memcpy(&r, &bits, 4);
    return copysignf(r, x);
}

/* One block (a multiple of 16 values) to int8: amax = max |x| (exact in any order), inv = 127 / amax,
 * q = round half to even (x inv), clamped to +-127; returns d = amax / 127, rounded to half precision for blocks
 * of 32 (llama.cpp's block_q8_0 keeps its scale as a half, its block_q8_K as a float; its x86 code quantizes
 * with 127 / amax and rounds to even as here), so that a pass's arithmetic is llama.cpp's for every weight type.
 * Written in 16 lanes so that the compiler vectorises every loop. */
static inline float quantize_block(const float *xb, int block, int8_t *qb) {
    float lane[16] = {0};
    for (int l0 = 0; l0 < block; l0 += 16)
        for (int l = 0; l < 16; l++) {
            float a = fabsf(xb[l0 + l]);
            lane[l] = a > lane[l] ? a : lane[l];
        }
    float amax = 0.0f;
    for (int l = 0; l < 16; l++) amax = lane[l] > amax ? lane[l] : amax;
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    if (isinf(inv)) inv = 0.0f; /* amax below 127 / FLT_MAX: the block quantizes to zeros */
    for (int l = 0; l < block; l++) {
        /* round half to even: |x inv| <= 127 < 2^22, so adding and removing 1.5 * 2^23 rounds it
         * exactly as nearbyintf does (which the compiler does not vectorise) */
        float v = (xb[l] * inv + 12582912.0f) - 12582912.0f;
        v = v > 127.0f ? 127.0f : v;
        v = v < -127.0f ? -127.0f : v;
        qb[l] = (int8_t)(int32_t)v;
    }
    return block == 32 ? round_to_half(amax / 127.0f) : amax / 127.0f;
}

/* x (n, k) float32 -> q (n, k) int8, d (n, k / block) float32, bsum (n, k / 16) int32. The arithmetic is
 * the contract that verispec.models.gguf.reference.quantize_activations states. block: a positive multiple
 * of 16 that divides k (else VS_EINVAL). */
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
int vs_quantize_rows(const float *x, int64_t n, int64_t k, int block, int8_t *q, float *d, int32_t *bsum) {
    if (block <= 0 || block % 16 || n < 0 || k < 0 || k % block) return VS_EINVAL;
    /* rows are independent: several tokens split over the threads (each row's bits are its own) */
#pragma omp parallel for schedule(static) num_threads(vs_threads) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b0 = 0; b0 < k; b0 += block)
            d[i * (k / block) + b0 / block] = quantize_block(x + i * k + b0, block, q + i * k + b0);
        for (int64_t j = 0; j < k / 16; j++) {
            int32_t sum = 0;
            for (int l = 0; l < 16; l++) sum += q[i * k + 16 * j + l];
            bsum[i * (k / 16) + j] = sum;
        }
    }
    return VS_OK;
}
