"""Where speculation stops helping: aggregate decode tokens/s of B concurrent streams of the
W6 code edit (plait/bench/texts.py), with and without speculative decoding, in process.

    python scripts/bench_spec_streams.py [--model PATH] [--streams 1,2,4,8,16]
        [--spec JSON] [--max-tokens 160] [--rounds 1] [--engine-option NAME=VALUE ...]

Every stream is the same greedy chat request (the edit prompt), so each stream's drafts
are accepted as often as one stream's: the table shows the step's cost, not a change in
acceptance. Speculation runs at every batch size here (`disable_by_batch_size` is lifted unless
`--keep-policy`)
and the two modes alternate on one engine (plain, spec, plain, spec...) so a load change
on a shared machine hits both. Decode tokens/s counts the tokens after each stream's
first over the time from the step that made the last first token to the last step; the
prefills are not timed. This is the measurement behind engine/spec/policy.py's
DEFAULT_DISABLE_BY_BATCH_SIZE. Run it under `flock /tmp/plait-bench.lock`, note the load.
"""

from __future__ import annotations

import argparse
import statistics
import time

from plait._paths import drop_checkout_root

drop_checkout_root()

import torch  # noqa: E402

from plait import LLM, SamplingParams  # noqa: E402
from plait.bench.engine_options import engine_options  # noqa: E402
from plait.bench.texts import edit_prompt  # noqa: E402
from plait.engine.spec.config import SpeculativeConfig  # noqa: E402
from plait.engine.spec.policy import SpecPolicy  # noqa: E402

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, ' \
               '"prompt_lookup_max": 5}'


def run(llm: LLM, ids: list[int], num_streams: int, max_tokens: int,
        tag: str) -> tuple[float, int, list[int]]:
    """(decode tokens/s over all streams, tokens, stream 0's greedy tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i in range(num_streams):
        llm.engine.add_request(f"{tag}-{i}", ids, params)
    tokens: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(num_streams)}
    started = 0.0
    while llm.engine.has_unfinished():
        for delta in llm.engine.step().deltas:
            tokens[delta.request_id] += delta.token_ids
        if not started and all(tokens.values()):
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    decoded = sum(len(t) - 1 for t in tokens.values())
    return decoded / seconds, decoded, tokens[f"{tag}-0"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--spec", default=DEFAULT_SPEC)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier on a shared machine)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="NAME=VALUE",
                        help="an EngineConfig field (true/false, an int or a string)")
    parser.add_argument("--keep-policy", action="store_true",
                        help="keep the configured disable_by_batch_size (default: lifted), "
                             "to check what a server's policy gives at each B")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    options = engine_options(args.engine_option)
    config = SpeculativeConfig.parse(args.spec)
    llm = LLM(args.model, speculative_config=config, num_kv_blocks=2048,
              max_num_batched_tokens=4096, **options)
    spec = llm.engine.spec
    assert spec is not None
    limit = spec.policy.disable_by_batch_size if args.keep_policy else 10**9
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        edit_prompt().messages, add_generation_prompt=True, tokenize=False))
    run(llm, ids, 1, 8, "warm")
    print(f"W6 edit, prompt {len(ids)} tokens, up to {args.max_tokens} tokens a stream; "
          f"decode tok/s over all streams; spec {config.to_json()}; {options}", flush=True)
    print(f"{'streams':>7} {'plain':>8} {'spec':>8} {'ratio':>6}  acceptance")
    for num_streams in [int(s) for s in args.streams.split(",")]:
        rates: dict[str, list[float]] = {"plain": [], "spec": []}
        outputs: dict[str, list[int]] = {}
        before = llm.stats()
        for turn in range(args.rounds):
            for mode in ("plain", "spec"):
                llm.engine.spec = spec if mode == "spec" else None
                # a fresh policy each run: no pause carried over, at any batch size
                # (with --keep-policy: up to the configured one)
                spec.policy = SpecPolicy(spec.max_k, disable_by_batch_size=limit)
                rate, _, out = run(llm, ids, num_streams, args.max_tokens,
                                   f"{mode}-{num_streams}-{turn}")
                rates[mode].append(rate)
                outputs.setdefault(mode, out)
        after = llm.stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = (after.spec_decode_num_accepted_tokens
                    - before.spec_decode_num_accepted_tokens)
        plain, sped = statistics.median(rates["plain"]), statistics.median(rates["spec"])
        same = "" if outputs["plain"] == outputs["spec"] else "  OUTPUT DIFFERS"
        rate = f"{accepted / drafted:.2f} ({accepted}/{drafted})" if drafted else "-"
        print(f"{num_streams:>7} {plain:8.1f} {sped:8.1f} {sped / plain:6.2f}  {rate}{same}",
              flush=True)


if __name__ == "__main__":
    main()
