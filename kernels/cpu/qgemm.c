/* GEMM and dequantization straight from a GGUF file's GGML blocks (see vec.h, quant.py).
 *
 * A weight W [N, K] is the parts of an int64 descriptor (plait_cpu.h), each `rows` rows in
 * one GGML type; a GGML row is K / QK blocks, independent of the other rows:
 *
 *   desc = [num_parts, addr_0, type_0, rows_0, addr_1, type_1, rows_1, ...]
 *
 *   part 0 rows 0 .. rows_0-1        | blk | blk | ... |   (row_bytes = K / QK * block bytes)
 *   part 1 rows rows_0 .. +rows_1-1  | blk | blk | ... |
 *
 * plait_qgemm dequantizes a weight row (or a few, when x has many rows) into a float32
 * buffer that stays in L1, then takes its dot products with a tile of x rows, R <= RMAX
 * accumulator vectors in registers: the weights stream once from memory in their compact
 * form, the activations stay float32 (no activation quantization). The type PLAIT_GGML_F32
 * means float32 panels as plait_gemm packs them and goes to plait_gemm itself (the same
 * bits as calling it).
 *
 * Each block is dequantized with gguf-py's float32 operations in gguf-py's order (the
 * tests' reference, quant.dequantize_reference), so plait_dequantize matches it bit for bit.
 */
#include "plait_cpu.h"
#include "vec.h"

/* Weight rows dequantized together when x has more rows than a tile: each row's floats are
 * then read once per tile of x from L2, not dequantized again. */
#define ROWS_PER_CHUNK 32

typedef uint8_t u8v __attribute__((vector_size(LANES), aligned(1)));
typedef int8_t i8v __attribute__((vector_size(LANES), aligned(1)));
typedef uint16_t u16v __attribute__((vector_size(2 * LANES), aligned(2)));

typedef struct {
  const uint8_t *data;
  int type;
  long first, rows, row_bytes;  /* first: the part's first row in W */
} part_t;

