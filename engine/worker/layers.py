"""Wrap a loaded vLLM decoder stack so each layer calls the steering op.

vLLM's Llama-family layers pass ``(hidden_states, residual)`` between layers and
fuse "residual add + RMSNorm" at the start of the next norm, so the residual
stream at any point is ``hidden_states + residual`` (or just ``hidden_states`` in
front of layer 0, where ``residual is None``). Adding a vector to
``hidden_states`` therefore adds it to the stream:

* ``pre_attn``  of layer l: added to the ``hidden_states`` entering layer l;
* ``post_attn`` of layer l: added to attention's output, before the fused
  add-norm, i.e. to the stream after attention's residual add;
* ``post_block`` of layer l: added to the ``hidden_states`` the layer returns.

That tensor is the one layer l+1 receives, so ``pre_attn`` l+1 is served by
``post_block`` l's table (see engine/worker/tables.py) and only the first layer on
this rank calls the op on entry.

We replace ``forward`` on the *instances* (not the classes, not the module tree):
parameter names, weight loading and vLLM's per-layer attention registry are
untouched, and Dynamo traces straight through the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from steergate.engine.worker import capture, op
from steergate.engine.worker import clamp as clamp_op
from steergate.engine.worker.tables import SteeringTables

_WRAPPED = "_steergate_wrapped"


def find_decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, list[int]]:
    """The model's decoder ``ModuleList`` and the layer indices this rank runs
    (pipeline parallelism leaves placeholders without ``self_attn`` elsewhere)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module):
            present = [i for i, layer in enumerate(module) if hasattr(layer, "self_attn")]
            if present:
                return module, present
    raise RuntimeError("steergate: could not find the decoder layers (Llama-style model expected)")


def wrap_layers(layers: nn.ModuleList, present: list[int], tables: SteeringTables) -> None:
    index = tables.index
    for i in present:
        layer: Any = layers[i]
        if getattr(layer, _WRAPPED, False):
            continue
        # pre_attn i is post_block i-1's table when i-1 is here: the op already ran
        # on this tensor at the end of layer i-1, so the wrapper skips it (pre=None).
        shared = tables.shares_table_with_previous_layer(i)
        pre = None if shared else tables.tables[("pre_attn", i)]
        pre_clamp = None if shared else tables.clamps[("pre_attn", i)]
        layer.forward = _wrap_layer(
            layer.forward, pre, tables.tables[("post_block", i)], index, i,
            pre_clamp, tables.clamps[("post_block", i)],
        )
        layer.self_attn.forward = _wrap_attn(
            layer.self_attn.forward, tables.tables[("post_attn", i)], index
        )
        # post_attn clamps need the stream, attention output + residual: the norm
        # after attention receives exactly that pair, before it sums them.
        post_attn_clamp = tables.clamps[("post_attn", i)]
        if post_attn_clamp is not None:
            if not hasattr(layer, "post_attention_layernorm"):
                raise RuntimeError(
                    "steergate: post_attn clamps need the layer's post_attention_layernorm "
                    "(Llama-style layers); set STEERGATE_MAX_CLAMPS_PER_SITE=0 to serve "
                    "this model without clamps"
                )
            layer.post_attention_layernorm.forward = _wrap_norm(
                layer.post_attention_layernorm.forward, post_attn_clamp, index
            )
        setattr(layer, _WRAPPED, True)


def _wrap_layer(
    forward: Callable[..., Any], pre: torch.Tensor | None, post: torch.Tensor, index: torch.Tensor,
    layer: int, pre_clamp: clamp_op.ClampTable | None = None,
    post_clamp: clamp_op.ClampTable | None = None,
) -> Callable[..., Any]:
    def steered_layer_forward(positions: torch.Tensor, hidden_states: torch.Tensor, *args: Any,
                              **kwargs: Any) -> Any:
        # The layer returns (hidden, residual) with residual = the stream after attention.
        residual = args[0] if args else kwargs.get("residual")
        if pre is not None:
            op.apply(hidden_states, pre, index)
            clamp_op.apply(hidden_states, residual, pre_clamp, index)  # after the add
        # Capture reads each site after its steering (engine/worker/capture.py).
        capture.read(hidden_states, residual, "pre_attn", layer)
        out = forward(positions, hidden_states, *args, **kwargs)
        capture.read(out[1], None, "post_attn", layer)
        op.apply(out[0], post, index)
        clamp_op.apply(out[0], out[1], post_clamp, index)
        capture.read(out[0], out[1], "post_block", layer)
        return out

    return steered_layer_forward


def _wrap_norm(
    forward: Callable[..., Any], table: clamp_op.ClampTable, index: torch.Tensor
) -> Callable[..., Any]:
    def clamped_norm_forward(x: torch.Tensor, residual: torch.Tensor | None = None,
                             *args: Any, **kwargs: Any) -> Any:
        clamp_op.apply(x, residual, table, index)  # x already holds post_attn's add
        return forward(x, residual, *args, **kwargs)

    return clamped_norm_forward


def _wrap_attn(
    forward: Callable[..., Any], table: torch.Tensor, index: torch.Tensor
) -> Callable[..., Any]:
    def steered_attn_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        return op.apply(out, table, index)

    return steered_attn_forward
