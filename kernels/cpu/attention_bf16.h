/* attention.c's attend_shared in bfloat16 (AVX512-BF16), for kv_dtype PLAIT_KV_BF16 |
 * PLAIT_ATTN_BF16_DOT (plait_cpu.h): the tokens a chunk's rows share, read once for all
 * their queries, with the two products by vdpbf16ps, 32 bfloat16 products a vector where
 * the float32 loop's FMA takes 16. Included by attention.c after attend_shared, whose state,
 * block walk (locate, prefetch_rows) and online softmax (softmax_update) it reads.
 *
 * vdpbf16ps adds, in float32 lane i, the products of bfloat16 words 2 i and 2 i + 1 of its
 * two operands (each product exact: 8 x 8 significant bits), so each operand pairs its
 * elements along the dimension the sum runs over:
 *
 *   scores s[t][a] = sum_d q[a][d] k[t][d]    pairs along d:
 *     qp [D/2][queries]: word (q[a][2 i], q[a][2 i + 1]), 16 queries a vector (the queries
 *        across the lanes, as attend_shared's transpose), rounded once per call;
 *     k: a token's row is pairs along d already; word i broadcast to every lane.
 *   sums o[a][d] += sum_t p[t][a] v[t][d]    pairs along t (two tokens):
 *     pp [tokens/2][queries]: word (p[2 j][a], p[2 j + 1][a]), 16 queries a vector (an odd
 *        block's last pair: p = 0);
 *     vp [tokens/2][D]: word (v[2 j][d], v[2 j + 1][d]), the two rows interleaved by vpermw
 *        once per block (an odd block's last pair: a zero row), word d broadcast;
 *     so the sums run with the queries across the lanes too: acc_t [D][queries], the
 *     state's [queries][D] transposed (16 x 16 tiles) once on entry and once on exit.
 *
 * Rounding: q (already scaled) to nearest even by vcvtne2ps2bf16 (a float32 denormal reads
 * as zero; vdpbf16ps would read a bfloat16 denormal as zero anyway); the weights p to
 * nearest even by softmax_update's round_p, which also sums the rounded weights into l, so
 * the output is sum p~ v / sum p~ with the same p~ on both sides: a convex combination of
 * the V rows whose weights are off by at most 2^-8 relative each (a constant V comes out as
 * itself to float32 rounding, and an error common to all the weights cancels); l summing
 * the unrounded p would leave the output's scale off by the rounding errors' weighted mean.
 * K and V are the cache's bfloat16 values, exact. The running max, exp and normaliser stay
 * float32. A window's mask and a softcap apply to the float32 scores as in attend_shared
 * (shape_scores). */
#ifndef PLAIT_CPU_ATTENTION_BF16_H
#define PLAIT_CPU_ATTENTION_BF16_H

#if LANES == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define ATTN_BF16_DOT 1

/* A chunk's query vectors at most (attend_shared's QMAX), query columns of qp, pp, acc_t. */
#define DOT_QV (PLAIT_MAX_QUERIES / LANES)
#define DOT_QW (DOT_QV * LANES)
/* Tokens per pass of the score loop: DOT_TB x QV accumulators in registers. */
#define DOT_TB 8

typedef uint32_t word_t __attribute__((may_alias, aligned(4)));  /* a bfloat16 pair */

/* vpermw's indices that interleave a 512-bit [a 0..15 | b 0..15] into words (a[i], b[i]). */
static const uint16_t PAIR_WORDS[32] __attribute__((aligned(64))) = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const uint16_t ZERO_ROW[PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));

