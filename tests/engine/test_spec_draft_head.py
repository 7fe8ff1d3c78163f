"""The draft model's LM head over part of the vocabulary (engine/spec/draft_head.py): the
prefix is read in place and scores as the whole head does, the draft picks the best of
ids < N and the sequence's own ids past N (and nothing else), the setting's default and
validation, and greedy output with a cut draft head is still the target's."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers.engine import make_llm, prompt
from helpers.spec import spec_counts

from plait import LLM, SamplingParams
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.draft_head import DraftHead, SeqTokens, draft_vocab_rows
from plait.engine.spec.draft_model import DraftModelProposer
from plait.kernels.cpu import build, repack

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_draft_vocab_rows() -> None:
    assert draft_vocab_rows(151936, None) == 32768  # a large vocabulary: the default cut
    assert draft_vocab_rows(49152, None) == 49152  # 65536 or fewer: all of it
    assert draft_vocab_rows(65536, None) == 65536
    assert draft_vocab_rows(151936, 1000) == 1024  # whole 32-row units
    assert draft_vocab_rows(151936, 10**6) == 151936
    assert draft_vocab_rows(100, 99) == 100


def test_draft_vocab_size_is_a_draft_model_setting() -> None:
    config = SpeculativeConfig.parse('{"method": "draft_model", "model": "m", '
                                     '"draft_vocab_size": 4096}')
    assert config.draft_vocab_size == 4096
    assert '"draft_vocab_size": 4096' in config.to_json()
    with pytest.raises(ValueError, match="draft_vocab_size must be an integer >= 1, got 0"):
        SpeculativeConfig(method="draft_model", model="m", draft_vocab_size=0)
    with pytest.raises(ValueError, match="draft_vocab_size is a draft_model setting, not "
                                         "a 'ngram' one"):
        SpeculativeConfig(method="ngram", draft_vocab_size=4096)


def test_draft_p_min_is_a_draft_model_setting() -> None:
    config = SpeculativeConfig.parse('{"method": "draft_model", "model": "m", '
                                     '"draft_p_min": 0.75}')
    assert config.draft_p_min == 0.75
    assert '"draft_p_min": 0.75' in config.to_json()
    assert "draft_p_min" not in SpeculativeConfig(method="draft_model", model="m").to_json()
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match=r"draft_p_min must be a number in \[0.0, 1.0\]"):
            SpeculativeConfig(method="draft_model", model="m", draft_p_min=bad)
    with pytest.raises(ValueError, match="draft_p_min is a draft_model setting, not a "
                                         "'suffix' one"):
        SpeculativeConfig(method="suffix", draft_p_min=0.5)


def test_best_gives_each_tokens_softmax_probability(tiny_path) -> None:
    """`best`'s probability: the softmax, over the ids the head scored for the row (ids < N
    and the sequence's own), at the token `argmax` picks (float64 reference)."""
    lm_head = make_llm(tiny_path).engine.runner.model.lm_head
    n = 1024
    hidden = hidden_past(lm_head, n, 2, lm_head.in_features)
    full = lm_head(hidden).double()  # [2, V]
    head = DraftHead(lm_head, n)
    own = SeqTokens()
    past = int(full[0].argmax())  # >= n: the best of row 0 is one of its sequence's own
    head.update(own, [3, past, n + 5])
    seqs = [own, SeqTokens()]
    tokens, probs = head.best(hidden, seqs)
    assert tokens == head.argmax(hidden, seqs) == [past, int(full[1, :n].argmax())]
    assert probs is not None
    row0 = torch.cat([full[0, :n], full[0, [past, n + 5]]])
    assert probs[0] == pytest.approx(float(torch.softmax(row0, 0).max()), rel=1e-4)
    assert probs[1] == pytest.approx(float(torch.softmax(full[1, :n], 0).max()), rel=1e-4)
    whole = DraftHead(lm_head, lm_head.out_features)
    tokens, probs = whole.best(hidden, seqs)
    assert probs == pytest.approx(torch.softmax(full, -1).max(-1).values.tolist(), rel=1e-4)
    assert whole.best(hidden, seqs, probs=False) == (tokens, None)


