/* Decode attention over a slot cache on the CPU (AVX2 + FMA; attention_kernel_avx512.c widens it where the CPU has
   AVX-512), fp32 or bf16 caches: each query alone over exactly the columns it sees.

   Built and loaded by dvi/decode/attention_kernel.py. A decode step, a verify or a drafter step scores a few queries a
   row, each over its row's cached keys and values: torch's SDPA pays a call's setup for that, a mask over the padded
   columns, and rounds a query with the queries and masked columns beside it. Here query i reads batch row rows[i]
   and its columns 0 .. visible[i] - 1 (then, for a draft tree's node, its ancestors' and its own columns), nothing
   else: a query rounds the same whatever else the forward scores, so a verify row or a tree node equals the
   one-token step it stands for, and a batch row its lone decode.

   Per query: the scores of every head (one pass over its row's keys, each key loaded once for its group of query
   heads), a softmax in fp32 (max subtracted, exp vectorized), then the values weighted in fp32 and rounded to the
   cache's dtype once. Layouts are strided: q [n, heads, d] with row stride q_stride; keys and values [rows, kv_heads,
   columns, d] with strides row_stride, head_stride, col_stride (views of the slot cache, no copy); out [n, heads * d]. */
#ifndef DVI_ATTENTION_AVX2_H
#define DVI_ATTENTION_AVX2_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd_math.h"

/* a column's d entries of one head, fetched towards the core ahead of their use (the cache holds a column's
   keys and values of every head together, columns of a row one after the other, rows far apart) */
#define AHEAD 8
#define VB 32 /* columns a block of the values pass (its accumulators parked in scratch between blocks) */
static inline void prefetch(const void* p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)p + b, _MM_HINT_T0);
}

/* the 8 sums of a0 .. a7's lanes, as one vector (a fixed order of adds: the same result for the same inputs) */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3), t2 = _mm256_hadd_ps(a4, a5);
    const __m256 t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* lanes: 0 1 2 3 | 0 1 2 3 and 4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* a column's d entries as fp32: an fp32 cache's own row, a bf16 one's converted into buf (once for the group) */
static inline const float* row_f32(const float* x, float* buf, int64_t d) { (void)buf; (void)d; return x; }
static inline const float* row_bf16(const uint16_t* x, float* buf, int64_t d) {
    for (int64_t c = 0; c < d; c += 8) _mm256_store_ps(buf + c, load8_bf16(x + c));
    return buf;
}
static inline void store_f32(float* y, const float* x, int64_t n) { memcpy(y, x, n * sizeof(float)); }
static inline void store_bf16(uint16_t* y, const float* x, int64_t n) { /* round to nearest even */
    for (int64_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, x + i, sizeof b);
        y[i] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    }
}

/* query i's j-th visible column: its prefix 0 .. P - 1, then its extra columns (a draft tree node's ancestors and
   itself, in depth order: the order and count of the one-token step it stands for) */
#define COL(j) ((j) < P ? (j) : ex[(j) - P])

#define MAX_D 256

/* the keys and values of a row's columns from .. to - 1 (COL: its P visible ones, then ex[]), of every kv head, fetched
   towards the core; krow / vrow the row's keys and values, `size` bytes an element */
static inline void prefetch_columns(const void* krow, const void* vrow, int64_t size, int64_t from, int64_t to, int64_t P,
                                    const int64_t* ex, int64_t kv_heads, int64_t head_stride, int64_t col_stride,
                                    int64_t d) {
    for (int64_t r = from; r < to; r++)
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t at = (kh * head_stride + COL(r) * col_stride) * size;
            prefetch((const char*)krow + at, d * size);
            prefetch((const char*)vrow + at, d * size);
        }
}

/* A row's keys and values come from memory once a step, for its first query: read column by column beside the
   arithmetic they streamed at a third of what one core reads (a column's lines lie 0.75-1.5 KB apart, past what the
   hardware prefetchers follow), so every line of the row's first P columns is asked for into L2 in one burst first.
   Asking for the next row's behind this row's arithmetic measured slower: the burst stalls the core either way. */
static inline void prefetch_row(const void* k, const void* v, int64_t row, int64_t row_stride, int64_t size,
                                   int64_t P, int64_t kv_heads, int64_t head_stride, int64_t col_stride, int64_t d) {
    const char* kr = (const char*)k + row * row_stride * size;
    const char* vr = (const char*)v + row * row_stride * size;
    for (int64_t r = 0; r < P; r++)
        for (int64_t kh = 0; kh < kv_heads; kh++) {
            const int64_t at = (kh * head_stride + r * col_stride) * size;
            for (int64_t b = 0; b < d * size; b += 64) {
                _mm_prefetch(kr + at + b, _MM_HINT_T2);
                _mm_prefetch(vr + at + b, _MM_HINT_T2);
            }
        }
}

/* before query i's scores, where it is its row's first (a row's further queries, a chain's or a tree's, find its
   columns in L2) */
