"""What a step's attention needs, built once per step by the model runner and shared by
every layer: where each token's K/V goes, what each sequence attends to (the cache layout:
`reference.py`), and the backend's `plan` for this batch (`Ops.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to (shared by layers).

    `plan` is the attention backend's work list for this batch (None until `Ops.plan`);
    `keep`, when set, names the rows whose output the step needs: the last layer writes
    every token's K/V but attends for those rows only, through `kept` (their own metadata,
    planned too). `whole_stack` says the step runs every layer in one native call."""

    slot_mapping: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    context_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with -1
    max_query_len: int
    max_context_len: int
    plan: Any = None  # the backend's plan (ops.py); None: not planned yet
    keep: torch.Tensor | None = None  # [K] int64 increasing rows whose output is needed
    kept: AttentionMetadata | None = None  # the metadata of the rows `keep` names
    whole_stack: bool = False


def rows_metadata(meta: AttentionMetadata, positions: torch.Tensor,
                  rows: torch.Tensor) -> AttentionMetadata:
    """`meta` for only the query tokens `rows` ([K] int64, increasing) of its batch: each
    one a sequence of one query that attends its context up to and including itself (its
    K/V already written), through its sequence's block table. Not planned."""
    seq = torch.searchsorted(meta.cu_seqlens_q[1:].to(torch.int64), rows, right=True)
    ctx = (positions[rows] + 1).to(torch.int32)  # [K]
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        cu_seqlens_q=torch.arange(rows.shape[0] + 1, dtype=torch.int32, device=rows.device),
        context_lens=ctx, block_tables=meta.block_tables[seq], max_query_len=1,
        max_context_len=int(ctx.max()) if rows.numel() else 0)


__all__ = ["AttentionMetadata", "rows_metadata"]
