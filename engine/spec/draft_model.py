"""The `draft_model` proposer: a small model with the target's tokenizer, run by the same
engine process with its own weights and KV blocks, drafts k tokens greedily per step for
every speculating sequence, all of them batched in each of its k forward passes.

One `propose` for sequences of lengths L_i (the draft cache holds each one's first c_i
positions):

    pass 1   rows tokens[c_i : L_i] at positions c_i..L_i-1   -> argmax: d_1   (catch-up)
    pass j   one row d_{j-1} at position L_i + j - 2           -> argmax: d_j   (j = 2..k)

With `draft_p_min` > 0 a sequence's draft ends before the first d_j whose probability
under the draft model is below it (that token is neither drafted nor fed): text the draft
model cannot predict costs fewer passes and fewer rejected rows. An empty draft counts as
a missed one for the acceptance feedback (`Proposer.empty_draft_costs`), so does the empty
draft of a sequence whose blocks did not fit (no pass ran for it; it backs off while the
draft cache is full), and so does every draft while the sequence's recent acceptance is
below what a draft token costs (`draft_token_cost`: the draft's weight bytes over the
target's; policy.py).

The cache then holds positions < L_i for sure; after verification accepted a of the
draft, positions < L_i + min(a, f) too, f the draft tokens fed (k - 1, fewer for a draft
cut short: those rows were fed the accepted tokens), so the next catch-up starts there
(`on_verified`). Rejected positions are simply written again. Blocks come from the
proposer's own free list (no prefix cache); a sequence whose next blocks do not fit gets
no draft that step.

With `prompt_lookup_min` / `prompt_lookup_max` set, ngram's prompt lookup (ngram.py) is
tried first: where it finds a match its draft is the sequence's, at no pass of the draft
model, whose cache keeps the positions it held; the next pass catches up on them (one
multi-row pass: a copied span costs the draft model one pass, not one per token).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from plait.engine.model_loader import load_tokenizer, resolve_model
from plait.engine.model_runner import ModelRunner, cdiv
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.draft_head import DraftHead, SeqTokens, draft_vocab_rows
from plait.engine.spec.ngram import ngram_draft
from plait.engine.spec.proposer import Proposer, SpecInput
from plait.engine.spec.target import TargetModel, check_same_vocab
from plait.kernels import AttentionMetadata
from plait.kernels.cpu.products import prompt_rows

# Tokens in one draft pass past which it computes as prompt rows (`_greedy`).
CATCH_UP_TOKENS = 32
# What a catch-up row costs against a one-row pass of the draft model (`setup_cost`):
# on a Zen 4 EPYC, Qwen2.5-Coder-0.5B computed 346-369 rows in 482-527 ms, against 9-12 ms
# for one row (BENCHMARKS.md).
CATCH_UP_ROW_SHARE = 0.13

logger = logging.getLogger("plait.engine")


@dataclass(slots=True)
class _DraftSeq:
    """The draft cache's view of one sequence: its blocks, the positions computed for
    sure, and from the last `propose` its length and how many draft tokens were fed."""

    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    proposed_at: int = 0
    num_fed: int = 0
    tokens: SeqTokens = field(default_factory=SeqTokens)  # its ids past the head's prefix
    looked_up: bool = False  # the last draft came from the prompt lookup


@dataclass(slots=True)
class _Row:
    """One sequence's part of a forward pass: `token_ids` at positions from `start`."""

    request_id: str
    token_ids: list[int]
    start: int


