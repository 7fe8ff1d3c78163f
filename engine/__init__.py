"""Plait's inference engine: config, KV block pool, scheduler, model runner, sampler.

This module is the engine's public surface: the HTTP layer (`plait.server`) and the CLI
import what they use from here and nothing deeper. Names load lazily on first use, so
`import plait.engine` (and `plait --help`) does not import torch.

The engine path never imports fastapi or pydantic, so it runs on machines that only have
torch (and optionally triton and transformers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module (under plait.engine) that defines it
_EXPORTS = {
    "AsyncEngine": "async_engine",
    "EngineClient": "client",
    "EngineDeadError": "client",
    "EngineLoadError": "client",
    "RequestStream": "client",
    "ProcessEngine": "engine_process",
    "EngineConfig": "config",
    "RuntimeInfo": "config",
    "EngineStats": "core_api",
    "StepResult": "core_api",
    "VALID_DTYPES": "config",
    "CPU_GEMMS": "config",
    "ATTENTION_BACKENDS": "config",
    "KV_CACHE_DTYPES": "config",
    "KV_EVENTS_ENCODINGS": "config",
    "WEIGHT_FORMATS": "config",
    "NUMERICS": "config",
    "LLM": "llm",
    "RequestDelta": "outputs",
    "ChoiceAccumulator": "outputs",
    "TokenLogprob": "outputs",
    "CompletionOutput": "outputs",
    "RequestOutput": "outputs",
    "SamplingParams": "sampling_params",
    "SpeculativeConfig": "spec.config",
    "check_available": "spec.factory",
    "InvalidParamError": "sampling_params",
    "MAX_LOGPROBS": "sampling_params",
    "RequestRejected": "validation",
    "validate_params": "validation",
    "validate_prompt": "validation",
    "validate_request": "validation",
    "GRAMMAR_FAILED": "structured",
    "StructuredSpec": "structured",
    "structured_error": "structured",
    "TokenTextTable": "token_text",
    "decode_ids": "token_text",
    "FAKE_FRAME": "faults",
    "InjectedFault": "faults",
    "arm_engine_faults": "faults",
    "find_marker": "faults",
}
__all__ = [
    "ATTENTION_BACKENDS",
    "CPU_GEMMS",
    "FAKE_FRAME",
    "GRAMMAR_FAILED",
    "KV_CACHE_DTYPES",
    "KV_EVENTS_ENCODINGS",
    "LLM",
    "MAX_LOGPROBS",
    "NUMERICS",
    "VALID_DTYPES",
    "WEIGHT_FORMATS",
    "AsyncEngine",
    "ChoiceAccumulator",
    "CompletionOutput",
    "EngineClient",
    "EngineConfig",
    "EngineDeadError",
    "EngineLoadError",
    "EngineStats",
    "InjectedFault",
    "InvalidParamError",
    "ProcessEngine",
    "RequestDelta",
    "RequestOutput",
    "RequestRejected",
    "RequestStream",
    "RuntimeInfo",
    "SamplingParams",
    "SpeculativeConfig",
    "StepResult",
    "StructuredSpec",
    "TokenLogprob",
    "TokenTextTable",
    "arm_engine_faults",
    "check_available",
    "decode_ids",
    "find_marker",
    "structured_error",
    "validate_params",
    "validate_prompt",
    "validate_request",
]

if TYPE_CHECKING:
    from plait.engine.async_engine import AsyncEngine
    from plait.engine.client import EngineClient, EngineDeadError, EngineLoadError, RequestStream
    from plait.engine.config import (
        ATTENTION_BACKENDS,
        CPU_GEMMS,
        KV_CACHE_DTYPES,
        KV_EVENTS_ENCODINGS,
        NUMERICS,
        VALID_DTYPES,
        WEIGHT_FORMATS,
        EngineConfig,
        RuntimeInfo,
    )
    from plait.engine.core_api import EngineStats, StepResult
    from plait.engine.engine_process import ProcessEngine
    from plait.engine.faults import FAKE_FRAME, InjectedFault, arm_engine_faults, find_marker
    from plait.engine.llm import LLM
    from plait.engine.outputs import (
        ChoiceAccumulator,
        CompletionOutput,
        RequestDelta,
        RequestOutput,
        TokenLogprob,
    )
    from plait.engine.sampling_params import MAX_LOGPROBS, InvalidParamError, SamplingParams
    from plait.engine.spec.config import SpeculativeConfig
    from plait.engine.spec.factory import check_available
    from plait.engine.structured import GRAMMAR_FAILED, StructuredSpec, structured_error
    from plait.engine.token_text import TokenTextTable, decode_ids
    from plait.engine.validation import (
        RequestRejected,
        validate_params,
        validate_prompt,
        validate_request,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plait.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"plait.engine.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
