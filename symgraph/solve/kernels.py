r"""Pure math kernels of the alignment solvers: plain float64 arrays in, optimal group elements out.

The caller (the dispatcher) gathers the arrays from the two models; nothing here knows about models or groups.

Conventions
-----------
* **Source** :math:`X` is transformed to be close to **anchor** :math:`Y`; the anchor never moves.
* A member is a matrix whose **rows** are the group's coordinates: :math:`X \in \mathbb{R}^{n \times m}`
  (a linear layer's output rows, a bias as an extra column). A primal member moves as :math:`X \to T X`, a dual
  member (a linear layer's input columns, transposed so they are rows) as :math:`Z \to T^{-T} Z`.
* **Cross matrix** :math:`M = \sum_{\text{members}} X_{src} X_{anchor}^\top` (:func:`cross_matrix`), source
  index first: :math:`M_{ij} = \langle \text{source row } i, \text{anchor row } j\rangle`. For an orthogonal
  :math:`T` a dual member moves like a primal one (:math:`T^{-T} = T`), so it enters :math:`M` the same way.
* **Orthogonal** kernels return :math:`R` with the source mapped by :math:`X \to R^\top X`, i.e. the group
  element is :math:`T = R^\top` (paper, Algorithm 1: :math:`W_{Q_1} \to R^\top W_{Q_1}`).
* **Permutation** kernels take a *similarity* indexed ``[anchor, source]`` (that is ``cross.T``) and return
  ``perm`` with the aligned source ``X[perm]``: row ``i`` of the aligned source is source row ``perm[i]``
  (the monomial convention of :mod:`symgraph.elements`, :math:`(Tx)_i = s_i x_{perm_i}`).
* **Scale** kernels return the factor applied to the primal side; the dual side gets its inverse power.
* **Rotary** returns :math:`(\phi, c)` per pair with :math:`T = c\,R(\phi)` applied directly (no transpose):
  :math:`X_q \to c R(\phi) X_q`, :math:`X_k \to R(\phi) X_k / c`,
  :math:`R(\phi) = \begin{pmatrix}\cos\phi & -\sin\phi\\ \sin\phi & \cos\phi\end{pmatrix}`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from ._arrays import Array, as_numpy, as_tensor, like
from .polyroots import minimize_scale, polynomial_roots, scale_objective

__all__ = [
    "cross_matrix", "procrustes", "procrustes_value",
    "hungarian", "signed_hungarian",
    "rescale_quartic", "rescale_from_stats", "rescale_objective",
    "joint_rotation_rescale", "qk_objective",
    "rotary_closed_form", "rotation_2x2", "rotary_objective",
    "unit_scales", "unit_scale_objective",
    "MAX_CONDITION", "bound_condition",
]

_GOLDEN = (np.sqrt(5.0) - 1.0) / 2.0
_CHUNK_ELEMENTS = 1 << 23  # float64 entries per batched SVD call in the 1-D searches (64 MiB)
# A general linear map worse conditioned than this makes merged weights blow up: the solvers do not use one
# (symgraph.solve.dispatch), learned matching projects onto it (symgraph.continuous).
MAX_CONDITION = 100.0


# -- orthogonal: Procrustes ---------------------------------------------------------------------------------
def cross_matrix(pairs: Sequence[tuple[Array, Array]]) -> Array:
    r"""Cross matrix :math:`M = \sum_k X^{(k)}_{src} X^{(k)\top}_{anchor}`, batched over leading axes.

    Parameters
    ----------
    pairs : sequence of (X_src, X_anchor)
        Each of shape ``(..., n, m_k)`` (the ``n`` coordinates are rows; ``m_k`` may differ between members;
        a bias is a column of length ``n``, shape ``(..., n, 1)``).

    Returns
    -------
    (..., n, n)
        :math:`M_{ij} = \sum_k \langle X^{(k)}_{src}[i], X^{(k)}_{anchor}[j]\rangle`, in the type of the first
        source array.
    """
    if not pairs:
        raise ValueError("cross_matrix needs at least one (source, anchor) pair")
    total = None
    for x_src, x_anchor in pairs:
        x, y = as_tensor(x_src), as_tensor(x_anchor)
        if x.shape != y.shape:
            raise ValueError(f"source {tuple(x.shape)} and anchor {tuple(y.shape)} differ in shape")
        term = x @ y.transpose(-1, -2)
        total = term if total is None else total + term
    return like(total, pairs[0][0])


def procrustes(cross: Array, *, special: bool = False) -> Array:
    r"""Batched orthogonal Procrustes: :math:`R = \arg\max_{R \in O(n)} \operatorname{tr}(R^\top M)`.

    With :math:`M = \sum X_{src} X_{anchor}^\top = U S V^\top`, :math:`R = U V^\top` minimises
    :math:`\sum \|R^\top X_{src} - X_{anchor}\|_F^2 = \text{const} - 2\operatorname{tr}(R^\top M)`.
    **The source moves as** :math:`X_{src} \to R^\top X_{src}` (group element :math:`T = R^\top`).

    Parameters
    ----------
    cross : (..., n, n)
        Cross matrices; all leading axes are batch axes (one ``torch.linalg.svd`` call for all of them).
    special : bool
        Restrict to :math:`SO(n)` (Kabsch): :math:`R = U \operatorname{diag}(1, \dots, 1, \det UV^\top) V^\top`.

    Returns
    -------
    (..., n, n)
        :math:`R`, in the array type of ``cross``.
    """
    m = as_tensor(cross)
    u, _, vh = torch.linalg.svd(m)
    if special:
        flip = torch.sign(torch.linalg.det(u @ vh))
        u = torch.cat([u[..., :-1], u[..., -1:] * flip[..., None, None]], dim=-1)
    return like(u @ vh, cross)


def ones_basis(n: int) -> np.ndarray:
    r"""A symmetric orthogonal :math:`H` (a Householder reflection) whose first column is :math:`1/\sqrt{n}`: its
    other columns are an orthonormal basis of the complement of the ones vector."""
    v = -np.full(n, 1.0 / np.sqrt(n))
    v[0] += 1.0
    if not np.any(v):
        return np.eye(n)
    return np.eye(n) - 2.0 * np.outer(v, v) / (v @ v)


def procrustes_fixing_ones(cross: Array) -> np.ndarray:
    r"""Procrustes over :math:`\{R \in O(n) : R 1 = \pm 1\}` (the residual group of a LayerNorm model).

    In the basis :math:`H` of :func:`ones_basis`, :math:`R = H \operatorname{diag}(s, R') H`:
    :math:`\operatorname{tr}(R^\top M) = s\,(H^\top M H)_{00} + \operatorname{tr}(R'^\top (H^\top M H)_{1:,1:})`, so
    :math:`s` is the sign of the first term and :math:`R'` is ordinary Procrustes on the complement. Same
    convention as :func:`procrustes` (the source moves as :math:`R^\top X`); batched over leading axes.
    """
    m = as_numpy(cross)
    h = ones_basis(m.shape[-1])
    inner = h @ m @ h
    rotated = np.zeros_like(inner)
    rotated[..., 0, 0] = np.where(inner[..., 0, 0] < 0, -1.0, 1.0)
    rotated[..., 1:, 1:] = as_numpy(procrustes(np.ascontiguousarray(inner[..., 1:, 1:])))
    return h @ rotated @ h


def bound_condition(matrices: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The nearest matrices of condition number at most ``bound``, batched over leading axes; returns them and a
    mask of the matrices that changed (the others are returned exactly as they were).

    Nearest in the log-singular values: with :math:`M = U \operatorname{diag}(e^{x}) V^\top`, the logs
    :math:`x_i` are clipped into :math:`[l, l + \log \kappa]` with :math:`l` minimising
    :math:`\sum_i (x_i - \operatorname{clip}(x_i))^2`, keeping :math:`U, V`. That distance is the same for
    :math:`M` and :math:`M^{-1}` (which negates :math:`x`), as it must be for maps acting as :math:`T` on one
    side of a pair and :math:`T^{-1}` on the other; clipping only from below (or above) would move one side
    of the pair only, clipping around the geometric mean of the extremes ignores how many values sit at each.
    :math:`f(l) = \sum_i \operatorname{dist}(l, [x_i - \log \kappa, x_i])^2` is convex and piecewise
    quadratic: its derivative is piecewise linear between the breakpoints :math:`x_i, x_i - \log \kappa`,
    so the minimiser is found exactly by interpolating it on the segment where it changes sign.

    >>> m = torch.diag(torch.tensor([1000.0, 1.0, 0.1], dtype=torch.float64))
    >>> [round(float(v), 4) for v in torch.linalg.svdvals(bound_condition(m, 100.0)[0])]
    [100.0, 1.0, 1.0]
    """
    x = torch.log(torch.linalg.svdvals(matrices))  # every step checks every base: vectors only where needed
    out = x.amax(-1) - x.amin(-1) > math.log(bound)
    span = math.log(bound) * (1 - 1e-12)  # a hair inside: the condition measured afterwards stays <= bound
    if not bool(out.any()):
        return matrices, out
    u, s, vh = torch.linalg.svd(matrices[out])
    x = torch.log(s)
    breaks = torch.sort(torch.cat([x, x - span], dim=-1), dim=-1).values

    def slope(at):  # f'(l) / 2 at each breakpoint, batched
        at = at[..., :, None]
        low, high = x[..., None, :], x[..., None, :] - span
        return ((at - low).clamp(min=0) - (high - at).clamp(min=0)).sum(-1)

    d = slope(breaks)  # non-decreasing, <= 0 at the first breakpoint, >= 0 at the last
    k = torch.clamp((d <= 0).sum(-1, keepdim=True) - 1, 0, breaks.shape[-1] - 2)
    p0, p1 = breaks.gather(-1, k), breaks.gather(-1, k + 1)
    d0, d1 = d.gather(-1, k), d.gather(-1, k + 1)
    rise = d1 - d0
    lo = torch.where(rise > 0, p0 - d0 * (p1 - p0) / torch.where(rise > 0, rise, 1.0), p0)
    clipped = torch.exp(torch.minimum(torch.maximum(x, lo), lo + span))
    result = matrices.clone()
    result[out] = (u * clipped[..., None, :]) @ vh
    return result, out


