/* Prompt rows' attention on AMX-BF16 tiles: plait_decode_attention with kv_dtype
 * PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT | PLAIT_ATTN_AMX (plait_cpu.h). Included by
 * attention.c after attention_bf16.h (transpose16, PAIR_WORDS) and the online softmax's
 * helpers.
 *
 * The engine attends a step's prompt rows in a pass of their own (the products'
 * prompt_rows), so their attention may have arithmetic of its own, as long as a prompt
 * row's bits never depend on the chunk, tile or step it came in: a cached prefix must give
 * what the cold prompt gives. Here every query column runs the same sequence of
 * operations over the same slices (slice_len's grid from token 0 to its own position),
 * and every tile operation computes an element from its own row and column only, so a
 * query's result is a function of its query, its tokens and nothing else: no shared
 * range, no own range, no cut that depends on the other rows.
 *
 * A group is up to 16 query columns of one KV head that read one block table (a prefill
 * tile's rows x the heads of the KV group; a lone row's G heads). Per 16-token slice:
 *
 *   scores  S^T = K Q^T     A  K rows       16 tokens x 32 d (64 bytes), from the cache
 *                           B  Q^T pairs    16 x (q[c][2 i], q[c][2 i + 1]), built once
 *                           C  S^T          16 tokens x 16 columns float32
 *   softmax per column (the queries across the lanes, as attend_shared): masked tokens
 *           (past the column's position) score -inf and weigh exactly 0; the weights are
 *           rounded to bfloat16 (nearest even) and l sums the rounded weights
 *   sums    O^T = V^T P^T   A  V^T          16 d x 16 tokens (32 bytes), from the
 *                                           sequence's V^T, made once per call
 *                           B  P^T pairs    8 x (p[2 i][c], p[2 i + 1][c]), the
 *                                           weights of tokens 2 i and 2 i + 1 paired
 *                           C  O^T          16 d x 16 columns float32, kept in memory:
 *                                           each slice scales them by alpha, a column a lane
 *
 * (The same products, in the same order per element, as O = P V with P the A tile and V's
 * rows paired into B tiles, this kernel's first form: the same bits, without a transpose
 * of the weights per slice and of V per slice and task.)
 *
 * Rounding: the pre-scaled queries and the weights to bfloat16 (nearest even), as
 * attention_bf16.h rounds them; K and V are the cache's values; the tile sums, the max,
 * exp and normaliser float32. The bits are not attention_bf16.h's (the tiles sum in their
 * own order): generated rows (decode, verification) never come here. A slice's masked
 * tokens add exact zeros and a slice wholly masked for a column leaves it as it was
 * (alpha = vexp(0) = 1), so the group's other columns cannot change a column's bits. */
#ifndef PLAIT_CPU_ATTENTION_AMX_H
#define PLAIT_CPU_ATTENTION_AMX_H

#if ATTN_BF16_DOT && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ATTN_AMX 1

#include "amx.h"

#define AX_COLS 16 /* query columns of a group: a score tile's columns */

/* The tiles: scores S^T (C), K rows (A), Q^T pairs (B), sums O (C), weights P (A), V
 * pairs (B). */
#define AX_S 0
#define AX_K 1
#define AX_Q 2
#define AX_O 3
#define AX_P 4
#define AX_V 5

static inline void ax_config(void) {
  const int colsb[8] = {64, 64, 64, 64, 32, 64, 0, 0};
  const int rows[8] = {16, 16, 16, 16, 16, 8, 0, 0};
  am_load_config(colsb, rows);
}

/* qt: the B tiles of Q^T, D / 32 of 16 rows x 16 pairs: row i of tile kk, column c =
 * (q[c][32 kk + 2 i], q[c][32 kk + 2 i + 1]), q = scale * the query, rounded to bfloat16
 * (nearest even); zero past nc. */
