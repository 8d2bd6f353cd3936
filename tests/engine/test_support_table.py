"""docs/steering-op.md's support table says exactly what the conventions table
supports, and every supported architecture has a measured row (no engine needed:
the figures are what ``test_architectures.py`` recorded when the table was written).
Also the conventions' pure parts: lookup, refusal message, structural checks."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from scripts import support_table
from steergate.engine.worker import conventions
from steergate.engine.worker.conventions import SUPPORTED, lookup


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def _doc_rows() -> list[list[str]]:
    section = support_table.current_section(support_table.DOC.read_text())
    assert section is not None, "docs/steering-op.md lacks the support-table markers"
    return [_cells(line) for line in section.splitlines() if line.startswith("| `")]


def test_support_table_lists_exactly_the_supported_architectures_and_conventions() -> None:
    """Architecture, vLLM class, convention and hooks: as steergate/engine/worker/conventions.py
    says (regenerate with scripts/support_table.py --write after a test run)."""
    want = [_cells(r)[:4] for r in support_table.rows({})]
    assert [r[:4] for r in _doc_rows()] == want


def test_every_supported_architecture_was_measured_within_tolerance() -> None:
    for row in _doc_rows():
        arch, worst = row[0], row[-1]
        assert worst != "—", f"{arch} has no measured result: run test_architectures.py"
        assert float(worst) <= 1e-3, arch


def test_a_listed_architecture_served_through_another_class_is_refused() -> None:
    with pytest.raises(conventions.UnsupportedArchitecture) as exc:
        lookup("LlamaForCausalLM", "TransformersForCausalLM")
    assert "verified only as vLLM's LlamaForCausalLM" in str(exc.value)
    assert "served by vLLM as TransformersForCausalLM" in str(exc.value)


def test_an_unlisted_architecture_is_refused_naming_it_and_the_list() -> None:
    with pytest.raises(conventions.UnsupportedArchitecture) as exc:
        lookup("DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM")
    message = str(exc.value)
    assert "no verified steering convention for DeepseekV2ForCausalLM" in message
    assert "Supported: " + ", ".join(sorted(SUPPORTED)) in message
    assert "STEERGATE_STEERING=off" in message


class _GraniteLike(nn.Module):
    residual_multiplier = 0.5

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Identity()
        self.post_attention_layernorm = nn.Identity()

    def forward(self, positions, hidden_states):
        return hidden_states


def test_structural_check_names_a_layer_of_another_convention() -> None:
    layers = nn.ModuleList([_GraniteLike()])
    problems = conventions.check_layers(SUPPORTED["LlamaForCausalLM"], nn.Module(), layers, [0])
    assert "the model is vLLM's Module, not LlamaForCausalLM" in problems
    assert any("_GraniteLike, not LlamaDecoderLayer" in p for p in problems)
    assert any("does not start with ('positions', 'hidden_states', 'residual')" in p
               for p in problems)


def test_a_stream_of_the_wrong_shape_is_a_convention_error_not_a_broadcast() -> None:
    """What crashed the engine on Granite: the pair convention's ``out[0]`` of a plain
    tensor is token 0's row. Now the wrapper refuses it by name (at start-up, in
    vLLM's dummy forward) before the op runs."""
    table = torch.zeros(3, 8)
    index = torch.zeros(16, dtype=torch.int64)
    layer = _GraniteLike()
    conventions.FUSED_RESIDUAL.wrap(layer, conventions.LayerTables(0, table, None, table, index))
    with pytest.raises(conventions.ConventionError, match=re.escape("not the (hidden_states, "
                                                                    "residual) pair")):
        layer(None, torch.ones(4, 8))
