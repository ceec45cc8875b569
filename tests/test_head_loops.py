"""Attention computed head by head in a Python loop from one projection, the heads joined again.

``v = self.v(x).view(B, T, H, dh)`` is one projection; ``a[:, h] @ v[:, :, h]`` multiplies head h's value
coordinates by head h's own attention matrix. Nothing recorded that the coordinates reaching different per-head
matmuls met different matrices, so the value space came out as one orthogonal group over all H*dh coordinates
(``vo orthogonal 16x1``), mixing heads: relative output change 1e-1 in float64. The query and key coordinates of
grouped-query heads attended in a loop (``q[:, h] @ k[:, h // 2].T``) were mixed across KV groups the same way.
Coordinates now carry the set of matrices (and sums) they pass; coordinates of one space whose sets differ are
separate blocks, so the loop forms get the per-head groups of the batched form, the one-module-per-head form
gets its per-head VO maps too, and one matrix applied to two slices of the values (``a @ v1``, ``a @ v2``) still
lets the slices mix. Separated rows that share some classes (every query head's rotary half meets one shared
key) no longer merge into one block: the classes each row holds alone stay apart.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

WIDTH, HEADS, POINTS = 16, 2, 8
HEAD_DIM = WIDTH // HEADS


class LoopAttention(nn.Module):
    """One q, k, v projection each, scores batched over heads; values attended head by head and joined by
    ``stack``, ``cat``, or writes into a buffer (``batched``: the ordinary ``a @ v``, for comparison)."""

    def __init__(self, join: str):
        super().__init__()
        self.join = join
        self.embed = nn.Linear(POINTS, WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, p):
        x = self.embed(p)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(x).view(b, t, HEADS, HEAD_DIM)
        a = torch.softmax(q @ k.transpose(-1, -2) * HEAD_DIM ** -0.5, -1)
        if self.join == "stack":
            out = torch.stack([a[:, h] @ v[:, :, h] for h in range(HEADS)], 1).transpose(1, 2).reshape(b, t, WIDTH)
        elif self.join == "cat":
            out = torch.cat([a[:, h] @ v[:, :, h] for h in range(HEADS)], -1)
        elif self.join == "buffer":
            out = x.new_zeros(b, t, HEADS, HEAD_DIM)
            for h in range(HEADS):
                out[:, :, h] = a[:, h] @ v[:, :, h]
            out = out.reshape(b, t, WIDTH)
        else:
            out = (a @ v.transpose(1, 2)).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.o(out)
        return self.head(x.mean(1))


class HeadModules(nn.Module):
    """The nanoGPT lecture's multi-head attention: one module (own q, k, v) per head, outputs concatenated."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(POINTS, WIDTH)
        self.heads = nn.ModuleList(nn.ModuleDict({n: nn.Linear(WIDTH, HEAD_DIM, bias=False) for n in "qkv"})
                                   for _ in range(HEADS))
        self.proj, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, p):
        x = self.embed(p)
        outs = []
        for m in self.heads:
            a = torch.softmax(m["q"](x) @ m["k"](x).transpose(-2, -1) * 0.3, -1)
            outs.append(a @ m["v"](x))
        x = x + self.proj(torch.cat(outs, -1))
        return self.head(x.mean(1))


class GroupedLoop(nn.Module):
    """Four query heads, two KV heads; query head h attends with KV head h // 2, one head per loop step."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(POINTS, WIDTH)
        self.q, self.k, self.v = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.o, self.head = nn.Linear(2 * WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, p):
        x = self.embed(p)
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 2 * HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v(x).view(b, t, HEADS, HEAD_DIM)
        outs = []
        for h in range(2 * HEADS):
            a = torch.softmax(q[:, h] @ k[:, h // 2].transpose(-1, -2) * HEAD_DIM ** -0.5, -1)
            outs.append(a @ v[:, :, h // 2])
        x = x + self.o(torch.cat(outs, -1))
        return self.head(x.mean(1))


class SlicedValues(nn.Module):
    """One attention matrix applied to the first half of the values; the second half attended by the same matrix
    (``attend_both``: both halves meet one matrix) or passed on as it is (the halves meet different matrices)."""

    def __init__(self, attend_both: bool):
        super().__init__()
        self.attend_both = attend_both
        self.embed = nn.Linear(POINTS, WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, p):
        x = self.embed(p)
        v = self.v(x)
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * 0.25, -1)
        second = a @ v[..., HEAD_DIM:] if self.attend_both else v[..., HEAD_DIM:]
        x = x + self.o(torch.cat([a @ v[..., :HEAD_DIM], second], -1))
        return self.head(x.mean(1))


def _load(model):
    return symgraph.load(noisy(model), (torch.randn(2, 5, POINTS),))


@pytest.mark.parametrize("join", ["stack", "cat", "buffer"])
def test_values_attended_head_by_head_get_per_head_groups(join):
    s = _load(LoopAttention(join))
    assert_fuzzed_at_two_shapes(s)  # first: the error a wrong group makes is what fails
    groups = census(s)
    assert groups.get("vo orthogonal 8x2") == 1, groups  # one map per head, as the batched form gets
    assert not any(g.size > HEAD_DIM for g in s.report.groups if g.motif == "vo"), groups
    assert groups == census(_load(LoopAttention("batched")))


def test_one_module_per_head_keeps_its_per_head_groups():
    s = _load(HeadModules())
    assert_fuzzed_at_two_shapes(s)  # first: the error a wrong group makes is what fails
    groups = census(s)
    # each head's QK and (new: the heads' value rows were one block with the output columns, which no parameter
    # covered whole, so it was left out) each head's VO, general linear
    assert groups.get("other general_linear 8x1") == 2 * HEADS, groups


def test_grouped_query_heads_in_a_loop_keep_kv_groups_apart():
    s = _load(GroupedLoop())
    assert_fuzzed_at_two_shapes(s)  # first: the error a wrong group makes is what fails
    groups = census(s)
    assert groups.get("other general_linear 8x2") == 2, groups  # QK and VO: one map per KV group
    assert not any(g.size > HEAD_DIM for g in s.report.groups if g.motif != "residual"), groups


def test_one_matrix_on_two_value_slices_lets_them_mix():
    s = _load(SlicedValues(attend_both=True))
    assert_fuzzed_at_two_shapes(s)  # first: the error a wrong group makes is what fails
    members = {g.size: {m.param for m in g.members} for g in s.report.groups if g.motif != "residual"}
    assert {"v.weight", "o.weight"} <= members.get(WIDTH, set()), census(s)


def test_values_half_attended_keep_their_halves_apart():
    s = _load(SlicedValues(attend_both=False))
    assert_fuzzed_at_two_shapes(s)  # first: the error a wrong group makes is what fails
    v_groups = [g for g in s.report.groups if g.motif != "residual" and "v.weight" in {m.param for m in g.members}]
    assert v_groups and all(g.size <= HEAD_DIM for g in v_groups), census(s)
