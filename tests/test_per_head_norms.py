"""Per-head query/key norms as one module per head (StableLM's ``torch.split`` into heads, a LayerNorm per head,
``torch.cat``), and the report's account of the parameters no group moves."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.render import to_markdown


class Attn(nn.Module):
    """Attention with q/k LayerNorms, one for all heads or one per head, and rotate_half RoPE on ``r`` dims."""

    def __init__(self, per_head: bool, r: int = 4, d: int = 16, h: int = 2):
        super().__init__()
        self.h, self.dh, self.per_head, self.r = h, d // h, per_head, r
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        n = h if per_head else 1
        self.qn = nn.ModuleList(nn.LayerNorm(self.dh, bias=False) for _ in range(n))
        self.kn = nn.ModuleList(nn.LayerNorm(self.dh, bias=False) for _ in range(n))
        for m in [*self.qn, *self.kn]:
            nn.init.normal_(m.weight)
        ang = torch.outer(torch.arange(5).float(), 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r)))
        emb = torch.cat([ang, ang], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def norm(self, x, norms):
        if not self.per_head:
            return norms[0](x)
        return torch.cat([n(s) for n, s in zip(norms, torch.split(x, 1, dim=1))], dim=1)

    def rope(self, x):
        if not self.r:
            return x
        rot, rest = x[..., :self.r], x[..., self.r:]
        a, b = rot[..., :self.r // 2], rot[..., self.r // 2:]
        return torch.cat([rot * self.cos + torch.cat([-b, a], -1) * self.sin, rest], -1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.dh).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.rope(self.norm(q, self.qn)), self.rope(self.norm(k, self.kn))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


def _report(model):
    torch.manual_seed(0)
    return symgraph.analyze(model, inputs=(torch.randn(2, 5, 16),))


def test_parameters_in_no_group_are_listed_with_a_reason():
    torch.manual_seed(0)
    report = _report(Attn(per_head=True))
    in_groups = {p for g in report.groups for p in g.params}
    pinned = {p for s in report.pinned for p in s.params}
    missing = sorted(set(report.parameters) - in_groups - pinned)
    assert missing == ["k.bias", "kn.0.weight", "kn.1.weight", "q.bias", "qn.0.weight", "qn.1.weight"]
    unmoved = json.loads(report.dumps())["unmoved"]
    assert [u["param"] for u in unmoved] == missing
    assert all("rotary pairs" in u["reason"] and "norm weight" in u["reason"] for u in unmoved)
    md = to_markdown(report)
    assert "## In no group" in md and "| in no group and not pinned | 6 tensors" in md
    assert all(f"| `{p}` | rotary pairs" in md for p in missing)


def test_a_model_with_every_parameter_covered_lists_none():
    report = _report(Attn(per_head=False, r=0))
    assert json.loads(report.dumps())["unmoved"] == []
    assert "In no group" not in to_markdown(report)
