"""Named steering vectors, keyed by (already tenant-scoped) name.

A vector's identity is its content digest (:func:`shared.codecs.vector_digest`):
by-reference latches store it and are dropped when the name later points at other
content, so re-registering a name can never silently change a latched
conversation's steering. Lives in the API-server process next to the latch
controller; pure, no vLLM import.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from steergate.shared.codecs import encode_packed, vector_digest
from steergate.shared.engine_api import DEFAULT_MAX_VECTOR_BYTES, DEFAULT_MAX_VECTORS

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class NamedVector:
    name: str
    hook: str
    layers: Mapping[int, np.ndarray]  # float32, read-only
    digest: str
    description: str | None
    created: float
    updated: float

    @property
    def nbytes(self) -> int:
        """4 x hidden x layers: what the vector costs to keep (tenant quota unit)."""
        return FLOAT32_BYTES * sum(int(v.size) for v in self.layers.values())

    def metadata(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hook": self.hook,
            "layers": sorted(self.layers),
            "digest": self.digest,
            "bytes": self.nbytes,
            "description": self.description,
            "created": self.created,
            "updated": self.updated,
        }

    def with_data(self) -> dict[str, Any]:
        """Metadata plus the values as the contract's ``packed`` form, which a PUT
        accepts back unchanged (exact float32, unlike decimal JSON)."""
        indices = sorted(self.layers)
        matrix = np.stack([self.layers[i] for i in indices])
        return {**self.metadata(), "packed": encode_packed(matrix, indices)}


class VectorRegistry:
    """A bounded cache (``max_count`` vectors, ``max_bytes``), least recently used
    evicted: the gateway keeps every tenant's vectors in Redis and installs one again
    when a request names a vector this engine no longer holds (409 ``vector_missing``).
    Use (``get``, ``digest_of``) counts as recent. One vector larger than ``max_bytes``
    is kept alone: the cap bounds what is kept beside what is in use."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        max_count: int = DEFAULT_MAX_VECTORS,
        max_bytes: int = DEFAULT_MAX_VECTOR_BYTES,
    ) -> None:
        self._vectors: OrderedDict[str, NamedVector] = OrderedDict()
        self._clock = clock
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evictions = 0

    def put(
        self, name: str, hook: str, layers: Mapping[int, np.ndarray], description: str | None = None
    ) -> tuple[NamedVector, bool]:
        """Store or overwrite; returns (vector, created)."""
        frozen: dict[int, np.ndarray] = {}
        for layer, vec in layers.items():
            arr = np.array(vec, dtype=np.float32, copy=True)
            arr.setflags(write=False)  # latches and payloads share these arrays
            frozen[int(layer)] = arr
        now = self._clock()
        previous = self._vectors.get(name)
        vector = NamedVector(
            name=name,
            hook=hook,
            layers=frozen,
            digest=vector_digest(hook, frozen),
            description=description,
            created=previous.created if previous else now,
            updated=now,
        )
        self._vectors[name] = vector
        self._vectors.move_to_end(name)
        self.nbytes += vector.nbytes - (previous.nbytes if previous else 0)
        while len(self._vectors) > 1 and (
            len(self._vectors) > self.max_count or self.nbytes > self.max_bytes
        ):
            _, oldest = self._vectors.popitem(last=False)  # never the one just put
            self.nbytes -= oldest.nbytes
            self.evictions += 1
        return vector, previous is None

    def get(self, name: str) -> NamedVector | None:
        vector = self._vectors.get(name)
        if vector is not None:
            self._vectors.move_to_end(name)
        return vector

    def digest_of(self, name: str) -> str | None:
        vector = self.get(name)
        return vector.digest if vector else None

    def delete(self, name: str) -> bool:
        vector = self._vectors.pop(name, None)
        if vector is None:
            return False
        self.nbytes -= vector.nbytes
        return True

    def status(self) -> dict[str, int]:
        return {
            "vectors": len(self._vectors),
            "vector_bytes": self.nbytes,
            "max_vectors": self.max_count,
            "max_vector_bytes": self.max_bytes,
            "vector_evictions": self.evictions,
        }

    def list(self, prefix: str = "") -> list[NamedVector]:
        return [v for name, v in sorted(self._vectors.items()) if name.startswith(prefix)]
