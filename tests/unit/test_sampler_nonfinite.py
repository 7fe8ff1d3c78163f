"""Sampling never returns a token id outside the vocabulary, even from non-finite logits
(a repetition_penalty of 1e-300 turns positive logits into +inf)."""

from __future__ import annotations

import math

import torch

from plait import LLM, SamplingParams
from plait.engine.sampler import _inverse_cdf

INF = math.inf


def test_inverse_cdf_with_infinite_and_nan_rows() -> None:
    logits = torch.tensor([[0.0, INF, 1.0, INF],  # the +inf tokens share the mass
                           [-INF, -INF, -INF, -INF],  # nothing left: still a real token
                           [0.0, math.nan, 1.0, 2.0]])  # [3, 4]
    for u in (0.0, 0.3, 0.7, 0.999):
        picked = _inverse_cdf(logits, torch.full((3, 1), u)).tolist()
        assert picked[0] == (1 if u < 0.5 else 3)
        assert all(0 <= t < 4 for t in picked[1:])


def test_a_tiny_repetition_penalty_samples_a_prompt_token(tiny_path) -> None:
    """Dividing the positive logits of prompt tokens by 1e-300 makes them +inf (before the
    fix: a NaN distribution, a token id past the vocabulary, a failed step); the request
    finishes normally with tokens of the vocabulary."""
    llm = LLM(str(tiny_path), num_kv_blocks=64, block_size=16)
    ids = [5, 17, 300, 4000, 12345, 17, 99]
    out = llm.generate([ids], SamplingParams(repetition_penalty=1e-300, seed=3, max_tokens=4,
                                             ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert all(0 <= t < llm.engine.info.vocab_size for t in out.token_ids)
