"""The worker's capture plan and the worker -> API server files, without vLLM: steps
laid out as vLLM lays them out (flattened rows, first position per request), through
the real op, the real files and the API server's collector."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from steergate.engine import capture_io
from steergate.engine.worker import capture

H = 4
SITE = ("post_block", 1)


def _state(tmp_path: Path) -> capture.CaptureState:
    return capture.CaptureState(frozenset({0, 1}), H, writer=True, directory=tmp_path)


def _stream(positions: list[int]) -> torch.Tensor:
    """A stream whose row for position p is [p, p, p, p] (so rows name their position)."""
    return torch.tensor([[float(p)] * H for p in positions])


def _step(st: capture.CaptureState, layout: list[tuple[str, int, int, int]],
          prompt_len: dict[str, int]) -> None:
    """One step: ``layout`` is (req_id, first position, rows, flattened start)."""
    st.plan_step([(r, start, start + n, pos, prompt_len[r]) for r, pos, n, start in layout])
    rows: list[int] = []
    for _r, pos, n, _start in sorted(layout, key=lambda x: x[3]):
        rows += list(range(pos, pos + n))
    capture.install_state(st)
    try:
        capture.read(_stream(rows), None, *SITE)
    finally:
        capture.install_state(None)
    st.flush()


@pytest.mark.parametrize(("tokens", "want"), [
    ("prompt", list(range(6))), ("generated", [6, 7, 8]), ("all", list(range(9))),
])
def test_chunks_and_a_preemption_capture_each_position_once(
    tmp_path: Path, tokens: str, want: list[int]
) -> None:
    st = _state(tmp_path)
    cid = capture_io.new_capture_id()
    payload = capture_io.CapturePayload(cid, (SITE, ("pre_attn", 7)), tokens, "none")
    st.add_request("cmpl-x-0-0a1b2c3d", payload)
    other = "cmpl-y-0-0a1b2c3d"  # a plain request sharing the steps
    lens = {"cmpl-x-0-0a1b2c3d": 6, other: 3}
    _step(st, [("cmpl-x-0-0a1b2c3d", 0, 4, 0), (other, 0, 3, 4)], lens)  # chunk 1 of the prompt
    _step(st, [(other, 3, 1, 0), ("cmpl-x-0-0a1b2c3d", 4, 2, 1)], lens)  # chunk 2
    _step(st, [("cmpl-x-0-0a1b2c3d", 6, 1, 0)], lens)  # first generated token fed back
    # preempted, then recomputed from position 0 in one chunk together with two more
    _step(st, [("cmpl-x-0-0a1b2c3d", 0, 9, 0)], lens)
    got = capture_io.collect(cid, tmp_path)
    assert list(got) == ["cmpl-x-0-0a1b2c3d"]
    rows = got["cmpl-x-0-0a1b2c3d"][SITE]
    assert rows[:, 0].tolist() == want  # each position once, in order
    assert ("pre_attn", 7) not in got["cmpl-x-0-0a1b2c3d"]  # not on this rank's layers
    assert not list(tmp_path.iterdir())  # collected files are deleted


def test_mean_and_last_combine_records(tmp_path: Path) -> None:
    st = _state(tmp_path)
    for reduce in ("mean", "last"):
        cid = capture_io.new_capture_id()
        st.add_request(reduce, capture_io.CapturePayload(cid, (SITE,), "all", reduce))
        _step(st, [(reduce, 0, 3, 0)], {reduce: 5})
        _step(st, [(reduce, 3, 2, 0)], {reduce: 5})
        rows = capture_io.collect(cid, tmp_path)[reduce][SITE]
        want = [2.0] * H if reduce == "mean" else [4.0] * H
        np.testing.assert_allclose(rows, [want])


def test_a_step_without_capture_plans_nothing(tmp_path: Path) -> None:
    st = _state(tmp_path)
    st.plan_step([("a", 0, 5, 0, 5)])
    assert st.plan == []
    st.add_request("b", capture_io.CapturePayload(capture_io.new_capture_id(), (SITE,),
                                                  "generated", "none"))
    st.plan_step([("b", 0, 5, 0, 5)])  # only prompt positions this step
    assert st.plan == []


def test_only_tensor_parallel_rank_0_writes(tmp_path: Path) -> None:
    st = capture.CaptureState(frozenset({1}), H, writer=False, directory=tmp_path)
    st.add_request("a", capture_io.CapturePayload(capture_io.new_capture_id(), (SITE,), "all",
                                                  "none"))
    assert st.reqs == {}


@pytest.mark.parametrize(("req_id", "n", "prompt_list", "index"), [
    ("cmpl-abc-0-0a1b2c3d", 1, True, 0),
    ("cmpl-abc-3-0a1b2c3d", 1, True, 3),
    ("1_cmpl-abc-2-0a1b2c3d", 2, True, 5),
    ("chatcmpl-req-7-0a1b2c3d", 1, False, 0),  # a chat id ending in digits is not a list
    ("2_chatcmpl-req-0a1b2c3d", 3, False, 2),
])
def test_engine_request_ids_map_to_choice_indices(
    req_id: str, n: int, prompt_list: bool, index: int
) -> None:
    assert capture_io.choice_index(req_id, n, prompt_list) == index


def test_payload_refuses_a_capture_id_that_is_not_32_hex() -> None:
    with pytest.raises(ValueError):
        capture_io.decode_payload(capture_io.encode_payload("../../etc", [SITE], "all", "none"))
    assert capture_io.collect("../x") == {}


def _config(device: str, graphs: str, eager: bool = False) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=eager, max_model_len=64),
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs)),
    )


def test_only_an_engine_that_replays_cuda_graphs_cannot_capture() -> None:
    assert "CUDA graphs" in (capture_io.refusal(_config("cuda", "FULL_AND_PIECEWISE")) or "")
    assert capture_io.refusal(_config("cuda", "FULL_AND_PIECEWISE", eager=True)) is None
    assert capture_io.refusal(_config("cuda", "NONE")) is None
    assert capture_io.refusal(_config("cpu", "PIECEWISE")) is None


def test_an_engine_that_decodes_speculatively_cannot_capture() -> None:
    """Rejected draft tokens are rolled back and their positions recomputed; capture
    keeps each position once, so it answered with the rejected drafts' rows."""
    config = _config("cpu", "NONE")
    assert capture_io.refusal(config) is None
    config.speculative_config = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    assert "speculatively" in (capture_io.refusal(config) or "")


