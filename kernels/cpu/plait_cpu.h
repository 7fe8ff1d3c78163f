/* Plait's native CPU kernels: the C ABI, written once.
 *
 * Every function the library exports and every constant Python shares with the C is here,
 * and only here: each source includes this header, so the compiler checks each definition
 * against its declaration, and build.py parses this text to generate the ctypes signatures
 * (`build._declare`) and the Python constants (`build.ABI`, `build.MAX_QUERIES`, ...).
 *
 * The style is strict so that a small parser reads it (build.parse_header, which refuses
 * anything else rather than skipping it): comments, the include guard, `#include <...>`,
 * `#define PLAIT_<NAME> <integer>`, the one `enum` of PLAIT_STACK_* names (no values), and
 * one prototype per function, `int plait_<name>(<parameters>);`, whose parameters are
 * `long`, `int`, `float`, a pointer to `float`, `int32_t`, `int64_t`, `uint16_t` or `void`
 * (`const` or not; `void`: elements of a type another parameter names), or a lone `void`.
 * Activations are float32, row-major; strides count elements.
 *
 * Return codes, every function alike: PLAIT_OK, PLAIT_ERR_SHAPES when the shapes exceed the
 * kernel's limits (nothing written), PLAIT_ERR_NOMEM when a buffer could not be allocated.
 */
#ifndef PLAIT_CPU_H
#define PLAIT_CPU_H

#include <stdint.h>

#define PLAIT_OK 0
#define PLAIT_ERR_SHAPES -1
#define PLAIT_ERR_NOMEM -2

/* Attention limits: query vectors one task holds (a chunk's rows x query heads per KV
 * head), head_dim, tokens per cache block. */
#define PLAIT_MAX_QUERIES 48
#define PLAIT_MAX_HEAD_DIM 256
#define PLAIT_MAX_BLOCK 256
/* The element type of a KV cache (the kv_dtype parameters): float32, or bfloat16 (written
 * rounded to nearest even, read widened to float32: exact). */
#define PLAIT_KV_F32 0
#define PLAIT_KV_BF16 1
/* A flag OR-ed into plait_decode_attention's kv_dtype (PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT;
 * the engine's compute_dtype "bfloat16" over a bfloat16 cache): every token (those a
 * chunk's rows share and each row's own alike, so a row's bits do not depend on its
 * chunk) is attended with vdpbf16ps: the pre-scaled queries rounded to bfloat16 (nearest
 * even), scores summed in float32; each token's softmax weight p rounded to bfloat16
 * (nearest even), the weighted sum of V in float32; the online softmax (max, exp,
 * normaliser) float32. In a build without AVX512-BF16, every token as PLAIT_KV_BF16 alone
 * (the same bits). With PLAIT_KV_F32: PLAIT_ERR_SHAPES. */
#define PLAIT_ATTN_BF16_DOT 256
/* A flag OR-ed into PLAIT_KV_BF16 | PLAIT_ATTN_BF16_DOT for prompt rows (the engine's
 * prompt pass; plait_attention_amx() says where it runs): every query walks its tokens from
 * 0 in AMX-BF16 tiles (attention_amx.h), the queries and the softmax weights rounded to
 * bfloat16 as with PLAIT_ATTN_BF16_DOT alone, the sums in another order (other bits). A
 * query's result still depends only on its query and its tokens. No window, no softcap,
 * head_dim a multiple of 32; elsewhere, or where plait_attention_amx() is 0:
 * PLAIT_ERR_SHAPES. */
#define PLAIT_ATTN_AMX 512
/* A flag OR-ed into plait_decoder_stack's kv_dtype: the rows are prompt rows (the engine's
 * prompt pass): every PLAIT_QGEMM_REPACKED projection goes through plait_repack_gemm_bf16
 * (plait_repack_prompt_bf16() must be 1, else PLAIT_ERR_SHAPES), the others through
 * plait_qgemm as without it; the attention takes kv_dtype's other flags (PLAIT_ATTN_AMX
 * included), the KV write none. */
#define PLAIT_STACK_PROMPT 2048
/* The most rows the engine sends through plait_gemm (a decode step's few rows; more go to
 * BLAS), and so through plait_decoder_stack, unless every projection is a repacked one
 * (whose kernel is the same for any rows: then a prompt's rows too, stack.py). */
