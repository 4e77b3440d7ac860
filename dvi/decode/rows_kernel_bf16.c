/* y = x @ w^T in bf16 for the rows of a decode step, a verify or a prefill (AVX512-BF16), w packed once in panels.

   Built and loaded by dvi/decode/rows_kernel.py where the CPU has avx512_bf16; the fp32 kernel's design
   (rows_kernel.c) on bf16 weights, which halve the bytes a step streams. w [N, K] (K even) is packed as panels
   [ceil(N / 32)][2][K / 2][16][2] (panel i holds rows 32 i .. 32 i + 31 of w, zero-padded, in two halves of 16
   rows): one 64-byte line holds 16 weight rows' pair of columns k, k + 1, the operand of one vdpbf16ps, and a line
   from each half makes a panel's 32 outputs; each half is a stream of its own, as in the fp32 AVX-512 build.
   A tile of up to 12 rows of x keeps 12 x 32 fp32 outputs in 24 of AVX-512's 32 registers, each x pair broadcast
   once per tile; the next panel is prefetched a share per tile, so the weights stream behind the arithmetic (into
   L2, as the fp32 AVX-512 build says why).

   Each y[m, n] is one chain of vdpbf16ps over k in order (fixed rounding: round-to-nearest-even, denormals as zero),
   rounded to bf16 once at the end, whatever M is and however the rows are tiled: a row rounds the same alone as
   beside others. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 32
#define MAX_TILE 12

/* one row r of a tile: its pair x[r, 2k], x[r, 2k + 1] broadcast against the panel's two lines */
#define ROW(r)                                                                                             \
    if (rows > r) {                                                                                        \
        int32_t pair;                                                                                      \
        memcpy(&pair, x + r * ldx + 2 * k, sizeof pair);                                                   \
        __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);                                                   \
        a##r##_0 = _mm512_dpbf16_ps(a##r##_0, w0, xb);                                                     \
        a##r##_1 = _mm512_dpbf16_ps(a##r##_1, w1, xb);                                                     \
    }

#define STORE(r)                                                                                           \
    if (rows > r) {                                                                                        \
        __m256i lo = (__m256i)_mm512_cvtneps_pbh(a##r##_0), hi = (__m256i)_mm512_cvtneps_pbh(a##r##_1);    \
        if (ncols == PANEL) {                                                                              \
            _mm256_storeu_si256((__m256i*)(y + r * ldy), lo);                                              \
            _mm256_storeu_si256((__m256i*)(y + r * ldy + 16), hi);                                         \
        } else {                                                                                           \
            _mm256_store_si256((__m256i*)buf, lo);                                                         \
            _mm256_store_si256((__m256i*)(buf + 16), hi);                                                  \
            for (int64_t c = 0; c < ncols; c++) y[r * ldy + c] = buf[c];                                   \
        }                                                                                                  \
    }

/* MR rows of x [.., K] times one panel p [K / 2][32][2] into y [MR, ncols]; prefetches its share (tile t of T) of
   the next panel. Named accumulators, not an array: the compiler keeps an array of them in memory. */
#define TILE(MR)                                                                                           \
    static void tile_##MR(const uint16_t* x, int64_t ldx, const uint16_t* p, const uint16_t* next, int64_t pairs, \
                          uint16_t* y, int64_t ldy, int64_t ncols, int64_t t, int64_t T) {                 \
        const int rows = MR;                                                                               \
        __m512 a0_0 = _mm512_setzero_ps(), a0_1 = a0_0, a1_0 = a0_0, a1_1 = a0_0, a2_0 = a0_0, a2_1 = a0_0; \
        __m512 a3_0 = a0_0, a3_1 = a0_0, a4_0 = a0_0, a4_1 = a0_0, a5_0 = a0_0, a5_1 = a0_0;               \
        __m512 a6_0 = a0_0, a6_1 = a0_0, a7_0 = a0_0, a7_1 = a0_0, a8_0 = a0_0, a8_1 = a0_0;               \
        __m512 a9_0 = a0_0, a9_1 = a0_0, a10_0 = a0_0, a10_1 = a0_0, a11_0 = a0_0, a11_1 = a0_0;           \
        const uint16_t* pf = next + PANEL * ((t * pairs) / T);                                             \
        int64_t c = 0;                                                                                     \
        for (int64_t k = 0; k < pairs; k++) {                                                              \
            __m512bh w0 = (__m512bh)_mm512_load_si512(p + PANEL * k);                                      \
            __m512bh w1 = (__m512bh)_mm512_load_si512(p + PANEL * (pairs + k));                            \
            _mm_prefetch((const char*)pf, _MM_HINT_T2);                                                    \
            _mm_prefetch((const char*)(pf + PANEL * pairs), _MM_HINT_T2);                                  \
            if (++c == T) {                                                                                \
                c = 0;                                                                                     \
                pf += PANEL;                                                                               \
            }                                                                                              \
            ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)           \
        }                                                                                                  \
        uint16_t buf[PANEL] __attribute__((aligned(32)));                                                  \
        STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) \
        STORE(11)                                                                                          \
    }

TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11) TILE(12)

typedef void (*tile_fn)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t, uint16_t*, int64_t,
                        int64_t, int64_t, int64_t);
static const tile_fn TILES[MAX_TILE + 1] = {0,      tile_1, tile_2, tile_3,  tile_4,  tile_5, tile_6,
                                            tile_7, tile_8, tile_9, tile_10, tile_11, tile_12};

#include "rows_driver.h"
#include "rows_fused.h"

ROWS_DRIVER(dvi_panels_linear_bf16, uint16_t, K / 2)
ROWS_PROLOGUE(dvi_rows_prologue_bf16, uint16_t, bf16)
ROWS_FUSED(dvi_panels_fused_bf16, dvi_panels_linear_bf16, dvi_rows_prologue_bf16, uint16_t, bf16)
ROPE_STORE(dvi_rope_store_bf16, uint16_t, bf16)
