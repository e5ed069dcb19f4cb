"""deferred_weights / materialize on their own (one process, no group)."""

import pytest
import torch
from torch import nn

from dspark.distributed import deferred_weights, materialize


class _Toy(nn.Module):
    def __init__(self, derived_from_weight: bool = False):
        super().__init__()
        self.a = nn.Linear(4, 3, bias=False)
        self.b = nn.Linear(4, 3, bias=False)
        self.b.weight = self.a.weight  # tied
        self.norm = nn.Parameter(torch.ones(3))
        self.register_buffer("table", torch.empty(2, 2))
        source = self.a.weight if derived_from_weight else torch.arange(3.0)
        self.register_buffer("freqs", source * 2, persistent=False)


def test_weights_are_deferred_and_computed_values_are_real():
    with deferred_weights("cpu"):
        toy = _Toy()
    assert toy.a.weight.is_meta and toy.table.is_meta
    assert not toy.norm.is_meta and torch.equal(toy.freqs, torch.arange(3.0) * 2)
    materialize(toy, "cpu")
    assert not any(t.is_meta for t in (*toy.parameters(), *toy.buffers()))
    assert toy.b.weight is toy.a.weight and isinstance(toy.a.weight, nn.Parameter)
    assert torch.empty(1).device.type == "cpu"  # the mode ends with the block


def test_other_devices_are_left_alone():
    with deferred_weights("meta"):  # a build for another device: CPU requests stay real
        assert not nn.Linear(2, 2).weight.is_meta


def test_a_buffer_derived_from_a_deferred_weight_is_refused():
    with deferred_weights("cpu"):
        toy = _Toy(derived_from_weight=True)
    with pytest.raises(ValueError, match="freqs"):
        materialize(toy, "cpu")
