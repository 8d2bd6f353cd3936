"""post_block l and pre_attn l+1 are one point of the residual stream and share one
table (fewer op launches per step); the public hooks keep their meaning."""

from __future__ import annotations

import numpy as np
import torch

from steergate.engine.payload import decode_payload, encode_payload
from steergate.engine.worker import op
from steergate.engine.worker.layers import find_decoder_layers, wrap_layers
from steergate.engine.worker.tables import SteeringTables, StepRequest

from .test_steering_op import H, _Model

SITES_PER_LAYER_OP = 2  # post_attn + post_block; pre_attn only on the first layer


def _payload(sites: dict[tuple[str, int], np.ndarray]):
    return decode_payload(encode_payload("all", sites)[0])


def _tables(layers, dtype=torch.float32) -> SteeringTables:
    return SteeringTables(
        hidden_size=H, layers=list(layers), num_slots=4, max_tokens=8, dtype=dtype
    )


def test_pre_attn_shares_the_previous_layers_post_block_table_on_the_same_rank() -> None:
    t = _tables(layers=(4, 5, 6))  # a pipeline stage: layer 3 lives on another rank
    assert t.tables[("pre_attn", 5)] is t.tables[("post_block", 4)]
    assert t.tables[("pre_attn", 6)] is t.tables[("post_block", 5)]
    assert t.tables[("pre_attn", 4)] is not t.tables[("post_block", 4)]  # its own table
    assert not t.shares_table_with_previous_layer(4)
    assert t.shares_table_with_previous_layer(5) and t.shares_table_with_previous_layer(6)
    distinct = {id(table) for table in t.tables.values()}
    assert len(distinct) == 1 + SITES_PER_LAYER_OP * 3  # the last post_block stays its own


def test_both_vectors_of_a_merged_point_are_summed_in_one_row_and_freed_together() -> None:
    t = _tables(layers=(0, 1))
    a = np.full(H, 0.25, dtype=np.float32)
    b = np.arange(H, dtype=np.float32)
    t.add_request("r", _payload({("post_block", 0): a, ("pre_attn", 1): b}))
    t.fill([StepRequest("r", 0, 1, 0, 1)], 1)
    slot = int(t.index[0])
    table = t.tables[("pre_attn", 1)]
    assert torch.equal(table[slot], torch.from_numpy(a + b))
    assert table.data_ptr() in op._LIVE_TABLES
    t.remove_request("r")
    assert not table.any() and table.data_ptr() not in op._LIVE_TABLES


def test_one_vector_alone_lands_in_the_shared_table_unrounded_twice() -> None:
    """A request steering only pre_attn 1 must steer exactly as before the merge:
    its row is the vector rounded once to the table dtype."""
    t = _tables(layers=(0, 1), dtype=torch.bfloat16)
    vec = np.linspace(-3.1, 2.7, H, dtype=np.float32)
    t.add_request("r", _payload({("pre_attn", 1): vec}))
    t.fill([StepRequest("r", 0, 1, 0, 1)], 1)
    row = t.tables[("post_block", 0)][int(t.index[0])]
    assert torch.equal(row, torch.from_numpy(vec).to(torch.bfloat16))


def test_wrapped_model_adds_both_merged_vectors_once_each() -> None:
    model = _Model()
    layers, present = find_decoder_layers(model)
    t = _tables(layers=present)
    wrap_layers(layers, present, t)
    one = np.ones(H, dtype=np.float32)
    t.add_request("r", _payload({("post_block", 0): one, ("pre_attn", 1): one}))
    t.fill([StepRequest("r", 0, 1, 0, 1)], 1)
    out = model(torch.ones(1, H))
    t.remove_request("r")
    assert torch.equal(out, torch.full((1, H), 48.0))  # (6 + 1 + 1) * 6
