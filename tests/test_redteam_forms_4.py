"""Hand-written forms a fourth soundness pass tried: each one fuzzed in float64 at two input shapes, beside a
control that keeps the group the fixed form must not lose."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 8, 12


class Einsum(nn.Module):
    """``Linear -> ReLU -> einsum(equation, h, M) -> Linear``."""

    def __init__(self, equation: str, shape: tuple[int, ...]):
        super().__init__()
        self.equation = equation
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.m = nn.Parameter(torch.randn(*shape) / 3)

    def forward(self, x):
        return self.b(torch.einsum(self.equation, torch.relu(self.a(x)), self.m))


def einsum_subject(equation, shape):
    return symgraph.load(noisy(Einsum(equation, shape)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("equation, shape", [("...i,iij->...j", (H, H, H)), ("bti,iji->btj", (H, H, H)),
                                             ("...i,ii->...i", (H, H))], ids=["iij", "iji", "ii"])
def test_an_einsum_reading_a_diagonal_moves_nothing_it_reads(equation, shape):
    """A letter repeated in one operand reads only the diagonal ``M[i, i]``, which moves as row ``i`` and column
    ``i`` at once. The contraction took the two axes as independent: ``iij`` and ``iji`` permuted M's rows with
    ``a``'s units and left its columns (relative change 0.4-1.7), ``ii`` crashed on a permute of the labels."""
    subject = einsum_subject(equation, shape)
    assert not any("m" in g.params for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_an_einsum_with_distinct_letters_keeps_the_relu_units():
    subject = einsum_subject("...i,ij->...j", (H, H))
    assert census(subject).get("ffn permutation/positive 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class MatrixBias(nn.Module):
    """``addmm(bias, h, U)`` on the flattened ReLU units, the bias an (N, D) slice of them or a (1, D) parameter."""

    def __init__(self, bias: str):
        super().__init__()
        self.bias = bias
        self.a = nn.Linear(D, H)
        self.u = nn.Parameter(torch.randn(H, D) / 3)
        self.row = nn.Parameter(torch.randn(1, D))

    def forward(self, x):
        h = torch.relu(self.a(x)).reshape(-1, H)
        bias = h[:, :D] if self.bias == "units" else self.row
        return torch.addmm(bias, h, self.u).view(*x.shape[:-1], D)


@pytest.mark.parametrize("bias, kinds", [("units", {"ffn permutation/positive 4x1": 1}),
                                         ("row", {"ffn permutation/positive 12x1": 1})])
def test_an_addmm_with_a_matrix_bias_broadcasts_it_against_the_output(bias, kinds):
    """addmm's ``self`` may be 2-D; the rule gave it the spec's one bias letter and crashed on a permute."""
    subject = symgraph.load(noisy(MatrixBias(bias)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == kinds, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Flattened(nn.Module):
    """``Conv2d -> ReLU -> flatten -> form -> Linear``: the channels are moved with blocks of the Linear's columns."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.conv, self.fc, self.out = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4 * 36, 7), nn.Linear(7, 3)
        self.bias = nn.Parameter(torch.randn(4 * 36))

    def forward(self, x):
        h = torch.relu(self.conv(x))
        z, weight = h.flatten(1), self.fc.weight
        if self.form == "rolled":
            z = z.roll(5, 1)
        if self.form == "channels last, rolled":
            z = h.permute(0, 2, 3, 1).flatten(1).roll(3, 1)
        if self.form == "split across channels":
            z = h.reshape(-1, 6, 24).transpose(1, 2).flatten(1)
        if self.form == "weight rolled":
            weight = weight.roll(5, 1)
        if self.form == "bias rolled":
            z = z + self.bias.roll(3)
        if self.form == "weight vector rolled":
            z = z * self.bias.roll(3)
        if self.form == "norm weight rolled":
            z = nn.functional.layer_norm(z, (4 * 36,), self.bias.roll(3))
        if self.form == "cut off a channel's end, then joined":
            z = torch.cat([z[:, 3:], z[:, :3]], 1)
        if self.form == "halves swapped":
            z = torch.cat([z[:, 72:], z[:, :72]], 1)
        if self.form == "flipped":
            z = z.flip(1)
        if self.form == "channels last":
            z = h.permute(0, 2, 3, 1).flatten(1)
        if self.form == "bias added":
            z = z + self.bias
        return self.out(torch.relu(nn.functional.linear(z, weight, self.fc.bias)))


def flattened_subject(form):
    return symgraph.load(noisy(Flattened(form)).double(), (torch.randn(2, 3, 6, 6, dtype=torch.float64),))


@pytest.mark.parametrize("form", ["rolled", "channels last, rolled", "split across channels", "weight rolled",
                                  "bias rolled", "weight vector rolled", "norm weight rolled",
                                  "cut off a channel's end, then joined"])
def test_a_flattened_channel_whose_entries_change_order_moves_no_further(form):
    """A channel permutation moves a flattened channel's entries as one block, pairing the k-th entry of one channel
    with the k-th of another. A roll across the flattened axis (or a reshape splitting it off the channel
    boundary, then a transpose; a slice off a channel's boundary, then a cat) reorders one channel's entries unlike
    the others', as does a Linear weight, a bias or a weight vector rolled before it meets them: the conv's
    channels were permuted anyway (relative change 0.2-4.4)."""
    subject = flattened_subject(form)
    assert census(subject) == {"ffn permutation/positive 7x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["plain", "flipped", "channels last", "bias added", "halves swapped"])
def test_a_flattened_channel_read_in_one_order_keeps_its_permutation(form):
    subject = flattened_subject(form)
    assert census(subject) == {"ffn permutation/positive 4x1": 1, "ffn permutation/positive 7x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)
