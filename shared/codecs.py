"""Vector codecs: JSON float lists, packed base64 tensors, GGUF control vectors.

All decoders return float32 numpy arrays, the one in-memory form both sides use.
Packed data is little-endian; bfloat16 has no numpy dtype, so it is widened by a
16-bit shift into float32 (exact).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
from collections.abc import Mapping

import numpy as np

DTYPES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}


class CodecError(ValueError):
    """Malformed vector data; the caller turns it into a 400 naming its field."""


def b64decode_strict(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CodecError("is not valid base64") from exc


def decode_packed_bytes(raw: bytes, dtype: str, count: int) -> np.ndarray:
    """``count`` little-endian values of ``dtype`` as float32."""
    if dtype not in DTYPES:
        raise CodecError(f"dtype must be one of {', '.join(DTYPES)}")
    if len(raw) != count * DTYPES[dtype]:
        raise CodecError(
            f"holds {len(raw)} bytes but shape needs {count * DTYPES[dtype]} ({dtype})"
        )
    if dtype == "float32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=True)
    if dtype == "float16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return bits.view(np.float32).copy()


def encode_packed(matrix: np.ndarray, layer_indices: list[int], dtype: str = "float32") -> dict:
    """The contract's ``packed`` object for a ``[n, hidden]`` matrix."""
    m = np.asarray(matrix, dtype=np.float32)
    if dtype == "float32":
        raw = m.astype("<f4").tobytes()
    elif dtype == "float16":
        raw = m.astype("<f2").tobytes()
    elif dtype == "bfloat16":
        raw = (m.astype("<f4").view(np.uint32) >> 16).astype("<u2").tobytes()
    else:
        raise CodecError(f"dtype must be one of {', '.join(DTYPES)}")
    return {
        "dtype": dtype,
        "shape": list(m.shape),
        "layer_indices": list(layer_indices),
        "data": base64.b64encode(raw).decode("ascii"),
    }


def f32_to_b64(vector: np.ndarray) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def b64_to_f32(data: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(data), dtype="<f4").astype(np.float32, copy=True)


def vector_digest(hook: str, layers: Mapping[int, np.ndarray]) -> str:
    """Content digest of a named vector: hook, layer indices and float32 values."""
    h = hashlib.sha256(hook.encode())
    for layer in sorted(layers):
        h.update(int(layer).to_bytes(4, "little"))
        h.update(np.asarray(layers[layer], dtype="<f4").tobytes())
    return h.hexdigest()


def decode_gguf_control_vector(raw: bytes) -> dict[int, np.ndarray]:
    """Layer -> float32 direction from a llama.cpp / repeng control-vector file.

    Tensors are named ``direction.N`` and apply at ``post_block`` of layer N (the
    convention llama.cpp uses when it applies them after layer N's output).
    """
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - dependency is in both extras
        raise CodecError("GGUF support needs the 'gguf' package") from exc
    # GGUFReader memory-maps a path; the upload is bounded by the body limit.
    fd, path = tempfile.mkstemp(suffix=".gguf")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
        try:
            reader = GGUFReader(path)
            tensors = list(reader.tensors)
        except Exception as exc:  # gguf raises bare ValueError/struct errors
            raise CodecError("is not a readable GGUF file") from exc
        out: dict[int, np.ndarray] = {}
        for t in tensors:
            name = str(t.name)
            if not name.startswith("direction."):
                continue
            try:
                layer = int(name.split(".", 1)[1])
            except ValueError as exc:
                raise CodecError(f"has a tensor with a bad layer index: {name!r}") from exc
            out[layer] = np.asarray(t.data, dtype=np.float32).reshape(-1).copy()
        if not out:
            raise CodecError("holds no 'direction.N' tensors")
        return out
    finally:
        os.unlink(path)


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
