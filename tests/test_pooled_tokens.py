"""Tokens pooled by ``max`` over an axis the features do not vary along (Hiera's query pooling:
``h.view(b, stride, -1, d).max(dim=1).values``). The top-k rule laid the features' labels out as if the pooled axis
stayed (``keepdim``) and crashed the analysis on Hiera (an expand of (2, 1, 64, 32) to (2, 64, 32)); without
keepdim the axis is now dropped, and the features keep their permutation through the pooling."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy


class PooledTokens(nn.Module):
    def __init__(self, keepdim: bool):
        super().__init__()
        self.keepdim = keepdim
        self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        pooled = h.view(x.shape[0], 2, -1, 8).max(dim=1, keepdim=self.keepdim).values
        return self.out(pooled)


@pytest.mark.parametrize("keepdim", [False, True])
def test_features_keep_their_permutation_through_max_pooling_of_tokens(keepdim):
    subject = symgraph.load(noisy(PooledTokens(keepdim)).double(), (torch.randn(2, 6, 4, dtype=torch.float64),))
    moved = [g for g in subject.report.groups if any(m.param == "inp.weight" for m in g.members)]
    assert [(g.kind, g.size) for g in moved] == [("permutation", 8)], [(g.kind, g.size) for g in moved]
    assert_fuzzed_at_two_shapes(subject)
