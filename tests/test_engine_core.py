"""Engine core with a tiny model: seeded sampling, n fan-out, stop conditions, logprobs
checked against a dense transformers forward, injected faults, and stats.

Every expected token sequence comes from the same request run alone (no batch, no prefix
cache); every expected logprob from `transformers` on the same checkpoint.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.engine.sampling_params import InvalidParamError
from plait.engine.scheduler import RequestRejected

EOS = 2  # tiny_model's eos_token_id
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory, default_model):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_core"), default_model.path)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: thread hand-offs cost more than they save, worse on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_model(tiny_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_path, torch_dtype=torch.float32).eval()


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of the dense model's logits: row i predicts token i + 1. [len, vocab]"""
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(length)]


def make_llm(path, **options) -> LLM:
    defaults = dict(num_kv_blocks=64, block_size=4)
    defaults.update(options)
    return LLM(str(path), **defaults)


_ALONE: dict[str, LLM] = {}


def alone(path, token_ids: list[int], params: SamplingParams):
    """This request run by itself, with prefix caching (and so prompt sharing) off."""
    if "llm" not in _ALONE:
        _ALONE["llm"] = make_llm(path, enable_prefix_caching=False)
    return _ALONE["llm"].generate([token_ids], params)[0].outputs[0]


def run_until_done(llm: LLM) -> dict[str, list]:
    seen: dict[str, list] = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    return seen


def tokens_of(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def assert_pool_clean(llm: LLM) -> None:
    pool = llm.engine.pool
    pinned = {b for e in llm.engine.scheduler.share.ready.values() for b in e.block_ids}
    assert llm.stats()["kv_blocks_used"] == len(pinned)
    llm.engine.scheduler.share.clear()
    assert pool.num_free_blocks == pool.num_blocks
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks


# --- seeded sampling and n -----------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("arrival", ["first", "middle", "last"])
def test_seeded_request_is_reproducible_inside_a_busy_batch(tiny_path, arrival) -> None:
    target = prompt(1, 21)
    expected = alone(tiny_path, target, SEEDED).token_ids
    assert alone(tiny_path, target, SEEDED).token_ids == expected  # run twice alone
    # A small pool, few seats and chunked prefill: the target is batched with random
    # requests and, unless it is the oldest request, preempted and recomputed.
    llm = make_llm(tiny_path, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=24)
    others = [(f"o{i}", prompt(10 + i, 9 + 5 * i),
               SamplingParams(temperature=1.0, max_tokens=10 + i, ignore_eos=True,
                              seed=1234 if i == 2 else None)) for i in range(6)]
    position = {"first": 0, "middle": 3, "last": 6}[arrival]
    jobs = [*others[:position], ("target", target, SEEDED), *others[position:]]
    for rid, ids, params in jobs:
        llm.engine.add_request(rid, ids, params)
    request = llm.engine.requests["target"]
    seen = run_until_done(llm)
    assert tokens_of(seen["target"]) == expected
    assert llm.stats()["num_preemptions"] > 0
    assert (request.num_preemptions > 0) == (arrival != "first")  # the newest is preempted
    assert_pool_clean(llm)


def test_different_seeds_give_different_tokens(tiny_path) -> None:
    ids = prompt(1, 21)
    runs = {seed: tuple(alone(tiny_path, ids, SamplingParams(
        temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)).token_ids)
        for seed in (1, 2, 3)}
    assert len(set(runs.values())) == 3


def test_n_choices_equal_single_requests_with_seed_plus_index(tiny_path) -> None:
    ids = prompt(2, 30)
    llm = make_llm(tiny_path)
    params = SamplingParams(n=4, temperature=1.0, seed=77, max_tokens=10, ignore_eos=True)
    (result,) = llm.generate([ids], params)
    assert [c.index for c in result.outputs] == [0, 1, 2, 3]
    for i, choice in enumerate(result.outputs):
        single = SamplingParams(temperature=1.0, seed=77 + i, max_tokens=10, ignore_eos=True)
        assert choice.token_ids == alone(tiny_path, ids, single).token_ids, i
        assert choice.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in result.outputs}) == 4


# --- stop conditions -----------------------------------------------------------------------

def per_token_text(llm: LLM, ids: list[int], params: SamplingParams):
    """(tokens, text emitted after each token) of one request, stepping the engine."""
    llm.engine.add_request("probe", ids, params)
    deltas = run_until_done(llm)["probe"]
    return tokens_of(deltas), [d.text for d in deltas if d.token_ids]


def test_stop_string_ends_generation_and_is_cut_from_the_text(tiny_path) -> None:
    ids = prompt(3, 12)
    llm = make_llm(tiny_path)
    tokens, pieces = per_token_text(llm, ids, SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True))
    full = "".join(pieces)
    # A 4-character stop string that first occurs in the text of token 10 or later.
    start = next(i for i in range(len("".join(pieces[:10])), len(full) - 4)
                 if full.find(full[i:i + 4]) == i and full[i:i + 4].strip() == full[i:i + 4])
    stop = full[start:start + 4]
    num_tokens = next(k for k in range(1, 25) if stop in "".join(pieces[:k]))
    for include in (False, True):
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                 include_stop_str_in_output=include))
        choice = out[0].outputs[0]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        assert choice.token_ids == tokens[:num_tokens]
        assert choice.text == full[:start + 4 * include]


