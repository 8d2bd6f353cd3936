"""Vector codecs: JSON float lists and packed base64 tensors (GGUF control vectors:
``steergate/shared/gguf.py``).

All decoders return float32 numpy arrays, the one in-memory form both sides use.
Packed data is little-endian; bfloat16 has no numpy dtype, so it is widened by a
16-bit shift into float32 (exact).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
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


def check_b64_length(data: str, nbytes: int) -> None:
    """Strict base64 of ``nbytes`` bytes is exactly ``4 * ceil(nbytes / 3)`` characters:
    a string of any other length is refused before a byte of it is decoded (a 7.8 MB
    ``data`` for a shape of 8 values costs nothing)."""
    chars = 4 * -(-nbytes // 3)
    if len(data) != chars:
        raise CodecError(
            f"holds {len(data)} base64 characters but shape needs {nbytes} bytes "
            f"({chars} characters)"
        )


def decode_packed_bytes(raw: bytes, dtype: str, count: int) -> np.ndarray:
    """``count`` little-endian values of ``dtype`` as float32."""
    if not isinstance(dtype, str) or dtype not in DTYPES:
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
