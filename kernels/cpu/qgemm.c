/* GEMM and dequantization straight from a GGUF file's GGML blocks (see vec.h, quant.h,
 * quant.py).
 *
 * A weight W [N, K] is the parts of an int64 descriptor (plait_cpu.h), each `rows` rows in
 * one GGML type; a GGML row is K / QK blocks, independent of the other rows:
 *
 *   desc = [num_parts, addr_0, type_0, rows_0, addr_1, type_1, rows_1, ...]
 *
 *   part 0 rows 0 .. rows_0-1        | blk | blk | ... |   (row_bytes = K / QK * block bytes)
 *   part 1 rows rows_0 .. +rows_1-1  | blk | blk | ... |
 *
 * plait_qgemm: each weight row's 32-weight groups are decoded into registers (quant.h) and
 * multiplied into R <= FUSED_ROWS accumulators, one per x row of a tile: for a decode step's
 * few rows the weights stream once from memory in their compact form; the activations stay
 * float32 (no activation quantization). More rows than a tile: chunks of weight rows meet
 * each tile in turn (read again from L2, decoded again). With AVX-512, a batch of rows (10
 * or more, or fewer of long K) takes qgemm_batch.h instead: 16 weight rows decoded once into
 * float32, register tiles of 4 x 4. One x row: qgemm_bf16.h. The type PLAIT_GGML_F32 means
 * float32 panels as plait_gemm packs them and goes to plait_gemm itself (its bits).
 *
 * A descriptor flagged PLAIT_QGEMM_BF16 (bf16 compute) takes, from PLAIT_QGEMM_BF16_MIN_ROWS
 * x rows and K % 32 == 0, the batch path in bfloat16 (qgemm_batch_bf16.h: x and each decoded
 * weight rounded to bfloat16, vdpbf16ps); any other call of a flagged descriptor (fewer
 * rows, K % 32 != 0, a build without AVX512-BF16) runs the float32 paths above, as unflagged.
 *
 * plait_dequantize stores the same decoders' vectors: gguf-py's dequantizer, bit for bit.
 */
#include "plait_cpu.h"
#include "quant.h"

/* Weight rows per chunk when x has more rows than a tile (see qgemm_rows). */
#define ROWS_PER_CHUNK 32
/* The most x rows one fused pass over a weight row serves: accumulators in registers, and
 * 12 rows of K = 576 (27 KiB) still in L1 (16 rows measured 1.5x slower per row). */
#define FUSED_ROWS (RMAX < 12 ? RMAX : 12)

struct acts_s;

/* What qgemm and dequantize need of a type, one row of QUANT_TRAITS per GGML type
 * id (defined at the end, once every type's functions are): its block shape and its
 * row functions, each an instantiation for the type (its decoder inlined, the type a
 * constant), in place of a switch over the type. The bfloat16 members are NULL in a build
 * without AVX512-BF16 (QUANT_BF16), and bf16_tiles / bf16_rows for a type whose quants
 * quant.h's bf16_quants does not read (Q8_0, F16, BF16). */
typedef struct {
  long per_block, block_bytes;  /* weights and bytes per block; 0: a type not read here */
  /* 32-weight groups g0 .. g0 + n - 1 of a row into dst [32 n] float32 */
  void (*groups)(const uint8_t *row, long g0, long n, float *dst);
  /* y[r * ldy] = x[r] . row + bias for the R <= FUSED_ROWS rows of a tile (K % 32 == 0) */
  void (*tiles)(const float *x, int R, long ldx, const uint8_t *row, long K, float *y,
                long ldy, float bias);
  /* one x row factored (quants_32; xsum [K / 32] its group sums), or NULL: tiles */
  float (*factored)(const float *x, const uint8_t *row, long K, const float *xsum);
  /* y[r * ldy] = x[r] . row + bias for R <= FUSED_ROWS x rows from their bfloat16 pieces
   * (qgemm_bf16.h's bf16_tile) */
  void (*bf16_tiles)(const struct acts_s *a, int R, const uint8_t *row, long K, float *y,
                     long ldy, float bias);
  /* y[c] = x . row c + bias[c] (bias may be NULL) for WROWS rows row_bytes apart and one x
   * row's pieces xs and group sums xsum (qgemm_bf16.h's bf16_rows) */
  void (*bf16_rows)(const uint16_t *xs, const float *xsum, const uint8_t *row,
                    long row_bytes, long K, float *y, const float *bias);
  /* a row [K] (K % 32 == 0) into dst [K] (64-byte aligned) as bfloat16 bits
   * (qgemm_batch_bf16.h) */
  void (*to_bf16)(const uint8_t *src, long K, uint16_t *dst);
} quant_traits_t;

