"""Group elements: sampling respects each kind, application follows the primal/dual/permute conventions, and
inputs are never modified."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph.elements import Element, apply, composed_matrices, identity, sample
from symgraph.groups import Group, Member


def linear_pair_group(kind, **extra) -> Group:
    """T on the 3 hidden units between two linears: rows of a.weight/a.bias primal, columns of b.weight dual."""
    idx = np.arange(3).reshape(1, 3, 1)
    members = (Member("a.weight", 0, idx, "primal"), Member("a.bias", 0, idx, "primal"),
               Member("b.weight", 1, idx, "dual"))
    return Group(id=f"test:{kind}", motif="other", kind=kind, size=3, copies=1, members=members, **extra)


@pytest.fixture
def net():
    torch.manual_seed(0)
    return torch.nn.ModuleDict({"a": torch.nn.Linear(2, 3), "b": torch.nn.Linear(3, 2, bias=False)}).double()


def forward(state, x):
    h = x @ state["a.weight"].T + state["a.bias"]
    return h @ state["b.weight"].T


@pytest.mark.parametrize("kind,extra", [("general_linear", {}), ("orthogonal", {}), ("permutation", {}),
                                        ("signed_permutation", {}), ("permutation", {"scale": "nonzero"})])
def test_linear_pairs_are_invariant_and_inputs_untouched(net, kind, extra):
    state = {k: v.detach() for k, v in net.state_dict().items()}
    frozen = {k: v.clone() for k, v in state.items()}
    element = sample(linear_pair_group(kind, **extra), np.random.default_rng(0))
    new = apply(state, [element])
    x = torch.randn(5, 2, dtype=torch.float64)
    assert torch.allclose(forward(new, x), forward(state, x), atol=1e-12)
    assert not torch.allclose(new["a.weight"], state["a.weight"])
    for k in state:
        assert torch.equal(state[k], frozen[k])


def test_identity_changes_nothing(net):
    state = {k: v.detach() for k, v in net.state_dict().items()}
    new = apply(state, [identity(linear_pair_group("orthogonal"))])
    assert all(torch.equal(new[k], state[k]) for k in state)


def test_monomial_convention_rows_and_columns():
    group = linear_pair_group("permutation", scale="nonzero")
    state = {"a.weight": torch.arange(6.).reshape(3, 2), "a.bias": torch.arange(3.),
             "b.weight": torch.arange(6.).reshape(2, 3)}
    element = symgraph.Element(group, perm=np.array([[2, 0, 1]]), diag=np.array([[2.0, -1.0, 0.5]]))
    new = apply(state, [element])
    assert torch.equal(new["a.bias"], torch.tensor([2 * 2.0, -1 * 0.0, 0.5 * 1.0]))
    assert torch.equal(new["b.weight"][:, 0], state["b.weight"][:, 2] / 2.0)


@pytest.mark.parametrize("kind,check", [
    ("orthogonal", lambda m: np.allclose(m @ m.T, np.eye(len(m)))),
    ("general_linear", lambda m: abs(np.linalg.det(m)) > 1e-6),
])
def test_sampled_matrices_belong_to_their_group(kind, check):
    element = sample(linear_pair_group(kind), np.random.default_rng(1))
    assert all(check(m) for m in element.matrices)


def test_global_sign_is_one_sign_for_all_coordinates():
    group = linear_pair_group("permutation", global_sign=True)
    for seed in range(8):
        d = sample(group, np.random.default_rng(seed)).diag
        assert np.all(np.abs(d) == 1) and len(np.unique(d)) == 1


def test_sampled_permutations_of_two_always_swap():
    """A uniform permutation of two coordinates is the identity half the time: a fuzz's joint check or a
    transform would then move nothing there."""
    idx = np.arange(2).reshape(1, 2, 1)
    group = Group(id="pair", motif="other", kind="permutation", size=2, copies=3,
                  members=(Member("w", 0, np.stack([idx[0]] * 3), "primal"),))
    for seed in range(16):
        perm = sample(group, np.random.default_rng(seed)).perm
        assert perm.tolist() == [[1, 0]] * 3


def test_rotary_elements_rotate_pairs_and_keep_passthrough_separate():
    group = Group(id="r", motif="qk", kind="rotary", size=4, copies=1, members=(), scale="positive",
                  rotary_pairs=((0, 2),), passthrough=(1, 3))
    m = sample(group, np.random.default_rng(0)).matrices[0]
    block = m[np.ix_([0, 2], [0, 2])]
    assert np.isclose(block[0, 0], block[1, 1]) and np.isclose(block[0, 1], -block[1, 0])
    assert np.allclose(m[np.ix_([0, 2], [1, 3])], 0) and np.allclose(m[np.ix_([1, 3], [0, 2])], 0)


def test_apply_to_model_returns_a_transformed_copy():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    report = symgraph.analyze(model, inputs=(x,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    copy = symgraph.apply_to_model(model, symgraph.sample_elements(report, seed=2))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not torch.equal(copy[0].weight, model[0].weight)
    assert torch.allclose(copy(x), model(x), atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "bert", "gpt-neox"])
def test_in_place_application_matches_apply_and_the_inverse_undoes_it(family, zoo_subject):
    from symgraph.elements import apply_in_place, inverse

    subject = zoo_subject(family)
    state = {k: v.double() for k, v in subject.state_dict().items()}
    elements = symgraph.sample_elements(subject.report, seed=5)
    expected = apply(state, elements)
    work = {k: v.clone() for k, v in state.items()}
    apply_in_place(work, elements)
    assert all(torch.allclose(work[k], expected[k], rtol=1e-12, atol=1e-12) for k in state)
    apply_in_place(work, [inverse(e) for e in reversed(elements)])
    assert all(torch.allclose(work[k], state[k], rtol=1e-9, atol=1e-12) for k in state)


@pytest.mark.parametrize("kind", ["orthogonal", "general_linear"])
def test_kept_inverses_give_the_same_tensors_and_are_computed_once(net, kind, monkeypatch):
    """apply_in_place with ``inverses`` (streamed alignment: one residual rotation applied block after block):
    the dual members move by the same numbers as without, and the inverse is computed once per dtype."""
    from symgraph.elements import apply_in_place

    element = sample(linear_pair_group(kind), np.random.default_rng(0))
    state = {k: v.detach().float() for k, v in net.state_dict().items()}
    plain = {k: v.clone() for k, v in state.items()}
    apply_in_place(plain, [element])
    calls = []
    original = torch.linalg.inv
    monkeypatch.setattr(torch.linalg, "inv", lambda x: calls.append(x.dtype) or original(x))
    inverses: dict = {}
    for _ in range(3):  # three "blocks"
        kept = {k: v.clone() for k, v in state.items()}
        apply_in_place(kept, [element], inverses=inverses)
        for k in plain:
            assert torch.equal(kept[k], plain[k]), k
    assert calls == [torch.float32]


def test_composed_matrices_follow_the_coordinates_through_permutations_of_whole_copies(zoo_subject):
    """GQA LLaMA, value maps of its 2 KV groups: a map, a swap of the two groups, another map. Each group's
    rows end up moved by the second map times the first map of the group that was swapped in, as the weights say."""
    from symgraph.alignment import general_linear_heads, select_groups

    subject = zoo_subject("llama")
    groups = general_linear_heads(select_groups(subject.report.groups, "full"))
    vo = next(g for g in groups if g.motif == "vo" and g.kind == "general_linear" and g.copies == 2)
    heads = next(g for g in groups if g.motif == "heads" and g.size == 2 and g.copies == 1 and vo.layer == g.layer)
    rng = np.random.default_rng(0)
    first, second = sample(vo, rng), sample(vo, rng)
    swap = Element(heads, perm=np.array([[1, 0]]), diag=np.ones((1, 2)))
    maps = composed_matrices([first, swap, second], vo)
    assert np.allclose(maps, second.matrices @ first.matrices[::-1], atol=1e-12)
    assert np.allclose(composed_matrices([], vo), np.eye(vo.size))
    rows = next(m for m in vo.members if m.action == "primal")
    state = {k: v.double() for k, v in subject.state_dict().items()}
    before, after = state[rows.param], apply(state, [first, swap, second])[rows.param]
    for c, source_copy in ((0, 1), (1, 0)):
        moved = torch.as_tensor(maps[c]) @ before[rows.index[source_copy, :, 0]]
        assert torch.allclose(after[rows.index[c, :, 0]], moved, atol=1e-12)
