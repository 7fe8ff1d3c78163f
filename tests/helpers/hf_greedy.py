"""transformers' greedy tokens as the reference of an engine's (the family parity tests:
tests/engine/test_families_parity.py, test_families_gguf.py).

    hf_model(path)                          transformers' float32 eager model of a checkpoint
    hf_greedy(hf, ids, n)                   transformers' n greedy tokens and their logprobs
    assert_greedy_matches(llm, hf, ids, n)  the engine's n greedy tokens equal them, and its
                                            logprobs are within `atol`
"""

from __future__ import annotations

from pathlib import Path

import torch

from plait import LLM, SamplingParams


def hf_model(path: Path):
    """transformers' model of the checkpoint at `path`, float32, eager attention, eval."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_greedy(hf, ids: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' `num_tokens` greedy tokens after `ids` and the logprob of each under
    one full forward of the whole sequence."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=num_tokens, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        tokens = out[0, len(ids):].tolist()
        logprobs = torch.log_softmax(hf(out).logits[0, len(ids) - 1:-1].float(), dim=-1)
    return tokens, [logprobs[i, t].item() for i, t in enumerate(tokens)]


def assert_greedy_matches(llm: LLM, ids: list[int], reference: tuple[list[int], list[float]],
                          atol: float, context: object = None) -> None:
    """The engine's greedy tokens after `ids` equal `reference` (hf_greedy's), and each
    token's logprob is within `atol` of transformers'."""
    tokens, logprobs = reference
    params = SamplingParams(temperature=0, max_tokens=len(tokens), ignore_eos=True,
                            logprobs=0)
    (choice,) = llm.generate([ids], params)[0].outputs
    assert choice.token_ids == tokens, (context, ids)
    assert choice.logprobs is not None
    ours = [lp.logprob for lp in choice.logprobs]
    assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < atol, context
