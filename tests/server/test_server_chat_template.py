"""--chat-template and chat_template_kwargs: a model without a template serves completions
and answers chat with a 400 saying why; --chat-template (a file or inline) renders chats,
/tokenize and /render; chat_template_kwargs reach the template; the flag's value is read
and checked at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.scripted_text import TextCore, scripted_client
from helpers.server import MODEL, error_of, start_server

from plait.cli import build_parser, main, server_settings
from plait.engine.model_loader import load_tokenizer
from plait.server.prompts import RESERVED_TEMPLATE_KWARGS
from plait.server.settings import ServerSettings
from plait.server.template_source import read_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]
# A template of our own: thinking on unless the request turns it off.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>"
            "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
            "{% endif %}{% endif %}")


@pytest.fixture
def bare_tokenizer(default_model):
    tokenizer = load_tokenizer(default_model.path)
    tokenizer.chat_template = None  # a base model's tokenizer: no template
    return tokenizer


def chat(messages=MESSAGES, **fields) -> dict:
    return {"model": "scripted-model", "messages": messages, "max_tokens": 4, **fields}


def test_a_model_without_a_template_refuses_chat_and_serves_completions(bare_tokenizer):
    core = TextCore(bare_tokenizer, [" fine"])
    with scripted_client(core) as http:
        for path, body in (("/v1/chat/completions", chat()),
                           ("/v1/chat/completions/render", chat()),
                           ("/tokenize", {"messages": MESSAGES})):
            error = error_of(http.post(path, json=body), 400)
            assert error == {
                "message": "This model has no chat template, so it cannot serve chat "
                           "messages. Start the server with --chat-template, or send a "
                           "prompt to /v1/completions.",
                "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}
        response = http.post("/v1/completions", json={"model": "scripted-model",
                                                       "prompt": "hi", "max_tokens": 4})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == " fine"
        assert "chat_template" not in http.get("/tokenizer_info").json()


def test_the_flag_renders_chat_tokenize_and_render(bare_tokenizer):
    core = TextCore(bare_tokenizer, [" fine"])
    expected = bare_tokenizer.encode("<user>hi</user><assistant>", add_special_tokens=False)
    with scripted_client(core, ServerSettings(chat_template=TEMPLATE)) as http:
        response = http.post("/v1/chat/completions", json=chat())
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == " fine"
        assert core.prompts == [expected]
        assert http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == expected
        rendered = http.post("/v1/chat/completions/render", json=chat()).json()
        assert rendered["token_ids"] == expected
        assert http.get("/tokenizer_info").json()["chat_template"] == TEMPLATE


def test_the_flag_replaces_the_models_own_template(default_model, tokenizer):
    core = TextCore(load_tokenizer(default_model.path), [" fine"])
    with scripted_client(core, ServerSettings(chat_template=TEMPLATE)) as http:
        tokens = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert tokenizer.decode(tokens) == "<user>hi</user><assistant>"


def test_chat_template_kwargs_reach_the_template(bare_tokenizer):
    core = TextCore(bare_tokenizer, [" fine"])
    off = bare_tokenizer.encode("<user>hi</user><assistant><think></think>",
                                add_special_tokens=False)
    with scripted_client(core, ServerSettings(chat_template=TEMPLATE)) as http:
        kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
        response = http.post("/v1/chat/completions", json=chat(**kwargs))
        assert response.status_code == 200, response.text
        assert core.prompts == [off]
        assert http.post("/tokenize", json={"messages": MESSAGES, **kwargs}).json()[
            "tokens"] == off
        assert http.post("/v1/chat/completions/render", json=chat(**kwargs)).json()[
            "token_ids"] == off
        for bad in ({"tools": []}, {"add_generation_prompt": False}, {"not a name": 1}):
            error = error_of(http.post("/v1/chat/completions",
                                       json=chat(chat_template_kwargs=bad)), 400)
            assert (error["param"], error["code"]) == ("chat_template_kwargs", "invalid_value")
        error = error_of(http.post("/tokenize", json={"prompt": "hi", **kwargs}), 400)
        assert error["message"] == "'chat_template_kwargs' applies to 'messages' only, " \
                                   "not to 'prompt'."


def test_reserved_kwargs_cover_every_argument_of_apply_chat_template(tokenizer) -> None:
    import inspect

    params = inspect.signature(type(tokenizer).apply_chat_template).parameters
    named = {name for name, p in params.items()
             if p.kind is not p.VAR_KEYWORD and name != "self"}
    assert named <= RESERVED_TEMPLATE_KWARGS


# ------------------------------------------------------------------ reading the flag
def test_a_file_an_inline_template_and_errors(tmp_path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(str(path)) == TEMPLATE
    assert read_chat_template(TEMPLATE) == TEMPLATE
    assert read_chat_template(None) is None
    with pytest.raises(ValueError, match=r"'missing\.jinja': no such file"):
        read_chat_template("missing.jinja")
    with pytest.raises(ValueError, match=r"the inline template is not a Jinja template: .*line 1"):
        read_chat_template("{% for m in messages %}")
    # transformers' own tag (assistant masks) compiles, as transformers renders it
    tracked = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
               "{% endfor %}")
    assert read_chat_template(tracked) == tracked


def test_the_cli_reads_the_file_and_checks_parser_names(tmp_path, capsys) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    args = build_parser({}).parse_args(["serve", "--chat-template", str(path),
                                        "--tool-call-parser", "pythonic",
                                        "--reasoning-parser", "qwen3"])
    settings = server_settings(args)
    assert (settings.chat_template, settings.tool_call_parser, settings.reasoning_parser) == (
        TEMPLATE, "pythonic", "qwen3")
    env = build_parser({"PLAIT_CHAT_TEMPLATE": TEMPLATE}).parse_args(["serve"])
    assert server_settings(env).chat_template == TEMPLATE
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--tool-call-parser", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerSettings(tool_call_parser="json")


# ------------------------------------------------------------------ `plait serve`, for real
def test_plait_serve_with_the_three_flags(tiny_path) -> None:
    """The flags through the CLI into a served app: the Qwen3-shaped test template renders,
    its kwargs apply, and chat answers carry the reasoning fields (random weights: no
    <think>, so they are null)."""
    qwen3 = Path(__file__).parent.parent / "data" / "templates" / "qwen3.jinja"
    server = start_server([str(tiny_path), "--served-model-name", MODEL, "--num-kv-blocks",
                           "64", "--chat-template", str(qwen3), "--tool-call-parser",
                           "hermes", "--reasoning-parser", "qwen3"])
    try:
        server.wait_healthy()
        with server.http() as http:
            assert http.get("/tokenizer_info").json()["chat_template"] == qwen3.read_text()
            tokens = http.post("/tokenize", json={
                "messages": MESSAGES,
                "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
            message = http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                "seed": 1}).json()["choices"][0]["message"]
            # The engine compiles and applies the widened grammar (reasoning, then JSON).
            constrained = [http.post("/v1/chat/completions", json={
                "model": MODEL, "messages": MESSAGES, "max_tokens": 40, "seed": seed,
                "response_format": {"type": "json_object"}}).json()["choices"][0]
                for seed in range(4)]
    finally:
        server.stop()
    for choice in constrained:  # random weights: reasoning or JSON, as the grammar allows
        content, reasoning = choice["message"]["content"], choice["message"]["reasoning"]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict)
        else:  # cut by length: inside the <think> block, or inside the JSON
            assert choice["finish_reason"] == "length"
            assert reasoning is not None or (content or "").startswith("{")
    text = load_tokenizer(tiny_path).decode(tokens)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert message["reasoning_content"] is None and message["reasoning"] is None
    assert isinstance(message["content"], str)


def test_plait_serve_refuses_a_missing_template_file(capsys) -> None:
    assert main(["serve", "--chat-template", "no-such-template.jinja"]) == 2
    assert capsys.readouterr().err == (
        "plait serve: error: --chat-template 'no-such-template.jinja': no such file (an "
        "inline template holds '{{' or '{%')\n")
