"""Batched token sampler: logit processors, top-k/top-p/min-p masks, seeded draws, logprobs.

One call samples one token for every row of a `[num_rows, vocab]` logits tensor. The
pipeline (same order as vLLM):

    logits ─► logit_bias ─► allowed_token_ids ─► min_tokens
           ─► repetition / presence / frequency penalties
           ─► (logprobs are read here)
           ─► greedy rows: argmax
           ─► random rows: / temperature ─► top-k ─► top-p ─► min-p ─► softmax ─► draw
           ─► grammar rows whose pick the grammar refuses: grammar mask, pick again

Rows that use defaults never enter a Python loop over the vocab: the common case (every row
plain temperature sampling) is a handful of batched ops. Bias, min_tokens and penalty work is
done only for the rows that ask for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.engine.grammar import RequestGrammar, allowed_tokens
from plait.engine.outputs import TokenLogprob
from plait.engine.sampling_params import SamplingParams
from plait.engine.transfer import to_device
from plait.kernels.cpu import build, native

# Temperatures are clamped to this before dividing, so a tiny positive value cannot turn
# logits into inf (and the softmax into nan); it is already indistinguishable from greedy.
_MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row inputs of one sampling call: row i of the logits belongs to entry i.

    Built by the model runner each step. Every list has one entry per logits row.
    """

    params: list[SamplingParams]
    # A per-request generator (on the logits' device) when the request has a seed, else None.
    generators: list[torch.Generator | None]
    prompt_token_ids: list[list[int]]
    # Tokens generated so far, before this step.
    output_token_ids: list[list[int]]
    # The model's end-of-sequence ids, masked while a row is below `min_tokens`.
    eos_token_ids: tuple[int, ...]
    # The row's grammar (structured output) or None; None for the whole list: no row has one.
    grammars: list[RequestGrammar | None] | None = None


@dataclass(slots=True)
class SamplerOutput:
    """The sampled token of every row, and its logprobs where the row asked for them."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where params.logprobs is None


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float] | None]) -> None:
    """Add `biases[i][token_id]` to `logits[i, token_id]`, in place.

    logits: [num_rows, vocab]. Token ids outside `[0, vocab)` are ignored (the HTTP layer is
    expected to reject them; failing here would fail every request of the batch).
    """
    vocab_size = logits.shape[1]
    for row, bias in enumerate(biases):
        if not bias:
            continue
        items = [(t, b) for t, b in bias.items() if 0 <= t < vocab_size]
        if not items:
            continue
        token_ids = to_device([t for t, _ in items], logits.device)
        values = to_device([b for _, b in items], logits.device, logits.dtype)
        logits[row].index_add_(0, token_ids, values)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[list[int] | None]) -> None:
    """Set every logit of row i outside `allowed[i]` (when given) to -inf, in place (vLLM's
    `allowed_token_ids`). Ids outside the vocabulary are ignored (the HTTP layer rejects
    them)."""
    vocab_size = logits.shape[1]
    for row, ids in enumerate(allowed):
        if not ids:
            continue
        keep = to_device([t for t in ids if 0 <= t < vocab_size], logits.device)
        mask = torch.ones(vocab_size, dtype=torch.bool, device=logits.device)
        mask[keep] = False
        logits[row].masked_fill_(mask, float("-inf"))


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Set the stop tokens of rows still below `min_tokens` to -inf, in place.

    logits: [num_rows, vocab]. Stop tokens are `stop_token_ids` plus the EOS ids (unless
    `ignore_eos`, where EOS does not end the request and so need not be blocked).
    """
    vocab_size = logits.shape[1]
    for row, params in enumerate(meta.params):
        if len(meta.output_token_ids[row]) >= params.min_tokens:
            continue
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(meta.eos_token_ids)
        in_vocab = sorted(t for t in stop_ids if 0 <= t < vocab_size)
        if in_vocab:
            logits[row, in_vocab] = -math.inf


