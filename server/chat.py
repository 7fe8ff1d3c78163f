"""POST /v1/chat/completions: messages -> chat template -> n choices, streamed or not.

Stream of one request (n=2), one choice per chunk, same id/created on every chunk:

    {"index":0,"delta":{"role":"assistant","content":""}}    one per index, first
    {"index":1,"delta":{"role":"assistant","content":""}}
    {"index":1,"delta":{"content":"Hi"}} ...                  interleaved in arrival order
    {"index":0,"delta":{},"finish_reason":"stop"}             exactly one per index
    (tool calls and response_format: constrained/output_plan.py, output_reader.py)
    {"index":0,"delta":{"reasoning_content":"..","reasoning":".."}}  --reasoning-parser:
                                                  <think> text first (reasoning.py)
    {"choices":[],"usage":{...}}                              with include_usage only
    [DONE]                                        (the tail: serving.with_tail)

vLLM's extras (return_token_ids, prompt_logprobs, continuous usage, continue_final_message)
are described in extras.py and prompts.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from plait.engine import TokenLogprob
from plait.server.constrained.output_plan import (
    OutputPlan,
    chat_output_plan,
    render_messages,
)
from plait.server.constrained.output_reader import ChoiceStream, choice_message
from plait.server.extras import Extras, truncated
from plait.server.fanout import check_num_sequences
from plait.server.generation import ChoiceState, Generation, new_completion_id
from plait.server.logprobs import chat_content
from plait.server.params import Plan, chat_plan
from plait.server.prompts import (
    Prompt,
    TemplateInput,
    chat_prompt_ids,
    check_params,
    check_prompt,
    check_text_size,
    message_chars,
    template_flags,
    template_kwargs,
)
from plait.server.protocol import ChatCompletionRequest, reject_unsupported
from plait.server.reasoning import REASONING_TAIL_TOKENS, for_prompt, reasoning_format
from plait.server.routing import ApiRoute
from plait.server.serving import chunk_base, serve_generation, with_tail
from plait.server.sse import encode
from plait.server.state import ReadyDep, ServerState, check_model, request_id_of

router = APIRouter(route_class=ApiRoute)
CHUNK_OBJECT = "chat.completion.chunk"


@dataclass(frozen=True, slots=True)
class ChatInput:
    """A checked chat request: how it runs, how its output is read, its prompt's ids."""

    plan: Plan
    output: OutputPlan
    token_ids: list[int]


async def chat_input(body: ChatCompletionRequest, state: ServerState) -> ChatInput:
    """Every check of a chat request and the token ids the engine gets for it (chat
    template, tools, generation prompt or continued final message). Called by
    /v1/chat/completions and /v1/chat/completions/render (render.py): one code path."""
    check_model(state, body.model)
    reject_unsupported(body)
    engine = state.engine
    template = state.chat_template
    settings = state.settings
    fmt = reasoning_format(settings.reasoning_parser)
    output = await chat_output_plan(body, template, settings.tool_call_parser, fmt)
    plan = chat_plan(body, output.spec, keep_special=output.keep_special)
    check_params(engine, plan.params)
    flags = template_flags(body.messages, body.add_generation_prompt,
                           body.continue_final_message)
    messages = render_messages(body.messages, output)
    check_num_sequences(engine, state.settings.max_queued_requests, plan.num_samples, "n")
    check_text_size(engine, engine.tokenizer, message_chars(messages), "messages")
    token_ids = await chat_prompt_ids(engine.tokenizer, messages, TemplateInput(
        flags, output.template_tools, template, template_kwargs(body.chat_template_kwargs)))
    token_ids = truncated(body, token_ids, engine.info.max_model_len)
    check_prompt(engine, token_ids, "messages")
    if fmt is not None and fmt.starts_inside and \
            (opened := for_prompt(fmt, _tail(engine.tokenizer, token_ids))) != fmt:
        # the template closed the think block itself: the plan reads (and, with a grammar,
        # constrains) the output as starting outside it
        output = await chat_output_plan(body, template, settings.tool_call_parser, opened)
        plan = chat_plan(body, output.spec, keep_special=output.keep_special)
    return ChatInput(plan, output, token_ids)


