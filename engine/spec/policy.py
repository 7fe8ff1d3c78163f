"""How many tokens each sequence drafts this step: acceptance feedback per sequence, and
speculation stepping aside for large batches.

Per sequence, k (the draft budget) follows what was accepted:

    all of a draft accepted          k doubles (up to num_speculative_tokens)
    some accepted (a of p)           k = a + 1
    none accepted, or r < c          k halves; from k = 1 the sequence stops proposing for
                                     a pause of 8 steps, doubling (to 64) while its drafts
                                     keep missing, back to 8 once one is accepted

c is the proposer's `draft_token_cost` (proposer.py): what drafting one token costs,
against one decode step of the target; r the sequence's recent acceptance, accepted over
drafted tokens with both sums decayed by RATE_DECAY a draft. Drafting k tokens that each
hold with probability r yields at most r k accepted ones on average (a draft ends at its
first rejected token), at a cost of c k: where r < c no k pays, and the draft counts as
missed however it went. A lookup's drafts cost nothing (c = 0: the rule never fires); a
draft model's p tokens cost about c p steps, so free text that the draft model predicts
about as often as it costs (r about 0.4 against c = 0.43 for Qwen2.5-Coder-0.5B drafting
for -1.5B) backs off as a lookup's misses do.

A miss costs the extra rows of one step, so free text with few repeats settles at rare,
short drafts. A proposal that finds nothing (an empty draft) costs no rows and changes
nothing.

Before it drafts at all, a sequence whose drafts cost time (c > 0) must look predictable
to the target itself: the probability the target gives its most likely token at its plain
steps (`observe`, decayed as r is) must average at least c. A drafted token is accepted
about as often as the target would have picked it, so where the target spreads its
probability (free text sampled at temperature 1: random words continued on
Qwen2.5-Coder-1.5B average 0.19 and 0.36) no draft pays, and a draft model's first
proposal would also pay for computing the whole prompt into its own cache. Where the
target is sure (a code edit's copy: 0.997) drafting starts at its first decode step.
The gate takes no step of a pause and needs no draft to learn; it reads only plain steps
(a speculative step's rows are the verification's).

A proposal may cost something before its draft: a draft model first computes the tokens
its cache lacks (the whole prompt at the first proposal; `Proposer.setup_cost`, s target
steps). With each draft token accepted with probability a (the gate's average), a draft
of k tokens yields 1 + a + ... + a^k tokens for 1 + c k steps (Leviathan et al.), so each
of the R tokens a sequence may still make saves 1 - (1 + c k) / (1 + a + ... + a^k) steps
at best: a proposal is made only where R times that reaches s (`repays`). On a 128-token
answer whose target grows sure only late (random words that the 1.5B starts to repeat),
the 0.5B's catch-up over a 270-token prompt (0.5 s, 17 target steps) no longer comes with
30-70 tokens left at a near c.

Batch size: a decode step of B sequences reads every weight once for B rows; while B is
small the step is bound by reading the weights, and k extra rows per sequence are nearly
free. Past some B it is bound by computing them, and drafts only add work. A step with
`disable_by_batch_size` or more decoding sequences proposes nothing (vLLM's option of the
same name). scripts/bench_spec_rows.py measures what a step of B streams x (1 + k) rows
costs; scripts/bench_spec_streams.py what speculation gains at B streams of the W6 code edit
(ngram k = 4, 0.6-0.9 of the drafts accepted). DEFAULT_DISABLE_BY_BATCH_SIZE = 8 is where
that gain ends (BENCHMARKS.md, "Speculative decoding", 2026-12-06, one thread): with
the int8 numerics (`--numerics int8`, then flags that set the same), SmolLM2 gains
1.46x at 1 stream, 1.08x at 4, 1.03x at 6 and 8, loses at 12 (0.85x) and 16 (0.81x);
Qwen2.5-Coder-0.5B gains 2.55x at 1, 1.29x at 8, 1.02-1.03x at 12 and 16. In the exact mode
SmolLM2 gains 1.29x at 8 and loses at 16 (0.61x), Qwen gains 1.51x at 8 and
1.24x at 16. So from 8 decoding streams on a step does not speculate: there SmolLM2's
gain is gone (and it loses from 12); Qwen gives up its 1.29x at 8-11 streams for that, and
has about nothing (1.02x) left from 12. A model-dependent point would serve both better.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DISABLE_BY_BATCH_SIZE = 8
PAUSE_MIN_STEPS = 8
PAUSE_MAX_STEPS = 64
# The weight each earlier draft keeps in a sequence's recent acceptance, per later draft.
RATE_DECAY = 0.8


@dataclass(slots=True)
class _SeqState:
    k: int
    pause_left: int = 0  # steps left without proposing
    pause_len: int = PAUSE_MIN_STEPS  # the next pause's length
    accepted: float = 0.0  # decayed sums of accepted and drafted tokens (RATE_DECAY)
    drafted: float = 0.0
    sure: float = 0.0  # decayed sums of the target's top probability and of its steps
    steps: float = 0.0

    @property
    def certainty(self) -> float:
        """a: the target's decayed average top probability (1 with nothing observed)."""
        return self.sure / self.steps if self.steps > 0 else 1.0


