/* plait_qgemm at one x row through bfloat16 pieces of x (AVX512-BF16): included by qgemm.c
 * after its part_t, acts_t, FUSED_ROWS and part_of, which this section reads; row_dot is
 * qgemm.c's (the rows this section does not take). quant.h's bf16_quants looks a group's
 * quants up as bfloat16 words. Each type's instantiations (bf16_tiles_<t>, bf16_rows_<t>)
 * are its QUANT_TRAITS row's bf16_tiles and bf16_rows. */
#ifndef PLAIT_CPU_QGEMM_BF16_H
#define PLAIT_CPU_QGEMM_BF16_H

#if QUANT_BF16
/* Words of one group of x's pieces: 3 x 32. */
#define SPLIT_WORDS 96
/* x of at most this many rows takes the bfloat16 path; more rows share fused_tile's float
 * decode (its FMA per row and vector against 3 vdpbf16ps and an FMA here). */
#define BF16_ROWS 1
/* Weight rows bf16_rows takes at once for a single x row. */
#define WROWS 4

/* One x row [K] as three bfloat16 pieces, x = p0 + p1 + p2 exactly, into xs [K / 32][3][32]
 * (piece p of group g at xs + 96 g + 32 p), its group sums into xsum [K / 32]:
 *
 *   x  = s eeeeeeee mmmmmmm mmmmmmmmmmmmmmmm   (float32: 24 significant bits)
 *   p0 = x's high 16 bits, truncated           (8 of them; |p0| <= |x|, never rounds to inf)
 *   r  = x - p0                                (exact: x's low 16 mantissa bits)
 *   p1 = r's high 16 bits, p2 = r - p1         (exact; p2 holds <= 8 significant bits)
 *
 * Exact while p2 is a normal number (|x| >= 2^-103 or so): vdpbf16ps reads denormal inputs
 * as 0 and flushes denormal results (DAZ, FTZ), so a smaller x loses under 2^-126 per
 * element. inf and NaN: p0 = x (a NaN kept a NaN), p1 = p2 = 0. */
static void split_row(const float *x, long K, uint16_t *xs, float *xsum) {
  const __m512i high = _mm512_set1_epi32((int)0xffff0000), expo = _mm512_set1_epi32(0x7f800000);
  for (long g = 0; g < K / 32; g++) {
    vf sum = (vf){0};
    for (int j = 0; j < 2; j++) {
      __m512 v = _mm512_loadu_ps(x + 32 * g + 16 * j);
      __m512i bits = _mm512_castps_si512(v), p0 = _mm512_and_si512(bits, high);
      __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(bits, expo), expo);
      p0 = _mm512_mask_or_epi32(p0, nan, p0, _mm512_set1_epi32(0x00400000));
      __m512 r = _mm512_maskz_sub_ps(finite, v, _mm512_castsi512_ps(p0));
      __m512i p1 = _mm512_and_si512(_mm512_castps_si512(r), high);
      __m512i p2 = _mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(p1)));
      __m512i piece[3] = {p0, p1, p2};
      for (int p = 0; p < 3; p++)
        _mm256_storeu_si256((__m256i *)(xs + SPLIT_WORDS * g + 32 * p + 16 * j),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(piece[p], 16)));
      sum += (vf)v;
    }
    xsum[g] = hsum(sum);
  }
}

static void row_dot(const acts_t *a, int R, const part_t *p, long n, long K, float *y,
                    long ldy, float b);

/* y[r * ldy] = x[r] . row + bias for the R (constant once inlined) rows of a tile, from x's
 * pieces [R, K / 32, 3, 32] and group sums [R, K / 32]: per group, its quants as bfloat16
 * once, then per x row 3 vdpbf16ps (smallest piece first) and one FMA by the group's scale;
 * the min term (min x the group's sum) apart. */
ALWAYS_INLINE void bf16_tile(int R, int type, const uint16_t *xs, const float *xsum,
                             const uint8_t *row, long K, float *y, long ldy, float bias) {
  const int sub = type == PLAIT_GGML_Q4_K || type == PLAIT_GGML_Q5_K ||
                  type == PLAIT_GGML_Q6_K ? 8 : 1;
  const int has_min = type == PLAIT_GGML_Q4_1 || (sub == 8 && type != PLAIT_GGML_Q6_K);
  const long G = K / 32;
  vf acc[FUSED_ROWS], scale;
  float macc[FUSED_ROWS], min;
  for (int r = 0; r < R; r++) acc[r] = (vf){0}, macc[r] = 0.0f;
  for (long blk = 0; blk < G / sub; blk++) {
    _Pragma("GCC unroll 8") for (int s = 0; s < sub; s++) {
      long g = blk * sub + s;
      uint32_t sbits;
      __m512bh q = (__m512bh)bf16_quants(type, row, blk, s, &scale, &sbits, &min);
      if (sub == 1) {
        float d;
        memcpy(&d, &sbits, sizeof d);
        scale = vsplat(d);
      }
      _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
        const uint16_t *p = xs + (r * G + g) * SPLIT_WORDS;
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), q, (__m512bh)_mm512_load_si512(p + 64));
        t = _mm512_dpbf16_ps(t, q, (__m512bh)_mm512_load_si512(p + 32));
        t = _mm512_dpbf16_ps(t, q, (__m512bh)_mm512_load_si512(p));
        acc[r] += scale * (vf)t;
        if (has_min) macc[r] += min * xsum[r * G + g];
      }
    }
  }
  for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]) + macc[r] + bias;
}