#define PLAIT_NATIVE_MAX_ROWS 24

/* GGML type ids (gguf.GGMLQuantizationType) of a weight part in a descriptor (below) that
 * plait_qgemm / plait_dequantize read. PLAIT_GGML_F32 is not GGML's row-major float32: it
 * means float32 panels as plait_gemm packs them ([ceil(N / lanes), K, lanes]), a weight's
 * only part, so a float32 weight goes through the same call (to plait_gemm itself). */
#define PLAIT_GGML_F32 0
#define PLAIT_GGML_F16 1
#define PLAIT_GGML_Q4_0 2
#define PLAIT_GGML_Q4_1 3
#define PLAIT_GGML_Q5_0 6
#define PLAIT_GGML_Q8_0 8
#define PLAIT_GGML_Q4_K 12
#define PLAIT_GGML_Q5_K 13
#define PLAIT_GGML_Q6_K 14
#define PLAIT_GGML_BF16 30
/* The most parts one weight descriptor holds. */
#define PLAIT_MAX_PARTS 16
/* A flag OR-ed into a descriptor's desc[0] (num_parts | PLAIT_QGEMM_BF16): plait_qgemm
 * computes in bfloat16 (the engine's compute_dtype "bfloat16"): for M >=
 * PLAIT_QGEMM_BF16_MIN_ROWS rows and K % 32 == 0, x and every dequantized weight rounded to
 * bfloat16 (nearest even; the weight's bits those of plait_dequantize_bf16), products summed
 * in float32, bias added in float32. One row (qgemm_bf16.h's exact bf16 pieces; from 2
 * rows the bf16 batch path measured faster: qgemm_batch_bf16.h), other K, or a build
 * without AVX512-BF16: the float32 paths, the same bits as without the flag.
 * plait_dequantize(_bf16) ignore it. */
#define PLAIT_QGEMM_BF16 256
#define PLAIT_QGEMM_BF16_MIN_ROWS 2
/* A flag OR-ed into desc[0] (alone): the parts are repacked (plait_repack, below), and
 * plait_qgemm computes as plait_repack_gemm with plait_repack_isa()'s kernel (x quantized
 * to int8 per 32 weights), plait_dequantize as plait_repack_dequantize; the plait_repack_*
 * functions take it or not. The native stack reads such a weight through plait_qgemm. */
#define PLAIT_QGEMM_REPACKED 1024

/* The pointers of one layer in plait_decoder_stack's table, in this order (as int64). */
enum plait_stack_pointer {
  PLAIT_STACK_INPUT_NORM,     /* [hidden] */
  PLAIT_STACK_QKV_WEIGHT,     /* descriptor of [(H + 2 H_kv) D, hidden] (plait_qgemm) */
  PLAIT_STACK_QKV_BIAS,       /* [(H + 2 H_kv) D], or 0: none */
  PLAIT_STACK_O_WEIGHT,       /* descriptor of [hidden, H D] */
  PLAIT_STACK_POST_NORM,      /* [hidden] */
  PLAIT_STACK_GATE_UP_WEIGHT, /* descriptor of [2 I, hidden] */
  PLAIT_STACK_DOWN_WEIGHT,    /* descriptor of [hidden, I] */
  PLAIT_STACK_K_CACHE,        /* [num_blocks, block_size, H_kv, D] of the stack's kv_dtype */
  PLAIT_STACK_V_CACHE,        /* [num_blocks, block_size, H_kv, D] of the stack's kv_dtype */
  PLAIT_STACK_K_OFFSET,       /* [H_kv, D] subtracted from every stored key, or 0: none */
  PLAIT_STACK_POINTERS
};

/* gemm.c: floats per vector of this build (16, 8 or 4), the width of a weight panel. */
int plait_lanes(void);

/* gemm.c: y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none),
 * W packed as panels [ceil(N / lanes), K, lanes]. PLAIT_ERR_NOMEM. */
int plait_gemm(const float *x, long M, long ldx, const float *w, long N, long K,
               const float *bias, float *y, long ldy);

