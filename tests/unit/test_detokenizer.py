"""Incremental detokenizer (real SmolLM2 byte-level BPE tokenizer) and the token text table."""

from __future__ import annotations

import pytest

from plait.engine.detokenizer import DetokenizerStep, IncrementalDetokenizer
from plait.engine.sampling_params import SamplingParams
from plait.engine.token_text import TokenTextTable
from plait.engine.vocabulary import TextDecoder, TokenizerText, Vocabulary

IM_END = 2
MULTILINGUAL = "Hi 😀 你好世界 👩‍👩‍👧 café"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(params=["vocabulary", "tokenizer"])
def text(request, tokenizer) -> TextDecoder:
    """Both ways the engine decodes: the tokenizer's `Vocabulary`, and the tokenizer."""
    if request.param == "tokenizer":
        return TokenizerText(tokenizer)
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    assert vocabulary is not None and vocabulary.kind == "byte_level"
    return vocabulary


def run(tokenizer, token_ids: list[int], params: SamplingParams | None = None, *,
        prompt: str = "The answer is", chunk: int = 1, finish: bool = True,
        text: TextDecoder | None = None) -> tuple[IncrementalDetokenizer, list[DetokenizerStep]]:
    """Feed `token_ids` `chunk` at a time; the last call has finished=`finish`. `text`:
    the tokenizer's vocabulary unless given."""
    detok = IncrementalDetokenizer(text or Vocabulary.from_tokenizer(tokenizer),
                                   encode(tokenizer, prompt), params or SamplingParams())
    steps = []
    for start in range(0, len(token_ids), chunk):
        last = start + chunk >= len(token_ids)
        steps.append(detok.step(token_ids[start:start + chunk], finished=finish and last))
    return detok, steps


# --- text reconstruction -------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_split_utf8_characters_reconstruct_exactly(tokenizer, text, chunk):
    ids = encode(tokenizer, MULTILINGUAL)
    assert tokenizer.decode(ids[2:3]) == "\ufffd"  # precondition: the emoji is split
    detok, steps = run(tokenizer, ids, chunk=chunk, text=text)
    deltas = [s.text for s in steps]
    assert "".join(deltas) == tokenizer.decode(ids) == MULTILINGUAL
    assert detok.output_text == MULTILINGUAL
    assert not any("\ufffd" in d for d in deltas)
    assert all(s.stop_str is None for s in steps)


def test_split_character_is_emitted_when_complete(tokenizer, text):
    ids = encode(tokenizer, "😀!")  # three byte tokens for the emoji, then "!"
    assert len(ids) == 4
    _, steps = run(tokenizer, ids, text=text)
    assert [s.text for s in steps] == ["", "", "😀", "!"]


def test_leading_space_tokens(tokenizer):
    ids = encode(tokenizer, " forty two")
    _, steps = run(tokenizer, ids, prompt="The answer is")
    assert [s.text for s in steps] == [" forty", " two"]


def test_incomplete_character_is_released_on_finish(tokenizer, text):
    ids = encode(tokenizer, "ok 😀")[:-1]  # cut inside the emoji (e.g. max_tokens)
    detok, steps = run(tokenizer, ids, text=text)
    assert detok.output_text == tokenizer.decode(ids) == "ok \ufffd"
    assert steps[-1].text.endswith("\ufffd")


def test_skip_special_tokens(tokenizer, text):
    ids = [*encode(tokenizer, "Hi there"), IM_END]
    detok, _ = run(tokenizer, ids, text=text)
    assert detok.output_text == "Hi there"
    detok, _ = run(tokenizer, ids, SamplingParams(skip_special_tokens=False), text=text)
    assert detok.output_text == "Hi there<|im_end|>"


def test_special_token_in_the_middle_is_skipped(tokenizer, text):
    ids = [*encode(tokenizer, "Hi"), IM_END, *encode(tokenizer, " there")]
    _, steps = run(tokenizer, ids, text=text)
    assert [s.text for s in steps] == ["Hi", "", " there"]


# --- stop strings --------------------------------------------------------------------------

def test_stop_string_spanning_tokens(tokenizer):
    ids = encode(tokenizer, "Hello world, friend")  # Hello | ␣world | , | ␣friend
    detok, steps = run(tokenizer, ids, SamplingParams(stop=["o wo"]), finish=False)
    assert [s.text for s in steps] == ["Hell", "", "", ""]
    assert [s.stop_str for s in steps] == [None, "o wo", None, None]
    assert detok.output_text == "Hell"
    assert detok.step(encode(tokenizer, " more"), finished=True) == DetokenizerStep("", None)


