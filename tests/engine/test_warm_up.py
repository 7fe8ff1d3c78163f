"""ModelRunner.warm_up (`warm_up_tokens`): a dummy prompt run once at start writes only the
cache's first blocks, and changes no request's tokens or logprobs."""

from __future__ import annotations

import pytest
from helpers.engine import make_llm, prompt

from plait import SamplingParams
from plait.engine.config import EngineConfig


@pytest.mark.parametrize("tokens", [0, 40])
def test_the_warm_up_writes_the_first_blocks_of_every_layer_only(tiny_path, tokens) -> None:
    llm = make_llm(tiny_path, num_kv_blocks=32, block_size=16, warm_up_tokens=tokens)
    kv = llm.engine.runner.kv_cache  # [L, 2, blocks, 16, H_kv, D]
    written = kv.flatten(3).ne(0).any(-1)  # [L, 2, blocks]
    blocks = -(-tokens // 16)  # 40 tokens: blocks 0-2, the last one in part
    assert written[:, :, :blocks].all() and not written[:, :, blocks:].any()
    if tokens:
        assert not kv[:, :, 2, 40 % 16:].ne(0).any()  # past the prompt's last slot
    assert llm.engine.runner.warm_up(0) == 0
    assert llm.engine.runner.warm_up(10_000) == llm.engine.runner.max_model_len


def test_requests_after_a_warm_up_are_unchanged(tiny_path) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [prompt(seed, 37 + 9 * seed) for seed in range(3)]
    runs = []
    for tokens in (0, 200):
        llm = make_llm(tiny_path, num_kv_blocks=64, block_size=16, warm_up_tokens=tokens)
        runs.append(llm.generate(prompts, params))
    for cold, warm in zip(*runs, strict=True):
        assert cold.outputs[0].token_ids == warm.outputs[0].token_ids
        assert cold.outputs[0].logprobs == warm.outputs[0].logprobs


def test_warm_up_tokens_is_validated() -> None:
    with pytest.raises(ValueError, match="warm_up_tokens must be >= 0"):
        EngineConfig(warm_up_tokens=-1)
    assert EngineConfig().warm_up_tokens == 512
