"""Weight vectors that hold one number everywhere (a folded norm weight: 1, or 0 where the model multiplies by
1 + w) multiply every coordinate alike: the analysis reads that from their values and lets the stream they multiply
keep its full group. Only such a vector, and such a vector plus one number, may do that: a sum with anything that
differs per coordinate multiplies the stream by different numbers, and a sum of two weight vectors is no weight
vector whose scale the product may ignore (both were sources of emitted groups that changed the function)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census

WIDTH = 6


class Gated(nn.Module):
    """``up(x) * multiplier`` read by ``down``: the hidden width has GL(6) where the multiplier is one number, else
    permutations (and what scales the multiplier allows)."""

    def __init__(self, multiplier: str, g: torch.Tensor):
        super().__init__()
        self.multiplier = multiplier
        self.up, self.down = nn.Linear(5, WIDTH), nn.Linear(WIDTH, 3)
        self.g = nn.Parameter(g.clone())
        self.beta = nn.Parameter(torch.linspace(-1.0, 1.0, WIDTH))
        self.register_buffer("data", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x):
        g = {"g": self.g, "1 + g": 1.0 + self.g, "g + beta": self.g + self.beta, "g + data": self.g + self.data}
        return self.down(self.up(x) * g[self.multiplier])


def _subject(multiplier: str, g: torch.Tensor):
    torch.manual_seed(0)
    model = Gated(multiplier, g).double().eval()
    return symgraph.load(model, (torch.randn(4, 5, dtype=torch.float64),))


def _hidden_kinds(subject) -> set[str]:
    return {g.kind for g in subject.report.groups if g.size == WIDTH}


@pytest.mark.parametrize("multiplier,g", [("g", torch.ones(WIDTH)), ("g", torch.full((WIDTH,), 0.5)),
                                          ("1 + g", torch.zeros(WIDTH))])
def test_a_uniform_multiplier_keeps_the_full_group(multiplier, g):
    subject = _subject(multiplier, g)
    assert _hidden_kinds(subject) == {"general_linear"}
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("multiplier,g", [("g + beta", torch.ones(WIDTH)), ("g + beta", torch.randn(WIDTH)),
                                          ("g + data", torch.ones(WIDTH)), ("1 + g", torch.randn(WIDTH))])
def test_a_multiplier_that_differs_per_coordinate_allows_permutations_only(multiplier, g):
    subject = _subject(multiplier, g)
    assert "general_linear" not in _hidden_kinds(subject), census(subject)
    assert_fuzzed_at_two_shapes(subject)
