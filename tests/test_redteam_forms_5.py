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


class Treated(nn.Module):
    """``up -> treat -> Linear``."""

    def __init__(self, up: nn.Module, treat):
        super().__init__()
        self.up, self.treat, self.down = up, treat, nn.Linear(H, D)

    def forward(self, x):
        return self.down(self.treat(self.up(x)))


def treated_subject(treat):
    return symgraph.load(noisy(Treated(nn.Sequential(nn.Linear(D, H), nn.ReLU()), treat)).double(),
                         (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("treat", [lambda h: torch.cat([h[..., :1] * 2, h[..., 1:]], -1),
                                   lambda h: torch.cat([(h * 2)[..., 0, None], h[..., 1:]], -1),
                                   lambda h: torch.cat([h[..., :-1], shift(h)[..., -1:]], -1)],
                         ids=["first doubled", "first picked and doubled", "last shifted"])
def test_a_unit_treated_alone_is_not_permuted_with_the_rest(treat):
    """A piece one unit wide has no channel varying along the joined axis, so it was left out of the pieces kept
    apart, and one permutation moved the treated unit among the others (relative change 0.3-0.9)."""
    subject = treated_subject(treat)
    assert census(subject) == {"ffn permutation/positive 1x1": 1, "ffn permutation/positive 11x1": 1}, \
        census(subject)
    assert_fuzzed_at_two_shapes(subject)


class HeadShifted(nn.Module):
    """Three heads of causal attention; with ``shift_first``, the first head's keys are those of the previous
    token (a token shift of one head, joined to the other heads' keys along the head axis)."""

    def __init__(self, shift_first: bool):
        super().__init__()
        self.shift_first = shift_first
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def heads(self, t):
        return t.unflatten(-1, (3, 4)).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        if self.shift_first:
            k = torch.cat([shift(k[:, :1]), k[:, 1:]], 1)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def test_a_head_treated_alone_is_not_permuted_with_the_others():
    """The one-head piece was left out likewise: a head permutation moved the shifted keys to another head's
    queries (relative change 0.5-0.6). The two heads treated alike still permute with each other."""
    subject = symgraph.load(noisy(HeadShifted(True)).double(), (torch.randn(2, 5, H, dtype=torch.float64),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert [g.size for g in heads] == [2], census(subject)
    assert {int(i) // 4 for m in heads[0].members if m.param == "k.weight" for i in m.index.reshape(-1)} == {1, 2}
    assert_fuzzed_at_two_shapes(subject)


def test_heads_treated_alike_keep_their_permutation():
    subject = symgraph.load(noisy(HeadShifted(False)).double(), (torch.randn(2, 5, H, dtype=torch.float64),))
    assert census(subject).get("heads permutation 3x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


STACKED = {"interleaved": lambda h: torch.stack([h[..., :6] * 2, h[..., 6:]], -1).flatten(-2),
           "shifted, side by side": lambda h: torch.stack([shift(h)[..., :6], h[..., 6:]], -2).flatten(-2)}


@pytest.mark.parametrize("treat", STACKED.values(), ids=STACKED.keys())
def test_units_stacked_after_other_ops_are_not_permuted_with_the_rest(treat):
    """torch.stack joins pieces as cat does, each one position wide along the new axis; it kept no pieces apart,
    so one permutation of all 12 units moved doubled or shifted units among the others (relative change
    0.4-1.0)."""
    subject = treated_subject(treat)
    assert max((g.size for g in subject.report.groups), default=0) <= 6, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_units_stacked_alike_keep_one_permutation():
    subject = treated_subject(lambda h: torch.stack([h[..., :6], h[..., 6:]], -1).flatten(-2))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def _write(h, where, what):
    z = h.clone()
    z[where] = what(z)[where]
    return z


def _narrow_doubled(h):
    z = h.clone()
    z.narrow(-1, 0, 6).mul_(2)
    return z


WRITTEN = {"shifted": lambda h: _write(h, (..., slice(0, 6)), shift),
           "doubled": lambda h: _write(h, (..., slice(0, 6)), lambda z: 2 * z),
           "doubled in place": _narrow_doubled}


@pytest.mark.parametrize("treat", WRITTEN.values(), ids=WRITTEN.keys())
def test_units_overwritten_in_place_are_not_permuted_with_the_rest(treat):
    """An in-place write into some units of a tensor joins the written piece to the rest as a cat does, but kept
    no pieces apart: one permutation of all 12 units moved written units among the others (relative change
    0.3-1.0)."""
    subject = treated_subject(treat)
    assert max((g.size for g in subject.report.groups), default=0) <= 6, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_token_overwritten_in_place_keeps_the_permutation_of_all_units():
    subject = treated_subject(lambda h: _write(h, (slice(None), 0), lambda z: 2 * z))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Depthwise(nn.Module):
    """``Linear -> ReLU -> depthwise conv along tokens -> Linear``; ``kernel``: "own" (the conv's weight), "shared"
    (its first row expanded to every channel) or "buffer" (a fixed kernel)."""

    def __init__(self, kernel: str):
        super().__init__()
        self.kernel = kernel
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.conv = nn.Conv1d(H, H, 3, padding=1, groups=H)
        self.register_buffer("fixed", torch.randn(H, 1, 3))

    def forward(self, x):
        weight = {"own": self.conv.weight, "shared": self.conv.weight[:1].expand(H, 1, 3),
                  "buffer": self.fixed}[self.kernel]
        h = torch.relu(self.a(x)).transpose(1, 2)
        return self.b(F.conv1d(h, weight, self.conv.bias, padding=1, groups=H).transpose(1, 2))


@pytest.mark.parametrize("kernel", ["shared", "buffer"])
def test_a_depthwise_kernel_without_rows_of_its_own_pins_its_channels(kernel):
    """A depthwise kernel with no channel along its rows crashed the conv rule (``'NoneType' object has no
    attribute 'reshape'``); its channels now pin, with the kernel."""
    subject = symgraph.load(noisy(Depthwise(kernel)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert not subject.report.groups, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_depthwise_kernel_of_its_own_keeps_the_units():
    subject = symgraph.load(noisy(Depthwise("own")).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class JoinedStream(nn.Module):
    """An embedding, ``y = x + mix(x)``, and a head reading ``y`` (``join``: coordinates 0-3 from ``x``, the rest
    from ``y``)."""

    def __init__(self, join: bool):
        super().__init__()
        self.join = join
        self.emb, self.mix, self.head = nn.Embedding(11, D), nn.Linear(D, D), nn.Linear(D, 11)

    def forward(self, tokens):
        x = self.emb(tokens)
        y = x + self.mix(x)
        return self.head(torch.cat([x[..., :4], y[..., 4:]], -1) if self.join else y)


@pytest.mark.parametrize("join, kinds", [(True, {"residual general_linear 4x2": 1}),
                                         (False, {"residual general_linear 8x1": 1})])
def test_a_stream_joined_from_before_and_after_a_block_keeps_the_pieces_apart(join, kinds):
    """``x`` and ``x + mix(x)`` carry the same stream coordinates, cut from different tensors: one general linear
    map of all 8 moved coordinates of ``x`` into ``y``'s piece (relative change 0.35)."""
    subject = symgraph.load(noisy(JoinedStream(join)).double(), (torch.randint(0, 11, (2, 5)),))
    assert census(subject) == kinds, census(subject)
    assert_fuzzed_at_two_shapes(subject)
