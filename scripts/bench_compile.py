"""In-process decode throughput, eager vs `compile=True` (issue 12), interleaved in one run.

Both engines live in this process (default model, default options otherwise). Each round
generates, on each engine in turn, with a fresh 512-token prompt (so no round hits the
previous one's prefix cache):

    W3-like: n=16 choices x 128 tokens (ignore_eos, seeded, temperature 0.8)
    W5-like: one stream of 128 tokens (same sampling)

and prints tok/s (generated tokens / wall time of `generate`, prefill included), the startup
time of each engine (the compiled one compiles at startup) and whether the two engines
chose the same tokens. One JSON line per measurement with --json.

    PYTHONPATH=. python scripts/bench_compile.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from plait import LLM, SamplingParams


def make_prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def timed_generate(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[float, list]:
    start = time.perf_counter()
    out = llm.generate([ids], params)[0]
    seconds = time.perf_counter() - start
    return seconds, [c.token_ids for c in out.outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="one JSON line per measurement")
    args = parser.parse_args()

    engines: dict[str, LLM] = {}
    for name, options in (("eager", {}), ("compiled", {"compile": True})):
        start = time.perf_counter()
        engines[name] = LLM(**options)
        print(f"startup {name}: {time.perf_counter() - start:.1f} s", flush=True)
    workloads = {
        "W3 n=16": SamplingParams(n=args.n, temperature=0.8, max_tokens=args.max_tokens,
                                  seed=42, ignore_eos=True),
        "W5 n=1": SamplingParams(n=1, temperature=0.8, max_tokens=args.max_tokens, seed=42,
                                 ignore_eos=True),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    same = total = 0
    for round_ in range(args.rounds):
        for w, (workload, params) in enumerate(workloads.items()):
            ids = make_prompt(1000 * round_ + w, args.prompt_tokens)
            chosen = {}
            order = list(engines) if round_ % 2 == 0 else list(reversed(engines))
            for name in order:
                seconds, chosen[name] = timed_generate(engines[name], ids, params)
                tokens = sum(len(t) for t in chosen[name])
                rate = tokens / seconds
                rates.setdefault((workload, name), []).append(rate)
                line = dict(round=round_, workload=workload, engine=name, tokens=tokens,
                            seconds=round(seconds, 3), tok_s=round(rate, 1))
                print(json.dumps(line) if args.json else
                      f"round {round_} {workload:8s} {name:8s} {tokens} tokens in "
                      f"{seconds:6.2f} s = {rate:6.1f} tok/s", flush=True)
            same += sum(a == b for a, b in zip(chosen["eager"], chosen["compiled"],
                                               strict=True))
            total += len(chosen["eager"])
    if not args.rounds:
        return
    print("\nmedian tok/s over rounds:")
    for workload in workloads:
        eager = statistics.median(rates[(workload, "eager")])
        compiled = statistics.median(rates[(workload, "compiled")])
        print(f"  {workload:8s} eager {eager:6.1f}  compiled {compiled:6.1f}  "
              f"ratio {compiled / eager:.3f}")
    print(f"choices with identical tokens, eager vs compiled: {same}/{total}")


if __name__ == "__main__":
    main()
