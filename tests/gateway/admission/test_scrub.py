"""What leaves the gateway loses scoped ids (``request_scoping.scrub``), and nothing else:
a success body (or stream event) loses the caller's own ``<tenant>~`` only from a JSON
string that is one whole scoped id; generated text is never changed. Found from outside:
tenant ``a``'s "banana~split" came back as "bananasplit", and (later) "see a~b" as
"see b", in bodies and streams."""

from __future__ import annotations

import orjson

from steergate.gateway.admission.request_scoping import scrub
from steergate.gateway.admission.stream_meter import StreamMeter
from steergate.gateway.routes.inference import _relay_event

TEXT = "Use ~/data~backup and banana~split; see a~b or (a~c)"


def test_success_bodies_lose_the_callers_ids_not_its_words() -> None:
    body = orjson.dumps({"conversation_id": "a~chat-1", "text": TEXT})
    doc = orjson.loads(scrub(body, "a"))
    assert doc["conversation_id"] == "chat-1"
    assert doc["text"] == TEXT  # generated text: never changed
    # a whole string that is an id-shaped token is taken for an echoed id
    doc = orjson.loads(scrub(orjson.dumps({"names": ["a~calm", "a~b c", "xa~b"]}), "a"))
    assert doc["names"] == ["calm", "a~b c", "xa~b"]
    other = orjson.dumps({"conversation_id": "acme~chat-1"})
    assert scrub(other, "a") == other  # another tenant's prefix: not the caller's to cut
    assert scrub(b'{"x": "plain"}', "a") == b'{"x": "plain"}'


def test_error_bodies_lose_every_scope_prefix() -> None:
    assert scrub(b"no latch for acme~c1 or beta~c2", "acme", error=True) == (
        b"no latch for c1 or c2"
    )


def test_stream_events_are_scrubbed_as_bodies_are() -> None:
    event = b"data: " + orjson.dumps({"choices": [{"delta": {"content": TEXT}}]})
    out, failed = _relay_event(event, True, StreamMeter(), None, "a")
    assert out is not None and not failed
    content = orjson.loads(out[6:])["choices"][0]["delta"]["content"]
    assert content == TEXT