typedef struct {
  const uint8_t *data;
  int type;
  long first, rows, row_bytes;  /* first: the part's first row in W */
  const quant_traits_t *traits;  /* the type's traits (NULL for F32 panels) */
} part_t;

/* The traits of `type`, or NULL for a type this file does not read (after the table). */
static const quant_traits_t *traits_of(int type);

/* ------------------------------------------------------------------------------------ */
/* Rows -> float32                                                                       */
/* ------------------------------------------------------------------------------------ */

static void deq_f16_row(const uint8_t *src, long K, float *dst) {
  long k = 0;
#if LANES == 16 && defined(__AVX512F__)
  for (; k + 16 <= K; k += 16)
    _mm512_storeu_ps(dst + k, _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(src + 2 * k))));
#elif LANES == 8 && defined(__F16C__)
  for (; k + 8 <= K; k += 8)
    _mm256_storeu_ps(dst + k, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(src + 2 * k))));
#endif
  for (; k < K; k++) dst[k] = load_f16(src + 2 * k);
}

static void deq_bf16_row(const uint8_t *src, long K, float *dst) {  /* the high 16 bits */
  long k = 0;
  for (; k + LANES <= K; k += LANES) {
    const vf v = widen_bf16((const uint16_t *)(src + 2 * k));
    memcpy(dst + k, &v, sizeof v);
  }
  for (; k < K; k++) dst[k] = bf16_to_f32((uint16_t)(src[2 * k] | src[2 * k + 1] << 8));
}

/* 32-weight groups g0 .. g0 + num_groups - 1 of row `row` of part p (K % 32 == 0) into dst
 * [32 * num_groups] float32: the type's `groups` (its decoder inlined in a loop). */
static void dequant_groups(const part_t *p, long row, long g0, long num_groups, float *dst) {
  p->traits->groups(p->data + row * p->row_bytes, g0, num_groups, dst);
}

/* Row `row` of part p (K weights) into dst [K] float32; F16 / BF16 rows of K % 32 != 0
 * element by element. */
static void dequant_row(const part_t *p, long row, long K, float *dst) {
  const uint8_t *src = p->data + row * p->row_bytes;
  if (K % 32 == 0)
    dequant_groups(p, row, 0, K / 32, dst);
  else if (p->type == PLAIT_GGML_F16)
    deq_f16_row(src, K, dst);
  else
    deq_bf16_row(src, K, dst);
}

/* ------------------------------------------------------------------------------------ */
/* Descriptors                                                                           */
/* ------------------------------------------------------------------------------------ */

/* desc's parts into parts[], their total rows into *N and its PLAIT_QGEMM_BF16 flag into
 * *bf16; PLAIT_ERR_SHAPES for a descriptor this file cannot read with K (another flag, a
 * type it does not know, K not a whole number of blocks, F32 panels beside other parts,
 * more than PLAIT_MAX_PARTS parts, negative rows, rows at address 0). */
static int read_desc(const int64_t *desc, long K, part_t *parts, int *num_parts, long *N,
                     int *bf16) {
  if (!desc || K <= 0) return PLAIT_ERR_SHAPES;
  *bf16 = (desc[0] & PLAIT_QGEMM_BF16) != 0;
  int64_t count = desc[0] & ~(int64_t)PLAIT_QGEMM_BF16;
  if (count < 1 || count > PLAIT_MAX_PARTS) return PLAIT_ERR_SHAPES;
  *num_parts = (int)count;
  *N = 0;
  for (int i = 0; i < *num_parts; i++) {
    part_t *p = &parts[i];
    p->data = (const uint8_t *)(intptr_t)desc[1 + 3 * i];
    p->type = (int)desc[2 + 3 * i];
    p->rows = desc[3 + 3 * i];
    p->first = *N;
    p->traits = traits_of(p->type);
    long per_block = p->traits ? p->traits->per_block : 0;
    long bytes = p->traits ? p->traits->block_bytes : 0;
    if (p->type == PLAIT_GGML_F32 && *num_parts == 1) {
      per_block = 1;
      bytes = 4;
    }
    if (p->rows < 0 || (p->rows > 0 && !p->data) || per_block == 0 || K % per_block)
      return PLAIT_ERR_SHAPES;
    p->row_bytes = K / per_block * bytes;
    *N += p->rows;
  }
  return PLAIT_OK;
}

