/* plait_qgemm_i8: a kept weight's product with x quantized to int8 per group of k, by
 * AVX512-VNNI dot products (vpdpbusd), for prefills (the engine's `prefill_int8` option).
 * Included by qgemm.c after read_desc and part_of, which it uses.
 *
 * Every block type read here stores a group's weights as unsigned codes c with one scale a
 * and one offset o per group: w = a c - o (Q4_0: c the nibble, a = d, o = 8 d; Q4_1: o = -m;
 * Q5_0: c < 32, o = 16 d; Q8_0: c = q + 128, o = 128 d; Q4_K / Q5_K: a = d sc, o = dmin m of
 * the 32-weight sub-block; Q6_K: c < 64, a = d sc, o = 32 a per 16 weights). x's row is cut
 * into groups of G weights (G = 16 when a part is Q6_K, else 32), each quantized
 * symmetrically: sx = max |x| / 127, q = round(x / sx) to nearest even (|q| <= 127). Then
 * per row, output and group:
 *
 *   sum_k x_k w_k  ~  sx (a I - o S),   I = sum_k q_k c_k (int32, exact),  S = sum_k q_k
 *
 * I by vpdpbusd (unsigned codes x signed quants, 4 products a lane), the rest in float32.
 * The weights are the file's exact values; x's rounding to int8 is the only approximation
 * (llama.cpp quantizes activations the same way, per 32 weights).
 *
 * Layout: each thread packs 32 weight rows at a time (two panels of 16) into its buffer,
 * per group G / 4 vectors of [16 rows][4 codes] (lane n = weight row n, the 4 codes of k
 * .. k + 3), then a[16] and o[16]; the panels then meet every x row in tiles of I8_ROWS
 * rows: per group, G / 4 x 2 vpdpbusd per row (x's 4 quants broadcast), then 4 float32
 * operations per row and panel.
 */
#ifndef PLAIT_CPU_QGEMM_I8_H
#define PLAIT_CPU_QGEMM_I8_H

#if LANES == 16 && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QGEMM_I8 1
/* x rows per register tile: 4 rows x 2 panels of int32 and float32 accumulators (16 of the
 * 32 vector registers) measured fastest against 6 rows on Qwen2.5-0.5B's shapes. */
#define I8_ROWS 4
/* The fewest x values (M K) quantized by all threads rather than the caller alone. */
#define I8_PARALLEL_QUANTIZE 16384

static inline long i8_group_bytes(int G) { return 16L * G + 128; }

/* The bytes of i8_pack_panel's scratch for rows of K weights: 16 rows of codes [16][K],
 * then their scales and offsets ao [16][K / 32][4] floats. */
static inline size_t i8_scratch_bytes(long K) {
  return (size_t)(16 * K) + sizeof(float) * (size_t)(16 * (K / 32) * 4);
}

