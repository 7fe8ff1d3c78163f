"""`NAME=VALUE` engine options on a benchmark script's command line -> `LLM` keyword
arguments (EngineConfig fields): the one parser the scripts share."""

from __future__ import annotations

from collections.abc import Iterable


def option_value(raw: str) -> object:
    """"true"/"false" (any case) -> bool, an int or a float -> that number, else the
    string itself."""
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            continue
    return raw


def engine_options(items: Iterable[str]) -> dict[str, object]:
    """["a=1", "b=true", "c=x"] -> {"a": 1, "b": True, "c": "x"}; an item without "="
    raises ValueError naming it."""
    options: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"option {item!r}: expected NAME=VALUE")
        options[key] = option_value(raw)
    return options


__all__ = ["engine_options", "option_value"]
