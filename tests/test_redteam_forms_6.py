"""Hand-written forms a sixth soundness pass tried: each one fuzzed in float64 at two input shapes, beside a
control that keeps the group the fixed form must not lose."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 8, 12


class Cast(nn.Module):
    """``Linear -> cast -> Linear``: nothing between the layers but a round trip through another float type."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.b(self.a(x).to(self.dtype).to(x.dtype))


def cast_subject(dtype):
    return symgraph.load(noisy(Cast(dtype)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_a_cast_to_half_precision_passes_orthogonal_maps_only(dtype):
    """The cast was an identity for every group: a general linear map of the 12 units went through bfloat16's
    rounding, which its condition number spread (relative change 9e-2, three times bfloat16's tolerance). An
    orthogonal map keeps the rounding errors' size, so the orthogonal group stays."""
    subject = cast_subject(dtype)
    assert census(subject) == {"other orthogonal 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_bfloat16_llama_keeps_its_orthogonal_stream():
    """Every RMSNorm of a bfloat16 LLaMA computes in float32 and casts back: the casts must not cut the folded
    stream's O(D) down to permutations (the first version of the rule above restricted them to monomial maps)."""
    from symgraph import zoo

    model = zoo.build("llama", num_hidden_layers=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)  # folded
    model = model.to(torch.bfloat16)
    report = symgraph.load(model, zoo.example_inputs_for("llama", model)).report
    assert {g.kind for g in report.groups if g.motif == "residual"} == {"orthogonal"}


def test_a_cast_to_float32_keeps_the_general_linear_map():
    subject = cast_subject(torch.float32)
    assert census(subject) == {"other general_linear 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Rounded(nn.Module):
    """``Linear -> round -> Linear``, ``round`` a rounding of each unit (or a fake quantisation after a ReLU)."""

    def __init__(self, round_):
        super().__init__()
        self.round = round_
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.b(self.round(self.a(x)))


ROUNDINGS = {"fake quantised after a relu": (lambda h: torch.clamp(torch.round(torch.relu(h) / 0.1), -128, 127) * 0.1,
                                             "ffn permutation 12x1"),
             "rounded": (lambda h: torch.round(h * 4) / 4, "ffn signed_permutation 12x1"),
             "truncated": (torch.trunc, "ffn signed_permutation 12x1"),
             "sign": (torch.sign, "ffn signed_permutation 12x1"),
             "floored": (lambda h: torch.floor(h * 4), "ffn permutation 12x1"),
             "remainder": (lambda h: torch.remainder(h, 0.7), "ffn permutation 12x1"),
             "relu6": (nn.functional.relu6, "ffn permutation 12x1")}


@pytest.mark.parametrize("round_, kind", ROUNDINGS.values(), ids=ROUNDINGS.keys())
def test_a_rounding_of_each_unit_keeps_their_permutation(round_, kind):
    """round, trunc, floor, sign, remainder and relu6 had no spec in specs/ops.yaml, so they pinned every unit (a
    fake quantisation of the hidden units left no group at all); each acts on every unit alike, so permutations
    pass, signs where the rounding is odd, and no scale passes the grid."""
    subject = symgraph.load(noisy(Rounded(round_)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == {kind: 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Paired(nn.Module):
    """``max(a(x), g(x)) -> Linear`` and kin: an elementwise max or min of two labelled tensors."""

    def __init__(self, pair):
        super().__init__()
        self.pair = pair
        self.a, self.g, self.b = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.b(self.pair(self, self.a(x), self.g(x)))


PAIRS = {"max of two layers": (lambda m, h, g: torch.maximum(h, g),
                               {"ffn permutation 12x1": 1, "experts permutation 2x1": 1}),
         "min of two layers": (lambda m, h, g: torch.min(h, g),
                               {"ffn permutation 12x1": 1, "experts permutation 2x1": 1}),
         "max over halves": (lambda m, h, g: torch.maximum(h[..., :6], h[..., 6:]).repeat(1, 1, 2),
                             {"ffn permutation 6x1": 1}),
         "max of a layer and a reversed one": (lambda m, h, g: torch.maximum(h, g.flip(-1)),
                                               {"ffn permutation 12x1": 1})}


@pytest.mark.parametrize("pair, kinds", PAIRS.values(), ids=PAIRS.keys())
def test_a_max_of_two_labelled_tensors_ties_their_coordinates(pair, kinds):
    """A second operand with labels was taken as a bound that differs per coordinate, so max(a(x), g(x)) (maxout
    of two layers) pinned every unit. Coordinate i of one meets coordinate i of the other only: tied as in add,
    they permute together (and the two layers may swap)."""
    subject = symgraph.load(noisy(Paired(pair)).double(),
                            (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == kinds, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_max_with_a_parameter_of_its_own_still_pins():
    subject = symgraph.load(noisy(Paired(lambda m, h, g: torch.maximum(h, m.b.weight[0].repeat(2)[:H]))).double(),
                            (torch.randn(2, 5, D, dtype=torch.float64),))
    assert not subject.report.groups, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class ExpertChoice(nn.Module):
    """Expert-choice routing written as a loop: expert ``e`` takes its ``capacities(n)[e]`` top tokens."""

    def __init__(self, capacities):
        super().__init__()
        self.capacities = capacities
        self.router = nn.Linear(D, 4, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 6), nn.ReLU(), nn.Linear(6, D)) for _ in range(4))

    def forward(self, x):
        scores, out = self.router(x).softmax(-1), torch.zeros_like(x)
        for e, (expert, capacity) in enumerate(zip(self.experts, self.capacities(x.shape[1]))):
            weight, tokens = scores[..., e].topk(capacity, -1)
            rows = tokens.unsqueeze(-1).expand(-1, -1, D)
            out = out.scatter_add(1, rows, expert(x.gather(1, rows)) * weight.unsqueeze(-1))
        return x + out


def expert_groups(capacities):
    subject = symgraph.load(noisy(ExpertChoice(capacities)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    return subject, sorted(g.size for g in subject.report.groups if g.motif == "experts")


def test_experts_whose_capacities_differ_at_other_lengths_are_not_swapped():
    """Capacities n // 2, n // 3, n // 2 and 1 are 2, 1, 2, 1 at the traced length 5: the unrolled branches of
    experts 1 and 3 were isomorphic there (the trace bakes the sizes in), and swapping them changed the outputs
    at length 13 (relative change 0.1). Branch sets are now compared in the graphs traced at the probe shapes."""
    subject, sizes = expert_groups(lambda n: [max(1, n // 2), max(1, n // 3), max(1, n // 2), 1])
    assert sizes == [2], census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_experts_of_one_capacity_keep_their_permutation():
    subject, sizes = expert_groups(lambda n: [max(1, n // 2)] * 4)
    assert sizes == [4], census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Windowed(nn.Module):
    """Two heads of causal attention, head ``h`` seeing the last ``windows(n)[h]`` tokens."""

    def __init__(self, windows):
        super().__init__()
        self.windows = windows
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        i = torch.arange(n)
        back = (i[:, None] - i[None, :]).expand(2, n, n)
        window = torch.tensor(self.windows(n)).view(2, 1, 1)
        mask = (back >= 0) & (back < window)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(out.transpose(1, 2).reshape(b, n, D))


def windowed_subject(windows):
    return symgraph.load(noisy(Windowed(windows)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("windows", [lambda n: [8, 16], lambda n: [min(n, 8), min(n, 16)]], ids=["list", "min"])
def test_heads_whose_windows_differ_only_beyond_the_traced_length_are_not_permuted(windows):
    """Windows of 8 and 16 tokens are both the whole input at the traced length 5: the mask is the same for both
    heads there, and the heads permutation it allows changed the outputs at length 13 (relative change 0.1).
    Data computed from the input's size alone that the trace holds constant along a channel's axis is now
    compared with the graphs traced at the probe shapes, and forgotten where it varies there."""
    subject = windowed_subject(windows)
    assert not [g for g in subject.report.groups if g.motif == "heads"], census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_heads_of_one_window_keep_their_permutation():
    subject = windowed_subject(lambda n: [3, 3])
    assert census(subject).get("heads permutation 2x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Sink(nn.Module):
    """Two heads whose softmax also takes one learned logit per head (an attention sink), with a learned lambda
    subtracting a second softmax (differential attention) where ``differential``."""

    def __init__(self, differential: bool):
        super().__init__()
        self.differential = differential
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.sink, self.lam = nn.Parameter(torch.randn(2)), nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, 2, 4).transpose(1, 2) for p in (self.q, self.k, self.v))
        s = q @ k.transpose(-1, -2) / 2
        p = torch.cat([s, self.sink.view(1, 2, 1, 1).expand(b, 2, n, 1)], -1).softmax(-1)[..., :-1]
        if self.differential:
            p = p - self.lam * (s / 3).softmax(-1)
        return x + self.o((p @ v).transpose(1, 2).reshape(b, n, D))


@pytest.mark.parametrize("differential", [False, True], ids=["sink", "sink and differential"])
def test_heads_with_a_sink_logit_keep_their_groups(differential):
    subject = symgraph.load(noisy(Sink(differential)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    kinds = census(subject)
    assert kinds.get("vo orthogonal 4x2") == 1 and kinds.get("qk orthogonal 4x2") == 1, kinds
    assert_fuzzed_at_two_shapes(subject)


class SizeMasked(nn.Module):
    """``Linear -> ReLU -> * mask(n) -> Linear``, a 0/1 mask over the units computed from the input's length."""

    def __init__(self, mask):
        super().__init__()
        self.mask = mask
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.mask(x.shape[1]).to(x.dtype))


def test_units_masked_by_the_length_beyond_the_traced_one_are_not_permuted():
    """``arange(12) < n + 7`` keeps every unit at the traced length 5, but only 8 at length 1: a permutation of
    all 12 units changed the outputs there (relative change 6e-2)."""
    subject = symgraph.load(noisy(SizeMasked(lambda n: torch.arange(H) < n + 7)).double(),
                            (torch.randn(2, 5, D, dtype=torch.float64),))
    assert not subject.report.groups, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_units_masked_alike_at_every_probe_length_keep_their_permutation():
    subject = symgraph.load(noisy(SizeMasked(lambda n: torch.arange(H) < n + 70)).double(),
                            (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)
