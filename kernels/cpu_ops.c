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
 *                           place from the cache (no gather); rows sharing a prompt's
 *                           blocks read them once (cascade attention, no merge)
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
#define PREFETCH_LINES 64
#define PREFETCH_LOCALITY 2

typedef float vf __attribute__((vector_size(LANES * 4), aligned(4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4), aligned(4)));

int plait_lanes(void) { return LANES; }

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

#define MAX_QUERIES 32  /* query vectors one task holds: rows of a chunk x heads per KV head */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256   /* tokens per cache block */
/* Each task prefetches its rows of the block this many blocks ahead into L2: the blocks
 * are scattered over the pool, so the hardware prefetcher cannot follow (16 sequences of
 * ~560 tokens: 37.6 -> 27 ms per decode step over 30 layers; what is left is the latency
 * of reading 16-token blocks scattered over the pool, ~11 GB/s). */
#define PF_BLOCKS 2

/* The running softmax of one task: `nq` query vectors (pre-scaled), their running max,
 * normaliser and weighted sum of values. */
typedef struct {
  long nq, dv;
  float *q;    /* [nq, D] */
  float *m;    /* [nq] */
  float *l;    /* [nq] */
  vf *acc;     /* [nq, dv] */
} state_t;

/* Rescales query a's state to a new maximum `mb` (>= its current one). */
static inline void rescale(state_t *st, long a, float mb) {
  if (mb == st->m[a]) return;
  const float alpha = st->m[a] == -INFINITY ? 0.0f : expf(st->m[a] - mb);
  st->l[a] *= alpha;
  st->m[a] = mb;
  for (long d = 0; d < st->dv; d++) st->acc[a * st->dv + d] *= alpha;
}

/* Where token t's rows of KV head h are in the caches (*kb, *vb; the next tokens of its
 * block follow at a stride of H_kv * D floats). At a block's first token it also prefetches
 * this head's rows of the block PF_BLOCKS ahead, when [t, t_to) reaches that far. */
static inline void locate(const int32_t *table, long t, long t_to, const float *k_cache,
                          const float *v_cache, long block_size, long num_kv_heads, long h,
                          long head_dim, const float **kb, const float **vb) {
  const long blk = table[t / block_size], off = t % block_size;
  *kb = k_cache + ((blk * block_size + off) * num_kv_heads + h) * head_dim;
  *vb = v_cache + ((blk * block_size + off) * num_kv_heads + h) * head_dim;
  if (off == 0 && t + PF_BLOCKS * block_size < t_to) {
    const long ahead = table[t / block_size + PF_BLOCKS], stride = num_kv_heads * head_dim;
    const float *k = k_cache + (ahead * block_size * num_kv_heads + h) * head_dim;
    const float *v = v_cache + (ahead * block_size * num_kv_heads + h) * head_dim;
    for (long j = 0; j < block_size; j++)
      for (long d = 0; d < head_dim; d += 64 / (long)sizeof(float)) {
        __builtin_prefetch(k + j * stride + d, 0, 2);
        __builtin_prefetch(v + j * stride + d, 0, 2);
      }
  }
}

/* Every query of `st` attends tokens [t_from, t_to) of KV head h through `table`, with the
 * queries across the vector lanes: the queries are transposed once ([D][QMAX * LANES],
 * zero past nq), a token's scores for all of them are qv vectors (D FMAs each, the key's
 * elements broadcast), and the online softmax runs on whole vectors, once per LANES
 * tokens (at most one block). The
 * keys are read once for all the queries (the rows of a chunk sharing a prefix, times the
 * heads of a KV group). */
