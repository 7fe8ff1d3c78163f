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
 *                           blocks read them once (cascade attention, no merge); the
 *                           engine also feeds it prefill chunks as tiles of positions
 *   plait_rope_write_kv     RoPE of q and k and the KV-cache write, in one pass
 *   plait_sample_inverse_cdf  one token per row of logits by inverse-CDF sampling
 */
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

#define MAX_QUERIES 48  /* query vectors one task holds: rows of a chunk x heads per KV head */
/* Split a chunk into pieces when chunks x KV heads < PIECE_TASKS tasks per thread; a piece
 * has at least PIECE_BLOCKS blocks; at most MAX_PIECES_MERGED pieces per chunk. */
#define PIECE_TASKS 3
#define PIECE_BLOCKS 4
#define MAX_PIECES_MERGED 64
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

/* Where token t's rows of KV head h are in the caches (k, v; the next tokens of its block
 * follow at a stride of H_kv * D floats), and where the same rows of the block PF_BLOCKS
 * ahead are (kp, vp; NULL when [t, t_to) does not reach that far): the loops prefetch
 * those a token at a time, as they go (one burst per block overflowed the miss queues). */
typedef struct {
  const float *k, *v, *kp, *vp;
} span_t;

static inline span_t locate(const int32_t *table, long t, long t_to, const float *k_cache,
                            const float *v_cache, long block_size, long num_kv_heads, long h,
                            long head_dim) {
  const long blk = table[t / block_size], off = t % block_size;
  const long at = ((blk * block_size + off) * num_kv_heads + h) * head_dim;
  span_t sp = {k_cache + at, v_cache + at, NULL, NULL};
  if (t - off + PF_BLOCKS * block_size < t_to) {
    const long ahead = table[t / block_size + PF_BLOCKS];
    const long pat = ((ahead * block_size + off) * num_kv_heads + h) * head_dim;
    sp.kp = k_cache + pat;
    sp.vp = v_cache + pat;
  }
  return sp;
}

/* Prefetches token j's K and V rows (head_dim floats each) of the block ahead into L2. */
static inline void prefetch_rows(const span_t *sp, long j, long stride, long head_dim) {
  if (!sp->kp) return;
  for (long d = 0; d < head_dim; d += 64 / (long)sizeof(float)) {
    __builtin_prefetch(sp->kp + j * stride + d, 0, 2);
    __builtin_prefetch(sp->vp + j * stride + d, 0, 2);
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
  enum { QMAX = MAX_QUERIES / LANES, TB = LANES == 16 ? 8 : 1 };
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
    const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                             head_dim);
    const float *kb = sp.k, *vb = sp.v;
    vf sc[LANES][QMAX];
    for (long j0 = 0; j0 < n; j0 += TB) {  /* scores: TB tokens x QMAX vectors in registers */
      const float *kr[TB];
      vf part[TB][QMAX];
      for (int j = 0; j < TB; j++) {  /* past n: the last token again, ignored */
        kr[j] = kb + (j0 + j < n ? j0 + j : n - 1) * stride;
        for (int v = 0; v < QMAX; v++) part[j][v] = (vf){0};
        if (j0 + j < n) prefetch_rows(&sp, j0 + j, stride, head_dim);
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

/* Queries [a0, a0 + G) of `st` attend the n tokens of one block whose rows of their KV
 * head start at kb / vb (a stride of `stride` floats from token to token), token by token:
 * one dot product per token and query (for the few queries of one row the transpose of
 * `attend_shared` costs more than it saves). */
static inline __attribute__((always_inline)) void own_block_fixed(
    state_t *st, long a0, const int G, const int DV, const span_t *sp, long n, long stride) {
  /* own_block for G queries of DV vectors known at compile time: the queries and the
   * weighted sums stay in registers for the whole block */
  const long head_dim = DV * LANES;
  float s[G][MAX_BLOCK + LANES] __attribute__((aligned(64)));
  vf qr[G][DV];
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) qr[g][d] = *(const vf *)(st->q + (a0 + g) * head_dim + d * LANES);
  for (long j = 0; j < n; j++) {  /* scores */
    const float *kj = sp->k + j * stride;
    prefetch_rows(sp, j, stride, head_dim);
    vf kv[DV];
    for (int d = 0; d < DV; d++) kv[d] = *(const vf *)(kj + d * LANES);
    for (int g = 0; g < G; g++) {
      vf dot = qr[g][0] * kv[0];
      for (int d = 1; d < DV; d++) dot += qr[g][d] * kv[d];
      s[g][j] = hsum(dot);
    }
  }
  const long padded = (n + LANES - 1) / LANES * LANES;
  float alpha[G];
  for (int g = 0; g < G; g++) {  /* online softmax update */
    const long a = a0 + g;
    float mb = st->m[a];
    for (long j = 0; j < n; j++) mb = s[g][j] > mb ? s[g][j] : mb;
    alpha[g] = st->m[a] == -INFINITY ? 0.0f : expf(st->m[a] - mb);
    st->m[a] = mb;
    for (long j = n; j < padded; j++) s[g][j] = -INFINITY;
    const vf mv = (vf){0} + mb;
    vf sum = (vf){0};
    for (long j = 0; j < padded; j += LANES) {
      const vf e = vexp(*(vf *)&s[g][j] - mv);
      *(vf *)&s[g][j] = e;
      sum += e;
    }
    st->l[a] = st->l[a] * alpha[g] + hsum(sum);
  }
  vf r[G][DV];  /* acc = acc * alpha + sum_j p_j V_j */
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) r[g][d] = st->acc[(a0 + g) * DV + d] * alpha[g];
  for (long j = 0; j < n; j++) {
    const float *vj = sp->v + j * stride;
    for (int d = 0; d < DV; d++) {
      const vf vv = *(const vf *)(vj + d * LANES);
      for (int g = 0; g < G; g++) r[g][d] += s[g][j] * vv;
    }
  }
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) st->acc[(a0 + g) * DV + d] = r[g][d];
}

