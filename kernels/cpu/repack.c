/* Weights repacked once at load at their own bit width (layout: repack.h), their products
 * with x quantized to int8 per 32 weights, and their rows dequantized (plait_repack_*,
 * plait_cpu.h).
 *
 * The product, per x row, output column n and 32-weight group g (Q6_K: per half):
 *
 *   sum_k x_k w_nk  ~  f += (float)I * (a sx)  [+ (-o) sxq where o is not C a]
 *   I = sum_k q_k c_nk - C sum_k q_k    (int32, exact; C = 8, 16, 128, 32 or 0)
 *
 * with q = round(x / sx) (nearest even), sx = max |x| / 127 over the group, sxq = sx sum q.
 * The two float32 steps are FMAs in this order in both kernels: the AVX512-VNNI one
 * (repack_vnni.h; vpdpbusd computes I), and the plain C one below, which every build has:
 * they give the same bits. Threads (OpenMP, torch's pool) share units of two tiles (32
 * columns). Three rungs: up to a few register tiles of x rows, vnni_tiles widens the tiles'
 * codes for each (decode); from wd_min_rows(type) rows on (prefill, batched decode), the
 * rung of repack_wide.h widens each chunk of a unit's tiles once into a per-thread
 * scratch that all rows then read; with PLAIT_REPACK_AMX, from am_min_rows(type) rows,
 * repack_amx.h computes I for 16 rows x 16 columns a group with an AMX-INT8 tile product
 * from the same widened codes. All are the same arithmetic, so the same bits.
 */
#include "plait_cpu.h"
#include "repack.h"

/* ------------------------------------------------------------------------------------ */
/* Repacking                                                                             */
/* ------------------------------------------------------------------------------------ */

/* Code of weight k of a file block of `type` (the unsigned c of w = a c - o). */
static int src_code(int type, const uint8_t *b, int k) {
  int s = k / 32, l = k % 32;
  switch (type) {
    case PLAIT_GGML_Q4_0: return k < 16 ? b[2 + k] & 15 : b[2 + k - 16] >> 4;
    case PLAIT_GGML_Q4_1: return k < 16 ? b[4 + k] & 15 : b[4 + k - 16] >> 4;
    case PLAIT_GGML_Q5_0: {
      uint32_t qh;
      memcpy(&qh, b + 2, sizeof qh);
      int lo = k < 16 ? b[6 + k] & 15 : b[6 + k - 16] >> 4;
      return lo | (int)(qh >> k & 1) << 4;
    }
    case PLAIT_GGML_Q8_0: return b[2 + k] ^ 0x80;
    case PLAIT_GGML_Q4_K: {
      int q = b[16 + 32 * (s / 2) + l];
      return s & 1 ? q >> 4 : q & 15;
    }
    case PLAIT_GGML_Q5_K: {
      int q = b[48 + 32 * (s / 2) + l];
      return (s & 1 ? q >> 4 : q & 15) | (b[16 + l] >> s & 1) << 4;
    }
    default: { /* Q6_K: see quant.h's grp_q6_k */
      int h = s / 4, c = s % 4, lo = b[64 * h + 32 * (c % 2) + l];
      return (c < 2 ? lo & 15 : lo >> 4) | (b[128 + 32 * h + l] >> 2 * c & 3) << 4;
    }
  }
}

/* The 6-bit scale (*sc) and min (*mn) of sub-block s of Q4_K / Q5_K scale bytes q[12]. */
static void k4_scale_min(const uint8_t *q, int s, uint8_t *sc, uint8_t *mn) {
  if (s < 4) {
    *sc = q[s] & 63;
    *mn = q[s + 4] & 63;
  } else {
    *sc = (uint8_t)((q[s + 4] & 0xf) | (q[s - 4] >> 6) << 4);
    *mn = (uint8_t)((q[s + 4] >> 4) | (q[s] >> 6) << 4);
  }
}

