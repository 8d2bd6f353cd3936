"""Every id, name, key and layer-key validator, attacked with the characters that once
got through: a trailing newline (``$`` matches before it), other control characters,
whitespace, and non-ASCII digits and letters (``\\d``, ``isdigit`` and ``int`` take
"²", "١" and "１"). Plus property tests that what they accept round-trips exactly
through scoping, the engine's checks and the gateway's HTTP client."""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from steergate.engine.http.rewrite import _conversation_id as engine_conversation_id
from steergate.engine.http.routes import _vector_name as engine_vector_name
from steergate.gateway.admission.units import parse_bytes
from steergate.gateway.engines.http1 import HTTPError, InvalidRequestTarget, check_target
from steergate.gateway.tenancy.api_keys import generate_key, looks_like_key
from steergate.shared.errors import APIError
from steergate.shared.scoping import (
    CONVERSATION_ID_RE,
    DOT_SEGMENTS,
    ENGINE_CONVERSATION_ID_RE,
    ENGINE_VECTOR_NAME_RE,
    TENANT_ID_RE,
    VECTOR_NAME_RE,
    check_conversation_id,
    check_tenant_id,
    check_vector_name,
    is_engine_conversation_id,
    is_engine_vector_name,
    scope,
    unscope,
)
from steergate.shared.steering import ModelShape, parse_steering

SHAPE = ModelShape(hidden_size=8, num_layers=4)
CONTROL = [chr(c) for c in range(0x20)] + ["\x7f"]
WHITESPACE = [" ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u2028", "\u3000"]
#: Superscript two, Arabic-Indic one, fullwidth one and a, accented e, Kelvin sign,
#: dotless i, a zero-width space: each is a "digit", "letter" or invisible somewhere.
NON_ASCII = ["²", "١", "１", "ａ", "é", "\u212a", "ı", "\u200b"]


def _accepts(check: Callable[[str], object]) -> Callable[[str], bool]:
    def accepts(value: str) -> bool:
        try:
            return check(value) is not False
        except (APIError, ValueError, HTTPError):
            return False

    return accepts


def _layer_key(key: str) -> object:
    vectors = [{"hook": "post_block", "layers": {key: [0.5] * SHAPE.hidden_size}}]
    return parse_steering({"vectors": vectors}, SHAPE)


def _engine_regexes(value: str) -> bool:
    """The raw ENGINE_* patterns, by every method a caller might reach for."""
    patterns = (ENGINE_CONVERSATION_ID_RE, ENGINE_VECTOR_NAME_RE)
    return any(p.match(value) or p.fullmatch(value) or p.search(value) for p in patterns)


def _client_regexes(value: str) -> bool:
    patterns = (TENANT_ID_RE, CONVERSATION_ID_RE, VECTOR_NAME_RE)
    return any(p.match(value) or p.fullmatch(value) or p.search(value) for p in patterns)


#: name -> (accepts, a value it accepts). Every validator of an id, name, key or
#: layer key on either side of the gateway/engine boundary.
VALIDATORS: dict[str, tuple[Callable[[str], bool], str]] = {
    "check_conversation_id": (_accepts(check_conversation_id), "chat-1"),
    "check_vector_name": (_accepts(check_vector_name), "calm"),
    "check_tenant_id": (_accepts(check_tenant_id), "acme"),
    "is_engine_conversation_id": (is_engine_conversation_id, "acme~chat-1"),
    "is_engine_vector_name": (is_engine_vector_name, "acme~calm"),
    "ENGINE_*_RE (match/fullmatch/search)": (_engine_regexes, "acme~calm"),
    "client *_RE (match/fullmatch/search)": (_client_regexes, "acme"),
    "engine rewrite conversation_id": (_accepts(engine_conversation_id), "acme~chat-1"),
    "engine route vector name": (_accepts(engine_vector_name), "acme~calm"),
    "api key format": (looks_like_key, generate_key()),
    "layer key": (_accepts(_layer_key), "1"),
    "size flag (units)": (_accepts(parse_bytes), "64KiB"),
    "http1 request target": (_accepts(lambda t: check_target("GET", t)), "/v1/x?a=b"),
}


def _variants(base: str, bad: str) -> list[str]:
    """``bad`` appended, prepended, inside, and in place of the last character (the
    last catches fixed-length patterns such as the API key's)."""
    return [base + bad, bad + base, base[:1] + bad + base[1:], base[:-1] + bad]


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_validator_accepts_its_sample(name: str) -> None:
    accepts, sample = VALIDATORS[name]
    assert accepts(sample), name


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_validator_rejects_every_control_character_anywhere(name: str) -> None:
    accepts, sample = VALIDATORS[name]
    for c in CONTROL:
        for value in _variants(sample, c):
            assert not accepts(value), (name, value)


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_validator_rejects_leading_and_trailing_whitespace(name: str) -> None:
    accepts, sample = VALIDATORS[name]
    for w in WHITESPACE:
        for value in (sample + w, w + sample, sample + w + w):
            assert not accepts(value), (name, value)


