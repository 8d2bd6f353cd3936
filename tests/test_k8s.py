"""Kubernetes manifests (deploy/k8s): every overlay renders with `kubectl kustomize`
and every object validates against the Kubernetes JSON schemas, offline.

kubernetes-validate bundles the schemas (no cluster, no network). The ServiceMonitor
is a CRD with no schema there, so it is checked field by field. The other tests hold
the deployment's rules: only the gateway reaches the engines and Redis, every
container has resources and probes, no secret value is committed, and the NVIDIA
overlay asks for GPUs.
"""

from __future__ import annotations

import base64
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from packaging.version import Version

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
OVERLAYS = ("cpu", "nvidia", "trial")
KUBECTL = shutil.which("kubectl")
# The oldest Kubernetes the manifests claim (docs/operations.md), or the oldest
# schemas bundled above it, and the newest schemas bundled.
MIN_K8S = "1.29.0"
K8S_VERSIONS = (
    next(v for v in all_versions() if Version(v) >= Version(MIN_K8S)),
    kubernetes_validate.latest_version(),
)
# Kinds without a bundled schema, checked by test_servicemonitor_* instead.
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
SECRET_KEYS = ("engine-token", "admin-key", "key-pepper", "metrics-token", "redis-url")
GATEWAY_SECRET_ENV = {
    "STEERGATE_ENGINE_TOKEN": "engine-token",
    "STEERGATE_ADMIN_KEY": "admin-key",
    "STEERGATE_KEY_PEPPER": "key-pepper",
    "STEERGATE_METRICS_TOKEN": "metrics-token",
    "REDIS_URL": "redis-url",
}
WORKLOADS = ("Deployment", "StatefulSet")
SERVICEMONITOR_ENDPOINT_KEYS = {
    "port", "path", "scheme", "interval", "scrapeTimeout", "authorization",
    "bearerTokenSecret", "tlsConfig", "honorLabels", "relabelings", "metricRelabelings",
}
DURATION = re.compile(r"^(\d+(ms|s|m|h))+$")

Obj = dict[str, Any]


def kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed; it renders the Kustomize overlays")
    return subprocess.run(
        [KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60
    )


def copy_tree(dest: Path) -> Path:
    """deploy/k8s without any local secrets.env, so a developer's real one stays out."""
    root = dest / "k8s"
    shutil.copytree(K8S, root, ignore=shutil.ignore_patterns("secrets.env"))
    return root


@pytest.fixture(scope="module")
def secret_values() -> dict[str, str]:
    values = {key: secrets.token_urlsafe(32) for key in SECRET_KEYS}
    values["redis-url"] = "redis://redis:6379/0"
    return values


@pytest.fixture(scope="module")
def rendered(
    tmp_path_factory: pytest.TempPathFactory, secret_values: dict[str, str]
) -> dict[str, list[Obj]]:
    root = copy_tree(tmp_path_factory.mktemp("k8s"))
    (root / "base" / "secrets.env").write_text(
        "".join(f"{k}={v}\n" for k, v in secret_values.items())
    )
    out = {}
    for overlay in OVERLAYS:
        result = kustomize(root / "overlays" / overlay)
        assert result.returncode == 0, f"overlays/{overlay}: {result.stderr}"
        out[overlay] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


@pytest.fixture(params=OVERLAYS)
def objects(request: pytest.FixtureRequest, rendered: dict[str, list[Obj]]) -> list[Obj]:
    return rendered[request.param]


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in WORKLOADS]


