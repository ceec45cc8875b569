"""Solver kernels: planted recovery (exact) and optimality against brute force / random search / grids."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from symgraph.solve import (cross_matrix, hungarian, joint_rotation_rescale, minimize_scale, procrustes, procrustes_value,
                            qk_objective, rescale_from_stats, rescale_objective, rescale_quartic,
                            rotary_closed_form, rotary_objective, rotation_2x2, signed_hungarian,
                            unit_scale_objective, unit_scales)


def orth(n, rng, batch=()):
    q, r = np.linalg.qr(rng.standard_normal((*batch, n, n)))
    return q * np.sign(np.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


def sq(x):
    return float(np.sum(np.asarray(x) ** 2))


# -- Procrustes ---------------------------------------------------------------------------------------------
def test_procrustes_recovers_planted_rotation_batched():
    rng = np.random.default_rng(0)
    heads, d = 6, 8
    members = [rng.standard_normal((heads, d, m)) for m in (16, 16, 1)]  # Q, K, a bias column
    Q = orth(d, rng, (heads,))
    M = cross_matrix([(x, Q @ x) for x in members])
    assert M.shape == (heads, d, d)
    R = procrustes(M)
    for x in members:
        np.testing.assert_allclose(R.swapaxes(-1, -2) @ x, Q @ x, atol=1e-10)
    # torch in, torch out, same answer
    Rt = procrustes(torch.from_numpy(M))
    assert isinstance(Rt, torch.Tensor) and Rt.dtype == torch.float64
    np.testing.assert_allclose(Rt.numpy(), R, atol=1e-12)


def test_procrustes_is_optimal_against_random_orthogonals():
    rng = np.random.default_rng(1)
    d = 5
    X, Y = rng.standard_normal((d, 12)), rng.standard_normal((d, 12))
    R = procrustes(cross_matrix([(X, Y)]))
    best = sq(R.T @ X - Y)
    others = orth(d, rng, (2000,))
    assert np.all(np.sum((others.swapaxes(-1, -2) @ X - Y) ** 2, axis=(-2, -1)) >= best - 1e-12)
    assert abs(np.trace(R.T @ (X @ Y.T)) - procrustes_value(X @ Y.T)) < 1e-10


def test_procrustes_special_stays_in_so_n():
    rng = np.random.default_rng(2)
    d = 4
    X = rng.standard_normal((d, 10))
    reflect = np.diag([1.0, 1.0, 1.0, -1.0])
    M = X @ (reflect @ X).T
    R = procrustes(M, special=True)
    assert np.isclose(np.linalg.det(R), 1.0)
    assert np.isclose(np.trace(R.T @ M), procrustes_value(M, special=True))
    rots = orth(d, rng, (3000,))
    rots[np.linalg.det(rots) < 0, :, 0] *= -1
    assert np.all(np.einsum("bij,ij->b", rots, M) <= np.trace(R.T @ M) + 1e-10)


# -- Hungarian ------------------------------------------------------------------------------------------------
def test_hungarian_recovers_planted_permutation():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((20, 30))
    perm = rng.permutation(20)
    anchor = X[perm]
    found = hungarian(cross_matrix([(X, anchor)]).T)
    np.testing.assert_array_equal(found, perm)


def test_signed_hungarian_recovers_planted_signed_permutation():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((15, 25))
    planted, planted_signs = rng.permutation(15), rng.choice([-1.0, 1.0], 15)
    perm, signs = signed_hungarian(cross_matrix([(X, planted_signs[:, None] * X[planted])]).T)
    np.testing.assert_array_equal(perm, planted)
    np.testing.assert_array_equal(signs, planted_signs)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_hungarian_matches_brute_force(n):
    rng = np.random.default_rng(10 + n)
    for _ in range(5):
        S = rng.standard_normal((n, n))
        best = max(S[np.arange(n), p].sum() for p in itertools.permutations(range(n)))
        assert S[np.arange(n), hungarian(S)].sum() == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("shape", [(300, 300), (200, 260)])
def test_hungarian_negating_in_place_is_scipys_maximisation(shape):
    """The memory-saving path (the matrix negated in place for scipy, then restored) returns what scipy's own
    maximisation returns, and leaves the caller's matrix bit for bit as it was; read-only input still works."""
    from scipy.optimize import linear_sum_assignment

    rng = np.random.default_rng(5)
    S = rng.standard_normal(shape)  # a hard matching: row maxima collide
    S[0, 0] = -0.0
    kept = S.copy()
    rows, cols = linear_sum_assignment(S, maximize=True)
    assert np.unique(S.argmax(axis=1)).size < shape[0]
    np.testing.assert_array_equal(hungarian(S), cols[np.argsort(rows)])
    assert S.tobytes() == kept.tobytes()
    S.flags.writeable = False
    np.testing.assert_array_equal(hungarian(S), cols[np.argsort(rows)])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_signed_hungarian_matches_brute_force(n):
    rng = np.random.default_rng(20 + n)
    all_signs = np.array(list(itertools.product([-1.0, 1.0], repeat=n)))
    for _ in range(3):
        S = rng.standard_normal((n, n))
        best = max((all_signs * S[np.arange(n), p]).sum(1).max() for p in itertools.permutations(range(n)))
        perm, signs = signed_hungarian(S)
        assert (signs * S[np.arange(n), perm]).sum() == pytest.approx(best, abs=1e-12)


