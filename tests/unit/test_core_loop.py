"""`run_core_loop` (engine/client.py): the loop alone keeps `stalled`, from `StepResult`."""

from __future__ import annotations

import pytest

from plait.engine.client import run_core_loop
from plait.engine.core_api import StepResult
from plait.engine.outputs import RequestDelta
from plait.engine.sampling_params import SamplingParams
from plait.engine.wire import AbortCommand, AddBatchCommand, AddCommand, Command, ShutdownCommand


class StallingCore:
    """Every step stalls until the request is aborted."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.num_steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.live.add(request_id)

    def abort(self, request_id: str) -> RequestDelta | None:
        self.live.discard(request_id)
        return RequestDelta(request_id, finish_reason="abort")

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def idle_work(self) -> bool:
        return False

    def step(self) -> StepResult:
        self.num_steps += 1
        return StepResult([], stalled=True)

    def stats(self) -> None:
        return None


def test_a_stalled_step_blocks_the_loop_until_a_command_comes() -> None:
    core = StallingCore()
    script: list[Command | None] = [
        AddBatchCommand([AddCommand("a", [1, 2], SamplingParams())]), None,  # add, then step
        None,  # blocking (stalled): the receive timed out; the loop tries one step
        AbortCommand("a"), None,  # a command clears the stall; nothing left to step
        ShutdownCommand()]
    blocks: list[bool] = []

    def receive(block: bool) -> Command | None:
        blocks.append(block)
        return script.pop(0)

    emitted: list[list[str]] = []
    run_core_loop(core, receive, lambda deltas, _: emitted.append(
        [d.request_id for d in deltas]))
    assert core.num_steps == 2
    # with a request live, only the stall makes the loop block (blocks[2] and blocks[3])
    assert blocks == [True, False, True, True, False, True]
    assert emitted == [[], [], ["a"]]


class IdleWorkCore(StallingCore):
    """`slices` slices of idle work; a step finishes every live request. `events` is the
    order of the loop's calls."""

    def __init__(self, slices: int) -> None:
        super().__init__()
        self.slices = slices
        self.events: list[str] = []

    def idle_work(self) -> bool:
        assert not self.live, "idle work while a request can step"
        self.events.append("slice")
        self.slices -= 1
        return self.slices > 0

    def step(self) -> StepResult:
        self.events.append("step")
        done = [RequestDelta(r, finish_reason="stop") for r in sorted(self.live)]
        self.live.clear()
        return StepResult(done, stalled=False)


def _run_scripted(core: IdleWorkCore, script: list[Command | None]) -> list[bool]:
    blocks: list[bool] = []

    def receive(block: bool) -> Command | None:
        blocks.append(block)
        core.events.append("receive")
        return script.pop(0)

    run_core_loop(core, receive, lambda deltas, _: None)
    assert not script
    return blocks


@pytest.mark.parametrize(("slices", "blocks", "left"), [
    # slice 2 says it was the last: the loop blocks for the command, and after the step
    (2, [False, True, False, True], -1),
    # idle work is left every time: the loop never blocks
    (10, [False, False, False, False], 7)])
def test_idle_work_runs_slice_by_slice_and_a_command_between_slices_comes_first(
        slices: int, blocks: list[bool], left: int) -> None:
    """One slice, a look for a command; a command that came is served (and its step run)
    before the next slice; the loop blocks only once the core says no work is left."""
    core = IdleWorkCore(slices=slices)
    add = AddBatchCommand([AddCommand("a", [1, 2], SamplingParams())])
    assert _run_scripted(core, [None, add, None, ShutdownCommand()]) == blocks
    assert core.events == ["slice", "receive", "slice", "receive", "receive", "step",
                           "slice", "receive"]
    assert core.slices == left
