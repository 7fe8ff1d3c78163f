"""scripts/quality_scores.py: llama-perplexity's chunks and scored positions, scores read
from prompt_logprobs, perplexity / ratio / same-top-1, and llama.cpp's outputs parsed."""

from __future__ import annotations

import importlib.util
import io
import math
import struct
import sys
from dataclasses import replace

import pytest
from helpers.paths import SCRIPTS


def _load():
    spec = importlib.util.spec_from_file_location("quality_scores",
                                                  SCRIPTS / "quality_scores.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality_scores"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


qs = _load()


def test_chunks_are_whole_and_start_with_bos_where_the_model_adds_one() -> None:
    tokens = list(range(10, 21))  # 11 tokens: two chunks of 4, three left over
    assert qs.chunk_tokens(tokens, 4, 2, 1) == [[1, 11, 12, 13], [1, 15, 16, 17]]
    assert qs.chunk_tokens(tokens, 4, 2, None) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert tokens == list(range(10, 21))  # the input is not changed
    with pytest.raises(ValueError, match="2 chunks of 4, asked for 3"):
        qs.chunk_tokens(tokens, 4, 3, None)


def test_scored_positions_are_the_second_half_after_its_first_token() -> None:
    assert list(qs.scored_positions(512)) == list(range(257, 512))
    assert len(qs.scored_positions(512)) == 255  # llama-perplexity's n_ctx - 1 - n_ctx/2
    assert list(qs.scored_positions(6)) == [4, 5]


def _entry(token: int, logprob: float, rank: int, top: tuple[int, float] | None = None):
    entry = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": "x"}}
    if top is not None:
        entry[str(top[0])] = {"logprob": top[1], "rank": 1, "decoded_token": "y"}
    return entry


CHUNK = [1, 2, 3, 4, 5, 6]
# positions 4 and 5 are scored: token 5 is the top-1 itself, token 6 ranks 3 under token 9
ENTRIES = [None, _entry(2, -9.0, 7, (8, -1.0)), _entry(3, -9.0, 7, (8, -1.0)),
           _entry(4, -9.0, 7, (8, -1.0)), _entry(5, -0.5, 1), _entry(6, -2.0, 3, (9, -0.25))]


def test_scores_read_the_tokens_logprob_and_the_top_1_id() -> None:
    scores = qs.scores_of(CHUNK, ENTRIES)
    assert scores == qs.ChunkScores(logprobs=[-0.5, -2.0], top_ids=[5, 9])


def test_scores_refuse_entries_that_do_not_match_the_chunk() -> None:
    with pytest.raises(ValueError, match="5 prompt_logprobs entries for 6 tokens"):
        qs.scores_of(CHUNK, ENTRIES[:5])
    wrong_token = [*ENTRIES[:4], _entry(7, -0.5, 1), ENTRIES[5]]
    with pytest.raises(ValueError, match="no logprob for the prompt token 5"):
        qs.scores_of(CHUNK, wrong_token)
    second_ranked = [*ENTRIES[:5], {"6": {"logprob": -2.0, "rank": 3},
                                    "9": {"logprob": -1.0, "rank": 2}}]
    with pytest.raises(ValueError, match="position 5: expected the top-1 alternative"):
        qs.scores_of(CHUNK, second_ranked)


def test_perplexity_ratio_and_same_top_1_over_all_chunks() -> None:
    run = [qs.ChunkScores([-0.5, -2.0], [5, 9]), qs.ChunkScores([-1.5], [3])]
    reference = [qs.ChunkScores([-0.5, -1.0], [5, 8]), qs.ChunkScores([-1.5], [3])]
    assert qs.perplexity(run) == pytest.approx(math.exp(4.0 / 3), rel=1e-12)
    result = qs.compare(run, reference)
    assert result.perplexity == pytest.approx(math.exp(4.0 / 3), rel=1e-12)
    assert result.ratio == pytest.approx(math.exp(4.0 / 3 - 3.0 / 3), rel=1e-12)
    assert result.same_top1 == 2 / 3
    assert result.num_scored == 3
    with pytest.raises(ValueError, match="1 chunks against 2"):
        qs.compare(run[:1], reference)


LLAMA_LOG = """\
====== Perplexity statistics ======
Mean PPL(Q)                   :  18.391432 ±   0.864547
Mean PPL(base)                :  18.299381 ±   0.859447
Cor(ln(PPL(Q)), ln(PPL(base))):  99.96%
Mean ln(PPL(Q)/PPL(base))     :   0.005018 ±   0.001403
Mean PPL(Q)/PPL(base)         :   1.005030 ±   0.001410
====== KL divergence statistics ======
Mean    KLD:   0.003117 ±   0.000054
Maximum KLD:   0.061515
RMS Δp    :  1.380 ± 0.039 %
Same top p: 96.275 ± 0.317 %
"""


def test_llama_kl_divergence_summary_is_parsed() -> None:
    figures = qs.parse_llama_kld(LLAMA_LOG)
    assert figures.same_top1 == pytest.approx(0.96275, rel=1e-15)  # printed in percent
    assert replace(figures, same_top1=None) == qs.LlamaFigures(
        perplexity=18.391432, base_perplexity=18.299381, ratio=1.005030, mean_kld=0.003117,
        same_top1=None)
    with pytest.raises(ValueError, match="no same_top1"):
        qs.parse_llama_kld(LLAMA_LOG.replace("Same top p", "Same top"))


def test_kl_divergence_base_file_head_gives_its_tokens() -> None:
    head = b"_logits_" + struct.pack("<Iii", 2, 49152, 3) + struct.pack("<6i", *range(6))
    stream = io.BytesIO(head + b"\x00" * 64)  # the log-probabilities follow
    assert qs.read_kld_base_tokens(stream) == (2, [0, 1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="ends inside its token list"):
        qs.read_kld_base_tokens(io.BytesIO(head[:-4]))
    with pytest.raises(ValueError, match="not a llama-perplexity logits file"):
        qs.read_kld_base_tokens(io.BytesIO(b"_logitz_" + head[8:]))
