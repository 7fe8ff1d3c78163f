#!/usr/bin/env python3
"""One build's prefill and decode speed in-process, without HTTP, for before/after
comparisons of two checkouts (BENCHMARKS.md, "Model families"):

    python scripts/bench_prefill_ab.py FILE.gguf [--numerics int8|bf16|exact]
        [--kv-cache-dtype bfloat16]
        # prefill_ms=... decode_ms_per_token=... (least: ... / ...)

`LLM` on the file (its defaults, or the mode the flags name; builds before --numerics
took --compute-dtype and the int8 flags, which this script no longer passes), one warm-up,
then 6 times: a prefill of 520 random words (about W1's prompt) with 1 output token, and
another prompt with 65 greedy tokens, whose time less the prefill's, over 64, is the decode time per
token. Prints the medians (and the least of each, which a busy machine moves less). Run
it once per build, alternating, with PYTHONPATH naming the build's `plait` only (a folder
holding a link to that checkout's plait/) and a PLAIT_CACHE of its own."""
from __future__ import annotations

import argparse
import random
import statistics
import time

from plait import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("path")
parser.add_argument("--numerics", default=None,
                    help="auto, int8, bf16 or exact (default: the build's own default)")
parser.add_argument("--kv-cache-dtype", default="auto")
args = parser.parse_args()
extra = {"numerics": args.numerics} if args.numerics else {}
llm = LLM(args.path, num_kv_blocks=512, kv_cache_dtype=args.kv_cache_dtype, **extra)
rng = random.Random(0)
words = ["river", "stone", "light", "apple", "quiet", "number", "garden", "cloud", "paper",
         "iron", "silver", "market"]


def prompt() -> str:
    return " ".join(rng.choice(words) for _ in range(520))


llm.generate([prompt()], SamplingParams(max_tokens=1))  # warm-up
pre, dec = [], []
for _ in range(6):
    t = time.perf_counter()
    llm.generate([prompt()], SamplingParams(max_tokens=1, temperature=0))
    pre.append(time.perf_counter() - t)
    p = prompt()
    t = time.perf_counter()
    llm.generate([p], SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
    total = time.perf_counter() - t
    dec.append((total - pre[-1]) / 64)
print(f"prefill_ms={statistics.median(pre) * 1000:.1f} decode_ms_per_token="
      f"{statistics.median(dec) * 1000:.2f} (least: {min(pre) * 1000:.1f} / "
      f"{min(dec) * 1000:.2f})")
