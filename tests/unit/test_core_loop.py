"""`run_core_loop` (engine/client.py): the loop alone keeps `stalled`, from `StepResult`."""

from __future__ import annotations

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
