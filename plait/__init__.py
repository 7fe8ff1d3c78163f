"""Plait: an OpenAI-compatible inference server that prefills an n-choice prompt once.

`from plait import LLM, SamplingParams` is the offline API; it imports only the engine
(torch), never the HTTP stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from plait.engine import LLM, SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so that `import plait` (and the CLI's --help) stays fast.
    if name == "LLM":
        from plait.engine import LLM

        return LLM
    if name == "SamplingParams":
        from plait.engine import SamplingParams

        return SamplingParams
    raise AttributeError(name)
