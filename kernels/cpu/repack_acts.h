/* The activations of the repacked products (repack.c, which includes this file after
 * repack.h): x [M, K] quantized to int8 per 32 values, rp_acts_t's q, sx, sxq and sum16
 * (repack.h), by the rule repack.c's header states: sx = max |x| / 127 over the group,
 * q = round(x / sx) to nearest even (0 where the group is all zero), sxq = sx sum q, and
 * sum16 each half-group's sum of q. */
#ifndef PLAIT_CPU_REPACK_ACTS_H
#define PLAIT_CPU_REPACK_ACTS_H

#if LANES == 16
/* Lane j of the result = op over the 16 lanes of v[j], for 16 vectors at once: halves,
 * quarters, pairs and lanes folded pairwise across the vectors (15 x 2 shuffles and 15
 * ops, where 16 separate reductions take 16 x 4 of each); op is max or an integer add, so
 * the order does not change the result. The folds leave group 4 k + q in lane 4 q + k,
 * which the last permute undoes. */
#define RP_REDUCE16(T, OP, SHUF4, SHUF, v, out)                                          \
  do {                                                                                  \
    T w_[8], u_[4], r_[2];                                                              \
    for (int i_ = 0; i_ < 8; i_++)                                                      \
      w_[i_] = OP(SHUF4(v[2 * i_], v[2 * i_ + 1], 0x44),                                \
                  SHUF4(v[2 * i_], v[2 * i_ + 1], 0xee));                               \
    for (int i_ = 0; i_ < 4; i_++)                                                      \
      u_[i_] = OP(SHUF4(w_[2 * i_], w_[2 * i_ + 1], 0x88),                              \
                  SHUF4(w_[2 * i_], w_[2 * i_ + 1], 0xdd));                             \
    for (int i_ = 0; i_ < 2; i_++)                                                      \
      r_[i_] = OP(SHUF(u_[2 * i_], u_[2 * i_ + 1], 0x44),                               \
                  SHUF(u_[2 * i_], u_[2 * i_ + 1], 0xee));                              \
    const T f_ = OP(SHUF(r_[0], r_[1], 0x88), SHUF(r_[0], r_[1], 0xdd));                \
    out = f_;                                                                           \
  } while (0)
#define RP_SHUF4_PS(a, b, imm) _mm512_shuffle_f32x4(a, b, imm)
#define RP_SHUF_PS(a, b, imm) _mm512_shuffle_ps(a, b, imm)
#define RP_SHUF4_EPI(a, b, imm) _mm512_shuffle_i32x4(a, b, imm)
#define RP_SHUF_EPI(a, b, imm) \
  _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b), imm))

/* 16 groups of row x (x [512]) into q [512] and sx, sxq, sum16 [16, 32, 16, 32 entries]:
 * quantize_row's arithmetic, each group's reductions folded together with the other 15's
 * (RP_REDUCE16: the same maxima and integer sums). */
static void quantize_16_groups(const float *x, int8_t *q, float *sx, float *sxq,
                               int32_t *sum16) {
  /* lane j of RP_REDUCE16's result holds group 4 (j % 4) + j / 4 */
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512 m[16];
  for (int j = 0; j < 16; j++)
    m[j] = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + 32 * j)),
                         _mm512_abs_ps(_mm512_loadu_ps(x + 32 * j + 16)));
  __m512 amax;
  RP_REDUCE16(__m512, _mm512_max_ps, RP_SHUF4_PS, RP_SHUF_PS, m, amax);
  amax = _mm512_permutexvar_ps(order, amax);
  /* 127 / amax where amax > 0, else 0 (quantize_row's inv) */
  const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.0f), amax);
  float inv_j[16] __attribute__((aligned(64)));
  _mm512_store_ps(inv_j, inv);
  __m512i c[2][16];
  for (int j = 0; j < 16; j++)
    for (int h = 0; h < 2; h++) {
      /* vcvtps2dq rounds as lrintf (the default rounding mode: nearest even) */
      c[h][j] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 32 * j + 16 * h),
                                                 _mm512_set1_ps(inv_j[j])));
      _mm_storeu_si128((__m128i *)(q + 32 * j + 16 * h), _mm512_cvtepi32_epi8(c[h][j]));
    }
  __m512i s[2];
  for (int h = 0; h < 2; h++) {
    RP_REDUCE16(__m512i, _mm512_add_epi32, RP_SHUF4_EPI, RP_SHUF_EPI, c[h], s[h]);
    s[h] = _mm512_permutexvar_epi32(order, s[h]);
  }
  const __m512 scale = _mm512_div_ps(amax, _mm512_set1_ps(127.0f));
  _mm512_storeu_ps(sx, scale);
  _mm512_storeu_ps(sxq, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_add_epi32(s[0], s[1]))));
  /* sum16 [2 j + h] = s[h] lane j */
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  _mm512_storeu_si512(sum16, _mm512_permutex2var_epi32(s[0], lo, s[1]));
  _mm512_storeu_si512(sum16 + 16, _mm512_permutex2var_epi32(s[0], hi, s[1]));
}
#endif

