"""The `suffix` proposer (engine/spec/suffix.py) in the engine: greedy output equal token
for token with and without it, on a tiny random model whose prompts repeat themselves, and
drafts from an earlier request's output (the global trie) verified like any other."""

from __future__ import annotations

import pytest
from helpers.engine import assert_pool_clean, make_llm, prompt
from helpers.spec import spec_counts

from plait import LLM, SamplingParams
from plait.engine.spec.suffix import SuffixProposer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6,
          "suffix_decoding_max_tree_depth": 8, "disable_by_batch_size": 10_000}


def test_greedy_equal_with_suffix_drafts(tiny_path) -> None:
    looped = prompt(4, 6) * 4  # the same 6 tokens four times: the trie has drafts at once
    prompts = [looped, prompt(1, 9), prompt(2, 14)]
    want = [o.outputs[0].token_ids for o in make_llm(tiny_path).generate(prompts, PARAMS)]
    llm = LLM(str(tiny_path), speculative_config=SUFFIX, num_kv_blocks=64, block_size=4)
    assert isinstance(llm.engine.spec.proposer, SuffixProposer)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    assert got == want
    drafts, draft_tokens, accepted = spec_counts(llm)
    assert drafts > 0 and draft_tokens > 0 and 0 <= accepted <= draft_tokens
    # a second run of the same prompts: each request also finds the first run's outputs
    # in the global trie; the output is still exactly the greedy one
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]
    assert again == want
    assert spec_counts(llm)[2] > accepted
    assert_pool_clean(llm)