/* qgemm.c: y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none),
 * W [N, K] given by the int64 descriptor desc = [num_parts, (address, PLAIT_GGML_* type,
 * rows) per part], its parts stacked along N (N = the sum of their rows), each part's rows
 * dense in their GGML block format. float32 activations and accumulation, each block
 * dequantized on the fly (exact: float32 products of the dequantized values); any M;
 * desc[0] may carry PLAIT_QGEMM_BF16 (above). A type it does not read, K not a whole number
 * of the type's blocks, F32 panels beside other parts, more than PLAIT_MAX_PARTS parts,
 * another flag: PLAIT_ERR_SHAPES; a PLAIT_QGEMM_REPACKED descriptor: plait_repack_gemm.
 * PLAIT_ERR_NOMEM. */
int plait_qgemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                const float *bias, float *y, long ldy);

/* qgemm.c: out[num_rows, K] = rows[i] of the descriptor's W (rows NULL: all N rows in order,
 * num_rows = N) in float32, the same bits as gguf-py's dequantizer. A row outside [0, N) or
 * a descriptor plait_qgemm refuses: PLAIT_ERR_SHAPES (nothing written). A
 * PLAIT_QGEMM_REPACKED descriptor: plait_repack_dequantize. */
int plait_dequantize(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                     float *out);

/* qgemm.c: plait_dequantize's values as bfloat16 bits (rounded to nearest even, as torch's
 * .to(torch.bfloat16)), out[num_rows, K]. PLAIT_ERR_NOMEM. */
int plait_dequantize_bf16(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                          uint16_t *out);

/* repack.c: weights repacked once at load at their own bit width (repack.h: 16 rows
 * interleaved per block, codes kept at 4, 5, 6 or 8 bits, the file's fp16 scales and 6-bit
 * sub-block scales beside them; Q4_0, Q4_1, Q5_0, Q8_0, Q6_K the file's bytes, Q4_K 1.028x,
 * Q5_K 1.023x, rows padded to a multiple of 16). plait_repack_isa: the fastest product this
 * build and process have: PLAIT_REPACK_AMX (the VNNI product, with AMX-INT8 tiles for
 * prefill rows: a build with AMX-TILE and AMX-INT8, Linux granting the process tile state,
 * and no PLAIT_REPACK_AMX=0 in the environment; asked once), PLAIT_REPACK_VNNI512
 * (AVX512-VNNI, BW, VL) or PLAIT_REPACK_C (plain C, every build); all give the same bits. */
#define PLAIT_REPACK_C 0
#define PLAIT_REPACK_VNNI512 1
#define PLAIT_REPACK_AMX 2
int plait_repack_isa(void);
/* repack.c: why plait_repack_isa is or is not PLAIT_REPACK_AMX: PLAIT_AMX_ON (granted),
 * PLAIT_AMX_OFF (PLAIT_REPACK_AMX=0 in the environment), PLAIT_AMX_ABSENT (the build has no
 * AMX-TILE / AMX-INT8 code: the CPU it was built for lacks them), or -errno where Linux
 * refused the process tile state (arch_prctl ARCH_REQ_XCOMP_PERM). Asks Linux as
 * plait_repack_isa does, once. */
#define PLAIT_AMX_ABSENT 0
#define PLAIT_AMX_ON 1
#define PLAIT_AMX_OFF 2
int plait_repack_amx_state(void);
/* repack.c: whether plait_repack_gemm_bf16 computes here (1: a build with AMX-BF16 and
 * AVX512-BF16, plait_repack_isa() PLAIT_REPACK_AMX) or refuses every call (0). */
int plait_repack_prompt_bf16(void);
/* repack.c: y[M, N] (ldy apart) = x[M, K] (ldx apart) W^T + bias (NULL: none) for a
 * repacked desc (plait_repack_gemm's), x and W's values (w = a c - o) rounded to bfloat16,
 * float32 sums (AMX-BF16 tiles) over the whole K: each row's bits depend on that row and W
 * only, not on M, and differ from plait_repack_gemm's. PLAIT_ERR_SHAPES where
 * plait_repack_prompt_bf16() is 0 or the shapes do not fit; PLAIT_ERR_NOMEM. */
int plait_repack_gemm_bf16(const float *x, long M, long ldx, const int64_t *desc, long K,
                           const float *bias, float *y, long ldy);
