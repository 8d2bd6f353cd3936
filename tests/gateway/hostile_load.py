"""Issue 23, defect 2, as a load: tenant A sends maximal hostile steering bodies as
fast as its limits let it while tenant B probes the same gateway process; B's latency
with and without the attack is what ``tests/gateway/admission/test_hostile_bodies.py`` and
``bench/hostile_bodies.py`` report.

The hostile bodies are what the issue found: about 7.8 MB of valid JSON whose
``steering`` is invalid only at its very end (a string after a million numbers in an
inline array; a non-base64 character closing a packed ``data``), so a validator that
walks the body finds out last. The attacker runs in its own process
(``python -m tests.gateway.hostile_load URL KEY SECONDS chat|vector``), so its client work never
shares an interpreter with B's probes.
"""

from __future__ import annotations

import base64
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]
#: The gateway's default body limit is 8 MiB; the issue's bodies were 7.8 MB.
BODY_BYTES = 7_800_000
#: Senders in the attacker: more than A's max_concurrency (2), so its limit is met.
SENDERS = 4


def _chat(steering: dict) -> dict:
    return {
        "model": "stub",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "steering": steering,
    }


def inline_body(size: int = BODY_BYTES) -> bytes:
    """Short numbers (the most elements per byte a parser must build), one string last."""
    n = (size - 200) // 6
    values = b",".join([b"0.125"] * n)
    steering = _chat({"vectors": [{"hook": "post_block", "layers": {"1": [0]}}]})
    head = orjson.dumps(steering).replace(b'{"1":[0]}', b'{"1":[' + values + b',"x"]}')
    return head


def packed_body(size: int = BODY_BYTES) -> bytes:
    """A packed term whose base64 ``data`` is broken by its last character."""
    data = base64.b64encode(b"\0" * ((size - 300) // 4 * 3)).decode()[:-1] + "!"
    packed = {"dtype": "float32", "shape": [1, 8], "layer_indices": [1], "data": data}
    return orjson.dumps(_chat({"vectors": [{"hook": "post_block", "packed": packed}]}))


def vector_bodies() -> list[bytes]:
    """The same two as vector uploads (``PUT /v1/steering/vectors/{name}``)."""
    return [orjson.dumps(orjson.loads(b)["steering"]["vectors"][0]) for b in attack_bodies()]


def attack_bodies() -> list[bytes]:
    return [inline_body(), packed_body()]


def attack(url: str, key: str, seconds: float, kind: str = "chat") -> dict[str, int]:
    """SENDERS threads, each sending hostile bodies back to back (inline, packed, ...):
    ``kind`` "chat" posts them as chat steering, "vector" as vector uploads."""
    bodies = attack_bodies() if kind == "chat" else vector_bodies()
    path = CHAT if kind == "chat" else "/v1/steering/vectors/hostile"
    codes: dict[str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def send(i: int) -> None:
        headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
        with httpx.Client(timeout=60) as client:
            n = i
            while time.monotonic() < deadline:
                method = "POST" if kind == "chat" else "PUT"
                r = client.request(method, url + path, content=bodies[n % 2], headers=headers)
                n += 1
                try:
                    code = r.json()["error"]["code"]
                except Exception:
                    code = "-"
                with lock:
                    codes[f"{r.status_code} {code}"] = codes.get(f"{r.status_code} {code}", 0) + 1

    threads = [threading.Thread(target=send, args=(i,)) for i in range(SENDERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def start_attacker(url: str, key: str, seconds: float, kind: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.gateway.hostile_load", url, key, str(seconds), kind],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )


@dataclass
class Probes:
    """B's latencies in ms: ``GET /v1/usage`` and a small steered chat, alternating."""

    usage: list[float] = field(default_factory=list)
    chat: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def all(self) -> list[float]:
        return self.usage + self.chat


def probe(url: str, key: str, seconds: float, interval_s: float = 0.05) -> Probes:
    headers = {"Authorization": f"Bearer {key}"}
    cheap = _chat({"vectors": [{"hook": "post_block", "layers": {"1": [0.5] * 8}}]})
    out = Probes()
    deadline = time.monotonic() + seconds
    with httpx.Client(timeout=30) as client:
        client.get(url + "/v1/usage", headers=headers)  # connection and caches warm
        i = 0
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            if i % 4 == 3:
                r = client.post(url + CHAT, json=cheap, headers=headers)
                out.chat.append((time.perf_counter() - t0) * 1000)
            else:
                r = client.get(url + "/v1/usage", headers=headers)
                out.usage.append((time.perf_counter() - t0) * 1000)
            out.statuses[r.status_code] = out.statuses.get(r.status_code, 0) + 1
            i += 1
            time.sleep(interval_s)
    return out


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def summary(name: str, xs: list[float]) -> str:
    s = sorted(xs)
    return f"{name}: n={len(s)} p50={statistics.median(s):.1f} p95={p95(s):.1f} max={s[-1]:.1f} ms"


def under_attack(
    url: str, key_a: str, key_b: str, seconds: float, kind: str = "chat"
) -> tuple[Probes, dict]:
    proc = start_attacker(url, key_a, seconds, kind)
    time.sleep(1.0)  # the attacker's bodies built and its first ones in flight
    probes = probe(url, key_b, seconds - 1.5)
    out, _ = proc.communicate(timeout=seconds + 120)
    return probes, json.loads(out.decode().strip().splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(attack(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4])))
