/* GGML block formats, decoded 32 weights at a time into registers (private to qgemm.c; see
 * vec.h). Every decoder writes w[32 / LANES] vectors: weights 32 g .. 32 g + 31 of a row, for
 * a row of K weights (K a whole number of the type's blocks, g < K / 32), with gguf-py's
 * float32 operations in gguf-py's order, so a stored decode is its dequantizer's bits.
 *
 *   type   block  bytes   layout (fp16 scalars little-endian)           weight
 *   Q4_0   32     18      d, qs[16]                                     (q - 8) d
 *   Q4_1   32     20      d, m, qs[16]                                  q d + m
 *   Q5_0   32     22      d, qh (u32), qs[16]                           (q - 16) d
 *   Q8_0   32     34      d, int8 qs[32]                                q d
 *   Q4_K   256    144     d, dmin, scales[12], qs[128]                  q (d sc) - dmin m
 *   Q5_K   256    176     d, dmin, scales[12], qh[32], qs[128]          q (d sc) - dmin m
 *   Q6_K   256    210     ql[128], qh[64], int8 scales[16], d           (d sc) (q - 32)
 *   F16, BF16   1  2      the value
 *
 * The 32-weight types keep weight j < 16 in the low nibble of qs[j], 16 + j in its high
 * nibble (Q5_0's fifth bit j of qh); the K types hold 8 sub-blocks of 32 per block of 256.
 */
#ifndef PLAIT_CPU_QUANT_H
#define PLAIT_CPU_QUANT_H

#include "plait_cpu.h"
#include "vec.h"

typedef uint8_t u8v __attribute__((vector_size(LANES), aligned(1)));
typedef int8_t i8v __attribute__((vector_size(LANES), aligned(1)));


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
/* 32-weight groups                                                                      */
/* ------------------------------------------------------------------------------------ */

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE vi nibbles(const uint8_t *qs, int first) {  /* weights first..first+LANES-1 */
  vi q = load_u8(qs + first % 16);
  return first < 16 ? q & 15 : q >> 4;
}

ALWAYS_INLINE void grp_q4_0(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g * 18;
  vf d = vsplat(load_f16(b));
  for (int j = 0; j < 32 / LANES; j++) w[j] = d * to_f(nibbles(b + 2, j * LANES) - 8);
}

ALWAYS_INLINE void grp_q4_1(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g * 20;
  vf d = vsplat(load_f16(b)), m = vsplat(load_f16(b + 2));
  for (int j = 0; j < 32 / LANES; j++) w[j] = mul_add_2r(d, to_f(nibbles(b + 4, j * LANES)), m);
}

ALWAYS_INLINE void grp_q5_0(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g * 22;
  vf d = vsplat(load_f16(b));
  uint32_t qh;
  memcpy(&qh, b + 2, sizeof qh);
  vi high = (vi){0} + (int32_t)qh;
  for (int j = 0; j < 32 / LANES; j++) {
    vi hb = (high >> (iota() + j * LANES)) & 1;
    w[j] = d * to_f((nibbles(b + 6, j * LANES) | hb << 4) - 16);
  }
}

ALWAYS_INLINE void grp_q8_0(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g * 34;
  vf d = vsplat(load_f16(b));
  for (int j = 0; j < 32 / LANES; j++) w[j] = to_f(load_i8(b + 2 + j * LANES)) * d;
}

/* The 6-bit scale and min of sub-block s of a Q4_K / Q5_K block's 12 scale bytes. */
ALWAYS_INLINE void scale_min_k4(const uint8_t *q, int s, float *sc, float *mn) {
  if (s < 4) {
    *sc = (float)(q[s] & 63);
    *mn = (float)(q[s + 4] & 63);
  } else {
    *sc = (float)((q[s + 4] & 0xf) | (q[s - 4] >> 6) << 4);
    *mn = (float)((q[s + 4] >> 4) | (q[s] >> 6) << 4);
  }
}

/* Q4_K sub-block s = g % 8: the low (even s) or high nibbles of qs[32 (s / 2) ..]. */
ALWAYS_INLINE void grp_q4_k(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g / 8 * 144;
  int s = (int)(g % 8);
  float sc, mn;
  scale_min_k4(b + 4, s, &sc, &mn);
  vf ds = vsplat(load_f16(b) * sc), dm = vsplat(-(load_f16(b + 2) * mn));
  for (int j = 0; j < 32 / LANES; j++) {
    vi q = load_u8(b + 16 + 32 * (s / 2) + j * LANES);
    w[j] = mul_add_2r(ds, to_f(s & 1 ? q >> 4 : q & 15), dm);
  }
}

