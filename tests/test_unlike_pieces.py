"""Pieces of one tensor cut apart along a coordinate axis and joined again after different ops.

``cat([h[..., :8] * 2, h[..., 8:]])``: a scalar factor treats its whole piece alike, so it commutes with every
permutation of that piece and nothing in the graph told the two halves apart; the report listed one permutation
of all 16 units, which moved units into the other factor (relative output change 0.17, float64). The same held
for heads: queries of half the heads scaled, rotary embedding or tanh on some heads only, each with a head
permutation of all heads (changes of 0.04-0.12). Pieces computed by different ops from their cuts are now kept
apart (``rules._separate_unlike_pieces``): their units form separate blocks, and heads permute only among the
heads of their own piece. Pieces computed alike (a split and re-join, rotate_half's halves of every head) keep
their groups.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

WIDTH, HEADS = 16, 4
HEAD = WIDTH // HEADS


class SplitUnits(nn.Module):
    def __init__(self, treat: str):
        super().__init__()
        self.treat = treat
        self.up, self.down = nn.Linear(8, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x):
        h = torch.relu(self.up(x))
        first, second = h[..., :8], h[..., 8:]
        if self.treat == "scaled":
            first = first * 2.0
        return self.down(torch.cat([first, second], -1))


def _ffn_sizes(subject) -> list[int]:
    return sorted(g.size for g in subject.report.groups if g.motif == "ffn")


def test_units_of_a_scaled_half_are_not_permuted_with_the_rest():
    subject = symgraph.load(noisy(SplitUnits("scaled")), (torch.randn(2, 7, 8),))
    assert max(_ffn_sizes(subject), default=0) <= 8
    assert_fuzzed_at_two_shapes(subject)


def test_a_split_joined_again_unchanged_keeps_one_permutation():
    subject = symgraph.load(noisy(SplitUnits("none")), (torch.randn(2, 7, 8),))
    assert _ffn_sizes(subject) == [WIDTH]
    assert_fuzzed_at_two_shapes(subject)


def _rotate(x):
    """Rotary embedding of ``x`` (batch, heads, length, head size), rotate_half style."""
    length = x.shape[2]
    angles = torch.arange(length, dtype=x.dtype)[:, None] / 10000 ** (torch.arange(0, HEAD, 2, dtype=x.dtype) / HEAD)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., HEAD // 2:], x[..., :HEAD // 2]], -1) * sin


class SomeHeadsTreated(nn.Module):
    def __init__(self, treat: str):
        super().__init__()
        self.treat = treat
        self.embed, self.head = nn.Embedding(20, WIDTH), nn.Linear(WIDTH, 5)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, ids):
        x = self.embed(ids)
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, HEAD).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.treat == "scaled queries":
            q = torch.cat([q[:, :2] * 2.0, q[:, 2:]], 1)
        elif self.treat == "rotary":
            q, k = (torch.cat([_rotate(t[:, :2]), t[:, 2:]], 1) for t in (q, k))
        elif self.treat == "tanh values":
            v = torch.cat([torch.tanh(v[:, :2]), v[:, 2:]], 1)
        elif self.treat == "rotary everywhere":
            q, k = _rotate(q), _rotate(k)
        a = F.scaled_dot_product_attention(q, k, v)
        return self.head(x + self.o(a.transpose(1, 2).reshape(b, n, WIDTH)))


@pytest.mark.parametrize("treat", ["scaled queries", "rotary", "tanh values"])
def test_heads_treated_apart_permute_only_among_themselves(treat):
    subject = symgraph.load(noisy(SomeHeadsTreated(treat)), (torch.randint(0, 20, (2, 7)),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    query_rows = [{int(i) // (WIDTH // 2) for m in g.members if m.param == "q.weight" for i in m.index.reshape(-1)}
                  for g in heads]
    assert sorted(map(sorted, query_rows)) == [[0], [1]]  # heads 0-1 and heads 2-3, never one with the other
    assert {"qk", "vo"} <= {g.motif for g in subject.report.groups}
    assert_fuzzed_at_two_shapes(subject)


def test_rotary_on_every_head_keeps_the_head_permutation():
    subject = symgraph.load(noisy(SomeHeadsTreated("rotary everywhere")), (torch.randint(0, 20, (2, 7)),))
    assert [(g.kind, g.size) for g in subject.report.groups if g.motif == "heads"] == [("permutation", HEADS)]
    assert any(g.kind == "rotary" for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)