def test_stop_token_id_ends_generation_without_its_text(tiny_path) -> None:
    ids = prompt(4, 12)
    llm = make_llm(tiny_path)
    tokens, pieces = per_token_text(llm, ids, SamplingParams(temperature=0, max_tokens=16,
                                                             ignore_eos=True))
    idx = next(i for i in range(4, 16) if tokens[i] not in tokens[:i]
               and all(p and "\ufffd" not in p for p in pieces[:i + 1]))
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16,
                                             stop_token_ids=[tokens[idx]]))
    choice = out[0].outputs[0]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", tokens[idx])
    assert choice.token_ids == tokens[:idx + 1]
    assert choice.text == "".join(pieces[:idx])


def test_max_tokens_gives_length_with_exactly_that_many_tokens(tiny_path) -> None:
    ids = prompt(5, 10)
    llm = make_llm(tiny_path)
    for max_tokens in (1, 7):
        choice = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))
        choice = choice[0].outputs[0]
        assert (choice.finish_reason, choice.stop_reason) == ("length", None)
        assert len(choice.token_ids) == max_tokens
    assert llm.stats()["generation_tokens"] == 8


def test_min_tokens_holds_back_a_likely_eos(tiny_path) -> None:
    ids = prompt(6, 10)
    llm = make_llm(tiny_path)
    eager = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100.0})
    choice = llm.generate([ids], eager)[0].outputs[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == ([EOS], "", "stop")
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100.0}, min_tokens=5)
    choice = llm.generate([ids], held)[0].outputs[0]
    plain = alone(tiny_path, ids, SamplingParams(temperature=0, max_tokens=5))
    # While EOS is masked the other logits are untouched: the first 5 tokens are plain greedy.
    assert choice.token_ids == [*plain.token_ids, EOS]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
    assert choice.text == plain.text


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
    expected = alone(tiny_path, ids, SamplingParams(temperature=0, max_tokens=2))
    assert tokens_of(deltas) == expected.token_ids


def test_invalid_requests_are_rejected_and_leave_no_trace(tiny_path) -> None:
    llm = make_llm(tiny_path)
    vocab = llm.engine.info.vocab_size
    llm.engine.add_request("x", prompt(9, 5), GREEDY)
    with pytest.raises(ValueError, match="duplicate request id 'x'"):
        llm.engine.add_request("x", prompt(9, 5), GREEDY)
    with pytest.raises(RequestRejected, match=f"prompt token id {vocab} is outside the "
                       f"vocabulary \\[0, {vocab}\\)"):
        llm.engine.add_request("y", [5, vocab], GREEDY)
    with pytest.raises(InvalidParamError, match="token id -1 in 'stop_token_ids'") as err:
        llm.engine.add_request("y", [5], SamplingParams(stop_token_ids=[-1]))
    assert err.value.param == "stop_token_ids"
    with pytest.raises(InvalidParamError, match=f"token id {vocab} in 'logit_bias'"):
        llm.engine.add_request("y", [5], SamplingParams(logit_bias={vocab: 1.0}))
    assert list(llm.engine.requests) == ["x"]
    assert list(run_until_done(llm)) == ["x"]


# --- faults --------------------------------------------------------------------------------

class InjectedFault(RuntimeError):
    pass


def fail_once(phase: str, when=lambda requests: True):
    """A fault hook that raises the first time `phase` runs with requests matching `when`;
    `hit` records the request ids it failed."""
    hit: list[str] = []

    def hook(current: str, requests) -> None:
        if current == phase and not hit and when(requests):
            hit.extend(r.request_id for r in requests)
            raise InjectedFault(f"injected {phase} fault")

    hook.hit = hit  # type: ignore[attr-defined]
    return hook


def test_execute_fault_fails_exactly_that_steps_requests(tiny_path) -> None:
    llm = make_llm(tiny_path, max_num_seqs=2)
    jobs = {rid: prompt(20 + i, 10 + 3 * i) for i, rid in enumerate(("a", "b", "c"))}
    for rid, ids in jobs.items():
        llm.engine.add_request(rid, ids, GREEDY)
    first = llm.engine.step()  # a and b prefill; c waits for a seat
    assert sorted(d.request_id for d in first) == ["a", "b"]
    llm.engine.fault_hook = hook = fail_once("execute")
    failed = llm.engine.step()
    assert sorted(hook.hit) == ["a", "b"]
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in failed] == [
        ("a", "error", []), ("b", "error", [])]
    assert failed[0].error == "internal error while computing the request"
    stats = llm.stats()
    assert (stats["failed_steps"], stats["last_error"]) == (1, "InjectedFault: injected "
                                                                "execute fault")
    seen = run_until_done(llm)
    assert list(seen) == ["c"]
    assert tokens_of(seen["c"]) == alone(tiny_path, jobs["c"], GREEDY).token_ids
    # A fresh request after the fault, with the prompt of a failed one, is served normally.
    llm.engine.add_request("again", jobs["a"], GREEDY)
    assert tokens_of(run_until_done(llm)["again"]) == alone(tiny_path, jobs["a"],
                                                            GREEDY).token_ids
    assert_pool_clean(llm)


