/* What a rows kernel folds into one call around its matmul (rows_kernel.c, rows_kernel_avx512.c, rows_kernel_bf16.c,
   rows_kernel_amx.c):
   a decoder layer's RMS norm or SwiGLU before it, its residual add after. At the few rows of a decode step torch's
   calls for those cost their per-call overhead, not their arithmetic (a norm is six calls, ~10 us whatever the rows);
   here they ride on the call the matmul makes anyway.

   AVX2 + FMA, 8 lanes, whichever build includes it, so every build of a dtype computes the same bits; each row from
   its own input row alone, in a fixed order. Numerics follow Hugging Face's Llama modules: the norm's mean of squares
   in fp32, x * rsqrt(mean + eps) rounded to the rows' dtype before the weight multiplies it; silu(g) rounded to the
   dtype before up multiplies it; the residual add rounded once, as torch adds two tensors of the dtype. */
#ifndef DVI_ROWS_FUSED_H
#define DVI_ROWS_FUSED_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_math.h"

static inline __m256 fz_round8_f32(__m256 x) { return x; }
static inline float fz_round1_f32(float x) { return x; }
static inline void fz_store8_f32(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
static inline void fz_store1_f32(float* p, float x) { *p = x; }

/* to bf16 by round-to-nearest-even, kept as fp32 (the low 16 bits zero); finite inputs */
static inline __m256 fz_round8_bf16(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline float fz_round1_bf16(float x) {
    union { float f; uint32_t u; } b = {x};
    b.u = (b.u + 0x7FFFu + ((b.u >> 16) & 1u)) & 0xFFFF0000u;
    return b.f;
}
static inline void fz_store8_bf16(uint16_t* p, __m256 x) {
    __m256i u = _mm256_srli_epi32(_mm256_castps_si256(fz_round8_bf16(x)), 16);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}
static inline void fz_store1_bf16(uint16_t* p, float x) {
    union { float f; uint32_t u; } b = {fz_round1_bf16(x)};
    *p = (uint16_t)(b.u >> 16);
}

/* silu(x) = x * sigmoid(x), exp taken of -|x| (exp_neg's domain) */
static inline __m256 fz_silu8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 e = exp_neg(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));
    __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));
    return _mm256_mul_ps(x, _mm256_blendv_ps(pos, _mm256_sub_ps(one, pos), x));
}
static inline float fz_silu1(float x) {
    float v[8] = {x, 0, 0, 0, 0, 0, 0, 0}, r[8];
    _mm256_storeu_ps(r, fz_silu8(_mm256_loadu_ps(v)));
    return r[0];
}

/* per-thread scratch `slot` of at least `bytes`; NULL if it cannot grow. Slot 0: the prologue's rows; slot 1: a
   linear's own (the AMX build's padded rows, read while slot 0 holds its input) */
static inline void* fz_scratch(int slot, size_t bytes) {
    static __thread void* buf[2] = {0, 0};
    static __thread size_t cap[2] = {0, 0};
    if (bytes > cap[slot]) {
        void* p = realloc(buf[slot], bytes);
        if (!p) return 0;
        buf[slot] = p;
        cap[slot] = bytes;
    }
    return buf[slot];
}

/* NAME(x, ldx, K, M, norm_w, eps, swiglu, out): the work before a layer's matmul, into out [M, K]: x's rows RMS-normed
   and scaled by norm_w (norm_w not NULL), or silu(gate) * up of x's [gate | up] rows of 2K (swiglu). ROWS_FUSED runs it
   into its scratch; alone, it serves forwards whose matmuls another library runs (oneDNN's packed weights). */
