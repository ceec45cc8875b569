"""The two state dicts a solver reads, and the member slices and cost matrices it gathers from them.

Every solver sees the same :class:`Workspace`: working copies of the source (which moves) and the anchor (which
never does), restricted to the parameters some group touches. The anchor may stay in a narrower dtype that the
source's promotes exactly (a bf16 checkpoint's anchor beside float32 working copies): it is only read, and each slice
is promoted as it is gathered, which halves what a streamed block of a 7B or MoE model holds. Parameters in
``cost_excluded`` (functionally free slices, like a plain-softmax key bias) are still transformed but never enter
a cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..elements import apply_in_place, contiguous_run, split_beside
from ..groups import Group, Member, TensorMember
from .reduce import row_sums, squared_distance
from .sums import COLUMNS, ROWS, SCALAR, MemberSums


# bytes of copies of a group's members that a speed-up (the low-precision screen, a descent certificate's
# snapshot) may keep: past it (the FFN units a 7B MoE layer's experts share, 2.8 GB per bf16 copy) the copies would
# double a streamed block's peak, and the solve goes without the speed-up
COPY_BUDGET = 1 << 30


@dataclass
class Workspace:
    src: dict[str, torch.Tensor]
    anc: dict[str, torch.Tensor]
    cost_excluded: tuple[Member, ...] = ()  # functionally free slices: moved, never costed

    def __post_init__(self):
        self.sums = MemberSums()  # per-layer cost sums, read again only where the source moved
        self.certificates: dict = {}  # group id -> symgraph.solve.certify.Certificate of its last solve
        self._distance_sq: dict[str, float] = {}
        self._free: dict[tuple[str, int], set[int]] = {}
        for m in self.cost_excluded:
            self._free.setdefault((m.param, m.axis), set()).update(m.index.reshape(-1).tolist())

    def costed(self, members) -> list[Member]:
        """Members that enter costs: free slices are left out, unless nothing else is left."""
        kept = [m for m in members if not self._is_free(m)]
        return kept or list(members)

    def _is_free(self, m: Member) -> bool:
        if isinstance(m, TensorMember):
            return False
        free = self._free.get((m.param, m.axis))
        return bool(free) and set(m.index.reshape(-1).tolist()) <= free

    def gather(self, which: str, m: Member, *, stored: bool = False) -> torch.Tensor:
        """Member slice of ``which`` ("src" or "anc") as (copies, size, block, rest); a tensor member's slots as
        (copies, size, 1, the tensor flattened). In the source's working dtype, or with ``stored`` in the dtype
        it is kept in (for readers that promote as they go)."""
        state = getattr(self, which)
        if isinstance(m, TensorMember):
            out = torch.stack([torch.stack([state[p].reshape(1, -1) for p in row]) for row in m.slots])
        else:
            out = gather(state[m.param], m)
        return out if stored else out.to(self.src[m.params[0]].dtype)  # a no-op in that dtype

    def flat(self, which: str, m: Member, *, stored: bool = False) -> torch.Tensor:
        """Member slice as (copies, size, features): block and other axes flattened together."""
        g = self.gather(which, m, stored=stored)
        return g.reshape(g.shape[0], g.shape[1], -1)

    def product(self, first: str, second: str, m: Member) -> np.ndarray:
        """P[c, i, j] = <coordinate i of ``first``'s slice of ``m``, coordinate j of ``second``'s>, summed a part
        of the parameter at a time (split beside the axis ``m`` moves): a gathered slice is a copy, and a 3-D
        expert tensor's is several GB at 7B MoE sizes."""
        out = None
        for a, b in zip(self._flat_parts(first, m), self._flat_parts(second, m)):
            p = torch.einsum("cif,cjf->cij", a, b)
            out = p if out is None else out.add_(p)
        return out.cpu().numpy()

    def _flat_parts(self, which: str, m: Member, *, stored: bool = False):
        """``flat(which, m)`` a part of the parameter at a time (features split beside the axis ``m`` moves)."""
        if isinstance(m, TensorMember):
            yield self.flat(which, m, stored=stored)
            return
        working = self.src[m.param].dtype
        for part in split_beside(getattr(self, which)[m.param], m.axis):
            g = gather(part, m) if stored else gather(part, m).to(working)
            yield g.reshape(g.shape[0], g.shape[1], -1)

    def cross(self, members, g: Group) -> np.ndarray:
        """M[c] = sum over members X_src X_anchor^T (source coordinate first)."""
        def term(m):
            return self.product("src", "anc", m)

        return self.sums.total("cross", ROWS, g, members, term, self.features, (g.copies, g.size, g.size))

    def gram(self, members, g: Group, which: str = "src") -> np.ndarray:
        """G[c] = sum over members X X^T of one model."""
        out = np.zeros((g.copies, g.size, g.size))
        for m in members:
            out += self.product(which, which, m)
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
            return self.product("anc", "src", m)

        shape = (g.copies, g.size, g.size)
        if not normalise:
            return self.sums.total("similarity", COLUMNS, g, members, term, self.features, shape)
        out = self.sums.total(None, COLUMNS, g, members, term, self.features, shape)
        norm_s, norm_a = np.zeros((g.copies, g.size)), np.zeros((g.copies, g.size))
        for m in members:
            norm_s += self.unit_sums(m, "src")
            norm_a += self.unit_sums(m, "anc")
        out /= np.maximum(np.sqrt(norm_a)[:, :, None], 1e-30)
        out /= np.maximum(np.sqrt(norm_s)[:, None, :], 1e-30)
        return out

    def unit_sums(self, m: Member, which: str, other: str | None = None) -> np.ndarray:
        """Per coordinate of ``m`` (copies, size): the float64 squared norm of its ``which`` slice, or with
        ``other`` its inner product with that model's slice (read in chunks: no float64 copy of the member)."""
        parts = self._flat_parts(which, m, stored=True)
        if other is None:
            return sum(row_sums(x) for x in parts)
        return sum(row_sums(x, y) for x, y in zip(parts, self._flat_parts(other, m, stored=True)))

    def elements(self, g: Group, members) -> int:
        """Entries of the members' slices of one model: what a copy of them holds."""
        return g.copies * g.size * sum(self.features(m) for m in members)

    def features(self, m: Member) -> int:
        """Features per coordinate of a member: its block times the size of the parameter's other axes (a
        tensor member: a whole tensor)."""
        if isinstance(m, TensorMember):
            return self.src[m.params[0]].numel()
        shape = self.src[m.param].shape
        return m.index.shape[2] * int(np.prod(shape)) // shape[m.axis]

    def moved(self, elements) -> None:
        """The source moved by ``elements`` (already applied, and kept): sums that read it are stale."""
        self.sums.moved(elements)

    def distance_sq(self, params) -> float:
        """Squared distance to the anchor over ``params``; each parameter's part is kept until :meth:`apply`
        moves it (the residual group's distance, taken before and after each of its solves, is the whole model)."""
        for k in params:
            if k not in self._distance_sq:
                self._distance_sq[k] = squared_distance(self.src[k], self.anc[k])
        return sum(self._distance_sq[k] for k in params)

    def apply(self, elements) -> None:
        """Move the source working copy by ``elements``, in place (it is ours: no trial copy of the model)."""
        apply_in_place(self.src, elements)
        for e in elements:
            for p in e.group.params:
                self._distance_sq.pop(p, None)


def gather(x: torch.Tensor, m: Member) -> torch.Tensor:
    """Member slice of ``x`` as (copies, size, block, rest). A member over a contiguous run of positions (a
    residual member: the whole axis) comes back as a view, not a copy: read it, never write into it."""
    y = x.movedim(m.axis, 0)
    run = contiguous_run(m.index)
    if run is not None:
        return y[run].reshape(*m.index.shape, -1)
    y = y[torch.as_tensor(m.index, device=y.device)]
    return y.reshape(*y.shape[:3], -1)
