"""The two state dicts a solver reads, and the member slices and cost matrices it gathers from them.

Every solver sees the same :class:`Workspace`: float64 working copies of the source (which moves) and the anchor
(which never does), restricted to the parameters some group touches. Parameters in ``cost_excluded`` (functionally
free slices, like a plain-softmax key bias) are still transformed but never enter a cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..groups import Group, Member
from .sums import COLUMNS, ROWS, SCALAR, MemberSums


@dataclass
class Workspace:
    src: dict[str, torch.Tensor]
    anc: dict[str, torch.Tensor]
    cost_excluded: tuple[Member, ...] = ()  # functionally free slices: moved, never costed

    def __post_init__(self):
        self.sums = MemberSums()  # per-layer cost sums, read again only where the source moved
        self._free: dict[tuple[str, int], set[int]] = {}
        for m in self.cost_excluded:
            self._free.setdefault((m.param, m.axis), set()).update(m.index.reshape(-1).tolist())

    def costed(self, members) -> list[Member]:
        """Members that enter costs: free slices are left out, unless nothing else is left."""
        kept = [m for m in members if not self._is_free(m)]
        return kept or list(members)

    def _is_free(self, m: Member) -> bool:
        free = self._free.get((m.param, m.axis))
        return bool(free) and set(m.index.reshape(-1).tolist()) <= free

    def gather(self, which: str, m: Member) -> torch.Tensor:
        """Member slice of ``which`` ("src" or "anc") as (copies, size, block, rest)."""
        return gather(getattr(self, which)[m.param], m)

    def flat(self, which: str, m: Member) -> torch.Tensor:
        """Member slice as (copies, size, features): block and other axes flattened together."""
        g = self.gather(which, m)
        return g.reshape(g.shape[0], g.shape[1], -1)

    def cross(self, members, g: Group) -> np.ndarray:
        """M[c] = sum over members X_src X_anchor^T (source coordinate first)."""
        def term(m):
            return torch.einsum("cif,cjf->cij", self.flat("src", m), self.flat("anc", m)).cpu().numpy()

        return self.sums.total("cross", ROWS, g, members, term, self.features, (g.copies, g.size, g.size))

    def gram(self, members, g: Group, which: str = "src") -> np.ndarray:
        """G[c] = sum over members X X^T of one model."""
        out = np.zeros((g.copies, g.size, g.size))
        for m in members:
            x = self.flat(which, m)
            out += torch.einsum("cif,cjf->cij", x, x).cpu().numpy()
        return out

    def sq(self, members, g: Group) -> np.ndarray:
        """Squared norm of the source members, per copy."""
        def term(m):
            return self.flat("src", m).pow(2).sum((1, 2)).cpu().numpy()

        return self.sums.total("sq", SCALAR, g, members, term, self.features, (g.copies,))

    def similarity(self, members, g: Group, *, normalise: bool) -> np.ndarray:
        """S[c, i, j] = sum over members <anchor coordinate i, source coordinate j>; with ``normalise``, of unit
        vectors (a per-coordinate scale solved afterwards must not bias the matching). Accumulated member by
        member: the residual stream's members are the whole model, never concatenated."""
        def term(m):
            return torch.einsum("cif,cjf->cij", self.flat("anc", m), self.flat("src", m)).cpu().numpy()

        shape = (g.copies, g.size, g.size)
        if not normalise:
            return self.sums.total("similarity", COLUMNS, g, members, term, self.features, shape)
        out = self.sums.total(None, COLUMNS, g, members, term, self.features, shape)
        norm_s, norm_a = np.zeros((g.copies, g.size)), np.zeros((g.copies, g.size))
        for m in members:
            norm_s += self.flat("src", m).double().pow(2).sum(2).cpu().numpy()
            norm_a += self.flat("anc", m).double().pow(2).sum(2).cpu().numpy()
        out /= np.maximum(np.sqrt(norm_a)[:, :, None], 1e-30) * np.maximum(np.sqrt(norm_s)[:, None, :], 1e-30)
        return out

    def features(self, m: Member) -> int:
        """Features per coordinate of a member: its block times the size of the parameter's other axes."""
        shape = self.src[m.param].shape
        return m.index.shape[2] * int(np.prod(shape)) // shape[m.axis]

    def moved(self, elements) -> None:
        """The source moved by ``elements`` (already applied, and kept): sums that read it are stale."""
        self.sums.moved(elements)

    def distance_sq(self, params) -> float:
        return sum(float((self.src[k] - self.anc[k]).pow(2).sum()) for k in params)


def gather(x: torch.Tensor, m: Member) -> torch.Tensor:
    """Member slice of ``x`` as (copies, size, block, rest). A member over a contiguous run of positions (a
    residual member: the whole axis) comes back as a view, not a copy: read it, never write into it."""
    y = x.movedim(m.axis, 0)
    flat = m.index.reshape(-1)
    start = int(flat[0])
    if np.array_equal(flat, np.arange(start, start + flat.size)):
        return y[start:start + flat.size].reshape(*m.index.shape, -1)
    y = y[torch.as_tensor(m.index, device=y.device)]
    return y.reshape(*y.shape[:3], -1)
