"""The shared ``capture`` parser, its bounds, and the answer's encoder/decoder."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from steergate.shared.capture import (
    MAX_SITES,
    CaptureLimits,
    CaptureSpec,
    answer_bytes,
    capture_answer,
    check_capture_bytes,
    check_up_front,
    decode_capture,
    encode_site,
    parse_capture,
    reduce_rows,
)
from steergate.shared.errors import APIError, InvalidField
from steergate.shared.steering import ModelShape

SHAPE = ModelShape(hidden_size=8, num_layers=4)


def _param(exc: pytest.ExceptionInfo[APIError]) -> tuple[str, str | None]:
    return exc.value.code, exc.value.param


def test_defaults_are_prompt_and_mean_and_sites_keep_request_order() -> None:
    spec = parse_capture(
        {"sites": [{"hook": "post_block", "layers": [3, 1]}, {"hook": "pre_attn", "layers": [0]}]},
        SHAPE,
    )
    assert spec == CaptureSpec(
        sites=(("post_block", 3), ("post_block", 1), ("pre_attn", 0)),
        tokens="prompt",
        reduce="mean",
    )
    assert parse_capture(spec.to_json(), SHAPE) == spec


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], "capture"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}], "extra": 1}, "capture.extra"),
        ({"sites": []}, "capture.sites"),
        ({"sites": "x"}, "capture.sites"),
        ({}, "capture.sites"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}], "tokens": "some"}, "capture.tokens"),
        ({"sites": [{"hook": "pre_attn", "layers": [0]}], "reduce": "max"}, "capture.reduce"),
        ({"sites": [7]}, "capture.sites[0]"),
        ({"sites": [{"hook": "mlp", "layers": [0]}]}, "capture.sites[0].hook"),
        ({"sites": [{"hook": "pre_attn", "layers": []}]}, "capture.sites[0].layers"),
        ({"sites": [{"hook": "pre_attn", "layers": {"0": 1}}]}, "capture.sites[0].layers"),
        ({"sites": [{"hook": "pre_attn", "layers": [0], "x": 1}]}, "capture.sites[0].x"),
        ({"sites": [{"hook": "pre_attn", "layers": [0, 1, 4]}]}, "capture.sites[0].layers[2]"),
        ({"sites": [{"hook": "pre_attn", "layers": [-1]}]}, "capture.sites[0].layers[0]"),
        ({"sites": [{"hook": "pre_attn", "layers": [True]}]}, "capture.sites[0].layers[0]"),
        ({"sites": [{"hook": "pre_attn", "layers": [1.0]}]}, "capture.sites[0].layers[0]"),
        (
            {"sites": [{"hook": "pre_attn", "layers": [1]}, {"hook": "pre_attn", "layers": [1]}]},
            "capture.sites[1]",
        ),
    ],
)
def test_malformed_specs_are_invalid_request_naming_the_field(body: object, param: str) -> None:
    with pytest.raises(InvalidField) as exc:
        parse_capture(body, SHAPE)
    assert _param(exc) == ("invalid_request", param)


def test_layer_range_is_left_to_whoever_knows_the_model() -> None:
    spec = parse_capture({"sites": [{"hook": "pre_attn", "layers": [99]}]}, None)
    assert spec.sites == (("pre_attn", 99),)


def test_too_many_sites_is_capture_too_large_before_reading_them() -> None:
    body = {"sites": [None] * (MAX_SITES + 1)}  # entries never looked at
    with pytest.raises(APIError) as exc:
        parse_capture(body, None)
    assert _param(exc) == ("capture_too_large", "capture")
    assert exc.value.status == 400


def test_sites_are_counted_over_hooks_and_layers() -> None:
    limits = CaptureLimits(max_sites=5)
    ok = {
        "sites": [
            {"hook": "pre_attn", "layers": [0, 1]},
            {"hook": "post_attn", "layers": [0, 1, 2]},
        ]
    }
    assert len(parse_capture(ok, SHAPE, limits=limits).sites) == 5
    over = {"sites": [*ok["sites"], {"hook": "post_block", "layers": [0]}]}
    with pytest.raises(APIError) as exc:
        parse_capture(over, SHAPE, limits=limits)
    assert _param(exc) == ("capture_too_large", "capture")
    huge = {"sites": [{"hook": "pre_attn", "layers": list(range(10**6))}]}
    with pytest.raises(APIError) as exc:
        parse_capture(huge, None)
    assert exc.value.code == "capture_too_large"


def test_rows_follow_tokens_and_reduce() -> None:
    site = [{"hook": "pre_attn", "layers": [0]}]
    none_all = parse_capture({"sites": site, "tokens": "all", "reduce": "none"}, SHAPE)
    assert none_all.rows(10, 3) == 13
    assert none_all.max_rows(10, 4) == 13  # the 4th token is never fed back
    gen_mean = parse_capture({"sites": site, "tokens": "generated"}, SHAPE)
    assert gen_mean.rows(10, 3) == 1
    assert gen_mean.rows(10, 0) == 0  # max_tokens 1: nothing generated was fed back
    assert parse_capture({"sites": site, "reduce": "last"}, SHAPE).rows(10, 3) == 1


def test_byte_bound_is_exact_and_refused_with_capture_too_large() -> None:
    spec = parse_capture(
        {"sites": [{"hook": "pre_attn", "layers": [0, 1]}], "reduce": "none"}, SHAPE
    )
    rows = spec.max_rows(5, 3) + spec.max_rows(7, 3)  # two prompts: 5 and 7 rows
    exact = 4 * 8 * 2 * (5 + 7)
    limits = CaptureLimits(max_bytes=exact)
    assert check_capture_bytes(spec, 8, rows, limits) == exact
    with pytest.raises(APIError) as exc:
        check_capture_bytes(spec, 8, rows, CaptureLimits(max_bytes=exact - 1))
    assert _param(exc) == ("capture_too_large", "capture")
    assert str(exact) in exc.value.message


def test_reduce_rows() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(reduce_rows(rows, "none"), rows)
    np.testing.assert_array_equal(reduce_rows(rows, "last"), rows[2:])
    np.testing.assert_allclose(reduce_rows(rows, "mean"), rows.mean(axis=0, keepdims=True))
    assert reduce_rows(np.zeros((0, 4), np.float32), "mean").shape == (0, 4)


def test_answer_round_trips_through_decode() -> None:
    spec = parse_capture(
        {"sites": [{"hook": "post_block", "layers": [2]}], "reduce": "none"}, SHAPE
    )
    a = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    b = np.zeros((0, 8), np.float32)
    answer = capture_answer(
        spec, [encode_site(0, "post_block", 2, a), encode_site(1, "post_block", 2, b)]
    )
    assert answer["dtype"] == "float32" and answer["tokens"] == "prompt"
    assert answer["reduce"] == "none"
    assert answer["sites"][0]["shape"] == [3, 8]
    raw = base64.b64decode(answer["sites"][0]["data"])
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4").reshape(3, 8), a)
    decoded = decode_capture(answer)
    np.testing.assert_array_equal(decoded[(0, "post_block", 2)], a)
    assert decoded[(1, "post_block", 2)].shape == (0, 8)
    assert answer_bytes(answer) == 3 * 8 * 4


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {"dtype": "float16", "sites": []},
        {"dtype": "float32", "sites": [{"index": 0, "hook": "pre_attn", "layer": 0}]},
        {
            "dtype": "float32",
            "sites": [{"index": 0, "hook": "h", "layer": 0, "shape": [2, 2], "data": "AAAA"}],
        },
        {
            "dtype": "float32",
            "sites": [{"index": 0, "hook": "h", "layer": 0, "shape": [1, 1], "data": "!!"}],
        },
    ],
)
def test_decode_refuses_malformed_answers(bad: object) -> None:
    with pytest.raises(ValueError):
        decode_capture(bad)


@pytest.mark.parametrize("n", [10**7, 10**12, 2**63, 10**30])
@pytest.mark.parametrize("completions", [False, True])
def test_a_huge_n_is_capture_too_large_without_sizing_anything_by_it(
    n: int, completions: bool
) -> None:
    """``n`` is the client's number: the bound was a list of ``n`` rows (a MemoryError,
    an OverflowError, or ~1 s of the gateway's event loop at 5e7, all before admission)."""
    spec = parse_capture({"sites": [{"hook": "pre_attn", "layers": [0]}]}, SHAPE)
    body = {"n": n, "prompt": ["a", "b"]} if completions else {"n": n}
    with pytest.raises(APIError) as exc:
        check_up_front(spec, body, completions, SHAPE.hidden_size, tokens_estimate=10)
    assert _param(exc) == ("capture_too_large", "capture")
    rows = 2 * n if completions else n
    assert f"{rows} rows" in exc.value.message

