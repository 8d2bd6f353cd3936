"""The stream relay's event splitter (``routes/inference.py`` ``SseEvents``): the same
events however the engine's bytes are cut into chunks, a separator split across two
chunks included. It replaced ``buf += chunk`` and a search of the whole buffer per
chunk, which made one 40 MB capture event cost 15 s of the event loop (0.23 s now:
docs/benchmarks.md)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from steergate.gateway.routes.inference import SseEvents

EVENTS = st.lists(
    st.binary(min_size=1, max_size=40).map(lambda b: b"data: " + b.replace(b"\n", b"")),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, cuts=st.lists(st.integers(0, 400), max_size=12), last_ended=st.booleans())
def test_events_are_the_same_however_the_stream_is_chunked(
    events: list[bytes], cuts: list[int], last_ended: bool
) -> None:
    stream = b"\n\n".join(events) + (b"\n\n" if last_ended else b"")
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    splitter, out = SseEvents(), []
    for a, b in zip(points, points[1:], strict=False):
        out.extend(splitter.feed(stream[a:b]))
    rest = splitter.rest()
    assert out + ([rest] if rest else []) == events


def test_a_separator_split_across_two_chunks_ends_the_event() -> None:
    splitter = SseEvents()
    assert splitter.feed(b"data: a\n") == []
    assert splitter.feed(b"\ndata: b") == [b"data: a"]
    assert splitter.rest() == b"data: b"


def test_a_large_event_is_kept_in_pieces_until_it_ends() -> None:
    splitter = SseEvents()
    body = b"data: " + b"x" * (1 << 20)
    for i in range(0, len(body), 65536):
        assert splitter.feed(body[i : i + 65536]) == []
    assert splitter.feed(b"\n\n") == [body]
    assert splitter.rest() == b""


async def test_the_relay_gets_every_event_and_then_an_unended_last_one() -> None:
    async def chunks(*parts: bytes):  # noqa: ANN202
        for part in parts:
            yield part

    async def events(*parts: bytes) -> list[bytes]:
        return [e async for e in SseEvents.of(chunks(*parts))]

    assert await events(b"data: a\n\nda", b"ta: b") == [b"data: a", b"data: b"]
    assert await events(b"data: a\n\n", b"\n") == [b"data: a"]  # a blank tail is no event
    assert await events() == []
