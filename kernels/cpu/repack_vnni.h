/* The AVX512-VNNI product of repacked weights (repack.h) with int8 activations; included by
 * repack.c, whose c_tile is the same arithmetic in plain C (the same bits).
 *
 * One tile of 16 columns against R <= RP_TILE_ROWS x rows: per 32-weight group, the codes
 * of 4 weights x 16 rows are one vector V_s (s < 8), widened from 4 (5, 6) bits in
 * registers, and meet each row's 4 int8 activations (broadcast) in one vpdpbusd into the
 * row's int32 accumulator, which starts at -C sum q (the offsets that are a multiple of
 * the scale); then two float32 FMAs per row fold the group into the row's sums:
 *
 *   f = fma(cvt(I), a * sx, f);   f = fma(-o, sxq, f)   (Q4_1, Q4_K, Q5_K only)
 *
 * A 4-bit group costs 4 64-byte loads, 8 nibble extractions (and, shift) and 8 vpdpbusd
 * per row; the scales, per 16 columns, 1 or 2 conversions per group.
 */
#ifndef PLAIT_CPU_REPACK_VNNI_H
#define PLAIT_CPU_REPACK_VNNI_H

/* x rows per register tile: one tile of 16 columns against 8 rows, or two against 4 (8
 * int32 and 8 float32 accumulators, 16 of the 32 registers). */
#define RP_TILE_ROWS 8
#define RP_PAIR_ROWS 4

/* Bytes past a record's start that vnni_tiles prefetches while it reads the record: a
 * decode step reads each weight once from memory, and the hardware prefetchers alone keep
 * too few lines in flight for one core's share of the read bandwidth. The lines go to L2
 * (T1), not L1: on a Zen 4 EPYC a decode step's products (every weight once, one row) took
 * 0.74-0.90x the time of T0's, alternating in one process; 4096 bytes beat 2048, 3072,
 * 6144 and 8192 (BENCHMARKS.md). */
#define RP_PREFETCH_BYTES 4096

#if LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define REPACK_VNNI 1

/* V_s of group gi of a record (cg: the group's codes), as unsigned bytes. */
ALWAYS_INLINE __m512i vn_codes(int type, const rp_layout_t *L, const uint8_t *rec,
                               const uint8_t *cg, int gi, int s) {
  const __m512i lo4 = _mm512_set1_epi8(15);
  if (type == PLAIT_GGML_Q8_0) return _mm512_loadu_si512(cg + 64 * s);
  __m512i p = _mm512_loadu_si512(cg + 64 * (s / 2));
  __m512i c = _mm512_and_si512(s & 1 ? _mm512_srli_epi16(p, 4) : p, lo4);
  if (type == PLAIT_GGML_Q6_K) {
    __m512i h = _mm512_loadu_si512(rec + L->hbits + gi * 128 + 64 * (s / 4));
    int t = s % 4;
    h = t < 2 ? _mm512_slli_epi16(h, 4 - 2 * t) : t == 3 ? _mm512_srli_epi16(h, 2) : h;
    return _mm512_ternarylogic_epi32(c, h, _mm512_set1_epi8(0x30), 0xf8); /* c | h & 0x30 */
  }
  if (type == PLAIT_GGML_Q5_0 || type == PLAIT_GGML_Q5_K) {
    __m512i h = _mm512_loadu_si512(rec + L->hbits + gi * 64);
    __mmask64 bit = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << s)));
    return _mm512_mask_add_epi8(c, bit, c, _mm512_set1_epi8(16));
  }
  return c;
}

/* Prefetch (into L2) group gi's share of the record RP_PREFETCH_BYTES past rec: a record's
 * lines spread evenly over its groups, so that a walk over the record's groups fetches
 * the whole record that far ahead. */
ALWAYS_INLINE void vn_prefetch_group(const rp_layout_t *L, const uint8_t *rec, int gi) {
  const int groups = L->qk / 32, lines = (L->rec_bytes + 64 * groups - 1) / (64 * groups);
  const char *ahead = (const char *)rec + RP_PREFETCH_BYTES + 64 * lines * gi;
  for (int l = 0; l < lines; l++) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
}

