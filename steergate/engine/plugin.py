"""``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in the API server, the engine core and every worker,
possibly more than once per process, so it is idempotent and imports torch/vLLM
only when called. It checks the start-up contract (vLLM version, and every private
method, parameter list and field the adapters rely on; see
:mod:`engine.worker.contract`), registers the custom op (importing the module is what
registers it), tags the compile cache and patches the model runners. A contract
mismatch raises here, which vLLM does not catch: the engine refuses to start, naming
what changed, instead of failing at the first step or steering the wrong tokens.
"""

from __future__ import annotations

_done = False


def register() -> None:
    global _done
    if _done:
        return
    import vllm

    from steergate.engine.worker import (  # noqa: F401  (op, capture: register their ops)
        capture,
        compile_tag,
        contract,
        op,
        runner,
        runner_v2,
    )

    contract.raise_if(
        f"vLLM {vllm.__version__} does not match the steering adapter",
        contract.version_problems(vllm.__version__)
        or contract.v1_problems()
        or capture.bypass_problems(),
    )
    capture.install_prefix_cache_bypass()
    compile_tag.install()
    runner.install()
    # V2 differences only matter if the engine selects V2: its load_model then refuses.
    runner_v2.install(contract.v2_problems())
    _done = True
