/* The skinny GEMM of decode steps (see vec.h). */
#include "plait_cpu.h"
#include "vec.h"

/* Cache lines to prefetch ahead while streaming a weight panel (measured on a 2-core
 * Xeon: without it the loads and the FMAs do not overlap and 16 rows run 30% slower). */
#define PREFETCH_LINES 64
#define PREFETCH_LOCALITY 2

int plait_lanes(void) { return LANES; }

/* ------------------------------------------------------------------------------------ */
/* GEMM                                                                                  */
/*                                                                                       */
/* W [N, K] is packed as panels [ceil(N / LANES), K, LANES]: panel p holds columns        */
/* p*LANES .. p*LANES+LANES-1 of y, k-major, so a panel streams contiguously and one      */
/* vector load serves a k step for every row of x. x is repacked per call into row tiles */
/* of at most RMAX rows, k-major (xt[k * R + r]), so the tile's broadcasts share one base */
/* pointer. A tile keeps R accumulator vectors in registers.                              */
/* ------------------------------------------------------------------------------------ */

#define DEFINE_TILE(R)                                                                    \
  static void tile_##R(const float *restrict xt, const float *restrict w, long K,         \
                       float *restrict y, long ldy, int ncols,                            \
                       const float *restrict bias) {                                      \
    vf acc[R];                                                                            \
    for (int r = 0; r < R; r++) acc[r] = (vf){0};                                         \
    _Pragma("GCC unroll 4") for (long k = 0; k < K; k++) {                                \
      __builtin_prefetch(w + (k + PREFETCH_LINES) * LANES, 0, PREFETCH_LOCALITY);       \
      vf wv = *(const vf *)(w + k * LANES);                                               \
      _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) acc[r] += xt[k * R + r] * wv;  \
    }                                                                                     \
    for (int r = 0; r < R; r++) {                                                         \
      float out[LANES];                                                                   \
      memcpy(out, &acc[r], sizeof out);                                                   \
      for (int c = 0; c < ncols; c++) y[r * ldy + c] = out[c] + (bias ? bias[c] : 0.0f);  \
    }                                                                                     \
  }

DEFINE_TILE(1) DEFINE_TILE(2) DEFINE_TILE(3) DEFINE_TILE(4)
DEFINE_TILE(5) DEFINE_TILE(6) DEFINE_TILE(7) DEFINE_TILE(8)
#if RMAX > 8
DEFINE_TILE(9) DEFINE_TILE(10) DEFINE_TILE(11) DEFINE_TILE(12)
#endif
#if RMAX > 12
DEFINE_TILE(13) DEFINE_TILE(14) DEFINE_TILE(15) DEFINE_TILE(16)
#endif

typedef void (*tile_fn)(const float *, const float *, long, float *, long, int, const float *);

static const tile_fn TILES[RMAX + 1] = {
    0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8,
#if RMAX > 8
    tile_9, tile_10, tile_11, tile_12,
#endif
#if RMAX > 12
    tile_13, tile_14, tile_15, tile_16,
#endif
};

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ W^T + bias (NULL: none).
 * w: W packed as described above. Returns PLAIT_OK, or PLAIT_ERR_NOMEM if a buffer could
 * not be allocated. */
int plait_gemm(const float *x, long M, long ldx, const float *w, long N, long K,
               const float *bias, float *y, long ldy) {
  float *xt = malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
  if (!xt) return PLAIT_ERR_NOMEM;
  for (long m = 0; m < M; m += RMAX) {
    long R = M - m < RMAX ? M - m : RMAX;
    for (long r = 0; r < R; r++)
      for (long k = 0; k < K; k++) xt[m * K + k * R + r] = x[(m + r) * ldx + k];
  }
  long panels = (N + LANES - 1) / LANES;
#pragma omp parallel for schedule(static)
  for (long p = 0; p < panels; p++) {
    long c0 = p * LANES;
    int ncols = (int)(N - c0 < LANES ? N - c0 : LANES);
    for (long m = 0; m < M; m += RMAX) {
      long R = M - m < RMAX ? M - m : RMAX;
      TILES[R](xt + m * K, w + p * K * LANES, K, y + m * ldy + c0, ldy, ncols,
               bias ? bias + c0 : NULL);
    }
  }
  free(xt);
  return PLAIT_OK;
}
