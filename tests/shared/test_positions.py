"""``steering.tokens``: parsing, its canonical phase string, and the position spans."""

from __future__ import annotations

import pytest

from steergate.shared.errors import InvalidField
from steergate.shared.latch_spec import LatchSpec, decode_spec
from steergate.shared.positions import Window, parse_tokens, window
from steergate.shared.steering import parse_steering


@pytest.mark.parametrize(
    ("tokens", "phase"),
    [
        ({}, "all"),
        ({"prompt": "all", "generated": "all"}, "all"),
        ({"generated": "none"}, "prefill"),
        ({"prompt": "none"}, "decode"),
        ({"prompt": {"last": 3}}, "tokens:3:0:*"),
        ({"prompt": "none", "generated": {"first": 2}}, "tokens:0:0:2"),
        ({"prompt": {"last": 1}, "generated": {"from": 4}}, "tokens:1:4:*"),
        ({"prompt": "none", "generated": "none"}, "tokens:0:0:0"),
    ],
)
def test_selections_have_one_canonical_string(tokens, phase: str) -> None:
    assert parse_tokens(tokens, "steering.tokens") == phase
    assert parse_steering({"tokens": tokens}, None).phase == phase


def test_spans_in_positions() -> None:
    # 10 prompt tokens: positions 0..9; generated token g is fed back at 10 + g.
    assert window("all").spans(10) == ((0, 10), (10, None))
    assert window("prefill").spans(10) == ((0, 10), (10, 10))
    assert window("decode").spans(10) == ((10, 10), (10, None))
    assert window("tokens:3:0:*").spans(10) == ((7, 10), (10, None))
    assert window("tokens:30:0:*").spans(10) == ((0, 10), (10, None))
    assert window("tokens:0:2:5").spans(10) == ((10, 10), (12, 15))
    assert window("tokens:1:4:*") == Window(1, 4, None)


@pytest.mark.parametrize(
    ("steering", "param"),
    [
        ({"tokens": {"prompt": "all"}, "phase": "all"}, "steering.tokens"),
        ({"tokens": []}, "steering.tokens"),
        ({"tokens": {"prompt": "some"}}, "steering.tokens.prompt"),
        ({"tokens": {"prompt": {"first": 2}}}, "steering.tokens.prompt"),
        ({"tokens": {"prompt": {"last": -1}}}, "steering.tokens.prompt.last"),
        ({"tokens": {"prompt": {"last": True}}}, "steering.tokens.prompt.last"),
        ({"tokens": {"generated": {"first": 1, "from": 2}}}, "steering.tokens.generated"),
        ({"tokens": {"generated": {"last": 1}}}, "steering.tokens.generated"),
        ({"tokens": {"generated": {"from": 1.5}}}, "steering.tokens.generated.from"),
        ({"tokens": {"decode": "all"}}, "steering.tokens.decode"),
    ],
)
def test_bad_selections_name_the_field(steering, param: str) -> None:
    with pytest.raises(InvalidField) as err:
        parse_steering(steering, None)
    assert err.value.param == param


def test_latch_specs_keep_a_selection() -> None:
    spec = LatchSpec("tokens:2:0:3")
    assert decode_spec(spec.encode()).phase == "tokens:2:0:3"
    assert spec.digest != LatchSpec("all").digest


def test_a_selection_takes_one_prompt_per_request_like_prefill() -> None:
    from steergate.engine.http.exact import refuse_inexact

    refuse_inexact({"prompt": [1, 2, 3]}, "tokens:3:0:*")  # one prompt: served
    with pytest.raises(InvalidField) as err:
        refuse_inexact({"prompt": [[1, 2], [3, 4]]}, "tokens:3:0:*")
    assert err.value.param == "prompt" and "steering.tokens" in str(err.value)
