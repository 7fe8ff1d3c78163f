/* The AMX-BF16 product of repacked weights for prompt rows (plait_repack_gemm_bf16,
 * plait_cpu.h); included by repack.c after repack_amx.h, whose tile state it shares, and
 * repack_wide.h, whose wd_fill widens the codes.
 *
 * The int8 rungs fold every 32-weight group's int32 sums into float32 with the group's
 * scales (x's and W's), one vector operation chain per x row, group and 16 columns: on
 * AMX that fold, not the tile product, bounds them. Here W's values themselves go into
 * the tiles, so nothing is folded: a thread widens its unit's (up to) two tiles of 16
 * columns once per call into bfloat16 B tiles, w = a c - o rounded to bfloat16 (every
 * group of the whole K, in its scratch), and x is rounded to bfloat16 once; then each
 * block of 32 x rows and 32 columns is four float32 C tiles that start at the bias (or 0)
 * and accumulate by TDPBF16PS over every group of K in order, stored once:
 *
 *   A  tmm0, tmm1   16 x rows x 32 bf16 (64 bytes)   xb[m + r][32 g .. 32 g + 31]
 *   B  tmm2, tmm3   16 pairs x 16 columns x 2 bf16   (w[n][2 i], w[n][2 i + 1]) at row i
 *   C  tmm4 .. 7    16 x 16 float32                  C[r][n] += sum_k x[r][k] w[n][k]
 *
 * A row's result depends on its own x row and W only (its A tile row, the same B tiles
 * in the same group order), never on the other rows or on M: the rows of a prompt give
 * the same bits whatever chunks the scheduler cuts it into. They are not the int8 rungs'
 * bits (other arithmetic): the engine sends prompt rows here and generated rows (decode,
 * verification) to plait_repack_gemm, so that each token's state has one definition.
 *
 * A gate | up weight's product can end in silu(gate) * up instead (plait_repack_gemm_bf16_
 * silu): a unit's two tiles are the gate's tile t and the up's tile t, and the epilogue
 * stores silu_mul of their C tiles, never the product itself.
 */
#ifndef PLAIT_CPU_REPACK_AMX_BF16_H
#define PLAIT_CPU_REPACK_AMX_BF16_H

#if REPACK_AMX && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define REPACK_AMX_BF16 1

#define AB_TILE 1024 /* bytes of a B tile (16 pairs x 16 columns x 2 bf16) or a C tile */

/* plait_repack_gemm_bf16 takes more than AB_BLOCK_ROWS rows of K <= AB_BLOCK_MAX_K in
 * near-equal blocks of at most that many (multiples of 32), each a whole product (its
 * units' B tiles widened again). SmolLM2's q|k|v and gate_up at 2048 rows (K = 576)
 * measured 1.3-3x faster in blocks of 512, K = 896 and 1536 up to 30 %; from K = 4864
 * widening again per block cost more than it saved (BENCHMARKS.md). Presumably L2: every
 * unit reads all of x's A tiles, 590 KB for 512 rows of K = 576 and 2.4 MB for 2048 (L2
 * is 2 MB a core here). Not the TLB: y on transparent huge pages changed nothing. */
#define AB_BLOCK_ROWS 512
#define AB_BLOCK_MAX_K 2048

/* Loads the calling thread's tile configuration: tmm0, tmm1 A; tmm2, tmm3 B; tmm4 .. tmm7
 * C; each 16 rows x 64 bytes. */
static void ab_config(void) {
  const int colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
  const int rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
  am_load_config(colsb, rows);
}

/* Group j of a widened chunk (wg: wd_fill's record of one tile, codes c - C as signed
 * bytes, a at +512, o at +576; Q6_K: half 1's a at +576) into a B tile bt: row i holds
 * (w[n][2 i], w[n][2 i + 1]) for n < 16, w = a c - o rounded to bfloat16 (nearest even).
 * halves: 2 for Q6_K (a per 16 weights, no o). */
ALWAYS_INLINE void ab_tile(int halves, const uint8_t *wg, uint8_t *bt) {
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25,
                                         9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2,
                                         17, 1, 16, 0);
  const __m512 a0 = _mm512_load_ps(wg + 512), o = _mm512_load_ps(wg + 576);
