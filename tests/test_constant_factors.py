"""A constant factor on some terms of a rotary written in real arithmetic (``x0 c - 2 x1 s``): no transformation of
the coordinates sees a factor on its own, but a sum of terms does, and one that multiplies one term and not the
other makes a map that is no rotation. Each form is fuzzed in float64 at two input shapes; the controls, true
rotations (the same factor on every term, a -1 written as a product), keep their QK group."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, NH, DH = 8, 2, 4


class Rotated(nn.Module):
    """Attention whose queries and keys (b, n, heads, dims) go through ``rotate(x, cos, sin)``; ``cos`` and ``sin``
    hold one angle per position and pair of dims, or per position and dim when ``halves`` (rotate_half's layout)."""

    def __init__(self, rotate, halves: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.rotate, self.halves = rotate, halves

    def angles(self, x):
        n, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
        a = torch.outer(torch.arange(n, dtype=x.dtype), inv)[None, :, None, :]
        a = a.repeat(1, 1, 1, 2) if self.halves else a
        return a.cos(), a.sin()

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, NH, DH) for p in (self.q, self.k, self.v))
        q, k = (self.rotate(t, *self.angles(t)).transpose(1, 2) for t in (q, k))
        s = (q @ k.transpose(-1, -2) / math.sqrt(DH)).softmax(-1)
        return self.o((s @ v.transpose(1, 2)).transpose(1, 2).reshape(b, n, D))


def pairs(first, second):
    """Interleaved pairs (2i, 2i + 1): ``stack([first(x0, x1, c, s), second(...)], -1)``."""
    def rotate(x, c, s):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([first(x0, x1, c, s), second(x0, x1, c, s)], -1).flatten(-2)
    return rotate


def joined(scale0, scale1, coef1):
    """Pairs joined into one tensor with each half scaled, then split again: ``z1 = scale1 * x1`` read at
    ``coef1``; a rotation of x only where the two cancel."""
    def rotate(x, c, s):
        z = torch.stack([scale0 * x[..., 0::2], scale1 * x[..., 1::2]], -1)
        z0, z1 = z[..., 0], z[..., 1]
        return torch.stack([z0 * c - coef1 * z1 * s, coef1 * z1 * c + z0 * s], -1).flatten(-2)
    return rotate


def written(*halves):
    """The halves ``halves`` (0: even dims, 1: odd dims) doubled by an in-place write, then rotated in pairs."""
    def rotate(x, c, s):
        z = x.clone()
        for h in halves:
            z[..., h::2] = 2 * x[..., h::2]
        return pairs(lambda x0, x1, c, s: x0 * c - x1 * s, lambda x0, x1, c, s: x1 * c + x0 * s)(z, c, s)
    return rotate


def half(turned):
    """rotate_half's layout: ``x c + turned(x1, x2) s``, the halves x1, x2 of the dims."""
    def rotate(x, c, s):
        return x * c + turned(*x.chunk(2, -1)) * s
    return rotate


def second_row(x0, x1, c, s):
    return x1 * c + x0 * s


def turned(x):
    """rotate_half as a product with a fixed signed permutation matrix."""
    d = x.shape[-1] // 2
    r = torch.zeros(2 * d, 2 * d, dtype=x.dtype)
    r[torch.arange(d) + d, torch.arange(d)], r[torch.arange(d), torch.arange(d) + d] = -1, 1
    return x @ r


