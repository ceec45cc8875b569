"""Rotations whose pairs do not come from one tensor at every input shape: the second row of each pair read from
``r = x + f(x)`` (x's coordinates, another tensor), and a partial rotary whose width follows the input's length.
Each emitted a rotary QK group that changed the outputs; each form is fuzzed in float64 at two input shapes, beside
ordinary rotaries (rotate_half, interleaved pairs, a fixed partial width) that keep theirs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy
from test_rotary_prefix_tokens import _half, _pairs

D, H = 16, 2


def _angles(x, n):
    d = x.shape[-1]
    return torch.arange(n, dtype=x.dtype)[:, None] / 10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d)


def _rotate(x, turn=_half):
    a = _angles(x, x.shape[2])
    repeat = (lambda t: torch.repeat_interleave(t, 2, -1)) if turn is _pairs else (lambda t: torch.cat([t] * 2, -1))
    return x * repeat(a.cos()) + turn(x) * repeat(a.sin())


def _stacked(x, r):
    """Interleaved pairs written out: rows (x0 c - x1 s, r1 c + r0 s); ``r`` is ``x`` in the ordinary form."""
    a = _angles(x, x.shape[2])
    c, s = a.cos(), a.sin()
    return torch.stack([x[..., 0::2] * c - x[..., 1::2] * s, r[..., 1::2] * c + r[..., 0::2] * s], -1).flatten(-2)


def _partial(width):
    def rope(x, mix):
        r = width(x.shape[2])
        return torch.cat([_rotate(x[..., :r]), x[..., r:]], -1)
    return rope


FORMS = {  # name: (rotary on (x, mix), whether the rotary group is sound)
    "rotate_half": (lambda x, mix: _rotate(x), True),
    "interleaved": (lambda x, mix: _rotate(x, _pairs), True),
    "interleaved, stacked": (lambda x, mix: _stacked(x, x), True),
    "second rows from x + f(x)": (lambda x, mix: _stacked(x, x + mix(x)), False),
    "partial, width 4": (_partial(lambda n: 4), True),
    "partial, width from the length": (_partial(lambda n: 4 if n < 4 else 8), False),
    "partial, wider when short": (_partial(lambda n: 8 if n < 4 else 4), False),
    "partial, 2 dims, wider when short": (_partial(lambda n: 8 if n < 4 else 2), False),
}


class Attention(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.rope = FORMS[form][0]
        self.embed, self.q, self.k, self.v, self.o, self.head = (nn.Linear(D, D) for _ in range(6))
        self.mix = nn.Linear(D // H, D // H)

    def forward(self, x):
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = (f(h).view(b, n, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(self.rope(q, self.mix), self.rope(k, self.mix), v)
        return self.head(h + self.o(a.transpose(1, 2).reshape(b, n, -1)))


@pytest.mark.parametrize("form", list(FORMS))
def test_rotary_group_only_where_pairs_read_one_tensor_at_every_length(form):
    """On the old engine the stacked form with second rows from ``x + f(x)`` kept a rotary group (the sum carries
    x's ids, so each term looked like one map of x), the partial rotary over all 8 dims at length 6 (4 below
    length 4) kept rotations of pairs that a shorter input splits, and the partial rotaries over 4 or 2 dims at
    length 6 (all 8 below length 4) kept maps of pass-through dims that a shorter input rotates."""
    torch.manual_seed(0)
    subject = symgraph.load(noisy(Attention(form)).double(), (torch.randn(2, 6, D, dtype=torch.float64),))
    rotary = [g for g in subject.report.groups if g.kind == "rotary"]
    assert bool(rotary) == FORMS[form][1], census(subject)
    assert_fuzzed_at_two_shapes(subject)
