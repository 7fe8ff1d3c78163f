"""Offline API: `LLM(model).generate(prompts, SamplingParams(n=...))`.

`n` is fanned out into n independent engine sub-requests (choice i gets seed + i when a
seed is given), exactly as the HTTP server does; the engine shares their prompt's prefill.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from plait.engine.config import EngineConfig
from plait.engine.core import EngineCore
from plait.engine.outputs import CompletionOutput, RequestDelta, RequestOutput
from plait.engine.sampling_params import SamplingParams
from plait.engine.validation import validate_request

PromptInput = str | Sequence[int]


class LLM:
    """Synchronous engine for scripts and tests. `model=None` is the embedded default."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run every prompt's n choices to completion; one `RequestOutput` per prompt."""
        params = params or SamplingParams()
        batch = self._normalize(prompts)
        pending: dict[str, tuple[RequestOutput, CompletionOutput]] = {}
        try:
            return self._run(batch, params, pending)
        except BaseException:
            for request_id in pending:  # leave nothing of this call behind in the engine
                self.engine.abort(request_id)
            raise

    def _run(self, batch, params: SamplingParams, pending) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for _, token_ids in batch:
            validate_request(self.engine.info, token_ids, params)
        for text, token_ids in batch:
            result = RequestOutput(text, token_ids, [])
            outputs.append(result)
            for index in range(params.n):
                request_id = f"offline-{next(self._ids)}"
                choice = CompletionOutput(index, [], "", None, cumulative_logprob=None)
                result.outputs.append(choice)
                self.engine.add_request(request_id, token_ids, params.for_choice(index))
                pending[request_id] = (result, choice)
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                self._apply(delta, pending)
        return outputs

    def _normalize(self, prompts: PromptInput | Sequence[PromptInput]):
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        batch = []
        for prompt in prompts:  # type: ignore[union-attr]
            if isinstance(prompt, str):
                batch.append((prompt, self.tokenizer.encode(prompt)))
            else:
                batch.append((None, list(prompt)))
        return batch

    def _apply(self, delta: RequestDelta, pending) -> None:
        result, choice = pending[delta.request_id]
        choice.token_ids.extend(delta.token_ids)
        choice.text += delta.text
        choice.num_cached_tokens = delta.num_cached_tokens
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
            choice.cumulative_logprob = sum(lp.logprob for lp in choice.logprobs)
        if delta.prompt_logprobs is not None and result.prompt_logprobs is None:
            result.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.error is not None:
                raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
            del pending[delta.request_id]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()
