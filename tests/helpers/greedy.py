"""Sixteen short prompts decoded greedily together (16 rows a decode step) and how two
configurations' decodes compare, as the tests of inexact compute modes (bf16, int8) use
them."""

from __future__ import annotations

from typing import Any

from plait import LLM, SamplingParams
from plait.kernels.cpu import native

PROMPTS = [f"{topic} in one sentence:" for topic in (
    "Explain gravity", "Describe the sea", "Define a prime number", "Explain rain",
    "Describe a cat", "Explain photosynthesis", "Define an atom", "Describe Paris",
    "Explain a rainbow", "Describe winter", "Define energy", "Explain sleep",
    "Describe a forest", "Explain the moon", "Define music", "Describe bread")]
TOKENS = 8


def decode(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    """Each prompt's TOKENS greedy token ids and their logprobs, the 16 decoded together."""
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    choices = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    return ([c.token_ids for c in choices],
            [[lp.logprob for lp in c.logprobs or []] for c in choices])


def compare(a: tuple[list[list[int]], list[list[float]]],
            b: tuple[list[list[int]], list[list[float]]]) -> tuple[int, list[float]]:
    """(how many of the tokens are equal position by position, |logprob a - logprob b| of
    each token the two share: each choice up to where its tokens part)."""
    (ids_a, lps_a), (ids_b, lps_b) = a, b
    agree = sum(x == y for xs, ys in zip(ids_a, ids_b, strict=True)
                for x, y in zip(xs, ys, strict=True))
    diffs = []
    for xs, ys, lx, ly in zip(ids_a, ids_b, lps_a, lps_b, strict=True):
        for x, y, px, py in zip(xs, ys, lx, ly, strict=True):
            if x != y:
                break
            diffs.append(abs(px - py))
    return agree, diffs


def stacked_decode(llm: LLM, model: Any, linears: dict[str, Any]) -> tuple[
        list[list[int]], list[list[float]]]:
    """`decode` through the model's native decoder stack, after checking that the stack's
    first layer points at each of `linears`' descriptors (stack pointer name -> Linear)
    and that the layer loop through the rows' kernels decodes the same."""
    assert model.stack is not None
    for name, linear in linears.items():
        assert model.stack.layers[0, native.STACK_POINTERS.index(name)] \
            == linear.state.desc.data_ptr()
    stacked = decode(llm)
    stack, model.stack = model.stack, None  # the layer loop through the rows' kernels
    try:
        assert decode(llm) == stacked
    finally:
        model.stack = stack
    return stacked
