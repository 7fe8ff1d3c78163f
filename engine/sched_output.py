"""The engine step's data boundary: what the scheduler asks of the runner, and the answer.

    Scheduler.schedule() -> SchedulerOutput -> ModelRunner.execute() -> RunnerOutput
                                                             -> EngineCore update (by id)

Both types are frozen and hold only request ids and plain data (ints, strings, tuples,
`SamplingParams`): never `Request` objects, share entries, tensors or identity keys, so a
step can be logged, replayed in a test, or sent to a runner in another process as is.

The runner keeps a persistent state per request id (tokens, block table, sampling state):
a request is described in full once (`NewRequest`), afterwards only what changed is sent
(`block_tables` of requests whose table changed, `finished_ids` to drop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.engine.outputs import TokenLogprob
from plait.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the runner has not seen: everything it needs to keep for its whole life."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a request are computed in this step.

    `sample`: the chunk ends at the request's last known token, so its last position's
    logits row is computed (and sampled from, see `SampleRow`).

    `draft_token_ids` (speculative decoding, engine/spec/): k guessed tokens that follow
    the request's last known token. The chunk is then that token plus the draft
    (`num_tokens` = 1 + k, `sample` True), every one of its k + 1 rows is scored, and the
    runner keeps the longest prefix of the draft the model itself samples, plus one token
    of its own (engine/spec/verify.py):

        positions  start   start+1 ... start+k
        tokens     last    d0      ... d(k-1)
        rows       r0      r1      ... rk      r_j verifies d_j; the first miss (or rk) samples
    """

    request_id: str
    start: int
    num_tokens: int
    sample: bool
    draft_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One token is sampled for `request_id`, from one of two logits sources:

    * `computed_by`: the last-position row of that request's chunk in this very step (the
      request itself, or the owner of the prompt it shares);
    * `kept_slot`: row `kept_slot` of the runner's buffer of kept prompt logits.
    Exactly one of the two is set."""

    request_id: str
    computed_by: str | None = None
    kept_slot: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One step. The runner applies it in this order:

    1. forget `finished_ids`; 2. remember `new_requests`; 3. replace the block tables in
    `block_tables`; 4. copy blocks (`block_copies`, src -> dst, all layers) before any
    write; 5. run the forward pass over `chunks`; 6. sample `samples` (in order); 7. copy
    the computed row of each `keep_logits` request into its kept slot (after the rows of
    step 6 were read, so a slot may be reused in the step that evicts its old entry).
    """

    finished_ids: tuple[str, ...] = ()
    new_requests: tuple[NewRequest, ...] = ()
    block_tables: tuple[tuple[str, tuple[int, ...]], ...] = ()
    block_copies: tuple[tuple[int, int], ...] = ()
    chunks: tuple[ScheduledChunk, ...] = ()
    samples: tuple[SampleRow, ...] = ()
    keep_logits: tuple[tuple[str, int], ...] = ()  # (request id, kept slot)
    # Scheduler-side facts for the update phase (the runner ignores them).
    preempted_ids: tuple[str, ...] = ()
    unservable_ids: tuple[str, ...] = ()  # need more KV blocks than the pool has

    @property
    def has_work(self) -> bool:
        """True when the runner has something to compute or sample."""
        return bool(self.chunks or self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(slots=True)
class RunnerOutput:
    """What one `execute` produced, keyed by request id.

    `sampled` holds a token for every `SampleRow` whose sampling succeeded; a request whose
    own sampling failed is in `errors` instead (its neighbours are unaffected), and so is a
    structured request whose grammar could not be matched.
    A speculative chunk's result is `accepted[id]` then `sampled[id]` (see ScheduledChunk).
    `prompt_logprobs` holds, for chunks of requests that asked for them, the logprobs of the
    prompt tokens this chunk scored (the first prompt token's `None` included when the
    chunk starts the prompt)."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # Speculative chunks: the draft tokens accepted (in order) before `sampled[id]`, which
    # is then the model's own token after them; their logprobs where asked for.
    accepted: dict[str, list[int]] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # Structured requests whose grammar is complete after this step's token (it takes no
    # token but EOS): they finish with "stop".
    grammar_ended: set[str] = field(default_factory=set)
    # Where the runner reports confidence (`ModelRunner.report_confidence`): for every
    # request sampled by a plain row (not a speculative chunk), the probability its logits
    # give their most likely token (softmax at temperature 1, before any processing).
    top_probs: dict[str, float] = field(default_factory=dict)