static inline const part_t *part_of(const part_t *parts, int num_parts, long n) {
  int i = 0;
  while (i + 1 < num_parts && n >= parts[i + 1].first) i++;
  return &parts[i];
}

/* Row n of W [N, K] packed as plait_gemm's panels [ceil(N / LANES), K, LANES]. */
static void unpack_panel_row(const float *panels, long n, long K, float *dst) {
  const float *src = panels + (n / LANES) * K * LANES + n % LANES;
  for (long k = 0; k < K; k++) dst[k] = src[k * LANES];
}

/* ------------------------------------------------------------------------------------ */
/* Dot products with dequantized rows                                                    */
/* ------------------------------------------------------------------------------------ */

/* y[r * ldy] = x[r] . w + b for the R rows of a tile (R a constant once inlined: the
 * accumulators live in registers). */
ALWAYS_INLINE void dot_tile(int R, const float *x, long ldx, const float *w, long K, float *y,
                            long ldy, float b) {
  vf acc[RMAX];
  for (int r = 0; r < R; r++) acc[r] = (vf){0};
  long k = 0;
  for (; k + LANES <= K; k += LANES) {
    vf wv = *(const vf *)(w + k);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
      acc[r] += *(const vf *)(x + r * ldx + k) * wv;
  }
  for (int r = 0; r < R; r++) {
    float s = hsum(acc[r]);
    for (long t = k; t < K; t++) s += x[r * ldx + t] * w[t];
    y[r * ldy] = s + b;
  }
}

static void dot_rows(int R, const float *x, long ldx, const float *w, long K, float *y,
                     long ldy, float b) {
  switch (R) {
#define CASE(n) \
  case n: dot_tile(n, x, ldx, w, K, y, ldy, b); return;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#if RMAX > 8
    CASE(9) CASE(10) CASE(11) CASE(12)
#endif
#if RMAX > 12
    CASE(13) CASE(14) CASE(15) CASE(16)
#endif
#undef CASE
    default: return;
  }
}

/* ------------------------------------------------------------------------------------ */
/* Fused rows: a decode step's few x rows against a weight row decoded in registers      */
/* ------------------------------------------------------------------------------------ */

/* y[r * ldy] = x[r] . row + bias for the R (constant once inlined) rows of a tile: per group
 * of 32 weights, decoded once, one FMA per vector and x row. */
ALWAYS_INLINE void fused_tile(int R, int type, const float *x, long ldx, const uint8_t *row,
                              long K, float *y, long ldy, float bias) {
  vf acc[FUSED_ROWS], w[32 / LANES];
  for (int r = 0; r < R; r++) acc[r] = (vf){0};
  for (long g = 0; g < K / 32; g++) {
    decode_group(type, row, g, w);
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)
      for (int j = 0; j < 32 / LANES; j++)
        acc[r] += *(const vf *)(x + r * ldx + 32 * g + j * LANES) * w[j];
  }
  for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]) + bias;
}

/* y = x . row + bias for one x row and a 32-weight block type, factored (quants_32):
 * sum_g d_g (x_g . q_g) + m_g xsum_g, xsum_g the sum of x's group g. */
ALWAYS_INLINE float factored_dot(int type, const float *x, const uint8_t *row, long K,
                                 const float *xsum) {
  vf acc = (vf){0}, q[32 / LANES];
  float macc = 0.0f, m;
  for (long g = 0; g < K / 32; g++) {
    float d = quants_32(type, row, g, q, &m);
    vf t = *(const vf *)(x + 32 * g) * q[0];
    for (int j = 1; j < 32 / LANES; j++) t += *(const vf *)(x + 32 * g + j * LANES) * q[j];
    acc += vsplat(d) * t;
    if (type == PLAIT_GGML_Q4_1) macc += m * xsum[g];
  }
  return hsum(acc) + macc;
}

