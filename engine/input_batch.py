"""The runner's persistent per-request state, updated from each `SchedulerOutput`.

A request is described to the runner once (`NewRequest`); from then on the runner keeps
its tokens (it appends what it samples), its sampling state (a seeded `torch.Generator`
that advances across steps and preemptions, and the grammar matcher of a structured
request, which advances with the tokens) and a row of a block-table buffer that is
rewritten only when the scheduler sends a changed table:

    block_table  [max_rows, max_blocks_per_seq] int32, -1 padded, on the host
    row_of       request id -> row (held while the request has blocks; freed on
                 preemption and finish, so rows <= running requests <= max_num_seqs)

Each step then gathers the rows of its scheduled requests instead of rebuilding every
table from Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from plait.engine.grammar import RequestGrammar
from plait.engine.sampling_params import SamplingParams
from plait.engine.sched_output import SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of one request between steps."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None  # only for seeded requests
    num_blocks: int = 0  # entries of its block-table row in use
    block_ids: tuple[int, ...] = ()  # host copy of the row's blocks, for slot arithmetic
    # Structured output: the request's own matcher, made at its first sample and advanced
    # by every token appended to output_token_ids (kept across preemption, like the tokens).
    grammar: RequestGrammar | None = None

    def token_ids(self, start: int, end: int) -> list[int]:
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


class InputBatch:
    """Request states and the persistent block-table buffer (see module docstring)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, sample_device: torch.device):
        self.max_rows = max_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sample_device = sample_device
        self.states: dict[str, CachedRequestState] = {}
        self.block_table = torch.full((max_rows, max_blocks_per_seq), -1, dtype=torch.int32)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))

    def apply(self, out: SchedulerOutput) -> None:
        """Steps 1-3 of `SchedulerOutput`: forget, remember, rewrite changed tables."""
        for request_id in out.finished_ids:
            self.states.pop(request_id, None)
            self._free_row(request_id)
        for request_id in out.preempted_ids:
            self._free_row(request_id)
        for new in out.new_requests:
            generator = None
            if new.params.seed is not None:
                generator = torch.Generator(device=self.sample_device)
                generator.manual_seed(new.params.seed)
            self.states[new.request_id] = CachedRequestState(
                new.request_id, list(new.prompt_token_ids), new.params, generator=generator)
        for request_id, block_ids in out.block_tables:
            self._set_table(request_id, block_ids)

    def _set_table(self, request_id: str, block_ids: tuple[int, ...]) -> None:
        if len(block_ids) > self.max_blocks_per_seq:
            raise ValueError(f"request {request_id} has {len(block_ids)} blocks, more than "
                             f"the {self.max_blocks_per_seq} a sequence can have")
        row = self.row_of.get(request_id)
        if row is None:
            row = self._free_rows.pop()  # IndexError: more rows than running requests
            self.row_of[request_id] = row
        state = self.states[request_id]
        if len(block_ids) < state.num_blocks:
            self.block_table[row, len(block_ids):state.num_blocks] = -1
        if block_ids:
            self.block_table[row, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        state.num_blocks = len(block_ids)
        state.block_ids = block_ids

    def _free_row(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is None:
            return
        self.block_table[row] = -1
        self._free_rows.append(row)
        state = self.states.get(request_id)
        if state is not None:
            state.num_blocks = 0
            state.block_ids = ()
