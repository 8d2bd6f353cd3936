"""Gateway overhead benchmark.

Starts a real redis-server, a fast mock upstream (raw ASGI under uvicorn, its own
process) and the gateway (``steergate gateway``, its own process); then measures
  * added latency p50/p99 at concurrency 1: gateway -> mock vs mock directly,
  * added time to first byte of a stream (the first SSE event) at concurrency 1,
  * throughput through the gateway at concurrency 32,
  * Redis commands per request (INFO commandstats delta / requests),
and the same latency, TTFB and throughput with the embedded store (no ``REDIS_URL``:
fakeredis in the gateway process).

    .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--seconds 10]
        [--store redis|embedded|both]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BODY = (
    b'{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
    b'"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6},'
    b'"steering":{"applied":false,"latch":"none"}}'
)
INFO = (
    b'{"model":"m","hidden_size":8,"num_layers":4,"max_latched_conversations":1024,'
    b'"max_latched_bytes":268435456,"epoch":"bench"}'
)


#: A stream: the first event at once, then four more and the usage chunk.
EVENT = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":'
    b'[{"index":0,"delta":{"content":"ok"},"finish_reason":null}]}\n\n'
)
STREAM_TAIL = (
    EVENT * 4
    + b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":5,"total_tokens":10}}\n\n'
    b"data: [DONE]\n\n"
)


async def mock_app(scope, receive, send):  # type: ignore[no-untyped-def]
    """The fastest plausible engine: a fixed answer, no parsing (a stream when the body
    asks for one)."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    raw = b""
    while True:
        msg = await receive()
        raw += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    if b'"stream":true' in raw:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream"),
                    (b"x-steering-latch", b"none"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": STREAM_TAIL})
        return
    body = (
        INFO
        if scope["path"] == "/v1/steering/info"
        else (b"[]" if "latches" in scope["path"] else BODY)
    )
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"x-steering-latch", b"none"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p / 100 * len(values)))]