def procrustes_value(cross: Array, *, special: bool = False) -> np.ndarray:
    r""":math:`\max_R \operatorname{tr}(R^\top M)`: the nuclear norm :math:`\|M\|_* = \sum_i \sigma_i` over
    :math:`O(n)`; over :math:`SO(n)` the smallest singular value counts negatively when :math:`\det M < 0`.
    Returns a numpy array of the batch shape."""
    m = as_tensor(cross)
    s = torch.linalg.svdvals(m)
    value = s.sum(-1)
    if special:
        value = value - 2.0 * s[..., -1] * (torch.linalg.det(m) < 0)
    return as_numpy(value)


# -- permutations: Hungarian ---------------------------------------------------------------------------------
def hungarian(similarity: Array) -> np.ndarray:
    r"""Permutation maximising :math:`\sum_i S_{i, perm_i}` (exact, ``linear_sum_assignment``).

    Parameters
    ----------
    similarity : (n, n') with n <= n'
        :math:`S_{ij} = \langle \text{anchor unit } i, \text{source unit } j\rangle` (``cross.T``).

    Returns
    -------
    perm : (n,) int64
        Aligned source ``X[perm]``; as a matrix :math:`P_{i, perm_i} = 1`, :math:`X \to P X`, and
        :math:`\sum_i S_{i, perm_i} = \langle P, S\rangle = \sum \langle P X_{src}, X_{anchor}\rangle`.

    When every row's maximum lies in a different column, those maxima are the assignment: no assignment can
    beat the sum of the row maxima. Models that are already nearly aligned (refinement rounds) mostly take this
    O(n^2) exit instead of the O(n^3) search.

    ``maximize=True`` makes scipy minimise a negated copy of the matrix (970 MB at an 11008-unit FFN); a writable
    float64 array is negated in place instead, handed over as it is, and restored (negation is exact both ways:
    scipy sees the same numbers, the caller gets its array back bit for bit).
    """
    s = as_numpy(similarity)
    if s.ndim != 2 or s.shape[0] > s.shape[1]:
        raise ValueError(f"similarity must be (n, n') with n <= n', got {s.shape}")
    best = np.argmax(s, axis=1)
    if np.unique(best).size == s.shape[0] and np.isfinite(s).all():
        return best.astype(np.int64)
    if s.flags.writeable and s.flags.c_contiguous:
        np.negative(s, out=s)
        try:
            rows, cols = linear_sum_assignment(s)
        finally:
            np.negative(s, out=s)
    else:
        rows, cols = linear_sum_assignment(s, maximize=True)
    perm = np.empty(s.shape[0], dtype=np.int64)
    perm[rows] = cols
    return perm