/* Row n's file block b into record rec (zeroed beforehand; see repack.h). */
static void pack_row(int type, const rp_layout_t *L, const uint8_t *b, int n, uint8_t *rec) {
  for (int k = 0; k < L->qk; k++) {
    int c = src_code(type, b, k), gi = k / 32, s = k % 32 / 4, lane = 4 * n + k % 4;
    uint8_t *codes = rec + gi * L->code_group;
    if (type == PLAIT_GGML_Q8_0) {
      codes[64 * s + lane] = (uint8_t)c;
      continue;
    }
    codes[64 * (s / 2) + lane] |= (uint8_t)((c & 15) << (s & 1 ? 4 : 0));
    if (type == PLAIT_GGML_Q6_K)
      rec[L->hbits + gi * 128 + 64 * (s / 4) + lane] |= (uint8_t)((c >> 4) << 2 * (s % 4));
    else if (L->hbits >= 0)
      rec[L->hbits + gi * 64 + lane] |= (uint8_t)((c >> 4) << s);
  }
  switch (type) {
    case PLAIT_GGML_Q4_K:
    case PLAIT_GGML_Q5_K:
      memcpy(rec + L->d + 2 * n, b, 2);
      memcpy(rec + L->m + 2 * n, b + 2, 2);
      for (int s = 0; s < 8; s++)
        k4_scale_min(b + 4, s, rec + L->sc + 16 * s + n, rec + L->mn + 16 * s + n);
      return;
    case PLAIT_GGML_Q6_K:
      memcpy(rec + L->d + 2 * n, b + 208, 2);
      for (int h = 0; h < 16; h++) rec[L->sc + 16 * h + n] = b[192 + h];
      return;
    default:
      memcpy(rec + L->d + 2 * n, b, 2);
      if (L->m >= 0) memcpy(rec + L->m + 2 * n, b + 2, 2);
      return;
  }
}

long plait_repack_bytes(int type, long rows, long K) {
  const rp_layout_t *L = rp_layout(type);
  if (!L || rows < 0 || K <= 0 || K % L->qk) return PLAIT_ERR_SHAPES;
  return (rows + RP_ROWS - 1) / RP_ROWS * (K / L->qk) * L->rec_bytes;
}