/* The 32 codes of 32-weight group g of a row of `type`, scale and offset of each half. */
ALWAYS_INLINE __m256i i8_codes(int type, const uint8_t *row, long g, float a[2], float o[2]) {
  const __m256i low4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
  const uint8_t *b;
  __m256i c;
  switch (type) {
    case PLAIT_GGML_Q4_0:
    case PLAIT_GGML_Q4_1:
    case PLAIT_GGML_Q5_0: {
      int off = type == PLAIT_GGML_Q4_0 ? 2 : type == PLAIT_GGML_Q4_1 ? 4 : 6;
      b = row + g * (type == PLAIT_GGML_Q4_0 ? 18 : type == PLAIT_GGML_Q4_1 ? 20 : 22);
      __m128i q = _mm_loadu_si128((const __m128i *)(b + off));
      c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low4);
      float d = load_f16(b);
      a[0] = a[1] = d;
      if (type == PLAIT_GGML_Q4_1) {
        o[0] = o[1] = -load_f16(b + 2);
      } else if (type == PLAIT_GGML_Q4_0) {
        o[0] = o[1] = 8.0f * d;
      } else {
        uint32_t qh;
        memcpy(&qh, b + 2, sizeof qh);
        c = _mm256_or_si256(c, _mm256_maskz_mov_epi8((__mmask32)qh, bit4));
        o[0] = o[1] = 16.0f * d;
      }
      return c;
    }
    case PLAIT_GGML_Q8_0: {
      b = row + g * 34;
      float d = load_f16(b);
      a[0] = a[1] = d;
      o[0] = o[1] = 128.0f * d;
      return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                              _mm256_set1_epi8((char)0x80));
    }
    case PLAIT_GGML_Q4_K:
    case PLAIT_GGML_Q5_K: {
      int k5 = type == PLAIT_GGML_Q5_K, s = (int)(g % 8);
      b = row + g / 8 * (k5 ? 176 : 144);
      float sc, mn;
      scale_min_k4(b + 4, s, &sc, &mn);
      a[0] = a[1] = load_f16(b) * sc;
      o[0] = o[1] = load_f16(b + 2) * mn;
      __m256i q = _mm256_loadu_si256((const __m256i *)(b + (k5 ? 48 : 16) + 32 * (s / 2)));
      c = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
      if (k5) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        c = _mm256_or_si256(c, _mm256_maskz_mov_epi8(
                                   _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << s))),
                                   bit4));
      }
      return c;
    }
    default: { /* Q6_K: grp_q6_k's bits, two scales */
      int s = (int)(g % 8), h = s / 4, q = s % 4;
      b = row + g / 8 * 210;
      __m256i lo = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (q % 2)));
      __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
      lo = _mm256_and_si256(q < 2 ? lo : _mm256_srli_epi16(lo, 4), low4);
      hi = _mm256_and_si256(_mm256_srli_epi16(hi, 2 * q), _mm256_set1_epi8(3));
      float d = load_f16(b + 208);
      const int8_t *scales = (const int8_t *)(b + 192);
      for (int j = 0; j < 2; j++) {
        a[j] = d * (float)scales[8 * h + 2 * q + j];
        o[j] = 32.0f * a[j];
      }
      return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
    }
  }
}

/* Row `row` of `type` (K / 32 groups) into codes [K] bytes and ao [K / 32][4] = (a, a, o,
 * o) of its halves; `type` a constant once inlined. */
ALWAYS_INLINE void i8_row_of(int type, const uint8_t *row, long groups, uint8_t *codes,
                             float *ao) {
  for (long g = 0; g < groups; g++) {
    _mm256_storeu_si256((__m256i *)(codes + 32 * g), i8_codes(type, row, g, ao + 4 * g,
                                                              ao + 4 * g + 2));
  }
}

#define I8_ROW_OF(t)                                                                     \
  static void i8_row_##t(const uint8_t *row, long groups, uint8_t *codes, float *ao) {     \
    i8_row_of(t, row, groups, codes, ao);                                                  \
  }
I8_ROW_OF(PLAIT_GGML_Q4_0) I8_ROW_OF(PLAIT_GGML_Q4_1) I8_ROW_OF(PLAIT_GGML_Q5_0)
I8_ROW_OF(PLAIT_GGML_Q8_0) I8_ROW_OF(PLAIT_GGML_Q4_K) I8_ROW_OF(PLAIT_GGML_Q5_K)
I8_ROW_OF(PLAIT_GGML_Q6_K)
#undef I8_ROW_OF

/* Weight rows n0 .. n0 + 15 of W [N, K] (rows past N: zeros) packed into dst as above, through
 * the caller's scratch (i8_scratch_bytes(K): rows [16][K] codes, then ao [16][K / 32][4]
 * floats, 4-byte aligned as K % 32 == 0): each row decoded on its own
 * (one stream of its bytes: 16 rows read side by side, a group at a time, measured 4x
 * slower, more streams than the hardware prefetcher follows), then each group's 16 rows of
 * codes gathered into the panel's [G / 4][16][4] vectors. */
