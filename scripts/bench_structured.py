#!/usr/bin/env python3
"""Per-step cost of structured output: n-choice decode with and without a JSON schema.

    python scripts/bench_structured.py [--n 16] [--tokens 64] [--rounds 3] [--model PATH]

One engine (the offline `EngineCore`, default model unless `--model`), one chat prompt, and
rounds that alternate an unconstrained and a constrained request of `n` choices (seeded
sampling at `--temperature`; the order flips every round), so both modes see the same
machine load. Only decode steps
in which all `n` choices are running are timed (the constrained choices end when their JSON
is complete, the unconstrained ones run `--tokens` tokens with ignore_eos).

Reported per mode: median and mean step time, tokens/s over the timed steps, the runner's
sampling time per step (all sampling steps, grammar work included), and for the
constrained mode the time spent in the grammar step of the sampler (`Sampler._constrain`:
checking each pick, computing masks for refused picks, redrawing) and in advancing the
matchers, the llguidance mask computations alone, and how many picks needed a full mask.
The overhead is the ratio of the median step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from plait.engine import SamplingParams, StructuredSpec
from plait.engine.config import EngineConfig
from plait.engine.core import EngineCore
from plait.engine.grammar import RequestGrammar
from plait.engine.input_batch import CachedRequestState

SCHEMA = {
    "type": "object",
    "properties": {
        "people": {"type": "array", "minItems": 1, "maxItems": 6, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 24},
                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                           "city": {"type": "string", "maxLength": 24},
                           "role": {"enum": ["engineer", "artist", "doctor", "teacher"]}},
            "required": ["name", "age", "city", "role"], "additionalProperties": False}},
    },
    "required": ["people"], "additionalProperties": False,
}


class Timers:
    """Wall time inside the sampler's grammar step and the runner's matcher advance."""

    def __init__(self, core: EngineCore) -> None:
        self.reset()
        sampler = core.runner.sampler
        runner = core.runner
        constrain, advance = sampler._constrain, runner._advance

        def timed_constrain(logits, processed, tokens, meta):
            start = time.perf_counter()
            before = list(tokens)
            try:
                return constrain(logits, processed, tokens, meta)
            finally:
                self.constrain_s += time.perf_counter() - start
                self.checked_rows += sum(g is not None for g in meta.grammars)
                self.masked_rows += sum(a != b for a, b in zip(before, tokens, strict=True))

        def timed_advance(state: CachedRequestState, token_id: int, result) -> bool:
            start = time.perf_counter()
            try:
                return advance(state, token_id, result)
            finally:
                self.advance_s += time.perf_counter() - start

        fill = RequestGrammar.fill_bitmask

        def timed_fill(grammar: RequestGrammar, row) -> None:
            start = time.perf_counter()
            try:
                fill(grammar, row)
            finally:
                self.mask_s += time.perf_counter() - start

        sample = runner._sample

        def timed_sample(*args, **kwargs) -> None:
            start = time.perf_counter()
            try:
                sample(*args, **kwargs)
            finally:
                self.sample_s[self.mode] = (self.sample_s.get(self.mode, 0.0)
                                            + time.perf_counter() - start)

        sampler._constrain = timed_constrain
        runner._advance = timed_advance
        runner._sample = timed_sample
        RequestGrammar.fill_bitmask = timed_fill  # type: ignore[method-assign]

    def reset(self) -> None:
        self.constrain_s = self.advance_s = self.mask_s = 0.0
        self.sample_s: dict[str, float] = {}  # mode -> seconds in the runner's _sample
        self.mode = ""
        self.masked_rows = self.checked_rows = 0


def run_round(core: EngineCore, prompt: list[int], params: SamplingParams, n: int,
              tag: str) -> tuple[list[float], int]:
    """Step n choices to the end; return the times of steps that sampled all n choices."""
    for i in range(n):
        core.add_request(f"{tag}-{i}", prompt, params.for_choice(i))
    times: list[float] = []
    tokens = 0
    while core.has_unfinished():
        decoding = len(core.scheduler.running) == n and all(
            r.output_token_ids for r in core.scheduler.running)
        start = time.perf_counter()
        deltas = core.step().deltas
        elapsed = time.perf_counter() - start
        sampled = sum(len(d.token_ids) for d in deltas)
        if decoding and sampled == n:
            times.append(elapsed)
            tokens += sampled
    return times, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--json", default=None, help="write the results here as JSON")
    args = parser.parse_args()

    core = EngineCore(EngineConfig.from_kwargs(model=args.model))
    timers = Timers(core)
    text = core.tokenizer.apply_chat_template(
        [{"role": "user", "content": "List a few people as JSON: name, age, city and role "
          f"for each, matching this schema: {json.dumps(SCHEMA)}"}],
        tokenize=False, add_generation_prompt=True)
    prompt = core.tokenizer.encode(text)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA))
    free = SamplingParams(temperature=args.temperature, seed=1, max_tokens=args.tokens,
                          ignore_eos=True)
    bound = SamplingParams(temperature=args.temperature, seed=1, max_tokens=args.tokens,
                           structured=spec)
    run_round(core, prompt, SamplingParams(max_tokens=2, structured=spec), 2, "warm")
    timers.reset()  # discard the warm-up's timings
    results: dict[str, dict[str, list[float] | int]] = {
        "unconstrained": {"times": [], "tokens": 0}, "json_schema": {"times": [], "tokens": 0}}
    for r in range(args.rounds):
        order = [("unconstrained", free), ("json_schema", bound)]
        for mode, params in order if r % 2 == 0 else order[::-1]:
            timers.mode = mode
            times, tokens = run_round(core, prompt, params, args.n, f"{mode}-{r}")
            results[mode]["times"] += times  # type: ignore[operator]
            results[mode]["tokens"] += tokens  # type: ignore[operator]
    report: dict[str, dict[str, float]] = {}
    for mode, res in results.items():
        times = res["times"]
        assert isinstance(times, list) and times, f"no timed step for {mode}"
        report[mode] = {"steps": len(times), "median_ms": 1e3 * statistics.median(times),
                        "mean_ms": 1e3 * statistics.fmean(times),
                        "tok_s": res["tokens"] / sum(times),  # type: ignore[operator]
                        "sampling_ms_per_step": 1e3 * timers.sample_s[mode] / len(times)}
    steps = report["json_schema"]["steps"]
    report["json_schema"]["grammar_ms_per_step"] = 1e3 * timers.constrain_s / steps
    report["json_schema"]["advance_ms_per_step"] = 1e3 * timers.advance_s / steps
    report["json_schema"]["mask_ms_per_step"] = 1e3 * timers.mask_s / steps
    report["json_schema"]["masked_rows_share"] = timers.masked_rows / max(timers.checked_rows, 1)
    overhead = report["json_schema"]["median_ms"] / report["unconstrained"]["median_ms"] - 1
    print(f"n={args.n} tokens<={args.tokens} rounds={args.rounds} "
          f"temperature={args.temperature} device={core.info.device}")
    for mode, row in report.items():
        extra = ""
        if mode == "json_schema":
            extra = (f"\n{'':14s} per step: grammar step {row['grammar_ms_per_step']:.2f} ms "
                     f"(of which llguidance masks {row['mask_ms_per_step']:.2f} ms), matcher "
                     f"advance {row['advance_ms_per_step']:.2f} ms; "
                     f"{100 * row['masked_rows_share']:.1f}% of picks redrawn under the mask")
        print(f"{mode:14s} steps {row['steps']:4.0f}  median {row['median_ms']:7.2f} ms  "
              f"mean {row['mean_ms']:7.2f} ms  {row['tok_s']:7.1f} tok/s  sampling "
              f"{row['sampling_ms_per_step']:.2f} ms/step{extra}")
    print(f"overhead (median step): {100 * overhead:+.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "report": report, "overhead": overhead}, f, indent=2)


if __name__ == "__main__":
    main()
