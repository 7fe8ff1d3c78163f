/* Plait's native CPU kernels: the vector helpers every source shares. float32, OpenMP
 * across the torch thread pool's threads. What the library exports (and the constants Python
 * shares) is declared once, in plait_cpu.h, which every source includes beside this file.
 *
 * Built at run time by build.py with the machine's C compiler (cc -O3 -march=native
 * -fopenmp -Wall -Werror), the five sources into one library, linked against the libgomp
 * torch itself loads, so these parallel regions and torch's share one OpenMP runtime and
 * thread count:
 *
 *   gemm.c       plait_gemm: y[M, N] = x[M, K] @ W^T (+ bias), W pre-packed in column
 *                panels of LANES: the decode GEMM (few rows, weights streamed)
 *   attention.c  plait_decode_attention: one query token per sequence over its paged K/V
 *                (float32 or bfloat16, widened as read; attention_bf16.h: bf16 dot
 *                products), read in place from the cache (no
 *                gather); rows sharing a prompt's blocks read them once (cascade
 *                attention, no merge); the engine also feeds it prefill chunks as tiles
 *                of positions
 *   rowwise.c    plait_rope_write_kv, plait_add_rms_norm, plait_silu_mul,
 *                plait_sample_inverse_cdf: a layer's small per-row operations and the
 *                sampler, one pass each
 *   qgemm.c      plait_qgemm, plait_dequantize(_bf16): weights kept in a GGUF file's GGML
 *                blocks (quant.h decodes a 32-weight group into vectors), dequantized in
 *                registers against float32 activations; float32 panels go to plait_gemm
 *   repack.c     plait_repack*: weights repacked at their own bit width, products with x
 *                quantized to int8 (VNNI; the int8 numerics)
 *   decoder.c    plait_decoder_stack: every layer of a Llama decoder over a step's few rows
 *                through the kernels above, in one call
 *
 * Vectors are GCC vector extensions of LANES floats: the widest the target has
 * (16 with AVX-512, 8 with AVX/AVX2, 4 otherwise), so one source serves every CPU.
 */
#ifndef PLAIT_CPU_VEC_H
#define PLAIT_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define RMAX 16
#elif defined(__AVX__)
#define LANES 8
#define RMAX 12
#else
#define LANES 4
#define RMAX 8
#endif

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4)));

static inline vf vselect(vi mask, vf a, vf b) {  /* mask ? a : b, lane by lane */
  return (vf)(((vi)a & mask) | ((vi)b & ~mask));
}

/* x in every lane: x - 0 is x for every x (-0 too), so this folds to a broadcast, where
 * (vf){0} + x costs an add. */
static inline vf vsplat(float x) { return x - (vf){0}; }

/* a > b ? a : b, lane by lane (b where either is NaN): one instruction on x86. */
static inline vf vmax(vf a, vf b) {
#if LANES == 16
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif LANES == 8
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return vselect(a > b, a, b);
#endif
}

/* e^x for x in [-87, 88] to within a few ulp (Cody-Waite reduction x = n ln2 + r, |r| <=
 * ln2 / 2, a degree-6 polynomial for e^r, 2^n put into the exponent bits); smaller x
 * returns e^-87 (~1.6e-38), which the callers only ever add to sums of order >= 1.
 * vexp, hsum and hmax are always inlined: where a source's size made the compiler call
 * them instead, its float contractions around them changed, and with them the last bit
 * of results (attention.c's, when it grew its variants). */
static inline __attribute__((always_inline)) vf vexp(vf x) {
  const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
  x = vselect(x < lo, lo, x);
  x = vselect(x > hi, hi, x);
  vf t = x * 1.44269504088896341f;
  vi sign = (vi)t & (int32_t)0x80000000;
  vf half = (vf)(sign | (vi)((vf){0} + 0.5f));
  vi n = __builtin_convertvector(t + half, vi);  /* round to nearest */
  vf nf = __builtin_convertvector(n, vf);
  vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vf p = (vf){0} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf e = p * r * r + r + 1.0f;
  return e * (vf)((n + 127) << 23);
}