static void i8_pack_panel(const part_t *parts, int num_parts, long N, long K, int G, long n0,
                          uint8_t *dst, uint8_t *scratch) {
  long groups = K / 32;
  uint8_t *rows = scratch;
  float *ao = (float *)(scratch + 16 * K);
  for (int r = 0; r < 16; r++) {
    long n = n0 + r;
    if (n < N) {
      const part_t *p = part_of(parts, num_parts, n);
      p->traits->i8_row(p->data + (n - p->first) * p->row_bytes, groups, rows + r * K,
             ao + r * groups * 4);
    } else {
      memset(rows + r * K, 0, (size_t)K);
      memset(ao + r * groups * 4, 0, sizeof(float) * (size_t)(groups * 4));
    }
  }
  const __m512i by_row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7,
                                                             6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)(K / 4)));
  long gbytes = i8_group_bytes(G);
  for (long g = 0; g < groups; g++) {
    /* the 32 codes as 32 / G groups: the whole (G = 32) or half h (G = 16) */
    for (int h = 0; h < 32 / G; h++) {
      uint8_t *out = dst + (g * (32 / G) + h) * gbytes;
      for (int s = 0; s < G / 4; s++)
        _mm512_store_si512(out + 64 * s, _mm512_i32gather_epi32(
            _mm512_add_epi32(by_row, _mm512_set1_epi32((int)(8 * g + h * 4 + s))), rows, 4));
      float *scale = (float *)(out + 16 * G), *offset = scale + 16;
      for (int r = 0; r < 16; r++) {
        scale[r] = ao[(r * groups + g) * 4 + h];
        offset[r] = ao[(r * groups + g) * 4 + 2 + h];
      }
    }
  }
}

/* R rows of y from x's quantized rows against two packed panels: columns 0 .. cols - 1
 * (cols <= 32) of the two panels' 32 rows, bias (NULL: none) b[0 .. 31]; or with `silu`
 * (panel 0 gate rows, panel 1 the matching up rows) 16 columns silu(g) u, bias b0[0 .. 15]
 * and b1[0 .. 15]. R, G and silu constants once inlined. */
ALWAYS_INLINE void i8_tile(int R, int G, int silu, const int8_t *xq, const float *sx,
                           const float *sxq, long K, const uint8_t *p0, const uint8_t *p1,
                           const float *bias0, const float *bias1, float *y, long ldy,
                           int cols) {
  long ng = K / G, gbytes = i8_group_bytes(G);
  __m512 f[I8_ROWS][2];
  for (int r = 0; r < R; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (long j = 0; j < ng; j++) {
    __m512i acc[I8_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    const uint8_t *w0 = p0 + j * gbytes, *w1 = p1 + j * gbytes;
    const int8_t *xg = xq + j * G;
#pragma GCC unroll 8
    for (int s = 0; s < G / 4; s++) {
      __m512i v0 = _mm512_load_si512(w0 + 64 * s), v1 = _mm512_load_si512(w1 + 64 * s);
      for (int r = 0; r < R; r++) {
        int32_t quads;
        memcpy(&quads, xg + r * K + 4 * s, sizeof quads);
        __m512i xb = _mm512_set1_epi32(quads);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], v0, xb);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], v1, xb);
      }
    }
    __m512 a0 = _mm512_load_ps(w0 + 16 * G), a1 = _mm512_load_ps(w1 + 16 * G);
    __m512 o0 = _mm512_load_ps(w0 + 16 * G + 64), o1 = _mm512_load_ps(w1 + 16 * G + 64);
    for (int r = 0; r < R; r++) {
      __m512 s = _mm512_set1_ps(sx[r * ng + j]), t = _mm512_set1_ps(sxq[r * ng + j]);
      f[r][0] = _mm512_fnmadd_ps(t, o0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]),
                                                        _mm512_mul_ps(a0, s), f[r][0]));
      f[r][1] = _mm512_fnmadd_ps(t, o1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]),
                                                        _mm512_mul_ps(a1, s), f[r][1]));
    }
  }
  __mmask16 m0 = cols >= 16 ? 0xffff : (__mmask16)((1u << cols) - 1);
  __mmask16 m1 = silu ? m0 : cols >= 32 ? 0xffff : cols <= 16 ? 0
                                 : (__mmask16)((1u << (cols - 16)) - 1);
  __m512 b0 = bias0 ? _mm512_maskz_loadu_ps(m0, bias0) : _mm512_setzero_ps();
  __m512 b1 = bias1 ? _mm512_maskz_loadu_ps(m1, bias1) : _mm512_setzero_ps();
  for (int r = 0; r < R; r++) {
    __m512 g = _mm512_add_ps(f[r][0], b0), u = _mm512_add_ps(f[r][1], b1);
    if (silu) {  /* rowwise.c's silu_mul arithmetic: its bits on the unfused product */
      vf gv = (vf)g;
      _mm512_mask_storeu_ps(y + r * ldy, m0, (__m512)(gv / (1.0f + vexp(-gv)) * (vf)u));
    } else {
      _mm512_mask_storeu_ps(y + r * ldy, m0, g);
      _mm512_mask_storeu_ps(y + r * ldy + 16, m1, u);
    }
  }
}

