"""The Lua loader (steergate/gateway/store/scripts.py): one builder per script, whose
named fields land at the KEYS and ARGV positions each script's header comment documents."""

from __future__ import annotations

import dataclasses
import re

import fakeredis
import pytest

from steergate.gateway.store import key_names as keys
from steergate.gateway.store.scripts import (
    BUDGET_HOLD,
    CALLS,
    LUA_DIR,
    TENANT_GENERATION,
    AddKey,
    AdmitRequest,
    CasKey,
    DropLatch,
    DropVector,
    KeepLatch,
    PutVector,
    RecordKeyUse,
    RenewLeases,
    Scripts,
    SettleRequest,
    TakeKey,
    TenantCall,
    lua_source,
    script_text,
    wire,
)
from steergate.gateway.tenancy.records import Limits, Tenant
from tests.harness import aredis_client


def test_every_lua_file_has_exactly_one_builder_and_one_loaded_script() -> None:
    files = sorted(p.stem for p in LUA_DIR.glob("*.lua"))
    builders = sorted(c.script for c in CALLS)
    assert builders == files
    assert sorted(f.name for f in dataclasses.fields(Scripts)) == files


def test_builders_take_keyword_arguments_only() -> None:
    with pytest.raises(TypeError):
        DropVector("acme", "v")  # type: ignore[misc]


def test_admit_request_puts_each_named_field_at_its_argv_position() -> None:
    call = AdmitRequest(
        tenant_id="acme",
        generation=1.5,
        now_ms=120_000,
        limits=Limits(
            rpm=2,
            tpm=3,
            max_concurrency=5,
            latch_count=12,
            latch_bytes=13,
            latch_policy="reject",
            token_budget={"tokens": 21, "period": "month"},
        ),
        cost=4,
        lease_id="lease",
        lease_expiry_ms=7,
        conversation_id="conv",
        store_latch=True,
        latch_bytes=10,
        latch_kind="value",
        deadline_ms=16,
        pending_horizon_ms=17,
        key_id="key",
        key_rpm=19,
        key_concurrency=20,
        budget_left_ms=23,
        vector_names=["a", "b"],
        finished_leases=["done"],
    )
    # admit_request.lua's header: ARGV[1] .. ARGV[25], then N names, M, M lease ids.
    assert call.argv() == [
        120_000, 2, 3, 4, 5, "lease", 7, "conv", "1", 10, "value", 12, 13, "reject",
        keys.USAGE_MINUTE_TTL_S, 16, 17, "key", 19, 20, 21, "month", 23, keys.USAGE_DAY_TTL_S,
        2, "a", "b", 1, "done",
    ]  # fmt: skip
    assert call.keys() == keys.admit_keys("acme", 2, "key")
    assert call.keys()[12] == keys.key_gcra("acme", "key")  # KEYS[13]


def test_settle_request_puts_each_named_field_at_its_argv_position() -> None:
    call = SettleRequest(
        tenant_id="acme",
        generation=1.5,
        now_ms=60_000,
        lease_id="lease",
        tpm=3,
        token_delta=-4,
        status_class="2xx",
        tokens_used=6,
        conversation_id="conv",
        latch_action="record",
        prev_latch="9:ref",
        cancel_expiry_ms=11,
        prompt_tokens=12,
        completion_tokens=13,
        key_id="key",
        left_latch="16:value",
        latch_count_quota=17,
        latch_bytes_quota=18,
        record_info="19:ref:d:v",
        record_spec="s20",
        evicted_latches=[("c21", "22", "23:ref:d", "s24"), ("c25", "26", "27:value:d", "s28")],
    )
    assert call.argv() == [
        60_000, "lease", 3, -4, "2xx", 6, "conv", "record", "9:ref", keys.USAGE_MINUTE_TTL_S,
        11, 12, 13, "key", keys.USAGE_DAY_TTL_S, "16:value", 17, 18, "19:ref:d:v", "s20",
        "c21", "22", "23:ref:d", "s24", "c25", "26", "27:value:d", "s28",
    ]  # fmt: skip
    assert call.keys() == keys.admit_keys("acme", 1, "key")


