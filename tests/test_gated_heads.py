"""A per-head value that no transformation moves must not meet the heads' own coordinates (issue 10, WavLM).

WavLM gates head h's relative-position bias by ``sigmoid(sum(W x[h d:(h+1) d]))``: the gate is read from the
residual coordinates of head h's slice and summed, so the analysis sees it as invariant (no transformation moves
it), yet it differs from head to head. Permuting the heads (and the per-head bias with them) without the gate
changed the outputs (relative error 1.1e-5 in float64). Such a value must pin the head axis it varies along,
whether it multiplies the per-head bias or is added to it; a gate that is the same for every head must not.
"""
from __future__ import annotations

import pytest
import torch

import symgraph

from group_checks import assert_fuzzed_at_two_shapes

HEADS, WIDTH = 4, 16


class GatedBiasAttention(torch.nn.Module):
    """Self-attention whose additive per-head bias is combined with a gate computed from the input."""

    def __init__(self, combine: str, per_head_gate: bool):
        super().__init__()
        self.combine, self.per_head_gate = combine, per_head_gate
        self.inp, self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(5))
        self.bias = torch.nn.Parameter(torch.randn(HEADS, 1, 1))
        self.gate = torch.nn.Linear(WIDTH // HEADS, 4)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2)

    def forward(self, x):
        x = self.inp(x)
        b, n, _ = x.shape
        gate_input = self.split(x)  # (b, heads, n, d): head h's gate reads coordinates [h d, (h + 1) d)
        if not self.per_head_gate:
            gate_input = gate_input.mean(1, keepdim=True)  # one gate for every head
        gate = torch.sigmoid(self.gate(gate_input).sum(-1, keepdim=True))  # summed: invariant
        bias = gate * self.bias if self.combine == "mul" else gate + self.bias
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        mask = bias.expand(b, HEADS, n, n)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, WIDTH))


def load(combine: str, per_head_gate: bool):
    torch.manual_seed(0)
    return symgraph.load(GatedBiasAttention(combine, per_head_gate).eval(), (torch.randn(2, 5, WIDTH),))


def head_groups(subject):
    return [g for g in subject.report.groups if g.id.startswith("heads")]


@pytest.mark.parametrize("combine", ["mul", "add"])
def test_a_gate_that_differs_per_head_pins_the_head_permutation(combine):
    subject = load(combine, per_head_gate=True)
    assert not head_groups(subject), [g.id for g in head_groups(subject)]
    assert any(g.motif == "vo" for g in subject.report.groups)  # the per-head value maps do not need the order
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("combine", ["mul", "add"])
def test_a_gate_shared_by_every_head_keeps_the_head_permutation(combine):
    subject = load(combine, per_head_gate=False)
    heads = head_groups(subject)
    assert len(heads) == 1 and any(m.param == "bias" for m in heads[0].members), [g.id for g in heads]
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.slow
def test_wavlm_heads_stay_in_place_and_every_group_is_a_symmetry():
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model("wavlm", hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  num_hidden_layers=2, conv_dim=[16, 16], conv_kernel=[4, 2], conv_stride=[3, 2],
                                  num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, num_buckets=16,
                                  max_bucket_distance=32)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # gru_rel_pos_const starts at 1 everywhere: make every head's constant different
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    subject = symgraph.load(model)
    assert not head_groups(subject), [g.id for g in head_groups(subject)]
    assert any(g.motif == "vo" for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject, samples=3)