int plait_repack(const void *src, int type, long rows, long K, void *dst) {
  long nbytes = plait_repack_bytes(type, rows, K);
  if (nbytes < 0 || (rows && (!src || !dst))) return PLAIT_ERR_SHAPES;
  const rp_layout_t *L = rp_layout(type);
  long blocks = K / L->qk, row_bytes = blocks * L->src_bytes, tiles = (rows + 15) / 16;
  memset(dst, 0, (size_t)nbytes);
#pragma omp parallel for schedule(static) if (rows * K > 65536)
  for (long t = 0; t < tiles; t++) {
    uint8_t *tile = (uint8_t *)dst + t * blocks * L->rec_bytes;
    for (int n = 0; n < RP_ROWS && 16 * t + n < rows; n++) {
      const uint8_t *row = (const uint8_t *)src + (16 * t + n) * row_bytes;
      for (long blk = 0; blk < blocks; blk++)
        pack_row(type, L, row + blk * L->src_bytes, n, tile + blk * L->rec_bytes);
    }
  }
  return PLAIT_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Descriptors                                                                           */
/* ------------------------------------------------------------------------------------ */

/* desc = [num_parts (| PLAIT_QGEMM_REPACKED), (address, type, rows) per part] of repacked
 * parts into parts[], their
 * total rows into *N; PLAIT_ERR_SHAPES for a type not repacked, K not a whole number of its
 * blocks, a count outside [1, PLAIT_MAX_PARTS], negative rows or rows at address 0. */
static int rp_read_desc(const int64_t *desc, long K, rp_part_t *parts, int *num_parts, long *N) {
  int64_t count = desc ? desc[0] & ~(int64_t)PLAIT_QGEMM_REPACKED : 0;
  if (K <= 0 || count < 1 || count > PLAIT_MAX_PARTS) return PLAIT_ERR_SHAPES;
  *num_parts = (int)count;
  *N = 0;
  for (int i = 0; i < *num_parts; i++) {
    rp_part_t *p = &parts[i];
    p->data = (const uint8_t *)(intptr_t)desc[1 + 3 * i];
    p->type = (int)desc[2 + 3 * i];
    p->rows = desc[3 + 3 * i];
    p->lay = rp_layout(p->type);
    if (!p->lay || K % p->lay->qk || p->rows < 0 || (p->rows && !p->data)) return PLAIT_ERR_SHAPES;
    p->first = *N;
    p->tiles = (p->rows + 15) / 16;
    p->tile_bytes = K / p->lay->qk * p->lay->rec_bytes;
    *N += p->rows;
  }
  return PLAIT_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Dequantization                                                                        */
/* ------------------------------------------------------------------------------------ */

/* Weight c of row n of a record in float32 with gguf-py's operations (its bits). */
static float rp_weight(const rp_layout_t *L, int type, const uint8_t *rec, int gi, int n, int k) {
  int c = rp_code(L, type, rec, gi, n, k);
  float d = rp_f16(rec, L->d, n), a, o;
  switch (type) {
    case PLAIT_GGML_Q4_0: return d * (float)(c - 8);
    case PLAIT_GGML_Q4_1: return rp_mul_add(d, (float)c, rp_f16(rec, L->m, n));
    case PLAIT_GGML_Q5_0: return d * (float)(c - 16);
    case PLAIT_GGML_Q8_0: return (float)(c - 128) * d;
    case PLAIT_GGML_Q6_K:
      rp_scale(L, type, rec, gi, k / 16, n, &a, &o);
      return a * (float)(c - 32);
    default: /* Q4_K, Q5_K */
      rp_scale(L, type, rec, gi, 0, n, &a, &o);
      return rp_mul_add(a, (float)c, -o);
  }
}

static void rp_dequant_row(const rp_part_t *p, long r, long K, float *dst) {
  const rp_layout_t *L = p->lay;
  const uint8_t *tile = p->data + r / 16 * p->tile_bytes;
  int n = (int)(r % 16);
  for (long k = 0; k < K; k++) {
    const uint8_t *rec = tile + k / L->qk * L->rec_bytes;
    int kb = (int)(k % L->qk);
    dst[k] = rp_weight(L, p->type, rec, kb / 32, n, kb % 32);
  }
}

int plait_repack_dequantize(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                            float *out) {
  rp_part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  long N;
  if (rp_read_desc(desc, K, parts, &num_parts, &N) != PLAIT_OK || num_rows < 0 ||
      (!rows && num_rows != N) || (num_rows && !out))
    return PLAIT_ERR_SHAPES;
  for (long i = 0; rows && i < num_rows; i++)
    if (rows[i] < 0 || rows[i] >= N) return PLAIT_ERR_SHAPES;
#pragma omp parallel for schedule(static) if (num_rows * K > 65536)
  for (long i = 0; i < num_rows; i++) {
    long n = rows ? rows[i] : i;
    int j = 0;
    while (j + 1 < num_parts && n >= parts[j + 1].first) j++;
    rp_dequant_row(&parts[j], n - parts[j].first, K, out + i * K);
  }
  return PLAIT_OK;
}

#include "repack_acts.h" /* x to int8 per 32 values: quantize_acts */

/* ------------------------------------------------------------------------------------ */
/* Products: plain C                                                                     */
/* ------------------------------------------------------------------------------------ */

/* Columns 0 .. cols - 1 of a tile against rows 0 .. R - 1 of a (at the first row): y[r *
 * ldy + n] = sum + bias[n] (bias NULL: none). */
static void c_tile(const rp_part_t *p, const uint8_t *tile, const rp_acts_t *a, int R, long K,
                   const float *bias, float *y, long ldy, int cols) {
  const rp_layout_t *L = p->lay;
  int type = p->type, halves = type == PLAIT_GGML_Q6_K ? 2 : 1, span = 32 / halves;
  for (int r = 0; r < R; r++) {
    const int8_t *q = a->q + r * a->ldq;
    for (int n = 0; n < cols; n++) {
      float f = 0.0f;
      for (long g = 0; g < K / 32; g++) {
        const uint8_t *rec = tile + g * 32 / L->qk * L->rec_bytes;
        int gi = (int)(g % (L->qk / 32));
        float sx = a->sx[r * a->groups + g];
        for (int h = 0; h < halves; h++) {
          int32_t I = 0, S = 0;
          for (int k = h * span; k < (h + 1) * span; k++) {
            I += q[32 * g + k] * rp_code(L, type, rec, gi, n, k);
            S += q[32 * g + k];
          }
          I -= L->offset * S;
          float sa, o;
          rp_scale(L, type, rec, gi, h, n, &sa, &o);
          f = fmaf((float)I, sa * sx, f);
          if (L->offset == 0) f = fmaf(-o, a->sxq[r * a->groups + g], f);
        }
      }
      y[r * ldy + n] = f + (bias ? bias[n] : 0.0f);
    }
  }
}

/* The tile of W's rows [row, row + 16) (row a multiple of 16) and its part, or NULL where
 * no part holds those 16 rows as one of its tiles. */
static const uint8_t *rp_tile_at(const rp_part_t *parts, int num_parts, long row,
                                 const rp_part_t **part) {
  for (int i = 0; i < num_parts; i++) {
    const rp_part_t *p = &parts[i];
    if (row < p->first || row >= p->first + p->rows) continue;
    if ((row - p->first) % 16 || row + 16 > p->first + p->rows) return NULL;
    *part = p;
    return p->data + (row - p->first) / 16 * p->tile_bytes;
  }
  return NULL;
}

/* Whether every 16 rows of W's N lie in one part as one of its tiles (rp_tile_at). */
static int rp_whole_tiles(const rp_part_t *parts, int num_parts, long N) {
  const rp_part_t *p;
  for (long row = 0; row < N; row += 16)
    if (!rp_tile_at(parts, num_parts, row, &p)) return 0;
  return 1;
}

#include "repack_vnni.h"
#include "repack_wide.h"
#include "repack_amx.h"
#include "repack_amx_bf16.h"

int plait_repack_isa(void) {
#if REPACK_AMX
  if (am_permitted()) return PLAIT_REPACK_AMX;
#endif
#if REPACK_VNNI
  return PLAIT_REPACK_VNNI512;
#else
  return PLAIT_REPACK_C;
#endif
}

int plait_repack_amx_state(void) {
#if REPACK_AMX
  return am_state();
#else
  return PLAIT_AMX_ABSENT;
#endif
}

/* Units of work: up to 2 adjacent tiles of one part (32 columns), which the VNNI kernels
 * take together so that each broadcast activation feeds two tiles. */
static long rp_units(const rp_part_t *p) { return (p->tiles + 1) / 2; }

/* Unit t of the parts (counting across parts): its part, first tile, first column n0 in W,
 * its columns (<= 32) and tiles T (1 or 2). */
typedef struct {
  const rp_part_t *p;
  const uint8_t *tile;
  long n0;
  int cols, T;
} rp_unit_t;

static rp_unit_t rp_unit_at(const rp_part_t *parts, long t) {
  int i = 0;
  while (t >= rp_units(&parts[i])) t -= rp_units(&parts[i++]);
  const rp_part_t *p = &parts[i];
  int cols = (int)(p->rows - 32 * t < 32 ? p->rows - 32 * t : 32);
  return (rp_unit_t){p, p->data + 2 * t * p->tile_bytes, p->first + 32 * t, cols,
                     cols > 16 ? 2 : 1};
}

/* Whether the AMX rung (repack_amx.h) takes a part of `type` against M x rows. */
static inline int rp_amx_takes(int isa, int type, long M) {
#if REPACK_AMX
  return isa == PLAIT_REPACK_AMX && M >= am_min_rows(type);
#else
  (void)isa, (void)type, (void)M;
  return 0;
#endif
}

/* Whether the wide rung (repack_wide.h) takes a part of `type` against M x rows. */
static inline int rp_wide_takes(int isa, int type, long M) {
#if REPACK_VNNI
  return isa >= PLAIT_REPACK_VNNI512 && !rp_amx_takes(isa, type, M) && M >= wd_min_rows(type);
#else
  (void)isa, (void)type, (void)M;
  return 0;
#endif
}

/* Unit t of parts for x rows [0, M): y's columns of its tiles. Through a prefill rung
 * where scratch is given and M reaches the rung's rows for the unit's type: AMX tiles
 * (repack_amx.h; the thread has loaded their configuration) or the wide rung
 * (repack_wide.h), each widening a tile once into scratch; else register tiles of rows one
 * after another, each widening the tiles' codes again (vnni_tiles; c_tile for
 * PLAIT_REPACK_C). */
static void rp_unit(const rp_part_t *parts, long t, const rp_acts_t *a, long M, long K,
                    const float *bias, float *y, long ldy, int isa, uint8_t *scratch) {
  rp_unit_t un = rp_unit_at(parts, t);
  const rp_part_t *p = un.p;
  const float *b = bias ? bias + un.n0 : NULL;
  int T = un.T, cols = un.cols;
#if REPACK_AMX
  if (scratch && rp_amx_takes(isa, p->type, M)) {
    am_unit(p, T, un.tile, a, M, K, b, y + un.n0, ldy, cols, scratch);
    return;
  }
#endif
#if REPACK_VNNI
  if (scratch && rp_wide_takes(isa, p->type, M)) {
    wd_unit(p, T, un.tile, a, M, K, b, y + un.n0, ldy, cols, scratch);
    return;
  }
#endif
  /* Register tiles of rows. Up to RP_PAIR_ROWS rows the two tiles go together (each
   * broadcast activation feeds both); past that each tile goes alone against RP_TILE_ROWS
   * rows at a time, so that vnni_tiles widens its codes once per 8 rows, not once per 4:
   * 5 to 16 rows in 0.75-0.9x the time on a Zen 4 EPYC (BENCHMARKS.md). */
  const int TT = T == 2 && M > RP_PAIR_ROWS ? 1 : T, per = TT == 2 ? RP_PAIR_ROWS : RP_TILE_ROWS;
  for (int u = 0; u < T; u += TT) {
    const uint8_t *tile = un.tile + u * p->tile_bytes;
    const float *bu = b ? b + 16 * u : NULL;
    const int cu = cols - 16 * u < 16 * TT ? cols - 16 * u : 16 * TT;
    for (long m = 0; m < M; m += per) {
      int R = (int)(M - m < per ? M - m : per);
      rp_acts_t at = rp_acts_from(a, m);
      float *yt = y + m * ldy + un.n0 + 16 * u;
#if REPACK_VNNI
      if (isa >= PLAIT_REPACK_VNNI512) {
        vnni_tiles_any(p->type, TT, R, tile, p->tile_bytes, &at, K, bu, yt, ldy, cu);
        continue;
      }
#endif
      for (int v = 0; v < TT; v++)
        c_tile(p, tile + v * p->tile_bytes, &at, R, K, bu ? bu + 16 * v : NULL, yt + 16 * v,
               ldy, cu - 16 * v < 16 ? cu - 16 * v : 16);
    }
  }
}

/* The bytes of the per-thread scratch that the prefill rungs need for parts against M rows
 * (a multiple of 64; 0: none), and in *amx whether a part takes the AMX rung (each thread
 * then loads the tile configuration). */
static size_t rp_scratch_bytes(const rp_part_t *parts, int num_parts, long M, int isa,
                               int *amx) {
  size_t bytes = 0;
  *amx = 0;
  for (int i = 0; i < num_parts; i++) {
#if REPACK_VNNI
    if (rp_wide_takes(isa, parts[i].type, M) && wd_scratch_bytes() > bytes)
      bytes = wd_scratch_bytes();
#endif
#if REPACK_AMX
    if (rp_amx_takes(isa, parts[i].type, M)) {
      *amx = 1;
      if (am_scratch_bytes() > bytes) bytes = am_scratch_bytes();
    }
#endif
  }
  (void)parts, (void)M, (void)isa;
  return (bytes + 63) / 64 * 64;
}

/* Silu unit j of rp_products, act's columns 16 j .. 16 j + 15: gate tile j (W's rows 16 j ..)
 * and up tile j (rows N / 2 + 16 j ..) each through rp_unit as a part of one tile (the rung
 * and so the bits of plait_repack_gemm's columns; no bias) into gbuf and ubuf [M, 16], then
 * silu(gate) * up LANES columns at a time by vsilu_mul, plait_silu_mul's vector arithmetic
 * (a 16-column slice is whole vectors of it: the caller checked N % 32 == 0). */
static void rp_silu_unit(const rp_part_t *parts, int num_parts, long N, long j,
                         const rp_acts_t *a, long M, long K, int isa, uint8_t *scratch,
                         float *gbuf, float *ubuf, float *act, long lda) {
  const rp_part_t *pg = NULL, *pu = NULL;
  const uint8_t *gate = rp_tile_at(parts, num_parts, 16 * j, &pg);
  const uint8_t *up = rp_tile_at(parts, num_parts, N / 2 + 16 * j, &pu);
  const rp_part_t g1 = {gate, pg->lay, pg->type, 0, 16, 1, pg->tile_bytes};
  const rp_part_t u1 = {up, pu->lay, pu->type, 0, 16, 1, pu->tile_bytes};
  rp_unit(&g1, 0, a, M, K, NULL, gbuf, 16, isa, scratch);
  rp_unit(&u1, 0, a, M, K, NULL, ubuf, 16, isa, scratch);
  for (long m = 0; m < M; m++)
    for (int c = 0; c < 16; c += LANES)
      *(vf *)(act + m * lda + 16 * j + c) =
          vsilu_mul(*(const vf *)(gbuf + m * 16 + c), *(const vf *)(ubuf + m * 16 + c));
}

/* The units of parts against the quantized rows, shared by the threads: with act NULL,
 * rp_unit's (two tiles, y's columns; units of them), else silu units (rp_silu_unit: act's
 * 16 columns each, N / 32 of them), each thread then holding their two [M, 16] buffers.
 * Each thread holds a scratch for the prefill rungs where a part takes one, and loads the
 * AMX tile configuration (released after) where a part takes that rung. PLAIT_ERR_NOMEM
 * where a thread's buffers fail. */
static int rp_products(const rp_part_t *parts, int num_parts, long N, const rp_acts_t *a,
                       long M, long K, const float *bias, float *y, long ldy, float *act,
                       long lda, int isa) {
  int amx;
  const size_t scratch_bytes = rp_scratch_bytes(parts, num_parts, M, isa, &amx);
  const size_t own_bytes = scratch_bytes + (act ? 2 * sizeof(float) * 16 * (size_t)M : 0);
  long units = act ? N / 32 : 0;
  for (int i = 0; !act && i < num_parts; i++) units += rp_units(&parts[i]);
  int rc = PLAIT_OK;
#pragma omp parallel
  {
    uint8_t *own = own_bytes ? aligned_alloc(64, own_bytes) : NULL; /* multiples of 64 */
    if (own_bytes && !own) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
      uint8_t *scratch = scratch_bytes ? own : NULL;
      float *gbuf = NULL, *ubuf = NULL;
      if (act) {
        gbuf = (float *)(own + scratch_bytes);
        ubuf = gbuf + 16 * M;
      }
#if REPACK_AMX
      if (amx) am_config();
#endif
#pragma omp for schedule(static)
      for (long t = 0; t < units; t++) {
        if (act)
          rp_silu_unit(parts, num_parts, N, t, a, M, K, isa, scratch, gbuf, ubuf, act, lda);
        else
          rp_unit(parts, t, a, M, K, bias, y, ldy, isa, scratch);
      }
#if REPACK_AMX
      if (amx) _tile_release();
#endif
    }
    free(own);
  }
  (void)amx;
  return rc;
}

/* plait_repack_gemm (act NULL) and plait_repack_gemm_silu: their checks, x quantized
 * (quantize_acts), then rp_products. */
static int rp_gemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                   const float *bias, float *y, long ldy, float *act, long lda, int isa) {
  rp_part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  long N;
  if (rp_read_desc(desc, K, parts, &num_parts, &N) != PLAIT_OK || M < 0 || K % 32 ||
      isa < PLAIT_REPACK_C || isa > plait_repack_isa() ||
      (act && (bias || N % 32 || lda < N / 2 || !rp_whole_tiles(parts, num_parts, N))))
    return PLAIT_ERR_SHAPES;
  if (M == 0 || N == 0) return PLAIT_OK;
  rp_acts_t acts;
  void *mem;
  if (quantize_acts(x, M, ldx, K, &acts, &mem) != PLAIT_OK) return PLAIT_ERR_NOMEM;
  int rc = rp_products(parts, num_parts, N, &acts, M, K, bias, y, ldy, act, lda, isa);
  free(mem);
  return rc;
}