NO_ROTATION = {
    "scaled sine": pairs(lambda x0, x1, c, s: x0 * c - 2 * x1 * s, second_row),
    "scaled after the product": pairs(lambda x0, x1, c, s: x0 * c - 2 * (x1 * s), second_row),
    "channel divided": pairs(lambda x0, x1, c, s: x0 * c - (x1 / 2) * s, second_row),
    "one row scaled": pairs(lambda x0, x1, c, s: 2 * x0 * c - 2 * x1 * s, second_row),
    "scaled cosine": pairs(lambda x0, x1, c, s: 3 * x0 * c - x1 * s, second_row),
    "sine times -2": pairs(lambda x0, x1, c, s: x0 * c + (x1 * -2) * s, second_row),
    "channel added to itself": pairs(lambda x0, x1, c, s: (x0 + x0) * c - x1 * s, second_row),
    "half a channel taken from it": pairs(lambda x0, x1, c, s: (x0 - 0.5 * x0) * c - x1 * s, second_row),
    "halves scaled apart when joined": joined(1, 2, 1),
    "odd dims doubled in place": written(1),
    "rotate_half of a doubled half": (half(lambda x1, x2: torch.cat((-(2 * x2), x1), -1)), True),
    "rotate_half by a matrix, one half doubled": (half(lambda x1, x2: turned(torch.cat((x1, 2 * x2), -1))), True),
}

ROTATIONS = {
    "torchtune": pairs(lambda x0, x1, c, s: x0 * c - x1 * s, second_row),
    "negative angle": pairs(lambda x0, x1, c, s: x0 * c + x1 * s, lambda x0, x1, c, s: x1 * c - x0 * s),
    "every term doubled": pairs(lambda x0, x1, c, s: 2 * x0 * c - 2 * x1 * s,
                                lambda x0, x1, c, s: 2 * x1 * c + 2 * x0 * s),
    "sine times -1": pairs(lambda x0, x1, c, s: x0 * c + (x1 * -1) * s, second_row),
    "halves scaled apart when joined, undone": joined(1, 2, 0.5),
    "halves scaled alike when joined": joined(3, 3, 1),
    "every dim doubled in place": written(0, 1),
    "rotate_half times -1": (half(lambda x1, x2: torch.cat((x2 * -1, x1), -1)), True),
    "rotate_half by a matrix, every dim doubled": (half(lambda x1, x2: turned(2 * torch.cat((x1, x2), -1))), True),
    "rotate_half, both halves doubled": (half(lambda x1, x2: torch.cat((-(2 * x2), 2 * x1), -1)), True),
}


def subject_of(form):
    rotate, halves = form if isinstance(form, tuple) else (form, False)
    torch.manual_seed(0)
    return symgraph.load(noisy(Rotated(rotate, halves)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("name", NO_ROTATION)
def test_a_factor_on_some_terms_gives_no_rotary_group(name):
    """On the old engine a constant factor on a channel that was not yet mixed was dropped (a scalar commutes with
    every map), and the sum after it resolved as a rotation: ``qk rotary 4x2`` was kept and changed the outputs
    (relative change 0.02-0.6) in all but two of these forms."""
    subject = subject_of(NO_ROTATION[name])
    assert not any(g.motif == "qk" and g.kind == "rotary" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("name", ROTATIONS)
def test_a_factor_that_keeps_a_rotation_keeps_the_group(name):
    subject = subject_of(ROTATIONS[name])
    assert census(subject).get("qk rotary/positive 4x2") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Scan(nn.Module):
    """A linear recurrence started from zeros (Mamba's scan written out): ``h = decay_t * h + u_t``, the states
    stacked, plus a skip connection scaled by 2."""

    def __init__(self):
        super().__init__()
        self.decay, self.u, self.skip = (nn.Linear(D, 12) for _ in range(3))
        self.out = nn.Linear(12, D)

    def forward(self, x):
        decay, u = torch.sigmoid(self.decay(x)), self.u(x)
        h, states = torch.zeros_like(u[:, 0]), []
        for t in range(x.shape[1]):
            h = decay[:, t] * h + u[:, t]
            states.append(h)
        return self.out(torch.stack(states, 1) + 2 * self.skip(x))


def test_a_sum_with_a_zero_term_is_the_other_term():
    """``decay * 0 + u`` is ``u``: the sum keeps the factor of its first operand only where the second has the
    same one. With the 0 kept, the stacked states held a factor of 0 at the first step and 1 after it, their sum
    with the skip connection became a mixed channel, and the 12 units lost their permutation."""
    torch.manual_seed(0)
    subject = symgraph.load(noisy(Scan()).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject).get("ffn permutation 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)