static inline void ax_queries(int nc, const float *const *qcol, float scale, long head_dim,
                              uint32_t *qt) {
  for (long kk = 0; kk < head_dim / 32; kk++) {
    __m512 in[16], out[16];
    for (int c = 0; c < AX_COLS; c++) {
      in[c] = _mm512_setzero_ps();
      if (c >= nc) continue;
      const __m512 lo = (__m512)(*(const vf *)(qcol[c] + 32 * kk) * scale);
      const __m512 hi = (__m512)(*(const vf *)(qcol[c] + 32 * kk + 16) * scale);
      in[c] = (__m512)_mm512_cvtne2ps_pbh(hi, lo);
    }
    transpose16(in, out);
    for (int i = 0; i < 16; i++) _mm512_store_ps((float *)(qt + (kk * 16 + i) * 16), out[i]);
  }
}

/* V^T of one sequence and KV head for tokens [0, ctx): vt[d * tpad + t] = v[t][d] (bfloat16
 * words), zero from ctx to tpad (ax_tpad(ctx)); tokens [t0, t0 + 16) of it. vh: the V
 * cache offset to the head; table: the sequence's blocks. 16 tokens x 16 d at a time,
 * widened to float32 (exact), transposed and narrowed back. */
static void ax_transpose_values(const uint16_t *vh, const int32_t *table, long block_size,
                                long stride, long head_dim, long ctx, long tpad, long t0,
                                uint16_t *vt) {
  __m512 in[16], out[16];
  for (long d0 = 0; d0 < head_dim; d0 += 16) {
    for (int j = 0; j < 16; j++) {
      const long t = t0 + j;
      in[j] = _mm512_setzero_ps();
      if (t < ctx) {
        const uint16_t *row = vh + (table[t / block_size] * block_size + t % block_size) * stride;
        in[j] = (__m512)widen_bf16(row + d0);
      }
    }
    transpose16(in, out);
    for (int k = 0; k < 16; k++)
      _mm256_storeu_si256((__m256i *)(vt + (d0 + k) * tpad + t0),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)out[k], 16)));
  }
}

/* A group: up to 16 query columns of one KV head and block table, its running softmax
 * (a column a lane) and its sums in memory, transposed: o[d * 16 + c] (O^T, C tiles of 16
 * d a tile). */
