"""Softmaxes and reductions over groups of an axis: units viewed as (4, 8) and softmaxed per row, halves softmaxed
apart, heads summed or softmaxed in pairs.

A softmax over all of an axis lets its coordinates permute; over groups of it (``view(4, 8).softmax(-1)``, a
``chunk``'s halves, an uneven ``split``) a permutation may only move coordinates within a group, as a reduction's
rows already kept apart. The rule for softmax skipped that and emitted a permutation of all 32 units (relative
output change 0.15-0.38 in float64; log_softmax and softmin too, and a MoE router softmaxed in two halves moved
experts across them). Heads (block channels) were left free whenever a sum, maximum or softmax ran over the heads
axis, though it ran over pairs of heads (``view(b, 2, 2, ...)``, chunks): the head permutation moved a head into
the other pair (0.40-1.23). Found by a red-team sweep of hand-written models; each case must now fuzz clean, and
the groups that remain must still be there.

Values normalised a group of heads at a time before the view that splits them into heads (``cat([v[..., :8]
.softmax(-1), v[..., 8:].softmax(-1)])``, uneven chunks, a layer norm per half, halves of the heads axis) are
coordinates there, not heads: the coordinate groups kept the halves apart, but the head group, read from the
attention op's links, still moved a head into the other half (0.02-0.03). A head permutation now has to map every
row of such a statistic that holds several heads onto itself (analysis/head_rows.py); rows of one head (heads in a
loop), of every head, or of whole KV groups keep their groups. A top-k over rows of several heads is such a
statistic too (its rows were not listed: 0.21). Kept entries scattered back by top-k indices within rows of a view
(``view(2, 8)``, top-k along the last axis) name positions that a permutation within a row moves, and nothing
followed them: the units were permuted within their rows (0.63); they are now pinned where the indices are read.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

D, H, DH = 16, 4, 4


class Units(nn.Module):
    """32 hidden units, normalised by ``read``, then read by a linear."""

    def __init__(self, read):
        super().__init__()
        self.a, self.o, self.read = nn.Linear(D, 32), nn.Linear(32, 3), read

    def forward(self, x):
        return self.o(self.read(self.a(x)))


UNIT_READS = {  # name -> (the normalisation, the sizes of the unit permutations that must remain)
    "view (4, 8), softmax": (lambda h: h.unflatten(-1, (4, 8)).softmax(-1).flatten(-2), [8]),
    "view (4, 8), log_softmax": (lambda h: h.unflatten(-1, (4, 8)).log_softmax(-1).flatten(-2), [8]),
    "view (4, 8), softmin": (lambda h: torch.nn.functional.softmin(h.unflatten(-1, (4, 8)), -1).flatten(-2), [8]),
    "chunk, softmax each half": (lambda h: torch.cat([t.softmax(-1) for t in h.chunk(2, -1)], -1), [16, 16]),
    "uneven split, softmax each": (lambda h: torch.cat([t.softmax(-1) for t in h.split([12, 20], -1)], -1),
                                   [12, 20]),
    "softmax over all": (lambda h: h.softmax(-1), [32]),
}


@pytest.mark.parametrize("name", list(UNIT_READS))
def test_units_softmaxed_in_groups_permute_within_their_group_only(name):
    read, sizes = UNIT_READS[name]
    subject = symgraph.load(noisy(Units(read)).double(), (torch.randn(2, 7, D, dtype=torch.float64),))
    groups = [g for g in subject.report.groups
              if g.kind == "permutation" and any(m.param == "a.weight" and m.axis == 0 for m in g.members)]
    assert groups, "the units of each group still permute"
    assert max(g.size for g in groups) == max(sizes), [(g.size, g.copies) for g in groups]
    assert_fuzzed_at_two_shapes(subject)


class Attention(nn.Module):
    """Causal attention whose heads meet ``combine``: of the (b, H, n, n) logits, or of the (b, H, n, DH) output,
    which may come out with ``heads_out`` heads for the output projection."""

    def __init__(self, where, combine, heads_out=H):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D) for _ in range(3))
        self.o = nn.Linear(heads_out * DH, D)
        self.where, self.combine = where, combine

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, H, DH).transpose(1, 2) for t in (self.q(x), self.k(x), self.v(x)))
        s = q @ k.transpose(-1, -2) / math.sqrt(DH)
        if self.where == "logits":
            s = self.combine(s)
        out = (s + torch.triu(torch.full((n, n), -1e9, dtype=x.dtype), 1)).softmax(-1) @ v
        if self.where == "output":
            out = self.combine(out)
        return self.o(out.transpose(1, 2).flatten(2))


HEAD_COMBINES = {  # name -> (where, combine, heads out)
    "output, heads summed in pairs": ("output", lambda t: t.unflatten(1, (2, 2)).sum(2), 2),
    "output, heads' maximum in pairs": ("output", lambda t: t.unflatten(1, (2, 2)).amax(2), 2),
    "output, heads summed per chunk": ("output", lambda t: torch.stack([c.sum(1) for c in t.chunk(2, 1)], 1), 2),
    "logits, heads summed in pairs": ("logits", lambda s: s.unflatten(1, (2, 2)).sum(2).repeat_interleave(2, 1), H),
    "logits, softmax over head pairs": ("logits", lambda s: s.unflatten(1, (2, 2)).softmax(2).flatten(1, 2), H),
    "logits, softmax over head chunks": ("logits", lambda s: torch.cat([c.softmax(1) for c in s.chunk(2, 1)], 1), H),
}


def _head_groups(subject) -> list:
    return [g for g in subject.report.groups if g.motif == "heads"]


@pytest.mark.parametrize("name", list(HEAD_COMBINES))
def test_heads_reduced_in_groups_are_not_permuted_across_them(name):
    subject = symgraph.load(noisy(Attention(*HEAD_COMBINES[name])).double(),
                            (torch.randn(2, 7, D, dtype=torch.float64),))
    assert not _head_groups(subject), [g.id for g in _head_groups(subject)]
    assert any(g.motif == "qk" for g in subject.report.groups), "each head's own maps remain"
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("combine", [lambda s: s.softmax(1), lambda s: s - s.amax(1, keepdim=True)],
                         ids=["softmax over all heads", "maximum over all heads"])
def test_heads_normalised_over_all_of_them_still_permute(combine):
    subject = symgraph.load(noisy(Attention("logits", combine)).double(), (torch.randn(2, 7, D, dtype=torch.float64),))
    assert [g.size for g in _head_groups(subject)] == [H]
    assert_fuzzed_at_two_shapes(subject)


class ValueAttention(nn.Module):
    """Causal attention with ``kv`` key/value heads of ``heads`` query heads, whose values (the (b, n, kv * DH)
    projection) pass ``values`` before they are split into heads."""

    def __init__(self, values, heads=H, kv=H):
        super().__init__()
        self.values, self.heads, self.kv = values, heads, kv
        self.q, self.o = nn.Linear(D, heads * DH), nn.Linear(heads * DH, D)
        self.k, self.v = nn.Linear(D, kv * DH), nn.Linear(D, kv * DH)

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, DH).transpose(1, 2)
        k = self.k(x).view(b, n, self.kv, DH).transpose(1, 2)
        v = self.values(self.v(x)).view(b, n, self.kv, DH).transpose(1, 2)
        k, v = (t.repeat_interleave(self.heads // self.kv, 1) for t in (k, v))
        out = (q @ k.transpose(-1, -2) / math.sqrt(DH) + torch.triu(torch.full((n, n), -1e9, dtype=x.dtype), 1))
        return self.o((out.softmax(-1) @ v).transpose(1, 2).flatten(2))


def _top(t, k):
    """``t`` with all but the ``k`` largest entries of each row along the last axis zeroed (top-k, then scatter)."""
    values, indices = t.topk(k, -1)
    return torch.zeros_like(t).scatter(-1, indices, values)


def _by_heads(t, fn):
    """``fn`` on ``t`` viewed as (..., heads, DH)."""
    return fn(t.unflatten(-1, (-1, DH))).flatten(-2)


VALUES_NORMALISED_IN_GROUPS = {  # name -> the values' normalisation; each row holds several heads, not all
    "halves softmaxed apart": lambda t: torch.cat([t[..., :2 * DH].softmax(-1), t[..., 2 * DH:].softmax(-1)], -1),
    "three uneven chunks": lambda t: torch.cat([c.softmax(-1) for c in t.split([DH, 2 * DH, DH], -1)], -1),
    "chunks across heads": lambda t: torch.cat([c.softmax(-1) for c in t.split([6, 6, 4], -1)], -1),
    "view (2, 8), softmax": lambda t: t.unflatten(-1, (2, 2 * DH)).softmax(-1).flatten(-2),
    "halves layer-normed apart": lambda t: torch.cat([nn.functional.layer_norm(c, (2 * DH,)) for c in t.chunk(2, -1)],
                                                     -1),
    "halves of the heads axis, softmax across heads": lambda t: _by_heads(
        t, lambda h: torch.cat([c.softmax(-2) for c in h.chunk(2, -2)], -2)),
    "halves of the heads axis, softmax over both heads' entries": lambda t: _by_heads(
        t, lambda h: torch.cat([c.flatten(-2).softmax(-1).view_as(c) for c in h.chunk(2, -2)], -2)),
    "halves, top 3 of each kept (chunks)": lambda t: torch.cat([_top(c, 3) for c in t.chunk(2, -1)], -1),
    "halves, top 3 of each kept (view)": lambda t: _top(t.unflatten(-1, (2, 2 * DH)), 3).flatten(-2),
}


@pytest.mark.parametrize("name", list(VALUES_NORMALISED_IN_GROUPS))
def test_values_normalised_in_groups_of_heads_keep_the_heads_apart(name):
    """Values softmaxed (or normalised) a group of heads at a time, before the view that splits them into heads:
    a head moved into another group would meet that group's normaliser (relative output change 0.02-0.03 in
    float64 for the halves), so no head permutation may move it there; each head's own maps remain."""
    subject = symgraph.load(noisy(ValueAttention(VALUES_NORMALISED_IN_GROUPS[name])).double(),
                            (torch.randn(2, 7, D, dtype=torch.float64),))
    assert not _head_groups(subject), [g.id for g in _head_groups(subject)]
    assert any(g.motif == "qk" for g in subject.report.groups), "each head's own maps remain"
    assert_fuzzed_at_two_shapes(subject)


