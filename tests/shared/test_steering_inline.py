"""Inline steering arrays are converted and checked at C speed (issue 23, defect 2):
the same answers as the per-element checks they replace, for every kind of bad value."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from steergate.shared.errors import InvalidField
from steergate.shared.steering import ModelShape, inline_vector, parse_steering

P = "steering.vectors[0].layers.1"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([], "must be a non-empty array of numbers"),
        ("0.5", "must be a non-empty array of numbers"),
        ([0.5, True], "must contain only numbers"),
        ([False], "must contain only numbers"),
        ([0.5, None], "must contain only numbers"),
        ([0.5, "1.0"], "must contain only numbers"),  # numpy would convert the string
        ([[0.5, 0.5]], "must contain only numbers"),
        ([0.5, {"a": 1}], "must contain only numbers"),
        ([0.5, 10**400], "contains NaN or Inf"),  # past float64
        ([0.5, 1e39], "contains NaN or Inf"),  # past float32, where steering is applied
        ([0.5, float("nan")], "contains NaN or Inf"),
    ],
)
def test_bad_inline_values_are_refused_naming_the_array(values: Any, message: str) -> None:
    with pytest.raises(InvalidField) as exc:
        inline_vector(values, P)
    assert exc.value.param == P and message in exc.value.message


def test_ints_and_floats_convert_to_float32_exactly_as_before() -> None:
    vec = inline_vector([1, 0.5, -2, 3.25, 0], P)
    assert vec.dtype == np.float32
    assert vec.tolist() == [1.0, 0.5, -2.0, 3.25, 0.0]


def test_a_wrong_length_is_refused_before_its_elements_are_read() -> None:
    """A million-element array for a hidden size of 8 is refused on its length, even
    though its last element is not a number (it is never looked at)."""
    values: list[Any] = [0.5] * 1_000_000 + ["x"]
    with pytest.raises(InvalidField) as exc:
        parse_steering(
            {"vectors": [{"hook": "post_block", "layers": {"1": values}}]}, ModelShape(8, 4)
        )
    assert exc.value.param == P and "has length 1000001" in exc.value.message


def _packed(data: str, dtype: str = "float32") -> dict[str, Any]:
    packed = {"dtype": dtype, "shape": [1, 8], "layer_indices": [1], "data": data}
    return {"vectors": [{"hook": "post_block", "packed": packed}]}


def test_packed_data_of_the_wrong_length_is_refused_before_it_is_decoded() -> None:
    """8 float32 values are 32 bytes, 44 base64 characters; 7.8 MB of base64 that is
    invalid only at its end is refused on its length."""
    with pytest.raises(InvalidField) as exc:
        parse_steering(_packed("A" * 7_800_000 + "!"), ModelShape(8, 4))
    assert exc.value.param == "steering.vectors[0].packed.data"
    assert "holds 7800001 base64 characters but shape needs 32 bytes (44" in exc.value.message


@pytest.mark.parametrize(
    ("data", "dtype", "message"),
    [
        ("A" * 43 + "!", "float32", "is not valid base64"),
        ("A" * 43 + "=", "float32", None),  # 32 bytes of zeros and padding: accepted
        ("A" * 22 + "==", "float16", None),  # 16 bytes
        # 24 characters, as 16 bytes need, but they decode to 18: the decoder's check.
        ("A" * 24, "float16", "holds 18 bytes but shape needs 16 (float16)"),
    ],
)
def test_packed_data_of_the_right_length_is_decoded_as_before(
    data: str, dtype: str, message: str | None
) -> None:
    if message is None:
        parsed = parse_steering(_packed(data, dtype), ModelShape(8, 4))
        assert parsed.terms[0].layers[1].shape == (8,)  # type: ignore[union-attr]
        return
    with pytest.raises(InvalidField) as exc:
        parse_steering(_packed(data, dtype), ModelShape(8, 4))
    assert message in exc.value.message


def test_a_sum_that_overflows_is_left_to_the_range_check_without_a_numpy_warning() -> None:
    """Found from outside: two terms near float32's maximum at one site printed numpy's
    RuntimeWarning into the server log before the (correct) 400."""
    import warnings

    from steergate.shared.latch_spec import accumulate

    sites: dict = {}
    big = np.full(4, 3e38, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        accumulate(sites, ("post_block", 1), big, np.float32(1.0))
        accumulate(sites, ("post_block", 1), big, np.float32(1.0))
    assert np.isinf(sites[("post_block", 1)]).all()
