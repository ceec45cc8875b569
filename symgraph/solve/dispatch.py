"""The solver dispatcher: one optimal solver per group kind, registered with the name reports show.

A solver takes the :class:`~symgraph.solve.workspace.Workspace`, the group, the members it may trust and a
:class:`SolveContext`, and returns the group elements that move the source closest to the anchor. Lookups go
through :func:`solver_for`; a kind without a solver is a programming error that lists the registered kinds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..elements import Element
from ..errors import SymgraphError
from ..groups import Group, Member
from . import certify, kernels, screen
from .experts import expert_similarity
from .heads import invariant_head_similarity, rotation_head_similarity
from .polyroots import minimize_power_sum
from .workspace import Workspace


@dataclass(frozen=True)
class SolveContext:
    """What a solver needs to know beyond the group: the mode, the joint rescale partner, the pass."""

    mode: str = "full"
    rescale: bool = True  # scales inside rotation groups (QK rescale, rotary pair scales) are allowed
    partner: Group | None = None  # the QK scalar rescale group solved jointly with this rotation group
    first_pass: bool = True  # costs invariant to the groups still to come (exact recovery)
    groups: tuple[Group, ...] = ()  # every group being aligned (head costs read the per-head groups)
    # aligns tensors within groups: (groups, source, anchor) -> (elements, moved source); expert costs use it
    align_within: Callable | None = field(default=None, compare=False)

    @property
    def permutations_only(self) -> bool:
        return self.mode in ("paper", "permutation")


@dataclass(frozen=True)
class Solver:
    kind: str
    name: str
    summary: str
    fn: Callable[[Workspace, Group, list[Member], SolveContext], list[Element]] = field(repr=False)


SOLVERS: dict[str, Solver] = {}


def solver(kind: str, name: str, summary: str):
    """Register ``fn`` as the solver for group ``kind``."""
    def register(fn):
        if kind in SOLVERS:
            raise ValueError(f"a solver for {kind!r} is already registered ({SOLVERS[kind].name})")
        SOLVERS[kind] = Solver(kind, name, summary, fn)
        return fn
    return register


def solver_for(group: Group) -> Solver:
    kind = "heads" if group.motif == "heads" else "experts" if group.swaps_tensors else group.kind
    if kind not in SOLVERS:
        raise SymgraphError(f"No solver for groups of kind {kind!r} ({group.id}).",
                            hint=f"registered kinds: {', '.join(sorted(SOLVERS))}.")
    return SOLVERS[kind]


def solver_name(group: Group) -> str:
    """The name reports show: a QK scalar rescale is solved jointly with its rotation group."""
    if group.kind == "scale" and group.motif == "qk" and group.links:
        return f"joint with {group.links[0]}"
    name = solver_for(group).name
    return f"{name}+rescale" if group.kind == "orthogonal" and group.motif == "qk" else name


def solve(ws: Workspace, g: Group, members: list[Member], ctx: SolveContext) -> list[Element]:
    return solver_for(g).fn(ws, g, members, ctx)


# -- continuous groups ------------------------------------------------------------------------------------------
@solver("orthogonal", "procrustes", "orthogonal Procrustes, one batched SVD over every head of every layer solved "
                                    "together; with the QK scalar rescale: jointly optimal rotation + rescale "
                                    "(1-D search of a nuclear norm); a LayerNorm residual (Q 1 = +-1): Procrustes "
                                    "on the complement of the ones vector")
def solve_orthogonal(ws, g, members, ctx):
    return solve_orthogonal_together(ws, [(g, members, ctx)])[0]


def solve_orthogonal_together(ws, items) -> list[list[Element]]:
    """Orthogonal groups of one size (the QK or VO pairs of every layer) in one batched kernel call: their
    copies are stacked, so the whole model costs one SVD per step, not one per head or layer."""
    stats = []
    for g, members, ctx in items:
        members = ws.costed(members)
        primal = [m for m in members if m.action != "dual"]
        dual = [m for m in members if m.action == "dual"]
        joint = ctx.partner is not None and bool(primal) and bool(dual)
        stats.append((ws.cross(primal, g), ws.cross(dual, g), ws.sq(primal, g), ws.sq(dual, g), joint))
    out: list[list[Element]] = [[] for _ in items]
    for joint in (False, True):
        chosen = [i for i, st in enumerate(stats) if st[4] == joint]
        if not chosen:
            continue
        mq, mk, q_sq, k_sq = (np.concatenate([stats[i][j] for i in chosen]) for j in range(4))
        mode = items[chosen[0]][2].mode
        if not joint:
            R, a = _procrustes_per_group([items[i][0] for i in chosen], mq + mk), None
        elif mode == "paper":  # the paper: rotation first, then the quartic of eq. (12) for that rotation
            R = np.asarray(kernels.procrustes(mq + mk))
            a = kernels.rescale_from_stats(q_sq, (R * mq).sum((-2, -1)), k_sq, (R * mk).sum((-2, -1)),
                                           positive=False)
        else:
            R, a = kernels.joint_rotation_rescale(mq, mk, q_sq, k_sq, positive=False)
        start = 0
        for i in chosen:
            g, _, ctx = items[i]
            part = slice(start, start + g.copies)
            start += g.copies
            out[i].append(Element(g, matrices=_transpose(np.asarray(R)[part])))
            if joint:
                out[i].append(Element(ctx.partner, diag=np.asarray(a, dtype=np.float64)[part].reshape(-1, 1)))
    return out


def _procrustes_per_group(groups, cross: np.ndarray) -> np.ndarray:
    """Procrustes on stacked copies; the copies of a group with ``fixes_ones`` (LayerNorm residual) keep Q 1 = +-1."""
    R = np.array(kernels.procrustes(cross))
    start = 0
    for g in groups:
        if g.fixes_ones:
            R[start:start + g.copies] = kernels.procrustes_fixing_ones(cross[start:start + g.copies])
        start += g.copies
    return R


@solver("general_linear", "least_squares", "general linear: least squares from either side (primal rows, or "
                                           "dual columns through the inverse transpose), best of those and "
                                           "Procrustes")
def solve_general_linear(ws, g, members, ctx):
    members = ws.costed(members)
    return [_best_linear(ws, g, members, range(g.size), np.zeros((g.copies, g.size, g.size)))]


@solver("rotary", "rotary_closed_form", "RoPE commutant: per frequency pair the optimal 2x2 rotation and positive "
                                        "scale in closed form; Procrustes on pass-through dimensions")
def solve_rotary(ws, g, members, ctx):
    members = ws.costed(members)
    primal = [m for m in members if m.action != "dual"]
    dual = [m for m in members if m.action == "dual"]
    pairs = np.array(g.rotary_pairs, dtype=np.int64).reshape(-1, 2)
    mq, mk = ws.cross(primal, g), ws.cross(dual, g)
    T = np.zeros((g.copies, g.size, g.size))
    if len(pairs):
        pq, pk = _pair_blocks(mq, pairs), _pair_blocks(mk, pairs)
        if g.scale == "positive" and ctx.rescale and ctx.mode != "paper" and primal and dual:
            phi, c = kernels.rotary_closed_form(pq, pk, _pair_sq(ws, primal, g, pairs),
                                                _pair_sq(ws, dual, g, pairs), scaled=True)
        else:
            phi, c = kernels.rotary_closed_form(pq + pk, scaled=False)
        for (i, j), p_phi, p_c in zip(pairs, np.moveaxis(phi, -1, 0), np.moveaxis(c, -1, 0)):
            cos, sin = np.cos(p_phi), np.sin(p_phi)
            T[:, i, i], T[:, i, j], T[:, j, i], T[:, j, j] = p_c * cos, -p_c * sin, p_c * sin, p_c * cos
    rest = list(g.passthrough)
    if not rest:
        return [Element(g, matrices=T)]
    if g.scale == "positive" and ctx.rescale and ctx.mode != "paper":  # GL on dimensions RoPE leaves alone
        return [_best_linear(ws, g, members, rest, T)]
    T[np.ix_(range(g.copies), rest, rest)] = _transpose(kernels.procrustes((mq + mk)[:, rest][:, :, rest]))
    return [Element(g, matrices=T)]


# -- monomial groups ------------------------------------------------------------------------------------------
@solver("permutation", "hungarian", "linear assignment (Hungarian) per copy; positive/nonzero per-unit scales "
                                    "in closed form after matching directions; coordinate descent across groups")
def solve_permutation(ws, g, members, ctx):
    members = ws.costed(members)
    scaled = g.scale in ("positive", "nonzero") and not ctx.permutations_only
    element = _matching(ws, g, members, ctx, signed=scaled and g.scale == "nonzero", normalise=scaled)
    if not scaled:
        return [element]
    moved = Workspace({**ws.src, **_apply(ws.src, element)}, ws.anc, ws.cost_excluded)
    scales = _unit_scales(moved, g, members, positive=g.scale == "positive")
    return [Element(g, perm=element.perm, diag=element.diag * scales)]


@solver("signed_permutation", "hungarian_signed", "signed linear assignment: Hungarian on |similarity|, signs "
                                                  "from the matched entries")
def solve_signed_permutation(ws, g, members, ctx):
    return [_matching(ws, g, ws.costed(members), ctx, signed=True, normalise=False)]


def _matching(ws, g: Group, members, ctx: SolveContext, *, signed: bool, normalise: bool) -> Element:
    """The best (signed) permutation per copy. In descent, where costs are plain inner products, the margins of
    the answer are kept (:mod:`symgraph.solve.certify`), and a later solve that they prove to be the identity
    skips the costs. Not in the first pass: the groups solved after it move the source too far for them to hold.
    Large single-layer groups are first matched on low-precision costs (bfloat16 or int8,
    :mod:`symgraph.solve.screen`), used only when provably the working costs' answer."""
    signed = signed or g.kind == "signed_permutation"
    certifiable = not normalise and not g.global_sign and ctx.mode != "paper" and not ctx.first_pass
    if certifiable:
        certified = certify.identity_if_certified(ws, g, members)
        if certified is not None:
            return certified[0]
    screened = (screen.certified_matching(ws, g, members, signed=signed, normalise=normalise)
                if screen.pays_off(ws, g, members) else None)
    if screened is not None:  # provably the working costs' answer, from low-precision costs
        perms, diags, margin, entries = screened
    else:
        a, b = _similarities(ws, g, members, normalise=normalise)
        perms, diags, costs = zip(*(_assign(a[c], b[c], g, signed=signed) for c in range(g.copies)))
        if certifiable:
            margin = np.stack([certify.margins(cost, p) for cost, p in zip(costs, perms)])
            rows = np.arange(g.size)
            entries = np.abs(np.stack([a[c][rows, p] for c, p in enumerate(perms)]))
    element = Element(g, perm=np.stack(perms), diag=np.stack(diags))
    if certifiable:
        certify.keep(ws, g, members, margin, element, entries if signed else None)
    return element


