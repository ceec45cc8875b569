r"""Batched real root finding and the one-dimensional scale problems built on it.

The scale problems of the solvers all have the form, per unit (a head, an FFN unit, a rotary pair),

.. math::

    f(c) = A c^2 - 2 B c + C c^{-2p} - 2 D c^{-p}, \qquad c \ne 0 \ (\text{or } c > 0),

with :math:`A = \|x\|^2,\ B = \langle x, y\rangle` for the side scaled by :math:`c` and
:math:`C = \|z\|^2,\ D = \langle z, w\rangle` for the side scaled by :math:`c^{-p}`. Its stationary points are
the real roots of

.. math::

    c^{2p+1} f'(c) / 2 = A c^{2p+2} - B c^{2p+1} + p D c^{p} - p C = 0,

(for :math:`p = 1` this is the quartic of the paper's eq. (12)). When :math:`A, C > 0`, :math:`f \to +\infty` at
both ends of each admissible half-line, so the minimiser is one of those roots: all roots are computed, every
admissible real candidate (plus :math:`c = 1`, the identity) is evaluated, and the best one wins.

A per-coordinate scale group whose members carry other exponents (ReLU^2 scales its input side by :math:`c` and
its output side by :math:`c^{-2}`; a product may square either side) has the general form
:math:`f(c) = \sum_e A_e c^{2e} - 2 B_e c^e` over integer powers :math:`e \ne 0`, solved the same way by
:func:`minimize_power_sum` (of which :func:`minimize_scale` is the case :math:`e \in \{1, -p\}`).
"""
from __future__ import annotations

import numpy as np

__all__ = ["polynomial_roots", "scale_objective", "minimize_scale", "power_sum_objective", "minimize_power_sum"]


def polynomial_roots(coeffs: np.ndarray) -> np.ndarray:
    r"""All complex roots of a batch of polynomials.

    Parameters
    ----------
    coeffs : (N, k + 1) array
        Coefficients, highest degree first (``numpy.roots`` order).

    Returns
    -------
    (N, k) complex array
        Roots per row, eigenvalues of the stacked :math:`k \times k` companion matrices (one batched
        ``numpy.linalg.eigvals`` call). Rows whose leading coefficient vanishes fall back to ``numpy.roots``
        and are padded with ``nan``.
    """
    coeffs = np.asarray(coeffs, dtype=np.float64)
    n, k1 = coeffs.shape
    k = k1 - 1
    out = np.full((n, k), np.nan + 0j)
    if k == 0:
        return out
    scale = np.abs(coeffs).max(axis=1)
    regular = np.abs(coeffs[:, 0]) > 1e-14 * scale
    if regular.any():
        c = coeffs[regular]
        companion = np.zeros((c.shape[0], k, k))
        companion[:, 0, :] = -c[:, 1:] / c[:, :1]
        companion[:, np.arange(1, k), np.arange(k - 1)] = 1.0
        out[regular] = np.linalg.eigvals(companion)
    for i in np.flatnonzero(~regular):
        if scale[i] > 0:
            r = np.roots(coeffs[i])
            out[i, : r.size] = r
    return out


def scale_objective(c: np.ndarray, A, B, C, D, power: int = 1) -> np.ndarray:
    r""":math:`f(c) = A c^2 - 2 B c + C c^{-2p} - 2 D c^{-p}` (broadcasting), ``inf`` at :math:`c = 0`."""
    return power_sum_objective(c, {1: (A, B), -power: (C, D)})