int plait_repack_gemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                      const float *bias, float *y, long ldy, int isa) {
  return rp_gemm(x, M, ldx, desc, K, bias, y, ldy, NULL, 0, isa);
}

int plait_repack_gemm_silu(const float *x, long M, long ldx, const int64_t *desc, long K,
                           const float *bias, float *act, long lda, int isa) {
  return rp_gemm(x, M, ldx, desc, K, bias, NULL, 0, act, lda, isa);
}

/* ------------------------------------------------------------------------------------ */
/* Prompt rows: AMX-BF16 (repack_amx_bf16.h)                                             */
/* ------------------------------------------------------------------------------------ */

int plait_repack_prompt_bf16(void) {
#if REPACK_AMX_BF16
  return plait_repack_isa() == PLAIT_REPACK_AMX;
#else
  return 0;
#endif
}

#if REPACK_AMX_BF16
/* plait_repack_gemm_bf16 (act NULL: y = x W^T + bias) or plait_repack_gemm_bf16_silu (act:
 * silu(gate) * up of the gate | up weight, its N / 2 columns lda apart; no bias) of rows
 * [0, M), W's parts read, N its rows. */
static int ab_gemm(const float *x, long M, long ldx, const rp_part_t *parts, int num_parts,
                   long N, long K, const float *bias, float *y, long ldy, float *act, long lda) {
  if (M > AB_BLOCK_ROWS && K <= AB_BLOCK_MAX_K) {  /* in blocks of rows: the same bits */
    const long blocks = (M + AB_BLOCK_ROWS - 1) / AB_BLOCK_ROWS;
    const long block = ((M + blocks - 1) / blocks + 31) / 32 * 32;
    for (long m0 = 0; m0 < M; m0 += block) {
      const long rows = M - m0 < block ? M - m0 : block;
      const int rc = ab_gemm(x + m0 * ldx, rows, ldx, parts, num_parts, N, K, bias,
                             act ? NULL : y + m0 * ldy, ldy, act ? act + m0 * lda : NULL, lda);
      if (rc != PLAIT_OK) return rc;
    }
    return PLAIT_OK;
  }
  long units = 0;
  if (act)
    units = N / 32;  /* unit t: the gate's tile t and the up's tile t */
  else
    for (int i = 0; i < num_parts; i++) units += rp_units(&parts[i]);
  const long G = K / 32, M16 = (M + 15) / 16 * 16;
  uint16_t *xb = aligned_alloc(64, (sizeof(uint16_t) * (size_t)(M16 * K) + 63) / 64 * 64);
  if (!xb) return PLAIT_ERR_NOMEM;
  ab_round_x(x, M, ldx, K, xb, M16);
  const size_t wide_bytes = (size_t)2 * RP_WIDE_CHUNK * RP_WIDE_GROUP;
  const size_t scratch_bytes = wide_bytes + (size_t)(2 * G) * AB_TILE + 3 * AB_TILE;
  int rc = PLAIT_OK;
#pragma omp parallel
  {
    uint8_t *scratch = aligned_alloc(64, scratch_bytes);
    if (!scratch) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
      uint8_t *bt = scratch + wide_bytes;
      /* cbuf: one C tile, or two with act (whose second is the unused bias tiles') */
      float *cbuf = (float *)(bt + (size_t)(2 * G) * AB_TILE);
      uint8_t *bias_tiles = bt + (size_t)(2 * G + 1) * AB_TILE;
      ab_config();
#pragma omp for schedule(static)
      for (long t = 0; t < units; t++) {
        if (act) {
          const rp_part_t *pg = NULL, *pu = NULL;
          const uint8_t *gate = rp_tile_at(parts, num_parts, 16 * t, &pg);
          const uint8_t *up = rp_tile_at(parts, num_parts, N / 2 + 16 * t, &pu);
          ab_fill(pg->type, 1, gate, pg->tile_bytes, G, scratch, bt);
          ab_fill(pu->type, 1, up, pu->tile_bytes, G, scratch, bt + G * AB_TILE);
          ab_unit(2, bt, bt + G * AB_TILE, AB_TILE, G, xb, M, NULL, NULL, NULL, 0, 32, cbuf,
                  act + 16 * t, lda);
          continue;
        }
        rp_unit_t un = rp_unit_at(parts, t);
        const float *b = bias ? bias + un.n0 : NULL;
        ab_fill(un.p->type, un.T, un.tile, un.p->tile_bytes, G, scratch, bt);
        ab_bias_tiles(b, un.T, un.cols, bias_tiles);
        ab_unit(un.T, bt, bt + AB_TILE, (long)un.T * AB_TILE, G, xb, M, b, bias_tiles,
                y + un.n0, ldy, un.cols, cbuf, NULL, 0);
      }
      _tile_release();
    }
    free(scratch);
  }
  free(xb);
  return rc;
}

