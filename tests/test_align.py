"""Alignment: exact recovery of a randomly reparametrised model, modes, and refusals."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.elements import apply, sample
from symgraph.errors import SymgraphError

@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_random_group_element_is_recovered_exactly(family):
    model = zoo.build(family, seed=0, dtype=torch.float64)
    subject = symgraph.load(model, zoo.example_inputs_for(family, model))
    anchor = {k: v.detach() for k, v in subject.state_dict().items()}
    source = apply(anchor, [sample(g, np.random.default_rng(7)) for g in subject.report.groups])
    result = align_states(subject.report.groups, source, anchor, mode="full")
    assert result.distance_before > 0.5
    assert result.distance_after < 1e-6, result.distance_after


def test_modes_select_their_groups():
    model = zoo.build("llama", seed=0)
    groups = symgraph.load(model, zoo.example_inputs_for("llama", model)).report.groups
    perm = select_groups(groups, "permutation")
    assert perm and all(g.kind in ("permutation", "signed_permutation") for g in perm)
    paper = select_groups(groups, "paper")
    assert {g.motif for g in paper} <= {"qk", "vo", "ffn"} and not any(g.motif == "residual" for g in paper)
    assert select_groups(groups, "full", only="ffn") == [g for g in groups if g.motif == "ffn"]
    assert all("layers.0." in g.layer + "." for g in select_groups(groups, "full", layers=(0, 0)))
    with pytest.raises(SymgraphError, match="full, paper, permutation"):
        select_groups(groups, "best")
