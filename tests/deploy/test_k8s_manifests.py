"""The manifests in docker/: the kustomize base (docker/base, applied by docker/) and the opt-in
overlays docker/gateway (inference gateway: InferencePool, endpoint picker, HTTPRoute, KV
events) and docker/cpu (CPU replicas). Core kinds are validated against the Kubernetes schemas
in strict mode; InferencePool and HTTPRoute against their CRDs' own OpenAPI schemas, vendored
in tests/deploy/crds/ (source and version in each file's header). Both the files and the
overlays as rendered (`kubectl kustomize`, skipped without kubectl) are validated. Beyond the
schemas, only what the server and the picker rely on and a schema cannot see: references resolve
(files, ConfigMaps, Secrets, Services, ports, selectors, RBAC, plugins), probes hit a route
the real app has, the pod runs as the image's non-root user, the kubelet's grace period
covers the drain. The Dockerfile itself is checked in test_dockerfile.py.

CPU only, no cluster needed. The schemas come from `kubernetes-validate` and `jsonschema`, in
the `test` extra.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.deploy import (
    CONTAINER_PORT,
    CRD_DIR,
    DOCKERFILE,
    K8S_DIR,
    dockerfile_instructions,
    env_of,
    final_stage_of,
    get_status,
    kustomize_build,
)

from plait.server.serve import CLOSE_TIMEOUT_S, CUT_GRACE_S

BASE_DIR = K8S_DIR / "base"
GATEWAY_DIR = K8S_DIR / "gateway"
CPU_DIR = K8S_DIR / "cpu"
# What users apply: `kubectl apply -k` on each of these.
ENTRY_POINTS = {"plain": K8S_DIR, "gateway": GATEWAY_DIR, "cpu": CPU_DIR}
# A release that kubernetes-validate ships strict schemas for (checked below).
K8S_VERSION = "1.33"
# Manifests kept out of the kustomizations on purpose (see docker/README.md).
OPT_IN_MANIFESTS = {"secret.example.yaml", "hpa.yaml"}
# The port of the KV-event publisher (PLAIT_KV_EVENTS_ENDPOINT) and the picker's ext-proc port.
KV_EVENTS_PORT = 5557


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def final_stage() -> list[tuple[str, str]]:
    return final_stage_of(dockerfile_instructions(DOCKERFILE.read_text()))


def _load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomizations() -> list[Path]:
    return sorted(K8S_DIR.rglob("kustomization.yaml"))


def _patch_files() -> set[Path]:
    """Files that kustomizations use as patches: partial objects, valid only once rendered."""
    found = set()
    for kust in _kustomizations():
        doc = _load_all(kust)[0]
        for entry in doc.get("patches", []) + doc.get("patchesStrategicMerge", []):
            path = entry.get("path") if isinstance(entry, dict) else entry
            if path:
                found.add((kust.parent / path).resolve())
    return found


def _manifests() -> list[Path]:
    """Every complete manifest under docker/ (kustomizations included, patches not)."""
    patches = _patch_files()
    return sorted(p for p in K8S_DIR.rglob("*.y*ml") if p.resolve() not in patches)


def _rel(path: Path) -> str:
    return path.relative_to(K8S_DIR).as_posix()


def _one(path: Path, kind: str) -> dict[str, Any]:
    docs = [d for d in _load_all(path) if d.get("kind") == kind]
    assert len(docs) == 1, f"{path.name}: expected exactly one {kind}, found {len(docs)}"
    return docs[0]


@pytest.fixture(scope="module")
def deployment() -> dict[str, Any]:
    return _one(BASE_DIR / "deployment.yaml", "Deployment")


@pytest.fixture(scope="module")
def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "the Deployment should run exactly one container"
    return containers[0]


@pytest.fixture(scope="module")
def configmap() -> dict[str, Any]:
    return _one(BASE_DIR / "configmap.yaml", "ConfigMap")


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


# --- CRD kinds: validated against the vendored CRDs' openAPIV3Schema with jsonschema.


def _strict(schema: Any) -> Any:
    """The schema as the API server applies it with strict field validation (kubectl's
    default): a field the structural schema does not declare is an error, not pruned."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """{(apiVersion, kind): strict openAPIV3Schema} of every served version in
    tests/deploy/crds/."""
    schemas = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        head = path.read_text().split("apiVersion:", 1)[0]
        assert "Source:" in head and "commit" in head, (
            f"{path.name}: the header must name its source repository, path and commit")
        for crd in _load_all(path):
            assert crd["kind"] == "CustomResourceDefinition"
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                if version.get("served"):
                    schemas[(f"{group}/{version['name']}", kind)] = _strict(
                        version["schema"]["openAPIV3Schema"])
    return schemas


def _validate(doc: dict[str, Any], where: str) -> None:
    """One object: a vendored CRD's schema if it is a custom kind, else Kubernetes' own."""
    import jsonschema
    import kubernetes_validate

    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    schema = _crd_schemas().get((doc.get("apiVersion"), doc.get("kind")))
    if schema is not None:
        validator = jsonschema.Draft202012Validator(schema)
        errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            pytest.fail(f"{where} {name}: {'.'.join(map(str, e.path))}: {e.message}")
        assert doc["metadata"].get("name"), f"{where} {name}: metadata.name is required"
        return
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{where} {name}: {'.'.join(str(p) for p in e.path)}: {e.message}")
    except kubernetes_validate.SchemaNotFoundError as e:
        pytest.fail(f"{where} {name}: no schema, vendor its CRD in tests/deploy/crds/: "
                    f"{e.message}")


@pytest.mark.parametrize("path", _manifests(), ids=_rel)
def test_manifest_is_schema_valid(path: Path) -> None:
    docs = _load_all(path)
    assert docs, f"{_rel(path)} is empty"
    for doc in docs:
        if doc.get("kind") == "Kustomization":
            assert doc.get("apiVersion") == "kustomize.config.k8s.io/v1beta1"
            continue  # no Kubernetes schema; checked by test_kustomization_*
        _validate(doc, _rel(path))


def test_crd_validation_is_not_vacuous() -> None:
    """The vendored schemas catch a typo, a wrong type and a missing required field."""
    pool = _one(GATEWAY_DIR / "inferencepool.yaml", "InferencePool")
    route = _one(GATEWAY_DIR / "httproute.yaml", "HTTPRoute")
    assert ("inference.networking.k8s.io/v1", "InferencePool") in _crd_schemas()
    assert ("gateway.networking.k8s.io/v1", "HTTPRoute") in _crd_schemas()
    broken = []
    b = copy.deepcopy(pool)
    b["spec"]["targetPort"] = b["spec"].pop("targetPorts")  # typo, and required field gone
    broken.append(b)
    b = copy.deepcopy(pool)
    b["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"  # not in the enum
    broken.append(b)
    b = copy.deepcopy(route)
    b["spec"]["rules"][0]["backendRefs"][0]["weight"] = "heavy"  # wrong type
    broken.append(b)
    for doc in broken:
        with pytest.raises(pytest.fail.Exception):
            _validate(doc, "broken")


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


def _assert_quantities(docs: list[dict[str, Any]], where: str) -> None:
    for doc in docs:
        for what, value in _quantities(doc):
            assert isinstance(value, int) or (
                isinstance(value, str) and _QUANTITY.fullmatch(value)), (
                f"{where}: {what}={value!r} is not a Kubernetes quantity")


@pytest.mark.parametrize("path", _manifests(), ids=_rel)
def test_manifest_quantities_parse(path: Path) -> None:
    _assert_quantities(_load_all(path), _rel(path))


def test_strict_validation_rejects_unknown_fields(deployment: dict[str, Any]) -> None:
    import kubernetes_validate

    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}  # typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_resources(container: dict[str, Any]) -> None:
    listed: set[Path] = set()
    for kust_path in _kustomizations():
        kust = _one(kust_path, "Kustomization")
        where = _rel(kust_path)
        res = kust.get("resources", [])
        assert res, f"{where} lists no resources"
        assert len(res) == len(set(res)), f"{where}: duplicate resources"
        for entry in res:
            target = kust_path.parent / entry
            assert target.is_file() or (target / "kustomization.yaml").is_file(), (
                f"{where} lists missing {entry}")
            listed.add(target.resolve())
        for key in ("patches", "patchesStrategicMerge", "components", "configurations"):
            for entry in kust.get(key, []):
                path = entry.get("path") if isinstance(entry, dict) else entry
                if path:
                    assert (kust_path.parent / path).exists(), f"{where}: {key} lacks {path}"
        assert not any(Path(r).name == "secret.example.yaml" for r in res), (
            "the example Secret would overwrite the real API key on every `kubectl apply -k`")
        # Each entry point names the image it deploys; the base cannot (see its comment).
        images = {i["name"] for i in kust.get("images", [])}
        if kust_path.parent == BASE_DIR:
            assert not images, "set images in the entry points, not in docker/base"
        else:
            assert container["image"].split(":")[0] in images, (
                f"{where}: images does not rewrite the Deployment's image {container['image']!r}")
    # Every manifest is applied by some kustomization, is a patch, or is an opt-in example.
    unlisted = {_rel(p) for p in _manifests()
                if p.name != "kustomization.yaml" and p.resolve() not in listed
                and p.name not in OPT_IN_MANIFESTS}
    assert not unlisted, f"manifests neither in a kustomization nor opt-in: {unlisted}"


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
        assert get_status(http["path"]) != 404, f"{name}: the app has no {http['path']}"
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
    # After the drain, cut requests get CUT_GRACE_S to send their error and uvicorn
    # CLOSE_TIMEOUT_S to close; then the engine stops (a few seconds: the margin).
    stop = float(drain) + CUT_GRACE_S + CLOSE_TIMEOUT_S
    assert grace > stop + pre_stop + 5, (
        f"terminationGracePeriodSeconds={grace} leaves no margin over the drain "
        f"({drain}s, {stop}s with the cut) + preStop ({pre_stop}s): the kubelet would "
        "SIGKILL mid-drain")


def test_readiness_is_health_and_liveness_is_live(container: dict[str, Any]) -> None:
    """During the drain /health is 503 (out of the endpoints) while /live stays 200."""
    paths = {name: container[name]["httpGet"]["path"]
             for name in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/health", "readinessProbe": "/health",
                     "livenessProbe": "/live"}


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

    # PLAIT_MODEL lies in a read-only mount of the claim that pvc.yaml defines.
    pvc = _one(BASE_DIR / "pvc.yaml", "PersistentVolumeClaim")
    model = env.get("PLAIT_MODEL")
    assert isinstance(model, str)
    models = next(m for path, m in mounts.items() if model.startswith(path.rstrip("/") + "/"))
    assert models.get("readOnly") is True, f"{models['mountPath']} must be mounted read-only"
    claim = volumes[models["name"]].get("persistentVolumeClaim", {})
    assert claim.get("claimName") == pvc["metadata"]["name"]

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
    svc = _one(BASE_DIR / "service.yaml", "Service")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = svc["spec"]["selector"]
    assert selector and all(labels.get(k) == v for k, v in selector.items()), (
        "the Service selector does not match the pod labels")
    selector_dep = deployment["spec"]["selector"]["matchLabels"]
    assert all(labels.get(k) == v for k, v in selector_dep.items())
    (port,) = svc["spec"]["ports"]
    assert _port_number(container, port.get("targetPort", port["port"])) == CONTAINER_PORT


@pytest.mark.parametrize("path", [K8S_DIR / "hpa.yaml", GATEWAY_DIR / "hpa.yaml"], ids=_rel)
def test_hpa_targets_deployment(path: Path, deployment: dict[str, Any]) -> None:
    hpa = _one(path, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 1 <= hpa["spec"].get("minReplicas", 1) <= hpa["spec"]["maxReplicas"]
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] in ("Pods", "Object", "External"):
            name = metric[metric["type"].lower()]["metric"]["name"]
            # Plait's own gauge, or the vLLM-named one as prometheus-adapter serves it
            # (vllm:num_requests_waiting renamed: a custom-metric name has no colon).
            assert re.fullmatch(r"(plait|vllm)_[a-z_]+", name), f"not a Plait metric: {name}"


# --------------------------------------------------------------------------- rendered overlays


@functools.cache
def _rendered(entry: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize_build(ENTRY_POINTS[entry]))


def _find(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def _plait_container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    deployment = _find(docs, "Deployment", "plait")
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == "plait")


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_rendered_overlay_is_schema_valid(entry: str) -> None:
    docs = _rendered(entry)
    assert docs
    for doc in docs:
        _validate(doc, f"kubectl kustomize docker/{entry}")
    _assert_quantities(list(docs), f"docker/{entry}")
    # The overlays keep the API key, and set each variable once.
    container = _plait_container(docs)
    env_names = [e["name"] for e in container.get("env", [])]
    assert "PLAIT_API_KEY" in env_names and len(env_names) == len(set(env_names))


def _epp_config(docs: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the EPP Deployment's container, its EndpointPickerConfig as mounted from the ConfigMap)."""
    epp = _find(docs, "Deployment", "plait-epp")
    pod = epp["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    config_file = args[args.index("--config-file") + 1]
    mount = next(m for m in container["volumeMounts"]
                 if config_file.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    cm = _find(docs, "ConfigMap", volume["configMap"]["name"])
    key = config_file[len(mount["mountPath"].rstrip("/")) + 1:]
    assert key in cm["data"], f"--config-file {config_file} is not a key of {cm['metadata']}"
    return container, yaml.safe_load(cm["data"][key])


def test_gateway_pool_selects_plait_pods_on_the_server_port() -> None:
    docs = _rendered("gateway")
    pool = _find(docs, "InferencePool", "plait")
    container = _plait_container(docs)
    plait = _find(docs, "Deployment", "plait")["spec"]["template"]["metadata"]["labels"]
    epp = _find(docs, "Deployment", "plait-epp")["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert all(plait.get(k) == v for k, v in selector.items()), "the pool misses the Plait pods"
    assert not all(epp.get(k) == v for k, v in selector.items()), "the pool selects the picker"
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [CONTAINER_PORT]
    assert _port_number(container, "http") == CONTAINER_PORT
    # The picker reads vLLM metric names for pods with this label (llm-d-router
    # core-metrics-extractor; the inference.networking.k8s.io key is its deprecated fallback).
    assert plait.get("llm-d.ai/engine-type") == "vllm"
    # The route sends requests to the pool.
    route = _find(docs, "HTTPRoute", "plait")
    refs = [r for rule in route["spec"]["rules"] for r in rule["backendRefs"]]
    assert refs == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                     "name": "plait"}]


def test_gateway_endpoint_picker_wiring() -> None:
    docs = _rendered("gateway")
    pool = _find(docs, "InferencePool", "plait")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service"
    svc = _find(docs, "Service", ref["name"])
    epp = _find(docs, "Deployment", "plait-epp")
    pod_labels = epp["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    container, config = _epp_config(docs)
    port = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert _port_number(container, port["targetPort"]) == 9002, "ext-proc is the EPP's :9002"
    args = container["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-group") + 1] == "inference.networking.k8s.io"
    # RBAC: the service account may read pods (endpoints, KV-event subscribers) and the pool.
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    _find(docs, "ServiceAccount", sa)
    bindings = [b for b in docs if b["kind"] == "RoleBinding"
                and any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in b["subjects"])]
    rules = [r for b in bindings for r in _find(docs, b["roleRef"]["kind"],
                                                b["roleRef"]["name"])["rules"]]

    def allowed(group: str, resource: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"]
                   and {"get", "list", "watch"} <= set(r["verbs"]) for r in rules)

    assert allowed("", "pods") and allowed("inference.networking.k8s.io", "inferencepools")
    # The plugin config: every referenced plugin is declared, the three scorers are used.
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    names = [p.get("name", p["type"]) for p in config["plugins"]]
    assert len(names) == len(set(names)), "duplicate plugin names"
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    refs += [e["pluginRef"] for src in config.get("dataLayer", {}).get("sources", [])
             for e in [src, *src.get("extractors", [])]]
    assert set(refs) <= set(names), f"undeclared plugins: {set(refs) - set(names)}"
    scorers = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert {"prefix-cache-scorer", "queue-scorer", "kv-cache-utilization-scorer"} <= scorers