/* plait_repack_gemm_bf16 (act NULL) and plait_repack_gemm_bf16_silu: their checks, then
 * ab_gemm. */
static int ab_checked(const float *x, long M, long ldx, const int64_t *desc, long K,
                      const float *bias, float *y, long ldy, float *act, long lda) {
  rp_part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  long N;
  if (!plait_repack_prompt_bf16() || rp_read_desc(desc, K, parts, &num_parts, &N) != PLAIT_OK ||
      M < 0 || K % 32 || (act && (bias || N % 32 || lda < N / 2)))
    return PLAIT_ERR_SHAPES;
  if (act && !rp_whole_tiles(parts, num_parts, N)) return PLAIT_ERR_SHAPES;
  if (M == 0 || N == 0) return PLAIT_OK;
  return ab_gemm(x, M, ldx, parts, num_parts, N, K, bias, y, ldy, act, lda);
}
#endif

int plait_repack_gemm_bf16(const float *x, long M, long ldx, const int64_t *desc, long K,
                           const float *bias, float *y, long ldy) {
#if REPACK_AMX_BF16
  return ab_checked(x, M, ldx, desc, K, bias, y, ldy, NULL, 0);
#else
  (void)x, (void)M, (void)ldx, (void)desc, (void)K, (void)bias, (void)y, (void)ldy;
  return PLAIT_ERR_SHAPES;
#endif
}

int plait_repack_gemm_bf16_silu(const float *x, long M, long ldx, const int64_t *desc, long K,
                                const float *bias, float *act, long lda) {
#if REPACK_AMX_BF16
  return ab_checked(x, M, ldx, desc, K, bias, NULL, 0, act, lda);
#else
  (void)x, (void)M, (void)ldx, (void)desc, (void)K, (void)bias, (void)act, (void)lda;
  return PLAIT_ERR_SHAPES;
#endif
}
