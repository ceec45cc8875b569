"""The continuous part of group elements as differentiable parameters (learned matching's direct method).

Each group with continuous degrees of freedom gets one tensor of parameters, zero at the identity, and a map
from parameters to an element that lies in the group by construction:

- orthogonal: ``Q = exp(X - X^T)`` (a skew matrix's exponential is orthogonal); for ``{Q : Q 1 = 1}`` (a
  folded LayerNorm stream) the rotation acts on the complement of the ones vector only, ``Q = H diag(1,
  exp(K)) H`` with ``H`` the Householder basis of :func:`symgraph.solve.kernels.ones_basis`;
- general linear: ``exp(X)`` (always invertible; any invertible map is in the group, so bounding its condition
  number keeps it there: see below);
- rotary: a rotation angle and a log-scale per frequency pair, ``exp`` of a general (or skew, without scales)
  matrix on the pass-through coordinates;
- scales (scale groups and monomial groups with positive or nonzero scales): ``exp`` of a log-scale; signs and
  permutations are discrete and stay where the start put them.

Matrix exponentials are taken on a *base*: a matrix generator ``X`` stands for ``B exp(X)``, where the base ``B``
(float64, the identity at first) holds every step taken so far. Learning moves the generators by one optimiser
step and then :meth:`ContinuousElements.absorb` folds them into the bases (``B <- B exp(X)``, ``X <- 0``), so the
differentiable elements are always evaluated at ``X = 0``. There ``B exp(X)`` and ``B (I + X)`` have the same
value and the same gradient, and :meth:`ContinuousElements.elements` uses the second: no matrix exponential,
and above all no backward pass through one, in a learning step (on the wide ViT that backward pass cost more
than ten times its forward pass). The optimiser's moments live in the Lie algebra at the current point (Adam on
the right-trivialised gradient ``B^T dL/dB``). Vectors (log-scales, rotary angles) are their own parameters.

General linear bases (QK and VO maps, the pass-through block of a rotary group with scales) are kept *well
conditioned*: after each absorb, where the map applied to the source's coordinates, the base ``B`` composed with the
map ``S`` that the elements learning starts after already apply to them (``after``: a start's general linear head
maps or rotary pass-through maps; :func:`symgraph.elements.composed_matrices`), has a condition number above
``max_condition`` (the solvers' bound, :data:`symgraph.solve.kernels.MAX_CONDITION`, by default), ``B S`` is
replaced by the nearest map within it (:func:`symgraph.solve.kernels.bound_condition`: singular values clipped in
log space, singular vectors kept) and ``S`` divided back out. The bound holds for the map that moves the source's
weights, not for the learned step alone (which could otherwise compound a start of condition 100 to 100 x 100).
Every invertible matrix is an element of the group, so the projection changes where learning is, never whether the
result is an exact reparametrisation. Adam's moments are left as they are: the projection moves a base only at the
boundary, the component of the moments that pushes outward is undone by the next projection (projected gradient
descent) and the others still point where the loss falls; zeroing them would cost the moments of every other copy in
the same tensor, or (per copy) leave Adam's bias correction dividing by almost nothing.

:meth:`ContinuousElements.elements` gives elements whose ``matrices`` / ``diag`` are torch tensors, so
:func:`symgraph.elements.apply` is differentiable in the parameters; :meth:`ContinuousElements.exact` gives
the same elements in float64 NumPy, ``B exp(X)`` computed in float64 (orthogonal to rounding), for the final
state that is then verified like every alignment.

Examples
--------
>>> import numpy as np
>>> from symgraph.groups import Group, Member
>>> g = Group("r", "residual", "orthogonal", 3, 1, (Member("w", 0, np.arange(3).reshape(1, 3, 1)),))
>>> p = ContinuousElements([g])
>>> bool(np.allclose(p.exact()[0].matrices, np.eye(3)))
True
"""
from __future__ import annotations

import math

import numpy as np
import torch

from .elements import Element, composed_matrices
from .groups import Group
from .solve.kernels import MAX_CONDITION, bound_condition

__all__ = ["ContinuousElements", "REFERENCE_SIDE", "has_continuous_part"]

SCALED = ("positive", "nonzero")
REFERENCE_SIDE = 64  # the generator side whose entries step by the learning rate itself (the shipped widths)


def has_continuous_part(group: Group) -> bool:
    """Whether ``group`` has continuous degrees of freedom that :class:`ContinuousElements` parametrises."""
    if group.kind in ("orthogonal", "general_linear", "rotary"):
        return group.dof > 0
    return group.scale in SCALED and group.kind in ("scale", "permutation")


