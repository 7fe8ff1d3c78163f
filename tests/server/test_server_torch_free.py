"""The HTTP process of `plait serve` (default: the engine core in its own process) never
imports torch: not when its modules are imported and the app built, not when it loads the
tokenizer, not while it serves. torch stays in the `plait-engine` child.

torch is the bulk of the front end's resident memory (about 385 MB with it, 140 MB
without, for the default model); these tests keep it out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.paths import run_python
from helpers.server import MODEL, RemoteServer

from plait.engine.model_loader import DIRECT_TOKENIZERS, ResolvedModel, load_tokenizer


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(child) for child in text]
    return found


def test_app_and_tokenizer_do_not_import_torch(tmp_path, default_model: ResolvedModel) -> None:
    """Importing the server, building the default (process-engine) app, loading the
    default model's tokenizer and trimming the heap after it leave torch unimported; the
    in-thread engine imports it."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from plait.server.app import create_app
        from plait.server.serve import run_server
        from plait.server.settings import ServerSettings
        from plait.engine import ProcessEngine
        from plait.engine.model_loader import load_tokenizer
        app = create_app(ServerSettings())
        assert isinstance(app.state.plait.engine, ProcessEngine)
        tokenizer = load_tokenizer(Path({str(default_model.path)!r}))
        tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=True,
                                      add_generation_prompt=True)
        from plait.engine.libc import release_free_heap
        release_free_heap()
        print("torch" in sys.modules)
        create_app(ServerSettings(engine_process=False))  # the in-thread engine: torch
        print("torch" in sys.modules)
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["False", "True"], result.stdout


def test_gguf_conversion_runs_in_a_child_process(tmp_path) -> None:
    """With `isolate_conversion` (ProcessEngine.load), converting a GGUF on a cold cache
    imports torch in a spawned child, not here; a broken file still raises the one-line
    `ModelLoadError`."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from plait.engine.model_loader import ModelLoadError, resolve_model
        resolved = resolve_model(None, False, isolate_conversion=True)
        print(sorted(p.name for p in resolved.path.iterdir()))
        bad = Path({str(tmp_path / "bad.gguf")!r})
        bad.write_bytes(b"GGUF" + bytes(64))
        try:
            resolve_model(str(bad), False, isolate_conversion=True)
        except ModelLoadError as exc:
            print(str(exc).startswith("cannot convert"))
        print("torch" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300,
                            env={**os.environ, "PLAIT_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == [
        "['chat_template.jinja', 'config.json', 'tokenizer.json', 'tokenizer_config.json']",
        "True", "False"], result.stdout


@pytest.mark.parametrize(("pair", "target"), sorted(DIRECT_TOKENIZERS.items()))
def test_direct_tokenizers_match_auto_tokenizer(tmp_path, default_model: ResolvedModel,
                                                pair: tuple[str, str],
                                                target: tuple[str, str]) -> None:
    """Every (tokenizer class, model type) pair that `load_tokenizer` loads without
    AutoTokenizer gets the class AutoTokenizer picks (the default model's tokenizer files,
    relabelled)."""
    from transformers import AutoTokenizer

    tokenizer_class, model_type = pair
    folder = tmp_path / "model"
    shutil.copytree(default_model.path, folder,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    for name, key, value in (("tokenizer_config.json", "tokenizer_class", tokenizer_class),
                             ("config.json", "model_type", model_type)):
        data = json.loads((folder / name).read_text())
        data[key] = value
        (folder / name).write_text(json.dumps(data))
    direct = load_tokenizer(folder)
    assert (type(direct).__module__, type(direct).__name__) == target
    assert type(direct) is type(AutoTokenizer.from_pretrained(folder))


def test_default_tokenizer_matches_auto_tokenizer(default_model: ResolvedModel) -> None:
    """The default model's tokenizer, loaded directly, encodes and templates as
    AutoTokenizer's does."""
    from transformers import AutoTokenizer

    direct, auto = load_tokenizer(default_model.path), AutoTokenizer.from_pretrained(
        default_model.path)
    assert type(direct) is type(auto)
    text = "Hello <|im_start|> wörld\n\t  1234 🙂"
    assert direct(text)["input_ids"] == auto(text)["input_ids"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert (direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert direct.all_special_ids == auto.all_special_ids
    assert direct.get_vocab() == auto.get_vocab()
    assert (direct.eos_token_id, direct.bos_token_id, direct.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)


def test_running_server_maps_no_libtorch(server: RemoteServer, http) -> None:
    """The session's real server, after chat (plain, JSON schema, tools), completions with
    logprobs, responses and /tokenize: no libtorch in the HTTP process's memory map; the
    engine child has it (so the check can see it)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    requests = [
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"}),
        ("/v1/completions", {"model": MODEL, "prompt": "One", "max_tokens": 2, "logprobs": 2}),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4}),
        ("/tokenize", {"model": MODEL, "prompt": "hello"}),
    ]
    for path, body in requests:
        response = http.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
    pid = server.process.pid
    assert "libtorch" not in _maps(pid)
    engines = [child for child in _children(pid)
               if Path(f"/proc/{child}/comm").read_text().strip() == "plait-engine"]
    assert len(engines) == 1 and "libtorch" in _maps(engines[0])
