"""`Vocabulary.decode` equals the tokenizer's own `decode`, on the three tokenizer kinds the
supported families use: byte-level BPE (SmolLM2), and SentencePiece BPE with byte fallback
as Gemma's (no `Strip`) and as Llama's (strips one leading space) tokenizers decode."""

from __future__ import annotations

import random

import msgspec
import pytest
from helpers.families import families_cache
from helpers.families.tokenizers import write_tokenizer

from plait.engine.model_loader import load_tokenizer
from plait.engine.vocabulary import TokenizerText, Vocabulary, text_decoder

# kind -> (decoder kind, leading spaces stripped)
KINDS = {"smollm2": ("byte_level", 0), "spm-gemma": ("byte_fallback", 0),
         "spm-llama": ("byte_fallback", 1)}
TEXT = "Hi  there!\n\tdef f(x):\n    return x  # 😀 你好 café \u00a0 é"


@pytest.fixture(scope="module", params=list(KINDS))
def tokenizer_kind(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    write_tokenizer(request.param, out, families_cache())
    return request.param, load_tokenizer(out)


def random_ids(rng: random.Random, vocabulary: Vocabulary) -> list[int]:
    """Up to 12 ids, weighted towards what decoders treat apart: special tokens, byte
    pieces (byte fallback, or single bytes of byte-level BPE), ids past the vocabulary."""
    special, byte_ids = sorted(vocabulary.special_ids), sorted(vocabulary.byte_ids)
    ids = []
    for _ in range(rng.randint(0, 12)):
        roll = rng.random()
        if roll < 0.1:
            ids.append(rng.choice(special))
        elif roll < 0.3 and byte_ids:
            ids.append(rng.choice(byte_ids))
        elif roll < 0.33:
            ids.append(vocabulary.size + rng.randrange(4))
        else:
            ids.append(rng.randrange(vocabulary.size))
    return ids


def test_decode_equals_the_tokenizers_on_random_ids(tokenizer_kind) -> None:
    kind, tokenizer = tokenizer_kind
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    assert vocabulary is not None
    assert (vocabulary.kind, vocabulary.strip_start) == KINDS[kind]
    assert vocabulary.eos_token_id == tokenizer.eos_token_id
    assert set(tokenizer.all_special_ids) <= vocabulary.special_ids
    if vocabulary.kind == "byte_fallback":
        assert len(vocabulary.byte_ids) == 256 and sorted(vocabulary.byte_ids.values()) == \
            list(range(256))
    rng = random.Random(0)
    for _ in range(3000):
        ids = random_ids(rng, vocabulary)
        for skip in (False, True):
            want = tokenizer.decode(ids, skip_special_tokens=skip,
                                    clean_up_tokenization_spaces=False)
            assert vocabulary.decode(ids, skip) == want, (ids, skip)


def test_decode_equals_the_tokenizers_on_text(tokenizer_kind) -> None:
    _, tokenizer = tokenizer_kind
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    ids = tokenizer.encode(TEXT)  # with the tokenizer's own special tokens (a BOS)
    for skip in (False, True):
        want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert vocabulary.decode(ids, skip) == want
        for end in range(len(ids)):  # every prefix: a cut character, a cut space
            assert vocabulary.decode(ids[:end], skip) == tokenizer.decode(
                ids[:end], skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_vocabulary_crosses_the_wire_unchanged(tokenizer) -> None:
    vocabulary = Vocabulary.from_tokenizer(tokenizer)
    frame = msgspec.msgpack.encode(vocabulary)
    assert msgspec.msgpack.decode(frame, type=Vocabulary) == vocabulary


def test_another_decoder_keeps_the_tokenizer(tokenizer) -> None:
    """A decoder `Vocabulary` does not reproduce (here WordPiece's) gives None, and the
    engine decodes through the tokenizer itself."""
    from tokenizers import decoders

    backend = tokenizer.backend_tokenizer
    saved = backend.decoder
    backend.decoder = decoders.WordPiece()
    try:
        assert Vocabulary.from_tokenizer(tokenizer) is None
        assert isinstance(text_decoder(tokenizer), TokenizerText)
    finally:
        backend.decoder = saved
    assert isinstance(text_decoder(tokenizer), Vocabulary)


def test_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="kind"):
        Vocabulary("wordpiece", [], frozenset(), {})
    with pytest.raises(ValueError, match="strip_start"):
        Vocabulary("byte_fallback", [], frozenset(), {}, strip_start=-1)


def _run(core) -> dict[str, tuple[list[int], str, str | None]]:
    """Step `core` until idle: request id -> (tokens, text, finish reason)."""
    out: dict[str, tuple[list[int], str, str | None]] = {}
    while core.has_unfinished():
        for delta in core.step().deltas:
            tokens, text, _ = out.get(delta.request_id, ([], "", None))
            out[delta.request_id] = (tokens + delta.token_ids, text + delta.text,
                                     delta.finish_reason)
    return out


def test_a_core_given_the_vocabulary_loads_the_tokenizer_only_for_a_grammar(
        tiny_path, tokenizer, monkeypatch) -> None:
    """The engine process's core: text and stop strings as with the tokenizer, and the
    tokenizer loaded once, by the first structured request's compile."""
    import plait.engine.core as core_module
    from plait.engine import EngineConfig, SamplingParams, StructuredSpec
    from plait.engine.core import EngineCore

    loads: list[object] = []

    def counting_load(path):
        loads.append(path)
        return load_tokenizer(path)

    monkeypatch.setattr(core_module, "load_tokenizer", counting_load)
    config = EngineConfig(model=str(tiny_path), num_kv_blocks=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["e"])
    prompt_ids = tokenizer.encode("The quick brown fox")
    with_tokenizer = EngineCore(config, tokenizer=tokenizer)
    with_tokenizer.add_request("a", prompt_ids, params)
    want = _run(with_tokenizer)["a"]
    with_tokenizer.close()

    core = EngineCore(config, vocabulary=Vocabulary.from_tokenizer(tokenizer))
    core.add_request("a", prompt_ids, params)
    assert _run(core)["a"] == want
    assert loads == []
    core.add_request("b", prompt_ids, SamplingParams(
        max_tokens=8, temperature=0.0,
        structured=StructuredSpec("choice", '["yes", "no"]')))
    _, text, finish = _run(core)["b"]
    assert text in ("yes", "no") and finish == "stop"
    assert len(loads) == 1
    core.close()
