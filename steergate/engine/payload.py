"""The per-request steering payload the API server hands to the workers.

It travels as ``SamplingParams.extra_args["steergate"]`` (from the request's
``vllm_xargs``), a JSON string: every rank of a tensor-parallel group receives the
same bytes, so every rank applies identical steering without any coordination.

Terms are already resolved (names looked up, scales applied) and summed per
(hook, layer) site, so a worker only copies vectors into its tables.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from steergate.shared.clamp import Resolved, decode_resolved, encode_resolved, update_digest
from steergate.shared.codecs import b64_to_f32, f32_to_b64
from steergate.shared.positions import is_phase
from steergate.shared.steering import HOOKS

XARGS_KEY = "steergate"
VERSION = 1

Site = tuple[str, int]


@dataclass(frozen=True)
class Payload:
    phase: str
    sites: dict[Site, np.ndarray]
    digest: str
    #: Directional clamps in the order they apply (steergate/shared/clamp.py).
    clamps: tuple[Resolved, ...] = ()


def steering_digest(
    phase: str, sites: Mapping[Site, np.ndarray], clamps: tuple[Resolved, ...] = ()
) -> str:
    """Identity of an effective steering: equal digests steer identically, so
    workers share a table slot between them and the prefix cache may be shared."""
    h = hashlib.sha256(phase.encode())
    for hook, layer in sorted(sites):
        h.update(f"|{hook}:{layer}|".encode())
        h.update(np.asarray(sites[(hook, layer)], dtype="<f4").tobytes())
    if clamps:  # mixed in only when present: a pure add's digest is unchanged
        update_digest(h, clamps)
    return h.hexdigest()


def encode_payload(
    phase: str, sites: Mapping[Site, np.ndarray], clamps: tuple[Resolved, ...] = ()
) -> tuple[str, str]:
    """(JSON string for ``vllm_xargs``, digest)."""
    digest = steering_digest(phase, sites, clamps)
    doc = {
        "v": VERSION,
        "digest": digest,
        "phase": phase,
        "sites": [[hook, layer, f32_to_b64(sites[(hook, layer)])] for hook, layer in sorted(sites)],
    }
    if clamps:
        doc["clamps"] = encode_resolved(clamps)
    return json.dumps(doc, separators=(",", ":")), digest


def decode_payload(text: str, hidden_size: int | None = None) -> Payload:
    """A worker's read of the API server's payload, checked in full before a table
    slot is given to it (ValueError otherwise): its phase, hooks and, with
    ``hidden_size``, every vector's length, and its digest recomputed. Workers share a
    slot between requests of one digest, so a digest that did not match its vectors
    would steer other requests with them; a bad length or phase raised inside the
    step's table fill, in the engine core."""
    doc = json.loads(text)
    if doc.get("v") != VERSION:
        raise ValueError(f"unsupported steering payload version {doc.get('v')!r}")
    sites = {(str(h), int(layer)): b64_to_f32(data) for h, layer, data in doc["sites"]}
    clamps = decode_resolved(doc.get("clamps", ()))
    phase = str(doc["phase"])
    if not is_phase(phase):
        raise ValueError(f"not a steering phase: {phase!r}")
    for hook, _ in (*sites, *(c.site for c in clamps)):
        if hook not in HOOKS:
            raise ValueError(f"not a hook: {hook!r}")
    if hidden_size is not None:
        vectors = (*sites.values(), *(c.direction for c in clamps))
        if any(v.shape != (hidden_size,) for v in vectors):
            raise ValueError(f"a vector is not {hidden_size} long")
    digest = steering_digest(phase, sites, clamps)
    if doc["digest"] != digest:
        raise ValueError("the digest does not match the steering")
    return Payload(phase=phase, sites=sites, digest=digest, clamps=clamps)
