"""The text workloads: prompts built from text Python's standard library ships, so every
machine and every server gets the same real (not made-up) text.

    edit   (W6)  a code edit: `statistics.quantiles`' source (~480 tokens) to be given back
                 whole with one error message changed
    quote  (W7)  a summary with quotes: the "Naming and binding" section of the language
                 reference (pydoc_data.topics["naming"], ~1500 tokens), summarized in
                 five bullets that each quote their sentence

Both are chat requests run greedily (temperature 0) without ignore_eos: the answer ends
where the model ends it, and most of it repeats the context, which is what draft
proposers (ngram, suffix) and draft models are for. The texts come from the running
interpreter, so the Python version is part of a figure's description (`source`).
"""

from __future__ import annotations

import inspect
import platform
from dataclasses import dataclass
from typing import Any

TEXT_KINDS = ("edit", "quote")
EDIT_MAX_TOKENS = 640  # the function is ~480 tokens in the usual BPE vocabularies
QUOTE_MAX_TOKENS = 384


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """One text workload's chat request: `messages`, its `max_tokens`, and `source`, what
    the text is (module and Python version)."""

    messages: list[dict[str, Any]]
    max_tokens: int
    source: str


def edit_prompt() -> TextPrompt:
    """W6: give back a stdlib function with one small change."""
    import statistics

    code = inspect.getsource(statistics.quantiles)
    content = ("Here is a function from Python's standard library:\n\n```python\n"
               f"{code}```\n\nWrite the whole function again, unchanged except for one "
               "thing: the error message 'n must be at least 1' becomes 'n must be a "
               "positive integer'. Answer with the code only.")
    return TextPrompt([{"role": "user", "content": content}], EDIT_MAX_TOKENS,
                      f"statistics.quantiles, Python {platform.python_version()}")


def quote_prompt() -> TextPrompt:
    """W7: a summary of a long reference text, each point quoting its sentence."""
    from pydoc_data.topics import topics

    content = ("Read this section of the Python language reference:\n\n"
               f"{topics['naming'].strip()}\n\nSummarize it in five bullet points. Each "
               "bullet quotes, word for word and in quotation marks, the sentence of the "
               "text it is based on.")
    return TextPrompt([{"role": "user", "content": content}], QUOTE_MAX_TOKENS,
                      f'pydoc_data.topics["naming"], Python {platform.python_version()}')


def text_prompt(kind: str) -> TextPrompt:
    """The prompt of a text workload kind (TEXT_KINDS). Raises ValueError otherwise."""
    if kind == "edit":
        return edit_prompt()
    if kind == "quote":
        return quote_prompt()
    raise ValueError(f"unknown text workload {kind!r}; known: {', '.join(TEXT_KINDS)}")
