/* Weights repacked once at load at their own bit width (private to repack.c; see
 * plait_cpu.h's plait_repack_* and repack.py).
 *
 * A part of R rows of one GGML type becomes ceil(R / 16) tiles of 16 rows (rows past R:
 * zero bytes). A tile is K / QK records, one per block of QK weights (32, or 256 for the K
 * types), each the 16 rows' blocks interleaved so that one 64-byte vector holds 4
 * consecutive codes of each of the 16 rows (lane n = row n, byte 4 n + b = weight 4 s + b
 * of a 32-weight group): what vpdpbusd multiplies by 4 broadcast int8 activations.
 *
 *   record of 16 rows x one block     offset  bytes              per 32-weight group
 *   Q4_0 (QK 32)   codes, d           0, 256        288 (= file)  4 vectors of nibbles
 *   Q4_1 (QK 32)   codes, d, m        0, 256, 288   320 (= file)
 *   Q5_0 (QK 32)   codes, hbits, d    0, 256, 320   352 (= file)  + 1 vector of 5th bits
 *   Q8_0 (QK 32)   codes, d           0, 512        544 (= file)  8 vectors of bytes
 *   Q4_K (QK 256)  codes, sc, mn, d, dmin           2368 (1.028x)
 *   Q5_K (QK 256)  codes, hbits, sc, mn, d, dmin    2880 (1.023x)
 *   Q6_K (QK 256)  codes, hbits, sc, d              3360 (= file) + 2 vectors of 2-bit highs
 *
 * codes: per group, vectors P_j (j < 4) of 64 bytes, byte 4 n + b = code(n, 8 j + b) |
 * code(n, 8 j + 4 + b) << 4: V_s (the codes of weights 4 s .. 4 s + 3) is P_{s/2}'s low
 * nibbles for even s, high for odd. Q8_0 keeps V_0 .. V_7 whole (code = q + 128). hbits:
 * Q5_0 / Q5_K one vector per group, bit s of byte 4 n + b = bit 4 of code(n, 4 s + b); Q6_K
 * two per group (half h = s / 4), bits 2 t, 2 t + 1 (t = s % 4) = bits 4, 5 of code(n, 4 s
 * + b). sc, mn: the 6-bit sub-block scales and mins as bytes [8 groups][16 rows]; Q6_K's
 * int8 scales [16 halves of 16 weights][16 rows]. d, m / dmin: fp16 [16 rows], the file's
 * bits.
 *
 * A group's 8 vectors V_0 .. V_7 (widened to bytes) are also exactly the B tile of an
 * AMX-INT8 product for K = 32, N = 16 (repack_amx.h: 8 rows of 64 bytes, 4 bytes of K per
 * column).
 *
 * Every type's weight is w = a c - o over a group (or half, Q6_K) with unsigned codes c:
 * Q4_0 a = d, o = 8 d; Q4_1 a = d, o = -m; Q5_0 a = d, o = 16 d; Q8_0 a = d, o = 128 d;
 * Q4_K / Q5_K a = d sc, o = dmin mn; Q6_K a = d sc, o = 32 a.
 */
#ifndef PLAIT_CPU_REPACK_H
#define PLAIT_CPU_REPACK_H

#include "plait_cpu.h"
#include "quant.h"

#define RP_ROWS 16 /* rows per tile: one vector's int32 lanes */

/* Where a type's fields sit in a record (bytes; -1: none), and the record's shape. */
typedef struct {
  int qk;         /* weights per block (record) */
  int src_bytes;  /* bytes of one block in the file */
  int rec_bytes;  /* bytes of one record of 16 rows */
  int code_group; /* code bytes per 32-weight group (256, Q8_0 512) */
  int hbits;      /* high-bit planes (64 bytes a group, Q6_K 128) */
  int sc, mn;     /* sub-block scales and mins, 16 bytes per sub-block */
  int d, m;       /* fp16 d [16] and m / dmin [16] */
  int offset;     /* o / a for the types whose offset is a multiple of the scale; else 0 */
} rp_layout_t;

