"""The workers' read of a steering payload (``engine/payload.py`` ``decode_payload``,
``worker/runner.py`` ``payload_of``): checked in full before a table slot is given.
A payload whose digest did not match its vectors shared the slot of the requests that
have that digest (steering them with its vectors); a wrong length or phase raised in
the step's table fill, inside the engine core, for every request in the batch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from steergate.engine.payload import XARGS_KEY, decode_payload, encode_payload
from steergate.engine.worker.runner import payload_of
from steergate.shared.clamp import Bounds, Resolved
from steergate.shared.codecs import f32_to_b64

H = 8
SITES = {("post_block", 1): np.full(H, 0.5, np.float32), ("pre_attn", 3): np.ones(H, np.float32)}
CLAMPS = (Resolved(("post_attn", 2), np.eye(H, dtype=np.float32)[0], Bounds(None, 1.0, 0.5)),)


def _forged(**change: object) -> str:
    text, _ = encode_payload("prefill", SITES, CLAMPS)
    doc = json.loads(text)
    doc.update(change)
    return json.dumps(doc)


def test_a_genuine_payload_round_trips_with_its_digest() -> None:
    text, digest = encode_payload("tokens:*:0:*", SITES, CLAMPS)
    p = decode_payload(text, H)
    assert p.digest == digest and p.phase == "tokens:*:0:*"
    np.testing.assert_array_equal(p.sites[("post_block", 1)], SITES[("post_block", 1)])
    assert p.clamps[0].bounds == CLAMPS[0].bounds


@pytest.mark.parametrize(
    ("change", "why"),
    [
        # another request's digest on these vectors: it would share that request's slot
        (
            {"digest": encode_payload("prefill", {("post_block", 1): np.zeros(H, np.float32)})[1]},
            "digest",
        ),
        ({"sites": [["post_block", 1, f32_to_b64(np.full(H, 9.0, np.float32))]]}, "digest"),
        ({"phase": "bogus"}, "phase"),
        ({"sites": [["pre_mlp", 1, f32_to_b64(np.ones(H, np.float32))]]}, "hook"),
        ({"sites": [["post_block", 1, f32_to_b64(np.ones(3, np.float32))]]}, "long"),
    ],
)
def test_a_forged_or_broken_payload_is_refused_and_served_unsteered(
    change: dict[str, object], why: str
) -> None:
    text = _forged(**change)
    with pytest.raises(ValueError, match=why):
        decode_payload(text, H)
    params = SimpleNamespace(extra_args={XARGS_KEY: text})
    assert payload_of(params, "req-1", H) is None  # logged; the engine core goes on
