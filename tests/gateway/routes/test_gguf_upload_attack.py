"""Issue 9 item 2, as the attack: one tenant uploads hostile GGUF files (one huge
metadata array; a header claiming 10^6 key/value pairs) while another client polls
the gateway. Before the fix a 1 MB file held the event loop for 8-41 s."""

from __future__ import annotations

import concurrent.futures as cf
import struct
import time

import httpx
import numpy as np
import pytest

from tests.gateway.conftest import make_tenant
from tests.gateway.servers import ServerThread


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def huge_array_gguf(n_bytes: int) -> bytes:
    kv = _s(b"x.big") + struct.pack("<IIQ", 9, 0, n_bytes) + b"\1" * n_bytes
    info = _s(b"direction.1") + struct.pack("<IQIQ", 1, 8, 0, 0)
    body = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + kv + info
    return body + b"\0" * (-len(body) % 32) + np.ones(8, "<f4").tobytes()


MANY_KV = b"GGUF" + struct.pack("<IQQ", 3, 1, 10**6) + b"\0" * 200_000


@pytest.mark.timed
def test_hostile_gguf_uploads_are_refused_fast_and_do_not_stall_other_requests(
    gateway: ServerThread, redis_url: str
) -> None:
    key = make_tenant(redis_url, "mallory", rpm=10_000)
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/octet-stream"}
    files = [huge_array_gguf(200_000), huge_array_gguf(1_000_000), MANY_KV] * 3

    def upload(raw: bytes) -> tuple[float, httpx.Response]:
        start = time.perf_counter()
        r = httpx.put(
            gateway.url + "/v1/steering/vectors/evil", content=raw, headers=headers, timeout=60
        )
        return time.perf_counter() - start, r

    with httpx.Client(base_url=gateway.url) as victim, cf.ThreadPoolExecutor(4) as pool:
        victim.get("/healthz")
        futures = [pool.submit(upload, raw) for raw in files]
        healthz: list[float] = []
        while not all(f.done() for f in futures):
            start = time.perf_counter()
            assert victim.get("/healthz").status_code == 200
            healthz.append(time.perf_counter() - start)
        results = [f.result() for f in futures]

    for elapsed, r in results:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "body"
        assert elapsed < 1.0, f"upload took {elapsed:.2f} s"
    messages = {r.json()["error"]["message"] for _, r in results}
    assert any("'x.big' of 1000000 elements" in m for m in messages), messages
    assert any("1000000 metadata key/value pairs" in m for m in messages), messages
    assert max(healthz, default=0.0) < 0.5, f"/healthz took {max(healthz):.3f} s"


def test_valid_gguf_upload_still_stored(gateway: ServerThread, redis_url: str) -> None:
    from steergate.shared.gguf import encode_gguf_control_vector

    key = make_tenant(redis_url, "alice")
    raw = encode_gguf_control_vector({2: np.arange(8, dtype=np.float32)})
    r = httpx.put(
        gateway.url + "/v1/steering/vectors/calm",
        content=raw,
        headers={"Authorization": f"Bearer {key}", "content-type": "application/octet-stream"},
    )
    assert r.status_code == 201, r.text
    assert r.json()["layers"] == [2]
