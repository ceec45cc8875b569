"""Queries and keys merged with the batch axis for their product, then split again before the values.

GPT-NeoX-Japanese computes its scores with ``baddbmm`` over ``view(b * h, n, dh)`` queries and keys, views them back
to (b, h, n, n) and multiplies (b, h, n, dh) values. One head block was allocated per index of the merged axis, so
the scores' heads differed along the batch axis too, and the rule that pins heads multiplied by values that differ
from head to head without moving with them (``_pin_heads_beside_unlabelled_data``) read the batch axis, along which
values differ but no coordinate varies, as such a heads axis: the head group, sound (float64 change ~1e-16), was
lost. Batch indices whose query and key coordinates are the same rows are one head (analysis/contraction.py,
``_contract_pair``); values that really differ from head to head without moving with them still pin the heads.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

D, DH, H = 16, 4, 4

VALUES = {  # name -> values (b, n, h, dh) -> values (b, n, h, dh)
    "plain": lambda m, v: v,
    "one head's slice through a linear per head": lambda m, v: torch.cat([lin(v[:, :, :1]) for lin in m.per_head], 2),
}


class MergedBatchAttention(nn.Module):
    """Causal attention whose scores come from queries and keys merged with the batch axis (``baddbmm`` over
    ``b * h``, as GPT-NeoX-Japanese), split back to (b, h, n, n) before the values."""

    def __init__(self, values):
        super().__init__()
        self.values = values
        self.q, self.k, self.v, self.o = (nn.Linear(D, H * DH) for _ in range(4))
        self.per_head = nn.ModuleList(nn.Linear(DH, DH) for _ in range(H))

    def forward(self, x):
        b, n, _ = x.shape
        q, k = (p(x).view(b, n, H, DH).transpose(1, 2).reshape(b * H, n, DH) for p in (self.q, self.k))
        v = self.values(self, self.v(x).view(b, n, H, DH)).transpose(1, 2)
        scores = torch.baddbmm(torch.zeros(b * H, n, n, dtype=x.dtype), q, k.transpose(1, 2), alpha=1 / math.sqrt(DH))
        scores = scores.view(b, H, n, n) + torch.triu(torch.full((n, n), -1e9, dtype=x.dtype), 1)
        return self.o(torch.matmul(scores.softmax(-1), v).transpose(1, 2).flatten(2))


def _heads(values) -> tuple:
    subject = symgraph.load(noisy(MergedBatchAttention(values)).double(), (torch.randn(2, 7, D, dtype=torch.float64),))
    return subject, [g for g in subject.report.groups if g.motif == "heads"]


def test_heads_merged_with_the_batch_axis_keep_their_group():
    subject, heads = _heads(VALUES["plain"])
    assert [g.size for g in heads] == [H], [g.id for g in subject.report.groups]
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("name", ["one head's slice through a linear per head"])
def test_values_that_differ_per_head_without_moving_still_pin(name):
    subject, heads = _heads(VALUES[name])
    assert not heads, [g.id for g in heads]
    assert_fuzzed_at_two_shapes(subject)