def test_the_small_builders_follow_their_headers() -> None:
    renew = RenewLeases(tenant_id="t", now_ms=1, expiry_ms=2, lease_ids=["x", "y"], storing=["c"])
    assert renew.keys() == [
        keys.leases("t"),
        keys.latches("t"),
        keys.latch_info("t"),
        keys.leases_done("t"),
        keys.budget_held("t"),
    ]
    assert renew.argv() == [1, 2, 2, "x", "y", "c"]
    keep = KeepLatch(tenant_id="t", generation=1.5, conversation_id="c", info="3:value:d", spec="s")
    assert (keep.keys(), keep.argv()) == (keys.latch_keys("t"), ["c", "3:value:d", "s"])
    assert DropLatch(tenant_id="t", generation=1, conversation_ids=["a", "b"]).argv() == ["a", "b"]
    put = PutVector(
        tenant_id="t",
        generation=1,
        name="v",
        meta="{}",
        nbytes=3,
        count_quota=4,
        bytes_quota=5,
        data="d",
    )
    assert (put.keys(), put.argv()) == (keys.vector_keys("t"), ["v", "{}", 3, 4, 5, "d"])
    assert TakeKey(tenant_id="t", key_id="k").keys() == [
        keys.tenant_keys("t"),
        keys.key_last_used("t"),
    ]
    assert CasKey(tenant_id="t", key_id="k", expected="a", new="b").argv() == ["k", "a", "b"]
    uses = RecordKeyUse(tenant_id="t", uses=[("k1", 1.5), ("k2", 2.0)])
    assert uses.argv() == ["k1", "1.500", "k2", "2.000"]
    add = AddKey(tenant_id="t", generation=1, key_id="k", record="{}")
    assert (add.keys(), add.argv()) == ([keys.tenant_keys("t")], ["k", "{}"])


def test_a_tenant_call_sends_the_tenant_record_and_generation_last() -> None:
    keep = KeepLatch(tenant_id="t", generation=1.25, conversation_id="c", info="i", spec="s")
    assert wire(keep) == (
        [*keys.latch_keys("t"), keys.tenant_record("t")],
        ["c", "i", "s", 1.25],
    )
    renew = RenewLeases(tenant_id="t", now_ms=1, expiry_ms=2, lease_ids=[])
    assert wire(renew) == (renew.keys(), renew.argv())  # not a tenant call: no prelude


async def test_run_sends_the_named_arguments_to_their_script() -> None:
    redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    scripts = Scripts.load(redis)
    tenant = Tenant(id="t")
    await redis.set(keys.tenant_record("t"), tenant.record())
    stored = await scripts.run(
        PutVector(
            tenant_id="t", generation=tenant.created_at, name="v", meta='{"bytes":3}', nbytes=3,
            count_quota=1, bytes_quota=10, data="body",
        )
    )  # fmt: skip
    assert [int(stored[0]), stored[1]] == [0, ""]
    assert await redis.hget(keys.vector_data("t"), "v") == "body"
    drop = DropVector(tenant_id="t", generation=tenant.created_at, name="v")
    assert int(await scripts.run(drop)) == 1
    assert await redis.hlen(keys.vectors("t")) == 0


def test_the_budget_hold_rule_is_written_once_and_every_script_using_it_loads_it() -> None:
    """The lease id mark ``~<tokens>`` is parsed in prelude/budget_hold.lua alone; a
    script that calls its functions names the prelude, one that does not, does not."""
    functions = re.compile(r"\b(held_by|release_held|sweep_leases)\(")
    for call in CALLS:
        body = lua_source(call.script)
        assert "~(%d+)" not in body, f"{call.script}.lua parses the hold mark itself"
        uses = bool(functions.search(body))
        assert (BUDGET_HOLD in getattr(call, "preludes", ())) == uses, call.script
    assert "~(%d+)" in lua_source(BUDGET_HOLD)
    assert {c.script for c in CALLS if BUDGET_HOLD in getattr(c, "preludes", ())} == {
        "admit_request", "settle_request", "renew_leases",
    }  # fmt: skip


def test_the_tenant_generation_check_runs_first_in_every_tenant_call() -> None:
    # It takes its KEYS and ARGV entries off before any other prelude or the script runs.
    for call in CALLS:
        text = script_text(call)
        assert text.endswith(lua_source(call.script))
        guarded = text.startswith(lua_source(TENANT_GENERATION))
        assert guarded == issubclass(call, TenantCall), call.script


