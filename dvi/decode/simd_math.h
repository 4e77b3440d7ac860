/* Vector math shared by dvi's C kernels (AVX2 + FMA), included by attention_kernel.c, vocab_kernel.c and the rows
   kernels' rows_fused.h: the same loads, exp and horizontal sum wherever a kernel needs them (a fixed order of operations: the same result for the
   same inputs). */
#ifndef DVI_SIMD_MATH_H
#define DVI_SIMD_MATH_H
#include <immintrin.h>
#include <stdint.h>

/* 8 or 1 values of fp32 or bf16 rows as fp32 (bf16 widened exactly) */
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
static inline float load1_f32(const float* p) { return *p; }
static inline float load1_bf16(const uint16_t* p) {
    union { uint32_t u; float f; } b = {(uint32_t)*p << 16};
    return b.f;
}

/* exp(x) for x <= 0 (Cephes' polynomial, as in the SSE/AVX math libraries): ~2 ulp, the same result for the same x */
static inline __m256 exp_neg(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
    x = _mm256_max_ps(x, lo);
    __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, c1, x);
    x = _mm256_fnmadd_ps(fx, c2, x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, z, x);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* the largest of x[0 .. n - 1] (exact in any order) */
static inline float max_of(const float* x, int64_t n) {
    int64_t j = 0;
    float m = x[0];
    if (n >= 8) {
        __m256 mv = _mm256_loadu_ps(x);
        for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

#endif
