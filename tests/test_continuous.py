"""Differentiable group elements (symgraph.continuous, learned matching's direct method): every parametrised
kind lies in its group (the model's function is unchanged in float64 at several input shapes: the evaluator's
probes), the differentiable and the exact elements agree, and zero parameters are the identity."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import general_linear_heads, select_groups
from symgraph import continuous
from symgraph.continuous import ContinuousElements
from symgraph.elements import apply
from symgraph.fold import folded_subject
from symgraph.solve import kernels
from symgraph.verify import Evaluator

# llama: O(D) residual, RoPE (rotary with positive scales), GL VO, SwiGLU scales; vit: {Q : Q 1 = 1} residual,
# GL QK and VO
FAMILIES = {"llama": {"orthogonal", "rotary", "general_linear", "scale"},
            "vit": {"orthogonal", "general_linear"}}


@functools.cache
def _folded64(family):
    model = zoo.build(family, seed=0, dtype=torch.float64)
    return folded_subject(symgraph.load(model, zoo.example_inputs_for(family, model)))


def _randomised(family, spread=0.3, seed=0):
    subject = _folded64(family)
    elements = ContinuousElements(general_linear_heads(select_groups(subject.report.groups, "full")),
                                  dtype=torch.float64)
    rng = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in elements.parameters:
            p.copy_(spread * torch.randn(p.shape, generator=rng, dtype=p.dtype))
    return subject, elements


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_random_parameters_keep_the_function_at_every_probe_shape(family):
    subject, elements = _randomised(family)
    assert {g.kind for g in elements.groups} == FAMILIES[family]
    exact = elements.exact()
    evaluator = Evaluator.of(subject)
    assert len(evaluator.probes) > 1
    outcome = evaluator.check(apply(subject.state_dict(), exact), exact)
    assert outcome.ok, outcome
    moved = max(float(np.abs(e.matrices - np.eye(e.group.size)).max()) for e in exact if e.matrices is not None)
    assert moved > 0.1  # the elements are far from the identity: the check is not vacuous


def test_an_element_pushed_off_its_group_is_caught():
    """The check above can fail: the residual rotation scaled by 1.01 is no longer orthogonal."""
    subject, elements = _randomised("llama")
    exact = elements.exact()
    residual = next(i for i, e in enumerate(exact) if e.group.motif == "residual")
    exact[residual] = symgraph.Element(exact[residual].group, matrices=1.01 * exact[residual].matrices)
    assert not Evaluator.of(subject).check(apply(subject.state_dict(), exact), exact).ok


def test_orthogonal_elements_are_orthogonal_and_fix_the_ones_vector_where_the_group_does():
    _, elements = _randomised("vit", spread=1.0)
    for e in elements.exact():
        if e.group.kind == "orthogonal":
            n = e.group.size
            assert np.allclose(e.matrices @ e.matrices.transpose(0, 2, 1), np.eye(n), atol=1e-12)
            assert e.group.fixes_ones and np.allclose(e.matrices @ np.ones(n), np.ones(n), atol=1e-12)


def test_absorbing_keeps_the_elements_and_the_first_order_elements_agree_with_the_exact_ones():
    """After absorb (as after every learning step) the matrix generators are zero: the elements are unchanged, the
    differentiable ones equal the exact ones, and their gradient is the exponential map's (checked against autograd
    through matrix_exp). Zero parameters are the identity."""
    subject, elements = _randomised("llama")
    state = subject.state_dict()
    before = apply(state, elements.exact())
    elements.absorb()
    after = apply(state, elements.exact())
    assert all(torch.allclose(before[k], after[k], atol=1e-12) for k in state)
    live = apply(state, elements.elements(), dtype=torch.float64)
    assert all(torch.allclose(live[k], after[k], atol=1e-12) for k in state)

    def loss(elements_now):
        moved = apply(state, elements_now, dtype=torch.float64)
        return sum((v ** 2).sum() for v in moved.values() if v.requires_grad)

    def gradients(elements_now):
        for p in elements.parameters:
            p.grad = None
        loss(elements_now).backward()
        return [p.grad.clone() for p in elements.parameters]

    exponential = [continuous._element(g, p, continuous._exponential, b)
                   for g, p, b in zip(elements.groups, elements.parameters, elements.bases)]
    first_order, exact = gradients(elements.elements()), gradients(exponential)
    assert all(torch.isfinite(g).all() for g in first_order)
    assert any(float(g.abs().max()) > 1e-3 for g in first_order)  # not a vacuous comparison
    assert all(torch.allclose(g, e, rtol=1e-9, atol=1e-9) for g, e in zip(first_order, exact))
    unmoved = apply(state, ContinuousElements(elements.groups).exact())
    assert all(torch.allclose(unmoved[k], state[k], atol=1e-12) for k in state)


def test_first_order_elements_differ_from_the_exact_ones_before_absorbing():
    """The first-order map is only exact at zero generators: learning must absorb after every step."""
    subject, elements = _randomised("llama")
    state = subject.state_dict()
    live = apply(state, elements.elements(), dtype=torch.float64)
    exact = apply(state, elements.exact())
    assert not all(torch.allclose(live[k], exact[k], atol=1e-6) for k in state)


def _relative_move_of_one_adam_step(n: int, width_aware: bool) -> float:
    """||Q W - W|| / ||W|| after one Adam step (learning rate 0.01) on a random linear loss of the generator of a
    residual rotation of width ``n``, for a random ``n x 4n`` weight ``W``."""
    group = symgraph.Group("r", "residual", "orthogonal", n, 1, (symgraph.Member("w", 0, np.arange(n)[None, :, None]),))
    elements = ContinuousElements([group], dtype=torch.float64)
    rates = elements.learning_rates(0.01) if width_aware else [0.01]
    optimiser = torch.optim.Adam([{"params": [p], "lr": lr} for p, lr in zip(elements.parameters, rates)])
    rng = torch.Generator().manual_seed(n)
    (elements.parameters[0] * torch.randn(elements.parameters[0].shape, generator=rng, dtype=torch.float64)
     ).sum().backward()
    optimiser.step()
    q = elements.exact()[0].matrices[0]
    w = np.random.default_rng(n).standard_normal((n, 4 * n))
    return float(np.linalg.norm(q @ w - w) / np.linalg.norm(w))


def test_width_aware_learning_rates_move_the_weights_as_far_at_every_width():
    """Adam moves every generator entry by about the learning rate, so one rate turns a wide stream farther
    (about sqrt(256 / 48) = 2.3 times); the width-aware rates (lr * sqrt(64 / n)) move both about as far, and
    exactly as far as before at the reference side 64."""
    narrow, wide = (_relative_move_of_one_adam_step(n, width_aware=False) for n in (48, 256))
    assert wide / narrow > 2.0
    narrow, wide = (_relative_move_of_one_adam_step(n, width_aware=True) for n in (48, 256))
    assert 0.8 < wide / narrow < 1.25
    assert _relative_move_of_one_adam_step(64, True) == _relative_move_of_one_adam_step(64, False)


def test_vector_parameters_keep_the_learning_rate_and_generators_scale_with_their_side():
    _, elements = _randomised("llama")
    rates = dict(zip((g.kind for g in elements.groups), elements.learning_rates(0.01)))
    assert rates["scale"] == rates["rotary"] == 0.01  # log-scales and angles: one coordinate each
    head = next(g for g in elements.groups if g.kind == "general_linear")
    assert rates["general_linear"] == pytest.approx(0.01 * (64 / head.size) ** 0.5)


def _general_linear_heads(copies=3, n=6, max_condition=kernels.MAX_CONDITION):
    group = symgraph.Group("h", "vo", "general_linear", n, copies,
                           (symgraph.Member("w", 0, np.arange(copies * n).reshape(copies, n, 1)),))
    return ContinuousElements([group], dtype=torch.float64, max_condition=max_condition)


def _step_to(elements, generators):
    with torch.no_grad():
        elements.parameters[0].copy_(generators)
    return elements.absorb()


def test_a_step_that_would_make_a_learned_map_badly_conditioned_is_projected_back_within_the_bound():
    """Copy 0 steps to condition e^6 (about 400), copy 1 to e^3 (about 20), copy 2 stays: only copy 0 moves,
    to condition 100 with the same singular vectors; without a bound it keeps 400."""
    n = 6
    big = torch.diag(torch.linspace(-3.0, 3.0, n, dtype=torch.float64))
    mixing = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0),
                                         dtype=torch.float64)).Q
    generators = torch.stack([mixing @ big @ mixing.T, 0.5 * big, torch.zeros(n, n, dtype=torch.float64)])
    bounded, unbounded = _general_linear_heads(), _general_linear_heads(max_condition=math.inf)
    assert _step_to(unbounded, generators) == 0
    assert _step_to(bounded, generators) == 1
    free, kept = unbounded.exact()[0].matrices, bounded.exact()[0].matrices
    conditions = np.linalg.cond(kept)
    assert np.linalg.cond(free[0]) == pytest.approx(math.exp(6.0))
    assert conditions[0] == pytest.approx(kernels.MAX_CONDITION) and conditions[0] <= kernels.MAX_CONDITION
    assert np.array_equal(kept[1:], free[1:])  # within the bound: exactly unchanged
    assert np.allclose(mixing.T.numpy() @ kept[0] @ mixing.numpy(), np.diag(np.diag(mixing.T.numpy() @ kept[0]
                                                                                    @ mixing.numpy())), atol=1e-9)
    # the next step from within the bound projects nothing
    assert _step_to(bounded, torch.zeros_like(generators)) == 0


def test_the_bound_clips_log_singular_values_around_their_least_squares_centre():
    """Singular values e^(-3, 0, 0, 0, 3): the interval of width log(100) is centred where most values are
    (0 stays), and the map and its inverse are moved alike."""
    m = torch.diag(torch.exp(torch.tensor([3.0, 0.0, 0.0, 0.0, -3.0], dtype=torch.float64)))[None]
    projected, moved = kernels.bound_condition(m, 100.0)
    half = math.log(100.0) / 2
    assert bool(moved[0])
    assert torch.allclose(torch.log(torch.linalg.svdvals(projected[0])),
                          torch.tensor([half, 0.0, 0.0, 0.0, -half], dtype=torch.float64), atol=1e-9)
    lopsided, _ = kernels.bound_condition(torch.diag(torch.exp(torch.tensor(
        [6.0, 6.0, 6.0, 0.0], dtype=torch.float64)))[None], 100.0)
    # three values at the top, one at the bottom: the bottom one moves up by nearly all the excess
    assert torch.allclose(torch.log(torch.linalg.svdvals(lopsided[0])),
                          torch.tensor([6.0 - (6.0 - 2 * half) / 4] * 3 + [6.0 - (6.0 - 2 * half) / 4 - 2 * half],
                                       dtype=torch.float64), atol=1e-9)
