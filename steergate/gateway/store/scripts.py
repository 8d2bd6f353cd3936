"""Every Lua script of ``steergate/gateway/store/lua/``, loaded one way, called with
named arguments.

:class:`Scripts` registers each ``lua/<name>.lua`` once per client
(``register_script``: EVALSHA, reloaded on NOSCRIPT, so scripts survive a Redis
restart without gateway code knowing about it). A call is one typed *builder* per
script: a frozen dataclass of keyword-only fields whose ``keys()`` and ``argv()`` put
them in the order the script's header comment lists as KEYS and ARGV, so no call site
counts positions::

    await scripts.run(DropVector(tenant_id=tenant.id, generation=tenant.created_at, name=name))

A script that writes a tenant's state is a :class:`TenantCall`: it names the tenant's
generation (``Tenant.created_at``) as the request authenticated it, and runs behind
``lua/prelude/tenant_generation.lua``, which refuses it (:class:`TenantGone`, nothing
written) once that tenant is deleted, even if a tenant of the same id exists again.

A script may also name *preludes* (``lua/prelude/``): Lua put before its own text, so
a rule that several scripts apply is written once. ``budget_hold.lua`` is the one rule of
a token budget's held sum, for every script that adds or removes leases.

``tests/gateway/store/test_scripts.py`` pins each builder's order and checks that every
``.lua`` file has exactly one builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Protocol

from redis.exceptions import NoScriptError, ResponseError

from steergate.gateway.store import key_names
from steergate.gateway.store.connection import Redis
from steergate.shared.errors import APIError

LUA_DIR = Path(__file__).resolve().parent / "lua"
#: Put before every :class:`TenantCall`'s script: the tenant generation check.
TENANT_GENERATION = "prelude/tenant_generation"
#: The token budget's held sum (``held_by``, ``release_held``, ``sweep_leases``): named
#: in ``preludes`` by every script that adds or removes leases.
BUDGET_HOLD = "prelude/budget_hold"
#: The error a refused :class:`TenantCall` answers (the prelude's ``error_reply``).
TENANT_GONE = "TENANT_GONE"


@cache
def lua_source(name: str) -> str:
    """The text of ``gateway/lua/<name>.lua`` (read once per process)."""
    return (LUA_DIR / f"{name}.lua").read_text()


class LuaCall(Protocol):
    """One call of one script: which, and its KEYS and ARGV in the script's order. A
    builder may name ``preludes: ClassVar[tuple[str, ...]]``, put before its script
    (:func:`script_text`)."""

    script: ClassVar[str]

    def keys(self) -> Sequence[str]: ...

    def argv(self) -> list[Any]: ...


class TenantGone(APIError):
    """A :class:`TenantCall` refused: the tenant that authenticated the request was
    deleted while it ran (nothing was written). To its caller the key no longer exists:
    401 ``invalid_api_key``."""

    def __init__(self) -> None:
        super().__init__("invalid_api_key", "Incorrect API key: its tenant no longer exists.")


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantCall:
    """A script that writes a tenant's state. ``generation``: the tenant's
    ``created_at`` as the caller's request authenticated it. :func:`wire` adds the
    tenant record to its KEYS and the generation to its ARGV, last, for the prelude."""

    tenant_id: str
    generation: float


def wire(call: LuaCall) -> tuple[Sequence[str], list[Any]]:
    """The KEYS and ARGV one EVALSHA of ``call`` sends: its own, and for a
    :class:`TenantCall` the prelude's two after them."""
    if isinstance(call, TenantCall):
        return (
            [*call.keys(), key_names.tenant_record(call.tenant_id)],
            [*call.argv(), call.generation],
        )
    return call.keys(), call.argv()