/* Each type's row functions for its QUANT_TRAITS row (an X-macro instantiation per type). */
#if RMAX > 8
#define MORE_TILES(t) TILE(9, t) TILE(10, t) TILE(11, t) TILE(12, t)
#else
#define MORE_TILES(t)
#endif
#define TILE(n, t) \
  case n: fused_tile(n, t, x, ldx, row, K, y, ldy, bias); return;
#define ROW_FUNCTIONS(t)                                                                  \
  static void groups_##t(const uint8_t *row, long g0, long n, float *dst) {               \
    vf w[32 / LANES];                                                                     \
    for (long g = 0; g < n; g++) {                                                        \
      decode_group(t, row, g0 + g, w);                                                    \
      for (int j = 0; j < 32 / LANES; j++) store(dst + 32 * g + j * LANES, w[j]);          \
    }                                                                                     \
  }                                                                                       \
  static void tiles_##t(const float *x, int R, long ldx, const uint8_t *row, long K,      \
                        float *y, long ldy, float bias) {                                 \
    switch (R) { TILE(1, t) TILE(2, t) TILE(3, t) TILE(4, t) TILE(5, t) TILE(6, t)         \
                 TILE(7, t) TILE(8, t) MORE_TILES(t) default: return; }                   \
  }
FOR_EACH_TYPE(ROW_FUNCTIONS)
#undef ROW_FUNCTIONS
#undef TILE
#undef MORE_TILES
#define FACTORED(t)                                                                       \
  static float factored_##t(const float *x, const uint8_t *row, long K, const float *xsum) { \
    return factored_dot(t, x, row, K, xsum);                                              \
  }
FACTORED(PLAIT_GGML_Q4_0) FACTORED(PLAIT_GGML_Q4_1) FACTORED(PLAIT_GGML_Q5_0)
FACTORED(PLAIT_GGML_Q8_0)
#undef FACTORED

/* y[r * ldy] = x[r] . row + bias for the R <= FUSED_ROWS rows of a tile (K % 32 == 0); a
 * single x row of a 32-weight block type factored when its group sums are given (xsum
 * [K / 32], else NULL). */
static void fused_row(const quant_traits_t *t, const float *x, int R, long ldx,
                      const uint8_t *row, long K, const float *xsum, float *y, long ldy,
                      float bias) {
  if (xsum && t->factored) {
    *y = t->factored(x, row, K, xsum) + bias;
    return;
  }
  t->tiles(x, R, ldx, row, K, y, ldy, bias);
}

/* ------------------------------------------------------------------------------------ */
/* Activations                                                                           */
/* ------------------------------------------------------------------------------------ */

/* x as plait_qgemm's row functions read it: x [M, K] rows ldx apart; xsum [M, K / 32] its
 * 32-element group sums (the min terms of Q4_1 / Q4_K / Q5_K) or NULL; pieces [M, K / 32,
 * 3, 32] bfloat16 (split_row) or NULL: when set, every part of a type bf16_quants reads
 * takes bf16_tile; xb [M, K] x rounded to bfloat16 (dense) or NULL: when set, qgemm_batch
 * computes in bfloat16. */
typedef struct acts_s {
  const float *x;
  long ldx;
  const float *xsum;
  const uint16_t *pieces;
  const uint16_t *xb;
} acts_t;

#include "qgemm_batch.h"
#include "qgemm_bf16.h"

/* ------------------------------------------------------------------------------------ */
/* GEMM                                                                                  */
/* ------------------------------------------------------------------------------------ */

/* y[r * ldy] = x[r] . weight row n + bias for the R rows of a tile (a at the tile's first
 * row). */
static void row_dot(const acts_t *a, int R, const part_t *p, long n, long K, float *y,
                    long ldy, float b) {
  const uint8_t *row = p->data + (n - p->first) * p->row_bytes;
  if (a->pieces && p->traits && p->traits->bf16_tiles) {
    p->traits->bf16_tiles(a, R, row, K, y, ldy, b);
    return;
  }
  fused_row(p->traits, a->x, R, a->ldx, row, K, R == 1 ? a->xsum : NULL, y, ldy, b);
}

