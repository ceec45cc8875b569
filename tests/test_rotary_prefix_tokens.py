"""Rotary embeddings on some tokens only (DINOv3 rotates its patch tokens and leaves the class and register tokens
as they are): the rotated and plain pieces are joined along the tokens, and the queries and keys keep the rotary
group, the heads their permutation. Each form is fuzzed in float64 at two input shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 16, 2


def _half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def _pairs(x):  # interleaved pairs (2i, 2i+1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([-b, a], -1).flatten(-2)


class PrefixAttention(nn.Module):
    """One residual attention block whose first ``prefix`` tokens are left unrotated, in the ``form`` given."""

    def __init__(self, prefix: int, form: str):
        super().__init__()
        self.prefix, self.form, self.dh = prefix, form, D // H
        self.embed, self.q, self.k, self.v, self.o, self.head = (nn.Linear(D, D) for _ in range(6))

    def rotate(self, x, turn=_half):
        n = x.shape[2]
        angles = torch.arange(n, dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, self.dh // 2, dtype=x.dtype)
        cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
        if turn is _pairs:
            cos, sin = (torch.repeat_interleave(f(angles), 2, -1) for f in (torch.cos, torch.sin))
        return x * cos + turn(x) * sin

    def rope(self, x):
        p, n = self.prefix, x.shape[2] - self.prefix
        if self.form == "split, then rotated":  # DINOv3
            prefix, patches = x.split((p, n), dim=2)
            return torch.cat([prefix, self.rotate(patches)], dim=2)
        if self.form == "rotated, then cut":
            return torch.cat([x[:, :, :p], self.rotate(x)[:, :, p:]], dim=2)
        if self.form == "prefix flipped":  # the plain piece holds the coordinates in another order
            return torch.cat([x[:, :, :p].flip(-1), self.rotate(x)[:, :, p:]], dim=2)
        if self.form == "prefix half zero":  # the plain piece holds half the coordinates
            half = self.dh // 2
            prefix = torch.cat([x[:, :, :p, :half], torch.zeros_like(x[:, :, :p, half:])], -1)
            return torch.cat([prefix, self.rotate(x)[:, :, p:]], dim=2)
        # "rotated unlike": the prefix by interleaved pairs, the rest by halves: no map common to both pieces
        return torch.cat([self.rotate(x[:, :, :p], _pairs), self.rotate(x[:, :, p:])], dim=2)

    def forward(self, x):
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = (f(h).view(b, n, H, self.dh).transpose(1, 2) for f in (self.q, self.k, self.v))
        h = h + self.o(F.scaled_dot_product_attention(self.rope(q), self.rope(k), v).transpose(1, 2).reshape(b, n, -1))
        return self.head(h)


def _subject(prefix, form):
    torch.manual_seed(0)
    return symgraph.load(noisy(PrefixAttention(prefix, form)).double(), (torch.randn(2, 6, D, dtype=torch.float64),))


@pytest.mark.parametrize("form", ["split, then rotated", "rotated, then cut"])
@pytest.mark.parametrize("prefix", [1, 3])
def test_plain_prefix_tokens_keep_the_rotary_group(prefix, form):
    """The joined queries were pinned ("pieces with mixed coordinates concatenated along a data axis"). They are
    one mixed channel now: the rotated piece's terms, with coefficients 1 and 0 (the identity) at the plain tokens,
    so a map must commute with every rotation and the identity: the rotary group, not a general one."""
    subject = _subject(prefix, form)
    found = census(subject)
    assert found["qk rotary/positive 8x2"] == 1 and found["heads permutation 2x1"] == 1, found
    assert not any(k.startswith("qk orthogonal") for k in found), found
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["rotated unlike", "prefix flipped", "prefix half zero"])
def test_pieces_rotated_unlike_stay_pinned(form):
    """A plain piece is given the identity map: one that reorders or zeroes coordinates is no identity (the
    flipped and half-zero prefixes emitted a rotary and an orthogonal QK group that changed outputs by 0.14 and
    0.08)."""
    subject = _subject(2, form)
    assert not any(g.motif == "qk" for g in subject.report.groups), census(subject)
    assert any(p.reason == "pieces with mixed coordinates concatenated along a data axis"
               for p in subject.report.pinned)
    assert_fuzzed_at_two_shapes(subject)
