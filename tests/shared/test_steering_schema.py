"""The steering schema: every contract 400 names its field; valid input decodes exactly."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from steergate.shared.codecs import encode_packed
from steergate.shared.errors import InvalidField
from steergate.shared.steering import (
    InlineTerm,
    ModelShape,
    NamedTerm,
    parse_steering,
    parse_vector_body,
)

SHAPE = ModelShape(hidden_size=8, num_layers=4)


def vec(value: float = 0.5) -> list[float]:
    return [value] * SHAPE.hidden_size


def rejects(obj: object, param: str) -> InvalidField:
    with pytest.raises(InvalidField) as info:
        parse_steering(obj, SHAPE)
    assert info.value.param == param, info.value.message
    assert info.value.status == 400
    return info.value


def test_named_inline_and_packed_terms_decode_to_float32() -> None:
    packed = encode_packed(np.array([vec(1.0), vec(2.0)]), [1, 3], "float16")
    req = parse_steering(
        {
            "vectors": [
                {"name": "calm", "scale": 4},
                {"hook": "post_block", "layers": {"2": vec(0.25)}},
                {"hook": "post_attn", "packed": packed, "scale": -1.5},
            ],
            "phase": "decode",
            "latch": False,
        },
        SHAPE,
    )
    named, inline, packed_term = req.terms
    assert named == NamedTerm(name="calm", scale=4.0, index=0)
    assert isinstance(inline, InlineTerm) and inline.scale == 1.0
    np.testing.assert_array_equal(inline.layers[2], np.full(8, 0.25, np.float32))
    assert isinstance(packed_term, InlineTerm)
    assert sorted(packed_term.layers) == [1, 3]
    np.testing.assert_array_equal(packed_term.layers[3], np.full(8, 2.0, np.float32))
    assert req.phase == "decode"
    assert req.names == ["calm"]


def test_latch_bytes_count_distinct_inline_sites_once() -> None:
    req = parse_steering(
        {
            "vectors": [
                {"hook": "post_block", "layers": {"2": vec(), "3": vec()}},
                {"hook": "post_block", "layers": {"2": vec()}},
                {"hook": "pre_attn", "layers": {"2": vec()}},
                {"name": "x"},
            ]
        },
        SHAPE,
    )
    assert req.inline_latch_bytes(SHAPE.hidden_size) == 4 * 8 * 3


def test_bfloat16_packed_is_widened_exactly() -> None:
    values = np.array([[1.0, -2.0, 0.5, 3.0, 0.0, 8.0, -0.25, 1.5]], np.float32)
    packed = encode_packed(values, [0], "bfloat16")
    req = parse_steering({"vectors": [{"hook": "pre_attn", "packed": packed}]}, SHAPE)
    np.testing.assert_array_equal(req.terms[0].layers[0], values[0])


@pytest.mark.parametrize(
    ("obj", "param"),
    [
        ("calm", "steering"),
        ({"vectors": [{"hook": "mid_block", "layers": {"0": vec()}}]}, "steering.vectors[0].hook"),
        (
            {"vectors": [{"hook": "post_block", "layers": {"4": vec()}}]},
            "steering.vectors[0].layers.4",
        ),
        (
            {"vectors": [{"hook": "post_block", "layers": {"-1": vec()}}]},
            "steering.vectors[0].layers.-1",
        ),
        (
            {"vectors": [{"hook": "post_block", "layers": {"1": [0.1] * 7}}]},
            "steering.vectors[0].layers.1",
        ),
        (
            {"vectors": [{"hook": "post_block", "layers": {"1": [*vec()[:7], float("nan")]}}]},
            "steering.vectors[0].layers.1",
        ),
        (
            {"vectors": [{"hook": "post_block", "layers": {"1": [*vec()[:7], 1e39]}}]},
            "steering.vectors[0].layers.1",
        ),
        (
            {"vectors": [{"hook": "post_block", "layers": {"1": [*vec()[:7], "x"]}}]},
            "steering.vectors[0].layers.1",
        ),
        ({"vectors": [{"name": "a", "scale": float("inf")}]}, "steering.vectors[0].scale"),
        ({"vectors": [{"name": "a", "scale": True}]}, "steering.vectors[0].scale"),
        ({"vectors": [{"name": "a"}], "phase": "later"}, "steering.phase"),
        ({"vectors": [{"name": "a"}], "latch": "yes"}, "steering.latch"),
        ({"vectors": [{"name": "a"}] * 257}, "steering.vectors"),
        ({"vectors": [], "latch": True}, "steering.vectors"),
        ({"vectors": [{"hook": "post_block"}]}, "steering.vectors[0].layers"),
        ({"vectors": [{"name": "a", "scal": 2}]}, "steering.vectors[0].scal"),
        ({"vectors": [{"name": "a"}], "extra": 1}, "steering.extra"),
    ],
)
def test_invalid_steering_names_the_field(obj: object, param: str) -> None:
    rejects(obj, param)


def packed(**over: object) -> dict:
    base = encode_packed(np.ones((2, 8), np.float32), [0, 1])
    base.update(over)
    return {"vectors": [{"hook": "post_attn", "packed": base}]}


@pytest.mark.parametrize(
    ("obj", "param"),
    [
        (packed(data="!!notbase64!!"), "steering.vectors[0].packed.data"),
        (packed(data=base64.b64encode(b"\0" * 12).decode()), "steering.vectors[0].packed.data"),
        (packed(shape=[3, 8]), "steering.vectors[0].packed.layer_indices"),
        (packed(shape=[2, 16]), "steering.vectors[0].packed.shape"),
        (packed(dtype="int8"), "steering.vectors[0].packed.dtype"),
        # Unhashable: a dict lookup raised TypeError (a 500) before this was checked.
        (packed(dtype=["float32"]), "steering.vectors[0].packed.dtype"),
        (packed(dtype={"float32": 4}), "steering.vectors[0].packed.dtype"),
        (packed(layer_indices=[0, 9]), "steering.vectors[0].packed.layer_indices"),
        (packed(layer_indices=[1, 1]), "steering.vectors[0].packed.layer_indices"),
        (
            packed(data=base64.b64encode(np.full(16, np.nan, np.float32).tobytes()).decode()),
            "steering.vectors[0].packed.data",
        ),
    ],
)
def test_invalid_packed_names_the_field(obj: object, param: str) -> None:
    rejects(obj, param)


def test_structure_only_validation_skips_model_bounds() -> None:
    req = parse_steering({"vectors": [{"hook": "pre_attn", "layers": {"40": [1.0, 2.0]}}]}, None)
    assert list(req.terms[0].layers) == [40]


def test_vector_body_accepts_description_and_rejects_unknown_fields() -> None:
    hook, layers, desc = parse_vector_body(
        {"hook": "post_block", "layers": {"1": vec()}, "description": "calm"}, SHAPE
    )
    assert (hook, list(layers), desc) == ("post_block", [1], "calm")
    with pytest.raises(InvalidField) as info:
        parse_vector_body({"hook": "post_block", "layers": {"1": vec()}, "nme": "x"}, SHAPE)
    assert info.value.param == "nme"
