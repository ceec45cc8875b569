"""Resolve a mixed channel ``sum_k coef_k * x[ids_k]`` into a commutation constraint.

RoPE is the case that matters: ``x * cos + rotate_half(x) * sin`` is, at every position t, a linear map M_t on
the head dimension. A transformation T of x's coordinates survives exactly when T M_t = M_t T for every t. The
maps are sparse: coordinates only meet the few others they are mixed with (pairs (i, i + r/2) for rotate_half,
(2i, 2i+1) for interleaved layouts), so the commutant is computed per connected component. Components whose maps
are 2x2 rotations give rotary pairs; components that see only the identity are pass-through coordinates. Any
other structure pins its coordinates: never guess.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .constraints import Commute
from .labels import Chan, Term

_MAX_POSITIONS = 32


def resolve(walker, chan: Chan, node: str) -> Chan:
    if not chan.mixed:
        return chan
    one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.int64)
    terms = [Term(t.ids, one if t.coef is None else t.coef, zero if t.src is None else t.src) for t in chan.terms]
    shape = torch.broadcast_shapes(*[t.ids.shape for t in terms], *[t.coef.shape for t in terms])
    ids = [t.ids.expand(shape) for t in terms]
    coefs = [t.coef.expand(shape).to(torch.float64) for t in terms]
    sources = [t.src.expand(shape) for t in terms]
    chan_axes = sorted({a for i in ids for a in range(len(shape)) if i.shape[a] > 1 and i.stride(a) != 0
                        and not bool((i == i.narrow(a, 0, 1)).all())})
    base = ids[0]
    if not chan_axes:
        return Chan.clean(base)  # scalar-per-position coefficients only: every transformation commutes
    data_axes = [a for a in range(len(shape)) if a not in chan_axes]
    width = int(np.prod([shape[a] for a in chan_axes]))

    def flat(t):
        return t.permute(*data_axes, *chan_axes).reshape(-1, width)

    id_rows = [flat(i)[0].numpy() for i in ids]
    coef_rows = [flat(c).numpy() for c in coefs]
    source_rows = [flat(s)[0].numpy() for s in sources]
    # Broadcast copies (GQA keys repeated per query head) repeat positions: keep each coordinate once.
    order, keep = np.unique(id_rows[0], return_index=True)
    keep = np.sort(keep)
    order = id_rows[0][keep]
    id_rows = [r[keep] for r in id_rows]
    coef_rows = [c[:, keep] for c in coef_rows]
    source_rows = [r[keep] for r in source_rows]
    if any(set(r[r >= 0].tolist()) - set(order.tolist()) for r in id_rows):
        walker.c.pin(np.concatenate(id_rows), "mixed with coordinates of another space", node)
        return Chan.clean(base)
    position = {int(v): k for k, v in enumerate(order)}
    cols = [np.array([position.get(int(v), -1) for v in r]) for r in id_rows]
    samples = _distinct_positions(coef_rows)
    _commutant(walker, _sparse_entries(cols, coef_rows, source_rows, samples), order, node)
    return Chan.clean(base)


def _sparse_entries(cols, coef_rows, source_rows, samples) -> dict[tuple[int, int], np.ndarray]:
    """Each term's maps M_t as {(row, col): values over the sampled positions t, term after term}; never an n x n
    array. The terms are not summed: they may read different tensors of one space (``x * m + shift(x) * (1 - m)``,
    a token shift of some coordinates), so a transformation must commute with each term's map on its own. Nor are
    the parts of one term that read different tensors (``stack([x0 * c, r1 * c])`` with ``r = x + f(x)``): each
    (term, source) is a map of its own."""
    slots: dict[tuple[int, int], int] = {}
    for k, (col, src) in enumerate(zip(cols, source_rows)):
        for s in np.unique(src[col >= 0]):
            slots.setdefault((k, int(s)), len(slots))
    entries: dict[tuple[int, int], np.ndarray] = {}
    n = len(samples)
    for k, (col, coef, src) in enumerate(zip(cols, coef_rows, source_rows)):
        values = coef[samples]  # (S, P)
        for p in np.nonzero(col >= 0)[0]:
            key, at = (int(p), int(col[p])), slots[(k, int(src[p]))]
            entries.setdefault(key, np.zeros(n * len(slots)))[at * n:(at + 1) * n] += values[:, p]
    return {k: v for k, v in entries.items() if np.any(np.abs(v) > 0)}


def _distinct_positions(coef_rows: list[np.ndarray]) -> list[int]:
    stacked = np.concatenate(coef_rows, axis=1)
    _, first = np.unique(np.round(stacked, 12), axis=0, return_index=True)
    first = np.sort(first)
    if len(first) > _MAX_POSITIONS:
        first = first[np.linspace(0, len(first) - 1, _MAX_POSITIONS).astype(int)]
    return list(first)


def _commutant(walker, entries: dict, order: np.ndarray, node: str) -> None:
    """Classify each connected component of the maps' support and record the constraint."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    n = len(order)
    rows = np.array([r for r, _ in entries] + list(range(n)))
    cols = np.array([c for _, c in entries] + list(range(n)))
    _, comp = connected_components(coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(n, n)), directed=False)
    members_of: dict[int, list[int]] = {}
    for p, c in enumerate(comp):
        members_of.setdefault(int(c), []).append(p)
    n_samples = len(next(iter(entries.values()))) if entries else 1
    zero = np.zeros(n_samples)
    pairs, freq, passthrough, pinned = [], [], [], []
    signatures: dict[tuple, int] = {}
    # coordinates by the maps they see: a pair by its rotations, a pass-through coordinate by its scales
    seeing: dict[tuple, list[int]] = defaultdict(list)
    for members in members_of.values():
        block = np.stack([np.stack([entries.get((i, j), zero) for j in members], -1) for i in members], -2)
        if len(members) == 1:  # scaled by one number per position and term: mixes with those scaled alike
            diag = block[:, 0, 0]
            if np.any(np.abs(diag) > 0):
                passthrough.append(order[members[0]])
                seeing[("scale", tuple(np.round(diag, 12)))].append(order[members[0]])
            else:
                pinned.extend(order[members])
            continue
        if len(members) == 2 and _is_rotation_family(block):
            key = tuple(np.round(block.reshape(len(block), -1), 9).ravel())
            freq.append(signatures.setdefault(key, len(signatures)))
            pairs.append((order[members[0]], order[members[1]]))
            seeing[("pair", freq[-1])].extend(pairs[-1])
            continue
        pinned.extend(order[members])
    if pinned:
        walker.c.pin(np.array(pinned), "mixed with data-dependent coefficients in a way no rule covers", node)
    scales = [ids for key, ids in seeing.items() if key[0] == "scale"]
    if len(scales) > 1:  # x * c, c fixed and differing per coordinate (a buffer, arange): only those scaled alike mix
        for k, ids in enumerate(scales):
            walker.c.passes_through(np.array(ids, dtype=np.int64), f"{node} (scales {k})")
    if len(seeing) > 1:  # and only heads that see the same maps trade places (rotary frequencies per head)
        walker.c.separate_pieces([np.array(ids, dtype=np.int64) for ids in seeing.values()], node)
    if pairs or passthrough:
        walker.c.commutes.append(Commute(np.array(pairs, dtype=np.int64).reshape(-1, 2),
                                         np.array(passthrough, dtype=np.int64), np.array(freq), node))


def _is_rotation_family(block: np.ndarray) -> bool:
    """Every 2x2 map is a scaled rotation [[c, -s], [s, c]], and at least one has s != 0."""
    c1, c2 = block[:, 0, 0], block[:, 1, 1]
    s1, s2 = block[:, 1, 0], block[:, 0, 1]
    return bool(np.allclose(c1, c2, atol=1e-9) and np.allclose(s1, -s2, atol=1e-9) and np.any(np.abs(s1) > 1e-9))
