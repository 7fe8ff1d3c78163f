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
 * float32 paths (scripts/bench_qgemm.py, a decode step's GEMMs summed), before the group
 * tables and the next chunk's prefetch below: SmolLM2's shapes 0.69x the time at 16 rows,
 * 0.85x at 7 and 8, 0.95x at 6, 1.1x at 5, 1.15x at 4, 1.35x at 2; Qwen2.5-0.5B's 0.68x at
 * 16, 0.84x at 8, 0.91x at 6, 1.1x at 4 (the chunk's decode, rounding and folds, which a
 * few rows do not repay). With them (--against the float32 paths, the threshold lowered to
 * measure): SmolLM2 0.57x at 16, 0.66x at 8, 0.77x at 6, 0.83x at 5, 0.82x at 4, 0.85x at
 * 3, 0.90x at 2; Qwen 0.56x at 16, 0.64x at 8, 0.68x at 6, 0.77x at 5, 0.78x at 4, 0.80x at
 * 3, 0.84x at 2: the threshold went from 6 to 2 (one row keeps qgemm_bf16.h). The tables
 * and prefetch against the previous bf16 decode (--against-dtype bfloat16): SmolLM2 38.0
 * -> 33.4 ms a step at 16 rows, 26.9 -> 22.3 at 8; Qwen 165.0 -> 150.7 at 16, 108.5 ->
 * 92.0 at 8 (a noisy host: one code's step differs by up to 20%
 * from run to run; each ratio is of calls interleaved in one run). */

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

/* Group tables: within a group (a K-quant sub-block) every weight is f(q) for a quant q of
 * 4 or 5 bits and the group's scale and min, so the group's 16 or 32 values of f are
 * computed as float32 vectors over all q (decode_group's operations in its order: the same
 * float32 bits), rounded to bfloat16 once, and the quants mapped through them by vpermw
 * (which reads an index's low 5 bits: a 16-entry table is stored twice, so a nibble needs
 * no mask). Per group one or two float32 vectors and one rounding, where decode_group
 * widens, converts and scales 32 quants in two vectors. Q6_K (two scales per group, 64
 * values each), Q8_0 (256 values) and F16 keep decode_group. */
static const float TAB_IOTA[32] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

/* q, q + 16 for q = 0 .. 15 (the table vectors' quants), less `off`. */
ALWAYS_INLINE vf tab_q(int high, float off) {
  return *(const vf *)(TAB_IOTA + 16 * high) - off;
}

/* A row src [K] (K % 32 == 0) into dst [K] (64-byte aligned) bfloat16 bits, one function
 * per type (its QUANT_TRAITS row's to_bf16): groups through their tables (above), or
 * decoded to float32 in registers (dequant_groups' vectors) then rounded; a BF16 row
 * copied. */
static void to_bf16_PLAIT_GGML_BF16(const uint8_t *src, long K, uint16_t *dst) {
  memcpy(dst, src, sizeof(uint16_t) * (size_t)K);
}

static void to_bf16_PLAIT_GGML_Q4_0(const uint8_t *src, long K, uint16_t *dst) {
  const vf q = tab_q(0, 8.0f);
  for (long g = 0; g < K / 32; g++) {
    const uint8_t *b = src + g * 18;
    vf t = vsplat(load_f16(b)) * q;
    _mm512_store_si512(dst + 32 * g, _mm512_permutexvar_epi16(
        nibble_words(b + 2), round_bf16((__m512)t, (__m512)t)));
  }
}

static void to_bf16_PLAIT_GGML_Q4_1(const uint8_t *src, long K, uint16_t *dst) {
  const vf q = tab_q(0, 0.0f);
  for (long g = 0; g < K / 32; g++) {
    const uint8_t *b = src + g * 20;
    vf t = mul_add_2r(vsplat(load_f16(b)), q, vsplat(load_f16(b + 2)));
    _mm512_store_si512(dst + 32 * g, _mm512_permutexvar_epi16(
        nibble_words(b + 4), round_bf16((__m512)t, (__m512)t)));
  }
}

static void to_bf16_PLAIT_GGML_Q5_0(const uint8_t *src, long K, uint16_t *dst) {
  const vf q0 = tab_q(0, 16.0f), q1 = tab_q(1, 16.0f);
  for (long g = 0; g < K / 32; g++) {
    const uint8_t *b = src + g * 22;
    uint32_t qh;
    memcpy(&qh, b + 2, sizeof qh);
    vf d = vsplat(load_f16(b));
    __m512i q = _mm512_and_si512(nibble_words(b + 6), _mm512_set1_epi16(15));
    q = _mm512_mask_add_epi16(q, (__mmask32)qh, q, _mm512_set1_epi16(16));
    _mm512_store_si512(dst + 32 * g, _mm512_permutexvar_epi16(
        q, round_bf16((__m512)(d * q0), (__m512)(d * q1))));
  }
}

/* Q4_K (five 0) and Q5_K (five 1, constant once inlined). */
ALWAYS_INLINE void k4_to_bf16(int five, const uint8_t *src, long K, uint16_t *dst) {
  const long bytes = five ? 176 : 144;
  const vf q0 = tab_q(0, 0.0f), q1 = tab_q(1, 0.0f);
  for (long blk = 0; blk < K / 256; blk++) {
    const uint8_t *b = src + blk * bytes;
    const float d = load_f16(b), dmin = load_f16(b + 2);
    _Pragma("GCC unroll 8") for (int s = 0; s < 8; s++) {
      float sc, mn;
      scale_min_k4(b + 4, s, &sc, &mn);
      vf ds = vsplat(d * sc), dm = vsplat(-(dmin * mn));
      vf lo = mul_add_2r(ds, q0, dm);
      __m512i tab, q;
      if (five) {
        tab = round_bf16((__m512)lo, (__m512)mul_add_2r(ds, q1, dm));
        q = low4_high(byte_words(b + 48 + 32 * (s / 2), s & 1 ? 4 : 0),
                      shift_words(byte_words(b + 16, 0), 4 - s));
      } else {
        tab = round_bf16((__m512)lo, (__m512)lo);
        q = byte_words(b + 16 + 32 * (s / 2), s & 1 ? 4 : 0);
      }
      _mm512_store_si512(dst + 256 * blk + 32 * s, _mm512_permutexvar_epi16(q, tab));
    }
  }
}

static void to_bf16_PLAIT_GGML_Q4_K(const uint8_t *src, long K, uint16_t *dst) {
  k4_to_bf16(0, src, K, dst);
}

static void to_bf16_PLAIT_GGML_Q5_K(const uint8_t *src, long K, uint16_t *dst) {
  k4_to_bf16(1, src, K, dst);
}

/* F16, Q8_0 and Q6_K: decode_group's float32 vectors, rounded. */
#define GROUPS(type)                                                                \
  static void to_bf16_##type(const uint8_t *src, long K, uint16_t *dst) {           \
    vf w[2];                                                                        \
    for (long g = 0; g < K / 32; g++) {                                             \
      decode_group(type, src, g, w);                                                \
      _mm512_store_si512(dst + 32 * g, round_bf16((__m512)w[0], (__m512)w[1]));     \
    }                                                                               \
  }
GROUPS(PLAIT_GGML_F16) GROUPS(PLAIT_GGML_Q8_0) GROUPS(PLAIT_GGML_Q6_K)
#undef GROUPS

/* Row `row` of part p (K % 32 == 0, a type of QUANT_TRAITS) into dst [K] (64-byte aligned)
 * bfloat16 bits through its type's to_bf16, the next chunk's row prefetched. */
static void dequant_row_bf16(const part_t *p, long row, long K, uint16_t *dst) {
  const uint8_t *src = p->data + row * p->row_bytes;
  /* this row of the next chunk (this thread's next one under qgemm_batch's static
   * schedule), in flight while this chunk's tiles run; past a part's end, a prefetch of
   * nothing (it does not fault) */
  for (long o = 0; o < p->row_bytes; o += 64)
    _mm_prefetch((const char *)src + BATCH_ROWS * p->row_bytes + o, _MM_HINT_T1);
  p->traits->to_bf16(src, K, dst);
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