def test_gateway_kv_events_wiring() -> None:
    docs = _rendered("gateway")
    container = _plait_container(docs)
    configmap = _find(docs, "ConfigMap", "plait-config")
    env = _resolved_env(container, configmap)
    endpoint = env.get("PLAIT_KV_EVENTS_ENDPOINT")  # ZMQ bind address, tcp://*:<port>
    assert int(endpoint.rsplit(":", 1)[1]) == KV_EVENTS_PORT
    assert _port_number(container, "kv-events") == KV_EVENTS_PORT
    _, config = _epp_config(docs)
    plugins = {p.get("name", p["type"]): p.get("parameters", {}) for p in config["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    events = producer["kvEventsConfig"]
    assert events["podDiscoveryConfig"]["socketPort"] == KV_EVENTS_PORT
    assert events.get("discoverPods") is True
    # Topic "kv@<pod>@<model>": the picker subscribes by prefix and keys blocks by the model.
    topic = env["PLAIT_KV_EVENTS_TOPIC"]
    assert topic.startswith(events.get("topicFilter", "kv@"))
    served = env["PLAIT_SERVED_MODEL_NAME"]
    assert topic.split("@")[-1] in (served, "$(PLAIT_SERVED_MODEL_NAME)")
    names = [e["name"] for e in container["env"]]
    for var in re.findall(r"\$\((\w+)\)", topic):  # defined before use, or from envFrom
        assert var in configmap["data"] or names.index(var) < names.index("PLAIT_KV_EVENTS_TOPIC")
    # The picker's tokenizer calls Plait's /render endpoints for the served model.
    assert plugins["token-producer"]["modelName"] == served
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == (
        "precise-prefix-cache-producer")


def test_cpu_overlay_has_no_gpu_and_fits_its_kv_budget() -> None:
    docs = _rendered("cpu")
    text = yaml.safe_dump_all(list(docs))
    assert "nvidia" not in text, "the CPU variant still mentions a GPU resource or toleration"
    container = _plait_container(docs)
    pod = _find(docs, "Deployment", "plait")["spec"]["template"]["spec"]
    assert not pod.get("tolerations")
    assert container["image"].endswith("-cpu"), "the CPU variant must run the CPU image"
    env = _resolved_env(container, _find(docs, "ConfigMap", "plait-config"))
    assert env.get("PLAIT_DEVICE") == "cpu"
    assert "PLAIT_GPU_MEMORY_UTILIZATION" not in env
    assert "PLAIT_MODEL" not in env, "the CPU variant serves the model baked into the image"
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert not claims, "a volume still refers to the removed model claim"

    def gib(q: str) -> float:
        m = re.fullmatch(r"(\d+(?:\.\d+)?)(Gi|Mi|G|M)?", q)
        assert m, f"unexpected quantity {q}"
        scale = {"Gi": 1.0, "Mi": 1 / 1024, "G": 1e9 / 2**30, "M": 1e6 / 2**30, None: 2**-30}
        return float(m.group(1)) * scale[m.group(2)]

    res = container["resources"]
    kv_gb = float(env["PLAIT_KV_CACHE_MEMORY_GB"])
    # SmolLM2-135M with a 1 GB KV cache: ~3.5 GB resident (soaks: 2.5-2.9 GB); so the request
    # must cover 2.5 GB + the KV budget, and requests == limits (no OOM kill by overcommit).
    assert gib(res["requests"]["memory"]) >= 2.5 + kv_gb * 1e9 / 2**30
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert str(res["requests"]["cpu"]) == str(res["limits"]["cpu"])
    assert env.get("OMP_NUM_THREADS") == str(res["limits"]["cpu"]), (
        "torch's thread count should equal the CPU limit")