# -- scalar rescale (eq. 11-12) ---------------------------------------------------------------------------------
def test_rescale_quartic_recovers_planted_scale():
    rng = np.random.default_rng(40)
    Q1, K1 = rng.standard_normal((8, 17)), rng.standard_normal((8, 17))
    for a in (0.03, 0.7, 1.0, 3.3, 250.0, -0.4, -5.0):
        got = rescale_quartic(Q1, a * Q1, K1, K1 / a, positive=a > 0)
        assert got == pytest.approx(a, rel=1e-12)


@pytest.mark.parametrize("positive", [True, False])
def test_rescale_quartic_matches_grid_search(positive):
    rng = np.random.default_rng(41)
    grid = np.geomspace(1e-3, 1e3, 200001)
    grid = grid if positive else np.concatenate([-grid[::-1], grid])
    for _ in range(20):
        Q1, Q2, K1, K2 = (rng.standard_normal((4, 9)) * rng.uniform(0.1, 3) for _ in range(4))
        a = rescale_quartic(Q1, Q2, K1, K2, positive=positive)
        assert a != 0 and (a > 0 or not positive)
        f = lambda x: sq(x * Q1 - Q2) + sq(K1 / x - K2)  # noqa: E731
        stats = (sq(Q1), np.sum(Q1 * Q2), sq(K1), np.sum(K1 * K2))
        on_grid = rescale_objective(grid, *stats).min() + sq(Q2) + sq(K2)
        assert f(a) <= on_grid + 1e-9
        assert f(a) == pytest.approx(rescale_objective(a, *stats) + sq(Q2) + sq(K2), rel=1e-10)


def test_rescale_degenerate_inputs_fall_back_to_identity_or_one_sided_optimum():
    assert rescale_from_stats(0.0, 0.0, 0.0, 0.0) == 1.0
    assert rescale_from_stats(4.0, 6.0, 0.0, 0.0) == pytest.approx(1.5)  # K absent: a = <Q1,Q2>/|Q1|^2
    assert rescale_from_stats(0.0, 0.0, 4.0, 2.0) == pytest.approx(2.0)  # Q absent: 1/a = <K1,K2>/|K1|^2


# -- joint rotation + rescale -----------------------------------------------------------------------------------
def qk_instance(rng, heads, d, m=12):
    Q1, Q2, K1, K2 = (rng.standard_normal((heads, d, m)) for _ in range(4))
    return Q1, Q2, K1, K2


def qk_stats(Q1, Q2, K1, K2):
    return (cross_matrix([(Q1, Q2)]), cross_matrix([(K1, K2)]), np.sum(Q1**2, axis=(-2, -1)),
            np.sum(K1**2, axis=(-2, -1)))


def sequential(mq, mk, q_sq, k_sq):
    R = procrustes(mq + mk)
    a = rescale_from_stats(q_sq, np.sum(R * mq, (-2, -1)), k_sq, np.sum(R * mk, (-2, -1)), positive=True)
    return R, a


def test_joint_rotation_rescale_recovers_planted():
    rng = np.random.default_rng(50)
    heads, d = 5, 6
    Q1, _, K1, _ = qk_instance(rng, heads, d)
    O = orth(d, rng, (heads,))
    a_true = np.exp(rng.normal(0, 1.5, heads))
    Q2, K2 = a_true[:, None, None] * (O @ Q1), (O @ K1) / a_true[:, None, None]
    R, a = joint_rotation_rescale(*qk_stats(Q1, Q2, K1, K2))
    np.testing.assert_allclose(a, a_true, rtol=1e-10)
    Rt = R.swapaxes(-1, -2)
    np.testing.assert_allclose(a[:, None, None] * (Rt @ Q1), Q2, atol=1e-9)
    np.testing.assert_allclose((Rt @ K1) / a[:, None, None], K2, atol=1e-9)


