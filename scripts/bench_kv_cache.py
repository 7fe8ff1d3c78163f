"""Decode steps and resident memory of an in-process engine with a given KV cache: `--n`
unique prompts of `--prompt-tokens` tokens submitted at once, `--tokens` tokens each
(temperature 0.8, seeded, EOS ignored), stepped by hand. Prints the pool (blocks, tokens,
MiB), the wall time of the steps after the last prefill (min / median: the median is the
all-rows decode step), and the process's resident memory after load, after the run and at
its peak (/proc/self/status VmRSS, VmHWM). Compare dtypes with the same `--num-kv-blocks`
(a pool of the same token count).

    python scripts/bench_kv_cache.py [--kv-cache-dtype auto|bfloat16] [--num-kv-blocks 600]
        [--n 16] [--prompt-tokens 512] [--tokens 40] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from plait import LLM, SamplingParams
from plait.bench.workloads import random_words


def _mib(key: str) -> float:
    """A /proc/self/status memory figure (kB there) in MiB."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (float32) or bfloat16")
    parser.add_argument("--num-kv-blocks", type=int, default=600)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_dtype=args.kv_cache_dtype, num_kv_blocks=args.num_kv_blocks)
    runner = llm.engine.runner
    loaded = _mib("VmRSS")
    rng = random.Random(0)
    prompts = [llm.tokenizer.encode(f"a{i} " + random_words(rng, 2 * args.prompt_tokens))
               [:args.prompt_tokens] for i in range(args.n)]
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        llm.engine.add_request(f"r{i}", ids, params)
    total_prompt = sum(map(len, prompts))
    decode_ms: list[float] = []
    while llm.engine.has_unfinished():
        start = time.perf_counter()
        llm.engine.step()
        elapsed = (time.perf_counter() - start) * 1e3
        if llm.stats().prompt_tokens_computed >= total_prompt:
            decode_ms.append(elapsed)
    decode_ms = decode_ms[1:]  # the first computed the last prefill
    print(f"{args.kv_cache_dtype} KV: {runner.num_blocks} blocks ({runner.num_blocks * 16} "
          f"tokens), pool {runner.kv_cache.nbytes / 2**20:.0f} MiB | decode steps min "
          f"{min(decode_ms):.1f} ms, median {statistics.median(decode_ms):.1f} ms "
          f"({len(decode_ms)} steps) | RSS after load {loaded:.0f} MiB, after the run "
          f"{_mib('VmRSS'):.0f} MiB, peak {_mib('VmHWM'):.0f} MiB")


if __name__ == "__main__":
    main()
