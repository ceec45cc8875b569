"""GL(d_head) alignment of QK and VO (``general_linear=True``): the widened groups are sound (fuzzed in float64 at
two input shapes), a GL-reparametrised model comes back exactly, one solve is never farther than Procrustes, and
every map it keeps is well conditioned."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, general_linear_heads, select_groups
from symgraph.elements import apply, sample
from symgraph.fuzz import fuzz
from symgraph.solve import dispatch, kernels
from symgraph.solve.workspace import Workspace


def _subject(family, seed=0, batch=2, seq=7):
    model = zoo.build(family, seed=seed, dtype=torch.float64)
    return symgraph.load(model, zoo.example_inputs_for(family, model, batch=batch, seq=seq))


def test_widening_replaces_the_orthogonal_heads_and_drops_the_rescale():
    groups = _subject("bert").report.groups
    widened = general_linear_heads(groups)
    assert {g.kind for g in widened if g.motif in ("qk", "vo")} == {"general_linear"}
    assert len(widened) == len(groups) - sum(1 for g in groups if g.id.startswith("qk-rescale:"))
    assert select_groups(groups, "paper", general_linear=True) == select_groups(groups, "paper")  # full mode only


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "llama"])  # llama: RoPE keeps its QK rotary; VO widens
def test_widened_head_groups_fuzz_clean_at_two_shapes(family):
    subject = _subject(family)
    widened = [g for g in general_linear_heads(subject.report.groups) if g.kind == "general_linear"
               and g.motif in ("qk", "vo")]
    assert widened
    other = symgraph.load(subject.model, zoo.example_inputs_for(family, subject.model, batch=3, seq=11, seed=4))
    for s in (subject, other):
        outcome = fuzz(s, groups=widened[:2], samples=6)
        assert outcome.ok, outcome.failures


def test_a_general_linear_reparametrisation_is_recovered_exactly():
    subject = _subject("bert")
    groups = select_groups(subject.report.groups, "full", general_linear=True)
    anchor = subject.state_dict()
    source = apply(anchor, [sample(g, np.random.default_rng(5)) for g in groups])
    result = align_states(groups, source, anchor, mode="full")
    assert result.distance_before > 0.2
    assert result.distance_after < 1e-6, result.distance_after


def test_one_solve_is_never_farther_than_procrustes_and_stays_well_conditioned():
    a, b = _subject("bert", seed=0), _subject("bert", seed=1)
    for group in (g for g in a.report.groups if g.motif in ("qk", "vo") and g.kind == "orthogonal"):
        wide = general_linear_heads([group])[0]
        ws = Workspace(b.state_dict(), a.state_dict(), ())
        ctx = dispatch.SolveContext()
        orthogonal = dispatch.solve_orthogonal_together(ws, [(group, list(group.members), ctx)])[0]
        general = dispatch.solve(ws, wide, list(wide.members), ctx)
        assert dispatch._element_cost(ws, wide.members, general[0]) <= \
            dispatch._element_cost(ws, group.members, orthogonal[0]) * (1 + 1e-9)
        assert np.all(np.linalg.cond(general[0].matrices) <= kernels.MAX_CONDITION)


def test_align_general_linear_end_to_end_keeps_the_function():
    a, b = _subject("bert", seed=0), _subject("bert", seed=1)
    plain = symgraph.align(b, a, fold=False)
    wide = symgraph.align(b, a, fold=False, general_linear=True)
    assert wide.verified_error is not None and wide.verified_error < 1e-9
    assert any(e.group.kind == "general_linear" and e.group.motif in ("qk", "vo") for e in wide.elements)
    assert wide.distance_after < plain.distance_before
