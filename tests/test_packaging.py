"""Packaging contracts: import names, and an engine path free of the HTTP stack."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tiny_model import make_tiny_model

BLOCK_HTTP_STACK = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"fastapi", "pydantic", "starlette", "uvicorn",
                                      "sse_starlette"}:
                raise ImportError(f"blocked: {name}")
            return None
    sys.meta_path.insert(0, Block())
""")


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_generic_import_names_are_not_installed(tmp_path) -> None:
    code = textwrap.dedent("""
        import importlib.util
        for name in ("kernels", "server", "engine"):
            spec = importlib.util.find_spec(name)
            origin = getattr(spec, "origin", None) or ""
            assert spec is None or "/work/" not in origin and "plait" not in origin, (name, origin)
        import plait.kernels, plait.engine, plait.server
        print("ok")
    """)
    result = run_python(code, tmp_path)  # outside the repo: only site-packages is searched
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_engine_runs_without_fastapi_or_pydantic(tmp_path, default_model) -> None:
    model = make_tiny_model(tmp_path / "tiny", default_model.path)
    code = BLOCK_HTTP_STACK + textwrap.dedent(f"""
        from plait import LLM, SamplingParams
        import plait.engine.async_engine, plait.kernels
        llm = LLM({str(model)!r}, num_kv_blocks=32)
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        try:
            import fastapi
        except ImportError:
            print("ok")
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
