"""Draft budgets (engine/spec/policy.py) and the core's draft selection
(engine/spec/driver.py): acceptance feedback shrinks k down to pauses, large batches
propose nothing, drafts never run past max_tokens or the context."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from plait import SamplingParams
from plait.engine import StructuredSpec
from plait.engine.request import Request, RequestStatus
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.driver import SpecDecoder
from plait.engine.spec.policy import PAUSE_MAX_STEPS, PAUSE_MIN_STEPS, RATE_DECAY, SpecPolicy
from plait.engine.spec.proposer import Proposer, SpecInput


def test_k_follows_acceptance() -> None:
    policy = SpecPolicy(max_k=8)
    assert policy.budget("a") == 8
    policy.record("a", 8, 3)
    assert policy.budget("a") == 4  # a + 1
    policy.record("a", 4, 4)
    assert policy.budget("a") == 8  # doubled, capped
    policy.record("a", 8, 0)
    policy.record("a", 4, 0)
    policy.record("a", 2, 0)
    assert policy.budget("a") == 1
    policy.record("a", 1, 1)
    assert policy.budget("a") == 2
    assert policy.budget("b") == 8  # per sequence


def test_misses_at_k_1_pause_proposals_longer_each_time() -> None:
    policy = SpecPolicy(max_k=1)
    policy.record("a", 1, 0)
    assert [policy.budget("a") for _ in range(PAUSE_MIN_STEPS + 1)] == \
        [0] * PAUSE_MIN_STEPS + [1]
    policy.record("a", 1, 0)
    assert [policy.budget("a") for _ in range(2 * PAUSE_MIN_STEPS + 1)] == \
        [0] * (2 * PAUSE_MIN_STEPS) + [1]
    for _ in range(10):
        policy.record("a", 1, 0)
    assert sum(policy.budget("a") == 0 for _ in range(200)) == PAUSE_MAX_STEPS
    policy.record("a", 1, 1)  # an accepted draft resets the pause length
    policy.record("a", 1, 0)
    assert sum(policy.budget("a") == 0 for _ in range(200)) == PAUSE_MIN_STEPS
    policy.forget("a")
    assert policy.budget("a") == 1


def test_drafts_that_cost_more_than_they_keep_count_as_misses() -> None:
    """With a draft token costing c of a target step, a draft counts as missed while the
    sequence's recent acceptance (decayed sums, RATE_DECAY) is below c; a lookup (c = 0)
    keeps a + 1 for the same drafts."""
    lookup, costly = SpecPolicy(max_k=8), SpecPolicy(max_k=8, draft_token_cost=0.5)
    for policy in (lookup, costly):
        policy.record("a", 8, 2)
    assert lookup.budget("a") == 3  # a + 1
    assert costly.budget("a") == 4  # 2 of 8 < 0.5: halved
    costly.record("a", 4, 4)  # (0.8 * 2 + 4) / (0.8 * 8 + 4) = 0.54: all kept
    assert costly.budget("a") == 8
    assert RATE_DECAY == 0.8
    slow = SpecPolicy(max_k=1, draft_token_cost=0.5)
    for _ in range(5):
        slow.record("a", 1, 0)
    for _ in range(PAUSE_MAX_STEPS):  # the last pause runs out
        slow.budget("a")
    assert slow.budget("a") == 1
    slow.record("a", 1, 1)  # accepted, yet the recent rate 1 / 3.69 < 0.5: a pause
    assert slow.budget("a") == 0
    with pytest.raises(ValueError, match="draft_token_cost"):
        SpecPolicy(max_k=1, draft_token_cost=-0.1)


def test_a_costly_draft_waits_for_a_target_sure_of_its_tokens() -> None:
    """With c > 0 a sequence drafts only while the target's top probability at its plain
    steps (decayed as the acceptance) averages at least c; a lookup (c = 0) ignores it.
    The gate counts no pause step and needs no observation to start."""
    lookup, costly = SpecPolicy(max_k=4), SpecPolicy(max_k=4, draft_token_cost=0.4)
    assert costly.budget("new") == 4  # nothing observed yet
    for policy in (lookup, costly):
        policy.observe("a", 0.1)
    assert lookup.budget("a") == 4
    assert costly.budget("a") == 0
    costly.observe("a", 0.6)  # (0.8 * 0.1 + 0.6) / 1.8 = 0.378 < 0.4
    assert costly.budget("a") == 0
    costly.observe("a", 0.5)  # (0.8 * 0.68 + 0.5) / 2.44 = 0.428
    assert costly.budget("a") == 4
    costly.record("a", 4, 0)
    costly.record("a", 2, 0)
    costly.record("a", 1, 0)  # a pause of PAUSE_MIN_STEPS
    costly.observe("a", 0.0)
    costly.observe("a", 0.0)  # unsure again: the pause runs out, the gate stays shut
    assert [costly.budget("a") for _ in range(PAUSE_MIN_STEPS + 1)] == [0] * (
        PAUSE_MIN_STEPS + 1)
    for _ in range(10):
        costly.observe("a", 1.0)
    assert costly.budget("a") == 1
    costly.forget("a")
    assert costly.budget("a") == 4


class Echo(Proposer):
    """Drafts 1, 2, 3, ... up to the budget; records what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, int]] = []

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        self.asked += [(s.request_id, s.max_draft_tokens) for s in seqs]
        return [list(range(1, s.max_draft_tokens + 3)) for s in seqs]  # too long: cut


