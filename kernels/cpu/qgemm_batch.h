/* plait_qgemm for a batch of x rows (AVX-512; M >= BATCH_MIN_ROWS, or 8 or 9 rows of long
 * K): every weight row decoded once for all of x's rows. Included by qgemm.c after part_t,
 * acts_t, part_of and dequant_groups.
 *
 * A chunk of BATCH_ROWS weight rows is decoded whole, row after row (one stream the hardware
 * prefetcher follows), into w [BATCH_ROWS, K] float32 (L2), then register tiles of 4 x rows
 * by 4 weight rows multiply it, K block by K block (<= 1024 weights), each tile's 16
 * accumulators (vectors along k) folded into one vector of 16 sums per block:
 *
 *                  k block                          k block
 *   x rows m0..m0+3 | ..... |   .   w rows c0..c0+3 | ..... |   ->  sums[rt][ct] lane 4 r + c
 *   (8 loads, 16 FMAs per 16 k, where fused_tile loads a row of x per FMA)
 *
 * The 4 x rows of a tile's block (16 KiB) stay in L1 across the chunk's column tiles, the
 * weights come from L2 (16 B per cycle at one FMA a cycle). Blocks of 1024 rather than 256:
 * 5% faster (fewer folds). float32 accumulation of the same products as
 * fused_tile; the sum over k is split by lane and by block (another order of additions).
 */
#ifndef PLAIT_CPU_QGEMM_BATCH_H
#define PLAIT_CPU_QGEMM_BATCH_H

#if LANES == 16
#define QGEMM_BATCH 1
/* Weight rows per chunk (4 column tiles), 32-weight groups per K block at most, x rows per
 * pass over a chunk (the partial sums' 6 x 4 vectors). */
#define BATCH_ROWS 16
#define BATCH_GROUPS 32
#define BATCH_M 24
/* x of fewer rows than BATCH_MIN_ROWS takes fused_tile's decode in registers instead (x's
 * tile stays in L1 there), but for 8 or 9 rows of at least BATCH_MIN_FLOATS. Measured, 1
 * thread: batched faster from M = 12 at K = 576 and 896 and M = 8 at K = 1536 and 4864,
 * slower at M = 8 at K = 576 and 896, M = 2 at K = 4864, mixed at M = 4 at K = 4864. */
#define BATCH_MIN_ROWS 10
#define BATCH_MIN_FLOATS 12288

/* a and b's lanes summed in pairs h apart (h = 8, 4, 2, 1): lanes l & h == 0 hold a[l] +
 * a[l ^ h], the others b[l] + b[l ^ h]; two masked shuffles and an add. */
ALWAYS_INLINE __m512 fold(int h, __m512 a, __m512 b) {
  const __mmask16 high = h == 8 ? 0xff00 : h == 4 ? 0xf0f0 : h == 2 ? 0xcccc : 0xaaaa;
  __m512 t1, t2;
  if (h == 8) {
    t1 = _mm512_mask_shuffle_f32x4(a, high, b, b, 0x4e);
    t2 = _mm512_mask_shuffle_f32x4(b, (__mmask16)~high, a, a, 0x4e);
  } else if (h == 4) {
    t1 = _mm512_mask_shuffle_f32x4(a, high, b, b, 0xb1);
    t2 = _mm512_mask_shuffle_f32x4(b, (__mmask16)~high, a, a, 0xb1);
  } else if (h == 2) {
    t1 = _mm512_mask_permute_ps(a, high, b, 0x4e);
    t2 = _mm512_mask_permute_ps(b, (__mmask16)~high, a, 0x4e);
  } else {
    t1 = _mm512_mask_permute_ps(a, high, b, 0xb1);
    t2 = _mm512_mask_permute_ps(b, (__mmask16)~high, a, 0xb1);
  }
  return _mm512_add_ps(t1, t2);
}

/* 16 vectors to one: lane l the sum of v[i]'s lanes, i = l's 4 bits reversed (15 folds). */
ALWAYS_INLINE vf reduce16(const vf *v) {
  __m512 t[16];
  for (int i = 0; i < 16; i++) t[i] = (__m512)v[i];
  _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) t[i] = fold(8, t[2 * i], t[2 * i + 1]);
  _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) t[i] = fold(4, t[2 * i], t[2 * i + 1]);
  _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) t[i] = fold(2, t[2 * i], t[2 * i + 1]);
  return (vf)fold(1, t[0], t[1]);
}

/* *sums += x rows r . w rows c over kb weights (kb % 16 == 0) in lane 4 r + c, for the R
 * (constant once inlined) x rows of a tile, ldx apart, and 4 weight rows ldw apart. */
ALWAYS_INLINE void batch_tile(int R, const float *x, long ldx, const float *w, long ldw,
                              long kb, vf *sums) {
  static const int REV[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  vf acc[16];
  for (int i = 0; i < 16; i++) acc[i] = (vf){0};
  for (long k = 0; k < kb; k += LANES) {
    vf wv[4];
    /* in registers: GCC would fold a load into each FMA (a load per FMA: load bound) */
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
      wv[c] = *(const vf *)(w + c * ldw + k);
      __asm__("" : "+v"(wv[c]));
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
      vf xv = *(const vf *)(x + r * ldx + k);
      __asm__("" : "+v"(xv));
      _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[REV[4 * r + c]] += xv * wv[c];
    }
  }
  *sums += reduce16(acc);
}