def signed_hungarian(similarity: Array) -> tuple[np.ndarray, np.ndarray]:
    r"""Best signed permutation: maximise :math:`\sum_i s_i S_{i, perm_i}` over permutations and signs.

    For a fixed pairing the best sign is :math:`\operatorname{sign} S_{i, perm_i}`, giving
    :math:`|S_{i, perm_i}|`; so assign on :math:`|S|` and read the signs off.

    Returns
    -------
    perm : (n,) int64
    signs : (n,) float64 in {-1, +1}
        Aligned source ``signs[:, None] * X[perm]`` (:math:`T = \operatorname{diag}(s) P`); a dual member moves
        the same way, since :math:`T^{-T} = T`.
    """
    s = as_numpy(similarity)
    perm = hungarian(np.abs(s))
    signs = np.where(s[np.arange(s.shape[0]), perm] < 0, -1.0, 1.0)
    return perm, signs


# -- scalar rescale: the quartic of eq. (12) -------------------------------------------------------------------
def rescale_from_stats(q_sq, q_dot, k_sq, k_dot, *, positive: bool = False) -> np.ndarray:
    r"""Vectorised eq. (11)-(12): minimise :math:`a^2\|Q_1\|^2 - 2a\langle Q_1,Q_2\rangle
    + \|K_1\|^2/a^2 - 2\langle K_1,K_2\rangle/a` over :math:`a \ne 0` (or :math:`a > 0`).

    Stationary points: :math:`\|Q_1\|^2 a^4 - \langle Q_1,Q_2\rangle a^3 + \langle K_1,K_2\rangle a
    - \|K_1\|^2 = 0`; every admissible real root and :math:`a = 1` is evaluated and the minimiser returned.
    Arguments broadcast; the result has their common shape."""
    return minimize_scale(q_sq, q_dot, k_sq, k_dot, power=1, positive=positive)


