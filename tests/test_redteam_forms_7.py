"""Forms a seventh soundness pass tried, from whole small models written the way well-known repositories write
them (timm, nanoGPT, Meta's and torchtune's rotary, HF BERT's relative keys, VQ-VAE): each fuzzed in float64 at
two input shapes, with the groups the engine must keep."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, NH, DH, H = 8, 2, 4, 12


def heads(t):
    b, n, _ = t.shape
    return t.view(b, n, NH, DH).transpose(1, 2)


def merged(t):
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b, n, h * d)


class InterleavedRope(nn.Module):
    """Attention with rotary pairs (2i, 2i + 1) written in real arithmetic: ``stack([x0 c - x1 s, <second>], -1)
    .flatten(-2)``, the second entry ``x1 c + x0 s`` (torchtune) or ``x0 s + x1 c`` (sine term first)."""

    def __init__(self, sine_first: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.sine_first = sine_first

    def rotate(self, x):  # (b, n, h, d)
        n, d = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
        a = torch.outer(torch.arange(n, dtype=x.dtype), inv)[None, :, None, :]
        c, s = a.cos(), a.sin()
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        x0, x1 = pairs[..., 0], pairs[..., 1]
        second = x0 * s + x1 * c if self.sine_first else x1 * c + x0 * s
        return torch.stack([x0 * c - x1 * s, second], -1).flatten(3)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, NH, DH) for p in (self.q, self.k, self.v))
        q, k = self.rotate(q).transpose(1, 2), self.rotate(k).transpose(1, 2)
        s = q @ k.transpose(-1, -2) / math.sqrt(DH)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return self.o(merged(s.softmax(-1) @ v.transpose(1, 2)))


@pytest.mark.parametrize("sine_first", [True, False], ids=["sine term first", "torchtune order"])
def test_interleaved_rotary_written_in_real_arithmetic_keeps_its_pairs(sine_first):
    """The stack joins two mixed channels term by term, in the order the model wrote each sum: with the sine term
    first, x0 was paired with x0, the joined first term held every coordinate twice, and resolving it pinned q and
    k (no QK group, no head permutation). The terms are now paired so that each joined term reads each coordinate
    once."""
    subject = symgraph.load(noisy(InterleavedRope(sine_first)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    kinds = census(subject)
    assert kinds.get("qk rotary/positive 4x2") == 1 and kinds.get("heads permutation 2x1") == 1, kinds
    assert_fuzzed_at_two_shapes(subject)


class RelativeKey(nn.Module):
    """HF BERT ``position_embedding_type="relative_key"``: one distance table of head-dim width read by every
    head's queries."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.distance_embedding = nn.Embedding(15, DH)
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        n = x.shape[1]
        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        pos = torch.arange(n)
        table = self.distance_embedding(pos[:, None] - pos[None, :] + 7).to(x.dtype)
        s = q @ k.transpose(-1, -2) + torch.einsum("bhld,lrd->bhlr", q, table)
        return self.out(x + self.o(merged((s / math.sqrt(DH)).softmax(-1) @ v)))


def test_a_distance_table_shared_by_every_head_shares_one_qk_map():
    """Control: the table's columns move with the keys' head dimension, so one map serves both heads."""
    subject = symgraph.load(noisy(RelativeKey()).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    kinds = census(subject)
    assert kinds.get("qk orthogonal 4x1") == 1 and "qk orthogonal 4x2" not in kinds, kinds
    assert_fuzzed_at_two_shapes(subject)


class GRNBlock(nn.Module):
    """ConvNeXt-V2 global response normalisation between two linears: ``x * (gx / gx.mean(-1))``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.gamma, self.beta = nn.Parameter(torch.zeros(H)), nn.Parameter(torch.zeros(H))

    def forward(self, x):  # (b, h, w, D)
        y = F.gelu(self.a(x))
        gx = torch.norm(y, p=2, dim=(1, 2), keepdim=True)
        nx = gx / (gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.b(self.gamma * (y * nx) + self.beta + y)


def test_global_response_normalisation_keeps_the_permutation_and_no_scale():
    subject = symgraph.load(noisy(GRNBlock()).double(), (torch.randn(2, 3, 3, D, dtype=torch.float64),))
    assert census(subject) == {"ffn permutation 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Codebook(nn.Module):
    """VQ-VAE: the nearest codebook entry by squared distance, straight through in eval."""

    def __init__(self):
        super().__init__()
        self.enc, self.pre = nn.Linear(D, H), nn.Linear(H, 4)
        self.codebook = nn.Embedding(6, 4)
        self.post = nn.Linear(4, D)

    def forward(self, x):
        z = self.pre(F.relu(self.enc(x)))
        d = z.pow(2).sum(-1, keepdim=True) - 2 * z @ self.codebook.weight.t() + self.codebook.weight.pow(2).sum(-1)
        q = self.codebook(d.argmin(-1))
        return self.post(z + (q - z).detach())


def test_a_codebook_searched_by_distance_keeps_the_rotations_of_its_space():
    """Control: distances and the entries picked are unchanged by a rotation of the code space applied to the
    encoder's rows, the codebook's columns and the decoder's columns."""
    subject = symgraph.load(noisy(Codebook()).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject).get("residual orthogonal 4x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)
