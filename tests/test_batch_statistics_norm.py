"""Batch norm on the statistics of its own input, with no running statistics (``F.batch_norm(x, None, None,
training=True)``): BiT's weight standardisation normalises each convolution filter over its inputs that way. The
filters' input channels keep what a LayerNorm over them passes, their output channels permute and flip sign."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy


class StandardisedConv(nn.Conv2d):
    """BiT's ``WeightStandardizedConv2d``: every filter centred and scaled over its inputs and kernel positions."""

    def forward(self, x):
        weight = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True,
                              momentum=0.0, eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, weight, self.bias, self.stride, self.padding)


class StandardisedNet(nn.Module):
    def __init__(self, batch_statistics_on_activations: bool = False):
        super().__init__()
        self.batch_statistics_on_activations = batch_statistics_on_activations
        self.stem = StandardisedConv(3, 8, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(4, 8)
        self.conv = StandardisedConv(8, 12, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(12, 12)
        self.head = nn.Linear(12, 5)

    def forward(self, pixels):
        h = torch.relu(self.norm1(self.stem(pixels)))
        h = self.conv(h)
        h = F.batch_norm(h, None, None, training=True) if self.batch_statistics_on_activations else self.norm2(h)
        return self.head(torch.relu(h).mean((2, 3)))


def subject(**kw):
    return symgraph.load(noisy(StandardisedNet(**kw)), (torch.randn(2, 3, 6, 6),))


def test_standardised_filters_keep_their_channel_permutations():
    """Main pinned every standardised filter (batch norm in training mode): no group at all."""
    s = subject()
    kinds = census(s)
    assert kinds.get("ffn permutation 2x4") == 1, kinds  # the stem's 8 channels: within each of 4 groups
    assert kinds.get("ffn permutation 12x1") == 1, kinds  # the second conv's channels (one per group)
    members = {(m.param, m.axis) for g in s.report.groups for m in g.members}
    assert {("stem.weight", 0), ("conv.weight", 1), ("conv.weight", 0), ("head.weight", 1)} <= members
    assert_fuzzed_at_two_shapes(s)


def test_batch_statistics_on_activations_permute_channels_with_a_sign():
    s = subject(batch_statistics_on_activations=True)
    assert any(g.motif == "ffn" and g.size == 12 for g in s.report.groups), census(s)
    assert_fuzzed_at_two_shapes(s)


def test_a_channel_along_the_channel_and_the_normalised_axes_pins():
    """Statistics over a tensor whose coordinate runs along axis 1 and axis 2 at once cannot follow it."""

    class Crossed(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(4, 16), nn.Linear(16, 3)

        def forward(self, x):
            h = self.up(x)  # (batch, 16): one coordinate spread over axes 1 and 2 below
            h = F.batch_norm(h.reshape(x.shape[0], 4, 4), None, None, training=True)
            return self.down(torch.relu(h.reshape(x.shape[0], 16)))

    s = symgraph.load(noisy(Crossed()), (torch.randn(3, 4),))
    assert not any(g.motif == "ffn" and g.size == 16 for g in s.report.groups), census(s)
    assert_fuzzed_at_two_shapes(s)
