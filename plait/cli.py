"""`plait` command line: `plait serve [MODEL] [options]`.

Every option can also be set in the environment as PLAIT_<OPTION_IN_UPPER_SNAKE> (the model
as PLAIT_MODEL); a flag on the command line wins over the environment, which wins over the
built-in default. Only the serve path imports the HTTP stack (fastapi, uvicorn), so
`plait --help` stays fast and the engine never needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import plait
from plait.engine.config import VALID_DTYPES, EngineConfig

ENV_PREFIX = "PLAIT_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_ENGINE = EngineConfig()


@dataclass(frozen=True, slots=True)
class Option:
    """One `serve` option. `kind` is int, float, str, bool (a --x/--no-x pair), "list"
    (comma-separated or a JSON array) or "int?" (an int or none)."""

    flag: str
    kind: Any
    default: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()


OPTIONS: tuple[Option, ...] = (
    Option("--host", str, "127.0.0.1", "address to listen on"),
    Option("--port", int, 8000, "port to listen on"),
    Option("--api-key", str, None, "require `Authorization: Bearer KEY` on the API routes"),
    Option("--api-key-file", str, None, "file of accepted API keys, one per line"),
    Option("--served-model-name", str, None,
           "the model name clients must send (default: the model's own name)"),
    Option("--device", str, _ENGINE.device, "auto, cpu, cuda or cuda:N"),
    Option("--dtype", str, _ENGINE.dtype, "weights/activations dtype", VALID_DTYPES),
    Option("--block-size", int, _ENGINE.block_size, "tokens per KV cache block"),
    Option("--num-kv-blocks", "int?", None, "KV cache blocks (default: sized from memory)"),
    Option("--kv-cache-memory-gb", float, _ENGINE.kv_cache_memory_gb,
           "KV cache size on CPU, in GB"),
    Option("--gpu-memory-utilization", float, _ENGINE.gpu_memory_utilization,
           "fraction of GPU memory for weights + KV cache"),
    Option("--max-num-seqs", int, _ENGINE.max_num_seqs, "most sequences running at once"),
    Option("--max-num-batched-tokens", int, _ENGINE.max_num_batched_tokens,
           "most tokens computed per engine step"),
    Option("--max-model-len", "int?", None, "context length (default: the model's)"),
    Option("--enable-prefix-caching", bool, _ENGINE.enable_prefix_caching,
           "reuse cached KV blocks of identical prompt prefixes"),
    Option("--max-shared-logits", int, _ENGINE.max_shared_logits,
           "recent prompts whose last logits (and blocks) are kept for reuse"),
    Option("--seed", int, _ENGINE.seed, "engine seed for unseeded requests"),
    Option("--max-queued-requests", int, 256,
           "sub-requests admitted beyond the --max-num-seqs running slots; past it a new "
           "request gets 503 + Retry-After"),
    Option("--max-request-bytes", int, 10 * 1024 * 1024,
           "largest request body in bytes; a larger one gets 413"),
    Option("--drain-timeout", float, 30.0,
           "seconds to finish in-flight requests after SIGTERM"),
    Option("--sse-ping-interval", float, 15.0, "idle seconds between `: ping` SSE comments"),
    Option("--header-timeout", float, 10.0,
           "seconds a connection has to send each request head; then 408 and closed"),
    Option("--keep-alive-timeout", float, 5.0,
           "idle seconds before a keep-alive connection is closed"),
    Option("--allowed-origins", "list", ["*"], "CORS allowed origins"),
    Option("--allowed-methods", "list", ["*"], "CORS allowed methods"),
    Option("--allowed-headers", "list", ["*"], "CORS allowed headers"),
    Option("--log-level", str, "info", "log level", LOG_LEVELS),
    Option("--log-prompts", bool, False,
           "log each request's prompt text (off: only ids, sizes and timings)"),
)
# Test-only and hidden from --help: lets a request's prompt trigger faults (server/faults.py).
FAULT_INJECTION = Option("--fault-injection", bool, False, "test-only fault injection")


class EnvError(ValueError):
    """An environment variable holds a value its option cannot take."""


def convert(option: Option, raw: str) -> Any:
    """An environment string -> the option's value."""
    text = raw.strip()
    try:
        if option.kind is bool:
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError("expected true/false")
        if option.kind == "list":
            return parse_list(text)
        if option.kind == "int?":
            return None if text.lower() in ("", "none") else int(text)
        value = option.kind(text)
    except ValueError as exc:
        raise EnvError(f"{option.env}={raw!r}: {exc}") from None
    if option.choices and value not in option.choices:
        raise EnvError(f"{option.env}={raw!r}: expected one of {', '.join(option.choices)}")
    return value


