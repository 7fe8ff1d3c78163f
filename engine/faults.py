"""Test-only fault injection, engine side. Nothing here runs unless a test (or the hidden
`plait serve --fault-injection` switch) installs it: the production step has no hook.

`install_fault_hook(core, hook)` wraps the core's seams, never its code:

    "execute"     the step boundary: before the runner executes a `SchedulerOutput`, once
                  per request in it (raising fails that step's requests, as a failing
                  forward pass would)
    "sample"      the runner's sampler, once per row (raising fails that row's request only:
                  the runner samples the rows one by one after a failed batch)
    "detokenize"  the request's detokenizer (raising fails that request only)

`FaultHook` is the marker-driven hook behind `--fault-injection` (markers in server/faults.py);
`arm_engine_faults(core)` installs it, wherever the core runs (thread or engine process).
This module imports nothing from `plait.server`.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from plait.engine.core import EngineCore
    from plait.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer
    from plait.engine.sampler import Sampler, SamplerOutput, SamplingMetadata
    from plait.engine.sampling_params import SamplingParams
    from plait.engine.vocabulary import TextDecoder

logger = logging.getLogger("plait.engine")

MARKER = re.compile(r"plait-fault:(tokenize|execute|sample|detokenize|kill)(?:@(\d+))?")
FAKE_FRAME = 'Traceback (most recent call last):\n  File "/srv/plait/internal/secret.py", line 7'


class InjectedFault(RuntimeError):
    """An injected error: the engine (or the HTTP layer) must contain it."""


class EngineKilled(BaseException):
    """Not an `Exception`, so `EngineCore.step` lets it through and the engine loop dies."""


@dataclass(frozen=True, slots=True)
class FaultSite:
    """The request a phase is about to work on."""

    request_id: str | None  # None in the sampler, which sees rows, not ids
    prompt_token_ids: Sequence[int]
    num_output_tokens: int  # tokens the request had before this phase


Hook = Callable[[str, FaultSite], None]


def find_marker(text: str) -> tuple[str, int] | None:
    """("execute", 3) for "... plait-fault:execute@3 ..."; None without a marker."""
    match = MARKER.search(text)
    if match is None:
        return None
    return match.group(1), int(match.group(2) or 0)


class _RunnerFaults:
    """The runner behind the step boundary, with the hook called before each execute."""

    def __init__(self, runner: Any, core: Any, hook: Hook) -> None:
        self._runner, self._core, self._hook = runner, core, hook

    def execute(self, out: Any) -> Any:
        self._runner.update_states(out)  # the runner's states follow the scheduler's anyway
        ids = dict.fromkeys([c.request_id for c in out.chunks]
                            + [s.request_id for s in out.samples])
        for request_id in ids:
            req = self._core.requests.get(request_id)
            if req is not None:
                self._hook("execute", FaultSite(request_id, req.prompt_token_ids,
                                                len(req.output_token_ids)))
        return self._runner.compute(out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class _SamplerFaults:
    def __init__(self, sampler: Sampler, hook: Hook) -> None:
        self._sampler, self._hook = sampler, hook

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        for prompt, output in zip(meta.prompt_token_ids, meta.output_token_ids, strict=True):
            self._hook("sample", FaultSite(None, prompt, len(output)))
        return self._sampler(logits, meta)


class _DetokenizerFaults:
    def __init__(self, detokenizer: IncrementalDetokenizer, prompt_token_ids: list[int],
                 hook: Hook) -> None:
        self._detokenizer, self._prompt, self._hook = detokenizer, prompt_token_ids, hook
        self._num_steps = 0

    def step(self, new_token_ids: list[int], finished: bool,
             match_stops: bool = True) -> DetokenizerStep:
        self._hook("detokenize", FaultSite(None, self._prompt, self._num_steps))
        self._num_steps += 1
        return self._detokenizer.step(new_token_ids, finished, match_stops)


def install_fault_hook(core: Any, hook: Hook) -> None:
    """Call `hook(phase, site)` at the core's three seams (see the module docstring).
    Requests added before this call keep their plain detokenizer."""
    runner = core.runner
    runner.sampler = _SamplerFaults(runner.sampler, hook)
    core.runner = _RunnerFaults(runner, core, hook)
    make_detokenizer = core.detokenizer_factory

    def faulty_detokenizer(text: TextDecoder, prompt_token_ids: list[int],
                           params: SamplingParams) -> _DetokenizerFaults:
        inner = make_detokenizer(text, prompt_token_ids, params)
        return _DetokenizerFaults(inner, prompt_token_ids, hook)

    core.detokenizer_factory = faulty_detokenizer


class FaultHook:
    """The `--fault-injection` hook: raises for requests whose prompt carries a marker.

    A prompt's marker is found once (the prompt decoded) and remembered in a bounded LRU
    table keyed by the prompt's tokens."""

    def __init__(self, text: TextDecoder, max_remembered: int = 4096) -> None:
        self._text = text
        self._max_remembered = max_remembered
        self._markers: OrderedDict[tuple[int, ...], tuple[str, int] | None] = OrderedDict()

    def __call__(self, phase: str, site: FaultSite) -> None:
        marker = self._marker(tuple(site.prompt_token_ids))
        if marker is None:
            return
        kind, after = marker
        if kind == "kill":
            raise EngineKilled(f"injected engine death\n{FAKE_FRAME}")
        if kind == phase and site.num_output_tokens >= after:
            raise InjectedFault(f"injected {phase} fault\n{FAKE_FRAME}")

    def _marker(self, prompt: tuple[int, ...]) -> tuple[str, int] | None:
        if prompt in self._markers:
            self._markers.move_to_end(prompt)
            return self._markers[prompt]
        marker = find_marker(self._text.decode(list(prompt)))
        self._markers[prompt] = marker
        if len(self._markers) > self._max_remembered:
            self._markers.popitem(last=False)
        return marker


def arm_engine_faults(core: EngineCore) -> None:
    """Install the marker-driven `FaultHook` on a loaded core; call where the core runs."""
    install_fault_hook(core, FaultHook(core.text))
    logger.warning("FAULT INJECTION IS ON (test-only): engine phases fail for prompts with "
                   "'plait-fault:' markers")
