"""One stream with and without speculative decoding, in process, on the same engine:
decode tokens per second and the acceptance rate of a code edit (the model writes a
300-token function back with one change) and of free text (a story: few repeats).

    python scripts/bench_spec_ab.py [--model PATH] [--spec JSON] [--rounds 2]
                                    [--max-tokens 256] [--engine-option NAME=VALUE ...]

The two modes alternate (plain, spec, plain, spec, ...) on one LLM, so a load change on a
shared machine hits both; each line is one run. Greedy output is checked to be the same
in both modes. Run it under `flock /tmp/plait-bench.lock` and note `uptime`'s load.
"""

from __future__ import annotations

import argparse
import time

from plait._paths import drop_checkout_root

drop_checkout_root()

import torch  # noqa: E402

from plait import LLM, SamplingParams  # noqa: E402
from plait.bench.engine_options import engine_options  # noqa: E402

FUNCTION = '''def summarize(values, percentiles=(50, 90, 99), drop_outliers=False):
    """Count, mean, standard deviation and percentiles of a list of numbers.

    Percentiles are nearest-rank, so every reported value is one of the inputs. With
    drop_outliers, values more than three standard deviations from the mean are left out
    before anything is computed.
    """
    if not values:
        raise ValueError("summarize() needs at least one value")
    data = sorted(float(v) for v in values)
    count = len(data)
    mean = sum(data) / count
    variance = sum((x - mean) ** 2 for x in data) / count
    std = variance ** 0.5
    if drop_outliers and std > 0:
        data = [x for x in data if abs(x - mean) <= 3 * std]
        count = len(data)
        mean = sum(data) / count
        variance = sum((x - mean) ** 2 for x in data) / count
        std = variance ** 0.5
    result = {"count": count, "mean": mean, "std": std}
    for p in percentiles:
        if not 0 < p <= 100:
            raise ValueError(f"percentile {p} is outside (0, 100]")
        rank = max(1, -(-p * count // 100))
        result[f"p{p}"] = data[rank - 1]
    return result
'''
PROMPTS = {
    "code edit": "Rename the function `summarize` to `describe` and output the whole "
                 f"function, nothing else:\n\n```python\n{FUNCTION}```",
    "free text": "Write a long story about a lighthouse keeper who finds a message in a "
                 "bottle.",
}
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, ' \
               '"prompt_lookup_max": 5}'


def run(llm: LLM, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens and decode seconds (first token to last) of one request alone."""
    llm.engine.add_request("ab", ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    tokens: list[int] = []
    first = end = 0.0
    while llm.engine.has_unfinished():
        for delta in llm.engine.step().deltas:
            if delta.token_ids and not tokens:
                first = time.perf_counter()
            tokens += delta.token_ids
            end = time.perf_counter()
    return tokens, end - first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier on a shared machine)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineConfig field (true/false, an int or a string), e.g. "
                             "numerics=exact")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = engine_options(args.engine_option)
    llm = LLM(args.model, speculative_config=args.spec, num_kv_blocks=1024, **options)
    spec = llm.engine.spec
    for name, text in PROMPTS.items():
        chat = [{"role": "user", "content": text}]
        ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=False))
        outputs = {}
        for _ in range(args.rounds):
            for mode in ("plain", "spec"):
                llm.engine.spec = spec if mode == "spec" else None
                before = llm.stats()
                tokens, seconds = run(llm, ids, args.max_tokens)
                after = llm.stats()
                drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                accepted = (after.spec_decode_num_accepted_tokens
                            - before.spec_decode_num_accepted_tokens)
                rate = f"{accepted / drafted:.2f}" if drafted else "-"
                print(f"{name:10} {mode:5} prompt {len(ids):4} out {len(tokens):4} "
                      f"decode {(len(tokens) - 1) / seconds:6.1f} tok/s  acceptance {rate}"
                      f" ({accepted}/{drafted})", flush=True)
                outputs.setdefault(mode, tokens)
                if tokens != outputs[mode]:
                    print(f"  {mode}: output differs between rounds")
        same = outputs["plain"] == outputs["spec"]
        print(f"{name:10} greedy output the same with and without: {same}")


if __name__ == "__main__":
    main()
