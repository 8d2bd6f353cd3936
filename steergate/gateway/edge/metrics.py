"""Prometheus metrics: one registry per app, never a process-global one.

Two kinds of series live here:

* **events** — counters and a latency histogram, observed by
  :class:`steergate.gateway.edge.metrics_middleware.MetricsMiddleware` as each authenticated request
  finishes: status code, duration (for streams, until the last chunk), the
  ``x-steering-latch`` header and, for a 429, the error code in its body.
  Observing at the ASGI edge means the request path needs no metrics calls, and
  sees exactly what the client saw;
* **state** — quota use, tokens, the store's and the engines' health. These are
  read fresh on every scrape (``GET /metrics`` builds a :class:`Snapshot` first) and
  emitted by a custom collector, so a deleted tenant or engine disappears from the
  next scrape instead of lingering as a stale gauge.

``gateway.app.create_app`` creates one :class:`Metrics` per app, adds the middleware
(``steergate/gateway/edge/metrics_middleware.py``) and the ``/metrics`` route
(``steergate/gateway/routes/metrics.py``); both import this module, which imports neither.

Every per-tenant label is the tenant id; API keys, key ids and conversation ids
never become label values (they are secrets or unbounded).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: LLM requests take from milliseconds (errors, cache hits) to minutes (long streams).
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

#: Time to first token: from tens of milliseconds (a warm engine) to tens of seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Quota names, shared with ``/v1/usage`` (``quotas.<name>``) and the dashboard.
QUOTA_NAMES = (
    "requests_per_minute",
    "tokens_per_minute",
    "concurrency",
    "latch_count",
    "latch_bytes",
    "vector_count",
    "vector_bytes",
)

#: Engine status fields that are monotonically increasing counters on the engine.
ENGINE_COUNTERS = {
    "evictions": (
        "steergate_engine_latch_evictions",
        "Latches the engine evicted (LRU over a cap).",
    ),
    "refusals": (
        "steergate_engine_latch_refusals",
        "Latches the engine refused as larger than its byte cap.",
    ),
    "bridges": ("steergate_engine_latch_bridges", "Turns the engine steered from a stored latch."),
    "latches_stored": ("steergate_engine_latches_stored", "Latches the engine stored."),
}
ENGINE_GAUGES = {
    "latched_conversations": (
        "steergate_engine_latched_conversations",
        "Latches held by the engine now.",
    ),
    "latched_bytes": ("steergate_engine_latched_bytes", "Bytes of latches held by the engine now."),
    "max_latched_conversations": (
        "steergate_engine_max_latched_conversations",
        "The engine's latch count cap.",
    ),
    "max_latched_bytes": ("steergate_engine_max_latched_bytes", "The engine's latch byte cap."),
}


@dataclass(frozen=True)
class QuotaSample:
    used: float
    limit: float


@dataclass(frozen=True)
class EngineSample:
    """One engine as seen at scrape time; ``status`` is its /v1/steering/status body."""

    url: str
    up: bool
    status: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class TenantSample:
    quotas: dict[str, QuotaSample]
    tokens_total: int = 0


@dataclass(frozen=True)
class Snapshot:
    """State read at scrape time. ``store_up=False`` means tenants could not be read."""

    store_up: bool = True
    store_ping_s: float | None = None
    tenants: dict[str, TenantSample] = field(default_factory=dict)
    engines: tuple[EngineSample, ...] = ()


class _SnapshotCollector(Collector):
    """Emits the latest :class:`Snapshot`; set by :meth:`Metrics.render` just before
    serialisation (one scrape at a time per app, see ``render``)."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        yield _gauge(
            "steergate_store_up",
            "1 if the Redis store answered the scrape's ping.",
            [([], 1.0 if snap.store_up else 0.0)],
        )
        if snap.store_ping_s is not None:
            yield _gauge(
                "steergate_store_ping_seconds",
                "Round trip of the scrape's Redis ping.",
                [([], snap.store_ping_s)],
            )
        yield _gauge("steergate_tenants", "Tenants configured.", [([], float(len(snap.tenants)))])
        limit = GaugeMetricFamily(
            "steergate_quota_limit", "A tenant's configured limit.", labels=["tenant", "quota"]
        )
        used = GaugeMetricFamily(
            "steergate_quota_used", "A tenant's current use of a quota.", labels=["tenant", "quota"]
        )
        tokens = CounterMetricFamily(
            "steergate_tokens",
            "Tokens (prompt + completion) charged to a tenant, all replicas.",
            labels=["tenant"],
        )
        for tenant_id, sample in sorted(snap.tenants.items()):
            for quota, q in sample.quotas.items():
                limit.add_metric([tenant_id, quota], q.limit)
                used.add_metric([tenant_id, quota], q.used)
            tokens.add_metric([tenant_id], sample.tokens_total)
        yield limit
        yield used
        yield tokens
        yield _gauge(
            "steergate_engine_up",
            "1 if the engine answered /v1/steering/status.",
            [([e.url], 1.0 if e.up else 0.0) for e in snap.engines],
            ["engine"],
        )
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield _gauge(name, doc, _engine_values(snap.engines, key), ["engine"])
        for key, (name, doc) in ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["engine"])
            for labels, value in _engine_values(snap.engines, key):
                family.add_metric(labels, value)
            yield family


