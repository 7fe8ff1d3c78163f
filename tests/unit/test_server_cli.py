"""`plait` CLI: env vars vs flags, help text, config building, import hygiene."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import fields

import pytest
from helpers.paths import REPO

from plait.cli import (
    FAULT_INJECTION,
    FIELD_DEFAULTS,
    NOT_OPTIONS,
    OPTIONS,
    EnvError,
    api_keys,
    build_parser,
    engine_config,
    server_settings,
)
from plait.engine.config import EngineConfig
from plait.server.settings import ServerSettings


def parse(argv: list[str], env: dict[str, str] | None = None):
    return build_parser(env or {}).parse_args(["serve", *argv])


def test_defaults_serve_the_embedded_model() -> None:
    settings = server_settings(parse([]))
    assert settings.engine.model is None
    assert (settings.host, settings.port, settings.api_keys) == ("127.0.0.1", 8000, ())
    assert settings.engine.enable_prefix_caching is True
    assert settings.allowed_origins == ("*",)


def test_env_sets_every_kind_and_flags_win() -> None:
    env = {"PLAIT_MODEL": "/models/m.gguf", "PLAIT_PORT": "9001", "PLAIT_MAX_NUM_SEQS": "7",
           "PLAIT_KV_CACHE_MEMORY_GB": "0.25", "PLAIT_ENABLE_PREFIX_CACHING": "false",
           "PLAIT_ALLOWED_ORIGINS": "https://a.example, https://b.example",
           "PLAIT_NUM_KV_BLOCKS": "64", "PLAIT_API_KEY": "from-env", "PLAIT_CACHE": "/x",
           "PLAIT_SERVICE_HOST": "10.0.0.1"}  # not options: ignored
    args = parse([], env)
    config = engine_config(args)
    assert (config.model, config.max_num_seqs, config.kv_cache_memory_gb) == \
        ("/models/m.gguf", 7, 0.25)
    assert (config.enable_prefix_caching, config.num_kv_blocks) == (False, 64)
    assert args.port == 9001 and api_keys(args) == ("from-env",)
    assert args.allowed_origins == ["https://a.example", "https://b.example"]

    args = parse(["other.gguf", "--port", "9002", "--max-num-seqs", "3",
                  "--enable-prefix-caching", "--allowed-origins", '["https://c.example"]'], env)
    config = engine_config(args)
    assert (config.model, args.port, config.max_num_seqs) == ("other.gguf", 9002, 3)
    assert config.enable_prefix_caching is True
    assert args.allowed_origins == ["https://c.example"]


def test_no_enable_prefix_caching_flag() -> None:
    assert engine_config(parse(["--no-enable-prefix-caching"])).enable_prefix_caching is False


def test_kernel_switches_are_engine_options_env_included() -> None:
    """The old kernel environment switches still work, through the options table, into
    EngineConfig (read once at start, nowhere below the runner)."""
    config = engine_config(parse([]))
    assert (config.native, config.cascade, config.attention_backend, config.cpu_gemm) == \
        (True, True, "auto", "auto")
    env = {"PLAIT_NATIVE": "0", "PLAIT_CASCADE": "0", "PLAIT_ATTENTION_BACKEND": "reference",
           "PLAIT_CPU_GEMM": "onednn"}
    config = engine_config(parse([], env))
    assert (config.native, config.cascade, config.attention_backend, config.cpu_gemm) == \
        (False, False, "reference", "onednn")
    config = engine_config(parse(["--native", "--cpu-gemm", "none"], env))
    assert (config.native, config.cpu_gemm) == (True, "none")
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        EngineConfig(cpu_gemm="blas")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


@pytest.mark.parametrize("env", [{"PLAIT_PORT": "eighty"}, {"PLAIT_DTYPE": "int3"},
                                 {"PLAIT_ENABLE_PREFIX_CACHING": "maybe"},
                                 {"PLAIT_CPU_GEMM": "blas"},
                                 {"PLAIT_ATTENTION_BACKEND": "flash"}])
def test_bad_env_values_are_named(env: dict[str, str]) -> None:
    with pytest.raises(EnvError, match=next(iter(env))):
        build_parser(env)


def test_help_lists_the_env_var_of_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    serve = build_parser({})._subparsers._group_actions[0].choices["serve"]  # type: ignore
    text = serve.format_help()
    assert "[env: PLAIT_MODEL]" in text
    blocks = re.split(r"\n(?=  -)", text)  # one block per option: flags, then its help
    for option in OPTIONS:
        block = next(b for b in blocks if b.strip().startswith(option.flag + " ")
                     or b.strip().startswith(option.flag + ","))
        assert f"[env: {option.env}]" in " ".join(block.split()), block


def test_every_config_field_has_an_option() -> None:
    """A field added to EngineConfig or ServerSettings needs its line in OPTIONS (options
    are matched to fields by name, so no name may be in both classes)."""
    dests = {option.dest for option in (*OPTIONS, FAULT_INJECTION)}
    names = {cls: {f.name for f in fields(cls)} for cls in (EngineConfig, ServerSettings)}
    for cls, field_names in names.items():
        missing = sorted(field_names - dests - NOT_OPTIONS)
        assert not missing, f"{cls.__name__} field(s) without a `plait serve` option: {missing}"
    assert not names[EngineConfig] & names[ServerSettings]
    assert dests - set(FIELD_DEFAULTS) == {"api_key", "api_key_file"}  # the only non-fields


def test_defaults_are_the_dataclasses() -> None:
    args = parse([])
    assert engine_config(args) == EngineConfig()
    assert server_settings(args) == ServerSettings()
    assert args.allowed_origins == ["*"]  # a "list" option parses to a list, its field a tuple


def _readme_default(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "on" if value else "off"
    return ",".join(value) if isinstance(value, tuple) else str(value)


def test_readme_documents_every_option() -> None:
    readme = (REPO / "README.md").read_text()
    rows = [line for line in readme.splitlines() if line.startswith("| `--")]
    for option in OPTIONS:
        row = next((r for r in rows if r.startswith(f"| `{option.flag}`")), None)
        assert row is not None, f"README has no row for {option.flag}"
        assert f"`{option.env}`" in row
        default_cell = row.split(" | ")[2]
        assert default_cell.startswith(_readme_default(option.default)), (row, option.default)
    assert "--fault-injection" not in "".join(rows)  # test-only, kept out of the table


def test_api_key_file(tmp_path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nkey-one\n\n  key-two  \n")
    assert api_keys(parse(["--api-key", "flag", "--api-key-file", str(keys)])) == \
        ("flag", "key-one", "key-two")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys(parse(["--api-key-file", str(empty)]))


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_help_and_engine_import_without_the_http_stack() -> None:
    result = _run(
        "import sys, contextlib, io\n"
        "from plait.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    try: main(['serve', '--help'])\n"
        "    except SystemExit: pass\n"
        "import plait.engine.async_engine, plait.engine.llm\n"
        "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'sse_starlette') "
        "if m in sys.modules]\n"
        "assert not bad, bad\n"
        "assert 'PLAIT_PORT' in out.getvalue()\n")
    assert result.returncode == 0, result.stderr
    top = subprocess.run([sys.executable, "-m", "plait", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert top.returncode == 0 and "serve" in top.stdout


def test_bad_model_path_exits_1_with_one_line(tmp_path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "plait", "serve", str(tmp_path / "missing"), "--port", "0",
         "--log-level", "warning"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "cannot load the model" in result.stderr
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- torch's build at start
@pytest.mark.parametrize(("lines", "expected"), [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n",
     "torch 2.13.0+cpu (CPU build)"),
    ("__version__ = '2.10.0'\ncuda: Optional[str] = '12.8'\nhip: Optional[str] = None\n",
     "torch 2.10.0 (CUDA 12.8 build)"),
    ("__version__ = '2.9.1+rocm6.4'\ncuda = None\nhip = '6.4.4'\n",
     "torch 2.9.1+rocm6.4 (ROCm 6.4.4 build)"),
])
def test_torch_build_reads_version_py_without_importing_torch(
        tmp_path, monkeypatch: pytest.MonkeyPatch, lines: str, expected: str) -> None:
    import importlib.machinery
    import importlib.util

    from plait.server import serve

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('never imported')\n")
    (tmp_path / "torch" / "version.py").write_text(lines)
    spec = importlib.machinery.ModuleSpec("torch", None,
                                          origin=str(tmp_path / "torch" / "__init__.py"))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: spec if name == "torch" else None)
    assert serve.torch_build() == expected


def test_torch_build_of_the_installed_torch() -> None:
    import torch

    from plait.server.serve import torch_build

    kind = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
    assert torch_build() == f"torch {torch.__version__} ({kind} build)"
