"""A warning that a client (or an outage) could repeat per request is said at most once
per interval, with a count of what it held back, so nobody can flood a log."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any


class RateLimitedWarning:
    """Logs to ``logger`` at most once per ``interval`` seconds and reports how many were
    suppressed in between."""

    def __init__(
        self,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self._interval = interval
        self._clock = clock
        self._log = logger or logging.getLogger("steergate")
        self._next_at = float("-inf")
        self.suppressed = 0

    def warn(self, message: str, *args: Any) -> bool:
        now = self._clock()
        if now < self._next_at:
            self.suppressed += 1
            return False
        if self.suppressed:
            message += " (%d similar warnings suppressed)"
            args = (*args, self.suppressed)
        self._log.warning(message, *args)
        self.suppressed = 0
        self._next_at = now + self._interval
        return True
