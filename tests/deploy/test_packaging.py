"""Packaging contracts: import names (installed, as a wheel, and from a checkout without any
install), and an engine path free of the HTTP stack."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest
from helpers.paths import REPO, run_python
from helpers.tiny_model import make_tiny_model

SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]  # import name -> source folder

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


def test_generic_import_names_are_not_installed(tmp_path) -> None:
    """The distribution installs only `plait.*`: a top-level `kernels`/`server`/`engine` may
    exist (PyPI's `kernels` is a transformers dependency) but never from plait's files."""
    sources = [str(REPO / folder) for folder in PACKAGE_DIRS.values()]
    code = textwrap.dedent(f"""
        import importlib.metadata, importlib.util, os
        owners = importlib.metadata.packages_distributions()
        for name in ("kernels", "server", "engine"):
            assert "plait" not in owners.get(name, []), (name, owners.get(name))
            spec = importlib.util.find_spec(name)
            origin = os.path.realpath(getattr(spec, "origin", None) or "")
            assert not any(origin.startswith(src + os.sep) for src in {sources!r}), (name, origin)
        import plait.kernels, plait.engine, plait.server
        print("ok")
    """)
    result = run_python(code, tmp_path)  # outside the repo: only site-packages is searched
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("entry", ["", str(REPO)])
def test_a_checkout_root_on_sys_path_stops_shadowing_once_plait_is_imported(entry) -> None:
    """`python -c`/`-m` from the checkout ("") or PYTHONPATH=<checkout> make kernels/ import
    as the top-level `kernels`, hiding PyPI's (a transformers dependency): `python -m plait`
    and the tests' conftest drop that entry, and plait's own packages still import."""
    code = textwrap.dedent(f"""
        import importlib.util, sys
        sys.path.insert(0, {entry!r})
        def origin():
            spec = importlib.util.find_spec("kernels")
            return getattr(spec, "origin", None) or ""
        before = origin()
        import plait
        from plait._paths import drop_checkout_root
        drop_checkout_root()
        import plait.kernels, plait.engine.core, plait.server.app
        ours = {str(REPO / "kernels" / "__init__.py")!r}
        print(before == ours, origin() == ours)
    """)
    result = run_python(code, REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_a_spawned_child_imports_the_same_checkout_after_the_root_is_dropped(tmp_path) -> None:
    """The engine process is spawned after `python -m plait` dropped the checkout root: it
    inherits sys.path, and must import this checkout's `plait`, not another one further
    along sys.path (here a decoy; in a git worktree, the venv's editable install of the
    main checkout), nor the checkout's `kernels` as a top-level module."""
    decoy = tmp_path / "decoy"
    (decoy / "plait").mkdir(parents=True)
    (decoy / "plait" / "__init__.py").write_text("")
    code = textwrap.dedent(f"""
        import concurrent.futures, multiprocessing, sys
        sys.path[:0] = [{str(REPO)!r}, {str(decoy)!r}]
        import plait
        from plait._paths import drop_checkout_root
        drop_checkout_root()
        probe = ("__import__('os').path.realpath(__import__('plait').__file__), "
                 "getattr(__import__('importlib.util').util.find_spec('kernels'), "
                 "'origin', None)")
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
            child_plait, child_kernels = pool.submit(eval, probe).result()
        print(child_plait)
        print(child_kernels != {str(REPO / "kernels" / "__init__.py")!r})
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / "plait" / "__init__.py"), "True"]


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


def _source_packages() -> dict[str, Path]:
    """Every package (a folder with __init__.py, nested ones too) under the mapped folders,
    by import name; plait/'s symlinks to the other mapped folders are not walked twice."""
    found = {}
    for name, src in PACKAGE_DIRS.items():
        for init in (REPO / src).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / src).parts
            linked = name == "plait" and rel and (REPO / src / rel[0]).is_symlink()
            if "__pycache__" not in rel and not linked:
                found[".".join((name, *rel))] = init.parent
    return found


def test_every_package_is_listed_and_linked_into_plait() -> None:
    """pyproject's `packages` names every package (a new sub-package must be added there, or
    installs silently lack it), and plait/<name> is a relative symlink to each mapped folder
    so that a checkout imports plait.<name> without an install."""
    assert sorted(SETUPTOOLS["packages"]) == sorted(_source_packages())
    for name, src in PACKAGE_DIRS.items():
        if name != "plait":
            link = REPO / "plait" / name.split(".")[-1]
            assert link.is_symlink() and os.readlink(link) == f"../{src}", link


def _deps_only_env(**extra: str) -> dict[str, str]:
    """An environment whose PYTHONPATH holds only the dependencies' site-packages; with -S
    their .pth files (the editable install's finder among them) are not run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    paths = [*extra.get("prefix", "").split(os.pathsep), *site.getsitepackages()]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


NO_INSTALL_CHECK = textwrap.dedent("""
    import os, sys
    assert not any("editable" in repr(f).lower() for f in sys.meta_path), sys.meta_path
    import plait.engine.config, plait.engine.models.llama, plait.kernels.reference
    import plait.server.settings
    from plait.cli import build_parser, server_settings
    assert server_settings(build_parser({}).parse_args(["serve"])).engine_process in (True, False)
    for module in (plait, plait.engine, plait.server, plait.kernels):
        print(os.path.realpath(module.__file__))
""")


@pytest.mark.parametrize("where", ["repo root", "PYTHONPATH"])
def test_imports_from_a_checkout_without_install(tmp_path, where: str) -> None:
    """`python -c` from the repo root (cwd on sys.path), or a script elsewhere with the repo
    on PYTHONPATH, imports plait.* from the source folders with nothing installed."""
    if where == "repo root":
        cwd, env = REPO, _deps_only_env()
    else:
        cwd, env = tmp_path, _deps_only_env(prefix=str(REPO))
    result = subprocess.run([sys.executable, "-S", "-c", NO_INSTALL_CHECK], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(REPO / folder / "__init__.py")
                                     for folder in ("plait", "engine", "server", "kernels")]


def test_wheel_holds_every_module(tmp_path) -> None:
    """The wheel (what the Dockerfile installs) has every module of every package, nested
    ones included, exactly once, under plait/, the native kernels' C source and the
    playground's static files. Built from
    a copy that keeps the symlinks, as docker's COPY does."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in set(PACKAGE_DIRS.values()):
        shutil.copytree(REPO / folder, src / folder, symlinks=True, ignore=ignore)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp_path / "wheels"), str(src)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("plait-*.whl")
    names = [n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n]
    expected = [f"{package.replace('.', '/')}/{py.name}"
                for package, folder in _source_packages().items() for py in folder.glob("*.py")]
    c_sources = sorted(p.name for p in (REPO / "kernels" / "cpu").iterdir()
                       if p.suffix in (".c", ".h"))
    assert len(c_sources) >= 5
    ui_files = sorted(p.name for p in (REPO / "server" / "ui").iterdir() if p.is_file())
    assert {"index.html", "ui.js", "ui.css"} <= set(ui_files)
    assert sorted(names) == sorted([*expected,
                                    *(f"plait/kernels/cpu/{name}" for name in c_sources),
                                    *(f"plait/server/ui/{name}" for name in ui_files)])


def test_server_imports_the_engine_only_through_its_public_module() -> None:
    """`plait.engine` is the engine's one public surface for the HTTP layer and the CLI."""

    root = REPO
    deep = [f"{path.relative_to(root)}:{n}: {line.strip()}"
            for folder in ("server", "plait")
            for path in sorted((root / folder).glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if "import" in line and "plait.engine." in line.split("#")[0]]
    assert deep == []


def test_engine_public_module_is_lazy_and_complete(tmp_path) -> None:
    code = textwrap.dedent("""
        import sys
        import plait.engine as engine
        assert "torch" not in sys.modules, "import plait.engine must stay cheap"
        assert sorted(engine.__all__) == sorted(engine._EXPORTS)
        for name in engine.__all__:
            assert getattr(engine, name) is not None, name
        print("ok")
    """)
    result = run_python(code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