def rescale_objective(a, q_sq, q_dot, k_sq, k_dot) -> np.ndarray:
    r""":math:`\|aQ_1 - Q_2\|^2 + \|K_1/a - K_2\|^2 - \|Q_2\|^2 - \|K_2\|^2` (anchor constants dropped)."""
    return scale_objective(a, q_sq, q_dot, k_sq, k_dot, power=1)


def rescale_quartic(wq_src: Array, wq_anchor: Array, wk_src: Array, wk_anchor: Array, *,
                    positive: bool = False) -> float:
    r"""Paper eq. (11)-(12): :math:`\arg\min_a \|a Q_1 - Q_2\|^2 + \|K_1 / a - K_2\|^2`.

    Parameters
    ----------
    wq_src, wq_anchor, wk_src, wk_anchor : arrays
        :math:`Q_1, Q_2, K_1, K_2` of any shapes (:math:`Q_1 \sim Q_2`, :math:`K_1 \sim K_2`), biases already
        concatenated by the caller.
    positive : bool
        Keep :math:`a > 0`; otherwise any :math:`a \ne 0`.

    Returns
    -------
    float
        :math:`a`; the source moves as :math:`Q_1 \to a Q_1`, :math:`K_1 \to K_1 / a`.
    """
    q1, q2, k1, k2 = (as_numpy(x) for x in (wq_src, wq_anchor, wk_src, wk_anchor))
    a = rescale_from_stats(np.sum(q1 * q1), np.sum(q1 * q2), np.sum(k1 * k1), np.sum(k1 * k2),
                           positive=positive)
    return float(a)


# -- joint rotation + rescale ----------------------------------------------------------------------------------
def qk_objective(R: Array, a, mq: Array, mk: Array, q_sq, k_sq) -> np.ndarray:
    r""":math:`\|a R^\top Q_1 - Q_2\|^2 + \|R^\top K_1 / a - K_2\|^2` minus the anchor constants
    :math:`\|Q_2\|^2 + \|K_2\|^2`, i.e. :math:`a^2\|Q_1\|^2 + \|K_1\|^2/a^2 - 2a\langle R, M_Q\rangle
    - 2\langle R, M_K\rangle / a`. Batched; returns a numpy array of the batch shape."""
    r, mq_, mk_ = as_numpy(R), as_numpy(mq), as_numpy(mk)
    a = np.asarray(a, dtype=np.float64)
    tq, tk = np.sum(r * mq_, axis=(-2, -1)), np.sum(r * mk_, axis=(-2, -1))
    return a * a * q_sq + k_sq / (a * a) - 2 * a * tq - 2 * tk / a


def _profile(mq: torch.Tensor, mk: torch.Tensor, q: np.ndarray, k: np.ndarray, a: np.ndarray,
             special: bool) -> np.ndarray:
    r"""Rotation-optimised objective :math:`F(a) = a^2 q + k/a^2 - 2 V(a M_Q + M_K/a)` for a (B, G) grid of
    :math:`a` per batch item (B, d, d): batched SVDs, chunked to bound memory."""
    b, g = a.shape
    d = mq.shape[-1]
    out = np.empty((b, g))
    step = max(1, _CHUNK_ELEMENTS // max(1, g * d * d))
    for lo in range(0, b, step):
        sl = slice(lo, lo + step)
        at = torch.from_numpy(a[sl])[..., None, None]
        m = at * mq[sl, None] + mk[sl, None] / at
        out[sl] = a[sl] ** 2 * q[sl, None] + k[sl, None] / a[sl] ** 2 - 2 * procrustes_value(m, special=special)
    return out


def _golden_refine(f, lo: np.ndarray, hi: np.ndarray, iters: int) -> np.ndarray:
    """Batched golden-section search of f(x: (B,)) -> (B,) on [lo, hi] per item; returns the best point seen."""
    x1, x2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    f1, f2 = f(x1), f(x2)
    for _ in range(iters):
        left = f1 < f2  # minimum in [lo, x2]
        hi, lo = np.where(left, x2, hi), np.where(left, lo, x1)
        new = np.where(left, hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo))
        fn = f(new)
        x2, f2, x1, f1 = (np.where(left, x1, new), np.where(left, f1, fn),
                          np.where(left, new, x2), np.where(left, fn, f2))
    return np.where(f1 < f2, x1, x2)


