/* The loop every rows kernel runs (rows_kernel.c, rows_kernel_avx512.c, rows_kernel_bf16.c), included after the
   kernel's PANEL, MAX_TILE and TILES table: per panel of PANEL weight rows, the rows of x in tiles as even as they
   go (16 rows = 8 + 8 with tiles of up to 12), each tile told its share of the next panel to prefetch. A panel holds
   PANEL * K elements of the kernel's type whatever its layout; DEPTH is the k steps a tile walks (K, or K / 2 where a
   step multiplies a pair of columns). */
#ifndef DVI_ROWS_DRIVER_H
#define DVI_ROWS_DRIVER_H
#include <stdint.h>

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ w^T, w as the kernel's aligned panels; returns 0 (the
   AMX build's linear, which may fail, returns -1 then) */
#define ROWS_DRIVER(NAME, T, DEPTH)                                                                        \
    int NAME(const T* x, int64_t ldx, const T* panels, int64_t N, int64_t K, T* y, int64_t ldy, int64_t M) {  \
        const int64_t count = (N + PANEL - 1) / PANEL, tiles = (M + MAX_TILE - 1) / MAX_TILE;              \
        for (int64_t i = 0; i < count; i++) {                                                              \
            const T* panel = panels + i * PANEL * K;                                                       \
            const T* next = i + 1 < count ? panel + PANEL * K : panel;                                     \
            const int64_t ncols = N - PANEL * i < PANEL ? N - PANEL * i : PANEL;                           \
            int64_t m = 0;                                                                                 \
            for (int64_t t = 0; t < tiles; t++) {                                                          \
                const int64_t mr = (M - m + (tiles - t) - 1) / (tiles - t);                                \
                TILES[mr](x + m * ldx, ldx, panel, next, DEPTH, y + m * ldy + PANEL * i, ldy, ncols, t, tiles); \
                m += mr;                                                                                   \
            }                                                                                              \
        }                                                                                                  \
        return 0;                                                                                          \
    }

#endif
