"""The bounded GGUF reader (steergate/shared/gguf.py): hostile files are refused fast and by
name, before anything proportional to their claims is allocated; valid control
vectors decode exactly as the ``gguf`` package's reader decodes them."""

from __future__ import annotations

import asyncio
import os
import struct
import tempfile
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from steergate.shared import gguf as bounded
from steergate.shared.codecs import CodecError
from steergate.shared.gguf import (
    decode_gguf_control_vector,
    decode_gguf_off_loop,
    encode_gguf_control_vector,
)

UINT8, UINT32, STRING, ARRAY = 0, 4, 8, 9


def s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def tensor_info(name: bytes, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        s(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def one_vector(kv: bytes = b"", n_kv: int = 0, info: bytes | None = None) -> bytes:
    """A file with ``kv`` metadata and one direction.1 tensor of 8 float32."""
    info = tensor_info(b"direction.1", [8]) if info is None else info
    body = header(1, n_kv) + kv + info
    body += b"\0" * (-len(body) % 32)
    return body + np.arange(8, dtype="<f4").tobytes()


def gguf_reader_decode(raw: bytes) -> dict[int, np.ndarray]:
    """The previous decoder (the ``gguf`` package's reader), as the oracle."""
    reader_mod = pytest.importorskip("gguf")
    fd, path = tempfile.mkstemp(suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        reader = reader_mod.GGUFReader(path)
        return {
            int(str(t.name).split(".", 1)[1]): np.asarray(t.data, dtype=np.float32).reshape(-1)
            for t in reader.tensors
            if str(t.name).startswith("direction.")
        }
    finally:
        os.unlink(path)


def write_with_gguf_writer(fill: Any) -> bytes:
    gguf = pytest.importorskip("gguf")
    fd, path = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(path, "controlvector")
        fill(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def assert_same(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for layer in a:
        assert a[layer].dtype == np.float32
        np.testing.assert_array_equal(a[layer], b[layer])


# -- valid files decode exactly ------------------------------------------------------


def test_files_from_encode_gguf_control_vector_decode_as_the_gguf_reader_does() -> None:
    rng = np.random.default_rng(1)
    layers = {i: rng.standard_normal(64).astype(np.float32) for i in (0, 2, 5, 31)}
    raw = encode_gguf_control_vector(layers, model_hint="mistral")
    ours = decode_gguf_control_vector(raw)
    assert_same(ours, gguf_reader_decode(raw))
    assert_same(ours, layers)


def test_gguf_writer_files_with_extra_metadata_f16_other_tensors_and_alignment() -> None:
    rng = np.random.default_rng(2)
    v32 = rng.standard_normal(16).astype(np.float32)
    v16 = rng.standard_normal(16).astype(np.float16)

    def fill(w: Any) -> None:
        w.add_custom_alignment(64)
        w.add_string("controlvector.model_hint", "llama")
        w.add_uint32("controlvector.layer_count", 2)
        w.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"] * 100)
        w.add_array("some.ints", list(range(1000)))
        w.add_float64("some.float", 1.5)
        w.add_bool("some.flag", True)
        w.add_tensor("other.weight", rng.standard_normal((3, 5)).astype(np.float32))
        w.add_tensor("direction.3", v32)
        w.add_tensor("direction.7", v16)

    raw = write_with_gguf_writer(fill)
    ours = decode_gguf_control_vector(raw)
    assert_same(ours, gguf_reader_decode(raw))
    np.testing.assert_array_equal(ours[7], v16.astype(np.float32))


# -- hostile files are refused fast, by name -----------------------------------------


def huge_array(n_bytes: int, etype: int = UINT8) -> bytes:
    """The audit's file: one metadata array filling the file (200 KB: 9 s before)."""
    if etype == STRING:
        n = n_bytes // 9
        return one_vector(s(b"x.big") + struct.pack("<IIQ", ARRAY, STRING, n) + s(b"x") * n, n_kv=1)
    return one_vector(s(b"x.big") + struct.pack("<IIQ", ARRAY, etype, n_bytes) + b"\1" * n_bytes, 1)


ATTACKS = {
    "array of 200 KB": (huge_array(200_000), "x.big"),
    "array of 1 MB": (huge_array(1_000_000), "x.big"),
    "string array of 1 MB": (huge_array(1_000_000, STRING), "x.big"),
    "10^6 kv pairs claimed": (header(1, 10**6), "key/value"),
    "2^64-1 tensors claimed": (header(2**64 - 1, 0), "tensors"),
    "array length 2^63 claimed": (
        one_vector(s(b"x.big") + struct.pack("<IIQ", ARRAY, UINT32, 2**63), 1),
        "x.big",
    ),
    "array length within limit but past the end": (
        header(1, 1) + s(b"x.arr") + struct.pack("<IIQ", ARRAY, 12, 4000),
        "truncated",
    ),
    "string length 2^64-1": (header(1, 1) + struct.pack("<Q", 2**64 - 1), "metadata key"),
    "value string of 1 MiB": (
        one_vector(s(b"k") + struct.pack("<I", STRING) + s(b"x" * (1 << 20)), 1),
        "string value",
    ),
    "nested array": (
        one_vector(s(b"n") + struct.pack("<IIQ", ARRAY, ARRAY, 1) + struct.pack("<IQ", 0, 0), 1),
        "nested",
    ),
    "unknown value type": (one_vector(s(b"k") + struct.pack("<I", 99), 1), "unknown type"),
    "1000 dims": (one_vector(info=tensor_info(b"direction.1", [1] * 1000)), "dims"),
    "dims 2^32 x 2^32": (one_vector(info=tensor_info(b"direction.1", [2**32, 2**32])), "larger"),
    "offset past the end": (
        one_vector(info=tensor_info(b"direction.1", [8], offset=2**40)),
        "past the end",
    ),
    "unaligned offset": (one_vector(info=tensor_info(b"direction.1", [8], offset=4)), "unaligned"),
    "quantized direction": (one_vector(info=tensor_info(b"direction.1", [8], 2)), "ggml type 2"),
    "non-ASCII layer digit": (
        one_vector(info=tensor_info("direction.١".encode(), [8])),
        "bad layer index",
    ),
    "signed layer": (one_vector(info=tensor_info(b"direction.+1", [8])), "bad layer index"),
    "alignment 3": (
        one_vector(s(b"general.alignment") + struct.pack("<II", UINT32, 3), 1),
        "alignment",
    ),
    "version 1": (header(1, 0, version=1), "version"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 1, 0), "big-endian"),
    "no directions": (header(0, 0), "no 'direction.N'"),
}


@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile_gguf_is_refused_fast_and_names_the_problem(name: str) -> None:
    raw, words = ATTACKS[name]
    start = time.perf_counter()
    with pytest.raises(CodecError, match=words.replace("+", r"\+")):
        decode_gguf_control_vector(raw)
    assert time.perf_counter() - start < 0.2, name


def test_file_over_the_size_limit_is_refused_before_parsing() -> None:
    with pytest.raises(CodecError, match="limit 1000"):
        decode_gguf_control_vector(one_vector() + b"\0" * 1000, max_bytes=1000)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_corruption_of_a_valid_file_is_a_codec_error_or_a_valid_parse(data: Any) -> None:
    raw = bytearray(
        encode_gguf_control_vector({1: np.ones(8, np.float32), 2: np.zeros(8, np.float32)})
    )
    cut = data.draw(st.integers(0, len(raw)))
    raw = raw[:cut] if data.draw(st.booleans()) else raw
    for _ in range(data.draw(st.integers(0, 4))):
        if raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    try:
        out = decode_gguf_control_vector(bytes(raw))
    except CodecError:
        return
    assert all(v.dtype == np.float32 and v.ndim == 1 for v in out.values())


# -- off the event loop, bounded in time ---------------------------------------------


async def test_parsing_runs_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(raw: bytes, max_bytes: int | None = None) -> dict[int, np.ndarray]:
        time.sleep(0.3)  # a slow parse holds its thread, never the loop
        return {1: np.ones(2, np.float32)}

    monkeypatch.setattr(bounded, "read_control_vector", slow)
    worst = 0.0
    done = False

    async def ticker() -> None:
        nonlocal worst
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst = max(worst, time.perf_counter() - t)

    tick = asyncio.create_task(ticker())
    out = await decode_gguf_off_loop(b"")
    done = True
    await tick
    assert list(out) == [1]
    assert worst < 0.1, f"event loop stalled {worst:.3f} s"


async def test_a_parse_past_its_time_bound_is_a_codec_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bounded, "read_control_vector", lambda raw, mb=None: time.sleep(1.0))
    start = time.perf_counter()
    with pytest.raises(CodecError, match=r"within 0\.1 s"):
        await decode_gguf_off_loop(b"", timeout_s=0.1)
    assert time.perf_counter() - start < 0.5
