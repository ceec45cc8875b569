"""Cuts (slice, select, narrow, split) and regroupings (a reshape that splits the axis, unfold) of an axis where
labelled positions sit beside unlabelled ones.

``torch.cat([x, tokens], 1)[:, 4:]`` of activations ``x`` of run-time length ``n`` and three learned tokens keeps
every token at ``n >= 4`` and cuts token 0 away at ``n = 3``: the positions of the tokens along the axis move with
the input's length, so a cut at fixed bounds keeps other tokens at another input shape, and a permutation of the
tokens is no symmetry. ``cat([tokens, x], 1)[:, :3]`` and ``cat([x, tokens], 1)[:, -3:]`` keep exactly the tokens
at every length. Which one a model does is read from the probe traces
(:meth:`~symgraph.analysis.selections.Selections.why_differs`): the movement ops that lead to the cut are replayed
there on *origin* tensors (which element of which tensor outside those ops each position came from; a tensor's
elements are told apart only along the axes its labels vary along, so an activation's rows are one origin), and
the labels the cut keeps at every probe shape, and at the shortest lengths the model takes (1 and 2: a chunk in
halves of ``cat([x, tokens])`` keeps every token in its second half until ``x`` is shorter than the tokens), must be
the ones it keeps at the traced shape, piece by piece for a split. A reshape that splits such an axis into rows
(pairs, windows) must likewise put the same labels in one row, at the same places, at every shape.
"""
from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..pattern import Pattern, parse_pattern
from ..spec import ContractSpec, aten_op, operand_names
from . import rules
from .contraction import expand_ellipsis, matmul_pattern
from .labels import NO_ID, Chan, Value, collapse, concrete_shape, labelled_axes, varying_axes
from .selections import Trace, selections_of


# rules whose output at a position reads its operands at that position only, along all but the axes they
# normalise (ops flagged `equivariant` in specs/ops.yaml do too)
_IN_PLACE_RULES = frozenset({"activation", "layer_norm"})
# rules that read positions as a contraction does: their operands, in the order of the pattern (attention's
# mask adds to the scores: it moves no position)
_READ_AS = {"attention": (("query", "key", "value"), "...td,...sd,...se->...te")}
_MOST_READS = 1 << 16  # origins read by one op's positions, all together, beyond which it is not followed


def moved_operands(node: fx.Node) -> list[fx.Node]:
    """The tensors a movement op moves: its first argument, or the tensors of a list there (cat, stack)."""
    first = node.args[0]
    return [a for a in first if isinstance(a, fx.Node)] if isinstance(first, (list, tuple)) else [first]


def beside_unlabelled(chan: Chan, axis: int, rank: int) -> bool:
    """Whether ``chan`` (of a tensor of ``rank`` axes) labels positions along ``axis`` with more than one id and
    leaves others unlabelled (tokens beside activations): where each id sits may depend on the input's shape. (A
    channel with one id along the axis, such as the tokens' coordinates beside rows written by activations, reads
    the same coordinates at whichever of those positions a cut keeps.)"""
    return any(axis - rank + t.ids.dim() in labelled_axes(t.ids) and bool((collapse(t.ids) == NO_ID).any())
               for t in chan.terms)


def why_cut_moves(w, node: fx.Node, chans: list[Chan], own_axes: bool = False) -> str | None:
    """None when movement op ``node`` keeps the same labels of ``chans`` (channels of its first operand) in the
    graph traced at every probe shape and at the shortest lengths; otherwise the reason. ``own_axes``: positions
    are told apart only along the axes the labels of ``chans`` vary along, not those of the operand's other
    channels (``table[:n][:, :2]`` asked about the table's columns keeps the same ones at every length, though
    rows the traced shape does not have)."""
    return _why_positions_move(w, node, chans, _Lookup.kept, "it keeps other labelled positions", own_axes=own_axes)


def why_regroup_moves(w, node: fx.Node, chans: list[Chan], outer: int, inner: tuple[int, ...]) -> str | None:
    """None when reshape ``node``, which splits an axis into output axes ``outer`` and ``inner`` (pairs of
    positions, windows), groups the labels of ``chans`` alike in the graph traced at every probe shape and at the
    shortest lengths: ``cat([x, tokens], 1).unflatten(1, (-1, 2))`` pairs tokens 1 and 2 when ``x`` has an odd
    length and tokens 0 and 1 when it has an even one; otherwise the reason."""
    return _why_positions_move(w, node, chans, lambda lookup, kept: lookup.arrangement(kept, outer, inner),
                               "it groups other labelled positions together", _same_arrangement)


