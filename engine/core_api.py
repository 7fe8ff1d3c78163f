"""What the core loop (engine/client.py `run_core_loop`) needs of an engine core, and what a
step gives back. `EngineCore` implements `Core`; so does the tests' scripted core.

    run_core_loop(core: Core, receive, emit)
      core.add_request / core.abort        commands, drained between steps
      core.step() -> StepResult            deltas, and whether nothing could progress
      core.stats() -> EngineStats          the snapshot emitted after each iteration

`EngineStats` crosses the engine-process pipe as it is (engine/wire.py) and is what
`/metrics` reads (server/metrics.py). No torch here: the server process imports this module
without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from plait.engine.config import RuntimeInfo
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, slots=True)
class StepResult:
    """One `step()`: its deltas, and `stalled`, set when the step found nothing it could
    compute (every live request waits for blocks that only a finish or an abort frees).
    The core loop then blocks for a command instead of stepping again."""

    deltas: list[RequestDelta] = field(default_factory=list)
    stalled: bool = False


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine core, taken after each loop iteration. Counters (`*_tokens`,
    `prefix_cache_*`, `num_preemptions`, `failed_steps`) only grow over the engine's life;
    the rest are gauges of the moment. Running and waiting count sub-requests (one per
    choice of n), the units the engine schedules."""

    num_running: int = 0  # sub-requests in the running batch
    num_waiting: int = 0  # queued, parked on an identical prompt, or compiling a grammar
    kv_blocks_used: int = 0  # referenced by live requests: 0 at rest (kept prompts own none)
    kv_blocks_total: int = 0  # the pool's size
    prompt_tokens_computed: int = 0  # prompt tokens run through the model
    prompt_tokens_cached: int = 0  # prompt tokens served from cached blocks or shared prompts
    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found
    num_preemptions: int = 0
    generation_tokens: int = 0  # tokens sampled
    shared_prompts_kept: int = 0  # computed prompts kept for reuse (prompt_share.py)
    failed_steps: int = 0  # forward passes that raised (their requests failed)
    last_error: str | None = None  # "Type: message" of the last step/sampling/decoding error
    model_weight_bytes: int = 0  # the model's weights in memory
    kv_events_dropped: int = 0  # KV-cache event batches never sent (engine/kv_events.py)
    # Speculative decoding (engine/spec/; all 0 when it is off): drafts verified, their
    # tokens, the tokens accepted, and per draft position i the drafts whose token i was
    # accepted (num_speculative_tokens entries; empty when off).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks in use (0..1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class Core(Protocol):
    """The engine core as `run_core_loop` and `AsyncEngine` drive it, on one thread.

    Every request added leaves with exactly one delta whose `finish_reason` is set: from
    `step()`, or from `abort()` (None for an unknown or finished id). `add_request` raises
    `ValueError` for a duplicate id."""

    info: RuntimeInfo

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> RequestDelta | None: ...

    def has_unfinished(self) -> bool: ...

    def idle_work(self) -> bool:
        """One short slice (milliseconds) of work that makes later steps faster, done only
        while idle; True while more remains."""
        ...

    def step(self) -> StepResult: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...
