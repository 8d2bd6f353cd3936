"""The engine's HTTP contract, in one module both sides import.

Routes, header names, latch states, the gateway-private ``steergate_expect``
field and the default caps live here and nowhere else: the engine's routes and
middleware are built from these names, and the gateway's engine client
(``steergate/gateway/engines/client.py``) is the only gateway module that turns them into URLs.

Every identifier that reaches a URL path goes through :func:`latch_path` or
:func:`vector_path`: it is validated in full against the engine's id grammar and
percent-encoded, so no caller can smuggle a byte into a request line.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import quote

from steergate.shared.scoping import is_engine_conversation_id, is_engine_vector_name

# -- routes ---------------------------------------------------------------------------

STEERING = "/v1/steering"
INFO = f"{STEERING}/info"
STATUS = f"{STEERING}/status"
LATCHES = f"{STEERING}/latches"
VECTORS = f"{STEERING}/vectors"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MODELS = "/v1/models"
#: vLLM's tokenizer routes (not under /v1 on the engine; the gateway serves them there).
TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"
#: The inference routes the engine's rewrite middleware steers.
STEERED_PATHS = frozenset({CHAT_COMPLETIONS, COMPLETIONS, RESPONSES})

# -- headers --------------------------------------------------------------------------

LATCH_HEADER = "x-steering-latch"

# -- latch states ---------------------------------------------------------------------

LatchState = Literal[
    "none",
    "latched",
    "replaced",
    "bridged",
    "restored",
    "refused_oversize",
    "dropped_stale",
    "evicted_quota",
]
#: States the engine itself reports (``evicted_quota`` is the gateway's).
ENGINE_LATCH_STATES: frozenset[str] = frozenset(
    {"none", "latched", "replaced", "bridged", "restored", "refused_oversize", "dropped_stale"}
)
#: States after which the conversation holds the latch the turn asked to store.
KEEP_STATES: frozenset[str] = frozenset({"latched", "replaced", "evicted_quota"})
#: States after which the conversation holds no latch.
DROP_STATES: frozenset[str] = frozenset({"refused_oversize", "dropped_stale"})

# -- the gateway's expectations (cache protocol) --------------------------------------

#: Body field the gateway adds to an inference request; the engine consumes it.
#: ``{"vectors": {scoped name: digest}, "latch": digest | null, "restore": spec | null}``.
#: - ``vectors``: the content each named term must have, the turn's and those of the latch
#:   it bridges or restores. An engine whose registry lacks the name, or holds other
#:   content, answers 409 ``vector_missing`` instead of steering.
#: - ``latch``: the digest of the latch Redis holds for the conversation. An engine that
#:   holds no latch, or another one, answers 409 ``latch_missing`` instead of generating
#:   an unsteered turn.
#: - ``restore``: a latch spec (``steergate/shared/latch_spec.py``) to install before the turn; the
#:   turn is then bridged by it and reports ``restored``. With ``latch`` given, the spec's
#:   digest must be that digest (else a 400 naming ``steergate_expect.restore``).
EXPECT_FIELD = "steergate_expect"
#: The two 409 codes above: the gateway installs what is missing from Redis and retries.
MISS_CODES = frozenset({"vector_missing", "latch_missing"})

# -- default caps ---------------------------------------------------------------------

DEFAULT_MAX_LATCHED_CONVERSATIONS = 1024
DEFAULT_MAX_LATCHED_BYTES = 256 * 2**20
#: The vector registry's caps: 16 tenants' default vector quotas (100 vectors, 64 MiB).
DEFAULT_MAX_VECTORS = 4096
DEFAULT_MAX_VECTOR_BYTES = 2**30


class InvalidIdentifier(ValueError):
    """An identifier that must never reach a URL."""


def latch_path(scoped_conversation_id: str) -> str:
    if not is_engine_conversation_id(scoped_conversation_id):
        raise InvalidIdentifier("conversation id")
    return f"{LATCHES}/{quote(scoped_conversation_id, safe='')}"


def vector_path(scoped_name: str) -> str:
    if not is_engine_vector_name(scoped_name):
        raise InvalidIdentifier("vector name")
    return f"{VECTORS}/{quote(scoped_name, safe='')}"
