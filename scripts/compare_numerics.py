#!/usr/bin/env python3
"""How far two engine configurations' numerics are apart, on the same model and tokens.

    python scripts/compare_numerics.py --model FILE.gguf \\
        --a numerics=exact --b numerics=bf16 --tokens 96

Each `--a` / `--b` is a comma-separated list of `LLM` keyword arguments (EngineConfig
fields; values parsed as int, float, true/false or left as strings). For a few prompts:

1. Configuration A generates `--tokens` greedy tokens per prompt, with EOS and the stop
   tokens masked (`min_tokens`), so every prompt scores the same number of tokens.
2. Both configurations score A's sequences, teacher-forced (`prompt_logprobs`: the logprob
   of each actual token given the tokens before it), so the two are compared on the very
   same inputs; the table gives the mean and max absolute difference of those logprobs over
   the generated positions, and over every position.
3. Configuration B generates greedily too: the number of prompts whose tokens equal A's, and
   the first position where they part where they do.

Nothing here is asserted; it prints figures (BENCHMARKS.md records them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from plait import LLM, SamplingParams
from plait.bench.engine_options import engine_options

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Here is a short story about a robot who learns to paint:",
    "Q: What are the three primary colors?\nA:",
]


def parse_options(spec: str) -> dict[str, object]:
    """"a=1,b=true,c=x" -> {"a": 1, "b": True, "c": "x"}."""
    try:
        return engine_options(filter(None, (part.strip() for part in spec.split(","))))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


def scored(llm: LLM, sequences: list[list[int]]) -> list[list[float]]:
    """Teacher-forced logprob of every token after the first, per sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    result = []
    for out in llm.generate(sequences, params):
        assert out.prompt_logprobs is not None
        result.append([lp.logprob for lp in out.prompt_logprobs[1:] if lp is not None])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--a", default="weights=float32", help="reference options")
    parser.add_argument("--b", required=True, help="options compared with --a")
    parser.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    configs = {"A": parse_options(args.a), "B": parse_options(args.b)}

    engines: dict[str, LLM] = {}
    for name, options in configs.items():
        began = time.perf_counter()
        engines[name] = LLM(args.model, **options)
        print(f"{name}: {options} loaded in {time.perf_counter() - began:.1f} s",
              file=sys.stderr)
    tokenizer = engines["A"].tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = {name: greedy(llm, prompts, args.tokens) for name, llm in engines.items()}
    sequences = [p + o for p, o in zip(prompts, outputs["A"], strict=True)]
    logprobs = {name: scored(llm, sequences) for name, llm in engines.items()}

    generated, every = [], []
    for prompt, a, b in zip(prompts, logprobs["A"], logprobs["B"], strict=True):
        diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
        every += diffs
        generated += diffs[len(prompt) - 1:]
    agree, parted = 0, []
    for a, b in zip(outputs["A"], outputs["B"], strict=True):
        if a == b:
            agree += 1
        else:
            parted.append(next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y))
    print(f"model: {args.model or 'SmolLM2-135M-Instruct (embedded)'}")
    print(f"A = {configs['A']}\nB = {configs['B']}")
    print(f"teacher-forced |logprob A - logprob B| over {len(generated)} generated tokens: "
          f"mean {statistics.fmean(generated):.5f}, max {max(generated):.5f}")
    print(f"  over all {len(every)} scored tokens (prompts too): mean "
          f"{statistics.fmean(every):.5f}, max {max(every):.5f}")
    print(f"greedy tokens equal on {agree}/{len(prompts)} prompts x {args.tokens} tokens"
          + (f"; the others part at token {parted}" if parted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
