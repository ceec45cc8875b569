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
"""
from __future__ import annotations

import numpy as np

__all__ = ["polynomial_roots", "scale_objective", "minimize_scale"]


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
    c = np.asarray(c, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inv = np.where(c != 0, 1.0 / np.where(c != 0, c, 1.0) ** power, np.inf)
        f = A * c * c - 2 * B * c + C * inv * inv - 2 * D * inv
    return np.where(np.isfinite(f), f, np.inf)


def _critical_polynomial(A, B, C, D, power: int) -> np.ndarray:
    """Coefficients (N, 2p+3) of A c^{2p+2} - B c^{2p+1} + p D c^p - p C, highest degree first."""
    p = power
    coeffs = np.zeros((A.shape[0], 2 * p + 3))
    coeffs[:, 0] = A
    coeffs[:, 1] = -B
    coeffs[:, 2 * p + 2 - p] = p * D
    coeffs[:, -1] = -p * C
    return coeffs


def _normalised_roots(A, B, C, D, power: int) -> np.ndarray:
    r"""Roots of the critical polynomial, computed in the balanced variable :math:`t = c / s`,
    :math:`s = (pC/A)^{1/(2p+2)}`, where the polynomial is monic with constant term :math:`-1`:
    :math:`t^{2p+2} - \frac{B}{A s} t^{2p+1} + \frac{D s^p}{C} t^p - 1`. Degenerate rows use the raw one."""
    p = power
    good = (A > 0) & (C > 0)
    roots = np.full((A.shape[0], 2 * p + 2), np.nan + 0j)
    if good.any():
        a, b, cc, d = A[good], B[good], C[good], D[good]
        s = (p * cc / a) ** (1.0 / (2 * p + 2))
        t = polynomial_roots(_critical_polynomial(np.ones_like(a), b / (a * s), np.full_like(a, 1.0 / p),
                                                  d * s**p / (p * cc), p))
        roots[good] = t * s[:, None]
    if (~good).any():
        raw = polynomial_roots(_critical_polynomial(A[~good], B[~good], C[~good], D[~good], p))
        roots[~good, : raw.shape[1]] = raw
    return roots


def _newton_polish(c: np.ndarray, A, B, C, D, power: int, steps: int = 2) -> np.ndarray:
    """A few Newton steps on f'(c) = 0 from each candidate (``nan`` where a step is not finite)."""
    p = power
    A, B, C, D = (x[:, None] for x in (A, B, C, D))
    with np.errstate(all="ignore"):
        for _ in range(steps):
            g = 2 * A * c - 2 * B - 2 * p * C * c ** (-2 * p - 1) + 2 * p * D * c ** (-p - 1)
            h = 2 * A + 2 * p * (2 * p + 1) * C * c ** (-2 * p - 2) - 2 * p * (p + 1) * D * c ** (-p - 2)
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
    A, B, C, D = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (A, B, C, D)))
    shape = A.shape
    A, B, C, D = (x.reshape(-1) for x in (A, B, C, D))
    roots = _normalised_roots(A, B, C, D, power)
    cand = roots.real
    cand = np.concatenate([cand, _newton_polish(cand, A, B, C, D, power), np.ones((A.shape[0], 1))], axis=1)
    admissible = np.isfinite(cand) & ((cand > 0) if positive else (cand != 0))
    f = scale_objective(np.where(admissible, cand, 1.0), A[:, None], B[:, None], C[:, None], D[:, None], power)
    f = np.where(admissible, f, np.inf)
    best = cand[np.arange(A.shape[0]), np.argmin(f, axis=1)]
    return best.reshape(shape)