/* out[k] lane i = in[i] lane k: a 16 x 16 transpose of 32-bit elements in registers. */
static inline void transpose16(const __m512 in[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; i++) {  /* pairs of rows interleaved, then quads, then 128-bit */
    t[2 * i] = _mm512_unpacklo_ps(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    u[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    out[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    out[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    out[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    out[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

/* qp[i * DOT_QW + a] = the pair (2 i, 2 i + 1) of query a of `st` rounded to bfloat16, for
 * a < qv * LANES (zero past nq), i < D / 2: per 16 queries and 32 dimensions, each query's
 * 16 pairs (one vcvtne2ps2bf16) transposed to 16 pair vectors. */
static inline void round_queries(const state_t *st, long qv, long head_dim, word_t *qp) {
  for (long a0 = 0; a0 < qv * LANES; a0 += LANES)
    for (long d = 0; d < head_dim; d += 2 * LANES) {
      const int half = d + LANES == head_dim;  /* D an odd multiple of 16: its last 16 */
      __m512 in[16], out[16];
      for (int i = 0; i < 16; i++) {
        const float *q = st->q + (a0 + i) * head_dim + d;
        in[i] = _mm512_setzero_ps();
        if (a0 + i < st->nq) {
          const __m512 hi = half ? _mm512_setzero_ps() : _mm512_load_ps(q + LANES);
          in[i] = (__m512)_mm512_cvtne2ps_pbh(hi, _mm512_load_ps(q));
        }
      }
      transpose16(in, out);
      for (int k = 0; k < (half ? 8 : 16); k++)
        _mm512_store_ps((float *)(qp + (d / 2 + k) * DOT_QW + a0), out[k]);
    }
}

/* The weighted sums of `st` transposed, to or from acc_t [D][DOT_QW] (query a in column a:
 * queries across the lanes, as the value loop adds them; zero past nq), qv query vectors,
 * a 16 x 16 tile at a time. */
static inline void transpose_sums(state_t *st, float *acc_t, long qv, long head_dim,
                                  int to_t) {
  const long dv = st->dv, nq = st->nq;
  for (long a0 = 0; a0 < qv * LANES; a0 += LANES)
    for (long dd = 0; dd < dv; dd++) {
      __m512 in[16], out[16];
      float *tile = acc_t + dd * LANES * DOT_QW + a0;  /* rows dd * 16 + k, DOT_QW apart */
      for (int i = 0; i < 16; i++)
        in[i] = to_t ? (a0 + i < nq ? (__m512)st->acc[(a0 + i) * dv + dd] : _mm512_setzero_ps())
                     : _mm512_load_ps(tile + i * DOT_QW);
      transpose16(in, out);
      for (int k = 0; k < 16; k++)
        if (to_t)
          _mm512_store_ps(tile + k * DOT_QW, out[k]);
        else if (a0 + k < nq)
          st->acc[(a0 + k) * dv + dd] = (vf)out[k];
    }
}

/* sc[j][v] = the scores of tokens j < n of one block (K rows from sp->k, `stride` elements
 * apart) for query vectors v < QV (a constant), float32 sums of exact products. */
INLINE void block_scores(const int QV, const word_t *qp, const span_t *sp, long n,
                         long stride, long head_dim, vf sc[LANES][DOT_QV]) {
  for (long j0 = 0; j0 < n; j0 += DOT_TB) {
    const word_t *kr[DOT_TB];
    __m512 part[DOT_TB][DOT_QV];
    for (int j = 0; j < DOT_TB; j++) {  /* past n: the last token again, ignored */
      kr[j] = kv_at(sp->k, (j0 + j < n ? j0 + j : n - 1) * stride, 1);
      for (int v = 0; v < QV; v++) part[j][v] = _mm512_setzero_ps();
      if (j0 + j < n) prefetch_rows(sp, j0 + j, stride, head_dim, 1);
    }
    for (long i = 0; i < head_dim / 2; i++) {
      __m512bh qd[DOT_QV];
      for (int v = 0; v < QV; v++) qd[v] = (__m512bh)_mm512_load_si512(qp + i * DOT_QW + v * LANES);
      _Pragma("GCC unroll 8") for (int j = 0; j < DOT_TB; j++) {
        const __m512bh kd = (__m512bh)_mm512_set1_epi32((int)kr[j][i]);
        _Pragma("GCC unroll 3") for (int v = 0; v < QV; v++)
          part[j][v] = _mm512_dpbf16_ps(part[j][v], qd[v], kd);
      }
    }
    for (long j = 0; j < DOT_TB && j0 + j < n; j++)
      for (int v = 0; v < QV; v++) sc[j0 + j][v] = (vf)part[j][v];
  }
}

/* vp[j * D + d] = (v[2 j][d], v[2 j + 1][d]) for the block's n V rows (`stride` apart),
 * pairs j < (n + 1) / 2; an odd n's last pair takes a zero row. */
static inline void pair_values(const void *v, long n, long stride, long head_dim,
                               word_t *vp) {
  const __m512i idx = _mm512_load_si512(PAIR_WORDS);
  for (long j = 0; 2 * j < n; j++) {
    const uint16_t *a = kv_at(v, 2 * j * stride, 1);
    const uint16_t *b = 2 * j + 1 < n ? kv_at(v, (2 * j + 1) * stride, 1) : ZERO_ROW;
    for (long d = 0; d < head_dim; d += LANES) {
      const __m512i ab = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(a + d))),
          _mm256_loadu_si256((const __m256i *)(b + d)), 1);
      _mm512_store_si512(vp + j * head_dim + d, _mm512_permutexvar_epi16(idx, ab));
    }
  }
}

/* pp[j * DOT_QW + a] = (p[2 j][a], p[2 j + 1][a]) of the rounded weights prob [n][DOT_QW]
 * (their low halves zero, so a pair is a shift and an or), query vectors v < qv; an odd n's
 * last pair takes p = 0. */
static inline void pair_weights(const float *prob, long n, long qv, word_t *pp) {
  for (long j = 0; 2 * j < n; j++)
    for (long v = 0; v < qv; v++) {
      const __m512i lo = _mm512_load_si512(prob + 2 * j * DOT_QW + v * LANES);
      const __m512i hi = 2 * j + 1 < n
                             ? _mm512_load_si512(prob + (2 * j + 1) * DOT_QW + v * LANES)
                             : _mm512_setzero_si512();
      _mm512_store_si512(pp + j * DOT_QW + v * LANES,
                         _mm512_or_si512(hi, _mm512_srli_epi32(lo, 16)));
    }
}

/* acc_t[d][a] = acc_t[d][a] * scale_by[a] + sum_j p[j][a] v[j][d] over the block's pairs
 * j < np, for query vectors v < QV (a constant): the score loop's shape with the roles
 * swapped (weight pairs across the lanes, a V pair broadcast), DT dimensions x QV vectors
 * of accumulators in registers a pass. */
INLINE void add_values(const int QV, float *acc_t, const float *scale_by, const word_t *vp,
                       const word_t *pp, long np, long head_dim) {
  enum { DT = 8 };
  __m512 alpha[DOT_QV];
  for (int v = 0; v < QV; v++) alpha[v] = _mm512_load_ps(scale_by + v * LANES);
  for (long d0 = 0; d0 < head_dim; d0 += DT) {
    __m512 r[DT][DOT_QV];
    for (int dt = 0; dt < DT; dt++)
      for (int v = 0; v < QV; v++)
        r[dt][v] = _mm512_mul_ps(_mm512_load_ps(acc_t + (d0 + dt) * DOT_QW + v * LANES),
                                 alpha[v]);
    for (long j = 0; j < np; j++) {
      __m512bh pv[DOT_QV];
      for (int v = 0; v < QV; v++) pv[v] = (__m512bh)_mm512_load_si512(pp + j * DOT_QW + v * LANES);
      _Pragma("GCC unroll 8") for (int dt = 0; dt < DT; dt++) {
        const __m512bh vd = (__m512bh)_mm512_set1_epi32((int)vp[j * head_dim + d0 + dt]);
        _Pragma("GCC unroll 3") for (int v = 0; v < QV; v++)
          r[dt][v] = _mm512_dpbf16_ps(r[dt][v], pv[v], vd);
      }
    }
    for (int dt = 0; dt < DT; dt++)
      for (int v = 0; v < QV; v++)
        _mm512_store_ps(acc_t + (d0 + dt) * DOT_QW + v * LANES, r[dt][v]);
  }
}

/* attend_shared's contract (every query of `st` attends tokens [t_from, t_to) of KV head h
 * through `table`, once for all of them) over a bfloat16 cache, with QV = ceil(nq / LANES)
 * query vectors (a constant: a decode chunk of a few rows computes no empty vector). */
INLINE void attend_shared_dot_qv(const int QV, const int VAR, state_t *st,
                                 const int32_t *table, long t_from, long t_to,
                                 const void *k_cache, const void *v_cache, long block_size,
                                 long num_kv_heads, long h, long head_dim) {
  const long stride = num_kv_heads * head_dim;
  word_t qp[PLAIT_MAX_HEAD_DIM / 2 * DOT_QW] __attribute__((aligned(64)));
  float acc_t[PLAIT_MAX_HEAD_DIM * DOT_QW] __attribute__((aligned(64)));
  word_t vp[LANES / 2 * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  word_t pp[LANES / 2 * DOT_QW] __attribute__((aligned(64)));
  float prob[LANES * DOT_QW] __attribute__((aligned(64)));
  float scale_by[DOT_QW] __attribute__((aligned(64)));
  vf m[DOT_QV], l[DOT_QV];
  round_queries(st, QV, head_dim, qp);
  transpose_sums(st, acc_t, QV, head_dim, 1);
  load_running(st, QV, m, l);
  for (long t = t_from; t < t_to;) {
    const long n = slice_len(t, t_to, block_size);
    const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                             head_dim, 1);
    vf sc[LANES][DOT_QV];
    block_scores(QV, qp, &sp, n, stride, head_dim, sc);
    if (VAR && (st->softcap > 0 || t < st->lo_max)) shape_scores(st, sc, t, n, QV);
    for (long v = 0; v < QV; v++)  /* online softmax, the weights rounded to bfloat16 */
      *(vf *)&scale_by[v * LANES] = softmax_update(&m[v], &l[v], (const float *)&sc[0][v],
                                                   DOT_QW, prob + v * LANES, DOT_QW, n, 1);
    pair_values(sp.v, n, stride, head_dim, vp);
    pair_weights(prob, n, QV, pp);
    add_values(QV, acc_t, scale_by, vp, pp, (n + 1) / 2, head_dim);
    t += n;
  }
  transpose_sums(st, acc_t, QV, head_dim, 0);
  store_running(st, m, l);
}

/* `var`: a window or a softcap (attend_task's), its copies of the loops. */
INLINE void attend_shared_dot(state_t *st, const int32_t *table, long t_from, long t_to,
                              const void *k_cache, const void *v_cache, long block_size,
                              long num_kv_heads, long h, long head_dim, int var) {
#define DOT_ARGS st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h, head_dim
  switch ((st->nq + LANES - 1) / LANES + (var ? 3 : 0)) {
    case 1: attend_shared_dot_qv(1, 0, DOT_ARGS); return;
    case 2: attend_shared_dot_qv(2, 0, DOT_ARGS); return;
    case 3: attend_shared_dot_qv(DOT_QV, 0, DOT_ARGS); return;
    case 4: attend_shared_dot_qv(1, 1, DOT_ARGS); return;
    case 5: attend_shared_dot_qv(2, 1, DOT_ARGS); return;
    default: attend_shared_dot_qv(DOT_QV, 1, DOT_ARGS); return;
  }
#undef DOT_ARGS
}
/* The most queries attend_few_dot takes: one head's G (at most FEW_ONE), or several heads'
 * (few_heads: at most FEW_HEADS heads, FEW_MAX queries). */
#define FEW_ONE 8
#define FEW_MAX 14
#define FEW_HEADS 3

/* One query's lane of softmax_update for attend_few_dot and attention.c's attend_few (the
 * tokens across the lanes): query a's scores s of tokens t .. t + 15 (`live` the slice's
 * lanes) capped and masked to its window (VAR), its running max st->m[a] moved to the
 * slice's, *alpha = e^(old max - new max); returns e^(s - new max), the caller's weights
 * before it rounds or stores them. Every e^ is softmax_exp's for `DOT` (a constant: 1 in
 * attend_few_dot, as its shared loop's softmax_update takes them; 0 in attend_few). */
INLINE vf few_weights(state_t *st, int a, vf s, long t, __mmask16 live, const int VAR,
                      const int DOT, float *alpha) {
  if (VAR && st->softcap > 0) s = st->softcap * vtanh(s * (1.0f / st->softcap));
  if (VAR && t < st->lo_max) {
    vf pos;
    for (int j = 0; j < LANES; j++) pos[j] = (float)(t + j);
    s = vselect(pos < vsplat(st->lo[a]), vsplat(-INFINITY), s);
  }
  const float top = _mm512_mask_reduce_max_ps(live, (__m512)s);
  const float mx = top > st->m[a] ? top : st->m[a];
  *alpha = softmax_exp(vsplat(st->m[a] - mx), DOT)[0];
  st->m[a] = mx;
  return softmax_exp(s - vsplat(mx), DOT);
}

/* A query's weighted sum of values, acc [D/16] = acc * alpha + sum_j p_j V_j, over the
 * slice's (p, V) pairs j < (n + 1) / 2 (vp: pair_values' words; e: the rounded weights,
 * 0 past n): per dimension vector one vdpbf16ps chain in pair order, four chains a pass in
 * registers. */
INLINE void few_values(const float *e, long n, float alpha, const word_t *vp, long head_dim,
                       vf *acc) {
  const long dv = head_dim / LANES;
  const __m512 al = _mm512_set1_ps(alpha);
  for (long d0 = 0; d0 < dv; d0 += 4) {
    const int w = dv - d0 < 4 ? (int)(dv - d0) : 4;  /* 4 but for a D of 16 x (4 k + r) */
    __m512 r[4];
    for (int c = 0; c < 4; c++)
      r[c] = c < w ? _mm512_mul_ps((__m512)acc[d0 + c], al) : _mm512_setzero_ps();
    for (long j = 0; 2 * j < n; j++) {
      uint32_t lo, hi;
      memcpy(&lo, e + 2 * j, 4);
      memcpy(&hi, e + 2 * j + 1, 4);
      const __m512bh pw = (__m512bh)_mm512_set1_epi32((int)((hi & 0xffff0000u) | lo >> 16));
      const word_t *row = vp + j * head_dim + d0 * LANES;
      for (int c = 0; c < 4; c++)
        if (c < w) r[c] = _mm512_dpbf16_ps(r[c], pw, (__m512bh)_mm512_load_si512(row + c * LANES));
    }
    for (int c = 0; c < w; c++) acc[d0 + c] = (vf)r[c];
  }
}

/* attend_shared_dot's arithmetic, bit for bit, for the few queries of one row (nq = NQ:
 * G per KV head, heads h .. h + NQ / G - 1, query a of head h + a / G; a decode row's or a
 * prefill tile row's own tokens), with the tokens across the lanes instead of the queries:
 * a slice's K rows of each head transposed once into pair columns kt [D/2][tokens], each
 * query's scores one vector of its tokens (the same vdpbf16ps chain over the pairs, lane by
 * lane), its softmax weights summed in token order (as each lane of the shared loop sums
 * them), its weighted sum of values in its own [D] layout (the same vdpbf16ps over the same
 * (p, V) pairs, per dimension). A query's every rounding is the shared loop's, so its
 * result does not depend on which loop ran it, nor on how many heads one call takes; with
 * 16 queries' lanes for G = 3 the shared loop would waste 13 in 16. Several heads a call
 * (a lone decode row's, attend_own): one walk over the row's blocks reads each token's K
 * and V rows of all of them (contiguous in the cache) at once, and their queries' chains
 * interleave, where one head at a time left the vdpbf16ps chains' latency exposed. */
INLINE void attend_few_dot_nq(const int NQ, const int G, const int VAR, state_t *st,
                              const int32_t *table, long t_from, long t_to,
                              const void *k_cache, const void *v_cache, long block_size,
                              long num_kv_heads, long h, long head_dim) {
  /* NQ, G (constants): NQ = st->nq, NH heads; the queries' chains interleaved, their sums in
   * registers */
  const int NH = NQ / G;
  const long stride = num_kv_heads * head_dim, dv = st->dv, pairs = head_dim / 2;
  word_t qw[FEW_MAX][PLAIT_MAX_HEAD_DIM / 2 + LANES] __attribute__((aligned(64)));
  __m512 kt[FEW_HEADS][PLAIT_MAX_HEAD_DIM / 2 + LANES];
  word_t vp[FEW_HEADS][LANES / 2 * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  float e[FEW_MAX][LANES] __attribute__((aligned(64)));
  for (int a = 0; a < NQ; a++)  /* round_queries' words, in the query's own order */
    for (long d = 0; d < head_dim; d += 2 * LANES) {
      const float *q = st->q + a * head_dim + d;
      const __m512 hi = d + LANES == head_dim ? _mm512_setzero_ps() : _mm512_load_ps(q + LANES);
      _mm512_store_si512(qw[a] + d / 2, (__m512i)_mm512_cvtne2ps_pbh(hi, _mm512_load_ps(q)));
    }
  for (long t = t_from; t < t_to;) {
    const long n = slice_len(t, t_to, block_size);
    const __mmask16 live = (__mmask16)((1u << n) - 1);
    const span_t sp = locate(table, t, t_to, k_cache, v_cache, block_size, num_kv_heads, h,
                             head_dim, 1);
    for (int k = 0; k < NH; k++) {
      const void *kh = kv_at(sp.k, k * head_dim, 1);
      /* head k's rows of the block ahead, a token at a time as its K rows are read */
      const span_t ahead = {NULL, NULL, sp.kp ? kv_at(sp.kp, k * head_dim, 1) : NULL,
                            sp.vp ? kv_at(sp.vp, k * head_dim, 1) : NULL};
      for (long i0 = 0; i0 < pairs; i0 += LANES) {  /* kt[k][i][j]: pair word i of token j */
        const __mmask16 words =
            pairs - i0 >= LANES ? 0xffff : (__mmask16)((1u << (pairs - i0)) - 1);
        __m512 in[16], out[16];
        for (int j = 0; j < 16; j++) {
          in[j] = _mm512_setzero_ps();
          if (j < n) {
            in[j] = _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
                words, (const word_t *)kv_at(kh, j * stride, 1) + i0));
            if (i0 == 0) prefetch_rows(&ahead, j, stride, head_dim, 1);
          }
        }
        transpose16(in, out);
        for (int c = 0; c < 16 && i0 + c < pairs; c++) kt[k][i0 + c] = out[c];
      }
      pair_values(kv_at(sp.v, k * head_dim, 1), n, stride, head_dim, vp[k]);
    }
    __m512 sc[FEW_MAX];
    for (int a = 0; a < NQ; a++) sc[a] = _mm512_setzero_ps();
    for (long i = 0; i < pairs; i++)
      for (int a = 0; a < NQ; a++)
        sc[a] = _mm512_dpbf16_ps(sc[a], (__m512bh)_mm512_set1_epi32((int)qw[a][i]),
                                 (__m512bh)kt[a / G][i]);
    float alpha[FEW_MAX], sum[FEW_MAX];
    for (int a = 0; a < NQ; a++) {
      vf w = few_weights(st, a, (vf)sc[a], t, live, VAR, 1, &alpha[a]);
      /* the weights, 0 past n (an odd n's last pair: p = 0) */
      _mm512_store_ps(e[a], _mm512_maskz_mov_ps(live, (__m512)round_to_bf16(w)));
      sum[a] = 0.0f;
    }
    for (long j = 0; j < n; j++)  /* in token order, as each lane of the shared loop */
      for (int a = 0; a < NQ; a++) sum[a] += e[a][j];
    for (int a = 0; a < NQ; a++) {  /* each (query, dimension) chain in pair order */
      st->l[a] = st->l[a] * alpha[a] + sum[a];
      few_values(e[a], n, alpha[a], vp[a / G], head_dim, st->acc + a * dv);
    }
    t += n;
  }
}

/* The queries of `st` (G per KV head, heads h, h + 1, ...) attend tokens [t_from, t_to):
 * one head at a time (nq = G <= FEW_ONE), or, without a window or a softcap, the heads of
 * a row together (few_heads: nq = NH x G). */
INLINE void attend_few_dot(const int VAR, state_t *st, long G, const int32_t *table,
                           long t_from, long t_to, const void *k_cache, const void *v_cache,
                           long block_size, long num_kv_heads, long h, long head_dim) {
#define FEW_ARGS st, table, t_from, t_to, k_cache, v_cache, block_size, num_kv_heads, h, head_dim
  if (st->nq == G) {
    switch (G) {
      case 1: attend_few_dot_nq(1, 1, VAR, FEW_ARGS); return;
      case 2: attend_few_dot_nq(2, 2, VAR, FEW_ARGS); return;
      case 3: attend_few_dot_nq(3, 3, VAR, FEW_ARGS); return;
      case 4: attend_few_dot_nq(4, 4, VAR, FEW_ARGS); return;
      case 5: attend_few_dot_nq(5, 5, VAR, FEW_ARGS); return;
      case 6: attend_few_dot_nq(6, 6, VAR, FEW_ARGS); return;
      case 7: attend_few_dot_nq(7, 7, VAR, FEW_ARGS); return;
      default: attend_few_dot_nq(8, 8, VAR, FEW_ARGS); return;  /* 8: the caller's limit */
    }
  }
  switch (st->nq / G * 8 + G) {  /* few_heads' shapes; never VAR */
    case 2 * 8 + 1: attend_few_dot_nq(2, 1, 0, FEW_ARGS); return;
    case 3 * 8 + 1: attend_few_dot_nq(3, 1, 0, FEW_ARGS); return;
    case 2 * 8 + 2: attend_few_dot_nq(4, 2, 0, FEW_ARGS); return;
    case 3 * 8 + 2: attend_few_dot_nq(6, 2, 0, FEW_ARGS); return;
    case 2 * 8 + 3: attend_few_dot_nq(6, 3, 0, FEW_ARGS); return;
    case 3 * 8 + 3: attend_few_dot_nq(9, 3, 0, FEW_ARGS); return;
    case 2 * 8 + 4: attend_few_dot_nq(8, 4, 0, FEW_ARGS); return;
    case 3 * 8 + 4: attend_few_dot_nq(12, 4, 0, FEW_ARGS); return;
    case 2 * 8 + 5: attend_few_dot_nq(10, 5, 0, FEW_ARGS); return;
    case 2 * 8 + 6: attend_few_dot_nq(12, 6, 0, FEW_ARGS); return;
    default: attend_few_dot_nq(14, 7, 0, FEW_ARGS); return;  /* 2 x 7: few_heads' last */
  }
#undef FEW_ARGS
}

/* How many of a row's `left` KV heads (G queries each) one attend_few_dot call takes
 * together: 3 for G <= 4, 2 for G <= 7 (at most FEW_MAX queries, FEW_HEADS heads), else
 * 1 (one head a call). */
static inline long few_heads(long G, long left) {
  const long most = G <= 4 ? 3 : G <= 7 ? 2 : 1;
  return left < most ? left : most;
}

#else
#define ATTN_BF16_DOT 0
/* No AVX512-BF16: never called (attend_task passes dot = 0; the flag takes the bfloat16
 * copy). */
static inline void attend_shared_dot(state_t *st, const int32_t *table, long t_from,
                                     long t_to, const void *k_cache, const void *v_cache,
                                     long block_size, long num_kv_heads, long h,
                                     long head_dim, int var) {}
#define FEW_ONE 0
#define FEW_MAX 0
static inline long few_heads(long G, long left) { return 1; }
static inline void attend_few_dot(const int VAR, state_t *st, long G, const int32_t *table,
                                  long t_from, long t_to, const void *k_cache,
                                  const void *v_cache, long block_size, long num_kv_heads,
                                  long h, long head_dim) {}
#endif

#endif /* PLAIT_CPU_ATTENTION_BF16_H */
