"""Every Lua script of ``steergate/gateway/store/lua/``, loaded one way, called with
named arguments.

:class:`Scripts` registers each ``lua/<name>.lua`` once per client
(``register_script``: EVALSHA, reloaded on NOSCRIPT, so scripts survive a Redis
restart without gateway code knowing about it). A call is one typed *builder* per
script: a frozen dataclass of keyword-only fields whose ``keys()`` and ``argv()`` put
them in the order the script's header comment lists as KEYS and ARGV, so no call site
counts positions::

    await scripts.run(DropVector(tenant_id=tenant.id, name=name))

``tests/gateway/store/test_scripts.py`` pins each builder's order and checks that every
``.lua`` file has exactly one builder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, ClassVar, Protocol

from redis.exceptions import NoScriptError

from steergate.gateway.store import key_names
from steergate.gateway.store.connection import Redis

LUA_DIR = Path(__file__).resolve().parent / "lua"


@cache
def lua_source(name: str) -> str:
    """The text of ``gateway/lua/<name>.lua`` (read once per process)."""
    return (LUA_DIR / f"{name}.lua").read_text()


class LuaCall(Protocol):
    """One call of one script: which, and its KEYS and ARGV in the script's order."""

    script: ClassVar[str]

    def keys(self) -> Sequence[str]: ...

    def argv(self) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class _LatchCall:
    """A script over the tenant's latch ledger: KEYS ``keys.latch_keys``."""

    tenant_id: str

    def keys(self) -> Sequence[str]:
        return key_names.latch_keys(self.tenant_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class _VectorCall:
    """A script over the tenant's vectors: KEYS ``keys.vector_keys``."""

    tenant_id: str

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
class AdmitRequest:
    """admit_request.lua: the whole admission decision of one request."""

    script: ClassVar[str] = "admit_request"
    tenant_id: str
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
class SettleRequest:
    """settle_request.lua: account one finished (or cancelled) request."""

    script: ClassVar[str] = "settle_request"
    tenant_id: str
    now_ms: int
    lease_id: str
    tpm: int
    #: Actual tokens minus the reservation (0 when the usage is unknown).
    token_delta: int
    status_class: str  # "2xx" | "4xx" | "429" | "5xx" | ""
    tokens_used: int
    conversation_id: str  # "" = none
    latch_action: str  # "" | "keep" | "drop" | "restore"
    prev_latch: str
    #: The lease's expiry (ms) when this settles a cancelled admission, else 0.
    cancel_expiry_ms: int
    prompt_tokens: int
    completion_tokens: int
    key_id: str  # "" = none

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
        ]


@dataclass(frozen=True, kw_only=True, slots=True)
class RenewLeases:
    """renew_leases.lua: the heartbeat of one tenant's running requests."""

    script: ClassVar[str] = "renew_leases"
    tenant_id: str
    now_ms: int
    expiry_ms: int
    lease_ids: Sequence[str]
    #: Conversations whose latch a live request is storing.
    storing: Sequence[str] = ()

    def keys(self) -> Sequence[str]:
        t = self.tenant_id
        return [key_names.leases(t), key_names.latches(t), key_names.latch_info(t)]

    def argv(self) -> list[Any]:
        return [self.now_ms, self.expiry_ms, len(self.lease_ids), *self.lease_ids, *self.storing]


# -- latches and vectors -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class KeepLatch(_LatchCall):
    """keep_latch.lua: record the latch an engine has just stored."""

    script: ClassVar[str] = "keep_latch"
    conversation_id: str
    info: str  # "bytes:kind:digest"
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
    CasTenant,
    TakeKey,
    CasKey,
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
    cas_tenant: Any
    take_key: Any
    cas_key: Any
    record_key_use: Any

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        return cls(**{c.script: redis.register_script(lua_source(c.script)) for c in CALLS})

    async def run(self, call: LuaCall) -> Any:
        """One EVALSHA of ``call``'s script with its KEYS and ARGV."""
        return await evalsha(getattr(self, call.script), call.keys(), call.argv())


async def evalsha(script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Run ``script`` with one EVALSHA on its own client, reloading it on NOSCRIPT.

    The same as calling the Script object, minus its per-call overhead (an import and
    an ``isinstance`` check against a typing Protocol, ~20 us): this is the hot path's
    only Redis round trip."""
    client = script.registered_client
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        script.sha = await client.script_load(script.script)
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
