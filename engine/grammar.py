"""Grammar compilation and per-request matchers for structured output (llguidance).

    EngineCore.add_request ─► GrammarCompiler.submit(spec)  (worker thread, LRU by spec)
    EngineCore.step        ─► a request enters the scheduler once its grammar compiled
                              (or finishes with "error" when it cannot compile)
    ModelRunner            ─► RequestGrammar per sub-request: a deep copy of the cached
                              pristine matcher, advanced by each token the request keeps

The llguidance tokenizer is built from the engine's Hugging Face tokenizer once, lazily, in
the compiler's worker thread (about 0.4 s for a 49k vocabulary, plus loading the tokenizer
itself where the engine had only its vocabulary), so neither engine start nor the step
loop pays for it. A compiled matcher is never advanced itself: each request gets a
`deep_copy`, so the n choices of one request have n independent matchers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from plait.engine.structured import StructuredSpec, grammar_text

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

DEFAULT_CACHE_SIZE = 64  # compiled grammars kept (LRU by spec)


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message is client-readable."""


class RequestGrammar:
    """One sub-request's grammar state: an llguidance matcher plus the tokenizer facts
    needed to read it (its vocabulary size and EOS ids).

    Token ids at or above the tokenizer's vocabulary (a model's padded logits columns) are
    never allowed. EOS is allowed exactly when the grammar is in an accepting state."""

    __slots__ = ("eos_ids", "matcher", "vocab_size")

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may be sampled next (cheap: no mask is computed)."""
        if not 0 <= token_id < self.vocab_size or self.matcher.is_error():
            return False
        if token_id in self.eos_ids:
            return self.matcher.is_accepting()
        return self.matcher.validate_tokens([token_id]) == 1

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into `row` ([words] int32, contiguous, on the
        host): bit `t % 32` of word `t // 32` is set when token t is allowed."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the grammar would accept in a row, from
        its current state (which is left unchanged). An EOS ends the count: a draft is
        never verified past one."""
        end = next((i for i, t in enumerate(token_ids)
                    if t in self.eos_ids or not 0 <= t < self.vocab_size), len(token_ids))
        if end == 0 or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens(token_ids[:end]))

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False (and the matcher in its error state) if the
        grammar does not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def ended(self) -> bool:
        """The output is complete: the grammar takes no token but EOS."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher is in its error state (its first line), or "" when it is not.
        A matcher in error allows nothing: the sampler refuses to sample it."""
        return self.matcher.get_error().split("\n", 1)[0]


def allowed_tokens(grammars: list[RequestGrammar], width: int,
                   device: torch.device) -> torch.Tensor:
    """The allowed tokens of each grammar: [len(grammars), width] bool on `device`.

    `width` is the logits' width; columns past the tokenizer's vocabulary are False."""
    vocab = grammars[0].vocab_size
    words = (vocab + 31) // 32
    bitmask = torch.zeros(len(grammars), words, dtype=torch.int32)  # [R, words]
    for i, grammar in enumerate(grammars):
        grammar.fill_bitmask(bitmask[i])
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.view(len(grammars), words * 32)[:, :min(vocab, width)].bool()
    if width > allowed.shape[1]:
        pad = torch.zeros(len(grammars), width - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad], dim=1)
    return allowed.to(device, non_blocking=True)


class GrammarCompiler:
    """Compiles specs off the step loop (one worker thread) and caches pristine matchers.

    `submit(spec)` returns a future that is done once `spec` is compiled (its exception a
    `GrammarError` when it cannot be); `grammar(spec)` then returns a fresh per-request
    `RequestGrammar`. Thread-safe."""

    def __init__(self, hf_tokenizer: Callable[[], PreTrainedTokenizerBase],
                 cache_size: int = DEFAULT_CACHE_SIZE, eos_ids: tuple[int, ...] = ()) -> None:
        """`hf_tokenizer()` gives the model's tokenizer, called once, at the first compile.
        `eos_ids`: every id that ends a sequence in the engine (the model config's and
        the tokenizer's); a complete grammar allows all of them. Empty: the tokenizer's."""
        self._hf_tokenizer = hf_tokenizer
        self._engine_eos = list(eos_ids)
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredSpec, LLMatcher] = OrderedDict()
        self._pending: dict[StructuredSpec, Future[None]] = {}
        self._tokenizer: LLTokenizer | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._worker: ThreadPoolExecutor | None = None
        self.num_compiled = 0

    def submit(self, spec: StructuredSpec) -> Future[None]:
        """Compile `spec` in the worker unless it is cached or already being compiled."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                done: Future[None] = Future()
                done.set_result(None)
                return done
            future = self._pending.get(spec)
            if future is None:
                if self._worker is None:
                    self._worker = ThreadPoolExecutor(1, thread_name_prefix="plait-grammar")
                future = self._worker.submit(self._compile_and_cache, spec)
                self._pending[spec] = future
            return future

    def grammar(self, spec: StructuredSpec) -> RequestGrammar:
        """A new matcher for one sub-request. Compiles in the calling thread only if `spec`
        was evicted since its `submit` (more distinct grammars than the cache holds)."""
        with self._lock:
            pristine = self._cache.get(spec)
        if pristine is None:
            pristine = self._compile(spec)
            self._store(spec, pristine)
        return RequestGrammar(pristine.deep_copy(), self._llg_tokenizer().vocab_size,
                              self._eos_ids)

    # ---------------------------------------------------------------- internals
    def _compile_and_cache(self, spec: StructuredSpec) -> None:
        """Cached before it stops being pending, so a `submit` in between never starts a
        second compile of the same spec."""
        try:
            self._store(spec, self._compile(spec))
        finally:
            with self._lock:
                self._pending.pop(spec, None)

    def _store(self, spec: StructuredSpec, pristine: LLMatcher) -> None:
        with self._lock:
            self._cache[spec] = pristine
            self._cache.move_to_end(spec)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    def _compile(self, spec: StructuredSpec) -> LLMatcher:
        from llguidance import LLMatcher

        tokenizer = self._llg_tokenizer()
        try:
            grammar = grammar_text(spec)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        self.num_compiled += 1
        return matcher

    def _llg_tokenizer(self) -> LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf

            # llguidance types its argument as a fast tokenizer; it checks the kind itself.
            tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer(),  # type: ignore[arg-type]
                eos_token=self._engine_eos or None)
            self._eos_ids = frozenset(tokenizer.eos_tokens)
            self._tokenizer = tokenizer
        return self._tokenizer
