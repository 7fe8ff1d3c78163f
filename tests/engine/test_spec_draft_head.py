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


def check_head(head: DraftHead, lm_head, n: int, hidden: torch.Tensor) -> None:
    """`head` (N = n) against the whole head's logits on `hidden` [S, H]."""
    full = lm_head(hidden).float()  # [S, V]
    assert head.num_rows == n
    assert torch.equal(head._scores(hidden).float(), full[:, :n])  # the same columns
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


def test_a_dense_head_is_cut_and_the_whole_vocabulary_kept_otherwise(tiny_path) -> None:
    lm_head = make_llm(tiny_path).engine.runner.model.lm_head
    assert lm_head.weight is not None
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
              "disable_by_batch_size": 10_000, "draft_vocab_size": 64}
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
