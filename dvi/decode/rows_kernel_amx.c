/* y = x @ w^T in bf16 for the rows of a decode step, a verify or a prefill (Intel AMX), w packed once in panels.

   Built and loaded by dvi/decode/rows_kernel.py where the CPU has AMX-BF16, before the AVX512-BF16 build
   (rows_kernel_bf16.c). w [N, K] is packed as panels [ceil(N / 32)][2][Kp / 2][16][2], Kp = K rounded up to 32 and
   zero-padded: the AVX512-BF16 build's layout, each half's 16 pairs of columns for 16 weight rows one 1 KB B tile of
   TDPBF16PS. Rows of x go through 16-row A tiles, two at a time (32 rows: four C tiles, two A, two B), the panel's
   tiles reused from cache for every further 32 rows, so the weights stream from memory once per call whatever the
   row count while the tiles do the arithmetic; the next panel is prefetched into L2 during the first row block, as
   the other builds do. oneDNN's AMX matmuls reached over a block of rows outermost, each block streaming the weights
   again (docs/design.md, "An AMX build of the rows kernel").

   Each y[m, n] is one chain of TDPBF16PS over k in order, from fp32 zero, rounded to bf16 once at the end
   (round-to-nearest-even): a row rounds the same alone as beside others. The bits are AMX's, not the AVX512-BF16
   build's: a process serves one build. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "rows_fused.h"

#define PANEL 32
#define KSTEP 32 /* k per tile step: 16 pairs */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* 1 where the kernel grants this process the tile state (Linux asks, once per process), else 0: no tile instruction
   may run before */
int dvi_amx_ready(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

/* tmm0-3: C, `rows` rows x 16 fp32; tmm4-5: A, `rows` rows x 16 bf16 pairs; tmm6-7: B, 16 pairs x 16 columns x 2.
   `rows` < 16 where a call has fewer rows than a tile: no zero rows are copied beneath them (each row's chain is the
   same whatever the tile's row count) */
static void configure(int rows) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = t < 6 ? rows : 16;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* a C tile's 16 x 16 fp32 (as stored) into `rows` rows of y, its first `ncols` columns, rounded to bf16 */
static inline void store_rows(const float* c, uint16_t* y, int64_t ldy, int64_t rows, int64_t ncols) {
    const __mmask16 keep = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1u);
    for (int64_t r = 0; r < rows; r++)
        _mm256_mask_storeu_epi16(y + r * ldy, keep, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + 16 * r)));
}

static inline int64_t clip16(int64_t n) { return n < 16 ? n : 16; }

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T, w as panels (above). Returns 0, or -1 where the
   scratch for x's rows padded to whole tiles could not grow (y unset). */
int dvi_panels_linear_bf16(const uint16_t* x, int64_t ldx, const uint16_t* panels, int64_t N, int64_t K, uint16_t* y,
                           int64_t ldy, int64_t M) {
    if (M <= 0) return 0; /* no rows: no tile of zero rows is configured */
    const int64_t Kp = (K + KSTEP - 1) / KSTEP * KSTEP, steps = Kp / KSTEP, count = (N + PANEL - 1) / PANEL;
    const int64_t half = Kp * 16, Mp = M < 16 ? M : (M + 15) / 16 * 16, blocks = (Mp + 15) / 16;
    const uint16_t* a = x;
    int64_t lda = ldx;
    if (Mp != M || Kp != K) { /* tiles read whole row blocks and 32-column steps: zeros past x's rows and columns */
        uint16_t* xp = (uint16_t*)fz_scratch(1, (size_t)(Mp * Kp) * sizeof(uint16_t));
        if (!xp) return -1;
        memset(xp + M * Kp, 0, (size_t)((Mp - M) * Kp) * sizeof(uint16_t));
        for (int64_t r = 0; r < M; r++) {
            memcpy(xp + r * Kp, x + r * ldx, (size_t)K * sizeof(uint16_t));
            memset(xp + r * Kp + K, 0, (size_t)(Kp - K) * sizeof(uint16_t));
        }
        a = xp;
        lda = Kp;
    }
    float c[4][256] __attribute__((aligned(64)));
    configure(M < 16 ? (int)M : 16);
    for (int64_t i = 0; i < count; i++) {
        const uint16_t* p = panels + i * 2 * half;
        const char* next = (const char*)(i + 1 < count ? p + 2 * half : p);
        const int64_t ncols = N - PANEL * i < PANEL ? N - PANEL * i : PANEL;
        for (int64_t b = 0; b < blocks; b += 2) {
            const int two = b + 1 < blocks;
            const uint16_t* a0 = a + 16 * b * lda;
            const uint16_t* a1 = a0 + 16 * lda;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < steps; s++) {
                if (b == 0) /* this step's share of the next panel: 1 KB of each half */
                    for (int l = 0; l < 1024; l += 64) {
                        _mm_prefetch(next + s * 1024 + l, _MM_HINT_T2);
                        _mm_prefetch(next + 2 * half + s * 1024 + l, _MM_HINT_T2);
                    }
                _tile_loadd(6, p + s * 512, 64);
                _tile_loadd(7, p + half + s * 512, 64);
                _tile_loadd(4, a0 + s * KSTEP, lda * (int64_t)sizeof(uint16_t));
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_loadd(5, a1 + s * KSTEP, lda * (int64_t)sizeof(uint16_t));
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            uint16_t* yb = y + 16 * b * ldy + PANEL * i;
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            store_rows(c[0], yb, ldy, clip16(M - 16 * b), ncols);
            if (ncols > 16) store_rows(c[1], yb + 16, ldy, clip16(M - 16 * b), ncols - 16);
            if (two && M > 16 * (b + 1)) {
                _tile_stored(2, c[2], 64);
                _tile_stored(3, c[3], 64);
                store_rows(c[2], yb + 16 * ldy, ldy, clip16(M - 16 * (b + 1)), ncols);
                if (ncols > 16) store_rows(c[3], yb + 16 * ldy + 16, ldy, clip16(M - 16 * (b + 1)), ncols - 16);
            }
        }
    }
    _tile_release();
    return 0;
}

ROWS_PROLOGUE(dvi_rows_prologue_bf16, uint16_t, bf16)
ROWS_FUSED(dvi_panels_fused_bf16, dvi_panels_linear_bf16, dvi_rows_prologue_bf16, uint16_t, bf16)
ROPE_STORE(dvi_rope_store_bf16, uint16_t, bf16)