def test_failed_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_path) -> None:
    """Block 1 is half computed in step 1 and completed in step 2, which fails: its hash
    must not stay findable, or a later request reads K/V that was never written."""
    head = prompt(30, 8)  # two blocks of 4
    longer = head + prompt(31, 4)
    llm = make_llm(tiny_path, max_num_batched_tokens=6)
    llm.engine.add_request("a", head, GREEDY)
    llm.engine.step()  # tokens 0..5: block 0 full, block 1 half
    llm.engine.fault_hook = fail_once("execute")
    (failed,) = llm.engine.step()  # tokens 6..7 would fill block 1
    assert failed.finish_reason == "error"
    llm.engine.fault_hook = None
    choice = llm.generate([longer], GREEDY)[0].outputs[0]
    assert choice.num_cached_tokens == 4  # only block 0 was ever computed
    assert choice.token_ids == alone(tiny_path, longer, GREEDY).token_ids


def test_detokenize_fault_fails_only_that_request(tiny_path) -> None:
    llm = make_llm(tiny_path)
    jobs = {rid: prompt(40 + i, 12 + i) for i, rid in enumerate(("a", "b", "c"))}
    for rid, ids in jobs.items():
        llm.engine.add_request(rid, ids, GREEDY)
    llm.engine.fault_hook = hook = fail_once(
        "detokenize", lambda reqs: reqs[0].request_id == "b" and len(reqs[0].output_token_ids) == 3)
    seen = run_until_done(llm)
    assert hook.hit == ["b"]
    expected = {rid: alone(tiny_path, ids, GREEDY).token_ids for rid, ids in jobs.items()}
    assert tokens_of(seen["b"]) == expected["b"][:3]
    assert (seen["b"][-1].finish_reason, seen["b"][-1].error) == (
        "error", "internal error while decoding the output")
    for rid in ("a", "c"):
        assert tokens_of(seen[rid]) == expected[rid]
        assert seen[rid][-1].finish_reason == "length"
    stats = llm.stats()
    assert (stats["generation_tokens"], stats["failed_steps"]) == (8 + 3 + 8, 0)
    assert stats["last_error"] == "InjectedFault: injected detokenize fault"
    assert_pool_clean(llm)


def test_generate_leaves_no_request_behind_when_one_is_rejected(tiny_path) -> None:
    llm = make_llm(tiny_path, num_kv_blocks=8)  # max_model_len 32
    ok = prompt(50, 6)
    with pytest.raises(RequestRejected, match="maximum context length of 32 tokens"):
        llm.generate([ok, prompt(51, 40)], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == alone(tiny_path, ok,
                                                                       GREEDY).token_ids


def test_generate_leaves_no_request_behind_when_one_fails(tiny_path) -> None:
    llm = make_llm(tiny_path)
    ok, bad = prompt(52, 6), prompt(53, 7)
    llm.engine.fault_hook = fail_once(
        "detokenize", lambda reqs: reqs[0].prompt_token_ids == bad)
    with pytest.raises(RuntimeError, match="failed: internal error while decoding the output"):
        llm.generate([ok, bad], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.generate([ok], GREEDY)[0].outputs[0].token_ids == alone(tiny_path, ok,
                                                                       GREEDY).token_ids


# --- stats ---------------------------------------------------------------------------------

def test_stats_count_what_was_done(tiny_path) -> None:
    llm = make_llm(tiny_path)
    jobs = [("a", prompt(60, 20), 5), ("b", prompt(61, 30), 7)]
    for rid, ids, max_tokens in jobs:
        llm.engine.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                        ignore_eos=True))
    assert (llm.stats()["num_waiting"], llm.stats()["num_running"]) == (2, 0)
    llm.engine.step()
    assert (llm.stats()["num_waiting"], llm.stats()["num_running"]) == (0, 2)
    assert llm.stats()["generation_tokens"] == 2
    run_until_done(llm)
    stats = llm.stats()
    assert stats == {
        "num_running": 0,
        "num_waiting": 0,
        "kv_blocks_used": 5 + 8,  # the two kept prompts: 20 and 30 tokens in blocks of 4
        "kv_blocks_total": 64,
        "kv_cache_usage": 13 / 64,
        "prompt_tokens_computed": 50,
        "prompt_tokens_cached": 0,
        "prefix_cache_queries": 50,
        "prefix_cache_hits": 0,
        "num_preemptions": 0,
        "generation_tokens": 12,
        "shared_prompts_kept": 2,
        "failed_steps": 0,
        "last_error": None,
    }
    assert math.isclose(stats["kv_cache_usage"], 13 / 64)
    assert_pool_clean(llm)
    assert llm.stats()["kv_blocks_used"] == 0