static void attend_shared(state_t *st, const int32_t *table, long t_from, long t_to,
                          const float *k_cache, const float *v_cache, long block_size,
                          long num_kv_heads, long h, long head_dim) {
  /* QMAX query vectors; TB tokens' partial scores: TB * QMAX accumulators in registers */
  enum { QMAX = MAX_QUERIES / LANES, TB = LANES == 16 ? 8 : 2 };
  const long stride = num_kv_heads * head_dim, dv = st->dv, nq = st->nq;
  const long qv = (nq + LANES - 1) / LANES;
  float qt[MAX_HEAD_DIM * QMAX * LANES] __attribute__((aligned(64)));
  /* +4: the value pass reads 4 queries at a time, past nq in its last group */
  float prob[LANES][QMAX * LANES + 4] __attribute__((aligned(64)));
  float scale_by[QMAX * LANES] __attribute__((aligned(64)));
  vf m[QMAX], l[QMAX];
  for (long d = 0; d < head_dim; d++)
    for (long a = 0; a < QMAX * LANES; a++)
      qt[d * QMAX * LANES + a] = a < nq ? st->q[a * head_dim + d] : 0.0f;
  for (long v = 0; v < qv; v++)
    for (int lane = 0; lane < LANES; lane++) {
      const long a = v * LANES + lane;
      m[v][lane] = a < nq ? st->m[a] : 0.0f;
      l[v][lane] = a < nq ? st->l[a] : 0.0f;
    }
  for (long t = t_from; t < t_to;) {
    const long off = t % block_size;
    const long block_end = t - off + block_size < t_to ? t - off + block_size : t_to;
    const long n = block_end - t < LANES ? block_end - t : LANES;
    const float *kb, *vb;
    locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h, head_dim, &kb, &vb);
    vf sc[LANES][QMAX];
    for (long j0 = 0; j0 < n; j0 += TB) {  /* scores: TB tokens x QMAX vectors in registers */
      const float *kr[TB];
      vf part[TB][QMAX];
      for (int j = 0; j < TB; j++) {  /* past n: the last token again, ignored */
        kr[j] = kb + (j0 + j < n ? j0 + j : n - 1) * stride;
        for (int v = 0; v < QMAX; v++) part[j][v] = (vf){0};
      }
      for (long d = 0; d < head_dim; d++) {
        vf qd[QMAX];
        for (int v = 0; v < QMAX; v++) qd[v] = *(const vf *)(qt + d * QMAX * LANES + v * LANES);
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {
          const float kd = kr[j][d];
          _Pragma("GCC unroll 4") for (int v = 0; v < QMAX; v++) part[j][v] += kd * qd[v];
        }
      }
      for (long j = 0; j < TB && j0 + j < n; j++)
        for (int v = 0; v < QMAX; v++) sc[j0 + j][v] = part[j][v];
    }
    for (long v = 0; v < qv; v++) {  /* online softmax, all queries at once */
      vf mx = m[v];
      for (long j = 0; j < n; j++) mx = vselect(sc[j][v] > mx, sc[j][v], mx);
      const vf alpha = vexp(m[v] - mx);
      vf sum = (vf){0};
      for (long j = 0; j < n; j++) {
        const vf p = vexp(sc[j][v] - mx);
        *(vf *)&prob[j][v * LANES] = p;
        sum += p;
      }
      l[v] = l[v] * alpha + sum;
      m[v] = mx;
      *(vf *)&scale_by[v * LANES] = alpha;
    }
    for (long d = 0; d < dv; d++) {  /* acc = acc * alpha + sum_j p_j V_j, 4 queries a pass */
      for (long a0 = 0; a0 < nq; a0 += 4) {
        vf r[4];
        const int na = nq - a0 < 4 ? (int)(nq - a0) : 4;
        for (int u = 0; u < 4; u++)
          r[u] = u < na ? st->acc[(a0 + u) * dv + d] * scale_by[a0 + u] : (vf){0};
        for (long j = 0; j < n; j++) {
          const vf vv = *(const vf *)(vb + j * stride + d * LANES);
          _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) r[u] += prob[j][a0 + u] * vv;
        }
        for (int u = 0; u < na; u++) st->acc[(a0 + u) * dv + d] = r[u];
      }
    }
    t += n;
  }
  for (long a = 0; a < nq; a++) {
    st->m[a] = m[a / LANES][a % LANES];
    st->l[a] = l[a / LANES][a % LANES];
  }
}

/* Queries [a0, a0 + G) of `st` (one row's heads of KV head h) attend tokens [t_from, t_to)
 * token by token: one dot product per token and query (for the few queries of one row
 * the transpose of `attend_shared` costs more than it saves). */
static void attend_own(state_t *st, long a0, long G, const int32_t *table, long t_from,
                       long t_to, const float *k_cache, const float *v_cache, long block_size,
                       long num_kv_heads, long h, long head_dim) {
  const long stride = num_kv_heads * head_dim, dv = st->dv;
  float s[MAX_QUERIES][MAX_BLOCK + LANES] __attribute__((aligned(64)));
  for (long t = t_from; t < t_to;) {
    const long off = t % block_size;
    const long n = t - off + block_size < t_to ? block_size - off : t_to - t;
    const float *kb, *vb;
    locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h, head_dim, &kb, &vb);
    for (long j = 0; j < n; j++) {  /* scores */
      const float *kj = kb + j * stride;
      for (long g = 0; g < G; g++) {
        const float *qa = st->q + (a0 + g) * head_dim;
        vf dot = (vf){0};
        for (long d = 0; d < dv; d++)
          dot += *(const vf *)(qa + d * LANES) * *(const vf *)(kj + d * LANES);
        s[g][j] = hsum(dot);
      }
    }
    const long padded = (n + LANES - 1) / LANES * LANES;
    for (long g = 0; g < G; g++) {  /* online softmax update */
      float mb = st->m[a0 + g];
      for (long j = 0; j < n; j++) mb = s[g][j] > mb ? s[g][j] : mb;
      rescale(st, a0 + g, mb);
      for (long j = n; j < padded; j++) s[g][j] = -INFINITY;
      const vf mv = (vf){0} + mb;
      for (long j = 0; j < padded; j += LANES) *(vf *)&s[g][j] = vexp(*(vf *)&s[g][j] - mv);
      float sum = 0.0f;
      for (long j = 0; j < n; j++) sum += s[g][j];
      st->l[a0 + g] += sum;
    }
    for (long j = 0; j < n; j++) {  /* acc += p V */
      const float *vj = vb + j * stride;
      for (long d = 0; d < dv; d++) {
        const vf vv = *(const vf *)(vj + d * LANES);
        for (long g = 0; g < G; g++) st->acc[(a0 + g) * dv + d] += s[g][j] * vv;
      }
    }
    t += n;
  }
}

