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

This module owns the switch and the tokenizer fault (server side); the engine phases fail in
`plait.engine.faults.FaultHook`, armed wherever the engine core runs.
"""

from __future__ import annotations

import logging
from typing import Any

from plait.engine import FAKE_FRAME, InjectedFault, arm_engine_faults, find_marker

logger = logging.getLogger("plait.server")


def install(engine: Any) -> None:
    """Arm a loaded engine's server side: its tokenizer's `encode` raises on a tokenize
    marker. The engine side (`FaultHook`) is armed where the core runs: here for an
    in-thread engine (`engine.core` set), in the engine process for a `ProcessEngine` built
    with `fault_injection=True` (its `core` is None in this process)."""
    tokenizer = engine.tokenizer
    encode = tokenizer.encode

    def faulty_encode(text: Any, *args: Any, **kwargs: Any) -> Any:
        marker = find_marker(text) if isinstance(text, str) else None
        if marker is not None and marker[0] == "tokenize":
            raise InjectedFault(f"injected tokenizer fault\n{FAKE_FRAME}")
        return encode(text, *args, **kwargs)

    tokenizer.encode = faulty_encode
    if engine.core is not None:
        arm_engine_faults(engine.core)
    logger.warning("FAULT INJECTION IS ON (test-only): prompts with 'plait-fault:' markers "
                   "fail on purpose")