typedef struct {
  int nc;
  long ctx_max, ctx_min;
  vf ctx;   /* each column's token count, as float (exact below 2^24; 0 past nc) */
  vf m, l;  /* running max (from -FLT_MAX), normaliser of the rounded weights */
  float *const *ocol;
  uint32_t qt[PLAIT_MAX_HEAD_DIM / 2 * AX_COLS] __attribute__((aligned(64)));
  float o[AX_COLS * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
} ax_group_t;

/* g's columns: query qcol[c] (head_dim floats) times `scale` attends tokens [0, ctx[c])
 * (>= 1) and writes to ocol[c]. */
static inline void ax_start(ax_group_t *g, int nc, const float *const *qcol,
                            const long *ctx, float scale, long head_dim, float *const *ocol) {
  float ctxf[AX_COLS] __attribute__((aligned(64)));
  g->nc = nc;
  g->ctx_max = 0;
  g->ctx_min = LONG_MAX;
  g->ocol = ocol;
  for (int c = 0; c < AX_COLS; c++) {
    ctxf[c] = c < nc ? (float)ctx[c] : 0.0f;
    if (c >= nc) continue;
    g->ctx_max = ctx[c] > g->ctx_max ? ctx[c] : g->ctx_max;
    g->ctx_min = ctx[c] < g->ctx_min ? ctx[c] : g->ctx_min;
  }
  g->ctx = *(const vf *)ctxf;
  g->m = vsplat(-FLT_MAX);
  g->l = (vf){0};
  ax_queries(nc, qcol, scale, head_dim, g->qt);
  memset(g->o, 0, sizeof(float) * AX_COLS * (size_t)head_dim);
}

/* g's columns attend the slice of n tokens from t: K rows k (k_bytes apart; 16 rows, zero
 * past n), V^T vt (ax_transpose_values, tpad tokens a row). */
static inline void ax_slice(ax_group_t *g, long t, long n, const uint16_t *k, long k_bytes,
                            const uint16_t *vt, long tpad, long head_dim) {
  const long D = head_dim;
  float sp[16 * 16] __attribute__((aligned(64)));
  uint16_t pb[8 * 32] __attribute__((aligned(64)));
  _tile_zero(AX_S);
  for (long kk = 0; kk < D / 32; kk++) {
    _tile_loadd(AX_K, k + 32 * kk, k_bytes);
    _tile_loadd(AX_Q, g->qt + kk * 256, 64);
    _tile_dpbf16ps(AX_S, AX_K, AX_Q);
  }
  _tile_stored(AX_S, sp, 64);
  /* the online softmax, a column a lane; a token past a column's position: -inf, weight 0 */
  const int masked = t + n > g->ctx_min;
  vf mx = g->m;
  for (long j = 0; j < n; j++) {
    vf s = *(const vf *)(sp + 16 * j);
    if (masked) s = vselect(vsplat((float)(t + j)) >= g->ctx, vsplat(-INFINITY), s);
    *(vf *)(sp + 16 * j) = s;
    mx = vmax(s, mx);
  }
  const vf alpha = (vf)vexp_fma((__m512)(g->m - mx));
  vf sum = (vf){0};
  for (long j = 0; j < 16; j++) {
    vf e = (vf){0};
    if (j < n) {
      e = round_to_bf16((vf)vexp_fma((__m512)(*(const vf *)(sp + 16 * j) - mx)));
      if (masked) e = vselect(vsplat((float)(t + j)) >= g->ctx, (vf){0}, e);
      sum += e;
    }
    *(vf *)(sp + 16 * j) = e;
  }
  g->l = g->l * alpha + sum;
  g->m = mx;
  {  /* P^T pairs: row i = (p[2 i][c], p[2 i + 1][c]) for c < 16, bfloat16 (exact) */
    const __m512i pairs = _mm512_load_si512(PAIR_WORDS);
    for (int i = 0; i < 8; i++) {
      const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(sp + 32 * i + 16),
                                                        _mm512_load_ps(sp + 32 * i));
      _mm512_store_si512(pb + 32 * i, _mm512_permutexvar_epi16(pairs, two));
    }
  }
  if (_mm512_cmp_ps_mask((__m512)alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ))
    for (long d = 0; d < D; d++)  /* x 1 is exact: the columns that did not move keep */
      *(vf *)(g->o + 16 * d) = *(const vf *)(g->o + 16 * d) * alpha;
  _tile_loadd(AX_V, pb, 64);
  for (long db = 0; db < D / 16; db++) {
    _tile_loadd(AX_O, g->o + 256 * db, 64);
    _tile_loadd(AX_P, vt + 16 * db * tpad + t, 2 * tpad);
    _tile_dpbf16ps(AX_O, AX_P, AX_V);
    _tile_stored(AX_O, g->o + 256 * db, 64);
  }
}

/* g's outputs: each column's sums over its normaliser. */
static inline void ax_finish(const ax_group_t *g, long head_dim) {
  for (long d0 = 0; d0 < head_dim; d0 += 16) {
    __m512 in[16], out[16];
    for (int j = 0; j < 16; j++) in[j] = _mm512_load_ps(g->o + 16 * (d0 + j));
    transpose16(in, out);  /* out[c]: column c's d0 .. d0 + 15 */
    for (int c = 0; c < g->nc; c++) {
      const float inv = 1.0f / g->l[c];
      *(vf *)(g->ocol[c] + d0) = (vf)out[c] * inv;
    }
  }
}