def _same_arrangement(a: tuple, b: tuple) -> bool:
    """Whether two :meth:`_Lookup.arrangement` results group the labels alike. Places along an inner axis count
    only where it has the same size in both: an inner axis whose size follows the input's length (``(B * n, D)``
    viewed back as ``(B, n, D)``) is the labelled axis itself, and where a token sits along it moves with ``n``
    before any reshape (cuts along it are checked as cuts)."""
    (sizes_a, rows_a), (sizes_b, rows_b) = a, b
    fixed = [k for k, (m, n) in enumerate(zip(sizes_a, sizes_b)) if m == n]

    def rows(found):
        return frozenset(frozenset((label, tuple(place[k] for k in fixed)) for label, place in r) for r in found)

    return len(sizes_a) == len(sizes_b) and rows(rows_a) == rows(rows_b)


def _why_positions_move(w, node: fx.Node, chans: list[Chan], seen, change: str, same=operator.eq,
                        own_axes: bool = False) -> str | None:
    """None when ``seen(lookup, origins)`` (what ``node`` does with the labels of one term) is the same (``same``)
    in every probe trace as in the traced graph; otherwise the reason (``change`` when it differs)."""
    asked = _ids_of(chans) if own_axes else None
    cache = w.origins.setdefault(asked, {})  # origins told apart along the axes of the ids asked about (None: all)
    offsets = cache.setdefault("offsets", {})
    traced = cache.get(None) or cache.setdefault(None, _Origins(w, w.data, lambda n: n, offsets, asked))
    source, kept = traced.of(moved_operands(node)[0]), traced.of(node)
    if source is None or kept is None:
        return "the positions it keeps cannot be replayed"
    lookups = [_Lookup(source, t.ids) for c in chans for t in c.terms]
    if any(lk.conflicting for lk in lookups):
        return "one position carries two labels"
    expected = [seen(lk, kept) for lk in lookups]
    selections = selections_of(w.cap)

    def differs(other: fx.Node, probe: Trace) -> str | None:
        if id(probe) not in cache:  # the probe kept with its origins, so that its id is not reused
            cache[id(probe)] = probe, _Origins(w, probe.values, lambda n: selections.traced.by_key.get(
                probe.key_of[n]), offsets, asked)
        origins = cache[id(probe)][1]
        found = origins.of(other)
        if found is None:
            return "the positions it keeps cannot be replayed"
        theirs = [seen(lk, found) for lk in lookups]
        if any(t is None for t in theirs):
            return "it keeps positions that the traced shape does not have there"
        if not all(same(t, e) for t, e in zip(theirs, expected)):
            return change
        return None

    return selections.why_differs(node, differs, shortest=True)


def _ids_of(chans: list[Chan]) -> frozenset[int]:
    return frozenset(i for c in chans for t in c.terms for i in collapse(t.ids).reshape(-1).tolist() if i != NO_ID)


def _distinct_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct pairs (a[i], b[i]), sorted by ``a`` then ``b``, as two tensors: ``torch.unique(dim=1)`` of
    the stacked pair, through one integer key per pair (unique along a dimension took 40 s of a YOLOS analysis)."""
    if not len(a):
        return a, b
    low_a, low_b = a.min(), b.min()
    span = b.max() - low_b + 1
    keys = torch.unique((a - low_a) * span + (b - low_b))
    return (keys // span + low_a).contiguous(), keys % span + low_b


class _Lookup:
    """The labels of one term at each origin of the cut's operand (origins sorted, for ``searchsorted``)."""

    def __init__(self, origins: torch.Tensor, ids: torch.Tensor):
        self.origins, self.ids = _distinct_pairs(*(t.reshape(-1) for t in torch.broadcast_tensors(origins, ids)))
        self.conflicting = bool((self.origins[1:] == self.origins[:-1]).any())

    def kept(self, kept) -> frozenset[int] | tuple | None:
        """The labels at origins ``kept`` (a tensor), or per piece of the list a split returns (a chunk in halves
        keeps every label, but in which half each is depends on the length); None when one is unknown."""
        if isinstance(kept, (list, tuple)):
            pieces = tuple(self.kept(k) for k in kept)
            return None if any(p is None for p in pieces) else pieces
        flat = torch.unique(kept.reshape(-1))
        if not len(self.origins):
            return None if len(flat) else frozenset()
        labels = self.labels(flat)
        return None if labels is None else frozenset(labels[labels != NO_ID].tolist())

    def labels(self, origins: torch.Tensor) -> torch.Tensor | None:
        """The label at each of ``origins`` (same shape); None when one is unknown."""
        if not len(self.origins):
            return None
        at = torch.searchsorted(self.origins, origins.contiguous()).clamp(max=len(self.origins) - 1)
        return self.ids[at] if bool((self.origins[at] == origins).all()) else None

    def arrangement(self, kept, outer: int, inner: tuple[int, ...]) -> tuple | None:
        """Which labels share a position along output axis ``outer``, and where each sits along ``inner``: the
        sizes of ``inner``, and a set of rows, each the (label, position along ``inner``) pairs at one position
        along ``outer`` (unordered: the rows themselves shift with the input's length); None when a label is
        unknown."""
        labels = self.labels(kept) if isinstance(kept, torch.Tensor) else None
        if labels is None:
            return None
        rest = [a for a in range(labels.dim()) if a != outer and a not in inner]
        grid = labels.permute(outer, *inner, *rest)
        grid = grid.reshape(*grid.shape[:1 + len(inner)], -1)
        where = (grid != NO_ID).nonzero()
        entries = torch.unique(torch.cat([where[:, :-1], grid[tuple(where.T)][:, None]], 1), dim=0).tolist()
        rows: dict[int, set] = {}
        for row, *place, label in entries:
            rows.setdefault(row, set()).add((label, tuple(place)))
        return tuple(labels.shape[a] for a in inner), frozenset(frozenset(r) for r in rows.values())


