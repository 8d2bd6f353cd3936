"""A bounded reader for GGUF control vectors (llama.cpp / repeng format).

Uploads come from tenants, so the reader trusts nothing in the file: every count,
length and offset is checked against a hard limit and against the bytes actually
present *before* anything is allocated or iterated. It reads only what a control
vector needs: the header, ``general.alignment``, the tensor infos, and the data of the
``direction.N`` tensors. Other metadata is skipped (fixed-size arrays by arithmetic;
string arrays one bounded length at a time), never materialised.

(The ``gguf`` package's reader builds Python objects for every array element: a
200 KB file with one large array took 9 s and the event loop with it.)

Format: magic ``GGUF``, version u32 (2 or 3; little-endian only), tensor count u64,
kv count u64; then kv pairs (key string, value type u32, value); then tensor infos
(name string, n_dims u32, dims u64[n_dims], ggml type u32, offset u64); then the data
section, starting at the next multiple of ``general.alignment`` (default 32), with
each tensor at its offset (a multiple of the alignment) from that start.
"""

from __future__ import annotations

import asyncio
import os
import re
import struct
import tempfile
from collections.abc import Mapping

import numpy as np

from steergate.shared.codecs import CodecError, decode_packed_bytes

__all__ = [
    "GGUF_PARSE_TIMEOUT_S",
    "LIMITS",
    "GGUFLimits",
    "decode_gguf_control_vector",
    "decode_gguf_off_loop",
    "encode_gguf_control_vector",
    "read_control_vector",
]


class GGUFLimits:
    """Hard limits, each far above what a control-vector file holds."""

    file_bytes = 64 * 1024 * 1024
    kv_count = 256
    array_len = 4096
    #: String-array elements over all keys (each is one Python-level step).
    array_elements_total = 65536
    string_bytes = 64 * 1024
    tensor_count = 1024
    n_dims = 4
    max_alignment = 1 << 16