#define I8_TILE(R, G, S) i8_tile(R, G, S, xq, sx, sxq, K, p0, p1, b0, b1, y, ldy, cols)
#define I8_TILE_CASES(G, S)              \
  switch (R) {                           \
    case 4: I8_TILE(4, G, S); return;    \
    case 3: I8_TILE(3, G, S); return;    \
    case 2: I8_TILE(2, G, S); return;    \
    default: I8_TILE(1, G, S); return;   \
  }

static void i8_tile_any(int R, int G, int silu, const int8_t *xq, const float *sx,
                        const float *sxq, long K, const uint8_t *p0, const uint8_t *p1,
                        const float *b0, const float *b1, float *y, long ldy, int cols) {
  if (G == 16 && silu) I8_TILE_CASES(16, 1)
  if (G == 16) I8_TILE_CASES(16, 0)
  if (silu) I8_TILE_CASES(32, 1)
  I8_TILE_CASES(32, 0)
}

/* x [M, K] (rows ldx apart) -> xq [M, K] int8, sx and sxq [M, K / G] (see the top); a few
 * rows on the calling thread (a parallel region's start costs more than they do). */
static void i8_quantize(const float *x, long M, long ldx, long K, int G, int8_t *xq, float *sx,
                        float *sxq) {
  long ng = K / G;
#pragma omp parallel for schedule(static) if (M * K >= I8_PARALLEL_QUANTIZE)
  for (long m = 0; m < M; m++) {
    for (long j = 0; j < ng; j++) {
      const float *v = x + m * ldx + j * G;
      __m512 v0 = _mm512_loadu_ps(v), v1 = G == 32 ? _mm512_loadu_ps(v + 16) : v0;
      float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
      _mm_storeu_si128((__m128i *)(xq + m * K + j * G), _mm512_cvtepi32_epi8(q0));
      int sum = _mm512_reduce_add_epi32(q0);
      if (G == 32) {
        __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(xq + m * K + j * G + 16), _mm512_cvtepi32_epi8(q1));
        sum += _mm512_reduce_add_epi32(q1);
      }
      sx[m * ng + j] = amax / 127.0f;
      sxq[m * ng + j] = sx[m * ng + j] * (float)sum;
    }
  }
}


/* G of parts (16 where one is Q6_K, else 32: the least of their traits' i8_group), or 0
 * where a part's type is not read here. */
static int i8_group(const part_t *parts, int num_parts) {
  int G = 32;
  for (int i = 0; i < num_parts; i++) {
    const quant_traits_t *t = parts[i].traits;
    if (!t || !t->i8_row) return 0;
    if (t->i8_group < G) G = t->i8_group;
  }
  return G;
}

/* How many panels of 16 rows W's resident panels hold: whole pairs (2 ceil(N / 32)), so
 * that qgemm_i8's last pair reads a panel of zeros where N - 32 p <= 16, not past the end. */
static long i8_panel_count(long N) { return 2 * ((N + 31) / 32); }

/* The bytes of W's resident panels (plait_qgemm_i8_pack): i8_panel_count(N) panels, each
 * K / G groups of i8_group_bytes(G). */
static long i8_panels_bytes(long N, long K, int G) {
  return i8_panel_count(N) * (K / G) * i8_group_bytes(G);
}