@solver("heads", "head_matching", "head permutation: Hungarian on invariants of each head's QK and VO circuits "
                                  "(first pass), on per-head Procrustes values (refinement), on inner products "
                                  "when no rotation follows")
def solve_heads(ws, g, members, ctx):
    members = ws.costed(members)
    if ctx.first_pass:
        similarity = invariant_head_similarity(ws, g, members, ctx.groups)
    elif ctx.permutations_only or max(m.index.shape[2] for m in members if isinstance(m, Member)) == 1:
        similarity = ws.similarity(members, g, normalise=False)
    else:
        similarity = rotation_head_similarity(ws, g, members, ctx.groups)
    perm = np.stack([kernels.hungarian(similarity[c]) for c in range(g.copies)])
    return [Element(g, perm=perm, diag=np.ones((g.copies, g.size)))]


@solver("experts", "expert_matching", "whole experts (tensors moved between slots): Hungarian on the similarity "
                                      "of each pair of experts once the second's own groups are aligned to the "
                                      "first's, router rows added; the chosen pairs' inner alignments kept")
def solve_experts(ws, g, members, ctx):
    similarity, inner = expert_similarity(ws, g, ws.costed(members), ctx)
    perm = np.stack([kernels.hungarian(similarity[c]) for c in range(g.copies)])
    within = [e for c in range(g.copies) for i in range(g.size) for e in inner.get((c, i, int(perm[c, i])), [])]
    return [Element(g, perm=perm, diag=np.ones((g.copies, g.size)))] + within


