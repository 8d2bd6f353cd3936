"""Human units for the operator surfaces (CLI tables, size flags).

Quotas are stored in bytes; operators think in KiB/MiB. One module parses and
formats them so that the CLI, the docs and the dashboard agree (the dashboard's
JavaScript mirrors :func:`format_bytes`).
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
}
# ASCII digits only (``\d`` would take "١٢" as 12), at most one space, and only before
# a unit (as format_bytes writes it: "64 KiB", never "64 "), and at most 15 digits, so
# float() never reaches inf.
_SIZE_RE = re.compile(r"([0-9]{1,15}(?:\.[0-9]{1,15})?)(?: ?([a-zA-Z]{1,3}))?")


def parse_bytes(text: str) -> int:
    """``"256MiB"`` -> 268435456. Bare numbers are bytes; ``k``/``m``/``g`` are binary
    (as in ``ulimit``), ``kB``/``MB``/``GB`` decimal. Raises ValueError on anything else."""
    match = _SIZE_RE.fullmatch(text)
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 256MiB, 1GiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_bytes(n: int | float | None) -> str:
    """``268435456`` -> ``"256 MiB"``; binary units, at most one decimal."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.1f} {unit}".replace(".0 ", " ")
        value /= 1024
    raise AssertionError("unreachable")


def format_percent(used: float, limit: float | None) -> str:
    if not limit:
        return "-"
    return f"{100.0 * used / limit:.0f}%"
