"""Clamp and ablate terms: parsing, validation, digests and latch specs (the fork's
clamp scenarios: bounds validation, one-sided bounds, value sugar, K cap, digests)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from steergate.engine.payload import decode_payload, encode_payload, steering_digest
from steergate.shared.clamp import Bounds, Resolved, check_per_point, point
from steergate.shared.errors import InvalidField
from steergate.shared.latch_spec import LatchSpec, clamp_items, decode_spec, latch_digest
from steergate.shared.steering import InlineTerm, ModelShape, parse_steering

SHAPE = ModelShape(hidden_size=4, num_layers=3)


def _term(**kw):
    return {"hook": "post_block", "layers": {"1": [3.0, 4.0, 0.0, 0.0]}, **kw}


def _parse(*terms):
    return parse_steering({"vectors": list(terms)}, SHAPE)


def _param(*terms) -> str:
    with pytest.raises(InvalidField) as err:
        _parse(*terms)
    return err.value.param or ""


def test_clamp_term_keeps_a_unit_direction_and_its_bounds() -> None:
    (term,) = _parse(_term(op="clamp", min=-1, max=2.5, strength=0.5)).terms
    assert isinstance(term, InlineTerm)
    assert term.clamp == Bounds(-1.0, 2.5, 0.5)
    np.testing.assert_allclose(term.layers[1], [0.6, 0.8, 0.0, 0.0], rtol=0, atol=1e-7)


def test_value_sugar_and_ablate() -> None:
    (v,) = _parse(_term(op="clamp", value=2)).terms
    (a,) = _parse(_term(op="ablate")).terms
    assert v.clamp == Bounds(2.0, 2.0, 1.0)
    assert a.clamp == Bounds(0.0, 0.0, 1.0)


def test_one_sided_bounds() -> None:
    (lo,) = _parse(_term(op="clamp", min=1)).terms
    (hi,) = _parse(_term(op="clamp", max=-1)).terms
    assert lo.clamp == Bounds(1.0, None, 1.0) and lo.clamp.floats() == (1.0, math.inf, 1.0)
    assert hi.clamp == Bounds(None, -1.0, 1.0) and hi.clamp.floats() == (-math.inf, -1.0, 1.0)


@pytest.mark.parametrize(
    ("term", "param"),
    [
        (_term(op="clamp", min=2, max=1), "steering.vectors[0].min"),
        (_term(op="clamp"), "steering.vectors[0].min"),
        (_term(op="clamp", min=math.inf), "steering.vectors[0].min"),
        (_term(op="clamp", max=math.nan), "steering.vectors[0].max"),
        (_term(op="clamp", value=1e39), "steering.vectors[0].value"),
        (_term(op="clamp", value=1, min=0), "steering.vectors[0].min"),
        (_term(op="clamp", value=True), "steering.vectors[0].value"),
        (_term(op="clamp", value=1, strength=1.5), "steering.vectors[0].strength"),
        (_term(op="clamp", value=1, strength=-0.1), "steering.vectors[0].strength"),
        (_term(op="ablate", value=1), "steering.vectors[0].value"),
        (_term(op="clamp", value=1, scale=2), "steering.vectors[0].scale"),
        (_term(op="erase"), "steering.vectors[0].op"),
        ({"hook": "post_block", "layers": {"1": [0.0] * 4}, "op": "ablate"},
         "steering.vectors[0].layers.1"),
        ({"name": "v", "op": "clamp", "min": 3, "max": 2}, "steering.vectors[0].min"),
    ],
)
def test_bad_clamps_name_the_field(term, param: str) -> None:
    assert _param(term) == param


def test_add_terms_are_unchanged_by_an_explicit_op_add() -> None:
    a = _parse(_term()).terms[0]
    b = _parse(_term(op="add")).terms[0]
    assert a.clamp is None and b.clamp is None
    np.testing.assert_array_equal(a.layers[1], b.layers[1])


def _resolved(site, n=1):
    return [Resolved(site, np.eye(4, dtype=np.float32)[i % 4], Bounds(0.0, 0.0)) for i in range(n)]


def test_k_cap_counts_per_point_with_merged_names() -> None:
    assert point(("pre_attn", 2)) == ("post_block", 1) and point(("pre_attn", 0)) == ("pre_attn", 0)
    check_per_point(_resolved(("post_block", 1), 2) + _resolved(("post_attn", 1), 2), 2)
    with pytest.raises(InvalidField) as err:
        check_per_point(_resolved(("post_block", 1), 2) + _resolved(("pre_attn", 2), 1), 2)
    assert err.value.status == 400 and "pre_attn layer 2" in str(err.value)


def test_payload_digest_changes_with_a_clamp_and_not_for_a_pure_add() -> None:
    sites = {("post_block", 1): np.ones(4, dtype=np.float32)}
    before = steering_digest("all", sites)  # what every add-only payload had
    text, digest = encode_payload("all", sites)
    assert digest == before and "clamps" not in text
    clamp = Resolved(("post_block", 1), np.eye(4, dtype=np.float32)[0], Bounds(None, 1.0, 0.5))
    text2, digest2 = encode_payload("all", sites, (clamp,))
    assert digest2 != digest
    other = Resolved(clamp.site, clamp.direction, Bounds(None, 1.0, 0.25))
    assert encode_payload("all", sites, (other,))[1] != digest2  # strength counts
    assert encode_payload("all", sites, (clamp, other))[1] != encode_payload(
        "all", sites, (other, clamp))[1]  # order counts
    back = decode_payload(text2)
    assert back.digest == digest2 and back.clamps[0].bounds == clamp.bounds
    np.testing.assert_array_equal(back.clamps[0].direction, clamp.direction)


def test_latch_spec_round_trips_clamps_by_value_and_by_reference() -> None:
    steering = _parse(_term(scale=2.0), _term(op="ablate"),
                      {"name": "bias", "op": "clamp", "max": 1.5, "strength": 0.5})
    items = clamp_items(steering.terms, lambda t: (f"T~{t.name}", "d1"))
    assert [i.ref for i in items] == [None, ("T~bias", "d1")]
    spec = LatchSpec("all", {("post_block", 1): np.ones(4, dtype=np.float32)}, (), items)
    back = decode_spec(spec.encode())
    assert back.digest == spec.digest and back.clamps[1].bounds == Bounds(None, 1.5, 0.5)
    assert spec.nbytes == 4 * 4 * 2 and spec.kind == "value"
    add_only = LatchSpec("all", dict(spec.sites))
    assert add_only.digest == latch_digest("all", spec.sites, ())  # unchanged for adds
    assert spec.digest != add_only.digest
    assert "clamps" not in add_only.encode()


def test_latch_bytes_count_inline_clamp_directions() -> None:
    steering = _parse(_term(), _term(op="ablate"), _term(op="clamp", value=1))
    assert steering.inline_latch_bytes(4) == 4 * 4 * 3
