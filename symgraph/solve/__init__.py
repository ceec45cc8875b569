"""Solvers: the pure math kernels the alignment dispatcher calls (see :mod:`symgraph.solve.kernels` for the
conventions: source moves onto anchor, members are row-major in their coordinates, Procrustes' R acts as R^T)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from .kernels import (cross_matrix, head_matching, hungarian, joint_rotation_rescale, procrustes,
                      procrustes_value, qk_objective, rescale_from_stats, rescale_objective, rescale_quartic,
                      rotary_closed_form, rotary_objective, rotation_2x2, signed_hungarian, unit_scale_objective,
                      unit_scales)
from .matching import DescentResult, PermVariable, SignedPerm, coordinate_descent
from .polyroots import minimize_scale, polynomial_roots


class Kernel(NamedTuple):
    """A kernel and a one-line description of what it solves (for reports). Calling it calls ``fn``."""

    fn: Callable[..., Any]
    summary: str

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


KERNELS: dict[str, Kernel] = {
    "cross_matrix": Kernel(cross_matrix, "M = sum X_src X_anchor^T over members, batched"),
    "procrustes": Kernel(procrustes, "orthogonal Procrustes R = U V^T of the cross matrix (source -> R^T X), "
                                     "batched SVD"),
    "hungarian": Kernel(hungarian, "exact linear assignment maximising sum S[i, perm[i]]"),
    "signed_hungarian": Kernel(signed_hungarian, "exact signed-permutation assignment on |S|"),
    "coordinate_descent": Kernel(coordinate_descent, "coupled permutations: Hungarian coordinate ascent "
                                                     "(Git Re-Basin weight matching), monotone"),
    "rescale_quartic": Kernel(rescale_quartic, "scalar QK rescale a, Q -> aQ, K -> K/a: global minimiser of "
                                               "the quartic (paper eq. 12)"),
    "joint_rotation_rescale": Kernel(joint_rotation_rescale, "joint QK rotation + scalar rescale: 1-D global "
                                                             "search of ||a M_Q + M_K/a||_*, never worse than "
                                                             "sequential"),
    "head_matching": Kernel(head_matching, "head permutation x per-head rotation: Hungarian on nuclear norms, "
                                           "then Procrustes per matched pair"),
    "rotary_closed_form": Kernel(rotary_closed_form, "RoPE commutant per frequency pair: angle atan2 in closed "
                                                     "form, joint positive scale from a sextic"),
    "unit_scales": Kernel(unit_scales, "per-unit scale (ReLU positive, gated up/down nonzero): per-unit "
                                       "quartic, batched companion eigenvalues"),
}

__all__ = [
    "KERNELS", "Kernel", "DescentResult", "PermVariable", "SignedPerm", "coordinate_descent", "cross_matrix",
    "head_matching", "hungarian", "joint_rotation_rescale", "minimize_scale", "polynomial_roots", "procrustes",
    "procrustes_value", "qk_objective", "rescale_from_stats", "rescale_objective", "rescale_quartic",
    "rotary_closed_form", "rotary_objective", "rotation_2x2", "signed_hungarian", "unit_scale_objective",
    "unit_scales",
]
