"""The `ngram` proposer (prompt lookup): the sequence's last n tokens are looked up earlier in
the same sequence (prompt and output so far), and the tokens that followed the most
recent earlier occurrence are the draft.

    tokens:  a b c d x y z ... a b c d e f g ... a b c d
                                 ^^^^^^^ most recent earlier match of the last 4
    draft:                               e f g ...        (up to k tokens)

n runs from `prompt_lookup_max` down to `prompt_lookup_min`: the longest suffix that
occurs earlier wins, and among its occurrences the most recent. Stateless.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plait.engine.spec.proposer import Proposer, SpecInput


def ngram_draft(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest
    suffix of `token_ids` of length in [min_n, max_n]; [] when none occurs earlier."""
    num_tokens = len(token_ids)
    if k < 1 or num_tokens < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
    last = num_tokens - 1
    # candidate ends p < last with tokens[p] == tokens[last]; the draft starts at p + 1
    ends = np.flatnonzero(tokens[:last] == tokens[last])  # [C], ascending
    if ends.size == 0:
        return []
    # match_len[c]: how many tokens before and at ends[c] equal the sequence's suffix
    match_len = np.ones(ends.size, dtype=np.int64)  # [C]
    alive = np.ones(ends.size, dtype=bool)  # [C]
    for back in range(1, max_n):
        pos = ends - back  # [C]
        alive &= pos >= 0
        alive[alive] = tokens[pos[alive]] == tokens[last - back]
        match_len += alive
        if not alive.any():
            break
    for n in range(max_n, min_n - 1, -1):
        hits = np.flatnonzero(match_len >= n)
        if hits.size:
            start = int(ends[hits[-1]]) + 1  # the most recent match
            return [int(t) for t in tokens[start:start + k]]
    return []


class NgramProposer(Proposer):
    """Prompt lookup over each sequence's own tokens (see the module docstring)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        return [ngram_draft(s.token_ids, self.min_n, self.max_n, s.max_draft_tokens)
                for s in seqs]
