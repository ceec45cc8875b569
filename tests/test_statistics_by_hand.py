"""Norms, softmaxes and gates written out by hand: a LayerNorm from ``x.var`` / ``x.std`` / ``var_mean``, a softmax
from ``amax`` / ``max`` / ``logsumexp`` and a division, ``F.glu``, and divisions by channels (per-head temperatures,
row-normalised weights, a cosine classifier). Those ops had no spec, or a division by a channel pinned both sides,
so such models lost their residual, head or FFN groups; each test fails without its rule. Every emitted group is
fuzzed in float64 at two input shapes."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.zoo import _perturb

from group_checks import assert_fuzzed_at_two_shapes

V, D, H, DH, FF = 30, 12, 3, 4, 20


def token_ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


def hand_norm(kind: str, x, gain, bias):
    mu = x.mean(-1, keepdim=True)
    if kind == "var":
        return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5) * gain + bias
    if kind == "std":  # the Annotated Transformer's: unbiased std, eps outside the root
        return gain * (x - mu) / (x.std(-1, keepdim=True) + 1e-6) + bias
    if kind == "var_mean":
        var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
        return (x - mean) * torch.rsqrt(var + 1e-5) * gain + bias
    if kind == "absmax":  # the stream scaled by its largest magnitude
        return x / (x.abs().amax(-1, keepdim=True) + 1e-5) * gain + bias
    raise ValueError(kind)


def hand_softmax(kind: str, s):
    if kind == "amax":
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    if kind == "max":
        e = torch.exp(s - s.max(-1, keepdim=True).values)
        return e / e.sum(-1, keepdim=True)
    if kind == "logsumexp":
        return torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
    return s.softmax(-1)


class Block(nn.Module):
    def __init__(self, norm, softmax, ffn, temperature):
        super().__init__()
        self.norm, self.softmax, self.ffn, self.temperature = norm, softmax, ffn, temperature
        self.g1, self.b1, self.g2, self.b2 = (nn.Parameter(torch.full((D,), float(k % 2 == 0))) for k in range(4))
        self.qkv, self.o = nn.Linear(D, 3 * H * DH), nn.Linear(H * DH, D)
        self.up, self.down = nn.Linear(D, 2 * FF if ffn == "glu" else FF), nn.Linear(FF, D)
        self.temp = nn.Parameter(torch.rand(H, 1, 1) + 0.5)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(hand_norm(self.norm, x, self.g1, self.b1)).view(b, n, 3, H, DH).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(DH)
        if self.temperature:
            s = s / self.temp
        a = hand_softmax(self.softmax, s)
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, n, H * DH))
        u = self.up(hand_norm(self.norm, x, self.g2, self.b2))
        return x + self.down(F.glu(u, -1) if self.ffn == "glu" else F.gelu(u))


class HandWritten(nn.Module):
    """A two-block pre-norm LM whose norm, softmax and FFN gate are written out by hand."""

    def __init__(self, norm="var", softmax="builtin", ffn="gelu", temperature=False):
        super().__init__()
        self.norm = norm
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(norm, softmax, ffn, temperature) for _ in range(2))
        self.gain, self.bias = nn.Parameter(torch.ones(D)), nn.Parameter(torch.zeros(D))
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(hand_norm(self.norm, x, self.gain, self.bias))


def subject_of(model: nn.Module):
    torch.manual_seed(0)
    model = model.eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return symgraph.load(model, (token_ids(2, 7),))


def motifs(subject) -> dict[tuple[str, str], int]:
    counts: dict[tuple[str, str], int] = {}
    for g in subject.report.groups:
        counts[g.motif, g.kind] = counts.get((g.motif, g.kind), 0) + 1
    return counts


@pytest.mark.parametrize("norm", ["var", "std", "var_mean", "absmax"])
def test_a_layer_norm_written_by_hand_keeps_the_residual_permutation(norm):
    subject = subject_of(HandWritten(norm=norm))
    assert not subject.report.unknown_ops
    found = motifs(subject)
    # the statistics see the stream's coordinates in any order, and nothing more: permutations, no scales; the
    # largest magnitude does not see their signs either
    assert found.get(("residual", "signed_permutation" if norm == "absmax" else "permutation")) == 1, found
    assert found.get(("ffn", "permutation")) == 2, found  # the abs of a statistic does not make the stream an FFN
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("softmax", ["amax", "max", "logsumexp"])
def test_a_softmax_written_by_hand_keeps_heads_and_their_value_maps(softmax):
    subject = subject_of(HandWritten(softmax=softmax))
    assert not subject.report.unknown_ops
    found = motifs(subject)
    assert found.get(("heads", "permutation")) == 2, found
    assert found.get(("vo", "orthogonal")) == 2 and found.get(("qk", "orthogonal")) == 2, found
    assert_fuzzed_at_two_shapes(subject)


def test_glu_units_permute_in_pairs():
    subject = subject_of(HandWritten(ffn="glu"))
    ffn = [g for g in subject.report.groups if g.motif == "ffn"]
    assert len(ffn) == 2 and all(g.kind == "permutation" and g.size == FF for g in ffn)
    # the up projection's rows of both halves move: unit i with unit i + FF
    assert all(any(m.param.endswith("up.weight") for m in g.members) for g in ffn)
    assert_fuzzed_at_two_shapes(subject)


def test_per_head_temperatures_move_with_their_heads():
    subject = subject_of(HandWritten(temperature=True))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert len(heads) == 2 and all(any(p.endswith("temp") for p in g.params) for g in heads)
    assert_fuzzed_at_two_shapes(subject)


class Divisions(nn.Module):
    """An FFN through row- or column-normalised weights, or a ratio of two activations, and a cosine classifier."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, D)
        self.w = nn.Parameter(torch.rand(FF, D) + 0.5)
        self.up, self.gate, self.down = nn.Linear(D, FF), nn.Linear(D, FF), nn.Linear(FF, D)
        self.classes = nn.Parameter(torch.randn(5, D))

    def forward(self, ids):
        x = self.emb(ids)
        if self.kind == "columns":  # each unit's weights sum to 1
            u = torch.relu(x @ (self.w / self.w.sum(1, keepdim=True)).T)
        else:  # a value divided by its gate's activation
            u = self.up(x) / (1 + self.gate(x).exp())
        x = x + self.down(u)
        return F.normalize(x, dim=-1) @ F.normalize(self.classes, dim=-1).T


