"""reasoning.py: <think> text split from the answer, exactly, for qwen3 (reasoning only when
the output opens it) and deepseek_r1 (the output starts inside it); fed in pieces of any
size the split is the same as of the whole text; deepseek_r1 after a prompt that closed the
block reads as qwen3."""

from __future__ import annotations

import pytest

from plait.server.reasoning import (
    REASONING_FORMATS,
    ReasoningSplitter,
    for_prompt,
    split_reasoning,
)

QWEN3, R1 = REASONING_FORMATS["qwen3"], REASONING_FORMATS["deepseek_r1"]


@pytest.mark.parametrize(("text", "split"), [
    ("<think>\nplan\n</think>\n\nAnswer.", ("\nplan\n", "Answer.")),
    ("\n<think>a</think>b", ("a", "b")),
    ("<think></think>\n\nOnly this.", ("", "Only this.")),
    ("Answer without thinking.", (None, "Answer without thinking.")),
    ("  Spaces kept </think>", (None, "  Spaces kept </think>")),
    ("<think>cut by length", ("cut by length", "")),
    ("<think>a</think>", ("a", "")),
    ("<thi", (None, "<thi")),
    ("", (None, "")),
    ("<think>x</thinking>y</think>z", ("x</thinking>y", "z")),
])
def test_qwen3(text, split) -> None:
    assert split_reasoning(QWEN3, text) == split


@pytest.mark.parametrize(("text", "split"), [
    ("plan</think>\n\nAnswer.", ("plan", "Answer.")),
    ("<think>\nplan</think>Answer.", ("\nplan", "Answer.")),
    ("still thinking", ("still thinking", "")),
    ("</think>answer", ("", "answer")),
    ("", ("", "")),
])
def test_deepseek_r1(text, split) -> None:
    assert split_reasoning(R1, text) == split


TEXTS = ["<think>\nplan a </th then </think>\n\nAnswer <think> stays.", "plain <think>",
         "  \n<think>x</think>   \n", "<think>never closed </thi", "a</think>b"]


@pytest.mark.parametrize("fmt", [QWEN3, R1])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("size", [1, 2, 5])
def test_pieces_split_as_the_whole(fmt, text, size) -> None:
    splitter = ReasoningSplitter(fmt)
    pieces = [splitter.feed(text[i:i + size]) for i in range(0, len(text), size)]
    pieces.append(splitter.finish())
    reasoning = "".join(p.reasoning for p in pieces)
    rest = "".join(p.rest for p in pieces)
    whole = split_reasoning(fmt, text)
    assert ((reasoning if splitter.entered else None), rest) == whole


def test_only_a_possible_marker_is_held() -> None:
    splitter = ReasoningSplitter(QWEN3)
    assert splitter.feed("<th").rest == "" and splitter.feed("ink>abc</").reasoning == "abc"
    assert splitter.feed("b>").reasoning == "</b>"
    assert splitter.feed("</think>  ").rest == ""
    assert splitter.feed(" ok").rest == "ok"
    assert ReasoningSplitter(QWEN3).feed("Hello").rest == "Hello"  # never held


@pytest.mark.parametrize(("tail", "inside"), [
    ("<｜Assistant｜><think>\n", True),  # the template opened the block
    ("<｜Assistant｜><think>\n</think>", False),  # ... and closed it: thinking off
    ("<｜Assistant｜>", True),  # no block in sight: the format's own rule
    ("</think>answer<｜end▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n", True),
])
def test_a_closed_block_in_the_prompt_starts_the_output_outside(tail, inside) -> None:
    fmt = for_prompt(R1, tail)
    assert (fmt.name, fmt.starts_inside) == ("deepseek_r1", inside)
    assert for_prompt(QWEN3, tail) is QWEN3
    assert split_reasoning(fmt, "Hello!") == ((None, "Hello!") if not inside else ("Hello!", ""))
