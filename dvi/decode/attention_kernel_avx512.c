/* The decode attention kernel widened to AVX-512 (16 lanes, 32 registers), built where the CPU has it: the method of
   attention_avx2.h (each query alone over exactly its columns, a softmax in fp32, the values weighted in fp32 and
   rounded once), with fewer instructions a column. Scores: a block of 8 keys is widened to fp32 once for its kv head,
   then up to three of that kv head's query heads take their 8 dot products at once, 24 accumulators held in registers
   over head_dim 16 lanes at a time (the AVX2 method has room for one head's 8). Values: up to three heads weight a
   slice of 64 of head_dim over every column with their accumulators in registers (the AVX2 method parks them in
   scratch every 32 columns). Its own fixed order of sums, the same bits for the same inputs whatever else a forward
   scores; not the AVX2 build's bits (a process loads one build). head_dim not a multiple of 16 takes the AVX2 method,
   compiled in here too. */
#include "attention_avx2.h"

static ATTEND(avx2_attend_f32, float, load8_f32, store_f32, row_f32)
static ATTEND(avx2_attend_bf16, uint16_t, load8_bf16, store_bf16, row_bf16)

#define INLINE static inline __attribute__((always_inline))

INLINE __m512 load16_f32(const float* p) { return _mm512_loadu_ps(p); }
INLINE __m512 load16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* a key's d entries as fp32: an fp32 cache's own row, a bf16 one's widened into buf */
INLINE const float* row16_f32(const float* x, float* buf, int64_t chunks) { (void)buf; (void)chunks; return x; }
INLINE const float* row16_bf16(const uint16_t* x, float* buf, int64_t chunks) {
    for (int64_t c = 0; c < chunks; c++) _mm512_store_ps(buf + 16 * c, load16_bf16(x + 16 * c));
    return buf;
}

/* a 16-lane accumulator's two halves added: 8 lanes, then `hsum8` across 8 of them (one fixed tree) */
INLINE __m256 halves(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

/* G (1..3) heads' scaled scores against 8 keys kr[0..7] (fp32, `chunks` x 16), into s + x * L + j for head x; only
   the first `rem` are stored (the others are a tail's copies of kr[0]) */
INLINE void scores_g(const int G, const float* qh, int64_t d, const float* const* kr, int64_t chunks, float scale,
                     float* s, int64_t L, int64_t j, int64_t rem) {
    __m512 a[3][8];
#pragma GCC unroll 3
    for (int x = 0; x < G; x++)
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) a[x][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        __m512 qv[3];
#pragma GCC unroll 3
        for (int x = 0; x < G; x++) qv[x] = _mm512_loadu_ps(qh + x * d + 16 * c);
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) {
            const __m512 kv = _mm512_loadu_ps(kr[r] + 16 * c);
#pragma GCC unroll 3
            for (int x = 0; x < G; x++) a[x][r] = _mm512_fmadd_ps(qv[x], kv, a[x][r]);
        }
    }
#pragma GCC unroll 3
    for (int x = 0; x < G; x++) {
        const __m256 sc = _mm256_mul_ps(hsum8(halves(a[x][0]), halves(a[x][1]), halves(a[x][2]), halves(a[x][3]),
                                              halves(a[x][4]), halves(a[x][5]), halves(a[x][6]), halves(a[x][7])),
                                        _mm256_set1_ps(scale));
        float* sh = s + x * L + j;
        if (rem == 8) {
            _mm256_storeu_ps(sh, sc);
        } else {
            float t[8] __attribute__((aligned(32)));
            _mm256_store_ps(t, sc);
            for (int64_t r = 0; r < rem; r++) sh[r] = t[r];
        }
    }
}

/* G (1..3) heads' values over a slice of W (1..4) x 16 of head_dim: each head's probabilities s + x * L times its
   columns' values, in column order, times its 1 / sum inv[x], rounded into o + x * d */