def test_a_head_permutation_across_softmaxed_halves_changes_the_function():
    """The unsound group this guards against: heads 0 and 2 swapped in q, k, v rows and o columns, with the
    values softmaxed in halves, change the output at two input shapes."""
    model = noisy(ValueAttention(VALUES_NORMALISED_IN_GROUPS["halves softmaxed apart"])).double()
    swapped = _heads_swapped(model, 0, 2)
    for shape in ((2, 7), (3, 11)):
        x = torch.randn(*shape, D, dtype=torch.float64)
        assert (model(x) - swapped(x)).norm() > 1e-3 * model(x).norm()
    swapped = _heads_swapped(model, 0, 1)  # within a half the heads still permute
    for shape in ((2, 7), (3, 11)):
        x = torch.randn(*shape, D, dtype=torch.float64)
        torch.testing.assert_close(model(x), swapped(x), rtol=1e-10, atol=1e-12)


def _heads_swapped(model, i, j):
    out = copy.deepcopy(model)
    order = torch.arange(H * DH).view(H, DH)
    order[[i, j]] = order[[j, i]]
    order = order.flatten()
    with torch.no_grad():
        for lin in (out.q, out.k, out.v):
            lin.weight.copy_(lin.weight[order])
            lin.bias.copy_(lin.bias[order])
        out.o.weight.copy_(out.o.weight[:, order])
    return out


