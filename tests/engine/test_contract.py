"""The start-up contract: this vLLM meets it, and a changed vLLM (faked by patching
its classes) is refused at registration or at model load, naming what changed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from steergate.engine import plugin
from steergate.engine.worker import contract, runner, runner_v2
from steergate.engine.worker.contract import ContractError

vllm = pytest.importorskip("vllm")
from vllm.config import CompilationConfig, ParallelConfig  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402


@pytest.fixture()
def fresh_register(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let plugin.register() run again in this process."""
    monkeypatch.setattr(plugin, "_done", False)


def test_this_vllm_meets_the_contract() -> None:
    assert contract.version_problems(vllm.__version__) == []
    assert contract.v1_problems() == []
    assert contract.v2_problems() == []


def test_another_vllm_version_refuses_registration(monkeypatch, fresh_register) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(ContractError, match=r"vLLM is 0\.33\.0; .* 0\.32\.x"):
        plugin.register()
    assert plugin._done is False
    assert contract.version_problems("0.32.7") == []


def test_changed_prepare_inputs_signature_refuses_registration(monkeypatch, fresh_register) -> None:
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any,
                        num_tokens_padded: int) -> Any:
        raise AssertionError("never called")

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    with pytest.raises(ContractError) as err:
        plugin.register()
    message = str(err.value)
    assert "refusing to start" in message
    assert "GPUModelRunner._prepare_inputs takes (self, scheduler_output, " \
           "num_scheduled_tokens, num_tokens_padded)" in message


def test_a_hook_vllm_no_longer_calls_is_refused(monkeypatch) -> None:
    def _update_states(self: Any, scheduler_output: Any) -> None:
        self.requests.clear()  # finished requests vanish without the removal hook

    monkeypatch.setattr(GPUModelRunner, "_update_states", _update_states)
    assert contract.v1_problems() == [
        "vllm.v1.worker.gpu_model_runner.GPUModelRunner._update_states no longer calls "
        "_on_request_state_removed, which the adapter hooks"
    ]


def test_cpu_runner_overriding_a_hooked_method_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(CPUModelRunner, "_prepare_inputs", lambda self, so, n: None,
                        raising=False)
    (problem,) = contract.v1_problems()
    assert "CPUModelRunner overrides _prepare_inputs" in problem


def test_missing_dataclass_field_and_property_are_named() -> None:
    class Batch:
        req_ids: list[str] = []  # a plain attribute, no longer a property

    assert contract.property_problems(Batch, ("req_ids",)) == [
        f"{__name__}.test_missing_dataclass_field_and_property_are_named.<locals>.Batch.req_ids"
        " is not a property"
    ]
    from vllm.v1.core.sched.output import NewRequestData

    assert contract.field_problems(NewRequestData, ("req_id", "sampling_params")) == []
    assert contract.field_problems(NewRequestData, ("steering",)) == [
        "vllm.v1.core.sched.output.NewRequestData has no field 'steering'"
    ]


def test_changed_v2_runner_makes_its_load_model_refuse(monkeypatch) -> None:
    for name in ("load_model", "initialize_kv_cache", "add_requests", "_remove_request",
                 "prepare_inputs"):
        monkeypatch.setattr(V2, name, getattr(V2, name))  # restored after the test
    monkeypatch.setattr(V2, "_steergate_patched", False, raising=False)

    def _remove_request(self: Any, req_id: str, reason: str) -> bool:
        return True

    monkeypatch.setattr(V2, "_remove_request", _remove_request)
    problems = contract.v2_problems()
    assert problems and "_remove_request takes (self, req_id, reason)" in problems[0]
    runner_v2.install(problems)
    assert not hasattr(V2.add_requests, "__wrapped__")  # hooks are not installed ...
    with pytest.raises(ContractError, match="V2 model runner does not match"):
        V2.load_model(object.__new__(V2))  # ... and the runner refuses to load


# ---- model load: instance attributes and features ----------------------------------


class LlamaDecoderLayer(nn.Module):
    """Named and shaped like vLLM's, so the structural check of the Llama convention
    passes (steergate/engine/worker/conventions.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Identity()
        self.post_attention_layernorm = nn.Identity()  # where post_attn clamps read the stream

    def forward(self, positions: Any, hidden_states: Any, residual: Any) -> Any:
        return hidden_states, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LlamaDecoderLayer(), LlamaDecoderLayer()])


def fake_v1_runner(**parallel: Any) -> SimpleNamespace:
    model = LlamaForCausalLM()
    return SimpleNamespace(
        get_model=lambda: model,
        vllm_config=SimpleNamespace(parallel_config=ParallelConfig(**parallel),
                                    compilation_config=CompilationConfig()),
        model_config=SimpleNamespace(get_hidden_size=lambda: 8, dtype=torch.float32,
                                     architectures=["LlamaForCausalLM"],
                                     architecture="LlamaForCausalLM"),
        input_batch=SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=[],
                                    num_prompt_tokens=[], generators={}),
        query_start_loc=SimpleNamespace(np=[0]),
        discard_request_mask=SimpleNamespace(np=[]),
        requests={}, max_num_reqs=4, max_num_tokens=32, device=torch.device("cpu"),
    )


def test_a_well_formed_runner_gets_tables() -> None:
    r = fake_v1_runner()
    tables = runner.attach(r, contract.V1_RUNNER_ATTRS)
    assert tables is not None and r._steergate is tables and tables.num_slots == 5
    assert runner.attach(r, contract.V1_RUNNER_ATTRS) is None  # a second load keeps them


def test_an_unsupported_architecture_refuses_to_start_unless_steering_is_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from steergate.engine.worker.conventions import UnsupportedArchitecture

    r = fake_v1_runner()
    r.model_config.architecture = "GemmaForCausalLM"
    r.model_config.architectures = ["GemmaForCausalLM"]
    with pytest.raises(UnsupportedArchitecture, match="for GemmaForCausalLM. Supported: "):
        runner.attach(r, contract.V1_RUNNER_ATTRS)
    monkeypatch.setenv("STEERGATE_STEERING", "off")
    assert runner.attach(r, contract.V1_RUNNER_ATTRS) is None
    assert not hasattr(r, "_steergate")  # no tables, no wrappers: served unsteered


def test_microbatching_refuses_to_start() -> None:
    with pytest.raises(ContractError, match=r"microbatching is on \(--enable-dbo"):
        runner.attach(fake_v1_runner(enable_dbo=True), contract.V1_RUNNER_ATTRS)
    with pytest.raises(ContractError, match="microbatching"):
        runner.attach(fake_v1_runner(ubatch_size=2), contract.V1_RUNNER_ATTRS)


def test_prefill_context_parallelism_refuses_to_start() -> None:
    with pytest.raises(ContractError, match="prefill context parallelism is on"):
        runner.attach(fake_v1_runner(prefill_context_parallel_size=2), contract.V1_RUNNER_ATTRS)


def test_a_missing_instance_attribute_refuses_to_start() -> None:
    r = fake_v1_runner()
    del r.input_batch.num_prompt_tokens
    del r.discard_request_mask  # what engine.worker.cpu_seeds reads
    with pytest.raises(ContractError, match="has no input_batch.num_prompt_tokens") as exc:
        runner.attach(r, contract.V1_RUNNER_ATTRS)
    assert "has no discard_request_mask.np" in str(exc.value)
    assert not hasattr(r, "_steergate")
