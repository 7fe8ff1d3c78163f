"""Engine core with a tiny model: logprobs checked against a dense transformers forward,
request validation, injected faults, and stats. Seeded sampling, n fan-out and stop conditions
are in test_engine_sampling.py.

Every expected token sequence comes from the same request run alone (no batch, no prefix
cache); every expected logprob from `transformers` on the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from helpers.engine import (
    GREEDY,
    assert_pool_clean,
    make_llm,
    prompt,
    run_until_done,
    solo,
    solo_tokens,
    tokens_of,
)

from plait import SamplingParams
from plait.engine.core_api import EngineStats
from plait.engine.faults import FaultSite, install_fault_hook
from plait.engine.sampling_params import InvalidParamError
from plait.engine.validation import RequestRejected, validate_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the dense model's logits: row i predicts token i + 1. [len, vocab]"""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


# --- logprobs ------------------------------------------------------------------------------

def test_logprobs_match_a_dense_forward(tiny_path, hf_model) -> None:
    ids = prompt(7, 15)
    llm = make_llm(tiny_path)
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                   SamplingParams(temperature=1.0, seed=5, max_tokens=6, ignore_eos=True,
                                  logprobs=3)):
        choice = llm.generate([ids], params)[0].outputs[0]
        ref = hf_logprobs(hf_model, ids + choice.token_ids)
        assert len(choice.logprobs) == 6
        for j, (token_id, lp) in enumerate(zip(choice.token_ids, choice.logprobs, strict=True)):
            row = ref[len(ids) + j - 1]
            assert lp.token_id == token_id
            assert lp.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
            top_values, top_ids = row.topk(3)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert [v for _, v in lp.top] == pytest.approx(top_values.tolist(), abs=1e-4)
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
            if params.temperature == 0:
                assert lp.top[0] == (token_id, lp.logprob)
        assert choice.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in
                                                               choice.logprobs))
    zero = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, logprobs=0))
    assert [lp.top for lp in zero[0].outputs[0].logprobs] == [[], []]


@pytest.mark.parametrize("setup", ["whole", "chunked", "preempted"])
def test_prompt_logprobs_match_a_dense_forward(tiny_path, hf_model, setup: str) -> None:
    ids = prompt(8, 45)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    if setup == "preempted":  # chunks of 8 in a small pool: recomputed from scratch
        llm = make_llm(tiny_path, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=8)
        for i in range(3):
            llm.engine.add_request(f"o{i}", prompt(80 + i, 20), SamplingParams(
                temperature=0, max_tokens=20, ignore_eos=True))
    else:
        llm = make_llm(tiny_path, max_num_batched_tokens=2048 if setup == "whole" else 16)
    llm.engine.add_request("p", ids, params)
    request = llm.engine.requests["p"]
    deltas = run_until_done(llm)["p"]
    assert (request.num_preemptions > 0) == (setup == "preempted")
    ref = hf_logprobs(hf_model, ids)
    entries = deltas[0].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    assert len(entries) == len(ids)
    assert entries[0] is None
    for i in range(1, len(ids)):
        entry, row = entries[i], ref[i - 1]
        assert entry.token_id == ids[i]
        assert entry.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        top_values, top_ids = row.topk(2)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
    expected = solo(tiny_path, ids, SamplingParams(temperature=0, max_tokens=2)).outputs[0]
    assert tokens_of(deltas) == expected.token_ids


