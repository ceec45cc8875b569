"""In-place ops: when the graph proves one can be read as a plain function of its inputs, and what it writes.

torch.export keeps in-place ops (``q.clamp_(-c, c)``, ``buf[..., :8].copy_(x)``), while the walker keeps one value
per node: a node that reads the written storage under an older name would see stale labels. Two forms are proven
safe from the graph alone; any other in-place op pins what it touches:

* the op overwrites a fresh tensor (the output of an op that aliases none of its inputs) that nothing else reads
  after it (readers before it copied what they read: ``x += attn(norm(x))``): it is its functional twin;
* the op writes through a chain of views (slice, select, ...) into a fresh tensor, each view read by the next link
  only, the op's own result unused, and every other reader of the tensor comes after the write (or is another such
  write): the tensor's written positions then carry the op's labels (DeepSeek's ``new_empty`` key buffer filled by
  two ``copy_`` calls is a concatenation).

The written labels join the tensor's channels by the axes they vary along, as a concatenation's operands do. What a
write leaves along an axis it cuts keeps its coordinates only where every write into the tensor lands at the same
place at every probe shape: ``buf[:, :n] = x`` over a cloned table leaves rows that depend on ``n``.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch import fx

from .labels import Chan, Term, Value, concrete_shape, labelled_axes, varying_axes


@dataclass(frozen=True)
class Write:
    """Where an in-place op's result goes: ``base`` (a fresh tensor) at ``positions`` (flat indices into it, in
    the order of the written view's elements); no base when the op overwrites its whole, unread input."""

    base: fx.Node | None = None
    positions: torch.Tensor | None = None


