/* A step's passes over the vocabulary on the CPU (AVX2 + FMA), fp32 or bf16 logits: the greedy token, and for the
   emitted positions the softmax's log-denominator and the k largest logits.

   Built and loaded by dvi/decode/vocab_kernel.py. Every step scores each row's next token over the whole vocabulary
   (49,152 logits for SmolLM2) and logs, per emitted token, its log-prob and the target's top k (the feedback the
   drafter learns from): torch runs that as separate calls (max with indices, a copy to fp32, logsumexp, topk), each
   its own pass and ~2 ms of a 16-row step. Here one pass finds the argmax, one more the log-denominator and the top k
   together (the top k kept sorted while the logits stream past a threshold that rises as they do).

   Rows are [rows, v] with row stride `stride` (elements), last dim contiguous. Ties: the argmax is the first of
   equal maxima (torch's `max(-1).indices`); the top k ranks equal logits by index, lowest first. NaN logits are
   never chosen (a target with finite weights has none). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "simd_math.h"

/* one more candidate for the top k, sorted descending in vals / ids (n held); an equal value goes after those held,
   which came earlier in the row */
static inline int64_t keep_top(float* vals, int64_t* ids, int64_t n, int64_t k, float x, int64_t id) {
    int64_t at = n < k ? n : k - 1;
    while (at > 0 && vals[at - 1] < x) {
        vals[at] = vals[at - 1];
        ids[at] = ids[at - 1];
        at--;
    }
    vals[at] = x;
    ids[at] = id;
    return n < k ? n + 1 : k;
}

#define VOCAB(SUFFIX, T, LOAD, LOAD1)                                                                    \
    void dvi_argmax_##SUFFIX(const T* x, int64_t rows, int64_t v, int64_t stride, int64_t* out) {      \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const T* xr = x + r * stride;                                                               \
            float best = -INFINITY;                                                                     \
            int64_t at = 0, j = 0;                                                                      \
            if (v >= 8) { /* lanes keep their running max and its first index */                       \
                __m256 mv = _mm256_set1_ps(-INFINITY);                                                  \
                __m256i iv = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);   \
                const __m256i step = _mm256_set1_epi32(8);                                              \
                for (; j + 8 <= v; j += 8) {                                                            \
                    const __m256 xv = LOAD(xr + j);                                                     \
                    const __m256 gt = _mm256_cmp_ps(xv, mv, _CMP_GT_OQ);                                \
                    mv = _mm256_blendv_ps(mv, xv, gt);                                                  \
                    iv = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(iv), _mm256_castsi256_ps(idx), gt)); \
                    idx = _mm256_add_epi32(idx, step);                                                  \
                }                                                                                       \
                float m[8], bestv = -INFINITY;                                                          \
                int32_t ix[8];                                                                          \
                _mm256_storeu_ps(m, mv);                                                                \
                _mm256_storeu_si256((__m256i*)ix, iv);                                                  \
                int64_t bi = v;                                                                         \
                for (int l = 0; l < 8; l++)                                                             \
                    if (m[l] > bestv || (m[l] == bestv && ix[l] < bi)) { bestv = m[l]; bi = ix[l]; }    \
                if (bi < v) { best = bestv; at = bi; }                                                  \
            }                                                                                           \
            for (; j < v; j++) {                                                                        \
                const float xj = LOAD1(xr + j);                                                         \
                if (xj > best) { best = xj; at = j; }                                                   \
            }                                                                                           \
            out[r] = at;                                                                                \
        }                                                                                               \
    }                                                                                                   \
                                                                                                        \
    void dvi_vocab_stats_##SUFFIX(const T* x, int64_t rows, int64_t v, int64_t stride, int64_t k,      \
                                  float* lse, float* top_vals, int64_t* top_ids) {                      \
        for (int64_t r = 0; r < rows; r++) {                                                            \
            const T* xr = x + r * stride;                                                               \
            float* tv = top_vals + r * k;                                                               \
            int64_t* ti = top_ids + r * k;                                                              \
            float m = -INFINITY;                                                                        \
            int64_t j = 0;                                                                              \
            if (v >= 8) {                                                                               \
                __m256 mv = LOAD(xr);                                                                   \
                for (j = 8; j + 8 <= v; j += 8) mv = _mm256_max_ps(mv, LOAD(xr + j));                  \
                float t[8];                                                                             \
                _mm256_storeu_ps(t, mv);                                                                \
                for (int l = 0; l < 8; l++) m = t[l] > m ? t[l] : m;                                    \
            }                                                                                           \
            for (; j < v; j++) m = LOAD1(xr + j) > m ? LOAD1(xr + j) : m;                               \
            const __m256 mm = _mm256_set1_ps(m);                                                        \
            __m256 sum = _mm256_setzero_ps();                                                           \
            int64_t held = 0;                                                                           \
            float thr = -INFINITY;                                                                      \
            for (j = 0; j + 8 <= v; j += 8) {                                                           \
                const __m256 xv = LOAD(xr + j);                                                         \
                sum = _mm256_add_ps(sum, exp_neg(_mm256_sub_ps(xv, mm)));                               \
                int mask = _mm256_movemask_ps(_mm256_cmp_ps(xv, _mm256_set1_ps(thr), _CMP_GT_OQ));      \
                if (mask) {                                                                             \
                    float t[8];                                                                         \
                    _mm256_storeu_ps(t, xv);                                                            \
                    for (int l = 0; l < 8; l++)                                                         \
                        if (t[l] > thr) {                                                               \
                            held = keep_top(tv, ti, held, k, t[l], j + l);                              \
                            if (held == k) thr = tv[k - 1];                                             \
                        }                                                                               \
                }                                                                                       \
            }                                                                                           \
            float s = hsum(sum);                                                                        \
            if (j < v) { /* the tail, padded with -inf's exp (0) */                                      \
                float e[8], ex[8];                                                                      \
                for (int l = 0; l < 8; l++) e[l] = j + l < v ? LOAD1(xr + j + l) - m : -1e30f;          \
                _mm256_storeu_ps(ex, exp_neg(_mm256_loadu_ps(e)));                                      \
                for (int64_t l = 0; j + l < v; l++) {                                                   \
                    s += ex[l];                                                                         \
                    const float xj = LOAD1(xr + j + l);                                                 \
                    if (xj > thr) {                                                                     \
                        held = keep_top(tv, ti, held, k, xj, j + l);                                    \
                        if (held == k) thr = tv[k - 1];                                                 \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            lse[r] = m + logf(s);                                                                       \
        }                                                                                               \
    }

VOCAB(f32, float, load8_f32, load1_f32)
VOCAB(bf16, uint16_t, load8_bf16, load1_bf16)
