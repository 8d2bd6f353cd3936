"""API keys: generation, the only stored form (a peppered HMAC), comparison.

A tenant key is ``sk-sg-`` + 43 urlsafe base64 characters (256 random bits); an
admin key (``POST /admin/keys``) is ``sk-sga-`` + the same, so neither can pass for
the other even before a lookup. Redis only ever holds HMAC-SHA256(pepper, key): a
Redis dump without the pepper reveals no usable key, and the lookup is by hash, so no
raw key is ever compared or logged.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "sk-sg-"
ADMIN_KEY_PREFIX = "sk-sga-"
#: Random part: 32 bytes -> 43 urlsafe base64 characters (no padding).
_KEY_RE = re.compile(r"\Ask-sg-[A-Za-z0-9_-]{43}\Z")  # \Z, not $: "$" passes a final "\n"
_ADMIN_KEY_RE = re.compile(r"\Ask-sga-[A-Za-z0-9_-]{43}\Z")
#: A key's public handle as generate_key_id / generate_admin_key_id make it.
_KEY_ID_RE = re.compile(r"\A(?:key|adm)_[0-9a-f]{16}\Z")
#: How much of a key is shown back (lists, dashboard): "sk-sg-" + 6 random chars,
#: 36 bits — enough to tell keys apart, far too little to guess the rest.
DISPLAY_CHARS = 12


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def generate_key_id() -> str:
    """Public handle of a key (safe to log): what revoke and lists use."""
    return "key_" + secrets.token_hex(8)


def generate_admin_key() -> str:
    return ADMIN_KEY_PREFIX + secrets.token_urlsafe(32)


def generate_admin_key_id() -> str:
    """Public handle of an admin key: ``adm_`` + 16 hex characters."""
    return "adm_" + secrets.token_hex(8)


def display_prefix(key: str) -> str:
    """The shown part: the type prefix and 6 random characters (36 bits)."""
    if key.startswith(ADMIN_KEY_PREFIX):
        return key[: len(ADMIN_KEY_PREFIX) + 6]
    return key[:DISPLAY_CHARS]


def looks_like_key(key: str) -> bool:
    """Cheap shape check, so garbage never costs a Redis round trip."""
    return _KEY_RE.fullmatch(key) is not None


def looks_like_admin_key(key: str) -> bool:
    return _ADMIN_KEY_RE.fullmatch(key) is not None


def looks_like_key_id(key_id: str) -> bool:
    """A tenant or admin key's handle in the shape it is made in (``key_``/``adm_`` + 16
    hex characters)."""
    return _KEY_ID_RE.fullmatch(key_id) is not None


def hash_key(pepper: str, key: str) -> str:
    return hmac.new(pepper.encode(), key.encode(), hashlib.sha256).hexdigest()


def same_secret(a: str, b: str) -> bool:
    """Constant-time equality (admin key, stored hashes)."""
    return hmac.compare_digest(a.encode(), b.encode())
