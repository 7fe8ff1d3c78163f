/* The prefill rung of the AVX512-VNNI repacked product (repack.c's plait_repack_gemm takes it
 * for a part of M >= wd_min_rows(type) x rows: Q6_K from 24, Q5_0 / Q5_K from 128); included by
 * repack.c after repack_vnni.h, whose vn_codes it reuses.
 *
 * vnni_tiles widens a tile's 4 (5, 6) bit codes and converts its scales again for every
 * register tile of RP_PAIR_ROWS (RP_TILE_ROWS) x rows: at M = 64 sixteen times. Here a
 * thread widens a chunk of RP_WIDE_CHUNK groups of its unit's (up to) two tiles once into a
 * scratch of its own, then every register tile of x rows reads that chunk with plain
 * 64-byte loads; the weights stream from memory once per product, the chunk (2 x 16 x 640 =
 * 20 KB) stays in L1 while all M rows pass it:
 *
 *   unit = tiles u = 0, 1 (32 columns)     scratch, RP_WIDE_GROUP = 640 bytes a group a tile
 *   for chunk c of the K / 32 groups:      +--------------------+ group j, tile 0
 *     widen c once (wd_fill) ------------> | +0   V_0 .. V_7    |  8 x 64 bytes of codes
 *     for x rows m = 0, 4, 8, ...:         | +512 a [16] f32    |  (Q6_K: half 0's a)
 *       f = y[m..m+3] (0 for c = 0)        | +576 o [16] f32    |  (Q6_K: half 1's a)
 *       fold c's groups in (wd_tiles)      +--------------------+ group j, tile 1, ...
 *       y[m..m+3] = f (+ bias after the last chunk)
 *
 * The arithmetic is vnni_tiles' to the bit: the same codes meet the same activations in
 * vpdpbusd (int32 sums, exact) from the same -C sum q start, then per row and group the same
 * float32 operations in the same order, f = fma(cvt(I), a * sx, f) and, for Q4_1 / Q4_K /
 * Q5_K, f = fnma(o, sxq, f) with o stored as w = a c - o defines it (Q4_1: o = -m, and
 * fnma(-m, t, f) is vnni_tiles' fma(m, t, f): negation is exact). Between chunks a row's f
 * waits in y (float32, exact); the bias is added once, after the last chunk. So c_tile
 * (repack.c) still defines the result.
 */
#ifndef PLAIT_CPU_REPACK_WIDE_H
#define PLAIT_CPU_REPACK_WIDE_H

#include <limits.h>

#if REPACK_VNNI

/* The fewest x rows that take this rung for a part of a GGML type: below them register
 * tiles of 8 rows against one tile (vnni_tiles), widening its codes again per 8 rows, cost
 * less than the scratch's stores and reloads. The cheaper a type's widening, the later the
 * rung pays: Q8_0's codes are bytes already and the 4-bit types' an and and a shift, so they
 * never take it. Measured on a Zen 4 EPYC, per type, every weight of a model once at M
 * rows, the rung against none (ms; BENCHMARKS.md): Q6_K (Qwen2.5-Coder-1.5B) 16.8 / 16.4
 * at 16, 25.2 / 26.2 at 24, 30.7 / 33.0 at 32, 210 / 257 at 256; Q5_0 (the 0.5B's gate_up)
 * about even at 128, 184 / 190 at 256; Q4_K (the 1.5B's gate_up) 101 / 87 at 32, 679 / 670
 * at 256; Q4_1 (SmolLM2, all its layers) 29.6 / 24.7 at 64, 104 / 98 at 256. Q5_K as
 * Q5_0, Q4_0 as Q4_1: unmeasured. */
static inline long wd_min_rows(int type) {
  switch (type) {
    case PLAIT_GGML_Q6_K: return 24;
    case PLAIT_GGML_Q5_0:
    case PLAIT_GGML_Q5_K: return 128;
    default: return LONG_MAX;
  }
}
/* 32-weight groups widened at once: 2 tiles x 16 x 640 bytes = 20 KB, within L1d (48 KB)
 * beside the x rows' codes. */
#define RP_WIDE_CHUNK 16
#define RP_WIDE_GROUP 640
/* x rows per register tile: two tiles against 4 rows, or one against 8 (as vnni_tiles). */
#define RP_WIDE_PAIR_ROWS 4
#define RP_WIDE_TILE_ROWS 8

/* The scratch bytes of one thread. */
static inline size_t wd_scratch_bytes(void) { return (size_t)2 * RP_WIDE_CHUNK * RP_WIDE_GROUP; }

/* Groups g0 .. g0 + ng - 1 of T tiles (tile u at tile + u tile_bytes) widened into dst
 * (64-byte aligned; group j of tile u at (j T + u) RP_WIDE_GROUP), every code less sub
 * (modulo 256: this rung 0, unsigned codes; repack_amx.h's the type's offset C, signed
 * codes). type, T, sub constants once inlined. */