/* ------------------------------------------------------------------------------------ */
/* Scalars and vectors                                                                   */
/* ------------------------------------------------------------------------------------ */

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | man << 13;  /* inf, nan */
  } else if (exp) {
    bits = sign | (exp + 112) << 23 | man << 13;
  } else if (man) {  /* subnormal: normalize */
    int shift = __builtin_clz(man) - 21;
    bits = sign | (uint32_t)(113 - shift) << 23 | ((man << shift) & 0x3ff) << 13;
  } else {
    bits = sign;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

static inline float load_f16(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  return f16_to_f32(h);
}

/* LANES bytes widened to int32 lanes: one vpmovzx / vpmovsx (GCC 12 lowers the generic
 * __builtin_convertvector of bytes through several narrower steps). */
static inline vi load_u8(const uint8_t *p) {
#if LANES == 16
  return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif LANES == 8
  return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
  return __builtin_convertvector(*(const u8v *)p, vi);
#endif
}

static inline vi load_i8(const uint8_t *p) {
#if LANES == 16
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif LANES == 8
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
  return __builtin_convertvector(*(const i8v *)p, vi);
#endif
}

static inline vi load_u16(const uint8_t *p) {
#if LANES == 16
  return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif LANES == 8
  return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
  return __builtin_convertvector(*(const u16v *)p, vi);
#endif
}
static inline vf to_f(vi q) { return __builtin_convertvector(q, vf); }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vi iota(void) {
  vi v;
  for (int i = 0; i < LANES; i++) v[i] = i;
  return v;
}

/* a * b + c rounded twice, as numpy computes it: the empty asm hides the product from the
 * compiler, which would otherwise fuse it into one FMA (one rounding, other bits). */
static inline vf mul_add_2r(vf a, vf b, vf c) {
  vf p = a * b;
  __asm__("" : "+v"(p));
  return p + c;
}

/* ------------------------------------------------------------------------------------ */
/* Blocks -> float32                                                                     */
/*                                                                                       */
/* The 32-weight types store weight j < 16 in the low nibble of qs[j], weight 16 + j in  */
/* its high nibble; a chunk of LANES weights c*LANES.. reads qs[(c*LANES) % 16 ..].      */
/* ------------------------------------------------------------------------------------ */

static inline vi nibbles(const uint8_t *qs, int first) {  /* weights first..first+LANES-1 */
  vi q = load_u8(qs + first % 16);
  return first < 16 ? q & 15 : q >> 4;
}

static inline __attribute__((always_inline)) void deq_q4_0(const uint8_t *b, float *dst) {  /* d, qs[16]: (q - 8) d */
  vf d = vsplat(load_f16(b));
  for (int j = 0; j < 32; j += LANES) store(dst + j, d * to_f(nibbles(b + 2, j) - 8));
}

static inline __attribute__((always_inline)) void deq_q4_1(const uint8_t *b, float *dst) {  /* d, m, qs[16]: q d + m */
  vf d = vsplat(load_f16(b)), m = vsplat(load_f16(b + 2));
  for (int j = 0; j < 32; j += LANES) store(dst + j, mul_add_2r(d, to_f(nibbles(b + 4, j)), m));
}

static inline __attribute__((always_inline)) void deq_q5_0(const uint8_t *b, float *dst) {  /* d, qh (bit j: weight j), qs[16] */
  vf d = vsplat(load_f16(b));
  uint32_t qh;
  memcpy(&qh, b + 2, sizeof qh);
  vi high = (vi){0} + (int32_t)qh;
  for (int j = 0; j < 32; j += LANES) {
    vi hb = (high >> (iota() + j)) & 1;
    store(dst + j, d * to_f((nibbles(b + 6, j) | hb << 4) - 16));
  }
}

static inline __attribute__((always_inline)) void deq_q8_0(const uint8_t *b, float *dst) {  /* d, int8 qs[32]: q d */
  vf d = vsplat(load_f16(b));
  for (int j = 0; j < 32; j += LANES) store(dst + j, to_f(load_i8(b + 2 + j)) * d);
}

/* The 6-bit scale and min of sub-block s of a Q4_K / Q5_K block's 12 scale bytes. */
static inline void scale_min_k4(const uint8_t *q, int s, float *sc, float *mn) {
  if (s < 4) {
    *sc = (float)(q[s] & 63);
    *mn = (float)(q[s + 4] & 63);
  } else {
    *sc = (float)((q[s + 4] & 0xf) | (q[s - 4] >> 6) << 4);
    *mn = (float)((q[s + 4] >> 4) | (q[s] >> 6) << 4);
  }
}

/* Q4_K: d, dmin, scales[12], qs[128]; 8 sub-blocks of 32, sub-block s in the low (even s)
 * or high nibbles of qs[32 (s / 2) ..]: q (d sc_s) - dmin m_s. */
static inline __attribute__((always_inline)) void deq_q4_k(const uint8_t *b, float *dst) {
  float d = load_f16(b), dmin = load_f16(b + 2), sc, mn;
  for (int s = 0; s < 8; s++) {
    scale_min_k4(b + 4, s, &sc, &mn);
    vf ds = vsplat(d * sc), dm = vsplat(-(dmin * mn));
    const uint8_t *qs = b + 16 + 32 * (s / 2);
    for (int j = 0; j < 32; j += LANES) {
      vi q = load_u8(qs + j);
      store(dst + 32 * s + j, mul_add_2r(ds, to_f(s & 1 ? q >> 4 : q & 15), dm));
    }
  }
}

/* Q5_K: d, dmin, scales[12], qh[32] (bit s of qh[l]: the fifth bit of weight l of
 * sub-block s), qs[128] as Q4_K's. */
static inline __attribute__((always_inline)) void deq_q5_k(const uint8_t *b, float *dst) {
  float d = load_f16(b), dmin = load_f16(b + 2), sc, mn;
  for (int s = 0; s < 8; s++) {
    scale_min_k4(b + 4, s, &sc, &mn);
    vf ds = vsplat(d * sc), dm = vsplat(-(dmin * mn));
    const uint8_t *qs = b + 48 + 32 * (s / 2);
    for (int j = 0; j < 32; j += LANES) {
      vi q = load_u8(qs + j), hb = (load_u8(b + 16 + j) >> s) & 1;
      q = (s & 1 ? q >> 4 : q & 15) | hb << 4;
      store(dst + 32 * s + j, mul_add_2r(ds, to_f(q), dm));
    }
  }
}

/* Q6_K: ql[128], qh[64], int8 scales[16], d. Two halves of 128; in half h, weight w =
 * 32 g + l takes its low 4 bits from ql[64 h + w % 64] (low nibble when w < 64) and its high
 * 2 from qh[32 h + l] >> 2 g; scale 8 h + w / 16: (d sc) (q - 32). */
static inline __attribute__((always_inline)) void deq_q6_k(const uint8_t *b, float *dst) {
  float d = load_f16(b + 208);
  const int8_t *scales = (const int8_t *)(b + 192);
  for (int h = 0; h < 2; h++) {
    for (int w = 0; w < 128; w += LANES) {
      int g = w / 32, l = w % 32;
      vi lo = load_u8(b + 64 * h + w % 64), hi = (load_u8(b + 128 + 32 * h + l) >> 2 * g) & 3;
      vi q = (w < 64 ? lo & 15 : lo >> 4) | hi << 4;
      vf ds = vsplat(d * (float)scales[8 * h + w / 16]);
      store(dst + 128 * h + w, ds * to_f(q - 32));
    }
  }
}

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
    vi bits = load_u16(src + 2 * k) << 16;
    store(dst + k, (vf)bits);
  }
  for (; k < K; k++) {
    uint32_t bits = (uint32_t)(src[2 * k] | src[2 * k + 1] << 8) << 16;
    memcpy(dst + k, &bits, sizeof bits);
  }
}

