"""The Responses objects: output items from a finished choice, usage, the response itself.

    choice text --output_reader.choice_message--> content + tool_calls
        content (or no calls)   {"type": "message", "id": "msg_..", "role": "assistant",
                                 "status", "content": [{"type": "output_text", "text",
                                 "annotations": [], "logprobs": [...]}]}
        each call               {"type": "function_call", "id": "fc_..", "call_id": "call_..",
                                 "name", "arguments", "status"}
        reasoning (first; with  {"type": "reasoning", "id": "rs_..", "summary": [], "status",
        --reasoning-parser)      "content": [{"type": "reasoning_text", "text"}]}

An item's `status` is its own: the item a length cut ended is "incomplete", never
"completed". The response is "failed" after an engine error, "incomplete" (reason
"max_output_tokens") when any choice was cut, else "completed".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.engine import TokenLogprob
from plait.server.constrained.output_plan import OutputPlan
from plait.server.constrained.output_reader import choice_message
from plait.server.generation import ChoiceState, Generation
from plait.server.logprobs import chat_content
from plait.server.responses.protocol import ResponsesRequest
from plait.server.responses.store import ResponseStore
from plait.server.responses.translate import Item, new_item_id, reasoning_item

DEFAULT_TEXT = {"format": {"type": "text"}, "verbosity": "medium"}


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def message_item(status: str = "in_progress", text: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> Item:
    """An assistant message; with `text`, its one output_text part."""
    content = [] if text is None else [text_part(text, logprobs)]
    return {"id": new_item_id("msg"), "type": "message", "role": "assistant",
            "status": status, "content": content}


def text_part(text: str = "", logprobs: list[dict[str, Any]] | None = None) -> Item:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call_id: str, name: str, arguments: str = "",
              status: str = "in_progress") -> Item:
    return {"id": new_item_id("fc"), "type": "function_call", "call_id": call_id,
            "name": name, "arguments": arguments, "status": status}


@dataclass(slots=True)
class ResponseContext:
    """One request's response, apart from its `Generation`: echoed settings, how output is
    read (`plan`), how many top logprobs to return (None: no logprobs), its conversation
    (`history`: earlier turns; `input_items`: this request's) and where it is stored."""

    body: ResponsesRequest
    response_id: str
    model: str
    plan: OutputPlan
    num_top_logprobs: int | None
    input_items: list[Item]
    history: list[Item]
    store: ResponseStore

    def logprobs(self, gen: Generation, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
        if self.num_top_logprobs is None or not logprobs:
            return []
        table = gen.state.token_text
        assert table is not None
        return chat_content(table, logprobs, self.num_top_logprobs)

    def choice_items(self, gen: Generation, choice: ChoiceState) -> list[Item]:
        """The output items of a finished non-streamed choice."""
        result = choice.output
        message, _ = choice_message(self.plan, result.text, result.finish_reason)
        calls = message.get("tool_calls") or []
        items = []
        if message.get("reasoning_content") is not None:
            items.append(reasoning_item(message["reasoning_content"]))
        if message["content"] is not None or not calls:
            items.append(message_item("completed", message["content"] or "",
                                      self.logprobs(gen, result.logprobs or [])))
        items.extend(call_item(c["id"], c["function"]["name"], c["function"]["arguments"],
                               "completed") for c in calls)
        items[-1]["status"] = item_status(result.finish_reason)
        return items

    def snapshot(self, created_at: int, status: str, output: list[Item],
                 usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object with the request's settings echoed."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        response: dict[str, Any] = {
            "id": self.response_id, "object": "response", "created_at": created_at,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
            "store": body.stored,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {**DEFAULT_TEXT, **(body.text or {})},
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": body.tools or [], "top_logprobs": body.top_logprobs or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled",
            "usage": usage, "user": body.user, "metadata": body.metadata or {}}
        if body.n is not None:
            response["n"] = body.n
        return response

    def finish(self, gen: Generation, output: list[Item],
               error: str | None = None) -> dict[str, Any]:
        """The final response (stored unless `store` is false)."""
        if error is not None:
            status = "failed"
            for item in output:
                if item["status"] == "in_progress":
                    item["status"] = "incomplete"
        elif any(c.output.finish_reason == "length" for c in gen.choices.values()):
            status = "incomplete"
        else:
            status = "completed"
        failure = None if error is None else {"code": "server_error", "message": error}
        response = self.snapshot(gen.created, status, output, usage(gen), failure)
        if self.body.stored:
            continued = output if gen.plan.n == 1 else output[:1]
            self.store.put(response, self.input_items,
                           [*self.history, *self.input_items, *continued])
        return response

    def complete(self, gen: Generation, choices: list[ChoiceState]) -> dict[str, Any]:
        """The non-streamed response."""
        output = [item for choice in choices for item in self.choice_items(gen, choice)]
        return self.finish(gen, output)


def usage(gen: Generation) -> dict[str, Any]:
    """Chat's usage in the Responses names."""
    chat = gen.usage()
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}