@pytest.mark.parametrize(
    "entry",
    [
        keys.LatchEntry(96, "value", "d1"),
        keys.LatchEntry(0, "ref"),
        keys.LatchEntry(7, "ref"),
        keys.LatchEntry(32, "ref", "d2", ("calm", "x.y-1_Z")),
        keys.LatchEntry(64, "value", "", ("calm", "x.y-1_Z")),  # pending, with names
    ],
)
async def test_latch_entries_read_the_same_in_python_and_in_keep_latch_lua(
    entry: keys.LatchEntry,
) -> None:
    """The ledger entry's one Python reader (``LatchEntry``) and the scripts' ``bytes_of``
    agree: keep_latch.lua counts the bytes Python wrote, and Python reads back its entry."""
    redis = fakeredis.FakeAsyncRedis(decode_responses=True)
    scripts = Scripts.load(redis)
    tenant = Tenant(id="t")
    await redis.set(keys.tenant_record("t"), tenant.record())
    await redis.hset(keys.latch_info("t"), "c", "5:ref")  # the pending entry admission left
    await redis.set(keys.latch_bytes("t"), 5)
    keep = KeepLatch(
        tenant_id="t", generation=tenant.created_at, conversation_id="c", info=str(entry), spec="s"
    )
    await scripts.run(keep)
    info = await redis.hget(keys.latch_info("t"), "c")
    assert keys.LatchEntry.parse(info) == entry
    assert int(await redis.get(keys.latch_bytes("t")) or 0) == entry.nbytes


def test_a_pending_or_missing_latch_entry_has_no_digest() -> None:
    assert keys.LatchEntry.parse("64:value") == keys.LatchEntry(64, "value", "")
    assert keys.LatchEntry.parse("") == keys.LatchEntry.parse(None) == keys.LatchEntry(0, "ref")
    assert str(keys.LatchEntry(64, "value")) == "64:value"


@pytest.mark.parametrize("current", ["pending", "other", "gone", "recorded"])
async def test_settlement_records_a_latch_only_over_the_pending_entry_its_turn_left(
    redis_url: str, current: str
) -> None:
    """``record`` (keep_latch.lua failed as the turn ended): written as keep_latch.lua
    would have, over the pending entry its admission left; another turn's entry, or this
    one already written (a keep whose reply was lost), is left as it is; a conversation
    evicted meanwhile answers 1 (the engine's copy is forgotten), and nothing else is
    put back."""
    redis = aredis_client(redis_url)
    scripts = Scripts.load(redis)
    tenant = Tenant(id="rec")
    await redis.delete(*keys.tenant_state_keys("rec", 1), keys.tenant_record("rec"))
    await redis.set(keys.tenant_record("rec"), tenant.record())
    pending, mine = "32:value", "40:value:d1:v"
    before = {"pending": pending, "other": "8:ref:d2:w", "gone": None, "recorded": mine}[current]
    if before is not None:
        await redis.hset(keys.latch_info("rec"), "c", before)
        await redis.zadd(keys.latches("rec"), {"c": 1})
    await redis.set(keys.latch_bytes("rec"), keys.LatchEntry.parse(before).nbytes)
    call = SettleRequest(
        tenant_id="rec", generation=tenant.created_at, now_ms=60_000, lease_id="l", tpm=10,
        token_delta=0, status_class="2xx", tokens_used=0, conversation_id="c",
        latch_action="record", prev_latch="", cancel_expiry_ms=0, prompt_tokens=0,
        completion_tokens=0, key_id="", left_latch=pending, latch_count_quota=10,
        latch_bytes_quota=1000, record_info=mine, record_spec="spec",
        evicted_latches=[("x", "1", "4:value:d3", "sx")],
    )  # fmt: skip
    assert int(await scripts.run(call)) == (1 if current == "gone" else 0)
    info = await redis.hget(keys.latch_info("rec"), "c")
    spec = await redis.hget(keys.latch_specs("rec"), "c")
    if current == "pending":
        assert (info, spec) == (mine, "spec")
        assert int(await redis.get(keys.latch_bytes("rec"))) == 40
    else:
        assert (info, spec) == (before, None)
        assert int(await redis.get(keys.latch_bytes("rec"))) == keys.LatchEntry.parse(before).nbytes
    assert await redis.hget(keys.latch_info("rec"), "x") is None  # its eviction stands
    await redis.aclose()