@pytest.mark.parametrize("kind, stream", [("columns", "permutation"), ("ratio", "orthogonal")])
def test_divisions_by_channels_keep_permutations(kind, stream):
    subject = subject_of(Divisions(kind))
    found = motifs(subject)
    assert found.get(("ffn", "permutation")) == 1, found
    # the cosine classifier: unit vectors on both sides, so the stream may rotate, unless a weight row's sum
    # over the stream's coordinates must stay (columns)
    assert found.get(("residual", stream)) == 1, found
    assert_fuzzed_at_two_shapes(subject)


class SquaredStatistic(nn.Module):
    """The spread of the squared units scales them: a sum of squares would pass rotations, a variance must not."""

    def __init__(self, statistic: str):
        super().__init__()
        self.statistic = statistic
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 3)

    def forward(self, x):
        h = self.up(x)
        sq = h * h
        spread = sq.var(-1, keepdim=True) if self.statistic == "var" else sq.amax(-1, keepdim=True)
        return self.down(h / (1 + spread))


@pytest.mark.parametrize("statistic", ["var", "amax"])
def test_statistics_of_squares_pass_permutations_only(statistic):
    torch.manual_seed(0)
    subject = symgraph.load(SquaredStatistic(statistic).eval(), (torch.randn(2, 5, 6),))
    on_units = [g for g in subject.report.groups if "up.weight" in g.params]
    assert [g.kind for g in on_units] == ["permutation"]
    assert_fuzzed_at_two_shapes(subject)