@solver("scale", "closed_form_scale", "per-coordinate scale: sign from the inner product, or the exact minimiser "
                                      "of each coordinate's quartic (positive or nonzero)")
def solve_scale(ws, g, members, ctx):
    members = ws.costed(members)
    if g.scale == "sign":
        sim = np.zeros((g.copies, g.size))
        for m in members:
            if m.action != "permute":
                sim += torch.einsum("cnbr,cnbr->cn", ws.gather("src", m), ws.gather("anc", m)).cpu().numpy()
        return [Element(g, diag=np.where(sim < 0, -1.0, 1.0))]
    return [Element(g, diag=_unit_scales(ws, g, members, positive=g.scale == "positive"))]


# -- helpers ----------------------------------------------------------------------------------------------------
def _transpose(R) -> np.ndarray:
    """Procrustes returns R with the source moving as R^T X: the group element is R^T."""
    return np.swapaxes(np.asarray(R), -1, -2)


def _best_linear(ws, g: Group, members, coords, T: np.ndarray) -> Element:
    """Fill the ``coords`` block of ``T`` with the best general linear map found: Procrustes, least squares on
    the primal rows, or least squares on the dual rows (which move by the inverse transpose)."""
    coords = list(coords)
    block = np.ix_(range(g.copies), coords, coords)

    def sub(m):
        return m[block]

    primal = [m for m in members if m.action != "dual"]
    dual = [m for m in members if m.action == "dual"]
    fills = [_transpose(kernels.procrustes(sub(ws.cross(members, g))))]
    if primal:
        fills.append(_least_squares(sub(ws.cross(primal, g)), sub(ws.gram(primal, g))))
    if dual:  # Z -> S Z with S = T^{-T}: least squares gives S, so the block of T is S^{-T}
        S = _least_squares(sub(ws.cross(dual, g)), sub(ws.gram(dual, g)))
        fills.append(np.linalg.inv(S).swapaxes(-1, -2))
    fills = [f for f in fills if np.all(np.linalg.cond(f) <= kernels.MAX_CONDITION)]  # Procrustes (1) always stays
    candidates = []
    for fill in fills:
        full = T.copy()
        full[block] = fill
        candidates.append(Element(g, matrices=full))
    return min(candidates, key=lambda e: _element_cost(ws, members, e))


