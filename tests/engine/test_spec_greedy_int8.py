"""Greedy output under `numerics="int8"` (the default for a GGUF on a VNNI CPU: repacked
weights, x as int8 per 32, a bf16 KV cache, bf16 dot products in attention) does not
depend on how a sequence's tokens were split into steps (issue 41): speculation's
verification steps of k + 1 rows, whatever the drafts (right, wrong at one token, wrong
everywhere, or n-gram's own), give the tokens of one-row decode steps, and a prompt partly
served from the prefix cache gives a cold prompt's tokens. The default GGUF (SmolLM2),
whose greedy streams parted on near ties before the attention was made row-invariant
(kernels/cpu/attention.c)."""

from __future__ import annotations

import pytest
from helpers.engine import assert_pool_clean
from helpers.spec import ReferenceProposer, calls, spec_counts
from helpers.threads import torch_threads

from plait import LLM, SamplingParams
from plait.engine.outputs import RequestOutput
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.driver import SpecDecoder
from plait.kernels import ops
from plait.kernels.cpu import build, native, products, repack
from plait.kernels.cpu.build import NATIVE_MAX_ROWS

pytestmark = [
    pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                       reason="no AVX512-VNNI repacked kernel in this build"),
    pytest.mark.usefixtures("one_torch_thread"),
]

PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
TEXTS = ["Write a short story about a robot who learns to paint.",
         "List the planets of the solar system in order, with one fact about each.",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]