#define PREFETCH_ROW(i)                                                                                          \
    if ((i) == 0 || rows[(i)] != rows[(i) - 1])                                                                 \
        prefetch_row(k, v, rows[(i)], row_stride, sizeof(*k), visible[(i)], kv_heads, head_stride, col_stride, d);

/* each head's scores s [heads][L] through a softmax in place, fp32 (the max subtracted, exp vectorized, the tail padded
   with -inf's exp, 0); 1 / each head's sum into inv[h] */
static inline void softmax_heads(float* s, int64_t heads, int64_t L, float* inv) {
    for (int64_t h = 0; h < heads; h++) {
        float* sh = s + h * L;
        const float m = max_of(sh, L); /* exact in any order */
        const __m256 mv = _mm256_set1_ps(m);
        __m256 sum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) {
            __m256 p = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
            _mm256_storeu_ps(sh + j, p);
            sum = _mm256_add_ps(sum, p);
        }
        if (j < L) {
            float t[8] __attribute__((aligned(32)));
            for (int64_t r = 0; r < 8; r++) t[r] = j + r < L ? sh[j + r] - m : -1e30f;
            __m256 p = exp_neg(_mm256_load_ps(t));
            _mm256_store_ps(t, p);
            for (int64_t r = 0; j + r < L; r++) sh[j + r] = t[r];
            sum = _mm256_add_ps(sum, _mm256_blendv_ps(_mm256_setzero_ps(), p,
                                                      _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                                                    _mm256_set1_ps((float)(L - j)), _CMP_LT_OQ)));
        }
        inv[h] = 1.0f / hsum(sum);
    }
}

/* scratch: qf [heads][d] a query's heads in fp32, acc [heads][d] their weighted values, then s [heads][L] their
   scores; d a multiple of 8. A query walks its columns once for all kv heads, 8 columns a block (a column's keys,
   then its values, of every head lie together in the cache): a bf16 block is converted to fp32 once into kf and
   shared by the kv head's group of query heads. Each head's sums run in a fixed order whatever the blocking (its
   scores chunk by chunk, its values column by column, accumulators parked in acc between blocks) */