/* y[M, N] = x[M, K] @ W^T + bias for W of quantized parts (see the top of the file). Each
 * thread owns chunks of `rows` weight rows. Fused (K % 32 == 0, any M): for each tile of
 * FUSED_ROWS x rows, every row of the chunk through row_dot, so the tile stays in L1 while
 * the chunk's compact rows are read again from L2 (x's rows in the outer loop would stream
 * all of x from L2 for every weight row: 1.5x slower at 16 rows). Else (F16 / BF16 rows of
 * K % 32 != 0) the chunk's rows are decoded into buf [rows, K], then every tile of x taken
 * against them. */
static void qgemm_rows(const acts_t *a, long M, const part_t *parts, int num_parts, long N,
                       long K, long rows, int fused, const float *bias, float *y, long ldy,
                       float *buf) {
  long chunks = (N + rows - 1) / rows, G = K / 32;
  int tile = fused ? FUSED_ROWS : RMAX;
#pragma omp for schedule(static)
  for (long c = 0; c < chunks; c++) {
    long n0 = c * rows, nr = N - n0 < rows ? N - n0 : rows;
    for (long i = 0; !fused && i < nr; i++) {
      const part_t *p = part_of(parts, num_parts, n0 + i);
      dequant_row(p, n0 + i - p->first, K, buf + i * K);
    }
    for (long m = 0; m < M; m += tile) {
      int R = (int)(M - m < tile ? M - m : tile);
      acts_t at = {a->x + m * a->ldx, a->ldx, a->xsum ? a->xsum + m * G : NULL,
#if QUANT_BF16
                   a->pieces ? a->pieces + m * G * SPLIT_WORDS : NULL, NULL};
#else
                   NULL, NULL};
#endif
#if QUANT_BF16
      if (fused && M == 1 && a->pieces) {
        bf16_chunk(a, parts, num_parts, n0, nr, K, bias, y);
        continue;
      }
#endif
      for (long i = 0; i < nr; i++) {
        long n = n0 + i;
        float b = bias ? bias[n] : 0.0f, *yt = y + m * ldy + n;
        if (fused)
          row_dot(&at, R, part_of(parts, num_parts, n), n, K, yt, ldy, b);
        else
          dot_rows(R, at.x, at.ldx, buf + i * K, K, yt, ldy, b);
      }
    }
  }
}

/* x's group sums and (bf16 path) pieces for acts_t, in one buffer the caller frees: sums of
 * one x row for factored_dot, of every row with the pieces when M <= BF16_ROWS; with
 * round_x, x rounded to bfloat16 (xb) instead. *scratch = NULL when none is needed;
 * PLAIT_ERR_NOMEM. */
static int prepare_acts(const float *x, long M, long ldx, long K, int round_x, acts_t *a,
                        void **scratch) {
  long G = K / 32;
  *a = (acts_t){x, ldx, NULL, NULL, NULL};
  *scratch = NULL;
  if (K % 32) return PLAIT_OK;
#if QGEMM_BATCH_BF16
  if (round_x) {
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)(M * K));
    if (!xb) return PLAIT_ERR_NOMEM;
    round_rows(x, M, ldx, K, xb);
    *a = (acts_t){x, ldx, NULL, NULL, xb};
    *scratch = xb;
    return PLAIT_OK;
  }
#endif
#if QUANT_BF16
  if (M <= BF16_ROWS) {
    /* the pieces first, on cache lines (a group's are 3 whole lines), then the sums */
    size_t piece_bytes = sizeof(uint16_t) * (size_t)(M * G * SPLIT_WORDS),
           sum_bytes = (sizeof(float) * (size_t)(M * G) + 63) / 64 * 64;
    uint16_t *pieces = aligned_alloc(64, piece_bytes + sum_bytes);
    if (!pieces) return PLAIT_ERR_NOMEM;
    float *sums = (float *)((char *)pieces + piece_bytes);
    for (long m = 0; m < M; m++)
      split_row(x + m * ldx, K, pieces + m * G * SPLIT_WORDS, sums + m * G);
    *a = (acts_t){x, ldx, sums, pieces, NULL};
    *scratch = pieces;
    return PLAIT_OK;
  }