def _alternate(mq, mk, q, k, a, special, iters):
    r"""Block coordinate descent from ``a``: :math:`R \leftarrow` Procrustes of :math:`aM_Q + M_K/a`, then
    :math:`a \leftarrow` the quartic for that :math:`R` (same sign as :math:`a`). Never increases the objective;
    polishes a bracketed minimiser to full precision (the stationarity condition in :math:`a` at fixed
    :math:`R` is exactly the quartic; convergence is linear and fast in practice)."""
    sign = np.sign(a)
    for _ in range(iters):
        at = torch.from_numpy(a)[:, None, None]
        r = as_tensor(procrustes(at * mq + mk / at, special=special))
        tq, tk = as_numpy((r * mq).sum((-2, -1))), as_numpy((r * mk).sum((-2, -1)))
        new = sign * minimize_scale(q, sign * tq, k, sign * tk, power=1, positive=True)
        done = np.all(np.abs(new - a) <= 1e-13 * np.abs(a))
        a = new
        if done:
            break
    return a


def _scale_bracket(mq, mk, q, k, f_best, fallback_lo, fallback_hi):
    r"""Rigorous bracket :math:`[a_{lo}, a_{hi}]` of :math:`|a^*|`: since
    :math:`\|aM_Q + M_K/a\|_* \le |a|\|M_Q\|_* + \|M_K\|_*/|a|`, :math:`F(a) \ge L(|a|)`,
    :math:`L(b) = qb^2 - 2\|M_Q\|_* b + k/b^2 - 2\|M_K\|_*/b`, so :math:`|a^*|` lies where
    :math:`L \le F_{best}`: between the extreme positive roots of
    :math:`qb^4 - 2\|M_Q\|_* b^3 - F_{best} b^2 - 2\|M_K\|_* b + k`. Falls back per item when degenerate."""
    nq, nk = procrustes_value(mq), procrustes_value(mk)
    coeffs = np.stack([q, -2 * nq, -f_best, -2 * nk, k], axis=1)
    roots = polynomial_roots(coeffs)
    real = np.where((np.abs(roots.imag) <= 1e-6 * np.abs(roots)) & (roots.real > 0), roots.real, np.nan)
    with np.errstate(all="ignore"):
        lo, hi = np.nanmin(real, axis=1) / (1 + 1e-8), np.nanmax(real, axis=1) * (1 + 1e-8)
    bad = ~((q > 0) & (k > 0) & np.isfinite(lo) & np.isfinite(hi) & (hi > lo))
    return np.where(bad, fallback_lo, lo), np.where(bad, fallback_hi, hi)