ALWAYS_INLINE void wd_fill(int type, int T, const uint8_t *tile, long tile_bytes, long g0,
                           long ng, int sub, uint8_t *dst) {
  const rp_layout_t *L = rp_layout(type);
  const int per_block = L->qk / 32;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32((int)0x80000000u));
  for (long j = 0; j < ng; j++) {
    long g = g0 + j;
    int gi = (int)(g % per_block);
    for (int u = 0; u < T; u++) {
      const uint8_t *rec = tile + u * tile_bytes + g / per_block * L->rec_bytes;
      uint8_t *out = dst + (j * T + u) * RP_WIDE_GROUP;
      vn_prefetch_group(L, rec, gi); /* 12-16 rows: 0.83x the time of none (the 1.5B, 13 rows) */
#pragma GCC unroll 8
      for (int s = 0; s < 8; s++)
        _mm512_store_si512(out + 64 * s,
                           _mm512_sub_epi8(vn_codes(type, L, rec, rec + gi * L->code_group, gi, s),
                                           _mm512_set1_epi8((char)sub)));
      __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + L->d)));
      __m512 sa = d, o = _mm512_setzero_ps();
      if (L->m >= 0) {
        __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(rec + L->m)));
        o = type == PLAIT_GGML_Q4_1 ? _mm512_xor_ps(dm, sign) /* o = -m */
                                    : _mm512_mul_ps(dm, vn_bytes(rec + L->mn + 16 * gi, 0));
        if (type != PLAIT_GGML_Q4_1) sa = _mm512_mul_ps(d, vn_bytes(rec + L->sc + 16 * gi, 0));
      } else if (type == PLAIT_GGML_Q6_K) {
        sa = _mm512_mul_ps(d, vn_bytes(rec + L->sc + 16 * (2 * gi), 1));
        o = _mm512_mul_ps(d, vn_bytes(rec + L->sc + 16 * (2 * gi + 1), 1)); /* half 1's a */
      }
      _mm512_store_ps(out + 512, sa);
      _mm512_store_ps(out + 576, o);
    }
  }
}

/* Columns 0 .. cols - 1 (cols <= 16 T) of T tiles' widened groups g0 .. g0 + ng - 1 (wide)
 * against R rows of a: f from y (first: from 0), then y = f (last: f + bias). halves: 2 for
 * Q6_K (its a per 16 weights), else 1; C: the type's offset / a (rp_layout_t.offset);
 * has_o: the fnma of o (Q4_1, Q4_K, Q5_K). halves, has_o, T, R constants once inlined. */
ALWAYS_INLINE void wd_tiles(int halves, int has_o, int T, int R, const uint8_t *wide, long g0,
                            long ng, int C, const rp_acts_t *a, int first, int last,
                            const float *bias, float *y, long ldy, int cols) {
  const int steps = 8 / halves;
  __mmask16 mask[2];
  __m512 f[2][RP_WIDE_TILE_ROWS];
  for (int u = 0; u < T; u++) {
    int c = cols - 16 * u;
    mask[u] = c >= 16 ? 0xffff : (__mmask16)((1u << c) - 1);
    for (int r = 0; r < R; r++)
      f[u][r] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[u], y + r * ldy + 16 * u);
  }
  for (long j = 0; j < ng; j++) {
    long g = g0 + j;
    const uint8_t *wg = wide + j * T * RP_WIDE_GROUP;
    for (int h = 0; h < halves; h++) {
      __m512i acc[2][RP_WIDE_TILE_ROWS];
      for (int r = 0; r < R; r++) {
        const int32_t *s16 = a->sum16 + r * 2 * a->groups + 2 * g;
        int32_t S = halves == 2 ? s16[h] : s16[0] + s16[1];
        for (int u = 0; u < T; u++) acc[u][r] = _mm512_set1_epi32(-C * S);
      }
#pragma GCC unroll 8
      for (int s = steps * h; s < steps * (h + 1); s++) {
        __m512i v[2];
        for (int u = 0; u < T; u++) v[u] = _mm512_load_si512(wg + u * RP_WIDE_GROUP + 64 * s);
        for (int r = 0; r < R; r++) {
          int32_t quad;
          memcpy(&quad, a->q + r * a->ldq + 32 * g + 4 * s, sizeof quad);
          __m512i xb = _mm512_set1_epi32(quad);
          for (int u = 0; u < T; u++) acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], v[u], xb);
        }
      }
      __m512 sa[2], o[2];
      for (int u = 0; u < T; u++) {
        sa[u] = _mm512_load_ps(wg + u * RP_WIDE_GROUP + 512 + 64 * h);
        o[u] = has_o ? _mm512_load_ps(wg + u * RP_WIDE_GROUP + 576) : _mm512_setzero_ps();
      }
      for (int r = 0; r < R; r++) {
        __m512 sx = _mm512_set1_ps(a->sx[r * a->groups + g]);
        __m512 t = _mm512_set1_ps(a->sxq[r * a->groups + g]);
        for (int u = 0; u < T; u++) {
          f[u][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[u][r]), _mm512_mul_ps(sa[u], sx),
                                    f[u][r]);
          if (has_o) f[u][r] = _mm512_fnmadd_ps(o[u], t, f[u][r]);
        }
      }
    }
  }
  for (int u = 0; u < T; u++) {
    __m512 b = last && bias ? _mm512_maskz_loadu_ps(mask[u], bias + 16 * u) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
      __m512 out = last ? _mm512_add_ps(f[u][r], b) : f[u][r];
      _mm512_mask_storeu_ps(y + r * ldy + 16 * u, mask[u], out);
    }
  }
}