class Piecewise(nn.Module):
    """An FFN whose activation is chosen per element by a comparison: of the unit's own value (a leaky ReLU or a
    ReLU by hand), or of something that differs per unit (a learned threshold per unit, another activation)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, D)
        self.up, self.gate, self.down = nn.Linear(D, FF), nn.Linear(D, FF), nn.Linear(FF, D)
        self.threshold = nn.Parameter(torch.randn(FF) * 0.1)
        self.alpha = nn.Parameter(torch.tensor([0.8]))  # xIELU's learned coefficients: one number for every unit
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        h = self.up(x)
        if self.kind == "leaky":
            u = torch.where(h > 0, h, 0.01 * h)
        elif self.kind == "xielu":  # transformers' XIELUActivation (Apertus), its Python form
            a = F.softplus(self.alpha)
            negative = (torch.expm1(torch.min(h, torch.tensor(-1e-6))) - h) * a + 0.5 * h
            u = torch.where(h > 0, a * h * h + 0.5 * h, negative)
        elif self.kind == "gated":  # chosen by another unit's sign: the two must move together
            u = torch.where(self.gate(x) > 0, h, 0.0)
        elif self.kind == "masked":
            u = h.masked_fill(h < 0, 0.0)
        elif self.kind == "threshold":  # a learned bound per unit: it moves with them
            u = torch.maximum(h, self.threshold)
        elif self.kind == "fixed threshold":  # a bound per unit that nothing moves
            u = torch.maximum(h, torch.linspace(-0.1, 0.1, FF, dtype=h.dtype))
        elif self.kind == "above threshold":  # kept above a learned threshold per unit, else 0
            u = torch.where(h > self.threshold, h, 0.0)
        elif self.kind == "above fixed threshold":
            u = torch.where(h > torch.linspace(-0.1, 0.1, FF, dtype=h.dtype), h, 0.0)
        else:  # the larger of two activations
            u = torch.maximum(h, self.gate(x))
        return self.head(x + self.down(u))


@pytest.mark.parametrize("kind", ["leaky", "masked", "xielu", "gated"])
def test_an_activation_chosen_by_a_units_value_keeps_its_unit_permutation(kind):
    # xielu: the branches' products with a parameter give the chosen values labels of their own, and the condition
    # was read as one on other coordinates, which pinned the units (Apertus had no FFN group); gated: the gate's
    # units now move with the ones they choose
    subject = subject_of(Piecewise(kind))
    assert not subject.report.unknown_ops
    ffn = [g for g in subject.report.groups if g.motif == "ffn"]
    assert [(g.kind, g.size) for g in ffn] == [("permutation", FF)]
    moved = {m.param for m in ffn[0].members if m.axis == 0}
    assert {"up.weight"} <= moved and ("gate.weight" in moved) == (kind == "gated")
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("kind", ["fixed threshold", "above fixed threshold"])
def test_a_bound_that_differs_per_unit_pins_the_units(kind):
    subject = subject_of(Piecewise(kind))
    assert not any(getattr(m, "param", None) == "up.weight" and m.axis == 0
                   for g in subject.report.groups for m in g.members)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("kind, bound", [("threshold", "threshold"), ("other", "gate.weight"),
                                         ("above threshold", "threshold")])
def test_a_labelled_bound_per_unit_moves_with_the_units(kind, bound):
    """max(up(x), t) with t a learned threshold per unit or another layer's units, or where(up(x) > t, up(x), 0):
    unit i meets t's entry i only, so the two permute together (they used to pin)."""
    subject = subject_of(Piecewise(kind))
    ffn = [g for g in subject.report.groups if g.motif == "ffn"]
    assert [(g.kind, g.size) for g in ffn] == [("permutation", FF)], [g.id for g in subject.report.groups]
    assert {"up.weight", bound} <= set(ffn[0].params)
    assert_fuzzed_at_two_shapes(subject)


class WeightNormed(nn.Module):
    """nn.utils weight norm on a linear (one g per output row) and on a convolution over positions (one g per tap,
    as wav2vec2's positional convolution)."""

    def __init__(self):
        super().__init__()
        from torch.nn.utils.parametrizations import weight_norm
        self.emb = nn.Embedding(V, D)
        self.up = weight_norm(nn.Linear(D, FF), dim=0)
        self.down = nn.Linear(FF, D)
        self.conv = weight_norm(nn.Conv1d(D, D, 3, padding=1), dim=2)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + F.gelu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_weight_norm_rows_move_with_their_scales():
    subject = subject_of(WeightNormed())
    assert not subject.report.unknown_ops
    v, g_ = "up.parametrizations.weight.original1", "up.parametrizations.weight.original0"
    units = [g for g in subject.report.groups if any(m.param == v and m.axis == 0 for m in g.members)]
    assert len(units) == 1 and units[0].kind == "permutation" and units[0].size == FF
    assert {v, g_} <= set(units[0].params)
    # the convolution's channels (the stream) stay free too: normalised per tap, they pass permutations
    assert any(any("conv.parametrizations" in p for p in g.params) for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)