def joint_rotation_rescale(mq: Array, mk: Array, q_sq, k_sq, *, positive: bool = True, special: bool = False,
                           span: float = 1e3, grid: int = 25, resolution: float = 0.03, refine_iters: int = 6,
                           polish_iters: int = 12) -> tuple[Array, np.ndarray]:
    r"""Globally optimal joint rotation and scalar rescale of a QK pair (per head).

    Minimises :math:`G(R, a) = \|a R^\top Q_1 - Q_2\|^2 + \|R^\top K_1/a - K_2\|^2
    = a^2\|Q_1\|^2 + \|K_1\|^2/a^2 - 2\operatorname{tr}(R^\top(aM_Q + M_K/a)) + \text{const}`.
    For fixed :math:`a` the best :math:`R` is Procrustes of :math:`aM_Q + M_K/a` with value
    :math:`\|aM_Q + M_K/a\|_*`, so the problem is the 1-D :math:`\min_a F(a)`,
    :math:`F(a) = a^2\|Q_1\|^2 + \|K_1\|^2/a^2 - 2\|aM_Q + M_K/a\|_*`:

    1. :math:`F` at :math:`a = 1`, :math:`a_0 = (\|K_1\|^2/\|Q_1\|^2)^{1/4}` and the sequential solution
       (Procrustes on :math:`M_Q + M_K`, then the quartic) gives :math:`F_{best}`;
    2. a rigorous bracket of the minimiser from the lower bound
       :math:`F(a) \ge a^2\|Q_1\|^2 - 2a\|M_Q\|_* + \|K_1\|^2/a^2 - 2\|M_K\|_*/a` (roots of a quartic);
       degenerate items use :math:`a_0[1/\text{span}, \text{span}]`;
    3. a log-spaced scan over the bracket, ``resolution`` apart in :math:`\log a` (at least 5, at most ``grid``
       points; one batched SVD per point, all heads at once),
       then ``refine_iters`` batched golden-section steps inside the best grid cell;
    4. polish by alternating Procrustes / quartic (monotone, converges to full precision);
    5. keep the best of the polished point and the step-1 candidates: never worse than rotation-then-rescale.

    Over :math:`O(n)`, :math:`F(-a) = F(a)` (absorb :math:`-I` into :math:`R`), so :math:`a > 0` always; with
    ``special=True`` and ``positive=False`` both signs are searched.

    Parameters
    ----------
    mq, mk : (..., d, d)
        :math:`M_Q = \sum Q_{src} Q_{anchor}^\top`, :math:`M_K = \sum K_{src} K_{anchor}^\top`
        (:func:`cross_matrix`; biases included by the caller).
    q_sq, k_sq : array_like broadcastable to the batch shape ``...``
        :math:`\|Q_{src}\|^2`, :math:`\|K_{src}\|^2` (same members as the cross matrices).

    Returns
    -------
    R : (..., d, d)
        In the type of ``mq``. Source moves as :math:`Q \to a R^\top Q`, :math:`K \to R^\top K / a`
        (group element :math:`T = a R^\top` on the primal Q side; :math:`T^{-T} = R^\top / a` on K).
    a : numpy array of the batch shape
    """
    MQ, MK = as_tensor(mq), as_tensor(mk)
    batch, d = MQ.shape[:-2], MQ.shape[-1]
    MQ, MK = MQ.reshape(-1, d, d), MK.reshape(-1, d, d)
    nb = MQ.shape[0]
    q = np.broadcast_to(np.asarray(q_sq, dtype=np.float64), batch).reshape(-1).copy()
    k = np.broadcast_to(np.asarray(k_sq, dtype=np.float64), batch).reshape(-1).copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        a0 = np.where((q > 0) & (k > 0), (k / np.where(q > 0, q, 1.0)) ** 0.25, 1.0)

    r0 = as_tensor(procrustes(MQ + MK, special=special))
    tq, tk = as_numpy((r0 * MQ).sum((-2, -1))), as_numpy((r0 * MK).sum((-2, -1)))
    a_seq = minimize_scale(q, tq, k, tk, power=1, positive=positive)
    start = np.stack([np.ones(nb), a0, a_seq], axis=1)
    f_start = _profile(MQ, MK, q, k, start, special)
    lo, hi = _scale_bracket(MQ, MK, q, k, f_start.min(axis=1), a0 / span, a0 * span)
    log_lo, log_hi = np.log(lo), np.log(hi)
    width = float(np.max(log_hi - log_lo))
    grid = int(np.clip(np.ceil(width / resolution) + 1, 5, grid))
    cells = np.linspace(0.0, 1.0, grid)[None, :]
    log_grid = log_lo[:, None] + cells * (log_hi - log_lo)[:, None]
    cell = (log_hi - log_lo) / (grid - 1)

    candidates = [start]
    for sign in ((1.0, -1.0) if (special and not positive) else (1.0,)):
        def F(la, sign=sign):
            return _profile(MQ, MK, q, k, sign * np.exp(la), special)
        centre = log_grid[np.arange(nb), np.argmin(F(log_grid), axis=1)]
        best = _golden_refine(lambda x: F(x[:, None])[:, 0], centre - cell, centre + cell, refine_iters)
        candidates.append(_alternate(MQ, MK, q, k, sign * np.exp(best), special, polish_iters)[:, None])
    cand = np.concatenate(candidates, axis=1)
    a = cand[np.arange(nb), np.argmin(_profile(MQ, MK, q, k, cand, special), axis=1)]

    at = torch.from_numpy(a)[:, None, None]
    R = as_tensor(procrustes(at * MQ + MK / at, special=special)).reshape(*batch, d, d)
    return like(R, mq), a.reshape(batch)


# -- rotary: per-pair scaled rotation -------------------------------------------------------------------------
def rotation_2x2(phi, c=1.0) -> np.ndarray:
    r""":math:`c R(\phi) = c\begin{pmatrix}\cos\phi & -\sin\phi\\ \sin\phi & \cos\phi\end{pmatrix}`,
    shape ``(..., 2, 2)``."""
    phi, c = np.broadcast_arrays(np.asarray(phi, dtype=np.float64), np.asarray(c, dtype=np.float64))
    cos, sin = c * np.cos(phi), c * np.sin(phi)
    return np.stack([np.stack([cos, -sin], -1), np.stack([sin, cos], -1)], -2)


def _pair_z(cross: Array) -> np.ndarray:
    r"""The 2x2 cross matrix as a complex number :math:`z = (M_{00} + M_{11}) + i(M_{01} - M_{10})`, so that
    :math:`\langle R(\phi) X, Y\rangle = \langle R(\phi), M^\top\rangle = \operatorname{Re}(z e^{-i\phi})`."""
    m = as_numpy(cross)
    return (m[..., 0, 0] + m[..., 1, 1]) + 1j * (m[..., 0, 1] - m[..., 1, 0])


def rotary_objective(phi, c, cross_q: Array, cross_k: Array, q_sq, k_sq) -> np.ndarray:
    r""":math:`\|cR(\phi)X_q - Y_q\|^2 + \|R(\phi)X_k/c - Y_k\|^2` minus anchor constants
    :math:`= c^2\|X_q\|^2 + \|X_k\|^2/c^2 - 2\operatorname{Re}((c z_q + z_k/c) e^{-i\phi})`, per pair."""
    zq, zk = _pair_z(cross_q), _pair_z(cross_k)
    c = np.asarray(c, dtype=np.float64)
    return c * c * q_sq + k_sq / (c * c) - 2 * np.real((c * zq + zk / c) * np.exp(-1j * np.asarray(phi)))