def test_invalid_requests_are_rejected_and_leave_no_trace(tiny_path) -> None:
    llm = make_llm(tiny_path)
    info = llm.engine.info
    vocab = info.vocab_size
    llm.engine.add_request("x", prompt(9, 5), GREEDY)
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        llm.engine.add_request("x", prompt(9, 5), GREEDY)
    with pytest.raises(RequestRejected, match=f"Invalid 'messages': token id {vocab} is "
                       f"outside the vocabulary \\[0, {vocab}\\)") as err:
        validate_request(info, [5, vocab], GREEDY, prompt_param="messages")
    assert err.value.param == "messages"
    with pytest.raises(InvalidParamError, match="token id -1 is outside") as err:
        validate_request(info, [5], SamplingParams(stop_token_ids=[-1]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidParamError, match=f"'logit_bias': token id {vocab} is") as err:
        llm.generate([[5]], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(RequestRejected, match="the prompt is empty"):
        validate_request(info, [], GREEDY)
    assert list(llm.engine.requests) == ["x"]
    assert list(run_until_done(llm)) == ["x"]


# --- faults --------------------------------------------------------------------------------

class InjectedFault(RuntimeError):
    pass


def fail_once(llm, phase: str, when=lambda site: True):
    """Install a fault hook that raises in the first step in which `phase` runs for a site
    matching `when` (for every matching site of that step); `hit` records those sites."""
    hit: list[FaultSite] = []
    steps: list[int] = []

    def hook(current: str, site: FaultSite) -> None:
        step = llm.engine.scheduler.step_idx
        if current == phase and steps in ([], [step]) and when(site):
            steps[:] = [step]
            hit.append(site)
            raise InjectedFault(f"injected {phase} fault")

    hook.hit = hit  # type: ignore[attr-defined]
    install_fault_hook(llm.engine, hook)
    return hook


def test_execute_fault_fails_exactly_that_steps_requests(tiny_path) -> None:
    llm = make_llm(tiny_path, max_num_seqs=2)
    jobs = {rid: prompt(20 + i, 10 + 3 * i) for i, rid in enumerate(("a", "b", "c"))}
    for rid, ids in jobs.items():
        llm.engine.add_request(rid, ids, GREEDY)
    first = llm.engine.step().deltas  # a and b prefill; c waits for a seat
    assert sorted(d.request_id for d in first) == ["a", "b"]
    hook = fail_once(llm, "execute")
    failed = llm.engine.step().deltas
    assert [site.request_id for site in hook.hit] == ["a"]  # the step fails at the first
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in failed] == [
        ("a", "error", []), ("b", "error", [])]
    assert failed[0].error == "internal error while computing the request"
    stats = llm.stats()
    assert (stats.failed_steps, stats.last_error) == (1, "InjectedFault: injected "
                                                                "execute fault")
    seen = run_until_done(llm)
    assert list(seen) == ["c"]
    assert tokens_of(seen["c"]) == solo_tokens(tiny_path, jobs["c"], GREEDY)
    # A fresh request after the fault, with the prompt of a failed one, is served normally.
    llm.engine.add_request("again", jobs["a"], GREEDY)
    assert tokens_of(run_until_done(llm)["again"]) == solo_tokens(tiny_path, jobs["a"],
                                                            GREEDY)
    assert_pool_clean(llm)


def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_path) -> None:
    """Block 1 is half computed in step 1 and completed in step 2, which fails: its hash
    must not stay findable, or a later request reads K/V that was never written."""
    head = prompt(30, 8)  # two blocks of 4
    longer = head + prompt(31, 4)
    llm = make_llm(tiny_path, max_num_batched_tokens=6)
    llm.engine.add_request("a", head, GREEDY)
    llm.engine.step()  # tokens 0..5: block 0 full, block 1 half
    fail_once(llm, "execute")
    (failed,) = llm.engine.step().deltas  # tokens 6..7 would fill block 1
    assert failed.finish_reason == "error"
    choice = llm.generate([longer], GREEDY)[0].outputs[0]
    assert choice.num_cached_tokens == 4  # only block 0 was ever computed
    assert choice.token_ids == solo_tokens(tiny_path, longer, GREEDY)


def test_detokenize_fault_fails_only_that_request(tiny_path) -> None:
    llm = make_llm(tiny_path)
    jobs = {rid: prompt(40 + i, 12 + i) for i, rid in enumerate(("a", "b", "c"))}
    hook = fail_once(llm, "detokenize", lambda site: list(site.prompt_token_ids) == jobs["b"]
                     and site.num_output_tokens == 3)
    for rid, ids in jobs.items():
        llm.engine.add_request(rid, ids, GREEDY)
    seen = run_until_done(llm)
    assert len(hook.hit) == 1
    expected = {rid: solo_tokens(tiny_path, ids, GREEDY) for rid, ids in jobs.items()}
    assert tokens_of(seen["b"]) == expected["b"][:3]
    assert (seen["b"][-1].finish_reason, seen["b"][-1].error) == (
        "error", "internal error while decoding the output")
    for rid in ("a", "c"):
        assert tokens_of(seen[rid]) == expected[rid]
        assert seen[rid][-1].finish_reason == "length"
    stats = llm.stats()
    # b's 4th token was generated; decoding it failed, so it never reached the client.
    assert (stats.generation_tokens, stats.failed_steps) == (8 + 4 + 8, 0)
    assert stats.last_error == "InjectedFault: injected detokenize fault"
    assert_pool_clean(llm)


