"""``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in the API server, the engine core and every worker,
possibly more than once per process, so it is idempotent and imports torch/vLLM
only when called. It registers the custom op (importing the module is what
registers it), tags the compile cache and patches the model runner.
"""

from __future__ import annotations

_done = False


def register() -> None:
    global _done
    if _done:
        return
    from engine.worker import compile_tag, op, runner  # noqa: F401  (op: registers steergate::steer)

    compile_tag.install()
    runner.install()
    _done = True