VALUES_KEEPING_HEADS = {  # name -> (the values' normalisation, query heads, KV heads, head group sizes)
    "plain": (lambda t: t, H, H, [H]),
    "softmax over the whole width": (lambda t: t.softmax(-1), H, H, [H]),
    "softmax per head": (lambda t: _by_heads(t, lambda h: h.softmax(-1)), H, H, [H]),
    "softmax across all heads": (lambda t: _by_heads(t, lambda h: h.softmax(-2)), H, H, [H]),
    "GQA, halves softmaxed apart, one KV head each": (
        lambda t: torch.cat([c.softmax(-1) for c in t.chunk(2, -1)], -1), H, 2, [2, 2]),
    "GQA, halves of four KV heads softmaxed apart": (
        lambda t: torch.cat([c.softmax(-1) for c in t.chunk(2, -1)], -1), 2 * H, H, [2]),
    "GQA, a chunk over half of each of two KV heads": (
        lambda t: torch.cat([c.softmax(-1) for c in t.split([2, 4, 2], -1)], -1), H, 2, [2]),
}


@pytest.mark.parametrize("name", list(VALUES_KEEPING_HEADS))
def test_values_normalised_per_head_or_over_all_heads_keep_the_head_group(name):
    """Rows of one head, of every head, or of whole KV groups leave the permutations that keep them whole: all
    heads; with GQA the query heads within each KV group, and the KV groups too unless a row holds two of them."""
    values, heads, kv, sizes = VALUES_KEEPING_HEADS[name]
    subject = symgraph.load(noisy(ValueAttention(values, heads, kv)).double(),
                            (torch.randn(2, 7, D, dtype=torch.float64),))
    assert sorted(g.size for g in _head_groups(subject)) == sorted(sizes), [g.id for g in _head_groups(subject)]
    assert_fuzzed_at_two_shapes(subject)