LIMITS = GGUFLimits()

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# GGUF metadata value types -> byte size of one value (STRING and ARRAY are variable).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9
# ggml tensor types a control vector may use -> our codec dtype names.
_TENSOR_DTYPES = {0: "float32", 1: "float16", 30: "bfloat16"}
_DIRECTION = re.compile(rb"direction\.([0-9]{1,6})")


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        end = self.pos + n
        if n < 0 or end > len(self.buf):
            raise CodecError(f"is truncated ({what} at byte {self.pos} runs past the end)")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def u32(self, what: str) -> int:
        return int(_U32.unpack(self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(_U64.unpack(self.take(8, what))[0])

    def string(self, what: str, limit: int) -> bytes:
        n = self.u64(f"{what} length")
        if n > limit:
            raise CodecError(f"has a {what} of {n} bytes (limit {limit})")
        return bytes(self.take(n, what))


def read_control_vector(raw: bytes, max_bytes: int | None = None) -> dict[int, np.ndarray]:
    """Layer -> float32 direction. Raises CodecError naming what was wrong."""
    limit = LIMITS.file_bytes if max_bytes is None else min(max_bytes, LIMITS.file_bytes)
    if len(raw) > limit:
        raise CodecError(f"is {len(raw)} bytes (limit {limit})")
    cur = _Cursor(memoryview(raw))
    if len(raw) < 4 or bytes(cur.take(4, "magic")) != b"GGUF":
        raise CodecError("is not a GGUF file (no 'GGUF' magic)")
    version = cur.u32("version")
    if version not in (2, 3):
        if version & 0xFFFF == 0 and version >> 16:
            raise CodecError("is big-endian GGUF, which is not supported")
        raise CodecError(f"has GGUF version {version} (2 or 3 supported)")
    n_tensors = cur.u64("tensor count")
    if n_tensors > LIMITS.tensor_count:
        raise CodecError(f"declares {n_tensors} tensors (limit {LIMITS.tensor_count})")
    n_kv = cur.u64("key/value count")
    if n_kv > LIMITS.kv_count:
        raise CodecError(f"declares {n_kv} metadata key/value pairs (limit {LIMITS.kv_count})")
    alignment = _read_metadata(cur, n_kv)
    infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    data_start = -(-cur.pos // alignment) * alignment  # each tensor's bounds are checked
    return _directions(raw, infos, data_start, alignment)


def _read_metadata(cur: _Cursor, n_kv: int) -> int:
    """Skip every kv pair; return ``general.alignment`` (default 32)."""
    alignment = 32
    budget = LIMITS.array_elements_total
    for _ in range(n_kv):
        key = cur.string("metadata key", 256)
        vtype = cur.u32(f"type of '{_show(key)}'")
        if vtype == _ARRAY:
            etype = cur.u32(f"element type of '{_show(key)}'")
            count = cur.u64(f"length of '{_show(key)}'")
            if count > LIMITS.array_len:
                raise CodecError(
                    f"has a metadata array '{_show(key)}' of {count} elements "
                    f"(limit {LIMITS.array_len})"
                )
            if etype in _FIXED:
                cur.take(count * _FIXED[etype], f"array '{_show(key)}'")
            elif etype == _STRING:
                budget -= count
                if budget < 0:
                    raise CodecError(
                        f"has more than {LIMITS.array_elements_total} string-array elements"
                    )
                for _ in range(count):
                    cur.string(f"string in '{_show(key)}'", LIMITS.string_bytes)
            else:
                raise CodecError(
                    f"has metadata array '{_show(key)}' of element type {etype} (nested or unknown)"
                )
        elif vtype == _STRING:
            cur.string(f"string value of '{_show(key)}'", LIMITS.string_bytes)
        elif vtype in _FIXED:
            value = cur.take(_FIXED[vtype], f"value of '{_show(key)}'")
            if key == b"general.alignment":
                if vtype != _UINT32:
                    raise CodecError("has a 'general.alignment' that is not a uint32")
                alignment = int(_U32.unpack(value)[0])
                if not 0 < alignment <= LIMITS.max_alignment or alignment & (alignment - 1):
                    raise CodecError(
                        f"has general.alignment {alignment} (a power of two up to "
                        f"{LIMITS.max_alignment})"
                    )
        else:
            raise CodecError(f"has metadata '{_show(key)}' of unknown type {vtype}")
    return alignment


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[bytes, int, int, int]:
    """(name, element count, ggml type, offset) of tensor ``i``."""
    name = cur.string(f"name of tensor {i}", 256)
    n_dims = cur.u32(f"n_dims of tensor {i}")
    if not 1 <= n_dims <= LIMITS.n_dims:
        raise CodecError(f"has tensor '{_show(name)}' with {n_dims} dims (1-{LIMITS.n_dims})")
    count = 1
    for _ in range(n_dims):
        dim = cur.u64(f"dims of tensor {i}")
        # Bounded by the file size at every step, so the product never grows large.
        count *= dim
        if count > len(cur.buf):
            raise CodecError(f"has tensor '{_show(name)}' larger than the file")
    ggml_type = cur.u32(f"type of tensor {i}")
    offset = cur.u64(f"offset of tensor {i}")
    return name, count, ggml_type, offset


def _directions(
    raw: bytes, infos: list[tuple[bytes, int, int, int]], data_start: int, alignment: int
) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for name, count, ggml_type, offset in infos:
        if not name.startswith(b"direction."):
            continue  # other tensors are allowed and never read
        m = _DIRECTION.fullmatch(name)
        if m is None:
            raise CodecError(f"has a tensor with a bad layer index: {_show(name)!r}")
        layer = int(m.group(1))
        if layer in out:
            raise CodecError(f"has two tensors for layer {layer}")
        dtype = _TENSOR_DTYPES.get(ggml_type)
        if dtype is None:
            raise CodecError(
                f"has tensor '{_show(name)}' of ggml type {ggml_type} "
                "(float32, float16 or bfloat16 supported)"
            )
        if offset % alignment:
            raise CodecError(f"has tensor '{_show(name)}' at an unaligned offset {offset}")
        start = data_start + offset
        nbytes = count * (4 if dtype == "float32" else 2)
        if start + nbytes > len(raw):
            raise CodecError(f"has tensor '{_show(name)}' whose data runs past the end")
        out[layer] = decode_packed_bytes(raw[start : start + nbytes], dtype, count)
    if not out:
        raise CodecError("holds no 'direction.N' tensors")
    return out


def _show(name: bytes) -> str:
    """A file-supplied name, safe to put in an error message."""
    text = name[:64].decode("utf-8", "replace")
    return "".join(c if c.isprintable() else "?" for c in text) + ("…" if len(name) > 64 else "")


#: Wall-clock bound on one GGUF parse, queueing for a worker thread included.
GGUF_PARSE_TIMEOUT_S = 5.0


def decode_gguf_control_vector(raw: bytes, max_bytes: int | None = None) -> dict[int, np.ndarray]:
    """Layer -> float32 direction from a llama.cpp / repeng control-vector file.

    Tensors are named ``direction.N`` and apply at ``post_block`` of layer N (the
    convention llama.cpp uses when it applies them after layer N's output). The
    reader is bounded (:func:`read_control_vector`); servers call
    ``decode_gguf_off_loop``.
    """
    return read_control_vector(raw, max_bytes)


async def decode_gguf_off_loop(
    raw: bytes, *, max_bytes: int | None = None, timeout_s: float = GGUF_PARSE_TIMEOUT_S
) -> dict[int, np.ndarray]:
    """``decode_gguf_control_vector`` in a worker thread, bounded in time, so an
    upload never holds the event loop (every other tenant's requests) while it parses."""
    try:
        return await asyncio.wait_for(
            asyncio.to_thread(decode_gguf_control_vector, raw, max_bytes), timeout_s
        )
    except TimeoutError as exc:
        raise CodecError(f"could not be read within {timeout_s:g} s") from exc


def encode_gguf_control_vector(
    layers: Mapping[int, np.ndarray], model_hint: str = "llama"
) -> bytes:
    """Write a repeng-style control-vector GGUF (used by tests and the CLI)."""
    from gguf import GGUFWriter

    fd, path = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    try:
        writer = GGUFWriter(path, "controlvector")
        writer.add_string("controlvector.model_hint", model_hint)
        writer.add_uint32("controlvector.layer_count", len(layers))
        for layer in sorted(layers):
            writer.add_tensor(f"direction.{layer}", np.asarray(layers[layer], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)