def _gauge(
    name: str, doc: str, samples: Iterable[tuple[list[str], float]], labels: list[str] | None = None
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels or [])
    for label_values, value in samples:
        family.add_metric(label_values, value)
    return family


def _engine_values(engines: Iterable[EngineSample], key: str) -> list[tuple[list[str], float]]:
    return [([e.url], float(e.status[key])) for e in engines if e.up and key in e.status]


class _WithoutCreated:
    """The registry minus the ``*_created`` timestamp samples prometheus-client adds
    to every counter child: noise for dashboards, and a global switch would be the
    process-wide state this module avoids."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class Metrics:
    """The gateway's metrics. Create one per app (in ``create_app`` or the lifespan)
    and keep it on ``app.state.metrics``; tests create as many as they like."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "steergate_requests",
            "Requests answered, by tenant, route and HTTP status code.",
            ["tenant", "route", "code"],
            registry=self.registry,
        )
        self.rejections = Counter(
            "steergate_rejections",
            "429 answers by tenant and cause (the error code).",
            ["tenant", "cause"],
            registry=self.registry,
        )
        self.latch_events = Counter(
            "steergate_latch_events",
            "Inference answers by tenant and x-steering-latch state.",
            ["tenant", "state"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "steergate_request_duration_seconds",
            "Time from request received to response finished (streams: last chunk sent).",
            ["tenant", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "steergate_prompt_tokens",
            "Prompt tokens billed, by tenant (settled requests; see docs/api.md usage export).",
            ["tenant"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "steergate_completion_tokens",
            "Completion tokens billed, by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.capture_bytes = Counter(
            "steergate_capture_bytes",
            "Activation-capture float32 bytes answered (before base64), by tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "steergate_time_to_first_token_seconds",
            "Streams: time from request received to the first event relayed to the client.",
            ["tenant", "route"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._state = _SnapshotCollector()
        self.registry.register(self._state)
        # Label tuples seen per tenant, so a deleted tenant's series can be removed.
        self._seen: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
        # Children by label tuple: ``labels()`` costs a lock and a few allocations,
        # which every request would pay again. Cleared per tenant by forget_tenant.
        self._children: dict[tuple[str, tuple[str, ...]], Any] = {}

    # -- called by MetricsMiddleware ----------------------------------------------

    def observe_request(
        self, tenant_id: str, route: str, status: int, seconds: float | None
    ) -> None:
        """One answered request. ``route`` is the route template
        (``/v1/steering/latches/{conversation_id}``), never a path with ids in it.
        ``seconds`` is None when the response never finished (client gone, stream
        broken): counted, but kept out of the latency histogram."""
        self._child("requests", (tenant_id, route, str(status))).inc()
        if seconds is not None:
            self._child("latency", (tenant_id, route)).observe(max(0.0, seconds))

    def observe_first_token(self, tenant_id: str, route: str, seconds: float) -> None:
        """A stream's first relayed event, ``seconds`` after its request arrived."""
        self._child("ttft", (tenant_id, route)).observe(max(0.0, seconds))

    def observe_outcome(self, outcome: Any) -> None:
        """A settled request (``accounting.Outcome``): its prompt and completion tokens."""
        if outcome.cancelled:
            return
        prompt, completion = outcome.split()
        tenant_id = outcome.admission.tenant.id
        if prompt:
            self._child("prompt_tokens", (tenant_id,)).inc(prompt)
        if completion:
            self._child("completion_tokens", (tenant_id,)).inc(completion)

    def observe_capture(self, tenant_id: str, nbytes: int) -> None:
        """An answer's ``capture`` object: its float32 bytes (a zero-row capture still
        makes the tenant's series appear)."""
        self._child("capture_bytes", (tenant_id,)).inc(max(0, nbytes))

    def observe_rejection(self, tenant_id: str, cause: str) -> None:
        """One 429; ``cause`` is its error code (``rate_limit_exceeded``, ...)."""
        self._child("rejections", (tenant_id, cause)).inc()

    def observe_latch(self, tenant_id: str, state: str) -> None:
        """The ``x-steering-latch`` state of one inference answer."""
        self._child("latch_events", (tenant_id, state)).inc()

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop a deleted tenant's event series (ids may be reused later)."""
        for attr, labels in self._seen.pop(tenant_id, set()):
            self._children.pop((attr, labels), None)
            metric = getattr(self, attr)
            try:
                metric.remove(*labels)
            except KeyError:
                pass

    def _child(self, attr: str, labels: tuple[str, ...]) -> Any:
        """The metric child for ``labels`` (labels[0] is the tenant id), cached."""
        child = self._children.get((attr, labels))
        if child is None:
            self._seen.setdefault(labels[0], set()).add((attr, labels))
            child = self._children[(attr, labels)] = getattr(self, attr).labels(*labels)
        return child

    # -- called by GET /metrics ----------------------------------------------------

    def render(self, snapshot: Snapshot) -> bytes:
        """The Prometheus text for this registry with ``snapshot`` as the state.

        Synchronous from setting the snapshot to serialising it, so on one event
        loop two concurrent scrapes cannot interleave their snapshots."""
        self._state.snapshot = snapshot
        return generate_latest(_WithoutCreated(self.registry))
