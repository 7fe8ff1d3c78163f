"""Model runner: owns every piece of device state and turns a step into sampled tokens.

It owns the weights, the KV cache, the buffer of kept prompt-logits rows (addressed by
slot), the persistent per-request state (tokens, seeded generators, block-table rows; see
input_batch.py) and the sampler. It knows nothing of queues or policy: `execute` takes a
`SchedulerOutput` (ids and plain data) and returns a `RunnerOutput` keyed by request id.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from plait.engine.config import EngineConfig
from plait.engine.gguf_weights import load_gguf_weights
from plait.engine.grammar import GrammarCompiler
from plait.engine.host_memory import keep_freed_memory_mapped, release_free_heap, warm_sampler
from plait.engine.input_batch import CachedRequestState, InputBatch
from plait.engine.kv_cache import (
    DTYPES,
    allocate_kv_cache,
    block_bytes,
    blocks_from_memory,
    resolve_kv_dtype,
)
from plait.engine.model_config import ModelConfig
from plait.engine.model_loader import (
    ResolvedModel,
    ensure_float32_weights,
    reads_gguf_directly,
)
from plait.engine.models.linear import resolve_cpu_gemm, select_products, weight_bytes
from plait.engine.models.llama import LlamaForCausalLM
from plait.engine.numerics import Numerics, resolve_numerics
from plait.engine.outputs import TokenLogprob
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sched_output import RunnerOutput, ScheduledChunk, SchedulerOutput
from plait.engine.spec.verify import SpecRequest, Verified, verify_batch, verify_one
from plait.engine.transfer import to_device
from plait.engine.weights import load_weights
from plait.kernels import AttentionMetadata, AttentionShape, TorchOps, select_ops
from plait.kernels.cpu import build, repack
from plait.kernels.cpu.products import prompt_rows, prompt_rows_differ

logger = logging.getLogger("plait.engine")


def resolve_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return torch.device(requested)


def resolve_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[requested]


def engine_numerics(config: EngineConfig, device: torch.device, dtype: torch.dtype,
                    gguf: bool) -> Numerics:
    """`config.numerics` resolved for an engine on `device` computing in `dtype`, of a GGUF
    file or not (the native kernels and their VNNI product as this machine has them built).
    ValueError where the mode asked for cannot run."""
    native = device.type == "cpu" and config.native and build.available()
    vnni = native and repack.isa() >= repack.ISA_VNNI512
    return resolve_numerics(config.numerics, device, dtype, native, vnni,
                            kept=config.weights == "auto", gguf=gguf)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class ModelRunner:
    """Builds the model on `device`, a KV cache sized from `config`, and serves steps.

    The ops table (kernels/ops.py) and the linear layers' weight format are chosen here,
    once, from `config`; the model is built with the table, loaded, converted to the format,
    then bound to the KV cache. `eos_token_ids` are masked for rows below `min_tokens`;
    `seed` seeds the generator of unseeded requests (see `Sampler`)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel,
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.numerics = engine_numerics(config, self.device, self.dtype,
                                        resolved.gguf is not None)
        logger.info("%s", self.numerics.describe())
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device,
                                         self.numerics.kv_dtype)
        if self.device.type == "cpu":
            keep_freed_memory_mapped()  # step temporaries reuse mapped pages
        self.model_config: ModelConfig = resolved.config
        self.block_size = config.block_size
        cfg = self.model_config
        self.ops: TorchOps = select_ops(
            self.device, self.dtype,
            AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.block_size),
            native_kernels=config.native, cascade=config.cascade,
            attention_backend=config.attention_backend,
            cpu_gemm=resolve_cpu_gemm(config.cpu_gemm) if self.device.type == "cpu"
            else "none", compute_dtype=self.numerics.compute_dtype)
        max_pos = config.max_model_len or resolved.config.max_position_embeddings
        # weight_bytes: what the weights hold in memory (kept format + float32 tensors)
        self.model, self.weight_bytes = self._load_model(config, resolved, max_pos)
        if self.device.type == "cpu":
            release_free_heap()  # what loading freed (before warm_sampler maps its own)
        self.num_blocks = config.num_kv_blocks or blocks_from_memory(
            config, self.device, block_bytes(cfg, self.block_size, self.kv_dtype),
            self.weight_bytes)
        self.max_model_len = min(max_pos, self.num_blocks * self.block_size)
        self.kv_cache = allocate_kv_cache(cfg, self.num_blocks, self.block_size, self.kv_dtype,
                                          self.device, config.kv_cache_prefault)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.model.bind(self.kv_caches)
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(config.seed, native_draw=config.native)
        if self.device.type == "cpu":
            warm_sampler(self.sampler, cfg.vocab_size, config.max_num_seqs)
        # Structured output: the engine core's compiler (engine/grammar.py), set by the core.
        self.grammars: GrammarCompiler | None = None
        # Set by the core where speculation asks for it: `RunnerOutput.top_probs`.
        self.report_confidence = False
        self.batch = InputBatch(config.max_num_seqs, cdiv(self.max_model_len, self.block_size),
                                self.device)
        # kept_logits: [max_shared_logits, vocab] float32, rows addressed by kept slot; a
        # row is read only after its slot was written, so unwritten rows stay unset (and,
        # on CPU, their pages untouched: 19 MB for Qwen2's vocabulary)
        self.kept_logits = torch.empty(config.max_shared_logits, cfg.vocab_size,
                                       dtype=torch.float32, device=self.device)
        self.warm_up(config.warm_up_tokens)

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> int:
        """One forward pass of a dummy prompt of `num_tokens` tokens (at most the context)
        into the cache's first blocks, which no request reads before writing them: the
        first prefill's one-time costs (oneDNN generating its kernels, the heap growing to
        a prefill's temporaries, kept mapped by host_memory; those blocks' pages) are paid
        at start rather than by the first prompt, as vLLM's warm-up run does. Returns the
        tokens run (0: none)."""
        n = min(num_tokens, self.max_model_len)
        if n <= 0:
            return 0
        positions = list(range(n))  # block b holds positions [b * block_size, ...): slot = p
        meta = AttentionMetadata(
            slot_mapping=self.to_device(positions, torch.int64),  # [n]
            cu_seqlens_q=self.to_device([0, n], torch.int32),
            context_lens=self.to_device([n], torch.int32),
            block_tables=self._move(torch.arange(cdiv(n, self.block_size),
                                                 dtype=torch.int32)[None]),  # [1, blocks]
            max_query_len=n, max_context_len=n)
        meta.keep = self.to_device([n - 1], torch.int64)  # only the last row's state
        vocab = self.model_config.vocab_size
        # ids 0..n-1: the embedding's first rows, not rows spread over a table that stays
        # file-backed (gguf_weights.py) and would become resident wherever it was read
        input_ids = self.to_device([p % vocab for p in positions], torch.int64)
        pos = self.to_device(positions, torch.int64)
        self.model.compute_logits(self.model(input_ids, pos, self.ops.plan(meta, pos)))
        return n

    def _load_model(self, config: EngineConfig, resolved: ResolvedModel,
                    max_pos: int) -> tuple[LlamaForCausalLM, int]:
        """The model in eval mode, its weights kept in the file's format where
        `config.weights` allows it (float32 CPU), and the bytes its weights hold."""
        with torch.device(self.device):
            model = LlamaForCausalLM(resolved.config, max_pos, self.ops)
        # kept weights compute through the native kernels: without them, float32 weights
        keep = config.weights == "auto" and self.device.type == "cpu" \
            and self.dtype == torch.float32 and self.ops.native
        if config.weights == "auto" and not keep:
            logger.info("weights: dequantized to %s (the file's format is kept only on a "
                        "float32 CPU engine with the native kernels)",
                        str(self.dtype).removeprefix("torch."))
        if resolved.gguf is not None and (keep or reads_gguf_directly(resolved)):
            load_gguf_weights(model, resolved.gguf, keep)
        else:
            load_weights(model, ensure_float32_weights(resolved), keep)
        model = model.to(self.device, self.dtype)  # (the GGUF loader builds on the CPU)
        chosen = select_products(model, self.numerics)  # every linear's product row, once
        # prompt rows in passes of their own where the products compute them apart
        self.split_prompt_rows = self.device.type == "cpu" and prompt_rows_differ(chosen)
        kept, dense = weight_bytes(model)
        logger.info("weights: %.1f MiB (%.1f MiB in the file's blocks, %.1f MiB repacked, "
                    "float or packed)", (kept + dense) / 2**20, kept / 2**20, dense / 2**20)
        return model.eval(), kept + dense

    # ---------------------------------------------------------------- one step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply `out` in the order its docstring gives; return the step's results.

        `update_states` then `compute`: the request states always follow the scheduler,
        even when the computation raises. Raises if the forward pass fails (every request
        of the step is then lost). A failure while sampling one request fails only that
        request (`RunnerOutput.errors`).
        """
        self.update_states(out)
        return self.compute(out)

    def update_states(self, out: SchedulerOutput) -> None:
        """Steps 1-3 of `SchedulerOutput`: forget finished requests, remember new ones,
        rewrite changed block tables."""
        self.batch.apply(out)

    @torch.inference_mode()
    def compute(self, out: SchedulerOutput) -> RunnerOutput:
        """Steps 4-7 of `SchedulerOutput`, on states `update_states` brought up to date."""
        if out.block_copies:
            src = self.to_device([s for s, _ in out.block_copies], torch.int64)
            dst = self.to_device([d for _, d in out.block_copies], torch.int64)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        result = RunnerOutput()
        computed, row_of = self._forward(out, result)  # [num_sample_rows, vocab]
        drafts = {c.request_id: c.draft_token_ids for c in out.chunks if c.draft_token_ids}
        if drafts:
            self._verify(drafts, computed, row_of, result)
        if len(out.samples) > len(drafts):
            self._sample(out, computed, row_of, result, drafts)
        for request_id, slot in out.keep_logits:
            self.kept_logits[slot] = computed[row_of[request_id]]
        return result

    def _forward(self, out: SchedulerOutput,
                 result: RunnerOutput) -> tuple[torch.Tensor, dict[str, int]]:
        """The forward pass over `out.chunks`: the last-position logits of each sampling
        chunk (and the request id -> row map), prompt logprobs into `result`. Where the
        products compute prompt rows apart (`split_prompt_rows`), the chunks of prompt
        tokens run in a pass of their own before the others (decode, verification), so
        each token's state has one definition whatever shares its step."""
        vocab = self.model_config.vocab_size
        if not out.chunks:
            return torch.empty(0, vocab, device=self.device), {}
        if not self.split_prompt_rows:
            return self._forward_chunks(out.chunks, result, prompt=False)
        kinds = [self._prompt_chunk(c) for c in out.chunks]
        prompt = [c for c, is_prompt in zip(out.chunks, kinds, strict=True) if is_prompt]
        generated = [c for c, is_prompt in zip(out.chunks, kinds, strict=True) if not is_prompt]
        if not generated or not prompt:
            return self._forward_chunks(out.chunks, result, prompt=bool(prompt))
        first, first_rows = self._forward_chunks(prompt, result, prompt=True)
        second, second_rows = self._forward_chunks(generated, result, prompt=False)
        row_of = first_rows | {rid: row + first.shape[0] for rid, row in second_rows.items()}
        return torch.cat([first, second]), row_of

    def _prompt_chunk(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` computes prompt tokens (all prompt rows; a chunk that recomputes
        a preempted request's prompt and output together counts as one too)."""
        return chunk.start < len(self.batch.states[chunk.request_id].prompt_token_ids)

    def _forward_chunks(self, chunks: Sequence[ScheduledChunk], result: RunnerOutput,
                        prompt: bool) -> tuple[torch.Tensor, dict[str, int]]:
        """One forward pass over `chunks` (`prompt`: they are prompt rows, which `_forward`
        says only where `split_prompt_rows`): the last-position logits of each sampling
        chunk, in the chunks' order, and the request id -> row map; prompt logprobs into
        `result`."""
        input_ids, positions, meta, sample_idx = self._prepare(chunks)
        # Only the sampled rows' states are needed, unless a chunk scores its prompt.
        every_row = sample_idx.shape[0] == input_ids.shape[0] or any(
            self.batch.states[c.request_id].params.prompt_logprobs is not None
            for c in chunks)
        if not every_row:
            meta.keep = sample_idx
        meta = self.ops.plan(meta, positions)  # the attention plan, once for every layer
        with prompt_rows(prompt):
            hidden = self.model(input_ids, positions, meta)  # [T, hidden], or [K, hidden]
        computed = self.model.compute_logits(hidden[sample_idx] if every_row else hidden)
        # request id -> its first row in `computed` (a speculative chunk has 1 + k rows)
        row_of: dict[str, int] = {}
        num_rows = 0
        for chunk in chunks:
            if chunk.sample:
                row_of[chunk.request_id] = num_rows
                num_rows += 1 + len(chunk.draft_token_ids)
        offset = 0
        for chunk in chunks:
            state = self.batch.states[chunk.request_id]
            num_prompt = len(state.prompt_token_ids)
            if state.params.prompt_logprobs is not None and chunk.start < num_prompt:
                span = self.model.compute_logits(hidden[offset : offset + chunk.num_tokens])
                result.prompt_logprobs[chunk.request_id] = self._prompt_logprobs(
                    state, chunk.start, span)
            offset += chunk.num_tokens
        return computed, row_of

    def _prepare(self, chunks: Sequence[ScheduledChunk]):
        """Flatten the chunks into the model's inputs (see models/llama.py).

        Slots are computed in Python from each request's host copy of its block ids
        (`slot = block_ids[pos // block_size] * block_size + pos % block_size`), so a step
        builds its host tensors from lists with no per-token tensor arithmetic."""
        bs = self.block_size
        batch = self.batch
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        sample_idx: list[int] = []
        max_blocks = 1
        for chunk in chunks:
            state = batch.states[chunk.request_id]
            end = chunk.start + chunk.num_tokens
            num_draft = len(chunk.draft_token_ids)
            input_ids.extend(state.token_ids(chunk.start, end - num_draft))
            input_ids.extend(chunk.draft_token_ids)
            positions.extend(range(chunk.start, end))
            ids = state.block_ids
            slots.extend(ids[p // bs] * bs + p % bs for p in range(chunk.start, end))
            rows.append(batch.row_of[chunk.request_id])
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
            context_lens.append(end)
            max_blocks = max(max_blocks, state.num_blocks)
            if chunk.sample:  # the last row, or every row of a speculative chunk
                sample_idx.extend(range(cu_seqlens[-1] - 1 - num_draft, cu_seqlens[-1]))
        tables = batch.block_table[torch.tensor(rows), :max_blocks]  # [S, max_blocks]
        meta = AttentionMetadata(
            slot_mapping=self.to_device(slots, torch.int64),  # [T]
            cu_seqlens_q=self.to_device(cu_seqlens, torch.int32),  # [S + 1]
            context_lens=self.to_device(context_lens, torch.int32),  # [S]
            block_tables=self._move(tables),
            max_query_len=max(c.num_tokens for c in chunks),
            max_context_len=max(context_lens),
        )
        return (self.to_device(input_ids, torch.int64), self.to_device(positions, torch.int64),
                meta, self.to_device(sample_idx, torch.int64))

    def _prompt_logprobs(self, state: CachedRequestState, start: int,
                         logits: torch.Tensor) -> list[TokenLogprob | None]:
        """Reduce a chunk's prompt logits ([num_tokens, vocab]) at once to the logprob of
        each next prompt token (+ top-k), so no [P, vocab] tensor outlives the step."""
        prompt = state.prompt_token_ids
        scored: list[TokenLogprob | None] = [None] if start == 0 else []
        end = min(start + logits.shape[0], len(prompt) - 1)
        if end <= start:
            return scored
        logprobs = torch.log_softmax(logits[: end - start].float(), dim=-1)
        targets = prompt[start + 1 : end + 1]
        chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
        ranks = (logprobs > chosen).sum(dim=-1) + 1  # [num_scored]
        k = state.params.prompt_logprobs or 0
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],) * 2
        for i, (token, rank) in enumerate(zip(targets, ranks.tolist(), strict=True)):
            top = list(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True))
            scored.append(TokenLogprob(token, chosen[i, 0].item(), top, rank))
        return scored

    # ---------------------------------------------------------------- sampling
    def _sample(self, out: SchedulerOutput, computed: torch.Tensor, row_of: dict[str, int],
                result: RunnerOutput, drafts: Mapping[str, tuple[int, ...]]) -> None:
        """One token for every `SampleRow` (but those of speculative chunks, `drafts`:
        `_verify`), appended to the request's state.

        The rows are sampled as one batch. If that raises, each row is sampled alone (its
        seeded generator rewound first), so one request's failure is its own."""
        samples = [row for row in out.samples if row.request_id not in drafts]
        states = [self.batch.states[row.request_id] for row in samples]
        kept_slots = [row.kept_slot for row in samples if row.kept_slot is not None]
        table = computed
        if kept_slots:
            table = torch.cat([computed, self.kept_logits[self.to_device(kept_slots,
                                                                         torch.int64)]])
        index: list[int] = []
        num_kept = 0
        for row in samples:
            if row.computed_by is not None:
                index.append(row_of[row.computed_by])
            else:
                index.append(computed.shape[0] + num_kept)
                num_kept += 1
        logits = table[self.to_device(index, torch.int64)]  # [num_samples, vocab]
        failed = self._grammars(states, result)
        rewind = [s.generator.get_state() if s.generator is not None else None
                  for s in states]
        picks: list[tuple[int, TokenLogprob | None] | None]
        try:
            sampled = self.sampler(logits, self._metadata(states))
            picks = list(zip(sampled.token_ids, sampled.logprobs, strict=True))
        except Exception:
            logger.exception("batched sampling failed; sampling each request alone")
            picks = []
            for i, (state, saved) in enumerate(zip(states, rewind, strict=True)):
                if state.generator is not None and saved is not None:
                    state.generator.set_state(saved)
                try:
                    alone = self.sampler(logits[i : i + 1], self._metadata([state]))
                    picks.append((alone.token_ids[0], alone.logprobs[0]))
                except Exception as exc:
                    logger.exception("sampling request %s failed", state.request_id)
                    result.errors[state.request_id] = f"{type(exc).__name__}: {exc}"
                    picks.append(None)
        if self.report_confidence and samples:
            top = logits.float()  # [num_samples, vocab]
            top = (top.amax(dim=-1) - torch.logsumexp(top, dim=-1)).exp()  # [num_samples]
            result.top_probs.update(zip([s.request_id for s in states],
                                        torch.nan_to_num(top).tolist(), strict=True))
        for state, pick in zip(states, picks, strict=True):
            if pick is None or state.request_id in failed:
                continue
            token_id, logprob = pick
            if state.grammar is not None and not self._advance(state, token_id, result):
                continue
            state.output_token_ids.append(token_id)
            result.sampled[state.request_id] = token_id
            if logprob is not None:
                result.logprobs[state.request_id] = logprob

    def _verify(self, drafts: Mapping[str, tuple[int, ...]], computed: torch.Tensor,
                row_of: dict[str, int], result: RunnerOutput) -> None:
        """Verify the drafts of speculative chunks (engine/spec/verify.py): the kept
        tokens are appended to each request's state and reported as `accepted` +
        `sampled`. Requests without a grammar are verified in one batch; if that raises,
        and for structured requests, each is verified alone (its generator rewound)."""
        reqs = []
        for request_id, draft in drafts.items():
            state = self.batch.states[request_id]
            reqs.append(SpecRequest(request_id, state.params, state.prompt_token_ids,
                                    state.output_token_ids, state.generator, state.grammar,
                                    draft))
        rows = {r.request_id: computed[row_of[r.request_id]:
                                       row_of[r.request_id] + len(r.draft) + 1] for r in reqs}
        plain = [r for r in reqs if r.grammar is None]
        verified: dict[str, Verified] = {}
        if plain:
            rewind = [r.generator.get_state() if r.generator is not None else None
                      for r in plain]
            try:
                logits = torch.cat([rows[r.request_id] for r in plain])  # [sum(k + 1), vocab]
                batch = verify_batch(self.sampler, logits, plain, self.eos_token_ids)
                verified.update((r.request_id, v) for r, v in zip(plain, batch, strict=True))
            except Exception:
                logger.exception("batched verification failed; verifying each request alone")
                for r, saved in zip(plain, rewind, strict=True):
                    if r.generator is not None and saved is not None:
                        r.generator.set_state(saved)
        for r in reqs:
            if r.request_id in verified:
                continue
            try:
                verified[r.request_id] = verify_one(self.sampler, rows[r.request_id], r,
                                                    self.eos_token_ids)
            except Exception as exc:
                logger.exception("verifying request %s failed", r.request_id)
                verified[r.request_id] = Verified(error=f"{type(exc).__name__}: {exc}")
        for r in reqs:
            self._keep_verified(self.batch.states[r.request_id], verified[r.request_id],
                                result)

    def _keep_verified(self, state: CachedRequestState, verified: Verified,
                       result: RunnerOutput) -> None:
        """Append a verified request's kept tokens to its state and to `result`."""
        request_id = state.request_id
        if verified.error is not None:
            result.errors[request_id] = verified.error
            return
        *accepted, last = verified.token_ids
        state.output_token_ids.extend(verified.token_ids)
        result.accepted[request_id] = accepted
        result.sampled[request_id] = last
        if state.params.logprobs is not None:
            logprobs = [lp for lp in verified.logprobs if lp is not None]
            result.accepted_logprobs[request_id] = logprobs[:-1]
            result.logprobs[request_id] = logprobs[-1]
        if verified.grammar_ended:
            result.grammar_ended.add(request_id)

    def _metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        grammars = [s.grammar for s in states]
        return SamplingMetadata(
            params=[s.params for s in states], generators=[s.generator for s in states],
            prompt_token_ids=[s.prompt_token_ids for s in states],
            output_token_ids=[s.output_token_ids for s in states],
            eos_token_ids=self.eos_token_ids,
            grammars=grammars if any(g is not None for g in grammars) else None)

    # ---------------------------------------------------------------- structured output
    def _grammars(self, states: list[CachedRequestState], result: RunnerOutput) -> set[str]:
        """Give each structured request its matcher at its first sample (from the core's
        compiler, `self.grammars`); the ids whose matcher cannot be made go to `errors`
        (their row is still sampled with the batch, and its pick dropped)."""
        failed: set[str] = set()
        for state in states:
            spec = state.params.structured
            if spec is None or state.grammar is not None:
                continue
            try:
                if self.grammars is None:
                    raise RuntimeError("this runner has no grammar compiler")
                state.grammar = self.grammars.grammar(spec)
            except Exception as exc:
                logger.exception("no grammar for request %s", state.request_id)
                result.errors[state.request_id] = f"{type(exc).__name__}: {exc}"
                failed.add(state.request_id)
        return failed

    def grammar_valid_prefix(self, request_id: str, draft: list[int]) -> int:
        """How many leading tokens of `draft` the request's grammar accepts from its
        current state (all of them for a request without a matcher yet)."""
        state = self.batch.states.get(request_id)
        if state is None:
            return 0
        if state.grammar is None:
            return 0 if state.params.structured is not None else len(draft)
        return state.grammar.valid_prefix(draft)

    def _advance(self, state: CachedRequestState, token_id: int, result: RunnerOutput) -> bool:
        """Advance the request's matcher past its sampled token; False (the request in
        `errors`) if the grammar refuses it. A complete grammar marks `grammar_ended`."""
        assert state.grammar is not None
        if not state.grammar.accept(token_id):
            result.errors[state.request_id] = (
                f"the grammar refused token {token_id}: {state.grammar.error}")
            return False
        if state.grammar.ended:
            result.grammar_ended.add(state.request_id)
        return True

    def _move(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, without waiting for the GPU (see transfer.py)."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """Host list -> device tensor, without waiting for the GPU (see transfer.py)."""
        return to_device(values, self.device, dtype)
