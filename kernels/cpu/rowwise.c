/* Per-row operations of a layer, and the sampler (see vec.h). */
#include "plait_cpu.h"
#include "vec.h"

/* Element i of a cache (or row) of bfloat16 (bf16) or float32 set to x (rounded to nearest
 * even). */
static inline __attribute__((always_inline)) void put_kv(void *cache, long i, float x,
                                                         const int bf16) {
  if (bf16)
    ((uint16_t *)cache)[i] = f32_to_bf16(x);
  else
    ((float *)cache)[i] = x;
}

/* LANES floats stored at element i of a cache (or row) of bfloat16 (bf16: each rounded to
 * nearest even, as put_kv) or float32. */
static inline __attribute__((always_inline)) void put_lanes(void *cache, long i, vf x,
                                                            const int bf16) {
  if (bf16)
    store_bf16((uint16_t *)cache + i, x);
  else
    *(vf *)((float *)cache + i) = x;
}

/* One head's rotation: pairs (x[i], x[i + half]) of x rotated by (cs[i], sn[i]), i < half,
 * each element (x1 * cos) - (x2 * sin) or (x2 * cos) + (x1 * sin), less c[i] where c is
 * given, into out at element o (float32, or bfloat16 bits rounded to nearest even:
 * put_kv). LANES pairs a vector, the same arithmetic lane by lane: no FMA contraction in
 * this file's rope functions, so every element rounds as torch's separate multiplies and
 * subtractions round it. out may be x. */
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rotate_half(
    const float *x, const float *cs, const float *sn, long half, const float *c, void *out,
    long o, const int bf16) {
  long i = 0;
  for (; i + LANES <= half; i += LANES) {
    const vf x1 = *(const vf *)(x + i), x2 = *(const vf *)(x + i + half);
    const vf cv = *(const vf *)(cs + i), sv = *(const vf *)(sn + i);
    vf y1 = x1 * cv - x2 * sv, y2 = x2 * cv + x1 * sv;
    if (c) {
      y1 = y1 - *(const vf *)(c + i);
      y2 = y2 - *(const vf *)(c + i + half);
    }
    put_lanes(out, o + i, y1, bf16);
    put_lanes(out, o + i + half, y2, bf16);
  }
  for (; i < half; i++) {
    const float x1 = x[i], x2 = x[i + half];
    const float y1 = x1 * cs[i] - x2 * sn[i], y2 = x2 * cs[i] + x1 * sn[i];
    put_kv(out, o + i, c ? y1 - c[i] : y1, bf16);
    put_kv(out, o + i + half, c ? y2 - c[i + half] : y2, bf16);
  }
}

/* plait_rope_write_kv for caches of float32 (bf16 = 0) or bfloat16 (bf16 = 1), a constant
 * in each of the two copies the entry point calls. Dims [0, rot_dim) rotated, pairs
 * (i, i + rot_dim / 2); dims [rot_dim, D) of q untouched, of k copied to the cache. */
static inline __attribute__((always_inline, optimize("fp-contract=off"))) void rope_write_kv(
    float *q, long q_stride, const float *k, long k_stride, const float *v, long v_stride,
    long num_tokens, long num_heads, long num_kv_heads, long head_dim, long rot_dim,
    const float *cos_sin, const int64_t *positions, void *k_cache, void *v_cache,
    const int64_t *slots, const float *k_offset, const int bf16) {
  const long half = rot_dim / 2, kv_dim = num_kv_heads * head_dim;
#pragma omp parallel for schedule(static) if (num_tokens >= 64)
  for (long t = 0; t < num_tokens; t++) {
    const float *cs = cos_sin + positions[t] * rot_dim, *sn = cs + half;
    for (long h = 0; h < num_heads; h++) {
      /* q in place, float32, no offset: x1 * cos - x2 * sin exactly as the keys' */
      float *x = q + t * q_stride + h * head_dim;
      rotate_half(x, cs, sn, half, NULL, x, 0, 0);
    }
    if (slots[t] < 0) continue;
    const long at = slots[t] * kv_dim;  /* the slot's first element */
    for (long h = 0; h < num_kv_heads; h++) {
      const float *x = k + t * k_stride + h * head_dim;
      const float *c = k_offset ? k_offset + h * head_dim : NULL;
      const long o = at + h * head_dim;
      rotate_half(x, cs, sn, half, c, k_cache, o, bf16);
      for (long i = rot_dim; i < head_dim; i++)
        put_kv(k_cache, o + i, x[i] - (c ? c[i] : 0.0f), bf16);
    }
    if (bf16) {
      const float *vr = v + t * v_stride;
      long i = 0;
      for (; i + LANES <= kv_dim; i += LANES)
        put_lanes(v_cache, at + i, *(const vf *)(vr + i), 1);
      for (; i < kv_dim; i++) put_kv(v_cache, at + i, vr[i], 1);
    } else {
      memcpy((float *)v_cache + at, v + t * v_stride, kv_dim * sizeof(float));
    }
  }
}

