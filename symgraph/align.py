"""Alignment: move SOURCE inside its symmetry groups until it is as close to ANCHOR as the groups allow.

Groups are solved one at a time, each by the optimal solver for its kind (specs/motifs.yaml ``solvers``), in
*reliability order*: a group is solved when some of its members have every other axis already aligned (or fixed:
no group moves it, like the vocabulary axis of an embedding). Its cost then uses only those members, so a source
that is an exact reparametrisation of the anchor is recovered exactly, whatever the architecture. Afterwards,
``full`` mode runs coordinate-descent rounds with every member until the distance stops falling.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from .elements import Element, apply
from .errors import MismatchError, SymgraphError
from .groups import Group, Member
from .solve import kernels

MODES = ("full", "paper", "permutation")
ONLY = ("attention", "ffn", "residual")
_ORDER = {"residual": 0, "heads": 1, "qk": 2, "vo": 3, "ffn": 4, "scale_free": 5, "other": 6}


@dataclass
class GroupStat:
    group: str
    kind: str
    solver: str
    before: float
    after: float
    seconds: float


@dataclass
class AlignResult:
    state: dict[str, torch.Tensor]
    elements: list[Element]
    stats: list[GroupStat]
    distance_before: float
    distance_after: float
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"distance_before": self.distance_before, "distance_after": self.distance_after,
                "timings_s": self.timings, "groups": [s.__dict__ for s in self.stats]}


def select_groups(groups, mode: str = "full", only: str | None = None, rescale: bool = True,
                  layers: tuple[int, int] | None = None) -> list[Group]:
    """The groups a mode aligns (``paper``: per-head QK/VO with heads in fixed order, the QK rescale and a
    one-shot FFN permutation; ``permutation``: permutations only; ``full``: everything)."""
    if mode not in MODES:
        raise SymgraphError(f"Unknown mode {mode!r}.", hint=f"choose one of {', '.join(MODES)}.")
    if only is not None and only not in ONLY:
        raise SymgraphError(f"Unknown --only {only!r}.", hint=f"choose one of {', '.join(ONLY)}.")
    chosen = []
    for g in groups:
        if mode == "paper" and not (g.motif in ("qk", "vo") or (g.motif == "ffn" and g.kind != "scale")):
            continue
        if mode == "permutation" and g.kind not in ("permutation", "signed_permutation"):
            continue
        if not rescale and g.kind == "scale" and g.motif == "qk":
            continue
        if only == "attention" and g.motif not in ("qk", "vo", "heads"):
            continue
        if only == "ffn" and g.motif != "ffn":
            continue
        if only == "residual" and g.motif not in ("residual", "scale_free"):
            continue
        if layers is not None and not _in_layers(g, layers):
            continue
        chosen.append(g)
    return chosen


def align_states(groups, source: dict, anchor: dict, *, mode: str = "full", rescale: bool = True,
                 rounds: int = 4, progress=None) -> AlignResult:
    """Align ``source`` to ``anchor`` (state dicts of one architecture) within ``groups``."""
    start = time.perf_counter()
    aligner = Aligner(groups, source, anchor, mode=mode, rescale=rescale)
    before = aligner.distance()
    aligner.first_pass(progress)
    solve_time = time.perf_counter() - start
    if mode == "full":
        aligner.refine(rounds)
    out = {k: v.to(source[k].dtype) if k in aligner.src else v for k, v in source.items()}
    out.update({k: aligner.src[k].to(source[k].dtype) for k in aligner.src})
    timings = {"first_pass": solve_time, "total": time.perf_counter() - start}
    return AlignResult(out, aligner.elements, aligner.stats, before, aligner.distance(), timings)


class Aligner:
    def __init__(self, groups, source: dict, anchor: dict, *, mode: str, rescale: bool):
        self.groups = list(groups)
        self.mode, self.rescale = mode, rescale
        names = {m.param for g in self.groups for m in g.members}
        self.src = {k: source[k].detach().to(torch.float64).clone() for k in names}
        self.anc = {k: anchor[k].detach().to(torch.float64) for k in names}
        self.elements: list[Element] = []
        self.stats: list[GroupStat] = []
        self.rescale_of = {link: g for g in self.groups for link in g.links if g.kind == "scale"}
        self.pending = defaultdict(int)  # (param, axis) -> groups still to solve on it (joint rescales excluded)
        for g in self.groups:
            if g not in self.rescale_of.values():
                for m in g.members:
                    self.pending[(m.param, m.axis)] += 1

    # -- driver ------------------------------------------------------------------------------------------------
    def first_pass(self, progress=None) -> None:
        todo = [g for g in self.groups if not (g.kind == "scale" and g.links and g.links[0] in self._ids())]
        while todo:
            ready = [g for g in todo if not self._waits_for_coarser(g, todo)] or todo
            g = max(ready, key=lambda g: (self._reliable_share(g), -_ORDER.get(g.motif, 9)))
            todo.remove(g)
            self._solve_and_apply(g, reliable_only=True)
            for m in g.members:
                self.pending[(m.param, m.axis)] -= 1
            if progress is not None:
                progress(g)

    def refine(self, rounds: int) -> None:
        """Coordinate descent with every member, until a whole round no longer lowers the distance."""
        for _ in range(rounds):
            before = self.distance()
            for g in self.groups:
                if g.kind == "scale" and g.links and g.links[0] in self._ids():
                    continue
                self._solve_and_apply(g, reliable_only=False, keep_if_worse=False)
            if self.distance() >= before * (1 - 1e-9):
                break

    def distance(self) -> float:
        num = sum(float((self.src[k] - self.anc[k]).pow(2).sum()) for k in self.src)
        den = sum(float(self.anc[k].pow(2).sum()) for k in self.anc)
        return float(np.sqrt(num / max(den, 1e-300)))

    # -- one group -----------------------------------------------------------------------------------------------
    def _solve_and_apply(self, g: Group, *, reliable_only: bool, keep_if_worse: bool = True) -> None:
        t0 = time.perf_counter()
        members = self._reliable(g) if reliable_only else list(g.members)
        before = self._group_distance(g)
        elements = self._solve(g, members or list(g.members))
        trial = apply(self.src, elements, dtype=torch.float64)
        after = sum(float((trial[m.param] - self.anc[m.param]).pow(2).sum()) for m in _unique(g.members))
        if not keep_if_worse and after > before:
            return
        self.src.update({k: trial[k] for k in self.src})
        self.elements.extend(elements)
        self.stats.append(GroupStat(g.id, g.kind, solver_name(g), float(np.sqrt(before)), float(np.sqrt(after)),
                                    time.perf_counter() - t0))

    def _solve(self, g: Group, members: list[Member]) -> list[Element]:
        if g.kind == "orthogonal" or g.kind == "general_linear":
            return self._solve_orthogonal(g, members)
        if g.kind == "rotary":
            return [self._solve_rotary(g, members)]
        if g.kind in ("permutation", "signed_permutation"):
            return [self._solve_monomial(g, members)]
        return [self._solve_scale(g, members)]

    def _solve_orthogonal(self, g: Group, members) -> list[Element]:
        rescale = self.rescale_of.get(g.id) if self.rescale else None
        primal = [m for m in members if m.action != "dual"]
        dual = [m for m in members if m.action == "dual"]
        mq, mk = self._cross(primal, g), self._cross(dual, g)
        if rescale is None or not primal or not dual:
            T = kernels.procrustes(torch.as_tensor(mq + mk)).transpose(-1, -2).numpy()
            return [Element(g, matrices=T)]
        q_sq, k_sq = self._sq(primal, g), self._sq(dual, g)
        R, a = kernels.joint_rotation_rescale(mq, mk, q_sq, k_sq, positive=False)
        T = np.swapaxes(np.asarray(R), -1, -2)
        return [Element(g, matrices=T), Element(rescale, diag=np.asarray(a, dtype=np.float64).reshape(-1, 1))]

    def _solve_rotary(self, g: Group, members) -> Element:
        primal = [m for m in members if m.action != "dual"]
        dual = [m for m in members if m.action == "dual"]
        pairs = np.array(g.rotary_pairs, dtype=np.int64)
        mq, mk = self._cross(primal, g), self._cross(dual, g)
        T = np.zeros((g.copies, g.size, g.size))
        if len(pairs):
            pq, pk = _pair_blocks(mq, pairs), _pair_blocks(mk, pairs)
            scaled = g.scale == "positive" and self.rescale and bool(primal) and bool(dual)
            if scaled:
                q_sq, k_sq = self._pair_sq(primal, g, pairs), self._pair_sq(dual, g, pairs)
                phi, c = kernels.rotary_closed_form(pq, pk, q_sq, k_sq, scaled=True)
            else:
                phi, c = kernels.rotary_closed_form(pq + pk, scaled=False)
            for (i, j), p_phi, p_c in zip(pairs, np.moveaxis(phi, -1, 0), np.moveaxis(c, -1, 0)):
                cos, sin = np.cos(p_phi), np.sin(p_phi)
                T[:, i, i], T[:, i, j], T[:, j, i], T[:, j, j] = p_c * cos, -p_c * sin, p_c * sin, p_c * cos
        rest = list(g.passthrough)
        if rest:
            block = (mq + mk)[:, rest][:, :, rest]
            T[np.ix_(range(g.copies), rest, rest)] = kernels.procrustes(torch.as_tensor(block)).transpose(-1, -2).numpy()
        return Element(g, matrices=T)

    def _solve_monomial(self, g: Group, members) -> Element:
        if g.motif == "heads" and max(m.index.shape[2] for m in members) > 1:
            return self._solve_heads(g, members)
        signed = [m for m in members if m.action != "permute"]
        sign_free = [m for m in members if m.action == "permute"]
        scaled = g.scale in ("positive", "nonzero")
        a = self._similarity(signed, g, normalise=scaled)
        b = self._similarity(sign_free, g, normalise=scaled)
        perms, diags = [], []
        for c in range(g.copies):
            perm, signs = _assign(a[c], b[c], g)
            perms.append(perm)
            diags.append(signs)
        element = Element(g, perm=np.stack(perms), diag=np.stack(diags))
        if scaled:
            moved = apply(self.src, [element], dtype=torch.float64)
            scales = self._unit_scales(g, members, moved, positive=g.scale == "positive")
            element = Element(g, perm=element.perm, diag=element.diag * scales)
        return element

    def _solve_heads(self, g: Group, members) -> Element:
        crosses = []
        for m in members:
            xs, xa = _gather(self.src[m.param], m), _gather(self.anc[m.param], m)  # (copies, H, block, rest)
            crosses.append(torch.einsum("kibr,kjcr->kijbc", xs, xa).numpy())  # source head i, anchor head j
        perm, _ = kernels.head_matching(crosses)
        return Element(g, perm=np.asarray(perm).reshape(g.copies, g.size), diag=np.ones((g.copies, g.size)))

    def _solve_scale(self, g: Group, members) -> Element:
        if g.scale == "sign":
            sim = np.zeros((g.copies, g.size))
            for m in members:
                xs, xa = _gather(self.src[m.param], m), _gather(self.anc[m.param], m)
                sim += torch.einsum("cnbr,cnbr->cn", xs, xa).numpy()
            return Element(g, diag=np.where(sim < 0, -1.0, 1.0))
        return Element(g, diag=self._unit_scales(g, members, self.src, positive=g.scale == "positive"))

    def _unit_scales(self, g: Group, members, state, *, positive: bool) -> np.ndarray:
        """Closed-form per-coordinate scale for exponent-1 members (others keep scale 1)."""
        rows_s, rows_a, cols_s, cols_a = [], [], [], []
        for m in members:
            if m.action == "permute" or m.exponent != 1:
                continue
            xs = _gather(state[m.param], m).reshape(g.copies * g.size, -1)
            xa = _gather(self.anc[m.param], m).reshape(g.copies * g.size, -1)
            (rows_s if m.action == "primal" else cols_s).append(xs)
            (rows_a if m.action == "primal" else cols_a).append(xa)
        if not rows_s and not cols_s:
            return np.ones((g.copies, g.size))
        n = g.copies * g.size
        xs = torch.cat(rows_s, 1) if rows_s else torch.zeros(n, 0, dtype=torch.float64)
        xa = torch.cat(rows_a, 1) if rows_a else torch.zeros(n, 0, dtype=torch.float64)
        zs = torch.cat(cols_s, 1).T if cols_s else None
        za = torch.cat(cols_a, 1).T if cols_a else None
        d = kernels.unit_scales(xs.numpy(), xa.numpy(), None if zs is None else zs.numpy(),
                                None if za is None else za.numpy(), positive=positive)
        return np.asarray(d, dtype=np.float64).reshape(g.copies, g.size)

    # -- costs ---------------------------------------------------------------------------------------------------
    def _cross(self, members, g: Group) -> np.ndarray:
        out = np.zeros((g.copies, g.size, g.size))
        for m in members:
            xs, xa = _flat(self.src[m.param], m), _flat(self.anc[m.param], m)
            out += torch.einsum("cif,cjf->cij", xs, xa).numpy()
        return out

    def _sq(self, members, g: Group) -> np.ndarray:
        return sum((_flat(self.src[m.param], m).pow(2).sum((1, 2)).numpy() for m in members), np.zeros(g.copies))

    def _pair_sq(self, members, g: Group, pairs) -> np.ndarray:
        out = np.zeros((g.copies, len(pairs)))
        for m in members:
            sq = _flat(self.src[m.param], m).pow(2).sum(2).numpy()  # (copies, n)
            out += sq[:, pairs[:, 0]] + sq[:, pairs[:, 1]]
        return out

    def _similarity(self, members, g: Group, *, normalise: bool) -> np.ndarray:
        """S[c, i, j] = sum over members <anchor coordinate i, source coordinate j>."""
        xs = [_flat(self.src[m.param], m) for m in members]
        xa = [_flat(self.anc[m.param], m) for m in members]
        if not xs:
            return np.zeros((g.copies, g.size, g.size))
        xs, xa = torch.cat(xs, 2), torch.cat(xa, 2)
        if normalise:  # a per-unit scale is solved afterwards: match directions
            xs = xs / xs.norm(dim=2, keepdim=True).clamp_min(1e-30)
            xa = xa / xa.norm(dim=2, keepdim=True).clamp_min(1e-30)
        return torch.einsum("cif,cjf->cij", xa, xs).numpy()

    # -- reliability -------------------------------------------------------------------------------------------------
    def _waits_for_coarser(self, g: Group, todo) -> bool:
        """A group is relative to the coarser groups on its own axes (a unit's scale to the permutation that
        placed the unit, a head's rotation to the head permutation): those go first."""
        axes = {(m.param, m.axis) for m in g.members}
        return any(_stage(h) < _stage(g) and axes & {(m.param, m.axis) for m in h.members}
                   for h in todo if h is not g)

    def _reliable(self, g: Group) -> list[Member]:
        """Members that only ``g`` still moves: every other axis aligned (or fixed), and no other unsolved group
        on the member's own axis (a pending per-unit scale would bias the cost). Head permutations ignore the
        second condition: their nuclear-norm cost does not see the per-head rotations still to come."""
        out = []
        for m in g.members:
            ndim = self.src[m.param].dim()
            others_done = all(self.pending.get((m.param, a), 0) == 0 for a in range(ndim) if a != m.axis)
            alone = g.motif == "heads" or self.pending.get((m.param, m.axis), 0) <= 1
            if others_done and alone:
                out.append(m)
        return out

    def _reliable_share(self, g: Group) -> float:
        reliable = self._reliable(g)
        weight = sum(m.index.size for m in g.members)
        return sum(m.index.size for m in reliable) / max(weight, 1)

    def _group_distance(self, g: Group) -> float:
        return sum(float((self.src[m.param] - self.anc[m.param]).pow(2).sum()) for m in _unique(g.members))

    def _ids(self) -> set[str]:
        return {g.id for g in self.groups}


def solver_name(g: Group) -> str:
    from .report import solver_for

    return solver_for(g)


def check_same_architecture(source, anchor) -> None:
    """Refuse to align models whose parameters, shapes or detected groups differ."""
    s, a = source.state_dict(), anchor.state_dict()
    if set(s) != set(a):
        extra, missing = sorted(set(s) - set(a))[:3], sorted(set(a) - set(s))[:3]
        raise MismatchError(f"The models have different parameters (only in source: {extra}; only in anchor: "
                            f"{missing}).", hint="align two models of the same architecture and configuration.")
    shapes = [k for k in s if tuple(s[k].shape) != tuple(a[k].shape)]
    if shapes:
        k = shapes[0]
        raise MismatchError(f"Parameter {k} has shape {tuple(s[k].shape)} in the source but {tuple(a[k].shape)} in "
                            f"the anchor ({len(shapes)} parameters differ).",
                            hint="both models must use the same configuration sizes.")
    for name, t in (("source", s), ("anchor", a)):
        bad = [k for k, v in t.items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if bad:
            raise MismatchError(f"The {name} has NaN or Inf values in {bad[0]} ({len(bad)} tensors).",
                                hint="alignment needs finite weights; check the checkpoint.")
    if [g.to_json() for g in source.report.groups] != [g.to_json() for g in anchor.report.groups]:
        raise MismatchError("The two models have different symmetry groups.",
                            hint="compare `symgraph report` of both; they must be the same architecture.")


# -- helpers ---------------------------------------------------------------------------------------------------------
def _gather(x: torch.Tensor, m: Member) -> torch.Tensor:
    """Member slice as (copies, size, block, rest)."""
    y = x.movedim(m.axis, 0)
    g = y[torch.as_tensor(m.index)]
    return g.reshape(*g.shape[:3], -1)


def _flat(x: torch.Tensor, m: Member) -> torch.Tensor:
    """Member slice as (copies, size, features): block and other axes flattened together."""
    g = _gather(x, m)
    return g.reshape(g.shape[0], g.shape[1], -1)


def _pair_blocks(cross: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    idx = pairs[:, [0, 1]]
    return cross[:, idx[:, :, None], idx[:, None, :]]  # (copies, P, 2, 2)


def _assign(a: np.ndarray, b: np.ndarray, g: Group) -> tuple[np.ndarray, np.ndarray]:
    """Best (signed) assignment for one copy: anchor i receives source perm[i] with sign signs[i]."""
    if g.kind == "signed_permutation" or g.scale == "nonzero":
        perm = kernels.hungarian(np.abs(a) + b)
        signs = np.where(a[np.arange(len(perm)), perm] < 0, -1.0, 1.0)
        return perm, signs
    if g.global_sign:
        plus, minus = kernels.hungarian(a + b), kernels.hungarian(-a + b)
        rows = np.arange(len(plus))
        if (-a + b)[rows, minus].sum() > (a + b)[rows, plus].sum():
            return minus, -np.ones(len(minus))
        return plus, np.ones(len(plus))
    return kernels.hungarian(a + b), np.ones(a.shape[0])


def _stage(g: Group) -> float:
    """Coarse before fine on a shared axis: KV groups, query heads, other permutations, rotations, scales."""
    if g.motif == "heads":
        return 0.0 if g.copies == 1 else 0.5
    return {"permutation": 1.0, "signed_permutation": 1.0, "scale": 3.0}.get(g.kind, 2.0)


def _unique(members):
    seen, out = set(), []
    for m in members:
        if m.param not in seen:
            seen.add(m.param)
            out.append(m)
    return out


def _in_layers(g: Group, layers: tuple[int, int]) -> bool:
    digits = [int(x) for x in re.findall(r"\.(\d+)(?:\.|$)", g.layer + ".")]
    return bool(digits) and layers[0] <= digits[0] <= layers[1]
