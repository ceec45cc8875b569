"""Queries and keys whose rotations leave no rotary group: the two sides paired unlike (rotate_half on the queries,
interleaved pairs on the keys; a partial rotary on the queries, a full one on the keys) and a centring LayerNorm
without weights before the rotation. Each emitted a rotary QK group that changed the outputs; each form is
fuzzed in float64 at two input shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy
from test_rotary_prefix_tokens import _half, _pairs

D, H = 16, 2


def _rotate(x, turn=_half):
    angles = torch.arange(x.shape[2], dtype=x.dtype)[:, None] * torch.linspace(0.1, 1.0, x.shape[-1] // 2,
                                                                                dtype=x.dtype)
    if turn is _pairs:
        cos, sin = (torch.repeat_interleave(f(angles), 2, -1) for f in (torch.cos, torch.sin))
    else:
        cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
    return x * cos + turn(x) * sin


def _partial(x):
    half = x.shape[-1] // 2
    return torch.cat([_rotate(x[..., :half]), x[..., half:]], -1)


FORMS = {  # (queries, keys)
    "plain": (_rotate, _rotate),
    "halves, pairs": (_rotate, lambda x: _rotate(x, _pairs)),
    "partial, full": (_partial, _rotate),
    "centred, then rotated": (lambda x: _rotate(F.layer_norm(x, x.shape[-1:])),) * 2,
}


class Attention(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.rope_q, self.rope_k = FORMS[form]
        self.embed, self.q, self.k, self.v, self.o, self.head = (nn.Linear(D, D) for _ in range(6))

    def forward(self, x):
        h = self.embed(x)
        b, n, _ = h.shape
        q, k, v = (f(h).view(b, n, H, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(self.rope_q(q), self.rope_k(k), v)
        return self.head(h + self.o(a.transpose(1, 2).reshape(b, n, -1)))


@pytest.mark.parametrize("form", ["plain", "halves, pairs", "partial, full", "centred, then rotated"])
def test_only_rotations_alike_on_both_sides_keep_the_rotary_group(form):
    """A coordinate paired with two partners (or paired on one side, passed through on the other) commutes with no
    rotation per pair; after a centring the maps must fix the ones vector, which no turned pair does."""
    torch.manual_seed(0)
    subject = symgraph.load(noisy(Attention(form)).double(), (torch.randn(2, 6, D, dtype=torch.float64),))
    rotary = [g for g in subject.report.groups if g.kind == "rotary"]
    assert len(rotary) == (form == "plain"), census(subject)
    assert_fuzzed_at_two_shapes(subject)
