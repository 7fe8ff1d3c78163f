"""How a chat request with `tools` / `tool_choice` / `response_format` runs: the output
constraint, how the conversation (tool calls and tool results included) is rendered, and
how the output is read back (output_reader.py).

    tool_choice      constraint (grammar)                 output read as
    none / no tools  response_format's, or none           content
    "required"       calls_schema (a call, or an array)   "json" parser -> tool_calls
    named function   the function's parameters schema     the arguments of one call
    "auto", template the model's own format, unconstrained the family's parser
      renders tools    (call_parsers.detect_parser)
    "auto", other    Lark: plain text | calls_schema      "json" parser
    "auto", either   (as above)                           + bare call JSON (BareCalls)

Templates that render tools (Hermes/Qwen, Llama 3.1+: `tools` in the template) get the
tools, assistant `tool_calls` (arguments as a dict) and `tool` messages as Hugging Face
templates expect them. Other templates (the default SmolLM2's) get a system message that
lists the tools and the call format; a past call is rendered as the JSON the grammar makes,
and consecutive tool results become one user message "Result of <name> (<id>): <content>".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from plait.engine import StructuredSpec
from plait.server.constrained.call_parsers import PARSERS, BareCalls, ToolParser, detect_parser
from plait.server.constrained.grammars import (
    answer_spec,
    auto_spec,
    build_off_loop,
    check_tool_schemas,
    named_spec,
    required_spec,
)
from plait.server.constrained.reasoning_grammar import widened
from plait.server.constrained.request_fields import (
    Tool,
    parse_message_tool_calls,
    parse_tool_choice,
    parse_tools,
)
from plait.server.errors import bad_request
from plait.server.prompts import text_part
from plait.server.protocol import ChatMessage
from plait.server.reasoning import ReasoningFormat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

OutputMode = Literal["text", "named", "calls", "parser"]


class ToolRequest(Protocol):
    """The fields of a chat request that an output plan reads (`ChatCompletionRequest`;
    /tokenize builds one from its `tools` alone)."""

    @property
    def tools(self) -> list[dict[str, Any]] | None: ...
    @property
    def tool_choice(self) -> str | dict[str, Any] | None: ...
    @property
    def parallel_tool_calls(self) -> bool | None: ...
    @property
    def response_format(self) -> dict[str, Any] | None: ...
    @property
    def structured_outputs(self) -> dict[str, Any] | None: ...
_COMPACT = (",", ":")


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """What a chat request's output is constrained to and how it is read back.

    `mode`: "text" (content), "named" (the output is the arguments of `named`), "calls"
    or "parser" (`parser` splits content from calls). `native`: the chat template renders
    tools itself; `template_tools` go to it. `system_text` (non-native only) describes the
    tools and the call format. `forced`: the grammar makes every finished output a call
    (tool_choice required or named). `bare` (tool_choice auto only): reads a whole answer
    that is call JSON without the parser's markers as calls, when the parser found none.
    `reasoning` (--reasoning-parser) splits <think> reasoning off first (reasoning.py);
    it is None under a grammar that binds the output from its first token. `short_ids`: the
    family's template takes back only 9-character alphanumeric call ids (Mistral's raise
    on any other), so the calls get such ids, as vLLM's Mistral parser writes them."""

    mode: OutputMode
    spec: StructuredSpec | None
    tool_names: frozenset[str] = frozenset()
    named: str | None = None
    parser: ToolParser | None = None
    native: bool = False
    template_tools: list[dict[str, Any]] | None = None
    system_text: str | None = None
    forced: bool = False  # required / named: every finished output is a call
    bare: BareCalls | None = None
    reasoning: ReasoningFormat | None = None  # --reasoning-parser
    short_ids: bool = False

    @property
    def keep_special(self) -> bool:
        """The output is read by a parser whose markers are special tokens: decode them."""
        return self.mode == "parser" and self.parser is not None and self.parser.keep_special


