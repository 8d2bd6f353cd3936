"""``GET /v1/usage/export``, ``GET /admin/tenants/{id}/usage/export`` and ``steergate
usage --since``: billable usage per UTC day (or per day and API key) from the daily
rollup hashes that settlement and admission keep (``keys.usage_day``).

Most tests write the day hashes directly (the schema is the contract); the
end-to-end test sends real requests and compares the export with what the client
received."""

# ruff: noqa: F811 - pytest fixtures are imported, then named as parameters
from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from steergate.cli.main import main
from steergate.gateway.admission import usage
from steergate.gateway.store import key_names as keys
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.ops_env import ADMIN, Ops, bearer, chat_body, ops  # noqa: F401 - fixture
from tests.gateway.servers import ServerThread
from tests.harness import redis_client, wait_for

TODAY = keys.utc_day(time.time())


def date(day: int) -> str:
    return usage.date_of(day)


def write_day(redis_url: str, tenant_id: str, day: int, fields: dict[str, int]) -> None:
    client = redis_client(redis_url)
    try:
        client.hset(keys.usage_day(tenant_id, day), mapping=fields)
        client.expire(keys.usage_day(tenant_id, day), keys.USAGE_DAY_TTL_S)
    finally:
        client.close()


def create_tenant(url: str, tenant_id: str, **limits: Any) -> None:
    r = httpx.post(
        url + "/admin/tenants",
        json={"id": tenant_id, "limits": limits, "allow_overcommit": True},
        headers=ADMIN,
        timeout=10,
    )
    assert r.status_code == 201, r.text


def create_key(url: str, tenant_id: str) -> tuple[str, str]:
    """(key_id, key)"""
    r = httpx.post(url + f"/admin/tenants/{tenant_id}/keys", json={}, headers=ADMIN, timeout=10)
    assert r.status_code == 201, r.text
    return r.json()["key_id"], r.json()["key"]


def export(url: str, key: str, **params: Any) -> httpx.Response:
    return httpx.get(url + "/v1/usage/export", params=params, headers=bearer(key), timeout=10)


def admin_export(url: str, tenant_id: str, **params: Any) -> httpx.Response:
    return httpx.get(
        url + f"/admin/tenants/{tenant_id}/usage/export", params=params, headers=ADMIN, timeout=10
    )


DAY_A = {
    "requests": 5,
    "prompt_tokens": 40,
    "completion_tokens": 12,
    "tokens": 52,
    "2xx": 4,
    "4xx": 1,
    "429:rpm": 2,
    "429:budget": 1,
    "k:key_a:requests": 3,
    "k:key_a:prompt_tokens": 30,
    "k:key_a:completion_tokens": 9,
    "k:key_a:tokens": 39,
    "k:key_a:2xx": 3,
    "k:key_a:429:rpm": 2,
    "k:key_b:requests": 2,
    "k:key_b:prompt_tokens": 10,
    "k:key_b:completion_tokens": 3,
    "k:key_b:tokens": 13,
    "k:key_b:2xx": 1,
    "k:key_b:4xx": 1,
    "k:key_b:429:budget": 1,
}
DAY_B = {"requests": 1, "tokens": 8, "prompt_tokens": 5, "completion_tokens": 3, "5xx": 1,
         "429:someday_new_cause": 4, "k:key_b:requests": 1, "k:key_b:tokens": 8,
         "k:key_b:prompt_tokens": 5, "k:key_b:completion_tokens": 3, "k:key_b:5xx": 1}  # fmt: skip


@pytest.fixture()
def acme(gateway: ServerThread, redis_url: str) -> tuple[str, str]:
    """(gateway url, acme's key), with rollups written two and four days ago."""
    create_tenant(gateway.url, "acme")
    _, key = create_key(gateway.url, "acme")
    write_day(redis_url, "acme", TODAY - 4, DAY_A)
    write_day(redis_url, "acme", TODAY - 2, DAY_B)
    return gateway.url, key


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-13-01"}, "start"),
        ({"start": "2026-02-30"}, "start"),
        ({"start": "2026-1-1"}, "start"),
        ({"end": "20261201"}, "end"),
        ({"start": "1969-12-31", "end": "1970-01-02"}, "start"),
        ({"start": "2026-03-02", "end": "2026-03-01"}, "end"),
        ({"start": "2025-01-01", "end": "2026-02-05"}, "start"),  # 401 days
        ({"group_by": "week"}, "group_by"),
        ({"group_by": ""}, "group_by"),
        ({"format": "xml"}, "format"),
    ],
)
def test_bad_parameters_are_400_invalid_request_naming_the_param(
    acme: tuple[str, str], params: dict[str, str], param: str
) -> None:
    url, key = acme
    for r in (export(url, key, **params), admin_export(url, "acme", **params)):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("invalid_request", param), err
        assert r.headers["x-should-retry"] == "false"


