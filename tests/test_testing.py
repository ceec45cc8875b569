"""symgraph.testing: the strategies work inside another project's hypothesis tests."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings

import symgraph
from symgraph.testing import architectures, element_lists, equivalent_variants, group_elements
from symgraph.verify import Evaluator

MLP_INPUT = torch.randn(3, 4)


def mlp_subject():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 2))
    return symgraph.load(model, (MLP_INPUT,))


SUBJECT = mlp_subject()
EVALUATOR = Evaluator(SUBJECT.model, SUBJECT.args, SUBJECT.kwargs)


@settings(max_examples=20, database=None, deadline=None)
@given(equivalent_variants(SUBJECT))
def test_equivalent_variants_compute_the_same_function(state):
    assert EVALUATOR.check(state).ok


@settings(max_examples=20, database=None, deadline=None)
@given(group_elements(SUBJECT.report.groups[0]))
def test_relu_group_elements_are_positive_scaled_permutations(element):
    assert sorted(element.perm[0]) == list(range(8))
    assert np.all(element.diag > 0)


TWO_UNITS = symgraph.analyze(torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.ReLU(), torch.nn.Linear(2, 3)),
                             inputs=(MLP_INPUT,)).groups[0]


@settings(max_examples=30, database=None, deadline=None)
@given(group_elements(TWO_UNITS))
def test_a_permutation_of_two_units_is_never_the_identity(element):
    """Half of all permutations of two are the identity: a fuzz drawing them would check nothing half the time
    (a token pair a reshape groups only at some lengths went unseen at 3 samples)."""
    assert TWO_UNITS.kind == "permutation" and TWO_UNITS.size == 2
    assert element.perm[0].tolist() == [1, 0]


@settings(max_examples=10, database=None, deadline=None)
@given(element_lists(SUBJECT.report.groups))
def test_element_lists_cover_every_group(elements):
    assert [e.group.id for e in elements] == [g.id for g in SUBJECT.report.groups]


@settings(max_examples=5, database=None, deadline=None)
@given(architectures())
def test_architectures_name_zoo_families(family):
    from symgraph import zoo

    assert family in zoo.FAMILIES


def test_bad_argument_is_refused_early():
    import pytest

    with pytest.raises(TypeError, match="Group"):
        group_elements("not a group")
