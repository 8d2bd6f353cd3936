"""Bad numbers and odd input at the shared parsers (issue 9, item 8): each is a 400
naming the field, never a 500 and never a silently different meaning."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest

from steergate.shared.errors import InvalidField
from steergate.shared.jsondepth import MAX_JSON_DEPTH, check_json_depth, json_too_deep
from steergate.shared.steering import (
    FLOAT32_MAX,
    STEER_ABS_MAX,
    ModelShape,
    SteeringBound,
    check_sites_finite,
    parse_steering,
    parse_vector_body,
)

SHAPE = ModelShape(hidden_size=8, num_layers=4)


def steer(layers: dict[str, Any] | None = None, **term: Any) -> dict[str, Any]:
    layers = layers if layers is not None else {"1": [0.5] * 8}
    return {"vectors": [{"hook": "post_block", "layers": layers, **term}]}


def rejected(obj: Any) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        parse_steering(obj, SHAPE)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("scale", [1e300, -1e300, 3.5e38, 10**400, -(10**39)])
def test_a_scale_that_is_inf_in_float32_is_a_400_naming_scale(scale: Any) -> None:
    """1e300 is finite as a float64 and was latched as Inf (output empty)."""
    err = rejected(steer(scale=scale))
    assert err.param == "steering.vectors[0].scale"


def test_the_largest_float32_scale_is_accepted_when_the_product_stays_finite() -> None:
    term = parse_steering(steer({"1": [0.0] * 8}, scale=FLOAT32_MAX), SHAPE).terms[0]
    assert term.scale == FLOAT32_MAX


def test_a_scale_times_vector_that_overflows_float32_is_a_400() -> None:
    err = rejected(steer({"1": [3e38] * 8}, scale=2))
    assert err.param == "steering.vectors[0].scale" and "overflows" in err.message


def test_a_summed_steering_that_overflows_float32_is_refused() -> None:
    big = np.full(8, 3e38, dtype=np.float32)
    with np.errstate(over="ignore"):
        total = big + big
    bound = SteeringBound("float32", 30)
    for summed in (total, big, np.full(8, np.nan, dtype=np.float32)):
        with pytest.raises(InvalidField):
            check_sites_finite({("post_block", 1): summed}, bound)


def test_the_bound_keeps_every_point_at_once_within_the_models_range() -> None:
    """Found from outside: each point of the stream within float32 was not enough. 3e38
    at 8 points of a 4-layer model summed to inf in the stream, and the NaN hidden
    states reached KV-cache blocks that other tenants' requests were given next. Every
    point at once now stays within half the dtype's range, and never past 1e6."""
    assert STEER_ABS_MAX == 1e6
    for dtype, layers in [("float32", 4), ("bfloat16", 30), ("float32", 400)]:
        assert SteeringBound(dtype, layers).limit == STEER_ABS_MAX
    f16 = SteeringBound("float16", 30)
    assert f16.limit == 65504.0 / (2 * 61)  # 61 points of the stream
    assert 61 * f16.limit <= 65504.0 / 2
    bound = SteeringBound("float32", 4)
    check_sites_finite({("post_block", 1): np.full(8, 1e6, dtype=np.float32)}, bound)
    with pytest.raises(InvalidField, match="reaches 1.1e\\+06 in one element"):
        check_sites_finite({("post_attn", 0): np.full(8, 1.1e6, dtype=np.float32)}, bound)
    # post_block 1 and pre_attn 2 are one point: 6e5 each is 1.2e6 there
    half = np.full(8, 6e5, dtype=np.float32)
    with pytest.raises(InvalidField, match="same point as pre_attn layer 2"):
        check_sites_finite({("post_block", 1): half, ("pre_attn", 2): half}, bound)


@pytest.mark.parametrize(
    "key",
    [
        "²",
        "١",
        "１",
        "1²",
        "01",
        "-1",
        "+1",
        " 1",
        "1 ",
        "1\n",
        "1.0",
        "1e0",
        "0x1",
        "",
        "1_0",
        "1" * 10,
        "9" * 5000,
    ],
)
def test_a_layer_key_that_is_not_ascii_decimal_is_a_400_never_500_nor_another_layer(
    key: str,
) -> None:
    """ "²" used to be a 500 (isdigit true, int() fails); "١" was taken as layer 1."""
    err = rejected(steer({key: [0.5] * 8}))
    assert err.param is not None and err.param.startswith("steering.vectors[0].layers")


def test_layer_values_past_float64_are_a_400() -> None:
    """Python's json parses a 400-digit integer; numpy then raised OverflowError."""
    err = rejected(steer({"1": [10**400] * 8}))
    assert err.param == "steering.vectors[0].layers.1"


def test_vector_bodies_get_the_same_layer_key_check() -> None:
    with pytest.raises(InvalidField) as info:
        parse_vector_body({"hook": "post_block", "layers": {"١": [0.5] * 8}}, SHAPE)
    assert info.value.param is not None and info.value.param.startswith("layers")


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return (
        b'{"a":' * (depth // 2)
        + b"[" * (depth - depth // 2)
        + inner
        + b"]" * (depth - depth // 2)
        + b"}" * (depth // 2)
    )


def test_json_nested_1000_deep_is_a_400_invalid_json_before_parsing() -> None:
    raw = b"[" * 1000 + b"]" * 1000
    with pytest.raises(InvalidField) as info:
        check_json_depth(raw)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "invalid_json", "body")
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_the_depth_bound_is_exact_and_both_parsers_handle_what_it_lets_through() -> None:
    ok = nested(MAX_JSON_DEPTH)
    assert not json_too_deep(ok) and json_too_deep(nested(MAX_JSON_DEPTH + 1))
    # Everything the bound admits survives both sides' parsers and re-serializers.
    assert orjson.loads(orjson.dumps(orjson.loads(ok))) == json.loads(ok)


def test_brackets_inside_strings_do_not_count() -> None:
    inner = json.dumps("[" * 500 + '\\"{' * 100).encode()
    assert not json_too_deep(b'{"content": ' + inner + b"}")
    # An escaped quote does not end the string; an escaped backslash before one does.
    assert not json_too_deep(b'["\\"' + b"[" * 100 + b'"]')
    assert json_too_deep(b'["\\\\",' + b"[" * 100 + b"]" * 100 + b"]")


def test_many_shallow_arrays_are_fine() -> None:
    doc = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * 5000}
    assert not json_too_deep(json.dumps(doc).encode())


def test_an_unknown_key_is_named_not_echoed_whole() -> None:
    """A megabyte key came back twice in the error (param and message), and bodies past
    64 KiB skipped the error-shape rewrite: every parser quotes at most 64 characters."""
    from steergate.shared.capture import parse_capture
    from steergate.shared.errors import MAX_QUOTED_KEY, reject_unknown

    key = "k" * 1_000_000
    cases = [
        lambda: parse_steering({"vectors": [{"hook": "post_block", key: 1}]}, SHAPE),
        lambda: parse_steering({"vectors": [], "tokens": {key: 1}}, SHAPE),
        lambda: parse_capture({"sites": [], key: 1}, SHAPE),
        lambda: reject_unknown({key: 1}, ("name",)),
    ]
    for case in cases:
        with pytest.raises(InvalidField) as info:
            case()
        param = info.value.param or ""
        assert param.endswith("k" * MAX_QUOTED_KEY + "...") and len(param) < 100, param[:120]
        assert len(info.value.message) < 200
