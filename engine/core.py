"""Engine core: one step is schedule -> execute -> update.

    SchedulerOutput = scheduler.schedule()      ids and plain data (sched_output.py)
    RunnerOutput    = runner.execute(...)       forward pass + sampling, keyed by request id
    deltas          = self._update(...)         append tokens, detokenize, stop checks
                                                (request_output.py: each token's delta)

`EngineCore` is synchronous and single-threaded; `AsyncEngine` runs it in a thread, the
engine process (engine_process.py) in a child process, and the offline `LLM` drives it
directly. Every request that enters leaves with exactly one delta whose `finish_reason` is
set (stop, length, abort or error).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.engine.block_pool import BlockPool
from plait.engine.config import EngineConfig, RuntimeInfo
from plait.engine.core_api import EngineStats, StepResult
from plait.engine.detokenizer import IncrementalDetokenizer
from plait.engine.grammar import GrammarCompiler, GrammarError
from plait.engine.kv_events import KVEventPublisher
from plait.engine.kv_warm import kv_warmer
from plait.engine.model_loader import ResolvedModel, load_tokenizer, resolve_model
from plait.engine.model_runner import ModelRunner
from plait.engine.outputs import RequestDelta, TokenLogprob
from plait.engine.request import Request
from plait.engine.request_output import OutputState, token_delta
from plait.engine.sampling_params import SamplingParams
from plait.engine.sched_output import RunnerOutput, SchedulerOutput
from plait.engine.scheduler import Scheduler
from plait.engine.spec.driver import SpecDecoder
from plait.engine.spec.target import TargetModel
from plait.engine.structured import GRAMMAR_FAILED
from plait.engine.vocabulary import TextDecoder, Vocabulary, text_decoder

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("plait.engine")

# Builds a request's detokenizer: (text decoder, prompt token ids, params) -> detokenizer.
DetokenizerFactory = Callable[[TextDecoder, list[int], SamplingParams], IncrementalDetokenizer]
RunnerFactory = Callable[..., ModelRunner]

SAMPLING_FAILED = "internal error while sampling the request"
STEP_FAILED = "internal error while computing the request"
# How long a step with nothing to compute waits for a grammar being compiled.
COMPILE_WAIT_S = 0.05


@dataclass(slots=True)
class StepCounters:
    generation_tokens: int = 0
    failed_steps: int = 0
    steps: int = 0


def eos_token_ids(resolved: ResolvedModel, tokenizer_eos: int | None) -> tuple[int, ...]:
    """The model's end-of-sequence ids: its config's, plus the tokenizer's own."""
    eos = set(resolved.config.eos_token_ids)
    if tokenizer_eos is not None:
        eos.add(tokenizer_eos)
    return tuple(sorted(eos))