/* The most groups a task attends slice by slice together: a chunk's queries of one KV head
 * (PLAIT_MAX_QUERIES), which read each slice's K rows once. */
#define AX_GROUPS (PLAIT_MAX_QUERIES / AX_COLS)

/* Groups g[0 .. ng) (one block table) attend their tokens slice by slice on slice_len's
 * grid, each slice's K rows gathered once for all (a short one); a group whose tokens end
 * before a slice skips it (which is what the slice, all masked, would leave). kh: the K
 * cache offset to the KV head; vt: the sequence's V^T for that head (tpad a row). */
static void ax_groups(ax_group_t *g, int ng, const int32_t *table, const uint16_t *kh,
                      const uint16_t *vt, long tpad, long block_size, long stride,
                      long head_dim) {
  const long D = head_dim;
  uint16_t kbuf[16 * PLAIT_MAX_HEAD_DIM] __attribute__((aligned(64)));
  long ctx_max = 0;
  for (int i = 0; i < ng; i++) ctx_max = g[i].ctx_max > ctx_max ? g[i].ctx_max : ctx_max;
  for (long t = 0; t < ctx_max;) {
    const long n = slice_len(t, ctx_max, block_size);
    const uint16_t *k = kh + (table[t / block_size] * block_size + t % block_size) * stride;
    long k_bytes = stride * 2;
    if (n < 16) {  /* a short slice: its rows copied, the tile's others zero */
      for (long j = 0; j < n; j++) memcpy(kbuf + j * D, k + j * stride, 2 * (size_t)D);
      memset(kbuf + n * D, 0, 2 * (size_t)((16 - n) * D));
      k = kbuf;
      k_bytes = 2 * D;
    }
    for (int i = 0; i < ng; i++)
      if (t < g[i].ctx_max) ax_slice(&g[i], t, n, k, k_bytes, vt, tpad, D);
    t += n;
  }
  for (int i = 0; i < ng; i++) ax_finish(&g[i], D);
}

/* Tokens a row of a sequence's V^T holds, for a context of ctx: ctx rounded up to 16,
 * plus 16 (a slice's A tile reads 16 tokens from wherever the slice starts). */
static inline long ax_tpad(long ctx) { return (ctx + 15) / 16 * 16 + 16; }

/* A sequence (block-table row) of a call: the longest context its rows attend, and where
 * its V^T starts in the call's buffer (head h at at + h D ax_tpad(ctx) words). */
typedef struct {
  int64_t table;
  long ctx;
  size_t at;
} ax_seq_t;

/* The call's sequences, each once, into seq (room for `rows`), slot[i] that of row i;
 * returns how many, *words the bfloat16 words of all their V^T. */
static long ax_find_seqs(long rows, const int64_t *table_rows, const int32_t *ctx_len,
                         long num_kv_heads, long head_dim, ax_seq_t *seq, long *slot,
                         size_t *words) {
  long count = 0;
  for (long i = 0; i < rows; i++) {
    long j = count - 1;  /* the rows of a sequence mostly come together */
    while (j >= 0 && seq[j].table != table_rows[i]) j--;
    if (j < 0) {
      j = count++;
      seq[j].table = table_rows[i];
      seq[j].ctx = 0;
    }
    seq[j].ctx = ctx_len[i] > seq[j].ctx ? ctx_len[i] : seq[j].ctx;
    slot[i] = j;
  }
  *words = 0;
  for (long j = 0; j < count; j++) {
    seq[j].at = *words;
    *words += (size_t)(num_kv_heads * head_dim * ax_tpad(seq[j].ctx));
  }
  return count;
}

/* plait_decode_attention's contract over a bfloat16 cache for prompt rows (the file's
 * comment): first every sequence's V^T per KV head (ax_transpose_values), then a task per
 * chunk and KV head, its queries (row r, head g of the KV group) in groups of up to 16
 * consecutive ones that read one block table, the groups of a table together
 * (ax_groups). chunk_shared plays no part: every column walks its tokens from 0. */
