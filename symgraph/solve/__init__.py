"""Solvers: the dispatcher (:mod:`symgraph.solve.dispatch`, one registered solver per group kind), the slices and
costs it reads (:mod:`symgraph.solve.workspace`), head costs (:mod:`symgraph.solve.heads`) and the pure math
kernels (:mod:`symgraph.solve.kernels`: source moves onto anchor, members are row-major in their coordinates,
Procrustes' R acts as R^T)."""
from __future__ import annotations

from .kernels import (cross_matrix, hungarian, joint_rotation_rescale, procrustes, procrustes_value, qk_objective,
                      rescale_from_stats, rescale_objective, rescale_quartic, rotary_closed_form, rotary_objective,
                      rotation_2x2, signed_hungarian, unit_scale_objective, unit_scales)
from .polyroots import minimize_scale, polynomial_roots

__all__ = [
    "cross_matrix", "hungarian", "joint_rotation_rescale", "minimize_scale", "polynomial_roots", "procrustes",
    "procrustes_value", "qk_objective", "rescale_from_stats", "rescale_objective", "rescale_quartic",
    "rotary_closed_form", "rotary_objective", "rotation_2x2", "signed_hungarian", "unit_scale_objective",
    "unit_scales",
]