class EngineCore:
    """Owns the scheduler, the model runner and every live request (by id).

    Text comes from `vocabulary` (vocabulary.py) when given: the engine process gets it
    from the API process, and then loads the model's tokenizer only when something asks for
    `tokenizer` (a grammar, a draft model's vocabulary check). Else from `tokenizer`, loaded
    here when not given.

    `runner_factory(config, resolved, eos_token_ids=...)` and `detokenizer_factory` are the
    seams tests use to inject faults (engine/faults.py); production uses the defaults.
    Requests must be validated before `add_request` (engine/validation.py)."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None,
                 runner_factory: RunnerFactory = ModelRunner,
                 detokenizer_factory: DetokenizerFactory = IncrementalDetokenizer,
                 vocabulary: Vocabulary | None = None) -> None:
        self.config = config
        resolved = resolved or resolve_model(config.model, config.weights == "float32")
        self._tokenizer_path = resolved.path
        self._tokenizer = tokenizer
        self._tokenizer_lock = threading.Lock()
        self.text: TextDecoder = vocabulary if vocabulary is not None \
            else text_decoder(self.tokenizer)
        eos = eos_token_ids(resolved, self.text.eos_token_id)
        self.runner = runner_factory(config, resolved, eos_token_ids=eos)
        self.pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching,
                              record_events=config.kv_events_endpoint is not None)
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint is not None and self.pool.events is None:
            logger.warning("--kv-events-endpoint ignored: prefix caching is off")
        elif config.kv_events_endpoint is not None:
            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint, config.kv_events_topic,
                config.kv_events_replay_endpoint, config.block_size, config.kv_events_encoding)
        self.warmer = kv_warmer(config, getattr(self.runner, "kv_cache", None), self.pool)
        self.scheduler = Scheduler(self.pool, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, self.runner.max_model_len,
                                   config.max_shared_logits,
                                   config.max_prefill_tokens_with_decodes)
        self.detokenizer_factory = detokenizer_factory
        self.info = RuntimeInfo(
            device=str(self.runner.device), dtype=str(self.runner.dtype).removeprefix("torch."),
            num_kv_blocks=self.runner.num_blocks, max_model_len=self.runner.max_model_len,
            vocab_size=resolved.config.vocab_size, eos_token_ids=eos,
            model_name=resolved.name, block_size=config.block_size,
            weight_bytes=getattr(self.runner, "weight_bytes", 0))
        self.requests: dict[str, Request] = {}
        self.outputs: dict[str, OutputState] = {}  # by request id, for each of `requests`
        # Structured requests whose grammar is still being compiled (not yet scheduled).
        self.grammars = GrammarCompiler(lambda: self.tokenizer, eos_ids=eos)
        self.runner.grammars = self.grammars
        self.compiling: dict[str, tuple[Request, Future[None]]] = {}
        self.counters = StepCounters()
        self.last_error: str | None = None
        self.spec: SpecDecoder | None = None  # speculative decoding (engine/spec/)
        if config.speculative_config is not None:
            target = TargetModel(config, resolved.name, resolved.config.vocab_size,
                                 lambda: self.tokenizer,
                                 self.runner.num_blocks * config.block_size,
                                 self.runner.weight_bytes)
            self.spec = SpecDecoder(config.speculative_config, self.runner.max_model_len,
                                    vocab_size=resolved.config.vocab_size, target=target)
            self.runner.report_confidence = self.spec.wants_confidence
            logger.info("speculative decoding: %s", config.speculative_config.to_json())

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer, loaded on first use when the core was given only its
        vocabulary (any thread: the grammar compiler asks from its worker)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = load_tokenizer(self._tokenizer_path)
            return self._tokenizer

    # ---------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, extra_key: str | None = None) -> None:
        """Queue one sequence, already validated (`validate_request`). Raises `ValueError`
        for a duplicate id, `RequestRejected` if it can never fit."""
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        req = Request(request_id, list(prompt_token_ids), params, extra_key=extra_key)
        self.outputs[request_id] = OutputState(
            self.detokenizer_factory(self.text, req.prompt_token_ids, params))
        if params.structured is not None:  # scheduled once its grammar is compiled
            self.compiling[request_id] = (req, self.grammars.submit(params.structured))
        else:
            self.scheduler.add_request(req)
        self.requests[request_id] = req

    def abort(self, request_id: str) -> RequestDelta | None:
        """Stop a request at once and free what it holds; None if it is unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        del self.outputs[request_id]
        if self.spec is not None:
            self.spec.finish(request_id)
        if self.compiling.pop(request_id, None) is None:
            self.scheduler.finish(req)
        return self._final(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def idle_work(self) -> bool:
        """One short slice of work for an idle engine (warming the KV cache's next blocks,
        engine/kv_warm.py); True while more remains. The loop calls it only while no step
        can make progress (nothing unfinished, or the last step stalled) and no command is
        waiting."""
        return self.warmer is not None and self.warmer.step()

    # ---------------------------------------------------------------- one step
    def step(self) -> StepResult:
        """Schedule, execute, update. A failing forward pass fails that step's requests
        (and keeps the engine alive); a failing sampling or detokenization fails only the
        request it belongs to. Structured requests enter the scheduler once their grammar
        is compiled; one whose grammar cannot compile finishes with "error" here. The
        result is `stalled` when nothing was scheduled and no grammar is compiling: only a
        new or a finished request can change that."""
        admitted = self._admit_compiled()
        drafts = None
        if self.spec is not None:
            drafts = self.spec.drafts(self.scheduler.running,
                                      getattr(self.runner, "grammar_valid_prefix", None))
        out = self.scheduler.schedule(drafts)
        stalled = not out.has_work and not out.unservable_ids and not self.compiling
        if not out.has_work and self.compiling and not admitted:
            # nothing to compute: wait a little for a grammar instead of spinning
            wait([f for _, f in self.compiling.values()], COMPILE_WAIT_S, FIRST_COMPLETED)
        try:
            run = self.runner.execute(out)
        except Exception as exc:  # fail this step's requests, keep the engine alive
            deltas = admitted + self._fail_step(out, exc)
        else:
            deltas = admitted + self._update(out, run)
        events = self.pool.events  # recorded whenever kv_events is set
        if self.kv_events is not None and events is not None:  # this step's blocks
            self.kv_events.publish(events.take())
        return StepResult(deltas, stalled)

    def close(self) -> None:
        """Flush and close the KV events publisher (the rest needs no closing)."""
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None

    def _admit_compiled(self) -> list[RequestDelta]:
        """Move the requests whose grammar compiled into the scheduler (in arrival order,
        so the n choices of a request still share their prompt); fail those whose grammar
        cannot compile."""
        deltas: list[RequestDelta] = []
        for request_id, (req, future) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            exc = future.exception()
            if exc is None:
                self.scheduler.add_request(req)
                continue
            if not isinstance(exc, GrammarError):
                logger.error("compiling the grammar of %s failed", request_id, exc_info=exc)
            self._forget(req)
            deltas.append(self._final(req, "error", error=f"{GRAMMAR_FAILED}: {exc}"))
        return deltas

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[RequestDelta]:
        logger.exception("engine step failed")
        self.scheduler.fail_step(out)
        self.counters.failed_steps += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        ids = dict.fromkeys([c.request_id for c in out.chunks]
                            + [s.request_id for s in out.samples]
                            + list(out.unservable_ids))
        return [self._finish(self.requests[i], "error", error=STEP_FAILED)
                for i in ids if i in self.requests]

    def _update(self, out: SchedulerOutput, run: RunnerOutput) -> list[RequestDelta]:
        """Apply the step's results to the requests; return their deltas."""
        if out.has_work:
            self.counters.steps += 1
        self.scheduler.update_from_output(out)
        deltas = [self._finish(self.requests[i], "length" if self.requests[i].output_token_ids
                               else "error",
                               error="the request needs more KV blocks than the cache has")
                  for i in out.unservable_ids if i in self.requests]
        restarted = {c.request_id for c in out.chunks if c.start == 0}
        for request_id, scored in run.prompt_logprobs.items():
            output = self.outputs.get(request_id)
            if output is None:
                continue
            if request_id in restarted:  # (again, when recomputed after a preemption)
                output.prompt_logprobs = []
            output.prompt_logprobs.extend(scored)
        self._copy_shared_prompt_logprobs(out)
        if self.spec is not None:
            for request_id in out.preempted_ids:
                self.spec.finish(request_id, preempted=True)
        spec_chunks = {c.request_id: c for c in out.chunks if c.draft_token_ids}
        for row in out.samples:
            req = self.requests.get(row.request_id)
            if req is None:
                continue
            if row.request_id in run.errors:
                self.last_error = run.errors[row.request_id]
                deltas.append(self._finish(req, "error", error=SAMPLING_FAILED))
                continue
            accepted = run.accepted.get(row.request_id, [])
            accepted_logprobs: list[TokenLogprob | None] = [None] * len(accepted)
            if row.request_id in run.accepted_logprobs:
                accepted_logprobs = list(run.accepted_logprobs[row.request_id])
            chunk = spec_chunks.get(row.request_id)
            if self.spec is not None:  # before the tokens: one may finish the request,
                # whose speculation state then goes (SpecDecoder.finish)
                if chunk is not None:
                    self.spec.verified(req.request_id, len(chunk.draft_token_ids),
                                       len(accepted))
                if row.request_id in run.top_probs:
                    self.spec.observe(row.request_id, run.top_probs[row.request_id])
            delta = self._safe_update(req, [*accepted, run.sampled[row.request_id]],
                                      [*accepted_logprobs, run.logprobs.get(row.request_id)],
                                      row.request_id in run.grammar_ended)
            if delta is not None:
                deltas.append(delta)
            if chunk is not None and req.request_id in self.requests:  # not finished
                self.scheduler.verified(req, chunk.start, 1 + len(accepted))
        return deltas

    def _copy_shared_prompt_logprobs(self, out: SchedulerOutput) -> None:
        """A follower that asked for prompt logprobs samples from its owner's row (same
        prompt, same `prompt_logprobs`, see prompt_share.py): it gets a copy of the owner's
        scores, which this step completed, so the prompt is scored once."""
        for row in out.samples:
            if row.computed_by is None or row.computed_by == row.request_id:
                continue
            req = self.requests.get(row.request_id)
            owner = self.outputs.get(row.computed_by)
            if req is not None and owner is not None and req.needs_prompt_logprobs:
                self.outputs[row.request_id].prompt_logprobs = list(owner.prompt_logprobs)

    # ---------------------------------------------------------------- update
    def _safe_update(self, req: Request, token_ids: list[int],
                     logprobs: list[TokenLogprob | None],
                     grammar_ended: bool = False) -> RequestDelta | None:
        """Append the step's tokens of `req` (one, or a verified draft's accepted tokens
        then the model's own) one at a time, each with its stop checks, as one delta; the
        tokens after one that finishes the request are dropped. `grammar_ended` is about
        the last token."""
        if req.request_id not in self.requests:
            return None
        try:
            delta: RequestDelta | None = None
            last = len(token_ids) - 1
            for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs, strict=True)):
                step = self._append_token(req, token_id, logprob, grammar_ended and i == last)
                if delta is None:
                    delta = step
                else:
                    delta.merge(step)
                if delta.finished:
                    break
            return delta
        except Exception as exc:
            logger.exception("update of request %s failed", req.request_id)
            self.last_error = f"{type(exc).__name__}: {exc}"
            return self._finish(req, "error", error="internal error while decoding the output")

    def _append_token(self, req: Request, token_id: int, logprob: TokenLogprob | None,
                      grammar_ended: bool = False) -> RequestDelta:
        """Append one sampled token (request_output.token_delta); a token that ends the
        request frees it here."""
        self.counters.generation_tokens += 1
        delta = token_delta(req, self.outputs[req.request_id], token_id, logprob,
                            self.info.eos_token_ids, self.runner.max_model_len, grammar_ended)
        if delta.finished:
            self._forget(req)
            self.scheduler.finish(req)
        return delta

    def _finish(self, req: Request, reason: str, error: str | None = None) -> RequestDelta:
        self._forget(req)
        self.scheduler.finish(req)
        return self._final(req, reason, error)

    def _forget(self, req: Request) -> None:
        """Drop a finished request's entries (the scheduler frees what it holds)."""
        self.requests.pop(req.request_id, None)
        self.outputs.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.finish(req.request_id)

    def _final(self, req: Request, reason: str, error: str | None = None) -> RequestDelta:
        return RequestDelta(req.request_id, finish_reason=reason, error=error,
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens or 0)

    # ---------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        s = self.scheduler.stats
        parked = self.scheduler.share.num_parked
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + parked + len(self.compiling),
            kv_blocks_used=self.pool.num_used_blocks,
            kv_blocks_total=self.pool.num_blocks,
            prompt_tokens_computed=s.prompt_tokens_computed,
            prompt_tokens_cached=s.prompt_tokens_cached,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            generation_tokens=self.counters.generation_tokens,
            shared_prompts_kept=len(self.scheduler.share.kept),
            failed_steps=self.counters.failed_steps,
            last_error=self.last_error,
            model_weight_bytes=self.info.weight_bytes,
            kv_events_dropped=0 if self.kv_events is None else self.kv_events.dropped,
            **self._spec_stats())

    def _spec_stats(self) -> dict[str, Any]:
        if self.spec is None:
            return {}
        c = self.spec.counters
        return dict(spec_decode_num_drafts=c.num_drafts,
                    spec_decode_num_draft_tokens=c.num_draft_tokens,
                    spec_decode_num_accepted_tokens=c.num_accepted_tokens,
                    spec_decode_accepted_per_pos=tuple(c.accepted_per_pos))