/* repack.c: silu(gate) * up of a gate | up weight's plait_repack_gemm_bf16 (W's rows [0, N/2)
 * the gate, [N/2, N) the up) into act [M, N/2] (lda apart), in one pass: each 16-row tile of
 * the gate meets the up's tile of the same columns, and silu_mul's float32 arithmetic runs
 * on the product's values (the same bits as plait_silu_mul on plait_repack_gemm_bf16's y).
 * PLAIT_ERR_SHAPES as plait_repack_gemm_bf16's, and where bias is not NULL, N % 32, lda <
 * N / 2, or 16 rows of W lie in two parts; PLAIT_ERR_NOMEM. */
int plait_repack_gemm_bf16_silu(const float *x, long M, long ldx, const int64_t *desc, long K,
                                const float *bias, float *act, long lda);
/* repack.c: the bytes of `rows` rows of K weights of GGML `type` repacked; PLAIT_ERR_SHAPES
 * for a type not repacked, K not a whole number of its blocks, or negative rows. */
long plait_repack_bytes(int type, long rows, long K);
/* repack.c: src [rows, K] in the file's blocks of `type` into dst (plait_repack_bytes of
 * them, any alignment). PLAIT_ERR_SHAPES as plait_repack_bytes. */
int plait_repack(const void *src, int type, long rows, long K, void *dst);
/* repack.c: y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none),
 * W [N, K] given by desc = [num_parts (| PLAIT_QGEMM_REPACKED), (address, PLAIT_GGML_* type,
 * rows) per part] of repacked parts stacked along N. x quantized to int8 per 32 weights (sx = max |x| / 127, q
 * = round(x / sx) to nearest even), exact int32 dot products of q with the codes, float32
 * scales and sums (repack.c states the order). isa: PLAIT_REPACK_C, or up to
 * plait_repack_isa(); all give the same bits. K % 32 != 0, a part plait_repack_bytes
 * refuses, more than PLAIT_MAX_PARTS parts, another isa: PLAIT_ERR_SHAPES. PLAIT_ERR_NOMEM. */
int plait_repack_gemm(const float *x, long M, long ldx, const int64_t *desc, long K,
                      const float *bias, float *y, long ldy, int isa);
/* repack.c: silu(gate) * up of a gate | up weight's plait_repack_gemm (W's rows [0, N/2) the
 * gate, [N/2, N) the up) into act [M, N/2] (lda apart), in one pass: per 16 columns the
 * gate's tile and the up's tile of the same columns meet each x row (no [M, N] temporary),
 * and plait_silu_mul's float32 arithmetic runs on their values (the same bits as
 * plait_silu_mul on plait_repack_gemm's y, any isa). PLAIT_ERR_SHAPES as plait_repack_gemm's,
 * and where bias is not NULL, N % 32, lda < N / 2, or 16 rows of W lie in two parts;
 * PLAIT_ERR_NOMEM. */
int plait_repack_gemm_silu(const float *x, long M, long ldx, const int64_t *desc, long K,
                           const float *bias, float *act, long lda, int isa);
/* repack.c: out[num_rows, K] = rows[i] of the repacked W (rows NULL: all N in order,
 * num_rows = N) in float32, the same bits as gguf-py's dequantizer of the file's blocks.
 * A row outside [0, N) or a descriptor plait_repack_gemm refuses: PLAIT_ERR_SHAPES. */
int plait_repack_dequantize(const int64_t *desc, long K, const int64_t *rows, long num_rows,
                            float *out);

/* attention.c: 1 where plait_decode_attention takes PLAIT_ATTN_AMX (a build with AMX-BF16
 * and plait_repack_prompt_bf16()), else 0. */
int plait_attention_amx(void);
/* attention.c: one query per sequence over its paged K/V (PLAIT_KV_* kv_dtype elements,
 * PLAIT_KV_BF16 possibly with PLAIT_ATTN_BF16_DOT), read in place; the sequences of a chunk
 * read their chunk_shared[c] common tokens once. window > 0: sequence i attends only its
 * last `window` tokens; softcap > 0: scores s become softcap * tanh(s / softcap); 0: off.
 * Limits: PLAIT_MAX_HEAD_DIM, PLAIT_MAX_BLOCK, chunk rows x (H / H_kv) <=
 * PLAIT_MAX_QUERIES, D a multiple of lanes, kv_dtype one of those, window and softcap >= 0
 * (PLAIT_ERR_SHAPES). A sequence's result does not depend on its chunk, on chunk_shared or
 * on the other sequences of the call (row invariance). */