/* Weights per block and bytes per block of a type this file reads; 0 for any other. */
static void type_shape(int type, long *per_block, long *bytes) {
  switch (type) {
    case PLAIT_GGML_F16: case PLAIT_GGML_BF16: *per_block = 1; *bytes = 2; return;
    case PLAIT_GGML_Q4_0: *per_block = 32; *bytes = 18; return;
    case PLAIT_GGML_Q4_1: *per_block = 32; *bytes = 20; return;
    case PLAIT_GGML_Q5_0: *per_block = 32; *bytes = 22; return;
    case PLAIT_GGML_Q8_0: *per_block = 32; *bytes = 34; return;
    case PLAIT_GGML_Q4_K: *per_block = 256; *bytes = 144; return;
    case PLAIT_GGML_Q5_K: *per_block = 256; *bytes = 176; return;
    case PLAIT_GGML_Q6_K: *per_block = 256; *bytes = 210; return;
    default: *per_block = 0; *bytes = 0; return;
  }
}

/* Row `row` of part p (K weights) into dst [K] float32: a loop per type, so that each
 * block's code is inlined into it. */
static void dequant_row(const part_t *p, long row, long K, float *dst) {
  const uint8_t *src = p->data + row * p->row_bytes;
#define BLOCKS(fn, per_block, bytes) \
  for (long b = 0; b < K / (per_block); b++) fn(src + b * (bytes), dst + b * (per_block)); \
  return;
  switch (p->type) {
    case PLAIT_GGML_Q4_0: BLOCKS(deq_q4_0, 32, 18)
    case PLAIT_GGML_Q4_1: BLOCKS(deq_q4_1, 32, 20)
    case PLAIT_GGML_Q5_0: BLOCKS(deq_q5_0, 32, 22)
    case PLAIT_GGML_Q8_0: BLOCKS(deq_q8_0, 32, 34)
    case PLAIT_GGML_Q4_K: BLOCKS(deq_q4_k, 256, 144)
    case PLAIT_GGML_Q5_K: BLOCKS(deq_q5_k, 256, 176)
    case PLAIT_GGML_Q6_K: BLOCKS(deq_q6_k, 256, 210)
    case PLAIT_GGML_F16: deq_f16_row(src, K, dst); return;
    default: deq_bf16_row(src, K, dst); return;
  }
#undef BLOCKS
}

/* ------------------------------------------------------------------------------------ */
/* Descriptors                                                                           */
/* ------------------------------------------------------------------------------------ */

/* desc's parts into parts[], their total rows into *N; PLAIT_ERR_SHAPES for a descriptor
 * this file cannot read with K (a type it does not know, K not a whole number of blocks,
 * F32 panels beside other parts, more than PLAIT_MAX_PARTS parts, negative rows). */