def parse_list(text: str) -> list[str]:
    """'a,b' or '["a", "b"]' -> ["a", "b"]."""
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError("expected a JSON array of strings")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser, with defaults taken from `env` (os.environ if None)."""
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(prog="plait", description=plait.__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"plait {plait.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server. Every option can be set in the "
                    "environment (shown as env: NAME); flags win over the environment.")
    model_env = env.get(f"{ENV_PREFIX}MODEL") or None
    serve.add_argument("model", nargs="?", default=model_env, metavar="MODEL",
                       help="a .gguf file or a Hugging Face model directory (default: the "
                            f"embedded SmolLM2-135M-Instruct) [env: {ENV_PREFIX}MODEL]")
    for option in OPTIONS:
        _add(serve, option, env)
    _add(serve, FAULT_INJECTION, env, hidden=True)
    return parser


def _add(parser: argparse.ArgumentParser, option: Option, env: Mapping[str, str],
         hidden: bool = False) -> None:
    """Add `option` (default from its env var when set); `hidden` keeps it out of --help."""
    default = option.default
    if option.env in env:
        default = convert(option, env[option.env])
    shown = "none" if option.default is None else option.default
    if isinstance(shown, list):
        shown = ",".join(shown)
    default_text = "" if "default:" in option.help else f" (default: {shown})"
    help_text = (argparse.SUPPRESS if hidden
                 else f"{option.help}{default_text} [env: {option.env}]")
    if option.kind is bool:
        parser.add_argument(option.flag, action=argparse.BooleanOptionalAction,
                            default=default, help=help_text)
        return
    kind = {"list": parse_list, "int?": int}.get(option.kind, option.kind)
    parser.add_argument(option.flag, type=kind, default=default, choices=option.choices,
                        help=help_text, metavar=option.dest.upper())


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        max_shared_logits=args.max_shared_logits,
        seed=args.seed)


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key plus every non-empty, non-comment line of --api-key-file."""
    keys = [args.api_key] if args.api_key else []
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            keys += [line.strip() for line in fh
                     if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {args.api_key_file} holds no key")
    return tuple(keys)


def server_settings(args: argparse.Namespace) -> Any:  # -> plait.server.settings.ServerSettings
    from plait.server.settings import ServerSettings

    return ServerSettings(
        engine=engine_config(args), host=args.host, port=args.port,
        served_model_name=args.served_model_name, api_keys=api_keys(args),
        allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), sse_ping_interval=args.sse_ping_interval,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes, drain_timeout=args.drain_timeout,
        header_timeout=args.header_timeout, keep_alive_timeout=args.keep_alive_timeout,
        log_level=args.log_level, log_prompts=args.log_prompts,
        fault_injection=args.fault_injection)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except EnvError as exc:
        print(f"plait: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command != "serve":
        parser.print_help()
        return 2
    try:
        settings = server_settings(args)
    except (ValueError, OSError) as exc:
        print(f"plait serve: error: {exc}", file=sys.stderr)
        return 2
    from plait.server.serve import run_server  # the HTTP stack, imported only here

    return run_server(settings)


if __name__ == "__main__":
    sys.exit(main())