/* plait_qgemm_i8_pack (plait_cpu.h). */
static int i8_pack(const part_t *parts, int num_parts, long N, long K, int G, uint8_t *out) {
  long panel = K / G * i8_group_bytes(G), count = i8_panel_count(N);
  int rc = PLAIT_OK;
#pragma omp parallel
  {
    uint8_t *scratch = malloc(i8_scratch_bytes(K));
    if (!scratch) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
#pragma omp for schedule(static)
      for (long q = 0; q < count; q++)
        i8_pack_panel(parts, num_parts, N, K, G, 16 * q, out + q * panel, scratch);
    }
    free(scratch);
  }
  return rc;
}
#endif /* VNNI */

/* plait_qgemm_i8 (plait_cpu.h), and plait_qgemm's calls of descriptors with panels:
 * `panels` (NULL: each thread packs its pairs from the blocks) W's resident panels. A pair
 * of panels is weight rows 32 p .. 32 p + 31 (panels 2 p and 2 p + 1), or with `silu` gate
 * rows 16 p .. and up rows N / 2 + 16 p .. (panels p and N / 32 + p). PLAIT_ERR_SHAPES in a
 * build without VNNI. */
static int qgemm_i8(const float *x, long M, long ldx, const part_t *parts, int num_parts,
                    long N, long K, const uint8_t *panels, const float *bias, int silu,
                    float *y, long ldy) {
#if QGEMM_I8
  int G = i8_group(parts, num_parts);
  if (!G || M < 0 || K % 32 || (silu && N % 32)) return PLAIT_ERR_SHAPES;
  if (M == 0 || N == 0) return PLAIT_OK;
  long ng = K / G, pairs = silu ? N / 32 : (N + 31) / 32, gbytes = i8_group_bytes(G);
  long second = silu ? N / 2 : 16, stride = silu ? 16 : 32, panel = ng * gbytes;
  int8_t *xq = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
  float *sx = malloc(sizeof(float) * (size_t)(M * ng));
  float *sxq = malloc(sizeof(float) * (size_t)(M * ng));
  int rc = xq && sx && sxq ? PLAIT_OK : PLAIT_ERR_NOMEM;
  if (rc == PLAIT_OK) i8_quantize(x, M, ldx, K, G, xq, sx, sxq);
#pragma omp parallel if (rc == PLAIT_OK)
  {
    /* packing: two panels, then i8_pack_panel's scratch */
    uint8_t *buf = rc == PLAIT_OK && !panels
                       ? aligned_alloc(64, (size_t)(2 * panel) + i8_scratch_bytes(K))
                       : NULL;
    if (rc == PLAIT_OK && !panels && !buf) {
#pragma omp atomic write
      rc = PLAIT_ERR_NOMEM;
    }
#pragma omp barrier
    if (rc == PLAIT_OK) {
#pragma omp for schedule(static)
      for (long pair = 0; pair < pairs; pair++) {
        long n0 = stride * pair;
        const uint8_t *p0, *p1;
        if (panels) {
          p0 = panels + n0 / 16 * panel;
          p1 = panels + (n0 + second) / 16 * panel;
        } else {
          i8_pack_panel(parts, num_parts, N, K, G, n0, buf, buf + 2 * panel);
          i8_pack_panel(parts, num_parts, N, K, G, n0 + second, buf + panel, buf + 2 * panel);
          p0 = buf;
          p1 = buf + panel;
        }
        int cols = (int)(silu ? 16 : N - n0 < 32 ? N - n0 : 32);
        for (long m = 0; m < M; m += I8_ROWS) {
          int R = (int)(M - m < I8_ROWS ? M - m : I8_ROWS);
          i8_tile_any(R, G, silu, xq + m * K, sx + m * ng, sxq + m * ng, K, p0, p1,
                      bias ? bias + n0 : NULL, bias ? bias + n0 + second : NULL,
                      y + m * ldy + n0, ldy, cols);
        }
      }
    }
    free(buf);
  }
  free(xq);
  free(sx);
  free(sxq);
  return rc;
#else
  (void)x, (void)M, (void)ldx, (void)parts, (void)num_parts, (void)N, (void)K, (void)panels,
      (void)bias, (void)silu, (void)y, (void)ldy;
  return PLAIT_ERR_SHAPES;
#endif
}

#endif /* PLAIT_CPU_QGEMM_I8_H */
