from __future__ import annotations

import numpy as np
import pytest

from steergate.shared.codecs import vector_digest
from steergate.shared.errors import InvalidField
from steergate.shared.gguf import decode_gguf_control_vector, encode_gguf_control_vector
from steergate.shared.scoping import check_conversation_id, scope, unscope


def test_gguf_control_vector_round_trips_layer_by_layer() -> None:
    rng = np.random.default_rng(0)
    layers = {
        1: rng.standard_normal(16).astype(np.float32),
        3: rng.standard_normal(16).astype(np.float32),
    }
    decoded = decode_gguf_control_vector(encode_gguf_control_vector(layers))
    assert sorted(decoded) == [1, 3]
    for layer, values in layers.items():
        np.testing.assert_array_equal(decoded[layer], values)


def test_gguf_rejects_garbage() -> None:
    from steergate.shared.codecs import CodecError

    with pytest.raises(CodecError):
        decode_gguf_control_vector(b"not a gguf file at all")


@pytest.mark.parametrize("dtype", ["int8", ["float32"], {"float32": 4}, None])
def test_packed_bytes_refuse_a_dtype_that_is_not_a_known_name(dtype: object) -> None:
    """An unhashable dtype raised TypeError from the dict lookup (a 500 upstream)."""
    from steergate.shared.codecs import CodecError, decode_packed_bytes

    with pytest.raises(CodecError, match="dtype must be one of"):
        decode_packed_bytes(b"\0" * 8, dtype, 2)  # type: ignore[arg-type]


def test_digest_changes_with_content_hook_and_layer() -> None:
    v = np.ones(4, np.float32)
    base = vector_digest("post_block", {1: v})
    assert base == vector_digest("post_block", {1: v.copy()})
    assert base != vector_digest("post_block", {1: v * 2})
    assert base != vector_digest("pre_attn", {1: v})
    assert base != vector_digest("post_block", {2: v})


def test_scoped_ids_round_trip_only_for_their_tenant() -> None:
    scoped = scope("acme", "conv-1")
    assert unscope("acme", scoped) == "conv-1"
    assert unscope("acm", scoped) is None
    assert unscope("acme-2", scope("acme", "x")) is None


@pytest.mark.parametrize("bad", ["", "a" * 257, "has space", "a/b", "t~x", 5, None])
def test_conversation_id_rules(bad: object) -> None:
    with pytest.raises(InvalidField) as info:
        check_conversation_id(bad)
    assert info.value.code == "invalid_conversation_id"
    assert info.value.param == "conversation_id"


def test_conversation_id_accepts_the_full_alphabet() -> None:
    assert check_conversation_id("Ab9._:@-" * 32) == "Ab9._:@-" * 32