#define VALUES(NAME, T, LOAD16, STORE)                                                                               \
    INLINE void NAME(const int G, const int W, const T* vbase, int64_t col_stride, int64_t P, const int64_t* ex,      \
                     int64_t L, const float* s, const float* inv, T* o, int64_t d) {                                 \
        __m512 acc[3][4];                                                                                            \
        _Pragma("GCC unroll 3") for (int x = 0; x < G; x++)                                                          \
            _Pragma("GCC unroll 4") for (int c = 0; c < W; c++) acc[x][c] = _mm512_setzero_ps();                    \
        for (int64_t j = 0; j < L; j++) {                                                                            \
            const T* vj = vbase + COL(j) * col_stride;                                                               \
            __m512 vv[4];                                                                                            \
            _Pragma("GCC unroll 4") for (int c = 0; c < W; c++) vv[c] = LOAD16(vj + 16 * c);                        \
            _Pragma("GCC unroll 3") for (int x = 0; x < G; x++) {                                                    \
                const __m512 p = _mm512_set1_ps(s[x * L + j]);                                                       \
                _Pragma("GCC unroll 4") for (int c = 0; c < W; c++) acc[x][c] = _mm512_fmadd_ps(p, vv[c], acc[x][c]); \
            }                                                                                                        \
        }                                                                                                            \
        _Pragma("GCC unroll 3") for (int x = 0; x < G; x++) {                                                        \
            const __m512 iv = _mm512_set1_ps(inv[x]);                                                                \
            _Pragma("GCC unroll 4") for (int c = 0; c < W; c++) {                                                    \
                float t[16] __attribute__((aligned(64)));                                                            \
                _mm512_store_ps(t, _mm512_mul_ps(acc[x][c], iv));                                                    \
                STORE(o + x * d + 16 * c, t, 16);                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

VALUES(values_f32, float, load16_f32, store_f32)
VALUES(values_bf16, uint16_t, load16_bf16, store_bf16)

/* G and W as constants where they are the common ones, so the accumulators stay in registers */
#define DISPATCH(FN, G, W, ...)                                                                                       \
    do {                                                                                                             \
        if ((W) == 4) {                                                                                              \
            if ((G) == 3) FN(3, 4, __VA_ARGS__);                                                                     \
            else if ((G) == 2) FN(2, 4, __VA_ARGS__);                                                                \
            else FN(1, 4, __VA_ARGS__);                                                                              \
        } else {                                                                                                     \
            FN((G), (W), __VA_ARGS__);                                                                               \
        }                                                                                                            \
    } while (0)

#define ATTEND512(NAME, AVX2, T, LOAD16, ROW16, VALUES_FN)                                                           \
    void NAME(const T* q, int64_t q_stride, int64_t heads, int64_t kv_heads, int64_t d, const T* k, const T* v,     \
              int64_t row_stride, int64_t head_stride, int64_t col_stride, const int64_t* rows,                     \
              const int64_t* visible, const int64_t* extra, int64_t extra_stride, const int64_t* n_extra,          \
              int64_t n, float scale, T* out, float* scratch) {                                                    \
        if (d % 16) {                                                                                              \
            AVX2(q, q_stride, heads, kv_heads, d, k, v, row_stride, head_stride, col_stride, rows, visible, extra, \
                 extra_stride, n_extra, n, scale, out, scratch);                                                   \
            return;                                                                                                \
        }                                                                                                          \
        const int64_t g = heads / kv_heads, chunks = d / 16;                                                       \
        float* qf = scratch;                                                                                       \
        float* inv = scratch + heads * d; /* each head's 1 / sum (the AVX2 layout's accumulators, unused here) */  \
        float* s = scratch + 2 * heads * d;                                                                        \
        float kf[8 * MAX_D] __attribute__((aligned(64)));                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                          \
            const int64_t P = visible[i], L = P + n_extra[i];                                                      \
            const int64_t* ex = extra + i * extra_stride;                                                          \
            PREFETCH_ROW(i)                                                                                        \
            const T* krow = k + rows[i] * row_stride;                                                              \
            const T* vrow = v + rows[i] * row_stride;                                                              \
            for (int64_t h = 0; h < heads; h++)                                                                    \
                for (int64_t c = 0; c < chunks; c++)                                                               \
                    _mm512_storeu_ps(qf + h * d + 16 * c, LOAD16(q + i * q_stride + h * d + 16 * c));              \
            for (int64_t j = 0; j < L; j += 8) { /* scores, 8 keys a block */                                      \
                const int64_t rem = L - j < 8 ? L - j : 8;                                                         \
                prefetch_columns(krow, vrow, sizeof(T), j + AHEAD, j + AHEAD + 8 < L ? j + AHEAD + 8 : L, P, ex,           \
                                 kv_heads, head_stride, col_stride, d); /* keys and values to come */                \
                for (int64_t kh = 0; kh < kv_heads; kh++) {                                                        \
                    const float* kr[8];                                                                            \
                    for (int64_t r = 0; r < 8; r++)                                                                \
                        kr[r] = r < rem ? ROW16(krow + kh * head_stride + COL(j + r) * col_stride, kf + r * d, chunks) \
                                        : kr[0];                                                                   \
                    for (int64_t h = kh * g; h < (kh + 1) * g; h += 3) {                                           \
                        const int m = (int)((kh + 1) * g - h < 3 ? (kh + 1) * g - h : 3);                          \
                        if (m == 3) scores_g(3, qf + h * d, d, kr, chunks, scale, s + h * L, L, j, rem);           \
                        else if (m == 2) scores_g(2, qf + h * d, d, kr, chunks, scale, s + h * L, L, j, rem);      \
                        else scores_g(1, qf + h * d, d, kr, chunks, scale, s + h * L, L, j, rem);                  \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
            softmax_heads(s, heads, L, inv); /* the AVX2 method's */                                              \
            if (i + 1 < n) /* the next query's first columns, behind this one's values */                          \
                prefetch_columns(k + rows[i + 1] * row_stride, v + rows[i + 1] * row_stride, sizeof(T), 0,                \
                                 AHEAD < visible[i + 1] ? AHEAD : visible[i + 1], visible[i + 1], ex, kv_heads,            \
                                 head_stride, col_stride, d);                                                      \
            for (int64_t kh = 0; kh < kv_heads; kh++)                                                              \
                for (int64_t h = kh * g; h < (kh + 1) * g; h += 3) {                                               \
                    const int m = (int)((kh + 1) * g - h < 3 ? (kh + 1) * g - h : 3);                              \
                    for (int64_t c = 0; c < chunks; c += 4) {                                                      \
                        const int w = (int)(chunks - c < 4 ? chunks - c : 4);                                      \
                        DISPATCH(VALUES_FN, m, w, vrow + kh * head_stride + 16 * c, col_stride, P, ex, L,          \
                                 s + h * L, inv + h, out + i * heads * d + h * d + 16 * c, d);                     \
                    }                                                                                              \
                }                                                                                                  \
        }                                                                                                          \
    }

ATTEND512(dvi_attend_f32, avx2_attend_f32, float, load16_f32, row16_f32, values_f32)
ATTEND512(dvi_attend_bf16, avx2_attend_bf16, uint16_t, load16_bf16, row16_bf16, values_bf16)
