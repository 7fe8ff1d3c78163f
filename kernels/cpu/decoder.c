/* A Llama decoder stack for the few rows of a decode step, in one call (see vec.h). */
#include "vec.h"

/* The pointers of one layer in `plait_decoder_stack`'s table, in this order. */
enum {
  L_INPUT_NORM,   /* [hidden] */
  L_QKV,          /* panels of [(H + 2 H_kv) D, hidden] */
  L_QKV_BIAS,     /* [(H + 2 H_kv) D], or 0: none */
  L_O,            /* panels of [hidden, H D] */
  L_POST_NORM,    /* [hidden] */
  L_GATE_UP,      /* panels of [2 I, hidden] */
  L_DOWN,         /* panels of [hidden, I] */
  L_K_CACHE,      /* [num_blocks, block_size, H_kv, D] */
  L_V_CACHE,
  L_POINTERS
};

/* Every layer of a Llama decoder over `rows` tokens: what the model's eager forward does
 * through the same kernels, in the same order, without returning to Python between them
 * (the same bits as that path). For each layer l (pointers layers[l * L_POINTERS + ...]):
 *
 *   x, h = x + m, rms_norm(x + m)       (layer 0: h = rms_norm(x); m = the last MLP out)
 *   q|k|v = h @ Wqkv^T (+ bias); rope of q and k; k, v written at slot_mapping
 *   a = attention of q over the cache (the chunks of plait_decode_attention, written to
 *       their token rows, q_rows)
 *   x, h = x + a @ Wo^T, rms_norm(...);  m = down(silu(gate) * up) of h
 *
 * and at the end x += m, out = rms_norm(x) with final_norm. x [rows, hidden] (dense) is the
 * residual stream, updated in place; out [rows, hidden]. Returns 0, -1 for shapes the
 * attention kernel cannot take, -2 if out of memory. */
int plait_decoder_stack(long num_layers, const int64_t *layers, long rows, long hidden,
                        long num_heads, long num_kv_heads, long head_dim, long inter,
                        float eps, const float *final_norm, float *x, const float *cos_sin,
                        const int64_t *positions, const int64_t *slot_mapping, long block_size,
                        const int32_t *block_tables, long table_stride, long num_chunks,
                        const int64_t *chunk_start, const int32_t *chunk_shared,
                        const int64_t *q_rows, const int64_t *table_rows,
                        const int32_t *ctx_len, float scale, float *out) {
  const long q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
  const long qkv_dim = q_dim + 2 * kv_dim;
  const long sizes[] = {rows * hidden, rows * qkv_dim, rows * q_dim, rows * 2 * inter,
                        rows * inter, rows * hidden};
  long total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
  float *buf = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
  if (!buf) return -2;
  float *h = buf, *qkv = h + sizes[0], *att = qkv + sizes[1], *gate_up = att + sizes[2];
  float *act = gate_up + sizes[3], *m = act + sizes[4];
  /* rc: -1 when a kernel refuses the shapes (RoPE: odd D; attention: its limits), -2 when
   * one cannot allocate (the GEMMs' -1, the attention's -2) */
  int rc = 0;
  for (long l = 0; l < num_layers && rc == 0; l++) {
    const int64_t *p = layers + l * L_POINTERS;
#define PTR(i) ((float *)(intptr_t)p[i])
    plait_add_rms_norm(x, hidden, l == 0 ? NULL : m, hidden, PTR(L_INPUT_NORM), rows, hidden,
                       eps, x, h);
    if (plait_gemm(h, rows, hidden, PTR(L_QKV), qkv_dim, hidden, PTR(L_QKV_BIAS), qkv,
                   qkv_dim)) {
      rc = -2;
      break;
    }
    float *q = qkv, *k = qkv + q_dim, *v = k + kv_dim;
    if (plait_rope_write_kv(q, qkv_dim, k, qkv_dim, v, qkv_dim, rows, num_heads, num_kv_heads,
                            head_dim, cos_sin, positions, PTR(L_K_CACHE), PTR(L_V_CACHE),
                            slot_mapping)) {
      rc = -1;
      break;
    }
    if ((rc = plait_decode_attention(q, qkv_dim, PTR(L_K_CACHE), PTR(L_V_CACHE), block_size,
                                     num_kv_heads, num_heads, head_dim, block_tables,
                                     table_stride, num_chunks, chunk_start, chunk_shared,
                                     q_rows, table_rows, ctx_len, scale, att, q_rows)))
      break;
    if (plait_gemm(att, rows, q_dim, PTR(L_O), hidden, q_dim, NULL, m, hidden)) {
      rc = -2;
      break;
    }
    plait_add_rms_norm(x, hidden, m, hidden, PTR(L_POST_NORM), rows, hidden, eps, x, h);
    if (plait_gemm(h, rows, hidden, PTR(L_GATE_UP), 2 * inter, hidden, NULL, gate_up,
                   2 * inter)) {
      rc = -2;
      break;
    }
    plait_silu_mul(gate_up, 2 * inter, rows, inter, act);
    if (plait_gemm(act, rows, inter, PTR(L_DOWN), hidden, inter, NULL, m, hidden)) rc = -2;
#undef PTR
  }
  if (rc == 0) plait_add_rms_norm(x, hidden, m, hidden, final_norm, rows, hidden, eps, x, out);
  free(buf);
  return rc;
}