static void batch_tile_rows(int R, const float *x, long ldx, const float *w, long ldw,
                            long kb, vf *sums) {
  switch (R) {
    case 1: batch_tile(1, x, ldx, w, ldw, kb, sums); return;
    case 2: batch_tile(2, x, ldx, w, ldw, kb, sums); return;
    case 3: batch_tile(3, x, ldx, w, ldw, kb, sums); return;
    default: batch_tile(4, x, ldx, w, ldw, kb, sums); return;
  }
}

#include "qgemm_batch_bf16.h"

/* y[m0 .. m0 + mb) x [n0 .. n0 + nr) (mb <= BATCH_M, nr <= BATCH_ROWS) + bias from the
 * chunk's decoded rows w [BATCH_ROWS, K]: float32, or with a->xb set bfloat16 bits against
 * a->xb (rows nr.. of a last chunk: any finite values, their lanes dropped). */
static void batch_chunk(const acts_t *a, long m0, long mb, long n0, long nr, long K,
                        const float *bias, float *y, long ldy, const void *w) {
  const long G = K / 32, blocks = (G + BATCH_GROUPS - 1) / BATCH_GROUPS,
             per = (G + blocks - 1) / blocks, col_tiles = (nr + 3) / 4;
  vf sums[BATCH_M / 4][BATCH_ROWS / 4];
  memset(sums, 0, sizeof sums);
  for (long g0 = 0; g0 < G; g0 += per) {
    long ng = G - g0 < per ? G - g0 : per;
    for (long rt = 0; 4 * rt < mb; rt++) {
      int R = (int)(mb - 4 * rt < 4 ? mb - 4 * rt : 4);
      for (long ct = 0; ct < col_tiles; ct++) {
        long at = 4 * ct * K + 32 * g0;
#if QGEMM_BATCH_BF16
        if (a->xb) {
          batch_tile_bf16_rows(R, a->xb + (m0 + 4 * rt) * K + 32 * g0, K,
                               (const uint16_t *)w + at, K, 32 * ng, &sums[rt][ct]);
          continue;
        }
#endif
        batch_tile_rows(R, a->x + (m0 + 4 * rt) * a->ldx + 32 * g0, a->ldx,
                        (const float *)w + at, K, 32 * ng, &sums[rt][ct]);
      }
    }
  }
  for (long rt = 0; 4 * rt < mb; rt++)
    for (long ct = 0; ct < col_tiles; ct++) {
      float s[16];
      memcpy(s, &sums[rt][ct], sizeof s);
      for (long r = 0; r < 4 && 4 * rt + r < mb; r++)
        for (long c = 0, n = n0 + 4 * ct; c < 4 && n < n0 + nr; c++, n++)
          y[(m0 + 4 * rt + r) * ldy + n] = s[4 * r + c] + (bias ? bias[n] : 0.0f);
    }
}

/* y[M, N] = x[M, K] @ W^T + bias (K % 32 == 0, M >= 2): each thread owns chunks of
 * BATCH_ROWS weight rows (a w buffer of its own), each chunk decoded once (to bfloat16 when
 * a->xb is set, x rounded there: qgemm_batch_bf16.h) and met by x's rows BATCH_M at a time.
 * PLAIT_ERR_NOMEM or PLAIT_OK. */
static int qgemm_batch(const acts_t *a, long M, const part_t *parts, int num_parts, long N,
                       long K, const float *bias, float *y, long ldy) {
  const long chunks = (N + BATCH_ROWS - 1) / BATCH_ROWS;
  int rc = PLAIT_OK;
#pragma omp parallel
  {
    const size_t bytes = (a->xb ? sizeof(uint16_t) : sizeof(float)) * (size_t)(BATCH_ROWS * K);
    void *w = aligned_alloc(64, bytes);
    if (!w) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
      memset(w, 0, bytes);
#pragma omp for schedule(static)
      for (long c = 0; c < chunks; c++) {
        long n0 = c * BATCH_ROWS, nr = N - n0 < BATCH_ROWS ? N - n0 : BATCH_ROWS;
        for (long i = 0; i < nr; i++) {
          const part_t *p = part_of(parts, num_parts, n0 + i);
#if QGEMM_BATCH_BF16
          if (a->xb) {
            dequant_row_bf16(p, n0 + i - p->first, K, (uint16_t *)w + i * K);
            continue;
          }
#endif
          dequant_groups(p, n0 + i - p->first, 0, K / 32, (float *)w + i * K);
        }
        for (long m0 = 0; m0 < M; m0 += BATCH_M)
          batch_chunk(a, m0, M - m0 < BATCH_M ? M - m0 : BATCH_M, n0, nr, K, bias, y, ldy, w);
      }
    }
    free(w);
  }
  return rc;
}
#endif /* LANES == 16 */

#endif /* PLAIT_CPU_QGEMM_BATCH_H */
