"""Values or keys whose heads axis is rebuilt from pieces, and heads that meet operands carrying no head labels.

Values viewed (b, n, kv, dh), cut into one piece per KV head (``chunk(kv, dim=2)``), treated, and joined again on
dim 2: each piece has size 1 along the heads axis, so the join looked like one along a data axis (a class token in
front of patches) and tied every piece to the first piece's coordinates. The heads axis of the values then carried
no head labels, and the head permutation, read from the query/key product, moved the heads of q, k and o but not
of v (relative output change 0.35-1.8 in float64). The same held for values built from one head's slice by a
different linear per head (a real data axis): heads multiplied by values that differ from head to head must move
those values with them, or they stay put (analysis/contraction.py, ``_pin_heads_beside_unlabelled_data``). Keys
rebuilt the same way left them out of the head permutation of q, v and o the same way (0.08-1.15): a query/key
product whose operand differs from head to head without coordinates that vary there pins its heads too. Values
shared by every head (one KV head repeated, MQA) do not differ from head to head and keep the head group; a
``repeat_interleave`` of that one head, transformers' expand-and-reshape and SDPA's ``enable_gqa`` are now known to
repeat it (``rules._constant_axes_after``, ``rules._repeat_heads``; Falcon's multi-query head group depends on it).

A piece cut from the heads axis now keeps its heads' labels however narrow (``rules._cut_from_labelled_axis``): no
join of such pieces is taken for one along a data axis. Values whose pieces are computed alike move with their
heads; pieces computed unlike keep the heads in place, and only query heads within a KV group permute.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

D, DH, H = 16, 4, 4


def _one_linear_per_piece(m, v):
    return torch.cat([lin(c) for lin, c in zip(m.per_head, v.chunk(m.kv, dim=2))], 2)


VALUES_REJOINED = {  # name -> values (b, n, kv, dh) -> values of the same shape
    "chunks softmaxed, joined again": lambda m, v: torch.cat([c.softmax(-1) for c in v.chunk(m.kv, dim=2)], 2),
    "chunks treated unlike, joined again": lambda m, v: torch.cat(
        [v.chunk(m.kv, dim=2)[0].softmax(-1)] + [c * 2.0 for c in v.chunk(m.kv, dim=2)[1:]], 2),
    "chunks joined in reverse": lambda m, v: torch.cat(v.chunk(m.kv, dim=2)[::-1], 2),
    "one linear per chunk": _one_linear_per_piece,
    "one head's slice through a linear per head": lambda m, v: torch.cat([lin(v[:, :, :1]) for lin in m.per_head], 2),
}

VALUES_KEEPING_HEADS = {  # name -> (values, KV heads, head group sizes)
    "plain": (lambda m, v: v, H, [H]),
    "heads unbound, softmaxed, stacked": (lambda m, v: torch.stack([c.softmax(-1) for c in v.unbind(2)], 2), H, [H]),
    "heads selected and stacked": (lambda m, v: torch.stack([v[:, :, i] for i in range(m.kv)], 2), H, [H]),
    "GQA, heads unbound and stacked": (lambda m, v: torch.stack(v.unbind(2), 2), 2, [2, 2]),
    "MQA, one KV head": (lambda m, v: v, 1, [H]),
}


class Attention(nn.Module):
    """Causal attention with ``kv`` key/value heads shared by ``H`` query heads; the values (or the keys, with
    ``keys``), viewed (b, n, kv, dh), pass ``values`` before the heads axis moves in front. ``share`` repeats the
    KV heads: ``repeat_interleave``, transformers' ``repeat_kv`` (a new axis expanded, then reshaped), or SDPA with
    ``enable_gqa``."""

    def __init__(self, values, kv, share="repeat_interleave", keys=False):
        super().__init__()
        self.values, self.kv, self.share, self.keys = values, kv, share, keys
        self.q, self.o = nn.Linear(D, H * DH), nn.Linear(H * DH, D)
        self.k, self.v = nn.Linear(D, kv * DH), nn.Linear(D, kv * DH)
        self.per_head = nn.ModuleList(nn.Linear(DH, DH) for _ in range(kv))

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, H, DH).transpose(1, 2)
        k, v = (p(x).view(b, n, self.kv, DH) for p in (self.k, self.v))
        k, v = (self.values(self, t) if treated else t for t, treated in ((k, self.keys), (v, not self.keys)))
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.share == "sdpa":
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.o(out.transpose(1, 2).flatten(2))
        if self.share == "repeat_kv":
            k, v = (t[:, :, None].expand(b, self.kv, H // self.kv, n, DH).reshape(b, H, n, DH) for t in (k, v))
        else:
            k, v = (t.repeat_interleave(H // self.kv, 1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH) + torch.triu(torch.full((n, n), -1e9, dtype=x.dtype), 1)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).flatten(2))


def _load(values, kv, share="repeat_interleave", keys=False):
    return symgraph.load(noisy(Attention(values, kv, share, keys)).double(),
                         (torch.randn(2, 7, D, dtype=torch.float64),))


def _head_groups(subject) -> list:
    return [g for g in subject.report.groups if g.motif == "heads"]


SHARES = ["repeat_interleave", "repeat_kv", "sdpa"]


REJOINED_CASES = [(name, kv, "repeat_interleave", keys) for name in VALUES_REJOINED for kv in (2, H)
                  for keys in (False, True)] + [
    (name, kv, share, False) for name in ("chunks joined in reverse", "one linear per chunk") for kv in (2, H)
    for share in SHARES[1:]]


ALIKE = ("chunks softmaxed, joined again", "chunks joined in reverse")  # every piece computed by the same ops
# every piece computed by the same ops with a parameter of its own (a linear per head): the KV groups' query heads
# permute alike, one group of two copies, but whole heads stay (each linear's columns read values that stay)
BY_ROLE = ("one linear per chunk", "one head's slice through a linear per head")


@pytest.mark.parametrize("name, kv, share, keys", REJOINED_CASES)
def test_values_or_keys_rebuilt_along_the_heads_axis_move_with_the_heads_or_keep_them(name, kv, share, keys):
    """Each piece, cut from the heads axis, keeps its heads' labels: pieces computed alike move with whole heads
    (KV groups), pieces computed unlike (their own linear each) keep them in place, and only query heads within a
    KV group, which read the same values, permute."""
    subject = _load(VALUES_REJOINED[name], kv, share, keys)
    found = sorted((g.id.split(":")[0], g.size, g.copies) for g in _head_groups(subject))
    within = [("heads-within", 2, 2)] if name in ALIKE + BY_ROLE else [("heads-within", 2, 1)] * 2
    whole = [("heads", kv, 1)] if name in ALIKE else []
    assert found == sorted(whole + (within if kv < H else [])), found
    assert any(g.motif == "qk" for g in subject.report.groups), "each head's own maps remain"
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("name", list(VALUES_KEEPING_HEADS))
def test_values_that_move_with_their_heads_keep_the_head_group(name, share):
    values, kv, sizes = VALUES_KEEPING_HEADS[name]
    subject = _load(values, kv, share)
    assert sorted(g.size for g in _head_groups(subject)) == sorted(sizes), [g.id for g in _head_groups(subject)]
    assert_fuzzed_at_two_shapes(subject)


def test_the_head_permutation_left_out_changes_the_function():
    """What the removed group did: heads 0 and 1 swapped in q, k and o but not in the values (one linear per head
    on head 0's slice) change the output at two input shapes."""
    model = noisy(Attention(VALUES_REJOINED["one head's slice through a linear per head"], H)).double()
    swapped = copy.deepcopy(model)
    order = torch.arange(H * DH).view(H, DH)
    order[[0, 1]] = order[[1, 0]]
    order = order.flatten()
    with torch.no_grad():
        for lin in (swapped.q, swapped.k):
            lin.weight.copy_(lin.weight[order])
            lin.bias.copy_(lin.bias[order])
        swapped.o.weight.copy_(swapped.o.weight[:, order])
    for shape in ((2, 7), (3, 11)):
        x = torch.randn(*shape, D, dtype=torch.float64)
        assert (model(x) - swapped(x)).norm() > 1e-3 * model(x).norm()