def decoding(request_id: str, num_prompt: int, num_out: int, max_tokens: int) -> Request:
    req = Request(request_id, list(range(10, 10 + num_prompt)), SamplingParams(),
                  output_token_ids=[5] * num_out, status=RequestStatus.RUNNING,
                  max_tokens=max_tokens)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_drafts_fit_max_tokens_context_and_batch_size() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                               disable_by_batch_size=5)
    proposer = Echo()
    spec = SpecDecoder(config, max_model_len=20, proposer=proposer)
    a = decoding("a", 5, 1, max_tokens=10)  # room for 4
    b = decoding("b", 5, 7, max_tokens=10)  # 3 left after this one: 2 drafts
    c = decoding("c", 15, 2, max_tokens=10)  # 17 of 20 context: 2 drafts
    d = decoding("d", 5, 9, max_tokens=10)  # the step's token is its last: none
    prefilling = decoding("e", 5, 0, max_tokens=10)
    prefilling.num_computed_tokens = 2
    drafts = spec.drafts([a, b, c, d, prefilling])
    assert drafts == {"a": [1, 2, 3, 4], "b": [1, 2], "c": [1, 2]}
    assert proposer.asked == [("a", 4), ("b", 2), ("c", 2)]
    # 5 decoding sequences reach disable_by_batch_size: nothing is proposed
    e = decoding("e", 5, 1, max_tokens=10)
    assert spec.drafts([a, b, c, d, e]) == {}
    spec.verified("a", 4, 2)
    spec.verified("b", 2, 0)
    c_ = spec.counters
    assert (c_.num_drafts, c_.num_draft_tokens, c_.num_accepted_tokens,
            c_.accepted_per_pos) == (2, 6, 2, [1, 1, 0, 0])
    assert spec.drafts([a])["a"] == [1, 2, 3]  # k = accepted + 1
    # a token outside the vocabulary ends a draft
    small = SpecDecoder(config, max_model_len=20, proposer=Echo(), vocab_size=3)
    assert small.drafts([a]) == {"a": [1, 2]}


class Setup(Echo):
    """Echo whose every proposal first costs `cost` target steps."""

    draft_token_cost = 0.5

    def __init__(self, cost: float) -> None:
        super().__init__()
        self.cost = cost

    def setup_cost(self, seq: SpecInput) -> float:
        return self.cost


def test_a_proposal_with_a_setup_cost_waits_for_tokens_that_could_repay_it() -> None:
    """A draft of k tokens each accepted with probability a (the target's average
    certainty) yields 1 + a + ... + a^k tokens for 1 + c k steps: a proposal costing s
    steps first is made only where R (1 - (1 + c k) / (1 + a + ... + a^k)) >= s."""
    policy = SpecPolicy(max_k=4, draft_token_cost=0.5)
    assert policy.repays("new", 4.0, 10, 4)  # a = 1: 10 (1 - 3 / 5) = 4
    assert not policy.repays("new", 4.01, 10, 4)
    assert policy.repays("new", 2.5, 10, 1) and not policy.repays("new", 2.51, 10, 1)
    policy.observe("a", 0.6)  # 1 + 0.6 + 0.36 = 1.96 tokens for 2 steps: nothing saved
    assert not policy.repays("a", 0.01, 1000, 2)
    # k = 1: 1.6 tokens for 1.5 steps, 1 - 1.5 / 1.6 = 0.0625 a token
    assert policy.repays("a", 6.2, 100, 1) and not policy.repays("a", 6.3, 100, 1)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    cheap, dear = Setup(4.0), Setup(4.1)
    for proposer, want in ((cheap, {"a": [1, 2, 3, 4]}), (dear, {})):
        spec = SpecDecoder(config, max_model_len=100, proposer=proposer)
        assert spec.policy.draft_token_cost == 0.5
        a = decoding("a", 5, 1, max_tokens=11)  # 10 tokens left, k = 4: 4 steps saved
        assert spec.drafts([a]) == want
        assert proposer.asked == ([("a", 4)] if want else [])


def test_structured_drafts_are_cut_by_the_grammar() -> None:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    spec = SpecDecoder(config, max_model_len=100, proposer=Echo())
    a = decoding("a", 5, 1, max_tokens=50)
    a.params = SamplingParams(structured=None)
    b = decoding("b", 5, 1, max_tokens=50)
    b.params = SamplingParams(structured=StructuredSpec("regex", "[0-9]+"))
    checked: list[tuple[str, list[int]]] = []

    def check(request_id: str, draft: list[int]) -> int:
        checked.append((request_id, draft))
        return 1

    assert spec.drafts([a, b], check) == {"a": [1, 2, 3, 4], "b": [1]}
    assert checked == [("b", [1, 2, 3, 4])]