def test_the_range_is_inclusive_and_at_most_400_days(acme: tuple[str, str]) -> None:
    url, key = acme
    r = export(url, key, start="2025-01-01", end="2026-02-04")  # exactly 400 days
    assert r.status_code == 200 and len(r.json()["rows"]) == 400
    r = export(url, key, start="2026-03-01", end="2026-03-01")
    assert [row["date"] for row in r.json()["rows"]] == ["2026-03-01"]


def test_a_400_day_export_reads_every_day_in_order_across_its_read_slices(
    acme: tuple[str, str], redis_url: str
) -> None:
    """The read goes in slices of ``ROLLUP_DAYS_PER_TRIP`` days (so no one reply holds the
    event loop): days either side of each slice boundary land on their own rows."""
    url, key = acme
    per = usage.ROLLUP_DAYS_PER_TRIP
    first = TODAY - 399
    marked = sorted({first, first + per - 1, first + per, first + 2 * per, TODAY - 1, TODAY})
    for i, day in enumerate(marked):
        write_day(redis_url, "acme", day, {"requests": 1000 + i, "tokens": day})
    doc = export(url, key, start=date(first), end=date(TODAY - 1)).json()
    assert [row["date"] for row in doc["rows"]] == [date(d) for d in range(first, TODAY)]
    by_date = {row["date"]: row for row in doc["rows"]}
    for i, day in enumerate(marked[:-1]):  # all but TODAY, outside the range
        assert (by_date[date(day)]["requests"], by_date[date(day)]["tokens"]) == (1000 + i, day)
    assert doc["totals"]["requests"] == sum(1000 + i for i in range(len(marked) - 1)) + 6


def on_one_day(call: Callable[[], Any]) -> tuple[int, Any]:
    """``call()`` and the UTC day it ran on; called again if it ran across midnight
    (the module's TODAY is read at import, and a CI run can cross midnight)."""
    while True:
        day = keys.utc_day(time.time())
        out = call()
        if keys.utc_day(time.time()) == day:
            return day, out


def test_default_range_is_the_last_30_days_ending_today(acme: tuple[str, str]) -> None:
    url, key = acme
    today, doc = on_one_day(lambda: export(url, key).json())
    assert (doc["start"], doc["end"]) == (date(today - 29), date(today))
    assert [r["date"] for r in doc["rows"]] == [date(d) for d in range(today - 29, today + 1)]
    doc = export(url, key, end=date(TODAY - 10)).json()
    assert (doc["start"], doc["end"]) == (date(TODAY - 39), date(TODAY - 10))
    today, doc = on_one_day(lambda: export(url, key, start=date(TODAY - 3)).json())
    assert (doc["start"], doc["end"]) == (date(TODAY - 3), date(today))
    # near the epoch the default start stops at it (it was 1969-12-07, a date the
    # explicit `start` refuses)
    doc = export(url, key, end="1970-01-05").json()
    assert (doc["start"], doc["end"]) == ("1970-01-01", "1970-01-05") and len(doc["rows"]) == 5


# ---------------------------------------------------------------------------- shape


