"""The `suffix` proposer (engine/spec/suffix.py): exact drafts from a request's own tokens
and from earlier requests' outputs, incremental updates, the FIFO cache and its bounds."""

from __future__ import annotations

from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.factory import make_proposer
from plait.engine.spec.proposer import SpecInput
from plait.engine.spec.suffix import SuffixProposer


def make(max_cached: int = 10, depth: int = 8, factor: float = 1.0,
         min_prob: float = 0.1, max_global_nodes: int = 1 << 20) -> SuffixProposer:
    config = SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=depth,
                               suffix_decoding_max_cached_requests=max_cached,
                               suffix_decoding_max_spec_factor=factor,
                               suffix_decoding_min_token_prob=min_prob)
    return SuffixProposer(config, max_global_nodes=max_global_nodes)


def one(proposer: SuffixProposer, request_id: str, token_ids: list[int], num_prompt: int,
        k: int = 8) -> list[int]:
    return proposer.propose([SpecInput(request_id, token_ids, num_prompt, k)])[0]


def test_draft_from_the_prompt() -> None:
    proposer = make(max_cached=0)
    prompt = [10, 11, 12, 13, 14, 15, 16, 20, 21]
    # the output so far repeats "11 12 13": the prompt goes on with 14 15 16 ...
    assert one(proposer, "a", [*prompt, 11, 12, 13], len(prompt)) == [14, 15, 16]
    assert one(proposer, "b", [*prompt, 11, 12, 13], len(prompt), k=2) == [14, 15]
    assert one(proposer, "c", [*prompt, 99], len(prompt)) == []  # 99 never seen


def test_length_follows_the_match_length_times_the_spec_factor() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    tokens = [*prompt, 3, 4]  # matches "3 4" (2 tokens)
    assert one(make(max_cached=0, factor=1.0), "a", tokens, 9) == [5, 6]
    assert one(make(max_cached=0, factor=2.5), "a", tokens, 9) == [5, 6, 7, 8, 9]
    assert one(make(max_cached=0, factor=0.4), "a", tokens, 9) == []  # floor(0.8) = 0


def test_incremental_updates_give_the_drafts_of_a_fresh_proposer() -> None:
    prompt = [5, 1, 2, 3, 1, 2, 4, 1, 2, 3]
    output = [1, 2, 3, 1, 2, 4, 1, 2]
    grown = make(max_cached=0)
    for end in range(len(output) + 1):
        tokens = prompt + output[:end]
        assert one(grown, "r", tokens, len(prompt)) == one(make(max_cached=0), "r", tokens,
                                                           len(prompt)), end
    # the request's own trie holds what one built from scratch holds
    fresh = make(max_cached=0)
    one(fresh, "r", prompt + output, len(prompt))
    assert grown._running["r"].local.num_nodes == fresh._running["r"].local.num_nodes


def test_an_earlier_requests_output_drafts_for_a_new_request() -> None:
    proposer = make()
    first_output = [40, 41, 42, 43, 44, 45]
    one(proposer, "first", [1, 2, *first_output], 2)
    proposer.finish("first")
    # a new request whose prompt never had 42 43 44: only the global trie knows them
    assert one(proposer, "second", [7, 8, 9, 40, 41], 5) == [42, 43]  # match 2: 2 tokens
    assert one(proposer, "third", [7, 40, 41, 42, 43], 1) == [44, 45]
    # the prompt is not cached globally: "1 2" continues nowhere for a new request
    assert one(proposer, "fourth", [1, 2], 2) == []


def test_the_local_draft_wins_a_tie_and_the_stronger_one_wins_otherwise() -> None:
    proposer = make()
    one(proposer, "old", [0, 5, 6, 7, 8], 1)  # global: 5 6 7 8
    proposer.finish("old")
    # its own prompt says 5 6 -> 9 9; the global trie says 5 6 -> 7 8: equal scores
    assert one(proposer, "new", [5, 6, 9, 9, 0, 5, 6], 7) == [9, 9]
    # twice 5 6 7 8 in the cache: p = 1 there against 1 locally, still a tie -> local
    one(proposer, "old2", [0, 5, 6, 7, 8], 1)
    proposer.finish("old2")
    assert one(proposer, "new2", [5, 6, 9, 9, 0, 5, 6], 7) == [9, 9]
    # locally 5 6 -> 9 once and -> 3 once (p 1/2 each): the global 7 8 (p 1) scores higher
    tokens = [5, 6, 9, 5, 6, 3, 0, 5, 6]
    assert one(proposer, "new3", tokens, 9) == [7, 8]


def test_fifo_eviction_by_request_count() -> None:
    proposer = make(max_cached=2)
    for request_id, output in (("a", [30, 31, 32]), ("b", [40, 41, 42]), ("c", [50, 51, 52])):
        one(proposer, request_id, [0, *output], 1)
        proposer.finish(request_id)
    assert list(proposer._cached) == ["b", "c"]
    assert one(proposer, "x", [1, 30, 31], 3) == []  # a's output is gone
    assert one(proposer, "y", [1, 40, 41], 3) == [42]


def test_no_global_cache_when_max_cached_requests_is_zero() -> None:
    proposer = make(max_cached=0)
    one(proposer, "a", [0, 30, 31, 32], 1)
    proposer.finish("a")
    assert proposer.global_trie.num_nodes == 1
    assert one(proposer, "b", [1, 30, 31], 3) == []


def test_node_budget_pushes_out_the_oldest_outputs() -> None:
    # depth 2: an output of 3 distinct new tokens adds 3 + 2 = 5 nodes
    proposer = make(depth=2, max_global_nodes=12)
    for request_id, base in (("a", 30), ("b", 40), ("c", 50)):
        one(proposer, request_id, [0, base, base + 1, base + 2], 1)
        proposer.finish(request_id)
    assert list(proposer._cached) == ["b", "c"]  # 1 + 5 + 5 nodes fit, 16 do not
    assert proposer.global_trie.num_nodes == 11


def test_a_preempted_request_resumes_without_counting_its_output_twice() -> None:
    proposer = make()
    tokens = [0, 60, 61, 62, 60, 61]
    one(proposer, "r", tokens, 1)
    nodes = proposer.global_trie.num_nodes
    proposer.finish("r")  # preempted
    one(proposer, "r", tokens, 1)  # back with the same tokens
    assert proposer.global_trie.num_nodes == nodes
    node = proposer.global_trie.child(0, 60)
    assert node is not None and proposer.global_trie.count(node) == 2
    one(proposer, "r", [*tokens, 62], 1)  # and goes on from where its entry ended
    assert proposer._cached["r"].token_ids == [60, 61, 62, 60, 61, 62]
    assert proposer.global_trie.count(node) == 2


def test_the_factory_builds_it_from_the_speculative_config() -> None:
    config = SpeculativeConfig.parse(
        '{"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_tree_depth": 12,'
        ' "suffix_decoding_max_cached_requests": 3, "suffix_decoding_min_token_prob": 0.25}')
    proposer = make_proposer(config)
    assert isinstance(proposer, SuffixProposer)
    assert (proposer.max_depth, proposer.max_cached_requests, proposer.min_token_prob,
            proposer.max_spec_factor) == (12, 3, 0.25, 1.0)
    assert SpeculativeConfig.parse("suffix").num_tokens == 24  # k defaults to the depth
