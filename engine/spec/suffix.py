"""The `suffix` proposer: suffix decoding (Oliaro et al., "SuffixDecoding", 2024; vLLM's
`method: "suffix"`) over depth-bounded suffix tries (engine/spec/suffix_trie.py).

Two tries answer each step:

    local   one per running request: its prompt and its output so far
    global  the outputs of the last `suffix_decoding_max_cached_requests` requests
            (FIFO by arrival; running requests' outputs go in as they grow)

For each trie the longest suffix of the sequence (< `suffix_decoding_max_tree_depth`
tokens) that occurs followed by something is found, and the most frequent continuation
is drafted from it while its estimated probability stays >= `suffix_decoding_min_token_prob`,
for at most min(k, floor(`suffix_decoding_max_spec_factor` x match length)) tokens. The
draft with the higher score (expected accepted tokens) wins; the local one on a tie.

Tokens enter the tries when they are verified (they show up in `token_ids` of the next
`propose`), each in O(max_tree_depth): the tries are never rebuilt.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.proposer import Proposer, SpecInput
from plait.engine.spec.suffix_trie import ROOT, Draft, SuffixTrie

# The global trie's bound besides the request count: oldest outputs go while it holds more
# nodes than this (x 36 bytes and the branching nodes' dicts: ~200 MB at most).
MAX_GLOBAL_NODES = 1 << 22


@dataclass(slots=True)
class _Running:
    """A running request's place in the tries: its own trie and cursor in it, how many of
    its tokens that trie holds, and its cursor in the global trie with how many of its
    output tokens the global trie holds (engine/spec/suffix_trie.py)."""

    local: SuffixTrie
    num_inserted: int = 0
    local_cursor: int = ROOT
    global_cursor: int = ROOT
    num_in_global: int = 0


@dataclass(slots=True)
class _Cached:
    """A request's output in the global trie: `token_ids`, which start at output position
    `first_pos` (0 unless an earlier entry of the same running request was pushed out)."""

    first_pos: int
    token_ids: list[int]


class SuffixProposer(Proposer):
    """Suffix decoding (see the module docstring). Built by engine/spec/factory.py as
    `SuffixProposer(config)`; the `suffix_decoding_*` fields of `config` are its knobs.

    Memory: each running request's trie holds at most (its tokens) x depth nodes; the
    global one at most (the cached outputs' tokens) x depth, and never more than
    MAX_GLOBAL_NODES after an insertion. A request's trie is dropped at `finish`; its
    output stays in the global trie until pushed out by newer requests."""

    def __init__(self, config: SpeculativeConfig, max_global_nodes: int = MAX_GLOBAL_NODES
                 ) -> None:
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_global_nodes = max_global_nodes
        self.global_trie = SuffixTrie(self.max_depth)
        self._cached: OrderedDict[str, _Cached] = OrderedDict()  # oldest first
        self._running: dict[str, _Running] = {}

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        return [self._propose_one(seq) for seq in seqs]

    def finish(self, request_id: str) -> None:
        # the output stays in the global trie (a preempted request resumes its entry)
        self._running.pop(request_id, None)

    def _propose_one(self, seq: SpecInput) -> list[int]:
        state = self._sync(seq)
        best = self._draft(state.local, seq)
        if self.max_cached_requests > 0:
            other = self._draft(self.global_trie, seq)
            if other.score > best.score:
                best = other
        return best.token_ids

    def _draft(self, trie: SuffixTrie, seq: SpecInput) -> Draft:
        node, match_len = trie.longest_match(seq.token_ids)
        limit = min(seq.max_draft_tokens, math.floor(self.max_spec_factor * match_len))
        if match_len == 0 or limit < 1:
            return Draft([], 0.0)
        return trie.draft(node, limit, self.min_token_prob)

    def _sync(self, seq: SpecInput) -> _Running:
        """Insert the tokens of `seq` not yet in the tries: all into its local trie, the
        output ones also into the global trie."""
        state = self._running.get(seq.request_id)
        if state is None:
            state = self._running[seq.request_id] = _Running(SuffixTrie(self.max_depth))
            self._resume_global(seq.request_id, state)
        token_ids = seq.token_ids
        for pos in range(state.num_inserted, len(token_ids)):
            state.local_cursor = state.local.append(state.local_cursor, token_ids[pos])
        state.num_inserted = len(token_ids)
        if self.max_cached_requests > 0:
            start = seq.num_prompt_tokens + state.num_in_global
            for pos in range(start, len(token_ids)):
                self._append_global(seq.request_id, state, token_ids[pos])
        return state

    def _resume_global(self, request_id: str, state: _Running) -> None:
        """A request seen before (preempted, now back) continues its global entry: its
        cursor is the node of the entry's last tokens."""
        entry = self._cached.get(request_id)
        if entry is None:
            return
        node: int | None = ROOT
        for token in entry.token_ids[-self.max_depth:]:
            assert node is not None
            node = self.global_trie.child(node, token)
        assert node is not None, "a cached output's own suffix is in the global trie"
        state.global_cursor = node
        state.num_in_global = entry.first_pos + len(entry.token_ids)

    def _append_global(self, request_id: str, state: _Running, token: int) -> None:
        entry = self._cached.get(request_id)
        if entry is None:  # first output token, or the entry was pushed out meanwhile
            entry = self._cached[request_id] = _Cached(state.num_in_global, [])
            state.global_cursor = ROOT
        state.global_cursor = self.global_trie.append(state.global_cursor, token)
        entry.token_ids.append(token)
        state.num_in_global += 1
        while len(self._cached) > self.max_cached_requests or (
                len(self._cached) > 1 and self.global_trie.num_nodes > self.max_global_nodes):
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        request_id, entry = self._cached.popitem(last=False)
        self.global_trie.remove(entry.token_ids)
        running = self._running.get(request_id)
        if running is not None:  # it starts a new entry with its next token
            running.global_cursor = ROOT
