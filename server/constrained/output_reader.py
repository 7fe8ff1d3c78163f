"""A choice's generated text -> its chat message (content and/or tool_calls), whole or as a
stream of OpenAI deltas.

Non-streaming: `choice_message`. Streaming: one `ChoiceStream` per choice index:

    named function   {"tool_calls":[{"index":0,"id":..,"type":"function",
                                      "function":{"name":..,"arguments":"<first text>"}}]}
                     then {"tool_calls":[{"index":0,"function":{"arguments":"<more>"}}]}
    calls / parser   content streams as it comes until a call could start (a marker, or
                     its first characters, is held back); from there the text is buffered
                     and, at the end, each parsed call is one delta
                     {"tool_calls":[{"index":k,"id":..,"type":..,"function":{name, arguments}}]}
                     (malformed calls: the buffered text goes out as content instead)
    bare call JSON   tool_choice auto (plan.bare): while the answer so far could still be
                     a whole-answer call without markers (it starts with "{", "[" or a
                     ``` fence: BareCalls.possible) nothing is sent; once it cannot, the
                     held text goes out and the above applies; at the end, the calls as
                     above, or the held text as content. Other text is never held.

With a reasoning parser (plan.reasoning) the text is first split by reasoning.py: the
reasoning goes out as {"reasoning_content": .., "reasoning": ..} deltas (and message
fields), and only the text after </think> is read as above.

A choice whose calls were parsed and which stopped naturally ends with finish_reason
"tool_calls"; a length cut stays "length". Logprobs of held-back text go out with the next
delta that is sent.
"""

from __future__ import annotations

import secrets
import string
import uuid
from typing import Any

from plait.engine import TokenLogprob
from plait.server.constrained.call_parsers import ParsedCall, ParsedOutput
from plait.server.constrained.output_plan import OutputPlan
from plait.server.reasoning import ReasoningSplitter, Split, split_reasoning

Delta = tuple[dict[str, Any], list[TokenLogprob]]


_ALNUM = string.ascii_letters + string.digits