/* 16 bytes at p widened to float32 (signed or not). */
ALWAYS_INLINE __m512 vn_bytes(const uint8_t *p, int is_signed) {
  __m128i b = _mm_loadu_si128((const __m128i *)p);
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

/* The codes of V_s for T tiles' records (T constant once inlined). */
#define VN_RECS(expr) for (int u = 0; u < T; u++) expr

/* Columns 0 .. cols - 1 (cols <= 16 T) of T adjacent tiles (tile u at tile + u tile_bytes)
 * against R rows of a; see repack.c's c_tile. type, T and R constants once inlined. */
ALWAYS_INLINE void vnni_tiles(int type, int T, int R, const uint8_t *tile, long tile_bytes,
                              const rp_acts_t *a, long K, const float *bias, float *y, long ldy,
                              int cols) {
  const rp_layout_t *L = rp_layout(type);
  const int groups = L->qk / 32, halves = type == PLAIT_GGML_Q6_K ? 2 : 1, steps = 8 / halves;
  __m512 f[2][RP_TILE_ROWS];
  for (int u = 0; u < T; u++)
    for (int r = 0; r < R; r++) f[u][r] = _mm512_setzero_ps();
  for (long blk = 0; blk < K / L->qk; blk++) {
    const uint8_t *rec[2];
    __m512 d[2], dm[2];
    VN_RECS({
      rec[u] = tile + u * tile_bytes + blk * L->rec_bytes;
      d[u] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec[u] + L->d)));
      dm[u] = L->m >= 0 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec[u] + L->m)))
                        : _mm512_setzero_ps();
    });
    for (int gi = 0; gi < groups; gi++) {
      long g = blk * groups + gi;
      VN_RECS(vn_prefetch_group(L, rec[u], gi));
      for (int h = 0; h < halves; h++) {
        __m512i acc[2][RP_TILE_ROWS];
        for (int r = 0; r < R; r++) {
          const int32_t *s16 = a->sum16 + r * 2 * a->groups + 2 * g;
          int32_t S = halves == 2 ? s16[h] : s16[0] + s16[1];
          VN_RECS(acc[u][r] = _mm512_set1_epi32(-L->offset * S));
        }
#pragma GCC unroll 8
        for (int s = steps * h; s < steps * (h + 1); s++) {
          __m512i v[2];
          VN_RECS(v[u] = vn_codes(type, L, rec[u], rec[u] + gi * L->code_group, gi, s));
          for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, a->q + r * a->ldq + 32 * g + 4 * s, sizeof quad);
            __m512i xb = _mm512_set1_epi32(quad);
            VN_RECS(acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], v[u], xb));
          }
        }
        __m512 sa[2], o[2];
        VN_RECS({
          sa[u] = d[u];
          o[u] = dm[u];
          if (type == PLAIT_GGML_Q4_K || type == PLAIT_GGML_Q5_K) {
            sa[u] = _mm512_mul_ps(d[u], vn_bytes(rec[u] + L->sc + 16 * gi, 0));
            o[u] = _mm512_mul_ps(dm[u], vn_bytes(rec[u] + L->mn + 16 * gi, 0));
          } else if (type == PLAIT_GGML_Q6_K) {
            sa[u] = _mm512_mul_ps(d[u], vn_bytes(rec[u] + L->sc + 16 * (2 * gi + h), 1));
          }
        });
        for (int r = 0; r < R; r++) {
          __m512 sx = _mm512_set1_ps(a->sx[r * a->groups + g]);
          __m512 t = _mm512_set1_ps(a->sxq[r * a->groups + g]);
          VN_RECS({
            f[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u][r]), _mm512_mul_ps(sa[u], sx),
                                      f[u][r]);
            if (type == PLAIT_GGML_Q4_1) f[u][r] = _mm512_fmadd_ps(o[u], t, f[u][r]); /* -m */
            if (type == PLAIT_GGML_Q4_K || type == PLAIT_GGML_Q5_K)
              f[u][r] = _mm512_fnmadd_ps(o[u], t, f[u][r]);
          });
        }
      }
    }
  }
  VN_RECS({
    int c = cols - 16 * u;
    __mmask16 mask = c >= 16 ? 0xffff : (__mmask16)((1u << c) - 1);
    __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * u) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++)
      _mm512_mask_storeu_ps(y + r * ldy + 16 * u, mask, _mm512_add_ps(f[u][r], b));
  });
}
#undef VN_RECS

#define VN_CALL(T, R) vnni_tiles(ty, T, R, tile, tile_bytes, a, K, bias, y, ldy, cols)
/* One type's vnni_tiles for T = 2 (R <= RP_PAIR_ROWS) or 1 (R <= RP_TILE_ROWS). */
#define VN_SHAPES(NAME)                                                                  \
  ALWAYS_INLINE void vn_shapes_##NAME(int T, int R, const uint8_t *tile, long tile_bytes, \
                                      const rp_acts_t *a, long K, const float *bias,      \
                                      float *y, long ldy, int cols) {                     \
    const int ty = PLAIT_GGML_##NAME;                                                     \
    if (T == 2) {                                                                         \
      switch (R) {                                                                        \
        case 1: VN_CALL(2, 1); return;                                                   \
        case 2: VN_CALL(2, 2); return;                                                   \
        case 3: VN_CALL(2, 3); return;                                                   \
        default: VN_CALL(2, 4); return;                                                  \
      }                                                                                   \
    }                                                                                     \
    switch (R) {                                                                          \
      case 1: VN_CALL(1, 1); return;                                                     \
      case 2: VN_CALL(1, 2); return;                                                     \
      case 3: VN_CALL(1, 3); return;                                                     \
      case 4: VN_CALL(1, 4); return;                                                     \
      case 5: VN_CALL(1, 5); return;                                                     \
      case 6: VN_CALL(1, 6); return;                                                     \
      case 7: VN_CALL(1, 7); return;                                                     \
      default: VN_CALL(1, 8); return;                                                    \
    }                                                                                     \
  }
VN_SHAPES(Q4_0) VN_SHAPES(Q4_1) VN_SHAPES(Q5_0) VN_SHAPES(Q8_0) VN_SHAPES(Q4_K)
VN_SHAPES(Q5_K) VN_SHAPES(Q6_K)
#undef VN_SHAPES
#undef VN_CALL

/* vnni_tiles of a repacked type: T tiles (1 or 2) against R rows (R <= RP_PAIR_ROWS where
 * T = 2, else <= RP_TILE_ROWS). */
static void vnni_tiles_any(int type, int T, int R, const uint8_t *tile, long tile_bytes,
                           const rp_acts_t *a, long K, const float *bias, float *y, long ldy,
                           int cols) {
  switch (type) {
#define VN_TYPE(t)                                                                  \
  case PLAIT_GGML_##t:                                                              \
    vn_shapes_##t(T, R, tile, tile_bytes, a, K, bias, y, ldy, cols);                \
    return;
    VN_TYPE(Q4_0) VN_TYPE(Q4_1) VN_TYPE(Q5_0) VN_TYPE(Q8_0) VN_TYPE(Q4_K) VN_TYPE(Q5_K)
    VN_TYPE(Q6_K)
#undef VN_TYPE
    default: return;
  }
}

#endif /* VNNI */
#endif /* PLAIT_CPU_REPACK_VNNI_H */