#define WD_CALL(T, R) \
  wd_tiles(halves, has_o, T, R, wide, g0, ng, C, a, first, last, bias, y, ldy, cols)
/* wd_tiles for one (halves, has_o): T = 2 (R <= RP_WIDE_PAIR_ROWS) or 1 (R <=
 * RP_WIDE_TILE_ROWS). */
#define WD_SHAPES(NAME, H, O)                                                                 \
  static void wd_shapes_##NAME(int T, int R, const uint8_t *wide, long g0, long ng, int C,    \
                               const rp_acts_t *a, int first, int last, const float *bias,    \
                               float *y, long ldy, int cols) {                                \
    const int halves = H, has_o = O;                                                          \
    if (T == 2) {                                                                             \
      switch (R) {                                                                            \
        case 1: WD_CALL(2, 1); return;                                                       \
        case 2: WD_CALL(2, 2); return;                                                       \
        case 3: WD_CALL(2, 3); return;                                                       \
        default: WD_CALL(2, 4); return;                                                      \
      }                                                                                       \
    }                                                                                         \
    switch (R) {                                                                              \
      case 1: WD_CALL(1, 1); return;                                                         \
      case 2: WD_CALL(1, 2); return;                                                         \
      case 3: WD_CALL(1, 3); return;                                                         \
      case 4: WD_CALL(1, 4); return;                                                         \
      case 5: WD_CALL(1, 5); return;                                                         \
      case 6: WD_CALL(1, 6); return;                                                         \
      case 7: WD_CALL(1, 7); return;                                                         \
      default: WD_CALL(1, 8); return;                                                        \
    }                                                                                         \
  }
WD_SHAPES(plain, 1, 0) WD_SHAPES(offset, 1, 1) WD_SHAPES(halves, 2, 0)
#undef WD_SHAPES
#undef WD_CALL

/* wd_fill of a type that takes the rung (wd_min_rows) for T = 1 or 2 tiles. */
static void wd_fill_any(int type, int T, const uint8_t *tile, long tile_bytes, long g0, long ng,
                        uint8_t *dst) {
  switch (type) {
#define WD_TYPE(t)                                                                      \
  case PLAIT_GGML_##t:                                                                  \
    if (T == 2)                                                                         \
      wd_fill(PLAIT_GGML_##t, 2, tile, tile_bytes, g0, ng, 0, dst);                     \
    else                                                                                \
      wd_fill(PLAIT_GGML_##t, 1, tile, tile_bytes, g0, ng, 0, dst);                     \
    return;
    WD_TYPE(Q5_0) WD_TYPE(Q5_K) WD_TYPE(Q6_K)
#undef WD_TYPE
    default: return;
  }
}

/* T tiles (columns 0 .. cols - 1 of them) against x rows [0, M) of a: y [M rows, ldy apart]
 * = the product + bias (NULL: none), a chunk of groups at a time through scratch
 * (wd_scratch_bytes, 64-byte aligned). */
static void wd_unit(const rp_part_t *p, int T, const uint8_t *tile, const rp_acts_t *a, long M,
                    long K, const float *bias, float *y, long ldy, int cols, uint8_t *scratch) {
  const rp_layout_t *L = p->lay;
  long groups = K / 32;
  int rows_per = T == 2 ? RP_WIDE_PAIR_ROWS : RP_WIDE_TILE_ROWS;
  for (long g0 = 0; g0 < groups; g0 += RP_WIDE_CHUNK) {
    long ng = groups - g0 < RP_WIDE_CHUNK ? groups - g0 : RP_WIDE_CHUNK;
    int first = g0 == 0, last = g0 + ng == groups;
    wd_fill_any(p->type, T, tile, p->tile_bytes, g0, ng, scratch);
    for (long m = 0; m < M; m += rows_per) {
      int R = (int)(M - m < rows_per ? M - m : rows_per);
      rp_acts_t at = rp_acts_from(a, m);
      float *yt = y + m * ldy;
      if (p->type == PLAIT_GGML_Q6_K)
        wd_shapes_halves(T, R, scratch, g0, ng, L->offset, &at, first, last, bias, yt, ldy, cols);
      else if (L->offset == 0)
        wd_shapes_offset(T, R, scratch, g0, ng, 0, &at, first, last, bias, yt, ldy, cols);
      else
        wd_shapes_plain(T, R, scratch, g0, ng, L->offset, &at, first, last, bias, yt, ldy,
                        cols);
    }
  }
}

#endif /* REPACK_VNNI */
#endif /* PLAIT_CPU_REPACK_WIDE_H */