/* Q5_K: Q4_K's nibbles, the fifth bit of weight l of sub-block s in bit s of qh[l]. */
ALWAYS_INLINE void grp_q5_k(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g / 8 * 176;
  int s = (int)(g % 8);
  float sc, mn;
  scale_min_k4(b + 4, s, &sc, &mn);
  vf ds = vsplat(load_f16(b) * sc), dm = vsplat(-(load_f16(b + 2) * mn));
  for (int j = 0; j < 32 / LANES; j++) {
    vi q = load_u8(b + 48 + 32 * (s / 2) + j * LANES), hb = (load_u8(b + 16 + j * LANES) >> s) & 1;
    w[j] = mul_add_2r(ds, to_f((s & 1 ? q >> 4 : q & 15) | hb << 4), dm);
  }
}

/* Q6_K: group s = g % 8 is 32 c + l of half h = s / 4 (c = s % 4): low 4 bits from
 * ql[64 h + 32 (c % 2) + l] (the low nibble when c < 2), high 2 from qh[32 h + l] >> 2 c,
 * scale 8 h + 2 c + l / 16. */
ALWAYS_INLINE void grp_q6_k(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g / 8 * 210;
  int s = (int)(g % 8), h = s / 4, c = s % 4;
  float d = load_f16(b + 208);
  const int8_t *scales = (const int8_t *)(b + 192);
  for (int j = 0; j < 32 / LANES; j++) {
    int l = j * LANES;
    vi lo = load_u8(b + 64 * h + 32 * (c % 2) + l), hi = (load_u8(b + 128 + 32 * h + l) >> 2 * c) & 3;
    vi q = (c < 2 ? lo & 15 : lo >> 4) | hi << 4;
    w[j] = vsplat(d * (float)scales[8 * h + 2 * c + l / 16]) * to_f(q - 32);
  }
}

ALWAYS_INLINE void grp_f16(const uint8_t *row, long g, vf *w) {
  const uint8_t *b = row + g * 64;
  for (int j = 0; j < 32 / LANES; j++) {
#if LANES == 16
    w[j] = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 2 * j * LANES)));
#elif LANES == 8 && defined(__F16C__)
    w[j] = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 2 * j * LANES)));
#else
    for (int i = 0; i < LANES; i++) w[j][i] = load_f16(b + 2 * (j * LANES + i));
#endif
  }
}

ALWAYS_INLINE void grp_bf16(const uint8_t *row, long g, vf *w) {  /* the high 16 bits */
  const uint8_t *b = row + g * 64;
  for (int j = 0; j < 32 / LANES; j++) w[j] = widen_bf16((const uint16_t *)b + j * LANES);
}

/* The group decoder of a type read here, by a constant type once inlined. */
ALWAYS_INLINE void decode_group(int type, const uint8_t *row, long g, vf *w) {
  switch (type) {
    case PLAIT_GGML_Q4_0: grp_q4_0(row, g, w); return;
    case PLAIT_GGML_Q4_1: grp_q4_1(row, g, w); return;
    case PLAIT_GGML_Q5_0: grp_q5_0(row, g, w); return;
    case PLAIT_GGML_Q8_0: grp_q8_0(row, g, w); return;
    case PLAIT_GGML_Q4_K: grp_q4_k(row, g, w); return;
    case PLAIT_GGML_Q5_K: grp_q5_k(row, g, w); return;
    case PLAIT_GGML_Q6_K: grp_q6_k(row, g, w); return;
    case PLAIT_GGML_F16: grp_f16(row, g, w); return;
    default: grp_bf16(row, g, w); return;
  }
}

/* The unscaled quants of a 32-weight block type (Q4_0, Q4_1, Q5_0, Q8_0) as floats into
 * q[32 / LANES] (offsets -8 / -16 applied), its scale d returned and its min into *m (0 but
 * for Q4_1): weight = q d + m. A single x row's dot product then takes one FMA by d per block
 * instead of a multiply per weight. */
