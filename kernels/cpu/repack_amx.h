/* The AMX-INT8 prefill rung of the repacked product (repack.c's plait_repack_gemm takes it
 * with isa PLAIT_REPACK_AMX for a part of M >= am_min_rows(type) x rows: 32 or 48 by type,
 * never Q6_K); included by repack.c after repack_wide.h, whose wd_fill widens the codes.
 *
 * The wide rung (repack_wide.h) spends 8 vpdpbusd per x row, group and 16 columns; here
 * the tile unit (TMUL) computes 16 rows x 16 columns of a group's int32 sums in one
 * instruction, and the vector units keep only the float32 epilogue. A thread widens a chunk
 * of up to AM_CHUNK groups of its unit's (up to) two tiles once, as the wide rung does, but
 * as signed codes c - C (C: the type's offset / a, rp_layout_t.offset; 0 for Q4_1 / Q4_K
 * / Q5_K), which fit int8 for every type (Q8_0: c - 128 is the file's q). Per 32-weight
 * group the 8 vectors V_0 .. V_7 (byte 4 n + b of V_s = code of column n, weight 4 s + b)
 * are exactly the B tile of TDPBSSD for K = 32, N = 16, and the x rows' int8 codes are the
 * A tile as quantize_acts stores them (rows ldq bytes apart):
 *
 *   A  tmm0   16 x rows x 32 bytes   q[m + r][32 g .. 32 g + 31]
 *   B  tmm1   8 x 64 bytes           V_0 .. V_7 of group g, one tile of 16 columns
 *   C  tmm4.. 16 x 16 int32          I = sum_k q_k (c_k - C)   (tdpbssd: exact)
 *
 * so I is the int32 c_tile computes as sum q c - C sum q (|I| < 2^20), with no offset
 * left to add. Per x row block of 16 and tile of 16 columns, f[16] (one vector a row)
 * stays in registers across the chunk's groups; the C tiles are stored to cbuf and folded
 * in per row with c_tile's float32 operations in c_tile's order:
 *
 *   f = fma(cvt(I), a * sx, f);  f = fnma(o, sxq, f)   (Q4_1 / Q4_K / Q5_K)
 *
 *   groups of a chunk, batches of 4:   b0     b1     b2     b3 ...
 *   tile unit (tdpbssd x 4)            |--b1--|--b2--|--b3--|
 *   stores of C (4 tiles)                     b1     b2     b3
 *   vector units (fold 4 x 16 rows)    |--b0--|--b1--|--b2--|
 *
 * (am_block: a batch's products run during the previous batch's fold, and are stored
 * before the fold that reads them starts, so no load waits on a tile store.) Between
 * chunks f waits in y (exact), the bias is added after the last: the bits are c_tile's.
 * The x rows are padded with zero rows to a multiple of 16 (quantize_acts), so every A
 * tile has 16 rows; only the M real rows are stored.
 *
 * Q6_K's scale is per 16 weights: two K = 16 products, stores and folds a group measured
 * slower than its wide rung at every M (16 to 512; BENCHMARKS.md), so it stays there.
 *
 * Linux grants AMX tile state per process on request (am_permitted: arch_prctl
 * ARCH_REQ_XCOMP_PERM); the tile configuration (am_config) is per thread, loaded by
 * each thread of a product that takes the rung and released after it.
 */
#ifndef PLAIT_CPU_REPACK_AMX_H
#define PLAIT_CPU_REPACK_AMX_H

#if REPACK_VNNI && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define REPACK_AMX 1

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"

/* The fewest x rows that take this rung for a part of a GGML type (below them, the
 * decode or wide rungs): where it beat the wide rung (Q8_0: vnni_tiles) in an interleaved
 * single-product sweep on SmolLM2's and Qwen2.5-0.5B's shapes, 1 thread, 2026-12-06
 * (BENCHMARKS.md: 5-20 % from 48 rows, a loaded host). Q6_K never (above). */
