"""Speculative decoding in tests: engines whose drafts are known in advance.

    ReferenceProposer(references, wrong_every)   drafts the continuation of a reference
                                                 run, with chosen draft tokens wrong
    spec_llm(path, proposer, **options)          an LLM that speculates with `proposer`
    spec_counts(llm)                             (drafts, draft tokens, accepted tokens)
    calls(obj, name)                             the (args, result) of each later call of
                                                 obj.name (a proposer's pass, a hook)

ReferenceProposer is a real proposer (engine/spec/proposer.Proposer) that reads the
answer of a run without speculation: it makes verification see drafts that are right,
wrong at a chosen token, or wrong everywhere, which a model's own repeats do not give on
demand. What is tested is the verification; the output must not depend on the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait import LLM
from plait.engine.spec.config import SpeculativeConfig
from plait.engine.spec.driver import SpecDecoder
from plait.engine.spec.proposer import Proposer, SpecInput


class ReferenceProposer(Proposer):
    """Drafts the tokens that follow a sequence in the first reference sequence it is a
    prefix of. The draft token that would land at output position p is made wrong (the
    right token + 1) when `wrong_every` divides p + 1 (0: never). Counts its calls."""

    def __init__(self, references: Sequence[Sequence[int]], wrong_every: int = 0) -> None:
        self.references = [list(r) for r in references]
        self.wrong_every = wrong_every
        self.verified: list[tuple[str, int, int]] = []
        self.finished: list[str] = []

    def propose(self, seqs: Sequence[SpecInput]) -> list[list[int]]:
        return [self._draft(s) for s in seqs]

    def _draft(self, seq: SpecInput) -> list[int]:
        known = list(seq.token_ids)
        for ref in self.references:
            if ref[: len(known)] == known:
                draft = ref[len(known) : len(known) + seq.max_draft_tokens]
                first = len(known) - seq.num_prompt_tokens
                return [t + 1 if self.wrong_every and (first + i + 1) % self.wrong_every == 0
                        else t for i, t in enumerate(draft)]
        return []

    def on_verified(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        self.verified.append((request_id, num_proposed, num_accepted))

    def finish(self, request_id: str) -> None:
        self.finished.append(request_id)


def spec_llm(path, proposer: Proposer | None = None, k: int = 4, **options) -> LLM:
    """An LLM (64 blocks of 4 unless overridden) that speculates k tokens with `proposer`
    (ngram when None), at any batch size."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                               prompt_lookup_min=2, prompt_lookup_max=4,
                               disable_by_batch_size=10_000)
    defaults = dict(num_kv_blocks=64, block_size=4)
    defaults.update(options)
    llm = LLM(str(path), speculative_config=config, **defaults)
    if proposer is not None:
        spec = llm.engine.spec
        assert spec is not None
        llm.engine.spec = SpecDecoder(config, spec.max_model_len, proposer)
    return llm


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.stats()
    return (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens)


def calls(obj: object, name: str) -> list[tuple[tuple, Any]]:
    """Wrap `obj`'s attribute `name` (a bound method) on this instance so that every later
    call still runs it and appends `(args, result)` to the returned list."""
    log: list[tuple[tuple, Any]] = []
    method = getattr(obj, name)

    def recorded(*args: Any) -> Any:
        result = method(*args)
        log.append((args, result))
        return result

    setattr(obj, name, recorded)
    return log
