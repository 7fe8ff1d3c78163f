"""The kustomize base in docker/: Kubernetes schema validation in strict mode, the
kustomization, and the invariants the server relies on (probes, the API key Secret, volumes,
security, Service and HPA). The Dockerfile itself is checked in test_dockerfile.py.

CPU only, no cluster needed. The schemas come from `kubernetes-validate`, in the `test` extra.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import (
    CONTAINER_PORT,
    DOCKERFILE,
    REPO,
    dockerfile_instructions,
    env_of,
    final_stage_of,
)

K8S_DIR = REPO / "docker"
# A release that kubernetes-validate ships strict schemas for (checked below).
K8S_VERSION = "1.33"
# Manifests kept out of kustomization.yaml on purpose (see docker/README.md).
OPT_IN_MANIFESTS = {"secret.example.yaml", "hpa.yaml"}


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def final_stage() -> list[tuple[str, str]]:
    return final_stage_of(dockerfile_instructions(DOCKERFILE.read_text()))


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
    assert env_of(final_stage).get("PLAIT_PORT") == str(CONTAINER_PORT)
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

    cache = env.get("PLAIT_CACHE") or env_of(final_stage)["PLAIT_CACHE"]
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
