"""The latch controller on its own: caps, LRU order, refusal, staleness, determinism."""

from __future__ import annotations

import logging

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from steergate.engine.latch import Latch, LatchController, RefTerm
from steergate.shared.log_limits import RateLimitedWarning

HIDDEN = 4
SITE_BYTES = 4 * HIDDEN


def value_latch(n_sites: int, fill: float = 1.0) -> Latch:
    sites = {("post_block", i): np.full(HIDDEN, fill, dtype=np.float32) for i in range(n_sites)}
    return Latch("all", sites)


def ref_latch(name: str = "calm", digest: str = "d1") -> Latch:
    return Latch("all", {}, (RefTerm(name, digest, 2.0),))


def no_refs(_name: str) -> str | None:
    return None


def controller(max_count: int = 3, max_bytes: int = 10 * SITE_BYTES) -> LatchController:
    return LatchController(max_count, max_bytes, "epoch-1", wall_clock=lambda: 0.0)


def test_first_latch_is_latched_and_second_replaces() -> None:
    c = controller()
    assert c.store("a", value_latch(1)) == "latched"
    assert c.store("a", value_latch(2)) == "replaced"
    assert c.count == 1 and c.nbytes == 2 * SITE_BYTES
    assert c.status()["latches_stored"] == 2


def test_bytes_are_four_times_hidden_times_sites_and_ref_latches_cost_nothing() -> None:
    c = controller()
    c.store("v", value_latch(3))
    c.store("r", ref_latch())
    kinds = {e["conversation_id"]: (e["bytes"], e["kind"]) for e in c.list()}
    assert kinds == {"v": (3 * SITE_BYTES, "value"), "r": (0, "ref")}
    assert c.nbytes == 3 * SITE_BYTES


def test_count_cap_evicts_least_recently_used() -> None:
    c = controller(max_count=3)
    for cid in "abc":
        c.store(cid, value_latch(1))
    assert c.use("a", no_refs)[0] == "bridged"  # a is now the most recent
    c.store("d", value_latch(1))
    assert c.order() == ["c", "a", "d"]
    assert c.status()["evictions"] == 1


def test_byte_cap_evicts_oldest_until_it_fits() -> None:
    c = controller(max_count=10, max_bytes=4 * SITE_BYTES)
    c.store("a", value_latch(2))
    c.store("b", value_latch(1))
    c.store("c", value_latch(1))
    c.store("d", value_latch(3))  # needs 3: a (2) and b (1) must go
    assert c.order() == ["c", "d"]
    assert c.nbytes == 4 * SITE_BYTES
    assert c.status()["evictions"] == 2


def test_oversize_latch_is_refused_and_removes_the_earlier_latch() -> None:
    c = controller(max_bytes=2 * SITE_BYTES)
    c.store("a", value_latch(1))
    c.store("b", value_latch(1))
    assert c.store("a", value_latch(3)) == "refused_oversize"
    assert c.get("a") is None  # the client asked to replace it; the old one is gone
    assert c.order() == ["b"]  # nobody else was evicted for a latch that cannot fit
    status = c.status()
    assert status["refusals"] == 1 and status["evictions"] == 0 and status["latches_stored"] == 2


def test_count_cap_zero_refuses_every_latch() -> None:
    c = controller(max_count=0)
    assert c.store("a", ref_latch()) == "refused_oversize"
    assert c.count == 0


def test_use_of_unknown_conversation_is_none() -> None:
    assert controller().use("nope", no_refs) == ("none", None)


def test_ref_latch_bridges_while_digest_matches_and_drops_when_it_changes() -> None:
    c = controller()
    c.store("a", ref_latch("calm", "d1"))
    state, latch = c.use("a", {"calm": "d1"}.get)
    assert state == "bridged" and latch is not None
    assert c.use("a", {"calm": "d2"}.get) == ("dropped_stale", None)
    assert c.get("a") is None
    assert c.use("a", {"calm": "d2"}.get) == ("none", None)


def test_ref_latch_drops_when_vector_deleted() -> None:
    c = controller()
    c.store("a", ref_latch("calm", "d1"))
    assert c.use("a", no_refs)[0] == "dropped_stale"
    assert c.status()["bridges"] == 0


def test_delete_and_list_prefix() -> None:
    c = controller()
    c.store("t1~x", value_latch(1))
    c.store("t2~x", value_latch(1))
    assert [e["conversation_id"] for e in c.list("t1~")] == ["t1~x"]
    assert c.delete("t1~x") is True
    assert c.delete("t1~x") is False
    assert c.nbytes == SITE_BYTES