/* silu(g) * u lane by lane, g / (1 + e^-g) * u: plait_silu_mul's arithmetic, which the
 * fused gate | up product (repack_amx_bf16.h) must repeat bit for bit. */
static inline __attribute__((always_inline)) vf vsilu_mul(vf g, vf u) {
  return g / (1.0f + vexp(-g)) * u;
}

/* The sum of a vector's lanes, as a tree (a serial sum would chain LANES dependent adds). */
static inline __attribute__((always_inline)) float hsum(vf v) {
#if LANES == 16
  return _mm512_reduce_add_ps((__m512)v);
#elif LANES == 8
  __m128 h = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
  float t[LANES];
  memcpy(t, &v, sizeof t);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int i = 0; i < w; i++) t[i] += t[i + w];
  return t[0];
#endif
}

/* The largest of a vector's lanes, as a tree. */
static inline __attribute__((always_inline)) float hmax(vf v) {
#if LANES == 16
  return _mm512_reduce_max_ps((__m512)v);
#else
  float t[LANES];
  memcpy(t, &v, sizeof t);
  for (int w = LANES / 2; w > 0; w /= 2)
    for (int i = 0; i < w; i++) t[i] = t[i + w] > t[i] ? t[i + w] : t[i];
  return t[0];
#endif
}

typedef uint16_t u16v __attribute__((vector_size(2 * LANES), aligned(2)));

/* LANES little-endian 16-bit integers at p (any alignment), zero-extended to 32 bits. */
static inline vi load_u16(const uint8_t *p) {
#if LANES == 16
  return (vi)_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
#elif LANES == 8
  return (vi)_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
#else
  return __builtin_convertvector(*(const u16v *)p, vi);
#endif
}

/* The LANES bfloat16 values at p (the high 16 bits of a float32 each) as float32, exactly:
 * zero-extended to 32 bits and shifted left 16. */
static inline vf widen_bf16(const uint16_t *p) {
  return (vf)(load_u16((const uint8_t *)p) << 16);
}

/* x as bfloat16 bits, rounded to nearest even (torch's .to(torch.bfloat16)); a NaN stays a
 * quiet NaN. */
static inline uint16_t f32_to_bf16(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return (b & 0x7fffffff) > 0x7f800000 ? (uint16_t)(b >> 16 | 0x40)
                                        : (uint16_t)((b + 0x7fff + (b >> 16 & 1)) >> 16);
}

/* bfloat16 bits as float32, exactly (the scalar widen_bf16). */
static inline float bf16_to_f32(uint16_t h) {
  const uint32_t b = (uint32_t)h << 16;
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

typedef uint32_t vu __attribute__((vector_size(LANES * 4), aligned(4)));

/* The bits of each (non-NaN) lane of x rounded to the nearest bfloat16, ties to even, in
 * their high 16 bits (the low 16 are not cleared): f32_to_bf16's rounding, lane by lane. */
static inline vu round_bf16_high(vf x) {
  const vu b = (vu)x;
  return b + 0x7fff + (b >> 16 & 1);
}

/* The LANES floats of x stored at p (any alignment) as bfloat16 bits, each rounded to
 * nearest even as f32_to_bf16 rounds it (a NaN stays a quiet NaN). */
static inline void store_bf16(uint16_t *p, vf x) {
  const vu b = (vu)x;
  const vu is_nan = (vu)((b & 0x7fffffff) > 0x7f800000);  /* all ones where NaN */
  const vu out = ((b >> 16 | 0x40) & is_nan) | (round_bf16_high(x) >> 16 & ~is_nan);
  *(u16v *)p = __builtin_convertvector(out, u16v);
}

#endif /* PLAIT_CPU_VEC_H */