def test_json_by_day_one_row_per_day_with_429s_by_cause(acme: tuple[str, str]) -> None:
    url, key = acme
    r = export(url, key, start=date(TODAY - 5), end=date(TODAY - 1))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["object"] == "usage_export" and doc["tenant_id"] == "acme"
    assert doc["group_by"] == "day"
    assert doc["columns"] == [
        "date", "requests", "prompt_tokens", "completion_tokens", "tokens", "2xx", "4xx",
        "5xx", "429", "429_rpm", "429_tpm", "429_concurrency", "429_latch", "429_budget",
        "429_key_rpm", "429_key_concurrency",
    ]  # fmt: skip
    rows = doc["rows"]
    assert [row["date"] for row in rows] == [date(d) for d in range(TODAY - 5, TODAY)]
    assert all(list(row) == doc["columns"] for row in rows)
    assert rows[0] == {"date": date(TODAY - 5), **dict.fromkeys(doc["columns"][1:], 0)}
    day_a = rows[1]
    assert (day_a["requests"], day_a["prompt_tokens"], day_a["completion_tokens"]) == (5, 40, 12)
    assert (day_a["tokens"], day_a["2xx"], day_a["4xx"], day_a["5xx"]) == (52, 4, 1, 0)
    assert (day_a["429"], day_a["429_rpm"], day_a["429_budget"], day_a["429_tpm"]) == (3, 2, 1, 0)
    day_b = rows[3]
    assert day_b["429"] == 4 and day_b["5xx"] == 1  # a cause this version does not name
    assert doc["totals"] == {
        name: rows[1][name] + rows[3][name] for name in doc["columns"][1:]
    }  # per-key fields never leak into the tenant's numbers
    assert doc["totals"]["requests"] == 6 and doc["totals"]["tokens"] == 60


def test_csv_is_an_attachment_with_a_header_row_and_the_json_numbers(
    acme: tuple[str, str],
) -> None:
    url, key = acme
    params = {"start": date(TODAY - 5), "end": date(TODAY - 1)}
    doc = export(url, key, **params).json()
    r = export(url, key, format="csv", **params)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/csv")
    disposition = r.headers["content-disposition"]
    assert disposition.startswith("attachment;") and ".csv" in disposition
    assert "acme" in disposition
    lines = list(csv.reader(io.StringIO(r.text)))
    assert lines[0] == doc["columns"]
    assert len(lines) == 1 + len(doc["rows"])
    assert [dict(zip(lines[0], line, strict=True)) for line in lines[1:]] == [
        {c: str(v) for c, v in row.items()} for row in doc["rows"]
    ]


def test_group_by_key_splits_each_days_traffic_by_api_key(acme: tuple[str, str]) -> None:
    url, key = acme
    for kind in ("json", "csv"):
        r = export(url, key, start=date(TODAY - 5), end=date(TODAY), group_by="key", format=kind)
        assert r.status_code == 200, r.text
    doc = export(url, key, start=date(TODAY - 5), end=date(TODAY), group_by="key").json()
    assert doc["columns"][:2] == ["date", "key_id"]
    # Only (day, key) pairs with traffic, by date then key id.
    assert [(row["date"], row["key_id"]) for row in doc["rows"]] == [
        (date(TODAY - 4), "key_a"),
        (date(TODAY - 4), "key_b"),
        (date(TODAY - 2), "key_b"),
    ]
    a, b, b2 = doc["rows"]
    assert (a["requests"], a["tokens"], a["429"], a["429_rpm"]) == (3, 39, 2, 2)
    assert (b["requests"], b["tokens"], b["4xx"], b["429_budget"]) == (2, 13, 1, 1)
    assert (b2["requests"], b2["tokens"], b2["5xx"]) == (1, 8, 1)
    assert doc["totals"]["requests"] == 6  # the tenant's totals, as with group_by=day
    lines = list(csv.reader(io.StringIO(export(url, key, start=date(TODAY - 5), end=date(TODAY),
                                               group_by="key", format="csv").text)))  # fmt: skip
    assert lines[0] == doc["columns"] and [line[:2] for line in lines[1:]] == [
        [row["date"], row["key_id"]] for row in doc["rows"]
    ]


# ---------------------------------------------------------------------------- who sees what


