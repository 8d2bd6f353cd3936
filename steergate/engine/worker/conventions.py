"""Layer conventions: where each architecture's residual-stream points are in vLLM's
code, and how the steering op is applied there (pure torch, no vLLM imports).

The hooks are defined on the residual stream, whatever the layer's code:

* ``pre_attn`` l: the stream entering layer l (after any embedding scaling, for l = 0);
* ``post_attn`` l: the stream right after attention's residual add; for layers that
  norm attention's output before the add (Gemma 2/3, OLMo 2) that is after that norm;
* ``post_block`` l: the layer's output (after Granite's residual multiplier).

One :class:`Convention` subclass per layer convention says where those points are;
:data:`SUPPORTED` maps an architecture name (``hf_config.architectures[0]``) to the
vLLM model class that serves it and the convention of its layers. Nothing
architecture-specific lives anywhere else. An architecture not in the table is
refused at start-up with steering on (see :func:`lookup`); the support table in
docs/steering-op.md is generated from the tests that verify each entry.

Every wrapper checks, before calling the op, that the tensor it steers is what the
convention says (:func:`_stream`). vLLM runs a dummy forward through these wrappers
while it starts (profiling and compile warm-up), so a convention that does not fit
the loaded model stops the start, never a request.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from steergate.engine.worker import capture
from steergate.engine.worker import clamp as clamp_op

HOOKS: tuple[str, ...] = ("pre_attn", "post_attn", "post_block")
_WRAPPED = "_steergate_wrapped"


class ConventionError(RuntimeError):
    """The loaded model does not have the layer layout its convention describes."""


@dataclass(frozen=True)
class LayerTables:
    """The tables one layer's wrappers read; ``None`` for a point that is not steered
    there (e.g. when ``post_block`` l and ``pre_attn`` l+1 share one table). ``layer``
    names the layer's sites for activation capture (:mod:`engine.worker.capture`),
    which each wrapper reads right after the site's steering."""

    layer: int
    pre_attn: torch.Tensor | None
    post_attn: torch.Tensor | None
    post_block: torch.Tensor | None
    index: torch.Tensor
    # Directional clamps at the same points (steergate/engine/worker/clamp.py), applied right
    # after the point's add; None where no clamp tables exist (cap 0) or the point is
    # served by the previous layer's post_block.
    pre_attn_clamp: clamp_op.ClampTable | None = None
    post_attn_clamp: clamp_op.ClampTable | None = None
    post_block_clamp: clamp_op.ClampTable | None = None


class Convention:
    """Where the three stream points of one layer are, how to steer them, and where
    capture reads them (after the steering of that point)."""

    name: str = ""
    #: One line for docs/steering-op.md and ``/v1/steering/info``.
    summary: str = ""
    hooks: tuple[str, ...] = HOOKS
    #: The leading parameter names of the layer's ``forward``.
    signature: tuple[str, ...] = ()
    #: Submodules every layer must have (what the wrappers touch).
    submodules: tuple[str, ...] = ("self_attn",)

    def problems(self, layer: nn.Module) -> list[str]:
        """Structural differences between ``layer`` and this convention (start-up check)."""
        found: list[str] = []
        cls = type(layer).__name__
        for sub in self.submodules:
            if not isinstance(getattr(layer, sub, None), nn.Module):
                found.append(f"{cls} has no submodule {sub!r}")
        params = tuple(inspect.signature(type(layer).forward).parameters)[1:]
        if params[: len(self.signature)] != self.signature:
            found.append(
                f"{cls}.forward{params} does not start with {self.signature} "
                f"(the {self.name} convention)"
            )
        return found

    def wrap(self, layer: nn.Module, tables: LayerTables) -> None:
        """Replace ``forward`` on the layer's instances (idempotent)."""
        if getattr(layer, _WRAPPED, False):
            return
        self._wrap(layer, tables)
        setattr(layer, _WRAPPED, True)

    def _wrap(self, layer: nn.Module, tables: LayerTables) -> None:
        raise NotImplementedError