def test_wrappers_leave_the_op_out_where_capture_is_refused() -> None:
    """A capture call is a declared mutation of the stream, across which Inductor does
    not fuse; an engine that cannot capture (CUDA graphs) keeps it out of its graphs.
    The steering ops are called all the same."""
    from steergate.engine.worker.layers import find_decoder_layers, wrap_layers

    from .test_clamp_op import _op_calls, _tables
    from .test_steering_op import H, _Model

    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present)
    wrap_layers(layers, present, t)
    t.fill([], 1)
    x = torch.randn(1, H)
    try:
        calls = _op_calls(model, x)
        assert calls["steergate::capture"] == 3 * len(present)
        capture.call_op(False)
        off = _op_calls(model, x)
        assert "steergate::capture" not in off
        assert off["steergate::steer_and_clamp"] == calls["steergate::steer_and_clamp"] > 0
    finally:
        capture.call_op(True)


def test_the_stale_sweep_spares_a_request_still_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokens: "prompt"`` writes at prefill only; a generation (or a queue) that then
    ran past the stale horizon had its file swept by the next capture request's
    ``take``, and its answer was a 200 with zero rows. A running request's files stay;
    an orphan's (a worker that wrote after its client left) still go."""
    import os
    import time

    from steergate.engine.http import capture as capture_http
    from steergate.shared.steering import ModelShape

    monkeypatch.setenv("STEERGATE_CAPTURE_DIR", str(tmp_path))
    shape, support = ModelShape(hidden_size=H, num_layers=4), capture_http.CaptureSupport(64)

    def take() -> capture_http.CaptureCall:
        doc = {"prompt": [1, 2, 3], "max_tokens": 4,
               "capture": {"sites": [{"hook": "post_block", "layers": [1]}]}}  # fmt: skip
        call = capture_http.take(doc, "/v1/completions", shape, support)
        assert call is not None
        call.apply(doc)  # the request is sent: it is running
        return call

    running = take()
    st = _state(tmp_path)
    st.add_request("cmpl-r-0-0a1b2c3d", capture_io.CapturePayload(running.cid, (SITE,),
                                                                  "prompt", "mean"))  # fmt: skip
    _step(st, [("cmpl-r-0-0a1b2c3d", 0, 3, 0)], {"cmpl-r-0-0a1b2c3d": 3})
    orphan = tmp_path / f"{capture_io.new_capture_id()}.0.cap"
    orphan.write_bytes(b"")
    old = time.time() - capture_io.STALE_AFTER_S - 100
    for path in tmp_path.iterdir():
        os.utime(path, (old, old))
    later = take()  # another request's take() sweeps stale files
    assert not orphan.exists()
    from steergate.shared.capture import decode_capture

    rows = decode_capture(running.answer())[(0, *SITE)]
    np.testing.assert_allclose(rows, [[1.0] * H])  # the prompt's mean, not zero rows
    later.discard()
    assert capture_http._RUNNING == set()


