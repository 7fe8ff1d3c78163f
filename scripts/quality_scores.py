"""The pure arithmetic of scripts/quality.py: chunks of a token stream, the positions
llama.cpp's `llama-perplexity` scores in each, the scores read from vLLM-style
`prompt_logprobs`, and perplexity, perplexity ratio and same-top-1 rate of two runs.

How `llama-perplexity` scores a text (tools/perplexity/perplexity.cpp): the whole text is
tokenized once (a BOS in front where the model adds one), cut into `num_chunks` chunks of
`n_ctx` tokens, the first token of each chunk replaced by BOS where the model adds one,
and each chunk run alone. Only the second half is scored, so every scored token has at
least n_ctx/2 tokens of context:

    chunk:  t0  t1 ... t255 | t256  t257 ... t511        (n_ctx = 512, first = 256)
    logits row j predicts token j+1; rows 256..510 are scored, so tokens 257..511:
    n_ctx - 1 - n_ctx/2 = 255 scored tokens per chunk

`prompt_logprobs` entry p is the logprob of token p given tokens 0..p-1 (entry 0 is null),
so the scored entries are n_ctx/2 + 1 .. n_ctx - 1.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO


def chunk_tokens(tokens: list[int], n_ctx: int, num_chunks: int,
                 bos_id: int | None) -> list[list[int]]:
    """The first `num_chunks` whole chunks of `n_ctx` tokens of `tokens`, each with its
    first token replaced by `bos_id` when the model adds a BOS (None: left as it is).
    ValueError when the text holds fewer than `num_chunks` chunks (llama.cpp needs 2)."""
    available = len(tokens) // n_ctx
    if num_chunks < 1 or num_chunks > available:
        raise ValueError(f"the text has {len(tokens)} tokens: {available} chunks of {n_ctx}, "
                         f"asked for {num_chunks}")
    chunks = []
    for i in range(num_chunks):
        chunk = tokens[i * n_ctx:(i + 1) * n_ctx]
        if bos_id is not None:
            chunk[0] = bos_id
        chunks.append(chunk)
    return chunks


def scored_positions(n_ctx: int) -> range:
    """The `prompt_logprobs` entries llama-perplexity scores in a chunk of `n_ctx`."""
    return range(n_ctx // 2 + 1, n_ctx)


@dataclass(frozen=True, slots=True)
class ChunkScores:
    """One chunk as one run scored it: per scored position, the logprob of the text's
    token and the id of the most likely token there (the run's top-1)."""

    logprobs: list[float]
    top_ids: list[int]


def scores_of(chunk: list[int], entries: list[dict[str, dict[str, Any]] | None]
              ) -> ChunkScores:
    """Read a chunk's scores from its `prompt_logprobs` (asked with k=1: each entry maps the
    prompt token and the top-1 alternative, as string ids, to {logprob, rank, ...}). Where
    the prompt token is itself the most likely, the entry holds it alone. ValueError on an
    entry that does not hold the prompt token or one alternative of rank 1."""
    if len(entries) != len(chunk):
        raise ValueError(f"{len(entries)} prompt_logprobs entries for {len(chunk)} tokens")
    logprobs, top_ids = [], []
    for pos in scored_positions(len(chunk)):
        entry, token = entries[pos], chunk[pos]
        if entry is None or str(token) not in entry:
            raise ValueError(f"position {pos}: no logprob for the prompt token {token}")
        others = [int(key) for key in entry if int(key) != token]
        if len(others) > 1 or (others and entry[str(others[0])]["rank"] != 1):
            raise ValueError(f"position {pos}: expected the top-1 alternative, got {entry}")
        logprobs.append(float(entry[str(token)]["logprob"]))
        top_ids.append(others[0] if others else token)
    return ChunkScores(logprobs, top_ids)


def perplexity(chunks: list[ChunkScores]) -> float:
    """exp of the mean negative logprob over every scored token."""
    values = [lp for chunk in chunks for lp in chunk.logprobs]
    return math.exp(-math.fsum(values) / len(values))


@dataclass(frozen=True, slots=True)
class Comparison:
    """A run against the reference run on the same chunks."""

    perplexity: float
    ratio: float  # perplexity / the reference's perplexity
    same_top1: float  # fraction of scored positions where both runs' top-1 token is equal
    num_scored: int


def compare(run: list[ChunkScores], reference: list[ChunkScores]) -> Comparison:
    """`run` against `reference`, chunk by chunk (the same chunks, in the same order)."""
    if len(run) != len(reference):
        raise ValueError(f"{len(run)} chunks against {len(reference)}")
    same = total = 0
    for ours, theirs in zip(run, reference, strict=True):
        if len(ours.top_ids) != len(theirs.top_ids):
            raise ValueError("chunks of different lengths")
        same += sum(a == b for a, b in zip(ours.top_ids, theirs.top_ids, strict=True))
        total += len(ours.top_ids)
    ppl = perplexity(run)
    return Comparison(ppl, ppl / perplexity(reference), same / total, total)


@dataclass(frozen=True, slots=True)
class LlamaFigures:
    """What `llama-perplexity --kl-divergence` printed: the quantized file's perplexity,
    the base's (F32), their ratio, the mean KL divergence and "Same top p" (a fraction)."""

    perplexity: float
    base_perplexity: float
    ratio: float
    mean_kld: float
    same_top1: float


_LLAMA_FIELDS = {
    "perplexity": r"Mean PPL\(Q\)\s*:\s*([-\d.]+)",
    "base_perplexity": r"Mean PPL\(base\)\s*:\s*([-\d.]+)",
    "ratio": r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([-\d.]+)",
    "mean_kld": r"Mean\s+KLD:\s*([-\d.]+)",
    "same_top1": r"Same top p:\s*([-\d.]+)\s*±",
}


def parse_llama_kld(log: str) -> LlamaFigures:
    """The summary of a `llama-perplexity --kl-divergence` log. ValueError if a figure is
    missing (the run failed or its output changed)."""
    values = {}
    for name, pattern in _LLAMA_FIELDS.items():
        found = re.search(pattern, log)
        if found is None:
            raise ValueError(f"llama-perplexity output has no {name} ({pattern!r})")
        values[name] = float(found.group(1))
    values["same_top1"] /= 100.0
    return LlamaFigures(**values)


def read_kld_base_tokens(stream: BinaryIO) -> tuple[int, list[int]]:
    """(n_ctx, tokens) from the head of a `--kl-divergence-base` file: b"_logits_", then
    n_ctx (uint32), n_vocab and n_chunk (int32), then n_chunk * n_ctx int32 token ids (the
    text's tokens before any BOS replacement). Reads only that head of the stream."""
    head = stream.read(20)
    if len(head) != 20 or head[:8] != b"_logits_":
        raise ValueError("not a llama-perplexity logits file")
    n_ctx, _n_vocab, n_chunk = struct.unpack_from("<Iii", head, 8)
    count = n_ctx * n_chunk
    body = stream.read(4 * count)
    if len(body) != 4 * count:
        raise ValueError("the logits file ends inside its token list")
    return n_ctx, list(struct.unpack(f"<{count}i", body))
