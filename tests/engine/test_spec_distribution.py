"""Speculative sampling keeps the output distribution (engine/spec/verify.py): token
histograms of 600 sampled continuations with and without speculation pass a chi-square
test of homogeneity, while a control that changes the distribution (another temperature)
fails it. Fixed seeds: the test's outcome is deterministic."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from helpers.engine import make_llm, prompt
from helpers.spec import spec_counts, spec_llm

from plait import SamplingParams
from plait.engine.spec.proposer import Proposer, SpecInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_SAMPLES = 600
PROMPT = prompt(50, 8)


class ModeDraft(Proposer):
    """Drafts, after each output so far, the continuation most often seen after it in a
    set of samples (greedy over those counts): often right, often wrong."""

    def __init__(self, samples: list[list[int]]) -> None:
        counts: dict[tuple[int, ...], Counter] = {}
        for tokens in samples:
            for i in range(len(tokens)):
                counts.setdefault(tuple(tokens[:i]), Counter())[tokens[i]] += 1
        self.mode = {prefix: c.most_common(1)[0][0] for prefix, c in counts.items()}

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            known = tuple(seq.token_ids[seq.num_prompt_tokens:])
            draft: list[int] = []
            while len(draft) < seq.max_draft_tokens and known in self.mode:
                draft.append(self.mode[known])
                known = (*known, draft[-1])
            drafts.append(draft)
        return drafts


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of Pearson's chi-square test that two samples share one distribution;
    categories with an expected count below 5 are pooled into one."""
    total_a, total_b = sum(a.values()), sum(b.values())
    pooled: dict[object, tuple[int, int]] = {}
    rare = [0, 0]
    for key in set(a) | set(b):
        ca, cb = a[key], b[key]
        if min(total_a, total_b) * (ca + cb) / (total_a + total_b) < 5:
            rare[0] += ca
            rare[1] += cb
        else:
            pooled[key] = (ca, cb)
    if sum(rare):
        pooled["rare"] = (rare[0], rare[1])
    stat = 0.0
    for ca, cb in pooled.values():
        n = ca + cb
        for count, total in ((ca, total_a), (cb, total_b)):
            expected = n * total / (total_a + total_b)
            stat += (count - expected) ** 2 / expected
    dof = len(pooled) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def histograms(outputs) -> tuple[Counter, Counter]:
    """Whole outputs (4 tokens: the last 3 come from verification steps), and the last
    token alone."""
    whole = Counter(tuple(o.outputs[0].token_ids) for o in outputs)
    last = Counter(o.outputs[0].token_ids[-1] for o in outputs)
    return whole, last


def test_speculative_sampling_keeps_the_distribution(tiny_path) -> None:
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=4, ignore_eos=True)
    plain = make_llm(tiny_path, num_kv_blocks=512, seed=1).generate(
        [PROMPT] * NUM_SAMPLES, params)
    proposer = ModeDraft([o.outputs[0].token_ids for o in plain])
    llm = spec_llm(tiny_path, proposer, k=3, num_kv_blocks=2048, seed=2)
    spec = llm.generate([PROMPT] * NUM_SAMPLES, params)
    _, draft_tokens, accepted = spec_counts(llm)
    assert 0.2 * draft_tokens < accepted < 0.9 * draft_tokens  # both outcomes, often
    plain_pairs, plain_thirds = histograms(plain)
    spec_pairs, spec_thirds = histograms(spec)
    assert len(plain_pairs) >= 8  # a spread-out distribution, not one dominant path
    assert chi_square_p(plain_pairs, spec_pairs) > 0.001
    assert chi_square_p(plain_thirds, spec_thirds) > 0.001
    # control: the test tells a different distribution apart
    colder = make_llm(tiny_path, num_kv_blocks=512, seed=3).generate(
        [PROMPT] * NUM_SAMPLES, SamplingParams(temperature=0.3, top_k=2, max_tokens=4,
                                               ignore_eos=True))
    assert chi_square_p(plain_pairs, histograms(colder)[0]) < 0.001
