"""One engine sub-request as the scheduler sees it: a single sequence with its own sampling
params, its tokens, its block table and its place in prompt sharing. What the core keeps
for the output (detokenizer, prompt logprobs) lives in the core (engine/core.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plait.engine.prompt_share import InFlightPrompt


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable state of one sequence, owned by the engine core thread.

    `num_computed_tokens` counts tokens whose K/V is in the cache from this request's point
    of view (computed by it, or shared). `block_ids` is its block table; it only grows at the
    end, except on copy-on-write of a shared last block and on preemption (emptied).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    extra_key: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    max_tokens: int = 16
    # Prompt sharing (see prompt_share.py): the key of the prompt, the in-flight entry this
    # request computes (owner) or waits on (parked follower), and the hash under which its
    # partial last prompt block was registered (owners only).
    share_key: bytes | None = None
    share_entry: InFlightPrompt | None = None
    partial_block_hash: bytes | None = None
    # What the runner knows of this request (see sched_output.py): described once, then
    # only a changed block table is sent again.
    known_to_runner: bool = False
    blocks_changed: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def needs_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None
