"""Plait's Llama forward pass against transformers' own model on the same weights."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers.model import PagedHarness, load_model
from helpers.tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.engine.model_loader import ResolvedModel
from plait.kernels.cpu import build
from plait.kernels.cpu.build import NATIVE_MAX_ROWS

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far, far away, there lived a dragon who",
    "1, 2, 3, 4, 5,",
]
# float32 on CPU: observed max |diff| ~5e-5 on logits of magnitude ~20.
LOGITS_ATOL = 2e-3


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(default_model: ResolvedModel):
    return load_model(default_model.path), _hf_model(default_model.path)


def test_default_model_logits_match_transformers(models, tokenizer) -> None:
    plait_model, hf = models
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        harness = PagedHarness(plait_model.config)
        table = [7, 3, 12, 40, 9, 21, 30, 31, 5, 6, 1, 2, 8, 10, 11, 13, 14, 15]  # scattered
        (ours,) = harness.run(plait_model, [(ids, 0, table)])
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_mixed_batch_equals_each_alone(models, tokenizer) -> None:
    """One call mixing a fresh prefill, a continuation over a cached prefix and a decode."""
    model, _ = models
    a = tokenizer.encode(PROMPTS[0])
    b = tokenizer.encode(PROMPTS[2])
    c = tokenizer.encode(PROMPTS[1])
    alone = PagedHarness(model.config)
    a_ref = alone.run(model, [(a, 0, [0, 1, 2])])[0]
    b_ref = alone.run(model, [(b, 0, [10, 11, 12, 13, 14])])[0]
    c_ref = alone.run(model, [(c, 0, [20, 21, 22, 23, 24, 25])])[0]

    mixed = PagedHarness(model.config)
    mixed.run(model, [(b[:9], 0, [33, 34, 35])])  # b's first 9 tokens already cached
    mixed.run(model, [(c[:-1], 0, [40, 41, 42, 43, 44, 45])])  # c decodes its last token
    a_out, b_out, c_out = mixed.run(model, [(a, 0, [50, 51, 52]),
                                            (b, 9, [33, 34, 35, 36, 37]),
                                            (c, len(c) - 1, [40, 41, 42, 43, 44, 45])])
    # batch composition changes BLAS blocking (float noise ~1e-4), never more
    torch.testing.assert_close(a_out, a_ref, atol=5e-4, rtol=0)
    torch.testing.assert_close(b_out, b_ref[9:], atol=5e-4, rtol=0)
    torch.testing.assert_close(c_out, c_ref[-1:], atol=5e-4, rtol=0)


def test_kept_rows_equal_those_of_the_full_forward(models, tokenizer) -> None:
    """`keep` (the runner's sampled rows): the last layer attends and runs its MLP for those
    rows only. Their logits equal the full forward's (float noise: their attention runs
    as decode rows), and every token's K/V is written the same, bit for bit."""
    model, _ = models
    a = tokenizer.encode(" ".join(PROMPTS))  # a fresh prompt longer than the native stack's
    b, c = tokenizer.encode(PROMPTS[2]), tokenizer.encode(PROMPTS[1])
    base = PagedHarness(model.config)
    base.run(model, [(b[:9], 0, [33, 34, 35])])
    base.run(model, [(c[:-1], 0, [40, 41, 42, 43, 44, 45])])
    seqs = [(a, 0, list(range(46, 46 + -(-len(a) // 4)))), (b, 9, [33, 34, 35, 36, 37]),
            (c, len(c) - 1, [40, 41, 42, 43, 44, 45])]
    ids, positions, meta = base.step(seqs)
    assert ids.shape[0] > NATIVE_MAX_ROWS  # the layer loop, not the one-call native stack
    keep = meta.cu_seqlens_q[1:].long() - 1  # each sequence's last row
    full_kv, kept_kv, none_kv = (copy.deepcopy(base.kv) for _ in range(3))
    full = model.compute_logits(base.forward(model, ids, positions, meta, full_kv))
    meta = base.step(seqs)[2]
    meta.keep = keep
    kept = model.compute_logits(base.forward(model, ids, positions, meta, kept_kv))
    meta = base.step(seqs)[2]
    meta.keep = keep[:0]
    empty = base.forward(model, ids, positions, meta, none_kv)
    assert kept.shape == (3, model.config.vocab_size) and empty.shape[0] == 0
    torch.testing.assert_close(kept, full[keep], atol=5e-4, rtol=0)
    for kv in (kept_kv, none_kv):
        for (k, v), (k_ref, v_ref) in zip(kv, full_kv, strict=True):
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_wrong_block_table_changes_logits(models, tokenizer) -> None:
    """Guard: the harness really reads K/V through the block table."""
    model, _ = models
    ids = tokenizer.encode(PROMPTS[3])
    harness = PagedHarness(model.config)
    table = [1, 2, 3, 4, 5]
    harness.run(model, [(ids[:-1], 0, table)])
    good = harness.run(model, [(ids, len(ids) - 1, table)])[0]
    # Block 9 was never written: attention over it must give different logits.
    bad = harness.run(model, [(ids, len(ids) - 1, [1, 9, 3, 4, 5])])[0]
    assert (good - bad).abs().max() > 1e-2


def test_greedy_32_tokens_equal_transformers_generate(default_model, models, tokenizer) -> None:
    _, hf = models
    llm = LLM(num_kv_blocks=128, block_size=16, numerics="exact")
    ids = tokenizer.encode("Once upon a time, in a small village by the sea,")
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32))
    assert ours[0].outputs[0].finish_reason == "length"
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours[0].outputs[0].token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("native", [True, False], ids=["cpu-native-ops", "torch-ops"])
@pytest.mark.parametrize("model_type,rope_scaling", [
    ("qwen2", None),
    ("mistral", None),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_tiny_architectures_match_transformers(tmp_path, default_model, model_type,
                                               rope_scaling, native) -> None:
    """Both CPU ops tables (the native kernels, and plain torch) give transformers' logits."""
    path = make_tiny_model(tmp_path / model_type, default_model.path, model_type, rope_scaling)
    ours_model, hf = load_model(path, native=native), _hf_model(path)
    assert ours_model.ops.name == ("cpu-native" if native and build.available() else "torch")
    if rope_scaling is not None:
        assert ours_model.config.rope_scaling is not None
    ids = list(range(100, 300, 3))  # 67 tokens: positions past original_max_position_embeddings
    harness = PagedHarness(ours_model.config, num_blocks=32)
    (ours,) = harness.run(ours_model, [(ids, 0, list(range(20)))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