@pytest.mark.parametrize("name", list(VALIDATORS))
def test_every_validator_rejects_non_ascii_digits_and_letters(name: str) -> None:
    accepts, sample = VALIDATORS[name]
    for ch in NON_ASCII:
        for value in [*_variants(sample, ch), ch]:
            assert not accepts(value), (name, value)


def test_the_trailing_newline_attack_is_refused_at_the_client_checks() -> None:
    """The audit's reproduction: each of these used to pass ``re.match(r"^...$")``."""
    for check, value in [
        (check_conversation_id, "chat-1\n"),
        (check_vector_name, "calm\n"),
        (check_tenant_id, "acme\n"),
    ]:
        with pytest.raises(APIError) as info:
            check(value)
        assert info.value.status == 400
    assert not looks_like_key(generate_key() + "\n")


def test_dot_segments_are_no_names_for_the_client_or_the_engine() -> None:
    """ "." and ".." match the character classes but are path segments: a URL cannot
    name them (clients resolve them), so they are refused everywhere an id is checked."""
    for value in DOT_SEGMENTS:
        for check in (check_conversation_id, check_vector_name):
            with pytest.raises(APIError) as info:
                check(value)
            assert info.value.status == 400 and "not '.' or '..'" in info.value.message
        assert not is_engine_conversation_id(value)
        assert not is_engine_vector_name(value)
        # the engine's own checks are those predicates: it refuses them too
        for engine_check in (engine_conversation_id, engine_vector_name):
            with pytest.raises(APIError):
                engine_check(value)
    for value in ("...", ".a", "a..", "v1.2"):
        assert check_conversation_id(value) == value and check_vector_name(value) == value
        assert is_engine_vector_name(value) and is_engine_vector_name(scope("acme", value))


# -- properties ---------------------------------------------------------------------

TENANTS = st.from_regex(TENANT_ID_RE, fullmatch=True)
LOCAL_IDS = st.one_of(
    st.from_regex(CONVERSATION_ID_RE, fullmatch=True).map(lambda x: ("conv", x)),
    st.from_regex(VECTOR_NAME_RE, fullmatch=True).map(lambda x: ("vector", x)),
).filter(lambda kx: kx[1] not in DOT_SEGMENTS)
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(tenant=TENANTS, other=TENANTS, local=LOCAL_IDS)
def test_accepted_ids_round_trip_exactly_through_scoping_and_the_engine(
    tenant: str, other: str, local: tuple[str, str]
) -> None:
    kind, x = local
    assert check_tenant_id(tenant) == tenant
    if kind == "conv":
        assert check_conversation_id(x) == x
        scoped = scope(tenant, x)
        assert is_engine_conversation_id(scoped)
        assert engine_conversation_id(scoped) == scoped
        path = "/v1/steering/latches/"
    else:
        assert check_vector_name(x) == x
        scoped = scope(tenant, x)
        assert is_engine_vector_name(scoped)
        assert engine_vector_name(scoped) == scoped
        path = "/v1/steering/vectors/"
    assert unscope(tenant, scoped) == x
    if other != tenant:  # isolation: no other tenant can read it back as its own
        assert unscope(other, scoped) is None
    encoded = quote(scoped, safe="").encode("ascii")
    assert all(0x21 <= b <= 0x7E for b in encoded)
    # The gateway sends the scoped form unencoded; its HTTP client must let it through.
    check_target("DELETE", path + scoped)
    check_target("GET", f"{path[:-1]}?prefix={scoped[: len(tenant) + 1]}")


@PROPERTY
@given(
    data=st.data(),
    text=st.text(max_size=40),
    bad=st.sampled_from(CONTROL + WHITESPACE),
)
def test_nothing_with_a_control_character_or_whitespace_is_accepted(
    data: st.DataObject, text: str, bad: str
) -> None:
    pos = data.draw(st.integers(0, len(text)), label="pos")
    value = text[:pos] + bad + text[pos:]
    for name, (accepts, _) in VALIDATORS.items():
        assert not accepts(value), (name, value)


@PROPERTY
@given(sample=st.sampled_from(sorted(VALIDATORS)), pos=st.integers(0, 64), bad=st.data())
def test_a_control_character_inside_an_accepted_value_is_refused(
    sample: str, pos: int, bad: st.DataObject
) -> None:
    accepts, good = VALIDATORS[sample]
    c = bad.draw(st.sampled_from(CONTROL + WHITESPACE))
    pos = min(pos, len(good))
    assume(not (sample == "size flag (units)" and c == " "))  # "64 KiB", as format_bytes writes
    assert not accepts(good[:pos] + c + good[pos:])


def test_http1_target_check_raises_its_own_class() -> None:
    for target in ["/v1/x y", "/v1/x\r\nHost: evil", "/v1/\x7f", "/v1/é", "", "v1/x"]:
        with pytest.raises(InvalidRequestTarget):
            check_target("GET", target)
    with pytest.raises(InvalidRequestTarget):
        check_target("GET /x HTTP/1.1\r\n", "/")
