"""What the core loop (engine/client.py `run_core_loop`) needs of an engine core, and what a
step gives back. `EngineCore` implements `Core`; so does the tests' scripted core.

    run_core_loop(core: Core, receive, emit)
      core.add_request / core.abort        commands, drained between steps
      core.step() -> StepResult            deltas, and whether nothing could progress
      core.stats()                         the snapshot emitted after each iteration

No torch here: the server process imports this module without loading the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from plait.engine.config import RuntimeInfo
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StepResult:
    """One `step()`: its deltas, and `stalled`, set when the step found nothing it could
    compute (every live request waits for blocks that only a finish or an abort frees).
    The core loop then blocks for a command instead of stepping again.

    Iterating yields the deltas, so `for delta in core.step()` reads only those."""

    deltas: list[RequestDelta] = field(default_factory=list)
    stalled: bool = False

    def __iter__(self) -> Iterator[RequestDelta]:
        return iter(self.deltas)


class Core(Protocol):
    """The engine core as `run_core_loop` and `AsyncEngine` drive it, on one thread.

    Every request added leaves with exactly one delta whose `finish_reason` is set: from
    `step()`, or from `abort()` (None for an unknown or finished id). `add_request` raises
    `ValueError` for a duplicate id."""

    info: RuntimeInfo
    tokenizer: Any

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> RequestDelta | None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> StepResult: ...

    def stats(self) -> Any: ...

    def close(self) -> None: ...