static void own_block(state_t *st, long a0, long G, const span_t *sp, long n, long stride,
                      long head_dim) {
  const long dv = st->dv;
#define OWN_FIXED(g, d)                                    \
  if (G == g && dv == d) {                                 \
    own_block_fixed(st, a0, g, d, sp, n, stride);          \
    return;                                                \
  }
  OWN_FIXED(1, 4) OWN_FIXED(2, 4) OWN_FIXED(3, 4) OWN_FIXED(4, 4) OWN_FIXED(1, 8) OWN_FIXED(2, 8)
#undef OWN_FIXED
  const float *kb = sp->k, *vb = sp->v;
  float s[MAX_QUERIES][MAX_BLOCK + LANES] __attribute__((aligned(64)));
  for (long j = 0; j < n; j++) {  /* scores */
    const float *kj = kb + j * stride;
    prefetch_rows(sp, j, stride, head_dim);
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
}

/* One row's queries attend tokens [t_from, t_to), block by block: those of KV heads
 * [h, h + nh) are `st`'s queries a0 + (hh - h) * G + g. With every KV head (a row alone),
 * each block's K and V rows are read whole, in order. */
static void attend_own(state_t *st, long a0, long G, const int32_t *table, long t_from,
                       long t_to, const float *k_cache, const float *v_cache, long block_size,
                       long num_kv_heads, long h, long nh, long head_dim) {
  for (long t = t_from; t < t_to;) {
    const long off = t % block_size;
    const long n = t - off + block_size < t_to ? block_size - off : t_to - t;
    for (long hh = h; hh < h + nh; hh++) {
      const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, hh,
                               head_dim);
      own_block(st, a0 + (hh - h) * G, G, &sp, n, num_kv_heads * head_dim, head_dim);
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
 * head h / (H / H_kv). A task is one piece of one chunk and one KV head: it reads the
 * shared tokens once for all the chunk's queries (cascade attention: one online softmax
 * continues over each row's own tokens). When chunks x KV heads are too few to keep every
 * thread busy (one long prompt's n choices, or a single stream), a chunk's main range (its
 * shared tokens, or a lone row's context) is split into pieces of whole blocks attended in
 * parallel, whose partial softmaxes are then merged (flash-decoding); the rows' own tokens
 * go with the last piece. Writes out[i] ([H, D], dense, i in chunk order).
 * D must be a multiple of LANES and every sequence must attend at least one token.
 * Returns 0, -1 if the shapes exceed this kernel's limits, -2 if out of memory. */
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
  /* pieces: chunk c's are first_piece[c] .. first_piece[c + 1] - 1 */
  long *first_piece = malloc((num_chunks + 1) * sizeof(long));
  if (!first_piece) return -2;
  const long want = PIECE_TASKS * omp_get_max_threads();
  long split = (want + num_chunks * num_kv_heads - 1) / (num_chunks * num_kv_heads);
  split = split > MAX_PIECES_MERGED ? MAX_PIECES_MERGED : split;
  first_piece[0] = 0;
  for (long c = 0; c < num_chunks; c++) {
    const long first = chunk_start[c], rows = chunk_start[c + 1] - first;
    const long main = chunk_shared[c] > 0 ? chunk_shared[c] : rows == 1 ? ctx_len[first] : 0;
    long pieces = main / (PIECE_BLOCKS * block_size);
    pieces = pieces < 1 ? 1 : pieces < split ? pieces : split;
    first_piece[c + 1] = first_piece[c] + pieces;
  }
  const long num_pieces = first_piece[num_chunks];
  const long part = MAX_QUERIES * (head_dim + 2);  /* a piece's m, l, acc per KV head */
  float *parts = NULL;
  if (num_pieces > num_chunks) {
    parts = malloc(num_pieces * num_kv_heads * part * sizeof(float));
    if (!parts) {
      free(first_piece);
      return -2;
    }
  }
#pragma omp parallel
  {
    long c = 0;
#pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < num_pieces * num_kv_heads; task++) {
      const long piece = task / num_kv_heads, h = task % num_kv_heads;
      while (first_piece[c + 1] <= piece) c++;  /* tasks come in order per thread */
      while (first_piece[c] > piece) c--;
      const long first = chunk_start[c], rows = chunk_start[c + 1] - first;
      const long p = piece - first_piece[c], pieces = first_piece[c + 1] - first_piece[c];
      const long shared = chunk_shared[c];
      /* a row alone and whole: one task takes all its KV heads (contiguous block reads) */
      const int whole = rows == 1 && shared == 0 && pieces == 1 && num_heads <= MAX_QUERIES;
      if (whole && h > 0) continue;
      const long h0 = whole ? 0 : h, nh = whole ? num_kv_heads : 1;
      float qs[MAX_QUERIES * MAX_HEAD_DIM] __attribute__((aligned(64)));
      float m[MAX_QUERIES], l[MAX_QUERIES];
      vf acc[MAX_QUERIES * MAX_HEAD_DIM / LANES];
      /* query a: row a / (nh * G), KV head h0 + a / G % nh, its head a % G of that group */
      state_t st = {rows * nh * G, head_dim / LANES, qs, m, l, acc};
      for (long a = 0; a < st.nq; a++) {
        const long r = a / (nh * G), head = (h0 + a / G % nh) * G + a % G;
        const float *src = q + q_rows[first + r] * q_stride + head * head_dim;
        for (long d = 0; d < head_dim; d++) qs[a * head_dim + d] = src[d] * scale;
        m[a] = -INFINITY;
        l[a] = 0.0f;
        for (long d = 0; d < st.dv; d++) acc[a * st.dv + d] = (vf){0};
      }
      const long main = shared > 0 ? shared : rows == 1 ? ctx_len[first] : 0;
      /* this piece's share of the main range, in whole blocks */
      const long main_blocks = (main + block_size - 1) / block_size;
      const long from = p * main_blocks / pieces * block_size;
      const long to = p + 1 == pieces ? main : (p + 1) * main_blocks / pieces * block_size;
      const int32_t *table = block_tables + table_rows[first] * table_stride;
      if (shared > 0)
        attend_shared(&st, table, from, to, k_cache, v_cache, block_size, num_kv_heads, h,
                      head_dim);
      else if (main > 0)
        attend_own(&st, 0, G, table, from, to, k_cache, v_cache, block_size, num_kv_heads, h0,
                   nh, head_dim);
      if (p + 1 == pieces)
        for (long r = 0; r < rows; r++)
          attend_own(&st, r * nh * G, G, block_tables + table_rows[first + r] * table_stride,
                     main, ctx_len[first + r], k_cache, v_cache, block_size, num_kv_heads, h0,
                     nh, head_dim);
      if (pieces == 1) {
        for (long a = 0; a < st.nq; a++) {
          const long r = a / (nh * G), head = (h0 + a / G % nh) * G + a % G;
          const float inv = 1.0f / l[a];
          float *o = out + ((first + r) * num_heads + head) * head_dim;
          for (long d = 0; d < st.dv; d++) *(vf *)(o + d * LANES) = acc[a * st.dv + d] * inv;
        }
      } else {  /* nh == 1 */
        float *dst = parts + task * part;  /* [m | l | acc] of this piece and head */
        memcpy(dst, m, rows * G * sizeof(float));
        memcpy(dst + MAX_QUERIES, l, rows * G * sizeof(float));
        memcpy(dst + 2 * MAX_QUERIES, acc, rows * G * head_dim * sizeof(float));
      }
    }
    /* merge the pieces of split chunks: e^(m_p - m) weights their sums */
#pragma omp for schedule(dynamic, 1)
    for (long ch = 0; ch < num_chunks * num_kv_heads; ch++) {
      const long cc = ch / num_kv_heads, h = ch % num_kv_heads;
      const long p0 = first_piece[cc], pieces = first_piece[cc + 1] - p0;
      if (pieces == 1) continue;
      const long first = chunk_start[cc], rows = chunk_start[cc + 1] - first;
      for (long a = 0; a < rows * G; a++) {
        float mx = -INFINITY, sum = 0.0f;
        for (long p = 0; p < pieces; p++) {
          const float mp = parts[((p0 + p) * num_kv_heads + h) * part + a];
          mx = mp > mx ? mp : mx;
        }
        float w[MAX_PIECES_MERGED];
        for (long p = 0; p < pieces; p++) {
          const float *src = parts + ((p0 + p) * num_kv_heads + h) * part;
          w[p] = src[a] == -INFINITY ? 0.0f : expf(src[a] - mx);
          sum += w[p] * src[MAX_QUERIES + a];
        }
        const long r = a / G, g = a % G;
        float *o = out + ((first + r) * num_heads + h * G + g) * head_dim;
        for (long d = 0; d < head_dim; d++) {
          float v = 0.0f;
          for (long p = 0; p < pieces; p++)
            v += w[p] * parts[((p0 + p) * num_kv_heads + h) * part + 2 * MAX_QUERIES +
                              a * head_dim + d];
          o[d] = v / sum;
        }
      }
    }
  }
  free(parts);
  free(first_piece);
  return 0;
}

/* Rotary embedding (neox style: rotate halves) and the KV-cache write of one layer's new
 * tokens, in one pass. q [T, H, D] (row stride q_stride floats, heads dense) is rotated in
 * place; k [T, H_kv, D] (row stride k_stride) is rotated into k_cache and v (row stride
 * v_stride) copied into v_cache at slot slots[t] (caches [num_slots, H_kv, D] contiguous;
 * slot -1: not written). Token t's angles are row positions[t] of cos_sin [P, D] (cos |
 * sin halves). Without FMA contraction, each element is (x1 * cos) - (x2 * sin) rounded as
 * torch's separate multiplies and subtraction round it, so the result is the same bits as
 * the plain-torch path. Returns 0, or -1 if D is odd. */
__attribute__((optimize("fp-contract=off"))) int plait_rope_write_kv(
    float *q, long q_stride, const float *k, long k_stride, const float *v, long v_stride,
    long num_tokens, long num_heads, long num_kv_heads, long head_dim, const float *cos_sin,
    const int64_t *positions, float *k_cache, float *v_cache, const int64_t *slots) {
  if (head_dim % 2) return -1;
  const long half = head_dim / 2;
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
  for (long t = 0; t < num_tokens; t++) {
    const float *cs = cos_sin + positions[t] * head_dim, *sn = cs + half;
    for (long h = 0; h < num_heads; h++) {
      float *x = q + t * q_stride + h * head_dim;
      for (long i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * cs[i] - x2 * sn[i];
        x[i + half] = x2 * cs[i] + x1 * sn[i];
      }
    }
    if (slots[t] < 0) continue;
    float *kc = k_cache + slots[t] * num_kv_heads * head_dim;
    float *vc = v_cache + slots[t] * num_kv_heads * head_dim;
    for (long h = 0; h < num_kv_heads; h++) {
      const float *x = k + t * k_stride + h * head_dim;
      float *o = kc + h * head_dim;
      for (long i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        o[i] = x1 * cs[i] - x2 * sn[i];
        o[i + half] = x2 * cs[i] + x1 * sn[i];
      }
    }
    memcpy(vc, v + t * v_stride, num_kv_heads * head_dim * sizeof(float));
  }
  return 0;
}

/* One token per row by inverse-CDF sampling: the first token whose cumulative weight
 * exceeds u[r] times the row's total, the weights being exp(logit - max) (a logit equal to
 * the max weighs 1, so +inf logits share the mass; below max - 87, 0). A token of zero
 * weight is never picked; a rounding overshoot past the end picks the last token of
 * positive weight; a row with a NaN picks vocab - 1. logits [rows, vocab] (row stride
 * `stride` floats); scratch [rows, vocab] floats; writes out[rows]. Each row is computed by
 * one thread in a fixed order, so a row's token depends only on its logits and u. */
int plait_sample_inverse_cdf(const float *logits, long rows, long vocab, long stride,
                             const float *u, float *scratch, int64_t *out) {
#pragma omp parallel for schedule(static)
  for (long r = 0; r < rows; r++) {
    const float *l = logits + r * stride;
    float *w = scratch + r * vocab;
    float mx = -INFINITY;
    int nan = 0;
    for (long i = 0; i < vocab; i++) {
      mx = l[i] > mx ? l[i] : mx;
      nan |= l[i] != l[i];
    }
    if (nan) {
      out[r] = vocab - 1;
      continue;
    }
    const vf mv = (vf){0} + mx, lo = (vf){0} - 87.0f;
    vf acc = (vf){0};
    long i = 0;
    for (; i + LANES <= vocab; i += LANES) {
      const vf x = *(const vf *)(l + i), d = x - mv;
      vf e = vselect(d < lo, (vf){0}, vexp(d));
      e = vselect(x == mv, (vf){0} + 1.0f, e);
      *(vf *)(w + i) = e;
      acc += e;
    }
    double total = hsum(acc);
    for (; i < vocab; i++) {
      const float d = l[i] - mx;
      w[i] = l[i] == mx ? 1.0f : d < -87.0f ? 0.0f : expf(d);
      total += w[i];
    }
    const double target = (double)u[r] * total;
    double run = 0.0;
    long pick = -1;
    for (i = 0; i + LANES <= vocab && pick < 0; i += LANES) {  /* whole vectors first */
      const double block = hsum(*(const vf *)(w + i));
      if (run + block <= target) {
        run += block;
        continue;
      }
      for (long j = i; j < i + LANES; j++) {
        run += w[j];
        if (w[j] > 0 && run > target) {
          pick = j;
          break;
        }
      }
    }
    for (; i < vocab && pick < 0; i++) {
      run += w[i];
      if (w[i] > 0 && run > target) pick = i;
    }
    if (pick < 0)  /* overshoot: the last token of positive weight */
      for (pick = vocab - 1; pick > 0 && !(w[pick] > 0); pick--) {
      }
    out[r] = pick;
  }
  return 0;
}

/* RMS normalization of the rows of x [T, D] (row stride x_stride), after adding `add`
 * (same shape, row stride add_stride; NULL: nothing added): s = x + add is written to
 * sum_out (row stride D; NULL when add is NULL) and s * w / sqrt(mean(s^2) + eps) to out
 * (row stride D). The sum of squares runs over whole vectors, so it differs from torch's
 * in the last bits. Returns 0. */
int plait_add_rms_norm(const float *x, long x_stride, const float *add, long add_stride,
                       const float *w, long num_tokens, long dim, float eps, float *sum_out,
                       float *out) {
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
  for (long t = 0; t < num_tokens; t++) {
    const float *xr = x + t * x_stride;
    float *s = add ? sum_out + t * dim : (float *)xr;
    if (add)
      for (long i = 0; i < dim; i++) s[i] = xr[i] + add[t * add_stride + i];
    vf acc = (vf){0};
    long i = 0;
    for (; i + LANES <= dim; i += LANES) {
      const vf v = *(const vf *)(s + i);
      acc += v * v;
    }
    float ss = hsum(acc);
    for (; i < dim; i++) ss += s[i] * s[i];
    const float r = 1.0f / sqrtf(ss / (float)dim + eps);
    float *o = out + t * dim;
    for (i = 0; i < dim; i++) o[i] = s[i] * r * w[i];
  }
  return 0;
}

/* out[t] = silu(g) * u for the row t of gate_up [T, 2 I] = g | u (row stride gu_stride):
 * g / (1 + exp(-g)) * u, out [T, I] dense. Returns 0. */
int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, long inter,
                   float *out) {
#pragma omp parallel for schedule(static) if (num_tokens >= 16)
  for (long t = 0; t < num_tokens; t++) {
    const float *g = gate_up + t * gu_stride, *u = g + inter;
    float *o = out + t * inter;
    long i = 0;
    for (; i + LANES <= inter; i += LANES) {
      const vf gv = *(const vf *)(g + i);
      *(vf *)(o + i) = gv / (1.0f + vexp(-gv)) * *(const vf *)(u + i);
    }
    for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
  return 0;
}
