"""The depth-bounded suffix trie under the `suffix` proposer (engine/spec/suffix_trie.py):
exact counts after incremental appends and removals, the longest continued match, drafts."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from plait.engine.spec.suffix_trie import ROOT, SuffixTrie


def insert(trie: SuffixTrie, token_ids: Sequence[int]) -> int:
    cursor = ROOT
    for token in token_ids:
        cursor = trie.append(cursor, token)
    return cursor


def node_of(trie: SuffixTrie, token_ids: Sequence[int]) -> int | None:
    node: int | None = ROOT
    for token in token_ids:
        assert node is not None
        node = trie.child(node, token)
        if node is None:
            return None
    return node


def substring_counts(seqs: Sequence[Sequence[int]], depth: int) -> Counter[tuple[int, ...]]:
    """The reference: every substring of length 1..depth, counted by occurrence."""
    counts: Counter[tuple[int, ...]] = Counter()
    for seq in seqs:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def assert_trie_holds(trie: SuffixTrie, seqs: Sequence[Sequence[int]]) -> None:
    expected = substring_counts(seqs, trie.max_depth)
    for string, count in expected.items():
        node = node_of(trie, string)
        assert node is not None and trie.count(node) == count, string
    assert trie.num_nodes == len(expected) + 1  # nothing else is left (root included)


def test_counts_of_a_small_text() -> None:
    trie = SuffixTrie(2)
    cursor = insert(trie, [1, 2, 1, 3])  # a b a c
    counts = {s: trie.count(n) for s in [(1,), (2,), (3,), (1, 2), (1, 3), (2, 1)]
              if (n := node_of(trie, s)) is not None}
    assert counts == {(1,): 2, (2,): 1, (3,): 1, (1, 2): 1, (1, 3): 1, (2, 1): 1}
    assert trie.num_nodes == 7
    assert node_of(trie, [2, 1, 3]) is None  # deeper than 2
    assert cursor == node_of(trie, [1, 3])  # the last min(len, depth) tokens


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_incremental_appends_equal_every_substring_counted(depth: int) -> None:
    rng = random.Random(depth)
    seqs = [[rng.randrange(4) for _ in range(n)] for n in (40, 1, 25)]
    trie = SuffixTrie(depth)
    cursors = [ROOT] * len(seqs)
    # interleaved, one token at a time, as running requests grow
    for pos in range(max(map(len, seqs))):
        for i, seq in enumerate(seqs):
            if pos < len(seq):
                cursors[i] = trie.append(cursors[i], seq[pos])
    assert_trie_holds(trie, seqs)


def test_remove_leaves_exactly_the_other_sequences_and_reuses_nodes() -> None:
    rng = random.Random(7)
    first = [rng.randrange(5) for _ in range(30)]
    second = [rng.randrange(5) for _ in range(30)]
    trie = SuffixTrie(4)
    insert(trie, first)
    insert(trie, second)
    high_water = trie.num_nodes
    trie.remove(first)
    assert_trie_holds(trie, [second])
    insert(trie, first)  # freed nodes come back into use: no growth past the high water
    assert_trie_holds(trie, [second, first])
    assert trie.num_nodes == high_water
    trie.remove(second)
    trie.remove(first)
    assert trie.num_nodes == 1


def test_longest_match_needs_a_continuation_and_room_below_the_depth() -> None:
    tokens = [1, 2, 3, 4, 1, 2, 3]
    trie = SuffixTrie(8)
    insert(trie, tokens)
    node, length = trie.longest_match(tokens)
    # "1 2 3" ends the text too, but its first occurrence is followed by 4
    assert (node, length) == (node_of(trie, [1, 2, 3]), 3)
    shallow = SuffixTrie(3)
    insert(shallow, tokens)
    assert shallow.longest_match(tokens) == (node_of(shallow, [2, 3]), 2)  # <= depth - 1
    assert trie.longest_match([9, 9]) == (ROOT, 0)
    assert trie.longest_match([]) == (ROOT, 0)


def test_draft_takes_the_most_frequent_then_the_latest_and_stops_below_min_prob() -> None:
    #         0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    trie = SuffixTrie(8)
    insert(trie, tokens)
    node, length = trie.longest_match(tokens)
    assert length == 3  # "1 2 3", continued twice (by 4 both times)
    # 4 (p 1), then after "1 2 3 4": 5 and 6 once each, the tie goes to the later 6 (p 1/2)
    draft = trie.draft(node, 3, 0.5)
    assert (draft.token_ids, draft.score) == ([4, 6, 1], 1.0 + 0.5 + 0.5)
    draft = trie.draft(node, 3, 0.6)
    assert (draft.token_ids, draft.score) == ([4], 1.0)
    assert trie.draft(node, 0, 0.0).token_ids == []


def test_draft_backs_off_at_the_depth_bound() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    trie = SuffixTrie(3)
    insert(trie, tokens)
    node, length = trie.longest_match(tokens)
    assert length == 2
    # "1 2 3" is at depth 3: its link "2 3" goes on with 4, and so on past the depth bound
    assert trie.draft(node, 5, 0.1).token_ids == [3, 4, 5, 6, 1]


def test_best_child_after_a_removal() -> None:
    trie = SuffixTrie(2)
    insert(trie, [7, 1, 7, 1])  # after 7: 1 twice
    insert(trie, [7, 2])  # after 7: 2 once
    node = node_of(trie, [7])
    assert node is not None
    assert trie.draft(node, 1, 0.0).token_ids == [1]
    trie.remove([7, 1, 7, 1])
    node = node_of(trie, [7])
    assert node is not None
    assert trie.draft(node, 1, 0.0).token_ids == [2]


def test_depth_below_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        SuffixTrie(0)
