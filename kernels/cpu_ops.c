/* Plait's native CPU kernels: float32, OpenMP across the torch thread pool's threads.
 *
 * Built at run time by plait/kernels/native.py with the machine's C compiler
 * (cc -O3 -march=native -fopenmp), linked against the libgomp torch itself loads, so
 * these parallel regions and torch's share one OpenMP runtime and thread count.
 *
 * Vectors are GCC vector extensions of LANES floats: the widest the target has
 * (16 with AVX-512, 8 with AVX/AVX2, 4 otherwise), so one source serves every CPU.
 *
 *   plait_gemm              y[M, N] = x[M, K] @ W^T (+ bias), W pre-packed in column
 *                           panels of LANES: the decode GEMM (few rows, weights streamed)
 *   plait_decode_attention  one query token per sequence over its paged K/V, read in
 *                           place from the cache (no gather), with the log-sum-exp
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
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

/* Cache lines to prefetch ahead while streaming a weight panel (measured on a 2-core
 * Xeon: without it the loads and the FMAs do not overlap and 16 rows run 30% slower). */
#ifndef PREFETCH_LINES
#define PREFETCH_LINES 64
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4)));

int plait_lanes(void) { return LANES; }

int plait_max_tile_rows(void) { return RMAX; }

/* ------------------------------------------------------------------------------------ */
/* GEMM                                                                                  */
/*                                                                                       */
/* W [N, K] is packed as panels [ceil(N / LANES), K, LANES]: panel p holds columns        */
/* p*LANES .. p*LANES+LANES-1 of y, k-major, so a panel streams contiguously and one      */
/* vector load serves a k step for every row of x. x is repacked per call into row tiles */
/* of at most RMAX rows, k-major (xt[k * R + r]), so the tile's broadcasts share one base */
/* pointer. A tile keeps R accumulator vectors in registers.                              */
/* ------------------------------------------------------------------------------------ */

#define DEFINE_TILE(R)                                                                    \
  static void tile_##R(const float *restrict xt, const float *restrict w, long K,         \
                       float *restrict y, long ldy, int ncols,                            \
                       const float *restrict bias) {                                      \
    vf acc[R];                                                                            \
    for (int r = 0; r < R; r++) acc[r] = (vf){0};                                         \
    _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {                                \
      __builtin_prefetch(w + (k + PREFETCH_LINES) * LANES, 0, PREFETCH_LOCALITY);                         \
      vf wv = *(const vf *)(w + k * LANES);                                               \
      _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] += xt[k * R + r] * wv;  \
    }                                                                                     \
    for (int r = 0; r < R; r++) {                                                         \
      float out[LANES];                                                                   \
      memcpy(out, &acc[r], sizeof out);                                                   \
      for (int c = 0; c < ncols; c++) y[r * ldy + c] = out[c] + (bias ? bias[c] : 0.0f);  \
    }                                                                                     \
  }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4)
DEFINE_TILE(5) DEFINE_TILE(6) DEFINE_TILE(7) DEFINE_TILE(8)
#if RMAX > 8
DEFINE_TILE(9) DEFINE_TILE(10) DEFINE_TILE(11) DEFINE_TILE(12)
#endif
#if RMAX > 12
DEFINE_TILE(13) DEFINE_TILE(14) DEFINE_TILE(15) DEFINE_TILE(16)
#endif

typedef void (*tile_fn)(const float *, const float *, long, float *, long, int, const float *);

static const tile_fn TILES[RMAX + 1] = {
    0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8,
#if RMAX > 8
    tile_9, tile_10, tile_11, tile_12,
#endif
#if RMAX > 12
    tile_13, tile_14, tile_15, tile_16,
#endif
};

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none).
 * w: W packed as described above. Returns 0, or -1 if a buffer could not be allocated. */