/* The layout of a GGML type, or NULL for a type not repacked. */
static inline const rp_layout_t *rp_layout(int type) {
  static const rp_layout_t q4_0 = {32, 18, 288, 256, -1, -1, -1, 256, -1, 8};
  static const rp_layout_t q4_1 = {32, 20, 320, 256, -1, -1, -1, 256, 288, 0};
  static const rp_layout_t q5_0 = {32, 22, 352, 256, 256, -1, -1, 320, -1, 16};
  static const rp_layout_t q8_0 = {32, 34, 544, 512, -1, -1, -1, 512, -1, 128};
  static const rp_layout_t q4_k = {256, 144, 2368, 256, -1, 2048, 2176, 2304, 2336, 0};
  static const rp_layout_t q5_k = {256, 176, 2880, 256, 2048, 2560, 2688, 2816, 2848, 0};
  static const rp_layout_t q6_k = {256, 210, 3360, 256, 2048, 3072, -1, 3328, -1, 32};
  switch (type) {
    case PLAIT_GGML_Q4_0: return &q4_0;
    case PLAIT_GGML_Q4_1: return &q4_1;
    case PLAIT_GGML_Q5_0: return &q5_0;
    case PLAIT_GGML_Q8_0: return &q8_0;
    case PLAIT_GGML_Q4_K: return &q4_k;
    case PLAIT_GGML_Q5_K: return &q5_k;
    case PLAIT_GGML_Q6_K: return &q6_k;
    default: return NULL;
  }
}

/* One part of a repacked weight (a descriptor's triple). */
typedef struct {
  const uint8_t *data;
  const rp_layout_t *lay;
  int type;
  long first, rows, tiles, tile_bytes; /* first: the part's first row in W */
} rp_part_t;

/* Code of row n (< 16) and weight k (< 32) of group gi of a record. */
static inline int rp_code(const rp_layout_t *L, int type, const uint8_t *rec, int gi, int n,
                          int k) {
  int s = k / 4, b = k % 4, lane = 4 * n + b;
  const uint8_t *codes = rec + gi * L->code_group;
  if (type == PLAIT_GGML_Q8_0) return codes[64 * s + lane];
  int byte = codes[64 * (s / 2) + lane], c = s & 1 ? byte >> 4 : byte & 15;
  if (type == PLAIT_GGML_Q6_K) {
    const uint8_t *h = rec + L->hbits + gi * 128 + 64 * (s / 4);
    c |= (h[lane] >> (2 * (s % 4)) & 3) << 4;
  } else if (L->hbits >= 0) {
    c |= (rec[L->hbits + gi * 64 + lane] >> s & 1) << 4;
  }
  return c;
}

/* fp16 field `at` (d or m) of row n of a record, as float32. */
static inline float rp_f16(const uint8_t *rec, int at, int n) { return load_f16(rec + at + 2 * n); }

/* a * b + c rounded twice (the empty asm keeps the compiler from fusing it into an FMA):
 * gguf-py's float32 arithmetic. */
static inline float rp_mul_add(float a, float b, float c) {
  float p = a * b;
  __asm__("" : "+x"(p));
  return p + c;
}

/* a and o (w = a c - o) of row n, group gi (Q6_K: half h) of a record. */
static inline void rp_scale(const rp_layout_t *L, int type, const uint8_t *rec, int gi, int h,
                            int n, float *a, float *o) {
  float d = rp_f16(rec, L->d, n);
  switch (type) {
    case PLAIT_GGML_Q4_1:
      *a = d;
      *o = -rp_f16(rec, L->m, n);
      return;
    case PLAIT_GGML_Q4_K:
    case PLAIT_GGML_Q5_K:
      *a = d * (float)rec[L->sc + 16 * gi + n];
      *o = rp_f16(rec, L->m, n) * (float)rec[L->mn + 16 * gi + n];
      return;
    case PLAIT_GGML_Q6_K:
      *a = d * (float)(int8_t)rec[L->sc + 16 * (2 * gi + h) + n];
      *o = 0.0f; /* 32 a: applied through the integer sums */
      return;
    default:
      *a = d;
      *o = 0.0f; /* L->offset * d: applied through the integer sums */
      return;
  }
}

/* Activations quantized for the kernels: per row, int8 codes q [K] (64-byte aligned rows of
 * ldq bytes), per 32-group the scale sx = max |x| / 127 and sxq = sx * sum q, per 16 the
 * int32 sums of q (the offsets of Q4_0 / Q5_0 / Q8_0 / Q6_K). */
typedef struct {
  const int8_t *q;
  const float *sx, *sxq;
  const int32_t *sum16;
  long ldq, groups; /* groups = K / 32 */
} rp_acts_t;

/* a's rows from row m on (a register tile's or a block's first row). */
static inline rp_acts_t rp_acts_from(const rp_acts_t *a, long m) {
  rp_acts_t at = {a->q + m * a->ldq, a->sx + m * a->groups, a->sxq + m * a->groups,
                  a->sum16 + m * 2 * a->groups, a->ldq, a->groups};
  return at;
}

#endif /* PLAIT_CPU_REPACK_H */
