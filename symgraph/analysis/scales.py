"""Per-coordinate scale groups of elementwise products (gated FFNs, norm weights and the next linear).

An elementwise product ``out = a * b`` shares one permutation among its three coordinates, but each keeps its own
scale, with ``s_out = s_a + s_b`` (in logarithms). Everything else ties scales exactly (``add``, contractions
with a flipped sign), and some ops forbid them (``silu``, normalisations, pins). So the scale groups are the null
space of a small integer linear system over *scale classes*: ids tied by every tie except product ties.

SwiGLU: ``silu(gate) * up`` gives s_gate = 0, s_out = s_up: one free scale on up rows and down columns.
Pre-LN: ``norm(x) * w + b`` gives s_norm = 0, s_out = s_w = s_b: the norm weight trades scale with the next linear.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from scipy.linalg import null_space

from ..groups import Group, Member
from .naming import common_prefix, short_members
from .partition import parity_classes, union_sets


def scale_groups(asm, restriction, excluded: np.ndarray, rotary: np.ndarray) -> list[Group]:
    """Scale groups, solved with one exponent per id range (a parameter axis, or one op's activation ids), split
    where some of a range's coordinates must keep scale 1 and others need not (a fused gate_up projection: the
    gate rows feed an activation, the up rows only the product).

    Every coordinate of such a part obeys the same equations, so one variable per part suffices, and a 70B
    model has thousands of parts rather than millions of coordinates.
    """
    if not asm.c.products:
        return []
    range_of_id = np.searchsorted(asm.range_start, np.arange(asm.n), side="right") - 1
    zero_id, positive_id = _id_limits(asm)
    _, part_of_id = np.unique(range_of_id * 2 + zero_id, return_inverse=True)  # one variable per part
    part_of_id = part_of_id.reshape(-1)
    ties = _range_edges(asm.c.ties, part_of_id)
    products = _range_products(asm.c.products, part_of_id)
    zero = np.zeros(int(part_of_id.max()) + 1, bool)
    zero[part_of_id[zero_id]] = True
    positive = np.zeros_like(zero)
    positive[part_of_id[positive_id]] = True
    linked = [{a, b} for a, b, _ in ties] + [set(p) for p in products]
    groups = []
    for component in union_sets(linked):
        if not any(set(p) <= component for p in products):
            continue  # no product here: the permutation group's own scale (if any) says it all
        family = sorted(component)
        # tie a ~ b: v_a = v_b, or v_a = -v_b when dual (a scaled column meets a scaled activation)
        equations = [{a: 1, b: (1 if dual else -1)} if a != b else {a: 2 * dual}
                     for a, b, dual in ties if a in component]
        equations += [_product_row(p) for p in products if p[0] in component]
        for v in _nice_null_space(family, equations, zero):
            group = _emit(asm, v, part_of_id, positive, restriction, excluded, rotary)
            if group is not None:
                groups.append(group)
    return groups


def _range_edges(ties, part_of_id) -> list[tuple[int, int, int]]:
    edges = set()
    for a, b, dual, product in ties:
        if product:  # factors of a product keep their own scales
            continue
        pairs = np.unique(np.stack([part_of_id[a], part_of_id[b]], 1), axis=0)
        edges.update((int(x), int(y), int(dual)) for x, y in pairs)
    return sorted(edges)


def _range_products(products, part_of_id) -> list[tuple[int, int, int]]:
    out = set()
    for o, a, b, _node in products:
        cols = [x.reshape(-1) for x in (o, a, b)]
        ok = np.all([c >= 0 for c in cols], axis=0)
        table = np.unique(np.stack([part_of_id[c[ok]] for c in cols], 1), axis=0)
        out.update(tuple(int(x) for x in row) for row in table)
    return sorted(out)


def _product_row(p) -> dict[int, int]:
    row: dict[int, int] = defaultdict(int)
    for r, coef in zip(p, (1, -1, -1)):
        row[r] += coef
    return dict(row)


def _id_limits(asm) -> tuple[np.ndarray, np.ndarray]:
    """Per id: whether its scale must stay 1, and whether it may only be positive."""
    zero = np.zeros(asm.n, bool)
    positive = np.zeros(asm.n, bool)
    for ids, r, _why, _node, scales in asm.c.restricts:
        if not scales:
            continue
        if r.monomial and r.scale == "positive":
            positive[ids] = True
        elif r.monomial and r.scale == "nonzero" or not (r.monomial or r.orthogonal or r.fixes_ones):
            continue
        else:
            zero[ids] = True
    # Pinned coordinates keep scale 1. Only the pinned ids themselves: a pin reaches the rest of their
    # permutation class through product ties, which share the permutation but not the scale (a base model's
    # output pins the residual stream, yet each norm weight still trades scale with the linears reading it).
    for ids, _reason, _node in asm.c.pins:
        zero[ids] = True
    _, _, self_dual = parity_classes(asm.n, asm.c.ties, keep=lambda product: not product)
    zero[self_dual] = True  # a scale tied to its own inverse: s = -s
    return zero, positive


def _nice_null_space(family: list[int], equations, zero) -> list[dict]:
    """Null-space basis in reduced row-echelon form, scaled to small integers where possible."""
    index = {c: i for i, c in enumerate(family)}
    rows = []
    for eq in equations:
        row = np.zeros(len(family))
        for c, coef in eq.items():
            if c in index:
                row[index[c]] = coef
        rows.append(row)
    for c in family:
        if zero[c]:
            row = np.zeros(len(family))
            row[index[c]] = 1
            rows.append(row)
    basis = null_space(np.array(rows)) if rows else np.eye(len(family))
    if basis.size == 0:
        return []
    reduced = _rref(basis.T)
    out = []
    for v in reduced:
        nz = np.abs(v) > 1e-9
        v = v / np.min(np.abs(v[nz]))
        v = np.where(np.abs(v - np.round(v)) < 1e-6, np.round(v), v)
        out.append(dict(zip(family, v)))
    return out


def _rref(m: np.ndarray) -> np.ndarray:
    m = m.copy()
    lead = 0
    rows, cols = m.shape
    for r in range(rows):
        while lead < cols and np.all(np.abs(m[r:, lead]) < 1e-9):
            lead += 1
        if lead >= cols:
            break
        pivot = r + int(np.argmax(np.abs(m[r:, lead])))
        m[[r, pivot]] = m[[pivot, r]]
        m[r] /= m[r, lead]
        for i in range(rows):
            if i != r:
                m[i] -= m[i, lead] * m[r]
        lead += 1
    return m[np.any(np.abs(m) > 1e-9, axis=1)]


def _emit(asm, v: dict, part_of_id, positive, restriction, excluded, rotary) -> Group | None:
    active = [r for r, e in v.items() if abs(e) > 1e-9]
    ids = np.nonzero(np.isin(part_of_id, active))[0]
    coords = np.unique(asm.cls[ids])
    if len(coords) == 0 or excluded[coords].any():
        return None  # head blocks
    if rotary[coords].any():
        return None  # RoPE mixes each pair: a per-coordinate scale would have to be equal within pairs
    r0 = restriction[coords[0]]
    if r0.monomial and r0.scale in ("positive", "nonzero") and all(abs(abs(v[r]) - 1) < 1e-9 for r in active):
        return None  # the permutation group already carries this per-unit scale (ReLU FFN)
    ids = ids[asm.is_param[ids]]
    if len(ids) == 0:
        return None
    rng, pos = asm.decode(ids)
    where = {int(k): j for j, k in enumerate(coords)}
    found: dict[tuple, list[list[int]]] = defaultdict(lambda: [[] for _ in coords])
    for i, k, p in zip(ids, rng, pos):
        e = v[int(part_of_id[i])]
        key = (asm.range_of[k].owner, asm.range_of[k].axis, "primal" if e > 0 else "dual", abs(float(e)))
        found[key][where[int(asm.cls[i])]].append(int(p))
    members = []
    for (param, axis, action, exponent), per_coord in sorted(found.items()):
        counts = {len(x) for x in per_coord}
        if len(counts) != 1 or 0 in counts:
            return None
        index = np.array([sorted(x) for x in per_coord], dtype=np.int64)[None]
        exponent = int(exponent) if float(exponent).is_integer() else exponent
        members.append(Member(param, axis, index, action, exponent))
    motif = asm.motif_for("scales", coords)
    layer = common_prefix([m.param for m in members])
    sign = "positive" if positive[active].any() else "nonzero"
    return Group(id=f"{motif}-scale:{layer or 'model'}:{short_members(members)}", motif=motif, kind="scale",
                 size=len(coords), copies=1, members=tuple(members), scale=sign, layer=layer,
                 notes=("per-coordinate scale traded across an elementwise product",))
