"""The worker -> API server channel for activation capture (numpy only, no vLLM).

Workers append what a step captured to files under :func:`capture_dir`, named by
the request's random capture id (``<cid>.<req hash>.<pp rank>.cap``); the API
server reads and deletes them when it builds the answer (``collect``). One file per
engine request (a prompt of a list, a child of ``n``), append-only:

* a header line, JSON: ``{"req_id", "sites": [[hook, layer], ...], "hidden", "reduce"}``;
* one record per step that captured rows: ``<qq`` (first position, rows) and then,
  for every site in header order, ``none``: ``float32 [rows, hidden]``; ``mean``:
  the rows' ``float64 [hidden]`` sum; ``last``: the last row, ``float32 [hidden]``.

A step's rows are written before the step's output leaves the worker, so when the
API server holds a request's final output its file is complete. Positions are
recorded by the worker at most once (it keeps the next position it has not yet
captured), so a recomputed position after preemption is never counted twice.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: The ``vllm_xargs`` key of the capture payload (workers trust it: only the rewrite
#: middleware writes it, and it strips any a client sends).
XARGS_KEY = "steergate_capture"
_CID = re.compile(r"[0-9a-f]{32}")
_RECORD = struct.Struct("<qq")
#: Files of answers never built (a client gone mid-request) are removed after this.
STALE_AFTER_S = 600.0

Site = tuple[str, int]


def refusal(vllm_config: Any) -> str | None:
    """Why an engine of this configuration cannot capture (None: it can). Capture's op
    body runs on the host every forward; a CUDA graph replays only what was recorded, so
    an engine that replays graphs cannot. The API server answers capture there with a
    501 ``not_implemented``; the workers then leave the op out of the model's graphs."""
    model_config = getattr(vllm_config, "model_config", None)
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    graphs = mode is not None and getattr(mode, "name", "NONE") != "NONE"
    if device != "cpu" and graphs and not getattr(model_config, "enforce_eager", False):
        return "this engine replays CUDA graphs; serve it with --enforce-eager to capture"
    if getattr(vllm_config, "speculative_config", None) is not None:
        # Draft tokens run through the model and are rolled back when rejected; the
        # capture plan keeps each position once, so it would keep the rejected drafts'
        # rows and skip the accepted tokens recomputed at those positions.
        return "this engine decodes speculatively; serve it without a draft model to capture"
    return None


def capture_dir() -> Path:
    """Shared by the API server and its workers (same host, same environment):
    ``STEERGATE_CAPTURE_DIR``, else ``/dev/shm/steergate-capture-<uid>`` (memory, not
    disk), else the temp dir."""
    env = os.environ.get("STEERGATE_CAPTURE_DIR")
    if env:
        return Path(env)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"steergate-capture-{os.getuid()}"


def ensure_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def new_capture_id() -> str:
    return os.urandom(16).hex()


@dataclass(frozen=True)
class CapturePayload:
    cid: str
    sites: tuple[Site, ...]
    tokens: str
    reduce: str


def encode_payload(cid: str, sites: Iterable[Site], tokens: str, reduce: str) -> str:
    doc = {"cid": cid, "sites": [[h, int(layer)] for h, layer in sites], "tokens": tokens,
           "reduce": reduce}
    return json.dumps(doc, separators=(",", ":"))


def decode_payload(text: str) -> CapturePayload:
    doc = json.loads(text)
    cid = str(doc["cid"])
    if not _CID.fullmatch(cid):  # it names a file: nothing but 32 hex digits
        raise ValueError("bad capture id")
    tokens, reduce = str(doc["tokens"]), str(doc["reduce"])
    if tokens not in ("prompt", "generated", "all") or reduce not in ("mean", "last", "none"):
        raise ValueError("bad capture tokens/reduce")
    sites = tuple((str(h), int(layer)) for h, layer in doc["sites"])
    return CapturePayload(cid=cid, sites=sites, tokens=tokens, reduce=reduce)


def file_name(cid: str, req_id: str, rank: int) -> str:
    digest = hashlib.sha256(req_id.encode()).hexdigest()[:16]
    return f"{cid}.{digest}.{rank}.cap"


def append_step(
    path: Path,
    header: Mapping[str, Any],
    first_pos: int,
    rows: int,
    per_site: Iterable[np.ndarray],
) -> None:
    """Append one step's record (writing the header first if the file is new)."""
    new = not path.exists()
    with open(path, "ab") as f:
        if new:
            f.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
        f.write(_RECORD.pack(first_pos, rows))
        for arr in per_site:
            f.write(np.ascontiguousarray(arr).tobytes())