OPTIONS = dict(numerics="int8", weights="auto", num_kv_blocks=128, block_size=16,
               warm_up_tokens=0)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(**OPTIONS, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompts(plain: LLM) -> list[list[int]]:
    tokenizer = plain.engine.tokenizer
    return [tokenizer.encode(text) for text in TEXTS]


def greedy(out: RequestOutput) -> tuple[list[int], list[float]]:
    """The tokens of `out`'s one choice and their logprobs: the same bits wherever a row's
    logits are the same bits."""
    choice = out.outputs[0]
    assert choice.logprobs is not None
    return choice.token_ids, [lp.logprob for lp in choice.logprobs]


@pytest.fixture(scope="module")
def reference(plain: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens (and logprobs) by itself, one-row decode steps, nothing
    cached."""
    assert plain.engine.runner.numerics.name == "int8"
    return [greedy(plain.generate([p], PARAMS)[0]) for p in prompts]


def _spec_llm(proposer: ReferenceProposer | None) -> LLM:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                               prompt_lookup_max=4, disable_by_batch_size=10_000)
    llm = LLM(**OPTIONS, speculative_config=config)
    if proposer is not None:
        spec = llm.engine.spec
        assert spec is not None
        llm.engine.spec = SpecDecoder(config, spec.max_model_len, proposer)
    return llm


@pytest.mark.parametrize("wrong_every", [0, 3, 1, None])  # None: the n-gram proposer
def test_greedy_with_speculation_is_greedy_without(prompts, reference,
                                                    wrong_every: int | None) -> None:
    """One stream at a time: tokens and logprobs those of one-row steps."""
    proposer = None if wrong_every is None else ReferenceProposer(
        [p + w for p, (w, _) in zip(prompts, reference, strict=True)], wrong_every)
    llm = _spec_llm(proposer)
    for p, want in zip(prompts, reference, strict=True):  # one stream at a time
        assert greedy(llm.generate([p], PARAMS)[0]) == want
    drafts, draft_tokens, accepted = spec_counts(llm)
    assert drafts > 0
    if wrong_every == 0:
        assert accepted == draft_tokens
    elif wrong_every == 3:
        assert 0 < accepted < draft_tokens
    elif wrong_every == 1:
        assert accepted == 0
    assert_pool_clean(llm)


def test_greedy_with_speculation_in_one_batch(prompts, reference) -> None:
    """The three streams together: each verification step holds several sequences' rows."""
    llm = _spec_llm(ReferenceProposer([p + w for p, (w, _) in zip(prompts, reference,
                                                                    strict=True)], 3))
    assert [greedy(o) for o in llm.generate(prompts, PARAMS)] == reference
    assert spec_counts(llm)[2] > 0


def test_greedy_with_a_draft_model_behind_a_lookup(prompts, reference, default_model) -> None:
    """draft_model with a prompt lookup tried first (SmolLM2 drafting for itself, every
    draft kept for its cost): drafts from both, in the engine, and the tokens and logprobs
    of one-row steps."""
    config = SpeculativeConfig(method="draft_model", model=str(default_model.path),
                               num_speculative_tokens=4, prompt_lookup_min=2,
                               prompt_lookup_max=4, disable_by_batch_size=10_000,
                               draft_token_cost=0)
    llm = LLM(**OPTIONS, speculative_config=config)
    proposer = llm.engine.spec.proposer
    passes = calls(proposer, "_greedy")  # the draft model's
    lookups = calls(proposer, "_looked_up")  # asked by setup_cost and by propose
    for p, want in zip(prompts, reference, strict=True):
        assert greedy(llm.generate([p], PARAMS)[0]) == want
    assert passes and any(draft for _, draft in lookups) and spec_counts(llm)[2] > 0
    assert_pool_clean(llm)


@pytest.mark.parametrize("rest", [1, 21])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_partly_cached_prompt_is_greedy_as_a_cold_one(plain, prompts, rest: int,
                                                        threads: int) -> None:
    """Each prompt (over and over: 7 blocks and `rest` tokens) after a request that held
    its first 7 blocks: they come from the prefix cache, the prefill computes only the
    last `rest` tokens (one: a row alone, as a decode step is), and the greedy tokens and
    their logprobs are those of the prompt computed cold, on one thread or two."""
    llm = LLM(**OPTIONS)
    with torch_threads(threads):
        for p in prompts:
            long = (p * -(-(7 * 16 + rest) // len(p)))[:7 * 16 + rest]
            cold = plain.generate([long], PARAMS)[0]
            assert cold.num_cached_tokens == 0
            llm.generate([long[:7 * 16]], SamplingParams(temperature=0, max_tokens=1))
            warm = llm.generate([long], PARAMS)[0]
            assert warm.num_cached_tokens == 7 * 16
            assert greedy(warm) == greedy(cold)
    assert_pool_clean(llm)


def test_a_prompt_beside_decode_rows_changes_neither_stream(prompts, reference) -> None:
    """The first prompt decodes; after 5 of its steps the second arrives, and its prompt is
    computed 16 tokens a step in the same steps as the first's decode rows (a step of
    prompt rows and generated rows: where the products compute prompt rows apart, two
    passes). Each stream's greedy tokens and logprobs are those it has alone."""
    llm = LLM(**OPTIONS, enable_prefix_caching=False, max_num_batched_tokens=17)
    runner = llm.engine.runner
    passes: list[bool] = []
    forward = runner._forward_chunks

    def counted(chunks: list, result: object, prompt: bool) -> object:
        passes.append(prompt)
        return forward(chunks, result, prompt)

    runner._forward_chunks = counted
    llm.engine.add_request("a", prompts[0], PARAMS)
    seen: dict[str, list] = {"a": [], "b": []}
    step = 0
    while llm.engine.has_unfinished():
        if step == 5:
            llm.engine.add_request("b", prompts[1], PARAMS)
        for delta in llm.engine.step().deltas:
            seen[delta.request_id].append(delta)
        step += 1
    for rid, want in zip("ab", reference, strict=False):
        tokens = [t for d in seen[rid] for t in d.token_ids]
        logprobs = [lp.logprob for d in seen[rid] for lp in (d.logprobs or [])]
        assert (tokens, logprobs) == want
    steps_of_b = -(-len(prompts[1]) // 16)
    if runner.split_prompt_rows:  # the mixed steps ran a prompt pass and a generated pass
        assert len(passes) == step + steps_of_b
    else:
        assert len(passes) == step
    assert_pool_clean(llm)


def test_the_prompt_pass_attends_through_its_own_kernel(prompts, monkeypatch) -> None:
    """Where the runner passes prompt rows apart and the process has the AMX prompt
    attention (kernels/cpu/attention_amx.h), every attention call of a long prompt's pass
    layer by layer takes it and no call outside it does. Every projection repacked, the
    native stack takes a prompt of more than NATIVE_MAX_ROWS tokens too: then a prompt,
    long or short, runs in the stack with the prompt rows' kernels (PLAIT_STACK_PROMPT), all
    but its last layer (pruned to the sampled row, in the loop), and the decode steps
    without them."""
    llm = LLM(**OPTIONS, enable_prefix_caching=False)
    calls: list[tuple[bool, bool]] = []
    stacks: list[tuple[bool, int | None]] = []
    attention, decoder_stack = ops.native_attention, ops.stack.decoder_stack

    def spy(*args: object, **kwargs: object) -> object:
        calls.append((products.in_prompt_rows(), bool(args[-1])))
        return attention(*args, **kwargs)

    def stack_spy(*args: object, **kwargs: object) -> object:
        stacks.append((bool(kwargs["prompt"]), kwargs["num_layers"]))  # type: ignore[arg-type]
        return decoder_stack(*args, **kwargs)

    monkeypatch.setattr(ops, "native_attention", spy)
    monkeypatch.setattr(ops.stack, "decoder_stack", stack_spy)
    runner = llm.engine.runner
    split = runner.split_prompt_rows and native.prompt_attention_amx()
    long = prompts[0] + prompts[1] + prompts[2]
    assert NATIVE_MAX_ROWS < len(long) <= runner.ops.stack_rows
    layers = runner.model.config.num_layers
    stack = runner.model.stack
    for rid, ids, whole in (("long", long, False), ("long in the stack", long, True),
                            ("short", prompts[0], True)):
        calls.clear()
        stacks.clear()
        runner.model.stack = stack if whole else None
        llm.engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=4,
                                                        ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
        if not whole:  # one pass, layer by layer, then the decode steps
            assert stacks == []
            if split:
                assert calls[:layers] == [(True, True)] * layers
                assert not any(tiles for _, tiles in calls[layers:])
            else:
                assert not any(tiles for _, tiles in calls)
        else:  # every step in the stack, the first with the prompt rows' kernels
            # the pruned last layer's attention, in the loop
            assert calls == [(runner.split_prompt_rows, split)]
            assert stacks == [(runner.split_prompt_rows, layers - 1)] + [(False, None)] * 3
    assert_pool_clean(llm)


@pytest.mark.parametrize("which", ["short", "long"])
def test_a_prompt_in_the_stack_is_the_layer_loop(prompts, reference, which: str) -> None:
    """A prompt computes its every layer but the last in one C call: one of fewer tokens
    than NATIVE_MAX_ROWS (prompts[0]) as a decode step would, and, every projection
    repacked, one of more too; without the stack, layer by layer: the same greedy tokens
    and logprobs (the prompt pass's products and attention are the same kernels either
    way)."""
    llm = LLM(**OPTIONS, enable_prefix_caching=False)
    runner = llm.engine.runner
    ids = prompts[0] if which == "short" else prompts[0] + prompts[1] + prompts[2]
    assert (len(ids) <= NATIVE_MAX_ROWS) == (which == "short")
    assert len(ids) <= runner.ops.stack_rows and runner.model.stack is not None
    stacked = greedy(llm.generate([ids], PARAMS)[0])
    if which == "short":
        assert stacked == reference[0]
    runner.model.stack = None  # every step layer by layer
    assert greedy(llm.generate([ids], PARAMS)[0]) == stacked
