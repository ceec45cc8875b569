"""Manifold-constrained hyper-connections (mHC: DeepSeek-V4, GLM-5-Next): the residual stream held as N copies.

Each block reads its input as a weighted sum of the N streams and writes ``post[n] * out + (comb^T @ streams)[n]``,
with ``pre``, ``post`` and ``comb`` computed by one linear map of all N streams flattened (N * D columns) after an
unweighted RMSNorm. A map of the D coordinates, the same in every stream, is a symmetry: the norm over N * D and
the mixing over N do not see it, and the flattened linear's columns absorb it block by block.

The stream coefficients (``post``, one per stream) are pinned where they are added to the mixed streams, yet they
were carried on inside the sum: flattened with the stream's own coordinates into one axis, the two channels met in
the next layer's linear, which pinned the whole residual stream ("contracted with data that carries no
symmetry"). A pinned channel no longer rides on in a sum (``rules._add_data``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

STREAMS, WIDTH, VOCAB = 3, 8, 11


class HyperConnection(nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = nn.Parameter(torch.randn((2 + STREAMS) * STREAMS, STREAMS * WIDTH) * 0.3)
        self.base = nn.Parameter(torch.randn((2 + STREAMS) * STREAMS))
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, streams):
        batch, length = streams.shape[:2]
        flat = streams.view(batch, length, -1)
        flat = F.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6), self.fn)
        pre_w, post_w, comb_w = flat.split([STREAMS, STREAMS, STREAMS * STREAMS], dim=-1)
        pre_b, post_b, comb_b = self.base.split([STREAMS, STREAMS, STREAMS * STREAMS])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b)
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(batch, length, STREAMS, STREAMS) * comb_s + comb_b.view(STREAMS, STREAMS),
                             dim=-1)
        for _ in range(2):  # Sinkhorn-Knopp towards a doubly stochastic mixing
            comb = comb / comb.sum(dim=-2, keepdim=True)
            comb = comb / comb.sum(dim=-1, keepdim=True)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.hc, self.norm = HyperConnection(), nn.RMSNorm(WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 16, bias=False), nn.Linear(16, WIDTH, bias=False)

    def forward(self, streams):
        post, comb, h = self.hc(streams)
        h = self.down(F.silu(self.up(self.norm(h))))
        return post.unsqueeze(-1) * h.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)


class HyperConnected(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(VOCAB, WIDTH), nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids):
        streams = self.embed(ids).unsqueeze(2).expand(-1, -1, STREAMS, -1).contiguous()
        for block in self.blocks:
            streams = block(streams)
        return self.head(self.norm(streams.mean(dim=2)))


def test_the_stream_coordinates_shared_by_every_copy_form_the_residual_group():
    torch.manual_seed(0)
    model = noisy(HyperConnected(), 0.1).double()
    subject = symgraph.load(model, (torch.randint(0, VOCAB, (2, 7)),))
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert [(g.kind, g.size) for g in residual] == [("signed_permutation", WIDTH)]
    columns = {m.param: m for m in residual[0].members if m.param.endswith("hc.fn")}
    assert set(columns) == {"blocks.0.hc.fn", "blocks.1.hc.fn"}
    # each flattened column block (one per stream) moves with the stream's coordinates
    assert all(m.axis == 1 and m.index.size == STREAMS * WIDTH for m in columns.values())
    assert_fuzzed_at_two_shapes(subject)


def test_the_stream_coefficients_stay_pinned():
    """Only one set of coefficients may move: the first block's ``pre`` weights, which meet N copies of one
    embedding (an expand along the stream axis, so the weighted sum cannot tell the copies apart); every later
    coefficient, and ``post`` and ``comb`` everywhere, meet streams that differ."""
    torch.manual_seed(0)
    model = noisy(HyperConnected(), 0.1).double()
    subject = symgraph.load(model, (torch.randint(0, VOCAB, (2, 7)),))
    moved = {(m.param, int(i)) for g in subject.report.groups for m in g.members if m.axis == 0 and ".hc." in m.param
             for i in m.index.flatten()}
    assert moved <= {(f"blocks.0.hc.{p}", i) for p in ("fn", "base") for i in range(STREAMS)}, sorted(moved)
    assert_fuzzed_at_two_shapes(subject)
