/* The decode attention kernel for CPUs with AVX2 + FMA (the method: attention_avx2.h). Built and loaded by
   dvi/decode/attention_kernel.py where the CPU lacks AVX-512 (attention_kernel_avx512.c). */
#include "attention_avx2.h"

ATTEND(dvi_attend_f32, float, load8_f32, store_f32, row_f32)
ATTEND(dvi_attend_bf16, uint16_t, load8_bf16, store_bf16, row_bf16)