/* Decode attention: one query token per sequence over its paged K/V, read in place.
 *
 * Sequences come in chunks: chunk c is sequences chunk_start[c] .. chunk_start[c+1] - 1,
 * whose first chunk_shared[c] tokens are the same cache blocks (those of the chunk's first
 * sequence's table; 0 for a chunk of one). Sequence i's query row is q[q_rows[i]] ([H, D],
 * row stride q_stride floats); it attends its tokens 0 .. ctx_len[i] - 1, whose blocks are
 * block_tables[table_rows[i] * table_stride + t / block_size] (int32), in the caches
 * k_cache / v_cache [num_blocks, block_size, H_kv, D] (contiguous); query head h reads KV
 * head h / (H / H_kv). A task is one chunk and one KV head: it reads the shared tokens once
 * for all the chunk's queries (cascade attention without a merge: one online softmax
 * continues over each row's own tokens). Writes out[i] ([H, D], dense, i in chunk order).
 * D must be a multiple of LANES and every sequence must attend at least one token.
 * Returns 0, or -1 if the shapes exceed this kernel's limits. */
int plait_decode_attention(const float *q, long q_stride, const float *k_cache,
                           const float *v_cache, long block_size, long num_kv_heads,
                           long num_heads, long head_dim, const int32_t *block_tables,
                           long table_stride, long num_chunks, const int64_t *chunk_start,
                           const int32_t *chunk_shared, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *ctx_len, float scale,
                           float *out) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % LANES ||
      head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK)
    return -1;
  const long G = num_heads / num_kv_heads;
  for (long c = 0; c < num_chunks; c++)
    if ((chunk_start[c + 1] - chunk_start[c]) * G > MAX_QUERIES) return -1;
#pragma omp parallel for schedule(dynamic, 1)
  for (long task = 0; task < num_chunks * num_kv_heads; task++) {
    const long c = task / num_kv_heads, h = task % num_kv_heads;
    const long first = chunk_start[c], rows = chunk_start[c + 1] - first;
    float qs[MAX_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(64)));
    float m[MAX_QUERIES], l[MAX_QUERIES];
    vf acc[MAX_QUERIES * MAX_HEAD_DIM / LANES];
    state_t st = {rows * G, head_dim / LANES, qs, m, l, acc};
    for (long r = 0; r < rows; r++)
      for (long g = 0; g < G; g++) {
        const long a = r * G + g;
        const float *src = q + q_rows[first + r] * q_stride + (h * G + g) * head_dim;
        for (long d = 0; d < head_dim; d++) qs[a * head_dim + d] = src[d] * scale;
        m[a] = -INFINITY;
        l[a] = 0.0f;
        for (long d = 0; d < st.dv; d++) acc[a * st.dv + d] = (vf){0};
      }
    const long shared = chunk_shared[c];
    if (shared > 0)
      attend_shared(&st, block_tables + table_rows[first] * table_stride, 0, shared,
                    k_cache, v_cache, block_size, num_kv_heads, h, head_dim);
    for (long r = 0; r < rows; r++)
      attend_own(&st, r * G, G, block_tables + table_rows[first + r] * table_stride, shared,
                 ctx_len[first + r], k_cache, v_cache, block_size, num_kv_heads, h,
                 head_dim);
    for (long a = 0; a < rows * G; a++) {
      const long r = a / G, g = a % G;
      const float inv = 1.0f / l[a];
      float *o = out + ((first + r) * num_heads + h * G + g) * head_dim;
      for (long d = 0; d < st.dv; d++) *(vf *)(o + d * LANES) = acc[a * st.dv + d] * inv;
    }
  }
  return 0;
}
