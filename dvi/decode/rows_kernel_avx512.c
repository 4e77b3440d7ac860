/* y = x @ w^T in fp32 for the rows of a decode step, a verify or a prefill (AVX-512F), w packed once in panels.

   Built and loaded by dvi/decode/rows_kernel.py where the CPU has avx512f, instead of the AVX2 build (rows_kernel.c).
   w [N, K] is packed as panels [ceil(N / 32)][2][K][16] (panel i holds rows 32 i .. 32 i + 31 of w, zero-padded, in
   two halves of 16 rows): a column's 32 weights are a 64-byte line, a register, from each half. Two halves, two
   streams: one core reads memory faster as two sequential streams than as one (docs/design.md, "Two streams a
   panel"). A tile of up to 14 rows of x keeps 14 x 32 outputs in 28 of the 32 registers; each x[r, k] is broadcast
   from memory into two fmas, so a tile issues 16 loads for 28 fmas (with one register a line, 15 loads for 14: the
   loads, not the fmas, would bound it). The next panel is prefetched a share per tile, so the weights stream from
   memory behind the arithmetic; into L2 (T2), not L1: a prefetch to L1 holds one of the core's few L1 fill buffers
   for a whole memory latency, and with them all taken the weights stream at a fraction of the core's bandwidth
   (measured in docs/design.md, "the rows kernels' prefetch").

   Each y[m, n] is one fma chain over k in order, as in the AVX2 build: the two give the same bits, and a row rounds
   the same alone as beside others. */
#include <immintrin.h>
#include <stdint.h>

#define PANEL 32
#define HALF 16
#define MAX_TILE 14

#define ROW(r)                                                                                             \
    if (rows > r) {                                                                                        \
        const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);                                                  \
        a##r##_0 = _mm512_fmadd_ps(w0, xb, a##r##_0);                                                      \
        a##r##_1 = _mm512_fmadd_ps(w1, xb, a##r##_1);                                                      \
    }

#define STORE(r)                                                                                           \
    if (rows > r) {                                                                                        \
        _mm512_mask_storeu_ps(y + r * ldy, keep0, a##r##_0);                                               \
        _mm512_mask_storeu_ps(y + r * ldy + 16, keep1, a##r##_1);                                          \
    }

/* MR rows of x [.., K] times one panel p [K][32] into y [MR, ncols]; prefetches its share (tile t of T) of the next
   panel. Named accumulators, not an array: the compiler keeps an array of them in memory. */
#define TILE(MR)                                                                                           \
    static void tile_##MR(const float* x, int64_t ldx, const float* p, const float* next, int64_t K,        \
                          float* y, int64_t ldy, int64_t ncols, int64_t t, int64_t T) {                    \
        const int rows = MR;                                                                               \
        __m512 a0_0 = _mm512_setzero_ps(), a0_1 = a0_0, a1_0 = a0_0, a1_1 = a0_0, a2_0 = a0_0, a2_1 = a0_0; \
        __m512 a3_0 = a0_0, a3_1 = a0_0, a4_0 = a0_0, a4_1 = a0_0, a5_0 = a0_0, a5_1 = a0_0;               \
        __m512 a6_0 = a0_0, a6_1 = a0_0, a7_0 = a0_0, a7_1 = a0_0, a8_0 = a0_0, a8_1 = a0_0;               \
        __m512 a9_0 = a0_0, a9_1 = a0_0, a10_0 = a0_0, a10_1 = a0_0, a11_0 = a0_0, a11_1 = a0_0;           \
        __m512 a12_0 = a0_0, a12_1 = a0_0, a13_0 = a0_0, a13_1 = a0_0;                                     \
        const float* pf = next + HALF * ((t * K) / T);                                                     \
        int64_t c = 0;                                                                                     \
        for (int64_t k = 0; k < K; k++) {                                                                  \
            const __m512 w0 = _mm512_load_ps(p + HALF * k), w1 = _mm512_load_ps(p + HALF * (K + k));       \
            _mm_prefetch((const char*)pf, _MM_HINT_T2);                                                    \
            _mm_prefetch((const char*)(pf + HALF * K), _MM_HINT_T2);                                       \
            if (++c == T) {                                                                                \
                c = 0;                                                                                     \
                pf += HALF;                                                                                \
            }                                                                                              \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11) ROW(12)   \
            ROW(13)                                                                                        \
        }                                                                                                  \
        const int64_t left = ncols - 16;                                                                   \
        const __mmask16 keep0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1u);         \
        const __mmask16 keep1 = left >= 16 ? (__mmask16)0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1u) : 0; \
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) \
        STORE(11) STORE(12) STORE(13)                                                                      \
    }

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) TILE(14)

typedef void (*tile_fn)(const float*, int64_t, const float*, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, int64_t);
static const tile_fn TILES[MAX_TILE + 1] = {0,      tile_1, tile_2, tile_3,  tile_4,  tile_5,  tile_6, tile_7,
                                            tile_8, tile_9, tile_10, tile_11, tile_12, tile_13, tile_14};

#include "rows_driver.h"
#include "rows_fused.h"

ROWS_DRIVER(dvi_panels_linear_f32, float, K)
ROWS_PROLOGUE(dvi_rows_prologue_f32, float, f32)
ROWS_FUSED(dvi_panels_fused_f32, dvi_panels_linear_f32, dvi_rows_prologue_f32, float, f32)
ROPE_STORE(dvi_rope_store_f32, float, f32)
