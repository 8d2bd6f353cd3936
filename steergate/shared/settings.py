"""Settings, one pydantic-settings class per component.

Environment names are fixed by the contract; ``REDIS_URL`` is the only one
without the ``STEERGATE_`` prefix. CLI flags override by passing keyword values.
"""

from __future__ import annotations

import argparse
import re
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from steergate.shared.clamp import DEFAULT_MAX_CLAMPS_PER_SITE
from steergate.shared.engine_api import (
    DEFAULT_MAX_LATCHED_BYTES,
    DEFAULT_MAX_LATCHED_CONVERSATIONS,
    DEFAULT_MAX_VECTOR_BYTES,
    DEFAULT_MAX_VECTORS,
)

#: What REDIS_URL may start with (``steergate/gateway/store/connection.py`` connects each).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")


def display_url(url: str) -> str:
    """A URL as logs, errors, admin pages and metric labels may show it: no
    ``user:password@`` part, no query (``?password=`` is how a ``unix://`` Redis URL
    gives its password) and no fragment. Found from outside: ``steergate up`` printed a
    query's password, and a refused engine URL was quoted whole."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else netloc + parts.path


#: Query parameters REDIS_URL may carry; every other one is refused at start-up. redis-py
#: passes any name on to the connection, which then raised TypeError on the first command
#: (a 500 on every request), and ``socket_timeout`` & co. would replace the bound
#: ``STEERGATE_REDIS_TIMEOUT_S`` sets. The TLS ones need ``rediss://``.
REDIS_QUERY = frozenset({"db", "username", "password", "client_name"})
REDIS_TLS_QUERY = frozenset({
    "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
    "ssl_check_hostname", "ssl_min_version",
})
CERT_REQS = ("none", "optional", "required")
_QUERY_NAME = re.compile(r"[A-Za-z_]{1,40}")


def _redis_query_problem(url: str, scheme: str) -> str | None:
    """What REDIS_URL's query would make fail later. Names a parameter only when it looks
    like one (a name, then ``=``), so text typed in its place is never quoted; never
    quotes a value."""
    allowed = REDIS_QUERY | REDIS_TLS_QUERY if scheme.startswith("rediss") else REDIS_QUERY
    if "cluster" in scheme:
        allowed -= {"db"}  # a Redis Cluster has database 0 only
    query = urlsplit(url).query
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "ssl_cert_reqs" and name in allowed and value not in CERT_REQS:
            return f"its query parameter 'ssl_cert_reqs' is one of {', '.join(CERT_REQS)}"
        if name in allowed:
            continue
        named = _QUERY_NAME.fullmatch(name) and f"{name}=" in query
        which = f"its query parameter {name!r}" if named else "one of its query parameters"
        if name in REDIS_TLS_QUERY:
            return f"{which} needs a rediss:// URL"
        return f"{which} is not one the gateway takes (it takes {', '.join(sorted(allowed))})"
    from redis.connection import parse_url  # checks db's value and the TLS flags'

    try:
        parse_url(url.replace("+cluster", "", 1))
    except ValueError as exc:
        name = re.search(r"'([A-Za-z_]{1,40})'", str(exc))
        return f"its query parameter {name.group(1)!r} has an invalid value" if name else (
            "its query has an invalid value")
    return None


def _redis_url_problem(url: str) -> str | None:
    """What the Redis client would refuse only when it first connects (a traceback after
    start-up), or read silently otherwise (a database path that is not a number meant
    database 0). Found from outside. Never quotes the URL: it may hold a password."""
    parts = urlsplit(url)
    if parts.scheme == "unix":  # a socket path; its database is a query parameter
        return _redis_query_problem(url, parts.scheme)
    try:
        port = parts.port
    except ValueError:
        return "its port is not a number from 1 to 65535"
    if port == 0:
        return "its port is not a number from 1 to 65535"
    path = parts.path.strip("/")
    if path and not (path.isascii() and path.isdigit()):
        return "its path is a database index: a number (or nothing, for database 0)"
    if path and "cluster" in parts.scheme and int(path) != 0:
        return "a Redis Cluster has database 0 only"
    return _redis_query_problem(url, parts.scheme)


class EngineSettings(BaseSettings):
    """Read by the engine's plugins inside vLLM's API-server process."""

    # No inf/nan anywhere: an infinite timeout passed validation (gt=0), then overflowed
    # int() on the first request (500) or at start.
    model_config = SettingsConfigDict(env_prefix="STEERGATE_", extra="ignore", allow_inf_nan=False)

    engine_token: SecretStr | None = Field(
        default=None,
        description="Shared secret every engine route requires (Authorization: Bearer).",
    )
    max_latched_conversations: int = Field(
        default=DEFAULT_MAX_LATCHED_CONVERSATIONS, ge=0, description="Latch controller count cap."
    )
    max_latched_bytes: int = Field(
        default=DEFAULT_MAX_LATCHED_BYTES, ge=0, description="Latch controller byte cap."
    )
    max_vectors: int = Field(
        default=DEFAULT_MAX_VECTORS,
        ge=1,
        description="Vector registry count cap (least recently used evicted; the gateway "
        "reinstalls from Redis on demand).",
    )
    max_vector_bytes: int = Field(
        default=DEFAULT_MAX_VECTOR_BYTES, ge=1, description="Vector registry byte cap."
    )
    max_clamps_per_site: int = Field(
        default=DEFAULT_MAX_CLAMPS_PER_SITE,
        ge=0,
        le=64,
        description="Clamp/ablate directions per point of the residual stream (each costs "
        "a [slots, hidden] float32 table per point); more in one request: 400.",
    )
    cuda_compiled_steer: Literal["kernel", "inductor"] = Field(
        default="kernel",
        description="In graphs vLLM compiles on CUDA, each steering site is `kernel` (one "
        "fused Triton launch; cheaper for 1-token decode steps) or `inductor` (the torch "
        "body traced for Inductor to fuse; cheaper from 16 tokens). See docs/benchmarks.md.",
    )
    steering: Literal["on", "off"] = Field(
        default="on",
        description=(
            "`off` serves an architecture without a verified steering convention unsteered "
            "(requests that steer get 501); `on` refuses to start on one."
        ),
    )


    @field_validator("engine_token")
    @classmethod
    def _strip_token(cls, v: SecretStr | None) -> SecretStr | None:
        return strip_secret(v)

class GatewaySettings(BaseSettings):
    # No inf/nan anywhere: an infinite timeout passed validation (gt=0), then overflowed
    # int() on the first request (500) or at start.
    model_config = SettingsConfigDict(env_prefix="STEERGATE_", extra="ignore", allow_inf_nan=False)

    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "redis_url"),
        description=(
            "redis://, rediss://, unix:// or redis+cluster:// (rediss+cluster:// with "
            "TLS); unset means the embedded single-process store."
        ),
    )
    engine_urls: str = Field(
        default="http://127.0.0.1:8100", description="Comma-separated engine base URLs."
    )
    engine_token: SecretStr | None = Field(
        default=None, description="Secret presented to the engines."
    )
    admin_key: SecretStr | None = Field(default=None, description="Bootstrap admin key.")
    metrics_token: SecretStr | None = Field(
        default=None,
        description=(
            "Scrape-only credential for GET /metrics (Authorization: Bearer); "
            "unset: /metrics takes the admin key only."
        ),
        json_schema_extra={"required_outside_up": False},
    )
    key_pepper: SecretStr | None = Field(
        default=None, description="Server-side secret mixed into API-key hashes."
    )
    max_body_bytes: int = Field(
        default=8388608, ge=1024, description="Larger request bodies get 413."
    )
    max_inline_floats_per_request: int = Field(
        default=65536,
        ge=1,
        description="Numbers one request's `steering` may carry as JSON arrays (8 layers of "
        "hidden size 8192); more: 400 steering_too_large, send `packed` or a named vector.",
    )
    max_inline_floats_per_term: int = Field(
        default=32768,
        ge=1,
        description="Numbers one `steering.vectors[]` term may carry as JSON arrays "
        "(4 layers of hidden size 8192).",
    )
    examples_memory_bytes: int = Field(
        default=2 * 1024**3,
        ge=1,
        description="Bytes of captured activations `from-examples` jobs may hold at once, "
        "gateway-wide (examples x layers x hidden size x 4 each; one job per tenant at a "
        "time): a job larger than this is 400 examples_too_large, one that would pass it "
        "with other tenants' jobs 503 gateway_busy.",
    )
    body_parse_workers: int = Field(
        default=2,
        ge=0,
        le=64,
        description="Worker processes that parse and validate request bodies over 256 KiB, "
        "off the process serving other tenants; 0: on its event loop (docs/gateway.md).",
    )
    host: str = Field(default="127.0.0.1", min_length=1, description="Address the gateway binds.")
    port: int = Field(default=8080, ge=1, le=65535, description="Port the gateway binds.")
    rate_limit_fail_open: bool = Field(
        default=False,
        description=(
            "Admit requests unmetered when Redis is unreachable (default: fail closed with 503)."
        ),
    )
    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Per-command Redis timeout: past it, 503 store_unavailable "
        "(chosen from bench/redis_timeout.py; docs/operations.md).",
    )
    redis_health_check_interval_s: float = Field(
        default=5.0,
        ge=0,
        description="A pooled Redis connection idle this long is PINGed before use "
        "(and replaced if dead); 0 turns it off.",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        ge=3,
        description="Concurrency lease lifetime; renewed while the request runs, so it "
        "bounds only how long a lease outlives a dead gateway or a lost admission.",
    )
    settle_interval_s: float = Field(
        default=0.002,
        ge=0,
        le=5,
        description="How long finished requests' settlements gather before one pipeline "
        "writes them to Redis. Longer: fewer, larger writes and later usage figures; a "
        "finished request's concurrency slot is free at its tenant's next admission anyway.",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Connections that send no complete request head within this are closed.",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="A request body must be complete within this many seconds of its head "
        "(else 408 request_timeout and the connection closes).",
    )
    engine_connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Engine connect timeout."
    )
    engine_read_timeout_s: float = Field(
        default=600.0, gt=0, description="Engine read timeout (504 past it)."
    )
    reconcile_interval_s: float = Field(
        default=5.0, gt=0, description="How often the engines are polled (health, restarts)."
    )
    refuse_overcommit: bool = Field(
        default=False,
        description="Refuse (409) tenant limits whose Σ latch quotas exceed the engine caps, "
        "unless the tenant sets allow_overcommit. Off: overcommit costs latch restores, "
        "never latches.",
    )
    engine_sync_interval_s: float = Field(
        default=30.0,
        gt=0,
        description="How often every engine's cache is checked against Redis (stale entries "
        "deleted); a dirty engine is synced at the next poll.",
    )

    @field_validator("engine_urls")
    @classmethod
    def _strip(cls, v: str) -> str:
        urls: list[str] = []
        for url in (u.strip().rstrip("/") for u in v.split(",") if u.strip()):
            check_engine_url(url)
            if url not in urls:  # one engine named twice is one engine
                urls.append(url)
        if not urls:
            raise ValueError("STEERGATE_ENGINE_URLS must name at least one engine")
        return ",".join(urls)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        # Set but empty (a blank secret in a deployment) is not "unset": each replica
        # would quietly keep its own in-process tenants and limits.
        if v is not None and not v.strip():
            raise ValueError(
                "REDIS_URL is set but empty; unset it for the embedded single-process "
                "store, or give redis://, rediss:// or redis+cluster://"
            )
        if v is not None and not v.strip().startswith(REDIS_SCHEMES):
            # Else the client refused it at start-up, as a traceback (found from outside).
            scheme = v.strip().partition("://")[0] if "://" in v else "none"
            raise ValueError(
                f"must start with one of {', '.join(REDIS_SCHEMES)} "
                f"(its scheme is {scheme[:20]!r})"
            )
        problem = _redis_url_problem(v.strip()) if v is not None else None
        if problem is not None:
            raise ValueError(problem)
        return v.strip() if v is not None else None

    @field_validator("admin_key", "engine_token", "metrics_token")
    @classmethod
    def _strip_secret(cls, v: SecretStr | None) -> SecretStr | None:
        # The pepper is left as it is: it is hashed into every stored key.
        return strip_secret(v)

    @property
    def engine_url_list(self) -> list[str]:
        return self.engine_urls.split(",")


def strip_secret(v: SecretStr | None) -> SecretStr | None:
    """A bearer secret without surrounding whitespace (one read from a file keeps its
    trailing newline, which no client sends: every admin call was 401); blank is unset."""
    if v is None:
        return None
    value = v.get_secret_value().strip()
    return SecretStr(value) if value else None


def check_engine_url(url: str) -> None:
    """An engine base URL: http(s), a host, a port in range (else every request would
    fail later, as a 500)."""
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        raise ValueError(f"not an engine URL: {display_url(url)!r} ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an engine URL: {display_url(url)!r} (expected http://host:port)")
    if port == 0:
        raise ValueError(f"not an engine URL: {display_url(url)!r} (port 0)")


def port_argument(text: str) -> int:
    """A ``--port`` flag's value (argparse ``type=``): a flag's fault is named as the flag,
    not as the STEERGATE_PORT it stands in for."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"not a port: {text!r} (1-65535)")
    return port


def settings_error(exc: ValidationError, settings: type[BaseSettings]) -> str:
    """One line per invalid setting, named as it is set (the environment variable)."""
    prefix = str(settings.model_config.get("env_prefix", ""))
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        # a field read through its alias (REDIS_URL) is reported by that alias
        name = (prefix + field).upper() if field in settings.model_fields else field.upper()
        message = str(err["msg"]).removeprefix("Value error, ")
        lines.append(f"{name}: {message}")
    return "; ".join(lines)
