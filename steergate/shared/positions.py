"""Which token positions a steering applies to: ``steering.tokens`` and ``phase``.

``steering.tokens`` is ``{"prompt": "all" | "none" | {"last": N},
"generated": "all" | "none" | {"first": N} | {"from": K}}`` (a missing key is
``"all"``). ``phase`` is shorthand: ``all`` = all/all, ``prefill`` = all/none,
``decode`` = none/all. Giving both is a 400.

Every selection is two intervals of positions, with ``P`` prompt tokens:

* prompt positions ``[P - last, P)`` (``all``: last = ∞; ``none``: last = 0);
* generated positions ``[P + first, P + end)``, where generated token g sits at
  position ``P + g`` when it is fed back (so, as with ``decode``, steering
  "generated token 0" steers the forward pass that reads it, not the one that sampled it).

The selection travels everywhere a phase does (payload, latch, salt) as one string:
the phase name when it is one of the three, else ``tokens:<last>:<first>:<end>`` with
``*`` for ∞. So an add-only request's digest and salt with a plain ``phase`` are what
they always were.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from steergate.shared.errors import InvalidField, reject_unknown

PHASES: tuple[str, ...] = ("all", "prefill", "decode")
#: Past any context length: a larger N selects as much as "all".
MAX_N = 1 << 30
_CANON = re.compile(r"tokens:(\*|0|[1-9][0-9]{0,9}):(0|[1-9][0-9]{0,9}):(\*|0|[1-9][0-9]{0,9})")


@dataclass(frozen=True)
class Window:
    prompt_last: int | None  # None: every prompt token
    gen_first: int
    gen_end: int | None  # None: no end

    def spans(self, num_prompt: int) -> tuple[tuple[int, int], tuple[int, int | None]]:
        """(prompt [lo, hi), generated [lo, hi or None]) in positions."""
        last = num_prompt if self.prompt_last is None else min(self.prompt_last, num_prompt)
        gen_hi = None if self.gen_end is None else num_prompt + self.gen_end
        return (num_prompt - last, num_prompt), (num_prompt + self.gen_first, gen_hi)


_SHORTHAND: dict[str, Window] = {
    "all": Window(None, 0, None),
    "prefill": Window(None, 0, 0),
    "decode": Window(0, 0, None),
}


@functools.lru_cache(maxsize=1024)
def window(phase: str) -> Window:
    """The selection a phase string names (a shorthand or a ``tokens:`` string)."""
    if phase in _SHORTHAND:
        return _SHORTHAND[phase]
    m = _CANON.fullmatch(phase)
    if m is None:
        raise ValueError(f"not a steering phase: {phase!r}")
    last, first, end = m.groups()
    return Window(None if last == "*" else int(last), int(first), None if end == "*" else int(end))


def is_phase(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        window(value)
    except ValueError:
        return False
    return True


def canonical(w: Window) -> str:
    for name, short in _SHORTHAND.items():
        if short == w:
            return name
    star = lambda v: "*" if v is None else str(v)  # noqa: E731
    return f"tokens:{star(w.prompt_last)}:{w.gen_first}:{star(w.gen_end)}"


def parse_tokens(obj: Any, param: str) -> str:
    """``steering.tokens`` -> its canonical phase string; 400s name the field."""
    if not isinstance(obj, dict):
        raise InvalidField(param, f"'{param}' must be an object of prompt, generated")
    reject_unknown(obj, ("prompt", "generated"), param)
    prompt = obj.get("prompt", "all")
    generated = obj.get("generated", "all")
    last: int | None
    if prompt == "all":
        last = None
    elif prompt == "none":
        last = 0
    else:
        last = _one(prompt, ("last",), f"{param}.prompt")[1]
    if generated == "all":
        first, end = 0, None
    elif generated == "none":
        first, end = 0, 0
    else:
        key, n = _one(generated, ("first", "from"), f"{param}.generated")
        first, end = (0, n) if key == "first" else (n, None)
    return canonical(Window(last, first, end))


def _one(obj: Any, keys: tuple[str, ...], param: str) -> tuple[str, int]:
    shapes = " or ".join(f'{{"{k}": N}}' for k in keys)
    if not isinstance(obj, dict) or len(obj) != 1 or next(iter(obj)) not in keys:
        raise InvalidField(param, f"'{param}' must be \"all\", \"none\" or {shapes}")
    key, n = next(iter(obj.items()))
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_N:
        raise InvalidField(
            f"{param}.{key}", f"'{param}.{key}' must be an integer in 0..{MAX_N}"
        )
    return key, n