int plait_decode_attention(const float *q, long q_stride, const void *k_cache,
                           const void *v_cache, int kv_dtype, long block_size, long num_kv_heads,
                           long num_heads, long head_dim, const int32_t *block_tables,
                           long table_stride, long num_chunks, const int64_t *chunk_start,
                           const int32_t *chunk_shared, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *ctx_len, float scale,
                           long window, float softcap, float *out, const int64_t *out_rows);

/* rowwise.c: neox RoPE of the first rot_dim dims of each head of q (in place) and k (the
 * rest pass through; cos_sin rows of rot_dim), k - k_offset ([H_kv, D]; NULL: k) and v
 * written to the caches (PLAIT_KV_* kv_dtype elements; bfloat16 rounded to nearest even) at
 * slots (-1: not written); the same bits as the torch path. rot_dim odd, <= 0 or > D,
 * another kv_dtype: PLAIT_ERR_SHAPES. */
int plait_rope_write_kv(float *q, long q_stride, const float *k, long k_stride, const float *v,
                        long v_stride, long num_tokens, long num_heads, long num_kv_heads,
                        long head_dim, long rot_dim, const float *cos_sin, const int64_t *positions,
                        void *k_cache, void *v_cache, int kv_dtype, const int64_t *slots,
                        const float *k_offset);

/* rowwise.c: sum_out = x + add (add NULL: nothing added, sum_out unused), out =
 * rms_norm(sum) * w, row by row. Negative sizes: PLAIT_ERR_SHAPES. */
int plait_add_rms_norm(const float *x, long x_stride, const float *add, long add_stride,
                       const float *w, long num_tokens, long dim, float eps, float *sum_out,
                       float *out);

/* rowwise.c: out[T, I] = silu(gate) * up of gate_up [T, 2 I] = gate | up. Negative sizes:
 * PLAIT_ERR_SHAPES. */
int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, long inter,
                   float *out);

/* rowwise.c: plait_silu_mul over bfloat16 gate_up and out (bf16 bits; float32 arithmetic,
 * the result rounded to nearest even). Negative sizes: PLAIT_ERR_SHAPES. */
int plait_silu_mul_bf16(const uint16_t *gate_up, long gu_stride, long num_tokens, long inter,
                        uint16_t *out);

/* rowwise.c: one token per row of logits [rows, vocab] by inverse-CDF sampling at u[r],
 * weights exp(logit - max); scratch [rows, vocab] floats; out [rows]. */
int plait_sample_inverse_cdf(const float *logits, long rows, long vocab, long stride,
                             const float *u, float *scratch, int64_t *out);

/* decoder.c: every layer of a Llama decoder over a step's rows in one call, through the
 * kernels above in the eager forward's order (full causal attention, no softcap, RoPE over
 * whole heads of cos_sin [P, D]: a stack of layers with other variants is not for it); layers [num_layers, PLAIT_STACK_POINTERS]
 * addresses (the four projections as plait_qgemm descriptors whose rows must match the
 * shapes, else PLAIT_ERR_SHAPES; the caches of kv_dtype elements, its PLAIT_ATTN_BF16_DOT
 * flag, if set, for plait_decode_attention alone); x [rows, hidden] updated
 * in place, out = the final norm. Propagates the first failing kernel's code. */
int plait_decoder_stack(long num_layers, const int64_t *layers, long rows, long hidden,
                        long num_heads, long num_kv_heads, long head_dim, long inter,
                        float eps, const float *final_norm, float *x, const float *cos_sin,
                        const int64_t *positions, const int64_t *slot_mapping, int kv_dtype,
                        long block_size,
                        const int32_t *block_tables, long table_stride, long num_chunks,
                        const int64_t *chunk_start, const int32_t *chunk_shared,
                        const int64_t *q_rows, const int64_t *table_rows,
                        const int32_t *ctx_len, float scale, float *out);

#endif /* PLAIT_CPU_H */
