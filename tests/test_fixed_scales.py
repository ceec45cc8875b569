"""Coordinates multiplied by fixed numbers that differ from one coordinate to the next.

``relu(inp(x)) * buffer`` (a persistent or non-persistent buffer, ``torch.arange``, a constant tensor) followed by
a linear, a sum, a norm, a softmax, a concatenation or another activation: the product carries the numbers as
coefficients, resolved where the channel is consumed (``analysis/mixing.py``). A coordinate seeing the same number
at every position was read as a pass-through coordinate whatever that number, so every unit was listed in one
permutation although moving unit i to unit j multiplies it by c_j instead of c_i (fuzz error in float64 up to
order 1). Coordinates scaled by different numbers are now kept apart; those scaled alike still permute among
themselves. A query scaled per coordinate (``q * buffer``) no longer gets a rotation of the head; values scaled
per head, or rotary frequencies that differ from head to head, no longer let the heads trade places (the head
permutations read which fixed maps each head's coordinates see as pieces).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

UNITS = 8

CONSUMERS = {  # how the scaled units are read
    "linear": lambda m, s, x: m.out(s),
    "sum": lambda m, s, x: s.sum(-1, keepdim=True) * m.side(x),
    "tanh, linear": lambda m, s, x: m.out(torch.tanh(s)),
    "softmax, linear": lambda m, s, x: m.out(torch.softmax(s, -1)),
    "layer norm, linear": lambda m, s, x: m.out(F.layer_norm(s, (UNITS,))),
    "concatenated, linear": lambda m, s, x: m.wide(torch.cat([s, s.relu()], -1)),
    "added to the units, linear": lambda m, s, x: m.out(s + torch.relu(s)),
}

SCALES = {
    "buffer": lambda m: m.scale,
    "non-persistent buffer": lambda m: m.scratch,
    "arange": lambda m: torch.arange(1, UNITS + 1, dtype=torch.float64),
}


class Scaled(nn.Module):
    def __init__(self, scale, consume, values=None):
        super().__init__()
        self.inp, self.out, self.wide = nn.Linear(4, UNITS), nn.Linear(UNITS, 6), nn.Linear(2 * UNITS, 6)
        self.side = nn.Linear(4, 6)
        values = torch.linspace(0.5, 2.0, UNITS) if values is None else values
        self.register_buffer("scale", values.clone())
        self.register_buffer("scratch", values.clone(), persistent=False)
        self.scale_of, self.consume = scale, consume

    def forward(self, x):
        return self.consume(self, torch.relu(self.inp(x)) * self.scale_of(self), x)


def _subject(model):
    return symgraph.load(noisy(model).double(), (torch.randn(2, 7, 4, dtype=torch.float64),))


def _unit_sets(subject) -> list[frozenset[int]]:
    """The sets of units each copy of a group moves, where it moves more than one."""
    return [frozenset(int(i) for i in copy.reshape(-1)) for g in subject.report.groups for m in g.members
            if m.param == "inp.weight" and m.axis == 0 and m.index.shape[1] > 1 for copy in m.index]


@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("consumer", list(CONSUMERS))
def test_units_scaled_by_different_numbers_never_mix(scale, consumer):
    subject = _subject(Scaled(SCALES[scale], CONSUMERS[consumer]))
    assert _unit_sets(subject) == [], [(g.kind, g.size) for g in subject.report.groups]
    assert_fuzzed_at_two_shapes(subject)


def test_units_scaled_alike_still_permute_among_themselves():
    values = torch.tensor([1.0, 1.0, 2.0, 2.0, 1.0, 2.0, 1.0, 2.0])
    subject = _subject(Scaled(SCALES["buffer"], CONSUMERS["linear"], values))
    assert sorted(map(sorted, _unit_sets(subject))) == [[0, 1, 4, 6], [2, 3, 5, 7]]
    assert_fuzzed_at_two_shapes(subject)


HEADS, HEAD_DIM = 2, 4


def _rotary(t, theta):
    """rotate_half RoPE with base ``theta`` (a number, or one per head shaped (heads, 1, 1))."""
    inv = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angle = torch.arange(t.shape[-2], dtype=torch.float64).view(-1, 1) * inv
    angle = torch.cat([angle, angle], -1)
    a, b = t[..., :HEAD_DIM // 2], t[..., HEAD_DIM // 2:]
    return t * angle.cos() + torch.cat([-b, a], -1) * angle.sin()


ATTENTION = {  # (queries, keys, values) of each head -> what the layer attends with
    "queries scaled per coordinate": lambda m, q, k, v: (q * m.dim_scale, k, v),
    "values scaled per head": lambda m, q, k, v: (q, k, v * m.head_scale),
    "rotary, the same base for every head": lambda m, q, k, v: (_rotary(q, 1000.0), _rotary(k, 1000.0), v),
    "rotary, a base per head": lambda m, q, k, v: (_rotary(q, m.head_theta), _rotary(k, m.head_theta), v),
}


class Attention(nn.Module):
    def __init__(self, change):
        super().__init__()
        width = HEADS * HEAD_DIM
        self.change = change
        self.q, self.k, self.v, self.o = (nn.Linear(width, width, bias=False) for _ in range(4))
        self.register_buffer("dim_scale", torch.linspace(0.5, 2.0, HEAD_DIM))
        self.register_buffer("head_scale", torch.tensor([0.5, 2.0]).view(HEADS, 1, 1))
        self.register_buffer("head_theta", torch.tensor([100.0, 10000.0]).view(HEADS, 1, 1))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k, v = self.change(self, q, k, v)
        o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM), -1) @ v
        return self.o(o.transpose(1, 2).reshape(b, t, -1))


def _attention(name):
    return symgraph.load(noisy(Attention(ATTENTION[name])).double(), (torch.randn(2, 5, 8, dtype=torch.float64),))


def _kinds(subject, motif):
    return sorted((g.kind, g.size) for g in subject.report.groups if g.motif == motif)


def test_query_scaled_per_coordinate_gets_no_head_rotation():
    subject = _attention("queries scaled per coordinate")
    qk = [g for g in subject.report.groups if any(m.param == "q.weight" and m.axis == 0 for m in g.members)
          and g.kind in ("orthogonal", "general_linear", "rotary")]
    assert all(g.size == 1 for g in qk), [(g.motif, g.kind, g.size) for g in qk]
    assert _kinds(subject, "vo") == [("orthogonal", HEAD_DIM)]  # the values are untouched
    assert _kinds(subject, "heads") == [("permutation", HEADS)]  # every head is scaled alike
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("name", ["values scaled per head", "rotary, a base per head"])
def test_heads_that_see_different_fixed_maps_keep_their_places(name):
    subject = _attention(name)
    assert _kinds(subject, "heads") == []
    assert _kinds(subject, "vo") == [("orthogonal", HEAD_DIM)]  # within each head, a scalar commutes
    assert_fuzzed_at_two_shapes(subject)


def test_heads_that_see_the_same_rotary_maps_still_trade_places():
    subject = _attention("rotary, the same base for every head")
    assert _kinds(subject, "heads") == [("permutation", HEADS)]
    assert_fuzzed_at_two_shapes(subject)
