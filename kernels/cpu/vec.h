/* Plait's native CPU kernels: what every source shares. float32, OpenMP across the torch
 * thread pool's threads.
 *
 * Built at run time by plait/kernels/native.py with the machine's C compiler
 * (cc -O3 -march=native -fopenmp), the four sources into one library, linked against the
 * libgomp torch itself loads, so these parallel regions and torch's share one OpenMP
 * runtime and thread count:
 *
 *   cpu_gemm.c       plait_gemm: y[M, N] = x[M, K] @ W^T (+ bias), W pre-packed in column
 *                    panels of LANES: the decode GEMM (few rows, weights streamed)
 *   cpu_attention.c  plait_decode_attention: one query token per sequence over its paged
 *                    K/V, read in place from the cache (no gather); rows sharing a prompt's
 *                    blocks read them once (cascade attention, no merge); the engine also
 *                    feeds it prefill chunks as tiles of positions
 *   cpu_rowwise.c    plait_rope_write_kv, plait_add_rms_norm, plait_silu_mul,
 *                    plait_sample_inverse_cdf: a layer's small per-row operations and the
 *                    sampler, one pass each
 *   cpu_decoder.c    plait_decoder_stack: every layer of a Llama decoder over a step's few
 *                    rows through the kernels above, in one call
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

/* e^x for x in [-87, 88] to within a few ulp (Cody-Waite reduction x = n ln2 + r, |r| <=
 * ln2 / 2, a degree-6 polynomial for e^r, 2^n put into the exponent bits); smaller x
 * returns e^-87 (~1.6e-38), which the callers only ever add to sums of order >= 1. */
static inline vf vexp(vf x) {
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

/* The sum of a vector's lanes, as a tree (a serial sum would chain LANES dependent adds). */
static inline float hsum(vf v) {
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

/* The kernels each source exports (ctypes loads them; cpu_decoder.c calls the others). */
int plait_gemm(const float *x, long M, long ldx, const float *w, long N, long K,
               const float *bias, float *y, long ldy);
int plait_decode_attention(const float *q, long q_stride, const float *k_cache,
                           const float *v_cache, long block_size, long num_kv_heads,
                           long num_heads, long head_dim, const int32_t *block_tables,
                           long table_stride, long num_chunks, const int64_t *chunk_start,
                           const int32_t *chunk_shared, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *ctx_len, float scale,
                           float *out, const int64_t *out_rows);
int plait_rope_write_kv(float *q, long q_stride, const float *k, long k_stride, const float *v,
                        long v_stride, long num_tokens, long num_heads, long num_kv_heads,
                        long head_dim, const float *cos_sin, const int64_t *positions,
                        float *k_cache, float *v_cache, const int64_t *slots);
int plait_add_rms_norm(const float *x, long x_stride, const float *add, long add_stride,
                       const float *w, long num_tokens, long dim, float eps, float *sum_out,
                       float *out);
int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, long inter,
                   float *out);

#endif /* PLAIT_CPU_VEC_H */
