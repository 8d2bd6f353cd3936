"""What leaves the gateway loses scoped ids (``request_scoping.scrub``), and nothing else:
a success body (or stream event) loses the caller's own ``<tenant>~`` where it starts an
id; the same bytes inside a word are generated text. Found from outside: tenant ``a``'s
"banana~split" came back as "bananasplit", in bodies and streams."""

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
    # inside words untouched; where "a~" starts an id-shaped token it is still removed
    assert doc["text"] == "Use ~/data~backup and banana~split; see b or (c)"
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
    assert "banana~split" in content and "data~backup" in content