def tenant_gone(exc: BaseException) -> bool:
    """Whether a script's error is the prelude's refusal."""
    return isinstance(exc, TenantGone) or (
        isinstance(exc, ResponseError) and str(exc).startswith(TENANT_GONE)
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _LatchCall(TenantCall):
    """A script over the tenant's latch ledger: KEYS ``keys.latch_keys``."""

    def keys(self) -> Sequence[str]:
        return key_names.latch_keys(self.tenant_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class _VectorCall(TenantCall):
    """A script over the tenant's vectors: KEYS ``keys.vector_keys``."""

    def keys(self) -> Sequence[str]:
        return key_names.vector_keys(self.tenant_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class _KeyRecordCall:
    """A script over the tenant's API keys: KEYS the key hash, then its last-use hash."""

    tenant_id: str

    def keys(self) -> Sequence[str]:
        return [key_names.tenant_keys(self.tenant_id), key_names.key_last_used(self.tenant_id)]


# -- admission and settlement (gateway/limits.py, gateway/accounting.py) ----------------


class TokenBudget(Protocol):
    @property
    def tokens(self) -> int: ...
    @property
    def period(self) -> str: ...


class AdmissionLimits(Protocol):
    """What admission reads of a tenant's limits (tenancy/records.py ``Limits`` has
    it): a structural type, so the store floor imports no tenancy model."""

    @property
    def rpm(self) -> int: ...
    @property
    def tpm(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def latch_count(self) -> int: ...
    @property
    def latch_bytes(self) -> int: ...
    @property
    def latch_policy(self) -> str: ...
    @property
    def token_budget(self) -> TokenBudget | None: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmitRequest(TenantCall):
    """admit_request.lua: the whole admission decision of one request."""

    script: ClassVar[str] = "admit_request"
    preludes: ClassVar[tuple[str, ...]] = (BUDGET_HOLD,)
    now_ms: int
    #: The tenant's limits: rpm, tpm, concurrency, latch quota and policy, token budget.
    limits: AdmissionLimits
    #: Tokens reserved (already capped at ``tpm``).
    cost: int
    lease_id: str
    lease_expiry_ms: int
    conversation_id: str  # "" = none
    store_latch: bool
    latch_bytes: int
    latch_kind: str  # "value" | "ref"
    #: In Redis's clock (ms); 0 = none.
    deadline_ms: int
    pending_horizon_ms: int
    key_id: str  # "" = none
    key_rpm: int  # 0 = none
    key_concurrency: int  # 0 = none
    #: Until the token budget's period rolls over (0: no budget).
    budget_left_ms: int
    vector_names: Sequence[str] = ()
    #: Lease ids of this tenant's finished requests, released by this same call.
    finished_leases: Sequence[str] = ()

    def keys(self) -> Sequence[str]:
        return key_names.admit_keys(self.tenant_id, self.now_ms // 60000, self.key_id)

    def argv(self) -> list[Any]:
        lim, budget = self.limits, self.limits.token_budget
        return [
            self.now_ms,
            lim.rpm,
            lim.tpm,
            self.cost,
            lim.max_concurrency,
            self.lease_id,
            self.lease_expiry_ms,
            self.conversation_id,
            "1" if self.store_latch else "0",
            self.latch_bytes,
            self.latch_kind,
            lim.latch_count,
            lim.latch_bytes,
            lim.latch_policy,
            key_names.USAGE_MINUTE_TTL_S,
            self.deadline_ms,
            self.pending_horizon_ms,
            self.key_id,
            self.key_rpm,
            self.key_concurrency,
            budget.tokens if budget else 0,
            budget.period if budget else "day",
            self.budget_left_ms,
            key_names.USAGE_DAY_TTL_S,
            len(self.vector_names),
            *self.vector_names,
            len(self.finished_leases),
            *self.finished_leases,
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class SettleRequest(TenantCall):
    """settle_request.lua: account one finished (or cancelled) request."""

    script: ClassVar[str] = "settle_request"
    preludes: ClassVar[tuple[str, ...]] = (BUDGET_HOLD,)
    now_ms: int
    lease_id: str
    tpm: int
    #: Actual tokens minus the reservation (0 when the usage is unknown).
    token_delta: int
    status_class: str  # "2xx" | "4xx" | "429" | "5xx" | ""
    tokens_used: int
    conversation_id: str  # "" = none
    latch_action: str  # "" | "keep" | "record" | "drop" | "restore"
    prev_latch: str
    #: The lease's expiry (ms) when this settles a cancelled admission, else 0.
    cancel_expiry_ms: int
    prompt_tokens: int
    completion_tokens: int
    key_id: str  # "" = none
    #: The ledger entry the request's admission left (``Admission.left_latch``): a
    #: "drop" or "restore" applies only while the entry is still that one.
    left_latch: str
    latch_count_quota: int = 0
    latch_bytes_quota: int = 0
    #: "record": the ledger entry and spec that keep_latch.lua could not write.
    record_info: str = ""
    record_spec: str = ""
    #: The latches its admission evicted (``Admission.evicted_latches``): a "drop" or
    #: "restore" puts them back where they still fit the quota.
    evicted_latches: Sequence[tuple[str, str, str, str]] = ()

    def keys(self) -> Sequence[str]:
        return key_names.admit_keys(self.tenant_id, self.now_ms // 60000, self.key_id)

    def argv(self) -> list[Any]:
        return [
            self.now_ms,
            self.lease_id,
            self.tpm,
            self.token_delta,
            self.status_class,
            self.tokens_used,
            self.conversation_id,
            self.latch_action,
            self.prev_latch,
            key_names.USAGE_MINUTE_TTL_S,
            self.cancel_expiry_ms,
            self.prompt_tokens,
            self.completion_tokens,
            self.key_id,
            key_names.USAGE_DAY_TTL_S,
            self.left_latch,
            self.latch_count_quota,
            self.latch_bytes_quota,
            self.record_info,
            self.record_spec,
            *(item for latch in self.evicted_latches for item in latch),
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class RenewLeases:
    """renew_leases.lua: the heartbeat of one tenant's running requests."""

    script: ClassVar[str] = "renew_leases"
    preludes: ClassVar[tuple[str, ...]] = (BUDGET_HOLD,)
    tenant_id: str
    now_ms: int
    expiry_ms: int
    lease_ids: Sequence[str]
    #: Conversations whose latch a live request is storing.
    storing: Sequence[str] = ()

    def keys(self) -> Sequence[str]:
        t = self.tenant_id
        return [
            key_names.leases(t),
            key_names.latches(t),
            key_names.latch_info(t),
            key_names.leases_done(t),
            key_names.budget_held(t),
        ]

    def argv(self) -> list[Any]:
        return [self.now_ms, self.expiry_ms, len(self.lease_ids), *self.lease_ids, *self.storing]


# -- latches and vectors -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class KeepLatch(_LatchCall):
    """keep_latch.lua: record the latch an engine has just stored."""

    script: ClassVar[str] = "keep_latch"
    conversation_id: str
    info: str  # "bytes:kind:digest[:names]" (key_names.LatchEntry)
    spec: str

    def argv(self) -> list[Any]:
        return [self.conversation_id, self.info, self.spec]


@dataclass(frozen=True, kw_only=True, slots=True)
class DropLatch(_LatchCall):
    """drop_latch.lua: forget latches of a tenant."""

    script: ClassVar[str] = "drop_latch"
    conversation_ids: Sequence[str]

    def argv(self) -> list[Any]:
        return list(self.conversation_ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class PutVector(_VectorCall):
    """put_vector.lua: store a named vector within the tenant's quota."""

    script: ClassVar[str] = "put_vector"
    name: str
    meta: bytes | str  # JSON metadata
    nbytes: int
    count_quota: int
    bytes_quota: int
    data: bytes | str  # JSON body of the engine's vector PUT

    def argv(self) -> list[Any]:
        return [self.name, self.meta, self.nbytes, self.count_quota, self.bytes_quota, self.data]


@dataclass(frozen=True, kw_only=True, slots=True)
class DropVector(_VectorCall):
    """drop_vector.lua: forget a named vector."""

    script: ClassVar[str] = "drop_vector"
    name: str

    def argv(self) -> list[Any]:
        return [self.name]


# -- tenants -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class CreateTenant:
    """create_tenant.lua: a tenant's record where none is, over a clean slate."""

    script: ClassVar[str] = "create_tenant"
    tenant_id: str
    record: bytes | str
    #: Now, in seconds: which usage minutes, days and months an earlier tenant may have left.
    now: float

    def keys(self) -> Sequence[str]:
        return [
            key_names.tenant_record(self.tenant_id),
            *key_names.tenant_state_keys(self.tenant_id, int(self.now) // 60),
        ]

    def argv(self) -> list[Any]:
        return [self.record]


@dataclass(frozen=True, kw_only=True, slots=True)
class CasTenant:
    """cas_tenant.lua: compare-and-set a tenant's record (an update)."""

    script: ClassVar[str] = "cas_tenant"
    tenant_id: str
    expected: bytes | str
    new: bytes | str

    def keys(self) -> Sequence[str]:
        return [key_names.tenant_record(self.tenant_id)]

    def argv(self) -> list[Any]:
        return [self.expected, self.new]


# -- API keys ----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TakeKey(_KeyRecordCall):
    """take_key.lua: take an API key record out (a revocation)."""

    script: ClassVar[str] = "take_key"
    key_id: str

    def argv(self) -> list[Any]:
        return [self.key_id]


@dataclass(frozen=True, kw_only=True, slots=True)
class CasKey:
    """cas_key.lua: compare-and-set one API key record (a rotation)."""

    script: ClassVar[str] = "cas_key"
    tenant_id: str
    key_id: str
    expected: bytes | str
    new: bytes | str

    def keys(self) -> Sequence[str]:
        return [key_names.tenant_keys(self.tenant_id)]

    def argv(self) -> list[Any]:
        return [self.key_id, self.expected, self.new]


@dataclass(frozen=True, kw_only=True, slots=True)
class AddKey(TenantCall):
    """add_key.lua: add a new API key's record to its tenant."""

    script: ClassVar[str] = "add_key"
    key_id: str
    record: bytes | str

    def keys(self) -> Sequence[str]:
        return [key_names.tenant_keys(self.tenant_id)]

    def argv(self) -> list[Any]:
        return [self.key_id, self.record]


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordKeyUse(_KeyRecordCall):
    """record_key_use.lua: the last-use times of a tenant's keys, one replica's batch."""

    script: ClassVar[str] = "record_key_use"
    #: (key id, unix seconds) pairs.
    uses: Sequence[tuple[str, float]] = ()

    def argv(self) -> list[Any]:
        return [v for key_id, used in self.uses for v in (key_id, f"{used:.3f}")]


#: Every builder, one per ``gateway/lua/*.lua``.
CALLS: tuple[type[LuaCall], ...] = (
    AdmitRequest,
    SettleRequest,
    RenewLeases,
    KeepLatch,
    DropLatch,
    PutVector,
    DropVector,
    CreateTenant,
    CasTenant,
    TakeKey,
    CasKey,
    AddKey,
    RecordKeyUse,
)


@dataclass(frozen=True)
class Scripts:
    """Every script, registered on one client. ``run(call)`` is the way to call one;
    the registered objects (``.sha``, ``.script``) are there for a pipeline."""

    admit_request: Any
    settle_request: Any
    renew_leases: Any
    keep_latch: Any
    drop_latch: Any
    put_vector: Any
    drop_vector: Any
    create_tenant: Any
    cas_tenant: Any
    take_key: Any
    cas_key: Any
    add_key: Any
    record_key_use: Any

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        return cls(**{c.script: redis.register_script(script_text(c)) for c in CALLS})

    async def run(self, call: LuaCall) -> Any:
        """One EVALSHA of ``call``'s script with its KEYS and ARGV (:func:`wire`);
        :class:`TenantGone` if the prelude refused it."""
        return await evalsha(getattr(self, call.script), *wire(call))


def script_text(call: type[LuaCall]) -> str:
    """What is loaded for ``call``: its ``.lua`` file, behind its ``preludes``, and for a
    :class:`TenantCall` behind the tenant generation check first (it takes its KEYS and
    ARGV off before anything else reads them)."""
    guard = (TENANT_GENERATION,) if issubclass(call, TenantCall) else ()
    parts = (*guard, *getattr(call, "preludes", ()), call.script)
    return "\n".join(lua_source(name) for name in parts)


async def evalsha(script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Run ``script`` with one EVALSHA on its own client, reloading it on NOSCRIPT.

    The same as calling the Script object, minus its per-call overhead (an import and
    an ``isinstance`` check against a typing Protocol, ~20 us): this is the hot path's
    only Redis round trip."""
    client = script.registered_client
    try:
        try:
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            script.sha = await client.script_load(script.script)
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except ResponseError as exc:
        if tenant_gone(exc):
            raise TenantGone() from None
        raise
