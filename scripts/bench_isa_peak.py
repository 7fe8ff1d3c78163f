"""The vector instructions' own rates on this CPU, one core: what the int8 and bf16 products
can reach at best, and what a broadcast operand costs them. Compiles a small C program with
the machine's compiler (cc -O3 -march=native) into a temporary folder and runs it; needs
AVX-512 VNNI and BF16 (elsewhere it says so and exits 0).

Prints, per line, instructions retired per nanosecond and per cycle at the clock a chain
of dependent scalar adds runs at (one a cycle):
  - vpdpbusd zmm with 1 and 12 independent accumulators (its latency, its throughput);
  - vdpbf16ps zmm and vfmadd zmm (vLLM's bf16 product and a float32 one);
  - vpdpbusd whose int8 operand is broadcast from memory for each instruction: a separate
    vpbroadcastd, one broadcast shared by two, or the instruction's own {1to16} operand.

    python scripts/bench_isa_peak.py [--iters 200000000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static int32_t quads[16384] __attribute__((aligned(64)));
static double ghz;
static void report(const char *what, long n, double s) {
  printf("%-58s %6.2f /ns  %5.2f /cycle\n", what, n / s / 1e9, n / s / 1e9 / ghz);
}
#define DPB(acc, w, p) \
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(p)))
int main(int argc, char **argv) {
  const long N = argc > 1 ? atol(argv[1]) : 200000000L;
  for (int i = 0; i < 16384; i++) quads[i] = i * 7;
  long x = 0;
  double t = now();
  for (long i = 0; i < N; i++) __asm__ volatile("add $1, %0" : "+r"(x));
  ghz = N / (now() - t) / 1e9;
  printf("clock (a chain of dependent adds): %.2f GHz\n", ghz);
  __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5), b2 = _mm512_set1_epi8(4);
  {
    __m512i a = _mm512_setzero_si512();
    t = now();
    for (long n = 0; n < N / 4; n++) a = _mm512_dpbusd_epi32(a, b, c);
    report("vpdpbusd zmm, 1 accumulator (latency bound)", N / 4, now() - t);
    printf("  (check %d)\n", _mm512_reduce_add_epi32(a));
  }
  {
    __m512i a[12];
    for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
    t = now();
    for (long n = 0; n < N / 12; n++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
      __asm__ volatile("" : "+v"(b));
    }
    report("vpdpbusd zmm, 12 accumulators", N / 12 * 12, now() - t);
    int s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_epi32(a[i]);
    printf("  (check %d)\n", s);
  }
  {
    __m512 f[12];
    __m512bh p = (__m512bh)_mm512_set1_epi16(0x3f80);
    for (int i = 0; i < 12; i++) f[i] = _mm512_set1_ps((float)i);
    t = now();
    for (long n = 0; n < N / 12; n++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) f[i] = _mm512_dpbf16_ps(f[i], p, p);
      __asm__ volatile("" : "+v"(p));
    }
    report("vdpbf16ps zmm, 12 accumulators", N / 12 * 12, now() - t);
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(f[i]);
    printf("  (check %g)\n", s);
  }
  {
    __m512 f[12], g = _mm512_set1_ps(0.999f);
    for (int i = 0; i < 12; i++) f[i] = _mm512_set1_ps((float)i);
    t = now();
    for (long n = 0; n < N / 12; n++) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; i++) f[i] = _mm512_fmadd_ps(f[i], g, g);
      __asm__ volatile("" : "+v"(g));
    }
    report("vfmadd231ps zmm, 12 accumulators", N / 12 * 12, now() - t);
    float s = 0;
    for (int i = 0; i < 12; i++) s += _mm512_reduce_add_ps(f[i]);
    printf("  (check %g)\n", s);
  }
  {
    __m512i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
    t = now();
    for (long n = 0; n < N / 8; n++) {
      const int32_t *q = quads + (n & 511) * 8;
#pragma GCC unroll 8
      for (int i = 0; i < 8; i++) a[i] = _mm512_dpbusd_epi32(a[i], b, _mm512_set1_epi32(q[i]));
      __asm__ volatile("" : "+v"(b));
    }
    report("vpdpbusd, a vpbroadcastd from memory for each", N / 8 * 8, now() - t);
    int s = 0;
    for (int i = 0; i < 8; i++) s += _mm512_reduce_add_epi32(a[i]);
    printf("  (check %d)\n", s);
  }
  {
    __m512i a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_set1_epi32(i);
    t = now();
    for (long n = 0; n < N / 8; n++) {
      const int32_t *q = quads + (n & 511) * 8;
#pragma GCC unroll 4
      for (int i = 0; i < 4; i++) {
        const __m512i xb = _mm512_set1_epi32(q[i]);
        a[i] = _mm512_dpbusd_epi32(a[i], b, xb);
        a[i + 4] = _mm512_dpbusd_epi32(a[i + 4], b2, xb);
      }
      __asm__ volatile("" : "+v"(b), "+v"(b2));
    }
    report("vpdpbusd, one vpbroadcastd for two", N / 8 * 8, now() - t);
    int s = 0;
    for (int i = 0; i < 8; i++) s += _mm512_reduce_add_epi32(a[i]);
    printf("  (check %d)\n", s);
  }
  {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
            a7 = a0;
    t = now();
    for (long n = 0; n < N / 8; n++) {
      const int32_t *q = quads + (n & 511) * 8;
      DPB(a0, b, q); DPB(a1, b, q + 1); DPB(a2, b, q + 2); DPB(a3, b, q + 3);
      DPB(a4, b, q + 4); DPB(a5, b, q + 5); DPB(a6, b, q + 6); DPB(a7, b, q + 7);
      __asm__ volatile("" : "+v"(b));
    }
    report("vpdpbusd, its own {1to16} memory operand for each", N / 8 * 8, now() - t);
    const __m512i lo = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3));
    const __m512i hi = _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7));
    printf("  (check %d)\n", _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)));
  }
  return 0;
}
"""


def cpu_flags() -> set[str]:
    """The flags of the first processor in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200_000_000)
    args = parser.parse_args()
    missing = {"avx512_vnni", "avx512_bf16", "avx512bw"} - cpu_flags()
    if missing:
        print(f"this CPU lacks {', '.join(sorted(missing))}: nothing to measure")
        return
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        sys.exit("no C compiler (cc) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp, "peak.c"), Path(tmp, "peak")
        source.write_text(SOURCE)
        subprocess.run([compiler, "-O3", "-march=native", str(source), "-o", str(binary)],
                       check=True)
        subprocess.run([str(binary), str(args.iters)], check=True)


if __name__ == "__main__":
    main()
