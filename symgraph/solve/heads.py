r"""Head matching costs that no per-head transformation can change.

A head permutation has to be found before the rotations, rescales and rotary commutants that act inside each
head, so its cost must not depend on them. For a per-head group :math:`L` whose primal members :math:`X_P` move
as :math:`T X_P` and dual members :math:`X_D` as :math:`T^{-T} X_D`, the circuit :math:`F = X_P^\top X_D`
(the QK bilinear form :math:`W_K^\top W_Q`, the OV map :math:`W_V^\top W_O^\top`) is invariant for every
invertible :math:`T`. Heads are compared by the cosine of their circuits, computed without forming them:

.. math:: \langle X_{P,i}^\top X_{D,i}, X_{P,j}^\top X_{D,j}\rangle
          = \sum_{ab} (X_{P,i}X_{P,j}^\top)_{ab}\,(X_{D,i}X_{D,j}^\top)_{ab}.

When one side holds several slices of a head that a finer permutation may still reorder (the query heads of
one KV group), that side enters through its Gram matrix :math:`G = \sum_s X_s X_s^\top`, and the similarity is
:math:`\operatorname{tr}(G_i C G_j C^\top)` with :math:`C = X_{P,i} X_{P,j}^\top`: invariant to both.
Head members no per-head group covers are compared by the normalised Procrustes value
:math:`\|X_i X_j^\top\|_* / (\|X_i\|\|X_j\|)`, invariant to any orthogonal map inside the head.

At the true permutation every cosine is 1, its maximum, so an exactly reparametrised model is recovered.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..groups import Group, Member, TensorMember
from .kernels import procrustes_value

_WITHIN_KINDS = ("orthogonal", "general_linear", "rotary")


def invariant_head_similarity(ws, g: Group, members: list[Member], groups) -> np.ndarray:
    """S[c, anchor head, source head]: summed cosines of per-head circuits (and of uncovered members)."""
    return _head_similarity(ws, g, members, groups, _WITHIN_KINDS, _circuit_cosines, normalise=True)


def rotation_head_similarity(ws, g: Group, members: list[Member], groups) -> np.ndarray:
    """S[c, anchor head, source head]: the best similarity of two heads when the per-head rotations follow,
    sum over per-head groups ``L`` of ``||sum over L's members X_src,i X_anc,j^T||_*`` (members of one group
    share its rotation: one nuclear norm per group, not per member), plus members no such group covers."""
    return _head_similarity(ws, g, members, groups, ("orthogonal", "rotary"), _rotation_values, normalise=False)


def _head_similarity(ws, g: Group, members, groups, kinds, per_group, *, normalise: bool) -> np.ndarray:
    """``per_group`` summed over the per-head groups of ``kinds`` that sit inside single heads, plus the
    Procrustes value of each head member no such group covers."""
    coord = _coordinate_maps(g)
    total = np.zeros((g.copies, g.size, g.size))
    covered: dict[tuple[str, int], set[int]] = defaultdict(set)
    for other in groups:
        if other is g or other.kind not in kinds:
            continue
        layout = _circuit_layout(other, coord, g)
        if layout is None:
            continue
        total += per_group(ws, layout, g)
        for m in other.members:
            if (m.param, m.axis) in coord:
                covered[(m.param, m.axis)].update(m.index.reshape(-1).tolist())
    for m in members:  # a tensor member (a LayerNorm per head, swapped whole) is in no per-head group
        if isinstance(m, TensorMember) or set(m.index.reshape(-1).tolist()) - covered[(m.param, m.axis)]:
            total += _member_values(ws, m, normalise=normalise)
    return total


def _rotation_values(ws, layout, g: Group) -> np.ndarray:
    n_heads = g.copies * g.size
    cache: dict = {}

    def head_block(which: str, h: int) -> torch.Tensor:  # both sides of head h, features side by side
        slices = [x for side in ("primal", "dual") for x in _side_slices(ws, which, layout, h, side, cache)]
        return torch.cat(slices, 1)

    stacks = {w: _by_copy(torch.stack([head_block(w, h) for h in range(n_heads)]), g) for w in ("src", "anc")}
    cross = torch.einsum("cikf,cjlf->cijkl", stacks["src"], stacks["anc"])  # [copy, source head, anchor head]
    return np.swapaxes(procrustes_value(cross), -1, -2)


def _coordinate_maps(g: Group) -> dict[tuple[str, int], np.ndarray]:
    """(param, axis) -> position -> flat head coordinate (copy * size + head), -1 outside the group."""
    maps = {}
    for m in g.members:
        if isinstance(m, TensorMember):
            continue
        top = int(m.index.max()) + 1
        out = maps.get((m.param, m.axis))
        if out is None or len(out) < top:
            grown = np.full(top, -1, dtype=np.int64)
            if out is not None:
                grown[:len(out)] = out
            out = grown
        heads = np.arange(g.copies * g.size).reshape(g.copies, g.size, 1)
        out[m.index] = np.broadcast_to(heads, m.index.shape)
        maps[(m.param, m.axis)] = out
    return maps


def _circuit_layout(other: Group, coord, g: Group):
    """For each head: which copy of ``other`` it holds and which slices of each side, or None when ``other``
    does not sit inside single heads (then it does not enter the cost)."""
    n_heads = g.copies * g.size
    copy_of = np.full(n_heads, -1)
    sides = {"primal": defaultdict(list), "dual": defaultdict(list)}  # head -> [(member, slot index or None)]
    touches = False
    for m in other.members:
        side = "dual" if m.action == "dual" else "primal"
        heads_map = coord.get((m.param, m.axis))
        if heads_map is None:  # not moved by the head permutation: shared by every head of the copy
            continue
        touches = True
        idx = m.index
        if idx.max() >= len(heads_map):
            return None
        heads = heads_map[idx]  # (copies, size, block)
        for c in range(other.copies):
            for s in range(idx.shape[2]):
                h = np.unique(heads[c, :, s])
                if len(h) != 1 or h[0] < 0:
                    return None
                h = int(h[0])
                if copy_of[h] not in (-1, c):
                    return None
                copy_of[h] = c
                sides[side][h].append((m, s))
    if not touches or (copy_of < 0).any():
        return None
    shared = {side: [m for m in other.members if ("dual" if m.action == "dual" else "primal") == side
                     and (m.param, m.axis) not in coord] for side in sides}
    return other, copy_of, sides, shared


def _side_slices(ws, which, layout, h, side, cache: dict) -> list[torch.Tensor]:
    """The (size, features) slices of one side of head ``h``'s circuit. ``cache`` keeps each member's float64
    slices for the next head (every head reads the same members: gathering them once per head was most of the
    head solver's time)."""
    other, copy_of, sides, shared = layout
    c = int(copy_of[h])

    def gathered(m: Member) -> torch.Tensor:
        key = (which, id(m))
        if key not in cache:
            cache[key] = ws.gather(which, m).double()
        return cache[key]

    out = [gathered(m)[c, :, s] for m, s in sides[side][h]]
    for m in shared[side]:
        x = gathered(m)[c]  # (size, block, rest): every slice is shared by the heads of this copy
        out.extend(x[:, s] for s in range(x.shape[1]))
    return out


def _circuit_cosines(ws, layout, g: Group) -> np.ndarray:
    n_heads = g.copies * g.size
    per_side, cache = {}, {}
    for side in ("primal", "dual"):
        slices = {w: [_side_slices(ws, w, layout, h, side, cache) for h in range(n_heads)] for w in ("src", "anc")}
        counts = {len(s) for s in slices["src"]}
        if counts == {0} or len(counts) != 1:
            return np.zeros((g.copies, g.size, g.size))
        multi = _is_multi(layout, side)
        if multi:  # Gram over slices a finer permutation may reorder
            per_side[side] = {w: _by_copy(torch.stack([sum(x @ x.T for x in s) for s in slices[w]]), g)
                              for w in slices}
        else:
            per_side[side] = {w: _by_copy(torch.stack([torch.cat(s, 1) for s in slices[w]]), g) for w in slices}
        per_side[side]["multi"] = multi
    p, d = per_side["primal"], per_side["dual"]
    if p["multi"] and d["multi"]:
        return np.zeros((g.copies, g.size, g.size))
    if p["multi"]:
        p, d = d, p

    # Heads are only ever matched within their copy: pairs across copies are never formed.
    def sim(a: str, b: str) -> torch.Tensor:  # [copy, head of a, head of b]
        cp = torch.einsum("cikf,cjlf->cijkl", p[a], p[b])
        if d["multi"]:
            return torch.einsum("cikl,cijlm,cjmn,cijkn->cij", d[a], cp, d[b], cp)
        cd = torch.einsum("cikf,cjlf->cijkl", d[a], d[b])
        return (cp * cd).sum((-2, -1))

    def self_sim(a: str) -> torch.Tensor:  # the diagonal of sim(a, a), without the off-diagonal pairs
        cp = torch.einsum("cikf,cilf->cikl", p[a], p[a])
        if d["multi"]:
            return torch.einsum("cikl,cilm,cimn,cikn->ci", d[a], cp, d[a], cp)
        return (cp * torch.einsum("cikf,cilf->cikl", d[a], d[a])).sum((-2, -1))

    cross = sim("src", "anc")
    norm_s = self_sim("src").clamp_min(1e-300).sqrt()
    norm_a = self_sim("anc").clamp_min(1e-300).sqrt()
    cosine = (cross / norm_s[:, :, None] / norm_a[:, None, :]).cpu().numpy()
    return np.swapaxes(cosine, -1, -2)


def _is_multi(layout, side) -> bool:
    """A side is multi-slice when some member holds several slices of one head (query heads of a KV group)."""
    _, _, sides, _ = layout
    return any(len(v) != len({id(m) for m, _ in v}) for v in sides[side].values())


def _member_values(ws, m: Member, *, normalise: bool) -> np.ndarray:
    """S[c, anchor head, source head] = ||X_src,i X_anc,j^T||_* of one member's head blocks (invariant to any
    orthogonal map inside a head); with ``normalise``, divided by both blocks' norms (a cosine)."""
    bs, ba = ws.gather("src", m).double(), ws.gather("anc", m).double()  # (copies, heads, block, rest)
    copies, heads = bs.shape[:2]
    value = procrustes_value(torch.einsum("cibr,cjdr->cijbd", bs, ba)).reshape(copies, heads, heads)
    if normalise:
        ns, na = bs.flatten(2).norm(dim=2).cpu().numpy(), ba.flatten(2).norm(dim=2).cpu().numpy()
        value = value / np.maximum(ns[:, :, None] * na[:, None, :], 1e-300)
    return np.swapaxes(value, -1, -2)


def _by_copy(stacked: torch.Tensor, g: Group) -> torch.Tensor:
    """(copies * size, ...) per-head stacks -> (copies, size, ...): a head is matched only within its copy."""
    return stacked.reshape(g.copies, g.size, *stacked.shape[1:])
