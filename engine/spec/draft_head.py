"""The draft model's LM head over part of the vocabulary: `draft_model`'s
`draft_vocab_size`.

A draft step of a small model spends much of its time in the LM head: Qwen2.5-0.5B's is a
151936 x 896 Q8_0 matrix, 145 MB of its ~390 MB read per token. A draft only has to
guess, and the guess is the argmax, so the head can score fewer tokens (FR-Spec, Zhao
et al. 2025, keeps the most frequent ones). Here the draft scores

    token ids [0, N)                     a prefix of the head, read in place (no copy)
    the ids >= N already in the sequence  its prompt's and output's own rare tokens, a few
                                          float32 rows per request, dequantized once

and drafts the best of them. A BPE vocabulary numbers its tokens by merge order, the
frequent ones first: on the W6 code edit, 3 % of the prompt's Qwen tokens lie past 32768,
and those are in the sequence (its identifiers), so the draft still proposes them. A
token the subset lacks is never drafted, which costs acceptance, never correctness: the
target verifies every draft.

N defaults to 32768 for vocabularies over 65536 tokens (Qwen2.5's 151936), the whole
vocabulary otherwise. The prefix is read in place where the head's product row allows it:
the repacked weight (16-row tiles, so N rounds up to a multiple of 32) or a dense one;
another row scores the whole vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from plait.engine.models.linear import Linear
from plait.kernels.cpu import repack
from plait.kernels.cpu.products import TORCH

# `draft_vocab_size` when none is given: this many ids for vocabularies above AUTO_ABOVE.
DEFAULT_DRAFT_VOCAB = 32768
AUTO_ABOVE = 65536
# A repacked prefix ends on a whole unit of two 16-row tiles.
_PREFIX_ALIGN = 32


def draft_vocab_rows(vocab_size: int, draft_vocab_size: int | None) -> int:
    """N, the head's rows the draft scores for every sequence: `draft_vocab_size` (None:
    DEFAULT_DRAFT_VOCAB above AUTO_ABOVE tokens, else all), rounded up to a multiple of
    32, at most `vocab_size`."""
    if draft_vocab_size is None:
        draft_vocab_size = DEFAULT_DRAFT_VOCAB if vocab_size > AUTO_ABOVE else vocab_size
    rows = -(-draft_vocab_size // _PREFIX_ALIGN) * _PREFIX_ALIGN
    return min(rows, vocab_size)


@dataclass(slots=True)
class SeqTokens:
    """One sequence's ids past the prefix: `ids` in the order first seen, their head rows
    `rows` [E, hidden] float32, and how many of its tokens were scanned."""

    ids: list[int] = field(default_factory=list)
    rows: torch.Tensor | None = None
    scanned: int = 0


class DraftHead:
    """argmax over the ids [0, num_rows) and each sequence's own ids past them (module
    docstring) of `lm_head`'s logits. `num_rows` = the vocabulary where the head's row
    cannot read a prefix in place (`describe` says which)."""

    def __init__(self, lm_head: Linear, num_rows: int) -> None:
        self.vocab_size = lm_head.out_features
        bias = None if lm_head.bias is None else lm_head.bias.detach().float()
        self._bias = None if bias is None else bias.cpu()  # the own rows' terms
        prefix = (self._prefix(lm_head, bias, num_rows) if num_rows < self.vocab_size
                  else None)
        if prefix is None:
            self.num_rows = self.vocab_size
            self._scores: Callable[[torch.Tensor], torch.Tensor] = lm_head
            self._rows: Callable[[list[int]], torch.Tensor] | None = None
            return
        self.num_rows = num_rows
        self._scores, self._rows = prefix

    def describe(self) -> str:
        """"ids < N and each sequence's own" or "the whole vocabulary (V)"."""
        if self.num_rows == self.vocab_size:
            return f"the whole vocabulary ({self.vocab_size})"
        return (f"ids < {self.num_rows} of {self.vocab_size} and each sequence's own ids "
                f"past them")

    @staticmethod
    def _prefix(lm_head: Linear, bias: torch.Tensor | None, n: int,
                ) -> tuple[Callable[[torch.Tensor], torch.Tensor],
                           Callable[[list[int]], torch.Tensor]] | None:
        """(scores of ids < n, float32 rows of given ids) read in place, or None where the
        head's row offers no prefix. `bias`: the head's, float32 on its device."""
        state, k, v = lm_head.state, lm_head.in_features, lm_head.out_features
        cut = None if bias is None else bias[:n].contiguous()  # [n]
        if state is not None and state.packed is not None and state.desc is not None:
            desc = state.desc
            if int(desc[0]) != (1 | repack.REPACKED_FLAG):
                return None  # several parts: the prefix would cut across them
            head = torch.tensor([int(desc[0]), int(desc[1]), int(desc[2]), n],
                                dtype=torch.int64)  # the first n rows' tiles, in place

            def scores(x: torch.Tensor) -> torch.Tensor:
                return repack.product(x.float(), head, k, n, cut, what="draft head")

            def rows(ids: list[int]) -> torch.Tensor:
                return repack.dequantize_rows(desc, k, v, torch.tensor(ids, dtype=torch.int64))

            return scores, rows
        weight = lm_head.weight
        if weight is not None and lm_head.qweight is None:
            dense = weight.detach()
            # The torch row computes the prefix as the whole head (W @ x^T for few rows on
            # the CPU, which BLAS rounds otherwise than x @ W^T): the same bits, no copy.
            plain = TORCH.prepare(dense[:n], cut) if lm_head.product is TORCH else None

            def dense_scores(x: torch.Tensor) -> torch.Tensor:
                if plain is not None:
                    return TORCH(plain, x.to(dense.dtype))
                out = x.to(dense.dtype) @ dense[:n].T
                return out if cut is None else out + cut.to(out.dtype)

            def dense_rows(ids: list[int]) -> torch.Tensor:
                return dense[torch.tensor(ids, dtype=torch.int64, device=dense.device)].float()

            return dense_scores, dense_rows
        return None

    def update(self, seq: SeqTokens, token_ids: Sequence[int]) -> None:
        """Take the ids >= num_rows among `token_ids` past `seq.scanned` into `seq`."""
        if self._rows is None:
            seq.scanned = len(token_ids)
            return
        known = set(seq.ids)
        new = []
        for token in token_ids[seq.scanned:]:
            if token >= self.num_rows and token not in known:
                known.add(token)
                new.append(token)
        seq.scanned = len(token_ids)
        if not new:
            return
        rows = self._rows(new).cpu()  # [E_new, hidden]
        seq.ids += new
        seq.rows = rows if seq.rows is None else torch.cat([seq.rows, rows])

    def argmax(self, hidden: torch.Tensor,  # [S, hidden], the rows' last positions
               seqs: Sequence[SeqTokens]) -> list[int]:
        """Each row's best token among ids < num_rows and its sequence's own."""
        return self.best(hidden, seqs, probs=False)[0]

    def best(self, hidden: torch.Tensor,  # [S, hidden], the rows' last positions
             seqs: Sequence[SeqTokens], probs: bool = True,
             ) -> tuple[list[int], list[float] | None]:
        """`argmax`'s tokens and, with `probs`, each one's probability under the softmax of
        the logits the head scored for its row (ids < num_rows and its sequence's own: the
        ids left out hold little of the mass, so this is about the model's own)."""
        logits = self._scores(hidden).float()  # [S, num_rows]
        best, top = torch.max(logits, dim=-1)  # [S], [S]
        tokens = [int(t) for t in top.tolist()]
        values = [float(v) for v in best.tolist()]
        norms = [float(v) for v in torch.logsumexp(logits, dim=-1).tolist()] if probs \
            else None  # log of each row's softmax denominator
        if self._rows is not None:
            for i, seq in enumerate(seqs):
                if seq.rows is None:
                    continue
                own = seq.rows @ hidden[i].float().cpu()  # [E]
                if self._bias is not None:
                    own = own + self._bias[seq.ids]
                j = int(torch.argmax(own))
                if float(own[j]) > values[i]:
                    tokens[i], values[i] = seq.ids[j], float(own[j])
                if norms is not None:
                    norms[i] = float(torch.logaddexp(torch.tensor(norms[i]),
                                                     torch.logsumexp(own, dim=0)))
        if norms is None:
            return tokens, None
        return tokens, [math.exp(v - n) for v, n in zip(values, norms, strict=True)]
