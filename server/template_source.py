"""--chat-template's value -> the template source the server renders chats with.

Kept free of the HTTP stack (plait/cli.py imports it). The value is a file's path or the
template itself, as vLLM's `--chat-template`:

    an existing file           its text
    text with "{", "}" or a    the text itself (an inline template)
      line break
    anything else              an error: a path that names no file

Either way the source must compile as transformers compiles it for rendering (jinja2 with
its `{% generation %}` tag and loop controls), so a broken template stops the server at
start, not on the first chat request.
"""

from __future__ import annotations

from pathlib import Path

_INLINE_MARKS = ("{", "}", "\n")


def read_chat_template(value: str | None) -> str | None:
    """The template source `value` means (None stays None: the model's own template).
    Raises ValueError for a path that names no file and for a source Jinja cannot parse."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        source = path.read_text(encoding="utf-8")
        where = str(path)
    elif any(mark in value for mark in _INLINE_MARKS):
        source, where = value, "the inline template"
    else:
        raise ValueError(f"--chat-template {value!r}: no such file (an inline template "
                         "holds '{{' or '{%')")
    check_syntax(source, where)
    return source


def check_syntax(source: str, where: str) -> None:
    """ValueError naming `where` and the line when `source` is not a Jinja template."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template: {where} is not a Jinja template: {exc.message} "
                         f"(line {exc.lineno})") from None