class _Origins:
    """Origin tensors of the nodes of one trace (the traced graph or a probe's): movement ops are replayed, any
    other node is a source whose elements are told apart along the axes its labels vary along at the traced shape
    (``traced_of`` maps a node to its counterpart in the traced graph; ``offsets``, the first origin of each source
    by its traced name, each combination of origins an op that keeps positions in place meets, and the next free
    one under ``""``, is shared by the traces, so the same source gets the same origins in all of them; ``asked``:
    the ids whose labels alone tell elements apart where a node carries some, None: all)."""

    def __init__(self, w, data: dict, traced_of, offsets: dict, asked: frozenset[int] | None = None):
        self.w, self.data, self.traced_of, self.offsets = w, data, traced_of, offsets
        self.asked = None if asked is None else torch.tensor(sorted(asked), dtype=torch.int64)
        self.done: dict[fx.Node, object] = {}

    def of(self, node: fx.Node):
        if node not in self.done:
            if self._moves(node):
                self.done[node] = self._replay(node)
            else:
                found = self._in_place(node) if len(self._label_axes(node)) > 1 else None
                self.done[node] = found if found is not None else self._source(node)
        return self.done[node]

    def _label_axes(self, node: fx.Node) -> list[int]:
        """The axes the labels of ``node``'s traced counterpart vary along (none where it has no value)."""
        traced = self.traced_of(node)
        value = self.w.value(traced) if traced is not None else None
        if not isinstance(value, Value) or value.shape is None:
            return []
        terms = [t for c in value.chans for t in c.terms]
        if self.asked is not None:  # a node with none of them (read by an op followed in place): all its labels
            terms = [t for t in terms if bool(torch.isin(collapse(t.ids), self.asked).any())] or terms
        return sorted({a for t in terms for a in varying_axes(t.ids.expand(value.shape))})

    def _moves(self, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            return self._moves(node.args[0])
        spec = self.w.spec(node)
        return spec is not None and spec.rule == "movement"

    def _in_place(self, node: fx.Node) -> torch.Tensor | None:
        """Origins of an op that keeps positions in place (elementwise maths, a norm over trailing axes, a
        contraction along its kept axes): one per combination of the origins each output position reads, so a
        class token keeps its place through the residual sums, norms and projections after it is joined to the
        stream; None for any other op, where one of those origins is unknown, or where it reads too many. Asked
        where labels vary along several axes (tokens told apart): elsewhere a source's origins tell as much."""
        spec, val, traced = self.w.spec(node), node.meta.get("val"), self.traced_of(node)
        if not isinstance(val, torch.Tensor) or traced is None:
            return None
        if getattr(spec, "equivariant", False) or getattr(spec, "rule", None) in _IN_PLACE_RULES:
            operands = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
            letters = None
        elif getattr(spec, "rule", None) in _READ_AS or isinstance(spec, ContractSpec) and spec.pattern != "einsum":
            names, text = _READ_AS.get(spec.rule) or (operand_names(spec, node.target), spec.pattern)
            named = [rules.schema_arg(node, name) for name in names]
            pattern = parse_pattern(text) if text != "matmul" else \
                matmul_pattern(*(len(a.meta["val"].shape) for a in named))
            letters = [p for p, a in zip(pattern.operands, named) if isinstance(a, fx.Node)]
            operands = [a for a in named if isinstance(a, fx.Node)]
        else:
            return None
        shape = tuple(concrete_shape(val.shape))
        shapes = [tuple(concrete_shape(a.meta["val"].shape)) for a in operands]
        if len(operands) * (math.prod(shape) if letters is None else _summed_size(letters, pattern.output, shapes)) \
                > _MOST_READS:
            return None  # known before its operands are followed
        found = [self.of(a) for a in operands]
        if not found or any(not isinstance(f, torch.Tensor) for f in found):
            return None
        table = _read_at(found, shape) if letters is None else _contracted(found, letters, pattern.output, shape)
        if table is None or table.numel() > _MOST_READS:
            return None
        # a position's origin: the set of origins it reads together, however many times (a sum over the tokens
        # reads each patch row's origin more often at a greater length, and no other)
        combos, inverse = torch.unique(table.reshape(-1, table.shape[-1]), dim=0, return_inverse=True)
        read = torch.tensor([self._origin_of((traced.name, *c)) for c in combos.tolist()], dtype=torch.int64)
        read = read[inverse].reshape(table.shape[:-1]).sort(1).values
        read[:, 1:][read[:, 1:] == read[:, :-1]] = -1
        sets, inverse = torch.unique(read.sort(1).values, dim=0, return_inverse=True)
        codes = [self._origin_of((traced.name, frozenset(c for c in row if c >= 0))) for row in sets.tolist()]
        return torch.tensor(codes, dtype=torch.int64)[inverse].reshape(shape)

    def _origin_of(self, key) -> int:
        """The origin given to ``key`` in every trace (the next free one the first time)."""
        if key not in self.offsets:
            self.offsets[key] = self.offsets.get("", 0)
            self.offsets[""] = self.offsets[key] + 1
        return self.offsets[key]

    def _replay(self, node: fx.Node):
        if node.target is operator.getitem:
            container = self.of(node.args[0])
            return None if container is None else container[node.args[1]]
        moved, missing = set(moved_operands(node)), []

        def load(a):
            if not isinstance(a, fx.Node):
                return a
            value = self.of(a) if a in moved else self.data.get(a.name)
            if value is None:
                missing.append(a)
            return value

        args, kwargs = fx.node.map_aggregate(node.args, load), fx.node.map_aggregate(node.kwargs, load)
        if missing:
            return None
        try:
            return node.target(*args, **kwargs)
        except RuntimeError:
            spec = self.w.spec(node)
            return aten_op(spec.replay_as)(*args, **kwargs) if spec.replay_as else None

    def _source(self, node: fx.Node) -> torch.Tensor | None:
        val, traced = node.meta.get("val"), self.traced_of(node)
        value = self.w.value(traced) if traced is not None else None
        if not isinstance(val, torch.Tensor) or value is None or value.shape is None:
            return None
        shape, axes = concrete_shape(val.shape), self._label_axes(node)
        if len(shape) != len(value.shape) or any(shape[a] != value.shape[a] for a in axes):
            return None  # labels vary along an axis of another size here: no evidence
        view = [shape[a] if a in axes else 1 for a in range(len(shape))]
        if traced.name not in self.offsets:  # after every origin given out so far, in either trace
            self.offsets[traced.name] = self.offsets.get("", 0)
            self.offsets[""] = self.offsets[traced.name] + math.prod(view)
        start = self.offsets[traced.name]
        return (torch.arange(math.prod(view), dtype=torch.int64) + start).reshape(view).expand(shape)


def _read_at(origins: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """The origins each position of an output of ``shape`` reads (positions x 1 x operands), of operands
    broadcast to it (None where they do not broadcast to that shape)."""
    try:
        found = torch.broadcast_tensors(*origins)
    except RuntimeError:
        return None
    if tuple(found[0].shape) != shape:
        return None
    return torch.stack([f.reshape(-1, 1) for f in found], 2)


def _summed_size(letters: list[str], output: str, shapes: list[tuple[int, ...]]) -> int:
    """The number of (output position, summed position) pairs of a contraction of operands of ``shapes``."""
    explicit, _ = expand_ellipsis(Pattern(tuple(letters), output), shapes)
    return math.prod({letter: n for e, sh in zip(explicit, shapes) for letter, n in zip(e, sh)}.values())


def _contracted(origins: list[torch.Tensor], letters: list[str], output: str,
                shape: tuple[int, ...]) -> torch.Tensor | None:
    """The origins each position of a contraction's output (``letters``, ``output``: its pattern) reads together
    (positions x summed positions x operands)."""
    explicit, out = expand_ellipsis(Pattern(tuple(letters), output), [tuple(o.shape) for o in origins])
    if any(len(set(e)) != len(e) for e in explicit):
        return None  # a diagonal
    sizes: dict[str, int] = {}
    for e, o in zip(explicit, origins):
        for letter, n in zip(e, o.shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    order = list(out) + sorted(set("".join(explicit)) - set(out))
    if tuple(sizes[letter] for letter in out) != shape:
        return None
    rows = []
    for e, o in zip(explicit, origins):
        moved = o.permute([e.index(letter) for letter in order if letter in e])
        moved = moved.reshape([o.shape[e.index(letter)] if letter in e else 1 for letter in order])
        try:
            rows.append(moved.expand([sizes[letter] for letter in order]).reshape(math.prod(shape), -1))
        except RuntimeError:  # sizes that do not broadcast
            return None
    return torch.stack(rows, 2)