#endif
  if (M != 1) return PLAIT_OK;
  float *sums = malloc(sizeof(float) * (size_t)G);
  if (!sums) return PLAIT_ERR_NOMEM;
  for (long g = 0; g < G; g++) {
    vf t = *(const vf *)(x + 32 * g);
    for (int j = 1; j < 32 / LANES; j++) t += *(const vf *)(x + 32 * g + j * LANES);
    sums[g] = hsum(t);
  }
  *a = (acts_t){x, ldx, sums, NULL, NULL};
  *scratch = sums;
  return PLAIT_OK;
}

int plait_qgemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                const float *bias, float *y, long ldy) {
  if (desc && desc[0] & PLAIT_QGEMM_REPACKED)
    return plait_repack_gemm(x, M, ldx, desc, K, bias, y, ldy, plait_repack_isa());
  part_t parts[PLAIT_MAX_PARTS];
  int num_parts, bf16;
  long N;
  int rc = read_desc(desc, K, parts, &num_parts, &N, &bf16);
  if (rc != PLAIT_OK || M < 0) return PLAIT_ERR_SHAPES;
  if (parts[0].type == PLAIT_GGML_F32)
    return plait_gemm(x, M, ldx, (const float *)parts[0].data, N, K, bias, y, ldy);
  if (M == 0 || N == 0) return PLAIT_OK;
  int fused = K % 32 == 0;
  long rows = fused && M <= FUSED_ROWS ? 1 : ROWS_PER_CHUNK;
#if QUANT_BF16
  if (fused && M == 1) rows = WROWS;
#endif
  int round_x = 0;
#if QGEMM_BATCH_BF16
  round_x = bf16 && fused && M >= PLAIT_QGEMM_BF16_MIN_ROWS;
#endif
  acts_t acts;
  void *scratch;
  if (prepare_acts(x, M, ldx, K, round_x, &acts, &scratch) != PLAIT_OK) return PLAIT_ERR_NOMEM;
#if QGEMM_BATCH
  if (round_x || (fused && (M >= BATCH_MIN_ROWS || (M >= 8 && M * K >= BATCH_MIN_FLOATS)))) {
    rc = qgemm_batch(&acts, M, parts, num_parts, N, K, bias, y, ldy);
    free(scratch);
    return rc;
  }
#endif
#pragma omp parallel
  {
    float *buf = fused ? NULL : malloc(sizeof(float) * (size_t)(rows * K));
    if (!fused && !buf) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK)
      qgemm_rows(&acts, M, parts, num_parts, N, K, rows, fused, bias, y, ldy, buf);
    free(buf);
  }
  free(scratch);
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Dequantization                                                                        */
/* ------------------------------------------------------------------------------------ */

/* desc's parts, or PLAIT_ERR_SHAPES for a descriptor or a row plait_dequantize refuses. */
static int read_rows(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                     part_t *parts, int *num_parts) {
  long N;
  int bf16;
  if (read_desc(desc, K, parts, num_parts, &N, &bf16) != PLAIT_OK || num_rows < 0 ||
      (!rows && num_rows != N))
    return PLAIT_ERR_SHAPES;
  for (long i = 0; rows && i < num_rows; i++)
    if (rows[i] < 0 || rows[i] >= N) return PLAIT_ERR_SHAPES;
  return PLAIT_OK;
}

static void row_to_f32(const part_t *parts, int num_parts, long n, long K, float *dst) {
  const part_t *p = part_of(parts, num_parts, n);
  if (p->type == PLAIT_GGML_F32)
    unpack_panel_row((const float *)p->data, n, K, dst);
  else
    dequant_row(p, n - p->first, K, dst);
}

int plait_dequantize(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                     float *out) {
  if (desc && desc[0] & PLAIT_QGEMM_REPACKED)
    return plait_repack_dequantize(desc, K, rows, num_rows, out);
  part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  if (read_rows(desc, K, rows, num_rows, parts, &num_parts) != PLAIT_OK)
    return PLAIT_ERR_SHAPES;
#pragma omp parallel for schedule(static) if (num_rows * K > 65536)
  for (long i = 0; i < num_rows; i++)
    row_to_f32(parts, num_parts, rows ? rows[i] : i, K, out + i * K);
  return PLAIT_OK;
}

