"""In-place writes into views of a preallocated buffer (symgraph/analysis/writes.py) with operands whose channels lie
on different axes: learned tokens labelled on their token and coordinate axes written beside activations labelled on
the coordinate axis (GroupViT's ``cat([x, group_tokens], 1)`` written as two slice assignments).

The write rule paired the base's and the written value's channels by their place in the channel lists, so the
activations' coordinates were joined with the tokens' *token* channel, as the movement rule once did for ``cat``:
the residual class took in the token axis, and its sign flip changed the outputs (relative 2.7e-1 in float64). The
channels are now paired by the axes they vary along (the helper the movement rule uses).

Paired right, a table cloned into a buffer whose first ``n`` rows activations overwrite kept its other rows' labels,
and the rows were permuted: which rows survive depends on ``n``, so the permutation changed the outputs at other
input lengths (relative 1.8e-2, and on main already with the table stored transposed). What a write leaves along an
axis it cuts keeps its coordinates only where the write lands at the same place at every probe shape.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy
from test_token_concat import PATCH, WIDTH, GroupTokens


class WrittenGroupTokens(GroupTokens):
    """GroupTokens with the concatenation written into a buffer: activations into rows ``:n``, the learned tokens
    into rows ``n:`` (``order`` says which comes first)."""

    def __init__(self, tokens: int, order: str, alloc: str):
        super().__init__(tokens)
        self.order, self.alloc = order, alloc

    def forward(self, patches):
        x = self.embed(patches)
        b, n, d = x.shape
        both = torch.zeros(b, n + self.tokens, d, dtype=x.dtype) if self.alloc == "zeros" \
            else x.new_empty(b, n + self.tokens, d)
        for part in (("x", "tokens") if self.order == "x_first" else ("tokens", "x")):
            if part == "x":
                both[:, :n] = x
            else:
                both[:, n:] = self.group_token
        both = both + self.mix(self.norm(both))
        x, groups = both[:, :-self.tokens], both[:, -self.tokens:]
        groups = self.norm_post(self.mixer(self.norm_tokens(groups)))
        return self.head(groups.mean(1)) + self.head_x(x.mean(1))


@pytest.mark.parametrize("order, alloc", [("x_first", "zeros"), ("tokens_first", "new_empty")])
@pytest.mark.parametrize("tokens", [6, WIDTH])  # as many tokens as coordinates: sizes cannot tell the axes apart
def test_tokens_written_beside_activations_keep_their_own_axis(tokens, order, alloc):
    subject = symgraph.load(noisy(WrittenGroupTokens(tokens, order, alloc)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    token_axis = {g.id for g in subject.report.groups for m in g.members if m.param == "group_token" and m.axis == 1}
    coordinates = {g.id for g in subject.report.groups for m in g.members if m.param == "embed.weight"}
    assert not token_axis & coordinates  # the token axis never moves with the coordinates
    assert census(subject)["ffn permutation 16x1"] == 1  # the token mixer's hidden units still permute


class TablePool(nn.Module):
    """A learned table of ``rows`` x WIDTH cloned into a buffer, its first ``n`` rows overwritten by activations (or
    its first 3 rows by the first 3 tokens: ``fixed``), then a token-wise MLP and a mean over the tokens."""

    def __init__(self, transposed: bool = False, fixed: bool = False, rows: int = 16):
        super().__init__()
        self.transposed, self.fixed = transposed, fixed
        self.embed = nn.Linear(PATCH, WIDTH)
        self.table = nn.Parameter(torch.randn(WIDTH, rows) if transposed else torch.randn(rows, WIDTH))
        self.mix, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, patches):
        x = self.embed(patches)
        table = self.table.t() if self.transposed else self.table
        buf = table.expand(x.shape[0], -1, -1).clone()
        if self.fixed:
            buf[:, :3] = x[:, :3]
        else:
            buf[:, :x.shape[1]] = x
        return self.head(torch.relu(self.mix(buf)).mean(1))


def table_rows(subject, axis: int) -> set[str]:
    return {g.id for g in subject.report.groups for m in g.members if m.param == "table" and m.axis == axis}


@pytest.mark.parametrize("transposed", [False, True])
def test_rows_left_by_a_write_whose_place_follows_the_input_stay_fixed(transposed):
    subject = symgraph.load(noisy(TablePool(transposed)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    assert not table_rows(subject, 1 if transposed else 0)
    assert any("may land elsewhere at another input shape" in p.reason for p in subject.report.pinned)
    groups = census(subject)  # the coordinates pass the write: one invertible map on embed rows, table, mix columns
    assert groups["other general_linear 16x1"] == 1 and groups["ffn permutation/positive 16x1"] == 1, groups


def test_rows_left_by_a_write_at_fixed_places_still_permute():
    subject = symgraph.load(noisy(TablePool(fixed=True)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    rows = [g for g in subject.report.groups if table_rows(subject, 0) & {g.id}]
    assert [(g.kind, g.size) for g in rows] == [("permutation", 13)]  # the 13 rows no input length overwrites


class Registers(nn.Module):
    """Register tokens (a parameter of tokens x coordinates) written into a buffer beside the activations, through
    ``how``: a slice (``slice``), a transposed view (``transposed``), or one class vector by ``select``."""

    def __init__(self, how: str, registers: int = 3):
        super().__init__()
        self.how, self.registers = how, 1 if how == "select" else registers
        self.embed = nn.Linear(PATCH, WIDTH)
        self.tokens = nn.Parameter(torch.randn(WIDTH) if how == "select" else torch.randn(registers, WIDTH))
        self.norm, self.mix, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, patches):
        x = self.embed(patches)
        buf = x.new_zeros(x.shape[0], x.shape[1] + self.registers, WIDTH)
        if self.how == "select":
            buf[:, 0] = self.tokens
        elif self.how == "transposed":
            buf.transpose(1, 2)[..., :self.registers] = self.tokens.t()
        else:
            buf[:, :self.registers] = self.tokens
        buf[:, self.registers:] = x
        buf = buf + self.mix(self.norm(buf))
        return self.head(buf[:, :self.registers].mean(1) + buf[:, self.registers:].mean(1))


@pytest.mark.parametrize("how", ["slice", "transposed", "select"])
def test_registers_written_into_a_buffer_join_the_residual_stream(how):
    subject = symgraph.load(noisy(Registers(how)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert [g.size for g in residual] == [WIDTH]
    assert {"embed.weight", "tokens", "mix.weight", "head.weight"} <= {m.param for m in residual[0].members}


class ShiftedTokens(nn.Module):
    """Learned tokens written at rows ``n:n+3`` of a 16-row buffer, then rows ``:6`` overwritten (a write at a fixed
    place): which tokens survive depends on ``n`` through the earlier write (5 tokens: the last two; 4: the last)."""

    def __init__(self):
        super().__init__()
        self.embed, self.tokens = nn.Linear(PATCH, WIDTH), nn.Parameter(torch.randn(3, WIDTH))
        self.mix, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, patches):
        x = self.embed(patches)
        buf = x.new_zeros(x.shape[0], 16, WIDTH)
        buf[:, x.shape[1]:x.shape[1] + 3] = self.tokens
        buf[:, :6] = x[:, :1].expand(-1, 6, -1)
        return self.head(torch.relu(self.mix(buf)).mean(1))


def test_a_write_at_a_fixed_place_cuts_what_an_earlier_write_put_elsewhere():
    model = noisy(ShiftedTokens())
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    assert not {g.id for g in subject.report.groups for m in g.members if m.param == "tokens" and m.axis == 0}
    assert census(subject)["ffn permutation/positive 16x1"] == 1
    # the pin is needed: the two tokens that survive at 5 patches are not interchangeable at 4
    swapped = ShiftedTokens()
    swapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        swapped.tokens[[1, 2]] = model.tokens[[2, 1]]
    x = torch.randn(2, 4, PATCH, dtype=torch.float64)
    with torch.no_grad():
        assert (swapped.double()(x) - model.double()(x)).abs().max() > 1e-3


class RotaryWritten(nn.Module):
    """Attention with rotary embedding on the first 4 of 8 dimensions per head, the rotated and the passed parts
    written into an ``empty_like`` buffer (mixed channels written by slice) instead of concatenated."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(PATCH, WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 3)

    @staticmethod
    def rotary(t):
        angle = torch.arange(t.shape[2], dtype=t.dtype)[:, None] * torch.tensor([1.0, 0.3, 1.0, 0.3], dtype=t.dtype)
        half = t[..., :4]
        buf = torch.empty_like(t)
        buf[..., :4] = half * angle.cos() + torch.cat([-half[..., 2:], half[..., :2]], -1) * angle.sin()
        buf[..., 4:] = t[..., 4:]
        return buf

    def forward(self, patches):
        x = self.embed(patches)
        q, k, v = (f(x).unflatten(-1, (2, WIDTH // 2)).transpose(1, 2) for f in (self.q, self.k, self.v))
        attention = torch.softmax(self.rotary(q) @ self.rotary(k).transpose(-1, -2) / 3, -1)
        return self.head((x + self.o((attention @ v).transpose(1, 2).flatten(2))).mean(1))


def test_rotary_halves_written_into_a_buffer_keep_the_attention_groups():
    subject = symgraph.load(noisy(RotaryWritten()), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    groups = census(subject)
    assert groups["qk rotary/positive 8x2"] == groups["vo orthogonal 8x2"] == groups["heads permutation 2x1"] == 1, \
        groups


class GroupedQueries(nn.Module):
    """Grouped-query attention (4 query heads, 2 key/value heads); with ``written`` each key/value head is copied
    into an empty buffer by two strided writes along the head axis (head h reads key/value head h // 2) instead of
    ``repeat_interleave``."""

    def __init__(self, written: bool):
        super().__init__()
        self.written = written
        self.embed = nn.Linear(PATCH, WIDTH)
        self.q, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.k, self.v = nn.Linear(WIDTH, WIDTH // 2), nn.Linear(WIDTH, WIDTH // 2)
        self.head = nn.Linear(WIDTH, 3)

    def repeat(self, t):
        if not self.written:
            return t.repeat_interleave(2, 1)
        buf = t.new_empty(t.shape[0], 4, *t.shape[2:])
        buf[:, 0::2] = t
        buf[:, 1::2] = t
        return buf

    def forward(self, patches):
        x = self.embed(patches)
        q = self.q(x).unflatten(-1, (4, WIDTH // 4)).transpose(1, 2)
        k, v = (f(x).unflatten(-1, (2, WIDTH // 4)).transpose(1, 2) for f in (self.k, self.v))
        attention = torch.softmax(q @ self.repeat(k).transpose(-1, -2) / 2, -1)
        return self.head((x + self.o((attention @ self.repeat(v)).transpose(1, 2).flatten(2))).mean(1))


def test_key_value_heads_written_along_the_head_axis_keep_the_grouped_query_groups():
    subject = symgraph.load(noisy(GroupedQueries(written=True)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    groups = census(subject)
    assert groups == census(symgraph.load(noisy(GroupedQueries(written=False)), (torch.randn(2, 5, PATCH),)))
    assert groups["vo orthogonal 4x2"] == 1 and groups["residual general_linear 16x1"] == 1, groups
