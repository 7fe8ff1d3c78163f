"""Offline API: `LLM(model).generate(prompts, SamplingParams(n=...))`.

`n` is fanned out into n independent engine sub-requests (choice i gets seed + i when a
seed is given), exactly as the HTTP server does; the engine shares their prompt's prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from plait.engine.config import EngineConfig
from plait.engine.core import EngineCore
from plait.engine.core_api import EngineStats
from plait.engine.outputs import ChoiceAccumulator, RequestOutput
from plait.engine.sampling_params import SamplingParams
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.validation import validate_request

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PromptInput = str | Sequence[int]


class LLM:
    """Synchronous engine for scripts and tests. `model=None` is the embedded default."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """`engine_options`: EngineConfig's fields; `speculative_config` may also be given
        as `--speculative-config`'s text (JSON or a method name) or a dict of its fields."""
        spec = engine_options.get("speculative_config")
        if isinstance(spec, str):
            engine_options["speculative_config"] = SpeculativeConfig.parse(spec)
        elif isinstance(spec, dict):
            engine_options["speculative_config"] = SpeculativeConfig.from_dict(spec)
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt's n choices to completion; one `RequestOutput` per prompt."""
        params = params or SamplingParams()
        batch = self._normalize(prompts)
        for _, token_ids in batch:
            validate_request(self.engine.info, token_ids, params)
        choices: list[list[ChoiceAccumulator]] = [
            [ChoiceAccumulator() for _ in range(params.n)] for _ in batch]
        pending: dict[str, ChoiceAccumulator] = {}
        try:
            for (_, token_ids), prompt_choices in zip(batch, choices, strict=True):
                for index, choice in enumerate(prompt_choices):
                    request_id = f"offline-{next(self._ids)}"
                    pending[request_id] = choice
                    self.engine.add_request(request_id, token_ids, params.for_choice(index))
            self._run(pending)
        except BaseException:
            for request_id in pending:  # leave nothing of this call behind in the engine
                self.engine.abort(request_id)
            raise
        return [_request_output(text, token_ids, prompt_choices)
                for (text, token_ids), prompt_choices in zip(batch, choices, strict=True)]

    def _run(self, pending: dict[str, ChoiceAccumulator]) -> None:
        """Step the engine until it is idle; each finished request leaves `pending`."""
        while self.engine.has_unfinished():
            for delta in self.engine.step().deltas:
                choice = pending[delta.request_id]
                choice.add(delta)
                if delta.finished:
                    if delta.error is not None:
                        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                    del pending[delta.request_id]

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]
                   ) -> list[tuple[str | None, list[int]]]:
        batch: list[tuple[str | None, list[int]]] = []
        for prompt in [prompts] if _one_prompt(prompts) else prompts:
            if isinstance(prompt, str):
                batch.append((prompt, self.tokenizer.encode(prompt)))
            else:
                batch.append((None, list(prompt)))
        return batch

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _request_output(text: str | None, token_ids: list[int],
                    choices: list[ChoiceAccumulator]) -> RequestOutput:
    """One prompt's finished choices; every choice of a prompt gets the same prompt
    logprobs (the first that arrived)."""
    prompt_logprobs = next((c.prompt_logprobs for c in choices
                            if c.prompt_logprobs is not None), None)
    return RequestOutput(text, token_ids, [c.to_output(i) for i, c in enumerate(choices)],
                         prompt_logprobs)


def _one_prompt(prompts: PromptInput | Sequence[PromptInput]) -> TypeIs[PromptInput]:
    """One prompt (a text or its token ids), not a batch of them."""
    return isinstance(prompts, str) or (bool(prompts) and isinstance(prompts[0], int))
