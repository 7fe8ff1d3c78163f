"""HTTP-layer settings: one frozen dataclass built once by the CLI (or a test)."""

from __future__ import annotations

from dataclasses import dataclass, field

from plait.engine import EngineConfig

DEFAULT_MAX_REQUEST_BYTES = 10 * 1024 * 1024  # 10 MiB
# Hosts on which the playground (/ui) is on unless --ui/--no-ui says otherwise.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
# --tool-call-parser names (vLLM's): the families of constrained/call_parsers.PARSERS whose
# format a model writes itself ("json" is Plait's grammar fallback, never chosen by name).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "phi4_mini_json",
                     "granite")
# --reasoning-parser names (vLLM's): reasoning.py.
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """Everything `create_app` needs besides the engine.

    `served_model_name=None` serves the model under the engine's own name (known once it has
    loaded; "SmolLM2-135M-Instruct" for the embedded default). `api_keys` empty means no
    authentication. `sse_ping_interval` is the idle time after which a stream gets an SSE
    comment (`: ping`), 0 disables pings.

    Limits (README "Operations"): at most `max_num_seqs + max_queued_requests` sub-requests
    are admitted at once, a request past that gets 503 (an n-choice request is admitted or
    refused whole); a body over `max_request_bytes` gets 413. A connection must send each
    request head within `header_timeout` seconds (else 408 and closed); an idle keep-alive
    connection is closed after `keep_alive_timeout` seconds. `log_prompts` adds prompt text
    to the request log. `fault_injection` is test-only (see faults.py), never for production.
    `engine_process` runs the engine core in its own child process; off, it runs in a thread
    of the server process. `ui` serves the playground at /ui (server/ui.py): None (auto)
    means on exactly when `host` is a loopback address, see `ui_enabled`.
    `/v1/responses` keeps at most `responses_store_size` responses (0: none), each for
    `responses_ttl` seconds, in this process's memory (server/responses/store.py).
    `chat_template` is the template source that replaces the model's own (None: the
    model's; the CLI reads --chat-template's file). `tool_call_parser` names the tool-call
    format the model writes (None: detected from the template); `reasoning_parser` splits
    `<think>` reasoning from the answer (None: off). Names: TOOL_CALL_PARSERS,
    REASONING_PARSERS.
    """

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    sse_ping_interval: float = 15.0
    max_queued_requests: int = 256
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    drain_timeout: float = 30.0
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    log_level: str = "info"
    log_prompts: bool = False
    fault_injection: bool = False
    engine_process: bool = True
    ui: bool | None = None
    responses_store_size: int = 1000
    responses_ttl: float = 3600.0
    chat_template: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.sse_ping_interval < 0:
            raise ValueError("sse_ping_interval must be >= 0")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be >= 1")
        if self.drain_timeout < 0:
            raise ValueError("drain_timeout must be >= 0")
        if self.header_timeout <= 0 or self.keep_alive_timeout <= 0:
            raise ValueError("header_timeout and keep_alive_timeout must be > 0")
        if self.responses_store_size < 0 or self.responses_ttl <= 0:
            raise ValueError("responses_store_size must be >= 0 and responses_ttl > 0")
        if any(not key for key in self.api_keys):
            raise ValueError("an API key must not be empty")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}")

    @property
    def ui_enabled(self) -> bool:
        """Whether /ui is served: `ui` when set, else on only for a loopback `host`."""
        if self.ui is not None:
            return self.ui
        return self.host in LOOPBACK_HOSTS
