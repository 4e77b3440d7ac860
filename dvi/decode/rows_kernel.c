/* y = x @ w^T in fp32 for a few rows of x (a decode step, a verify), streaming w once (AVX2 + FMA).

   Built and loaded by dvi/decode/rows_kernel.py. Each output y[m, n] is one accumulator per 8-float lane over k in
   order, then a fixed horizontal sum, whatever M is and however the rows are blocked: a row rounds the same alone
   as beside others. */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

/* y[m0 .. m0+MB, n0 .. n0+NB): NB rows of w loaded once per 8 columns, multiplied into MB rows of x, while the
   rows 2 NB further on are prefetched (the hardware prefetcher alone left a few-row product well below the
   weights' streaming rate) */
#define BLOCK(NB, MB)                                                                                    \
    static void block_##NB##_##MB(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K,      \
                                  float* y, int64_t ldy, int64_t m0, int64_t n0) {                       \
        __m256 acc[NB][MB];                                                                              \
        const float* ahead[NB];                                                                          \
        for (int i = 0; i < NB; i++) {                                                                   \
            int64_t r = n0 + 2 * NB + i;                                                                 \
            ahead[i] = w + (r < N ? r : N - 1) * K;                                                      \
        }                                                                                                \
        for (int i = 0; i < NB; i++)                                                                     \
            for (int j = 0; j < MB; j++) acc[i][j] = _mm256_setzero_ps();                                \
        const int64_t k8 = K & ~(int64_t)7;                                                              \
        for (int64_t k = 0; k < k8; k += 8) {                                                            \
            __m256 wv[NB];                                                                               \
            for (int i = 0; i < NB; i++) wv[i] = _mm256_loadu_ps(w + (n0 + i) * K + k);                 \
            for (int i = 0; i < NB; i++) _mm_prefetch((const char*)(ahead[i] + k), _MM_HINT_T0);        \
            for (int j = 0; j < MB; j++) {                                                               \
                __m256 xv = _mm256_loadu_ps(x + (m0 + j) * ldx + k);                                     \
                for (int i = 0; i < NB; i++) acc[i][j] = _mm256_fmadd_ps(wv[i], xv, acc[i][j]);          \
            }                                                                                            \
        }                                                                                                \
        for (int i = 0; i < NB; i++)                                                                     \
            for (int j = 0; j < MB; j++) {                                                               \
                float s = hsum(acc[i][j]);                                                               \
                for (int64_t k = k8; k < K; k++) s = __builtin_fmaf(w[(n0 + i) * K + k], x[(m0 + j) * ldx + k], s); \
                y[(m0 + j) * ldy + n0 + i] = s;                                                          \
            }                                                                                            \
    }

BLOCK(4, 1)
BLOCK(4, 2)
BLOCK(4, 3)
BLOCK(1, 1)
BLOCK(1, 2)
BLOCK(1, 3)

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w [N, K]^T, w contiguous */
void dvi_rows_linear_f32(const float* x, int64_t ldx, const float* w, int64_t N, int64_t K, float* y, int64_t ldy,
                         int64_t M) {
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) block_4_3(x, ldx, w, N, K, y, ldy, m, n);
        if (M - m == 2) block_4_2(x, ldx, w, N, K, y, ldy, m, n);
        else if (M - m == 1) block_4_1(x, ldx, w, N, K, y, ldy, m, n);
    }
    for (; n < N; n++) {
        int64_t m = 0;
        for (; m + 3 <= M; m += 3) block_1_3(x, ldx, w, N, K, y, ldy, m, n);
        if (M - m == 2) block_1_2(x, ldx, w, N, K, y, ldy, m, n);
        else if (M - m == 1) block_1_1(x, ldx, w, N, K, y, ldy, m, n);
    }
}
