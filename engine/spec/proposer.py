"""The draft proposer interface: what every speculative method (ngram, suffix, draft_model)
implements, and the one input type it reads.

Contract, called from the engine core thread only (never concurrently):

    propose(seqs)                       once per step, for the sequences that speculate
    on_verified(id, proposed, accepted) after the step that verified a draft of `id`
    finish(id)                          once, when `id` finishes, is aborted or preempted

A proposer never sees tensors or `Request` objects, only token ids, so it can be tested on
plain lists. Proposers with no per-request state (ngram) ignore the two hooks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecInput:
    """One sequence that wants a draft this step.

    `token_ids`: every token of the sequence so far, prompt then output (read-only: the
    proposer must neither change nor keep this sequence, it is the request's own list);
    the first `num_prompt_tokens` are the prompt. `max_draft_tokens` (>= 1): the most
    tokens the proposer may return for it.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_draft_tokens: int


class Proposer(ABC):
    """Guesses the tokens that follow each sequence.

    A draft is only a guess: the engine verifies every drafted token against the target
    model before it becomes output, so a wrong draft costs time, never correctness.

    `empty_draft_costs`: whether proposing costs time even when no draft comes of it (a
    draft model's forward pass): the engine then takes an empty draft as a missed one, so
    that a sequence with nothing to draft backs off (policy.py) instead of paying for a
    proposal every step. False for lookups (ngram, suffix), whose misses cost nothing.
    `draft_token_cost`: see policy.py; 0 for lookups."""

    empty_draft_costs: bool = False
    # What drafting one token costs, against one decode step of the target model (0: a
    # lookup); the policy counts drafts as missed while a sequence's recent acceptance
    # is below it.
    draft_token_cost: float = 0.0

    @abstractmethod
    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        """Drafts for `seqs`, in the same order: for each, 0 to `max_draft_tokens` token
        ids that are guessed to follow `token_ids` (an empty list: no guess)."""

    def setup_cost(self, seq: SpecInput) -> float:
        """What proposing for `seq` now costs before its draft, in decode steps of the
        target (a draft model computing the tokens its cache lacks); the policy drafts
        only where the request's remaining tokens could repay it (policy.py). Default: 0."""
        del seq
        return 0.0

    def on_verified(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The draft of `num_proposed` tokens last returned for `request_id` was verified:
        its first `num_accepted` tokens were accepted (0 <= num_accepted <= num_proposed).
        The accepted tokens, and the one token the target model added after them, are in
        `token_ids` of the next `propose` call. Default: nothing."""
        del request_id, num_proposed, num_accepted

    def finish(self, request_id: str) -> None:
        """`request_id` will not be proposed for again (finished, aborted or preempted;
        a preempted request may come back later under the same id with the same tokens).
        Drop any state kept for it. Default: nothing."""
        del request_id
