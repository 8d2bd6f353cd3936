"""One installable namespace (issue 15): a wheel of this project adds exactly one
top-level name, ``steergate``, to the environment it is installed in (shared with vLLM
and everything else), with the Lua scripts and dashboard files inside it and the
entry points pointing into it; each module's path in the checkout is its path in the
wheel (issue 24); an image that copies only some folders (the gateway image has no
``steergate/engine/``) still builds."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.harness import ROOT


def build_wheel(src: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("steergate-*.whl")
    return wheel


def copy_source(dest: Path, folders: tuple[str, ...]) -> Path:
    """The files an image copies (pip builds in the source tree: not in this one):
    ``steergate/__init__.py`` and the named folders of ``steergate/``."""
    (dest / "steergate").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copy(ROOT / "steergate" / "__init__.py", dest / "steergate" / "__init__.py")
    for folder in folders:
        shutil.copytree(
            ROOT / "steergate" / folder,
            dest / "steergate" / folder,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = copy_source(tmp / "src", ("shared", "gateway", "engine", "cli"))
    return build_wheel(src, tmp / "out")


def test_the_wheel_holds_one_top_level_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if ".dist-info/" not in n}
    assert tops == {"steergate"}
    # path = import name: every module of the checkout's package is in the wheel at the
    # same path (no folder is mapped elsewhere)
    for module in (ROOT / "steergate").rglob("*.py"):
        if "__pycache__" in module.parts:
            continue
        rel = module.relative_to(ROOT).as_posix()
        assert rel in names, f"{rel} missing from the wheel"
    # every Lua script, the preludes put before some of them included
    for script in (ROOT / "steergate" / "gateway" / "store" / "lua").rglob("*.lua"):
        assert script.relative_to(ROOT).as_posix() in names, f"{script.name} missing"
    assert "steergate/gateway/store/lua/prelude/tenant_generation.lua" in names
    assert "steergate/gateway/static/dashboard.js" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "steergate = steergate.cli.main:main" in text
    assert "steergate = steergate.engine.plugin:register" in text
    assert "steergate = steergate.engine.http.plugin:SteeringEndpointPlugin" in text


def test_installing_the_wheel_adds_only_steergate(wheel: Path, tmp_path: Path) -> None:
    env = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    py = env / "bin" / "python"
    # the clean venv sees nothing of the test run's PYTHONPATH (a checkout on it would
    # make pip think steergate is already installed, and the import find the checkout)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    site = Path(
        subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True, env=clean,
        ).stdout.strip()
    )  # fmt: skip
    before = {p.name for p in site.iterdir()}
    subprocess.run(
        [py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True, capture_output=True, timeout=300, env=clean,
    )  # fmt: skip
    added = {p.name for p in site.iterdir()} - before
    assert {n for n in added if not n.endswith(".dist-info")} == {"steergate"}, added
    # the package is importable as installed (not from this checkout, whatever the test
    # run's PYTHONPATH) and has no path extension there: its folders are inside it, and
    # the data files are where the code looks for them
    out = subprocess.run(
        [py, "-c", "import steergate, steergate.cli as j; "
         "print(steergate.__path__, j.__file__); "
         "from importlib.resources import files; "
         "print(files('steergate.gateway.store').joinpath('lua', 'admit_request.lua').is_file(), "
         "files('steergate.gateway').joinpath('static', 'dashboard.html').is_file())"],
        check=True, capture_output=True, text=True, cwd=tmp_path, env=clean,
    ).stdout  # fmt: skip
    assert str(site / "steergate") in out and str(ROOT) not in out
    assert out.splitlines()[-1] == "True True", out


def test_an_image_without_engine_folder_builds_without_it(tmp_path: Path) -> None:
    # what docker/gateway.Dockerfile copies
    src = copy_source(tmp_path / "src", ("shared", "gateway", "cli"))
    names = zipfile.ZipFile(build_wheel(src, tmp_path / "out")).namelist()
    assert "steergate/gateway/app.py" in names
    assert not any(n.startswith("steergate/engine/") for n in names)
