"""A rotary table with learned rows (MLCD: the class token's angles are a parameter, ``cos(cat([a, a]))`` joined
above the table computed from the patch positions). The parameter was pinned where it was joined beside the
computed rows, and the pin spread to the queries and keys it multiplies: no QK and no head group. No group moves
it, so the walk reads it as data a second time; each form is fuzzed in float64 at two input shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from example_scripts import example_module
from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 16, 2


def _half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class LearnedRowAttention(nn.Module):
    """One residual attention block whose first token's rotary angles are a parameter: paired as the table is
    (``paired``: one angle per rotate_half pair) or one angle per coordinate (no rotation of pairs there)."""

    def __init__(self, paired: bool):
        super().__init__()
        self.paired, self.dh = paired, D // H
        self.angle = nn.Parameter(torch.randn(1, self.dh // 2 if paired else self.dh))
        self.embed, self.q, self.k, self.v, self.o, self.head = (nn.Linear(D, D) for _ in range(6))

    def rope(self, x):
        n = x.shape[2] - 1
        angles = torch.arange(n, dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, self.dh // 2, dtype=x.dtype)
        first = torch.cat([self.angle, self.angle], -1) if self.paired else self.angle
        cos, sin = (torch.cat([f(first), torch.cat([f(angles)] * 2, -1)], 0) for f in (torch.cos, torch.sin))
        return x * cos + _half(x) * sin

    def forward(self, x):
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = (f(h).view(b, n, H, self.dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = h + self.o(F.scaled_dot_product_attention(self.rope(q), self.rope(k), v).transpose(1, 2).reshape(b, n, -1))
        return self.head(h)


def _subject(paired):
    torch.manual_seed(0)
    model = noisy(LearnedRowAttention(paired)).double()
    return symgraph.load(model, (torch.randn(2, 6, D, dtype=torch.float64),))


def test_learned_rotary_rows_keep_the_rotary_and_head_groups():
    subject = _subject(paired=True)
    found = census(subject)
    assert found["qk rotary/positive 8x2"] == 1 and found["heads permutation 2x1"] == 1, found
    assert_fuzzed_at_two_shapes(subject)


def test_learned_rows_that_pair_nothing_pin_the_queries():
    """One angle per coordinate: at the first token the map mixes each pair by no rotation (cos and sin differ
    within the pair), so the table's pairs do not survive: no QK group may be emitted."""
    subject = _subject(paired=False)
    assert not any(g.motif == "qk" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("free_outputs", [False, True])
def test_mlcd_keeps_its_query_key_and_head_groups(free_outputs):
    with example_module("sweep_architectures") as sweep:
        model, _ = sweep.build("mlcd_vision_model")
    subject = symgraph.load(model, free_outputs=free_outputs)
    found = census(subject)
    assert found["qk rotary/positive 16x4"] == 2 and found["heads permutation 4x1"] == 2, found
    assert found.get("residual permutation 64x1", 0) == free_outputs, found  # its hidden states are an output
    assert_fuzzed_at_two_shapes(subject)


def test_learned_rows_that_repeat_values_stay_pinned():
    """Angles initialised to zeros make the first token's map the identity, which commutes with any map: read as
    data they would allow a group the trained angles do not. Values that repeat are not read as data."""
    model = noisy(LearnedRowAttention(paired=False)).double()
    with torch.no_grad():
        model.angle.zero_()
    subject = symgraph.load(model, (torch.randn(2, 6, D, dtype=torch.float64),))
    assert any(p.node.startswith("cat") and "angle" in p.params for p in subject.report.pinned), census(subject)
    assert not {"qk", "heads"} & {g.motif for g in subject.report.groups}  # heads may not leave their queries
    assert_fuzzed_at_two_shapes(subject)
