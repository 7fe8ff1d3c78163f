"""`stream: true`: chat deltas (output_reader.ChoiceStream, as chat streams them) -> the
Responses events, each framed `event: <type>\\ndata: <json>\\n\\n`:

    response.created, response.in_progress                 status in_progress, no output
    per message item (output_index k, in the order added):
      response.output_item.added    response.content_part.added
      response.output_text.delta ...                          interleaved across items (n>1)
      response.output_text.done     response.content_part.done    response.output_item.done
    per function_call item:
      response.output_item.added    response.function_call_arguments.delta ...
      response.function_call_arguments.done                   response.output_item.done
    exactly one of response.completed / response.incomplete / response.failed (the full
    response with output and usage); an engine error first sends an `error` event.

    per reasoning item (--reasoning-parser; before the choice's message or calls):
      response.output_item.added    response.content_part.added (a reasoning_text part)
      response.reasoning_text.delta ...
      response.reasoning_text.done  response.content_part.done    response.output_item.done

`sequence_number` counts every event from 0. Text output (n >= 1) adds one message item per
choice up front, so choice k is output_index k; with tools (n = 1) or a reasoning parser
items are added as the model writes them. An item's `.done` events carry its own final
status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from plait.engine import TokenLogprob
from plait.server.constrained.output_reader import ChoiceStream
from plait.server.generation import Generation, GenerationError
from plait.server.responses.objects import (
    ResponseContext,
    call_item,
    item_status,
    message_item,
    text_part,
)
from plait.server.responses.translate import Item, reasoning_item
from plait.server.sse import event_json


class EventLog:
    """Frames events with increasing sequence numbers; owns the output list (items are
    updated in place as their deltas arrive, so the final response reuses them)."""

    def __init__(self) -> None:
        self.num_events = 0
        self.output: list[Item] = []

    def frame(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return f"event: {kind}\ndata: {event_json(payload)}\n\n".encode()


class ItemWriter:
    """One choice's items: feeds its text through chat's `ChoiceStream` and turns each
    chat delta into Responses events."""

    def __init__(self, log: EventLog, ctx: ResponseContext, gen: Generation) -> None:
        self.log, self.ctx, self.gen = log, ctx, gen
        self.chat = ChoiceStream(ctx.plan)
        self.message_idx: int | None = None  # output_index of the open message
        self.reasoning_idx: int | None = None  # output_index of the open reasoning item
        self.num_messages = 0  # message items opened so far
        self.call_idx: dict[int, int] = {}  # chat tool_calls index -> output_index (open)

    def open_message(self) -> list[bytes]:
        self.num_messages += 1
        idx = len(self.log.output)
        item = message_item()
        self.log.output.append(item)
        self.message_idx = idx
        added = self.log.frame("response.output_item.added", output_index=idx, item=item)
        part = text_part()
        item["content"].append(part)  # after framing: the added item has no part yet
        return [added, self.log.frame("response.content_part.added", item_id=item["id"],
                                      output_index=idx, content_index=0, part=part)]

    def feed(self, text: str, logprobs: list[TokenLogprob]) -> list[bytes]:
        frames: list[bytes] = []
        for delta, lps in self.chat.feed(text, logprobs):
            frames += self._delta(delta, lps)
        return frames

    def finish(self, finish_reason: str) -> list[bytes]:
        rest, _ = self.chat.finish(finish_reason)
        frames: list[bytes] = []
        for delta, lps in rest:
            frames += self._delta(delta, lps)
        status = item_status(finish_reason)
        if self.reasoning_idx is not None:
            frames += self._close_reasoning(status)
        if not self.num_messages and not self.call_idx and self.ctx.plan.mode == "text":
            frames += self.open_message()  # (a reasoning plan opens it lazily) as whole
        if self.message_idx is not None:
            frames += self._close_message(status)
        for idx in self.call_idx.values():
            frames += self._close_call(idx, status)
        self.call_idx = {}
        return frames

    def _delta(self, delta: dict[str, Any], logprobs: list[TokenLogprob]) -> list[bytes]:
        frames: list[bytes] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self.reasoning_idx is None:
                frames += self._open_reasoning()
            frames.append(self._reasoning_delta(reasoning))
            return frames
        if self.reasoning_idx is not None and (delta.get("content") or delta.get("tool_calls")):
            frames += self._close_reasoning("completed")
        content = delta.get("content")
        if content or (content is not None and logprobs):
            if self.message_idx is None:
                frames += self.open_message()
            frames.append(self._text_delta(content, self.ctx.logprobs(self.gen, logprobs)))
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                if self.message_idx is not None:
                    frames += self._close_message("completed")
                frames += self._open_call(call)
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                idx = self.call_idx[call["index"]]
                item = self.log.output[idx]
                item["arguments"] += arguments
                frames.append(self.log.frame("response.function_call_arguments.delta",
                                             item_id=item["id"], output_index=idx,
                                             delta=arguments))
        return frames

    def _open_reasoning(self) -> list[bytes]:
        idx = len(self.log.output)
        item = reasoning_item("", status="in_progress")
        part = item["content"].pop()
        self.log.output.append(item)
        self.reasoning_idx = idx
        added = self.log.frame("response.output_item.added", output_index=idx, item=item)
        item["content"].append(part)  # after framing: the added item has no part yet
        return [added, self.log.frame("response.content_part.added", item_id=item["id"],
                                      output_index=idx, content_index=0, part=part)]

    def _reasoning_delta(self, text: str) -> bytes:
        assert self.reasoning_idx is not None
        item = self.log.output[self.reasoning_idx]
        item["content"][0]["text"] += text
        return self.log.frame("response.reasoning_text.delta", item_id=item["id"],
                              output_index=self.reasoning_idx, content_index=0, delta=text)

    def _close_reasoning(self, status: str) -> list[bytes]:
        assert self.reasoning_idx is not None
        idx, self.reasoning_idx = self.reasoning_idx, None
        item = self.log.output[idx]
        part = item["content"][0]
        item["status"] = status
        return [self.log.frame("response.reasoning_text.done", item_id=item["id"],
                               output_index=idx, content_index=0, text=part["text"]),
                self.log.frame("response.content_part.done", item_id=item["id"],
                               output_index=idx, content_index=0, part=part),
                self.log.frame("response.output_item.done", output_index=idx, item=item)]

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        assert self.message_idx is not None
        item = self.log.output[self.message_idx]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"].extend(logprobs)
        return self.log.frame("response.output_text.delta", item_id=item["id"],
                              output_index=self.message_idx, content_index=0, delta=text,
                              logprobs=logprobs)

    def _close_message(self, status: str) -> list[bytes]:
        assert self.message_idx is not None
        idx, self.message_idx = self.message_idx, None
        item = self.log.output[idx]
        part = item["content"][0]
        item["status"] = status
        return [self.log.frame("response.output_text.done", item_id=item["id"],
                               output_index=idx, content_index=0, text=part["text"],
                               logprobs=part["logprobs"]),
                self.log.frame("response.content_part.done", item_id=item["id"],
                               output_index=idx, content_index=0, part=part),
                self.log.frame("response.output_item.done", output_index=idx, item=item)]

    def _open_call(self, call: dict[str, Any]) -> list[bytes]:
        idx = len(self.log.output)
        item = call_item(call["id"], call["function"]["name"])
        self.log.output.append(item)
        self.call_idx[call["index"]] = idx
        return [self.log.frame("response.output_item.added", output_index=idx, item=item)]

    def _close_call(self, idx: int, status: str) -> list[bytes]:
        item = self.log.output[idx]
        item["status"] = status
        return [self.log.frame("response.function_call_arguments.done", item_id=item["id"],
                               output_index=idx, name=item["name"],
                               arguments=item["arguments"]),
                self.log.frame("response.output_item.done", output_index=idx, item=item)]


async def response_events(gen: Generation, ctx: ResponseContext) -> AsyncIterator[bytes]:
    """The whole event stream of one response (see the module docstring)."""
    log = EventLog()
    start = ctx.snapshot(gen.created, "in_progress", [])
    yield log.frame("response.created", response=start)
    yield log.frame("response.in_progress", response=start)
    writers = [ItemWriter(log, ctx, gen) for _ in range(gen.plan.n)]
    if ctx.plan.mode == "text" and ctx.plan.reasoning is None:
        for writer in writers:
            for frame in writer.open_message():
                yield frame
    try:
        async for choice, delta in gen.deltas():
            writer = writers[choice.slot]
            frames = writer.feed(delta.text, delta.logprobs or [])
            if delta.finish_reason is not None:
                frames += writer.finish(delta.finish_reason)
            for frame in frames:
                yield frame
    except GenerationError as exc:
        yield log.frame("error", code="server_error", message=str(exc), param=None)
        final = ctx.finish(gen, log.output, error=str(exc))
        yield log.frame("response.failed", response=final)
        return
    final = ctx.finish(gen, log.output)
    yield log.frame(f"response.{final['status']}", response=final)
