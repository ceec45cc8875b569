"""Llama 4's attention normalises q and k per head AFTER rotary, by a weightless L2 norm
(``x * rsqrt(mean(x^2) + eps)``). The factor was read as "a value that no transformation moves" and pinned q and k
(no QK, no heads group): a mixed (rotary) channel was never allowed to meet a per-row statistic. The reduction
resolves the rotary mixing and keeps only orthogonal maps, so the factor is one number per head and commutes with
them. A statistic over part of a head (or of x, not x^2) must still cost what it moves."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from example_scripts import example_module
from group_checks import assert_fuzzed_at_two_shapes, noisy
from symgraph.fuzz import fuzz

HEADS, DIM, WIDTH = 2, 8, 16


def rotate_half(x):
    return torch.cat((-x[..., DIM // 2:], x[..., :DIM // 2]), dim=-1)


class RotaryThenL2Norm(nn.Module):
    def __init__(self, stat: str):
        super().__init__()
        self.stat = stat
        self.q, self.k, self.v = (nn.Linear(WIDTH, HEADS * DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(HEADS * DIM, WIDTH, bias=False)

    def norm(self, x):
        if self.stat == "squares":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        if self.stat == "part":  # three of a head's dims: a rotation of a pair moves it
            return x * torch.rsqrt(x[..., :3].pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * torch.rsqrt(x.mean(-1, keepdim=True).abs() + 1e-6)  # not a sum of squares

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, DIM).transpose(1, 2) for m in (self.q, self.k, self.v))
        freqs = torch.arange(t, dtype=x.dtype)[:, None] * 10000 ** (-torch.arange(0, DIM, 2, dtype=x.dtype) / DIM)
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        q, k = self.norm(q * cos + rotate_half(q) * sin), self.norm(k * cos + rotate_half(k) * sin)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(b, t, HEADS * DIM))


def _subject(stat):
    return symgraph.load(noisy(RotaryThenL2Norm(stat)), (torch.randn(2, 5, WIDTH),))


def test_l2_norm_after_rotary_keeps_qk_and_heads():
    subject = _subject("squares")
    motifs = {g.motif: g for g in subject.report.groups}
    assert motifs["qk"].kind == "rotary" and "heads" in motifs
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("stat", ["part", "mean"])
def test_a_statistic_rotations_move_still_pins(stat):
    subject = _subject(stat)
    pinned = subject.report.pinned
    qk_pinned = any(set(p.params) & {"q.weight", "k.weight"} and p.node.startswith("pow") for p in pinned)
    assert qk_pinned or "qk" not in {g.motif for g in subject.report.groups}
    assert_fuzzed_at_two_shapes(subject)


def test_llama4_text_keeps_its_attention_groups():
    with example_module("sweep_architectures") as sweep:
        model, _ = sweep.build("llama4_text")
    subject = symgraph.load(model)
    attention = [g for g in subject.report.groups if g.motif in ("qk", "heads")]
    assert sorted({(g.motif, g.kind, g.scale) for g in attention}) == [("heads", "permutation", None),
                                                                       ("qk", "rotary", None)]  # no scale
    result = fuzz(subject, samples=3, groups=attention)
    assert result.ok, [v.counterexample for v in result.failures]
    assert len(set(result.shapes)) >= 2
