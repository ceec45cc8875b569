"""Head permutations when two attention ops read the same coordinates (found by the hand-written sweep's wider net).

ResFormer-style value residuals add the first layer's values to every later layer's, and cross-layer KV sharing
lets a layer attend to keys and values an earlier layer computed. The value coordinates of head h are then one
class read by the heads of several attention ops. Each op's head permutation was built alone: it moved the shared
value rows (the whole class) and its own queries and keys, but not the other layers' queries and keys, which then
met the values of another head (relative output change 5e-2 in float64). The ops that share a class are now
permuted together by one group, and a block run twice (its heads read the same rows each time) is one op.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

WIDTH, HEADS, VOCAB = 16, 4, 40
HEAD_DIM = WIDTH // HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def split(self, t):
        return t.view(*t.shape[:2], HEADS, HEAD_DIM).transpose(1, 2)

    def attend(self, q, k, v):
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)).masked_fill(causal, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(q.shape[0], n, WIDTH))


class SharedValues(nn.Module):
    """Three layers; ``mode="value_residual"``: every later layer's values are averaged with the first layer's;
    ``mode="cross_layer_kv"``: the later layers attend to the first layer's keys and values."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = nn.ModuleList(Attention() for _ in range(3))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 32), nn.GELU(), nn.Linear(32, WIDTH))
                                 for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        first = None
        for attn, mlp in zip(self.attn, self.mlp):
            q, k, v = (attn.split(p(x)) for p in (attn.q, attn.k, attn.v))
            if first is None:
                first = (k, v)
            elif self.mode == "value_residual":
                v = 0.5 * (v + first[1])
            else:
                k, v = first
            x = x + attn.attend(q, k, v)
            x = x + mlp(x)
        return self.head(x)



@pytest.mark.parametrize("mode", ["value_residual", "cross_layer_kv"])
def test_heads_that_share_values_across_layers_move_together(mode):
    torch.manual_seed(0)
    subject = symgraph.load(noisy(SharedValues(mode)), (torch.randint(0, VOCAB, (2, 7)),))
    assert_fuzzed_at_two_shapes(subject)
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert len(heads) == 1 and heads[0].size == HEADS
    moved = {m.param for m in heads[0].members}
    assert {f"attn.{i}.q.weight" for i in range(3)} <= moved  # every layer's queries move with the values


def test_one_layers_head_permutation_alone_changes_a_value_residual_model():
    # what the separate per-layer groups did: the first layer's heads permuted (its values too) and no other
    torch.manual_seed(0)
    model = noisy(SharedValues("value_residual")).double()
    ids = torch.randint(0, VOCAB, (2, 9))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    perm = torch.tensor([1, 0, 3, 2])
    rows = (perm[:, None] * HEAD_DIM + torch.arange(HEAD_DIM)).reshape(-1)
    for name in ("q", "k", "v"):
        state[f"attn.0.{name}.weight"] = state[f"attn.0.{name}.weight"][rows]
        state[f"attn.0.{name}.bias"] = state[f"attn.0.{name}.bias"][rows]
    state["attn.0.o.weight"] = state["attn.0.o.weight"][:, rows]
    before = model(ids)
    model.load_state_dict(state)
    assert not torch.allclose(model(ids), before, rtol=1e-6, atol=1e-9)