int plait_gemm(const float *x, long M, long ldx, const float *w, long N, long K,
               const float *bias, float *y, long ldy) {
  float *xt = malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
  if (!xt) return -1;
  for (long m = 0; m < M; m += RMAX) {
    long R = M - m < RMAX ? M - m : RMAX;
    for (long r = 0; r < R; r++)
      for (long k = 0; k < K; k++) xt[m * K + k * R + r] = x[(m + r) * ldx + k];
  }
  long panels = (N + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
  for (long p = 0; p < panels; p++) {
    long c0 = p * LANES;
    int ncols = (int)(N - c0 < LANES ? N - c0 : LANES);
    for (long m = 0; m < M; m += RMAX) {
      long R = M - m < RMAX ? M - m : RMAX;
      TILES[R](xt + m * K, w + p * K * LANES, K, y + m * ldy + c0, ldy, ncols,
               bias ? bias + c0 : NULL);
    }
  }
  free(xt);
  return 0;
}

/* ------------------------------------------------------------------------------------ */
/* Decode attention                                                                      */
/* ------------------------------------------------------------------------------------ */

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

#define MAX_GROUP 32     /* query heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256    /* tokens per cache block */
/* Each (sequence, head) task prefetches its rows of the block this many blocks ahead into
 * L2: the blocks are scattered over the pool, so the hardware prefetcher cannot follow
 * (16 sequences of ~560 tokens: 37.6 -> 27 ms per decode step over 30 layers; what is
 * left is the latency of reading 16-token blocks scattered over the pool, ~11 GB/s). */
#define PF_BLOCKS 2

/* For each sequence i (of S) and each of its query heads: attention of the query row
 * q[q_rows[i]] ([H, D], row stride q_stride floats) over the sequence's cached tokens
 * first_block[i] * block_size .. ctx_len[i] - 1, whose blocks are
 * block_tables[table_rows[i] * table_stride + t / block_size] (int32) in the caches
 * k_cache / v_cache [num_blocks, block_size, H_kv, D] (contiguous).
 * Writes out[i] ([H, D], dense) and, when lse is not NULL, lse[i * H + h] = the log of the
 * softmax's normaliser of the scaled scores (natural log). Head h reads KV head h / (H /
 * H_kv). D must be a multiple of LANES; every sequence must attend at least one token.
 * Returns 0, or -1 if the shapes exceed this kernel's limits. */
int plait_decode_attention(const float *q, long q_stride, const int64_t *q_rows,
                           const float *k_cache, const float *v_cache, long block_size,
                           long num_kv_heads, long num_heads, long head_dim,
                           const int32_t *block_tables, long table_stride,
                           const int64_t *table_rows, const int32_t *first_block,
                           const int32_t *ctx_len, long S, float scale, float *out,
                           float *lse) {
  const long G = num_heads / num_kv_heads, DV = head_dim / LANES;
  if (G < 1 || G > MAX_GROUP || head_dim % LANES || head_dim > MAX_HEAD_DIM ||
      block_size > MAX_BLOCK || num_heads % num_kv_heads)
    return -1;
  const long token_stride = num_kv_heads * head_dim;  /* floats between two tokens */
#pragma omp parallel for schedule(static)
  for (long task = 0; task < S * num_kv_heads; task++) {
    const long i = task / num_kv_heads, h = task % num_kv_heads;
    const float *qrow = q + q_rows[i] * q_stride + h * G * head_dim;
    const int32_t *table = block_tables + table_rows[i] * table_stride;
    vf qv[MAX_GROUP * MAX_HEAD_DIM / LANES], acc[MAX_GROUP * MAX_HEAD_DIM / LANES];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK + LANES] __attribute__((aligned(64)));
    for (long g = 0; g < G; g++) {
      m[g] = -INFINITY;
      l[g] = 0.0f;
      for (long d = 0; d < DV; d++) {
        qv[g * DV + d] = *(const vf *)(qrow + g * head_dim + d * LANES) * scale;
        acc[g * DV + d] = (vf){0};
      }
    }
    const long end = ctx_len[i];
    for (long t0 = (long)first_block[i] * block_size; t0 < end; t0 += block_size) {
      const long n = end - t0 < block_size ? end - t0 : block_size;
      const long blk = table[t0 / block_size];
      const float *kb = k_cache + (blk * block_size * num_kv_heads + h) * head_dim;
      const float *vb = v_cache + (blk * block_size * num_kv_heads + h) * head_dim;
      if (t0 + PF_BLOCKS * block_size < end) {  /* a later block's rows of this head, into L2 */
        const long next = table[t0 / block_size + PF_BLOCKS];
        const float *kn = k_cache + (next * block_size * num_kv_heads + h) * head_dim;
        const float *vn = v_cache + (next * block_size * num_kv_heads + h) * head_dim;
        for (long j = 0; j < block_size; j++)
          for (long d = 0; d < head_dim; d += 64 / (long)sizeof(float)) {
            __builtin_prefetch(kn + j * token_stride + d, 0, 2);
            __builtin_prefetch(vn + j * token_stride + d, 0, 2);
          }
      }
      for (long j = 0; j < n; j++) {  /* scores of the block's tokens */
        const float *kt = kb + j * token_stride;
        for (long g = 0; g < G; g++) {
          vf dot = (vf){0};
          for (long d = 0; d < DV; d++) dot += qv[g * DV + d] * *(const vf *)(kt + d * LANES);
          s[g][j] = hsum(dot);
        }
      }
      const long padded = (n + LANES - 1) / LANES * LANES;
      for (long g = 0; g < G; g++) {  /* online softmax update */
        float mb = m[g];
        for (long j = 0; j < n; j++) mb = s[g][j] > mb ? s[g][j] : mb;
        for (long j = n; j < padded; j++) s[g][j] = -INFINITY;
        const vf mv = (vf){0} + mb;
        float sum = 0.0f;
        for (long j = 0; j < padded; j += LANES) {
          vf e = vexp(*(vf *)&s[g][j] - mv);
          *(vf *)&s[g][j] = e;
        }
        for (long j = 0; j < n; j++) sum += s[g][j];
        const float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mb);
        l[g] = l[g] * alpha + sum;
        m[g] = mb;
        for (long d = 0; d < DV; d++) acc[g * DV + d] *= alpha;
      }
      for (long j = 0; j < n; j++) {  /* acc += p V */
        const float *vt = vb + j * token_stride;
        for (long d = 0; d < DV; d++) {
          const vf vv = *(const vf *)(vt + d * LANES);
          for (long g = 0; g < G; g++) acc[g * DV + d] += s[g][j] * vv;
        }
      }
    }
    for (long g = 0; g < G; g++) {
      const long head = h * G + g;
      const float inv = 1.0f / l[g];
      float *o = out + (i * num_heads + head) * head_dim;
      for (long d = 0; d < DV; d++) *(vf *)(o + d * LANES) = acc[g * DV + d] * inv;
      if (lse) lse[i * num_heads + head] = m[g] + logf(l[g]);
    }
  }
  return 0;
}
