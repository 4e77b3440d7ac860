/* y = x @ w^T in fp32 for the rows of a decode step, a verify or a prefill (AVX2 + FMA), w packed once in panels.

   Built and loaded by dvi/decode/rows_kernel.py. w [N, K] is packed as panels [ceil(N / 16)][2][K][8] (panel i holds
   rows 16 i .. 16 i + 15 of w, zero-padded, in two halves of 8 rows), so a column's 16 weights are a register from
   each half, and the kernel reads a panel as two streams, as the AVX-512 build does and why (rows_kernel_avx512.c).
   A tile of up to 6 rows of x keeps 6 x 16 outputs in 12 registers and multiplies each weight it loads into all of
   its rows (the outer product form of a GEMM micro-kernel, where a dot product per output would load each x row once
   per 4 outputs).
   The next panel is prefetched while this one is multiplied, a share of it per tile, so the weights stream from
   memory behind the arithmetic whatever the row count.

   Each y[m, n] is one fma chain over k in order, whatever M is and however the rows are tiled: a row rounds the same
   alone as beside others. */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 16
#define HALF 8
#define MAX_TILE 6

/* one row r of a tile: its x[r, k] broadcast into both halves of the panel's column */
#define ROW(r)                                                                                             \
    if (rows > r) {                                                                                        \
        __m256 xb = _mm256_broadcast_ss(x + r * ldx + k);                                                  \
        a##r##0 = _mm256_fmadd_ps(w0, xb, a##r##0);                                                        \
        a##r##1 = _mm256_fmadd_ps(w1, xb, a##r##1);                                                        \
    }

#define STORE(r)                                                                                           \
    if (rows > r) {                                                                                          \
        if (ncols == PANEL) {                                                                              \
            _mm256_storeu_ps(y + r * ldy, a##r##0);                                                        \
            _mm256_storeu_ps(y + r * ldy + 8, a##r##1);                                                    \
        } else {                                                                                           \
            _mm256_store_ps(buf, a##r##0);                                                                 \
            _mm256_store_ps(buf + 8, a##r##1);                                                             \
            for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = buf[c];                                   \
        }                                                                                                  \
    }

/* MR rows of x [.., K] times one panel p [K][16] into y [MR, ncols]; prefetches its share (tile t of T) of the next
   panel. Named accumulators, not an array: the compiler keeps an array of them in memory. */
#define TILE(MR)                                                                                           \
    static void tile_##MR(const float* x, int64_t ldx, const float* p, const float* next, int64_t K,        \
                          float* y, int64_t ldy, int64_t ncols, int64_t t, int64_t T) {                    \
        const int rows = MR;                                                                               \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;           \
        __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;                           \
        const float* pf = next + HALF * ((t * K) / T);                                                     \
        int64_t c = 0;                                                                                     \
        for (int64_t k = 0; k < K; k++) {                                                                  \
            __m256 w0 = _mm256_load_ps(p + HALF * k), w1 = _mm256_load_ps(p + HALF * (K + k));            \
            _mm_prefetch((const char*)pf, _MM_HINT_T0);                                                    \
            _mm_prefetch((const char*)(pf + HALF * K), _MM_HINT_T0);                                       \
            if (++c == T) {                                                                                \
                c = 0;                                                                                     \
                pf += HALF;                                                                                \
            }                                                                                              \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)                                                      \
        }                                                                                                  \
        float buf[PANEL] __attribute__((aligned(32)));                                                     \
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)                                              \
    }

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

typedef void (*tile_fn)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, int64_t);
static const tile_fn TILES[MAX_TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6};

#include "rows_driver.h"
#include "rows_fused.h"

ROWS_DRIVER(dvi_panels_linear_f32, float, K)
ROWS_PROLOGUE(dvi_rows_prologue_f32, float, f32)
ROWS_FUSED(dvi_panels_fused_f32, dvi_panels_linear_f32, dvi_rows_prologue_f32, float, f32)
ROPE_STORE(dvi_rope_store_f32, float, f32)
