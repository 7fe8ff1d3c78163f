"""Shared-prefix (cascade) attention inside the engine: the n choices of one prompt decode
with their shared prompt blocks attended once, and their tokens are exactly those of the
plain paged attention (and of each choice run alone)."""

from __future__ import annotations

import pytest
from engine_helpers import alone, make_llm, prompt

from plait import SamplingParams
from plait.kernels import cascade

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _choices(tiny_path, ids: list[int], params: SamplingParams) -> list[list[int]]:
    (result,) = make_llm(tiny_path).generate([ids], params)
    return [list(c.token_ids) for c in result.outputs]


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, 0), (1.0, 8)])
def test_cascade_decode_gives_the_tokens_of_plain_attention(tiny_path, monkeypatch,
                                                            temperature, top_k) -> None:
    """Greedy, and seeded sampling among the top 8: the tiny random model's distribution
    over the whole vocabulary is nearly flat, so an inverse-CDF draw over all of it moves to
    a neighbouring token when two attention kernels' logits differ in the last bits (5 of
    12 seeds did, with or without the native kernels); among 8 tokens it does not."""
    ids = prompt(4, 41)  # block_size 4: 10 full shared blocks, 1 partial copied per choice
    params = SamplingParams(n=5, temperature=temperature, top_k=top_k, seed=9, max_tokens=12,
                            ignore_eos=True)
    cascade._cached_plan.clear()
    shared = _choices(tiny_path, ids, params)
    plan = cascade._cached_plan.last
    assert [p.rows for p in plan.prefixes] == [slice(0, 5)]  # consecutive rows: a slice
    assert len(plan.prefixes[0].block_ids) == 10
    monkeypatch.setenv("PLAIT_CASCADE", "0")
    assert _choices(tiny_path, ids, params) == shared
    single = SamplingParams(temperature=temperature, top_k=top_k, seed=9 + 2, max_tokens=12,
                            ignore_eos=True)
    assert alone(tiny_path, ids, single).token_ids == shared[2]