class SpecPolicy:
    """Draft budgets per sequence id (see the module docstring). Core thread only."""

    def __init__(self, max_k: int, disable_by_batch_size: int | None = None,
                 draft_token_cost: float = 0.0) -> None:
        """`draft_token_cost`: c of the module docstring (>= 0)."""
        if max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {max_k}")
        if not draft_token_cost >= 0:
            raise ValueError(f"draft_token_cost must be >= 0, got {draft_token_cost}")
        self.max_k = max_k
        self.draft_token_cost = draft_token_cost
        self.disable_by_batch_size = (DEFAULT_DISABLE_BY_BATCH_SIZE
                                      if disable_by_batch_size is None
                                      else disable_by_batch_size)
        self._seqs: dict[str, _SeqState] = {}

    def enabled_for_batch(self, num_decoding: int) -> bool:
        """Whether a step with `num_decoding` decoding sequences speculates at all."""
        return num_decoding < self.disable_by_batch_size

    def budget(self, request_id: str) -> int:
        """Tokens `request_id` may draft this step (0: none). Counts one step of a pause."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = _SeqState(self.max_k)
        if seq.pause_left > 0:
            seq.pause_left -= 1
            return 0
        if seq.steps > 0 and seq.certainty < self.draft_token_cost:  # the target is unsure
            return 0
        return seq.k

    def repays(self, request_id: str, setup_cost: float, remaining: int, k: int) -> bool:
        """Whether `remaining` tokens of `request_id`, drafting k at a time, could repay a
        proposal's setup cost (target steps; see the module docstring). With nothing
        observed, a = 1."""
        seq = self._seqs.get(request_id)
        a = seq.certainty if seq is not None else 1.0
        tokens = 1 + sum(a ** j for j in range(1, k + 1))  # per draft and verification
        return remaining * (1 - (1 + self.draft_token_cost * k) / tokens) >= setup_cost

    def observe(self, request_id: str, top_prob: float) -> None:
        """At a plain step of `request_id`, the target gave its most likely token
        `top_prob` (0..1)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = _SeqState(self.max_k)
        seq.sure = RATE_DECAY * seq.sure + top_prob
        seq.steps = RATE_DECAY * seq.steps + 1

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """A draft of `num_proposed` (>= 1) tokens of `request_id` was verified."""
        seq = self._seqs.get(request_id)
        if seq is None:
            seq = self._seqs[request_id] = _SeqState(self.max_k)
        seq.accepted = RATE_DECAY * seq.accepted + num_accepted
        seq.drafted = RATE_DECAY * seq.drafted + num_proposed
        if seq.accepted < self.draft_token_cost * seq.drafted:  # r < c: no k pays
            num_accepted = 0
        if num_accepted >= num_proposed:
            seq.k = min(self.max_k, 2 * max(seq.k, num_proposed))
            seq.pause_len = PAUSE_MIN_STEPS
        elif num_accepted > 0:
            seq.k = min(self.max_k, num_accepted + 1)
            seq.pause_len = PAUSE_MIN_STEPS
        elif seq.k > 1:
            seq.k //= 2
        else:
            seq.pause_left = seq.pause_len
            seq.pause_len = min(PAUSE_MAX_STEPS, 2 * seq.pause_len)

    def forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