async def chat_output_plan(body: ToolRequest, template: str | None,
                           parser_name: str | None = None,
                           reasoning: ReasoningFormat | None = None) -> OutputPlan:
    """`plan_output`, off the event loop when the request has schemas to check. With
    `reasoning`, the plan reads the reasoning off first, and a JSON grammar lets the
    reasoning block come before the JSON (reasoning_grammar.py); a plan with any other
    grammar gets no reasoning."""
    if body.tools is None and body.response_format is None and body.structured_outputs is None:
        plan = plan_output(body, template, parser_name)
        return plan if reasoning is None else replace(plan, reasoning=reasoning)
    param = ("tools" if body.tools is not None else "response_format"
             if body.response_format is not None else "structured_outputs")
    plan = await build_off_loop(plan_output, body, template, parser_name, param=param)
    if reasoning is None:
        return plan
    if plan.spec is None:
        return replace(plan, reasoning=reasoning)
    spec = await build_off_loop(widened, plan.spec, reasoning, param, param=param)
    return plan if spec is None else replace(plan, spec=spec, reasoning=reasoning)


def plan_output(body: ToolRequest, template: str | None,
                parser_name: str | None = None) -> OutputPlan:
    """The request's `OutputPlan`; 400s name the offending parameter. `parser_name`
    (--tool-call-parser) overrides the parser detected from `template`."""
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    if body.structured_outputs is not None and tools and choice != "none":
        raise bad_request("Invalid 'structured_outputs': it cannot be combined with tools.",
                          "structured_outputs", "invalid_value")
    answer = answer_spec(body.response_format, body.structured_outputs)
    parser = detect_parser(template, parser_name)
    native = parser is not None
    template_tools = [t.model_dump(exclude_none=True) for t in tools] if native else None
    # A tool template still shows the tools (as vLLM). (choice is None only without tools.)
    if not tools or choice is None or choice == "none":
        return OutputPlan("text", answer, native=native, template_tools=template_tools)
    short_ids = parser is PARSERS["mistral"]
    check_tool_schemas(tools)
    parallel = body.parallel_tool_calls is not False
    names = frozenset(t.function.name for t in tools)
    if choice != "auto" and answer is not None:
        raise bad_request("Invalid 'response_format': it cannot be combined with "
                          "tool_choice \"required\" or a named function.", "response_format",
                          "invalid_value")
    bare = BareCalls({t.function.name: t.function.parameters_schema for t in tools}, parallel)
    if native and choice == "auto" and answer is None:
        return OutputPlan("parser", None, names, parser=parser, native=True,
                          template_tools=template_tools, bare=bare, short_ids=short_ids)
    shared: dict[str, Any] = {
        "native": native, "template_tools": template_tools, "short_ids": short_ids,
        "system_text": None if native else _system_text(tools, choice, parallel)}
    if choice == "required":
        return OutputPlan("calls", required_spec(tools, parallel), names,
                          parser=PARSERS["json"], forced=True, **shared)
    if choice != "auto":  # a named function
        return OutputPlan("named", named_spec(tools, choice), names, named=choice,
                          forced=True, **shared)
    return OutputPlan("calls", auto_spec(tools, parallel, answer), names,
                      parser=PARSERS["json"], bare=bare, **shared)


def _system_text(tools: list[Tool], choice: str, parallel: bool) -> str:
    listing = "\n".join(json.dumps({"name": t.function.name,
                                    "description": t.function.description or "",
                                    "parameters": t.function.parameters_schema},
                                   ensure_ascii=False) for t in tools)
    call = '{"name": <function name>, "arguments": <arguments object>}'
    several = " (or a JSON array of such objects to call several)" if parallel else ""
    if choice == "auto":
        how = (f"To call a function, answer with only a JSON object {call}{several}. "
               "Otherwise answer in plain text.")
    elif choice == "required":
        how = f"Call one of them: answer with only a JSON object {call}{several}."
    else:
        how = f"Call the function {json.dumps(choice)}: answer with only its arguments object."
    return f"You can call these functions:\n{listing}\n{how}"


