"""Wrap a loaded vLLM decoder stack so each layer calls the steering op.

Where the op (and activation capture) goes in each layer depends on the
architecture's layer convention (:mod:`engine.worker.conventions`); this module only
finds the decoder layers and hands each one its tables.

We replace ``forward`` on the *instances* (not the classes, not the module tree):
parameter names, weight loading and vLLM's per-layer attention registry are
untouched, and Dynamo traces straight through the wrappers.
"""

from __future__ import annotations

from torch import nn

from steergate.engine.worker.conventions import FUSED_RESIDUAL, Convention, LayerTables
from steergate.engine.worker.tables import SteeringTables


def find_decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, list[int]]:
    """The model's decoder ``ModuleList`` and the layer indices this rank runs
    (pipeline parallelism leaves placeholders without ``self_attn`` elsewhere)."""
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, nn.ModuleList) and len(module):
            present = [i for i, layer in enumerate(module) if hasattr(layer, "self_attn")]
            if present:
                return module, present
    raise RuntimeError("steergate: could not find the decoder layers (no *layers ModuleList "
                       "whose layers have self_attn)")


def wrap_layers(layers: nn.ModuleList, present: list[int], tables: SteeringTables,
                convention: Convention = FUSED_RESIDUAL) -> None:
    """Wrap every present layer (idempotent per layer) the way ``convention`` says."""
    for i in present:
        # pre_attn i is post_block i-1's table when i-1 is here: the op already ran on
        # this point of the stream at the end of layer i-1, so it is not run twice.
        shared = tables.shares_table_with_previous_layer(i)
        convention.wrap(layers[i], LayerTables(
            layer=i,
            pre_attn=None if shared else tables.tables[("pre_attn", i)],
            post_attn=tables.tables[("post_attn", i)],
            post_block=tables.tables[("post_block", i)],
            index=tables.index,
            pre_attn_clamp=None if shared else tables.clamps[("pre_attn", i)],
            post_attn_clamp=tables.clamps[("post_attn", i)],
            post_block_clamp=tables.clamps[("post_block", i)],
        ))