def _tail(tokenizer: Any, token_ids: list[int]) -> str:
    """The rendered prompt's last few tokens as text, special tokens kept (<think> is one
    in the families that use it)."""
    return str(tokenizer.decode(token_ids[-REASONING_TAIL_TOKENS:], skip_special_tokens=False))


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request,
                                 state: ReadyDep) -> Response:
    checked = await chat_input(body, state)
    extras, output = Extras.of(body), checked.output
    gen = Generation(state, new_completion_id("chatcmpl"), [Prompt(checked.token_ids, "")],
                     checked.plan, keep_output=not body.streaming,
                     log_id=request_id_of(request))
    return await serve_generation(
        request, gen, build=lambda g, choices: _response(g, choices, extras, output),
        stream=(lambda g: with_tail(_stream(g, extras, output), g, CHUNK_OBJECT,
                                    extras.include_usage)) if body.streaming else None)


def _logprobs(gen: Generation, logprobs: list[TokenLogprob]) -> dict[str, Any] | None:
    if gen.plan.logprobs is None:
        return None
    table = gen.state.token_text
    assert table is not None
    return {"content": chat_content(table, logprobs, gen.plan.logprobs), "refusal": None}


def _response(gen: Generation, choices: list[ChoiceState], extras: Extras,
              output: OutputPlan) -> dict[str, Any]:
    table = gen.state.token_text
    assert table is not None
    results = []
    for choice in choices:
        result = choice.output
        message, finish_reason = choice_message(output, result.text, result.finish_reason)
        results.append({"index": choice.slot, "message": message,
                        "logprobs": _logprobs(gen, result.logprobs or []),
                        "finish_reason": finish_reason,
                        **extras.token_ids("token_ids", result.token_ids)})
    return {"id": gen.request_id, "object": "chat.completion", "created": gen.created,
            "model": gen.state.model_name, "choices": results, "usage": gen.usage(),
            **extras.prompt_logprobs_of(table, gen.prompt_logprobs(0)),
            **extras.token_ids("prompt_token_ids", gen.prompts[0].token_ids)}


async def _stream(gen: Generation, extras: Extras,
                  output: OutputPlan) -> AsyncIterator[bytes]:
    """The stream of the module docstring up to its tail (serving.with_tail); with the
    extras (extras.py), each role chunk carries "prompt_token_ids", each other choice chunk
    "token_ids" and "usage". Tool calls are turned into deltas by `ChoiceStream`
    (constrained/output_reader.py); a step's token ids ride on the first chunk it produced
    (on an empty delta when it produced none)."""
    base = chunk_base(gen, CHUNK_OBJECT)
    num_prompt = len(gen.prompts[0].token_ids)

    def chunk(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None = None,
              finish_reason: str | None = None, *, num_tokens: int = 0,
              token_ids: list[int] | None = None, top: dict[str, Any] | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if token_ids is not None:
            choice.update(extras.token_ids("token_ids", token_ids))
        return encode({**base, "choices": [choice],
                       **extras.usage_tail(num_prompt, num_tokens), **(top or {})})

    streams = [ChoiceStream(output) for _ in range(gen.plan.n)]
    prompt_ids = extras.token_ids("prompt_token_ids", gen.prompts[0].token_ids)
    for index in range(gen.plan.n):
        yield chunk(index, streams[index].role_delta(), top=prompt_ids)
    async for choice, delta in gen.deltas():
        stream = streams[choice.slot]
        deltas = stream.feed(delta.text, delta.logprobs or [])
        if not deltas and extras.return_token_ids and delta.token_ids:
            deltas = [({"content": ""} if output.mode == "text" else {}, [])]
        for k, (content, logprobs) in enumerate(deltas):
            yield chunk(choice.slot, content, _logprobs(gen, logprobs),
                        num_tokens=choice.output.num_tokens,
                        token_ids=delta.token_ids if k == 0 else [])
        if delta.finish_reason is not None:
            rest, finish_reason = stream.finish(delta.finish_reason)
            for content, logprobs in rest:
                yield chunk(choice.slot, content, _logprobs(gen, logprobs),
                            num_tokens=choice.output.num_tokens, token_ids=[])
            yield chunk(choice.slot, {}, None, finish_reason,
                        num_tokens=choice.output.num_tokens, token_ids=[])