def test_a_block_run_twice_keeps_one_head_permutation_and_its_query_heads_within_kv_groups():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.q, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
            self.kv = nn.Linear(WIDTH, WIDTH)  # keys and values of two KV heads, two query heads each
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, ids):
            x = self.embed(ids)
            b, n, _ = x.shape
            for _ in range(2):
                q = self.q(x).view(b, n, HEADS, HEAD_DIM).transpose(1, 2)
                k, v = self.kv(x).view(b, n, 2, 2, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                x = x + self.o(out.transpose(1, 2).reshape(b, n, WIDTH))
            return self.head(x)

    subject = symgraph.load(noisy(Shared()), (torch.randint(0, VOCAB, (2, 7)),))
    heads = sorted((g.size, g.copies) for g in subject.report.groups if g.motif == "heads")
    assert heads == [(2, 1), (2, 2)]  # KV groups, and query heads within each: one of each, not one per call
    assert_fuzzed_at_two_shapes(subject)


class Retention(nn.Module):
    """RetNet-style retention: (q k^T * D) v with a causal decay mask D = gamma_h^(i - j), one rate per head (a
    buffer), no softmax."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = Attention()
        self.register_buffer("gammas", 1 - 2.0 ** (-2 - torch.arange(HEADS, dtype=torch.float)))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        n = x.shape[1]
        a = self.attn
        q, k, v = (a.split(p(x)) for p in (a.q, a.k, a.v))
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        decay = self.gammas.view(HEADS, 1, 1) ** (i - j).clamp_min(0) * (j <= i)
        out = (q @ k.transpose(-1, -2) * decay) @ v
        return self.head(x + a.o(out.transpose(1, 2).reshape(x.shape)))


def test_per_head_decay_rates_block_head_permutations_only():
    # the decay, data that differs from head to head, made the head labels of q k^T a mixed channel, and resolving
    # it pinned every value and output coordinate: the per-head VO groups were lost with the head permutation
    subject = symgraph.load(noisy(Retention()), (torch.randint(0, VOCAB, (2, 7)),))
    motifs = {g.motif for g in subject.report.groups}
    assert {"qk", "vo"} <= motifs and "heads" not in motifs
    assert_fuzzed_at_two_shapes(subject)


class ParameterRotaryRow(nn.Module):
    """MLCD-style rotary table: the class token's row is cos/sin of a parameter, the other rows come from positions
    (data). Permuting the heads' values and outputs alone changed MLCD's outputs (relative 6e-2 in float64) when
    the queries and keys were pinned; the parameter is read as data now (tests/test_rotary_learned_rows.py), and
    the heads move with their queries and keys."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.attn = Attention()
        self.class_angle = nn.Parameter(torch.randn(1, HEAD_DIM // 2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        n = x.shape[1]
        angles = torch.arange(n - 1, dtype=x.dtype)[:, None] * 0.3 ** torch.arange(HEAD_DIM // 2, dtype=x.dtype)
        angles = torch.cat([self.class_angle, angles]).repeat(1, 2)  # (n, HEAD_DIM)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # broadcast over heads

        def rotate(t):  # (b, n, heads, d)
            half = torch.cat([-t[..., HEAD_DIM // 2:], t[..., :HEAD_DIM // 2]], -1)
            return t * cos + half * sin

        a = self.attn
        q, k = (rotate(p(x).view(*x.shape[:2], HEADS, HEAD_DIM)).transpose(1, 2) for p in (a.q, a.k))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, a.split(a.v(x)))
        return self.head(x + a.o(out.transpose(1, 2).reshape(x.shape)))


def test_heads_whose_queries_meet_a_table_with_learned_rows_move_their_queries():
    subject = symgraph.load(noisy(ParameterRotaryRow()), (torch.randint(0, VOCAB, (2, 7)),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert heads and all({"attn.q.weight", "attn.k.weight"} <= {p for m in g.members for p in m.params}
                         for g in heads)
    assert "vo" in {g.motif for g in subject.report.groups}
    assert_fuzzed_at_two_shapes(subject)


class TableRotaryLayers(nn.Module):
    """RoFormer-style rotary: one cos/sin table, read from a parameter, rotates the queries and keys of every layer
    (``mode="values_too"``: and the values, which every later layer averages with the first layer's, as above;
    ``mode="head_zero_gate"``: the first layer's head 0 output scales every head's queries of the later layers)."""

    def __init__(self, mode: str = "plain"):
        super().__init__()
        self.mode = mode
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.table = nn.Parameter(torch.randn(32, HEAD_DIM))  # cos in the first half, sin in the second
        self.attn = nn.ModuleList(Attention() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def rotate(self, t):  # (b, heads, n, d)
        half = HEAD_DIM // 2
        cos, sin = (self.table[:t.shape[2], part].repeat_interleave(2, -1) for part in (slice(half), slice(half, None)))
        return t * cos + torch.stack([-t[..., 1::2], t[..., 0::2]], -1).reshape_as(t) * sin

    def forward(self, ids):
        x = self.embed(ids)
        first_v = first_out = None
        for attn in self.attn:
            q, k, v = (attn.split(p(x)) for p in (attn.q, attn.k, attn.v))
            q, k = self.rotate(q), self.rotate(k)
            if self.mode == "values_too":
                v = self.rotate(v)
                first_v = v if first_v is None else first_v
                v = 0.5 * (v + first_v)
            if self.mode == "head_zero_gate" and first_out is not None:
                q = q * first_out[:, :1]
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            first_out = out if first_out is None else first_out
            x = x + attn.o(out.transpose(1, 2).reshape(x.shape))
        return self.head(x)


def _moved_layers(group) -> set[str]:
    return {m.param.split(".")[1] for m in group.members if m.param.startswith("attn.")}


def test_a_rotary_table_every_layer_reads_leaves_each_layers_heads_their_own_permutation():
    # the table's entries scale the same coordinate of every head of every layer and stay where they are when heads
    # move; following them as links between attention ops joined all layers into one set that the head matching
    # could not pair up, and RoFormer had no head group at all
    subject = symgraph.load(noisy(TableRotaryLayers()), (torch.randint(0, VOCAB, (2, 7)),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert sorted(_moved_layers(g).pop() for g in heads) == ["0", "1", "2"]
    assert all(len(_moved_layers(g)) == 1 and g.size == HEADS for g in heads)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("mode", ["values_too", "head_zero_gate"])
def test_layers_joined_by_data_as_well_as_a_rotary_table_are_not_permuted_apart(mode):
    # guards: a value residual still ties the layers whose values it shares (no layer's heads move alone), and
    # heads whose output another layer reads by index stay where they are
    subject = symgraph.load(noisy(TableRotaryLayers(mode)), (torch.randint(0, VOCAB, (2, 7)),))
    for group in (g for g in subject.report.groups if g.motif == "heads"):
        assert "0" not in _moved_layers(group) or _moved_layers(group) == {"0", "1", "2"}
    assert_fuzzed_at_two_shapes(subject)
