"""The `draft_model` proposer (engine/spec/draft_model.py) on two tiny random models that
share a vocabulary: its drafts are exactly the draft model's own greedy tokens, its cache
catches up incrementally after verification, and the engine's greedy output is unchanged.
The draft runs with the target engine's config, and a draft model of another vocabulary
(size, or token strings at the same ids) is refused before it loads."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from helpers.engine import assert_pool_clean, make_llm, prompt
from helpers.spec import calls, spec_counts
from helpers.tiny_model import make_tiny_model

from plait import LLM, SamplingParams
from plait.engine.config import EngineConfig
from plait.engine.model_loader import load_tokenizer
from plait.engine.request import Request, RequestStatus
from plait.engine.spec import draft_model
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.draft_model import CATCH_UP_ROW_SHARE, DraftModelProposer
from plait.engine.spec.driver import SpecDecoder
from plait.engine.spec.proposer import SpecInput
from plait.engine.spec.target import DraftVocabMismatch, TargetModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory, default_model):
    """A second tiny model on the same tokenizer, with other random weights (seed 1)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), default_model.path, seed=1)


def greedy(path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in make_llm(path).generate(prompts, params)]


def make_proposer(path, k: int = 4, num_kv_tokens: int = 256, p_min: float = 0.0,
                  lookup: tuple[int, int] | None = None,
                  cost: float | None = None) -> DraftModelProposer:
    low, high = lookup if lookup is not None else (None, None)
    config = SpeculativeConfig(method="draft_model", model=str(path),
                               num_speculative_tokens=k, draft_p_min=p_min,
                               prompt_lookup_min=low, prompt_lookup_max=high,
                               draft_token_cost=cost)
    target = TargetModel(EngineConfig(block_size=4), "target", 49152,
                         lambda: load_tokenizer(path), num_kv_tokens=1024)
    return DraftModelProposer(config, target, num_kv_tokens)


def test_drafts_are_the_draft_models_greedy_tokens_batched(draft_path) -> None:
    prompts = [prompt(1, 9), prompt(2, 14)]
    want = greedy(draft_path, prompts, 12)
    proposer = make_proposer(draft_path)
    # both sequences in one call, one with a smaller budget
    first = proposer.propose([SpecInput("a", prompts[0] + want[0][:1], 9, 4),
                              SpecInput("b", prompts[1] + want[1][:2], 14, 3)])
    assert first == [want[0][1:5], want[1][2:5]]
    # "a" had 2 of 4 accepted, then the target added its own token: the cache resumes
    proposer.on_verified("a", 4, 2)
    assert proposer._seqs["a"].num_cached == 10 + 2  # prompt + first token, 2 accepted
    assert proposer.propose([SpecInput("a", prompts[0] + want[0][:4], 9, 4)]) == [
        want[0][4:8]]
    # a target token that differs from the draft: the rejected positions are rewritten
    proposer.on_verified("a", 4, 0)
    other = prompts[0] + want[0][:4] + [7]
    again = proposer.propose([SpecInput("a", other, 9, 2)])
    fresh = make_proposer(draft_path).propose([SpecInput("z", other, 9, 2)])
    assert again == fresh


def test_p_min_ends_a_draft_before_the_first_doubtful_token(draft_path) -> None:
    """With `draft_p_min`, a draft is the draft model's greedy tokens up to, not
    including, the first whose probability (its own logprob, from a run of the draft model
    alone) is below p_min; a doubtful first token gives an empty draft."""
    ids = prompt(1, 9)
    out = make_llm(draft_path).generate([ids], SamplingParams(
        temperature=0, max_tokens=9, ignore_eos=True, logprobs=0))[0].outputs[0]
    tokens = out.token_ids
    assert out.logprobs is not None
    probs = [math.exp(lp.logprob) for lp in out.logprobs]
    # drafting after tokens[0]: tokens[1:9], of probabilities probs[1:9]. The cut c (2..8)
    # where probs[c] falls furthest below every probs[1..c-1]: p_min between them
    c = max(range(2, 9), key=lambda i: min(probs[1:i]) / probs[i])
    assert min(probs[1:c]) > 1.02 * probs[c], "no clear cut in this model's probabilities"
    seq = SpecInput("a", ids + tokens[:1], 9, 8)
    for p_min, want in ((math.sqrt(min(probs[1:c]) * probs[c]), tokens[1:c]),
                        (1.02 * probs[1], []), (0.0, tokens[1:9])):
        proposer = make_proposer(draft_path, k=8, p_min=p_min)
        assert proposer.propose([seq]) == [want], p_min


