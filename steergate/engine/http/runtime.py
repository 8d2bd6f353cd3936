"""Per-process engine state the routes and middlewares share.

Built once in the plugin's ``init_state`` (after vLLM knows the model) and reached
through a :class:`RuntimeRef`, because the middlewares are constructed earlier, in
``attach_router``, before any state exists.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from steergate.engine.http.capture import CaptureSupport
from steergate.engine.latch import LatchController
from steergate.engine.registry import VectorRegistry
from steergate.shared.clamp import DEFAULT_MAX_CLAMPS_PER_SITE
from steergate.shared.errors import APIError
from steergate.shared.settings import EngineSettings
from steergate.shared.steering import HOOKS, ModelShape, SteeringBound


@dataclass(frozen=True)
class ServedArchitecture:
    """What ``/v1/steering/info`` says about the served model's layers: its architecture
    (``config.json``), the vLLM class serving it, the layer convention steering uses
    (``None`` with ``STEERGATE_STEERING=off``) and the hooks it supports."""

    architecture: str = "LlamaForCausalLM"
    vllm_class: str = "LlamaForCausalLM"
    convention: str | None = "fused-residual"

    @property
    def steered(self) -> bool:
        return self.convention is not None

    @property
    def hooks(self) -> list[str]:
        return list(HOOKS) if self.steered else []


@dataclass
class SteeringRuntime:
    model: str
    shape: ModelShape
    controller: LatchController
    registry: VectorRegistry = field(default_factory=VectorRegistry)
    capture: CaptureSupport = field(default_factory=lambda: CaptureSupport(max_model_len=2048))
    max_clamps: int = DEFAULT_MAX_CLAMPS_PER_SITE  # clamp directions per point of the stream
    served: ServedArchitecture = field(default_factory=ServedArchitecture)
    #: The served model's dtype (a key of ``shared.steering.DTYPE_MAX``): the tables
    #: hold the steering in it, so a sum beyond its range is refused, not applied as inf.
    dtype: str = "float32"

    @property
    def bound(self) -> SteeringBound:
        """How far a request may move this model's stream (``shared.steering``)."""
        return SteeringBound(self.dtype, self.shape.num_layers)

    @property
    def epoch(self) -> str:
        return self.controller.epoch

    @classmethod
    def create(
        cls, model: str, shape: ModelShape, settings: EngineSettings, epoch: str | None = None,
        capture: CaptureSupport | None = None,
        served: ServedArchitecture | None = None,
        dtype: str = "float32",
    ) -> SteeringRuntime:
        controller = LatchController(
            settings.max_latched_conversations,
            settings.max_latched_bytes,
            epoch or uuid.uuid4().hex,  # changes on every start: clients can tell latches were lost
        )
        registry = VectorRegistry(
            max_count=settings.max_vectors, max_bytes=settings.max_vector_bytes
        )
        runtime = cls(model=model, shape=shape, controller=controller, registry=registry,
                      served=served or ServedArchitecture(),
                      max_clamps=settings.max_clamps_per_site, dtype=dtype)
        if capture is not None:
            runtime.capture = capture
        return runtime

    def info(self) -> dict[str, object]:
        return {
            "model": self.model,
            "hidden_size": self.shape.hidden_size,
            "num_layers": self.shape.num_layers,
            "architecture": self.served.architecture,
            "vllm_class": self.served.vllm_class,
            "layer_convention": self.served.convention,
            "steering": "on" if self.served.steered else "off",
            "hooks": self.served.hooks,
            "max_latched_conversations": self.controller.max_count,
            "max_latched_bytes": self.controller.max_bytes,
            "epoch": self.epoch,
        }


class RuntimeRef:
    """A late-bound handle: set once by ``init_state``; until then requests get 503."""

    def __init__(self) -> None:
        self._runtime: SteeringRuntime | None = None

    def set(self, runtime: SteeringRuntime) -> None:
        self._runtime = runtime

    def get(self) -> SteeringRuntime:
        if self._runtime is None:
            raise APIError("engine_starting", "the steering engine is still starting")
        return self._runtime
