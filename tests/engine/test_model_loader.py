"""Model resolution: default GGUF, conversion cache, clear one-line errors."""

from __future__ import annotations

import json

import pytest

from plait.engine import model_loader
from plait.engine.model_config import ModelLoadError
from plait.engine.model_loader import resolve_model


def test_default_model_resolves_to_converted_cache(default_model) -> None:
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert (default_model.path / "model.safetensors").is_file()
    assert (default_model.path / "tokenizer.json").is_file()
    assert default_model.path.parent == model_loader.cache_root()
    assert default_model.config.num_kv_heads == 3 and default_model.config.num_heads == 9


def test_second_load_skips_conversion(default_model, monkeypatch) -> None:
    def boom(*_args, **_kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_loader, "convert_gguf", boom)
    assert resolve_model(None).path == default_model.path


def test_missing_path_is_one_clear_line() -> None:
    with pytest.raises(ModelLoadError) as err:
        resolve_model("/nonexistent/model")
    message = str(err.value)
    assert "does not exist" in message and "\n" not in message
    assert "llama, mistral, qwen2" in message and ".gguf" in message


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    expected = r"unsupported architecture 'gpt2'.*llama, mistral, qwen2"
    with pytest.raises(ModelLoadError, match=expected):
        resolve_model(str(tmp_path))


def test_corrupt_gguf(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError) as err:
        resolve_model(str(bad))
    assert str(err.value).startswith(f"cannot convert {bad}")
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "cache").glob("gguf-*")), "no half-converted cache entry"


def test_not_a_gguf_file(tmp_path) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"is not a \.gguf file"):
        resolve_model(str(other))


def test_directory_without_weights(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 2, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "vocab_size": 10}))
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(str(tmp_path))