def test_an_empty_draft_of_a_draft_model_counts_as_a_miss(tiny_path, draft_path) -> None:
    """A draft model's pass costs time even when it drafts nothing (every token doubted):
    the sequence then backs off as after a missed draft (k halves, then pauses), where an
    empty lookup (ngram) changes nothing."""
    config = SpeculativeConfig(method="draft_model", model=str(draft_path),
                               num_speculative_tokens=4, draft_p_min=1.0)
    target = TargetModel(EngineConfig(block_size=4), "target", 49152,
                         lambda: load_tokenizer(draft_path), num_kv_tokens=1024)
    spec = SpecDecoder(config, 1024, target=target)
    req = Request("a", prompt(2, 12), SamplingParams(max_tokens=64), max_tokens=64)
    req.status, req.output_token_ids, req.num_computed_tokens = RequestStatus.RUNNING, [5], 12
    budgets = []
    for _ in range(5):
        assert spec.drafts([req]) == {}
        budgets.append(spec.policy._seqs["a"].k)
    assert budgets == [2, 1, 1, 1, 1]
    assert spec.policy._seqs["a"].pause_left > 0  # from k = 1: a pause
    ngram = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 1024)
    assert ngram.drafts([req]) == {} and ngram.policy._seqs["a"].k == 4


def test_a_prompt_lookup_drafts_first_and_the_cache_catches_up_after(draft_path) -> None:
    """With prompt_lookup_min/max a draft model proposes the lookup's draft where it
    finds one (no pass of the draft model, no catch-up cost), and its own greedy draft
    elsewhere, catching up then on every token since its last pass."""
    proposer = make_proposer(draft_path, lookup=(2, 3), cost=0.5)
    log = calls(proposer, "_greedy")

    def passes() -> list[int]:  # tokens per pass of the draft model
        return [sum(len(r.token_ids) for r in rows) for (rows,), _ in log]

    ids = prompt(5, 12)
    want = greedy(draft_path, [ids], 8)[0]
    first = SpecInput("a", ids + want[:1], 12, 4)
    assert proposer.setup_cost(first) > 0
    assert proposer.propose([first]) == [want[1:5]] and passes() == [13, 1, 1, 1]
    proposer.on_verified("a", 4, 4)  # the cache holds 13 + 3 fed tokens for sure
    seen = ids + want[:6]  # every draft token accepted, then the target's own
    repeat = SpecInput("a", seen + ids[3:6], 12, 4)  # ends with a span of the prompt
    assert proposer.setup_cost(repeat) == 0.0
    assert proposer.propose([repeat]) == [ids[6:10]] and len(passes()) == 4
    proposer.on_verified("a", 4, 1)
    assert proposer._seqs["a"].num_cached == 16  # unchanged by the lookup's draft
    after = SpecInput("a", seen + ids[3:7] + [9], 12, 3)  # no match of its last tokens
    assert proposer.setup_cost(after) == pytest.approx(7 * CATCH_UP_ROW_SHARE * 0.5)
    assert proposer.propose([after]) == make_proposer(draft_path).propose([after])
    assert passes()[4:] == [7, 1, 1]  # one pass catches up on the 7 tokens since


def test_the_prompt_lookup_runs_once_a_step(draft_path, monkeypatch) -> None:
    """`setup_cost` and `propose` of one step share each sequence's lookup; the next
    step, one token longer, looks up again."""
    lengths: list[int] = []  # the tokens of each lookup's sequence
    real = draft_model.ngram_draft
    monkeypatch.setattr(draft_model, "ngram_draft",
                        lambda tokens, *rest: lengths.append(len(tokens)) or real(tokens, *rest))
    proposer = make_proposer(draft_path, lookup=(2, 3), cost=0.5)
    ids = prompt(5, 12)
    seqs = [SpecInput("a", ids + ids[3:6], 12, 4), SpecInput("b", [*ids, ids[0]], 12, 4)]
    costs = [proposer.setup_cost(seq) for seq in seqs]
    drafts = proposer.propose(seqs)
    assert lengths == [15, 13]
    assert costs[0] == 0.0 and drafts[0] == ids[6:10]
    step = SpecInput("a", ids + ids[3:7], 12, 4)
    assert proposer.setup_cost(step) == 0.0
    assert proposer.propose([step]) == [ids[7:11]]
    assert lengths == [15, 13, 16]
    proposer.finish("a")
    proposer.finish("b")
    assert proposer._lookups == {}  # one entry a request, gone with it


