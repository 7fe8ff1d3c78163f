"""The ngram proposer (engine/spec/ngram.py) and `--speculative-config` parsing
(engine/spec/config.py, engine/spec/factory.py): exact drafts, exact errors."""

from __future__ import annotations

import pytest

from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.factory import make_proposer
from plait.engine.spec.ngram import NgramProposer, ngram_draft
from plait.engine.spec.proposer import SpecInput


def test_most_recent_match_of_the_longest_suffix() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4]
    # the last 4 (1 2 3 4) occur at 0..3 (then 9) and at 5..8 (then 5 6 1): most recent wins
    assert ngram_draft(tokens, 2, 5, 3) == [5, 6, 1]
    assert ngram_draft(tokens, 2, 5, 10) == [5, 6, 1, 2, 3, 4]  # runs to the end
    assert ngram_draft(tokens, 2, 5, 1) == [5]


def test_longer_match_beats_a_more_recent_shorter_one() -> None:
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 8, 9, 1, 5, 8, 9, 2, 7, 8, 9]
    # suffix "7 8 9" occurs at 0..2 (then 1); "8 9" more recently at 5..6 (then 2)
    assert ngram_draft(tokens, 2, 3, 2) == [1, 5]
    assert ngram_draft(tokens, 2, 2, 2) == [2, 7]  # max 2: the most recent "8 9"


def test_no_match_below_min_n() -> None:
    tokens = [1, 2, 3, 4, 5, 3]  # only the last token (n = 1) occurs earlier
    assert ngram_draft(tokens, 2, 4, 3) == []
    assert ngram_draft(tokens, 1, 4, 3) == [4, 5, 3]
    assert ngram_draft([5], 1, 3, 3) == []
    assert ngram_draft([], 1, 3, 3) == []
    assert ngram_draft([1, 2, 1, 2], 2, 2, 0) == []


def test_overlapping_repeat() -> None:
    # "a a a a": the last 2 occur at 1..2 (most recent), followed by the last token itself
    assert ngram_draft([4, 4, 4, 4], 2, 2, 3) == [4]
    assert ngram_draft([1, 2, 1, 2, 1, 2], 2, 4, 4) == [1, 2]


def test_proposer_keeps_order_and_each_budget() -> None:
    proposer = NgramProposer(2, 3)
    seqs = [SpecInput("a", [1, 2, 3, 1, 2], 3, 2),
            SpecInput("b", [9, 8, 7], 3, 4),
            SpecInput("c", (5, 6, 0, 0, 5, 6), 2, 1)]
    assert proposer.propose(seqs) == [[3, 1], [], [0]]


def test_config_json_and_short_form() -> None:
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                  '"prompt_lookup_min": 2, "prompt_lookup_max": 5}')
    assert (cfg.method, cfg.num_tokens, cfg.lookup_window) == ("ngram", 4, (2, 5))
    short = SpeculativeConfig.parse("ngram")
    assert (short.num_tokens, short.lookup_window) == (4, (5, 5))
    assert SpeculativeConfig.parse('{"method": "ngram", "prompt_lookup_max": 3}'
                                   ).lookup_window == (3, 3)
    assert SpeculativeConfig.parse('{"method": "suffix"}').num_tokens == 24
    assert SpeculativeConfig.parse(cfg.to_json()) == cfg
    proposer = make_proposer(cfg)
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (2, 5)


@pytest.mark.parametrize(("text", "message"), [
    ('{"method": "eagle"}', "method must be one of ngram, suffix, draft_model, got 'eagle'"),
    ('{"num_speculative_tokens": 3}', '"method" is required'),
    ('{"method": "ngram", "num_speculative_token": 3}',
     "unknown field(s) num_speculative_token"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be an integer >= 1, got 0"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}',
     "num_speculative_tokens must be an integer >= 1, got '4'"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ('{"method": "ngram", "prompt_lookup_min": 0}',
     "prompt_lookup_min must be an integer >= 1, got 0"),
    ('{"method": "draft_model"}', 'method \'draft_model\' needs "model"'),
    ('{"method": "ngram", "model": "x.gguf"}', '"model" is a draft_model setting'),
    ('{"method": "suffix", "prompt_lookup_max": 3}',
     "are ngram and draft_model settings, not 'suffix' ones"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}',
     "suffix_decoding_min_token_prob must be a number in [0.0, 1.0], got 2"),
    ('{"method": ', "speculative config is not valid JSON"),
    ('[1]', "must be a JSON object"),
    ("ngrams", "method must be one of"),
])
def test_config_errors_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.parse(text)
    assert message in str(info.value)
