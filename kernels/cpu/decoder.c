/* A Llama decoder stack over a step's rows, every layer in one call (see vec.h). */
#include "plait_cpu.h"
#include "vec.h"

/* The rows of W that a descriptor holds (0 for NULL). */
static long desc_rows(const int64_t *desc) {
  const int64_t parts = desc ? desc[0] & ~(int64_t)(PLAIT_QGEMM_BF16 | PLAIT_QGEMM_REPACKED)
                             : 0;
  long total = 0;
  for (int64_t i = 0; i < parts && i < PLAIT_MAX_PARTS; i++) total += desc[3 + 3 * i];
  return total;
}

/* y[rows, n] = x @ W^T (+ bias) through plait_qgemm, W the descriptor at `desc` (its
 * PLAIT_QGEMM_BF16 or PLAIT_QGEMM_REPACKED flag, if set, for plait_qgemm; with `prompt`, a
 * PLAIT_QGEMM_REPACKED one through plait_repack_gemm_bf16), which must hold n rows
 * (PLAIT_ERR_SHAPES otherwise: the table does not fit the shapes). */
static int linear(const float *x, long rows, long k, const int64_t *desc, long n,
                  const float *bias, float *y, int prompt) {
  if (desc_rows(desc) != n) return PLAIT_ERR_SHAPES;
  if (prompt && (desc[0] & PLAIT_QGEMM_REPACKED))
    return plait_repack_gemm_bf16(x, rows, k, desc, k, bias, y, n);
  return plait_qgemm(x, rows, k, desc, k, bias, y, n);
}

/* act[rows, inter] = silu(gate) * up of h @ Wgate_up^T through `linear` and plait_silu_mul
 * (gate_up [rows, 2 inter] the scratch between them); a repacked weight's in one pass
 * instead where the fused kernel takes it (the same bits): plait_repack_gemm_bf16_silu for
 * prompt rows, else plait_repack_gemm_silu. */
static int gate_up_silu(const float *h, long rows, long k, const int64_t *desc, long inter,
                        float *gate_up, float *act, int prompt) {
  if (desc_rows(desc) == 2 * inter && (desc[0] & PLAIT_QGEMM_REPACKED) &&
      (prompt ? plait_repack_gemm_bf16_silu(h, rows, k, desc, k, NULL, act, inter)
              : plait_repack_gemm_silu(h, rows, k, desc, k, NULL, act, inter,
                                       plait_repack_isa())) == PLAIT_OK)
    return PLAIT_OK;
  const int rc = linear(h, rows, k, desc, 2 * inter, NULL, gate_up, prompt);
  return rc != PLAIT_OK ? rc : plait_silu_mul(gate_up, 2 * inter, rows, inter, act);
}

/* Every layer of a Llama decoder over `rows` tokens: what the model's eager forward does
 * through the same kernels, in the same order, without returning to Python between them
 * (the same bits as that path; the projections through plait_qgemm, which sends float32
 * panels to plait_gemm). For each layer l (its pointers: layers[l *
 * PLAIT_STACK_POINTERS + PLAIT_STACK_*], plait_cpu.h):
 *
 *   x, h = x + m, rms_norm(x + m)       (layer 0: h = rms_norm(x); m = the last MLP out)
 *   q|k|v = h @ Wqkv^T (+ bias); rope of q and k; k, v written at slot_mapping (caches of
 *       kv_dtype elements, PLAIT_KV_*)
 *   a = attention of q over the cache (the chunks of plait_decode_attention, written to
 *       their token rows, q_rows; kv_dtype's PLAIT_ATTN_BF16_DOT and PLAIT_ATTN_AMX flags,
 *       if set, are its alone)
 *   x, h = x + a @ Wo^T, rms_norm(...);  m = down(silu(gate) * up) of h
 *
 * and at the end x += m, out = rms_norm(x) with final_norm; or, with final_norm NULL (and
 * num_layers >= 1), out = m and x as it is: the stream and the last MLP's output, for the
 * caller to go on with further layers. With PLAIT_STACK_PROMPT in
 * kv_dtype the rows are prompt rows: the repacked projections take plait_repack_gemm_bf16
 * (plait_cpu.h), what the layer-by-layer forward's prompt pass computes. x [rows, hidden]
 * (dense) is the residual stream, updated in place; out [rows, hidden]. Returns PLAIT_OK, or the first
 * failing kernel's code: PLAIT_ERR_SHAPES for shapes a kernel refuses (RoPE: odd D; the
 * attention's limits; a weight descriptor of other rows, or one plait_qgemm refuses), PLAIT_ERR_NOMEM when one cannot allocate (layers after it are not
 * run; x is then partly updated). */
