"""The Lua scripts, each loaded once per client with ``register_script``.

redis-py's Script objects call EVALSHA and reload on NOSCRIPT (a restarted Redis),
so scripts survive a Redis restart without gateway code knowing about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from steergate.gateway.store.connection import Redis, lua_source


@dataclass(frozen=True)
class Scripts:
    admit_request: Any
    settle_request: Any
    drop_latch: Any
    keep_latch: Any
    put_vector: Any
    drop_vector: Any
    renew_leases: Any

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        return cls(
            **{name: redis.register_script(lua_source(name)) for name in cls.__dataclass_fields__}
        )


async def evalsha(script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """Run ``script`` with one EVALSHA on its own client, reloading it on NOSCRIPT.

    The same as calling the Script object, minus its per-call overhead (an import and
    an ``isinstance`` check against a typing Protocol, ~20 us): this is the hot path's
    only Redis round trip."""
    client = script.registered_client
    try:
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    except NoScriptError:
        script.sha = await client.script_load(script.script)
        return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