def test_status_has_every_contract_field() -> None:
    assert set(controller().status()) == {
        "latched_conversations",
        "latched_bytes",
        "max_latched_conversations",
        "max_latched_bytes",
        "evictions",
        "refusals",
        "bridges",
        "latches_stored",
        "epoch",
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_oversize_warning_is_rate_limited_with_suppressed_count() -> None:
    now = [0.0]
    logger = logging.getLogger("steergate.latch")
    warning = RateLimitedWarning(10.0, clock=lambda: now[0], logger=logger)
    c = LatchController(3, SITE_BYTES, "e", warning=warning)
    records = _Records()
    logger.addHandler(records)
    try:
        for i in range(5):
            assert c.store(f"c{i}", value_latch(2)) == "refused_oversize"
        now[0] = 11.0
        c.store("late", value_latch(2))
    finally:
        logger.removeHandler(records)
    assert len(records.messages) == 2
    assert "4 similar warnings suppressed" in records.messages[1]
    assert c.status()["refusals"] == 6


# -- property tests -------------------------------------------------------------

IDS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
NAMES = st.sampled_from(["n1", "n2"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store_value"), IDS, st.integers(0, 5)),
        st.tuples(st.just("store_ref"), IDS, NAMES),
        st.tuples(st.just("use"), IDS, st.none()),
        st.tuples(st.just("delete"), IDS, st.none()),
        st.tuples(st.just("reregister"), NAMES, st.none()),
    ),
    max_size=60,
)


class Model:
    """An obviously-correct reference: a list, oldest first."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self.entries: list[
            tuple[str, int, str | None, int | None]
        ] = []  # (id, bytes, ref name, ref version)

    def store(self, cid: str, nbytes: int, ref: str | None, version: int | None) -> str:
        existed = any(e[0] == cid for e in self.entries)
        self.entries = [e for e in self.entries if e[0] != cid]
        if nbytes > self.max_bytes or self.max_count < 1:
            return "refused_oversize"
        self.entries.append((cid, nbytes, ref, version))
        while (
            len(self.entries) > self.max_count or sum(e[1] for e in self.entries) > self.max_bytes
        ):
            self.entries.pop(0)
        return "replaced" if existed else "latched"

    def use(self, cid: str, versions: dict[str, int]) -> str:
        found = [e for e in self.entries if e[0] == cid]
        if not found:
            return "none"
        entry = found[0]
        self.entries.remove(entry)
        if entry[2] is not None and versions[entry[2]] != entry[3]:
            return "dropped_stale"
        self.entries.append(entry)
        return "bridged"


def run(ops: list[tuple[str, str, object]], max_count: int, max_bytes: int) -> LatchController:
    c = LatchController(max_count, max_bytes, "e", wall_clock=lambda: 0.0)
    model = Model(max_count, max_bytes)
    versions = {"n1": 0, "n2": 0}
    for op, key, arg in ops:
        if op == "store_value":
            assert isinstance(arg, int)
            got = c.store(key, value_latch(arg))
            assert got == model.store(key, arg * SITE_BYTES, None, None)
        elif op == "store_ref":
            assert isinstance(arg, str)
            got = c.store(key, ref_latch(arg, f"v{versions[arg]}"))
            assert got == model.store(key, 0, arg, versions[arg])
        elif op == "use":
            state, _ = c.use(key, lambda n: f"v{versions[n]}")
            assert state == model.use(key, versions)
        elif op == "delete":
            existed = any(e[0] == key for e in model.entries)
            model.entries = [e for e in model.entries if e[0] != key]
            assert c.delete(key) is existed
        else:
            versions[key] += 1
        # Caps, accounting and LRU order hold after every operation.
        assert c.count <= max_count
        assert c.nbytes <= max_bytes
        assert c.nbytes == sum(e["bytes"] for e in c.list())
        assert c.order() == [e[0] for e in model.entries]
    return c


@settings(max_examples=300, deadline=None)
@given(ops=OPS, max_count=st.integers(0, 4), max_sites=st.integers(0, 8))
def test_caps_and_lru_order_hold_after_any_sequence(ops, max_count: int, max_sites: int) -> None:
    run(ops, max_count, max_sites * SITE_BYTES)


@settings(max_examples=100, deadline=None)
@given(ops=OPS, max_count=st.integers(0, 4), max_sites=st.integers(0, 8))
def test_same_sequence_gives_same_state(ops, max_count: int, max_sites: int) -> None:
    first = run(ops, max_count, max_sites * SITE_BYTES)
    second = run(ops, max_count, max_sites * SITE_BYTES)
    assert first.list() == second.list()
    assert first.status() == second.status()


def test_undo_store_puts_back_what_the_refused_turn_replaced_and_no_more() -> None:
    """A turn vLLM refuses takes its latch back (engine/http/rewrite.py): the earlier
    latch returns, or none; the refused one is not counted as stored; a later turn's
    latch, stored while the refused one ran, stands; and an oversize refusal (which had
    removed the earlier latch) gives it back too."""
    c = controller()
    old, new = value_latch(1), value_latch(2, fill=2.0)
    c.store("a", old)
    c.store("a", new)
    c.undo_store("a", new, old)
    assert c.get("a") is old and c.nbytes == SITE_BYTES
    assert c.status()["latches_stored"] == 1
    fresh = value_latch(1, fill=3.0)
    c.store("b", fresh)
    c.undo_store("b", fresh, None)
    assert c.get("b") is None and c.count == 1
    later = value_latch(1, fill=4.0)
    c.store("a", new)
    c.store("a", later)  # a concurrent turn latched after the refused one
    c.undo_store("a", new, old)
    assert c.get("a") is later
    huge = value_latch(11)  # over the 10-site byte cap: refused, and "a"'s latch removed
    assert c.store("a", huge) == "refused_oversize" and c.get("a") is None
    c.undo_store("a", huge, later)
    assert c.get("a") is later