def test_stop_string_included_in_output(tokenizer):
    ids = encode(tokenizer, "Hello world, friend")
    params = SamplingParams(stop=["o wo"], include_stop_str_in_output=True)
    detok, steps = run(tokenizer, ids, params, finish=False)
    assert [s.text for s in steps] == ["Hell", "o wo", "", ""]
    assert detok.output_text == "Hello wo"


@pytest.mark.parametrize("chunk", [1, 100])
def test_earliest_stop_string_wins(tokenizer, chunk):
    ids = encode(tokenizer, "Hello world, this is a test.")
    params = SamplingParams(stop=["test", "is a", "s is"])
    detok, steps = run(tokenizer, ids, params, chunk=chunk, finish=False)
    assert detok.output_text == "Hello world, thi"
    assert [s.stop_str for s in steps if s.stop_str] == ["s is"]


def test_stop_string_prefix_is_held_back_then_released(tokenizer):
    ids = encode(tokenizer, "Hello world, friend")
    _, steps = run(tokenizer, ids, SamplingParams(stop=["world peace"]))
    assert [s.text for s in steps] == ["Hello", " ", "world,", " friend"]


def test_held_back_text_is_released_when_finished(tokenizer):
    ids = encode(tokenizer, "Hello world")
    detok, steps = run(tokenizer, ids, SamplingParams(stop=["world peace"]), finish=False)
    assert [s.text for s in steps] == ["Hello", " "]
    assert detok.step([], finished=True) == DetokenizerStep("world", None)
    assert detok.output_text == "Hello world"


def test_stop_string_matching_a_split_character(tokenizer):
    ids = encode(tokenizer, "Hi 😀 there")
    detok, steps = run(tokenizer, ids, SamplingParams(stop=["😀"]))
    assert detok.output_text == "Hi "
    assert [s.stop_str for s in steps if s.stop_str] == ["😀"]
    assert not any("\ufffd" in s.text for s in steps)


# --- token text table ----------------------------------------------------------------------

def test_token_text_has_real_leading_space(tokenizer):
    table = TokenTextTable(tokenizer)
    (hello,) = encode(tokenizer, " hello")
    assert table.text(hello) == " hello"
    assert table.bytes(hello) == list(b" hello")
    assert table.text(IM_END) == "<|im_end|>"


def test_token_bytes_of_a_partial_emoji(tokenizer):
    table = TokenTextTable(tokenizer)
    ids = encode(tokenizer, "😀")
    assert [table.bytes(i) for i in ids] == [[0xF0, 0x9F], [0x98], [0x80]]
    assert all(table.text(i) == "\ufffd" for i in ids)
    assert b"".join(bytes(table.bytes(i)) for i in ids).decode() == "😀"


def test_token_bytes_concatenate_to_the_text(tokenizer):
    table = TokenTextTable(tokenizer)
    ids = encode(tokenizer, MULTILINGUAL)
    assert b"".join(bytes(table.bytes(i)) for i in ids) == MULTILINGUAL.encode()


def test_stop_strings_only_match_from_min_tokens_on(tokenizer):
    """The engine passes match_stops=False below min_tokens: "o" in "Hello" and " world" is
    not a stop; "world," ends in the third token's text, so it stops there."""
    ids = encode(tokenizer, "Hello world, friend")  # Hello | ␣world | , | ␣friend
    params = SamplingParams(stop=["o", "world,"], min_tokens=3)
    detok = IncrementalDetokenizer(Vocabulary.from_tokenizer(tokenizer),
                                   encode(tokenizer, "The answer is"), params)
    steps = [detok.step([t], finished=False, match_stops=i + 1 >= params.min_tokens)
             for i, t in enumerate(ids)]
    assert [s.text for s in steps] == ["Hello", " ", "", ""]
    assert [s.stop_str for s in steps] == [None, None, "world,", None]
    assert detok.output_text == "Hello "


def test_stop_string_before_min_tokens_is_emitted(tokenizer):
    ids = encode(tokenizer, "Hello world, friend")
    detok = IncrementalDetokenizer(Vocabulary.from_tokenizer(tokenizer),
                                   encode(tokenizer, "The answer is"),
                                   SamplingParams(stop=["o"], min_tokens=4))
    steps = [detok.step([t], finished=i == 3, match_stops=i + 1 >= 4)
             for i, t in enumerate(ids)]
    assert [s.stop_str for s in steps] == [None, None, None, None]
    assert detok.output_text == "Hello world, friend"
