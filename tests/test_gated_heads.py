"""A per-head value that no transformation moves must not meet the heads' own coordinates (issue 10, WavLM).

WavLM gates head h's relative-position bias by ``sigmoid(sum(W x[h d:(h+1) d]))``: the gate is read from the
residual coordinates of head h's slice and summed, so the analysis sees it as invariant (no transformation moves
it), yet it differs from head to head. Permuting the heads (and the per-head bias with them) without the gate
changed the outputs (relative error 1.1e-5 in float64). Such a value must pin the head axis it varies along,
whether it multiplies the per-head bias or is added to it; a gate that is the same for every head, or one reduced
from the heads' own rows (a per-head q/k norm, Qwen3), must not.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import symgraph

from cli_runner import assert_fuzzed, report_json
from group_checks import assert_fuzzed_at_two_shapes

HEADS, WIDTH = 4, 16


class GatedBiasAttention(torch.nn.Module):
    """Self-attention whose additive per-head bias is combined with a per-head gate.

    ``gate``: ``"residual"`` reads head h's gate from the input's coordinates [h d, (h + 1) d) (WavLM);
    ``"shared"`` averages that over the heads first. ``"own"`` leaves the bias alone and scales head h's queries
    by their own inverse norm (a q-norm, which moves with the heads); ``"own-flipped"`` by head H - 1 - h's."""

    def __init__(self, combine: str, gate: str):
        super().__init__()
        self.combine, self.gate_kind = combine, gate
        self.inp, self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(5))
        self.bias = torch.nn.Parameter(torch.randn(HEADS, 1, 1))
        self.gate = torch.nn.Linear(WIDTH // HEADS, 4)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2)

    def gate_of(self, x):
        gate_input = self.split(x)  # (b, heads, n, d): head h's gate reads coordinates [h d, (h + 1) d)
        if self.gate_kind == "shared":
            gate_input = gate_input.mean(1, keepdim=True)  # one gate for every head
        return torch.sigmoid(self.gate(gate_input).sum(-1, keepdim=True))  # summed: invariant

    def forward(self, x):
        x = self.inp(x)
        b, n, _ = x.shape
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        if self.gate_kind in ("own", "own-flipped"):
            norm = torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6)  # (b, heads, n, 1): invariant per head
            q, bias = q * (norm.flip(1) if self.gate_kind == "own-flipped" else norm), self.bias
        else:
            gate = self.gate_of(x)
            bias = gate * self.bias if self.combine == "mul" else gate + self.bias
        mask = bias.expand(b, HEADS, n, n)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(out.transpose(1, 2).reshape(b, n, WIDTH))


def load(combine: str, gate: str):
    torch.manual_seed(0)
    return symgraph.load(GatedBiasAttention(combine, gate).eval(), (torch.randn(2, 5, WIDTH),))


def head_groups(subject):
    return [g for g in subject.report.groups if g.id.startswith("heads")]


@pytest.mark.parametrize("combine,gate", [("mul", "residual"), ("add", "residual"), ("mul", "own-flipped")])
def test_a_gate_that_differs_per_head_pins_the_head_permutation(combine, gate):
    subject = load(combine, gate)
    assert not head_groups(subject), [g.id for g in head_groups(subject)]
    if gate == "residual":  # the per-head value maps do not need the heads' order
        assert any(g.motif == "vo" for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("combine,gate", [("mul", "shared"), ("add", "shared"), ("mul", "own")])
def test_a_gate_shared_by_every_head_or_moving_with_them_keeps_the_head_permutation(combine, gate):
    subject = load(combine, gate)
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


def test_cli_report_and_fuzz_leave_the_heads_of_a_residual_gate_in_place(tmp_path):
    factory = tmp_path / "gated.py"
    factory.write_text(f"import torch\n\nHEADS, WIDTH = {HEADS}, {WIDTH}\n\n\n{inspect.getsource(GatedBiasAttention)}"
                       "\n\ndef gated():\n    torch.manual_seed(0)\n"
                       "    return GatedBiasAttention('mul', 'residual').eval(), (torch.randn(2, 5, WIDTH),)\n")
    motifs = [g["motif"] for g in report_json(f"{factory}:gated")["groups"]]
    assert "vo" in motifs and "heads" not in motifs, motifs
    assert_fuzzed(f"{factory}:gated", tmp_path)
