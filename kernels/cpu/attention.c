/* Paged attention over the KV cache, read in place (see vec.h). */
#include <float.h>
#include <limits.h>

#include "plait_cpu.h"
#include "vec.h"

/* The caches hold float32 or bfloat16 (plait_cpu.h's PLAIT_KV_*); every function below that
 * reads them takes `const int bf16`, a constant where it is inlined: each runs as two
 * copies, one per element type, entered once per task (attend_task_f32 / _bf16), so the
 * float32 copy is the code it was. bfloat16 elements are widened to float32 (exact) as they
 * are loaded; the arithmetic is float32 either way. With PLAIT_ATTN_BF16_DOT (a third copy,
 * attend_task_bf16_dot) the shared tokens go through attention_bf16.h's vdpbf16ps loops
 * instead; without AVX512-BF16 that flag takes the bfloat16 copy. */
#define INLINE static inline __attribute__((always_inline))

/* a * b + c in one rounding (an FMA) where the build has one, else two: this file is
 * built with -ffp-contract=off (build.py's SOURCE_FLAGS), so every fused product is this
 * one, spelled out, and each copy of a loop rounds alike. */
INLINE vf vfma(vf a, vf b, vf c) {
#if LANES == 16
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif LANES == 8 && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

/* The address of element i of a cache of bfloat16 (bf16) or float32. */
INLINE const void *kv_at(const void *p, long i, const int bf16) {
  return (const char *)p + i * (bf16 ? 2 : 4);
}

/* LANES elements of a cache row from element i, as float32. */
INLINE vf load_kv(const void *row, long i, const int bf16) {
  return bf16 ? widen_bf16((const uint16_t *)row + i) : *(const vf *)((const float *)row + i);
}

/* PLAIT_MAX_QUERIES (plait_cpu.h): query vectors one task holds: rows of a chunk x heads
 * per KV head; PLAIT_MAX_HEAD_DIM; PLAIT_MAX_BLOCK: tokens per cache block. */
/* Lone rows run one task for all their KV heads only where the chunks give each thread
 * at least this many tasks. */
#define TASKS_PER_THREAD 3
/* Each task prefetches its rows of the block this many blocks ahead into L2: the blocks
 * are scattered over the pool, so the hardware prefetcher cannot follow (16 sequences of
 * ~560 tokens: 37.6 -> 27 ms per decode step over 30 layers; what is left is the latency
 * of reading 16-token blocks scattered over the pool, ~11 GB/s). */
#define PF_BLOCKS 2

/* Query vectors of LANES a task holds at most (the shared loops' score arrays). */
#define QVMAX (PLAIT_MAX_QUERIES / LANES)

/* The running softmax of one task: `nq` query vectors (pre-scaled), their running max,
 * normaliser and weighted sum of values; and the variants every score goes through
 * (plait_decode_attention's window and softcap). The running max starts at -FLT_MAX, not
 * -inf: a window can mask every token of a query in a slice (scores -inf), and -FLT_MAX
 * keeps softmax_update's e^(m - m') from -inf - -inf (NaN); the first real score gives
 * alpha = e^-87 (vexp's floor; vexp_fma's: 0) either way, so without a window the bits
 * are the same. */
typedef struct {
  long nq, dv;
  float *q;    /* [nq, D] */
  float *m;    /* [nq] */
  float *l;    /* [nq] */
  vf *acc;     /* [nq, dv] */
  float softcap;    /* > 0: each score s becomes softcap * tanh(s / softcap) */
  long window;      /* > 0: a row at position p attends tokens [p + 1 - window, p] */
  long lo_min;      /* the first token any query attends (0 without a window) */
  long lo_max;      /* tokens before this are masked for some query (0: none) */
  const float *lo;  /* [QVMAX * LANES] each query's first token (0 past nq), as float */
} state_t;

/* The first token a row attending tokens [0, ctx) sees within `window` (0: none). */
static inline long window_start(long ctx, long window) {
  return window > 0 && ctx > window ? ctx - window : 0;
}

/* tanh(x), lane by lane, to a few float32 ulps: for |x| < 0.5 its odd Taylor polynomial to
 * x^13 (the next term is below 1.5e-3 |x|^15 < 5e-8), else (1 - e) / (1 + e) with e =
 * e^(-2 |x|) <= 0.37 (no cancellation; vexp's floor gives 1 for |x| >= 44), x's sign. */
static inline vf vtanh(vf x) {
  const vi sign = (vi)x & (int32_t)0x80000000;
  const vf ax = (vf)((vi)x & 0x7fffffff), x2 = ax * ax;
  vf p = (vf){0} + 21844.0f / 6081075.0f;
  p = p * x2 - 1382.0f / 155925.0f;
  p = p * x2 + 62.0f / 2835.0f;
  p = p * x2 - 17.0f / 315.0f;
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 - 1.0f / 3.0f;
  const vf small = ax + ax * x2 * p;
  const vf e = vexp(-(ax + ax));
  const vf t = vselect(ax < 0.5f, small, (1.0f - e) / (1.0f + e));
  return (vf)((vi)t | sign);
}

/* softcap * tanh(s / softcap) of the scores s[0, n) (n a multiple of LANES), in place. */
static inline void cap_scores(float *s, long n, float softcap) {
  const float inv = 1.0f / softcap;
  for (long j = 0; j < n; j += LANES) *(vf *)(s + j) = softcap * vtanh(*(vf *)(s + j) * inv);
}

/* The variants on the shared loops' scores sc[j][v] of tokens t + j (j < n) for query
 * vectors v < qv: capped (st->softcap), then -inf where the token is before the query's
 * window (only where t < st->lo_max: the slices some window starts after). */
static inline void shape_scores(const state_t *st, vf sc[LANES][QVMAX], long t, long n,
                                long qv) {
  if (st->softcap > 0)
    for (long j = 0; j < n; j++) cap_scores((float *)sc[j], qv * LANES, st->softcap);
  if (t < st->lo_max)
    for (long v = 0; v < qv; v++) {
      const vf lo = *(const vf *)(st->lo + v * LANES);
      for (long j = 0; j < n; j++)
        sc[j][v] = vselect(vsplat((float)(t + j)) < lo, vsplat(-INFINITY), sc[j][v]);
    }
}

/* x (finite, >= 0) rounded to the nearest bfloat16 value, ties to even, kept as float32
 * (its low 16 bits zero): vec.h's round_bf16_high, the low half cleared. */
static inline vf round_to_bf16(vf x) {
  return (vf)(round_bf16_high(x) & 0xffff0000u);
}

#if LANES == 16
/* e^x, x <= 0 (-inf: 0), to about 2 ulp: x = n ln2 + r (|r| <= ln2 / 2), vexp's degree-6
 * polynomial for e^r by FMAs, times 2^n by vscalefps (which gives 0 below float32's range,
 * so no clamp but the one that keeps -inf from making r a NaN). Spelled in intrinsics, so
 * its roundings do not depend on the compiler's contractions. A third of vexp's work: the
 * bfloat16-product loops (attention_bf16.h, attention_amx.h) take one per score, and
 * their every softmax runs on it (softmax_exp), so they agree bit for bit. */
static inline __attribute__((always_inline)) __m512 vexp_fma(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

/* The softmax's e^x: vexp_fma in the loops with bfloat16 products (`dot`, a constant:
 * their weights are rounded to bfloat16 anyway), vexp in the float32 ones, whose bits
 * the builds without AVX-512 repeat. */
static inline __attribute__((always_inline)) vf softmax_exp(vf x, const int dot) {
#if LANES == 16
  if (dot) return (vf)vexp_fma((__m512)x);
#endif
  return vexp(x);
}

/* The online-softmax update, the one every path runs: a running max m and normaliser l
 * meet n new score vectors s[j * s_stride] (floats; pre-scaled): m' = max(m, s), the
 * weights p[j * p_stride] = e^(s_j - m') are written (p may be s), l' = l e^(m - m') +
 * sum_j p_j; returns alpha = e^(m - m'), by which the caller scales the query's weighted sum
 * of values before adding sum_j p_j V_j. With `round_p` (a constant) each p_j is rounded to
 * a bfloat16 value first (round_to_bf16), the weight vdpbf16ps then multiplies V by
 * (attention_bf16.h), so l sums the weights actually applied, and every e^ is vexp_fma's
 * (softmax_exp). One query per lane (m, l, alpha lane by lane), one token per vector (a
 * row's few queries with the tokens across the lanes take few_weights, attention_bf16.h,
 * instead). alpha is exactly 1 when the max did not move (e^0 = 1); from m = -FLT_MAX
 * (nothing attended yet) it is e^-87 (vexp's floor) or 0 (vexp_fma), which scales an l and
 * a weighted sum still 0. Inlined: it is the hot loop of the shared-token attention. */
static inline __attribute__((always_inline)) vf softmax_update(
    vf *m, vf *l, const float *s, long s_stride, float *p, long p_stride, long n,
    const int round_p) {
  vf mx = *m;
  for (long j = 0; j < n; j++) mx = vmax(*(const vf *)(s + j * s_stride), mx);
  const vf alpha = softmax_exp(*m - mx, round_p);
  vf sum = (vf){0};
  for (long j = 0; j < n; j++) {
    vf e = softmax_exp(*(const vf *)(s + j * s_stride) - mx, round_p);
    if (round_p) e = round_to_bf16(e);
    *(vf *)(p + j * p_stride) = e;
    sum += e;
  }
  *l = *l * alpha + sum;
  *m = mx;
  return alpha;
}

/* Where token t's rows of KV head h are in the caches (k, v; the next tokens of its block
 * follow at a stride of H_kv * D elements), and where the same rows of the block PF_BLOCKS
 * ahead are (kp, vp; NULL when [t, t_to) does not reach that far): the loops prefetch
 * those a token at a time, as they go (one burst per block overflowed the miss queues). */
typedef struct {
  const void *k, *v, *kp, *vp;
} span_t;

INLINE span_t locate(const int32_t *table, long t, long t_to, const void *k_cache,
                     const void *v_cache, long block_size, long num_kv_heads, long h,
                     long head_dim, const int bf16) {
  const long blk = table[t / block_size], off = t % block_size;
  const long at = ((blk * block_size + off) * num_kv_heads + h) * head_dim;
  span_t sp = {kv_at(k_cache, at, bf16), kv_at(v_cache, at, bf16), NULL, NULL};
  if (t - off + PF_BLOCKS * block_size < t_to) {
    const long ahead = table[t / block_size + PF_BLOCKS];
    const long pat = ((ahead * block_size + off) * num_kv_heads + h) * head_dim;
    sp.kp = kv_at(k_cache, pat, bf16);
    sp.vp = kv_at(v_cache, pat, bf16);
  }
  return sp;
}

/* Prefetches token j's K and V rows (head_dim elements each) of the block ahead into L2. */
INLINE void prefetch_rows(const span_t *sp, long j, long stride, long head_dim,
                          const int bf16) {
  if (!sp->kp) return;
  const char *kp = kv_at(sp->kp, j * stride, bf16), *vp = kv_at(sp->vp, j * stride, bf16);
  for (long b = 0; b < head_dim * (bf16 ? 2 : 4); b += 64) {
    __builtin_prefetch(kp + b, 0, 2);
    __builtin_prefetch(vp + b, 0, 2);
  }
}

/* Rows [0, n) of a bfloat16 span (a stride of `stride` elements) widened into dst [n, D]. */
INLINE void widen_rows(const void *src, long n, long stride, long head_dim, float *dst) {
  for (long j = 0; j < n; j++)
    for (long d = 0; d < head_dim; d += LANES)
      *(vf *)(dst + j * head_dim + d) = widen_bf16((const uint16_t *)src + j * stride + d);
}

/* The running max and normaliser of `st`'s queries as qv vectors of LANES (lanes past nq
 * hold 0), and back into `st`. */
INLINE void load_running(const state_t *st, long qv, vf *m, vf *l) {
  for (long v = 0; v < qv; v++)
    for (int lane = 0; lane < LANES; lane++) {
      const long a = v * LANES + lane;
      m[v][lane] = a < st->nq ? st->m[a] : 0.0f;
      l[v][lane] = a < st->nq ? st->l[a] : 0.0f;
    }
}
INLINE void store_running(state_t *st, const vf *m, const vf *l) {
  for (long a = 0; a < st->nq; a++) {
    st->m[a] = m[a / LANES][a % LANES];
    st->l[a] = l[a / LANES][a % LANES];
  }
}

/* How many of tokens [t, t_to) the loops take at once (one online-softmax update): up to
 * the next multiple of LANES, within t's block. The slices are cut on one grid of token
 * positions (the multiples of LANES and the blocks' starts), so a walk that starts on it
 * (`grid_floor`) cuts a token range in the same slices wherever it starts and stops: a
 * row's arithmetic does not depend on how its tokens were split between calls. */
INLINE long slice_len(long t, long t_to, long block_size) {
  const long off = t % block_size;
  long end = t - off + block_size < t_to ? t - off + block_size : t_to;
  const long lane_end = t - t % LANES + LANES;
  end = lane_end < end ? lane_end : end;
  return end - t;
}

/* t rounded down to a multiple of LANES: a point of slice_len's grid. */
static inline long grid_floor(long t) { return t - t % LANES; }

/* Every query of `st` attends tokens [t_from, t_to) of KV head h through `table`, with the
 * queries across the vector lanes: the queries are transposed once ([D][QMAX * LANES],
 * zero past nq), a token's scores for all of them are qv vectors (D FMAs each, the key's
 * elements broadcast), and the online softmax runs on whole vectors, once per LANES
 * tokens (at most one block). The
 * keys are read once for all the queries (the rows of a chunk sharing a prefix, times the
 * heads of a KV group). */
INLINE void attend_shared_qv(const int QMAX, state_t *st, const int32_t *table, long t_from,
                             long t_to, const void *k_cache, const void *v_cache,
                             long block_size, long num_kv_heads, long h, long head_dim,
                             const int bf16, const int var) {
  /* QMAX (a constant, ceil(nq / LANES)) query vectors; TB tokens' partial scores: TB *
   * QMAX accumulators in registers. Each lane's sums run in the same order whatever QMAX,
   * so a query's result does not depend on the other queries of its call. */
  enum { TB = LANES == 16 ? 8 : 1 };
  const long stride = num_kv_heads * head_dim, dv = st->dv, nq = st->nq;
  const long qv = QMAX;
  float qt[PLAIT_MAX_HEAD_DIM * QVMAX * LANES] __attribute__((aligned(64)));
  /* +4: the value pass reads 4 queries at a time, past nq in its last group */
  float prob[LANES][QVMAX * LANES + 4] __attribute__((aligned(64)));
  float scale_by[QVMAX * LANES] __attribute__((aligned(64)));
  /* bf16: the LANES tokens' K and V rows widened, read by the loops below as float32 rows */
  float kw[LANES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  float vw[LANES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  vf m[QVMAX], l[QVMAX];
  for (long d = 0; d < head_dim; d++)
    for (long a = 0; a < QMAX * LANES; a++)
      qt[d * QMAX * LANES + a] = a < nq ? st->q[a * head_dim + d] : 0.0f;
  load_running(st, qv, m, l);
  for (long t = t_from; t < t_to;) {
    const long n = slice_len(t, t_to, block_size);
    const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                             head_dim, bf16);
    /* the rows as float32 (rs floats from token to token) */
    const float *kb = sp.k, *vb = sp.v;
    long rs = stride;
    if (bf16) {
      widen_rows(sp.k, n, stride, head_dim, kw);
      widen_rows(sp.v, n, stride, head_dim, vw);
      kb = kw;
      vb = vw;
      rs = head_dim;
    }
    vf sc[LANES][QVMAX];
    for (long j0 = 0; j0 < n; j0 += TB) {  /* scores: TB tokens x QMAX vectors in registers */
      const float *kr[TB];
      vf part[TB][QVMAX];
      for (int j = 0; j < TB; j++) {  /* past n: the last token again, ignored */
        kr[j] = kb + (j0 + j < n ? j0 + j : n - 1) * rs;
        for (int v = 0; v < QMAX; v++) part[j][v] = (vf){0};
        if (j0 + j < n) prefetch_rows(&sp, j0 + j, stride, head_dim, bf16);
      }
      for (long d = 0; d < head_dim; d++) {
        vf qd[QVMAX];
        for (int v = 0; v < QMAX; v++) qd[v] = *(const vf *)(qt + d * QMAX * LANES + v * LANES);
        _Pragma("GCC unroll 8") for (int j = 0; j < TB; j++) {
          const float kd = kr[j][d];
          _Pragma("GCC unroll 4") for (int v = 0; v < QMAX; v++)
            part[j][v] = vfma(vsplat(kd), qd[v], part[j][v]);
        }
      }
      for (long j = 0; j < TB && j0 + j < n; j++)
        for (int v = 0; v < QMAX; v++) sc[j0 + j][v] = part[j][v];
    }
    if (var && (st->softcap > 0 || t < st->lo_max)) shape_scores(st, sc, t, n, qv);
    for (long v = 0; v < qv; v++)  /* online softmax, all queries at once */
      *(vf *)&scale_by[v * LANES] = softmax_update(&m[v], &l[v], (const float *)&sc[0][v],
                                                   QVMAX * LANES, &prob[0][v * LANES],
                                                   QVMAX * LANES + 4, n, 0);
    for (long d = 0; d < dv; d++) {  /* acc = acc * alpha + sum_j p_j V_j, 4 queries a pass */
      for (long a0 = 0; a0 < nq; a0 += 4) {
        vf r[4];
        const int na = nq - a0 < 4 ? (int)(nq - a0) : 4;
        for (int u = 0; u < 4; u++)
          r[u] = u < na ? st->acc[(a0 + u) * dv + d] * scale_by[a0 + u] : (vf){0};
        for (long j = 0; j < n; j++) {
          const vf vv = *(const vf *)(vb + j * rs + d * LANES);
          _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)
            r[u] = vfma(vsplat(prob[j][a0 + u]), vv, r[u]);
        }
        for (int u = 0; u < na; u++) st->acc[(a0 + u) * dv + d] = r[u];
      }
    }
    t += n;
  }
  store_running(st, m, l);
}

/* attend_shared with as many query vectors as `st` fills (a decode row's few queries
 * compute no empty vector). */
INLINE void attend_shared(state_t *st, const int32_t *table, long t_from, long t_to,
                          const void *k_cache, const void *v_cache, long block_size,
                          long num_kv_heads, long h, long head_dim, const int bf16,
                          const int var) {
#define SHARED_ARGS st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h, \
    head_dim, bf16, var
  switch ((st->nq + LANES - 1) / LANES) {
    case 1: attend_shared_qv(1, SHARED_ARGS); return;
    case 2: attend_shared_qv(2, SHARED_ARGS); return;
    default: attend_shared_qv(QVMAX, SHARED_ARGS); return;
  }
#undef SHARED_ARGS
}

#include "attention_bf16.h"
#include "attention_amx.h"

#if ATTN_BF16_DOT
/* attend_shared's float32 arithmetic, bit for bit, for the few queries of one row and KV
 * head (nq <= FEW_MAX: a decode row's or a tile row's own tokens), with the tokens across
 * the lanes (attend_few_dot's layout): a slice's K rows transposed once into columns kt
 * [D][tokens] (bf16 widened), each query's scores one vector of its tokens (the same FMA
 * chain over d, lane by lane), its weights summed in token order, its weighted sum of
 * values the same FMAs per dimension. Built where transpose16 is (attention_bf16.h). */
INLINE void attend_few_nq(const int NQ, const int VAR, state_t *st, const int32_t *table,
                          long t_from, long t_to, const void *k_cache, const void *v_cache,
                          long block_size, long num_kv_heads, long h, long head_dim,
                          const int bf16) {
  const long stride = num_kv_heads * head_dim, dv = st->dv;
  vf kt[PLAIT_MAX_HEAD_DIM];
  float vw[LANES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  float e[FEW_MAX][LANES] __attribute__((aligned(64)));
  for (long t = t_from; t < t_to;) {
    const long n = slice_len(t, t_to, block_size);
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                             head_dim, bf16);
    for (long d0 = 0; d0 < head_dim; d0 += LANES) {  /* kt[d][j]: element d of token j */
      __m512 in[16], out[16];
      for (int j = 0; j < 16; j++) {
        in[j] = j < n ? (__m512)load_kv(kv_at(sp.k, j * stride, bf16), d0, bf16)
                      : _mm512_setzero_ps();
        if (j < n && d0 == 0) prefetch_rows(&sp, j, stride, head_dim, bf16);
      }
      transpose16(in, out);
      for (int k = 0; k < 16; k++) kt[d0 + k] = (vf)out[k];
    }
    const float *vb = sp.v;
    long rs = stride;
    if (bf16) {
      widen_rows(sp.v, n, stride, head_dim, vw);
      vb = vw;
      rs = head_dim;
    }
    vf sc[FEW_MAX];
    for (int a = 0; a < NQ; a++) sc[a] = (vf){0};
    for (long d = 0; d < head_dim; d++)
      for (int a = 0; a < NQ; a++) sc[a] = vfma(vsplat(st->q[a * head_dim + d]), kt[d], sc[a]);
    float alpha[FEW_MAX], sum[FEW_MAX];
    for (int a = 0; a < NQ; a++) {
      *(vf *)e[a] = few_weights(st, a, sc[a], t, live, VAR, 0, &alpha[a]);
      sum[a] = 0.0f;
    }
    for (long j = 0; j < n; j++)  /* in token order, as each lane of the shared loop */
      for (int a = 0; a < NQ; a++) sum[a] += e[a][j];
    for (int a = 0; a < NQ; a++) {
      st->l[a] = st->l[a] * alpha[a] + sum[a];
      for (long dd = 0; dd < dv; dd++) {
        vf r = st->acc[a * dv + dd] * alpha[a];
        for (long j = 0; j < n; j++)
          r = vfma(vsplat(e[a][j]), *(const vf *)(vb + j * rs + dd * LANES), r);
        st->acc[a * dv + dd] = r;
      }
    }
    t += n;
  }
}

INLINE void attend_few(state_t *st, const int32_t *table, long t_from, long t_to,
                       const void *k_cache, const void *v_cache, long block_size,
                       long num_kv_heads, long h, long head_dim, const int bf16,
                       const int var) {
#define FEW_ARGS st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h, \
    head_dim, bf16
  switch (st->nq) {
    case 1: attend_few_nq(1, var, FEW_ARGS); return;
    case 2: attend_few_nq(2, var, FEW_ARGS); return;
    case 3: attend_few_nq(3, var, FEW_ARGS); return;
    default: attend_few_nq(4, var, FEW_ARGS); return;  /* 4: the caller's limit */
  }
#undef FEW_ARGS
}
#endif

/* The loop every token range goes through: `st`'s queries attend tokens [t_from, t_to) of
 * KV head h, with bf16 dot products (`dot`, a constant) or in float32. */
INLINE void attend_range(state_t *st, const int32_t *table, long t_from, long t_to,
                         const void *k_cache, const void *v_cache, long block_size,
                         long num_kv_heads, long h, long head_dim, const int bf16,
                         const int dot, const int var) {
  if (t_from >= t_to) return;
  if (dot)
    attend_shared_dot(st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                      head_dim, var);
  else
    attend_shared(st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                  head_dim, bf16, var);
}

/* One row's queries attend tokens [t_from, t_to) (t_from on the slice grid): those of KV
 * heads [h, h + nh) are `st`'s queries a0 + (hh - h) * G + g, each head's G as a state of
 * their own (or, through attend_few_dot without a window or a softcap, few_heads' heads'
 * together), through attend_few_dot / attend_few (a few queries, the tokens across the
 * lanes) or attend_range: the same roundings, so the same bits as when the row's tokens
 * are shared with other rows, or split elsewhere between the shared and the own range. */
INLINE void attend_own(state_t *st, long a0, long G, const int32_t *table, long t_from,
                       long t_to, const void *k_cache, const void *v_cache, long block_size,
                       long num_kv_heads, long h, long nh, long head_dim, const int bf16,
                       const int dot, const int var) {
  float lo[QVMAX * LANES] __attribute__((aligned(64)));
  /* attend_few_dot's tokens-across-lanes loop, several heads a call without a window or a
   * softcap */
  const int few_dot = dot && G <= FEW_ONE && t_from < t_to;
  for (long hh = h, take; hh < h + nh; hh += take) {
    take = few_dot && !var ? few_heads(G, h + nh - hh) : 1;
    const long first = a0 + (hh - h) * G, nq = take * G;
    state_t sub = {nq, st->dv, st->q + first * head_dim, st->m + first, st->l + first,
                   st->acc + first * st->dv, st->softcap, st->window, LONG_MAX, 0, lo};
    for (long a = 0; a < QVMAX * LANES; a++) {
      lo[a] = a < nq ? st->lo[first + a] : 0.0f;
      if (a >= nq) continue;
      sub.lo_min = (long)lo[a] < sub.lo_min ? (long)lo[a] : sub.lo_min;
      sub.lo_max = (long)lo[a] > sub.lo_max ? (long)lo[a] : sub.lo_max;
    }
    if (few_dot)
      attend_few_dot(var, &sub, G, table, t_from, t_to, k_cache, v_cache, block_size,
                     num_kv_heads, hh, head_dim);
#if ATTN_BF16_DOT
    else if (G <= 4 && t_from < t_to)
      attend_few(&sub, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, hh,
                 head_dim, bf16, var);
#endif
    else
      attend_range(&sub, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads,
                   hh, head_dim, bf16, dot, var);
  }
}

/* What one task of plait_decode_attention attends: a chunk's shared tokens [lo, main)
 * (main: its chunk_shared rounded down to the slice grid; lo: its rows' lowest window
 * start, on the grid), read once for all the queries of `st`, then each of the chunk's
 * `rows` rows' own tokens [max(main, its window start on the grid), ctx_len[r]) through
 * its table, block_tables + table_rows[r] * table_stride. The queries of `st` are those of
 * KV heads [h0, h0 + nh), G per head and row. Every range runs one loop (attend_range) on
 * one slice grid, so a query's result is the same bits whichever chunk, tile or step its
 * row came in: a row alone, a prefill tile's row, or a draft's verification row.
 * `dot` (a constant, with bf16): bf16 dot products for every token (attention_bf16.h).
 * `var` (a constant): a window or a softcap; the code that applies them (shape_scores,
 * cap_scores) is compiled into the _var copies only. With a window, a range starts at the
 * grid point at or below its rows' windows; the loops mask per query the tokens before
 * its own (a masked token's weight is exactly 0). */
INLINE void attend_task(state_t *st, long main, long rows, long G,
                        const int32_t *block_tables, long table_stride,
                        const int64_t *table_rows, const int32_t *ctx_len, const void *k_cache,
                        const void *v_cache, long block_size, long num_kv_heads, long h0,
                        long nh, long head_dim, const int bf16, const int dot,
                        const int var) {
  const int32_t *table = block_tables + table_rows[0] * table_stride;
  attend_range(st, table, grid_floor(st->lo_min), main, k_cache, v_cache, block_size,
               num_kv_heads, h0, head_dim, bf16, dot, var);
  for (long r = 0; r < rows; r++) {
    const long lo = grid_floor(window_start(ctx_len[r], st->window));
    attend_own(st, r * nh * G, G, block_tables + table_rows[r] * table_stride,
               lo > main ? lo : main, ctx_len[r], k_cache, v_cache, block_size, num_kv_heads,
               h0, nh, head_dim, bf16, dot, var);
  }
}

/* attend_task over float32 caches, over bfloat16 caches, and over bfloat16 caches with
 * bfloat16 dot products (PLAIT_ATTN_BF16_DOT; builds without AVX512-BF16: the second),
 * each without and with the variants (_var: a window or a softcap). */
#define TASK_PARAMS                                                                          \
  state_t *st, long main, long rows, long G, const int32_t *block_tables, long table_stride,  \
      const int64_t *table_rows, const int32_t *ctx_len, const void *k_cache,                \
      const void *v_cache, long block_size, long num_kv_heads, long h0, long nh, long head_dim
#define TASK_ARGS                                                                            \
  st, main, rows, G, block_tables, table_stride, table_rows, ctx_len, k_cache, v_cache,      \
      block_size, num_kv_heads, h0, nh, head_dim
typedef void attend_task_fn(TASK_PARAMS);
static void attend_task_f32(TASK_PARAMS) { attend_task(TASK_ARGS, 0, 0, 0); }
static void attend_task_bf16(TASK_PARAMS) { attend_task(TASK_ARGS, 1, 0, 0); }
static void attend_task_f32_var(TASK_PARAMS) { attend_task(TASK_ARGS, 0, 0, 1); }
static void attend_task_bf16_var(TASK_PARAMS) { attend_task(TASK_ARGS, 1, 0, 1); }
#if ATTN_BF16_DOT
static void attend_task_bf16_dot(TASK_PARAMS) { attend_task(TASK_ARGS, 1, 1, 0); }
static void attend_task_bf16_dot_var(TASK_PARAMS) { attend_task(TASK_ARGS, 1, 1, 1); }
#else
#define attend_task_bf16_dot attend_task_bf16
#define attend_task_bf16_dot_var attend_task_bf16_var
#endif
#undef TASK_PARAMS
#undef TASK_ARGS

/* Whether plait_decode_attention takes PLAIT_ATTN_AMX in this process (plait_cpu.h). */
int plait_attention_amx(void) {
#if ATTN_AMX
  return plait_repack_prompt_bf16();
#else
  return 0;
#endif
}

/* Decode attention: one query token per sequence over its paged K/V, read in place.
 *
 * Sequences come in chunks: chunk c is sequences chunk_start[c] .. chunk_start[c+1] - 1,
 * whose first chunk_shared[c] tokens are the same cache blocks (those of the chunk's first
 * sequence's table; 0 for a chunk of one). Sequence i's query row is q[q_rows[i]] ([H, D],
 * row stride q_stride floats); it attends its tokens 0 .. ctx_len[i] - 1, whose blocks are
 * block_tables[table_rows[i] * table_stride + t / block_size] (int32), in the caches
 * k_cache / v_cache [num_blocks, block_size, H_kv, D] (contiguous) of kv_dtype elements
 * (PLAIT_KV_F32, or PLAIT_KV_BF16: widened to float32, exactly, as they are read; the
 * arithmetic is float32 either way; PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT: every token with
 * bfloat16 products, plait_cpu.h); query head h reads KV head h / (H / H_kv). A task
 * is one chunk and one KV head (or a lone row and all its KV heads, when the chunks alone
 * keep every thread busy): it reads the shared tokens once for all the chunk's queries
 * (cascade attention: one online softmax continues over each row's own tokens).
 * Row invariance: a sequence's result depends only on its query, its tokens and
 * kv_dtype, never on the chunk it came in, on chunk_shared, or on the other sequences of
 * the call (attend_task: one loop on one slice grid, no split of a range into merged
 * pieces), so a prefill's positions, a draft's verification rows and one-row decode steps
 * give the same bits. Writes sequence i's [H, D] (dense) to out row out_rows[i], or to
 * row i (chunk order) when out_rows is NULL.
 * The variants (0: off): `window` > 0, sequence i attends only tokens [ctx_len[i] - window,
 * ctx_len[i]) (its query at ctx_len[i] - 1 and window - 1 earlier): its own tokens start
 * there, a chunk's shared tokens from the lowest row's window start, masked per query in
 * the slices where the rows' windows differ (positions compared as float32: exact below
 * 2^24); `softcap` > 0, every score s (scale q.k) becomes softcap * tanh(s / softcap)
 * before the softmax (vtanh, a few ulps).
 * D must be a multiple of LANES and every sequence must attend at least one token.
 * Returns 0, -1 if the shapes exceed this kernel's limits (or window, softcap < 0). */
#define OUT_ROW(i) (out_rows ? out_rows[i] : (i))
int plait_decode_attention(const float *q, long q_stride, const void *k_cache,
                           const void *v_cache, int kv_dtype, long block_size, long num_kv_heads,
                           long num_heads, long head_dim, const int32_t *block_tables,
                           long table_stride, long num_chunks, const int64_t *chunk_start,
                           const int32_t *chunk_shared, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *ctx_len, float scale,
                           long window, float softcap, float *out, const int64_t *out_rows) {
  const int amx = kv_dtype == (PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT | PLAIT_ATTN_AMX);
  if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % LANES || window < 0 ||
      !(softcap >= 0) ||
      head_dim > PLAIT_MAX_HEAD_DIM || block_size > PLAIT_MAX_BLOCK ||
      (kv_dtype != PLAIT_KV_F32 && kv_dtype != PLAIT_KV_BF16 &&
       kv_dtype != (PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT) && !amx))
    return PLAIT_ERR_SHAPES;
  if (amx) {  /* prompt rows (attention_amx.h) */
#if ATTN_AMX
    if (head_dim % 32 || window != 0 || softcap != 0 || !plait_repack_prompt_bf16())
      return PLAIT_ERR_SHAPES;
    return ax_attention(q, q_stride, k_cache, v_cache, block_size, num_kv_heads, num_heads,
                        head_dim, block_tables, table_stride, num_chunks, chunk_start, q_rows,
                        table_rows, ctx_len, scale, out, out_rows);
#else
    return PLAIT_ERR_SHAPES;
#endif
  }
  const long G = num_heads / num_kv_heads;
  /* a window or a softcap: the copies that apply them (the others hold no such code) */
  const int var = window > 0 || softcap > 0;
  attend_task_fn *const task_fn =
      kv_dtype == PLAIT_KV_F32 ? (var ? attend_task_f32_var : attend_task_f32)
      : kv_dtype == PLAIT_KV_BF16 ? (var ? attend_task_bf16_var : attend_task_bf16)
      : var ? attend_task_bf16_dot_var : attend_task_bf16_dot;
  for (long c = 0; c < num_chunks; c++)
    if ((chunk_start[c + 1] - chunk_start[c]) * G > PLAIT_MAX_QUERIES)
      return PLAIT_ERR_SHAPES;
  /* lone rows as one task each (all KV heads: contiguous block reads) only when the
   * chunks alone give every thread TASKS_PER_THREAD tasks; else a task per KV head */
  const int lone_whole = num_chunks >= TASKS_PER_THREAD * omp_get_max_threads() &&
                         num_heads <= PLAIT_MAX_QUERIES;
#pragma omp parallel for schedule(dynamic, 1)
  for (long task = 0; task < num_chunks * num_kv_heads; task++) {
    const long c = task / num_kv_heads, h = task % num_kv_heads;
    const long first = chunk_start[c], rows = chunk_start[c + 1] - first;
    const long main = grid_floor(chunk_shared[c]);
    const int whole = lone_whole && rows == 1 && main == 0;
    if (whole && h > 0) continue;
    const long h0 = whole ? 0 : h, nh = whole ? num_kv_heads : 1;
    float qs[PLAIT_MAX_QUERIES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float m[PLAIT_MAX_QUERIES], l[PLAIT_MAX_QUERIES];
    float lo[QVMAX * LANES] __attribute__((aligned(64)));
    vf acc[PLAIT_MAX_QUERIES * PLAIT_MAX_HEAD_DIM / LANES];
    /* query a: row a / (nh * G), KV head h0 + a / G % nh, its head a % G of that group */
    state_t st = {rows * nh * G, head_dim / LANES, qs, m, l, acc, softcap, window,
                  LONG_MAX, 0, lo};
    for (long a = 0; a < QVMAX * LANES; a++) {
      const long start = a < st.nq ? window_start(ctx_len[first + a / (nh * G)], window) : 0;
      lo[a] = (float)start;
      if (a >= st.nq) continue;
      st.lo_min = start < st.lo_min ? start : st.lo_min;
      st.lo_max = start > st.lo_max ? start : st.lo_max;
    }
    for (long a = 0; a < st.nq; a++) {
      const long r = a / (nh * G), head = (h0 + a / G % nh) * G + a % G;
      const float *src = q + q_rows[first + r] * q_stride + head * head_dim;
      for (long d = 0; d < head_dim; d++) qs[a * head_dim + d] = src[d] * scale;
      m[a] = -FLT_MAX;
      l[a] = 0.0f;
      for (long d = 0; d < st.dv; d++) acc[a * st.dv + d] = (vf){0};
    }
    task_fn(&st, main, rows, G, block_tables, table_stride, table_rows + first,
            ctx_len + first, k_cache, v_cache, block_size, num_kv_heads, h0, nh, head_dim);
    for (long a = 0; a < st.nq; a++) {
      const long r = a / (nh * G), head = (h0 + a / G % nh) * G + a % G;
      const float inv = 1.0f / l[a];
      float *o = out + (OUT_ROW(first + r) * num_heads + head) * head_dim;
      for (long d = 0; d < st.dv; d++) *(vf *)(o + d * LANES) = acc[a * st.dv + d] * inv;
    }
  }
  return PLAIT_OK;
}
