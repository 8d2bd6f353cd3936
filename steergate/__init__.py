"""steergate: a multi-tenant API gateway and a steering engine for vLLM.

The distribution installs exactly one top-level package, this one; its folders are its
subpackages, and each one's path is its import name:

* ``steergate.gateway`` (``steergate/gateway/``): the FastAPI + Redis gateway,
* ``steergate.engine`` (``steergate/engine/``): the vLLM plugins (steering op, latches, routes),
* ``steergate.shared`` (``steergate/shared/``): what both sides use (contract, errors, settings),
* ``steergate.cli`` (``steergate/cli/``): the ``steergate`` command.

Which of them an image holds is its choice (the gateway image has no
``steergate/engine/``); the extras in ``pyproject.toml`` name each side's dependencies.
"""