@dataclass
class _Acc:
    """What one engine request captured, combined over its records."""

    req_id: str
    sites: list[Site]
    reduce: str
    hidden: int
    rows: dict[Site, list[np.ndarray]] = field(default_factory=dict)
    sums: dict[Site, np.ndarray] = field(default_factory=dict)
    count: int = 0
    last: dict[Site, np.ndarray] = field(default_factory=dict)
    last_pos: int = -1


def _read_file(path: Path) -> _Acc:
    data = path.read_bytes()
    nl = data.index(b"\n")
    head = json.loads(data[:nl])
    hidden, reduce = int(head["hidden"]), str(head["reduce"])
    acc = _Acc(str(head["req_id"]), [(str(h), int(x)) for h, x in head["sites"]], reduce, hidden)
    off = nl + 1
    while off < len(data):
        first_pos, n = _RECORD.unpack_from(data, off)
        off += _RECORD.size
        for site in acc.sites:
            if reduce == "none":
                size = 4 * n * hidden
                arr = np.frombuffer(data, "<f4", n * hidden, off).reshape(n, hidden)
                acc.rows.setdefault(site, []).append(arr)
            elif reduce == "mean":
                size = 8 * hidden
                arr = np.frombuffer(data, "<f8", hidden, off)
                acc.sums[site] = acc.sums.get(site, 0) + arr
            else:
                size = 4 * hidden
                arr = np.frombuffer(data, "<f4", hidden, off)
                if first_pos + n - 1 > acc.last_pos:
                    acc.last[site] = arr
            off += size
        acc.count += n
        acc.last_pos = max(acc.last_pos, first_pos + n - 1)
    return acc


def _result(acc: _Acc, site: Site) -> np.ndarray:
    h = acc.hidden
    if acc.reduce == "none":
        parts = acc.rows.get(site, [])
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros((0, h), np.float32)
    if acc.count == 0:
        return np.zeros((0, h), np.float32)
    if acc.reduce == "mean":
        return (acc.sums[site] / acc.count).astype(np.float32).reshape(1, h)
    return np.asarray(acc.last[site], np.float32).reshape(1, h)


def collect(cid: str, directory: Path | None = None) -> dict[str, dict[Site, np.ndarray]]:
    """Every engine request's captured rows for ``cid``, by worker request id, by
    site; the files are deleted (0 bytes retained after the answer)."""
    directory = directory or capture_dir()
    out: dict[str, dict[Site, np.ndarray]] = {}
    for path in sorted(directory.glob(f"{cid}.*.cap")) if _CID.fullmatch(cid) else []:
        try:
            acc = _read_file(path)
        finally:
            path.unlink(missing_ok=True)
        sites = out.setdefault(acc.req_id, {})
        for site in acc.sites:  # pipeline stages write their own layers' files
            sites[site] = _result(acc, site)
    return out


def discard(cid: str, directory: Path | None = None) -> None:
    directory = directory or capture_dir()
    if _CID.fullmatch(cid):
        for path in directory.glob(f"{cid}.*.cap"):
            path.unlink(missing_ok=True)


def sweep_stale(
    directory: Path | None = None,
    older_than_s: float = STALE_AFTER_S,
    running: Container[str] = (),
) -> int:
    """Remove files no answer collected (a worker wrote after the client left), except
    those of ``running`` capture ids: a request still running may not have written for
    a long while (``tokens: "prompt"`` writes at prefill only, then generation runs).
    Sweeping them answered it 200 with empty activations."""
    directory = directory or capture_dir()
    cutoff, removed = time.time() - older_than_s, 0
    for path in directory.glob("*.cap"):
        if path.name.split(".", 1)[0] in running:
            continue
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            pass
    return removed


# -- worker request ids -> choice index ------------------------------------------------
# vLLM names an engine request ``<base>[-<prompt i>]-<8 random hex>``, and the n
# children of one ``<child i>_<that>`` (vllm.v1.engine: input_processor.assign_request_id,
# parallel_sampling.get_child_info; completion serving appends ``-<i>`` per prompt).
_CHILD = re.compile(r"^(\d+)_(.*)$", re.S)
_RAND = re.compile(r"-[0-9a-f]{8}$")
_PROMPT_I = re.compile(r"-(\d+)$")


def choice_index(req_id: str, n: int, prompt_list: bool) -> int:
    """The answer's choice index of an engine request: ``prompt_i * n + child_i``
    (``prompt_list``: /v1/completions, whose ids carry the prompt's index)."""
    child, rest = 0, req_id
    m = _CHILD.match(rest)
    if m and n > 1:
        child, rest = int(m.group(1)), m.group(2)
    rest = _RAND.sub("", rest)
    prompt_i = 0
    if prompt_list:
        pm = _PROMPT_I.search(rest)
        prompt_i = int(pm.group(1)) if pm else 0
    return prompt_i * n + child