def mutated_argument(node: fx.Node) -> fx.Node | None:
    """The tensor an ATen op writes into (its first argument, when the schema marks it written), else None."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments:
        return None
    alias = schema.arguments[0].alias_info
    return node.args[0] if alias is not None and alias.is_write and isinstance(node.args[0], fx.Node) else None


def plan_write(node: fx.Node, order: dict[fx.Node, int], last_write: dict[fx.Node, int], data: dict) -> Write | None:
    """How the walker may read in-place ``node`` (see the module docstring); None when the graph does not prove
    it safe. ``order``: each node's position in the graph; ``last_write``: per base, the position of its latest
    write so far; ``data``: concrete values of data nodes (sizes a view reads)."""
    target = mutated_argument(node)
    chain = _view_chain(target, order)
    if chain is None:
        return None
    base, views = chain
    if not views:
        return Write() if _read_before_only(base, node, order) else None
    if node.users or any(order[v] < last_write.get(base, -1) for v in views):
        return None
    if not all(_sees_the_write(u, order, order[node]) for u in base.users if u is not views[0]):
        return None
    positions = _positions(base, views, data)
    if positions is None or len(torch.unique(positions)) != positions.numel():
        return None
    return Write(base, positions)


def written(base: Value, base_shape, wrote: Value, positions: torch.Tensor) -> Value | None:
    """``base`` with the labels of ``wrote`` (the written view's value) at ``positions``; None when a label kind
    cannot be rewritten position by position (squared channels, index pointers). A channel of ``wrote`` takes the
    place of the base's channel at its index, unless the two vary along disjoint axes of the base: then it joins
    the base's channel that varies along the same axes, or stands alone (register tokens, a parameter labelled on
    its token and coordinate axes, written into a buffer beside activations labelled on the coordinate axis)."""
    if base.points_to is not None or wrote.points_to is not None or wrote.shape is None:
        return None
    values = (base, wrote)
    if any(c.degree != 1 for v in values for c in v.chans):
        return None
    from .rules import _factored, _slot, slots_by_axes

    place = _Placing(tuple(base_shape), wrote.shape, positions)
    slots = slots_by_axes({id(base): [place.axes(c, None) for c in base.chans],
                           id(wrote): [place.axes(None, c) for c in wrote.chans]})
    chans = []
    for j in range(max((len(s) for s in slots.values()), default=0)):
        old, new = _slot(base, j, slots), _slot(wrote, j, slots)
        present = [c for c in (old, new) if c is not None]
        mixed = any(c.mixed for c in present)
        terms = [Term(place.labels(old, new, k, "ids"), place.labels(old, new, k, "coef") if mixed else None)
                 for k in range(max(len(c.terms) for c in present))]
        factor = place.labels(old, new, 0, "factor") \
            if not mixed and any(c.factor is not None for c in present) else None
        chans.append(_factored(Chan(tuple(terms), block=any(c.block for c in present)), factor))
    return Value(chans=chans, shape=tuple(base_shape))


@dataclass(frozen=True)
class _Placing:
    """A write of a view of shape ``wrote_shape`` at ``positions`` (flat indices) of a base of ``base_shape``."""

    base_shape: tuple
    wrote_shape: tuple
    positions: torch.Tensor

    def labels(self, old: Chan | None, new: Chan | None, k: int, what: str) -> torch.Tensor:
        """Term ``k``'s labels (coefficients, factors) of ``old`` (a base channel) with ``new``'s (a channel of the
        written view) at the written positions; -1 (0, 1) where either is absent."""
        from .rules import _term_tensor  # the labels (or coefficients) of one term, -1 (or 0) where absent

        out = _term_tensor(old, k, self.base_shape, what).expand(self.base_shape).reshape(-1).clone()
        out[self.positions] = _term_tensor(new, k, self.wrote_shape, what).expand(self.wrote_shape).reshape(-1)
        return out.reshape(self.base_shape)

    def axes(self, old: Chan | None, new: Chan | None) -> frozenset[int]:
        """The base's axes along which the channel (``old`` where the write leaves it, or ``new`` where it is
        written) varies where it labels positions."""
        chan = old if old is not None else new
        return frozenset().union(*(labelled_axes(self.labels(old, new, k, "ids")) for k in range(len(chan.terms))))


def pieces(base: Value, base_shape, wrote: Value, positions: torch.Tensor,
           across_cut: bool = False) -> list[torch.Tensor]:
    """The ids a write puts at ``positions`` and those the base keeps elsewhere: pieces that other ops computed
    (``z[..., :6] = shift(z)[..., :6]``, ``z.narrow(-1, 0, 6).mul_(2)``), kept apart as a concatenation's are.
    ``across_cut``: only the channels that vary along an axis the write cuts, whose coordinates where the write
    lands there tells apart (not activations' coordinates written at some rows of a buffer)."""
    mask = _mask(base_shape, positions)
    place, cut, kept = _Placing(tuple(base_shape), wrote.shape, positions), varying_axes(mask), ~mask.reshape(-1)

    def chosen(old: Chan | None, new: Chan | None) -> bool:
        return not across_cut or bool(place.axes(old, new) & cut)

    old = [t.ids.expand(tuple(base_shape)).reshape(-1)[kept] for c in base.chans if chosen(c, None) for t in c.terms]
    new = [t.ids.reshape(-1) for c in wrote.chans if chosen(None, c) for t in c.terms]
    return [torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64) for ids in (new, old)]


def shifted(base: Value, base_shape, positions: torch.Tensor) -> list[Chan]:
    """The channels of ``base`` that vary, where a write at ``positions`` leaves them, along an axis the write cuts
    (a cloned table whose first ``n`` rows activations overwrite): which of their labels survive depends on where
    the write lands, so they keep their coordinates only if it lands at the same place at every input shape."""
    place = _Placing(tuple(base_shape), tuple(positions.shape), positions)
    cut = varying_axes(_mask(base_shape, positions))
    return [c for c in base.chans if place.axes(c, None) & cut]


def why_write_moves(node: fx.Node, base_shape, positions: torch.Tensor, selections) -> str | None:
    """None when in-place ``node`` (writing ``positions`` of a base of ``base_shape``) writes the same places
    along the axes it cuts, of axes of the same sizes, in the graph traced at every probe shape of
    ``selections`` (:class:`~symgraph.analysis.selections.Selections`); otherwise the reason."""
    mask = _mask(base_shape, positions)
    cut = varying_axes(mask)
    line = tuple(slice(None) if a in cut else 0 for a in range(mask.dim()))

    def differs(other: fx.Node, probe) -> str | None:
        chain = _view_chain(mutated_argument(other), {n: i for i, n in enumerate(other.graph.nodes)})
        found = _positions(*chain, probe.values) if chain is not None else None
        if found is None:
            return "the positions the write reaches cannot be replayed"
        theirs = _mask(concrete_shape(chain[0].meta["val"].shape), found)
        if (theirs.dim() != mask.dim() or varying_axes(theirs) != cut
                or any(theirs.shape[a] != mask.shape[a] for a in cut) or not torch.equal(theirs[line], mask[line])):
            return "the write lands elsewhere"
        return None

    return selections.why_differs(node, differs)