def power_sum_objective(c: np.ndarray, terms: dict) -> np.ndarray:
    r""":math:`f(c) = \sum_e A_e c^{2e} - 2 B_e c^e` over the powers :math:`e` of ``terms`` (``{e: (A_e, B_e)}``,
    broadcasting), ``inf`` where it is not finite (:math:`c = 0` with a negative power)."""
    c = np.asarray(c, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        f = sum(A * c ** (2 * e) - 2 * B * c ** e for e, (A, B) in terms.items())
    return np.where(np.isfinite(f), f, np.inf)


def _critical_polynomial(terms: dict, n: int) -> np.ndarray:
    r"""Coefficients (n, k + 1), highest degree first, of :math:`c^{-l} \sum_e e (A_e c^{2e} - B_e c^e)`
    (:math:`c f'(c) / 2` times the power :math:`c^{-l}` that clears the lowest negative one)."""
    powers = [q for e in terms for q in (2 * e, e)]
    low, high = min(powers), max(powers)
    coeffs = np.zeros((n, high - low + 1))
    for e, (A, B) in terms.items():
        coeffs[:, high - 2 * e] += e * A
        coeffs[:, high - e] -= e * B
    return coeffs


def _balanced_roots(coeffs: np.ndarray) -> np.ndarray:
    r"""Roots of each row, computed in the balanced variable :math:`t = c / s`, :math:`s = |a_0 / a_k|^{1/k}`,
    where the leading and constant coefficients have one magnitude. Rows lacking either use the raw row."""
    k = coeffs.shape[1] - 1
    lead, const = np.abs(coeffs[:, 0]), np.abs(coeffs[:, -1])
    good = (lead > 0) & (const > 0)
    roots = np.full((coeffs.shape[0], k), np.nan + 0j)
    if good.any():
        s = (const[good] / lead[good]) ** (1.0 / k)
        t = coeffs[good] * s[:, None] ** np.arange(k, -1, -1)
        roots[good] = polynomial_roots(t / np.abs(t).max(axis=1, keepdims=True)) * s[:, None]
    if (~good).any():
        roots[~good] = polynomial_roots(coeffs[~good])
    return roots


def _newton_polish(c: np.ndarray, terms: dict, steps: int = 2) -> np.ndarray:
    """A few Newton steps on f'(c) = 0 from each candidate (``nan`` where a step is not finite)."""
    with np.errstate(all="ignore"):
        for _ in range(steps):
            g = sum(2 * e * (A[:, None] * c ** (2 * e - 1) - B[:, None] * c ** (e - 1)) for e, (A, B) in terms.items())
            h = sum(2 * e * ((2 * e - 1) * A[:, None] * c ** (2 * e - 2) - (e - 1) * B[:, None] * c ** (e - 2))
                    for e, (A, B) in terms.items())
            c = c - g / h
    return np.where(np.isfinite(c), c, np.nan)


def minimize_scale(A, B, C, D, *, power: int = 1, positive: bool = False) -> np.ndarray:
    r"""Global minimiser of :math:`f(c) = A c^2 - 2Bc + C c^{-2p} - 2 D c^{-p}` per unit.

    Parameters
    ----------
    A, B, C, D : array_like, broadcastable to a common shape ``S``
        :math:`\|x\|^2, \langle x, y\rangle, \|z\|^2, \langle z, w\rangle` per unit (``A, C >= 0``).
    power : int
        :math:`p`, the power of :math:`1/c` on the dual side (1 for a plain rescale, 2 for ReLU^2).
    positive : bool
        Only :math:`c > 0` is admissible (ReLU scales, rotary scales); otherwise any :math:`c \ne 0`.

    Returns
    -------
    array of shape ``S``
        The admissible :math:`c` with the smallest :math:`f` among all real stationary points and
        :math:`c = 1`; exact (to rounding) whenever :math:`A, C > 0`, since :math:`f` is then coercive on each
        admissible half-line. Never worse than :math:`c = 1`.
    """
    return minimize_power_sum({1: (A, B), -power: (C, D)}, positive=positive)


def minimize_power_sum(terms: dict, *, positive: bool = False) -> np.ndarray:
    r"""Global minimiser of :math:`f(c) = \sum_e A_e c^{2e} - 2 B_e c^e` per unit, over nonzero integer powers
    :math:`e` (the keys of ``terms``; a negative one is a side scaled by :math:`c^{-|e|}`).

    Parameters
    ----------
    terms : dict
        ``{e: (A_e, B_e)}``: :math:`\|x\|^2` and :math:`\langle x, y\rangle` per unit of the slices scaled by
        :math:`c^e` (``A_e >= 0``), arrays broadcastable to a common shape ``S``.
    positive : bool
        Only :math:`c > 0` is admissible; otherwise any :math:`c \ne 0`.

    Returns
    -------
    array of shape ``S``
        The admissible :math:`c` with the smallest :math:`f` among all real stationary points and
        :math:`c = 1`: never worse than :math:`c = 1`, and exact (to rounding) when the highest and the lowest
        power carry weight, since :math:`f` is then coercive on each admissible half-line.

    >>> round(float(minimize_power_sum({1: (1.0, 2.0), -2: (1.0, 0.25)}, positive=True)), 12)  # c in, 1/c^2 out
    2.0
    """
    arrays = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for pair in terms.values() for x in pair))
    shape = arrays[0].shape
    flat = {e: (arrays[2 * i].reshape(-1), arrays[2 * i + 1].reshape(-1)) for i, e in enumerate(terms)}
    n = arrays[0].size
    cand = _balanced_roots(_critical_polynomial(flat, n)).real
    cand = np.concatenate([cand, _newton_polish(cand, flat), np.ones((n, 1))], axis=1)
    admissible = np.isfinite(cand) & ((cand > 0) if positive else (cand != 0))
    columns = {e: (A[:, None], B[:, None]) for e, (A, B) in flat.items()}
    f = np.where(admissible, power_sum_objective(np.where(admissible, cand, 1.0), columns), np.inf)
    return cand[np.arange(n), np.argmin(f, axis=1)].reshape(shape)
