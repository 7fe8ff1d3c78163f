"""Engine core with a tiny model: seeded sampling, n fan-out and stop conditions. Logprobs,
request validation, injected faults and stats are in test_engine_logprobs_faults.py.

Every expected token sequence comes from the same request run alone (no batch, no prefix
cache).
"""

from __future__ import annotations

import pytest
from helpers.engine import (
    EOS,
    assert_pool_clean,
    make_llm,
    prompt,
    run_until_done,
    solo,
    solo_tokens,
    tokens_of,
)

from plait import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- seeded sampling and n -----------------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("arrival", ["first", "middle", "last"])
def test_seeded_request_is_reproducible_inside_a_busy_batch(tiny_path, arrival) -> None:
    target = prompt(1, 21)
    expected = solo_tokens(tiny_path, target, SEEDED)
    assert solo_tokens(tiny_path, target, SEEDED) == expected  # run twice alone
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
    assert llm.stats().num_preemptions > 0
    assert (request.num_preemptions > 0) == (arrival != "first")  # the newest is preempted
    assert_pool_clean(llm)


def test_different_seeds_give_different_tokens(tiny_path) -> None:
    ids = prompt(1, 21)
    runs = {seed: tuple(solo_tokens(tiny_path, ids, SamplingParams(
        temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)))
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
        assert choice.token_ids == solo_tokens(tiny_path, ids, single), i
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


def test_stop_string_only_counts_from_min_tokens_on(tiny_path) -> None:
    """As vLLM: below min_tokens a stop string is plain text; the first match that ends in
    the text of token min_tokens or later stops the request."""
    ids = prompt(3, 12)
    llm = make_llm(tiny_path)
    tokens, pieces = per_token_text(llm, ids, SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True))
    full = "".join(pieces)
    stop = next(full[i:i + 2] for i in range(len(full) - 2)
                if full[i:i + 2].strip() == full[i:i + 2])  # the first 2-char string
    first_end = full.find(stop) + 2
    min_tokens = next(k for k in range(1, 25) if len("".join(pieces[:k])) >= first_end) + 1
    ignored_before = len("".join(pieces[:min_tokens - 1]))
    later = next((i for i in range(len(full)) if full.startswith(stop, i)
                  and i + 2 > ignored_before), None)
    choice = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                min_tokens=min_tokens, ignore_eos=True))
    choice = choice[0].outputs[0]
    assert choice.text.startswith(full[:first_end])  # the early match was not a stop
    if later is None:
        assert (choice.finish_reason, choice.token_ids, choice.text) == ("length", tokens, full)
    else:
        num_tokens = next(k for k in range(1, 25) if len("".join(pieces[:k])) >= later + 2)
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        assert choice.token_ids == tokens[:num_tokens] and choice.text == full[:later]


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
    assert llm.stats().generation_tokens == 8


def test_min_tokens_holds_back_a_likely_eos(tiny_path) -> None:
    ids = prompt(6, 10)
    llm = make_llm(tiny_path)
    eager = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100.0})
    choice = llm.generate([ids], eager)[0].outputs[0]
    assert (choice.token_ids, choice.text, choice.finish_reason) == ([EOS], "", "stop")
    held = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100.0}, min_tokens=5)
    choice = llm.generate([ids], held)[0].outputs[0]
    plain = solo(tiny_path, ids, SamplingParams(temperature=0, max_tokens=5)).outputs[0]
    # While EOS is masked the other logits are untouched: the first 5 tokens are plain greedy.
    assert choice.token_ids == [*plain.token_ids, EOS]
    assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
    assert choice.text == plain.text
