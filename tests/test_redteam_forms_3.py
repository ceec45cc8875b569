"""Hand-written forms a third soundness pass tried: each one fuzzed in float64 at two input shapes, beside a
control that keeps the group the fixed form must not lose."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 8, 12


class Cast(nn.Module):
    """``Linear -> relu(h) + f(h) -> Linear``, ``f`` a cast of the hidden units (or none)."""

    def __init__(self, cast):
        super().__init__()
        self.cast = cast
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) * self.cast(h))


def cast_subject(cast):
    return symgraph.load(noisy(Cast(cast)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("cast", [lambda h: h.long().double(), lambda h: h.bool().double(),
                                  lambda h: h.to(torch.int32).type_as(h)], ids=["long", "bool", "int32"])
def test_a_cast_to_integers_rounds_so_no_scale_passes_it(cast):
    """(2.4 c).long() is not c * 2: identity passed the ReLU's scale through the cast (the bool one took c twice)."""
    subject = cast_subject(cast)
    assert census(subject).get("ffn permutation 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_cast_between_float_types_keeps_the_scale():
    subject = cast_subject(lambda h: h.float().double())
    assert census(subject).get("ffn scale/positive 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)
