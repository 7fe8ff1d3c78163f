"""The engine core's side of speculative decoding: which running sequences draft this step
and how much (policy.py), the proposer call, and what verification taught (acceptance
counters for the metrics, feedback to the policy and the proposer).

    drafts = spec.drafts(running, ...)        before Scheduler.schedule(drafts)
    spec.verified(id, proposed, accepted)     per speculative chunk, after the step
    spec.observe(id, top_prob)                per plain sample, after the step, where
                                              spec.wants_confidence
    spec.finish(id)                           when a sequence ends or is preempted
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from plait.engine.request import Request, RequestStatus
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.factory import make_proposer
from plait.engine.spec.policy import SpecPolicy
from plait.engine.spec.proposer import Proposer, SpecInput
from plait.engine.spec.target import TargetModel

logger = logging.getLogger("plait.engine")

# (request id, draft) -> how many leading draft tokens the request's grammar accepts
GrammarCheck = Callable[[str, list[int]], int]
# The acceptance log line comes at most this often, and only after drafts were verified.
LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class SpecCounters:
    """Counters over the engine's life (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # drafts verified
    num_draft_tokens: int = 0  # tokens in them
    num_accepted_tokens: int = 0  # of those, accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


class SpecDecoder:
    """Proposer + policy + counters for one engine (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 proposer: Proposer | None = None, vocab_size: int | None = None,
                 target: TargetModel | None = None) -> None:
        """`vocab_size`: draft tokens outside [0, vocab_size) end a draft (a proposer's
        bug must not fail the step of every request); None: no check. `proposer`: None
        builds `config`'s (make_proposer), given `target`, the engine it drafts for
        (required for draft_model)."""
        self.config = config
        self.vocab_size = vocab_size
        self.max_k = config.num_tokens
        self.max_model_len = max_model_len
        self.proposer = proposer if proposer is not None else make_proposer(config, target)
        self.policy = SpecPolicy(self.max_k, config.disable_by_batch_size,
                                 self.proposer.draft_token_cost)
        self.counters = SpecCounters(accepted_per_pos=[0] * self.max_k)
        self._logged_at = time.monotonic()
        self._logged_drafts = 0

    def drafts(self, running: Iterable[Request],
               grammar_check: GrammarCheck | None = None) -> dict[str, list[int]]:
        """Drafts for the running sequences that decode in the next step (their K/V is
        computed up to their last token), within each one's budget: the policy's k, the
        tokens `max_tokens` leaves after the step's own token, and the context. A
        structured sequence's draft is cut before the first token its grammar refuses
        (`grammar_check`, given for those). A sequence whose proposal has a setup cost
        (`Proposer.setup_cost`) drafts only where its remaining tokens could repay it
        (`SpecPolicy.repays`). Empty when the batch is too large."""
        decoding = [r for r in running if r.status == RequestStatus.RUNNING
                    and r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1]
        if not decoding or not self.policy.enabled_for_batch(len(decoding)):
            return {}
        seqs: list[SpecInput] = []
        for req in decoding:
            room = min(req.max_tokens - len(req.output_token_ids),
                       self.max_model_len - req.num_tokens) - 1
            k = min(self.policy.budget(req.request_id), room) if room > 0 else 0
            if k <= 0:
                continue
            seq = SpecInput(req.request_id, req.prompt_token_ids + req.output_token_ids,
                            req.num_prompt_tokens, k)
            setup = self.proposer.setup_cost(seq)
            if setup == 0 or self.policy.repays(req.request_id, setup, room + 1, k):
                seqs.append(seq)
        if not seqs:
            return {}
        found: dict[str, list[int]] = {}
        structured = {r.request_id for r in decoding if r.params.structured is not None}
        for seq, draft in zip(seqs, self.proposer.propose(seqs), strict=True):
            draft = list(draft[:seq.max_draft_tokens])
            if self.vocab_size is not None:
                draft = draft[:next((i for i, t in enumerate(draft)
                                     if not 0 <= t < self.vocab_size), len(draft))]
            if not draft and self.proposer.empty_draft_costs:
                self.policy.record(seq.request_id, 1, 0)  # paid for, and nothing to verify
            if draft and seq.request_id in structured and grammar_check is not None:
                draft = draft[:grammar_check(seq.request_id, draft)]
            if draft:
                found[seq.request_id] = draft
        return found

    @property
    def wants_confidence(self) -> bool:
        """Whether `observe` matters: only where a draft costs time (policy.py)."""
        return self.policy.draft_token_cost > 0

    def observe(self, request_id: str, top_prob: float) -> None:
        """The target's probability of its most likely token at a step where `request_id`
        verified no draft (RunnerOutput.top_probs)."""
        self.policy.observe(request_id, top_prob)

    def verified(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A draft of `num_proposed` tokens was verified, `num_accepted` kept."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_proposed
        c.num_accepted_tokens += num_accepted
        for pos in range(min(num_accepted, len(c.accepted_per_pos))):
            c.accepted_per_pos[pos] += 1
        self.policy.record(request_id, num_proposed, num_accepted)
        self.proposer.on_verified(request_id, num_proposed, num_accepted)
        now = time.monotonic()
        if now - self._logged_at >= LOG_INTERVAL_S:
            self._log(now)

    def _log(self, now: float) -> None:
        """The acceptance so far, as one info line (vLLM logs the same figures)."""
        c = self.counters
        per_pos = ", ".join(f"{n / c.num_drafts:.2f}" for n in c.accepted_per_pos)
        logger.info("speculative decoding: acceptance rate %.1f%% (%d of %d draft tokens), "
                    "%.2f tokens per draft, %d drafts (%d since the last line); per "
                    "position: %s", 100 * c.acceptance_rate, c.num_accepted_tokens,
                    c.num_draft_tokens, 1 + c.num_accepted_tokens / c.num_drafts,
                    c.num_drafts, c.num_drafts - self._logged_drafts, per_pos)
        self._logged_at = now
        self._logged_drafts = c.num_drafts

    def finish(self, request_id: str, preempted: bool = False) -> None:
        """`request_id` ended (or, `preempted`, left the running batch for now)."""
        if not preempted:
            self.policy.forget(request_id)
        self.proposer.finish(request_id)
