"""A key/value cache that starts as torch's legacy 1-D empty tensor (``torch.cat([torch.tensor([]), k], dim=-2)``,
XLM and FlauBERT's cache update): the empty piece adds nothing, and the analysis goes on (it crashed with an
IndexError inside the movement rule, issue 10)."""
from __future__ import annotations

import torch

import symgraph

from group_checks import assert_fuzzed_at_two_shapes

HEADS, WIDTH = 4, 16


class EmptyCacheAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2)

    def forward(self, x):
        b, n, _ = x.shape
        empty = x.new_zeros(0)  # the cache before its first update: shape (0,), whatever the rank of k and v
        q = self.split(self.q(x))
        k = torch.cat([empty, self.split(self.k(x))], dim=-2)
        v = torch.cat([empty, self.split(self.v(x))], dim=-2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, n, WIDTH))


def test_an_empty_legacy_cache_piece_adds_nothing_to_the_concatenation():
    torch.manual_seed(0)
    subject = symgraph.load(EmptyCacheAttention().eval(), (torch.randn(2, 5, WIDTH),))
    motifs = {g.motif for g in subject.report.groups}
    assert {"heads", "qk", "vo"} <= motifs, motifs
    assert_fuzzed_at_two_shapes(subject)