def new_call_id(short: bool = False) -> str:
    """A tool call's id: OpenAI's form, `call_` + 24 hex digits; `short` (OutputPlan.short_ids):
    9 letters and digits, the only ids Mistral's chat templates take back."""
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_dict(call: ParsedCall, plan: OutputPlan) -> dict[str, Any]:
    return {"id": new_call_id(plan.short_ids), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def parse_output(plan: OutputPlan, text: str, finish_reason: str | None) -> ParsedOutput:
    """Content and calls of a finished choice's text under `plan`. Bare call JSON
    (plan.bare) is tried last, and only on an answer that ended naturally ("stop"): one cut
    by length is not known to be whole."""
    if plan.mode == "named":
        assert plan.named is not None
        return ParsedOutput(None, [ParsedCall(plan.named, text)])
    if plan.parser is None:
        return ParsedOutput(text, [])
    parsed = plan.parser.parse(text, plan.tool_names)
    if parsed.calls or plan.bare is None or finish_reason != "stop":
        return parsed
    calls = plan.bare.parse(text)
    return ParsedOutput(None, calls) if calls else parsed


def _finish(parsed: ParsedOutput, finish_reason: str | None) -> str | None:
    return "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason


def choice_message(plan: OutputPlan, text: str,
                   finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The `message` of a finished choice and its finish_reason. With a reasoning parser
    the message has `reasoning_content` and `reasoning` (the same text; None without
    reasoning) and the rest of the text is read as without one (an empty rest after
    reasoning: content null)."""
    if plan.reasoning is None:
        return _answer_message(plan, text, finish_reason)
    reasoning, rest = split_reasoning(plan.reasoning, text)
    message, finish_reason = _answer_message(plan, rest, finish_reason)
    if reasoning is not None and not rest:
        message["content"] = None
    return {**message, **reasoning_fields(reasoning)}, finish_reason


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's (or a delta's) reasoning under both names vLLM has written."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def _answer_message(plan: OutputPlan, text: str,
                    finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    parsed = parse_output(plan, text, finish_reason)
    if not parsed.calls:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    return ({"role": "assistant", "content": parsed.content, "refusal": None,
             "tool_calls": [_call_dict(c, plan) for c in parsed.calls]},
            _finish(parsed, finish_reason))


class ChoiceStream:
    """Turns one choice's text deltas into chat deltas (see the module docstring)."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self._text = ""  # everything generated so far
        self._sent = 0  # characters of `_text` sent as content
        self._calls = plan.forced and plan.mode == "calls"  # buffering a call
        self._named_id: str | None = None
        self._held: list[TokenLogprob] = []
        self._bare = plan.bare is not None  # holding: the answer may be bare call JSON
        self._splitter = None if plan.reasoning is None else ReasoningSplitter(plan.reasoning)
        self._reasoning_lps: list[TokenLogprob] = []  # logprobs not yet sent, reasoning on

    def role_delta(self) -> dict[str, Any]:
        """The first delta of the choice; content stays null until text is known to be
        content (a tool-call-only message has content null, as OpenAI's)."""
        return {"role": "assistant", "content": "" if self.plan.mode == "text" else None}

    def feed(self, text: str, logprobs: list[TokenLogprob]) -> list[Delta]:
        """Deltas to send for newly generated `text` (and its logprobs)."""
        if self._splitter is None:
            return self._feed(text, logprobs)
        self._reasoning_lps.extend(logprobs)
        return self._split_deltas(self._splitter.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        """Deltas still to send once the choice finished, and its finish_reason."""
        if self._splitter is None:
            return self._finish_answer(finish_reason)
        deltas = self._split_deltas(self._splitter.finish())
        if self._reasoning_lps and self.plan.mode == "text":
            deltas.append(({"content": ""}, self._take_reasoning_lps()))
        self._held.extend(self._take_reasoning_lps())
        rest, finish_reason = self._finish_answer(finish_reason)
        return deltas + rest, finish_reason

    def _split_deltas(self, split: Split) -> list[Delta]:
        """Reasoning deltas, then the rest fed on as the answer; the logprobs go with the
        answer's delta when there is one, else with the reasoning's."""
        deltas: list[Delta] = []
        if split.reasoning:
            lps = [] if split.rest else self._take_reasoning_lps()
            deltas.append((reasoning_fields(split.reasoning), lps))
        if split.rest:
            deltas += self._feed(split.rest, self._take_reasoning_lps())
        return deltas

    def _take_reasoning_lps(self) -> list[TokenLogprob]:
        held, self._reasoning_lps = self._reasoning_lps, []
        return held

    def _feed(self, text: str, logprobs: list[TokenLogprob]) -> list[Delta]:
        if self.plan.mode == "text":
            return [({"content": text}, logprobs)] if text or logprobs else []
        self._held.extend(logprobs)
        self._text += text
        if self.plan.mode == "named":
            return self._named(text) if text else []
        if self._calls:
            return []
        if self._bare:
            assert self.plan.bare is not None
            if self.plan.bare.possible(self._text):
                return []
            self._bare = False
        return self._content(self._sendable())

    def _finish_answer(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        if self.plan.mode == "text":
            return [], finish_reason
        if self.plan.mode == "named":
            deltas = self._named("") if self._named_id is None or self._held else []
            return deltas, _finish(parse_output(self.plan, self._text, finish_reason),
                                   finish_reason)
        parsed = parse_output(self.plan, self._text, finish_reason)
        if not parsed.calls:
            return self._content(len(self._text)), finish_reason
        deltas = self._content(len(parsed.content or ""))
        for k, call in enumerate(parsed.calls):
            entry = {"index": k, **_call_dict(call, self.plan)}
            deltas.append(({"tool_calls": [entry]}, self._take_logprobs()))
        return deltas, _finish(parsed, finish_reason)

    # ---------------------------------------------------------------- helpers
    def _take_logprobs(self) -> list[TokenLogprob]:
        held, self._held = self._held, []
        return held

    def _named(self, text: str) -> list[Delta]:
        if self._named_id is None:
            self._named_id = new_call_id(self.plan.short_ids)
            entry = {"index": 0, "id": self._named_id, "type": "function",
                     "function": {"name": self.plan.named, "arguments": text}}
        else:
            entry = {"index": 0, "function": {"arguments": text}}
        return [({"tool_calls": [entry]}, self._take_logprobs())]

    def _content(self, upto: int) -> list[Delta]:
        """Send `_text[_sent:upto]` as content (with the held logprobs)."""
        if upto <= self._sent and not (self._held and upto == len(self._text)):
            return []
        piece, self._sent = self._text[self._sent:upto], max(self._sent, upto)
        return [({"content": piece}, self._take_logprobs())]

    def _sendable(self) -> int:
        """How far the text can go out as content; switches to buffering at a call.
        Whitespace alone is held back: before a call it is not content (null, as in the
        whole message)."""
        upto = self._call_free()
        return upto if self._text[self._sent:upto].strip() else self._sent

    def _call_free(self) -> int:
        parser = self.plan.parser
        assert parser is not None
        text = self._text
        if parser.at_start:  # the first non-space characters decide: call or text
            head = text.lstrip()
            if any(head.startswith(m) for m in parser.markers):
                self._calls = True
                return self._sent
            if not head or any(m.startswith(head) for m in parser.markers):
                return self._sent  # not decided yet
            return len(text)
        for marker in parser.markers:
            idx = text.find(marker, self._sent)
            if idx >= 0:
                self._calls = True
                return idx
        hold = max((k for m in parser.markers for k in range(1, len(m))
                    if text.endswith(m[:k])), default=0)
        return len(text) - hold