def test_joint_rotation_rescale_never_worse_than_sequential():
    worse, better = 0, 0
    for seed in range(50):
        rng = np.random.default_rng(1000 + seed)
        heads, d = 3, int(rng.integers(2, 7))
        Q1, Q2, K1, K2 = qk_instance(rng, heads, d, m=int(rng.integers(3, 10)))
        Q1 = Q1 * rng.uniform(0.2, 5)  # unbalanced scales
        stats = qk_stats(Q1, Q2, K1, K2)
        R, a = joint_rotation_rescale(*stats)
        Rs, a_s = sequential(*stats)
        joint, seq = qk_objective(R, a, *stats), qk_objective(Rs, a_s, *stats)
        direct = (np.sum((a[:, None, None] * (R.swapaxes(-1, -2) @ Q1) - Q2) ** 2, axis=(-2, -1))
                  + np.sum(((R.swapaxes(-1, -2) @ K1) / a[:, None, None] - K2) ** 2, axis=(-2, -1))
                  - np.sum(Q2**2, axis=(-2, -1)) - np.sum(K2**2, axis=(-2, -1)))
        np.testing.assert_allclose(joint, direct, rtol=1e-9, atol=1e-9)
        worse += int(np.sum(joint > seq + 1e-9))
        better += int(np.sum(joint < seq - 1e-6))
    assert worse == 0
    assert better > 0  # the joint solve is not just the sequential one


def test_joint_rotation_rescale_matches_grid_over_a():
    rng = np.random.default_rng(60)
    heads, d = 4, 5
    stats = qk_stats(*qk_instance(rng, heads, d))
    mq, mk, q_sq, k_sq = stats
    R, a = joint_rotation_rescale(*stats)
    grid = np.geomspace(1e-2, 1e2, 4001)
    at = grid[:, None, None, None]
    s = np.linalg.svd(at * mq[None] + mk[None] / at, compute_uv=False).sum(-1)  # (G, heads)
    on_grid = (grid[:, None] ** 2 * q_sq + k_sq / grid[:, None] ** 2 - 2 * s).min(0)
    joint = qk_objective(R, a, *stats)
    assert np.all(joint <= on_grid + 1e-9)
    assert np.all(joint >= on_grid - 1e-3 * np.abs(on_grid))  # the grid is close to it: same problem


def test_joint_rotation_rescale_torch_and_unbatched():
    rng = np.random.default_rng(61)
    mq, mk, q_sq, k_sq = qk_stats(*qk_instance(rng, 1, 4))
    R, a = joint_rotation_rescale(mq[0], mk[0], q_sq[0], k_sq[0])
    Rt, at = joint_rotation_rescale(torch.from_numpy(mq), torch.from_numpy(mk), q_sq, k_sq)
    assert R.shape == (4, 4) and a.shape == () and isinstance(Rt, torch.Tensor)
    np.testing.assert_allclose(Rt.numpy()[0], R, atol=1e-10)
    assert at[0] == pytest.approx(float(a), rel=1e-10)


@pytest.mark.parametrize("positive", [True, False])
def test_joint_rotation_rescale_special_orthogonal_odd_dimension(positive):
    rng = np.random.default_rng(62)
    heads, d = 6, 3
    stats = qk_stats(*qk_instance(rng, heads, d, m=5))
    mq, mk, q_sq, k_sq = stats
    R, a = joint_rotation_rescale(*stats, special=True, positive=positive)
    assert np.allclose(np.linalg.det(R), 1.0) and (np.all(a > 0) or not positive)
    grid = np.geomspace(1e-2, 1e2, 2001)
    grid = grid if positive else np.concatenate([-grid[::-1], grid])
    at = grid[:, None]
    value = procrustes_value(at[..., None, None] * mq[None] + mk[None] / at[..., None, None], special=True)
    on_grid = (at**2 * q_sq + k_sq / at**2 - 2 * value).min(0)
    assert np.all(qk_objective(R, a, *stats) <= on_grid + 1e-9)


# -- rotary ---------------------------------------------------------------------------------------------------------
def test_rotary_angle_convention_matches_procrustes_so2():
    rng = np.random.default_rng(80)
    X, Y = rng.standard_normal((7, 2, 9)), rng.standard_normal((7, 2, 9))
    M = cross_matrix([(X, Y)])
    phi, c = rotary_closed_form(M, scaled=False)
    np.testing.assert_array_equal(c, 1.0)
    np.testing.assert_allclose(phi, np.arctan2(M[:, 0, 1] - M[:, 1, 0], M[:, 0, 0] + M[:, 1, 1]))
    np.testing.assert_allclose(rotation_2x2(phi), procrustes(M, special=True).swapaxes(-1, -2), atol=1e-12)


