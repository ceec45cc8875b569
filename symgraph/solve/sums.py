"""Member sums kept per layer, so a cost over the whole model reads again only the layers that moved.

The residual stream's costs (``sum over members X_src X_anchor^T``) read every parameter of the model; solved
once per descent round, that was most of an alignment's time at 1B. Its sums are kept per layer (the parameters
under one ``...layers.N.`` prefix) with the versions of the parameters they read: a layer is read again only when
a group inside it moved. When the group itself moves by a rigid element (a signed permutation or an orthogonal
matrix, the residual kinds), its own sums follow algebraically (``T M`` or ``S T^T``) instead of being read
again. Groups inside one layer, and layers with few features (norm vectors), are not kept: recomputing them is
as cheap as keeping them.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from ..elements import Element
from ..groups import Group, Member, TensorMember

MIN_FEATURES = 64  # fewer features per coordinate than this: recomputing the layer costs less than keeping it
ROWS, COLUMNS, SCALAR = "rows", "columns", "scalar"  # where a sum carries the source coordinate


@dataclass
class _Entry:
    signature: frozenset
    versions: tuple[int, ...]
    params: tuple[str, ...]
    value: np.ndarray


def layer_of(param: str) -> str:
    """The layer prefix of a parameter (``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``), or the
    parameter itself outside the layers."""
    match = re.match(r"(.*?\.\d+)\.", param)
    return match.group(1) if match else param


def signature(m: Member) -> tuple:
    if isinstance(m, TensorMember):
        return m.slots, m.action
    return m.param, m.axis, m.action, m.exponent, m.index.shape, m.index.tobytes()


class MemberSums:
    """Per-layer sums of member terms, valid while the versions of the parameters they read are unchanged."""

    def __init__(self):
        self.version: dict[str, int] = defaultdict(int)  # bumped whenever a source parameter moves
        self._entries: dict[tuple, _Entry] = {}
        self._layouts: dict[str, str] = {}  # kind -> where its sums carry the source coordinate

    def total(self, kind: str | None, layout: str, g: Group, members, term, features, shape) -> np.ndarray:
        """Float64 sum of ``term(m)`` over ``members``; with a ``kind`` (the name of the sum) and members in more
        than one layer, each layer's part is kept and reused while its parameters have not moved.
        ``features(m)`` is the member's feature count (small layers are not kept)."""
        self._layouts[kind] = layout
        out = np.zeros(shape)
        for key, ms in self._layers(kind, g, members, features):
            if key is None:
                _sum(ms, term, shape, out)
            else:
                out += self._layer_sum(key, ms, term, shape)
        return out

    def _layers(self, kind, g: Group, members, features):
        """(key under which the layer's sum is kept, or None when it is not kept; that layer's members)."""
        layers = defaultdict(list)
        for m in members:
            layers[layer_of(m.params[0])].append(m)
        keep = kind is not None and len(layers) > 1
        for layer, ms in layers.items():
            kept = keep and sum(features(m) for m in ms) >= MIN_FEATURES
            yield ((kind, g.id, layer, frozenset(m.action for m in ms)) if kept else None), ms  # primal, dual apart

    def _valid(self, entry: _Entry, ms) -> bool:
        return (entry.signature == frozenset(signature(m) for m in ms)
                and entry.versions == tuple(self.version[p] for p in entry.params))

    def _layer_sum(self, key, ms: list[Member], term, shape) -> np.ndarray:
        entry = self._entries.get(key)
        if entry is None or not self._valid(entry, ms):
            params = tuple(dict.fromkeys(p for m in ms for p in m.params))
            entry = _Entry(frozenset(signature(m) for m in ms), tuple(self.version[p] for p in params), params,
                           _sum(ms, term, shape))
            self._entries[key] = entry
        return entry.value

    def moved(self, elements: list[Element]) -> None:
        """The source moved by ``elements``: their parameters get new versions; sums of an element's own group
        that it moves rigidly follow it, the others are read again when next asked for."""
        for e in elements:
            params = set(e.group.params)
            current = {id(entry) for entry in self._entries.values()  # a stale sum cannot follow: read it again
                       if entry.versions == tuple(self.version[p] for p in entry.params)}
            for p in params:
                self.version[p] += 1
            own = {signature(m) for m in e.group.members}
            for (kind, gid, *_), entry in self._entries.items():
                if gid != e.group.id or not set(entry.params) <= params or id(entry) not in current:
                    continue
                moves = {s for s in own if _names(s) & set(entry.params)}
                transformed = _follow(entry, e, self._layouts[kind]) if moves == entry.signature else None
                if transformed is not None:
                    entry.value = transformed
                    entry.versions = tuple(self.version[p] for p in entry.params)


def _names(sig: tuple) -> set[str]:
    """The tensors a member signature names."""
    return {p for row in sig[0] for p in row} if isinstance(sig[0], tuple) else {sig[0]}


def _sum(members, term, shape, out: np.ndarray | None = None) -> np.ndarray:
    """Sum of ``term(m)`` over ``members``, accumulated into ``out`` when given (no second n x n buffer)."""
    out = np.zeros(shape) if out is None else out
    for m in members:
        out += term(m)
    return out


def _follow(entry: _Entry, e: Element, layout: str) -> np.ndarray | None:
    """``entry``'s sum after the source coordinates moved by ``e`` (X_src -> T X_src), or None when ``e`` is not
    rigid (a general scale or matrix changes the sum in a way only reading the members again gives)."""
    if layout == SCALAR:
        return entry.value if _rigid(e) else None
    if e.matrices is not None:
        if not _rigid(e):
            return None
        T = e.matrices  # orthogonal: primal and dual members move alike (T^{-T} = T)
        return T @ entry.value if layout == ROWS else entry.value @ np.swapaxes(T, -1, -2)
    if not _rigid(e):
        return None
    actions = {s[2] for s in entry.signature}
    diag = np.ones(e.perm.shape) if e.diag is None else e.diag
    if "permute" in actions:  # weight vectors follow the permutation without the signs
        if len(actions) > 1 and np.any(diag < 0):
            return None
        diag = np.ones(e.perm.shape)
    rows = np.arange(e.perm.shape[0])[:, None]
    if layout == ROWS:
        return entry.value[rows, e.perm] * diag[:, :, None]
    return entry.value[rows, :, e.perm].swapaxes(1, 2) * diag[:, None, :]


def _rigid(e: Element) -> bool:
    """Orthogonal matrices, or permutations with signs: norms are unchanged and primal, dual move alike."""
    if e.matrices is not None:
        eye = np.eye(e.matrices.shape[-1])
        return bool(np.allclose(e.matrices @ np.swapaxes(e.matrices, -1, -2), eye, atol=1e-10))
    return e.diag is None or bool(np.all(np.abs(e.diag) == 1.0))
