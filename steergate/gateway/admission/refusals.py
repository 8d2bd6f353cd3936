"""Why a request was refused with a 429: one table, read by everything that names a cause.

Each :class:`Refusal` ties together what used to be spelled in several places:

* ``status``: admit_request.lua's status for it (0: not the limiter's; the vector quota
  is put_vector.lua's). The script's own ``CAUSES`` list names the same causes by status
  (``tests/gateway/admission/test_refusals.py`` checks they agree);
* ``code``: the error code of the 429 body (``steergate/shared/errors.py``'s registry), the key
  of ``/v1/usage``'s ``rejections`` and the ``cause`` label of
  ``steergate_rejections_total``;
* ``cause``: the short name in Redis, the field ``429:<cause>`` of the usage hashes
  (minute, total and the day rollups) and the export column ``429_<cause>``;
* ``message``: the 429's message template; ``limit``: the limit its ``{limit}`` names;
  ``says_when``: whether the 429 carries ``Retry-After``.

A refusal is raised as :class:`Refused` (an ``APIError`` that keeps its ``Refusal``);
the app's error handler puts it on the request state (``scope["state"]["refusal"]``),
where the metrics middleware reads it: nothing re-reads the cause from the 429 body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from steergate.shared.errors import APIError

#: Where the usage hashes count one refusal: ``429:<cause>``.
FIELD_PREFIX = "429:"
#: The request-state entry (``scope["state"]``) that carries a refusal to the edge.
STATE_KEY = "refusal"


@dataclass(frozen=True)
class Refusal:
    cause: str
    code: str
    #: admit_request.lua's status (0: refused elsewhere).
    status: int
    message: str
    #: The limit that ``{limit}`` in ``message`` stands for ("" where none does).
    limit: str
    #: The refusal knows when it lifts (a GCRA's exact time, a budget's next period):
    #: the 429 carries ``Retry-After``.
    says_when: bool

    @property
    def field(self) -> str:
        """The usage-hash field that counts this refusal."""
        return FIELD_PREFIX + self.cause

    @property
    def by_limiter(self) -> bool:
        """Counted by admit_request.lua itself (in the day rollups)."""
        return self.status > 0


# fmt: off
REFUSALS: tuple[Refusal, ...] = (
    Refusal("rpm", "rate_limit_exceeded", 1,
            "Rate limit reached for requests per minute ({limit}). Retry in {retry}.", "rpm", True),
    Refusal("tpm", "rate_limit_exceeded", 2,
            "Rate limit reached for tokens per minute ({limit}). Retry in {retry}.", "tpm", True),
    Refusal("concurrency", "concurrency_limit_exceeded", 3,
            "Too many concurrent requests (limit {limit}).", "max_concurrency", False),
    Refusal("latch", "latch_quota_exceeded", 4,
            "Storing this latch would exceed the tenant's latch quota; waiting does not help: "
            "delete a latch (DELETE /v1/steering/latches/{{conversation_id}}) to make room.", "",
            False),
    Refusal("budget", "budget_exceeded", 6,
            "The tenant's token budget ({limit} tokens per {period}) is spent; it renews in "
            "{retry} (UTC {period} start).", "token_budget", True),
    Refusal("key_rpm", "rate_limit_exceeded", 7,
            "Rate limit reached for requests per minute of this API key ({limit}). "
            "Retry in {retry}.", "key_rpm", True),
    Refusal("key_concurrency", "concurrency_limit_exceeded", 8,
            "Too many concurrent requests of this API key (limit {limit}).",
            "key_max_concurrency", False),
    Refusal("vector", "vector_quota_exceeded", 0,
            "Storing this vector would exceed the tenant's vector quota ({limit} vectors, "
            "{bytes} bytes).", "vector_count", False),
)
# fmt: on

BY_STATUS: dict[int, Refusal] = {r.status: r for r in REFUSALS if r.status}
BY_CAUSE: dict[str, Refusal] = {r.cause: r for r in REFUSALS}
#: The causes admit_request.lua counts in the day rollups (the export's columns).
LIMITER_CAUSES: tuple[str, ...] = tuple(r.cause for r in REFUSALS if r.by_limiter)
#: Every error code a refusal can carry, in table order.
CODES: tuple[str, ...] = tuple(dict.fromkeys(r.code for r in REFUSALS))


class Refused(APIError):
    """A 429 that knows its :class:`Refusal`."""

    def __init__(
        self,
        refusal: Refusal,
        *,
        headers: dict[str, str] | None = None,
        retry_after_ms: int | None = None,
        **values: Any,
    ) -> None:
        super().__init__(
            refusal.code,
            refusal.message.format(**values),
            headers=headers,
            retry_after_ms=retry_after_ms,
        )
        self.refusal = refusal


def code_of_field(field: str) -> str | None:
    """The error code a usage-hash field counts (``None``: not a refusal field).

    ``429:<cause>`` is today's naming; ``429:<error code>`` is what the minute and
    total hashes held before (the all-time hash keeps it), read as that code; an
    unknown suffix (a later version's cause) is kept as it is."""
    if not field.startswith(FIELD_PREFIX):
        return None
    name = field[len(FIELD_PREFIX) :]
    refusal = BY_CAUSE.get(name)
    return refusal.code if refusal is not None else name
