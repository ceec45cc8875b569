"""Channel labels: which coordinate of which space every element of a tensor carries.

A *coordinate id* names one coordinate of a space (row ``o`` of a linear weight, unit ``i`` of an FFN). Every
parameter axis gets fresh ids; the analysis ties ids together when the graph forces two coordinates to transform
alike. A tensor carries zero or more :class:`Chan` objects: integer label tensors of the tensor's full shape
(usually stride-0 expanded views, so they cost no memory) whose entries are the ids. Replaying a movement op
(view, slice, cat, ...) on a label tensor gives the labels of its output, so layout changes need no handwritten
index loops.

A channel may also be *mixed*: a sum of terms ``coef_k * x[ids_k]`` with data coefficients (RoPE writes
``x * cos + rotate_half(x) * sin``). Mixed channels are resolved into a commutation constraint when consumed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

NO_ID = -1

# A size torch.export knows only at run time (the tokens routed to one expert: an unbacked symbol) gets this
# stand-in. Labels never vary along such an axis (the ops that create one pin channels that vary along it), so any
# size gives the same labels; above 1, so no rule takes the axis for a broadcast one.
STAND_IN_SIZE = 5


def concrete_shape(shape) -> tuple[int, ...]:
    """``shape`` with each size known only at run time replaced by :data:`STAND_IN_SIZE`."""
    return tuple(d if isinstance(d, int) else STAND_IN_SIZE for d in shape)


@dataclass(frozen=True)
class IdRange:
    """A contiguous block of ids allocated for one owner."""

    start: int
    size: int
    owner: str  # parameter name, or "" for ids that live only on activations (head blocks)
    axis: int = 0
    block: bool = False  # a head index (permutable only), not a vector coordinate


class IdSpace:
    """Allocates coordinate ids and remembers who owns each range."""

    def __init__(self):
        self.ranges: list[IdRange] = []
        self.next = 0
        self._starts = np.zeros(0, dtype=np.int64)  # each range's first id, extended as ranges are allocated

    def allocate(self, size: int, owner: str = "", axis: int = 0, block: bool = False) -> torch.Tensor:
        rng = IdRange(self.next, size, owner, axis, block)
        self.ranges.append(rng)
        self.next += size
        return torch.arange(rng.start, rng.start + size, dtype=torch.int64)

    def range_index(self, ids: np.ndarray) -> np.ndarray:
        """The index in :attr:`ranges` of the range holding each of ``ids`` (all valid ids)."""
        if len(self._starts) < len(self.ranges):
            self._starts = np.array([r.start for r in self.ranges], dtype=np.int64)
        return np.searchsorted(self._starts, ids, side="right") - 1

    def param_mask(self) -> np.ndarray:
        """Ids that index a parameter axis (not head blocks, not activation-only ids)."""
        mask = np.zeros(self.next, dtype=bool)
        for r in self.ranges:
            if r.owner and not r.block:
                mask[r.start:r.start + r.size] = True
        return mask

    def block_mask(self) -> np.ndarray:
        mask = np.zeros(self.next, dtype=bool)
        for r in self.ranges:
            if r.block:
                mask[r.start:r.start + r.size] = True
        return mask


@dataclass(frozen=True)
class Term:
    ids: torch.Tensor
    coef: torch.Tensor | None  # None means 1
    # which tensor each position reads (tags, the ids' shape; None: all one tensor). ``x + f(x)`` carries x's ids
    # but is another tensor: a rotation pairing a coordinate of x with one of it is no map of one tensor
    src: torch.Tensor | None = None


@dataclass(frozen=True)
class Chan:
    """One labelled structure on a tensor. ``terms`` has one entry unless the channel is mixed."""

    terms: tuple[Term, ...]
    degree: int = 1  # 2 after squaring: only reductions may consume it as such
    block: bool = False  # carries head-block ids (heads of an attention op), not coordinates
    weight: bool = False  # read straight from a parameter (through movement ops only): a weight vector
    # a weight vector known to hold one number in every entry (a folded norm's weight: 1, or 0 where the model
    # multiplies by 1 + w): a product with it scales every coordinate alike
    uniform: bool = False
    # a constant factor on the values of a channel that is not mixed (2 * x, x / 2; one per position where pieces
    # scaled apart were joined), None for 1: no transformation of the coordinates sees it, but a later sum of terms
    # does (``x0 * c - 2 * x1 * s`` is no rotation). Mixed channels hold it in their terms' coefficients
    factor: torch.Tensor | None = None

    @staticmethod
    def clean(ids: torch.Tensor, *, block: bool = False) -> "Chan":
        return Chan((Term(ids, None),), block=block)

    @property
    def ids(self) -> torch.Tensor:
        return self.terms[0].ids

    @property
    def mixed(self) -> bool:
        return len(self.terms) > 1 or self.terms[0].coef is not None

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    def map(self, fn) -> "Chan":
        """Apply a movement op to every label and coefficient tensor."""
        terms = tuple(Term(fn(t.ids), None if t.coef is None else fn(t.coef), None if t.src is None else fn(t.src))
                      for t in self.terms)
        return replace(self, terms=terms, factor=None if self.factor is None else fn(self.factor))

    def scaled(self, coef: torch.Tensor | float) -> "Chan":
        """The channel times ``coef`` as a mixed one: the coefficient (and the factor) on every term."""
        return replace(self, terms=tuple(replace(t, coef=_times(self.coef(k), coef)) for k, t in enumerate(self.terms)),
                       factor=None)

    def read_from(self, tag: int) -> "Chan":
        """The channel as read from another tensor, tagged ``tag``, at every position of every term."""
        return replace(self, terms=tuple(replace(t, src=torch.tensor(tag).expand(t.ids.shape)) for t in self.terms))

    def times(self, coef: torch.Tensor | float) -> "Chan":
        """A channel that is not mixed times ``coef``, the same for all its coordinates: a factor."""
        factor = _times(torch.as_tensor(coef, dtype=torch.float64), self.factor).expand(self.ids.shape)
        return replace(self, factor=None if bool((collapse(factor) == 1).all()) else factor)

    def coef(self, k: int) -> torch.Tensor:
        """Term ``k``'s coefficient, the factor included (broadcastable to the labels' shape)."""
        return _times(self.terms[k].coef, self.factor)

    def broadcast_to(self, shape) -> "Chan":
        return self.map(lambda t: t.expand(shape) if t.dim() else t.reshape([1] * len(shape)).expand(shape))


def _times(a: torch.Tensor | float | None, b: torch.Tensor | float | None) -> torch.Tensor:
    """``a * b`` in float64, None read as 1; broadcasts stay broadcasts (no copy over the axes both repeat)."""
    a, b = (torch.as_tensor(1.0 if x is None else x, dtype=torch.float64) for x in (a, b))
    x, y = collapse_pair(a, b)
    return (x * y).expand(torch.broadcast_shapes(a.shape, b.shape))


def param_channels(ids_per_axis: dict[int, torch.Tensor], shape: tuple[int, ...],
                   uniform: bool = False) -> list[Chan]:
    """Channels of a parameter: axis ``a`` carries ids that vary along ``a`` only. ``uniform``: its entries are
    known to be one number."""
    chans = []
    for axis, ids in ids_per_axis.items():
        view = [1] * len(shape)
        view[axis] = shape[axis]
        chans.append(Chan((Term(ids.reshape(view).expand(shape), None),), weight=True, uniform=uniform))
    return chans


def collapse(t: torch.Tensor, keep: frozenset[int] = frozenset()) -> torch.Tensor:
    """``t`` with every stride-0 axis (a broadcast) cut to size 1, except ``keep``: same labels, no copies.

    Label tensors are mostly broadcasts (a weight row id repeated over batch and sequence, an embedding column
    over 128k vocabulary rows); everything that reads them goes through here before flattening.
    """
    index = tuple(slice(0, 1) if t.stride(a) == 0 and a not in keep else slice(None) for a in range(t.dim()))
    return t[index]


def dropped_ids(given: list[Chan], kept: list[Chan]) -> torch.Tensor:
    """The ids the channels ``given`` carry that none of ``kept`` (a movement's result channels) still carries."""
    ids = [collapse(t.ids).reshape(-1) for c in given for t in c.terms]
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    left = [collapse(t.ids).reshape(-1) for c in kept for t in c.terms]
    ids = torch.unique(torch.cat(ids))
    dropped = ids[~torch.isin(ids, torch.cat(left))] if left else ids
    return dropped[dropped >= 0]


def collapse_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcast ``a`` and ``b`` together, then cut the axes along which both are broadcasts."""
    a, b = torch.broadcast_tensors(a, b)
    shared = tuple(slice(0, 1) if a.stride(x) == 0 and b.stride(x) == 0 else slice(None) for x in range(a.dim()))
    return a[shared], b[shared]


def orders_differ(coords: np.ndarray, keys: np.ndarray) -> bool:
    """Whether coordinates found at several positions meet ``keys`` there in different orders.

    ``coords[i]`` is the coordinate at position ``i`` (positions in order; negative: none) and ``keys[i]`` what it
    meets there (a partner's id, the rank of the input position a movement took it from). A group pairs the k-th
    position of one coordinate with the k-th of another (a channel permutation moves a flattened channel's entries
    as one block), which is right only while every coordinate, read in position order, ranks its keys alike: a
    roll across a flattened channel axis, or a weight whose columns were shuffled, breaks it.
    """
    keep = coords >= 0
    coords, keys = coords[keep], keys[keep]
    _, inv, counts = np.unique(coords, return_inverse=True, return_counts=True)
    several = counts[inv] > 1
    if not several.any():
        return False
    order = np.argsort(inv[several], kind="stable")  # grouped by coordinate, positions in order
    inv, keys = inv[several][order], keys[several][order]
    by_key = np.lexsort((keys, inv))
    first = np.r_[True, inv[by_key][1:] != inv[by_key][:-1]]
    dense = np.cumsum(np.r_[True, first[1:] | (keys[by_key][1:] != keys[by_key][:-1])])
    rank = np.empty_like(dense)
    rank[by_key] = dense - dense[np.flatnonzero(first)][np.cumsum(first) - 1]  # dense rank within the coordinate
    starts = np.flatnonzero(np.r_[True, inv[1:] != inv[:-1]])
    lengths = np.diff(np.r_[starts, len(inv)])
    for n in np.unique(lengths):
        rows = rank[starts[lengths == n][:, None] + np.arange(n)]
        if (rows != rows[0]).any():
            return True
    return False


def varying_axes(t: torch.Tensor) -> frozenset[int]:
    """Axes along which ``t`` is not constant (stride-0 and size-1 axes are skipped without reading data)."""
    small = collapse(t)
    out = set()
    for axis in range(small.dim()):
        if small.shape[axis] <= 1:
            continue
        if not bool((small == small.narrow(axis, 0, 1)).all()):
            out.add(axis)
    return frozenset(out)


def labelled_axes(t: torch.Tensor) -> frozenset[int]:
    """Axes along which ``t`` holds more than one id, :data:`NO_ID` entries skipped: the axes a channel varies
    along where it labels positions (a buffer's rows written by other tensors carry no id of it)."""
    small = collapse(t)
    low = torch.where(small == NO_ID, torch.iinfo(small.dtype).max, small)
    return frozenset(a for a in range(small.dim()) if small.shape[a] > 1 and bool((small.amax(a) > low.amin(a)).any()))


def chan_axes(chan: Chan) -> frozenset[int]:
    axes = set()
    for term in chan.terms:
        axes |= varying_axes(term.ids)
    return frozenset(axes)


def one_coordinate(c: Chan) -> int | None:
    """The id of the one coordinate a plain channel labels at every position (none of its axes varies), else None."""
    if c.block or c.mixed or c.degree != 1:
        return None
    ids = collapse(c.ids).reshape(-1)  # one pass over the entries: every sum and contraction asks, channel by channel
    if not len(ids) or int(ids[0]) < 0 or not bool((ids == ids[0]).all()):
        return None
    return int(ids[0])


def by_one_coordinate(chans: list[Chan]) -> dict[int, list[int]]:
    """The indices of ``chans`` that label one coordinate everywhere (:func:`one_coordinate`), by its id."""
    index: dict[int, list[int]] = {}
    for j, c in enumerate(chans):
        coordinate = one_coordinate(c)
        if coordinate is not None:
            index.setdefault(coordinate, []).append(j)
    return index


def without_pinned_repeats(chans: list[Chan], pinned: set[int]) -> list[Chan]:
    """``chans`` with each plain channel of one pinned coordinate kept once: its copies tie and restrict only that
    coordinate, which no group moves, so they add nothing but work (Funnel carried one such coordinate 50 times)."""
    if len(chans) < 2 or not pinned:
        return chans
    kept, seen = [], set()
    for c in chans:
        if c.factor is None and c.terms[0].src is None:
            coordinate = one_coordinate(c)
            if coordinate is not None and coordinate in pinned:
                key = (coordinate, c.weight, c.uniform, tuple(c.ids.shape))
                if key in seen:
                    continue
                seen.add(key)
        kept.append(c)
    return kept


def unique_rows(ids: torch.Tensor, axes: list[int]) -> torch.Tensor:
    """Distinct label vectors along ``axes`` (moved last and flattened), over every other position."""
    ids = collapse(ids, keep=frozenset(axes))
    rest = [a for a in range(ids.dim()) if a not in axes]
    moved = ids.permute(*rest, *axes)
    width = int(np.prod([ids.shape[a] for a in axes])) if axes else 1
    rows = moved.reshape(-1, width)
    return torch.unique(rows, dim=0) if rows.shape[0] > 1 else rows


def ids_along(ids: torch.Tensor, axis: int) -> torch.Tensor:
    """The labels along ``axis`` (at index 0 of every other axis)."""
    return ids[tuple(slice(None) if a == axis else 0 for a in range(ids.dim()))]


def data_varies(value, axes: frozenset[int], out_shape) -> bool:
    """Whether a data operand varies along any of ``axes`` of the broadcast output (unknown data: yes)."""
    if value is None:
        return True
    if not isinstance(value, torch.Tensor):
        return False  # a Python scalar
    if value.dim() == 0:
        return False
    full = value.expand(out_shape) if tuple(value.shape) != tuple(out_shape) else value
    return bool(varying_axes(full) & axes)


def slices_are_whole_spaces(ids: IdSpace, c: Chan, summed: frozenset[int]) -> bool:
    """Whether each slice of ``c`` along the one summed axis holds every coordinate of one space, alone (experts'
    outputs stacked, then summed; a weight per slice allowed): a sum of those slices, as ``add`` sums tensors,
    rather than a statistic of coordinates (a sum over a head's own coordinates, or over one coordinate of each
    head, holds part of a space per slice)."""
    if len(summed) != 1 or c.block or c.degree != 1 or len(c.terms) != 1:
        return False
    axis, labels = next(iter(summed)), collapse(c.ids)
    kept = chan_axes(c) - summed
    coef = c.terms[0].coef
    if not kept or (coef is not None and data_varies(coef, kept, c.ids.shape)):
        return False
    for e in range(labels.shape[axis]):
        held = torch.unique(labels.select(axis, e)).numpy()
        if held.size == 0 or held[0] < 0:
            return False
        r = ids.ranges[int(ids.range_index(held[:1])[0])]
        if r.block or held.size != r.size or held[0] != r.start or held[-1] != r.start + r.size - 1:
            return False
    return True


def chans_with_terms(chans: list[Chan], fn) -> list[Chan]:
    return [c.map(fn) for c in chans]


@dataclass
class Value:
    """The analysis state of one tensor: its channels, and its data value when it depends on no parameter."""

    chans: list[Chan] = field(default_factory=list)
    data: object = None  # torch.Tensor, Python scalar, or None when unknown
    shape: tuple[int, ...] | None = None
    invariant: bool = False  # derived from channels but unchanged by every allowed transformation (norms)
    # for an invariant value reduced from a channel that still varies along kept axes (a per-head norm): the id
    # of the coordinate row each element was computed from, so it moves with exactly those rows
    follows: torch.Tensor | None = None
    points_to: torch.Tensor | None = None  # integer data indexing a labelled axis (top-k indices): that axis' ids
    constant_axes: frozenset[int] = frozenset()  # axes along which the values are known not to vary (expanded)
    complex: bool = False  # complex values, labelled by their real view (a trailing axis: real, imaginary part)
    # for an invariant value without channels: positions with equal entries hold equal values (analysis/classes.py)
    classes: torch.Tensor | None = None