static int read_desc(const int64_t *desc, long K, part_t *parts, int *num_parts, long *N) {
  if (!desc || desc[0] < 1 || desc[0] > PLAIT_MAX_PARTS || K <= 0) return PLAIT_ERR_SHAPES;
  *num_parts = (int)desc[0];
  *N = 0;
  for (int i = 0; i < *num_parts; i++) {
    part_t *p = &parts[i];
    p->data = (const uint8_t *)(intptr_t)desc[1 + 3 * i];
    p->type = (int)desc[2 + 3 * i];
    p->rows = desc[3 + 3 * i];
    p->first = *N;
    long per_block, bytes;
    type_shape(p->type, &per_block, &bytes);
    if (p->type == PLAIT_GGML_F32 && *num_parts == 1) {
      per_block = 1;
      bytes = 4;
    }
    if (p->rows < 0 || per_block == 0 || K % per_block) return PLAIT_ERR_SHAPES;
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
static inline __attribute__((always_inline)) void dot_tile(int R, const float *x, long ldx,
                                                           const float *w, long K, float *y,
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
/* Fused rows: a decode step's few x rows against Q8_0 / Q4_1 blocks in registers        */
/*                                                                                       */
/* Per block of 32 and row r, t = sum_j x_j q_j as a vector (the quants converted to     */
/* float, never scaled), then acc_r += d t: one FMA by the scale per block instead of a  */
/* multiply per weight. Q4_1's min m adds m sum_j x_j, from the x block sums xsum.       */
/* ------------------------------------------------------------------------------------ */

#define FUSED_ROWS 8

static inline __attribute__((always_inline)) vf dot_block(const float *x, const vf *q) {
  vf t = *(const vf *)x * q[0];
  for (int j = 1; j < 32 / LANES; j++) t += *(const vf *)(x + j * LANES) * q[j];
  return t;
}

static inline __attribute__((always_inline)) void fused_tile(
    int R, int type, const float *x, long ldx, const uint8_t *w, long nb, const float *xsum,
    long xs_stride, float *y, long ldy, float bias) {
  vf acc[FUSED_ROWS], q[32 / LANES];
  float macc[FUSED_ROWS];
  for (int r = 0; r < R; r++) acc[r] = (vf){0}, macc[r] = 0.0f;
  for (long b = 0; b < nb; b++) {
    const float *xb = x + b * 32;
    if (type == PLAIT_GGML_Q8_0) {
      const uint8_t *blk = w + b * 34;
      vf d = vsplat(load_f16(blk));
      for (int j = 0; j < 32 / LANES; j++) q[j] = to_f(load_i8(blk + 2 + j * LANES));
      _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)
        acc[r] += d * dot_block(xb + r * ldx, q);
    } else { /* Q4_1 */
      const uint8_t *blk = w + b * 20;
      vf d = vsplat(load_f16(blk));
      float m = load_f16(blk + 2);
      for (int j = 0; j < 32 / LANES; j++) q[j] = to_f(nibbles(blk + 4, j * LANES));
      _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {
        acc[r] += d * dot_block(xb + r * ldx, q);
        macc[r] += m * xsum[r * xs_stride + b];
      }
    }
  }
  for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]) + macc[r] + bias;
}

/* y[m * ldy] = x[m] . row + bias for every m < M, when the row's type has a fused kernel;
 * returns 0 (nothing done) for the other types. */
static int fused_row(int type, const float *x, long M, long ldx, const uint8_t *row, long K,
                     const float *xsum, float *y, long ldy, float bias) {
  if (type != PLAIT_GGML_Q8_0 && type != PLAIT_GGML_Q4_1) return 0;
  long nb = K / 32;
  for (long m = 0; m < M; m += FUSED_ROWS) {
    int R = (int)(M - m < FUSED_ROWS ? M - m : FUSED_ROWS);
    const float *xm = x + m * ldx, *xs = xsum + m * nb;
    float *ym = y + m * ldy;
#define CASE(n)                                                                            \
  case n:                                                                                  \
    if (type == PLAIT_GGML_Q8_0)                                                           \
      fused_tile(n, PLAIT_GGML_Q8_0, xm, ldx, row, nb, xs, nb, ym, ldy, bias);            \
    else                                                                                   \
      fused_tile(n, PLAIT_GGML_Q4_1, xm, ldx, row, nb, xs, nb, ym, ldy, bias);            \
    break;
    switch (R) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) }
#undef CASE
  }
  return 1;
}

/* xsum[m, b] = the sum of x[m]'s block b of 32 (Q4_1's min term). */
static void block_sums(const float *x, long M, long ldx, long K, float *xsum) {
  long nb = K / 32;
  for (long m = 0; m < M; m++)
    for (long b = 0; b < nb; b++) {
      vf t = *(const vf *)(x + m * ldx + 32 * b);
      for (int j = 1; j < 32 / LANES; j++) t += *(const vf *)(x + m * ldx + 32 * b + j * LANES);
      xsum[m * nb + b] = hsum(t);
    }
}