def test_rotary_recovers_planted_angles_and_scales():
    rng = np.random.default_rng(81)
    heads, P, m = 3, 8, 10
    Xq, Xk = rng.standard_normal((heads, P, 2, m)), rng.standard_normal((heads, P, 2, m))
    phi = rng.uniform(-np.pi, np.pi, (heads, P))
    c = np.exp(rng.normal(0, 1.0, (heads, P)))
    T = rotation_2x2(phi)
    Yq, Yk = c[..., None, None] * (T @ Xq), (T @ Xk) / c[..., None, None]
    got_phi, got_c = rotary_closed_form(cross_matrix([(Xq, Yq)]), cross_matrix([(Xk, Yk)]),
                                        np.sum(Xq**2, (-2, -1)), np.sum(Xk**2, (-2, -1)))
    np.testing.assert_allclose(got_c, c, rtol=1e-10)
    np.testing.assert_allclose(np.angle(np.exp(1j * (got_phi - phi))), 0.0, atol=1e-10)
    # balanced planted scale c^4 = |Xk|^2/|Xq|^2: the sextic has a double root there; still exact
    Xq1 = Xq[0, 0]
    c0 = 1.7
    Xk1 = Xq1 * c0**2
    T1 = rotation_2x2(0.3)
    p1, c1 = rotary_closed_form(Xq1 @ (c0 * T1 @ Xq1).T, Xk1 @ (T1 @ Xk1 / c0).T, sq(Xq1), sq(Xk1))
    assert float(c1) == pytest.approx(c0, rel=1e-10) and float(p1) == pytest.approx(0.3, abs=1e-10)


def test_rotary_optimal_against_grids():
    rng = np.random.default_rng(82)
    P = 12
    Xq, Yq, Xk, Yk = (rng.standard_normal((P, 2, 6)) * rng.uniform(0.3, 3, (P, 1, 1)) for _ in range(4))
    mq, mk = cross_matrix([(Xq, Yq)]), cross_matrix([(Xk, Yk)])
    qs, ks = np.sum(Xq**2, (-2, -1)), np.sum(Xk**2, (-2, -1))
    phi, c = rotary_closed_form(mq, mk, qs, ks)
    ours = rotary_objective(phi, c, mq, mk, qs, ks)
    direct = (np.sum((c[:, None, None] * rotation_2x2(phi) @ Xq - Yq) ** 2, (-2, -1))
              + np.sum((rotation_2x2(phi) @ Xk / c[:, None, None] - Yk) ** 2, (-2, -1))
              - np.sum(Yq**2, (-2, -1)) - np.sum(Yk**2, (-2, -1)))
    np.testing.assert_allclose(ours, direct, atol=1e-9)
    grid_phi = np.linspace(-np.pi, np.pi, 721)[:, None, None]
    grid_c = np.geomspace(1e-2, 1e2, 801)[None, :, None]
    on_grid = rotary_objective(grid_phi, grid_c, mq, mk, qs, ks).min(axis=(0, 1))
    assert np.all(ours <= on_grid + 1e-9)
    # never worse than sequential (angle at c = 1, then the quartic)
    phi0, _ = rotary_closed_form(mq + mk, scaled=False)
    rot = np.exp(-1j * phi0)
    zq = (mq[:, 0, 0] + mq[:, 1, 1]) + 1j * (mq[:, 0, 1] - mq[:, 1, 0])
    zk = (mk[:, 0, 0] + mk[:, 1, 1]) + 1j * (mk[:, 0, 1] - mk[:, 1, 0])
    c0 = rescale_from_stats(qs, np.real(zq * rot), ks, np.real(zk * rot), positive=True)
    assert np.all(ours <= rotary_objective(phi0, c0, mq, mk, qs, ks) + 1e-9)
    # unscaled: optimal against the angle grid
    phi_u, _ = rotary_closed_form(mq + mk, scaled=False)
    unscaled = rotary_objective(phi_u, 1.0, mq, mk, qs, ks)
    assert np.all(unscaled <= rotary_objective(grid_phi[:, 0], 1.0, mq, mk, qs, ks).min(0) + 1e-12)