class ContinuousElements:
    """Parameters (zero: the identity) of the continuous part of every group in ``groups`` that has one, and the
    bases their matrix generators act on, the general linear ones kept within ``max_condition`` together with the
    maps that the elements ``after`` (those applied before these, as a start's) give the same coordinates (module
    docstring; ``math.inf``: no bound)."""

    def __init__(self, groups, dtype=torch.float32, max_condition: float = MAX_CONDITION, after=()):
        self.max_condition = max_condition
        self.groups = [g for g in groups if has_continuous_part(g)]
        self.parameters = [_zeros(g, dtype).requires_grad_(True) for g in self.groups]
        self.bases = [_identity_base(g) for g in self.groups]  # float64; None: the group has no matrix generator
        # the general linear block of the map the elements `after` apply to each bounded group (None: not bounded)
        self.starts = [torch.as_tensor(_bounded_block(g, composed_matrices(list(after), g))) if _bounded(g)
                       else None for g in self.groups]

    def elements(self) -> list[Element]:
        """The elements, differentiable in :attr:`parameters` (torch tensors in ``matrices`` or ``diag``): exact in
        value and gradient where the matrix generators are zero (after :meth:`absorb`), first order elsewhere."""
        return [_element(g, p, _first_order, base) for g, p, base in zip(self.groups, self.parameters, self.bases)]

    @torch.no_grad()
    def exact(self) -> list[Element]:
        """The same elements in float64 NumPy (computed from the bases and parameters in float64)."""
        out = []
        for g, p, base in zip(self.groups, self.parameters, self.bases):
            e = _element(g, p.detach().to(torch.float64), _exponential, base)
            out.append(Element(g, matrices=None if e.matrices is None else e.matrices.numpy(),
                               perm=e.perm, diag=None if e.diag is None else e.diag.numpy()))
        return out

    @torch.no_grad()
    def absorb(self) -> int:
        """Fold the matrix generators into the bases (``B <- B exp(X)``, ``X <- 0``; the elements are unchanged),
        then bring every general linear base back within ``max_condition``, composed with the start's map of its
        coordinates (module docstring; a base that is not finite is left for :meth:`finite` to report). Returns how
        many bases (copies) that moved."""
        projected = 0
        for g, p, base, start in zip(self.groups, self.parameters, self.bases, self.starts):
            if base is None:
                continue
            generator = _generator(g, p.detach().to(torch.float64))
            base.copy_(base @ torch.linalg.matrix_exp(generator))
            _generator_entries(g, p).zero_()
            if start is not None and math.isfinite(self.max_condition) and bool(torch.isfinite(base).all()):
                bounded, moved = bound_condition(base @ start, self.max_condition)
                base[moved] = torch.linalg.solve(start[moved], bounded[moved], left=False)  # B = (B S) S^-1
                projected += int(moved.sum())
        return projected

    def condition(self, elements: list[Element]) -> float | None:
        """The largest condition number of the maps the bound covers, for ``elements`` (from :meth:`exact`):
        each general linear block composed with the map of the elements learning starts after, as the source's
        coordinates are moved by both (None: no group has such a block)."""
        conditions = [float(torch.linalg.cond(torch.as_tensor(_bounded_block(g, e.matrices)) @ start).max())
                      for g, e, start in zip(self.groups, elements, self.starts) if start is not None]
        return max(conditions) if conditions else None

    def finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.parameters) and \
            all(bool(torch.isfinite(b).all()) for b in self.bases if b is not None)

    def learning_rates(self, lr: float) -> list[float]:
        """The learning rate of each tensor in :attr:`parameters` for the width-aware rate ``lr`` (module
        docstring): ``lr * sqrt(REFERENCE_SIDE / n)`` for a generator of side ``n``, ``lr`` for vectors."""
        sides = [_generator_side(g) for g in self.groups]
        return [lr if side is None else lr * math.sqrt(REFERENCE_SIDE / side) for side in sides]

    @torch.no_grad()
    def values(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """A copy of the parameters and bases (for :meth:`load`)."""
        return [(p.detach().clone(), None if b is None else b.clone()) for p, b in zip(self.parameters, self.bases)]

    @torch.no_grad()
    def load(self, values: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Set the parameters and bases to ``values`` (from :meth:`values`)."""
        for p, b, (pv, bv) in zip(self.parameters, self.bases, values):
            p.copy_(pv)
            if b is not None:
                b.copy_(bv)


def _generator_side(g: Group) -> int | None:
    """The side of the square matrix ``g``'s parameters are the generator of (None: a vector of parameters;
    rotary groups are angles and scales per pair, their pass-through block is small)."""
    if g.kind == "orthogonal":
        return g.size - 1 if g.fixes_ones else g.size
    return g.size if g.kind == "general_linear" else None


def _zeros(g: Group, dtype) -> torch.Tensor:
    c, n = g.copies, g.size
    if g.kind == "orthogonal":
        m = n - 1 if g.fixes_ones else n
        return torch.zeros(c, m, m, dtype=dtype)
    if g.kind == "general_linear":
        return torch.zeros(c, n, n, dtype=dtype)
    if g.kind == "rotary":  # per pair an angle (and a log-scale), then the pass-through block
        per_pair = 2 if g.scale == "positive" else 1
        return torch.zeros(c, per_pair * len(g.rotary_pairs) + len(g.passthrough) ** 2, dtype=dtype)
    return torch.zeros(c, n, dtype=dtype)


def _identity_base(g: Group) -> torch.Tensor | None:
    """The base a group's matrix generator acts on, the identity at first (None: no matrix generator)."""
    side = _base_side(g)
    return None if side is None else torch.eye(side, dtype=torch.float64).repeat(g.copies, 1, 1)


def _base_side(g: Group) -> int | None:
    return len(g.passthrough) if g.kind == "rotary" and g.passthrough else _generator_side(g)


def _generator_entries(g: Group, p: torch.Tensor) -> torch.Tensor:
    """The entries of ``p`` that make up the matrix generator (a view: rotary keeps its angles and scales first)."""
    if g.kind != "rotary":
        return p
    return p[:, p.shape[1] - len(g.passthrough) ** 2:]


def _generator(g: Group, p: torch.Tensor) -> torch.Tensor:
    """The matrix generator ``X`` of ``p``: skew for rotations (orthogonal, and rotary without scales)."""
    x = _generator_entries(g, p)
    if g.kind == "rotary":
        side = len(g.passthrough)
        x = x.reshape(g.copies, side, side)
    return x - x.transpose(-1, -2) if _skew(g) else x


def _bounded(g: Group) -> bool:
    """Whether ``g`` has a general linear base (kept within the condition bound)."""
    return _base_side(g) is not None and not _skew(g)


def _bounded_block(g: Group, matrices: np.ndarray) -> np.ndarray:
    """The block of ``g``'s element matrices (copies, n, n) that its general linear base makes: all of a general
    linear group's, a rotary group's pass-through block."""
    if g.kind != "rotary":
        return matrices
    through = list(g.passthrough)
    return matrices[:, through][:, :, through]


def _skew(g: Group) -> bool:
    """Whether ``g``'s matrix generator is skew (its base a rotation), not general (its base general linear)."""
    return g.kind == "orthogonal" or (g.kind == "rotary" and g.scale != "positive")


def _exponential(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``B exp(X)``: the element, exactly in the group."""
    return base.to(x.dtype) @ torch.linalg.matrix_exp(x)


def _first_order(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``B (I + X)``: ``B exp(X)`` in value and gradient at ``X = 0``, where learning evaluates it."""
    b = base.to(x.dtype)
    return b + b @ x


def _element(g: Group, p: torch.Tensor, on_base, base: torch.Tensor | None) -> Element:
    if g.kind == "orthogonal":
        return Element(g, matrices=_orthogonal(g, on_base(base, _generator(g, p))))
    if g.kind == "general_linear":
        return Element(g, matrices=on_base(base, _generator(g, p)))
    if g.kind == "rotary":
        return Element(g, matrices=_rotary(g, p, on_base, base))
    perm = np.tile(np.arange(g.size), (g.copies, 1)) if g.kind == "permutation" else None
    return Element(g, perm=perm, diag=torch.exp(p))


def _orthogonal(g: Group, rotation: torch.Tensor) -> torch.Tensor:
    if not g.fixes_ones:
        return rotation
    from .solve.kernels import ones_basis

    n = g.size
    h = torch.as_tensor(ones_basis(n), dtype=rotation.dtype)
    inner = torch.zeros(rotation.shape[0], n, n, dtype=rotation.dtype)
    inner[:, 0, 0] = 1.0
    inner[:, 1:, 1:] = rotation
    return h @ inner @ h


def _rotary(g: Group, p: torch.Tensor, on_base, base: torch.Tensor | None) -> torch.Tensor:
    c, n, k = g.copies, g.size, len(g.rotary_pairs)
    scaled = g.scale == "positive"
    angle, through_at = p[:, :k], 2 * k if scaled else k
    scale = torch.exp(p[:, k:through_at]) if scaled else 1.0
    cos, sin = scale * torch.cos(angle), scale * torch.sin(angle)
    m = torch.zeros(c, n, n, dtype=p.dtype)
    i, j = (torch.as_tensor([pair[s] for pair in g.rotary_pairs], dtype=torch.long) for s in (0, 1))
    m[:, i, i], m[:, i, j], m[:, j, i], m[:, j, j] = cos, -sin, sin, cos
    through = list(g.passthrough)
    if through:
        idx = torch.as_tensor(through, dtype=torch.long)
        m[:, idx[:, None], idx[None, :]] = on_base(base, _generator(g, p))
    return m
