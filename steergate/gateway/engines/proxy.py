"""Proxy: one admitted turn sent to an engine, with the engine cache filled from
Redis when the engine lacks what the turn needs.

The gateway tells the engine what Redis holds (``steergate_expect``, see
``steergate/shared/engine_api.py``): the digest of every named vector the turn uses, and the
digest of the conversation's latch ("" when Redis holds none). An engine that lacks
one of them answers 409 ``vector_missing`` / ``latch_missing`` before generating
anything; the turn then installs what is missing (vectors from Redis, the latch as a
``restore`` spec that the engine stores and bridges with: state ``restored``) and is
sent again. A turn that needs nothing restored costs no extra round trip.

An engine that cannot be connected to gets the turn's engine changed to the next one
in rendezvous order (nothing was sent, so nothing is repeated).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from steergate.gateway.admission.admitted import Admission
from steergate.gateway.admission.request_scoping import Head, Prepared
from steergate.gateway.engines.client import EngineClient, miss_code
from steergate.gateway.engines.upstream import (
    Engine,
    EngineUnreachable,
    UpstreamBroken,
    UpstreamResponse,
    UpstreamStream,
)
from steergate.gateway.store import key_names as keys
from steergate.gateway.store.connection import Redis, store_errors
from steergate.gateway.store.scripts import KeepLatch, Scripts, TenantGone
from steergate.shared.engine_api import EXPECT_FIELD, KEEP_STATES
from steergate.shared.errors import APIError
from steergate.shared.latch_spec import LatchSpec, SpecError, decode_spec
from steergate.shared.scoping import scope, unscope

log = logging.getLogger("steergate.gateway.proxy")

#: Installs per turn: a latch restore, then its vectors, then one spare.
MAX_INSTALLS = 3


@dataclass
class Replayed:
    """An answer already read (a 409 that was not a cache miss), shaped like a stream."""

    status: int
    headers: dict[str, str]
    body: bytes

    async def read(self) -> bytes:
        return self.body


@dataclass
class Turn:
    """One inference turn on an engine: picks it, fills its cache on a miss, moves on
    when it cannot be reached, and records a latch it stored."""

    engines: EngineClient
    redis: Redis
    scripts: Scripts
    adm: Admission
    head: Head
    prep: Prepared
    body: dict[str, Any]
    path: str
    engine: Engine = field(init=False)
    expect: dict[str, Any] = field(default_factory=dict)
    #: The state the client is told when the gateway, not the engine, decided it.
    state_override: str | None = None
    _spec_text: str | None = field(default=None, repr=False)
    # _spec_text decoded when the turn was admitted with a latch (None: undecodable).
    _spec: LatchSpec | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.engine = self.engines.pick(self.prep.scoped_conversation_id)
        self.expect = self._expectations()

    @property
    def tenant_id(self) -> str:
        return self.adm.tenant.id

    def _expectations(self) -> dict[str, Any]:
        if self.adm.unmetered:  # fail-open without Redis: the engine decides alone
            return {}
        expect: dict[str, Any] = {}
        vectors = {
            scope(self.tenant_id, n): self.adm.vector_digests.get(n, "") for n in self.head.names
        }
        if self.head.conversation_id and not self.head.steered:
            if not self.adm.prev_latch:
                expect["latch"] = ""  # Redis holds none: the engine must not bridge
            elif self.adm.latch_digest:
                expect["latch"] = self.adm.latch_digest
            # else: another turn is storing this latch right now; the engine bridges the
            # one it holds (the new one or the one before: either may be current).
            # What the latch's vectors hold now (a pending entry names both latches'):
            # an engine that missed a write to one installs it from Redis, then finds
            # the latch stale, or bridges with the content Redis holds; never with its
            # own old copy.
            for n, digest in self.adm.latch_vector_digests.items():
                vectors[scope(self.tenant_id, n)] = digest
        if vectors:
            expect["vectors"] = vectors
        return expect

    def content(self) -> bytes:
        if self.expect:
            self.body[EXPECT_FIELD] = self.expect
        else:  # only the gateway speaks for Redis (prescan refuses a client's)
            self.body.pop(EXPECT_FIELD, None)
        return orjson.dumps(self.body)

    def failover(self) -> bool:
        """After ``EngineUnreachable``: move to the next healthy engine, if any."""
        nxt = self.engines.pick(self.prep.scoped_conversation_id)
        if nxt is self.engine or not nxt.healthy:
            return False
        self.engine = nxt
        return True

    async def handle_miss(self, status: int, body: bytes, attempt: int) -> bool:
        """True when the engine's answer was a cache miss that is now repaired (send
        again); False when it was an ordinary answer."""
        code = miss_code(status, body)
        if code is None:
            return False
        if attempt >= MAX_INSTALLS:
            raise APIError(
                "steering_state_changed",
                "The tenant's steering state changed while this request ran; retry it.",
            )
        if code == "latch_missing":
            await self._restore_latch()
        else:
            await self._install_vectors()
        return True

    async def _load_spec(self) -> str | None:
        """The conversation's latch spec from Redis (None: it holds none), once per turn.
        A spec that is not the latch this turn was admitted with (its digest differs:
        another turn replaced the latch in between, or the stored spec was altered) is
        never installed: the engine would steer with a latch the conversation's record
        does not name, and every later turn would miss and restore it again."""
        if self._spec_text is None and self.head.conversation_id:
            async with store_errors():
                text = await self.redis.hget(
                    keys.latch_specs(self.tenant_id), self.head.conversation_id
                )
            if text is not None and self.adm.latch_digest:
                try:
                    self._spec = decode_spec(text)
                except SpecError:
                    pass  # sent as is: the engine refuses it, naming the field
                if self._spec is not None and self._spec.digest != self.adm.latch_digest:
                    raise APIError(
                        "steering_state_changed",
                        "The conversation's latch changed while this request ran; retry it.",
                    )
            self._spec_text = text
        return self._spec_text

    async def _restore_latch(self) -> None:
        spec = await self._load_spec()
        if spec is None:  # Redis no longer holds it (deleted meanwhile): none
            self.expect["latch"] = ""
            self.expect.pop("restore", None)
        else:
            self.expect["restore"] = spec

    async def _install_vectors(self) -> None:
        names = dict.fromkeys(self.head.names)
        latch_refs: set[str] = set()
        if self.head.conversation_id and not self.head.steered:
            # the vectors of the latch (or, pending, the latches) the ledger names
            for local in self.adm.latch_vector_digests:
                names[local] = None
                latch_refs.add(local)
        if self.head.conversation_id and not self.head.steered and self.adm.latch_digest:
            spec = await self._load_spec()
            if spec is not None:
                decoded = self._spec  # decoded by _load_spec (None: undecodable)
                # By-reference adds and clamps alike name vectors the engine needs.
                named = decoded.named() if decoded is not None else []
                for scoped, _ in named:
                    local = unscope(self.tenant_id, scoped)
                    if local is not None:
                        names[local] = None
                        latch_refs.add(local)
                self.expect["restore"] = spec
        if not names:
            return
        async with store_errors():
            rows = await self.redis.hmget(keys.vector_data(self.tenant_id), list(names))
        for name, data in zip(names, rows, strict=True):
            if data is None:
                if name in latch_refs and self.adm.latch_digest:
                    # The latch refers to a vector the tenant deleted: it is stale.
                    await self._drop_stale_latch()
                    return
                if name in latch_refs:
                    # Pending: a latch this engine may hold refers to it; without its
                    # copy, the engine finds that latch stale itself.
                    scoped = scope(self.tenant_id, name)
                    await self.engines.delete_engine_entry(self.engine, "vector", scoped)
                    continue
                raise self.head.unknown_vector(name)  # deleted since admission read it
            await self.engines.put_vector(self.engine, self.tenant_id, name, data.encode())

    async def _drop_stale_latch(self) -> None:
        self.expect["latch"] = ""
        self.expect.pop("restore", None)
        self.state_override = "dropped_stale"

    async def send(self) -> UpstreamResponse:
        """The turn's unary exchange, filling the engine's cache on a miss and moving to
        the next engine when one cannot be reached."""
        attempt = 0
        while True:
            try:
                r = await self.engines.complete(self.engine, self.path, self.content())
            except EngineUnreachable:
                if not self.failover():
                    raise
                continue
            if not await self.handle_miss(r.status, r.body, attempt):
                return r
            attempt += 1

    async def open_stream(self) -> tuple[Any, UpstreamStream, bytes]:
        """The turn's stream, opened once the engine holds what the turn needs (a cache
        miss is answered before any event, as a plain 409); returns (context, stream,
        content sent). A non-200 answer comes back open, for the caller to relay."""
        attempt = 0
        while True:
            content = self.content()
            cm = self.engines.stream(self.engine, self.path, content)
            try:
                up = await cm.__aenter__()
            except EngineUnreachable:
                if not self.failover():
                    raise
                continue
            if up.status != 409:
                return cm, up, content
            try:
                data = await up.read()
            except UpstreamBroken as exc:
                await cm.__aexit__(None, None, None)
                raise APIError(
                    "engine_unavailable", "The inference engine is unavailable."
                ) from exc
            await cm.__aexit__(None, None, None)
            if not await self.handle_miss(up.status, data, attempt):
                return cm, Replayed(up.status, up.headers, data), content
            attempt += 1

    async def keep_latch(self, engine_state: str | None) -> None:
        """Record the latch the engine just stored (digest and spec) before the client
        hears of it, so the conversation's next turn can restore it on any engine."""
        spec = self.prep.spec
        if spec is None or engine_state not in KEEP_STATES or not self.head.conversation_id:
            return
        names = (unscope(self.tenant_id, scoped) for scoped, _ in spec.named())
        info = str(
            keys.LatchEntry(
                spec.nbytes, spec.kind, spec.digest, tuple(dict.fromkeys(n for n in names if n))
            )
        )
        text = spec.encode()
        try:
            async with store_errors():
                orphaned = await self.scripts.run(
                    KeepLatch(
                        tenant_id=self.tenant_id,
                        generation=self.adm.tenant.created_at,
                        conversation_id=self.head.conversation_id,
                        info=info,
                        spec=text,
                    )
                )
        except TenantGone:
            orphaned = 1  # the tenant was deleted while the turn ran: nothing to keep
        except APIError:
            # The engine holds it and the ledger counts it as pending. Never fail the
            # turn for it: its settlement, retried until Redis takes it, records it.
            log.warning("could not record a latch spec (store unavailable): left to settlement")
            self.adm.unrecorded_latch = (info, text)
            return
        if int(orphaned):
            # A concurrent turn's quota eviction took it while this one ran (or its tenant
            # is gone): Redis holds no latch, so the engine's copy is never bridged; free
            # its memory.
            self.engines.forget_latches_soon(self.tenant_id, [self.head.conversation_id])


__all__ = ["MAX_INSTALLS", "Replayed", "Turn", "EngineUnreachable"]
