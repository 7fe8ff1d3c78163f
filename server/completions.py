"""POST /v1/completions: one or more prompts (text or tokens) x n choices, or best_of.

Choice index for prompt p and returned sample k is p * n + k. With `echo`, each choice's
text starts with its prompt; with `echo` + `logprobs` the arrays start with the prompt's
tokens (the first one with null logprobs). `text_offset` counts characters from the start
of the returned text (vLLM's convention; OpenAI counts from the start of the prompt).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plait.engine import StructuredSpec, TokenLogprob
from plait.server.constrained.grammars import answer_spec, build_off_loop
from plait.server.extras import Extras, truncated
from plait.server.fanout import check_num_sequences
from plait.server.generation import Generation, new_completion_id
from plait.server.logprobs import CompletionLogprobs
from plait.server.params import Plan, completion_plan
from plait.server.prompts import Prompt, check_params, completion_prompts, num_prompts
from plait.server.protocol import CompletionRequest, reject_unsupported
from plait.server.routing import ApiRoute
from plait.server.serving import chunk_base, serve_generation, with_tail
from plait.server.sse import encode
from plait.server.state import ReadyDep, ServerState, check_model, request_id_of

router = APIRouter(route_class=ApiRoute)
CHUNK_OBJECT = "text_completion"


async def completion_input(body: CompletionRequest,
                           state: ServerState) -> tuple[Plan, list[Prompt]]:
    """Every check of a completion request, its plan and its prompts' token ids. Called by
    /v1/completions and /v1/completions/render (render.py): one code path."""
    check_model(state, body.model)
    reject_unsupported(body)
    engine = state.engine
    plan = completion_plan(body, await _structured(body))
    check_params(engine, plan.params)
    check_num_sequences(engine, state.settings.max_queued_requests,
                        num_prompts(body.prompt) * plan.num_samples,
                        "best_of" if plan.num_samples > plan.n else "n")
    truncate = (None if body.truncate_prompt_tokens is None else
                functools.partial(truncated, body, max_model_len=engine.info.max_model_len))
    return plan, await completion_prompts(engine, body.prompt, truncate)


async def _structured(body: CompletionRequest) -> StructuredSpec | None:
    """The constraint of `response_format` / `structured_outputs`, built off the loop."""
    if body.response_format is None and body.structured_outputs is None:
        return None
    return await build_off_loop(answer_spec, body.response_format, body.structured_outputs,
                                param="response_format" if body.structured_outputs is None
                                else "structured_outputs")


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request,
                            state: ReadyDep) -> Response:
    plan, prompts = await completion_input(body, state)
    gen = Generation(state, new_completion_id("cmpl"), prompts, plan,
                     keep_output=not body.streaming, log_id=request_id_of(request))
    echo, extras = bool(body.echo), Extras.of(body)
    return await serve_generation(
        request, gen, build=lambda g, _: _response(g, echo, extras),
        stream=(lambda g: with_tail(_stream(g, echo, extras), g, CHUNK_OBJECT,
                                    extras.include_usage)) if body.streaming else None)


def _text_and_logprobs(gen: Generation, prompt: Prompt | None, text: str,
                       logprobs: list[TokenLogprob],
                       prompt_logprobs: list[TokenLogprob | None] | None,
                       offset: int) -> tuple[str, dict[str, Any] | None]:
    """Text of one choice (or one stream chunk) and its logprobs object. `prompt` is set
    when the prompt is echoed here; `offset` is where this text starts in the choice."""
    plan = gen.plan
    if plan.discard_output:
        text, logprobs = "", []
    prefix = prompt.text if prompt is not None else ""
    if plan.logprobs is None:
        return prefix + text, None
    table = gen.state.token_text
    assert table is not None
    arrays = CompletionLogprobs()
    if prompt is not None:
        arrays.add_prompt(table, prompt.token_ids, prompt_logprobs, plan.logprobs)
    arrays.add(table, logprobs, plan.logprobs, offset + len(prefix))
    return prefix + text, arrays.to_dict()


def _response(gen: Generation, echo: bool, extras: Extras) -> dict[str, Any]:
    table = gen.state.token_text
    assert table is not None
    choices = []
    for p, prompt in enumerate(gen.prompts):
        for k, choice in enumerate(gen.prompt_choices(p)):
            result = choice.output
            text, logprobs = _text_and_logprobs(
                gen, prompt if echo else None, result.text, result.logprobs or [],
                result.prompt_logprobs, 0)
            choices.append({"text": text, "index": p * gen.plan.n + k, "logprobs": logprobs,
                            "finish_reason": result.finish_reason,
                            **extras.prompt_logprobs_of(table, result.prompt_logprobs),
                            **extras.token_ids("prompt_token_ids", prompt.token_ids),
                            **extras.token_ids("token_ids", _output_ids(gen, result.token_ids))})
    return {"id": gen.request_id, "object": "text_completion", "created": gen.created,
            "model": gen.state.model_name, "choices": choices, "usage": gen.usage()}


def _output_ids(gen: Generation, token_ids: list[int]) -> list[int]:
    return [] if gen.plan.discard_output else token_ids


async def _stream(gen: Generation, echo: bool, extras: Extras) -> AsyncIterator[bytes]:
    """One chunk per delta; the first chunk of a choice carries the echoed prompt (and its
    "prompt_token_ids" with return_token_ids); exactly one chunk per choice carries its
    finish_reason (streaming never uses best_of). The tail is `with_tail`'s (serving.py)."""
    base = chunk_base(gen, CHUNK_OBJECT)
    emitted: dict[int, int] = {}  # slot -> characters sent so far
    async for choice, delta in gen.deltas():
        first = choice.slot not in emitted
        prompt = gen.prompts[choice.prompt_idx] if echo and first else None
        text, logprobs = _text_and_logprobs(
            gen, prompt, delta.text, delta.logprobs or [], choice.output.prompt_logprobs,
            emitted.get(choice.slot, 0))
        emitted[choice.slot] = emitted.get(choice.slot, 0) + len(text)
        output_ids = _output_ids(gen, delta.token_ids)
        has_tokens = bool(logprobs and logprobs["tokens"]) or (
            extras.return_token_ids and (first or bool(output_ids)))
        if not text and not has_tokens and delta.finish_reason is None:
            continue
        prompt_ids = gen.prompts[choice.prompt_idx].token_ids
        num_tokens = 0 if gen.plan.discard_output else choice.output.num_tokens
        yield encode({**base, "choices": [{
            "text": text, "index": choice.slot, "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            **(extras.token_ids("prompt_token_ids", prompt_ids) if first else {}),
            **extras.token_ids("token_ids", output_ids)}],
            **extras.usage_tail(len(prompt_ids), num_tokens)})