def _mask(shape, positions: torch.Tensor) -> torch.Tensor:
    """True at the flat ``positions`` of a tensor of ``shape``."""
    mask = torch.zeros(math.prod(shape), dtype=torch.bool)
    mask[positions] = True
    return mask.reshape(tuple(shape))


def _view_chain(node: fx.Node | None, order: dict[fx.Node, int]) -> tuple[fx.Node, list[fx.Node]] | None:
    """The fresh tensor ``node`` is a view of and the views from it to ``node`` (base first); None when some link
    is not a view op read by the next link only, or the chain starts at a graph input or an aliasing op."""
    views = []
    while node is not None and _is_view(node):
        if views and len(node.users) != 1:
            return None
        views.append(node)
        node = node.args[0] if isinstance(node.args[0], fx.Node) else None
    if node is None or not _fresh(node, order):
        return None
    if views and len(views[0].users) != 1:
        return None
    return node, views[::-1]


def _fresh(node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """An op output that shares storage with no other tensor the graph reads: a non-aliasing op, or an in-place op
    on such an output that nothing reads after it (``h.relu_().mul_(v)``; ``x += a; x += b``)."""
    if node.op != "call_function":
        return False
    target = mutated_argument(node)
    if target is not None:
        return _read_before_only(target, node, order) and _fresh(target, order)
    return not aliases_input(node)


def _read_before_only(base: fx.Node, writer: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether every reader of ``base`` but ``writer`` (an in-place op on it) ran before the write and copied what
    it read: a later reader, or a view read later, would see the written storage under ``base``'s older labels."""
    return all(u is writer or (order[u] < order[writer] and not aliases_input(u)) for u in base.users)


def _is_view(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    first = schema.arguments[0].alias_info if schema.arguments else None
    return alias is not None and not alias.is_write and first is not None and not first.is_write


def aliases_input(node: fx.Node) -> bool:
    """Whether the op's output may share storage with an input (views, in-place ops, ``to`` without a cast)."""
    if node.target is operator.getitem:
        return aliases_input(node.args[0]) if isinstance(node.args[0], fx.Node) else True
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    return any(r.alias_info is not None for r in schema.returns)


def _sees_the_write(user: fx.Node, order: dict[fx.Node, int], at: int) -> bool:
    """A reader of the base that is consistent with the write at position ``at``: it comes later (and sees the
    written value), or it came before and copied what it read, or it is a view chain feeding another in-place op
    (checked when that write is planned)."""
    if order[user] > at or not aliases_input(user):
        return True
    node = user
    while _is_view(node) and len(node.users) == 1:
        node = next(iter(node.users))
    return node is not user and mutated_argument(node) is not None


def _positions(base: fx.Node, views: list[fx.Node], data: dict) -> torch.Tensor | None:
    """Flat indices of ``base`` that the last view of ``views`` reads, in its element order: the views replayed
    on ``arange`` (None when one cannot be replayed, e.g. a size known only at run time)."""
    val = base.meta.get("val")
    if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in val.shape):
        return None
    current: object = torch.arange(val.numel()).reshape(concrete_shape(val.shape))
    previous = base
    for view in views:
        def load(a, previous=previous, current=current):
            if a is previous:
                return current
            return data.get(a.name) if isinstance(a, fx.Node) else a

        try:
            current = view.target(*fx.node.map_aggregate(view.args, load), **fx.node.map_aggregate(view.kwargs, load))
        except (RuntimeError, TypeError, IndexError):
            return None
        previous = view
    return current.reshape(-1) if isinstance(current, torch.Tensor) else None