#pragma GCC unroll 8
  for (int s = 0; s < 8; s++) {
    /* V_s: byte 4 n + b = code of column n, weight 4 s + b */
    const __m512i v = _mm512_load_si512(wg + 64 * s);
    const __m512 a = halves == 2 && s >= 4 ? o : a0;
    __m512 w[4];
    for (int b = 0; b < 4; b++) {
      __m512i c = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
      w[b] = halves == 2 ? _mm512_mul_ps(a, _mm512_cvtepi32_ps(c))
                         : _mm512_fmsub_ps(a, _mm512_cvtepi32_ps(c), o);
    }
    /* rows 2 s (weights 4 s, 4 s + 1) and 2 s + 1 (4 s + 2, 4 s + 3), pairs interleaved */
    for (int h = 0; h < 2; h++) {
      __m512i lohi = (__m512i)_mm512_cvtne2ps_pbh(w[2 * h + 1], w[2 * h]);
      _mm512_store_si512(bt + 64 * (2 * s + h), _mm512_permutexvar_epi16(pairs, lohi));
    }
  }
}

/* Every group of T tiles (tile u at tile + u tile_bytes) into B tiles (group g of tile u
 * at bt + (g T + u) AB_TILE), through wide (am_fill_any's chunk, RP_WIDE_CHUNK groups). */
static void ab_fill(int type, int T, const uint8_t *tile, long tile_bytes, long groups,
                    uint8_t *wide, uint8_t *bt) {
  const int halves = type == PLAIT_GGML_Q6_K ? 2 : 1;
  for (long g0 = 0; g0 < groups; g0 += RP_WIDE_CHUNK) {
    long ng = groups - g0 < RP_WIDE_CHUNK ? groups - g0 : RP_WIDE_CHUNK;
    am_fill_any(type, T, tile, tile_bytes, g0, ng, wide);
    for (long j = 0; j < ng; j++)
      for (int u = 0; u < T; u++) {
        const uint8_t *wg = wide + (j * T + u) * RP_WIDE_GROUP;
        uint8_t *dst = bt + ((g0 + j) * T + u) * AB_TILE;
        if (halves == 2)
          ab_tile(2, wg, dst);
        else
          ab_tile(1, wg, dst);
      }
  }
}

/* C tile CT into y's 16 columns at column 16 U, rows m + ROW0 ..: straight where all 16
 * rows and columns are real, else through cbuf. */
#define AB_STORE(CT, ROW0, U)                                                             \
  do {                                                                                    \
    long rr = M - m - (ROW0) < 16 ? M - m - (ROW0) : 16;                                 \
    int cc = cols - 16 * (U) < 16 ? cols - 16 * (U) : 16;                                 \
    float *yt = y + (m + (ROW0)) * ldy + 16 * (U);                                        \
    if (rr == 16 && cc == 16) {                                                           \
      _tile_stored(CT, yt, 4 * ldy);                                                      \
    } else {                                                                              \
      _tile_stored(CT, cbuf, 64);                                                         \
      const __mmask16 mask = (__mmask16)((1u << cc) - 1);                                 \
      for (long r = 0; r < rr; r++)                                                       \
        _mm512_mask_storeu_ps(yt + r * ldy, mask, _mm512_load_ps(cbuf + 16 * r));         \
    }                                                                                     \
  } while (0)

/* C tile CT from the bias (bias_tiles: tile U's 16 rows of its bias, AB_TILE bytes a
 * tile) or 0 where bias is NULL. */
#define AB_START(CT, U)                                \
  do {                                                 \
    if (bias)                                          \
      _tile_loadd(CT, bias_tiles + (U) * AB_TILE, 64); \
    else                                               \
      _tile_zero(CT);                                  \
  } while (0)

/* act's 16 columns (rows m + ROW0 ..) = silu(C tile CG) * C tile CU, through cbuf (two
 * tiles): plait_silu_mul's vsilu_mul on the same values, so the same bits. */
#define AB_SILU(CG, CU, ROW0)                                                             \
  do {                                                                                    \
    long rr = M - m - (ROW0) < 16 ? M - m - (ROW0) : 16;                                 \
    _tile_stored(CG, cbuf, 64);                                                           \
    _tile_stored(CU, cbuf + 256, 64);                                                     \
    for (long r = 0; r < rr; r++) {                                                       \
      const vf yv = vsilu_mul(*(const vf *)(cbuf + 16 * r),                               \
                              *(const vf *)(cbuf + 256 + 16 * r));                        \
      _mm512_storeu_ps(act + (m + (ROW0) + r) * lda, (__m512)yv);                         \
    }                                                                                     \
  } while (0)