def pod_labels(workload: Obj) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def containers(workload: Obj) -> list[Obj]:
    spec = workload["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    assert "matchExpressions" not in selector, "extend selects() for matchExpressions"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def selected_workloads(objs: list[Obj], selector: Obj) -> set[str]:
    """Workloads whose pods a label selector picks (a Service's plain map works too)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    return {w["metadata"]["name"] for w in workloads(objs) if selects(selector, pod_labels(w))}


def env_secret_refs(container: Obj) -> dict[str, tuple[str, str]]:
    """env name -> (Secret name, key) for every variable read from a Secret."""
    refs = {}
    for var in container.get("env", []):
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            refs[var["name"]] = (ref["name"], ref["key"])
    return refs


def test_every_object_validates_against_the_kubernetes_schemas(objects: list[Obj]) -> None:
    errors = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRDS:
            continue
        for version in K8S_VERSIONS:
            try:
                # strict: unknown fields fail too, so a misspelt probe is not dropped.
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError as e:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message}")
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(
                    f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {version}) "
                    f"at {path}: {e.message}"
                )
    assert not errors, "\n".join(errors)


def test_every_namespaced_object_lands_in_one_namespace(objects: list[Obj]) -> None:
    # Components add objects after the base set its namespace; a missing one would
    # land in `default`, and the ServiceMonitor could not find its Secret.
    namespaced = [o for o in objects if o["kind"] != "Namespace"]
    assert {o["metadata"].get("namespace") for o in namespaced} == {"steergate"}
    assert one(objects, "Namespace")["metadata"]["name"] == "steergate"


@pytest.mark.parametrize("overlay", ["cpu", "nvidia"])
def test_servicemonitor_scrapes_every_gateway_with_the_metrics_token(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    monitor = one(objs, "ServiceMonitor")
    assert (monitor["apiVersion"], monitor["kind"]) in CRDS
    assert monitor["metadata"]["name"] and monitor["metadata"]["namespace"]
    spec = monitor["spec"]
    assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}

    services = [
        s for s in find(objs, "Service") if selects(spec["selector"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in services] == ["gateway"]
    port_names = {p["name"] for p in services[0]["spec"]["ports"]}

    secret = one(objs, "Secret")
    assert spec["endpoints"], "a ServiceMonitor needs at least one endpoint"
    for endpoint in spec["endpoints"]:
        assert set(endpoint) <= SERVICEMONITOR_ENDPOINT_KEYS, set(endpoint)
        assert endpoint["port"] in port_names
        assert endpoint["path"] == "/metrics"
        assert endpoint.get("scheme", "http") in {"http", "https"}
        for field in ("interval", "scrapeTimeout"):
            assert DURATION.match(endpoint[field]), endpoint[field]
        auth = endpoint["authorization"]
        assert auth["type"] == "Bearer"
        # The hashed name of the generated Secret, in the ServiceMonitor's namespace.
        assert auth["credentials"] == {"name": secret["metadata"]["name"], "key": "metrics-token"}
        assert secret["metadata"]["namespace"] == monitor["metadata"]["namespace"]
        assert "metrics-token" in secret["data"]


def test_trial_overlay_needs_no_prometheus_operator(rendered: dict[str, list[Obj]]) -> None:
    assert not [o for o in rendered["trial"] if (o["apiVersion"], o["kind"]) in CRDS]


def test_ingress_to_engines_and_redis_comes_only_from_the_gateway(objects: list[Obj]) -> None:
    policies = find(objects, "NetworkPolicy")
    default_deny = [
        p for p in policies
        if p["spec"]["podSelector"] == {} and "Ingress" in p["spec"]["policyTypes"]
        and not p["spec"].get("ingress")
    ]
    assert default_deny, "the namespace needs a default-deny ingress policy"

    gateway = one(objects, "Deployment", "gateway")
    protected = {"engine": 8100, "redis": 6379}
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        if name not in protected:
            continue
        applying = [p for p in policies if selects(p["spec"]["podSelector"], pod_labels(workload))]
        allowing = [p for p in applying if p["spec"].get("ingress")]
        assert allowing, f"no policy admits anything to {name}"
        for policy in allowing:
            for rule in policy["spec"]["ingress"]:
                # An empty `from` admits every source.
                assert rule.get("from"), f"{policy['metadata']['name']} admits anyone to {name}"
                for peer in rule["from"]:
                    # podSelector alone: pods of this namespace, no ipBlock, no other namespace.
                    assert set(peer) == {"podSelector"}, peer
                    assert selected_workloads(objects, peer["podSelector"]) == {"gateway"}
                    assert selects(peer["podSelector"], pod_labels(gateway))
                assert [p["port"] for p in rule["ports"]] == [protected[name]]


def test_every_container_has_resources_probes_and_a_pinned_image(objects: list[Obj]) -> None:
    for workload in workloads(objects):
        for c in containers(workload):
            where = f"{workload['metadata']['name']}/{c['name']}"
            resources = c.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), where
            assert "memory" in resources.get("limits", {}), where
            assert "readinessProbe" in c and "livenessProbe" in c, where
            image = c["image"]
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), where


def test_gateway_probes_scales_and_survives_drains(objects: list[Obj]) -> None:
    gateway = one(objects, "Deployment", "gateway")
    (c,) = containers(gateway)
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"http": 8080}
    assert gateway["spec"]["replicas"] >= 2

    hpa = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"
    }
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]

    pdbs = [
        p for p in find(objects, "PodDisruptionBudget")
        if selected_workloads(objects, p["spec"]["selector"]) == {"gateway"}
    ]
    assert len(pdbs) == 1

    service = one(objects, "Service", "gateway")
    assert selected_workloads(objects, service["spec"]["selector"]) == {"gateway"}


def test_containers_run_unprivileged_on_a_read_only_root(objects: list[Obj]) -> None:
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for c in containers(workload):
            where = f"{workload['metadata']['name']}/{c['name']}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            assert not sc.get("privileged"), where
            added = set(sc["capabilities"].get("add", []))
            # Only vLLM's CPU backend gets SYS_NICE, for NUMA binding (as in compose).
            cpu_engine = c["image"].startswith("steergate/engine-cpu:")
            assert added <= ({"SYS_NICE"} if cpu_engine else set()), where


def test_secrets_come_only_from_the_generated_secret(
    objects: list[Obj], secret_values: dict[str, str]
) -> None:
    secret = one(objects, "Secret")
    assert secret["metadata"]["name"].startswith("steergate-secrets-")  # content hash
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == secret_values, "the Secret holds exactly what secrets.env says"

    for workload in workloads(objects):
        for c in containers(workload):
            for var in c.get("env", []):
                assert not ("value" in var and var["name"] in GATEWAY_SECRET_ENV), var
            for name, (ref, _) in env_secret_refs(c).items():
                assert ref == secret["metadata"]["name"], (name, ref)

    (gateway,) = containers(one(objects, "Deployment", "gateway"))
    refs = env_secret_refs(gateway)
    assert {name: key for name, (_, key) in refs.items()} == GATEWAY_SECRET_ENV
    # The engines get the engine token (and an optional HF token), nothing else.
    (engine,) = containers(one(objects, "StatefulSet", "engine"))
    assert {key for _, key in env_secret_refs(engine).values()} == {"engine-token", "hf-token"}


def test_engine_urls_name_every_engine_pod(objects: list[Obj]) -> None:
    engines = one(objects, "StatefulSet", "engine")
    service = one(objects, "Service", engines["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None", "stable pod names need a headless Service"
    assert selected_workloads(objects, service["spec"]["selector"]) == {"engine"}
    (port,) = service["spec"]["ports"]

    (gateway,) = containers(one(objects, "Deployment", "gateway"))
    (config_ref,) = gateway["envFrom"]
    config = one(objects, "ConfigMap", config_ref["configMapRef"]["name"])
    urls = config["data"]["STEERGATE_ENGINE_URLS"].split(",")
    expected = [
        f"http://engine-{i}.{service['metadata']['name']}:{port['port']}"
        for i in range(engines["spec"]["replicas"])
    ]
    assert urls == expected


def test_nvidia_overlay_requests_gpus(rendered: dict[str, list[Obj]]) -> None:
    engines = one(rendered["nvidia"], "StatefulSet", "engine")
    (engine,) = containers(engines)
    assert engine["image"].startswith("steergate/engine-gpu:")
    assert int(engine["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    pod = engines["spec"]["template"]["spec"]
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["nodeSelector"]


@pytest.mark.parametrize("overlay", ["cpu", "trial"])
def test_cpu_overlays_run_the_cpu_image_without_gpus(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    (engine,) = containers(one(rendered[overlay], "StatefulSet", "engine"))
    assert engine["image"].startswith("steergate/engine-cpu:")
    assert "nvidia.com/gpu" not in str(engine["resources"])


def test_trial_redis_keeps_an_append_only_file(rendered: dict[str, list[Obj]]) -> None:
    redis = one(rendered["trial"], "StatefulSet", "redis")
    (c,) = containers(redis)
    args = " ".join(c["args"])
    assert "--appendonly yes" in args and "--maxmemory-policy noeviction" in args
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": "/data"} in c["volumeMounts"]
    assert "--dir /data" in args
    # The external-Redis overlays ship no Redis of their own.
    for overlay in ("cpu", "nvidia"):
        assert not find(rendered[overlay], "StatefulSet", "redis")


def test_rendering_without_secrets_env_fails(tmp_path: Path) -> None:
    result = kustomize(copy_tree(tmp_path) / "overlays" / "cpu")
    assert result.returncode != 0
    assert "secrets.env" in result.stderr


def test_no_secret_values_are_committed() -> None:
    assert "secrets.env" in (K8S / ".gitignore").read_text().split()
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "Secret":
                pytest.fail(f"{path}: Secrets come from secrets.env, not from a manifest")
    example = (K8S / "base" / "secrets.env.example").read_text()
    entries = dict(
        line.split("=", 1) for line in example.splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert set(entries) == set(SECRET_KEYS)
    assert all(value == "" for value in entries.values()), entries
