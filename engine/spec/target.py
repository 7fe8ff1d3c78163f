"""What a proposer is told of the model it drafts for (`TargetModel`), and the check that
a draft model speaks the target's vocabulary (`check_same_vocab`).

A draft model's token ids are verified as the target's token ids, so the two must number
their tokens alike: same vocabulary size (rows of the embedding and LM head) and the same
token string at every id. Anything else would draft garbage that is always rejected (or,
worse, accepted as a different text), so it is refused at startup, as vLLM refuses a
draft model of another vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from plait.engine.config import EngineConfig

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PreTrainedTokenizerBase

# How many differing ids a vocabulary error lists.
SHOWN_DIFFERENCES = 3


@dataclass(frozen=True, slots=True)
class TargetModel:
    """The target engine as a proposer sees it: its `engine_config` (device, dtypes, kernel
    flags, block size: a draft model runs with the same), served `name`, `vocab_size`
    (rows of its LM head), its `tokenizer()` (loaded on the first call where the engine
    had only its vocabulary), `num_kv_tokens`, the tokens its KV pool
    holds (a draft model's own pool holds as many), and `weight_bytes`, what its weights
    hold in memory (0: unknown), which a decode step reads once."""

    engine_config: EngineConfig
    name: str
    vocab_size: int
    tokenizer: Callable[[], PreTrainedTokenizerBase]
    num_kv_tokens: int
    weight_bytes: int = 0


class DraftVocabMismatch(ValueError):
    """A draft model whose vocabulary is not the target's (raised before it is loaded)."""


def check_same_vocab(target: TargetModel, draft_name: str, draft_vocab_size: int,
                     draft_tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise DraftVocabMismatch, naming both models, unless the draft model has the
    target's vocabulary size and its tokenizer maps every token string to the same id as
    the target's (added and special tokens included)."""
    prefix = (f"speculative config: draft model {draft_name!r} does not share the "
              f"vocabulary of the target model {target.name!r}")
    if draft_vocab_size != target.vocab_size:
        raise DraftVocabMismatch(f"{prefix}: vocabulary size {draft_vocab_size} vs "
                                 f"{target.vocab_size}")
    want, got = target.tokenizer().get_vocab(), draft_tokenizer.get_vocab()
    if want == got:
        return
    by_id_want = {i: t for t, i in want.items()}
    by_id_got = {i: t for t, i in got.items()}
    differ = sorted(i for i in by_id_want.keys() | by_id_got.keys()
                    if by_id_want.get(i) != by_id_got.get(i))
    shown = ", ".join(f"id {i}: {by_id_got.get(i)!r} vs {by_id_want.get(i)!r}"
                      for i in differ[:SHOWN_DIFFERENCES])
    raise DraftVocabMismatch(f"{prefix}: {len(differ)} token id(s) differ between their "
                             f"tokenizers ({len(got)} vs {len(want)} tokens; {shown})")
