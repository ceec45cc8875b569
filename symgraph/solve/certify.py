r"""Permutation solves whose answer is provably the identity, returned without recomputing their costs.

In descent a permutation group is solved again whenever one of its parameters moved, mostly by a little (a
scale near 1 on a neighbouring group), and the answer is then mostly the identity: an FFN's 5632 x 5632 cost (three
5632 x 2048 products) is rebuilt to find nothing. So after each solve the margin by which every row's assigned
entry beats the rest of its row is kept, measured on the source as the solve's element leaves it, with a bf16
copy of the source's member slices as they then stand.

At the next solve of the same members, let :math:`\delta_j` bound how far source unit :math:`j` moved since
(from the copy, plus the copy's own rounding) and :math:`\alpha_i` be anchor unit :math:`i`'s norm. By
Cauchy-Schwarz no cost entry moved by more than :math:`\alpha_i\delta_j`, and neither computation of an entry
errs by more than the float32 products' rounding bound (features x unit roundoff x :math:`\alpha_i\sigma_j`).
When every row's margin exceeds both, the maximum of every row is still on the diagonal, and that is exactly what
the solver would return (:func:`~symgraph.solve.kernels.hungarian` takes distinct row maxima as they are, and a
signed matching keeps sign +1 where the diagonal entry stays positive): the identity. Otherwise the costs are
computed as before. A certificate that could never hold (some margin not positive) is not kept.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..elements import Element, transform_slice
from ..groups import Group, Member
from .reduce import row_sums
from .sums import signature
from .workspace import COPY_BUDGET

BF16_ERROR = 2.0 ** -8  # a float32 rounded to bfloat16 moves by at most 2^-9 of itself; twice that, for safety
ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53}


@dataclass
class Certificate:
    key: tuple  # the signatures of the members the costs were built from
    snapshot: list[torch.Tensor]  # per member: its source slice after the move, (copies, size, features), bf16
    margin: np.ndarray  # (copies, size): row i's assigned entry minus the largest other entry, after the move
    diagonal: np.ndarray | None  # signed matching: the signed entry of row i after the move (must stay > 0)
    alpha: np.ndarray  # (copies, size): anchor unit norms over the members
    sigma: np.ndarray  # (copies, size): source unit norms after the move
    rounding: float  # relative error bound of one computed cost entry


def identity_if_certified(ws, g: Group, members: list[Member]) -> list[Element] | None:
    """The identity element of ``g`` when the certificate kept at its last solve proves it is the answer now."""
    cert = ws.certificates.get(g.id)
    if cert is None or cert.key != _key(members):
        return None
    moved = sum(row_sums(ws.flat("src", m), snap, minus=True) for m, snap in zip(members, cert.snapshot))
    delta = (1 + 1e-9) * np.sqrt(moved) + BF16_ERROR * cert.sigma  # from the exact source after the move
    slack = 2 * cert.rounding * cert.alpha * (2 * cert.sigma.max() + delta.max())
    held = cert.margin > cert.alpha * (delta + delta.max()) + slack
    if cert.diagonal is not None:
        held &= cert.diagonal > cert.alpha * delta + slack
    if not held.all():
        return None
    return [Element(g, perm=np.tile(np.arange(g.size), (g.copies, 1)), diag=np.ones((g.copies, g.size)))]


def keep(ws, g: Group, members: list[Member], margin: np.ndarray, element: Element,
         signed_entries: np.ndarray | None) -> None:
    """Keep the certificate of a solve that chose ``element`` with row ``margin`` (copies, size: :func:`margins`
    of its costs, or a lower bound of them); a signed matching also passes ``signed_entries`` (copies, size): the
    magnitude of each row's assigned inner product, which its sign turns positive."""
    ws.certificates.pop(g.id, None)
    if signed_entries is not None and any(m.exponent != 1 for m in members if m.action != "permute"):
        return  # a sign squared does not flip the member: the cost after the move is not the cost permuted
    if not (margin > 0).all() or 2 * ws.elements(g, members) > COPY_BUDGET:  # the snapshot is bf16
        return
    snapshot, sigma, alpha = [], 0.0, 0.0
    for m in members:
        after = ws.gather("src", m) if _identity(element) else transform_slice(ws.gather("src", m), m, element)
        after = after.reshape(*after.shape[:2], -1)
        sigma = sigma + row_sums(after)
        alpha = alpha + ws.unit_sums(m, "anc")
        snapshot.append(after.to(torch.bfloat16))
        del after
    ws.certificates[g.id] = Certificate(_key(members), snapshot, margin, signed_entries, np.sqrt(alpha),
                                        np.sqrt(sigma), rounding(ws, members))


def margins(cost: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Per row: the assigned entry minus the largest other entry of the row (``cost`` is restored)."""
    rows = np.arange(len(perm))
    assigned = cost[rows, perm].copy()
    cost[rows, perm] = -np.inf
    other = cost.max(axis=1)
    cost[rows, perm] = assigned
    return assigned.astype(np.float64) - other  # float64: a float32 difference may round up


def rounding(ws, members) -> float:
    """Bound on |computed - exact| / (alpha_i sigma_j) of a cost entry: each member's product sums its features
    in the working dtype (any order: features x unit roundoff), in float32 at the matmul precision torch is set to
    (bf16's roundoff unless "highest"); the float64 sums across members add nothing that matters."""
    dtype = next(iter(ws.src.values())).dtype
    roundoff = ROUNDOFF.get(dtype, 2.0 ** -8)
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        roundoff = 2.0 ** -8
    return 1.01 * max(ws.features(m) for m in members) * roundoff


def _identity(e: Element) -> bool:
    """Exactly the identity (most descent solves): the source slices stand as they are."""
    return (e.matrices is None and (e.perm is None or (e.perm == np.arange(e.perm.shape[1])).all())
            and (e.diag is None or (e.diag == 1.0).all()))


def _key(members) -> tuple:
    return tuple(signature(m) for m in members)
