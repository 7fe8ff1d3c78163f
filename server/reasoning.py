"""--reasoning-parser: a choice's text -> its reasoning (the text inside <think>...</think>)
and the rest, which is the answer (content, tool calls, structured output) as without a
reasoning parser.

    qwen3        reasoning only when the output starts with <think> (after whitespace):
                 "<think>plan</think>\\n\\nanswer"  -> reasoning "plan", rest "answer"
                 "answer"                          -> no reasoning, rest "answer"
                 (with enable_thinking false the Qwen3 template closes the block itself)
    deepseek_r1  the template already opened <think>: the output starts inside reasoning
                 (a <think> the model writes again is dropped) up to </think>:
                 "plan</think>answer"             -> reasoning "plan", rest "answer"
                 unless the prompt ends with the block closed (a template that turns
                 thinking off writes "<think>\n</think>"): then read as qwen3 (`for_prompt`)

Without </think> (cut by length, say) everything after the opening is reasoning. The
rest starts at its first non-whitespace character. `ReasoningSplitter` does this
incrementally, holding back only what could still be the start of <think> / </think>; the
whole-text split runs the same machine, so streamed and whole answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

THINK_START, THINK_END = "<think>", "</think>"
# How many of the prompt's last tokens `for_prompt` reads (the generation prompt's
# "<｜Assistant｜><think>\n</think>" is a few tokens, as text tokens up to ~12).
REASONING_TAIL_TOKENS = 16
State = Literal["opening", "reasoning", "after", "content"]


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """A --reasoning-parser: `name`, and whether the output starts inside the reasoning
    (the template opened <think>) or only when the model writes <think> itself."""

    name: str
    starts_inside: bool


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", starts_inside=False),
    "deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format --reasoning-parser `name` means (None: off)."""
    return None if name is None else REASONING_FORMATS[name]


def for_prompt(fmt: ReasoningFormat, prompt_tail: str) -> ReasoningFormat:
    """`fmt` for a prompt whose rendered text ends with `prompt_tail`: a format that starts
    inside the reasoning does not when the tail's last <think> block is closed (the
    template turned thinking off); the output then holds reasoning only if the model opens
    a block itself."""
    closed = prompt_tail.rfind(THINK_END) > prompt_tail.rfind(THINK_START) >= 0
    return ReasoningFormat(fmt.name, starts_inside=False) if fmt.starts_inside and closed \
        else fmt


@dataclass(frozen=True, slots=True)
class Split:
    """Text split so far: `reasoning` and `rest` are the new pieces of each."""

    reasoning: str = ""
    rest: str = ""


class ReasoningSplitter:
    """One choice's text, fed piece by piece, split into reasoning and the rest.
    `entered` is true once the choice's output was found to hold reasoning."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.state: State = "opening"
        self.entered = False
        self._held = ""

    def feed(self, text: str) -> Split:
        """The new reasoning and rest that `text` makes known."""
        self._held += text
        reasoning, rest = [], []
        while self._held:
            before = (self.state, len(self._held))
            if self.state == "opening":
                self._open()
            elif self.state == "reasoning":
                reasoning.append(self._reason())
            elif self.state == "after":
                self._held = self._held.lstrip()
                if self._held:
                    self.state = "content"
            else:
                rest.append(self._held)
                self._held = ""
            if (self.state, len(self._held)) == before:
                break  # waiting for more text
        return Split("".join(reasoning), "".join(rest))

    def finish(self) -> Split:
        """What was held back, once the choice ended."""
        held, self._held = self._held, ""
        if self.state == "reasoning" or (self.state == "opening" and self.fmt.starts_inside):
            self.entered = True
            return Split(reasoning=held)
        return Split(rest=held if self.state in ("opening", "content") else "")

    def _open(self) -> None:
        head = self._held.lstrip()
        if head.startswith(THINK_START):
            self._held = head[len(THINK_START):]
        elif not head or THINK_START.startswith(head):
            return  # could still become <think>
        elif not self.fmt.starts_inside:
            self.state = "content"
            return
        self.state, self.entered = "reasoning", True

    def _reason(self) -> str:
        """Reasoning text up to </think> (then on to "after"), or up to a possible start
        of it, which stays held."""
        end = self._held.find(THINK_END)
        if end >= 0:
            piece, self._held = self._held[:end], self._held[end + len(THINK_END):]
            self.state = "after"
            return piece
        hold = max((k for k in range(1, len(THINK_END)) if self._held.endswith(THINK_END[:k])),
                   default=0)
        piece = self._held[:len(self._held) - hold]
        self._held = self._held[len(piece):]
        return piece


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning, rest) of a finished choice's whole text; reasoning is None when the
    output held none."""
    splitter = ReasoningSplitter(fmt)
    first, last = splitter.feed(text), splitter.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if splitter.entered else None), first.rest + last.rest