class DraftModelProposer(Proposer):
    """Greedy drafts from a second model (see the module docstring). Built by
    engine/spec/factory.py as `DraftModelProposer(config, target)`: `config.model` is the
    draft model (any path the engine loads). It runs with the target engine's config
    (`target.engine_config`: device, dtype, weight/compute/KV dtypes, native kernels,
    block size) in its own KV pool of `num_kv_tokens` tokens (default: as many as the
    target's pool, `target.num_kv_tokens`). Raises DraftVocabMismatch (before loading
    the draft's weights) when its vocabulary is not the target's."""

    empty_draft_costs = True  # a pass of the draft model, whatever it finds (see above)

    def __init__(self, config: SpeculativeConfig, target: TargetModel,
                 num_kv_tokens: int | None = None) -> None:
        if config.model is None:
            raise ValueError("draft_model needs \"model\", the draft model's path")
        base = target.engine_config
        block_size = base.block_size
        num_kv_tokens = target.num_kv_tokens if num_kv_tokens is None else num_kv_tokens
        draft_config = dataclasses.replace(
            base, model=config.model, num_kv_blocks=max(2, cdiv(num_kv_tokens, block_size)),
            max_model_len=None, warm_up_tokens=0, max_shared_logits=0,
            speculative_config=None, kv_events_endpoint=None,
            kv_events_replay_endpoint=None, kv_cache_warm_tokens=0)
        resolved = resolve_model(config.model, draft_config.weights == "float32")
        check_same_vocab(target, resolved.name, resolved.config.vocab_size,
                         load_tokenizer(resolved.path))
        self.config = draft_config
        self.runner = ModelRunner(draft_config, resolved)
        self.head = DraftHead(self.runner.model.lm_head,
                              draft_vocab_rows(resolved.config.vocab_size,
                                               config.draft_vocab_size))
        logger.info("draft model %s: its LM head scores %s", resolved.name,
                    self.head.describe())
        # a decode step reads every weight once: a draft token costs about the draft's
        # weight bytes over the target's (0.43 for Qwen2.5-Coder-0.5B drafting for -1.5B;
        # measured on an EPYC, 17 ms a draft token against 42 ms a target step: 0.40)
        self.draft_token_cost = (self.runner.weight_bytes / target.weight_bytes
                                 if target.weight_bytes > 0 else 0.0)
        source = "the weights' bytes"
        if config.draft_token_cost is not None:
            self.draft_token_cost, source = config.draft_token_cost, "draft_token_cost"
        logger.info("draft model %s: a draft token costs about %.2f of a target step (%s)",
                    resolved.name, self.draft_token_cost, source)
        self.p_min = config.draft_p_min
        self.lookup = config.draft_lookup  # (min n, max n) of the lookup tried first
        self.block_size = block_size
        self._free = list(range(self.runner.num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._seqs: dict[str, _DraftSeq] = {}
        # each request's last prompt lookup, request id -> (tokens, k, draft): `setup_cost`
        # and `propose` of one step share it
        self._lookups: dict[str, tuple[int, int, list[int]]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        rows: list[_Row] = []
        budgets: dict[str, int] = {}
        found: dict[str, list[int]] = {}  # the prompt lookup's drafts
        for seq in seqs:
            state = self._seqs.setdefault(seq.request_id, _DraftSeq())
            found[seq.request_id] = self._looked_up(seq)
            state.looked_up = bool(found[seq.request_id])
            if state.looked_up:
                continue  # the cache keeps what it holds for sure
            length = len(seq.token_ids)
            # positions written: up to length + k - 2 (d_k is never fed)
            if not self._reserve(state, length + seq.max_draft_tokens - 1):
                continue
            state.num_cached = min(state.num_cached, length - 1)
            rows.append(_Row(seq.request_id, list(seq.token_ids[state.num_cached:]),
                             state.num_cached))
            budgets[seq.request_id] = seq.max_draft_tokens
            state.proposed_at, state.num_fed = length, 0
            self.head.update(state.tokens, seq.token_ids)
        drafts: dict[str, list[int]] = {r.request_id: [] for r in rows}
        while rows:
            tokens, probs = self._greedy(rows)
            sure = []  # the rows whose draft goes on
            for i, (row, token) in enumerate(zip(rows, tokens, strict=True)):
                if probs is not None and probs[i] < self.p_min:
                    continue  # the draft ends before a token the draft model doubts
                drafts[row.request_id].append(token)
                sure.append(row)
            rows = [_Row(r.request_id, [drafts[r.request_id][-1]],
                         r.start + len(r.token_ids)) for r in sure
                    if len(drafts[r.request_id]) < budgets[r.request_id]]
            for row in rows:
                self._seqs[row.request_id].num_fed += 1
        for request_id in drafts:
            self._seqs[request_id].num_cached = self._seqs[request_id].proposed_at
        return [found[seq.request_id] or drafts.get(seq.request_id, []) for seq in seqs]

    def setup_cost(self, seq: SpecInput) -> float:
        """The catch-up before the next draft: the tokens past what the draft cache holds
        for sure, each CATCH_UP_ROW_SHARE of a draft pass (a pass: `draft_token_cost`
        target steps); nothing where the prompt lookup drafts instead."""
        if self._looked_up(seq):
            return 0.0
        state = self._seqs.get(seq.request_id)
        length = len(seq.token_ids)
        cached = min(state.num_cached, length - 1) if state is not None else 0
        return (length - cached) * CATCH_UP_ROW_SHARE * self.draft_token_cost

    def _looked_up(self, seq: SpecInput) -> list[int]:
        """The prompt lookup's draft for `seq` ([] without a lookup or a match), looked up
        once a step: a request's tokens up to a length never change, so the key is its
        length and k."""
        if self.lookup is None:
            return []
        length, k = len(seq.token_ids), seq.max_draft_tokens
        last = self._lookups.get(seq.request_id)
        if last is not None and last[:2] == (length, k):
            return last[2]
        draft = ngram_draft(seq.token_ids, *self.lookup, k)
        self._lookups[seq.request_id] = (length, k, draft)
        return draft

    def on_verified(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        state = self._seqs.get(request_id)
        if state is not None and not state.looked_up:
            state.num_cached = state.proposed_at + min(num_accepted, state.num_fed)

    def finish(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        state = self._seqs.pop(request_id, None)
        if state is not None:
            self._free.extend(reversed(state.block_ids))

    def _reserve(self, state: _DraftSeq, num_positions: int) -> bool:
        """Blocks for `num_positions` positions, or False (nothing taken) when they do not
        fit in the free list or the draft model's context."""
        if num_positions > self.runner.max_model_len:
            return False
        missing = cdiv(num_positions, self.block_size) - len(state.block_ids)
        if missing > len(self._free):
            return False
        state.block_ids.extend(self._free.pop() for _ in range(max(0, missing)))
        return True

    def _greedy(self, rows: list[_Row]) -> tuple[list[int], list[float] | None]:
        """One forward pass of the draft model over `rows`: the argmax token after each
        row's last position (its K/V written into the draft cache on the way) and, where
        `p_min` cuts drafts, its probability (DraftHead.best)."""
        runner, bs = self.runner, self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        tables = []
        for row in rows:
            ids = self._seqs[row.request_id].block_ids
            end = row.start + len(row.token_ids)
            input_ids.extend(row.token_ids)
            positions.extend(range(row.start, end))
            slots.extend(ids[p // bs] * bs + p % bs for p in range(row.start, end))
            cu_seqlens.append(cu_seqlens[-1] + len(row.token_ids))
            context_lens.append(end)
            tables.append(ids[:cdiv(end, bs)])
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=runner.to_device(slots, torch.int64),  # [T]
            cu_seqlens_q=runner.to_device(cu_seqlens, torch.int32),  # [S + 1]
            context_lens=runner.to_device(context_lens, torch.int32),  # [S]
            block_tables=runner.to_device([t + [-1] * (width - len(t)) for t in tables],
                                          torch.int32),  # [S, width], padded with -1
            max_query_len=max(len(r.token_ids) for r in rows),
            max_context_len=max(context_lens))
        meta.keep = runner.to_device([c - 1 for c in cu_seqlens[1:]], torch.int64)  # [S]
        pos = runner.to_device(positions, torch.int64)  # [T]
        # A pass of many tokens is a prompt's catch-up: the prompt rows' products (faster
        # where they compute apart; drafts are guesses, so the arithmetic is free to vary).
        with prompt_rows(len(input_ids) > CATCH_UP_TOKENS):
            hidden = runner.model(runner.to_device(input_ids, torch.int64), pos,
                                  runner.ops.plan(meta, pos))  # [S, hidden]: the kept rows
        return self.head.best(hidden, [self._seqs[r.request_id].tokens for r in rows],
                              probs=self.p_min > 0)