def test_blocks_are_returned_and_a_full_cache_gives_no_draft(draft_path) -> None:
    proposer = make_proposer(draft_path, num_kv_tokens=32)  # 8 blocks of 4
    seq = SpecInput("a", prompt(3, 20), 20, 4)  # 20 + 3 positions: 6 blocks
    assert len(proposer.propose([seq])[0]) == 4
    assert proposer.num_free_blocks == 2
    assert proposer.propose([SpecInput("b", prompt(4, 20), 20, 4)]) == [[]]  # no room
    proposer.finish("a")
    proposer.finish("b")
    assert proposer.num_free_blocks == 8
    assert len(proposer.propose([SpecInput("b", prompt(4, 20), 20, 4)])[0]) == 4


@pytest.mark.parametrize("same", [True, False])
def test_greedy_equal_with_a_draft_model(tiny_path, draft_path, same: bool) -> None:
    prompts = [prompt(1, 9), prompt(2, 14), prompt(3, 5)]
    want = greedy(tiny_path, prompts, 24)
    # the two tiny models cost the same, so by default the policy would never let one
    # draft for the other (test_a_draft_model_as_costly_as_the_target_never_drafts);
    # draft_token_cost 0 keeps every draft, which is what verification is tested on
    config = {"method": "draft_model", "model": str(tiny_path if same else draft_path),
              "num_speculative_tokens": 4, "disable_by_batch_size": 10_000,
              "draft_token_cost": 0}
    llm = LLM(str(tiny_path), speculative_config=config, num_kv_blocks=64, block_size=4)
    assert isinstance(llm.engine.spec.proposer, DraftModelProposer)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]
    assert got == want
    drafts, draft_tokens, accepted = spec_counts(llm)
    assert drafts > 0
    if same:  # the target drafting for itself: every draft token is its own greedy token
        assert accepted == draft_tokens
    else:
        assert accepted < draft_tokens
    assert_pool_clean(llm)


def test_the_draft_runs_with_the_targets_engine_config(tiny_path, draft_path) -> None:
    config = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 3}
    llm = LLM(str(tiny_path), speculative_config=config, num_kv_blocks=40, block_size=8,
              kv_cache_dtype="bfloat16", native=False, max_model_len=200)
    proposer = llm.engine.spec.proposer
    assert isinstance(proposer, DraftModelProposer)
    target = llm.engine.runner
    for name in ("device", "dtype", "weights", "numerics", "kv_cache_dtype", "native",
                 "cpu_gemm", "block_size", "attention_backend", "seed"):
        assert getattr(proposer.config, name) == getattr(llm.config, name), name
    assert proposer.config.model == str(draft_path)
    assert proposer.config.speculative_config is None
    runner = proposer.runner
    assert runner.kv_dtype == target.kv_dtype == torch.bfloat16
    assert runner.dtype == target.dtype
    assert runner.ops.native is False
    # its own pool, as many tokens as the target's (40 blocks of 8), its own context
    assert runner.block_size == 8 and runner.num_blocks == 40
    assert runner.kv_cache.data_ptr() != target.kv_cache.data_ptr()
    assert runner.max_model_len == 320