def test_a_tenant_reads_only_its_own_export_and_admins_read_any(
    acme: tuple[str, str], redis_url: str
) -> None:
    url, acme_key = acme
    create_tenant(url, "beta")
    _, beta_key = create_key(url, "beta")
    write_day(redis_url, "beta", TODAY - 1, {"requests": 77, "tokens": 700})
    span = {"start": date(TODAY - 5), "end": date(TODAY)}
    assert export(url, acme_key, **span).json()["totals"]["requests"] == 6
    beta = export(url, beta_key, **span).json()
    assert beta["tenant_id"] == "beta" and beta["totals"]["requests"] == 77
    assert admin_export(url, "acme", **span).json()["totals"]["requests"] == 6
    assert admin_export(url, "beta", **span).json()["totals"]["tokens"] == 700
    # A tenant key never opens the admin route, for another tenant or its own.
    for tenant_id in ("beta", "acme"):
        r = httpx.get(
            url + f"/admin/tenants/{tenant_id}/usage/export", headers=bearer(acme_key), timeout=10
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = httpx.get(url + "/v1/usage/export", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(url + "/admin/tenants/acme/usage/export", timeout=10)
    assert r.status_code == 401
    r = admin_export(url, "ghost")
    assert r.status_code == 404 and r.json()["error"]["code"] == "tenant_not_found"
    r = admin_export(url, "Bad_Id")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_tenant_id"


def test_a_key_without_the_usage_scope_cannot_export(acme: tuple[str, str]) -> None:
    url, _ = acme
    r = httpx.post(
        url + "/admin/tenants/acme/keys", json={"scopes": ["inference"]}, headers=ADMIN, timeout=10
    )
    if r.status_code == 400 and r.json()["error"]["param"] in ("body", "scopes"):
        pytest.skip("key scopes are not available in this build")
    assert r.status_code == 201, r.text
    r = export(url, r.json()["key"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


# ---------------------------------------------------------------------------- end to end



def test_export_totals_equal_the_sum_of_what_clients_were_charged(gateway: ServerThread) -> None:
    """A scripted workload over two keys: non-streamed and streamed answers (streams with
    different lengths, so completion tokens differ), some refused by a low rpm. The export
    adds up to the ``usage`` objects the clients received and the 429s they got."""
    url = gateway.url
    create_tenant(url, "acme", rpm=7, max_concurrency=4)
    keys_ = dict([create_key(url, "acme"), create_key(url, "acme")])
    (id_a, key_a), (id_b, key_b) = keys_.items()
    charged: dict[str, dict[str, int]] = {
        k: dict.fromkeys(("requests", "prompt", "completion", "total", "429"), 0)
        for k in (id_a, id_b)
    }
    script = [(id_a, 0), (id_b, 2), (id_a, 5), (id_b, 0), (id_a, 3), (id_b, 7), (id_a, 0)]
    script += [(id_a, 1), (id_b, 0), (id_b, 4), (id_a, 0)]  # past the rpm: refused
    for key_id, chunks in script:
        key = keys_[key_id]
        if chunks:
            body = chat_body(
                stream=True, fake_chunks=chunks, stream_options={"include_usage": True}
            )
        else:
            body = chat_body()
        r = httpx.post(url + "/v1/chat/completions", json=body, headers=bearer(key), timeout=10)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            charged[key_id]["429"] += 1
            continue
        assert r.status_code == 200, r.text
        got = _usage_of(r, chunks)
        if chunks:
            assert got["completion_tokens"] == chunks
        tally = charged[key_id]
        tally["requests"] += 1
        tally["prompt"] += got["prompt_tokens"]
        tally["completion"] += got["completion_tokens"]
        tally["total"] += got["total_tokens"]
    made = sum(t["requests"] for t in charged.values())
    refused = sum(t["429"] for t in charged.values())
    # The rpm (a burst of 7, then one per 8.6 s) refused the tail; a very slow run may
    # have let one more in, which the comparison below counts like any other.
    assert made >= 7 and refused >= 2, charged

    def totals() -> dict[str, int]:
        return export(url, key_a).json()["totals"]

    # Settlement is asynchronous (batched off the hot path): wait for the last request.
    wait_for(lambda: totals()["requests"] == made and totals()["429"] == refused, 10)
    got = totals()
    assert got["prompt_tokens"] == sum(t["prompt"] for t in charged.values())
    assert got["completion_tokens"] == sum(t["completion"] for t in charged.values())
    assert got["tokens"] == sum(t["total"] for t in charged.values())
    assert (got["2xx"], got["4xx"], got["5xx"]) == (made, 0, 0)
    assert got["429_rpm"] == refused

    by_key = export(url, key_b, group_by="key").json()
    split: dict[str, dict[str, int]] = {}
    for row in by_key["rows"]:  # the workload may straddle UTC midnight: add the days up
        acc = split.setdefault(row["key_id"], dict.fromkeys(usage.EXPORT_COUNTERS, 0))
        for name in usage.EXPORT_COUNTERS:
            acc[name] += row[name]
    assert set(split) == {id_a, id_b}
    for key_id, tally in charged.items():
        row = split[key_id]
        assert row["requests"] == tally["requests"], (key_id, row, tally)
        assert (row["prompt_tokens"], row["completion_tokens"], row["tokens"]) == (
            tally["prompt"],
            tally["completion"],
            tally["total"],
        )
        assert row["2xx"] == tally["requests"]
        assert row["429"] == row["429_rpm"] == tally["429"]


def _usage_of(r: httpx.Response, chunks: int) -> dict[str, int]:
    if not chunks:
        return dict(r.json()["usage"])
    last: dict[str, int] | None = None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                last = event["usage"]
    assert last is not None, r.text
    return last


# ---------------------------------------------------------------------------- CLI


@pytest.fixture()
def cli(ops: Ops, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("STEERGATE_GATEWAY_URL", ops.url)
    monkeypatch.setenv("STEERGATE_ADMIN_KEY", ADMIN_KEY)
    monkeypatch.setenv("COLUMNS", "250")

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_cli_usage_export_table_json_csv_and_by_key(cli, ops: Ops, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    ops.tenant("acme")
    write_day(redis_url, "acme", TODAY - 4, DAY_A)
    write_day(redis_url, "acme", TODAY - 2, DAY_B)
    since, until = date(TODAY - 5), date(TODAY - 1)

    code, out, err = cli("usage", "--tenant", "acme", "--since", since, "--until", until)
    assert code == 0, err
    assert f"usage of acme, {since} .. {until}" in out
    row = next(line for line in out.splitlines() if date(TODAY - 4) in line)
    assert " 5 " in row and "52" in row and "rpm 2, budget 1" in row
    total = next(line for line in out.splitlines() if "total" in line)
    assert " 6 " in total and "60" in total

    code, out, _ = cli("usage", "--tenant", "acme", "--since", since, "--until", until, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["totals"]["requests"] == 6 and len(doc["rows"]) == 5

    code, out, _ = cli("usage", "acme", "--since", since, "--until", until, "--csv")
    lines = list(csv.reader(io.StringIO(out)))
    assert code == 0 and lines[0] == doc["columns"] and len(lines) == 6
    assert lines[2][:3] == [date(TODAY - 4), "5", "40"]

    code, out, _ = cli("usage", "--tenant", "acme", "--since", since, "--group-by", "key")
    assert code == 0 and "per API key" in out
    assert "key_a" in out and "key_b" in out

    code, out, _ = cli("usage", "--tenant", "acme", "--since", since, "--group-by", "key", "--csv")
    assert code == 0 and out.splitlines()[0].startswith("date,key_id,requests,")


def test_cli_usage_export_errors(cli, ops: Ops) -> None:  # type: ignore[no-untyped-def]
    ops.tenant("acme")
    code, _, err = cli("usage", "--tenant", "acme", "--since", "2026-02-30")
    assert code == 1 and "invalid_request" in err and "field start" in err
    code, _, err = cli("usage", "--tenant", "ghost", "--since", "2026-02-01")
    assert code == 1 and "tenant_not_found" in err
    code, _, err = cli("usage", "--since", "2026-02-01")
    assert code == 2 and "--tenant" in err
    code, _, err = cli("usage", "--tenant", "acme")
    assert code == 2 and "--since" in err
    code, _, err = cli("usage", "acme", "--until", "2026-02-01")
    assert code == 2 and "--since" in err
    code, _, err = cli("usage", "acme", "--tenant", "beta", "--since", "2026-02-01")
    assert code == 2
    assert cli("usage", "--tenant", "acme", "--since", "2026-02-01", "--group-by", "week")[0] == 2
    # The current-usage form is unchanged.
    code, out, _ = cli("usage")
    assert code == 0 and "acme" in out
