"""`plait` command line: `plait serve [MODEL] [options]` and `plait bench [options]`
(plait/bench/cli.py).

Every option can also be set in the environment as PLAIT_<OPTION_IN_UPPER_SNAKE> (the model
as PLAIT_MODEL); a flag on the command line wins over the environment, which wins over the
built-in default (the field defaults of EngineConfig and ServerSettings, written nowhere
else). Only the serve path imports the HTTP stack (fastapi, uvicorn), so
`plait --help` stays fast and the engine never needs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from typing import Any

import plait
from plait.bench.cli import add_parser as add_bench_parser
from plait.bench.cli import run as run_bench
from plait.engine import (
    ATTENTION_BACKENDS,
    CPU_GEMMS,
    KV_CACHE_DTYPES,
    KV_EVENTS_ENCODINGS,
    NUMERICS,
    VALID_DTYPES,
    WEIGHT_FORMATS,
    EngineConfig,
    SpeculativeConfig,
    check_available,
)
from plait.server.settings import (  # plain dataclass and names: no HTTP stack
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ServerSettings,
)
from plait.server.template_source import read_chat_template

ENV_PREFIX = "PLAIT_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
# The one place defaults are written is the dataclasses: every option whose dest names a
# field of EngineConfig or ServerSettings takes that field's default.
CONFIG_CLASSES = (EngineConfig, ServerSettings)
FIELD_DEFAULTS: dict[str, Any] = {
    f.name: f.default for cls in CONFIG_CLASSES for f in fields(cls) if f.default is not MISSING}
# Fields no option of their own sets: the positional MODEL, the nested engine config, and
# the keys read from --api-key and --api-key-file.
NOT_OPTIONS = frozenset({"model", "engine", "api_keys"})


@dataclass(frozen=True, slots=True)
class Option:
    """One `serve` option. `kind` is int, float, str, bool (a --x/--no-x pair), "bool?" (a
    --x/--no-x pair whose default none means auto), "list" (comma-separated or a JSON
    array; a tuple field) or "int?" (an int or none). The
    default is the same-named field's of EngineConfig / ServerSettings; an option that is
    no field (--api-key, --api-key-file) defaults to none."""

    flag: str
    kind: Any
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.dest.upper()

    @property
    def default(self) -> Any:
        return FIELD_DEFAULTS.get(self.dest)


OPTIONS: tuple[Option, ...] = (
    Option("--host", str, "address to listen on"),
    Option("--port", int, "port to listen on"),
    Option("--api-key", str, "require `Authorization: Bearer KEY` on the API routes"),
    Option("--api-key-file", str, "file of accepted API keys, one per line"),
    Option("--served-model-name", str,
           "the model name clients must send (default: the model's own name)"),
    Option("--device", str, "auto, cpu, cuda or cuda:N"),
    Option("--dtype", str, "weights/activations dtype", VALID_DTYPES),
    Option("--block-size", int, "tokens per KV cache block"),
    Option("--num-kv-blocks", "int?", "KV cache blocks (default: sized from memory)"),
    Option("--kv-cache-memory-gb", float, "KV cache size on CPU, in GB"),
    Option("--kv-cache-prefault", bool,
           "make the whole CPU KV cache resident at start, on transparent huge pages "
           "(default: 4 KiB pages, resident as first written)"),
    Option("--kv-cache-warm-tokens", int,
           "CPU KV cache tokens made resident ahead of use while the engine is idle (0: off)"),
    Option("--warm-up-tokens", int,
           "tokens of the dummy prompt run once at start, so the first real prefill does "
           "not pay one-time costs (0: none)"),
    Option("--idle-memory-release-s", float,
           "seconds a CPU engine waits idle before it gives its steps' freed temporaries "
           "back to the OS (0: never)"),
    Option("--gpu-memory-utilization", float, "fraction of GPU memory for weights + KV cache"),
    Option("--max-num-seqs", int, "most sequences running at once"),
    Option("--max-num-batched-tokens", int, "most tokens computed per engine step"),
    Option("--max-prefill-tokens-with-decodes", int,
           "most prompt tokens computed in a step that also decodes (0: no cap)"),
    Option("--max-model-len", "int?", "context length (default: the model's)"),
    Option("--enable-prefix-caching", bool,
           "reuse cached KV blocks of identical prompt prefixes"),
    Option("--max-shared-logits", int,
           "recent prompts kept for reuse (their last logits; their blocks stay cached, "
           "not pinned)"),
    Option("--seed", int, "engine seed for unseeded requests"),
    Option("--native", bool,
           "use the native CPU kernels (float32 CPU; built with the machine's C compiler on "
           "first use)"),
    Option("--cascade", bool,
           "attend a prompt's shared KV blocks once for all the choices sharing them (off: "
           "plain paged attention)"),
    Option("--attention-backend", str,
           "auto (Triton on CUDA, the CPU backend on CPU) or reference (plain torch)",
           ATTENTION_BACKENDS),
    Option("--cpu-gemm", str,
           "the CPU GEMMs' weight packing (auto: mkl on Intel, onednn elsewhere)", CPU_GEMMS),
    Option("--weights", str,
           "auto: keep a GGUF's quantized blocks (a checkpoint's bf16) as they are on CPU, "
           "memory about the file's size; float32: dequantize at load", WEIGHT_FORMATS),
    Option("--numerics", str,
           "the arithmetic: int8 (GGUF weights repacked at load at their own bit width, "
           "x quantized to int8 per 32 weights as llama.cpp does; bf16 KV cache and "
           "attention dot products), bf16 (bf16 x bf16 products with float32 sums, "
           "bf16 KV cache), exact (float32: greedy output equals transformers'); auto: int8 "
           "for a GGUF file on a CPU with AVX512-VNNI, else exact. --exact is --numerics "
           "exact",
           NUMERICS),
    Option("--kv-cache-dtype", str,
           "the KV cache's element type: auto (bfloat16 under --numerics int8 or bf16, else "
           "the model dtype), bfloat16 (half the bytes of a float32 CPU engine's, so twice "
           "the blocks) or float32 (CPU: float32 K/V and attention under any --numerics)",
           KV_CACHE_DTYPES),
    Option("--speculative-config", "spec",
           "speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
           "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": 2, "
           "\"prompt_lookup_max\": 5}', or a method name alone (ngram; suffix and "
           "draft_model where built) (default: none, off)"),
    Option("--kv-events-endpoint", str,
           "publish KV-cache events as vLLM does on this ZeroMQ PUB endpoint, e.g. "
           "tcp://*:5557 (default: none, off)"),
    Option("--kv-events-topic", str, "topic frame of the KV-cache event messages"),
    Option("--kv-events-replay-endpoint", str,
           "ZeroMQ ROUTER endpoint answering replay requests for missed KV-event batches "
           "(default: none)"),
    Option("--kv-events-encoding", str,
           "KV events as tagged maps (vLLM >= 0.24) or tagged arrays (older vLLM consumers)",
           KV_EVENTS_ENCODINGS),
    Option("--max-queued-requests", int,
           "sub-requests admitted beyond the --max-num-seqs running slots; past it a new "
           "request gets 503 + Retry-After"),
    Option("--max-request-bytes", int, "largest request body in bytes; a larger one gets 413"),
    Option("--responses-store-size", int,
           "most /v1/responses responses kept in memory for previous_response_id and GET "
           "(the oldest is dropped first; 0: keep none)"),
    Option("--responses-ttl", float,
           "seconds a stored /v1/responses response is kept (then a 404)"),
    Option("--drain-timeout", float, "seconds running requests get after SIGTERM (/health 503 "
           "meanwhile); then they end with an error event"),
    Option("--sse-ping-interval", float, "idle seconds between `: ping` SSE comments"),
    Option("--header-timeout", float,
           "seconds a connection has to send each request head; then 408 and closed"),
    Option("--keep-alive-timeout", float,
           "idle seconds before a keep-alive connection is closed"),
    Option("--allowed-origins", "list", "CORS allowed origins"),
    Option("--allowed-methods", "list", "CORS allowed methods"),
    Option("--allowed-headers", "list", "CORS allowed headers"),
    Option("--log-level", str, "log level", LOG_LEVELS),
    Option("--log-prompts", bool,
           "log each request's prompt text (off: only ids, sizes and timings)"),
    Option("--engine-process", bool,
           "run the engine core in its own child process (off: a thread of the server "
           "process)"),
    Option("--chat-template", str,
           "chat template for messages, a file or the template itself (default: the "
           "model's own; a model without one serves /v1/completions only)"),
    Option("--tool-call-parser", str,
           "the tool-call format the model writes (default: detected from the chat "
           "template)", TOOL_CALL_PARSERS),
    Option("--reasoning-parser", str,
           "return <think> reasoning as reasoning_content (default: none, off)",
           REASONING_PARSERS),
    Option("--ui", "bool?",
           "serve the playground page at /ui (default: on when --host is 127.0.0.1, "
           "localhost or ::1, off otherwise)"),
)
# Flags the --numerics modes replaced: passing one (or its PLAIT_ variable) is an error that
# names what to use now.
REPLACED_FLAGS = {
    "--compute-dtype": "--numerics bf16 (bfloat16) or --numerics exact (float32)",
    "--prefill-int8": "--numerics int8 (the default on a CPU with AVX512-VNNI)",
    "--int8-panels": "--numerics int8 (the default on a CPU with AVX512-VNNI: the weights "
                     "repacked at their own bit width, without an int8 copy)",
    "--repacked-weights": "--numerics int8 (the default on a CPU with AVX512-VNNI)",
}
# Test-only and hidden from --help: lets a request's prompt trigger faults (server/faults.py).
FAULT_INJECTION = Option("--fault-injection", bool, "test-only fault injection")


class EnvError(ValueError):
    """An environment variable holds a value its option cannot take."""


def convert(option: Option, raw: str) -> Any:
    """An environment string -> the option's value."""
    text = raw.strip()
    try:
        if option.kind == "bool?" and text.lower() in ("", "auto", "none"):
            return None
        if option.kind in (bool, "bool?"):
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise ValueError("expected true/false" + ("/auto" if option.kind == "bool?" else ""))
        if option.kind == "list":
            return parse_list(text)
        if option.kind == "int?":
            return None if text.lower() in ("", "none") else int(text)
        if option.kind == "spec":
            return None if text.lower() in ("", "none") else parse_speculative_config(text)
        value = option.kind(text)
    except (ValueError, argparse.ArgumentTypeError) as exc:
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


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config's text -> the config; an error names the bad field, and a
    method this build has no proposer for is refused here, before the model loads."""
    try:
        config = SpeculativeConfig.parse(text)
        check_available(config)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return config


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
    serve.add_argument("--exact", dest="numerics", action="store_const", const="exact",
                       help="--numerics exact")
    for flag, instead in REPLACED_FLAGS.items():
        variable = ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper()
        if variable in env:
            raise EnvError(f"{variable} is no longer read: use {instead}")
        serve.add_argument(flag, nargs="?", action=_Replaced, help=argparse.SUPPRESS,
                           default=argparse.SUPPRESS, instead=instead)
    _add(serve, FAULT_INJECTION, env, hidden=True)
    add_bench_parser(commands)
    return parser


class _Replaced(argparse.Action):
    """A flag the --numerics modes replaced: using it is a usage error naming the new one."""

    def __init__(self, *args: Any, instead: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} was replaced: use {self.instead}")


def _add(parser: argparse.ArgumentParser, option: Option, env: Mapping[str, str],
         hidden: bool = False) -> None:
    """Add `option` (default from its env var when set); `hidden` keeps it out of --help."""
    builtin = list(option.default) if option.kind == "list" else option.default
    default = convert(option, env[option.env]) if option.env in env else builtin
    shown = "none" if builtin is None else builtin
    if isinstance(shown, list):
        shown = ",".join(shown)
    default_text = "" if "default:" in option.help else f" (default: {shown})"
    help_text = (argparse.SUPPRESS if hidden
                 else f"{option.help}{default_text} [env: {option.env}]")
    if option.kind in (bool, "bool?"):
        parser.add_argument(option.flag, action=argparse.BooleanOptionalAction,
                            default=default, help=help_text)
        return
    parsers: dict[str, Callable[[str], object]] = {"list": parse_list, "int?": int,
                                                   "spec": parse_speculative_config}
    kind = parsers.get(option.kind, option.kind)
    parser.add_argument(option.flag, type=kind, default=default, choices=option.choices,
                        help=help_text, metavar=option.dest.upper())


def _field_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed value of every field of `cls` that `args` holds, by name (a "list"
    option's list becomes the field's tuple). Fields `args` lacks keep their defaults."""
    values = {}
    for f in fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**_field_values(EngineConfig, args))


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


def server_settings(args: argparse.Namespace) -> ServerSettings:
    values = _field_values(ServerSettings, args)
    values["chat_template"] = read_chat_template(values.get("chat_template"))
    return ServerSettings(**values, engine=engine_config(args), api_keys=api_keys(args))


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except EnvError as exc:
        print(f"plait: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(args, list(sys.argv[2:] if argv is None else argv[1:]))
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