def _least_squares(cross: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """argmin_T sum ||T X - Y||^2 = (Y X^T)(X X^T)^{-1}, with a relative ridge so rank deficits stay finite."""
    ridge = 1e-12 * np.trace(gram, axis1=-2, axis2=-1)[:, None, None] * np.eye(gram.shape[-1])
    return np.linalg.solve(gram + ridge, cross).swapaxes(-1, -2)  # cross is X Y^T: (G^{-1} X Y^T)^T


def _element_cost(ws: Workspace, members, element: Element) -> float:
    moved = _apply(ws.src, element)
    return sum(float((moved[p] - ws.anc[p]).pow(2).sum()) for p in {p for m in members for p in m.params})


def _apply(state, element: Element) -> dict[str, torch.Tensor]:
    from ..elements import apply

    touched = set(element.group.params)
    return apply({k: state[k] for k in touched}, [element], dtype=state[next(iter(touched))].dtype)


def _pair_blocks(cross: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    return cross[:, pairs[:, :, None], pairs[:, None, :]]  # (copies, P, 2, 2)


def _pair_sq(ws, members, g, pairs) -> np.ndarray:
    out = np.zeros((g.copies, len(pairs)))
    for m in members:
        sq = ws.unit_sums(m, "src")
        out += sq[:, pairs[:, 0]] + sq[:, pairs[:, 1]]
    return out


def _similarities(ws, g: Group, members, *, normalise: bool) -> tuple[np.ndarray, list]:
    """(similarity of the members that move with signs and scales, per copy that of the weight vectors that
    only follow the permutation, None where there are none: an 11008-unit FFN's would be 1 GB of zeros)."""
    moving = [m for m in members if m.action != "permute"]
    following = [m for m in members if m.action == "permute"]
    b = ws.similarity(following, g, normalise=normalise) if following else [None] * g.copies
    return ws.similarity(moving, g, normalise=normalise), b


def _assign(a: np.ndarray, b: np.ndarray | None, g: Group, *, signed: bool):
    """Best (signed) assignment for one copy: anchor i receives source perm[i] with sign signs[i]. Returns
    (perm, signs, the cost matrix it maximised; None for a global sign, which compares two)."""
    if signed or g.kind == "signed_permutation":
        cost = np.abs(a)
        if b is not None:
            cost += b
        perm = kernels.hungarian(cost)
        return perm, np.where(a[np.arange(len(perm)), perm] < 0, -1.0, 1.0), cost
    if g.global_sign:
        b = 0.0 if b is None else b
        plus, minus = kernels.hungarian(a + b), kernels.hungarian(-a + b)
        rows = np.arange(len(plus))
        if (-a + b)[rows, minus].sum() > (a + b)[rows, plus].sum():
            return minus, -np.ones(len(minus)), None
        return plus, np.ones(len(plus)), None
    cost = a if b is None else a + b
    return kernels.hungarian(cost), np.ones(a.shape[0]), cost


def _unit_scales(ws: Workspace, g: Group, members, *, positive: bool) -> np.ndarray:
    """Closed-form per-coordinate scale: each member counts with its exponent (a primal one moves by d^e, a dual
    one by d^-e; ReLU^2 scales its output side by 1/d^2), :func:`minimize_power_sum` of each power's float64
    norms and inner products, summed member by member. A fractional exponent has no polynomial: scale 1."""
    terms: dict[int, list[np.ndarray]] = {}
    for m in members:
        if m.action == "permute":
            continue
        if not float(m.exponent).is_integer():
            return np.ones((g.copies, g.size))
        power = int(m.exponent) if m.action == "primal" else -int(m.exponent)
        sums = terms.setdefault(power, [np.zeros((g.copies, g.size)), np.zeros((g.copies, g.size))])
        sums[0] += ws.unit_sums(m, "src")
        sums[1] += ws.unit_sums(m, "src", "anc")
    if not terms:
        return np.ones((g.copies, g.size))
    return minimize_power_sum(terms, positive=positive)
