"""Verification of drafts: which drafted tokens the target model keeps, and its own next
token, in one pass over the k + 1 logits rows a speculative chunk computed.

Row j of a chunk is the model's distribution p_j after the sequence's known tokens and the
draft's first j tokens. Every row is run through the ordinary sampler (engine/sampler.py)
as the row of a request whose output already holds those j draft tokens, so logit bias,
min_tokens, penalties (row j sees the tokens accepted before it), temperature, top-k/p,
min-p, grammar masks and logprobs are exactly what non-speculative decoding would apply at
that position. The sampler picks y_j from row j; d_j is kept while y_j == d_j, and the
first y_j that differs (or y_k after a fully kept draft) is the model's own token:

    draft    d0  d1  d2  d3
    picks    y0  y1  y2  y3  y4
             ==  ==  !=               kept: d0 d1, then y2 (3 tokens for one step)

Why this is exact. Greedy: y_j is the argmax, so the output is greedy decoding's. Sampling:
the drafts are deterministic given the sequence (the proposal q is one-hot at d_j), and
for such a q this is Leviathan et al.'s / Chen et al.'s rejection sampling: d_j is kept
with probability p_j(d_j) = min(1, p_j(d_j) / q(d_j)), and on a miss y_j is distributed as
p_j restricted to tokens != d_j, renormalised, which is norm(max(0, p_j - q)). Better: y_j
is drawn with the request's generator exactly as non-speculative sampling would draw it
(one uniform per kept token, the same inverse-CDF rule), so a seeded request gives the
same tokens with and without speculation, and choice i of n still equals n=1 with
seed + i. Rows after the first miss are discarded, and the generator is rewound to have
advanced once per kept token only. "The same" up to the logits' float rounding: a row
of a (k + 1)-row chunk and the row of a one-row decode step differ by GEMM summation
order (about 1e-6 in logprobs on the tests' tiny model), which can move a sampled pick
across a boundary of the inverse CDF, rarely (a flat distribution's tail makes it less
rare), exactly as a different batch composition can without speculation.

Structured requests are verified row by row (`verify_one`): the grammar matcher must
advance through the kept drafts before it can mask the next row, and a refused pick
draws a second uniform, in the order non-speculative decoding draws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from plait.engine.grammar import RequestGrammar
from plait.engine.outputs import TokenLogprob
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SpecRequest:
    """One request to verify: what the runner keeps of it, and its draft."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # before this step
    generator: torch.Generator | None
    grammar: RequestGrammar | None
    draft: tuple[int, ...]


@dataclass(slots=True)
class Verified:
    """The tokens kept for one request: the accepted drafts, then the model's own token
    (`token_ids[-1]`; so 1 + number accepted tokens), with their logprobs where asked.
    `grammar_ended`: the grammar is complete after the last token. `error`: the request
    failed (its grammar refused its own pick); `token_ids` is then empty."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    grammar_ended: bool = False
    error: str | None = None

    @property
    def num_accepted(self) -> int:
        return max(len(self.token_ids) - 1, 0)


def verify_batch(sampler: Sampler, logits: torch.Tensor, reqs: Sequence[SpecRequest],
                 eos_token_ids: tuple[int, ...]) -> list[Verified]:
    """Verify requests without grammars in one sampler call.

    logits: [sum(len(r.draft) + 1 for r in reqs), vocab], each request's k + 1 rows in
    order. A seeded generator is used for its request's rows in row order (one uniform
    per random row) and then rewound to have advanced once per kept token."""
    params: list[SamplingParams] = []
    generators: list[torch.Generator | None] = []
    prompts: list[list[int]] = []
    outputs: list[list[int]] = []
    for req in reqs:
        if req.grammar is not None:
            raise ValueError(f"{req.request_id} has a grammar: verify it with verify_one")
        for j in range(len(req.draft) + 1):
            params.append(req.params)
            generators.append(req.generator)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids + list(req.draft[:j]))
    saved = [r.generator.get_state() if r.generator is not None else None for r in reqs]
    sampled = sampler(logits, SamplingMetadata(params, generators, prompts, outputs,
                                               eos_token_ids))
    results: list[Verified] = []
    row = 0
    for req, state in zip(reqs, saved, strict=True):
        picks = sampled.token_ids[row : row + len(req.draft) + 1]
        num_kept = _num_kept(req.draft, picks)
        results.append(Verified(picks[:num_kept],
                                sampled.logprobs[row : row + num_kept]))
        row += len(req.draft) + 1
        if req.generator is not None and state is not None and not req.params.greedy:
            _rewind(req.generator, state, num_kept, logits.device)
    return results


def verify_one(sampler: Sampler, logits: torch.Tensor, req: SpecRequest,
               eos_token_ids: tuple[int, ...]) -> Verified:
    """Verify one request row by row (any request; the only way for a structured one).

    logits: [len(req.draft) + 1, vocab]. A grammar is advanced past every kept token
    (as the runner advances it past a sampled one); verification stops where it ends."""
    result = Verified()
    output = list(req.output_token_ids)
    grammars: list[RequestGrammar | None] | None = None if req.grammar is None else [req.grammar]
    for j in range(len(req.draft) + 1):
        meta = SamplingMetadata([req.params], [req.generator], [req.prompt_token_ids],
                                [output], eos_token_ids, grammars)
        sampled = sampler(logits[j : j + 1], meta)
        token = sampled.token_ids[0]
        if req.grammar is not None and not req.grammar.accept(token):
            return Verified(error=f"the grammar refused token {token}: {req.grammar.error}")
        result.token_ids.append(token)
        result.logprobs.append(sampled.logprobs[0])
        output.append(token)
        if req.grammar is not None and req.grammar.ended:
            result.grammar_ended = True
            break
        if j == len(req.draft) or token != req.draft[j]:
            break
    return result


def _num_kept(draft: Sequence[int], picks: Sequence[int]) -> int:
    """1 + the length of the longest prefix of `draft` that `picks` repeat."""
    num = 0
    while num < len(draft) and picks[num] == draft[num]:
        num += 1
    return num + 1


def _rewind(generator: torch.Generator, state: torch.Tensor, num_draws: int,
            device: torch.device) -> None:
    """Put `generator` where `num_draws` uniforms (the sampler's one per random row,
    Sampler._uniforms) after `state` leave it."""
    generator.set_state(state)
    for _ in range(num_draws):
        torch.rand(1, device=device, generator=generator)