def test_generate_leaves_no_request_behind_when_one_is_rejected(tiny_path) -> None:
    llm = make_llm(tiny_path, num_kv_blocks=8)  # max_model_len 32
    ok = prompt(50, 6)
    with pytest.raises(RequestRejected, match="maximum context length of 32 tokens"):
        llm.generate([ok, prompt(51, 40)], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == solo_tokens(tiny_path, ok,
                                                                       GREEDY)


def test_generate_leaves_no_request_behind_when_one_fails(tiny_path) -> None:
    llm = make_llm(tiny_path)
    ok, bad = prompt(52, 6), prompt(53, 7)
    fail_once(llm, "detokenize", lambda site: list(site.prompt_token_ids) == bad)
    with pytest.raises(RuntimeError, match="failed: internal error while decoding the output"):
        llm.generate([ok, bad], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == solo_tokens(tiny_path, ok,
                                                                       GREEDY)


# --- stats ---------------------------------------------------------------------------------

def test_stats_count_what_was_done(tiny_path) -> None:
    llm = make_llm(tiny_path)
    jobs = [("a", prompt(60, 20), 5), ("b", prompt(61, 30), 7)]
    for rid, ids, max_tokens in jobs:
        llm.engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True))
    assert (llm.stats().num_waiting, llm.stats().num_running) == (2, 0)
    llm.engine.step()
    assert (llm.stats().num_waiting, llm.stats().num_running) == (0, 2)
    assert llm.stats().generation_tokens == 2
    # Every block in use belongs to a running request (a's 5 and b's 8 at least).
    held = {b for req in llm.engine.requests.values() for b in req.block_ids}
    assert llm.stats().kv_blocks_used == len(held) >= 5 + 8
    run_until_done(llm)
    stats = llm.stats()
    assert stats == EngineStats(
        num_running=0,
        num_waiting=0,
        kv_blocks_used=0,  # the two kept prompts name cached blocks; they hold none
        kv_blocks_total=64,
        prompt_tokens_computed=50,
        prompt_tokens_cached=0,
        prefix_cache_queries=50,
        prefix_cache_hits=0,
        num_preemptions=0,
        generation_tokens=12,
        shared_prompts_kept=2,
        failed_steps=0,
        last_error=None,
        # the tiny model's float32 weights (a checkpoint, nothing kept) and their packs
        model_weight_bytes=llm.engine.runner.weight_bytes,
    )
    assert stats.kv_cache_usage == 0.0
    assert stats.model_weight_bytes > sum(
        p.numel() * 4 for p in llm.engine.runner.model.parameters())
    assert_pool_clean(llm)
    # The kept prompts still serve a repeat without computing anything.
    llm.generate([jobs[0][1]], SamplingParams(temperature=0, max_tokens=1))
    assert llm.stats().prompt_tokens_computed == 50


def test_a_poisoned_sampling_request_fails_alone(tiny_path) -> None:
    """top_k = 2**63 overflows inside the sampler: only that request fails; its seeded and
    greedy neighbours in the same steps get exactly their solo tokens (the batch is
    resampled row by row, each seeded generator rewound first)."""
    llm = make_llm(tiny_path)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, top_k=50)
    jobs = {"greedy": (prompt(70, 9), GREEDY), "seeded": (prompt(71, 11), seeded),
            "poison": (prompt(72, 10), SamplingParams(temperature=1.0, top_k=2**63,
                                                      max_tokens=6, ignore_eos=True))}
    for rid, (ids, params) in jobs.items():
        llm.engine.add_request(rid, ids, params)
    seen = run_until_done(llm)
    assert [(d.finish_reason, d.error) for d in seen["poison"]] == [
        ("error", "internal error while sampling the request")]
    for rid in ("greedy", "seeded"):
        ids, params = jobs[rid]
        assert tokens_of(seen[rid]) == solo_tokens(tiny_path, ids, params), rid
        assert seen[rid][-1].finish_reason == "length"
    stats = llm.stats()
    assert stats.failed_steps == 0 and "Overflow" in stats.last_error
    assert_pool_clean(llm)


def test_failed_steps_leave_the_runner_in_step_with_the_scheduler(tiny_path) -> None:
    """Steps that fail before computing still hand the runner its new and finished
    requests: after many of them, with only 2 block-table rows, a request is served."""
    llm = make_llm(tiny_path, max_num_seqs=2)
    poisoned = prompt(80, 9)

    def hook(phase: str, site: FaultSite) -> None:
        if phase == "execute" and list(site.prompt_token_ids) == poisoned:
            raise InjectedFault("injected execute fault")

    install_fault_hook(llm.engine, hook)
    ok = prompt(81, 7)
    expected = solo_tokens(tiny_path, ok, GREEDY)
    for i in range(4):
        # A served request, whose finish reaches the runner with the next step: a failing
        # one. Were that step's news lost, its block-table row would never be freed.
        assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == expected, i
        llm.engine.add_request(f"p{i}", poisoned, GREEDY)
        seen = run_until_done(llm)
        assert [d.finish_reason for d in seen[f"p{i}"]] == ["error"]
    assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == expected
    llm.engine.step()  # hands the runner the last finish
    assert llm.engine.runner.batch.row_of == {}
    assert_pool_clean(llm)