static inline long am_min_rows(int type) {
  switch (type) {
    case PLAIT_GGML_Q4_0:
    case PLAIT_GGML_Q5_0: return 32;
    case PLAIT_GGML_Q4_1:
    case PLAIT_GGML_Q8_0:
    case PLAIT_GGML_Q4_K:
    case PLAIT_GGML_Q5_K: return 48;
    default: return LONG_MAX;
  }
}

#define AM_ROWS 16   /* x rows per A tile */
#define AM_CBUF 1024 /* bytes of one stored C tile: 16 x 16 int32 */
/* Bytes from the first set of 4 stored C tiles to the second: not 4 KB, where each folded
 * row's load would share its address's low 12 bits with a store into the other set in
 * flight (4K aliasing); measured a little faster. */
#define AM_SET 6144
#define AM_ARCH_REQ_XCOMP_PERM 0x1023
#define AM_XFEATURE_XTILEDATA 18

/* The most 32-weight groups widened at once: 2 tiles x 64 x 640 bytes = 80 KB (in L2: the
 * B tiles' loads are contiguous 512 bytes). K is cut into chunks of equal size up to it,
 * so f passes through y as seldom as possible. */
#define AM_CHUNK 64

/* The scratch bytes of one thread: a chunk widened and 2 x 4 C tiles. */
static inline size_t am_scratch_bytes(void) {
  return (size_t)2 * AM_CHUNK * RP_WIDE_GROUP + AM_SET + 4 * AM_CBUF;
}

/* What this process may do with AMX tiles: PLAIT_AMX_ON, PLAIT_AMX_OFF (PLAIT_REPACK_AMX=0
 * in the environment), or -errno where Linux refused the tile state; asked of Linux once
 * (the answer holds for all threads). */
static int am_state(void) {
  static int state; /* 0: not asked yet */
  int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
  if (s == 0) {
    const char *env = getenv("PLAIT_REPACK_AMX");
    if (env && strcmp(env, "0") == 0)
      s = PLAIT_AMX_OFF;
    else
      s = syscall(SYS_arch_prctl, AM_ARCH_REQ_XCOMP_PERM, AM_XFEATURE_XTILEDATA) == 0
              ? PLAIT_AMX_ON
              : -(errno ? errno : EPERM);
    __atomic_store_n(&state, s, __ATOMIC_RELEASE);
  }
  return s;
}

/* Whether this process may use AMX tiles (am_state). */
static int am_permitted(void) { return am_state() == PLAIT_AMX_ON; }

/* This rung's tiles: tmm0 A 16 x 32 bytes, tmm1 B 8 x 64, tmm4 .. tmm7 C 16 x 64 (tmm2,
 * tmm3 unused). */
static void am_config(void) {
  const int colsb[8] = {32, 64, 0, 0, 64, 64, 64, 64}, rows[8] = {16, 8, 0, 0, 16, 16, 16, 16};
  am_load_config(colsb, rows);
}

/* Group s of a chunk into C tile CT where n > CT - 4: x codes q (16 rows, lda apart), the
 * chunk's widened codes wide (groups stride apart). */
#define AM_STEP(CT)                          \
  if (n > (CT) - 4) {                        \
    long s = s0 + (CT) - 4;                  \
    _tile_loadd(0, q + 32 * s, lda);         \
    _tile_loadd(1, wide + s * stride, 64);   \
    _tile_zero(CT);                          \
    _tile_dpbssd(CT, 0, 1);                  \
  }
#define AM_STORE(CT) \
  if (n > (CT) - 4) _tile_stored(CT, cb + ((CT) - 4) * AM_CBUF, 64);

/* Groups s0 .. s0 + n - 1 (n <= 4) of a chunk into C tiles tmm4 .. tmm4 + n - 1 (no
 * stores: see am_block's pipeline). */
ALWAYS_INLINE void am_dots(const int8_t *q, long lda, const uint8_t *wide, long stride, long s0,
                           int n) {
  AM_STEP(4) AM_STEP(5) AM_STEP(6) AM_STEP(7)
}