int plait_decoder_stack(long num_layers, const int64_t *layers, long rows, long hidden,
                        long num_heads, long num_kv_heads, long head_dim, long inter,
                        float eps, const float *final_norm, float *x, const float *cos_sin,
                        const int64_t *positions, const int64_t *slot_mapping, int kv_dtype,
                        long block_size,
                        const int32_t *block_tables, long table_stride, long num_chunks,
                        const int64_t *chunk_start, const int32_t *chunk_shared,
                        const int64_t *q_rows, const int64_t *table_rows,
                        const int32_t *ctx_len, float scale, float *out) {
  if (!final_norm && num_layers < 1) return PLAIT_ERR_SHAPES;
  const int prompt = (kv_dtype & PLAIT_STACK_PROMPT) != 0;
  const int attn_dtype = kv_dtype & ~PLAIT_STACK_PROMPT;
  const int cache_dtype = attn_dtype & ~(PLAIT_ATTN_BF16_DOT | PLAIT_ATTN_AMX);
  const long q_dim = num_heads * head_dim, kv_dim = num_kv_heads * head_dim;
  const long qkv_dim = q_dim + 2 * kv_dim;
  const long sizes[] = {rows * hidden, rows * qkv_dim, rows * q_dim, rows * 2 * inter,
                        rows * inter, rows * hidden};
  long total = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += sizes[i];
  float *buf = malloc(sizeof(float) * (size_t)(total > 0 ? total : 1));
  if (!buf) return PLAIT_ERR_NOMEM;
  float *h = buf, *qkv = h + sizes[0], *att = qkv + sizes[1], *gate_up = att + sizes[2];
  float *act = gate_up + sizes[3], *m = act + sizes[4];
  /* each kernel's return code, checked: the first that is not PLAIT_OK ends the stack */
  int rc = PLAIT_OK;
  for (long l = 0; l < num_layers && rc == PLAIT_OK; l++) {
    const int64_t *p = layers + l * PLAIT_STACK_POINTERS;
#define PTR(i) ((float *)(intptr_t)p[i])
#define CACHE(i) ((void *)(intptr_t)p[i])
#define DESC(i) ((const int64_t *)(intptr_t)p[i])
#define RUN(call) \
  if ((rc = (call)) != PLAIT_OK) break
    RUN(plait_add_rms_norm(x, hidden, l == 0 ? NULL : m, hidden, PTR(PLAIT_STACK_INPUT_NORM),
                           rows, hidden, eps, x, h));
    RUN(linear(h, rows, hidden, DESC(PLAIT_STACK_QKV_WEIGHT), qkv_dim,
               PTR(PLAIT_STACK_QKV_BIAS), qkv, prompt));
    float *q = qkv, *k = qkv + q_dim, *v = k + kv_dim;
    RUN(plait_rope_write_kv(q, qkv_dim, k, qkv_dim, v, qkv_dim, rows, num_heads, num_kv_heads,
                            head_dim, head_dim, cos_sin, positions, CACHE(PLAIT_STACK_K_CACHE),
                            CACHE(PLAIT_STACK_V_CACHE), cache_dtype, slot_mapping,
                            PTR(PLAIT_STACK_K_OFFSET)));
    RUN(plait_decode_attention(q, qkv_dim, CACHE(PLAIT_STACK_K_CACHE),
                               CACHE(PLAIT_STACK_V_CACHE), attn_dtype, block_size,
                               num_kv_heads, num_heads, head_dim, block_tables, table_stride,
                               num_chunks, chunk_start, chunk_shared, q_rows, table_rows,
                               ctx_len, scale, 0, 0.0f, att, q_rows));
    RUN(linear(att, rows, q_dim, DESC(PLAIT_STACK_O_WEIGHT), hidden, NULL, m, prompt));
    RUN(plait_add_rms_norm(x, hidden, m, hidden, PTR(PLAIT_STACK_POST_NORM), rows, hidden, eps,
                           x, h));
    RUN(gate_up_silu(h, rows, hidden, DESC(PLAIT_STACK_GATE_UP_WEIGHT), inter, gate_up, act,
                     prompt));
    RUN(linear(act, rows, inter, DESC(PLAIT_STACK_DOWN_WEIGHT), hidden, NULL, m, prompt));
#undef RUN
#undef PTR
#undef CACHE
#undef DESC
  }
  if (rc == PLAIT_OK && final_norm)
    rc = plait_add_rms_norm(x, hidden, num_layers > 0 ? m : NULL, hidden, final_norm, rows,
                            hidden, eps, x, out);
  else if (rc == PLAIT_OK)
    memcpy(out, m, sizeof(float) * (size_t)(rows * hidden));
  free(buf);
  return rc;
}
