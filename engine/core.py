"""Engine core: schedule -> execute -> sample -> update, one step at a time.

`EngineCore` is synchronous and single-threaded; `AsyncEngine` runs it in a thread and the
offline `LLM` drives it directly. Every request that enters leaves with exactly one delta
whose `finish_reason` is set (stop, length, abort or error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plait.engine.block_pool import BlockPool
from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.detokenizer import IncrementalDetokenizer
from plait.engine.model_loader import ResolvedModel, load_tokenizer, resolve_model
from plait.engine.model_runner import ModelRunner, RunnerOutput
from plait.engine.outputs import RequestDelta, TokenLogprob
from plait.engine.request import Request
from plait.engine.sampler import Sampler, SamplingMetadata
from plait.engine.sampling_params import InvalidParamError, SamplingParams
from plait.engine.scheduler import RequestRejected, Scheduler, SchedulerOutput

logger = logging.getLogger("plait.engine")

# A test-only hook: called with (phase, requests) before each phase ("execute", "sample",
# "detokenize"); raising from it simulates a fault in that phase.
FaultHook = Callable[[str, list[Request]], None]


@dataclass(slots=True)
class StepCounters:
    generation_tokens: int = 0
    failed_steps: int = 0
    steps: int = 0


class EngineCore:
    """Owns the scheduler, the model runner, the sampler and every live request."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None,
                 tokenizer=None, runner: ModelRunner | None = None) -> None:
        self.config = config
        resolved = resolved or resolve_model(config.model)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(resolved.path)
        self.runner = runner or ModelRunner(config, resolved)
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.runner.max_model_len,
                                   config.max_shared_logits)
        self.sampler = Sampler(config.seed)
        eos = set(resolved.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.info = RuntimeInfo(
            device=str(self.runner.device), dtype=str(self.runner.dtype).removeprefix("torch."),
            num_kv_blocks=self.runner.num_blocks, max_model_len=self.runner.max_model_len,
            vocab_size=resolved.config.vocab_size, eos_token_ids=tuple(sorted(eos)),
            model_name=resolved.name)
        self.requests: dict[str, Request] = {}
        self.counters = StepCounters()
        self.last_error: str | None = None
        self.fault_hook: FaultHook | None = None
        self.stalled = False
        self._held_blocks = (0.0, 0)  # (monotonic time computed, value): see _held_by_requests

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, extra_key: str | None = None) -> None:
        """Queue one sequence. Raises `RequestRejected` (never fits) or `ValueError`."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        vocab = self.info.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or {}),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = next((t for t in ids if not 0 <= int(t) < vocab), None)
            if bad is not None:
                raise InvalidParamError(name, f"token id {bad} in '{name}' is outside the "
                                        f"vocabulary [0, {vocab})")
        req = Request(request_id, list(prompt_token_ids), params, extra_key=extra_key)
        self.scheduler.add_request(req)
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params)
        self.requests[request_id] = req

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stop a request at once and free what it holds; None if it is unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req)
        return self._final(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- one step
    def step(self) -> list[RequestDelta]:
        out = self.scheduler.schedule()
        # Nothing schedulable: only a new command (add/abort) can change that.
        self.stalled = out.is_empty
        deltas = [self._finish(req, "length" if req.output_token_ids else "error",
                               error="the request needs more KV blocks than the cache has")
                  for req in out.unservable]
        if not out.chunks and not out.shared:
            return deltas
        self.counters.steps += 1
        batch = [c.request for c in out.chunks] + [s.request for s in out.shared]
        try:
            self._inject("execute", batch)
            run = self.runner.execute(out)
            self._collect_prompt_logprobs(out, run)
            sampled = self._sample(out, run)
        except Exception as exc:  # fail this step's requests, keep the engine alive
            logger.exception("engine step failed")
            self.scheduler.fail_step(out)
            self.counters.failed_steps += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            message = "internal error while computing the request"
            return deltas + [self._finish(r, "error", error=message) for r in batch
                             if r.request_id in self.requests]
        for req, token_id, logprob in sampled:
            delta = self._safe_update(req, token_id, logprob)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _inject(self, phase: str, requests: list[Request]) -> None:
        if self.fault_hook is not None:
            self.fault_hook(phase, requests)

    def _sample(self, out: SchedulerOutput, run: RunnerOutput):
        """Sample one token for every chunk that ended its sequence and every sharer."""
        reqs: list[Request] = []
        rows: list[int] = []
        kept: list[torch.Tensor] = []
        for chunk in out.chunks:
            if chunk.sample:
                reqs.append(chunk.request)
                rows.append(run.row_of[id(chunk.request)])
        for shared in out.shared:
            reqs.append(shared.request)
            if shared.source is not None:
                rows.append(run.row_of[id(shared.source)])
            else:
                assert shared.entry is not None
                kept.append(shared.entry.logits)
                rows.append(run.logits.shape[0] + len(kept) - 1)
        if not reqs:
            return []
        table = torch.cat([run.logits, torch.stack(kept)]) if kept else run.logits
        logits = table[self.runner.to_device(rows, torch.int64)]  # [num_samples, vocab]
        self._inject("sample", reqs)
        for req in reqs:
            if req.params.seed is not None and req.generator is None:
                req.generator = torch.Generator(device=logits.device)
                req.generator.manual_seed(req.params.seed)
        meta = SamplingMetadata(
            params=[r.params for r in reqs], generators=[r.generator for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            eos_token_ids=self.info.eos_token_ids)
        result = self.sampler(logits, meta)
        for chunk in out.chunks:  # owners that just computed a shared prompt keep its row
            req = chunk.request
            if chunk.sample and req.share_entry is not None and not req.output_token_ids:
                row = run.logits[run.row_of[id(req)]].clone()
                self.scheduler.publish_prompt_logits(req, row)
        return list(zip(reqs, result.token_ids, result.logprobs, strict=True))

    # ---------------------------------------------------------------- update
    def _safe_update(self, req: Request, token_id: int,
                     logprob: TokenLogprob | None) -> RequestDelta | None:
        if req.request_id not in self.requests:
            return None
        try:
            self._inject("detokenize", [req])
            return self._update(req, token_id, logprob)
        except Exception as exc:
            logger.exception("update of request %s failed", req.request_id)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return self._finish(req, "error", error="internal error while decoding the output")

    def _update(self, req: Request, token_id: int,
                logprob: TokenLogprob | None) -> RequestDelta:
        params = req.params
        first = not req.output_token_ids
        if first:
            req.first_token_time = time.monotonic()
        req.output_token_ids.append(token_id)
        self.counters.generation_tokens += 1
        if logprob is not None:
            req.cumulative_logprob += logprob.logprob
        reason, stop_reason = self._check_stop(req, token_id)
        # A stop token (EOS or stop_token_ids) ends the text without its own text.
        hide = reason == "stop" and not params.include_stop_str_in_output
        # Below min_tokens a stop string cannot end the request either (as vLLM).
        step = req.detokenizer.step([] if hide else [token_id], finished=reason is not None,
                                    match_stops=len(req.output_token_ids) >= params.min_tokens)
        if step.stop_str is not None:
            reason, stop_reason = "stop", step.stop_str
        delta = RequestDelta(
            req.request_id, token_ids=[token_id], text=step.text,
            logprobs=[logprob] if logprob is not None and params.logprobs is not None else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0)
        if first and req.needs_prompt_logprobs:
            delta.prompt_logprobs = req.prompt_logprobs
        if reason is not None:
            del self.requests[req.request_id]
            self.scheduler.finish(req)
            delta.finish_reason, delta.stop_reason = reason, stop_reason
        return delta

    def _check_stop(self, req: Request, token_id: int) -> tuple[str | None, int | None]:
        params = req.params
        num_out = len(req.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.info.eos_token_ids:
                return "stop", None
            if token_id in params.stop_token_ids:
                return "stop", token_id
        if num_out >= req.max_tokens or req.num_tokens >= self.runner.max_model_len:
            return "length", None
        return None, None

    def _collect_prompt_logprobs(self, out: SchedulerOutput, run: RunnerOutput) -> None:
        """Reduce each chunk's prompt logits to the logprob of the next prompt token (+top-k)
        right away, so a long prompt never keeps [P, vocab] logits around."""
        for chunk in out.chunks:
            req = chunk.request
            logits = run.prompt_logits.get(id(req))
            if logits is None:
                continue
            if chunk.start == 0:
                req.prompt_logprobs = [None]
            end = min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1)
            if end <= chunk.start:
                continue
            logprobs = torch.log_softmax(logits[: end - chunk.start].float(), dim=-1)
            targets = req.prompt_token_ids[chunk.start + 1 : end + 1]
            chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])
            k = req.params.prompt_logprobs or 0
            top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],) * 2
            for i, token in enumerate(targets):
                top = list(zip(top_ids[i].tolist(), top_vals[i].tolist(), strict=True))
                req.prompt_logprobs.append(TokenLogprob(token, chosen[i, 0].item(), top))

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestDelta:
        self.requests.pop(req.request_id, None)
        self.scheduler.finish(req)
        return self._final(req, reason, error)

    def _final(self, req: Request, reason: str, error: str | None = None) -> RequestDelta:
        return RequestDelta(req.request_id, finish_reason=reason, error=error,
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens or 0)

    # ---------------------------------------------------------------- stats
    HELD_BLOCKS_EXACT_UP_TO = 4096  # block-table entries counted after every step
    HELD_BLOCKS_REFRESH_S = 0.5

    def _held_by_requests(self) -> int:
        """Distinct blocks in live requests' block tables. Exact while the tables hold at
        most HELD_BLOCKS_EXACT_UP_TO entries (and so 0 with no request); above that,
        recounted at most every HELD_BLOCKS_REFRESH_S, since walking every table of a large
        long-context batch after every step would cost milliseconds."""
        total = sum(len(req.block_ids) for req in self.requests.values())
        now = time.monotonic()
        if (total <= self.HELD_BLOCKS_EXACT_UP_TO
                or now - self._held_blocks[0] >= self.HELD_BLOCKS_REFRESH_S):
            self._held_blocks = (now, len({
                block for req in self.requests.values() for block in req.block_ids}))
        return self._held_blocks[1]

    def stats(self) -> dict[str, int | float | str | None]:
        s = self.scheduler.stats
        parked = sum(len(e.followers) for e in self.scheduler.share.in_flight.values())
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting) + parked,
            "kv_blocks_used": self.pool.num_used_blocks,
            "kv_blocks_held_by_requests": self._held_by_requests(),
            "kv_blocks_total": self.pool.num_blocks,
            "kv_cache_usage": self.pool.num_used_blocks / self.pool.num_blocks,
            "prompt_tokens_computed": s.prompt_tokens_computed,
            "prompt_tokens_cached": s.prompt_tokens_cached,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            "generation_tokens": self.counters.generation_tokens,
            "shared_prompts_kept": len(self.scheduler.share.ready),
            "failed_steps": self.counters.failed_steps,
            "last_error": self.last_error,
        }
