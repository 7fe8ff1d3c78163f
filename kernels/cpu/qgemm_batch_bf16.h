/* qgemm_batch.h's bfloat16 variant (AVX512-BF16), for descriptors flagged PLAIT_QGEMM_BF16:
 * x rounded to bfloat16 once per call, each chunk of weight rows decoded once to bfloat16,
 * products by vdpbf16ps with float32 accumulation. Included by qgemm_batch.h after reduce16,
 * which it reads; qgemm_batch picks it per call.
 *
 * Rounding: a weight is its float32 dequantized value (dequant_groups' vectors: gguf-py's
 * bits) rounded to nearest even by vcvtne2ps2bf16, x's elements alike. That is torch's
 * .to(torch.bfloat16) (plait_dequantize_bf16's bits) but for float32 denormals, which it
 * flushes to zero where torch keeps a bfloat16 denormal; vdpbf16ps reads a denormal input
 * as zero, so the products are the same either way (and no weight of a block type is a
 * float32 denormal: its values are multiples of fp16 scales; BF16 rows are copied as they
 * are). vdpbf16ps then multiplies exactly (8 x 8 significant bits fit float32) and adds in
 * float32.
 *
 * Layout: vdpbf16ps's lane i adds the products of bfloat16 words 2 i and 2 i + 1 of its two
 * operands, so a pair (k, k + 1) of one row must share a 32-bit lane. A row of bfloat16
 * words in k order is that layout already: the chunk is decoded as rows wb [BATCH_ROWS, K]
 * and x as xb [M, K], and batch_tile_bf16 takes qgemm_batch.h's tile shape (4 x rows by 4
 * weight rows, accumulators along k, folded by reduce16 per K block): one x load feeds 4
 * vdpbf16ps, one weight load feeds the tile's 4 x rows, 32 weights per instruction where
 * batch_tile's FMA takes 16. (Lanes along N instead, x pairs broadcast, would need the chunk
 * transposed into [K / 2, 16 rows] pair vectors, a scatter per pair as it is decoded.)
 */
#ifndef PLAIT_CPU_QGEMM_BATCH_BF16_H
#define PLAIT_CPU_QGEMM_BATCH_BF16_H

#if QUANT_BF16
#define QGEMM_BATCH_BF16 1
/* Flagged descriptors take this path from PLAIT_QGEMM_BF16_MIN_ROWS x rows; fewer keep the
 * float32 paths (one row: qgemm_bf16.h's exact pieces). Measured, 1 thread, against the
 * float32 paths (scripts/bench_qgemm.py, a decode step's GEMMs summed): SmolLM2's shapes
 * 0.69x the time at 16 rows, 0.85x at 7 and 8, 0.95x at 6, 1.1x at 5, 1.15x at 4, 1.35x at
 * 2; Qwen2.5-0.5B's 0.68x at 16, 0.84x at 8, 0.91x at 6, 1.1x at 4 (the chunk's decode,
 * rounding and folds, which a few rows do not repay). */

/* 32 float32 (lo: k 0 .. 15, hi: k 16 .. 31) -> 32 bfloat16 words, nearest even. */
ALWAYS_INLINE __m512i round_bf16(__m512 lo, __m512 hi) {
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* x [M, K] (rows ldx apart, K % 32 == 0) rounded into xb [M, K] bfloat16 bits, dense. */
static void round_rows(const float *x, long M, long ldx, long K, uint16_t *xb) {
  for (long m = 0; m < M; m++)
    for (long k = 0; k < K; k += 32)
      _mm512_storeu_si512(xb + m * K + k, round_bf16(_mm512_loadu_ps(x + m * ldx + k),
                                                     _mm512_loadu_ps(x + m * ldx + k + 16)));
}

/* Row `row` of part p (K % 32 == 0) into dst [K] (64-byte aligned) bfloat16 bits: each
 * 32-weight group decoded to float32 in registers (dequant_groups' vectors), then rounded;
 * a BF16 row copied. */
static void dequant_row_bf16(const part_t *p, long row, long K, uint16_t *dst) {
  const uint8_t *src = p->data + row * p->row_bytes;
  vf w[2];
  switch (p->type) {
    case PLAIT_GGML_BF16:
      memcpy(dst, src, sizeof(uint16_t) * (size_t)K);
      return;
#define GROUPS(type)                                                            \
  case type:                                                                    \
    for (long g = 0; g < K / 32; g++) {                                         \
      decode_group(type, src, g, w);                                            \
      _mm512_store_si512(dst + 32 * g, round_bf16((__m512)w[0], (__m512)w[1])); \
    }                                                                           \
    return;
    GROUPS(PLAIT_GGML_F16) GROUPS(PLAIT_GGML_Q4_0) GROUPS(PLAIT_GGML_Q4_1)
    GROUPS(PLAIT_GGML_Q5_0) GROUPS(PLAIT_GGML_Q8_0) GROUPS(PLAIT_GGML_Q4_K)
    GROUPS(PLAIT_GGML_Q5_K) GROUPS(PLAIT_GGML_Q6_K)
#undef GROUPS
    default: return;
  }
}

/* *sums += x rows r . w rows c over kb weights (kb % 32 == 0) in lane 4 r + c, for the R
 * (constant once inlined) x rows of a tile, ldx apart, and 4 weight rows ldw apart; all
 * bfloat16 bits, 64-byte aligned rows. batch_tile's loop with a vdpbf16ps per 32 k. */
ALWAYS_INLINE void batch_tile_bf16(int R, const uint16_t *x, long ldx, const uint16_t *w,
                                   long ldw, long kb, vf *sums) {
  static const int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  __m512 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  for (long k = 0; k < kb; k += 32) {
    __m512i wv[4];
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
      wv[c] = _mm512_load_si512(w + c * ldw + k);
      __asm__("" : "+v"(wv[c]));
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
      __m512i xv = _mm512_load_si512(x + r * ldx + k);
      __asm__("" : "+v"(xv));
      _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
        acc[REV[4 * r + c]] = _mm512_dpbf16_ps(acc[REV[4 * r + c]], (__m512bh)xv,
                                               (__m512bh)wv[c]);
    }
  }
  vf v[16];
  for (int i = 0; i < 16; i++) v[i] = (vf)acc[i];
  *sums += reduce16(v);
}

static void batch_tile_bf16_rows(int R, const uint16_t *x, long ldx, const uint16_t *w,
                                 long ldw, long kb, vf *sums) {
  switch (R) {
    case 1: batch_tile_bf16(1, x, ldx, w, ldw, kb, sums); return;
    case 2: batch_tile_bf16(2, x, ldx, w, ldw, kb, sums); return;
    case 3: batch_tile_bf16(3, x, ldx, w, ldw, kb, sums); return;
    default: batch_tile_bf16(4, x, ldx, w, ldw, kb, sums); return;
  }
}
#endif /* QUANT_BF16 */

#endif /* PLAIT_CPU_QGEMM_BATCH_BF16_H */