def _swap_two_tokens(src, out):
    """A copy of model dir `src` whose tokenizer numbers two ordinary tokens the other way
    round: same size, same strings, two ids differ."""
    shutil.copytree(src, out)
    data = json.loads((out / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out, by_id[1000], by_id[1001]


def test_a_draft_with_other_token_ids_is_refused(tiny_path, draft_path, tmp_path) -> None:
    other, first, second = _swap_two_tokens(draft_path, tmp_path / "swapped")
    config = {"method": "draft_model", "model": str(other)}
    with pytest.raises(DraftVocabMismatch) as info:
        LLM(str(tiny_path), speculative_config=config, num_kv_blocks=16, block_size=4)
    message = str(info.value)
    assert f"draft model {other.name!r}" in message
    assert f"target model {tiny_path.name!r}" in message
    assert (f"2 token id(s) differ between their tokenizers (49152 vs 49152 tokens; "
            f"id 1000: {second!r} vs {first!r}, id 1001: {first!r} vs {second!r})") in message


def test_a_draft_of_another_vocabulary_size_is_refused(tiny_path, tmp_path,
                                                        default_model) -> None:
    bigger = make_tiny_model(tmp_path / "bigger", default_model.path, vocab_size=49216)
    config = {"method": "draft_model", "model": str(bigger)}
    with pytest.raises(DraftVocabMismatch, match=(
            f"draft model {bigger.name!r} does not share the vocabulary of the target "
            f"model {tiny_path.name!r}: vocabulary size 49216 vs 49152")):
        LLM(str(tiny_path), speculative_config=config, num_kv_blocks=16, block_size=4)


def test_a_draft_token_costs_the_draft_models_share_of_the_weight_bytes(draft_path) -> None:
    """The draft model's `draft_token_cost` is its weights' bytes over the target's (a
    decode step reads each once), the policy's c; 0 where the target's are unknown."""
    config = SpeculativeConfig(method="draft_model", model=str(draft_path),
                               num_speculative_tokens=4)
    unknown = make_proposer(draft_path)
    assert unknown.draft_token_cost == 0.0
    own = unknown.runner.weight_bytes
    assert own > 0
    target = TargetModel(EngineConfig(block_size=4), "target", 49152,
                         lambda: load_tokenizer(draft_path), num_kv_tokens=1024,
                         weight_bytes=4 * own)
    spec = SpecDecoder(config, 1024, target=target)
    assert spec.proposer.draft_token_cost == 0.25
    assert spec.policy.draft_token_cost == 0.25
    assert spec.wants_confidence
    # the catch-up before a draft: the tokens the draft cache lacks, each a share of a pass
    row = CATCH_UP_ROW_SHARE * 0.25
    seq = SpecInput("a", prompt(3, 20), 20, 2)
    assert spec.proposer.setup_cost(seq) == pytest.approx(20 * row)
    assert spec.proposer.propose([seq])[0]
    longer = SpecInput("a", [*prompt(3, 20), 5, 6, 7], 20, 2)
    assert spec.proposer.setup_cost(longer) == pytest.approx(3 * row)
    given = SpecDecoder(dataclasses.replace(config, draft_token_cost=0.6), 1024,
                        target=target)
    assert given.policy.draft_token_cost == 0.6
    free = SpecDecoder(dataclasses.replace(config, draft_token_cost=0), 1024, target=target)
    assert free.policy.draft_token_cost == 0 and not free.wants_confidence


def test_a_draft_model_as_costly_as_the_target_never_drafts(tiny_path, draft_path) -> None:
    """The engine reports, at every plain step, the target's probability of its most
    likely token (the exp of the top logprob of an unprocessed greedy row); the policy
    lets a draft model draft only while that averages at least a draft token's cost. Two
    tiny models of the same size (c = 1): never, and the draft model never runs."""
    config = {"method": "draft_model", "model": str(draft_path), "num_speculative_tokens": 4,
              "disable_by_batch_size": 10_000}
    llm = LLM(str(tiny_path), speculative_config=config, num_kv_blocks=64, block_size=4)
    spec = llm.engine.spec
    assert spec.policy.draft_token_cost == 1.0 and llm.engine.runner.report_confidence
    observed, passes = calls(spec, "observe"), calls(spec.proposer, "_greedy")
    out = llm.generate([prompt(1, 9)], SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True, logprobs=1))
    tops = [math.exp(lp.top[0][1]) for lp in out[0].outputs[0].logprobs]
    assert [p for (_, p), _ in observed] == pytest.approx(tops, rel=1e-5)
    assert len(observed) == 12
    assert spec_counts(llm)[0] == 0 and passes == []
    assert_pool_clean(llm)
