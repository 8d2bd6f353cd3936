"""Large inference and vector-upload bodies parsed and validated in worker processes,
one at a time per tenant, so that one tenant's bodies never hold the event loop that
serves the others.

Why processes: parsing JSON builds a Python object per number (orjson: ~50 ms for a
7.8 MB body of short numbers), and neither orjson nor numpy's list conversion releases
the GIL, so a worker *thread* holds the event loop for just as long (issue 23: another
tenant's p95 went from 5 ms to 0.2–2 s). In a worker process that time is spent on
another core, or at worst shared by the OS scheduler, never in the loop's thread.

What comes back is small to unpickle: the body (its strings are copied, not parsed)
and the validated :class:`SteeringRequest` (numpy arrays, copied as bytes); inline
arrays that reach the pickle are bounded by the :class:`InlineBudget`, because the
worker refuses larger ones first. Errors come back as (param, message, code).

Why per tenant: a bounded pool shared by every tenant would let one tenant's queue
of large bodies delay another's; with one parse in flight per tenant (per gateway
process), a tenant that sends many large bodies waits for its own.

See docs/gateway.md ("Large bodies") for the measurements behind this.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import orjson

from steergate.gateway.admission.request_scoping import Head, InlineBudget, prescan
from steergate.gateway.admission.turns import TenantTurns
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.jsondepth import check_json_depth
from steergate.shared.steering import (
    ModelShape,
    SteeringRequest,
    parse_steering,
    parse_vector_body,
)

log = logging.getLogger("steergate.gateway.bodies")

#: Bodies up to this size are parsed on the event loop: at most ~1 ms of orjson, and
#: their inline steering (bounded by the budget) converts in about as long. Larger
#: ones go to a worker process (a round trip costs ~2 ms plus ~1 ms per MB copied).
OFF_LOOP_BYTES = 256 * 1024
#: A route's check of a parsed body (``request_shape.check_chat`` ...): raises a 400.
BodyCheck = Callable[[Mapping[str, Any]], None]


@dataclass(frozen=True)
class Parsed:
    """A body parsed off the loop; ``steering`` is validated against the shape given,
    ``head`` is what ``prescan`` read from it (the route does not scan it again)."""

    body: dict[str, Any]
    steering: SteeringRequest | None
    head: Head
    shape: ModelShape | None


#: Bodies up to this size get the path of a number too large to parse (a second parse,
#: only on that error); a larger one is told the fault without the path.
LOCATE_NUMBER_BYTES = 1024 * 1024


def parse_body(raw: bytes) -> dict[str, Any]:
    """The contract's JSON object checks (depth, syntax, object), for any route."""
    check_json_depth(raw)  # 1,000-deep JSON parses, then 500s in orjson.dumps
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("number is infinity"):
            # Valid JSON (``1e400``, a 400-digit integer) that no double holds: a field
            # fault, not a syntax one.
            if raw.lstrip()[:1] != b"{":
                raise InvalidField(
                    "body", "The request body must be a JSON object.", "invalid_json"
                ) from exc
            param = number_out_of_range(raw) if len(raw) <= LOCATE_NUMBER_BYTES else None
            raise InvalidField(
                param or "body",
                f"'{param}' is a number too large to represent (beyond a double's range)"
                if param
                else "The request body holds a number too large to represent "
                "(beyond a double's range).",
            ) from exc
        raise InvalidField("body", "The request body is not valid JSON.", "invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidField("body", "The request body must be a JSON object.", "invalid_json")
    return body


def number_out_of_range(raw: bytes) -> str | None:
    """The path (``messages[0].max_tokens`` style) of the first number in ``raw`` that
    is infinite as a double, or None. Python's parser keeps such numbers (an int as an
    int, a float as ``inf``); orjson refuses them."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", doc)] if isinstance(doc, dict) else []
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
        elif isinstance(value, float) and math.isinf(value):
            return path
        elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
            try:
                float(value)
            except OverflowError:  # past a double's largest finite value
                return path
    return None


def parse_in_worker(
    raw: bytes, shape: ModelShape | None, budget: InlineBudget, check: BodyCheck | None = None
) -> tuple[Any, ...]:
    """Run in a worker process: ``("ok", body, steering, head)`` or ``("error", param,
    message, code)`` (exceptions with their own ``__init__`` do not unpickle). The
    checks run in the route's order: ``prescan`` (the inline budget, from lengths,
    before any conversion), ``check`` (the route's request shape), then ``steering``."""
    try:
        body = parse_body(raw)
        head = prescan(body, budget)
        if check is not None:
            check(body)
        steering = None
        if body.get("steering") is not None:
            steering = parse_steering(body["steering"], shape)
        return ("ok", body, steering, head)
    except APIError as exc:
        return ("error", exc.param, exc.message, exc.code)


def vector_in_worker(raw: bytes, shape: ModelShape | None) -> tuple[Any, ...]:
    """A vector upload's JSON body (``parse_vector_body``) in a worker process:
    ``("ok", hook, layers, description)`` or the error as in :func:`parse_in_worker`."""
    try:
        return ("ok", *parse_vector_body(parse_body(raw), shape))
    except APIError as exc:
        return ("error", exc.param, exc.message, exc.code)


#: How often a worker checks that the gateway that started it is still alive.
PARENT_POLL_S = 1.0


def exit_with_parent(parent_pid: int, poll_s: float = PARENT_POLL_S) -> None:
    """A worker's initializer: it exits once its gateway is gone. A gateway killed
    outright (the OOM killer, SIGKILL after a grace period) left its workers running,
    reparented to init, for good."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="steergate-parent-watch", daemon=True).start()


class BodyParser:
    """The worker processes (owned by the app's lifespan) and the per-tenant turns."""

    def __init__(self, workers: int, budget: InlineBudget) -> None:
        self.workers = workers
        self.budget = budget
        self._pool: ProcessPoolExecutor | None = None
        self._turns = TenantTurns()

    def start(self) -> None:
        # spawn, not fork: the gateway process has threads (the executor's, Redis's).
        spawn = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(
            self.workers, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(),)
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def parse(
        self,
        raw: bytes,
        tenant_id: str,
        shape: ModelShape | None,
        check: BodyCheck | None = None,
    ) -> Parsed:
        """Parse and validate ``raw`` in a worker once this tenant's earlier large
        bodies are done (``check``, a module-level function, runs there too); raises
        the contract's 400 for what the worker refused."""
        result = await self._call(tenant_id, parse_in_worker, raw, shape, self.budget, check)
        return Parsed(result[0], result[1], result[2], shape)

    async def parse_vector(
        self, raw: bytes, tenant_id: str, shape: ModelShape | None
    ) -> tuple[str, dict[int, Any], str | None]:
        """A vector upload's ``(hook, layers, description)``, parsed the same way."""
        hook, layers, description = await self._call(tenant_id, vector_in_worker, raw, shape)
        return hook, layers, description

    async def _call(self, tenant_id: str, fn: Any, *args: Any) -> tuple[Any, ...]:
        async with self._turns.turn(tenant_id):
            result = await self._run(fn, *args)
        if result[0] == "error":
            _, param, message, code = result
            raise InvalidField(param, message, code)
        return tuple(result[1:])

    async def _run(self, fn: Any, *args: Any) -> tuple[Any, ...]:
        if not self.workers:  # configured off: on the event loop (measured in the docs)
            return fn(*args)  # type: ignore[no-any-return]
        if self._pool is None:
            self.start()
        assert self._pool is not None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except BrokenProcessPool as exc:  # a worker died (killed, out of memory)
            log.error("body parser pool broken; starting a new one")
            self.close()
            raise APIError("internal_error", "The request body could not be parsed.") from exc