def _applied_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An API server's capture call, applied (its request sent), with late re-discards
    0.1 s and 0.3 s after a discard."""
    from steergate.engine.http import capture as capture_http
    from steergate.shared.steering import ModelShape

    monkeypatch.setenv("STEERGATE_CAPTURE_DIR", str(tmp_path))
    monkeypatch.setattr(capture_http, "LATE_WRITES_S", (0.1, 0.3))
    shape, support = ModelShape(hidden_size=H, num_layers=4), capture_http.CaptureSupport(64)
    doc = {"prompt": [1, 2, 3], "max_tokens": 4,
           "capture": {"sites": [{"hook": "post_block", "layers": [1]}]}}  # fmt: skip
    call = capture_http.take(doc, "/v1/completions", shape, support)
    assert call is not None
    call.apply(doc)
    return call


async def test_a_file_written_after_its_request_was_discarded_is_removed_soon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found from outside: a streamed capture whose client left mid-answer had its
    files discarded, then a worker wrote one more step's rows; that file stayed in
    /dev/shm until a later capture's stale sweep (10 minutes), and past the engine's
    end. A discarded request's files are now removed again shortly after; another
    request's are left alone."""
    import asyncio

    call = _applied_call(tmp_path, monkeypatch)
    call.discard()  # the client left
    late = tmp_path / f"{call.cid}.0a1b.0.cap"
    other = tmp_path / f"{capture_io.new_capture_id()}.0a1b.0.cap"
    late.write_bytes(b"late rows")  # the worker's step after the discard
    other.write_bytes(b"another request's rows")
    await asyncio.sleep(0.2)
    assert not late.exists() and other.exists()
    late.write_bytes(b"later still")
    await asyncio.sleep(0.2)
    assert not late.exists() and other.exists()


async def test_rows_written_after_the_answer_are_removed_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found from outside: an answer that ends on a ``stop`` string is collected while
    the engine core runs the request one more step (the abort reaches it later), and
    that step's file stayed in /dev/shm until a later capture's stale sweep. The final
    discard after an answer removes files again later, as after a client left."""
    import asyncio

    call = _applied_call(tmp_path, monkeypatch)
    assert call.answer()["sites"]  # the answer collected the files there were
    call.discard()  # the request's end (engine/http/rewrite.py)
    late = tmp_path / f"{call.cid}.0a1b.0.cap"
    late.write_bytes(b"the step after the stop string")
    await asyncio.sleep(0.2)
    assert not late.exists()
