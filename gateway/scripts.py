"""The Lua scripts, each loaded once per client with ``register_script``.

redis-py's Script objects call EVALSHA and reload on NOSCRIPT (a restarted Redis),
so scripts survive a Redis restart without gateway code knowing about it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.store import Redis, lua_source


@dataclass(frozen=True)
class Scripts:
    admit_request: Any
    settle_request: Any
    drop_latch: Any
    put_vector: Any
    sync_latches: Any

    @classmethod
    def load(cls, redis: Redis) -> Scripts:
        return cls(
            **{name: redis.register_script(lua_source(name)) for name in cls.__dataclass_fields__}
        )
