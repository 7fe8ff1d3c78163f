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
/* Split a chunk into pieces when chunks x KV heads < PIECE_TASKS tasks per thread; a piece
 * has at least PIECE_BLOCKS blocks; at most MAX_PIECES_MERGED pieces per chunk. */
#define PIECE_TASKS 3
#define PIECE_BLOCKS 4
#define MAX_PIECES_MERGED 64
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
 * alpha = e^-87 (vexp's floor) either way, so without a window the bits are the same. */
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

/* The online-softmax update, the one every path runs: a running max m and normaliser l
 * meet n new score vectors s[j * s_stride] (floats; pre-scaled): m' = max(m, s), the
 * weights p[j * p_stride] = e^(s_j - m') are written (p may be s), l' = l e^(m - m') +
 * sum_j p_j; returns alpha = e^(m - m'), by which the caller scales the query's weighted sum
 * of values before adding sum_j p_j V_j. With `round_p` (a constant) each p_j is rounded to
 * a bfloat16 value first (round_to_bf16), the weight vdpbf16ps then multiplies V by
 * (attention_bf16.h), so l sums the weights actually applied. Two layouts, `across` a
 * compile-time constant:
 *   across = 0: one query per lane (m, l, alpha lane by lane), one token per vector;
 *   across = 1: one query, its tokens across the lanes (m, l broadcast over the lanes;
 *               the max and the sum reduce over them too); pad past the tokens with -inf.
 * alpha is exactly 1 when the max did not move (vexp(0) = 1); from m = -inf (nothing
 * attended yet) it is e^-87 (vexp's floor), which scales an l and a weighted sum still 0.
 * Inlined, `across` folded: it is the hot loop of decode attention. */
static inline __attribute__((always_inline)) vf softmax_update(
    vf *m, vf *l, const float *s, long s_stride, float *p, long p_stride, long n,
    const int across, const int round_p) {
  vf mx = *m;
  for (long j = 0; j < n; j++) {  /* the same max either way; each the faster where used */
    const vf sj = *(const vf *)(s + j * s_stride);
    mx = across ? vselect(sj > mx, sj, mx) : vmax(sj, mx);
  }
  if (across) mx = vsplat(hmax(mx));
  const vf alpha = vexp(*m - mx);
  vf sum = (vf){0};
  for (long j = 0; j < n; j++) {
    vf e = vexp(*(const vf *)(s + j * s_stride) - mx);
    if (round_p) e = round_to_bf16(e);
    *(vf *)(p + j * p_stride) = e;
    sum += e;
  }
  *l = *l * alpha + (across ? vsplat(hsum(sum)) : sum);
  *m = mx;
  return alpha;
}

/* softmax_update of query a of `st` (across = 1) over its padded scores s[0, padded). */
static inline __attribute__((always_inline)) vf update_query(state_t *st, long a, float *s,
                                                             long padded) {
  vf m = vsplat(st->m[a]), l = vsplat(st->l[a]);
  const vf alpha = softmax_update(&m, &l, s, LANES, s, LANES, padded / LANES, 1, 0);
  st->m[a] = m[0];
  st->l[a] = l[0];
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

/* How many of tokens [t, t_to) the shared loops take at once: up to LANES, within t's
 * block. */
INLINE long slice_len(long t, long t_to, long block_size) {
  const long off = t % block_size;
  const long block_end = t - off + block_size < t_to ? t - off + block_size : t_to;
  return block_end - t < LANES ? block_end - t : LANES;
}

/* Every query of `st` attends tokens [t_from, t_to) of KV head h through `table`, with the
 * queries across the vector lanes: the queries are transposed once ([D][QMAX * LANES],
 * zero past nq), a token's scores for all of them are qv vectors (D FMAs each, the key's
 * elements broadcast), and the online softmax runs on whole vectors, once per LANES
 * tokens (at most one block). The
 * keys are read once for all the queries (the rows of a chunk sharing a prefix, times the
 * heads of a KV group). */
INLINE void attend_shared(state_t *st, const int32_t *table, long t_from, long t_to,
                          const void *k_cache, const void *v_cache, long block_size,
                          long num_kv_heads, long h, long head_dim, const int bf16,
                          const int var) {
  /* QMAX query vectors; TB tokens' partial scores: TB * QMAX accumulators in registers */
  enum { QMAX = QVMAX, TB = LANES == 16 ? 8 : 1 };
  const long stride = num_kv_heads * head_dim, dv = st->dv, nq = st->nq;
  const long qv = (nq + LANES - 1) / LANES;
  float qt[PLAIT_MAX_HEAD_DIM * QMAX * LANES] __attribute__((aligned(64)));
  /* +4: the value pass reads 4 queries at a time, past nq in its last group */
  float prob[LANES][QMAX * LANES + 4] __attribute__((aligned(64)));
  float scale_by[QMAX * LANES] __attribute__((aligned(64)));
  /* bf16: the LANES tokens' K and V rows widened, read by the loops below as float32 rows */
  float kw[LANES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  float vw[LANES * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  vf m[QMAX], l[QMAX];
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
    vf sc[LANES][QMAX];
    for (long j0 = 0; j0 < n; j0 += TB) {  /* scores: TB tokens x QMAX vectors in registers */
      const float *kr[TB];
      vf part[TB][QMAX];
      for (int j = 0; j < TB; j++) {  /* past n: the last token again, ignored */
        kr[j] = kb + (j0 + j < n ? j0 + j : n - 1) * rs;
        for (int v = 0; v < QMAX; v++) part[j][v] = (vf){0};
        if (j0 + j < n) prefetch_rows(&sp, j0 + j, stride, head_dim, bf16);
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
    if (var && (st->softcap > 0 || t < st->lo_max)) shape_scores(st, sc, t, n, qv);
    for (long v = 0; v < qv; v++)  /* online softmax, all queries at once */
      *(vf *)&scale_by[v * LANES] = softmax_update(&m[v], &l[v], (const float *)&sc[0][v],
                                                   QMAX * LANES, &prob[0][v * LANES],
                                                   QMAX * LANES + 4, n, 0, 0);
    for (long d = 0; d < dv; d++) {  /* acc = acc * alpha + sum_j p_j V_j, 4 queries a pass */
      for (long a0 = 0; a0 < nq; a0 += 4) {
        vf r[4];
        const int na = nq - a0 < 4 ? (int)(nq - a0) : 4;
        for (int u = 0; u < 4; u++)
          r[u] = u < na ? st->acc[(a0 + u) * dv + d] * scale_by[a0 + u] : (vf){0};
        for (long j = 0; j < n; j++) {
          const vf vv = *(const vf *)(vb + j * rs + d * LANES);
          _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) r[u] += prob[j][a0 + u] * vv;
        }
        for (int u = 0; u < na; u++) st->acc[(a0 + u) * dv + d] = r[u];
      }
    }
    t += n;
  }
  store_running(st, m, l);
}

#include "attention_bf16.h"

/* Queries [a0, a0 + G) of `st` attend the n tokens of one block whose rows of their KV
 * head start at sp->k / sp->v (a stride of `stride` elements from token to token), token by
 * token:
 * one dot product per token and query (for the few queries of one row the transpose of
 * `attend_shared` costs more than it saves). */
#define OWN_GMAX 4  /* the largest G and DV `own_block` specialises for */
#define OWN_DVMAX 8
INLINE void own_block_fixed(state_t *st, long a0, const int G, const int DV, const span_t *sp,
                            long n, long stride, const int bf16, const int var) {
  /* own_block for G queries of DV vectors known at compile time: the queries and the
   * weighted sums stay in registers for the whole block */
  const long head_dim = DV * LANES;
  /* arrays of constant size (the largest G and DV `own_block` passes): sized by G and DV
   * they would be VLAs, allocated on the stack per iteration, not kept in registers */
  float s[OWN_GMAX][PLAIT_MAX_BLOCK + LANES] __attribute__((aligned(64)));
  vf qr[OWN_GMAX][OWN_DVMAX];
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) qr[g][d] = *(const vf *)(st->q + (a0 + g) * head_dim + d * LANES);
  for (long j = 0; j < n; j++) {  /* scores */
    const void *kj = kv_at(sp->k, j * stride, bf16);
    prefetch_rows(sp, j, stride, head_dim, bf16);
    vf kv[OWN_DVMAX];
    for (int d = 0; d < DV; d++) kv[d] = load_kv(kj, d * LANES, bf16);
    for (int g = 0; g < G; g++) {
      vf dot = qr[g][0] * kv[0];
      for (int d = 1; d < DV; d++) dot += qr[g][d] * kv[d];
      s[g][j] = hsum(dot);
    }
  }
  const long padded = (n + LANES - 1) / LANES * LANES;
  vf alpha[OWN_GMAX];
  for (int g = 0; g < G; g++) {  /* online softmax update */
    if (var && st->softcap > 0) cap_scores(s[g], padded, st->softcap);  /* pad reset next */
    for (long j = n; j < padded; j++) s[g][j] = -INFINITY;
    alpha[g] = update_query(st, a0 + g, s[g], padded);
  }
  vf r[OWN_GMAX][OWN_DVMAX];  /* acc = acc * alpha + sum_j p_j V_j */
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) r[g][d] = st->acc[(a0 + g) * DV + d] * alpha[g];
  for (long j = 0; j < n; j++) {
    const void *vj = kv_at(sp->v, j * stride, bf16);
    for (int d = 0; d < DV; d++) {
      const vf vv = load_kv(vj, d * LANES, bf16);
      for (int g = 0; g < G; g++) r[g][d] += s[g][j] * vv;
    }
  }
  for (int g = 0; g < G; g++)
    for (int d = 0; d < DV; d++) st->acc[(a0 + g) * DV + d] = r[g][d];
}

INLINE void own_block(state_t *st, long a0, long G, const span_t *sp, long n, long stride,
                      long head_dim, const int bf16, const int var) {
  const long dv = st->dv;
#define OWN_FIXED(g, d)                                    \
  if (G == g && dv == d) {                                 \
    own_block_fixed(st, a0, g, d, sp, n, stride, bf16, var); \
    return;                                                \
  }
  OWN_FIXED(1, 4) OWN_FIXED(2, 4) OWN_FIXED(3, 4) OWN_FIXED(4, 4) OWN_FIXED(1, 8) OWN_FIXED(2, 8)
#undef OWN_FIXED
  float s[PLAIT_MAX_QUERIES][PLAIT_MAX_BLOCK + LANES] __attribute__((aligned(64)));
  for (long j = 0; j < n; j++) {  /* scores */
    const void *kj = kv_at(sp->k, j * stride, bf16);
    prefetch_rows(sp, j, stride, head_dim, bf16);
    for (long g = 0; g < G; g++) {
      const float *qa = st->q + (a0 + g) * head_dim;
      vf dot = (vf){0};
      for (long d = 0; d < dv; d++)
        dot += *(const vf *)(qa + d * LANES) * load_kv(kj, d * LANES, bf16);
      s[g][j] = hsum(dot);
    }
  }
  const long padded = (n + LANES - 1) / LANES * LANES;
  for (long g = 0; g < G; g++) {  /* online softmax update; acc *= alpha */
    if (var && st->softcap > 0) cap_scores(s[g], padded, st->softcap);  /* pad reset next */
    for (long j = n; j < padded; j++) s[g][j] = -INFINITY;
    const vf alpha = update_query(st, a0 + g, s[g], padded);
    if (alpha[0] != 1.0f)  /* the max moved (vexp(0) is exactly 1) */
      for (long d = 0; d < dv; d++) st->acc[(a0 + g) * dv + d] *= alpha;
  }
  for (long j = 0; j < n; j++) {  /* acc += p V */
    const void *vj = kv_at(sp->v, j * stride, bf16);
    for (long d = 0; d < dv; d++) {
      const vf vv = load_kv(vj, d * LANES, bf16);
      for (long g = 0; g < G; g++) st->acc[(a0 + g) * dv + d] += s[g][j] * vv;
    }
  }
}

/* One row's queries attend tokens [t_from, t_to), block by block: those of KV heads
 * [h, h + nh) are `st`'s queries a0 + (hh - h) * G + g. With every KV head (a row alone),
 * each block's K and V rows are read whole, in order. */
INLINE void attend_own(state_t *st, long a0, long G, const int32_t *table, long t_from,
                       long t_to, const void *k_cache, const void *v_cache, long block_size,
                       long num_kv_heads, long h, long nh, long head_dim, const int bf16,
                       const int var) {
  for (long t = t_from; t < t_to;) {
    const long off = t % block_size;
    const long n = t - off + block_size < t_to ? block_size - off : t_to - t;
    for (long hh = h; hh < h + nh; hh++) {
      const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, hh,
                               head_dim, bf16);
      own_block(st, a0 + (hh - h) * G, G, &sp, n, num_kv_heads * head_dim, head_dim, bf16,
                var);
    }
    t += n;
  }
}

/* Tokens of a chunk's main range, the one split into pieces: its shared prefix, or a lone
 * row's whole context (`ctx_first`); 0 for rows with nothing in common. */
static inline long main_range(long shared, long rows, long ctx_first) {
  return shared > 0 ? shared : rows == 1 ? ctx_first : 0;
}

/* What one task of plait_decode_attention attends: tokens [from, to) of its chunk's main
 * range (shared > 0: read once for all the queries of `st`; else a lone row's context), and
 * when `last` (the chunk's last piece) each of the chunk's `rows` rows' own tokens [main,
 * ctx_len[r]) through its table, block_tables + table_rows[r] * table_stride. The queries of
 * `st` are those of KV heads [h0, h0 + nh), G per head and row. `dot` (a constant, with
 * bf16): the shared tokens through attention_bf16.h. `var` (a constant): a window or a
 * softcap, the code that applies them (shape_scores, cap_scores) compiled in; the copies
 * without it hold none (where it was only skipped at run time, its presence changed the
 * compiler's float choices elsewhere, an ulp off the results before the variants). With a
 * window, every range starts no
 * earlier than its rows' windows (st->lo_min for the main range, each row's own start for
 * its own tokens); the shared loops mask per query where the windows differ. */
INLINE void attend_task(state_t *st, long shared, long main, long from, long to, int last,
                        long rows, long G, const int32_t *block_tables, long table_stride,
                        const int64_t *table_rows, const int32_t *ctx_len, const void *k_cache,
                        const void *v_cache, long block_size, long num_kv_heads, long h0,
                        long nh, long head_dim, const int bf16, const int dot,
                        const int var) {
  const int32_t *table = block_tables + table_rows[0] * table_stride;
  from = from > st->lo_min ? from : st->lo_min;
  if (dot && shared > 0)
    attend_shared_dot(st, table, from, to, k_cache, v_cache, block_size, num_kv_heads, h0,
                      head_dim, var);
  else if (shared > 0)
    attend_shared(st, table, from, to, k_cache, v_cache, block_size, num_kv_heads, h0,
                  head_dim, bf16, var);
  else if (main > 0)
    attend_own(st, 0, G, table, from, to, k_cache, v_cache, block_size, num_kv_heads, h0, nh,
               head_dim, bf16, var);
  if (last)
    for (long r = 0; r < rows; r++) {
      const long lo = window_start(ctx_len[r], st->window);
      attend_own(st, r * nh * G, G, block_tables + table_rows[r] * table_stride,
                 lo > main ? lo : main, ctx_len[r], k_cache, v_cache, block_size,
                 num_kv_heads, h0, nh, head_dim, bf16, var);
    }
}

/* attend_task over float32 caches, over bfloat16 caches, and over bfloat16 caches with
 * bfloat16 dot products (PLAIT_ATTN_BF16_DOT; builds without AVX512-BF16: the second),
 * each without and with the variants (_var: a window or a softcap). */
#define TASK_PARAMS                                                                          \
  state_t *st, long shared, long main, long from, long to, int last, long rows, long G,      \
      const int32_t *block_tables, long table_stride, const int64_t *table_rows,             \
      const int32_t *ctx_len, const void *k_cache, const void *v_cache, long block_size,     \
      long num_kv_heads, long h0, long nh, long head_dim
#define TASK_ARGS                                                                            \
  st, shared, main, from, to, last, rows, G, block_tables, table_stride, table_rows, ctx_len, \
      k_cache, v_cache, block_size, num_kv_heads, h0, nh, head_dim
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

/* Decode attention: one query token per sequence over its paged K/V, read in place.
 *
 * Sequences come in chunks: chunk c is sequences chunk_start[c] .. chunk_start[c+1] - 1,
 * whose first chunk_shared[c] tokens are the same cache blocks (those of the chunk's first
 * sequence's table; 0 for a chunk of one). Sequence i's query row is q[q_rows[i]] ([H, D],
 * row stride q_stride floats); it attends its tokens 0 .. ctx_len[i] - 1, whose blocks are
 * block_tables[table_rows[i] * table_stride + t / block_size] (int32), in the caches
 * k_cache / v_cache [num_blocks, block_size, H_kv, D] (contiguous) of kv_dtype elements
 * (PLAIT_KV_F32, or PLAIT_KV_BF16: widened to float32, exactly, as they are read; the
 * arithmetic is float32 either way; PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT: the shared tokens
 * with bfloat16 products, plait_cpu.h); query head h reads KV head h / (H / H_kv). A task
 * is one piece of one chunk and one KV head: it reads the shared tokens once for all the
 * chunk's queries (cascade attention: one online softmax continues over each row's own
 * tokens). When chunks x KV heads are too few to keep every
 * thread busy (one long prompt's n choices, or a single stream), a chunk's main range (its
 * shared tokens, or a lone row's context) is split into pieces of whole blocks attended in
 * parallel, whose partial softmaxes are then merged (flash-decoding); the rows' own tokens
 * go with the last piece. Writes sequence i's [H, D] (dense) to out row out_rows[i], or to
 * row i (chunk order) when out_rows is NULL.
 * The variants (0: off): `window` > 0, sequence i attends only tokens [ctx_len[i] - window,
 * ctx_len[i]) (its query at ctx_len[i] - 1 and window - 1 earlier): its own tokens start
 * there, a chunk's shared tokens (and a lone row's pieces) from the lowest row's window
 * start, masked per query in the slices where the rows' windows differ (positions compared
 * as float32: exact below 2^24); `softcap` > 0, every score s (scale q.k) becomes softcap *
 * tanh(s / softcap) before the softmax (vtanh, a few ulps).
 * D must be a multiple of LANES and every sequence must attend at least one token.
 * Returns 0, -1 if the shapes exceed this kernel's limits (or window, softcap < 0), -2 if
 * out of memory. */
#define OUT_ROW(i) (out_rows ? out_rows[i] : (i))
int plait_decode_attention(const float *q, long q_stride, const void *k_cache,
                           const void *v_cache, int kv_dtype, long block_size, long num_kv_heads,
                           long num_heads, long head_dim, const int32_t *block_tables,
                           long table_stride, long num_chunks, const int64_t *chunk_start,
                           const int32_t *chunk_shared, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *ctx_len, float scale,
                           long window, float softcap, float *out, const int64_t *out_rows) {
  if (num_kv_heads < 1 || num_heads % num_kv_heads || head_dim % LANES || window < 0 ||
      !(softcap >= 0) ||
      head_dim > PLAIT_MAX_HEAD_DIM || block_size > PLAIT_MAX_BLOCK ||
      (kv_dtype != PLAIT_KV_F32 && kv_dtype != PLAIT_KV_BF16 &&
       kv_dtype != (PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT)))
    return PLAIT_ERR_SHAPES;
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
  /* pieces: chunk c's are first_piece[c] .. first_piece[c + 1] - 1; they split its main
   * range from chunk_base[c] (0, or with a window the block of its rows' lowest window
   * start: the blocks before it are not read) */
  long *first_piece = malloc((2 * num_chunks + 1) * sizeof(long));
  if (!first_piece) return PLAIT_ERR_NOMEM;
  long *chunk_base = first_piece + num_chunks + 1;
  const long want = PIECE_TASKS * omp_get_max_threads();
  long split = (want + num_chunks * num_kv_heads - 1) / (num_chunks * num_kv_heads);
  split = split > MAX_PIECES_MERGED ? MAX_PIECES_MERGED : split;
  first_piece[0] = 0;
  for (long c = 0; c < num_chunks; c++) {
    const long first = chunk_start[c], rows = chunk_start[c + 1] - first;
    const long main = main_range(chunk_shared[c], rows, ctx_len[first]);
    long lo = main;
    for (long r = 0; r < rows && window > 0; r++) {
      const long start = window_start(ctx_len[first + r], window);
      lo = start < lo ? start : lo;
    }
    chunk_base[c] = window > 0 ? lo / block_size * block_size : 0;
    long pieces = (main - chunk_base[c]) / (PIECE_BLOCKS * block_size);
    pieces = pieces < 1 ? 1 : pieces < split ? pieces : split;
    first_piece[c + 1] = first_piece[c] + pieces;
  }
  const long num_pieces = first_piece[num_chunks];
  const long part = PLAIT_MAX_QUERIES * (head_dim + 2);  /* a piece's m, l, acc per KV head */
  float *parts = NULL;
  if (num_pieces > num_chunks) {
    parts = malloc(num_pieces * num_kv_heads * part * sizeof(float));
    if (!parts) {
      free(first_piece);
      return PLAIT_ERR_NOMEM;
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
      const int whole =
          rows == 1 && shared == 0 && pieces == 1 && num_heads <= PLAIT_MAX_QUERIES;
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
      const long main = main_range(shared, rows, ctx_len[first]), base = chunk_base[c];
      /* this piece's share of the main range from its base, in whole blocks */
      const long main_blocks = (main - base + block_size - 1) / block_size;
      const long from = base + p * main_blocks / pieces * block_size;
      const long to =
          p + 1 == pieces ? main : base + (p + 1) * main_blocks / pieces * block_size;
      task_fn(
          &st, shared, main, from, to, p + 1 == pieces, rows, G, block_tables, table_stride,
          table_rows + first, ctx_len + first, k_cache, v_cache, block_size, num_kv_heads, h0,
          nh, head_dim);
      if (pieces == 1) {
        for (long a = 0; a < st.nq; a++) {
          const long r = a / (nh * G), head = (h0 + a / G % nh) * G + a % G;
          const float inv = 1.0f / l[a];
          float *o = out + (OUT_ROW(first + r) * num_heads + head) * head_dim;
          for (long d = 0; d < st.dv; d++) *(vf *)(o + d * LANES) = acc[a * st.dv + d] * inv;
        }
      } else {  /* nh == 1 */
        float *dst = parts + task * part;  /* [m | l | acc] of this piece and head */
        memcpy(dst, m, rows * G * sizeof(float));
        memcpy(dst + PLAIT_MAX_QUERIES, l, rows * G * sizeof(float));
        memcpy(dst + 2 * PLAIT_MAX_QUERIES, acc, rows * G * head_dim * sizeof(float));
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
          sum += w[p] * src[PLAIT_MAX_QUERIES + a];
        }
        const long r = a / G, g = a % G;
        float *o = out + (OUT_ROW(first + r) * num_heads + h * G + g) * head_dim;
        for (long d = 0; d < head_dim; d++) {
          float v = 0.0f;
          for (long p = 0; p < pieces; p++)
            v += w[p] * parts[((p0 + p) * num_kv_heads + h) * part + 2 * PLAIT_MAX_QUERIES +
                              a * head_dim + d];
          o[d] = v / sum;
        }
      }
    }
  }
  free(parts);
  free(first_piece);
  return PLAIT_OK;
}
