/* y = x @ w^T in fp32 for the rows of a decode step, a verify or a prefill (AVX-512F), w packed once in panels.

   Built and loaded by dvi/decode/rows_kernel.py where the CPU has avx512f, instead of the AVX2 build (rows_kernel.c)
   of the same panels [ceil(N / 16)][K][16]: one 64-byte line is one register here, so each weight loaded feeds one
   fma per row instead of two, and a tile of up to 16 rows keeps 16 x 16 outputs in 16 of the 32 registers (the AVX2
   build re-reads a panel per 6 rows). x[r, k] is broadcast from memory into each fma. The next panel is prefetched
   a share per tile, so the weights stream from memory behind the arithmetic.

   Each y[m, n] is one fma chain over k in order, as in the AVX2 build: the two give the same bits, and a row rounds
   the same alone as beside others. */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16
#define MAX_TILE 16

#define ROW(r)                                                                                             \
    if (rows > r) a##r = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * ldx + k]), a##r);

#define STORE(r)                                                                                           \
    if (rows > r) _mm512_mask_storeu_ps(y + r * ldy, keep, a##r);

/* MR rows of x [.., K] times one panel p [K][16] into y [MR, ncols]; prefetches its share (tile t of T) of the next
   panel. Named accumulators, not an array: the compiler keeps an array of them in memory. */
#define TILE(MR)                                                                                           \
    static void tile_##MR(const float* x, int64_t ldx, const float* p, const float* next, int64_t K,        \
                          float* y, int64_t ldy, int64_t ncols, int64_t t, int64_t T) {                    \
        const int rows = MR;                                                                               \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;    \
        __m512 a8 = a0, a9 = a0, a10 = a0, a11 = a0, a12 = a0, a13 = a0, a14 = a0, a15 = a0;               \
        const float* pf = next + PANEL * ((t * K) / T);                                                    \
        int64_t c = 0;                                                                                     \
        for (int64_t k = 0; k < K; k++) {                                                                  \
            __m512 w = _mm512_load_ps(p + PANEL * k);                                                      \
            _mm_prefetch((const char*)pf, _MM_HINT_T0);                                                    \
            if (++c == T) {                                                                                \
                c = 0;                                                                                     \
                pf += PANEL;                                                                               \
            }                                                                                              \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7)                                        \
            ROW(8) ROW(9) ROW(10) ROW(11) ROW(12) ROW(13) ROW(14) ROW(15)                                  \
        }                                                                                                  \
        const __mmask16 keep = (__mmask16)((1u << ncols) - 1u);                                            \
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)                            \
        STORE(8) STORE(9) STORE(10) STORE(11) STORE(12) STORE(13) STORE(14) STORE(15)                      \
    }

TILE(1)
TILE(2)
TILE(3)
TILE(4)
TILE(5)
TILE(6)
TILE(7)
TILE(8)
TILE(9)
TILE(10)
TILE(11)
TILE(12)
TILE(13)
TILE(14)
TILE(15)
TILE(16)

typedef void (*tile_fn)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, int64_t);
static const tile_fn TILES[MAX_TILE + 1] = {0,       tile_1,  tile_2,  tile_3,  tile_4,  tile_5,
                                            tile_6,  tile_7,  tile_8,  tile_9,  tile_10, tile_11,
                                            tile_12, tile_13, tile_14, tile_15, tile_16};

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T, w as 64-byte aligned panels (see above) */
void dvi_panels_linear_f32(const float* x, int64_t ldx, const float* panels, int64_t N, int64_t K, float* y,
                           int64_t ldy, int64_t M) {
    const int64_t count = (N + PANEL - 1) / PANEL, tiles = (M + MAX_TILE - 1) / MAX_TILE;
    for (int64_t i = 0; i < count; i++) {
        const float* panel = panels + i * PANEL * K;
        const float* next = i + 1 < count ? panel + PANEL * K : panel;
        const int64_t ncols = N - PANEL * i < PANEL ? N - PANEL * i : PANEL;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; t++) { /* tiles as even as they go: 24 rows = 12 + 12, 40 = 14 + 13 + 13 */
            const int64_t mr = (M - m + (tiles - t) - 1) / (tiles - t);
            TILES[mr](x + m * ldx, ldx, panel, next, K, y + m * ldy + PANEL * i, ldy, ncols, t, tiles);
            m += mr;
        }
    }
}
