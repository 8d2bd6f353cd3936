"""steergate: a multi-tenant API gateway and a steering engine for vLLM.

The distribution installs exactly one top-level package, this one; the project's three
folders are its subpackages (``pyproject.toml``'s package-dir mapping):

* ``steergate.gateway`` (``gateway/``): the FastAPI + Redis gateway,
* ``steergate.engine`` (``engine/``): the vLLM plugins (steering op, latches, routes),
* ``steergate.shared`` (``shared/``): what both sides use (contract, errors, CLI).

In a source checkout (tests, ``python -m steergate.cli`` from the repository
root) the folders sit beside this one, so they are added to this package's path; an
installed wheel holds them inside it, and the path is left alone.
"""

from __future__ import annotations

import os

# realpath: reached through a symlink (the test harness's view of a checkout, see
# tests/harness.py ``installed_env``), the folders are found beside the real file.
_HERE = os.path.dirname(os.path.realpath(__file__))
_CHECKOUT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "gateway")) and os.path.isfile(
    os.path.join(_CHECKOUT, "gateway", "__init__.py")
):
    __path__.append(_CHECKOUT)  # type: ignore[name-defined]  # noqa: F821