/* T tiles' B tiles (tile 0's group g at b0 + g bstride, tile 1's at b1 + g bstride) against
 * x rows [0, M) of xb (ab_round_x's blocks): y's columns [0, cols) = bias (bias_tiles: per
 * tile, 16 rows of its bias; unread where bias is NULL) + the sum over the groups in order.
 * With act (T = 2, no bias): instead of y, act's 16 columns = silu(tile 0) * tile 1 (lda
 * apart; cbuf two tiles). */
static void ab_unit(int T, const uint8_t *b0, const uint8_t *b1, long bstride, long G,
                    const uint16_t *xb, long M, const float *bias, const uint8_t *bias_tiles,
                    float *y, long ldy, int cols, float *cbuf, float *act, long lda) {
  for (long m = 0; m < M; m += 32) {
    const int two = m + 16 < M;
    const uint16_t *x0 = xb + m * 32 * G, *x1 = xb + (m + 16) * 32 * G;
    AB_START(4, 0);
    if (T == 2) AB_START(5, 1);
    if (two) {
      AB_START(6, 0);
      if (T == 2) AB_START(7, 1);
    }
    for (long g = 0; g < G; g++) {
      _tile_loadd(0, x0 + 512 * g, 64);
      _tile_loadd(2, b0 + g * bstride, 64);
      _tile_dpbf16ps(4, 0, 2);
      if (T == 2) {
        _tile_loadd(3, b1 + g * bstride, 64);
        _tile_dpbf16ps(5, 0, 3);
      }
      if (two) {
        _tile_loadd(1, x1 + 512 * g, 64);
        _tile_dpbf16ps(6, 1, 2);
        if (T == 2) _tile_dpbf16ps(7, 1, 3);
      }
    }
    if (act) {
      AB_SILU(4, 5, 0);
      if (two) AB_SILU(6, 7, 16);
      continue;
    }
    AB_STORE(4, 0, 0);
    if (T == 2) AB_STORE(5, 0, 1);
    if (two) {
      AB_STORE(6, 16, 0);
      if (T == 2) AB_STORE(7, 16, 1);
    }
  }
}
#undef AB_SILU
#undef AB_STORE
#undef AB_START

/* The bias tiles of a unit (bias: its columns, cols of them; NULL: none): 16 rows of
 * bias[16 u .. 16 u + 15] per tile u, 0 past cols. */
static void ab_bias_tiles(const float *bias, int T, int cols, uint8_t *dst) {
  if (!bias) return;
  for (int u = 0; u < T; u++) {
    int c = cols - 16 * u < 16 ? cols - 16 * u : 16;
    __m512 b = _mm512_maskz_loadu_ps((__mmask16)((1u << c) - 1), bias + 16 * u);
    for (int r = 0; r < 16; r++) _mm512_store_ps(dst + u * AB_TILE + 64 * r, b);
  }
}

/* x [M, K] float32 (ldx apart) rounded to bfloat16 (nearest even) into xb in A tiles'
 * blocks: rows m .. m + 15 (m a multiple of 16) of group g at xb + (m G + 16 g) 32, a row
 * 32 elements (64 bytes); rows past M zero. */
static void ab_round_x(const float *x, long M, long ldx, long K, uint16_t *xb, long M16) {
  const long G = K / 32;
#pragma omp parallel for schedule(static) if (M * K >= 16384)
  for (long m = 0; m < M16; m++) {
    uint16_t *dst = xb + (m / 16 * 16 * G + m % 16) * 32;
    for (long g = 0; g < G; g++) {
      __m512i v = _mm512_setzero_si512();
      if (m < M)
        v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * ldx + 32 * g + 16),
                                         _mm512_loadu_ps(x + m * ldx + 32 * g));
      _mm512_store_si512(dst + 512 * g, v);
    }
  }
}

#endif /* REPACK_AMX && __AMX_BF16__ && __AVX512BF16__ */
#endif /* PLAIT_CPU_REPACK_AMX_BF16_H */