/* Rotary embedding (neox style: rotate halves of the first rot_dim dims of each head, the
 * rest passed through: partial rotary when rot_dim < D) and the KV-cache write of one
 * layer's new tokens, in one pass. q [T, H, D] (row stride q_stride floats, heads dense) is
 * rotated in
 * place; k [T, H_kv, D] (row stride k_stride) is rotated into k_cache and v (row stride
 * v_stride) copied into v_cache at slot slots[t] (caches [num_slots, H_kv, D] contiguous, of
 * kv_dtype elements: PLAIT_KV_F32, or PLAIT_KV_BF16, each value rounded to nearest even as
 * torch's .to(torch.bfloat16) rounds it; slot -1: not written). Token t's angles are row
 * positions[t] of cos_sin [P, rot_dim] (cos | sin halves). k_offset [H_kv, D] (NULL: none)
 * is subtracted from every rotated k before it is stored (the model's key offset,
 * engine/models/key_offset.py). Without FMA contraction, each element is (x1 * cos) -
 * (x2 * sin) (then - k_offset) rounded as torch's separate multiplies and subtractions
 * round it, so the result is the same bits as the plain-torch path. Returns PLAIT_OK, or
 * PLAIT_ERR_SHAPES if rot_dim is odd, <= 0 or > D, or kv_dtype another value. */
__attribute__((optimize("fp-contract=off"))) int plait_rope_write_kv(
    float *q, long q_stride, const float *k, long k_stride, const float *v, long v_stride,
    long num_tokens, long num_heads, long num_kv_heads, long head_dim, long rot_dim,
    const float *cos_sin, const int64_t *positions, void *k_cache, void *v_cache,
    int kv_dtype, const int64_t *slots, const float *k_offset) {
  if (rot_dim % 2 || rot_dim <= 0 || rot_dim > head_dim ||
      (kv_dtype != PLAIT_KV_F32 && kv_dtype != PLAIT_KV_BF16))
    return PLAIT_ERR_SHAPES;
  if (kv_dtype == PLAIT_KV_BF16)
    rope_write_kv(q, q_stride, k, k_stride, v, v_stride, num_tokens, num_heads, num_kv_heads,
                  head_dim, rot_dim, cos_sin, positions, k_cache, v_cache, slots, k_offset, 1);
  else
    rope_write_kv(q, q_stride, k, k_stride, v, v_stride, num_tokens, num_heads, num_kv_heads,
                  head_dim, rot_dim, cos_sin, positions, k_cache, v_cache, slots, k_offset, 0);
  return PLAIT_OK;
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
  return PLAIT_OK;
}

/* RMS normalization of the rows of x [T, D] (row stride x_stride), after adding `add`
 * (same shape, row stride add_stride; NULL: nothing added): s = x + add is written to
 * sum_out (row stride D; NULL when add is NULL) and s * w / sqrt(mean(s^2) + eps) to out
 * (row stride D). The sum of squares runs over whole vectors, so it differs from torch's
 * in the last bits. Returns PLAIT_OK, or PLAIT_ERR_SHAPES for a negative size. */
int plait_add_rms_norm(const float *x, long x_stride, const float *add, long add_stride,
                       const float *w, long num_tokens, long dim, float eps, float *sum_out,
                       float *out) {
  if (num_tokens < 0 || dim < 0) return PLAIT_ERR_SHAPES;
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
  return PLAIT_OK;
}

/* Element i of a row of bfloat16 (bf16) or float32, as float32; LANES of them from i. */
static inline __attribute__((always_inline)) float get_elem(const void *row, long i,
                                                            const int bf16) {
  return bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}
static inline __attribute__((always_inline)) vf get_lanes(const void *row, long i,
                                                          const int bf16) {
  return bf16 ? widen_bf16((const uint16_t *)row + i) : *(const vf *)((const float *)row + i);
}

/* silu_mul over float32 (bf16 = 0) or bfloat16 rows (bf16 = 1: widened as loaded, the
 * float32 result rounded to nearest even as stored), a constant in each entry point's copy:
 * the arithmetic is the same float32 either way. */
static inline __attribute__((always_inline)) void silu_mul(const void *gate_up, long gu_stride,
                                                           long num_tokens, long inter,
                                                           void *out, const int bf16) {
#pragma omp parallel for schedule(static) if (num_tokens >= 16)
  for (long t = 0; t < num_tokens; t++) {
    const long g = t * gu_stride, u = g + inter, o = t * inter;
    long i = 0;
    for (; i + LANES <= inter; i += LANES) {
      const vf gv = get_lanes(gate_up, g + i, bf16);
      const vf y = vsilu_mul(gv, get_lanes(gate_up, u + i, bf16));
      if (bf16)
        store_bf16((uint16_t *)out + o + i, y);
      else
        *(vf *)((float *)out + o + i) = y;
    }
    for (; i < inter; i++) {
      const float gi = get_elem(gate_up, g + i, bf16);
      put_kv(out, o + i, gi / (1.0f + expf(-gi)) * get_elem(gate_up, u + i, bf16), bf16);
    }
  }
}

/* out[t] = silu(g) * u for the row t of gate_up [T, 2 I] = g | u (row stride gu_stride):
 * g / (1 + exp(-g)) * u, out [T, I] dense. Returns PLAIT_OK, or PLAIT_ERR_SHAPES for a
 * negative size. */
int plait_silu_mul(const float *gate_up, long gu_stride, long num_tokens, long inter,
                   float *out) {
  if (num_tokens < 0 || inter < 0) return PLAIT_ERR_SHAPES;
  silu_mul(gate_up, gu_stride, num_tokens, inter, out, 0);
  return PLAIT_OK;
}

/* plait_silu_mul over bfloat16: gate_up and out hold bf16 bits; each element widened
 * (exactly), the same float32 arithmetic as plait_silu_mul, the result rounded to nearest
 * even: the bits of plait_silu_mul on the widened input, then rounded. */
int plait_silu_mul_bf16(const uint16_t *gate_up, long gu_stride, long num_tokens, long inter,
                        uint16_t *out) {
  if (num_tokens < 0 || inter < 0) return PLAIT_ERR_SHAPES;
  silu_mul(gate_up, gu_stride, num_tokens, inter, out, 1);
  return PLAIT_OK;
}
