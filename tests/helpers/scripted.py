"""A scripted engine core for server tests: the real `AsyncEngine`, HTTP app and stream code
around a core that needs no model and writes known tokens.

    ScriptedCore(tokenizer)        stands in for EngineCore (implements engine/core_api.Core)
    scripted_engine(core, gate)    a real AsyncEngine around it; load() waits for `gate`

By default the core steps as fast as the engine loop calls it. A test that needs a stream to
stay in flight (a disconnect, an abort, a drain, idle pings) calls `core.hold()` first and
then lets steps through one at a time with `core.release(n)`:

    test thread          core.hold()    post ... read first chunks    core.release(3)
    engine loop    step: no permit -> stalled (the loop waits for a command)
                                                          release wakes it -> 3 steps
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import EngineStats, StepResult
from plait.engine.outputs import RequestDelta, TokenLogprob
from plait.engine.sampling_params import SamplingParams
from plait.engine.wire import AddBatchCommand

# A held core left without a release this long raises from step(): the engine dies and every
# stream ends in an error, so a test that forgot to release fails instead of hanging.
HELD_LIVENESS_S = 60.0


class ScriptedCore:
    """Stands in for `EngineCore` inside a real `AsyncEngine` (pass `core_factory`).

    Each step gives every live request the next token of `SCRIPT_TEXT`; a request finishes
    with "length" at its max_tokens (default 8). Knobs for tests: `fail_after` (emit an
    "error" delta after that many tokens; with `fail_with_token` it carries one more token,
    the shape a stream's merge gives a reader that fell behind), `reject` (every
    add_request raises, so the request fails before its first token), `die` (stats()
    raises: the engine loop dies),
    `hold()` / `release(n)` (steps only as the test allows). `added` / `aborted` record
    request ids; `num_steps` counts the steps that produced tokens.
    """

    SCRIPT_TEXT = " one two three four five six seven eight nine ten eleven twelve"

    def __init__(self, tokenizer, max_model_len: int = 512) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(self.SCRIPT_TEXT, add_special_tokens=False)
        self.info = RuntimeInfo(device="cpu", dtype="float32", num_kv_blocks=256,
                                max_model_len=max_model_len, vocab_size=len(tokenizer),
                                eos_token_ids=(2,), model_name="scripted-model")
        self.fail_after: int | None = None
        self.fail_with_token = False
        self.reject = False
        self.die = False
        self.live: dict[str, tuple[SamplingParams, int]] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.num_steps = 0
        self.lock = threading.Lock()
        self.wake: Callable[[], None] = lambda: None  # set by scripted_engine
        self._permits: int | None = None  # None: not held, steps run freely
        self._held_since: float | None = None

    # ---------------------------------------------------------------- the test's side
    def hold(self) -> None:
        """From now on a step runs only with a permit from `release`."""
        with self.lock:
            self._permits = 0

    def release(self, num_steps: int = 1) -> None:
        """Let `num_steps` more steps run (after `hold`), and wake the engine loop."""
        with self.lock:
            assert self._permits is not None, "release() without hold()"
            self._permits += num_steps
        self.wake()

    def run_freely(self) -> None:
        """Undo `hold`: every step runs."""
        with self.lock:
            self._permits = None
        self.wake()

    # ---------------------------------------------------------------- the Core protocol
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if self.reject:
            raise ValueError("scripted rejection")
        with self.lock:
            self.live[request_id] = (params, 0)
            self.added.append(request_id)

    def abort(self, request_id: str) -> RequestDelta | None:
        with self.lock:
            if self.live.pop(request_id, None) is None:
                return None
            self.aborted.append(request_id)
        return RequestDelta(request_id, finish_reason="abort")

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def idle_work(self) -> bool:
        return False

    def step(self) -> StepResult:
        with self.lock:
            if not self._take_permit():
                return StepResult([], stalled=True)  # the loop waits for a command or a wake
            self.num_steps += 1
            deltas = []
            for request_id, (params, done) in list(self.live.items()):
                delta = self.next_delta(request_id, params, done)
                if delta.finished:
                    del self.live[request_id]
                else:
                    self.live[request_id] = (params, done + 1)
                deltas.append(delta)
        return StepResult(deltas)

    def _take_permit(self) -> bool:
        """Under the lock: may this step run? Raises once a held core starved too long."""
        if self._permits is None:
            return True
        if self._permits > 0:
            self._permits -= 1
            self._held_since = None
            return True
        if self._held_since is None:
            self._held_since = time.monotonic()
        elif time.monotonic() - self._held_since > HELD_LIVENESS_S:
            raise RuntimeError(f"scripted core held for {HELD_LIVENESS_S:.0f} s: no release()")
        return False

    def next_delta(self, request_id: str, params: SamplingParams, done: int) -> RequestDelta:
        """The delta of a live request that has `done` tokens (under the lock): the next
        token of `SCRIPT_TEXT`, or the scripted failure."""
        token = self.script[done % len(self.script)]
        if self.fail_after is not None and done >= self.fail_after:
            if self.fail_with_token:  # as a stream merges a token into the failure after it
                return RequestDelta(request_id, [token], self.tokenizer.decode([token]),
                                    finish_reason="error", error="scripted engine failure")
            return RequestDelta(request_id, finish_reason="error",
                                error="scripted engine failure")
        delta = RequestDelta(request_id, [token], self.tokenizer.decode([token]),
                             num_prompt_tokens=3)
        if params.logprobs is not None:
            delta.logprobs = [TokenLogprob(token, -0.5, [(token, -0.5)])]
        if done + 1 >= (params.max_tokens or 8):
            delta.finish_reason = "length"
        return delta

    def close(self) -> None:
        pass

    def stats(self) -> EngineStats:
        if self.die:
            raise RuntimeError("scripted engine death")
        return EngineStats(num_running=len(self.live), kv_blocks_total=256)


def scripted_engine(core: ScriptedCore, gate: threading.Event | None = None):
    """A real AsyncEngine around `core`; its load() blocks until `gate` is set. The core's
    `wake` sends the loop an empty batch, which ends a stalled wait like any command."""
    from plait.engine.async_engine import AsyncEngine

    def factory(_: EngineConfig) -> ScriptedCore:
        if gate is not None and not gate.wait(60):
            raise RuntimeError("gate never opened")
        return core

    engine = AsyncEngine(EngineConfig(block_size=16), core_factory=factory)  # type: ignore[arg-type]
    core.wake = lambda: engine._send(AddBatchCommand([]))
    return engine