# -- per-unit scales ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("positive,dual_power", [(True, 1), (False, 1), (True, 2)])
def test_unit_scales_recover_planted(positive, dual_power):
    rng = np.random.default_rng(90)
    n, d, o = 24, 10, 7
    W1, W2 = rng.standard_normal((n, d + 1)), rng.standard_normal((o, n))  # bias as the last column of W1
    s = np.exp(rng.normal(0, 1.0, n))
    if not positive:
        s *= rng.choice([-1.0, 1.0], n)
    got = unit_scales(W1, s[:, None] * W1, W2, W2 / s[None, :] ** dual_power, positive, dual_power=dual_power)
    np.testing.assert_allclose(got, s, rtol=1e-10)


@pytest.mark.parametrize("positive,dual_power", [(True, 1), (False, 1), (True, 2)])
def test_unit_scales_optimal_against_grid(positive, dual_power):
    rng = np.random.default_rng(91)
    n = 30
    X, Y = rng.standard_normal((n, 5)), rng.standard_normal((n, 5))
    Z, W = rng.standard_normal((4, n)) * 3, rng.standard_normal((4, n))
    d = unit_scales(X, Y, Z, W, positive, dual_power=dual_power)
    assert np.all(d != 0) and (np.all(d > 0) or not positive)
    grid = np.geomspace(1e-3, 1e3, 100001)
    grid = grid if positive else np.concatenate([-grid[::-1], grid])
    on_grid = unit_scale_objective(grid[:, None], X, Y, Z, W, dual_power=dual_power).min(0)
    assert np.all(unit_scale_objective(d, X, Y, Z, W, dual_power=dual_power) <= on_grid + 1e-9)
    direct = np.sum((d[:, None] * X - Y) ** 2, 1) + np.sum((Z / d**dual_power - W) ** 2, 0) - np.sum(Y**2, 1) \
        - np.sum(W**2, 0)
    np.testing.assert_allclose(unit_scale_objective(d, X, Y, Z, W, dual_power=dual_power), direct, atol=1e-9)


def test_unit_scales_match_per_unit_numpy_roots():
    rng = np.random.default_rng(92)
    A, C = rng.uniform(0.1, 5, 50), rng.uniform(0.1, 5, 50)
    B, D = rng.normal(0, 2, 50), rng.normal(0, 2, 50)
    batched = minimize_scale(A, B, C, D, positive=False)
    for i in range(50):
        r = np.roots([A[i], -B[i], 0.0, D[i], -C[i]])
        r = r.real[(np.abs(r.imag) < 1e-9) & (r.real != 0)]
        f = A[i] * r**2 - 2 * B[i] * r + C[i] / r**2 - 2 * D[i] / r
        assert batched[i] == pytest.approx(r[np.argmin(f)], rel=1e-9)


@pytest.mark.parametrize("powers", [(1, -2), (2, -1), (1, 2, -1, -3), (3, -1, -2)])
def test_power_sums_are_minimised_exactly_and_never_above_the_identity(powers):
    from symgraph.solve.polyroots import minimize_power_sum, power_sum_objective
    rng = np.random.default_rng(93)
    terms = {e: (rng.uniform(0.1, 5, 40), rng.normal(0, 2, 40)) for e in powers}
    for positive in (True, False):
        c = minimize_power_sum(terms, positive=positive)
        grid = np.geomspace(1e-2, 1e2, 40001)
        grid = grid if positive else np.concatenate([-grid[::-1], grid])
        on_grid = power_sum_objective(grid[:, None], terms).min(0)
        assert np.all(power_sum_objective(c, terms) <= np.minimum(on_grid, power_sum_objective(1.0, terms)) + 1e-9)
    A, B, C, D = rng.uniform(0.1, 5, (4, 40))
    assert np.array_equal(minimize_scale(A, B, C, D, power=2), minimize_power_sum({1: (A, B), -2: (C, D)}))


def test_polynomial_roots_batch_handles_vanishing_leading_coefficient():
    from symgraph.solve import polynomial_roots
    roots = polynomial_roots(np.array([[1.0, -3.0, 2.0], [0.0, 2.0, -4.0], [0.0, 0.0, 0.0]]))
    np.testing.assert_allclose(np.sort(roots[0].real), [1.0, 2.0])
    assert roots[1, 0] == pytest.approx(2.0) and np.isnan(roots[1, 1]) and np.all(np.isnan(roots[2]))


def test_every_group_kind_has_a_registered_solver():
    from symgraph.errors import SymgraphError
    from symgraph.groups import KINDS, Group
    from symgraph.solve.dispatch import SOLVERS, solver_for

    assert set(KINDS) | {"heads"} <= set(SOLVERS)
    assert all(s.name and s.summary for s in SOLVERS.values())
    with pytest.raises(SymgraphError, match="registered kinds: .*orthogonal"):
        solver_for(Group("x", "other", "not-a-kind", 1, 1, ()))