def _rotary_stationary_u(A, C, a2, b2, g) -> np.ndarray:
    r"""Real parts of the roots (N, 6) in :math:`u = c^2` of
    :math:`(Au^2 - C)^2(a_2u^2 + 2gu + b_2) - u(a_2u^2 - b_2)^2`, solved in :math:`t = u/u_0`,
    :math:`u_0 = \sqrt{C/A}`, with each row scaled to unit max coefficient."""
    n = A.shape[0]
    left = np.zeros((n, 7))
    sq = np.stack([A * A, 0 * A, -2 * A * C, 0 * A, C * C], 1)  # (Au^2 - C)^2, degree 4
    quad = np.stack([a2, 2 * g, b2], 1)
    for i in range(5):
        for j in range(3):
            left[:, i + j] += sq[:, i] * quad[:, j]
    right = np.stack([0 * A, a2 * a2, 0 * A, -2 * a2 * b2, 0 * A, b2 * b2, 0 * A], 1)
    coeffs = left - right
    with np.errstate(divide="ignore", invalid="ignore"):
        u0 = np.where((A > 0) & (C > 0), np.sqrt(C / np.where(A > 0, A, 1.0)), 1.0)
    coeffs = coeffs * u0[:, None] ** np.arange(6, -1, -1)[None, :]
    norm = np.abs(coeffs).max(axis=1, keepdims=True)
    coeffs = coeffs / np.where(norm > 0, norm, 1.0)
    return polynomial_roots(coeffs).real * u0[:, None]


def rotary_closed_form(cross_q: Array, cross_k: Array | None = None, q_sq=None, k_sq=None, *,
                       scaled: bool = True, polish_iters: int = 8) -> tuple[np.ndarray, np.ndarray]:
    r"""Optimal rotary commutant element per frequency pair: :math:`T = c R(\phi)`, :math:`c > 0`.

    Angle: for :math:`X \to R(\phi) X`, :math:`\sum\langle R(\phi)X, Y\rangle = \operatorname{Re}(z e^{-i\phi})`
    with :math:`z = (M_{00} + M_{11}) + i(M_{01} - M_{10})`, :math:`M = \sum X Y^\top`; the maximiser is
    :math:`\phi = \operatorname{atan2}(M_{01} - M_{10}, M_{00} + M_{11})`, value :math:`|z|`. (Procrustes'
    :math:`R` acts as :math:`R^\top`, hence the swapped sign against :math:`\operatorname{atan2}(M_{10} -
    M_{01}, \cdot)`: ``rotation_2x2(phi) == procrustes(M, special=True).T``.)

    Scale (``scaled=True``): minimise :math:`\|cR X_q - Y_q\|^2 + \|R X_k / c - Y_k\|^2` jointly. For fixed
    :math:`c` the best angle is :math:`\arg(c z_q + z_k/c)`, leaving, with :math:`u = c^2`,
    :math:`h(u) = Au + C/u - 2\sqrt{a_2u + b_2/u + 2g}` (:math:`A = \|X_q\|^2`, :math:`C = \|X_k\|^2`,
    :math:`a_2 = |z_q|^2`, :math:`b_2 = |z_k|^2`, :math:`g = \operatorname{Re}(z_q\bar z_k)`).
    :math:`h'(u) = 0` squares to the sextic :math:`(Au^2 - C)^2(a_2u^2 + 2gu + b_2) = u(a_2u^2 - b_2)^2`; all its
    positive real roots, the kink :math:`u = \sqrt{b_2/a_2}`, :math:`u = 1` and the sequential solution
    (angle at :math:`c = 1`, then the quartic for :math:`c`) are compared, then polished by alternating
    angle / quartic (monotone). Exact, and never worse than the sequential solution.

    Parameters
    ----------
    cross_q : (..., P, 2, 2)
        :math:`M_Q = \sum X_q Y_q^\top` per pair (with ``scaled=False``: the total cross matrix of all members).
    cross_k : (..., P, 2, 2), optional
        :math:`M_K` (required when ``scaled``; added to ``cross_q`` otherwise).
    q_sq, k_sq : (..., P)
        :math:`\|X_q\|^2`, :math:`\|X_k\|^2` per pair (required when ``scaled``).

    Returns
    -------
    phi, c : (..., P) numpy arrays
        Source moves as :math:`X_q \to c R(\phi) X_q`, :math:`X_k \to R(\phi) X_k / c` (``c = 1`` unscaled).
    """
    zq = _pair_z(cross_q)
    zk = np.zeros_like(zq) if cross_k is None else _pair_z(cross_k)
    if not scaled:
        return np.angle(zq + zk), np.ones(zq.shape)
    if cross_k is None or q_sq is None or k_sq is None:
        raise ValueError("scaled rotary matching needs cross_k, q_sq and k_sq")
    shape = zq.shape
    zq, zk = zq.reshape(-1), zk.reshape(-1)
    A = np.broadcast_to(np.asarray(q_sq, dtype=np.float64), shape).reshape(-1)
    C = np.broadcast_to(np.asarray(k_sq, dtype=np.float64), shape).reshape(-1)
    a2, b2, g = np.abs(zq) ** 2, np.abs(zk) ** 2, np.real(zq * np.conj(zk))

    def scale_for(phi):  # the quartic at a fixed angle
        rot = np.exp(-1j * phi)
        return minimize_scale(A, np.real(zq * rot), C, np.real(zk * rot), power=1, positive=True)

    with np.errstate(divide="ignore", invalid="ignore"):
        kink = np.where(a2 > 0, np.sqrt(b2 / np.where(a2 > 0, a2, 1.0)), 1.0)
    u = np.concatenate([_rotary_stationary_u(A, C, a2, b2, g), kink[:, None], np.ones((A.size, 1)),
                        scale_for(np.angle(zq + zk))[:, None] ** 2], axis=1)
    ok = np.isfinite(u) & (u > 0)
    us = np.where(ok, u, 1.0)
    with np.errstate(invalid="ignore"):
        h = A[:, None] * us + C[:, None] / us - 2 * np.sqrt(np.maximum(
            a2[:, None] * us + b2[:, None] / us + 2 * g[:, None], 0.0))
    c = np.sqrt(us[np.arange(A.size), np.argmin(np.where(ok, h, np.inf), axis=1)])
    for _ in range(polish_iters):
        c_new = scale_for(np.angle(c * zq + zk / c))
        if np.all(np.abs(c_new - c) <= 1e-15 * c):
            c = c_new
            break
        c = c_new
    return np.angle(c * zq + zk / c).reshape(shape), c.reshape(shape)