/* C tiles tmm4 .. tmm4 + n - 1 stored to cb, AM_CBUF bytes apart. */
ALWAYS_INLINE void am_stores(int n, uint8_t *cb) {
  AM_STORE(4) AM_STORE(5) AM_STORE(6) AM_STORE(7)
}
#undef AM_STEP
#undef AM_STORE

/* Folds a stored C tile (c: [16 rows][16] int32) into f[16] with scale vector sa (and o
 * where has_o); sx, sxq: the rows' scales of this group, G apart. */
ALWAYS_INLINE void am_fold(int has_o, const uint8_t *c, __m512 sa, __m512 o, const float *sx,
                           const float *sxq, long G, __m512 *f) {
#pragma GCC unroll 16
  for (int r = 0; r < AM_ROWS; r++) {
    __m512 I = _mm512_cvtepi32_ps(_mm512_load_si512(c + 64 * r));
    f[r] = _mm512_fmadd_ps(I, _mm512_mul_ps(sa, _mm512_set1_ps(sx[r * G])), f[r]);
    if (has_o) f[r] = _mm512_fnmadd_ps(o, _mm512_set1_ps(sxq[r * G]), f[r]);
  }
}

/* Columns 0 .. cols - 1 (<= 16) of one widened tile (wide: its group 0, groups `stride`
 * bytes apart) against x rows [0, R) (R <= 16; the A tiles read 16, a's padding) of a over
 * the chunk's groups g0 .. g0 + ng - 1: f from y (first: 0), y = f (last: + bias). cbuf:
 * two sets of 4 C tiles, AM_SET bytes apart (64-byte aligned). has_o constant once
 * inlined. */
ALWAYS_INLINE void am_block(int has_o, const uint8_t *wide, long stride, long g0,
                            long ng, const rp_acts_t *a, int R, int first, int last,
                            const float *bias, float *y, long ldy, int cols, uint8_t *cbuf) {
  const __mmask16 mask = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
  const long G = a->groups, lda = a->ldq;
  const int8_t *q = a->q + 32 * g0;
  __m512 f[AM_ROWS];
#pragma GCC unroll 16
  for (int r = 0; r < AM_ROWS; r++)
    f[r] = first || r >= R ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + r * ldy);
  /* Software pipeline over batches of 4 groups, 2 x 4 C tiles of cbuf: batch b + 1's
   * products (computed during the last fold) are stored, batch b + 2's start on the tile
   * unit, then batch b (stored an iteration ago) is folded in. The folds' loads follow
   * only stores whose products are done, and the tile unit works during the fold. */
#define AM_BATCH(b) (ng - 4 * (b) < 4 ? (int)(ng - 4 * (b)) : 4)
  am_dots(q, lda, wide, stride, 0, AM_BATCH(0));
  am_stores(AM_BATCH(0), cbuf);
  if (ng > 4) am_dots(q, lda, wide, stride, 4, AM_BATCH(1));
  for (long s0 = 0; s0 < ng; s0 += 4) {
    const uint8_t *cb = cbuf + (s0 / 4 & 1) * AM_SET;
    if (s0 + 4 < ng) am_stores(AM_BATCH(s0 / 4 + 1), cbuf + ((s0 / 4 + 1) & 1) * AM_SET);
    if (s0 + 8 < ng) am_dots(q, lda, wide, stride, s0 + 8, AM_BATCH(s0 / 4 + 2));
    for (int i = 0; i < 4 && s0 + i < ng; i++) {
      const uint8_t *wg = wide + (s0 + i) * stride;
      am_fold(has_o, cb + i * AM_CBUF, _mm512_load_ps(wg + 512), _mm512_load_ps(wg + 576),
              a->sx + g0 + s0 + i, a->sxq + g0 + s0 + i, G, f);
    }
  }
#undef AM_BATCH
  __m512 b = last && bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < AM_ROWS; r++) /* unrolled: f stays in registers */
    if (r < R) _mm512_mask_storeu_ps(y + r * ldy, mask, last ? _mm512_add_ps(f[r], b) : f[r]);
}

