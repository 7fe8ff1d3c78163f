"""Test-only fault injection, off by default. On with the hidden `plait serve --fault-injection`
(env PLAIT_FAULT_INJECTION=1) so that tests can fail a real server process on purpose.
Never enable it in production: any client could then fail requests or stop the engine.

A marker in a request's prompt text (a completion prompt or a chat message) picks the fault:

    plait-fault:tokenize        encoding the prompt raises (HTTP layer: a 500 envelope)
    plait-fault:execute[@K]     the model step raises once the request has K output tokens
    plait-fault:sample[@K]      the sampler raises, likewise (both fail that step's batch)
    plait-fault:detokenize[@K]  decoding the request's token K+1 raises (only it fails)
    plait-fault:kill            the engine loop dies (a BaseException escapes the step)

K defaults to 0: before the first token. Every injected message carries a fake traceback
line with an internal path, so tests can check that none of it ever reaches a client.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Any

from plait.engine.async_engine import AsyncEngine

logger = logging.getLogger("plait.server")

MARKER = re.compile(r"plait-fault:(tokenize|execute|sample|detokenize|kill)(?:@(\d+))?")
FAKE_FRAME = 'Traceback (most recent call last):\n  File "/srv/plait/internal/secret.py", line 7'


class InjectedFault(RuntimeError):
    """An injected error: the engine (or the HTTP layer) must contain it."""


class EngineKilled(BaseException):
    """Not an `Exception`, so `EngineCore.step` lets it through and the engine loop dies."""


def find_marker(text: str) -> tuple[str, int] | None:
    """("execute", 3) for "... plait-fault:execute@3 ..."; None without a marker."""
    match = MARKER.search(text)
    if match is None:
        return None
    return match.group(1), int(match.group(2) or 0)


class FaultHook:
    """`EngineCore.fault_hook`: raises for requests whose prompt carries a marker.

    Runs on the engine thread. A request's marker is found once (its prompt decoded) and
    remembered by request id in a bounded LRU table.
    """

    def __init__(self, tokenizer: Any, max_remembered: int = 4096) -> None:
        self._tokenizer = tokenizer
        self._max_remembered = max_remembered
        self._markers: OrderedDict[str, tuple[str, int] | None] = OrderedDict()

    def __call__(self, phase: str, requests: list[Any]) -> None:
        for req in requests:
            marker = self._marker(req)
            if marker is None:
                continue
            kind, after = marker
            if kind == "kill":
                raise EngineKilled(f"injected engine death\n{FAKE_FRAME}")
            if kind == phase and len(req.output_token_ids) >= after:
                raise InjectedFault(f"injected {phase} fault\n{FAKE_FRAME}")

    def _marker(self, req: Any) -> tuple[str, int] | None:
        if req.request_id in self._markers:
            self._markers.move_to_end(req.request_id)
            return self._markers[req.request_id]
        marker = find_marker(self._tokenizer.decode(req.prompt_token_ids))
        self._markers[req.request_id] = marker
        if len(self._markers) > self._max_remembered:
            self._markers.popitem(last=False)
        return marker


def install(engine: AsyncEngine) -> None:
    """Arm a loaded engine: its tokenizer's `encode` and its core's `fault_hook`."""
    core = engine.core
    assert core is not None, "load the engine first"
    tokenizer = core.tokenizer
    encode = tokenizer.encode

    def faulty_encode(text: Any, *args: Any, **kwargs: Any) -> Any:
        marker = find_marker(text) if isinstance(text, str) else None
        if marker is not None and marker[0] == "tokenize":
            raise InjectedFault(f"injected tokenizer fault\n{FAKE_FRAME}")
        return encode(text, *args, **kwargs)

    tokenizer.encode = faulty_encode
    core.fault_hook = FaultHook(tokenizer)
    logger.warning("FAULT INJECTION IS ON (test-only): prompts with 'plait-fault:' markers "
                   "fail on purpose")