class RawClient:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams. httpx as the load
    generator tops out near 300 req/s on this box (it would measure itself); this
    costs a few microseconds a request, so the figures are the servers'."""

    def __init__(
        self, port: int, path: str, headers: dict[str, str], stream: bool = False
    ) -> None:
        doc: dict[str, object] = {
            "model": "m",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 1,
        }
        if stream:
            doc["stream"] = True
        body = orjson.dumps(doc)
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.request = (
            f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{head}content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def call(self) -> int:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return status

    async def first_event(self) -> float:
        """Send a stream request; seconds to its first SSE event (then drain the
        chunked body to its end)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        t0 = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        assert int(head[9:12]) == 200, head
        seen = await self.reader.readuntil(b"\n\n")  # chunk size line + first event
        took = time.perf_counter() - t0
        while not seen.endswith(b"0\r\n\r\n"):
            seen += await self.reader.read(65536)
        return took

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def ttfb(port: int, path: str, headers: dict[str, str], n: int) -> list[float]:
    """Milliseconds to the first SSE event of ``n`` streams, one at a time."""
    c = RawClient(port, path, headers, stream=True)
    for _ in range(20):
        await c.first_event()
    out = [await c.first_event() * 1000 for _ in range(n)]
    c.close()
    return out


async def latencies(port: int, path: str, headers: dict[str, str], n: int) -> list[float]:
    c = RawClient(port, path, headers)
    for _ in range(50):
        await c.call()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        status = await c.call()
        out.append((time.perf_counter() - t0) * 1000)
        assert status == 200, status
    c.close()
    return out


async def throughput(
    port: int, path: str, headers: dict[str, str], seconds: float, conc: int
) -> tuple[float, int]:
    done, errors = 0, 0
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done, errors
        c = RawClient(port, path, headers)
        while time.perf_counter() < deadline:
            status = await c.call()
            done += 1
            errors += status != 200
        c.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return done / (time.perf_counter() - t0), errors


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux ``/proc``; 0 elsewhere).
    CPU per request is the figure that stays put on a busy machine, where latency
    and throughput mostly measure the scheduler."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: Commands a client sends itself (everything else in commandstats runs inside Lua).
SENT_BY_CLIENT = {"evalsha", "eval", "script|load", "script|exists", "publish"}


def redis_calls(port: int) -> dict[str, int]:
    """Cumulative calls per command (INFO commandstats counts commands run inside
    scripts too, so the client's own round trips are the EVALSHA/GET lines)."""
    import redis

    stats = redis.Redis(port=port).info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def start_gateway(port: int, mock_port: int, redis_url: str | None) -> subprocess.Popen:
    env = {
        **os.environ,
        "STEERGATE_ENGINE_URLS": f"http://127.0.0.1:{mock_port}",
        "STEERGATE_ENGINE_TOKEN": "bench",
        "STEERGATE_ADMIN_KEY": "bench-admin",
        "STEERGATE_KEY_PEPPER": "bench-pepper",
    }
    env.pop("REDIS_URL", None)
    if redis_url:
        env["REDIS_URL"] = redis_url
    cmd = [sys.executable, "-m", "steergate.cli", "gateway", "--port", str(port)]
    return subprocess.Popen([*cmd, "--log-level", "warning"], cwd=ROOT, env=env)


LIMITS = {"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**4}


def tenant_via_admin_api(port: int) -> str:
    """A tenant and key through the admin API (the embedded store lives in the gateway)."""
    import httpx

    admin = {"Authorization": "Bearer bench-admin"}
    base = f"http://127.0.0.1:{port}/admin/tenants"
    r = httpx.post(base, json={"id": "bench", "limits": LIMITS}, headers=admin)
    assert r.status_code == 201, r.text
    r = httpx.post(f"{base}/bench/keys", json={}, headers=admin)
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def tenant_in_redis(redis_url: str) -> str:
    import redis.asyncio as aioredis

    from steergate.gateway.tenancy.tenants import TenantStore

    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        store = TenantStore(client, "bench-pepper")
        await store.create("bench", limits=LIMITS, allow_overcommit=True)
        key = (await store.create_key("bench"))[1]
        await client.aclose()
        return key

    return asyncio.run(go())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--store", choices=("redis", "embedded", "both"), default="both")
    args = ap.parse_args()

    from tests.harness import RedisProcess, free_port, wait_port

    mock_port = free_port()
    mock = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "bench.gateway_overhead:mock_app",
            "--port", str(mock_port), "--log-level", "warning", "--no-access-log",
            "--loop", "uvloop", "--http", "httptools",
        ],
        cwd=ROOT,
    )  # fmt: skip
    try:
        assert wait_port(mock_port, 20), "mock did not start"
        direct = asyncio.run(latencies(mock_port, CHAT, {}, args.requests))
        direct_ttfb = asyncio.run(ttfb(mock_port, CHAT, {}, args.requests // 2))
        direct_rps, _ = asyncio.run(
            throughput(mock_port, CHAT, {}, args.seconds / 2, args.concurrency)
        )
        d50, d99 = statistics.median(direct), pct(direct, 99)
        t50, t99 = statistics.median(direct_ttfb), pct(direct_ttfb, 99)
        print(f"direct  p50 {d50:.3f} ms  p99 {d99:.3f} ms; stream TTFB p50 {t50:.3f} ms  "
              f"p99 {t99:.3f} ms; c={args.concurrency} {direct_rps:.0f} req/s")  # fmt: skip
        stores = ("redis", "embedded") if args.store == "both" else (args.store,)
        for store in stores:
            redis_proc = RedisProcess().start() if store == "redis" else None
            gw_port = free_port()
            gw = start_gateway(gw_port, mock_port, redis_proc.url if redis_proc else None)
            try:
                assert wait_port(gw_port, 30), "gateway did not start"
                key = (
                    tenant_in_redis(redis_proc.url) if redis_proc else tenant_via_admin_api(gw_port)
                )
                gh = {"Authorization": f"Bearer {key}"}
                before = redis_calls(redis_proc.port) if redis_proc else {}
                via = asyncio.run(latencies(gw_port, CHAT, gh, args.requests))
                time.sleep(0.5)  # let settlement flush
                after = redis_calls(redis_proc.port) if redis_proc else {}
                n = args.requests + 50
                sent = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in after}
                via_ttfb = asyncio.run(ttfb(gw_port, CHAT, gh, args.requests // 2))
                cpu0 = cpu_seconds(gw.pid)
                t0 = time.perf_counter()
                rps, errors = asyncio.run(
                    throughput(gw_port, CHAT, gh, args.seconds, args.concurrency)
                )
                took = time.perf_counter() - t0
                gw_cpu_us = (cpu_seconds(gw.pid) - cpu0) / (rps * took) * 1e6
                g50, g99 = statistics.median(via), pct(via, 99)
                s50, s99 = statistics.median(via_ttfb), pct(via_ttfb, 99)
                print(f"[{store} store]")
                print(f"gateway p50 {g50:.3f} ms  p99 {g99:.3f} ms")
                print(f"added   p50 {g50 - d50:.3f} ms  p99 {g99 - d99:.3f} ms")
                print(f"stream TTFB via gateway p50 {s50:.3f} ms  p99 {s99:.3f} ms; "
                      f"added p50 {s50 - t50:.3f} ms  p99 {s99 - t99:.3f} ms")  # fmt: skip
                print(
                    f"throughput c={args.concurrency}: {rps:.0f} req/s ({errors} errors); "
                    f"same client straight to the mock: {direct_rps:.0f} req/s"
                )
                print(f"gateway CPU per request at c={args.concurrency}: {gw_cpu_us:.0f} us")
                if redis_proc:
                    inside = sum(v for k, v in sent.items() if k not in SENT_BY_CLIENT)
                    print(
                        "redis per request (c=1): "
                        + ", ".join(
                            f"{k} {v:.2f}" for k, v in sorted(sent.items()) if k in SENT_BY_CLIENT
                        )
                        + f"; commands run inside those scripts: {inside:.2f}"
                    )
            finally:
                gw.terminate()
                gw.wait(10)
                if redis_proc:
                    redis_proc.stop()
    finally:
        mock.terminate()
        mock.wait(10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
