"""Gateway overhead benchmark.

Starts a real redis-server, a fast mock upstream (raw ASGI under uvicorn, its own
process) and the gateway (``steergate gateway``, its own process); then measures
  * added latency p50/p99 at concurrency 1: gateway -> mock vs mock directly,
  * throughput through the gateway at concurrency 32,
  * Redis commands per request (INFO commandstats delta / requests).

    .venv/bin/python bench/gateway_overhead.py [--requests 2000] [--seconds 10]
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


async def mock_app(scope, receive, send):  # type: ignore[no-untyped-def]
    """The fastest plausible engine: a fixed answer, no parsing."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"})
                return
    while (await receive()).get("more_body"):
        pass
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

    def __init__(self, port: int, path: str, headers: dict[str, str]) -> None:
        body = orjson.dumps(
            {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
        )
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

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()

    from tests.harness import RedisProcess, free_port, wait_port

    redis_proc = RedisProcess().start()
    mock_port, gw_port = free_port(), free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "bench.gateway_overhead:mock_app",
                "--port",
                str(mock_port),
                "--log-level",
                "warning",
                "--no-access-log",
                "--loop",
                "uvloop",
                "--http",
                "httptools",
            ],
            cwd=ROOT,
        )
    ]
    env = {
        **os.environ,
        "REDIS_URL": redis_proc.url,
        "STEERGATE_ENGINE_URLS": f"http://127.0.0.1:{mock_port}",
        "STEERGATE_ENGINE_TOKEN": "bench",
        "STEERGATE_ADMIN_KEY": "bench-admin",
        "STEERGATE_KEY_PEPPER": "bench-pepper",
    }
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shared.cli",
                "gateway",
                "--port",
                str(gw_port),
                "--log-level",
                "warning",
            ],
            cwd=ROOT,
            env=env,
        )
    )
    try:
        assert wait_port(mock_port, 20) and wait_port(gw_port, 20), "servers did not start"
        import redis.asyncio as aioredis

        from gateway.tenants import TenantStore

        async def tenant() -> str:
            client = aioredis.Redis.from_url(redis_proc.url, decode_responses=True)
            store = TenantStore(client, "bench-pepper")
            await store.create(
                "bench",
                limits={"rpm": 10**9, "tpm": 10**12, "max_concurrency": 10**4},
                allow_overcommit=True,
            )
            key = (await store.create_key("bench"))[1]
            await client.aclose()
            return key

        key = asyncio.run(tenant())
        gh = {"Authorization": f"Bearer {key}"}
        direct = asyncio.run(latencies(mock_port, CHAT, {}, args.requests))
        before = redis_calls(redis_proc.port)
        via = asyncio.run(latencies(gw_port, CHAT, gh, args.requests))
        time.sleep(0.5)  # let settlement flush
        after = redis_calls(redis_proc.port)
        n = args.requests + 50
        sent = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in after}
        direct_rps, _ = asyncio.run(
            throughput(mock_port, CHAT, {}, args.seconds / 2, args.concurrency)
        )
        cpu0 = cpu_seconds(procs[1].pid)
        t0 = time.perf_counter()
        rps, errors = asyncio.run(throughput(gw_port, CHAT, gh, args.seconds, args.concurrency))
        gw_cpu_us = (cpu_seconds(procs[1].pid) - cpu0) / (rps * (time.perf_counter() - t0)) * 1e6
        d50, d99 = statistics.median(direct), pct(direct, 99)
        g50, g99 = statistics.median(via), pct(via, 99)
        print(f"direct  p50 {d50:.3f} ms  p99 {d99:.3f} ms")
        print(f"gateway p50 {g50:.3f} ms  p99 {g99:.3f} ms")
        print(f"added   p50 {g50 - d50:.3f} ms  p99 {g99 - d99:.3f} ms")
        print(
            f"throughput c={args.concurrency}: {rps:.0f} req/s ({errors} errors); "
            f"same client straight to the mock: {direct_rps:.0f} req/s"
        )
        print(f"gateway process CPU per request at c={args.concurrency}: {gw_cpu_us:.0f} us")
        inside = sum(v for k, v in sent.items() if k not in SENT_BY_CLIENT)
        print(
            "redis per request (c=1): "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(sent.items()) if k in SENT_BY_CLIENT)
            + f"; commands run inside those scripts: {inside:.2f}"
        )
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        redis_proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