# ------------------------------------------------------------------ conversation
def _text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(text_part(part, i, j) for j, part in enumerate(content))
    return content


def conversation_plan(template: str | None, parser_name: str | None = None) -> OutputPlan:
    """The plan of a conversation rendered with no tools to call (/tokenize): tool results
    and assistant tool calls render exactly as in a chat request to the same model."""
    return OutputPlan("text", None, native=detect_parser(template, parser_name) is not None)


def render_messages(messages: list[ChatMessage], plan: OutputPlan) -> list[dict[str, Any]]:
    """Template-ready messages with tool calls and results (see the module docstring)."""
    result: list[dict[str, Any]] = []
    names_by_id: dict[str, str] = {}
    pending_results: list[str] = []
    for i, message in enumerate(messages):
        _check_message(message, i)
        if message.role == "tool":
            content, call_id = _text(message, i), message.tool_call_id or ""
            name = names_by_id.get(call_id, "")
            if plan.native:
                result.append({"role": "tool", "tool_call_id": call_id, "name": name,
                               "content": content})
            else:
                pending_results.append(f"Result of {name or 'the call'} ({call_id}): {content}")
            continue
        if pending_results:
            result.append({"role": "user", "content": "\n".join(pending_results)})
            pending_results = []
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _text(message, i)}
        if message.name is not None:
            entry["name"] = message.name
        reasoning = (message.reasoning_content if message.reasoning_content is not None
                     else message.reasoning)
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        if message.tool_calls:
            calls = parse_message_tool_calls(message.tool_calls, i)
            names_by_id.update((call.id, call.function.name) for call, _ in calls)
            _add_calls(entry, calls, plan.native)
        result.append(entry)
    if pending_results:
        result.append({"role": "user", "content": "\n".join(pending_results)})
    if plan.system_text is not None:
        _add_system(result, plan.system_text)
    return result


def _check_message(message: ChatMessage, i: int) -> None:
    if message.role == "tool" and message.tool_call_id is None:
        raise bad_request(f"Missing required parameter: 'messages.[{i}].tool_call_id'.",
                          f"messages.[{i}].tool_call_id", "missing_required_parameter")
    if message.role != "tool" and message.tool_call_id is not None:
        raise bad_request(f"Invalid 'messages.[{i}].tool_call_id': only messages with role "
                          "'tool' have one.", f"messages.[{i}].tool_call_id", "invalid_value")
    for name in ("reasoning_content", "reasoning"):
        if getattr(message, name) is not None and message.role != "assistant":
            raise bad_request(f"Invalid 'messages.[{i}].{name}': only messages with role "
                              "'assistant' have one.", f"messages.[{i}].{name}", "invalid_value")
    if message.tool_calls is not None and message.role != "assistant":
        raise bad_request(f"Invalid 'messages.[{i}].tool_calls': only messages with role "
                          "'assistant' have them.", f"messages.[{i}].tool_calls",
                          "invalid_value")
    if message.content is None and not (message.role == "assistant" and message.tool_calls):
        raise bad_request(f"Invalid value for 'messages.[{i}].content': expected a string "
                          "or an array of text parts, but got null instead.",
                          f"messages.[{i}].content", "invalid_value")


def _add_calls(entry: dict[str, Any], calls: list[Any], native: bool) -> None:
    if native:
        entry["tool_calls"] = [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name, "arguments": args}}
                               for call, args in calls]
        return
    objects = [{"name": call.function.name, "arguments": args} for call, args in calls]
    text = json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False,
                      separators=_COMPACT)
    entry["content"] = f"{entry['content']}\n{text}" if entry["content"] else text


def _add_system(messages: list[dict[str, Any]], text: str) -> None:
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
    else:
        messages.insert(0, {"role": "system", "content": text})


def chat_template(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The tokenizer's chat template source (None when it has none, or several)."""
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None