#define ATTEND(NAME, T, LOAD, STORE, ROW)                                                                  \
    void NAME(const T* q, int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t d, const T* k, const T* v, \
              int64_t row_stride, int64_t head_stride, int64_t col_stride, const int64_t* rows,             \
              const int64_t* visible, const int64_t* extra, int64_t extra_stride, const int64_t* n_extra,  \
              int64_t n, float scale, T* out, float* scratch) {                                            \
        const int64_t g = heads / kv_heads, chunks = d / 8;                                                \
        float* qf = scratch;                                                                               \
        float* acc = scratch + heads * d;                                                                  \
        float* s = scratch + 2 * heads * d;                                                                \
        float kf[VB * MAX_D] __attribute__((aligned(32)));                                                 \
        for (int64_t i = 0; i < n; i++) {                                                                  \
            const int64_t P = visible[i], L = P + n_extra[i];                                              \
            const int64_t* ex = extra + i * extra_stride;                                                  \
            PREFETCH_ROW(i)                                                                                \
            const T* krow = k + rows[i] * row_stride;                                                      \
            const T* vrow = v + rows[i] * row_stride;                                                      \
            for (int64_t h = 0; h < heads; h++)                                                            \
                for (int64_t c = 0; c < chunks; c++)                                                       \
                    _mm256_storeu_ps(qf + h * d + 8 * c, LOAD(q + i * q_stride + h * d + 8 * c));          \
            for (int64_t j = 0; j < L; j += 8) { /* scores, 8 keys at a time: 8 independent chains */      \
                const int64_t rem = L - j < 8 ? L - j : 8;                                                 \
                prefetch_columns(krow, vrow, sizeof(T), j + AHEAD, j + AHEAD + 8 < L ? j + AHEAD + 8 : L, P, ex,   \
                                 kv_heads, head_stride, col_stride, d); /* keys and values to come */        \
                for (int64_t kh = 0; kh < kv_heads; kh++) {                                                \
                    const float* kr[8];                                                                    \
                    for (int64_t r = 0; r < rem; r++)                                                      \
                        kr[r] = ROW(krow + kh * head_stride + COL(j + r) * col_stride, kf + r * d, d);     \
                    for (int64_t h = kh * g; h < (kh + 1) * g; h++) {                                      \
                        const float* qh = qf + h * d;                                                      \
                        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                        for (int64_t c = 0; c < chunks; c++) {                                             \
                            const __m256 qv = _mm256_loadu_ps(qh + 8 * c);                                 \
                            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[0] + 8 * c), a0);                  \
                            if (rem > 1) a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[1] + 8 * c), a1);     \
                            if (rem > 2) a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[2] + 8 * c), a2);     \
                            if (rem > 3) a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[3] + 8 * c), a3);     \
                            if (rem > 4) a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[4] + 8 * c), a4);     \
                            if (rem > 5) a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[5] + 8 * c), a5);     \
                            if (rem > 6) a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[6] + 8 * c), a6);     \
                            if (rem > 7) a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[7] + 8 * c), a7);     \
                        }                                                                                  \
                        /* every key's score by the same sum tree, wherever it sits in a block */         \
                        const __m256 sc = _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale)); \
                        if (rem == 8) {                                                                    \
                            _mm256_storeu_ps(s + h * L + j, sc);                                           \
                        } else {                                                                           \
                            float t[8] __attribute__((aligned(32)));                                       \
                            _mm256_store_ps(t, sc);                                                        \
                            for (int64_t r = 0; r < rem; r++) s[h * L + j + r] = t[r];                     \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            softmax_heads(s, heads, L, qf); /* the queries are spent: qf[0 .. heads - 1] holds the inverses */ \
            if (i + 1 < n) /* the next query's first columns, behind this one's values */                  \
                prefetch_columns(k + rows[i + 1] * row_stride, v + rows[i + 1] * row_stride, sizeof(T), 0,        \
                                 AHEAD < visible[i + 1] ? AHEAD : visible[i + 1], visible[i + 1], ex, kv_heads,    \
                                 head_stride, col_stride, d);                                              \
            memset(acc, 0, (size_t)(heads * d) * sizeof(float));                                           \
            for (int64_t j = 0; j < L; j += VB) { /* values, VB columns a block, each head column by column */ \
                const int64_t rem = L - j < VB ? L - j : VB;                                               \
                for (int64_t kh = 0; kh < kv_heads; kh++) {                                                \
                    const float* vr[VB];                                                                   \
                    for (int64_t r = 0; r < rem; r++)                                                      \
                        vr[r] = ROW(vrow + kh * head_stride + COL(j + r) * col_stride, kf + r * d, d);     \
                    for (int64_t h = kh * g; h < (kh + 1) * g; h++) {                                      \
                        const float* sh = s + h * L + j;                                                   \
                        for (int64_t c = 0; c < chunks; c += 8) { /* 8 chunks (64 floats) a pass */        \
                            const int64_t w = chunks - c < 8 ? chunks - c : 8;                             \
                            float* ac = acc + h * d + 8 * c;                                               \
                            __m256 a0 = _mm256_loadu_ps(ac), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0; \
                            if (w > 1) a1 = _mm256_loadu_ps(ac + 8);                                       \
                            if (w > 2) a2 = _mm256_loadu_ps(ac + 16);                                      \
                            if (w > 3) a3 = _mm256_loadu_ps(ac + 24);                                      \
                            if (w > 4) a4 = _mm256_loadu_ps(ac + 32);                                      \
                            if (w > 5) a5 = _mm256_loadu_ps(ac + 40);                                      \
                            if (w > 6) a6 = _mm256_loadu_ps(ac + 48);                                      \
                            if (w > 7) a7 = _mm256_loadu_ps(ac + 56);                                      \
                            for (int64_t r = 0; r < rem; r++) {                                            \
                                const __m256 p = _mm256_broadcast_ss(sh + r);                              \
                                const float* vj = vr[r] + 8 * c;                                           \
                                a0 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj), a0);                          \
                                if (w > 1) a1 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8), a1);           \
                                if (w > 2) a2 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 16), a2);          \
                                if (w > 3) a3 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 24), a3);          \
                                if (w > 4) a4 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 32), a4);          \
                                if (w > 5) a5 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 40), a5);          \
                                if (w > 6) a6 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 48), a6);          \
                                if (w > 7) a7 = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 56), a7);          \
                            }                                                                              \
                            _mm256_storeu_ps(ac, a0);                                                      \
                            if (w > 1) _mm256_storeu_ps(ac + 8, a1);                                       \
                            if (w > 2) _mm256_storeu_ps(ac + 16, a2);                                      \
                            if (w > 3) _mm256_storeu_ps(ac + 24, a3);                                      \
                            if (w > 4) _mm256_storeu_ps(ac + 32, a4);                                      \
                            if (w > 5) _mm256_storeu_ps(ac + 40, a5);                                      \
                            if (w > 6) _mm256_storeu_ps(ac + 48, a6);                                      \
                            if (w > 7) _mm256_storeu_ps(ac + 56, a7);                                      \
                        }                                                                                  \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int64_t h = 0; h < heads; h++) {                                                          \
                float o[MAX_D] __attribute__((aligned(32)));                                               \
                const __m256 iv = _mm256_set1_ps(qf[h]);                                                   \
                for (int64_t c = 0; c < chunks; c++)                                                       \
                    _mm256_store_ps(o + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + 8 * c), iv));   \
                STORE(out + i * heads * d + h * d, o, d);                                                  \
            }                                                                                              \
        }                                                                                                  \
    }

#endif