# -- per-unit scales ----------------------------------------------------------------------------------------------
def unit_scale_objective(d, x_src_rows, x_anchor_rows, dual_src_cols=None, dual_anchor_cols=None, *,
                         dual_power: int = 1) -> np.ndarray:
    r"""Per unit :math:`\|d_i x_i - y_i\|^2 + \|z_i d_i^{-p} - w_i\|^2` minus :math:`\|y_i\|^2 + \|w_i\|^2`."""
    A, B, C, D = _unit_stats(x_src_rows, x_anchor_rows, dual_src_cols, dual_anchor_cols)
    return scale_objective(d, A, B, C, D, power=dual_power)


def _unit_stats(x_src_rows, x_anchor_rows, dual_src_cols, dual_anchor_cols):
    x, y = as_numpy(x_src_rows), as_numpy(x_anchor_rows)
    A, B = np.sum(x * x, axis=-1), np.sum(x * y, axis=-1)
    if dual_src_cols is None:
        return A, B, np.zeros_like(A), np.zeros_like(A)
    z, w = as_numpy(dual_src_cols), as_numpy(dual_anchor_cols)
    return A, B, np.sum(z * z, axis=-2), np.sum(z * w, axis=-2)


def unit_scales(x_src_rows: Array, x_anchor_rows: Array, dual_src_cols: Array | None = None,
                dual_anchor_cols: Array | None = None, positive: bool = True, *,
                dual_power: int = 1) -> np.ndarray:
    r"""Optimal per-unit scale, each unit independently and exactly.

    Unit :math:`i` moves as :math:`x_i \to d_i x_i` (a row of the primal side: FFN input rows, up-projection
    rows, with bias) and :math:`z_i \to z_i d_i^{-p}` (a column of the dual side: FFN output / down-projection
    columns). Minimises :math:`f_i(d) = d^2\|x_i\|^2 - 2d\langle x_i,y_i\rangle + \|z_i\|^2 d^{-2p}
    - 2\langle z_i,w_i\rangle d^{-p}`; stationary points are the roots of
    :math:`\|x_i\|^2 d^{2p+2} - \langle x_i,y_i\rangle d^{2p+1} + p\langle z_i,w_i\rangle d^p - p\|z_i\|^2`
    (a quartic for :math:`p = 1`), found for all units at once as eigenvalues of stacked companion matrices.

    Parameters
    ----------
    x_src_rows, x_anchor_rows : (..., n, m)
        Primal side, unit ``i`` is row ``i``.
    dual_src_cols, dual_anchor_cols : (..., p, n), optional
        Dual side, unit ``i`` is column ``i``.
    positive : bool
        ``True`` for ReLU / LeakyReLU (:math:`d > 0`), ``False`` for the gated-FFN up/down scale (:math:`d\ne0`).
    dual_power : int
        :math:`p`: 1 normally, 2 for ReLU^2 (output side scaled by :math:`1/d^2`).

    Returns
    -------
    d : (..., n) numpy array
    """
    A, B, C, D = _unit_stats(x_src_rows, x_anchor_rows, dual_src_cols, dual_anchor_cols)
    return minimize_scale(A, B, C, D, power=dual_power, positive=positive)