/* y[c] = x . weight row c + bias[c] for C (constant once inlined) consecutive rows of one
 * part, row_bytes apart, and a single x row: the C rows' sums are independent chains (one
 * row's sums would wait on each other's FMA latency), x's pieces are loaded once per group. */
ALWAYS_INLINE void bf16_rows(int C, int type, const uint16_t *xs, const float *xsum,
                             const uint8_t *row, long row_bytes, long K, float *y,
                             const float *bias) {
  const int sub = type == PLAIT_GGML_Q4_K || type == PLAIT_GGML_Q5_K ||
                  type == PLAIT_GGML_Q6_K ? 8 : 1;
  const int has_min = type == PLAIT_GGML_Q4_1 || (sub == 8 && type != PLAIT_GGML_Q6_K);
  const long step = C * row_bytes / (K / 32);  /* bytes of the C rows per group */
  vf acc[WROWS], scale;
  float macc[WROWS], min;
  for (int c = 0; c < C; c++) acc[c] = (vf){0}, macc[c] = 0.0f;
  for (long blk = 0; blk < K / 32 / sub; blk++) {
    _Pragma("GCC unroll 8") for (int s = 0; s < sub; s++) {
      long g = blk * sub + s;
      const uint16_t *p = xs + g * SPLIT_WORDS;
      /* the next C rows, as far into them as these are: interleaved rows of a few hundred
       * bytes throw off the hardware prefetcher (2 lines: a group spans <= 4 x 34 bytes) */
      const char *ahead = (const char *)row + C * row_bytes + g * step;
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
      __m512bh x2 = (__m512bh)_mm512_load_si512(p + 64),
               x1 = (__m512bh)_mm512_load_si512(p + 32), x0 = (__m512bh)_mm512_load_si512(p);
      _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
        uint32_t sbits;
        __m512bh q = (__m512bh)bf16_quants(type, row + c * row_bytes, blk, s, &scale, &sbits,
                                           &min);
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), q, x2);
        t = _mm512_dpbf16_ps(t, q, x1);
        t = _mm512_dpbf16_ps(t, q, x0);
        if (sub == 8)
          acc[c] += scale * (vf)t;
        else  /* the scale broadcast by the FMA's load (a register broadcast is a shuffle) */
          __asm__("vfmadd231ps %2%{1to16%}, %1, %0" : "+v"(acc[c]) : "v"(t), "m"(sbits));
        if (has_min) macc[c] += min * xsum[g];
      }
    }
  }
  for (int c = 0; c < C; c++) y[c] = hsum(acc[c]) + macc[c] + (bias ? bias[c] : 0.0f);
}

/* Each type's functions for its QUANT_TRAITS row: bf16_tile at R = 1 .. FUSED_ROWS x rows,
 * bf16_rows at WROWS weight rows. */
#if FUSED_ROWS > 8
#define MORE_TILES(t) TILE(9, t) TILE(10, t) TILE(11, t) TILE(12, t)
#else
#define MORE_TILES(t)
#endif
#define TILE(n, t) \
  case n: bf16_tile(n, t, a->pieces, a->xsum, row, K, y, ldy, bias); return;
#define BF16_FUNCTIONS(t)                                                                 \
  static void bf16_tiles_##t(const acts_t *a, int R, const uint8_t *row, long K, float *y, \
                             long ldy, float bias) {                                      \
    switch (R) { TILE(1, t) TILE(2, t) TILE(3, t) TILE(4, t) TILE(5, t) TILE(6, t)         \
                 TILE(7, t) TILE(8, t) MORE_TILES(t) default: return; }                   \
  }                                                                                       \
  static void bf16_rows_##t(const uint16_t *xs, const float *xsum, const uint8_t *row,    \
                            long row_bytes, long K, float *y, const float *bias) {        \
    bf16_rows(WROWS, t, xs, xsum, row, row_bytes, K, y, bias);                            \
  }
BF16_FUNCTIONS(PLAIT_GGML_Q4_0) BF16_FUNCTIONS(PLAIT_GGML_Q4_1) BF16_FUNCTIONS(PLAIT_GGML_Q5_0)
BF16_FUNCTIONS(PLAIT_GGML_Q4_K) BF16_FUNCTIONS(PLAIT_GGML_Q5_K) BF16_FUNCTIONS(PLAIT_GGML_Q6_K)
#undef BF16_FUNCTIONS
#undef TILE
#undef MORE_TILES

/* y[n0 .. n0 + nr) for a single x row: runs of WROWS rows of one part whose type has
 * bf16_rows, any other row through row_dot. */
static void bf16_chunk(const acts_t *a, const part_t *parts, int num_parts, long n0, long nr,
                       long K, const float *bias, float *y) {
  for (long n = n0; n < n0 + nr;) {
    const part_t *p = part_of(parts, num_parts, n);
    if (n + WROWS <= n0 + nr && n + WROWS <= p->first + p->rows && p->traits &&
        p->traits->bf16_rows) {
      p->traits->bf16_rows(a->pieces, a->xsum, p->data + (n - p->first) * p->row_bytes,
                           p->row_bytes, K, y + n, bias ? bias + n : NULL);
      n += WROWS;
    } else {
      row_dot(a, 1, p, n, K, y + n, 1, bias ? bias[n] : 0.0f);
      n++;
    }
  }
}
#endif /* QUANT_BF16 */

#endif /* PLAIT_CPU_QGEMM_BF16_H */
