"""What the graph says about coordinates: ties, restrictions, separations, head links, pins.

Rules append records here while walking the graph; :mod:`symgraph.analysis.assemble` turns them into groups.
Every record keeps the node that produced it so reports can say why an axis was restricted or pinned.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .labels import collapse, collapse_pair, orders_differ

PRODUCT_FACTOR, PRODUCT_WEIGHT = 1, 2  # kinds of product tie (see Constraints.tie)

# Per-coordinate scalings a monomial (permutation times diagonal) group may keep, from largest to smallest.
# "sign" is +-1 per coordinate, "global_sign" one +-1 shared by all coordinates, "one" no scaling.
_SCALE_MEET = {
    frozenset({"nonzero"}): "nonzero",
    frozenset({"nonzero", "positive"}): "positive",
    frozenset({"nonzero", "sign"}): "sign",
    frozenset({"nonzero", "global_sign"}): "global_sign",
    frozenset({"positive", "sign"}): "one",
    frozenset({"positive", "global_sign"}): "one",
    frozenset({"sign", "global_sign"}): "global_sign",
}


def meet_scale(a: str, b: str) -> str:
    if a == b:
        return a
    if "one" in (a, b):
        return "one"
    return _SCALE_MEET[frozenset({a, b})]


@dataclass(frozen=True)
class Restriction:
    """A subgroup of GL(n) described by a few properties; ``&`` intersects two of them."""

    orthogonal: bool = False
    monomial: bool = False
    fixes_ones: bool = False  # T 1 = +-1 (centering commutes with T)
    scale: str = "nonzero"  # monomial only: the diagonal scalings kept

    def __and__(self, other: "Restriction") -> "Restriction":
        r = Restriction(self.orthogonal or other.orthogonal, self.monomial or other.monomial,
                        self.fixes_ones or other.fixes_ones, meet_scale(self.scale, other.scale))
        return r.normalised()

    def normalised(self) -> "Restriction":
        scale = self.scale
        if self.monomial and self.orthogonal:
            scale = meet_scale(scale, "sign")
        if self.monomial and self.fixes_ones:
            scale = meet_scale(scale, "global_sign")
        return Restriction(self.orthogonal, self.monomial, self.fixes_ones, scale)


GENERAL = Restriction()
ORTHOGONAL = Restriction(orthogonal=True)


def monomial(scale: str = "one") -> Restriction:
    return Restriction(monomial=True, scale=scale)


def from_group_name(group: str, scale: str | None = None) -> Restriction:
    """The restriction for an activation spec (``group`` and ``scale`` from specs/ops.yaml)."""
    if group == "general_linear":
        return GENERAL
    if group == "orthogonal":
        return ORTHOGONAL
    if group == "signed_permutation":
        return monomial("sign" if scale is None else meet_scale("sign", scale))
    return monomial(scale or "one")


@dataclass(frozen=True)
class Commute:
    """RoPE-like constraint: on ``ids`` the transformation must commute with a set of linear maps.

    ``pairs`` are coordinate pairs whose maps are 2x2 rotations (each pair: its own frequency), ``passthrough``
    coordinates see the identity. Anything else was pinned while resolving.
    """

    pairs: np.ndarray  # (P, 2) ids
    passthrough: np.ndarray  # (Q,) ids
    frequency: np.ndarray  # (P,) an identifier of each pair's map class (equal maps may mix)
    node: str


@dataclass
class Constraints:
    ties: list[tuple[np.ndarray, np.ndarray, int, int]] = field(default_factory=list)  # a ~ b, dual, product
    # ids, restriction, why, node, and whether it also limits per-coordinate scales (products only share
    # their permutation; each factor keeps its own scale)
    restricts: list[tuple[np.ndarray, Restriction, str, str, bool]] = field(default_factory=list)
    separates: list[tuple[np.ndarray, str]] = field(default_factory=list)  # (R, K) rows that may not mix
    # (R, K) rows that one statistic takes a row at a time (a softmax, a sum, a norm), kept even when R is 1: a head
    # permutation must map each row holding several heads onto itself (see analysis/head_rows.py)
    taken: list[tuple[np.ndarray, str]] = field(default_factory=list)
    # ids of the pieces of one tensor, cut apart and joined again after different ops: no piece's coordinates
    # (or heads) may mix with another's (see rules._separate_unlike_pieces)
    pieces: list[tuple[list[np.ndarray], str]] = field(default_factory=list)
    # indices into ``pieces`` of pieces computed alike but for per-piece parameters of one role (a LayerNorm per
    # head): their coordinates stay apart, but whole heads may move with those parameters swapped along
    alike_pieces: set[int] = field(default_factory=set)
    # (index into ``pieces``, why the cuts that made those pieces may cut elsewhere at another input shape, or
    # None): asked only where the pieces' coordinates would otherwise mix (analysis/assemble.py)
    cut_pieces: list[tuple[int, Callable[[], str | None]]] = field(default_factory=list)
    # (ids, node, why the cuts may cut elsewhere): coordinates joined beside a piece without labels, cut empty at
    # the traced shape (``h[..., 4:]`` of 4 units) or with its coordinates pinned (a rotary over 2 dims): at another
    # input shape the cuts may put some of them in that piece
    beside_unlabelled: list[tuple[np.ndarray, str, Callable[[], str | None]]] = field(default_factory=list)
    # ids pinned where they were joined beside data that differs along them (learned rows of a computed table)
    beside_data: list[np.ndarray] = field(default_factory=list)
    # (ids, matrix key): ids multiplied by one matrix or summed by one contraction; coordinates whose sets of keys
    # differ may not mix (see Constraints.passes_through)
    passes: list[tuple[np.ndarray, str]] = field(default_factory=list)
    rowlinks: list[tuple[np.ndarray, np.ndarray, str]] = field(default_factory=list)  # block ids (R,), rows (R, K)
    pins: list[tuple[np.ndarray, str, str]] = field(default_factory=list)  # ids, reason, node
    pinned: set[int] = field(default_factory=set, repr=False)  # every id pinned so far (pins are never lifted)
    commutes: list[Commute] = field(default_factory=list)
    permute_only: list[np.ndarray] = field(default_factory=list)  # param ids entering products as weights
    products: list[tuple[np.ndarray, np.ndarray, np.ndarray, str]] = field(default_factory=list)  # out = a * b
    # (R, K) rows a norm centres (LayerNorm): T 1 = s 1 over a whole row, one sign s for every coordinate in it
    centred: list[tuple[np.ndarray, str]] = field(default_factory=list)
    tags: dict[str, list[np.ndarray]] = field(default_factory=dict)  # motif tag -> ids

    def tie(self, a: torch.Tensor, b: torch.Tensor, dual: bool = False, product: int = 0, node: str = "") -> None:
        """``a`` and ``b`` are the same coordinate (``dual``: contracted with each other). A product tie
        (``product`` = PRODUCT_FACTOR, or PRODUCT_WEIGHT when ``b`` is a weight vector broadcast along other axes)
        shares the coordinate's permutation but not its scale (the factors of an elementwise product).

        A coordinate that meets an unlabelled position (data: a zero-padded or concatenated input piece) would be
        transformed while its partner is not: it is pinned."""
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            a, b = collapse_pair(a, b)
        a, b = _np(a).reshape(-1), _np(b).reshape(-1)
        self.pin(np.concatenate([a[(a >= 0) & (b < 0)], b[(b >= 0) & (a < 0)]]),
                 "meets data where a coordinate was expected (concatenated with data?)", node)
        if orders_differ(a, b) or orders_differ(b, a):
            self.pin(np.concatenate([a[a >= 0], b[b >= 0]]), "its positions meet their partners in another order "
                     "than other coordinates' do (a flattened channel tied to shuffled or rolled entries)", node)
        keep = (a >= 0) & (b >= 0)
        if keep.any():
            pairs = np.unique(np.stack([a[keep], b[keep]], axis=1), axis=0)
            self.ties.append((pairs[:, 0], pairs[:, 1], int(dual), product))

    def restrict(self, ids, restriction: Restriction, why: str, node: str, scales: bool = True) -> None:
        ids = _ids(ids)
        if ids.size:
            self.restricts.append((ids, restriction, why, node, scales))

    def pin(self, ids, reason: str, node: str) -> None:
        ids = _ids(ids)
        if ids.size:
            self.pins.append((ids, reason, node))
            self.pinned.update(ids.tolist())

    def separate(self, rows: torch.Tensor | np.ndarray, node: str) -> None:
        rows = _np(rows)
        if rows.ndim == 2 and rows.shape[0] > 1:
            self.separates.append((rows, node))

    def take_rows(self, rows: torch.Tensor | np.ndarray, node: str) -> None:
        """``node`` computes one statistic per row of ``rows`` (R, K) from all of its coordinates at once."""
        rows = _np(rows)
        if rows.size:
            self.taken.append((rows.reshape(-1, rows.shape[-1]), node))

    def separate_pieces(self, pieces: list, node: str, cuts_move: Callable[[], str | None] | None = None,
                        alike: bool = False) -> None:
        """``pieces`` (ids) may not mix; ``cuts_move``: where the pieces were cut apart at bounds the trace bakes
        in, why those bounds may differ at another input shape (None when they do not); ``alike``: computed by the
        same ops but for per-piece parameters of one role (``alike_pieces``)."""
        pieces = [p for p in (_ids(p) for p in pieces) if p.size]
        if len(pieces) > 1:
            self.pieces.append((pieces, node))
            if alike:
                self.alike_pieces.add(len(self.pieces) - 1)
            if cuts_move is not None:
                self.cut_pieces.append((len(self.pieces) - 1, cuts_move))

    def passes_through(self, ids, node: str) -> None:
        """``ids`` pass through ``node``, a matrix (a contraction multiplies passing coordinates by its other
        operand's values: an attention matrix) or a sum (a contraction sums its contracted coordinates into one
        product). Coordinates of one space that pass different such nodes (heads computed one by one and joined
        again) meet different matrices or sums: a map mixing them is no symmetry."""
        ids = _ids(ids)
        if ids.size:
            self.passes.append((ids, node))

    def centre(self, rows: torch.Tensor | np.ndarray, node: str) -> None:
        self.centred.append((_np(rows).reshape(-1, _np(rows).shape[-1]), node))

    def tag(self, name: str, ids) -> None:
        ids = _ids(ids)
        if ids.size:
            self.tags.setdefault(name, []).append(ids)


def _np(t) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _ids(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = collapse(t)
    a = _np(t).reshape(-1)
    return np.unique(a[a >= 0])
