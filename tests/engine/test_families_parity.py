"""Each supported family's forward pass against transformers' own model on the same tiny
random weights (float32, CPU): every position's logits through both CPU ops tables,
transformers' greedy tokens and their logprobs through the engine (`LLM`), n > 1 with
seeds, prefix caching, and a batch equal to each request alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine import make_llm, prompt
from helpers.hf_greedy import assert_greedy_matches, hf_greedy, hf_model
from helpers.model import PagedHarness, load_model
from helpers.tiny_model import save_checkpoint

from plait import SamplingParams
from plait.engine.model_loader import ResolvedModel
from plait.kernels.cpu import build

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# family -> (HF model_type, config overrides). Each exercises its variants: an explicit
# head_dim unequal to hidden / heads (qwen3), multipliers (granite), a NoPE layer
# (smollm3: every 4th), whole-projection q/k norms and post-norms (olmo2).
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", dict(head_dim=32)),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(embedding_multiplier=6.0, residual_multiplier=0.5,
                                attention_multiplier=0.2, logits_scaling=2.5)),
    "smollm3": ("smollm3", {}),
    # Qwen2.5's long-context yarn on the Llama shape (the native whole stack reads the
    # scaled table); prompts past original_max_position_embeddings
    "qwen2-yarn": ("qwen2", dict(rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
        rope_theta=10000.0))),
    # partial rotary (8 of 16 dims), longrope past original_max_position_embeddings (the
    # prompts are longer: transformers takes the long factors, as Plait does for a context
    # beyond it), every layer windowed
    "phi3": ("phi3", dict(
        partial_rotary_factor=0.5, original_max_position_embeddings=16, sliding_window=12,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                             short_factor=[1.0, 1.3, 1.7, 2.5],
                             long_factor=[1.5, 2.0, 3.5, 6.0]))),
    # alternate layers windowed, both softcaps, query_pre_attn_scalar != head_dim, tied head
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                              tie_word_embeddings=True)),
    # 7 layers: layer 5 global (one in 6), the others windowed with their own RoPE base;
    # linear scaling on the global layer only
    "gemma3": ("gemma3_text", dict(
        head_dim=16, num_hidden_layers=7, sliding_window=8, query_pre_attn_scalar=24,
        final_logit_softcapping=8.0, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
            "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
}
NUM_TOKENS = 16
# float32 on CPU: the two models differ by reduction order only (observed ~1e-5)
LOGITS_ATOL = 2e-4
LOGPROB_ATOL = 1e-4


def make_family_model(out_dir: Path, tokenizer_dir: Path, family: str, seed: int = 0) -> Path:
    """A tiny random checkpoint of `family` with the default model's tokenizer: weights
    ~N(0, 0.2) (peaky logits), norm weights around their identity."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, overrides = FAMILIES[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
        pad_token_id=0)
    kwargs.update(overrides)  # (a family's own keys override the shared ones)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    identity = 0.0 if model_type.startswith("gemma") else 1.0  # Gemma norms scale by 1 + w
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.2)
            else:
                param.normal_(identity, 0.2)
    return save_checkpoint(model, out_dir, tokenizer_dir)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory, default_model: ResolvedModel):
    """(family name, checkpoint path, transformers' model on it)."""
    name = request.param
    path = make_family_model(tmp_path_factory.mktemp(name), default_model.path, name)
    return name, path, hf_model(path)


@pytest.mark.parametrize("native", [True, False], ids=["cpu-native-ops", "torch-ops"])
def test_logits_match_transformers(family, native) -> None:
    """Every position of a 67-token prompt, in one prefill over scattered blocks."""
    _, path, hf = family
    ours = load_model(path, native=native)
    assert ours.ops.name == ("cpu-native" if native and build.available() else "torch")
    assert ours.stack is None or ours.config.is_plain
    ids = list(range(100, 300, 3))
    harness = PagedHarness(ours.config, num_blocks=32)
    (logits,) = harness.run(ours, [(ids, 0, [5, 2, 9, *range(10, 27)])])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(logits, ref, atol=LOGITS_ATOL, rtol=0)


def test_greedy_tokens_and_logprobs_match_transformers(family) -> None:
    """16 greedy tokens through the engine (decode steps on the native stack's size) equal
    transformers' `generate`, and their logprobs its full forward's."""
    _, path, hf = family
    llm = make_llm(path, num_kv_blocks=64, block_size=4)
    for seed in (1, 2):
        ids = prompt(seed, 21)
        assert_greedy_matches(llm, ids, hf_greedy(hf, ids, NUM_TOKENS), LOGPROB_ATOL)


def test_seeded_choices_cache_and_batch(family) -> None:
    """n=3 seeded: choice i is the n=1 request with seed + i; the same request again is
    served from the prefix cache with the same tokens; two prompts batched give what each
    gives alone."""
    _, path, _ = family
    llm = make_llm(path, num_kv_blocks=128, block_size=4)
    ids = prompt(7, 26)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11, n=3)
    first = llm.generate([ids], params)[0]
    alone = [llm.generate([ids], params.for_choice(i))[0].outputs[0].token_ids
             for i in range(3)]
    assert [c.token_ids for c in first.outputs] == alone
    assert len({tuple(t) for t in alone}) > 1  # the seeds really differ
    again = llm.generate([ids], params)[0]
    assert [c.token_ids for c in again.outputs] == alone
    assert again.outputs[0].num_cached_tokens >= 4 * math.floor(len(ids) / 4) - 4

    other = prompt(8, 13)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    fresh = make_llm(path, num_kv_blocks=128, block_size=4, enable_prefix_caching=False)
    batched = fresh.generate([ids, other], greedy)
    solo = [fresh.generate([p], greedy)[0] for p in (ids, other)]
    assert [b.outputs[0].token_ids for b in batched] == [s.outputs[0].token_ids for s in solo]


def test_chunked_prefill_matches_transformers(family) -> None:
    """A 45-token prompt prefilled in chunks of 16 (the first two sample nothing: their
    last layer attends no row) gives transformers' greedy tokens and logprobs."""
    _, path, hf = family
    llm = make_llm(path, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    ids = prompt(5, 45)
    assert_greedy_matches(llm, ids, hf_greedy(hf, ids, NUM_TOKENS), LOGPROB_ATOL)
