"""The compiled forward (`EngineConfig.compile`, engine/models/compiled.py) against the
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
    compiled = CompiledDecoder(model, native_steps=False)  # the graphs, not the native stack
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


class _CompiledModel:
    """A compiled decoder with its model's LM head, as `PagedHarness.run` drives a model."""

    def __init__(self, compiled: CompiledDecoder) -> None:
        self.compiled, self.compute_logits = compiled, compiled.model.compute_logits

    def __call__(self, *args):
        return self.compiled(*args)


def test_compiled_prefill_and_mixed_steps_match_eager(tmp_path, default_model) -> None:
    """Every step kind runs through the compiled stack: a prefill of two prompts, then a
    mixed step (one decode, one chunk after a cached prefix, one new prompt): the same
    logits and K/V as eager."""
    path = make_tiny_model(tmp_path / "llama", default_model.path, "llama")
    model = _model(path, prepack=True)
    compiled = _CompiledModel(CompiledDecoder(model))
    eager_kv = PagedHarness(model.config, num_blocks=48)
    ours_kv = copy.deepcopy(eager_kv)
    a, b, c = prompt(1, 9), prompt(2, 14), prompt(3, 6)
    tables = [[5, 17, 2, 30], [8, 9, 40, 41, 3], [20, 21, 22]]
    steps = [
        [(a, 0, tables[0]), (b[:7], 0, tables[1])],
        [([*a, 11], 9, tables[0]), (b, 7, tables[1]), (c, 0, tables[2])],
    ]
    for seqs in steps:
        ref = eager_kv.run(model, seqs)
        ours = ours_kv.run(compiled, seqs)
        for r, o in zip(ref, ours, strict=True):
            torch.testing.assert_close(o, r, atol=LOGITS_ATOL, rtol=0)
    for (k_ref, v_ref), (k, v) in zip(eager_kv.kv, ours_kv.kv, strict=True):
        torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=0)
    assert compiled.compiled.calls == 2


def test_past_the_recompile_limit_a_decoder_runs_uncompiled(tmp_path, default_model) -> None:
    """A new shape past dynamo's recompile limit runs the same stack uncompiled, with the
    same logits, instead of failing (the function is compiled with fullgraph=True)."""
    path = make_tiny_model(tmp_path / "qwen2", default_model.path, "qwen2")
    model = _model(path, prepack=False)  # bias and plain weights: no other test's graphs
    compiled = CompiledDecoder(model)
    uncompiled = []
    with torch._dynamo.config.patch(recompile_limit=1):
        # the 1-row call compiles or, if other tests' graphs fill the cache, runs uncompiled;
        # the 3-row call needs one more graph than the 1-row one: always past the limit of 1
        for rows in (1, 3):
            uncompiled.append(compiled.uncompiled_calls)
            harness = PagedHarness(model.config, num_blocks=16 * rows)
            meta, _ = _decode_meta(harness, [4] * rows)
            ids, positions = torch.arange(rows) + 5, torch.full((rows,), 3)
            ours_kv = copy.deepcopy(harness)
            with torch.inference_mode():
                ref = model(ids, positions, harness.kv, meta)
                ours = compiled(ids, positions, ours_kv.kv, meta)
            torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)
    assert compiled.uncompiled_calls == uncompiled[1] + 1
    assert StepContext.current is None


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
    # 4 prompts: their prefill and at least 23 decode steps ran through the compiled stack
    assert compiled.engine.runner.compiled.calls - calls >= 24
    for r, o in zip(ref, ours, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for lr, lo in zip(r.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
            assert lo.logprob == pytest.approx(lr.logprob, abs=LOGITS_ATOL)
            assert [t for t, _ in lo.top] == [t for t, _ in lr.top]


def _assert_same_draws(ref, ours) -> None:
    """Two runs of one seeded choice: the same tokens, except that they may part at a draw
    that fell on a CDF boundary, which float noise from the batch's other rows (a GEMM with
    more rows, a differently padded attention) can flip. The tiny random model's flat
    distributions make such near-ties common; so until they part the runs must agree to
    float noise (logprobs within 1e-5), and the first 8 tokens must always be equal."""
    part = next((i for i, (a, b) in enumerate(zip(ref.token_ids, ours.token_ids, strict=True))
                 if a != b), len(ref.token_ids))
    assert part >= 8, (part, ref.token_ids, ours.token_ids)
    for lr, lo in zip(ref.logprobs[:part], ours.logprobs[:part], strict=True):
        assert lo.logprob == pytest.approx(lr.logprob, abs=1e-5)


def test_compiled_seeded_sampling_reproduces_in_any_batch(llms) -> None:
    """Seeded choices are the same alone and batched on the compiled engine (up to a
    near-tie draw, see `_assert_same_draws`). Against the eager engine they may part
    sooner: the fused kernels round differently (greedy tokens are compared above)."""
    _, compiled = llms
    ids = prompt(7, 21)
    params = SamplingParams(n=4, temperature=0.8, max_tokens=20, seed=1234, ignore_eos=True,
                            logprobs=0)
    alone = compiled.generate([ids], params)[0].outputs
    # the same request next to another prompt's 4 choices (a decode batch of 8)
    batched = compiled.generate([ids, prompt(8, 13)], params)[0].outputs
    for a, b in zip(alone, batched, strict=True):
        _assert_same_draws(a, b)
    assert len({tuple(c.token_ids) for c in alone}) > 1  # the choices really were sampled