def _stream(t: Any, width: int, convention: str, where: str) -> torch.Tensor:
    """``t`` as the ``[tokens, hidden]`` stream the op steers; anything else is a
    :class:`ConventionError` (raised at start-up: vLLM's dummy forward runs this)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[-1] != width:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ConventionError(
            f"steergate: {where} is {shape}, not [tokens, {width}]: the model's "
            f"layers do not follow the {convention} convention"
        )
    return t


def _steer(t: Any, table: torch.Tensor | None, index: torch.Tensor, convention: str,
           where: str, residual: torch.Tensor | None = None,
           clamps: clamp_op.ClampTable | None = None) -> None:
    """One point of the stream: its add (``table``) then its clamps, one op
    (:func:`engine.worker.clamp.apply`); ``residual`` completes the stream where the
    convention carries it in two tensors."""
    if table is not None:
        clamp_op.apply(_stream(t, table.shape[-1], convention, where), residual, clamps,
                       index, add=table)
    elif clamps is not None:
        clamp_op.apply(_stream(t, clamps.dirs.shape[-1], convention, where), residual,
                       clamps, index)


def _output_steered(forward: Callable[..., Any], table: torch.Tensor, index: torch.Tensor,
                    convention: str, where: str,
                    pick: Callable[[Any], Any] = lambda out: out) -> Callable[..., Any]:
    """``forward`` followed by the op on (a view of) its output."""
    def steered(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        _steer(pick(out), table, index, convention, where)
        return out

    return steered


def _pair_steered(forward: Callable[..., Any], table: torch.Tensor,
                  clamps: clamp_op.ClampTable, index: torch.Tensor, convention: str,
                  where: str) -> Callable[..., Any]:
    """The point's add and clamps on a fused add-norm's ``(x, residual)`` before it
    sums them: ``x`` is attention's contribution (the add goes there, as on the
    submodule's output it arrives from unchanged) and the stream is ``x + residual``."""
    def steered(x: torch.Tensor, residual: torch.Tensor | None = None, *args: Any,
                **kwargs: Any) -> Any:
        _steer(x, table, index, convention, where, residual, clamps)
        return forward(x, residual, *args, **kwargs)
    return steered


