"""Expert-choice routing (examples/handwritten_zoo.py ``moe_expert_choice``): each expert takes its top tokens by
a top-k over the token axis, so the expert order lives in the layout of integer index tensors, (experts, capacity)
rows of token positions. Top-k keeps the rows' coordinates on both of its results; a pick by such indices
(``x[rows]``, ``index_select``) lays the picked tokens out by expert, and ``index_add`` of those rows sums the
entries in any order (the index's layout is tied to the added values' and summed out). Every other op reading
such indices pins their coordinates (analysis/walk.py ``_FOLLOWS_LAYOUTS``).

Positive forms get the expert permutation of the 3-D expert tensors with the router rows, a float64 fuzz at two
shapes and exact recovery; the other index readers (gather, embedding, one_hot, index_put, scatter_add) and a
router row read on its own pin it, each checked by the fuzz (and, for the last, the naive swap shown to change the
function).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.alignment import align_states
from symgraph.elements import apply, sample

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, E, HIDDEN, TOKENS = 8, 3, 6, 6


class ExpertChoice(nn.Module):
    """``inp -> x + experts(norm(x)) -> out``; each of E experts (3-D weights) takes its top half of the tokens.

    ``form``: ``index_add`` (the zoo's: ``flat[rows]``, ``index_add`` back), ``index_select`` (the tokens picked
    by ``index_select`` over the flattened rows), ``two_routers`` (tokens picked by one router's choice, added
    back at another's), ``first_gate`` (every expert's output scaled by expert 0's gates), or a reader of the
    indices that does not follow their layout: ``gather``, ``embedding``, ``one_hot``, ``index_put``,
    ``scatter_add``."""

    def __init__(self, form="index_add"):
        super().__init__()
        self.form = form
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)
        self.router = nn.Linear(D, E, bias=False)
        self.second = nn.Linear(D, E, bias=False) if form == "two_routers" else None
        self.w_in = nn.Parameter(torch.randn(E, D, HIDDEN) / 3)
        self.w_out = nn.Parameter(torch.randn(E, HIDDEN, D) / 3)
        self.table = nn.Parameter(torch.randn(64, D) / 3) if form == "embedding" else None

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.experts(self.norm(h).reshape(-1, D)).view_as(h))

    def experts(self, flat):
        capacity = max(1, flat.shape[0] // 2)
        gate, rows = self.router(flat).softmax(-1).t().topk(capacity, -1)  # (E, capacity) each
        picked = flat.index_select(0, rows.reshape(-1)).view(E, capacity, D) if self.form == "index_select" \
            else flat[rows]
        hidden = F.relu(torch.einsum("ecd,edh->ech", picked, self.w_in))
        y = torch.einsum("ech,ehd->ecd", hidden, self.w_out)
        y = y * (gate[:1] if self.form == "first_gate" else gate)[..., None]
        back = rows
        if self.form == "two_routers":
            back = self.second(flat).softmax(-1).t().topk(capacity, -1)[1]
        out = torch.zeros_like(flat)
        if self.form == "index_put":
            return out.index_put((back.reshape(-1),), y.reshape(-1, D), accumulate=True)
        if self.form == "scatter_add":
            return out.scatter_add(0, back.reshape(-1, 1).expand(-1, D), y.reshape(-1, D))
        out = out.index_add(0, back.reshape(-1), y.reshape(-1, D))
        if self.form == "gather":
            out = out + torch.gather(flat[:, :1].t().expand(E, -1), 1, rows).sum()
        elif self.form == "embedding":
            out = out + F.embedding(rows, self.table).sum((0, 1))
        elif self.form == "one_hot":
            out = out * F.one_hot(rows, flat.shape[0]).sum((0, 1)).to(out.dtype)[:, None]
        return out



def _load(form, dtype=torch.float32):
    torch.manual_seed(1)
    model = noisy(ExpertChoice(form)).to(dtype)
    return model, symgraph.load(model, (torch.randn(2, TOKENS, D, dtype=dtype),))


def experts_of(subject):
    return [g for g in subject.report.groups if g.motif == "experts"]


@pytest.mark.parametrize("form", ["index_add", "index_select"])
def test_experts_choosing_tokens_move_with_their_router_rows(form):
    _, subject = _load(form)
    experts = experts_of(subject)
    assert [(g.kind, g.size) for g in experts] == [("permutation", E)], census(subject)
    assert {(m.param, m.axis) for m in experts[0].members} == {("router.weight", 0), ("w_in", 0), ("w_out", 0)}
    units = [g for g in subject.report.groups if g.motif == "ffn" and g.size == HIDDEN]
    assert {(m.param, m.axis) for g in units for m in g.members} == {("w_in", 2), ("w_out", 1)}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_align_states_undoes_a_random_element_of_expert_choice_exactly():
    _, subject = _load("index_add", torch.float64)
    groups, state = subject.report.groups, subject.state_dict()
    rng = np.random.default_rng(4)
    elements = next(draw for draw in ([sample(g, rng) for g in groups] for _ in range(20))
                    if not next(e for e in draw if e.group.motif == "experts").is_identity())
    result = align_states(groups, apply(state, elements), state, mode="full")
    assert result.distance_after < 1e-9 < 0.3 < result.distance_before


def test_tokens_added_back_at_another_routers_choice_move_both_routers():
    """The tokens an expert processed (router A's choice) are added back where router B's choice of that expert
    says: the entries are tied, so both routers' rows move with the experts. Moving router A alone changes the
    function."""
    model, subject = _load("two_routers", torch.float64)
    (g,) = experts_of(subject)
    assert {(m.param, m.axis) for m in g.members} >= {("router.weight", 0), ("second.weight", 0)}, census(subject)
    assert naive_swap_change(model, subject.state_dict()) > 1e-3
    assert_fuzzed_at_two_shapes(subject)


def naive_swap_change(model: nn.Module, state: dict) -> float:
    """Relative float64 output change when experts 0 and 1 trade places with router A's rows only."""
    naive = {k: (v[[1, 0, 2]] if k in ("router.weight", "w_in", "w_out") else v) for k, v in state.items()}
    x = torch.randn(3, 11, D, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(naive)
        after = model(x)
    return float((after - before).norm() / before.norm())


def test_one_experts_gates_read_by_all_keep_that_expert_in_place():
    """Every expert's output is scaled by expert 0's gates (``gate[:1]``): expert 0 must stay, the other two may
    still trade places. Moving expert 0 changes the function."""
    model, subject = _load("first_gate", torch.float64)
    (g,) = experts_of(subject)
    router = next(m for m in g.members if m.param == "router.weight")
    assert g.size == 2 and 0 not in router.index, census(subject)
    assert naive_swap_change(model, subject.state_dict()) > 1e-3
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["gather", "embedding", "one_hot", "index_put", "scatter_add"])
def test_other_readers_of_the_token_indices_pin_their_layout(form):
    """Ops that read the (experts, capacity) indices without following which expert each row is: the rows'
    coordinates (the router's) are pinned, so no expert permutation is emitted, and every group found passes
    the float64 fuzz."""
    _, subject = _load(form)
    assert experts_of(subject) == [], census(subject)
    reasons = [p.reason for p in subject.report.pinned if "router.weight" in p.params]
    assert any("indices laid out along coordinates" in r for r in reasons), reasons
    assert_fuzzed_at_two_shapes(subject)