def check_head(head: DraftHead, lm_head, n: int, hidden: torch.Tensor) -> None:
    """`head` (N = n) against the whole head's logits on `hidden` [S, H]."""
    full = lm_head(hidden).float()  # [S, V]
    assert head.num_rows == n
    scores = head._scores(hidden).float()
    if lm_head.product.name.startswith(("repacked/", "torch")):
        assert torch.equal(scores, full[:, :n])  # the same columns, the same bits
    else:  # a packed dense row: the prefix read in place through plain torch
        torch.testing.assert_close(scores, full[:, :n], rtol=1e-5, atol=1e-5)
    top_below = full[:, :n].argmax(-1)
    # no ids of its own: the best id < n, whatever the rest of the vocabulary says
    nothing = [SeqTokens() for _ in range(hidden.shape[0])]
    assert head.argmax(hidden, nothing) == top_below.tolist()
    # a sequence holding the overall best id (>= n) drafts it; one holding an id past n
    # that scores below its best id < n keeps that one
    best = full.argmax(-1).tolist()
    worst = full.argmin(-1).tolist()
    for i in range(hidden.shape[0]):
        assert best[i] >= n, "pick hidden rows whose overall best lies past the prefix"
        holds_best, holds_worst = SeqTokens(), SeqTokens()
        head.update(holds_best, [5, best[i], best[i], 7])  # duplicates kept once
        head.update(holds_worst, [worst[i] if worst[i] >= n else n])
        assert holds_best.ids == [best[i]] and holds_best.scanned == 4
        got = head.argmax(hidden[i:i + 1], [holds_best])
        assert got == [best[i]]
        assert head.argmax(hidden[i:i + 1], [holds_worst]) == [int(top_below[i])]
    # update scans only what is new
    seq = SeqTokens()
    head.update(seq, [n + 1, 3])
    head.update(seq, [n + 1, 3, n + 2, n + 1])
    assert seq.ids == [n + 1, n + 2] and seq.scanned == 4
    assert seq.rows is not None and seq.rows.shape == (2, lm_head.in_features)


def hidden_past(lm_head, n: int, rows: int, dim: int) -> torch.Tensor:
    """Random hidden rows whose overall best token lies past the first n."""
    gen = torch.Generator().manual_seed(0)
    picked = []
    while len(picked) < rows:
        h = torch.randn(1, dim, generator=gen) * 4
        if int(lm_head(h).float().argmax()) >= n:
            picked.append(h)
    return torch.cat(picked)


@pytest.mark.skipif(not build.available() or repack.isa() < repack.ISA_VNNI512,
                    reason="no AVX512-VNNI repacked kernel in this build")
def test_a_repacked_head_is_cut_in_place() -> None:
    llm = LLM(numerics="int8", weights="auto", num_kv_blocks=16, warm_up_tokens=0)
    lm_head = llm.engine.runner.model.lm_head
    assert lm_head.product.name.startswith("repacked/")
    head = DraftHead(lm_head, 4096)
    assert head.describe() == ("ids < 4096 of 49152 and each sequence's own ids past "
                               "them")
    check_head(head, lm_head, 4096, hidden_past(lm_head, 4096, 3, lm_head.in_features))


@pytest.mark.parametrize("options", [{}, {"native": False, "cpu_gemm": "none"}],
                         ids=["panels", "torch"])
def test_a_dense_head_is_cut_and_the_whole_vocabulary_kept_otherwise(tiny_path,
                                                                     options) -> None:
    lm_head = make_llm(tiny_path, **options).engine.runner.model.lm_head
    assert lm_head.weight is not None
    assert (lm_head.product.name == "torch") == bool(options)
    head = DraftHead(lm_head, 1024)
    check_head(head, lm_head, 1024, hidden_past(lm_head, 1024, 3, lm_head.in_features))
    whole = DraftHead(lm_head, lm_head.out_features)
    assert whole.describe() == f"the whole vocabulary ({lm_head.out_features})"
    h = torch.randn(2, lm_head.in_features)
    seqs = [SeqTokens(), SeqTokens()]
    whole.update(seqs[0], [40000, 3])
    assert seqs[0].ids == [] and seqs[0].scanned == 2  # nothing kept: all ids are scored
    assert whole.argmax(h, seqs) == lm_head(h).float().argmax(-1).tolist()


def test_greedy_equal_with_a_cut_draft_head(tiny_path, caplog) -> None:
    """The target drafting for itself through a head cut at 64 ids (said in the startup
    log): its drafts are the target's own greedy tokens only where those lie in the
    subset, and the output is the target's greedy output either way."""
    prompts = [prompt(1, 9), prompt(2, 14)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in make_llm(tiny_path).generate(prompts, params)]
    config = {"method": "draft_model", "model": str(tiny_path), "num_speculative_tokens": 4,
              "disable_by_batch_size": 10_000, "draft_vocab_size": 64,
              "draft_token_cost": 0}  # as costly as the target: drafts kept all the same
    with caplog.at_level(logging.INFO, logger="plait.engine"):
        llm = LLM(str(tiny_path), speculative_config=config, num_kv_blocks=64, block_size=4)
    assert (f"draft model {tiny_path.name}: its LM head scores ids < 64 of 49152 and each "
            f"sequence's own ids past them") in caplog.text
    proposer = llm.engine.spec.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.head.num_rows == 64
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert got == want
    drafts, draft_tokens, accepted = spec_counts(llm)
    assert drafts > 0
    # the greedy tokens are mostly past id 64 and not in the prompts: drafts miss there
    assert accepted < draft_tokens
