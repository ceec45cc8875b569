"""The alignment's fast paths give what the plain ones give: per-layer member sums (symgraph.solve.sums) equal sums
read afresh after any moves, alignment lands where it lands without them, in-place moves through slice views
equal the copying application, and assignments read off bfloat16 cost estimates (only where their error bound
proves them) are the ones the exact costs give."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.elements import Element, apply, apply_in_place, sample
from symgraph.fold import folded_subject
from symgraph.solve import dispatch, kernels, sums, workspace
from symgraph.solve.workspace import Workspace


def _pair(folded: bool):
    a, b = zoo.build("llama", seed=0, dtype=torch.float64), zoo.build("llama", seed=1, dtype=torch.float64)
    subjects = [symgraph.load(m, zoo.example_inputs_for("llama", m)) for m in (a, b)]
    if folded:
        subjects = [folded_subject(s) for s in subjects]
    return subjects[0].report.groups, subjects[1].state_dict(), subjects[0].state_dict()


def _fresh(ws: Workspace) -> Workspace:
    return Workspace({k: v.clone() for k, v in ws.src.items()}, ws.anc)


@pytest.mark.parametrize("folded", [False, True])
def test_cached_residual_sums_follow_every_move(folded):
    groups, source, anchor = _pair(folded)
    residual = next(g for g in groups if g.motif == "residual")
    inner = [g for g in groups if g.motif != "residual"]
    assert len({sums.layer_of(m.param) for m in residual.members}) > 2  # spans layers: its sums are kept
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    primal = [m for m in residual.members if m.action != "dual"]
    rng = np.random.default_rng(0)
    for step, g in enumerate([residual, inner[0], residual, inner[-1], residual]):
        cached = ws.cross(primal, residual), ws.similarity(residual.members, residual, normalise=False)
        if step:  # after a move: the kept sums must equal sums read afresh from the moved source
            fresh = _fresh(ws)
            np.testing.assert_allclose(cached[0], fresh.cross(primal, residual), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(cached[1], fresh.similarity(residual.members, residual, normalise=False),
                                       rtol=1e-12, atol=1e-12)
        element = sample(g, rng)
        apply_in_place(ws.src, [element])
        ws.moved([element])
    assert any(e.versions == tuple(ws.sums.version[p] for p in e.params) for e in ws.sums._entries.values())


@pytest.mark.parametrize("mode", ["full", "permutation"])
def test_alignment_is_the_same_with_and_without_kept_sums(mode, monkeypatch):
    groups, source, anchor = _pair(folded=mode == "full")
    chosen = select_groups(groups, mode)
    kept = align_states(chosen, source, anchor, mode=mode, rounds=3)
    monkeypatch.setattr(sums, "MIN_FEATURES", 10**12)  # nothing kept: every sum read afresh
    fresh = align_states(chosen, source, anchor, mode=mode, rounds=3)
    assert kept.distance_after < kept.distance_before
    assert kept.distance_after == pytest.approx(fresh.distance_after, rel=1e-9)
    for k in fresh.state:
        torch.testing.assert_close(kept.state[k], fresh.state[k], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_in_place_moves_equal_the_copying_application(family):
    model = zoo.build(family, seed=0, dtype=torch.float64)
    groups = symgraph.load(model, zoo.example_inputs_for(family, model)).report.groups
    state = model.state_dict()
    elements = [sample(g, np.random.default_rng(3)) for g in groups]
    work = {k: v.clone() for k, v in state.items()}
    apply_in_place(work, elements)
    expected = apply(state, elements)
    assert any(not torch.equal(expected[k], state[k]) for k in state)
    for k in state:
        torch.testing.assert_close(work[k], expected[k], rtol=0, atol=0)


# -- bfloat16 cost estimates ---------------------------------------------------------------------------------------
def test_certain_row_maxima_are_the_assignment_of_every_matrix_within_the_bound():
    rng = np.random.default_rng(0)
    n = 40
    s = rng.normal(size=(n, n)) * 0.1 + 3 * np.eye(n)[rng.permutation(n)]
    bound = np.full((n, n), 0.2)
    perm = kernels.certain_row_maxima(s, bound)
    assert perm is not None
    for _ in range(20):
        np.testing.assert_array_equal(kernels.hungarian(s + rng.uniform(-0.2, 0.2, size=s.shape)), perm)
    assert kernels.certain_row_maxima(s, np.full((n, n), 2.0)) is None  # gaps inside the bound: undecided
    tied = s.copy()
    tied[0] = tied[1]  # two rows want one column
    assert kernels.certain_row_maxima(tied, bound) is None


def _members_workspace(features: int, seed: int):
    """A one-member permutation group over ``features`` all-positive features (worst case for rounding: nothing
    cancels), as a Workspace and its group."""
    from symgraph.groups import Group, Member

    g = torch.Generator().manual_seed(seed)
    anc = torch.rand(48, features, generator=g)
    src = anc[torch.randperm(48, generator=g)] + 0.01 * torch.rand(48, features, generator=g)
    member = Member("w", 0, np.arange(48).reshape(1, 48, 1))
    group = Group(id="g", kind="permutation", motif="ffn", layer="l", size=48, copies=1, members=(member,))
    return Workspace({"w": src}, {"w": anc}), group, member


@pytest.mark.parametrize("features", [64, 30000])
def test_bfloat16_estimates_stay_within_their_bound(features):
    ws, group, member = _members_workspace(features, seed=features)
    estimate = ws.similarity_estimate([member], group)
    if not workspace._bf16_matmul_is_fast(torch.device("cpu")):  # no bfloat16 matrix unit: exact costs only
        assert estimate is None
        return
    value, bound = estimate
    exact = (ws.anc["w"].double() @ ws.src["w"].double().T).numpy()[None]
    error = np.abs(value - exact)
    assert np.all(error <= bound) and error.max() > 0  # rounded, and within the bound
    assert bound.max() < 0.05 * np.abs(exact).max()  # yet tight enough to decide clear assignments


def _noisy_copy():
    a = zoo.build("llama", seed=0)
    subject = symgraph.load(a, zoo.example_inputs_for("llama", a))
    moved = symgraph.apply(subject.state_dict(), symgraph.sample_elements(subject.report, seed=7),
                           dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    for v in moved.values():
        if v.is_floating_point() and v.numel() > 1:
            v.add_(0.01 * float(v.std()) * torch.randn(v.shape, generator=generator))
    return subject.report.groups, moved, subject.state_dict()


@pytest.mark.parametrize("mode", ["full", "permutation"])
def test_alignment_is_the_same_with_and_without_bfloat16_estimates(mode, monkeypatch):
    groups, source, anchor = _noisy_copy()
    chosen = select_groups(groups, mode)
    decided, certain_row_maxima = [], kernels.certain_row_maxima

    def recording(s, bound):
        perm = certain_row_maxima(s, bound)
        decided.append(perm is not None)
        return perm

    monkeypatch.setattr(kernels, "certain_row_maxima", recording)
    estimated = align_states(chosen, source, anchor, mode=mode)
    fast = workspace._bf16_matmul_is_fast(torch.device("cpu"))
    monkeypatch.setattr(workspace, "_bf16_matmul_is_fast", lambda device: False)  # exact costs only
    exact = align_states(chosen, source, anchor, mode=mode)
    if mode == "full":  # on this noisy copy the estimates decide assignments wherever bfloat16 is fast
        assert any(decided) == fast
    assert [e.group.id for e in estimated.elements] == [e.group.id for e in exact.elements]
    for e, f in zip(estimated.elements, exact.elements):
        for field in ("perm", "diag", "matrices"):
            x, y = getattr(e, field), getattr(f, field)
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
    assert estimated.distance_after == exact.distance_after


def test_a_stale_kept_sum_is_read_again_after_its_group_moves():
    """An estimate reads a moved layer without refreshing its kept sum; when the residual group then moves, that
    stale sum must not be carried along as if it were current."""
    groups, source, anchor = _pair(folded=False)
    residual = next(g for g in groups if g.motif == "residual")
    inner = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    rng = np.random.default_rng(1)
    ws.similarity(residual.members, residual, normalise=False)  # kept sums for every layer
    unsigned = Element(residual, perm=sample(residual, rng).perm, diag=np.ones((1, residual.size)))  # followable
    for element in (sample(inner, rng), unsigned):  # one layer stale, then the residual moves
        apply_in_place(ws.src, [element])
        ws.moved([element])
    np.testing.assert_allclose(ws.similarity(residual.members, residual, normalise=False),
                               _fresh(ws).similarity(residual.members, residual, normalise=False),
                               rtol=1e-12, atol=1e-12)