#define ROWS_PROLOGUE(NAME, T, SFX)                                                                                  \
    void NAME(const T* x, int64_t ldx, int64_t K, int64_t M, const T* norm_w, float eps, int32_t swiglu, T* out) {  \
        for (int64_t i = 0; i < M; i++) {                                                                          \
            const T* xi = x + i * ldx;                                                                             \
            T* si = out + i * K;                                                                                   \
            int64_t j = 0;                                                                                         \
            if (norm_w) {                                                                                          \
                __m256 acc = _mm256_setzero_ps();                                                                  \
                for (; j + 8 <= K; j += 8) {                                                                       \
                    __m256 v = load8_##SFX(xi + j);                                                             \
                    acc = _mm256_fmadd_ps(v, v, acc);                                                              \
                }                                                                                                  \
                float ss = hsum(acc);                                                                              \
                for (; j < K; j++) ss = fmaf(load1_##SFX(xi + j), load1_##SFX(xi + j), ss);                  \
                const float r = 1.0f / sqrtf(ss / (float)K + eps);                                                 \
                const __m256 rv = _mm256_set1_ps(r);                                                               \
                for (j = 0; j + 8 <= K; j += 8)                                                                    \
                    fz_store8_##SFX(si + j, _mm256_mul_ps(fz_round8_##SFX(_mm256_mul_ps(load8_##SFX(xi + j), rv)), \
                                                          load8_##SFX(norm_w + j)));                            \
                for (; j < K; j++)                                                                                 \
                    fz_store1_##SFX(si + j, fz_round1_##SFX(load1_##SFX(xi + j) * r) * load1_##SFX(norm_w + j)); \
            } else if (swiglu) {                                                                                   \
                const T* u = xi + K;                                                                               \
                for (; j + 8 <= K; j += 8)                                                                         \
                    fz_store8_##SFX(si + j, _mm256_mul_ps(fz_round8_##SFX(fz_silu8(load8_##SFX(xi + j))),       \
                                                          load8_##SFX(u + j)));                                 \
                for (; j < K; j++)                                                                                 \
                    fz_store1_##SFX(si + j, fz_round1_##SFX(fz_silu1(load1_##SFX(xi + j))) * load1_##SFX(u + j)); \
            }                                                                                                      \
        }                                                                                                          \
    }

/* NAME(x, ldx, panels, N, K, y, ldy, M, norm_w, eps, swiglu, res, ldres): LINEAR's y = x' @ w^T where x' is x's rows
   through PROLOGUE (ROWS_PROLOGUE's: normed by norm_w, or swiglu), or x; then y += res (res not NULL, row stride
   ldres). Returns 0, or -1 where the scratch could not grow (y unset). */
#define ROWS_FUSED(NAME, LINEAR, PROLOGUE, T, SFX)                                                                   \
    int NAME(const T* x, int64_t ldx, const T* panels, int64_t N, int64_t K, T* y, int64_t ldy, int64_t M,         \
             const T* norm_w, float eps, int32_t swiglu, const T* res, int64_t ldres) {                          \
        const T* src = x;                                                                                          \
        int64_t ld = ldx;                                                                                          \
        if (norm_w || swiglu) {                                                                                    \
            T* s = (T*)fz_scratch(0, (size_t)(M * K) * sizeof(T) + 64);                                            \
            if (!s) return -1;                                                                                     \
            PROLOGUE(x, ldx, K, M, norm_w, eps, swiglu, s);                                                        \
            src = s;                                                                                               \
            ld = K;                                                                                                \
        }                                                                                                          \
        if (LINEAR(src, ld, panels, N, K, y, ldy, M)) return -1;                                                   \
        if (res) {                                                                                                 \
            for (int64_t i = 0; i < M; i++) {                                                                      \
                T* yi = y + i * ldy;                                                                               \
                const T* ri = res + i * ldres;                                                                     \
                int64_t j = 0;                                                                                     \
                for (; j + 8 <= N; j += 8)                                                                         \
                    fz_store8_##SFX(yi + j, _mm256_add_ps(load8_##SFX(yi + j), load8_##SFX(ri + j)));       \
                for (; j < N; j++) fz_store1_##SFX(yi + j, load1_##SFX(yi + j) + load1_##SFX(ri + j));      \
            }                                                                                                      \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

/* NAME(x, cos, sin, n, W, D, out, kv, slot, col, slots, capacity, q_width): rows of a fused q|k|v projection x [n, W]
   rotated per head of D as torch's x * cos + flip_halves(x) * sin computes it (each product and the sum rounded to
   the dtype; cos / sin [n, W], sin sign-folded), into out [n, W]; each row's k|v part (after its first q_width
   elements) also stored to the layer's cache kv [slots, capacity, W - q_width] at (slot[i], col[i]). Returns 0, or
   -1 (nothing written) where a slot or column lies outside the cache. */
#define ROPE_STORE(NAME, T, SFX)                                                                                     \
    int NAME(const T* x, const T* cos, const T* sin, int64_t n, int64_t W, int64_t D, T* out, T* kv,               \
             const int64_t* slot, const int64_t* col, int64_t slots, int64_t capacity, int64_t q_width) {         \
        const int64_t h = D / 2, kvw = W - q_width;                                                                \
        for (int64_t i = 0; i < n; i++)                                                                            \
            if (slot[i] < 0 || slot[i] >= slots || col[i] < 0 || col[i] >= capacity) return -1;                   \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            const T *xi = x + i * W, *ci = cos + i * W, *si = sin + i * W;                                         \
            T* oi = out + i * W;                                                                                   \
            for (int64_t s = 0; s + D <= W; s += D) {                                                              \
                int64_t j = 0;                                                                                     \
                for (; j + 8 <= h; j += 8) {                                                                       \
                    const int64_t a = s + j, b = s + h + j;                                                        \
                    __m256 xa = load8_##SFX(xi + a), xb = load8_##SFX(xi + b);                               \
                    fz_store8_##SFX(oi + a, _mm256_add_ps(fz_round8_##SFX(_mm256_mul_ps(xa, load8_##SFX(ci + a))), \
                                                          fz_round8_##SFX(_mm256_mul_ps(xb, load8_##SFX(si + a))))); \
                    fz_store8_##SFX(oi + b, _mm256_add_ps(fz_round8_##SFX(_mm256_mul_ps(xb, load8_##SFX(ci + b))), \
                                                          fz_round8_##SFX(_mm256_mul_ps(xa, load8_##SFX(si + b))))); \
                }                                                                                                  \
                for (; j < h; j++) {                                                                               \
                    const int64_t a = s + j, b = s + h + j;                                                        \
                    const float xa = load1_##SFX(xi + a), xb = load1_##SFX(xi + b);                          \
                    fz_store1_##SFX(oi + a, fz_round1_##SFX(xa * load1_##SFX(ci + a)) +                         \
                                                fz_round1_##SFX(xb * load1_##SFX(si + a)));                     \
                    fz_store1_##SFX(oi + b, fz_round1_##SFX(xb * load1_##SFX(ci + b)) +                         \
                                                fz_round1_##SFX(xa * load1_##SFX(si + b)));                     \
                }                                                                                                  \
            }                                                                                                      \
            memcpy(kv + (slot[i] * capacity + col[i]) * kvw, oi + q_width, (size_t)kvw * sizeof(T));               \
        }                                                                                                          \
        return 0;                                                                                                  \
    }

#endif