def _input_steered(forward: Callable[..., Any], table: torch.Tensor | None,
                   index: torch.Tensor, convention: str, where: str,
                   layer: int, clamps: clamp_op.ClampTable | None = None) -> Callable[..., Any]:
    """The op on ``forward``'s first argument, in place, before it runs; that argument
    is the stream at ``post_attn`` of ``layer``, which capture then reads."""
    def steered(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _steer(hidden_states, table, index, convention, where, None, clamps)
        capture.read(hidden_states, None, "post_attn", layer)
        return forward(hidden_states, *args, **kwargs)

    return steered


class FusedResidual(Convention):
    """vLLM's Llama family: ``layer(positions, hidden_states, residual) ->
    (hidden_states, residual)`` with "residual add + RMSNorm" fused into the next
    norm, so the stream is ``hidden_states + residual`` and adding to
    ``hidden_states`` adds to the stream. ``post_attn`` is added to attention's output,
    which the next fused add-norm adds to the residual."""

    name = "fused-residual"
    summary = ("(hidden, residual) pair; post_attn on self_attn's output, "
               "before the fused add-norm")
    signature = ("positions", "hidden_states", "residual")
    #: The submodule whose output joins the stream at attention's residual add.
    post_attn_module = "self_attn"
    #: The fused add-norm that receives (attention's contribution, residual): where the
    #: stream after attention is first whole, so where post_attn clamps apply.
    post_attn_clamp_module = "post_attention_layernorm"

    def __init__(self) -> None:
        self.submodules = tuple(dict.fromkeys(("self_attn", self.post_attn_module)))

    def _wrap(self, layer: nn.Module, tables: LayerTables) -> None:
        name, index, layer_i = self.name, tables.index, tables.layer
        forward = layer.forward

        def steered_layer(positions: torch.Tensor, hidden_states: torch.Tensor, *args: Any,
                          **kwargs: Any) -> Any:
            # The stream is hidden + residual (hidden alone in front of layer 0).
            residual = args[0] if args else kwargs.get("residual")
            _steer(hidden_states, tables.pre_attn, index, name, "pre_attn's hidden_states",
                   residual, tables.pre_attn_clamp)
            capture.read(hidden_states, residual, "pre_attn", layer_i)
            out = forward(positions, hidden_states, *args, **kwargs)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise ConventionError(
                    f"steergate: the layer returned {type(out).__name__}, not the "
                    f"(hidden_states, residual) pair of the {name} convention"
                )
            # The residual returned is the stream after attention's (fused) residual add.
            capture.read(out[1], None, "post_attn", layer_i)
            _steer(out[0], tables.post_block, index, name, "the layer's hidden_states",
                   out[1], tables.post_block_clamp)
            capture.read(out[0], out[1], "post_block", layer_i)
            return out

        layer.forward = steered_layer
        if tables.post_attn is None:
            return
        if tables.post_attn_clamp is None:
            sub = getattr(layer, self.post_attn_module)
            sub.forward = _output_steered(sub.forward, tables.post_attn, index, name,
                                          f"{self.post_attn_module}'s output")
            return
        # With clamps, the add and the clamps run together where the stream after
        # attention is first whole: the fused add-norm that receives the submodule's
        # output unchanged as its x. One op there, not one on the output and one here.
        norm = getattr(layer, self.post_attn_clamp_module, None)
        if not isinstance(norm, nn.Module):
            raise ConventionError(
                f"steergate: post_attn clamps need the layer's {self.post_attn_clamp_module}"
                f" (the {name} convention); STEERGATE_MAX_CLAMPS_PER_SITE=0 serves the "
                "model without clamps"
            )
        norm.forward = _pair_steered(norm.forward, tables.post_attn, tables.post_attn_clamp,
                                     index, name, f"{self.post_attn_clamp_module}'s x")


class SandwichNorm(FusedResidual):
    """Gemma 2 and 3: the same pair convention, but attention's output passes through
    ``post_attention_layernorm`` before the (fused) residual add, so ``post_attn`` is
    added to that norm's output (adding it to attention's output would add
    norm(attn + v) - norm(attn) to the stream, not v)."""

    name = "sandwich-norm"
    summary = ("(hidden, residual) pair; post_attn on post_attention_layernorm's output, "
               "before the fused add-norm")
    post_attn_module = "post_attention_layernorm"
    post_attn_clamp_module = "pre_feedforward_layernorm"


class ScaledResidual(Convention):
    """Granite: ``layer(positions, hidden_states) -> hidden_states`` (one tensor, the
    stream) with ``residual + x * residual_multiplier`` at both residual adds. The
    stream after attention's add is the input of ``post_attention_layernorm``, which
    the layer also keeps as the MLP's residual (the same tensor), so ``post_attn`` is
    added to that input in place: the norm and the residual both see it, unscaled."""

    name = "scaled-residual"
    summary = ("one stream tensor, residual_multiplier at each add; post_attn on "
               "post_attention_layernorm's input (the residual), in place")
    signature = ("positions", "hidden_states")
    submodules = ("self_attn", "post_attention_layernorm")

    def problems(self, layer: nn.Module) -> list[str]:
        found = super().problems(layer)
        if not isinstance(getattr(layer, "residual_multiplier", None), (int, float)):
            found.append(f"{type(layer).__name__} has no residual_multiplier")
        return found

    def _wrap(self, layer: nn.Module, tables: LayerTables) -> None:
        name, index, layer_i = self.name, tables.index, tables.layer
        forward = layer.forward

        def steered_layer(positions: torch.Tensor, hidden_states: torch.Tensor, *args: Any,
                          **kwargs: Any) -> Any:
            _steer(hidden_states, tables.pre_attn, index, name, "pre_attn's hidden_states",
                   None, tables.pre_attn_clamp)
            capture.read(hidden_states, None, "pre_attn", layer_i)
            out = forward(positions, hidden_states, *args, **kwargs)
            _steer(out, tables.post_block, index, name, "the layer's output", None,
                   tables.post_block_clamp)
            capture.read(out, None, "post_block", layer_i)
            return out

        layer.forward = steered_layer
        norm = layer.post_attention_layernorm
        norm.forward = _input_steered(norm.forward, tables.post_attn, index, name,
                                      "post_attention_layernorm's input", layer_i,
                                      tables.post_attn_clamp)


class TransformersPostNorm(Convention):
    """A ``transformers`` decoder layer run by vLLM's Transformers backend
    (``TransformersForCausalLM``), of the OLMo 2 kind: ``layer(hidden_states,
    attention_mask=…, …)`` on ``[1, tokens, hidden]`` (the backend adds a batch
    dimension), returning the stream (a tensor, or a tuple whose first item is it);
    attention's output goes through ``post_attention_layernorm`` before the residual
    add, so ``post_attn`` is added to that norm's output. The op steers the ``[tokens,
    hidden]`` view of each."""

    name = "transformers-post-norm"
    summary = ("transformers layer (hidden_states, attention_mask=…) on [1, tokens, hidden]; "
               "post_attn on post_attention_layernorm's output")
    signature = ("hidden_states",)
    submodules = ("self_attn", "post_attention_layernorm", "mlp")

    def _wrap(self, layer: nn.Module, tables: LayerTables) -> None:
        name, index, layer_i = self.name, tables.index, tables.layer
        forward = layer.forward

        def steered_layer(*args: Any, **kwargs: Any) -> Any:
            hidden = args[0] if args else kwargs.get("hidden_states")
            _steer(_batch_row(hidden), tables.pre_attn, index, name, "pre_attn's hidden_states",
                   None, tables.pre_attn_clamp)
            capture.read(_batch_row(hidden), None, "pre_attn", layer_i)
            out = forward(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            _steer(_batch_row(first), tables.post_block, index, name, "the layer's output",
                   None, tables.post_block_clamp)
            capture.read(_batch_row(first), None, "post_block", layer_i)
            return out

        layer.forward = steered_layer
        if tables.post_attn is not None:
            norm = layer.post_attention_layernorm
            norm.forward = _output_steered(norm.forward, tables.post_attn, index, name,
                                           "post_attention_layernorm's output", _batch_row)
        # The stream after attention's residual add is the MLP's input.
        mlp = layer.mlp
        mlp_forward = mlp.forward

        def captured_mlp(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # x is the stream after attention's add and also the tensor the layer keeps
            # as the MLP's residual: a clamp in place reaches both.
            _steer(_batch_row(x), None, index, name, "the MLP's input", None,
                   tables.post_attn_clamp)
            capture.read(_batch_row(x), None, "post_attn", layer_i)
            return mlp_forward(x, *args, **kwargs)

        mlp.forward = captured_mlp


def _batch_row(t: Any) -> Any:
    """The ``[tokens, hidden]`` view of the backend's ``[1, tokens, hidden]`` (a view,
    so the op's in-place add reaches the tensor the layer uses); anything else is
    returned as it is, for :func:`_stream` to refuse."""
    if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 1:
        return t[0]
    return t


FUSED_RESIDUAL = FusedResidual()
SANDWICH_NORM = SandwichNorm()
SCALED_RESIDUAL = ScaledResidual()
TRANSFORMERS_POST_NORM = TransformersPostNorm()


@dataclass(frozen=True)
class Support:
    """One verified architecture: the vLLM model class that serves it
    (``model_config.architecture``), its decoder layer class and its convention."""

    architecture: str
    vllm_class: str
    layer_class: str
    convention: Convention


def _native(arch: str, layer: str, convention: Convention = FUSED_RESIDUAL,
            vllm_class: str | None = None) -> Support:
    return Support(arch, vllm_class or arch, layer, convention)


#: architecture (``hf_config.architectures[0]``) -> how vLLM 0.32 serves it. Each entry
#: is verified end to end by tests/engine/test_architectures.py; add one only with a test.
SUPPORTED: dict[str, Support] = {s.architecture: s for s in (
    _native("LlamaForCausalLM", "LlamaDecoderLayer"),  # also SmolLM 1/2
    _native("Qwen2ForCausalLM", "Qwen2DecoderLayer"),  # Qwen 2 and 2.5
    _native("Qwen3ForCausalLM", "Qwen3DecoderLayer"),
    _native("MistralForCausalLM", "MistralDecoderLayer"),
    _native("Phi3ForCausalLM", "LlamaDecoderLayer"),
    _native("MixtralForCausalLM", "MixtralDecoderLayer"),
    _native("Qwen2MoeForCausalLM", "Qwen2MoeDecoderLayer"),
    _native("Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer"),
    _native("Gemma2ForCausalLM", "Gemma2DecoderLayer", SANDWICH_NORM),
    _native("Gemma3ForCausalLM", "Gemma3DecoderLayer", SANDWICH_NORM),
    _native("GraniteForCausalLM", "GraniteDecoderLayer", SCALED_RESIDUAL),
    Support("Olmo2ForCausalLM", "TransformersForCausalLM", "Olmo2DecoderLayer",
            TRANSFORMERS_POST_NORM),
)}


class UnsupportedArchitecture(RuntimeError):
    pass


def steering_enabled() -> bool:
    """``STEERGATE_STEERING`` (default ``on``): ``off`` serves any architecture unsteered."""
    from steergate.shared.settings import EngineSettings

    return EngineSettings().steering == "on"


def architecture_of(model_config: Any) -> str:
    """``config.json``'s ``architectures[0]`` (what the support table is keyed on)."""
    archs = list(getattr(model_config, "architectures", None) or [])
    return str(archs[0]) if archs else "(no architecture in config.json)"


def vllm_class_of(model_config: Any) -> str:
    """The vLLM model class that serves it, from its config (the API server has no
    model object): ``model_config.architecture`` is the registry key vLLM resolved,
    which names the architecture also when the Transformers backend serves it."""
    using_backend = getattr(model_config, "using_transformers_backend", None)
    if callable(using_backend) and using_backend():
        return str(model_config._get_transformers_backend_cls())
    return str(model_config.architecture)


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED))


def lookup(architecture: str, vllm_class: str) -> Support:
    """The verified support entry for this model, or :class:`UnsupportedArchitecture`
    naming it and the supported list (also when vLLM serves a listed architecture
    through another class than the verified one, e.g. ``--model-impl transformers``)."""
    support = SUPPORTED.get(architecture)
    if support is not None and support.vllm_class == vllm_class:
        return support
    served = f" (served by vLLM as {vllm_class})" if vllm_class != architecture else ""
    why = (f"steering on {architecture} is verified only as vLLM's {support.vllm_class}"
           if support is not None else f"no verified steering convention for {architecture}")
    raise UnsupportedArchitecture(
        f"steergate: refusing to start: {why}{served}. Supported: {supported_list()}. "
        "Set STEERGATE_STEERING=off (steergate engine --no-steering) to serve it unsteered."
    )


def check_layers(support: Support, model: nn.Module, layers: nn.ModuleList,
                 present: list[int]) -> list[str]:
    """Every structural difference between the loaded model and ``support``."""
    found: list[str] = []
    if type(model).__name__ != support.vllm_class:
        found.append(f"the model is vLLM's {type(model).__name__}, not {support.vllm_class}")
    for i in present:
        layer = layers[i]
        if type(layer).__name__ != support.layer_class:
            found.append(f"layer {i} is {type(layer).__name__}, not {support.layer_class}")
        found += [f"layer {i}: {p}" for p in support.convention.problems(layer)]
        if found:
            break  # one layer's differences say enough
    return found
