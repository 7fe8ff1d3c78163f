"""The compiled decode path (`EngineConfig.compile`, engine/models/compiled.py) against the
eager forward it replaces: same logits within float noise, same KV cache writes, same
greedy tokens, same seeded samples."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from engine_helpers import make_llm, prompt
from test_model_parity import PagedHarness
from tiny_model import make_tiny_model
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from plait import SamplingParams
from plait.engine.model_config import ModelConfig
from plait.engine.models.compiled import CompiledDecoder, StepContext
from plait.engine.models.cpu_linear import prepack_cpu_linears
from plait.engine.models.llama import AttentionMetadata, LlamaForCausalLM
from plait.engine.weights import load_weights

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

# Fused kernels round differently from the eager ops: observed max |diff| ~1e-5 on the tiny
# model's logits (magnitude ~10).
LOGITS_ATOL = 1e-4


def _model(path: Path, prepack: bool) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(path), 2048)
    load_weights(model, path)
    if prepack:
        prepack_cpu_linears(model)
    return model.eval()


def _decode_meta(harness: PagedHarness, contexts: list[int]) -> tuple[AttentionMetadata, list]:
    """Decode metadata for sequences of the given lengths, sequence i in blocks 16*i..."""
    bs = harness.block_size
    tables = [[16 * i + b for b in range(16)] for i in range(len(contexts))]
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(contexts)]
    meta = AttentionMetadata(
        torch.tensor(slots), torch.arange(len(contexts) + 1, dtype=torch.int32),
        torch.tensor(contexts, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
        max_query_len=1, max_context_len=max(contexts))
    return meta, tables


@pytest.mark.parametrize("model_type,prepack", [("llama", True), ("qwen2", True),
                                                ("llama", False)])
def test_compiled_decode_step_matches_eager(tmp_path, default_model, model_type,
                                            prepack) -> None:
    """Decode steps of 1, 3 and 6 rows (the 1-token graph and the dynamic one) after a
    prefill: the same logits and the same K/V written into the cache."""
    path = make_tiny_model(tmp_path / model_type, default_model.path, model_type)
    model = _model(path, prepack)
    compiled = CompiledDecoder(model)
    for rows in (1, 3, 6):
        eager_kv = PagedHarness(model.config, num_blocks=16 * rows)
        contexts = [5 + 3 * i for i in range(rows)]
        meta, tables = _decode_meta(eager_kv, contexts)
        # a prefill of every sequence but its last token, run eagerly
        seqs = [(prompt(i, n), 0, tables[i]) for i, n in enumerate(contexts)]
        eager_kv.run(model, [(ids[:-1], 0, table) for ids, _, table in seqs])
        compiled_kv = copy.deepcopy(eager_kv)
        ids = torch.tensor([s[0][-1] for s in seqs])
        positions = torch.tensor(contexts) - 1
        with torch.inference_mode():
            ref = model.compute_logits(model(ids, positions, eager_kv.kv, meta))
            ours = model.compute_logits(compiled(ids, positions, compiled_kv.kv, meta))
        torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)
        for (k_ref, v_ref), (k, v) in zip(eager_kv.kv, compiled_kv.kv, strict=True):
            torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0)
            torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0)
    assert compiled.calls == 3
    assert StepContext.current is None
    # dynamo really compiled graphs (for 1 row and for 2+ rows), it did not run eagerly
    code = compiled._fn._torchdynamo_orig_callable.__code__
    assert len(_debug_get_cache_entry_list(code)) >= 2


def test_attention_op_outside_a_compiled_forward_raises() -> None:
    q = torch.zeros(1, 4, 16)
    with pytest.raises(RuntimeError, match="outside a compiled forward"):
        torch.ops.plait.attention(q, q[:, :2], q[:, :2], torch.tensor(0), 0.25)


@pytest.fixture(scope="module")
def llms(tiny_path):
    eager = make_llm(tiny_path, num_kv_blocks=128, block_size=4)
    compiled = make_llm(tiny_path, num_kv_blocks=128, block_size=4, compile=True)
    assert eager.engine.runner.compiled is None
    assert compiled.engine.runner.compiled is not None
    return eager, compiled


def test_compiled_greedy_tokens_and_logprobs_equal_eager(llms) -> None:
    eager, compiled = llms
    prompts = [prompt(s, 9 + 5 * s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    calls = compiled.engine.runner.compiled.calls
    ref = eager.generate(prompts, params)
    ours = compiled.generate(prompts, params)
    # 4 prompts: at least 23 decode steps ran through the compiled decoder
    assert compiled.engine.runner.compiled.calls - calls >= 23
    for r, o in zip(ref, ours, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lo in zip(r.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
            assert lo.logprob == pytest.approx(lr.logprob, abs=LOGITS_ATOL)
            assert [t for t, _ in lo.top] == [t for t, _ in lr.top]


def test_compiled_seeded_sampling_reproduces_in_any_batch(llms) -> None:
    eager, compiled = llms
    ids = prompt(7, 21)
    params = SamplingParams(n=4, temperature=0.8, max_tokens=20, seed=1234, ignore_eos=True)
    ref = [c.token_ids for c in eager.generate([ids], params)[0].outputs]
    alone = [c.token_ids for c in compiled.generate([ids], params)[0].outputs]
    # the same request next to another prompt's 4 choices (a decode batch of 8)
    batched = compiled.generate([ids, prompt(8, 13)], params)
    assert alone == ref
    assert [c.token_ids for c in batched[0].outputs] == ref
    assert len({tuple(t) for t in ref}) > 1  # the choices really were sampled