/* Row x [K] into q [K], sx, sxq [K / 32], sum16 [K / 16] (see repack.h's rp_acts_t). */
static void quantize_row(const float *x, long K, int8_t *q, float *sx, float *sxq,
                         int32_t *sum16) {
  long g = 0;
#if LANES == 16
  for (; g + 16 <= K / 32; g += 16)
    quantize_16_groups(x + 32 * g, q + 32 * g, sx + g, sxq + g, sum16 + 2 * g);
#endif
  for (; g < K / 32; g++) {
    const float *v = x + 32 * g;
    float amax = 0.0f;
#if LANES == 16
    amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)),
                                              _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
#else
    for (int i = 0; i < 32; i++) amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
#endif
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t sums[2] = {0, 0};
#if LANES == 16
    /* vcvtps2dq rounds as lrintf (the default rounding mode: nearest even) */
    for (int h = 0; h < 2; h++) {
      __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * h),
                                                   _mm512_set1_ps(inv)));
      _mm_storeu_si128((__m128i *)(q + 32 * g + 16 * h), _mm512_cvtepi32_epi8(c));
      sums[h] = _mm512_reduce_add_epi32(c);
    }
#else
    for (int i = 0; i < 32; i++) {
      int32_t c = (int32_t)lrintf(v[i] * inv);
      q[32 * g + i] = (int8_t)c;
      sums[i / 16] += c;
    }
#endif
    sx[g] = amax / 127.0f;
    sxq[g] = sx[g] * (float)(sums[0] + sums[1]);
    sum16[2 * g] = sums[0];
    sum16[2 * g + 1] = sums[1];
  }
}

/* The buffers of M quantized rows in one allocation (*mem, freed by the caller), padded
 * with zero rows (q, sx, sxq, sum16 all 0) to a multiple of 16: the AMX rung's A tiles
 * (repack_amx.h) read whole blocks of 16 rows. */
static int quantize_acts(const float *x, long M, long ldx, long K, rp_acts_t *a, void **mem) {
  long ldq = (K + 63) / 64 * 64, G = K / 32, M16 = (M + 15) / 16 * 16;
  size_t qbytes = (size_t)(M16 * ldq), fbytes = sizeof(float) * (size_t)(M16 * G);
  size_t total = (qbytes + 2 * fbytes + 2 * fbytes + 63) / 64 * 64;
  uint8_t *buf = aligned_alloc(64, total);
  *mem = buf;
  if (!buf) return PLAIT_ERR_NOMEM;
  int8_t *q = (int8_t *)buf;
  float *sx = (float *)(buf + qbytes), *sxq = sx + M16 * G;
  int32_t *sum16 = (int32_t *)(sxq + M16 * G);
  memset(q + M * ldq, 0, (size_t)((M16 - M) * ldq));
  memset(sx + M * G, 0, sizeof(float) * (size_t)((M16 - M) * G));
  memset(sxq + M * G, 0, sizeof(float) * (size_t)((M16 - M) * G));
  memset(sum16 + M * 2 * G, 0, sizeof(int32_t) * (size_t)((M16 - M) * 2 * G));
#pragma omp parallel for schedule(static) if (M * K >= 16384)
  for (long m = 0; m < M; m++)
    quantize_row(x + m * ldx, K, q + m * ldq, sx + m * G, sxq + m * G, sum16 + m * 2 * G);
  *a = (rp_acts_t){q, sx, sxq, sum16, ldq, G};
  return PLAIT_OK;
}

#endif /* PLAIT_CPU_REPACK_ACTS_H */