/* float32 -> bfloat16 (vec.h's f32_to_bf16), K values. */
static void to_bf16(const float *src, long K, uint16_t *dst) {
  for (long k = 0; k < K; k++) dst[k] = f32_to_bf16(src[k]);
}

/* Row n of desc's parts into dst [K] as bfloat16 bits; buf [K] float32 scratch. A block,
 * F16 or BF16 row (K % 32 == 0, dst 64-byte aligned) goes through qgemm_batch_bf16.h's
 * decoder, which rounds in registers: the same bits as row_to_f32 then to_bf16, as no value
 * of those types is a float32 denormal (see that file). F32 panels and the rest take the
 * float32 row. */
static void row_to_bf16(const part_t *parts, int num_parts, long n, long K, uint16_t *dst,
                        float *buf) {
  const part_t *p = part_of(parts, num_parts, n);
  if (p->traits && p->traits->to_bf16 && K % 32 == 0 && ((uintptr_t)dst & 63) == 0) {
    p->traits->to_bf16(p->data + (n - p->first) * p->row_bytes, K, dst);
    return;
  }
  row_to_f32(parts, num_parts, n, K, buf);
  to_bf16(buf, K, dst);
}

int plait_dequantize_bf16(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                          uint16_t *out) {
  part_t parts[PLAIT_MAX_PARTS];
  int num_parts, rc = PLAIT_OK;
  if (read_rows(desc, K, rows, num_rows, parts, &num_parts) != PLAIT_OK)
    return PLAIT_ERR_SHAPES;
#pragma omp parallel if (num_rows * K > 65536)
  {
    float *buf = malloc(sizeof(float) * (size_t)K);
    if (!buf) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
#pragma omp for schedule(static)
      for (long i = 0; i < num_rows; i++)
        row_to_bf16(parts, num_parts, rows ? rows[i] : i, K, out + i * K, buf);
    }
    free(buf);
  }
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* The traits table: one row per GGML type id                                             */
/* ------------------------------------------------------------------------------------ */

/* bf16: BF16 (the type's bf16_tiles and bf16_rows) or NO_BF16 (none; see quant_traits_t).
 * Every function name is pasted here from t unexpanded (t's name is a macro for its id). */
#if QUANT_BF16
#define BF16(tiles, rows) tiles, rows
#define TO_BF16(f) f
#else
#define BF16(tiles, rows) NULL, NULL
#define TO_BF16(f) NULL
#endif
#define NO_BF16(tiles, rows) NULL, NULL
#define TRAITS(t, per_block, bytes, factored, bf16)                              \
  [t] = {per_block, bytes, groups_##t, tiles_##t, factored,                     \
         bf16(bf16_tiles_##t, bf16_rows_##t), TO_BF16(to_bf16_##t)},
static const quant_traits_t QUANT_TRAITS[PLAIT_GGML_BF16 + 1] = {
  TRAITS(PLAIT_GGML_F16, 1, 2, NULL, NO_BF16)
  TRAITS(PLAIT_GGML_BF16, 1, 2, NULL, NO_BF16)
  TRAITS(PLAIT_GGML_Q4_0, 32, 18, factored_PLAIT_GGML_Q4_0, BF16)
  TRAITS(PLAIT_GGML_Q4_1, 32, 20, factored_PLAIT_GGML_Q4_1, BF16)
  TRAITS(PLAIT_GGML_Q5_0, 32, 22, factored_PLAIT_GGML_Q5_0, BF16)
  TRAITS(PLAIT_GGML_Q8_0, 32, 34, factored_PLAIT_GGML_Q8_0, NO_BF16)
  TRAITS(PLAIT_GGML_Q4_K, 256, 144, NULL, BF16)
  TRAITS(PLAIT_GGML_Q5_K, 256, 176, NULL, BF16)
  TRAITS(PLAIT_GGML_Q6_K, 256, 210, NULL, BF16)
};
#undef TRAITS
#undef NO_BF16
#undef TO_BF16
#undef BF16

static const quant_traits_t *traits_of(int type) {
  if (type < 0 || type > PLAIT_GGML_BF16 || QUANT_TRAITS[type].per_block == 0) return NULL;
  return &QUANT_TRAITS[type];
}
