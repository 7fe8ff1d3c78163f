"""Shared-prefix (cascade) attention inside the engine: the n choices of one prompt decode
with their shared prompt blocks attended once, and their tokens are exactly those of the
plain paged attention (and of each choice run alone)."""

from __future__ import annotations

import pytest
from helpers.engine import make_llm, prompt, solo_tokens

from plait import SamplingParams
from plait.kernels import AttentionMetadata
from plait.kernels.cpu.attention import CascadePlan, NativeRows

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _choices(tiny_path, ids: list[int], params: SamplingParams, plans: list | None = None,
             **options) -> list[list[int]]:
    """The n choices' tokens; every step's attention plan appended to `plans`."""
    llm = make_llm(tiny_path, **options)
    if plans is not None:
        ops = llm.engine.runner.ops
        real = ops.plan

        def recording(meta: AttentionMetadata, positions):
            plans.append(real(meta, positions).plan)
            return meta

        ops.plan = recording
    (result,) = llm.generate([ids], params)
    return [list(c.token_ids) for c in result.outputs]


def _shared_rows(plan) -> list[tuple[int, int]]:
    """(rows, shared tokens) of each group of decode rows attended together over a shared
    prefix, in either CPU backend's plan."""
    if isinstance(plan, NativeRows):
        sizes = plan.chunk_start.diff().tolist()
        return [(n, t) for n, t in zip(sizes, plan.chunk_shared.tolist(), strict=True)
                if n > 1]
    assert isinstance(plan, CascadePlan)
    return [(p.num_rows, len(p.block_ids) * 4) for p in plan.prefixes]


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, 0), (1.0, 8)])
def test_cascade_decode_gives_the_tokens_of_plain_attention(tiny_path, temperature,
                                                            top_k) -> None:
    """Greedy, and seeded sampling among the top 8: the tiny random model's distribution
    over the whole vocabulary is nearly flat, so an inverse-CDF draw over all of it moves to
    a neighbouring token when two attention kernels' logits differ in the last bits (5 of
    12 seeds did, with or without the native kernels); among 8 tokens it does not."""
    ids = prompt(4, 41)  # block_size 4: 10 full shared blocks, 1 partial copied per choice
    params = SamplingParams(n=5, temperature=temperature, top_k=top_k, seed=9, max_tokens=12,
                            ignore_eos=True)
    for native in (True, False):  # the CPU ops table's native attention, and torch's
        plans: list = []
        shared = _choices(tiny_path, ids, params, plans, native=native)
        # the last decode step: the 5 choices' rows read the 10 shared blocks once
        assert _shared_rows(plans[-1]) == [(5, 40)]
        if not native:
            assert plans[-1].prefixes[0].rows == slice(0, 5)  # consecutive rows: a slice
        assert _choices(tiny_path, ids, params, cascade=False) == shared
    single = SamplingParams(temperature=temperature, top_k=top_k, seed=9 + 2, max_tokens=12,
                            ignore_eos=True)
    assert solo_tokens(tiny_path, ids, single) == shared[2]
