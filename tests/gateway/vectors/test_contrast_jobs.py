"""Where from-examples' contrast math runs (``gateway/vectors/contrast_jobs.py``): its
own threads, one job per tenant at a time. It used ``asyncio.to_thread``, the default
executor whose threads also decode GGUF uploads under a 5 s bound: a tenant's ``pca``
jobs held every thread and another tenant's upload was refused (400 invalid_gguf,
"could not be read within 5 s")."""

from __future__ import annotations

import asyncio
import threading

import pytest

from steergate.gateway.vectors.contrast_jobs import ContrastJobs


async def test_a_tenants_backlog_never_delays_another_tenant() -> None:
    jobs = ContrastJobs(threads=2)
    done: list[str] = []
    release = threading.Event()

    def slow(tag: str) -> str:
        release.wait(10)
        done.append(tag)
        return tag

    try:
        # Tenant a queues three jobs that hold their thread until released.
        a = [asyncio.ensure_future(jobs.run("a", lambda i=i: slow(f"a{i}"))) for i in range(3)]
        await asyncio.sleep(0.1)
        # Tenant b's job runs at once, on the other thread, while a's first one runs.
        b = await asyncio.wait_for(jobs.run("b", lambda: done.append("b") or "b"), 5)
        assert b == "b" and done == ["b"]
        release.set()
        assert await asyncio.gather(*a) == ["a0", "a1", "a2"]
        assert done == ["b", "a0", "a1", "a2"]  # a's jobs one at a time, in order
    finally:
        release.set()
        jobs.close()


async def test_the_default_executor_stays_free_while_jobs_run() -> None:
    jobs = ContrastJobs(threads=2)
    release = threading.Event()
    try:
        # 40 tenants' jobs: more than the default executor's threads (min(32, cpus + 4))
        tenants = [f"t{i}" for i in range(40)]
        running = [asyncio.ensure_future(jobs.run(t, lambda: release.wait(10))) for t in tenants]
        await asyncio.sleep(0.1)
        # what a GGUF decode does: it gets a thread while every job is waiting or running
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 42), 5) == 42
        release.set()
        await asyncio.gather(*running)
    finally:
        release.set()
        jobs.close()


async def test_a_cancelled_caller_keeps_its_tenants_turn_until_the_math_ends() -> None:
    """A client that leaves cancels its request; the math already on a thread cannot be
    stopped, so the tenant's next job waits for it rather than running beside it."""
    jobs = ContrastJobs(threads=2)
    release = threading.Event()
    order: list[str] = []

    def first() -> None:
        release.wait(10)
        order.append("first ended")

    try:
        job = asyncio.ensure_future(jobs.run("a", first))
        await asyncio.sleep(0.1)
        job.cancel()
        nxt = asyncio.ensure_future(jobs.run("a", lambda: order.append("second ran")))
        await asyncio.sleep(0.2)
        assert order == []  # the second waits for the first's thread
        release.set()
        await nxt
        assert order == ["first ended", "second ran"]
    finally:
        release.set()
        jobs.close()


async def test_activation_memory_is_one_hold_per_tenant_and_refuses_past_its_bound() -> None:
    from steergate.gateway.vectors.contrast_jobs import ActivationMemory
    from steergate.shared.errors import APIError

    memory = ActivationMemory(100)
    entered = asyncio.Event()
    release = asyncio.Event()

    async def hold(tenant: str, nbytes: int, log: list[str]) -> None:
        async with memory.hold(tenant, nbytes):
            log.append(f"{tenant} in")
            entered.set()
            await release.wait()

    log: list[str] = []
    a1 = asyncio.ensure_future(hold("a", 60, log))
    await entered.wait()
    a2 = asyncio.ensure_future(hold("a", 60, log))  # waits for a1: not refused
    await asyncio.sleep(0.05)
    assert log == ["a in"] and memory.held == 60
    with pytest.raises(APIError) as err:  # b would pass the bound beside a's job: at once
        async with memory.hold("b", 50):
            pass
    assert err.value.code == "gateway_busy"
    async with memory.hold("b", 40):  # within the bound beside a's: runs
        assert memory.held == 100
    release.set()
    await asyncio.gather(a1, a2)
    assert log == ["a in", "a in"] and memory.held == 0

    with pytest.raises(RuntimeError):  # a job that fails gives its memory back
        async with memory.hold("c", 100):
            raise RuntimeError("boom")
    assert memory.held == 0
