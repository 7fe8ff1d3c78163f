"""Plait's Llama forward pass against transformers' own model on the same weights."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.engine.model_config import ModelConfig
from plait.engine.model_loader import ResolvedModel
from plait.engine.models.cpu_linear import NATIVE_MAX_ROWS
from plait.engine.models.llama import AttentionMetadata, LlamaForCausalLM
from plait.engine.weights import load_weights

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far, far away, there lived a dragon who",
    "1, 2, 3, 4, 5,",
]
# float32 on CPU: observed max |diff| ~5e-5 on logits of magnitude ~20.
LOGITS_ATOL = 2e-3


def _plait_model(path: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(path), 4096)
    load_weights(model, path)
    return model.eval()


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class PagedHarness:
    """A KV cache with hand-written block tables, to drive the model directly."""

    def __init__(self, cfg: ModelConfig, num_blocks: int = 64, block_size: int = 4) -> None:
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]

    def run(self, model, seqs: list[tuple[list[int], int, list[int]]]) -> list[torch.Tensor]:
        """seqs: (all token ids so far, num already cached, block table). Returns the logits
        of every newly computed position, per sequence."""
        ids, positions, meta = self.step(seqs)
        with torch.no_grad():
            hidden = model(ids, positions, self.kv, meta)
            logits = model.compute_logits(hidden)
        cu = meta.cu_seqlens_q.tolist()
        return [logits[a:b] for a, b in itertools.pairwise(cu)]

    def step(self, seqs: list[tuple[list[int], int, list[int]]],
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The input ids, positions and metadata of one forward over `seqs` (as `run`)."""
        bs = self.block_size
        ids, pos, slots, cu, ctx, tables = [], [], [], [0], [], []
        width = max(len(t) for _, _, t in seqs)
        for tokens, cached, table in seqs:
            span = range(cached, len(tokens))
            ids += tokens[cached:]
            pos += span
            slots += [table[p // bs] * bs + p % bs for p in span]
            cu.append(cu[-1] + len(span))
            ctx.append(len(tokens))
            tables.append(table + [-1] * (width - len(table)))
        meta = AttentionMetadata(
            torch.tensor(slots), torch.tensor(cu, dtype=torch.int32),
            torch.tensor(ctx, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(b - a for a, b in itertools.pairwise(cu)),
            max_context_len=max(ctx))
        return torch.tensor(ids), torch.tensor(pos), meta


@pytest.fixture(scope="module")
def models(default_model: ResolvedModel):
    return _plait_model(default_model.path), _hf_model(default_model.path)


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
    with torch.no_grad():
        full = model.compute_logits(model(ids, positions, full_kv, meta))
        kept = model.compute_logits(model(ids, positions, kept_kv, meta, keep))
        empty = model(ids, positions, none_kv, meta, keep[:0])
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
    llm = LLM(num_kv_blocks=128, block_size=16)
    ids = tokenizer.encode("Once upon a time, in a small village by the sea,")
    ours = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32))
    assert ours[0].outputs[0].finish_reason == "length"
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    assert ours[0].outputs[0].token_ids == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("model_type,rope_scaling", [
    ("qwen2", None),
    ("mistral", None),
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
])
def test_tiny_architectures_match_transformers(tmp_path, default_model, model_type,
                                               rope_scaling) -> None:
    path = make_tiny_model(tmp_path / model_type, default_model.path, model_type, rope_scaling)
    ours_model, hf = _plait_model(path), _hf_model(path)
    if rope_scaling is not None:
        assert ours_model.config.rope_scaling is not None
    ids = list(range(100, 300, 3))  # 67 tokens: positions past original_max_position_embeddings
    harness = PagedHarness(ours_model.config, num_blocks=32)
    (ours,) = harness.run(ours_model, [(ids, 0, list(range(20)))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
