"""A depth-bounded suffix trie over token sequences, updated one token at a time: the data
structure under the `suffix` proposer (engine/spec/suffix.py).

Every substring of length <= `max_depth` of every inserted sequence is a path from the root;
a node stands for one such string and counts its occurrences. Text `a b a c`, depth 2:

    root ─a(2)─┬─b(1)          count(s): occurrences of s
               └─c(1)          continued(s): occurrences of s followed by a token
         ─b(1)──a(1)                        (sum of the children's counts)
         ─c(1)                 link(s): the node of s without its first token

Appending a token to a sequence extends each of its active nodes (the nodes of its last
0..max_depth-1 tokens), which are the `cursor` (its deepest) and the chain of suffix links
below it: O(max_depth) per token, never a rebuild. A sequence can be removed again
(`remove`, O(len x max_depth)); nodes whose count falls to 0 are freed. A node's link
never points at a freed node: count(a s) <= count(s), so s outlives every a s.

Drafting follows the most frequent continuation ("best" child: highest count, ties to the
one extended most recently) and backs off through the suffix link where a path has no
continuation (the depth bound, or the sequence's own end).

Memory: at most (tokens inserted) x max_depth nodes, 36 bytes each in flat arrays (a
node's first child is inline), plus a dict entry (~100 bytes) per further child of the
nodes that branch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
# `_best` of a node with no children (the one sentinel inside these arrays).
NO_CHILD = -1


@dataclass(frozen=True, slots=True)
class Draft:
    """A guessed continuation: `token_ids` and `score`, the sum over the draft of the
    estimated probability that the draft is right up to and including that token (the
    expected number of accepted tokens under the trie's counts)."""

    token_ids: list[int]
    score: float


class SuffixTrie:
    """All substrings (length <= `max_depth`) of the inserted sequences, with counts.

    Node ids are ints (ROOT is 0); a sequence being inserted is tracked by its cursor, the
    node of its last min(len, max_depth) tokens, which the caller keeps and passes back to
    `append`. Not thread-safe: one owner (the engine core thread)."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"suffix trie depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        # per node (index = node id); int32 except the stamps
        self._count = array("i", [0])
        self._continued = array("i", [0])
        self._best = array("i", [NO_CHILD])
        self._last = array("q", [0])  # stamp of the node's latest count increment
        self._link = array("i", [ROOT])
        self._depth = array("i", [0])
        self._token = array("i", [NO_CHILD])  # the token on the edge into the node
        # children: most nodes have at most one, kept inline; the others go to `_more`
        self._child1 = array("i", [NO_CHILD])
        self._more: dict[int, dict[int, int]] = {}  # node -> {token: child}, child1 excluded
        self._free: list[int] = []
        self._stamp = 0

    @property
    def num_nodes(self) -> int:
        """Live nodes, the root included."""
        return len(self._count) - len(self._free)

    def child(self, node: int, token: int) -> int | None:
        """The node of (node's string + token), or None when it does not occur."""
        first = self._child1[node]
        if first == NO_CHILD:
            return None
        if self._token[first] == token:
            return first
        more = self._more.get(node)
        return None if more is None else more.get(token)

    def _children(self, node: int) -> list[int]:
        first = self._child1[node]
        if first == NO_CHILD:
            return []
        more = self._more.get(node)
        return [first] if more is None else [first, *more.values()]

    def count(self, node: int) -> int:
        """Occurrences of the node's string in the inserted sequences."""
        return self._count[node]

    def append(self, cursor: int, token: int) -> int:
        """Count one more token of the sequence whose cursor is `cursor` (ROOT for a new
        sequence): every suffix of (its last tokens + token) of length <= max_depth gets one
        more occurrence. Returns the sequence's new cursor. O(max_depth)."""
        link, depth = self._link, self._depth
        if depth[cursor] == self.max_depth:
            cursor = link[cursor]  # the deepest node cannot be extended
        chain = [cursor]  # active nodes, deepest first
        while cursor != ROOT:
            cursor = link[cursor]
            chain.append(cursor)
        self._stamp += 1
        stamp = self._stamp
        count, continued, best, last = self._count, self._continued, self._best, self._last
        child1, tokens = self._child1, self._token
        shorter = ROOT  # the node made from the next shorter active node: its link
        for node in reversed(chain):
            child = child1[node]
            if child == NO_CHILD:
                child = child1[node] = self._new_node(depth[node] + 1, shorter, token)
            elif tokens[child] != token:
                more = self._more.setdefault(node, {})
                found = more.get(token)
                if found is None:
                    found = more[token] = self._new_node(depth[node] + 1, shorter, token)
                child = found
            count[child] += 1
            last[child] = stamp
            continued[node] += 1
            top = best[node]
            if top == NO_CHILD or count[child] >= count[top]:
                best[node] = child  # a tie goes to the latest extended
            shorter = child
        return shorter

    def _new_node(self, depth: int, link: int, token: int) -> int:
        values = ((self._count, 0), (self._continued, 0), (self._best, NO_CHILD),
                  (self._last, 0), (self._link, link), (self._depth, depth),
                  (self._token, token), (self._child1, NO_CHILD))
        if self._free:
            node = self._free.pop()
            for column, value in values:
                column[node] = value
            return node
        for column, value in values:
            column.append(value)
        return len(self._count) - 1

    def remove(self, token_ids: Sequence[int]) -> None:
        """Undo every `append` of a sequence that was inserted whole as `token_ids` (from
        ROOT): its occurrences are uncounted and nodes left with count 0 are freed.
        Removing a sequence that was not inserted corrupts the counts. O(len x max_depth)."""
        num_tokens = len(token_ids)
        freed: list[int] = []
        for start in range(num_tokens):
            node = ROOT
            for pos in range(start, min(start + self.max_depth, num_tokens)):
                node = self._uncount(node, token_ids[pos], freed)
        self._free.extend(freed)

    def _uncount(self, node: int, token: int, freed: list[int]) -> int:
        child = self.child(node, token)
        assert child is not None, "remove() of a sequence that was not inserted"
        self._count[child] -= 1
        self._continued[node] -= 1
        if self._count[child] == 0:
            self._unlink_child(node, child, token)
            freed.append(child)  # reused only after this removal: the walk still reads it
        if self._best[node] == child:
            self._best[node] = max(self._children(node), default=NO_CHILD,
                                   key=lambda c: (self._count[c], self._last[c]))
        return child

    def _unlink_child(self, node: int, child: int, token: int) -> None:
        more = self._more.get(node)
        if self._child1[node] == child:
            if more is None:
                self._child1[node] = NO_CHILD
                return
            _, self._child1[node] = more.popitem()
        else:
            assert more is not None
            del more[token]
        if not more:
            del self._more[node]

    def longest_match(self, token_ids: Sequence[int]) -> tuple[int, int]:
        """(node, m): the longest suffix of `token_ids`, m <= max_depth - 1 tokens, that
        occurs followed by some token; (ROOT, 0) when none does. Whether a length-m suffix
        qualifies is monotone in m (a continued s contains a continued s[1:]), so m is
        found by binary search: O(max_depth log max_depth)."""
        low, high = 0, min(len(token_ids), self.max_depth - 1)
        found = ROOT
        while low < high:
            mid = (low + high + 1) // 2
            node = self._walk(token_ids[len(token_ids) - mid:])
            if node is not None and self._continued[node] > 0:
                low, found = mid, node
            else:
                high = mid - 1
        return found, low

    def _walk(self, token_ids: Sequence[int]) -> int | None:
        node = ROOT
        for token in token_ids:
            found = self.child(node, token)
            if found is None:
                return None
            node = found
        return node

    def draft(self, node: int, max_tokens: int, min_prob: float) -> Draft:
        """Up to `max_tokens` tokens after the string of `node`: each step takes the best
        child, whose probability is count(child) / continued(parent); the draft stops
        before the running product of these falls below `min_prob`. A node without a
        continuation backs off to its suffix link (ROOT: the draft ends)."""
        token_ids: list[int] = []
        prob, score = 1.0, 0.0
        while len(token_ids) < max_tokens:
            while node != ROOT and self._continued[node] == 0:
                node = self._link[node]
            if node == ROOT:
                break
            best = self._best[node]
            prob *= self._count[best] / self._continued[node]
            if prob < min_prob:
                break
            token_ids.append(self._token[best])
            score += prob
            node = best
        return Draft(token_ids, score)