ALWAYS_INLINE float quants_32(int type, const uint8_t *row, long g, vf *q, float *m) {
  const uint8_t *b;
  *m = 0.0f;
  switch (type) {
    case PLAIT_GGML_Q4_0:
      b = row + g * 18;
      for (int j = 0; j < 32 / LANES; j++) q[j] = to_f(nibbles(b + 2, j * LANES) - 8);
      return load_f16(b);
    case PLAIT_GGML_Q4_1:
      b = row + g * 20;
      for (int j = 0; j < 32 / LANES; j++) q[j] = to_f(nibbles(b + 4, j * LANES));
      *m = load_f16(b + 2);
      return load_f16(b);
    case PLAIT_GGML_Q5_0: {
      b = row + g * 22;
      uint32_t qh;
      memcpy(&qh, b + 2, sizeof qh);
      vi high = (vi){0} + (int32_t)qh;
      for (int j = 0; j < 32 / LANES; j++) {
        vi hb = (high >> (iota() + j * LANES)) & 1;
        q[j] = to_f((nibbles(b + 6, j * LANES) | hb << 4) - 16);
      }
      return load_f16(b);
    }
    default: /* Q8_0 */
      b = row + g * 34;
      for (int j = 0; j < 32 / LANES; j++) q[j] = to_f(load_i8(b + 2 + j * LANES));
      return load_f16(b);
  }
}

/* ------------------------------------------------------------------------------------ */
/* Quants as bfloat16 (AVX512-BF16): exact products with float32 activations             */
/* ------------------------------------------------------------------------------------ */

/* Every quant integer below (Q4: 0..15, Q5: 0..31, offsets -8 / -16 / -32 applied, Q6:
 * -32..31) has at most 6 significant bits, so it is exact in bfloat16, and so is its product
 * with a bfloat16 piece of x (8 + 6 bits) in float32: x . q over a group is then 3
 * vdpbf16ps against x's three pieces (qgemm.c, split_row), float32 sums of exact products.
 * A group's quants come out as 32 bfloat16 words, word j = weight j of the group, looked up
 * by vpermw / vpermt2w from the quant's bits (which read only an index's low 5 / 6 bits). */
#if LANES == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QUANT_BF16 1

/* bfloat16 bits of -32 .. 31; +16: Q5_0's -16 .. 15, +32: Q5_K's 0 .. 31. */
static const uint16_t BF16_I6[64] __attribute__((aligned(64))) = {
    0xc200, 0xc1f8, 0xc1f0, 0xc1e8, 0xc1e0, 0xc1d8, 0xc1d0, 0xc1c8, 0xc1c0, 0xc1b8, 0xc1b0,
    0xc1a8, 0xc1a0, 0xc198, 0xc190, 0xc188, 0xc180, 0xc170, 0xc160, 0xc150, 0xc140, 0xc130,
    0xc120, 0xc110, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000,
    0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130,
    0x4140, 0x4150, 0x4160, 0x4170, 0x4180, 0x4188, 0x4190, 0x4198, 0x41a0, 0x41a8, 0x41b0,
    0x41b8, 0x41c0, 0x41c8, 0x41d0, 0x41d8, 0x41e0, 0x41e8, 0x41f0, 0x41f8};
/* 0 .. 15 and -8 .. 7, twice: a nibble's index needs no mask (bit 4 picks the copy). */
static const uint16_t BF16_U4[32] __attribute__((aligned(64))) = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
    0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
    0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
static const uint16_t BF16_I4[32] __attribute__((aligned(64))) = {
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000,
    0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040,
    0xc000, 0xbf80, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};

static inline __m512i load_table(const uint16_t *t) { return _mm512_loadu_si512(t); }

/* 16 bytes of packed nibbles as 32 words: low nibbles (in bits 0-3, junk above), then high. */
ALWAYS_INLINE __m512i nibble_words(const uint8_t *qs) {
  __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
  return _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
}

/* 32 bytes as words, shifted right by `shift` (the high nibbles: 4). */
ALWAYS_INLINE __m512i byte_words(const uint8_t *p, int shift) {
  __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
  return shift ? _mm512_srli_epi16(v, shift) : v;
}

/* bits 0-3 of lo, the other bits of hi (vpternlog's bitwise select). */
ALWAYS_INLINE __m512i low4_high(__m512i lo, __m512i hi) {
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi16(15), 0xe4);
}

/* hi's bits shifted left by n (right by -n). */
ALWAYS_INLINE __m512i shift_words(__m512i v, int n) {
  return n > 0 ? _mm512_slli_epi16(v, n) : n < 0 ? _mm512_srli_epi16(v, -n) : v;
}

/* fp16 bits to float32 bits with integer operations (normal numbers; others through
 * f16_to_f32): no vector register on the way to a broadcast load. */
static inline uint32_t f16_bits(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, sizeof h);
  uint32_t e = h & 0x7c00u, bits;
  if (__builtin_expect(e == 0 || e == 0x7c00u, 0)) {
    float f = f16_to_f32(h);
    memcpy(&bits, &f, sizeof bits);
    return bits;
  }
  return (uint32_t)(h & 0x8000u) << 16 | ((uint32_t)(h & 0x7fffu) + 0x1c000u) << 13;
}

