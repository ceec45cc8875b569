"""Hand-written forms a fifth soundness pass tried: each one fuzzed in float64 at two input shapes, beside a
control that keeps the group the fixed form must not lose."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 8, 12


def shift(h):
    """Each token gets the previous token's values (RWKV's token shift), the first token zeros."""
    return F.pad(h, (0, 0, 1, -1))


class Halves(nn.Module):
    """``Linear -> ReLU -> cat([f(h)[..., :6], h[..., 6:]]) -> Linear``: ``f`` applied to the whole tensor before
    the cut."""

    def __init__(self, treat):
        super().__init__()
        self.treat = treat
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(torch.cat([self.treat(h)[..., :6], h[..., 6:]], -1))


TREATED_BEFORE_THE_CUT = {"doubled": lambda h: 2 * h, "token shift": shift,
                          "rolled along tokens": lambda h: h.roll(1, -2), "flipped along tokens": lambda h: h.flip(-2),
                          "cumsum along tokens": lambda h: h.cumsum(-2)}


def halves_subject(treat):
    return symgraph.load(noisy(Halves(treat)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("treat", TREATED_BEFORE_THE_CUT.values(), ids=TREATED_BEFORE_THE_CUT.keys())
def test_units_treated_before_the_cut_are_not_permuted_with_the_rest(treat):
    """The pieces were compared only when both were cut from one tensor: here the cuts read ``f(h)`` and ``h``,
    which carry the same coordinates, and one permutation of all 12 units moved units into the other piece
    (relative change 0.3-1.5; a token shift of some units is RWKV's time mix with a fixed split)."""
    subject = halves_subject(treat)
    assert max((g.size for g in subject.report.groups), default=0) <= 6, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_units_cut_from_one_tensor_and_joined_alike_keep_one_permutation():
    subject = halves_subject(lambda h: h)
    assert census(subject) == {"ffn permutation/positive 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class MaskedShift(nn.Module):
    """``Linear -> ReLU -> shift(h) * m + h * (1 - m) -> Linear`` with a fixed 0/1 vector ``m`` over the units: the
    first ``shifted`` units read the previous token, the rest their own (a token shift of some units, by mask)."""

    def __init__(self, shifted: int):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.register_buffer("mask", (torch.arange(H) < shifted).double())

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(shift(h) * self.mask + h * (1 - self.mask))


def test_units_mixed_from_shifted_and_unshifted_values_keep_to_their_mask():
    """The terms of the sum were added up coordinate by coordinate, ``m + (1 - m) = 1`` for every unit, as if both
    read one tensor: one permutation of all 12 units moved shifted units among unshifted ones (relative change
    0.4-1.0). Each term's map now has to commute on its own, so units keep to the ones masked alike."""
    subject = symgraph.load(noisy(MaskedShift(6)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == {"ffn permutation/positive 6x2": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)