#define AM_BLOCK(NAME, O)                                                                   \
  static void am_block_##NAME(const uint8_t *wide, long stride, long g0, long ng,           \
                              const rp_acts_t *a, int R, int first, int last,               \
                              const float *bias, float *y, long ldy, int cols,              \
                              uint8_t *cbuf) {                                              \
    am_block(O, wide, stride, g0, ng, a, R, first, last, bias, y, ldy, cols, cbuf);         \
  }
AM_BLOCK(plain, 0) AM_BLOCK(offset, 1)
#undef AM_BLOCK

/* wd_fill of every repacked type for T = 1 or 2 tiles, as signed codes c - C (C the
 * type's offset: what this rung's and repack_amx_bf16.h's tiles read; this rung never
 * takes Q6_K, am_min_rows). */
static void am_fill_any(int type, int T, const uint8_t *tile, long tile_bytes, long g0, long ng,
                        uint8_t *dst) {
  switch (type) {
#define AM_TYPE(t, C)                                                                   \
  case PLAIT_GGML_##t:                                                                  \
    if (T == 2)                                                                         \
      wd_fill(PLAIT_GGML_##t, 2, tile, tile_bytes, g0, ng, C, dst);                     \
    else                                                                                \
      wd_fill(PLAIT_GGML_##t, 1, tile, tile_bytes, g0, ng, C, dst);                     \
    return;
    AM_TYPE(Q4_0, 8) AM_TYPE(Q4_1, 0) AM_TYPE(Q5_0, 16) AM_TYPE(Q8_0, 128) AM_TYPE(Q4_K, 0)
    AM_TYPE(Q5_K, 0) AM_TYPE(Q6_K, 32)
#undef AM_TYPE
    default: return;
  }
}

/* T tiles (columns 0 .. cols - 1 of them) against x rows [0, M) of a (padded to a multiple
 * of 16 rows): y [M rows, ldy apart] = the product + bias (NULL: none), a chunk of groups
 * at a time through scratch (am_scratch_bytes, 64-byte aligned). The calling thread has
 * loaded am_config. */
static void am_unit(const rp_part_t *p, int T, const uint8_t *tile, const rp_acts_t *a, long M,
                    long K, const float *bias, float *y, long ldy, int cols, uint8_t *scratch) {
  const rp_layout_t *L = p->lay;
  long groups = K / 32, stride = T * RP_WIDE_GROUP;
  long chunks = (groups + AM_CHUNK - 1) / AM_CHUNK, per = (groups + chunks - 1) / chunks;
  uint8_t *cbuf = scratch + 2 * AM_CHUNK * RP_WIDE_GROUP;
  for (long g0 = 0; g0 < groups; g0 += per) {
    long ng = groups - g0 < per ? groups - g0 : per;
    int first = g0 == 0, last = g0 + ng == groups;
    am_fill_any(p->type, T, tile, p->tile_bytes, g0, ng, scratch);
    for (long m = 0; m < M; m += AM_ROWS) {
      int R = (int)(M - m < AM_ROWS ? M - m : AM_ROWS);
      rp_acts_t at = rp_acts_from(a, m);
      for (int u = 0; u < T; u++) {
        const uint8_t *wide = scratch + u * RP_WIDE_GROUP;
        const float *b = bias ? bias + 16 * u : NULL;
        float *yt = y + m * ldy + 16 * u;
        int c = cols - 16 * u < 16 ? cols - 16 * u : 16;
        if (L->offset == 0)
          am_block_offset(wide, stride, g0, ng, &at, R, first, last, b, yt, ldy, c, cbuf);
        else
          am_block_plain(wide, stride, g0, ng, &at, R, first, last, b, yt, ldy, c, cbuf);
      }
    }
  }
}

#endif /* REPACK_VNNI && __AMX_TILE__ && __AMX_INT8__ */
#endif /* PLAIT_CPU_REPACK_AMX_H */