/* The quants of group s of block `blk` (32-weight types: the block, s = 0; K types: the
 * super-block and its sub-block s, a constant once unrolled) as bfloat16 words, and the
 * scale and min with weight = q * scale + min. The scale of a 32-weight type as float32
 * bits into *sbits (the caller's FMA broadcasts it from memory), of a K type per float lane
 * of a vdpbf16ps sum into *scale (lane i holds weights 2i, 2i + 1; one value but for
 * Q6_K's two halves). */
ALWAYS_INLINE __m512i bf16_quants(int type, const uint8_t *row, long blk, int s, vf *scale,
                                  uint32_t *sbits, float *min) {
  const uint8_t *b;
  *min = 0.0f;
  switch (type) {
    case PLAIT_GGML_Q4_0:
      b = row + blk * 18;
      *sbits = f16_bits(b);
      return _mm512_permutexvar_epi16(nibble_words(b + 2), load_table(BF16_I4));
    case PLAIT_GGML_Q4_1:
      b = row + blk * 20;
      *sbits = f16_bits(b);
      *min = load_f16(b + 2);
      return _mm512_permutexvar_epi16(nibble_words(b + 4), load_table(BF16_U4));
    case PLAIT_GGML_Q5_0: {
      b = row + blk * 22;
      uint32_t qh;
      memcpy(&qh, b + 2, sizeof qh);
      *sbits = f16_bits(b);
      __m512i q = _mm512_and_si512(nibble_words(b + 6), _mm512_set1_epi16(15));
      q = _mm512_mask_add_epi16(q, (__mmask32)qh, q, _mm512_set1_epi16(16));
      return _mm512_permutexvar_epi16(q, load_table(BF16_I6 + 16));
    }
    case PLAIT_GGML_Q4_K: {
      b = row + blk * 144;
      float sc, mn;
      scale_min_k4(b + 4, s, &sc, &mn);
      *scale = vsplat(load_f16(b) * sc);
      *min = -(load_f16(b + 2) * mn);
      return _mm512_permutexvar_epi16(byte_words(b + 16 + 32 * (s / 2), s & 1 ? 4 : 0),
                                      load_table(BF16_U4));
    }
    case PLAIT_GGML_Q5_K: {
      b = row + blk * 176;
      float sc, mn;
      scale_min_k4(b + 4, s, &sc, &mn);
      *scale = vsplat(load_f16(b) * sc);
      *min = -(load_f16(b + 2) * mn);
      __m512i q = low4_high(byte_words(b + 48 + 32 * (s / 2), s & 1 ? 4 : 0),
                            shift_words(byte_words(b + 16, 0), 4 - s));
      return _mm512_permutexvar_epi16(q, load_table(BF16_I6 + 32));
    }
    default: { /* Q6_K: see grp_q6_k */
      b = row + blk * 210;
      int h = s / 4, c = s % 4;
      vf scales = to_f(load_i8(b + 192)) * load_f16(b + 208);
      *scale = (vf)_mm512_permutexvar_ps(_mm512_set_epi32(2 * s + 1, 2 * s + 1, 2 * s + 1,
          2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s, 2 * s, 2 * s, 2 * s,
          2 * s, 2 * s, 2 * s, 2 * s), (__m512)scales);
      __m512i q = low4_high(byte_words(b + 64 * h + 32 * (c % 2), c < 2 ? 0 : 4),
                            shift_words(byte_words(b + 128 + 32 * h, 0), 4 - 2 * c));
      return _mm512_permutex2var_epi16(load_table(BF16_I6), q, load_table(BF16_I6 + 32));
    }
  }
}
#endif /* QUANT_BF16 */

/* Calls MACRO(type) for every type read here (an X-macro: one instantiation per type). */
#define FOR_EACH_TYPE(MACRO)                                                             \
  MACRO(PLAIT_GGML_Q4_0) MACRO(PLAIT_GGML_Q4_1) MACRO(PLAIT_GGML_Q5_0) MACRO(PLAIT_GGML_Q8_0) \
  MACRO(PLAIT_GGML_Q4_K) MACRO(PLAIT_GGML_Q5_K) MACRO(PLAIT_GGML_Q6_K) MACRO(PLAIT_GGML_F16)  \
  MACRO(PLAIT_GGML_BF16)

#endif /* PLAIT_CPU_QUANT_H */