/* ------------------------------------------------------------------------------------ */
/* GEMM                                                                                  */
/* ------------------------------------------------------------------------------------ */

/* y[M, N] = x[M, K] @ W^T + bias for W of quantized parts (see the top of the file). Each
 * thread owns chunks of `rows` weight rows. A chunk of one row of a fused type (xsum given:
 * M <= PLAIT_NATIVE_MAX_ROWS) runs fused_row; the others are dequantized into buf [rows, K],
 * then every tile of x is taken against them. */
static void qgemm_rows(const float *x, long M, long ldx, const part_t *parts, int num_parts,
                       long N, long K, long rows, const float *xsum, const float *bias,
                       float *y, long ldy, float *buf) {
  long chunks = (N + rows - 1) / rows;
#pragma omp for schedule(static)
  for (long c = 0; c < chunks; c++) {
    long n0 = c * rows, nr = N - n0 < rows ? N - n0 : rows;
    if (xsum && nr == 1) {
      const part_t *p = part_of(parts, num_parts, n0);
      if (fused_row(p->type, x, M, ldx, p->data + (n0 - p->first) * p->row_bytes, K, xsum,
                    y + n0, ldy, bias ? bias[n0] : 0.0f))
        continue;
    }
    for (long i = 0; i < nr; i++) {
      const part_t *p = part_of(parts, num_parts, n0 + i);
      dequant_row(p, n0 + i - p->first, K, buf + i * K);
    }
    for (long m = 0; m < M; m += RMAX) {
      int R = (int)(M - m < RMAX ? M - m : RMAX);
      for (long i = 0; i < nr; i++)
        dot_rows(R, x + m * ldx, ldx, buf + i * K, K, y + m * ldy + n0 + i, ldy,
                 bias ? bias[n0 + i] : 0.0f);
    }
  }
}

int plait_qgemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                const float *bias, float *y, long ldy) {
  part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  long N;
  int rc = read_desc(desc, K, parts, &num_parts, &N);
  if (rc != PLAIT_OK || M < 0) return PLAIT_ERR_SHAPES;
  if (parts[0].type == PLAIT_GGML_F32)
    return plait_gemm(x, M, ldx, (const float *)parts[0].data, N, K, bias, y, ldy);
  if (M == 0 || N == 0) return PLAIT_OK;
  /* few rows: one weight row per chunk, fused where the type has it (K % 32 == 0 then) */
  int few = M <= PLAIT_NATIVE_MAX_ROWS && K % 32 == 0;
  long rows = few ? 1 : ROWS_PER_CHUNK;
  float *xsum = few ? malloc(sizeof(float) * (size_t)(M * (K / 32))) : NULL;
  if (few && !xsum) return PLAIT_ERR_NOMEM;
  if (xsum) block_sums(x, M, ldx, K, xsum);
#pragma omp parallel
  {
    float *buf = malloc(sizeof(float) * (size_t)(rows * K));
    if (!buf) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK)
      qgemm_rows(x, M, ldx, parts, num_parts, N, K, rows, xsum, bias, y, ldy, buf);
    free(buf);
  }
  free(xsum);
  return rc;
}

/* ------------------------------------------------------------------------------------ */
/* Dequantization                                                                        */
/* ------------------------------------------------------------------------------------ */

int plait_dequantize(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                     float *out) {
  part_t parts[PLAIT_MAX_PARTS];
  int num_parts;
  long N;
  if (read_desc(desc, K, parts, &num_parts, &N) != PLAIT_OK || num_rows < 0 ||
      (!rows && num_rows != N))
    return PLAIT_ERR_SHAPES;
  for (long i = 0; rows && i < num_rows; i++)
    if (rows[i] < 0 || rows[i] >= N) return PLAIT_ERR_SHAPES;
#pragma omp parallel for schedule(static) if (num_rows * K > 65536)
  for (long i = 0; i < num_rows; i++) {
    long n = rows ? rows[i] : i;
    const part_t *p = part_of(parts, num_parts, n);
    if (p->type == PLAIT_GGML_F32)
      unpack_panel_row((const float *)p->data, n, K, out + i * K);
    else
      dequant_row(p, n - p->first, K, out + i * K);
  }
  return PLAIT_OK;
}
