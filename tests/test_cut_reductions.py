"""Units cut apart, then summed, ranked or normalised as a set.

``sigmoid(x @ fn.T)[..., :3].sum(-1)``: the sum is blind to the order of the three units it reads, and nothing
else reads the two the slice cut away, so every one of the five rows of ``fn`` touched the same parameters and the
report listed one permutation of all five, which moves a cut-away unit into the sum (relative output change
0.18-0.80 in float64). The same for narrow, split and chunk with differently weighted pieces, fixed index
selections, strided slices, amax, logsumexp, top-k and a softmax's slice. A sum, statistic or ranking over some
coordinates now marks them as passing that op (``passes_through``): coordinates passing different such ops, or
none, are never mixed; the units read together still permute among themselves, the ones cut away among theirs.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

UNITS = 5

READ_AS_A_SET = {  # the units kept, read by something blind to their order (the rest is cut away)
    "slice, sum": lambda c: c[..., :3].sum(-1, keepdim=True),
    "narrow, mean": lambda c: c.narrow(-1, 1, 3).mean(-1, keepdim=True),
    "strided slice, sum": lambda c: c[..., ::2].sum(-1, keepdim=True),
    "index_select, sum": lambda c: c.index_select(-1, torch.tensor([0, 2])).sum(-1, keepdim=True),
    "fancy index, amax": lambda c: c[..., [0, 2, 3]].amax(-1, keepdim=True),
    "slice, logsumexp": lambda c: torch.logsumexp(c[..., :3], -1, keepdim=True),
    "slice, top-k": lambda c: torch.topk(c[..., :3], 2).values.sum(-1, keepdim=True),
    "softmax, slice, sum": lambda c: torch.softmax(c, -1)[..., :2].sum(-1, keepdim=True),
    "slice, layer norm": lambda c: F.layer_norm(c[..., :3], (3,)).pow(3).sum(-1, keepdim=True),
}

SPLIT_UNLIKE = {  # every unit read, but the pieces as different sets
    "split, weighted sums": lambda c: sum(k * p.sum(-1, keepdim=True) for k, p in enumerate(c.split([2, 3], -1), 1)),
    "two slices, difference of means": lambda c: c[..., :3].mean(-1, keepdim=True) - c[..., 3:].mean(-1, keepdim=True),
}


class Gated(nn.Module):
    """``UNITS`` sigmoid units of a parameter ``fn``, read by ``read``, gating a linear map of the input."""

    def __init__(self, read):
        super().__init__()
        self.read = read
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 6)
        self.fn = nn.Parameter(torch.randn(UNITS, 8))

    def forward(self, x):
        x = self.inp(x)
        return self.read(torch.sigmoid(F.linear(x, self.fn))) * self.out(x)


def _unit_groups(subject) -> list[frozenset[int]]:
    """The sets of ``fn`` rows each group moves."""
    sets = []
    for g in subject.report.groups:
        for m in g.members:
            if m.param == "fn" and m.axis == 0:
                sets.append(frozenset(int(i) for i in m.index.reshape(-1)))
    return sets


def _subject(read):
    return symgraph.load(noisy(Gated(read)).double(), (torch.randn(2, 7, 4, dtype=torch.float64),))


@pytest.mark.parametrize("name", list(READ_AS_A_SET))
def test_units_read_as_a_set_never_permute_with_units_cut_away(name):
    subject = _subject(READ_AS_A_SET[name])
    kept = {frozenset(range(3)), frozenset(range(1, 4)), frozenset({0, 2, 4}), frozenset({0, 2}),
            frozenset({0, 2, 3}), frozenset({0, 1})}
    groups = _unit_groups(subject)
    assert all(len(s) < UNITS for s in groups), groups  # never all five
    assert any(s in kept for s in groups), groups  # the units read together still permute
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("name", list(SPLIT_UNLIKE))
def test_pieces_read_as_different_sets_permute_apart(name):
    subject = _subject(SPLIT_UNLIKE[name])
    groups = _unit_groups(subject)
    assert sorted(len(s) for s in groups) == [2, 3], groups
    assert_fuzzed_at_two_shapes(subject)


def test_every_unit_summed_still_permutes_as_one_group():
    subject = _subject(lambda c: c.sum(-1, keepdim=True))
    assert [len(s) for s in _unit_groups(subject)] == [UNITS]
    assert_fuzzed_at_two_shapes(subject)
