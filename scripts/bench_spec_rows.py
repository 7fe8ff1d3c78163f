"""What a verification row costs: the time of one engine decode step with B streams of R
query rows each (R = 1 + k drafted tokens), on a real model, in process.

Every stream drafts exactly R - 1 tokens each step (junk drafts that are always rejected,
with the acceptance feedback turned off), so a step computes B * R rows and yields B
tokens: its time is the price of verifying R - 1 drafts, whatever they would yield. This
is the measurement behind engine/spec/policy.py's DEFAULT_DISABLE_BY_BATCH_SIZE:

    python scripts/bench_spec_rows.py [--model PATH] [--streams 1,2,4,8,16]
                                      [--rows 1,2,4,8,16] [--context 400] [--steps 12]

Prints ms per step (median of --steps steps after 3 warm-up steps) for every (B, R).
Run it under `flock /tmp/plait-bench.lock` on a shared machine, and note the load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from plait._paths import drop_checkout_root

drop_checkout_root()

import torch  # noqa: E402

from plait import LLM, SamplingParams  # noqa: E402
from plait.engine.spec.config import SpeculativeConfig  # noqa: E402
from plait.engine.spec.driver import SpecDecoder  # noqa: E402
from plait.engine.spec.policy import SpecPolicy  # noqa: E402
from plait.engine.spec.proposer import Proposer, SpecInput  # noqa: E402

WARMUP_STEPS = 3


class JunkDraft(Proposer):
    """Drafts `max_draft_tokens` copies of a token that is (almost) never right."""

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        return [[0] * s.max_draft_tokens for s in seqs]


class FixedK(SpecPolicy):
    """Always the full k: no acceptance feedback, any batch size."""

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        del request_id, num_proposed, num_accepted


def step_ms(llm: LLM, num_streams: int, context: int, steps: int, k: int) -> float:
    """Median ms of a decode step of `num_streams` streams of 1 + k rows."""
    spec = llm.engine.spec
    assert spec is not None
    spec.policy = FixedK(max(k, 1), disable_by_batch_size=10**9)
    if k == 0:
        spec.policy.disable_by_batch_size = 0  # no drafts at all: plain decode steps
    text = "The quick brown fox jumps over the lazy dog. " * (context // 10 + 1)
    ids = llm.tokenizer.encode(text)[:context]
    params = SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=WARMUP_STEPS + steps + k + 4)
    for i in range(num_streams):
        llm.engine.add_request(f"s{num_streams}-{k}-{i}", [i + 5, *ids[1:]], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running
              ) or llm.engine.scheduler.waiting:
        llm.engine.step()  # prefills
    times = []
    for _ in range(WARMUP_STEPS + steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(llm.engine.requests):
        llm.engine.abort(request_id)
    return 1000 * statistics.median(times[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--streams", default="1,2,4,8,16")
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: steadier on a shared machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    streams = [int(s) for s in args.streams.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    max_k = max(rows) - 1
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=max(max_k, 1))
    llm = LLM(args.model, speculative_config=config, num_kv_blocks=2048,
              max_num_batched_tokens=4096)
    spec = llm.engine.spec
    assert spec is not None
    llm.engine.spec = SpecDecoder(config, spec.max_model_len, JunkDraft())
    step_ms(llm, 1, args.context, 2, 0)  # one-time costs (first steps, kernels) first
    print(f"ms per step, context {args.context}; columns: rows per stream (1 + k)")
    print("streams " + "".join(f"{r:>9}" for r in rows))
    for num_streams in streams:
        cells = [step_ms(llm, num_streams, args.context, args.steps, r - 1) for r in rows]
        print(f"{num_streams:>7} " + "".join(f"{c:9.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
