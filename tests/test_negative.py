"""The checker is not vacuous: a transformation just outside each detected group breaks invariance.

Each test takes a real detected group, widens it by one step (a generic rotation where only RoPE's commutant is
allowed, a scale where only a permutation is, one rotation mixing two heads, ...) and asserts that fuzzing finds
a counterexample and shrinks it.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import symgraph
from symgraph.fuzz import fuzz
from symgraph.groups import Group, Member


def violated(subject, group: Group) -> str:
    result = fuzz(subject, groups=[group], samples=25, seed=3)
    assert not result.ok, f"{group.id} should break invariance"
    return result.failures[0].counterexample


def first(subject, **where) -> Group:
    return next(g for g in subject.report.groups if all(getattr(g, k) == v for k, v in where.items()))


def test_generic_rotation_on_a_rope_model_breaks_it(zoo_subject):
    subject = zoo_subject("llama")
    rotary = first(subject, kind="rotary")
    assert "relative output change" in violated(subject, dataclasses.replace(rotary, kind="orthogonal"))


def test_scaling_a_gelu_unit_breaks_it(zoo_subject):
    subject = zoo_subject("bert")
    ffn = first(subject, motif="ffn", kind="permutation", size=64)
    violated(subject, dataclasses.replace(ffn, scale="positive"))


def test_sign_flips_on_gelu_units_break_it(zoo_subject):
    subject = zoo_subject("bert")
    ffn = first(subject, motif="ffn", kind="permutation", size=64)
    violated(subject, dataclasses.replace(ffn, kind="signed_permutation"))


def test_one_qk_rotation_across_two_heads_breaks_it(zoo_subject):
    subject = zoo_subject("bert")
    qk = first(subject, motif="qk", kind="orthogonal")
    # heads 0 and 1 as one block of 2 * d_head coordinates: a rotation may now mix them
    members = tuple(Member(m.param, m.axis, m.index[:2].reshape(1, -1, m.index.shape[2]), m.action)
                    for m in qk.members)
    merged = dataclasses.replace(qk, size=2 * qk.size, copies=1, members=members)
    violated(subject, merged)


def test_per_coordinate_signs_on_a_layernorm_residual_break_it(zoo_subject):
    subject = zoo_subject("gpt2")
    residual = first(subject, motif="residual")
    assert residual.global_sign
    violated(subject, dataclasses.replace(residual, kind="signed_permutation", global_sign=False))


def test_orthogonal_residual_with_unfolded_rmsnorm_weights_breaks_it(zoo_subject):
    subject = zoo_subject("llama")
    residual = first(subject, motif="residual")
    members = tuple(dataclasses.replace(m, action="primal" if m.action == "permute" else m.action)
                    for m in residual.members)  # a rotation cannot pass the elementwise norm weight
    violated(subject, dataclasses.replace(residual, kind="orthogonal", members=members))


def test_scaling_the_swiglu_gate_breaks_it(zoo_subject):
    subject = zoo_subject("llama")
    scale = first(subject, motif="ffn", kind="scale")
    members = tuple(dataclasses.replace(m, param=m.param.replace("up_proj", "gate_proj")) for m in scale.members)
    violated(subject, dataclasses.replace(scale, members=members))


def test_permuting_alibi_like_data_is_pinned_not_emitted():
    import torch

    class Biased(torch.nn.Module):
        """Attention whose scores get a fixed per-head bias buffer (ALiBi-like): heads must not move."""

        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))
            self.register_buffer("slopes", torch.arange(1, 5, dtype=torch.float32).reshape(1, 4, 1, 1))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (p(x).view(b, n, 4, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
            bias = self.slopes * torch.arange(n, dtype=x.dtype).reshape(1, 1, 1, n)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            return self.o(out.transpose(1, 2).reshape(b, n, 16))

    report = symgraph.analyze(Biased(), inputs=(torch.randn(2, 5, 16),))
    assert not [g for g in report.groups if g.motif == "heads"]
    assert [g for g in report.groups if g.motif == "qk"]  # per-head rotations are still fine
    assert np.all([g.copies == 4 for g in report.groups if g.motif in ("qk", "vo")])
