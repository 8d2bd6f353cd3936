"""The package layout, computed: the distribution's one top-level package is
``steergate``, and each of the project's folders that is present (``gateway/``,
``engine/``, ``shared/``, ``cli/``) is mapped into it as ``steergate.<folder>`` with its
subpackages. Everything else is in pyproject.toml. Computed rather than listed so an
image that copies only some folders (the gateway image has no ``engine/``) builds."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
FOLDERS = [
    f for f in ("gateway", "engine", "shared", "cli") if (ROOT / f / "__init__.py").is_file()
]

setup(
    packages=["steergate"]
    + [f"steergate.{f}" for f in FOLDERS]
    + [f"steergate.{f}.{sub}" for f in FOLDERS for sub in find_packages(str(ROOT / f))],
    package_dir={"steergate": "steergate", **{f"steergate.{f}": f for f in FOLDERS}},
)
