"""Opt-in (PLAIT_REAL_MODELS=1, and the file fetched by `fetch.sh gemma-3-270m`): the real
Gemma 3 270M base model, Q4_K_M GGUF, served in its own format, against transformers on the
same file (its GGUF loader dequantizes the same blocks): at every generated position the
engine's top-5 probabilities equal transformers' within 0.02, on a prompt longer than the
model's 512-token sliding window and on a short one."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers.model import transformers_on_gguf

from plait import LLM, SamplingParams
from plait.engine.models.linear import QuantEmbedding

GEMMA_GGUF = Path(os.environ.get(
    "PLAIT_GEMMA3_GGUF", Path.home() / ".cache/plait/models/gemma-3-270m-q4_k_m.gguf"))
NUM_TOKENS = 16
TOP_K = 5
PROB_ATOL = 0.02

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("PLAIT_REAL_MODELS") != "1",
                       reason="real models run with PLAIT_REAL_MODELS=1"),
    pytest.mark.skipif(not GEMMA_GGUF.is_file(), reason=f"no {GEMMA_GGUF}"),
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(GEMMA_GGUF), num_kv_blocks=96, block_size=16)


def test_gemma3_270m_loads_in_its_own_format(llm) -> None:
    cfg = llm.engine.runner.model_config
    assert (cfg.model_type, cfg.num_layers, cfg.head_dim, cfg.sliding_window) == \
        ("gemma3_text", 18, 256, 512)
    assert [i for i in range(18) if cfg.window_of(i) == 0] == [5, 11, 17]
    model = llm.engine.runner.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.lm_head.qweight is not None
    out = llm.generate(["The capital of France is"],
                       SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert "Paris" in out.text or "France" in out.text, out.text


def test_gemma3_270m_top_k_probabilities_match_transformers(llm) -> None:
    tokenizer = llm.tokenizer
    long_text = " ".join(f"Item {i}: the {i % 7}th colour of the rainbow." for i in range(70))
    prompts = [tokenizer.encode(long_text + " To summarise,"),
               tokenizer.encode("Water boils at a temperature of")]
    assert len(prompts[0]) > 600  # past the 512-token window
    hf = transformers_on_gguf(GEMMA_GGUF)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=TOP_K,
                            ignore_eos=True)
    for ids, result in zip(prompts, llm.generate(prompts, params), strict=True):
        choice = result.outputs[0]
        assert choice.logprobs is not None
        with torch.no_grad():
            sequence = torch.tensor([ids + choice.token_ids])
            probs = torch.softmax(hf(sequence).logits[0, len(ids) - 1:-1].float(), dim=-1)
        for step, logprob in enumerate(choice.logprobs):
            for token_id, ours in logprob.top:
                theirs = probs[step, token_id].item()
                assert abs(math.exp(ours) - theirs) < PROB_ATOL, \
                    (step, token_id)
            # the greedy pick is transformers' top token, or within the tolerance of it
            assert probs[step].max().item() - probs[step, choice.token_ids[step]].item() \
                < PROB_ATOL


def test_plait_serve_answers_the_openai_sdk_on_gemma3_270m() -> None:
    """The real file through `plait serve` (a base model: completions answer, chat is the
    400 naming the missing template)."""
    import openai
    from helpers.server import start_server

    server = start_server([str(GEMMA_GGUF), "--served-model-name", "gemma-3-270m",
                           "--num-kv-blocks", "256"])
    try:
        server.wait_healthy()
        client = server.openai()
        out = client.completions.create(model="gemma-3-270m", n=2, seed=1, max_tokens=12,
                                        prompt="The capital of France is")
        assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens >= 2
        greedy = client.completions.create(model="gemma-3-270m", max_tokens=12,
                                           temperature=0, prompt="The capital of France is")
        assert "Paris" in greedy.choices[0].text or "France" in greedy.choices[0].text
        with pytest.raises(openai.BadRequestError, match="chat template"):
            client.chat.completions.create(model="gemma-3-270m", max_tokens=4,
                                           messages=[{"role": "user", "content": "Hi"}])
    finally:
        server.stop()