static int ax_attention(const float *q, long q_stride, const uint16_t *k_cache,
                        const uint16_t *v_cache, long block_size, long num_kv_heads,
                        long num_heads, long head_dim, const int32_t *block_tables,
                        long table_stride, long num_chunks, const int64_t *chunk_start,
                        const int64_t *q_rows, const int64_t *table_rows,
                        const int32_t *ctx_len, float scale, float *out,
                        const int64_t *out_rows) {
  const long G = num_heads / num_kv_heads, stride = num_kv_heads * head_dim;
  const long rows = chunk_start[num_chunks];
  ax_seq_t *seq = malloc(sizeof(ax_seq_t) * (size_t)(rows + 1));
  long *slot = malloc(sizeof(long) * (size_t)(rows + 1));
  size_t words = 0;
  const long count = seq && slot ? ax_find_seqs(rows, table_rows, ctx_len, num_kv_heads,
                                                head_dim, seq, slot, &words)
                                 : 0;
  uint16_t *vt = seq && slot ? aligned_alloc(64, (2 * words + 63) / 64 * 64 + 64) : NULL;
  if (!vt) {
    free(seq);
    free(slot);
    return PLAIT_ERR_NOMEM;
  }
  int nomem = 0;
#pragma omp parallel
  {
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < count * num_kv_heads; item++) {
      const long j = item / num_kv_heads, h = item % num_kv_heads, tpad = ax_tpad(seq[j].ctx);
      for (long t0 = 0; t0 < tpad; t0 += 16)
        ax_transpose_values(v_cache + h * head_dim, block_tables + seq[j].table * table_stride,
                            block_size, stride, head_dim, seq[j].ctx, tpad, t0,
                            vt + seq[j].at + (size_t)(h * head_dim * tpad));
    }
    ax_config();
    ax_group_t *groups = aligned_alloc(64, sizeof(ax_group_t) * AX_GROUPS);
#pragma omp for schedule(dynamic, 1)
    for (long task = 0; task < num_chunks * num_kv_heads; task++) {
      if (!groups) continue;
      const long ch = task / num_kv_heads, h = task % num_kv_heads;
      const long first = chunk_start[ch], nq = (chunk_start[ch + 1] - first) * G;
      const float *qcol[AX_GROUPS][AX_COLS];
      float *ocol[AX_GROUPS][AX_COLS];
      long ctx[AX_COLS];
      for (long a = 0; a < nq;) {  /* a bundle: the groups of one table */
        const int64_t table = table_rows[first + a / G];
        const long j = slot[first + a / G], tpad = ax_tpad(seq[j].ctx);
        int ng = 0;
        for (; ng < AX_GROUPS && a < nq && table_rows[first + a / G] == table; ng++) {
          int nc = 0;
          for (; nc < AX_COLS && a < nq && table_rows[first + a / G] == table; nc++, a++) {
            const long i = first + a / G, head = h * G + a % G;
            qcol[ng][nc] = q + q_rows[i] * q_stride + head * head_dim;
            ocol[ng][nc] = out + ((out_rows ? out_rows[i] : i) * num_heads + head) * head_dim;
            ctx[nc] = ctx_len[i];
          }
          ax_start(&groups[ng], nc, qcol[ng], ctx, scale, head_dim, ocol[ng]);
        }
        ax_groups(groups, ng, block_tables + table * table_stride, k_cache + h * head_dim,
                  vt + seq[j].at + (size_t)(h * head_dim * tpad), tpad, block_size, stride,
                  head_dim);
      }
    }
    if (!groups) __atomic_store_n(&nomem, 1, __ATOMIC_RELAXED);
    free(groups);
    _tile_release();
  }
  free(vt);
  free(seq);
  free(slot);
  return nomem ? PLAIT_ERR_NOMEM : PLAIT_OK;
}

#endif
#endif