def _token_counts(token_ids: list[list[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list. Returns [num_rows, vocab] int64."""
    max_len = max((len(ids) for ids in token_ids), default=0)
    # Pad with `vocab_size`: those counts land in an extra column that is then dropped.
    padded = torch.full((len(token_ids), max_len), vocab_size, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        padded[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    padded = padded.pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
        else padded
    counts = torch.zeros((len(token_ids), vocab_size + 1), dtype=torch.long, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, prompt_token_ids: list[list[int]],
                    output_token_ids: list[list[int]], repetition_penalties: torch.Tensor,
                    presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor) -> torch.Tensor:
    """Apply repetition, presence and frequency penalties in place; returns `logits`.

    logits: [num_rows, vocab]; each penalty tensor: [num_rows].
    * repetition (HF semantics): for every token seen in the prompt or the output, a positive
      logit is divided by the penalty and a negative one multiplied by it.
    * presence / frequency (OpenAI semantics, output tokens only):
      `logit -= frequency * count + presence * (count > 0)`.
    """
    vocab_size = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size, logits.device)
    seen = (_token_counts(prompt_token_ids, vocab_size, logits.device) > 0) | (output_counts > 0)
    rep = repetition_penalties.to(logits.dtype).unsqueeze(1)  # [num_rows, 1]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency_penalties.to(logits.dtype).unsqueeze(1) * output_counts
    logits -= presence_penalties.to(logits.dtype).unsqueeze(1) * (output_counts > 0)
    return logits


def _needs_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min_tokens and penalties. Returns a float32 tensor; `logits` is untouched.

    logits: [num_rows, vocab]. This is the distribution logprobs are reported from.
    """
    out = logits.float()
    needs_bias = any(p.logit_bias for p in meta.params)
    needs_allowed = any(p.allowed_token_ids for p in meta.params)
    needs_min = any(len(out_ids) < p.min_tokens
                    for p, out_ids in zip(meta.params, meta.output_token_ids, strict=True))
    pen_rows = [i for i, p in enumerate(meta.params) if _needs_penalties(p)]
    if not (needs_bias or needs_allowed or needs_min or pen_rows):
        return out
    if out.data_ptr() == logits.data_ptr():
        out = out.clone()
    if needs_bias:
        apply_logit_bias(out, [p.logit_bias for p in meta.params])
    if needs_allowed:
        apply_allowed_token_ids(out, [p.allowed_token_ids for p in meta.params])
    if needs_min:
        apply_min_tokens(out, meta)
    if pen_rows:
        idx = to_device(pen_rows, out.device)
        ps = [meta.params[i] for i in pen_rows]
        out[idx] = apply_penalties(
            out[idx],
            [meta.prompt_token_ids[i] for i in pen_rows],
            [meta.output_token_ids[i] for i in pen_rows],
            to_device([p.repetition_penalty for p in ps], out.device),
            to_device([p.presence_penalty for p in ps], out.device),
            to_device([p.frequency_penalty for p in ps], out.device))
    return out


def mask_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p, then min-p: masked tokens get -inf. Returns a new tensor.

    logits: [num_rows, vocab] (already divided by temperature); top_k: [num_rows] int, 0 = off;
    top_p: [num_rows] float, 1.0 = off; min_p: [num_rows] float, 0.0 = off.
    * top-k keeps the k largest logits (ties with the k-th value are all kept).
    * top-p keeps the smallest set of most likely tokens whose probability, renormalised
      after top-k, sums to at least p (the most likely token is always kept).
    * min-p keeps tokens whose probability is at least `min_p * max probability`.
    Softmax of the result is the renormalised distribution over the kept tokens.
    """
    vocab_size = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending: [num_rows, vocab]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size).to(torch.long)
    kth_value = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_rows, 1]
    sorted_logits.masked_fill_(sorted_logits < kth_value, -math.inf)
    # Mass at or below each token (ascending); tokens whose mass fits in 1 - p are dropped.
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    top_p_mask = cum_probs <= (1.0 - top_p.to(cum_probs.dtype)).unsqueeze(1)
    top_p_mask[:, -1] = False
    sorted_logits.masked_fill_(top_p_mask, -math.inf)
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf masks nothing.
    threshold = sorted_logits[:, -1:] + min_p.to(sorted_logits.dtype).log().unsqueeze(1)
    sorted_logits.masked_fill_(sorted_logits < threshold, -math.inf)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _needs_mask(params: SamplingParams) -> bool:
    return bool(params.top_k) or params.top_p < 1.0 or params.min_p > 0.0


def _compute_logprobs(processed: torch.Tensor, token_ids: list[int],
                      params: list[SamplingParams]) -> list[TokenLogprob | None]:
    """Logprob of each sampled token plus the top `params.logprobs` alternatives (descending).

    processed: [num_rows, vocab], the logits after bias and penalties (see `Sampler`).
    """
    result: list[TokenLogprob | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return result
    device = processed.device
    if len(rows) < len(params):
        processed = processed[to_device(rows, device)]
    logprobs = processed.log_softmax(dim=-1)  # [num_logprob_rows, vocab]
    chosen = to_device([token_ids[i] for i in rows], device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen).squeeze(1).tolist()
    max_k = min(max(params[i].logprobs or 0 for i in rows), logprobs.shape[1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_k > 0:
        top = logprobs.topk(max_k, dim=-1)  # values, indices: [num_logprob_rows, max_k]
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    for n, row in enumerate(rows):
        k = params[row].logprobs or 0
        pairs = list(zip(top_ids[n][:k], top_values[n][:k], strict=True)) if k else []
        result[row] = TokenLogprob(token_ids[row], chosen_logprobs[n], pairs)
    return result


def _inverse_cdf(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token of each row by inverse-CDF: the first token whose cumulative mass exceeds
    `u * total`. logits: [num_rows, vocab] float32 (masked = -inf); u: [num_rows, 1] in
    [0, 1). Returns [num_rows] int64.

        weights  0.2 0.0 0.5 0.3     cdf  0.2 0.2 0.7 1.0     u * total = 0.45  ->  token 2

    Token i is picked for u * total in [cdf[i-1], cdf[i]), an interval of its own weight, so
    a zero-weight token never is; a rounding overshoot past the last positive weight is
    clamped back to it. The weights are unnormalised (`exp(logit - max)`), so no softmax
    division is needed; u has float32 resolution (2**-24 of the total mass).
    """
    amax = logits.amax(dim=-1, keepdim=True)  # [num_rows, 1]
    # A +inf logit (e.g. a tiny repetition_penalty) takes all the mass, shared with its
    # equals; inf - inf would be NaN, and a NaN cdf sends searchsorted past the vocabulary.
    weights = torch.exp(torch.where(logits == amax, 0.0, logits - amax))  # [num_rows, vocab]
    cdf = weights.cumsum_(dim=-1)  # [num_rows, vocab], non-decreasing
    total = cdf[:, -1:].contiguous()  # [num_rows, 1]
    picked = torch.searchsorted(cdf, u * total, right=True)  # [num_rows, 1]
    last_positive = torch.searchsorted(cdf, total, right=False)  # first index at the total
    # Clamped: a NaN row (no sane distribution) still gives a token id in the vocabulary.
    return torch.minimum(picked, last_positive).clamp_(max=logits.shape[1] - 1).squeeze(1)


class Sampler:
    """Samples one token per logits row. Called by the model runner once per step.

    Randomness: a row whose request has a seed draws its random number only from its own
    generator (`meta.generators[i]`, one uniform per random step), so its tokens depend
    only on its seed and its own logits, not on the batch or the row position. Unseeded
    rows share one batched draw from the sampler's generator (seeded by `seed`). Sampling
    is inverse-CDF with that one uniform per row (see `_inverse_cdf`): no vocabulary-wide
    random draw, and no device sync, unlike `torch.multinomial`.

    Logprobs are `log_softmax` of the logits after logit_bias, min_tokens and penalties but
    before temperature, top-k, top-p, min-p and the grammar mask: they describe the model's
    (adjusted) distribution, independent of the sampling knobs and of structured output (as
    vLLM's default). Greedy rows never consume randomness.

    Grammar rows (`meta.grammars`): see `_constrain`. A row whose first pick the grammar
    refuses draws a second uniform from its generator, so seeded structured output is still
    reproducible and independent of the batch.
    """

    def __init__(self, seed: int = 0, native_draw: bool = True) -> None:
        """`native_draw`: draw float32 CPU rows with the native kernel where it is built
        (`native.sample_inverse_cdf`, the same rule as `_inverse_cdf`)."""
        self._seed = seed
        self._native = native_draw and build.available()
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [num_rows, vocab], any float dtype; it is not modified."""
        num_rows = logits.shape[0]
        lengths = {len(meta.params), len(meta.generators), len(meta.prompt_token_ids),
                   len(meta.output_token_ids)}
        if lengths != {num_rows}:
            raise ValueError(f"SamplingMetadata lists must all have {num_rows} entries")
        processed = process_logits(logits, meta)  # [num_rows, vocab] float32
        tokens = self._pick(processed, meta.params, meta.generators).tolist()
        source = processed
        if meta.grammars is not None:
            source = self._constrain(logits, processed, tokens, meta)
        return SamplerOutput(tokens, _compute_logprobs(source, tokens, meta.params))

    def _pick(self, processed: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> torch.Tensor:
        """Argmax for greedy rows, one draw for the others. Returns [num_rows] int64."""
        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return processed.argmax(dim=-1)
        if not greedy_rows:
            return self._sample(processed, params, generators)
        device = processed.device
        token_ids = torch.empty(len(params), dtype=torch.long, device=device)
        g_idx = to_device(greedy_rows, device)
        token_ids[g_idx] = processed[g_idx].argmax(dim=-1)
        r_idx = to_device(random_rows, device)
        token_ids[r_idx] = self._sample(processed[r_idx], [params[i] for i in random_rows],
                                        [generators[i] for i in random_rows])
        return token_ids

    def _constrain(self, logits: torch.Tensor, processed: torch.Tensor, tokens: list[int],
                   meta: SamplingMetadata) -> torch.Tensor:
        """Replace, in `tokens`, each pick its row's grammar refuses by a pick from the
        grammar-masked distribution (drawn with the row's own generator). Returns the
        logits the logprobs are read from (`processed`, see the class docstring).

        A pick the grammar allows is kept as is, so the grammar never changes a token the
        seed picks when the grammar allows it; the full mask is computed only for refused
        rows. For plain temperature sampling the result is distributed exactly as sampling
        from the masked distribution: P(t) = p(t) + (1 - A) p(t) / A = p(t) / A, with A the
        allowed mass. Where min_tokens blocks every token the grammar allows (it wants EOS),
        the grammar wins: that row is masked from the unprocessed logits instead."""
        assert meta.grammars is not None
        rows = [i for i, g in enumerate(meta.grammars)
                if g is not None and not g.allows(tokens[i])]
        if not rows:
            return processed
        device = processed.device
        grammars = [g for i in rows if (g := meta.grammars[i]) is not None]  # every row's
        broken = next((g.error for g in grammars if g.error), None)
        if broken:  # never happens to the runner's matchers; fails that row when alone
            raise ValueError(f"the grammar allows no token: {broken}")
        allowed = allowed_tokens(grammars, processed.shape[1], device)
        idx = to_device(rows, device)
        masked = processed[idx].masked_fill(~allowed, -math.inf)  # [R, vocab]
        blocked = (masked.amax(dim=-1) == -math.inf).tolist()
        if any(blocked):
            raw = logits[idx].float().masked_fill(~allowed, -math.inf)
            empty = (raw.amax(dim=-1) == -math.inf).tolist()
            if any(empty):
                raise ValueError("the grammar allows no token of the model's vocabulary")
            which = to_device([j for j, b in enumerate(blocked) if b], device)
            masked[which] = raw[which]
            processed = processed.clone()
            processed[idx[which]] = logits[idx[which]].float()
        picks = self._pick(masked, [meta.params[i] for i in rows],
                           [meta.generators[i] for i in rows]).tolist()
        for i, token in zip(rows, picks, strict=True):
            tokens[i] = token
        return processed

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """Temperature, masks and one draw per row. logits: [num_rows, vocab] float32."""
        device = logits.device
        temperatures = to_device([max(p.temperature, _MIN_TEMPERATURE) for p in params],
                                 device)
        logits = logits / temperatures.unsqueeze(1)
        mask_rows = [j for j, p in enumerate(params) if _needs_mask(p)]
        if mask_rows:
            ps = [params[j] for j in mask_rows]
            idx = to_device(mask_rows, device)
            logits[idx] = mask_logits(
                logits[idx],
                to_device([p.top_k or 0 for p in ps], device),
                to_device([p.top_p for p in ps], device),
                to_device([p.min_p for p in ps], device))
        u = self._uniforms(generators, device)
        if self._native and device.type == "cpu" and logits.dtype == torch.float32:
            return native.sample_inverse_cdf(logits, u)  # the same rule, one pass per row
        return _inverse_cdf(logits, u)

    def _uniforms(self, generators: list[torch.Generator | None],
                  device: torch.device) -> torch.Tensor:
        """One U[0, 1) number per row: [num_rows, 1]. A seeded row draws it from its own
        generator; the unseeded rows share one draw from the sampler's generator."""
        unseeded = [j for j, g in enumerate(generators) if g is None]
        if len(unseeded) == len(generators):
            return torch.rand((len(generators), 1), device=device,
                              generator=self._generator(device))
        u = torch.empty((len(generators), 1), device=device)
        if unseeded:
            u[to_device(unseeded, device)] = torch.rand(
                (len(unseeded), 1), device=device, generator=self._generator(device))
        for j, g in enumerate(generators):
            if g is not None:
                u[j] = torch.rand(1, device=device, generator=g)
        return u

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self._seed)
            self._generators[device] = generator
        return generator
