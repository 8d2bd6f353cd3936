"""The docs are true: every block marked ``<!-- run -->`` in README.md and docs/api.md
runs, in order, against a live stack (a gateway under uvicorn, the stub engine with
the real endpoint plugin, real Redis, and the demo tenant made by ``steergate up``'s
own code), and prints what its ``# →`` lines say it prints.

A block runs as written, with one substitution: ``http://127.0.0.1:8080`` becomes the
test gateway's URL. The environment is what ``steergate up`` tells the reader to
export (``KEY`` of the demo tenant, ``STEERGATE_ADMIN_KEY``, ``STEERGATE_GATEWAY_URL``;
``ADMIN`` as docs/api.md uses it), with ``.venv/bin`` first on ``PATH`` (``steergate``,
``python3``). A block's exports carry over to the next block of the same file. A ``# →``
line is checked as a fragment of the block's output, ignoring whitespace.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from steergate.cli import up
from tests.gateway.conftest import ADMIN_KEY, ENGINE_TOKEN, FakeEngine
from tests.gateway.servers import ServerThread
from tests.harness import installed_env

ROOT = Path(__file__).resolve().parents[3]
DOCS = ("README.md", "docs/api.md")
MARK = "<!-- run -->"
DOC_URL = "http://127.0.0.1:8080"
CARRIED = ("KEY", "ADMIN", "STEERGATE_ADMIN_KEY", "STEERGATE_GATEWAY_URL")


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str

    @property
    def expects(self) -> list[str]:
        return re.findall(r"^\s*# → (.+)$", self.code, re.M)


def runnable_blocks(doc: str) -> list[Block]:
    lines = (ROOT / doc).read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = lines[i + 1]
        assert fence.startswith("```"), f"{doc}:{i + 1}: {MARK} must precede a fenced block"
        lang = fence[3:].strip()
        assert lang in ("sh", "python"), f"{doc}:{i + 2}: runnable blocks are sh or python"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        blocks.append(Block(doc, i + 3, lang, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_runnable_blocks_are_complete() -> None:
    for doc in DOCS:
        blocks = runnable_blocks(doc)
        assert len(blocks) >= 4, doc
        for b in blocks:
            assert "…" not in b.code, f"{b.doc}:{b.line}: a runnable block holds a literal …"
            commands = re.sub(r"^\s*# → .*$", "", b.code, flags=re.M)
            assert "sk-sg-" not in commands, f"{b.doc}:{b.line}: a literal key; use $KEY"
            assert b.expects, f"{b.doc}:{b.line}: say what it prints (# → ...)"


@pytest.fixture()
def demo_env(gateway: ServerThread, fake_engine: FakeEngine) -> dict[str, str]:
    """What a reader has after pasting the export line ``steergate up`` printed."""
    info = httpx.get(
        fake_engine.url + "/v1/steering/info",
        headers={"Authorization": f"Bearer {ENGINE_TOKEN}"},
    ).json()
    demo = asyncio.run(up.create_demo(gateway.url, ADMIN_KEY, info, "stub"))
    env = installed_env()  # the docs' commands as installed, not from this checkout
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(
        KEY=demo.tenant_key,
        ADMIN=ADMIN_KEY,
        STEERGATE_ADMIN_KEY=ADMIN_KEY,
        STEERGATE_GATEWAY_URL=gateway.url,
    )
    return env


def run_blocks(doc: str, gateway: ServerThread, env: dict[str, str], tmp: Path) -> None:
    state = tmp / "env.sh"
    state.write_text("".join(f"export {k}={shlex.quote(env[k])}\n" for k in CARRIED))
    save = "".join(f'printf "export %s=%q\\n" {k} "${{{k}:-}}"; ' for k in CARRIED)
    for n, block in enumerate(runnable_blocks(doc)):
        code = block.code.replace(DOC_URL, gateway.url)
        if block.lang == "python":
            script = tmp / f"block{n}.py"
            script.write_text(code)
            command = f"source {state} && exec python3 {script}"
        else:
            script = tmp / f"block{n}.sh"
            script.write_text(code)
            command = (
                f"set -eo pipefail; source {state}; source {script}; "
                f"{{ {save}}} > {state}.new && mv {state}.new {state}"
            )
        done = subprocess.run(
            ["bash", "-c", command],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        where = f"{block.doc}:{block.line}"
        assert done.returncode == 0, f"{where} failed:\n{done.stdout}\n{done.stderr}"
        out = squash(done.stdout)
        for fragment in block.expects:
            assert squash(fragment) in out, f"{where}: no {fragment!r} in:\n{done.stdout}"


@pytest.mark.parametrize("doc", DOCS)
def test_documented_blocks_run_against_a_live_stack(
    doc: str, gateway: ServerThread, demo_env: dict[str, str], tmp_path: Path
) -> None:
    run_blocks(doc, gateway, demo_env, tmp_path)
