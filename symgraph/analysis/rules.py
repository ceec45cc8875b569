"""One handler per ``rule`` of specs/ops.yaml. Each takes the walker, the node and its spec, and returns the
node's :class:`Value` (or a list of them for multi-output ops)."""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import replace

import numpy as np
import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from .constraints import ORTHOGONAL, PRODUCT_FACTOR, PRODUCT_WEIGHT, Restriction, from_group_name, monomial
from ..pattern import parse_pattern
from ..spec import MapSpec, MovementSpec, aten_op, operand_names
from .centring import centred_input, is_centring_mean
from .classes import blocks_kept_by
from .contraction import NEUTRAL, Contraction, Operand, expand_ellipsis, matmul_pattern, tie_slices
from .cuts import beside_unlabelled, moved_operands, why_cut_moves, why_regroup_moves
from .labels import (NO_ID, STAND_IN_SIZE, Chan, Term, Value, chan_axes, collapse, collapse_pair, concrete_shape,
                     by_one_coordinate, data_varies, dropped_ids, ids_along, labelled_axes, orders_differ,
                     slices_are_whole_spaces, one_coordinate, unique_rows, varying_axes)
from .naming import role
from .recurrent import rule_recurrent  # noqa: F401  (handlers are found by name: rule_<rule>)
from .selections import selections_of


# -- movement ---------------------------------------------------------------------------------------------
def _pointers_into_one_axis(moved: list[Value | None]) -> bool:
    """Whether every moved operand is indices into one labelled axis and nothing else: their entries, however
    rearranged, still point into it."""
    return bool(moved) and all(v is not None and v.points_to is not None and not v.chans for v in moved) and all(
        torch.equal(v.points_to, moved[0].points_to) for v in moved[1:])


def rule_movement(w, node: fx.Node, spec) -> Value | list[Value]:
    """Replay the op on label (and coefficient) tensors; every channel of every operand moves alike."""
    moved = [w.value(a) for a in moved_operands(node)]
    if _pointers_into_one_axis(moved):  # PhiMoE: cat of its two picks' indices
        return _like(node, lambda k: Value(points_to=moved[0].points_to, shape=_shape_of(node, k)))
    if spec.broadcasts and len(moved) == 1 and moved[0] is not None and moved[0].invariant and not moved[0].chans:
        # a norm expanded to its input's shape (F.normalize: expand_as, then divide): still invariant, and known
        # not to vary along the axes the expand repeats it
        return Value(invariant=True, shape=_shape_of(node), follows=moved[0].follows,
                     constant_axes=repeated_axes(node, spec, moved[0]))
    if any(v is not None and v.points_to is not None for v in moved):
        return _pin_moved(w, node, "indices moved together with other tensors")
    if _indexed_by_unknown(w, node) or (spec.cuts and _cut_at_run_time(node)):
        return _pick_unknown_rows(w, node)
    for a in index_operands(node, "movement"):  # known indices laid out along coordinates: not followed here
        _pin_value(w, node, w.value(a), "indices laid out along coordinates, read by an op that does not follow them")
    if spec.along is not None and any(len(_node_shape(a) or ()) <= spec.along for a in moved_operands(node)):
        return _pin_moved(w, node, f"pieces with {spec.along} axes or fewer, reshaped before they are joined")
    if spec.concatenates:
        joined = _cat_along_data_axis(w, node, spec)
        if joined is not None:
            return joined
        _separate_unlike_pieces(w, node, spec)
        _pin_beside_bare_pieces(w, node, spec)
    if spec.stacks:
        _separate_unlike_pieces(w, node, spec)
    tensors = [w.value(a) for a in moved_operands(node)]
    slots = _channel_slots(tensors, len(_node_shape(node) or ()))
    n_chans = max(len(order) for order in slots.values())
    guessed = _axes_chosen_by_unknown_indices(w, node)
    if spec.cuts:
        _pin_moving_cut(w, node, tensors[0])
    if spec.regroups:
        _pin_moving_regroup(w, node, tensors[0])
    if spec.shifts:
        _pin_moving_shift(w, node, tensors[0])
    results = []
    for j in range(n_chans):
        moved = [c for v in tensors if (c := _slot(v, j, slots)) is not None]
        if any(chan_axes(c) & guessed for c in moved):  # replay would invent positions (MoE routing by top-k)
            for c in moved:
                for t in c.terms:
                    w.c.pin(t.ids, "positions chosen by indices whose values depend on parameters", node.name)
            continue
        kept = _align_joined_terms(w, node, j, slots) if spec.concatenates or spec.stacks else {}
        try:
            results.append(_move_channel(w, node, j, spec, slots))
            if isinstance(results[-1], Chan) and _reorders(w, node, spec, j, slots, results[-1]):
                _pin_chan(w, node, results[-1], "its positions are reordered unlike other coordinates' (a roll or "
                          "transpose across a flattened channel axis)")
        except RuntimeError:  # a run-time size merged with other axes: the stand-in does not fit, never guess
            if not any(_run_time_size(a) for a in node.all_input_nodes):
                raise
            return _pin_moved(w, node, "reshaped by a size known only at run time, merged with other axes")
        finally:
            w.values.update(kept)
    if results and isinstance(results[0], list):
        return [Value(chans=_labelling([r[k] for r in results if r[k] is not None]), shape=_shape_of(node, k))
                for k in range(len(results[0]))]
    if _indexed_by_data(node):
        _pin_unselected(w, node, tensors, results)
    if spec.cuts:
        w.note_cut(node, tensors[0], [r for r in results if r is not None])
    return Value(chans=_labelling([r for r in results if r is not None]), shape=_shape_of(node),
                 constant_axes=_constant_axes_after(w, node, spec, tensors))


def _labelling(chans: list[Chan]) -> list[Chan]:
    """``chans`` less those a cut left without any id (the register tokens' own axis on the patch tokens cut from
    the stream), while others remain: nothing pairs with them, so every sum would carry both operands' copies on
    (GroupViT's group tokens: thousands of channels, doubling with every block)."""
    return [c for c in chans if any(bool((collapse(t.ids) >= 0).any()) for t in c.terms)] or chans


def _pin_moving_cut(w, node: fx.Node, x: Value | None) -> None:
    """Pin the channels of ``x`` that label positions beside unlabelled ones along the axis ``node`` cuts, unless
    it keeps the same labels at every probe shape (analysis/cuts.py: ``cat([x, tokens], 1)[:, 4:]`` cuts token 0
    away when ``x`` has 3 rows)."""
    if x is None or x.shape is None:
        return
    dim = schema_arg(node, "dim") % len(x.shape)
    chans = [c for c in x.chans if beside_unlabelled(c, dim, len(x.shape))]
    why = why_cut_moves(w, node, chans) if chans else None
    for c in chans if why is not None else ():
        _pin_chan(w, node, c, f"cut where labelled positions may move with the input shape ({why})")


def _pin_moving_shift(w, node: fx.Node, x: Value | None) -> None:
    """Pin the channels of ``x`` that label positions along an axis ``node`` moves them along (a roll), unless it
    is given the same numbers at every probe shape: ``torch.roll(h, n, -1)`` puts unit ``u`` where the next layer
    reads column ``u + n``, which the traced length alone decides."""
    if x is None or x.shape is None:
        return
    rank = len(x.shape)
    dims = schema_arg(node, "dims", ())
    axes = {d % rank for d in dims} if dims else set(range(rank))  # no dims: a roll of the flattened tensor
    chans = [c for c in x.chans if any(a - rank + t.ids.dim() in labelled_axes(t.ids) for a in axes for t in c.terms)]
    if not chans:
        return
    why = selections_of(w.cap).why_differs(node, lambda other, probe: None if other.args[1:] == node.args[1:]
                                           else "its shifts differ")
    for c in chans if why is not None else ():
        _pin_chan(w, node, c, f"rolled by shifts that may follow the input shape ({why})")


def _pin_moving_regroup(w, node: fx.Node, x: Value | None) -> None:
    """Pin the channels of ``x`` that label positions beside unlabelled ones along an axis ``node`` splits into
    rows (a reshape into pairs or windows, unfold), unless the same labels share a row, at the same places, at
    every probe shape (analysis/cuts.py: ``cat([x, tokens], 1).unflatten(1, (-1, 2))`` pairs other tokens when
    the length of ``x`` changes parity)."""
    out_shape = _shape_of(node)
    if x is None or x.shape is None or out_shape is None:
        return
    for axis, outer, inner in _split_axes(node, tuple(x.shape), out_shape):
        chans = [c for c in x.chans if beside_unlabelled(c, axis, len(x.shape))]
        why = why_regroup_moves(w, node, chans, outer, inner) if chans else None
        for c in chans if why is not None else ():
            _pin_chan(w, node, c, f"split into rows where labelled positions may move with the input shape ({why})")


def _split_axes(node: fx.Node, in_shape: tuple, out_shape: tuple) -> list[tuple[int, int, tuple[int, ...]]]:
    """``(input axis, outer output axis, inner output axes)`` for each input axis that ``node`` splits into more
    than one output axis of size above 1: unfold's windows (the dimension, and the window axis it appends), or a
    reshape's runs of axes with equal products (an axis merged and split at once counts as split)."""
    if node.target == aten_op("aten.unfold.default"):
        dim = node.args[1] % max(len(in_shape), 1)
        return [(dim, dim, (len(out_shape) - 1,))]
    splits, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        ins, outs, p, q = [i], [j], in_shape[i], out_shape[j]
        while p != q and p and q:
            if p < q and i + 1 < len(in_shape):
                i += 1
                ins.append(i)
                p *= in_shape[i]
            elif j + 1 < len(out_shape):
                j += 1
                outs.append(j)
                q *= out_shape[j]
            else:
                break
        i, j = i + 1, j + 1
        rows = [o for o in outs if out_shape[o] > 1]
        splits += [(a, rows[0], tuple(rows[1:])) for a in ins if in_shape[a] > 1] if len(rows) > 1 else []
    return splits


def repeated_axes(node: fx.Node, spec, x: Value | None) -> frozenset[int]:
    """Output axes along which a broadcasting movement (expand, expand_as) repeats its input ``x``, so its values
    are known not to vary there; none for any other op."""
    if not getattr(spec, "broadcasts", False) or x is None:
        return frozenset()
    return _broadcast_axes(x.shape, _shape_of(node))


def _constant_axes_after(w, node: fx.Node, spec, tensors: list[Value | None]) -> frozenset[int]:
    """Output axes along which a movement of one operand keeps the values constant: those it repeats (an expand,
    ``repeat_interleave`` of a one-head axis into query heads) and those it carries over from axes its operand is
    known constant along (that expand, then a reshape). Found by replaying the op on a tensor that differs
    exactly where the operand may; asked only where the op repeats entries or the operand has such axes, and
    only where every other input is known."""
    repeated = repeated_axes(node, spec, tensors[0] if tensors else None)
    out_shape, moved = _shape_of(node), moved_operands(node)
    if len(tensors) != 1 or len(moved) != 1 or tensors[0] is None or tensors[0].shape is None or out_shape is None:
        return repeated
    x = tensors[0]
    if not x.constant_axes and math.prod(out_shape) <= math.prod(x.shape):
        return repeated
    probe = torch.arange(math.prod(x.shape), dtype=torch.int64).reshape(tuple(x.shape))
    for axis in x.constant_axes:
        probe = probe.narrow(axis, 0, 1).expand(probe.shape)

    def load(a):
        if a is moved[0]:
            return probe
        if isinstance(a, fx.Node):
            v = w.values.get(a.name)
            if not isinstance(v, Value) or v.chans or v.points_to is not None or v.data is None:
                raise LookupError(a.name)  # an input whose values are unknown here: claim nothing
            return v.data
        return a

    try:
        args, kwargs = fx.node.map_aggregate(node.args, load), fx.node.map_aggregate(node.kwargs, load)
        try:
            out = node.target(*args, **kwargs)
        except RuntimeError:
            if not spec.replay_as:
                raise
            out = aten_op(spec.replay_as)(*args, **kwargs)  # a view of the expanded probe: reshape copies
    except (LookupError, RuntimeError, TypeError, ValueError, IndexError):
        return repeated
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(out_shape):
        return repeated
    return repeated | (frozenset(range(out.dim())) - varying_axes(out))


def _broadcast_axes(in_shape, out_shape) -> frozenset[int]:
    """Output axes an expand fills by repeating the input (new leading axes, and size-1 axes grown)."""
    if in_shape is None or out_shape is None:
        return frozenset()
    shift = len(out_shape) - len(in_shape)
    return frozenset(a for a, n in enumerate(out_shape)
                     if n != 1 and (a < shift or in_shape[a - shift] == 1))


def _indexed_by_data(node: fx.Node) -> bool:
    """An index operand (gather, index_select, index.Tensor) whose values the analysis knows from the input."""
    moved = set(moved_operands(node))
    return any(isinstance(a.meta.get("val"), torch.Tensor) and not a.meta["val"].is_floating_point()
               for a in node.all_input_nodes if a not in moved)


def _pin_unselected(w, node: fx.Node, operands, results) -> None:
    """Pin what known indices choose from unless they are a fixed selection (the same at every probe shape, see
    analysis/selections.py: Falcon's ``fused_qkv[..., [-2], :]``), whose unselected coordinates are simply not
    read here. Indices computed from the input (ProphetNet's relative position buckets, ``torch.arange(n)``)
    select other positions at another input shape: what this one skips is not free, and what it selects may be
    skipped by a shorter input (a permutation of the units a sum reads is then no longer harmless)."""
    given = [c for v in operands if v is not None for c in v.chans]
    if not any(c.terms for c in given):
        return
    skipped = dropped_ids(given, [c for c in results if c is not None])
    axes = _indexed_axes_of(node, len(_node_shape(moved_operands(node)[0]) or ()))
    chosen = [c for v in operands if v is not None for c in v.chans if chan_axes(c) & axes]
    if not skipped.numel() and not chosen:
        return
    why = selections_of(w.cap).why_not_fixed(node, index_operands(node, "movement"), axes)
    if why is None:
        return
    if skipped.numel():
        w.c.pin(skipped, f"not selected by indices at the traced input shape ({why}); another input shape may "
                         "select it", node.name)
    for c in chosen:
        _pin_chan(w, node, c, f"chosen by indices that may choose other positions at another input shape ({why})")


def _cat_along_data_axis(w, node: fx.Node, spec) -> Value | None:
    """Concatenation along an axis no input channel varies along (a class token in front of patches): the
    pieces carry the same coordinates, so tie them instead of stacking two labellings along a data axis."""
    values = [w.value(a) for a in moved_operands(node)]
    out_shape = _shape_of(node)
    dim = _join_dim(node, spec) % len(out_shape)
    if any(_cut_from_labelled_axis(w, a, dim) for a in moved_operands(node)):
        return None  # a single head cut from the heads axis: one position of a labelled axis, not of a data axis
    values = [v for v in values if v is None or v.shape is None or not (_empty_piece(v.shape, dim) or _zeros(v))]
    if not values or any(v is None or len(v.chans) != len(values[0].chans) for v in values) or not values[0].chans:
        return None
    if any(dim in chan_axes(c) for v in values for c in v.chans):
        return None
    mixed = [j for j in range(len(values[0].chans)) if any(v.chans[j].mixed for v in values)]
    if mixed and not all(_terms_alike(values, j, dim) and _plain_pieces_unmoved(values, j, dim) for j in mixed):
        return _pin_moved(w, node, "pieces with mixed coordinates concatenated along a data axis")
    w.mark_read(values[1:])  # tied to the first piece's coordinates, which the output carries on
    chans = []
    for j, first in enumerate(values[0].chans):
        if j in mixed:  # DINOv3: rotated patch queries beside unrotated class ones
            chans.append(_joined_mixed(w, node, j, dim, out_shape))
            continue
        head = first.ids.narrow(dim, 0, 1)
        for v in values[1:]:
            w.c.tie(head.expand_as(v.chans[j].ids.narrow(dim, 0, 1)), v.chans[j].ids.narrow(dim, 0, 1),
                  node=node.name)
        chans.append(replace(first, terms=(Term(head.expand(out_shape), None),), factor=None))
    return Value(chans=chans, shape=out_shape)


def _terms_alike(values: list[Value], j: int, dim: int) -> bool:
    """Whether the mixed ones of the ``j``-th channels of ``values`` (pieces joined along the data axis ``dim``)
    read the same coordinates in each term they share: the joined maps are then one per position."""
    heads: dict[int, list[torch.Tensor]] = {}
    for v in values:
        if v.chans[j].mixed:
            for k, t in enumerate(v.chans[j].terms):
                heads.setdefault(k, []).append(t.ids.narrow(dim, 0, 1))
    return all(h.shape == hs[0].shape and bool((h == hs[0]).all()) for hs in heads.values() for h in hs[1:])


def _plain_pieces_unmoved(values: list[Value], j: int, dim: int) -> bool:
    """Whether the plain ones of the ``j``-th channels of ``values`` hold, at every entry, the coordinate the mixed
    pieces' first term reads there: the identity map, which :func:`_joined_mixed` gives them. A plain piece
    reordered (``prefix.flip(-1)``) or partly zero (``cat([prefix[..., :4], zeros])``) is another map."""
    first = next(v.chans[j] for v in values if v.chans[j].mixed).ids.narrow(dim, 0, 1)
    return all(bool((first >= 0).all()) and v.chans[j].ids.narrow(dim, 0, 1).shape == first.shape
               and bool((v.chans[j].ids.narrow(dim, 0, 1) == first).all()) for v in values if not v.chans[j].mixed)


def _joined_mixed(w, node: fx.Node, j: int, dim: int, out_shape) -> Chan:
    """The ``j``-th channel of pieces joined along the data axis ``dim``, some of them mixed (rotated patch tokens
    beside unrotated class tokens): term by term, the coordinates the mixed pieces' terms read, and each piece's
    coefficients at its own positions (1 on the only term of a plain piece, 0 on terms a piece lacks). The plain
    pieces' coordinates are tied to the mixed ones', as plain pieces are tied to each other."""
    pieces = []
    for a in moved_operands(node):  # empty and zero pieces too: they hold positions (a zero piece meets any map)
        v = w.value(a)
        shape = _node_shape(a)
        pieces.append((shape, v.chans[j] if v is not None and len(v.chans) > j and shape[dim] else None))
    mixed = [c for _, c in pieces if c is not None and c.mixed]
    for _, c in pieces:
        if c is not None and not c.mixed:
            w.c.tie(mixed[0].ids.narrow(dim, 0, 1).expand_as(c.ids.narrow(dim, 0, 1)), c.ids.narrow(dim, 0, 1),
                    node=node.name)
    terms = []
    for k in range(max(len(c.terms) for c in mixed)):
        ids = next(c.terms[k].ids for c in mixed if k < len(c.terms)).narrow(dim, 0, 1).expand(out_shape)
        terms.append(Term(ids, torch.cat([torch.broadcast_to(_coef(c, k), shape) for shape, c in pieces], dim)))
    return replace(mixed[0], terms=tuple(terms), factor=None)


def _coef(c: Chan | None, k: int) -> torch.Tensor:
    """The coefficient of ``c``'s ``k``-th term, its factor included: 1 on the only term of a plain piece, 0 on
    terms it lacks."""
    if c is None or k >= len(c.terms):
        return torch.tensor(float(k == 0), dtype=torch.float64)
    coef = c.coef(k)
    return torch.ones((), dtype=torch.float64) if coef is None else coef.to(torch.float64)


def _cut_from_labelled_axis(w, node: fx.Node, dim: int) -> bool:
    """Whether ``node`` is, through ops that keep its shape, a cut along ``dim`` of a value some channel of which
    varies along ``dim``: its positions there are coordinates or heads, however few (``q[:, :1] + 1``)."""
    shape = _node_shape(node)
    for _ in range(_PIECE_DEPTH):
        target = node.args[0] if node.target is operator.getitem else node
        if target.op != "call_function":
            return False
        if getattr(w.spec(target), "cuts", False):
            x = w.value(target.args[0])
            return x is not None and x.shape is not None and len(x.shape) == len(shape) and \
                schema_arg(target, "dim", 0) % len(shape) == dim and any(dim in chan_axes(c) for c in x.chans)
        node = next((a for a in target.all_input_nodes if _node_shape(a) == shape), None)
        if node is None or node.op != "call_function":
            return False
    return False


def _join_dim(node: fx.Node, spec) -> int:
    """The axis a cat or stack joins its pieces along: its ``dim``, or the spec's fixed ``along`` (hstack)."""
    return spec.along if spec.along is not None else schema_arg(node, "dim")


def _separate_unlike_pieces(w, node: fx.Node, spec) -> None:
    """Pieces of one tensor cut apart along a coordinate axis and joined again by ``node`` after different ops
    (``cat([h[..., :8] * 2, h[..., 8:]])``, rotary on some heads only) hold coordinates that no permutation may
    mix: a unit moved into the other piece would meet the other ops. Each op that treats a whole piece alike (a
    scalar factor) is equivariant there, so nothing else tells the pieces apart. The ops may also come before the
    cuts (``cat([(h * 2)[..., :8], h[..., 8:]])``, a token shift of some units only): the cuts then read different
    tensors carrying the same coordinates. Pieces computed by the same ops from their cuts are left alone; pieces
    of unrelated coordinates never share a class, so keeping them apart costs nothing."""
    pieces = moved_operands(node)
    dim = _join_dim(node, spec)
    values = [w.value(p) for p in pieces]
    if len(pieces) < 2 or any(v is None or v.shape is None for v in values):
        return
    dim %= len(values[0].shape)
    structures = ({}, {})
    if len({piece_structure(w, p, structures) for p in pieces}) == 1:
        return  # the same ops on every piece
    # a piece one position wide along ``dim`` (a single unit, a single head, any stacked piece) carries its
    # coordinates there too, though no channel varies along an axis of size 1
    ids = [torch.cat([collapse(t.ids).reshape(-1) for c in v.chans
                      if spec.stacks or dim in chan_axes(c) or v.shape[dim] == 1 for t in c.terms]
                     or [torch.zeros(0, dtype=torch.int64)]) for v in values]
    cuts = coordinate_cuts_before(w, pieces, torch.cat(ids))
    by_role = ({}, {})
    alike = len({piece_structure(w, p, by_role, roles=True) for p in pieces}) == 1
    w.c.separate_pieces(ids, node.name, (lambda: why_cuts_move(w, cuts)) if cuts else None, alike)
    labelled = [bool((i >= 0).any()) for i in ids]
    if any(labelled) and not all(labelled):  # beside a piece cut empty, or one whose coordinates were pinned
        edges = coordinate_cuts_before(w, pieces, None)
        if edges:
            w.c.beside_unlabelled.append((torch.cat(ids).numpy(), node.name, lambda: why_cuts_move(w, edges)))


def coordinate_cuts_before(w, nodes: list[fx.Node], ids: torch.Tensor | None) -> list[fx.Node]:
    """The cuts (slice, narrow, split) on the way up from ``nodes`` through labelled values, up to the first cut on
    each path, that dropped some of ``ids`` (the coordinates of pieces kept apart): where the pieces were cut
    apart. Their bounds are Python numbers the trace baked in, which the model may compute from the input's size
    (``h[..., :min(n, 6)]``). A cut that drops none of them (the class token taken off a sequence) decides
    nothing about which coordinate lies in which piece. No path is cut short: pieces may pass through any number
    of ops between their cut and their join. ``ids`` None: the cuts that dropped any coordinate."""
    wanted = None if ids is None else set(ids[ids >= 0].tolist())
    found, seen, todo = [], set(), list(nodes)
    while todo:
        node = todo.pop()
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        cut = node.args[0] if node.target is operator.getitem else node
        spec = w.spec(cut) if isinstance(cut, fx.Node) else None
        if isinstance(spec, MovementSpec) and spec.cuts:
            given, kept = w.value(cut.args[0]), w.value(node)
            dropped = dropped_ids(given.chans, kept.chans) if isinstance(given, Value) and isinstance(kept, Value) \
                else torch.zeros(0, dtype=torch.int64)
            if dropped.numel() if wanted is None else wanted & set(dropped.tolist()):
                found.append(cut)
            continue
        todo.extend(a for a in node.all_input_nodes if (v := w.value(a)) is not None and getattr(v, "chans", None))
    return list(dict.fromkeys(found))


def why_cuts_move(w, cuts: list[fx.Node]) -> str | None:
    """Why one of ``cuts`` may keep other coordinates at another input shape (None when none does)."""
    for cut in cuts:
        why = why_cut_moves(w, cut, w.value(cut.args[0]).chans)
        if why is not None:
            return f"{cut.name}: {why}"
    return None


def _pin_beside_bare_pieces(w, node: fx.Node, spec) -> None:
    """A channel constant along ``dim`` labels the same coordinate at every position there, so a piece joined
    beside it without labels sits beside that coordinate; if that piece may differ along the channel's axes (a
    per-head attention sink held in a buffer joined to the logits, a cached key from the input joined to the new
    ones), moving the coordinates or heads would leave its values where they are: the channel pins. Zeros, pieces
    constant along those axes, and channels that vary along ``dim`` (the piece is then other coordinates) are
    fine."""
    pieces = [w.value(a) for a in moved_operands(node)]
    out_shape = _shape_of(node)
    if out_shape is None or len(pieces) < 2:
        return
    rank = len(out_shape)
    dim = _join_dim(node, spec) % rank
    varying = frozenset().union(*(_bare_varying_axes(v, rank) for v in pieces
                                  if v is None or (not v.chans and v.points_to is None and not _zeros(v))))
    for v in pieces:
        for c in v.chans if v is not None and v.shape is not None else ():
            shift = rank - len(c.ids.shape)
            axes = frozenset(a + shift for a in chan_axes(c))
            if dim not in axes and axes & varying:
                _pin_chan(w, node, c, "joined beside a piece without labels that differs along its coordinates")
                w.c.beside_data += [t.ids.reshape(-1).numpy() for t in c.terms]


def _bare_varying_axes(v: Value | None, rank: int) -> frozenset[int]:
    """Axes along which a piece without labels may hold different values (every axis, when nothing is known)."""
    if v is None or v.shape is None:
        return frozenset(range(rank))
    shift = rank - len(v.shape)
    if isinstance(v.data, torch.Tensor):
        data = v.data if tuple(v.data.shape) == tuple(v.shape) else v.data.expand(v.shape)
        return frozenset(a + shift for a in varying_axes(data))
    if v.data is not None:  # a Python number
        return frozenset()
    return frozenset(a + shift for a, n in enumerate(v.shape) if n > 1 and a not in v.constant_axes)


# the key of rules._fresh_like's one id for every product of two pinned single coordinates (no pair of ids is this)
PINNED_PRODUCT = (NO_ID, NO_ID)
_PIECE_DEPTH = 40  # ops followed back from a piece to its cuts; past that, a piece is taken as unlike any other


def piece_structure(w, node: fx.Node, structures: tuple[dict, dict], depth: int = 0, roles: bool = False) -> int:
    """A number for the ops that compute ``node`` back to the cuts it reads, with their constant arguments, every
    other input by name and the tensor each cut reads, the bounds of each cut left out (equal numbers, equal
    computations). ``structures``: (memo, numbers): each node visited once in the memo, so shared inputs cost
    nothing twice, and each distinct structure numbered once. ``roles``: a parameter counts by its role and shape
    rather than its name (``norms.0.weight`` and ``norms.1.weight`` alike)."""
    memo, numbers = structures
    if node in memo:
        return memo[node]
    base = node.args[0] if node.target is operator.getitem else None
    target = base if isinstance(base, fx.Node) else node
    spec = w.spec(target) if target.op == "call_function" else None
    if depth > _PIECE_DEPTH:
        structure = ("deep", node.name)
    elif getattr(spec, "cuts", False) and isinstance(target.args[0], fx.Node):
        structure = ("cut", target.args[0].name)
    elif node.op != "call_function":
        param = w.cap.params.get(node.name) if roles else None
        structure = ("leaf", node.name) if param is None else ("param", role(param), w.cap.shapes[param])
    else:
        def number(a):
            return ("node", piece_structure(w, a, structures, depth + 1, roles)) if isinstance(a, fx.Node) else a

        structure = (str(node.target), repr(fx.node.map_aggregate(node.args, number)),
                     repr(fx.node.map_aggregate(node.kwargs, number)))
    memo[node] = numbers.setdefault(structure, len(numbers))
    return memo[node]


def _empty_piece(shape: tuple, dim: int) -> bool:
    """A piece that adds nothing to a concatenation: size 0 along ``dim``, or torch's legacy 1-D empty tensor of
    any rank (an empty key/value cache before its first update: XLM, FlauBERT)."""
    return shape == (0,) or shape[dim] == 0


def _zeros(v: Value) -> bool:
    """A data piece of zeros (nn.MultiheadAttention's ``add_zero_attn`` key and value): every group element is a
    linear map of the coordinates, so zeros stay zeros and the piece may carry the other pieces' coordinates."""
    return not v.chans and isinstance(v.data, torch.Tensor) and v.data.numel() > 0 and not bool(v.data.any())


def _indexed_by_unknown(w, node: fx.Node) -> bool:
    """An index operand whose values the analysis does not know: the labels it picks cannot be replayed. (Its
    own channels, when it has some, are a layout: which coordinate each index belongs to, see
    :func:`_pick_unknown_rows`.)"""
    moved = set(moved_operands(node))
    others = [a for a in node.all_input_nodes if a not in moved]
    if _counted_at_run_time(node) and index_operands(node, "movement"):
        return True
    return any(isinstance(v, Value) and (not v.chans or _integer(a)) and v.data is None  # invariant: unknown too
               and not _run_time_size(a) for v, a in ((w.values.get(a.name), a) for a in others))


def _counted_at_run_time(node: fx.Node) -> bool:
    """A pick whose number of positions, or that of the tensor it picks from, torch.export knows only at run time
    (``x[mask]`` with a mask built from the input ids: HiggsAudio's audio tokens; V-JEPA 2's mask tokens repeated
    ``mask.max() + 1`` times, then gathered by the mask). Even where the analysis knows this input's index values,
    another input picks other positions, and as many of them as it likes, so they are as unknown as routed rows
    (and the labels replayed along a run-time axis have a stand-in size those values overrun)."""
    vals = [node.meta.get("val"), *(a.meta.get("val") for a in moved_operands(node))]
    return any(isinstance(v, torch.Tensor) and bool(free_unbacked_symbols(v.shape)) for v in vals)


def _cut_at_run_time(node: fx.Node) -> bool:
    """A cut into one tensor at bounds torch.export knows only at run time (``h[..., i:i + 1]`` with ``i`` from
    ``argmax().item()``): which positions it keeps depends on values, as with indices of unknown values."""
    return isinstance(node.meta.get("val"), torch.Tensor) and any(map(_unbacked, node.all_input_nodes))


def _unbacked(a: fx.Node) -> bool:
    """A scalar whose value torch.export knows only at run time (computed from tensor values by ``.item()``)."""
    val = a.meta.get("val")
    return isinstance(val, torch.SymInt) and bool(free_unbacked_symbols(val))


def _integer(a: fx.Node) -> bool:
    val = a.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and not val.is_complex()


def index_operands(node: fx.Node, rule: str) -> list[fx.Node]:
    """The integer tensors ``node`` reads as indices under ``rule`` (for movements: every integer operand but the
    moved tensors)."""
    if rule == "movement":
        moved = set(moved_operands(node))
        return [a for a in node.all_input_nodes if a not in moved and _integer(a)]
    names = _INDEX_ARGUMENTS.get(rule, ())
    out = []
    fx.node.map_aggregate([schema_arg(node, n) for n in names],
                          lambda a: out.append(a) if isinstance(a, fx.Node) and _integer(a) else None)
    return out


_INDEX_ARGUMENTS = {"gather": ("index",), "scatter": ("index",), "index_add": ("index",), "index_put": ("indices",),
                    "embedding": ("indices", "offsets"), "one_hot": ("self",)}


def _pin_value(w, node: fx.Node, v: Value | None, why: str) -> None:
    for c in v.chans if v is not None else ():
        _pin_chan(w, node, c, why)


def _run_time_size(a: fx.Node) -> bool:
    """A size argument torch.export knows only at run time (``view(rows.shape[0], ...)`` of routed tokens)."""
    return isinstance(a.meta.get("val"), torch.SymInt)


def _pick_unknown_rows(w, node: fx.Node) -> Value:
    """Positions picked by indices whose values depend on the weights (the tokens routed to one expert). A channel
    that does not vary along the picked axes carries the same labels at every picked position, so it keeps them;
    channels that vary there (or mix with coefficients that may), and pickings laid out otherwise than in place or
    in front (``index_select``, ``x[rows]``) pin. Indices that point into a labelled axis (the router's experts
    picking each token's expert weights, ``w[idx]``) pin that axis: which expert they pick must not move."""
    picked = _axes_chosen_by_unknown_indices(w, node)
    x, out_shape = w.value(moved_operands(node)[0]), _shape_of(node)
    relabel = None
    for v in map(w.value, node.all_input_nodes):  # routed ids of one axis picking another tensor's positions (an
        if v is not None and v.points_to is not None:  # expert's weights by the router's choice): the router's
            w.c.pin(v.points_to, "its indices pick another tensor's positions", node.name)  # axis stays
    if len(moved_operands(node)) == 1 and x is not None and x.shape is not None and out_shape is not None and picked:
        rank, kept = len(x.shape), [a for a in range(len(x.shape)) if a not in picked]
        if len(out_shape) == rank and all(x.shape[a] == out_shape[a] for a in kept):  # index_select, gather
            relabel = lambda t: _first_along(t, picked, out_shape)  # noqa: E731
        elif picked == set(range(rank - len(kept))) and tuple(out_shape[len(out_shape) - len(kept):]) == tuple(
                x.shape[a] for a in kept):  # x[rows], x[mask]: the leading axes replaced by the indices' own
            relabel = lambda t: _leading_replaced(t, rank - len(kept), out_shape)  # noqa: E731
    if relabel is None:
        return _pin_moved(w, node, "rows picked by indices that depend on the weights (routed experts)")
    chans = []
    for c in x.chans:
        if chan_axes(c) & picked or c.mixed:
            _pin_chan(w, node, c, "positions picked by indices that depend on the weights")
        else:
            chans.append(c.map(relabel))
    return Value(chans=chans + _picked_layouts(w, node, x, out_shape), shape=out_shape)


def _picked_layouts(w, node: fx.Node, x: Value, out_shape) -> list[Chan]:
    """The channels of the indices of a pick (which coordinate each index belongs to: top-k tokens laid out per
    expert) as channels of the result, whose picked positions follow the indices' own layout: ``x[rows]`` puts
    the indices' shape in front, ``index_select`` along ``dim``. Any other layout pins."""
    operands = index_operands(node, "movement")
    laid = [(a, w.value(a)) for a in operands if w.value(a) is not None and w.value(a).chans]
    if not laid:
        return []
    rank, dim = len(x.shape), schema_arg(node, "dim")
    out = []
    for a, v in laid:
        shape = _node_shape(a)
        clean = [c for c in v.chans if not c.mixed and not c.block and c.degree == 1]
        if len(operands) == 1 and len(clean) == len(v.chans) and shape is not None:
            if isinstance(dim, int) and len(shape) == 1 and len(out_shape) == rank:  # index_select along dim
                view = [1] * rank
                view[dim % rank] = shape[0]
                out += [c.map(lambda t, view=view: t.reshape(view).expand(out_shape)) for c in clean]
                continue
            if dim is None and tuple(out_shape[:len(shape)]) == tuple(shape):  # x[rows]: the indices' shape first
                view = list(shape) + [1] * (len(out_shape) - len(shape))
                out += [c.map(lambda t, view=view: t.reshape(view).expand(out_shape)) for c in clean]
                continue
        _pin_value(w, node, v, "indices laid out along coordinates, placed where the pick cannot follow them")
    return out


def _leading_replaced(t: torch.Tensor, n_leading: int, out_shape) -> torch.Tensor:
    """Labels constant along ``t``'s first ``n_leading`` axes, as those of ``out_shape``, whose leading axes
    replace them (``x[rows]``: the indices' shape in front of the axes kept)."""
    rest = list(t.shape[n_leading:])
    return t[(0,) * n_leading].reshape([1] * (len(out_shape) - len(rest)) + rest).expand(out_shape)


def _first_along(t: torch.Tensor, axes, out_shape) -> torch.Tensor:
    """``t``'s labels at position 0 of ``axes``, broadcast to ``out_shape`` (labels constant along those axes)."""
    return t[tuple(slice(0, 1) if a in axes else slice(None) for a in range(t.dim()))].expand(out_shape)


def _pin_moved(w, node: fx.Node, reason: str):
    for a in node.all_input_nodes:
        v = w.value(a)
        if v is not None:
            for c in v.chans:
                for t in c.terms:
                    w.c.pin(t.ids, reason, node.name)
            if v.points_to is not None:
                w.c.pin(v.points_to, reason, node.name)
    return _like(node, lambda k: Value(shape=_shape_of(node, k)))


def _like(node: fx.Node, make):
    val = node.meta.get("val")
    return [make(k) for k in range(len(val))] if isinstance(val, (list, tuple)) else make(None)


def _channel_slots(tensors: list[Value | None], out_rank: int) -> dict[int, list[int | None]]:
    """Which channel of each operand moves in each replay (by ``id`` of the operand's Value): the j-th channels
    of all operands, unless two of them vary along disjoint axes (aligned right, as broadcasting does). Then each
    channel joins the channels of the other operands that vary along the same axes, or moves alone: ``cat([x,
    tokens], 1)`` of activations x (coordinates on axis 2) and a parameter of tokens x coordinates (axes 1 and 2)
    must carry x's coordinates on with the parameter's axis-2 channel, not with its token channel (GroupViT)."""
    return slots_by_axes({id(v): [frozenset(a + out_rank - len(c.ids.shape) for a in chan_axes(c)) for c in v.chans]
                          for v in tensors if v is not None})


def slots_by_axes(axes: dict[int, list[frozenset[int]]]) -> dict[int, list[int | None]]:
    """Which channel of each tensor (keyed by ``id`` of its Value, with the axes each of its channels varies along,
    in common coordinates) goes into each slot of the result: the j-th channels of all tensors, unless two of them
    vary along disjoint axes; then each channel joins the channels of the other tensors that vary along the same
    axes, or takes a slot alone."""
    if all(not (x and y) or x & y for j in range(max((len(a) for a in axes.values()), default=0))
           for x, y in itertools.combinations([a[j] for a in axes.values() if j < len(a)], 2)):
        return {key: list(range(len(a))) for key, a in axes.items()}
    slots: list[frozenset] = []  # the axes of each slot, in order of first appearance
    order: dict[int, list[int | None]] = {}
    for key, chans in axes.items():
        taken: list[int | None] = []
        for a in chans:
            j = next((j for j, s in enumerate(slots) if s == a and j not in taken), None)
            if j is None:
                slots.append(a)
                j = len(slots) - 1
            taken.append(j)
        order[key] = taken
    return {key: [taken.index(j) if j in taken else None for j in range(len(slots))] for key, taken in order.items()}


def _slot(v: Value | None, j: int, slots: dict[int, list[int | None]]) -> Chan | None:
    """The channel of ``v`` that moves in replay ``j`` (None: ``v`` has none there; its positions get no label)."""
    if v is None or id(v) not in slots or j >= len(slots[id(v)]) or slots[id(v)][j] is None:
        return None
    return v.chans[slots[id(v)][j]]


def _align_joined_terms(w, node: fx.Node, j: int, slots: dict[int, list[int | None]]) -> dict[str, Value]:
    """Mixed pieces joined term by term: the k-th terms of all pieces become the k-th term of the result, whose
    first term labels its positions. A sum's terms come in the order the model wrote them: ``stack([x0 * c - x1 *
    s, x0 * s + x1 * c], -1)`` (interleaved rotary, sine term first) would pair x0 with x0, and a first term holding
    each coordinate twice resolves to nothing. Each later piece's terms are put in the order that makes its k-th
    term read coordinates the first mixed piece's k-th term does not (kept where none does); the sum is the same.
    The pieces' values are swapped in ``w.values`` for the join; the originals are returned, to be put back."""
    first, kept = None, {}
    for a in moved_operands(node):
        v = w.values.get(a.name)
        c = _slot(v, j, slots) if isinstance(v, Value) else None
        if c is None or not c.mixed or a.name in kept:
            continue
        if first is None:
            first = [_coordinates(t) for t in c.terms]
            continue
        rest, terms = list(c.terms), []
        for seen in first[:len(rest)]:
            terms.append(rest.pop(next((k for k, t in enumerate(rest) if seen.isdisjoint(_coordinates(t))), 0)))
        terms += rest
        if any(t is not u for t, u in zip(terms, c.terms)):
            chans = list(v.chans)
            chans[slots[id(v)][j]] = replace(c, terms=tuple(terms))
            kept[a.name] = v
            w.values[a.name] = swapped = replace(v, chans=chans)
            slots[id(swapped)] = slots[id(v)]
    return kept


def _coordinates(term: Term) -> set[int]:
    return set(term.ids[term.ids >= 0].unique().tolist())


def _move_channel(w, node: fx.Node, j: int, spec, slots: dict[int, list[int | None]]):
    operands = [_slot(w.value(a), j, slots) for a in moved_operands(node)]
    n_terms = max(len(c.terms) if c is not None else 1 for c in operands)
    block = any(c is not None and c.block for c in operands)
    mixed = any(c is not None and c.mixed for c in operands)
    sourced = any(t.src is not None for c in operands if c is not None for t in c.terms)
    terms_out = []
    for k in range(n_terms):
        ids = _replay(w, node, spec, lambda v, shape, k=k: _term_tensor(_slot(v, j, slots), k, shape, "ids"))
        coef = _replay(w, node, spec, lambda v, shape, k=k: _term_tensor(_slot(v, j, slots), k, shape, "coef")) \
            if mixed else None
        src = _replay(w, node, spec, lambda v, shape, k=k: _term_tensor(_slot(v, j, slots), k, shape, "src")) \
            if sourced else None
        terms_out.append((ids, coef, src))
    # factors of pieces that are not mixed, position by position (their coefficients carry them where mixed)
    factor = _replay(w, node, spec, lambda v, shape: _term_tensor(_slot(v, j, slots), 0, shape, "factor")) \
        if not mixed and any(c is not None and c.factor is not None for c in operands) else None
    if isinstance(terms_out[0][0], (list, tuple)):
        count = len(terms_out[0][0])
        return [_factored(Chan(tuple(Term(*(None if x is None else x[i] for x in t)) for t in terms_out),
                               block=block), None if factor is None else factor[i]) for i in range(count)]
    return _factored(Chan(tuple(Term(*t) for t in terms_out), block=block), factor)


def _factored(chan: Chan, factor: torch.Tensor | None) -> Chan:
    return chan if factor is None else chan.times(factor)


def _reorders(w, node: fx.Node, spec, j: int, slots, out: Chan) -> bool:
    """Whether the movement gives a coordinate found at several positions of its output (a flattened channel) its
    input positions in another order than other coordinates get theirs: replayed on the input positions, read
    through each coordinate's rank among its own input positions (:func:`~symgraph.analysis.labels.orders_differ`).
    """
    shape = _shape_of(node)
    if not math.prod(shape):
        return False
    for k, term in enumerate(out.terms):
        ids = term.ids.expand(shape)
        varying = varying_axes(ids)
        at = tuple(slice(None) if a in varying else 0 for a in range(ids.dim()))
        coords = ids[at].reshape(-1).numpy()
        held, counts = np.unique(coords[coords >= 0], return_counts=True)
        if (counts == 1).all():
            continue  # every coordinate at one position: nothing to pair
        repeated = counts > 1
        if len(np.unique(np.stack([w.ids.range_index(held[repeated]), counts[repeated]]), axis=1)[0]) > \
                len(np.unique(w.ids.range_index(held[repeated]))):
            # a cut off a channel's boundary (z[:, 3:]): its k-th entry is no longer the others' k-th. Coordinates
            # of different spaces may repeat differently (the stream's rows beside two learned register tokens)
            return True
        offsets, inputs, start = {}, [], 0
        for a in moved_operands(node):
            v = w.value(a)
            c = _slot(v, j, slots)
            if c is not None and k < len(c.terms) and id(v) not in offsets:
                offsets[id(v)] = start
                inputs.append(c.terms[k].ids.expand(tuple(v.shape)).reshape(-1).numpy())
                start += inputs[-1].size

        def positions(v, shape, k=k):
            if v is not None and id(v) in offsets:
                return offsets[id(v)] + torch.arange(math.prod(shape), dtype=torch.int64).reshape(tuple(shape))
            return _term_tensor(_slot(v, j, slots), k, shape, "ids")

        taken = _replay(w, node, spec, positions).expand(shape)[at].reshape(-1).numpy()
        if inputs and orders_differ(coords, np.where(taken >= 0, _rank_within(np.concatenate(inputs))[taken], -1)):
            return True
    return False


def _rank_within(coords: np.ndarray) -> np.ndarray:
    """Each position's rank among the positions of its own coordinate, in position order."""
    order = np.argsort(coords, kind="stable")
    first = np.r_[True, coords[order][1:] != coords[order][:-1]]
    index = np.arange(len(coords))
    rank = np.empty_like(index)
    rank[order] = index - index[first][np.cumsum(first) - 1]
    return rank


def _term_tensor(chan: Chan | None, k: int, shape, what: str) -> torch.Tensor:
    """Term ``k``'s labels, coefficients (the factor included), source tags or the channel's factor; where ``chan``
    has no such term: -1, 0, -1, 1."""
    if chan is not None and k < len(chan.terms):
        term = chan.terms[k]
        if what == "ids":
            return term.ids
        if what == "src":
            return torch.zeros((), dtype=torch.int64).expand(term.ids.shape) if term.src is None else term.src
        factor = torch.ones((), dtype=torch.float64) if chan.factor is None else chan.factor
        return (chan.coef(k) if what == "coef" else factor).expand(term.ids.shape)
    if what in ("ids", "src"):
        return torch.full(shape, -1, dtype=torch.int64)
    return torch.full(shape, float(what == "factor"), dtype=torch.float64)


def _replay(w, node: fx.Node, spec, pick):
    def load(a):
        if isinstance(a, fx.Node):
            v = w.values.get(a.name)
            if isinstance(v, Value) and (_is_labelled_position(node, a) or (v.chans and not _integer(a))):
                return pick(v, v.shape or _node_shape(a))
            if isinstance(v, Value):
                if _run_time_size(a):  # the stand-in the shapes use for it (labels do not vary along that axis)
                    return STAND_IN_SIZE
                if v.data is None:
                    return pick(None, v.shape or _node_shape(a))
                return v.data
        return a

    args = fx.node.map_aggregate(node.args, load)
    kwargs = fx.node.map_aggregate(node.kwargs, load)
    try:
        return node.target(*args, **kwargs)
    except RuntimeError:
        if spec.replay_as:  # expanded label tensors are not viewable; reshape copies instead
            return aten_op(spec.replay_as)(*args, **kwargs)
        raise


def _axes_chosen_by_unknown_indices(w, node: fx.Node) -> frozenset[int]:
    """Input axes whose positions an integer index tensor with unknown values selects (``dim`` of gather and
    index_select, the indexed leading axes of ``index.Tensor``); empty when every index is known data and picks
    as many positions at every input (see :func:`_counted_at_run_time`); for a cut, ``dim`` when its bounds are
    known only at run time (a view's run-time sizes are routed rows, along which labels do not vary)."""
    unknown, cut = [], getattr(w.spec(node), "cuts", False)

    def visit(a):
        if isinstance(a, fx.Node) and a not in moved_operands(node):
            val, v = a.meta.get("val"), w.value(a)
            if isinstance(val, torch.Tensor) and not val.is_floating_point() and (
                    v is None or v.data is None or _counted_at_run_time(node)) or (cut and _unbacked(a)):
                unknown.append(a)
        return a

    fx.node.map_aggregate((node.args[1:], node.kwargs), visit)
    if not unknown:
        return frozenset()
    return _indexed_axes_of(node, len(_node_shape(moved_operands(node)[0]) or ()))


def _indexed_axes_of(node: fx.Node, rank: int) -> frozenset[int]:
    """The axes of ``node``'s first operand (of rank ``rank``) whose positions its indices choose: ``dim`` of
    gather and index_select, the indexed leading axes of ``index.Tensor``, else every axis."""
    dim = schema_arg(node, "dim")
    if isinstance(dim, int):
        return frozenset({dim % rank})
    indices = schema_arg(node, "indices")
    if isinstance(indices, (list, tuple)):  # index.Tensor
        return _indexed_axes(indices)
    return frozenset(range(rank))  # an op that reads index values some other way: every axis


def _indexed_axes(indices) -> frozenset[int]:
    """The axes an index list (``index.Tensor``, ``index_put``) picks: one entry per leading axis, None for an axis
    taken whole, a boolean mask spanning as many axes as it has."""
    axes, axis = set(), 0
    for t in indices:
        val = t.meta.get("val") if isinstance(t, fx.Node) else None
        span = val.dim() if isinstance(val, torch.Tensor) and val.dtype == torch.bool else 1
        if t is not None:
            axes.update(range(axis, axis + span))
        axis += span
    return frozenset(axes)


def _is_labelled_position(node: fx.Node, arg: fx.Node) -> bool:
    """Tensor operands that are moved (as opposed to index tensors) of a movement op."""
    first = node.args[0]
    if isinstance(first, (list, tuple)):
        return arg in first
    return arg is first




# -- identity, activations -------------------------------------------------------------------------------
# a cast of real values to an integer or bool dtype: trunc(x) or x != 0 for each coordinate, which only
# permutations pass
_ROUNDED = MapSpec(rule="activation", group="permutation")


def rule_identity(w, node: fx.Node, spec) -> Value:
    v = w.value(node.args[0])
    if v.points_to is not None and not v.chans:  # indices cast or copied still point there; negated do not
        if not spec.negates:
            return Value(points_to=v.points_to, shape=_shape_of(node))
        return _pin_moved(w, node, "indices negated")
    if v.chans and _integer(node) and not _integer(node.args[0]):
        return rule_activation(w, node, _ROUNDED)  # no scale passes a rounding: (2.4 c).long() != c * 2
    if _narrows_to_half(node):
        for c in v.chans:
            if not c.block:
                w.c.restrict(w.resolve(c, node.name).ids, ORTHOGONAL, "rounded to half precision", node.name)
    chans = v.chans
    if spec.negates:
        chans = [c.scaled(-1.0) for c in chans]
    # type_as(values, activation): the channels come from the reference tensor, the values (and whether they are
    # invariant, as routing weights are) from the first argument
    return Value(chans=list(chans), shape=_shape_of(node), invariant=v.invariant and not chans)


def _narrows_to_half(node: fx.Node) -> bool:
    """A cast of wider floats to float16 or bfloat16: each coordinate is rounded to about 3 significant digits.
    An orthogonal map keeps the rounding errors' size, but a general linear map spreads them by its condition
    number (one through such a cast changed the outputs by 9e-2, three times the bfloat16 tolerance). The
    orthogonal group, not the monomial one, is what passes: a half-precision model casts its normalised
    residual stream back from float32 in every norm, and its stream's group is O(D) once the norms are folded.
    Scales are lost with it (float16 overflows near 6.5e4 anyway)."""
    out, x = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    return (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and out.dtype in _HALF
            and x.dtype.is_floating_point and torch.finfo(x.dtype).bits > torch.finfo(out.dtype).bits)


_HALF = (torch.float16, torch.bfloat16)


def rule_ignore(w, node: fx.Node, spec) -> Value:
    return Value(shape=_shape_of(node))


def rule_activation(w, node: fx.Node, spec) -> Value:
    v = w.value(node.args[0])
    limit = from_group_name(spec.group, spec.scale)
    if spec.bounds and not _opposite_numbers(*(schema_arg(node, b) for b in spec.bounds)):
        limit = limit & NEUTRAL  # clamp(-x, a, b) = -clamp(x, -b, -a): sign flips need b = -a
    slopes = schema_arg(node, spec.slopes) if spec.slopes else None
    if spec.pairs and _both_labelled_alike(w, node):
        v = _add_values(w, node, v, w.value(node.args[1]), residual=False)  # coordinate i of each meets there
    elif _bounded_by_varying_tensor(w, node, v, slopes):  # max(x, t): t must not differ between x's coordinates
        return _pin_operands(w, node, [v] + [w.value(a) for a in node.args[1:] if isinstance(a, fx.Node)],
                             "elementwise bound by a tensor that differs per coordinate")
    chans = [replace(w.resolve(c, node.name), degree=1) for c in v.chans]
    if spec.even and _even_statistic(w, node, chans):
        return Value(invariant=True, shape=_shape_of(node))
    coordinates = [c for c in chans if not c.block]
    for c in coordinates:
        w.c.restrict(c.ids, limit, f"elementwise {node.target.__name__.split('.')[0]}", node.name)
    if spec.slopes:
        _slopes_per_channel(w, node, slopes, chans)
    # the activation's units: its one channel, or among several those along the last axis, where a linear layer
    # writes them (a token-mixing MLP activates (batch, stream, units): the stream only rides along). Coordinates
    # only reduced away into a statistic (x.abs().amax(-1) scaling the stream) are no units: the stream keeps its name
    last = len(v.shape) - 1 if v.shape else None
    for c in coordinates:
        if (len(coordinates) == 1 or last in chan_axes(c)) and not _only_reduced_away(w, node, chan_axes(c)):
            w.c.tag("activation", c.ids)
    return Value(chans=chans, shape=_shape_of(node))


def _both_labelled_alike(w, node: fx.Node) -> bool:
    """Whether both operands of a map of coordinate pairs (``max(a, b)``) carry channels of one coordinate each
    (no linear mixes) along the same axes, so that coordinate i of one meets coordinate i of the other only: tied,
    they move alike and the map commutes with any permutation of both (of heads too: a sink logit per head joined
    to its head's scores by ``logaddexp`` moves with its head)."""
    if len(node.args) != 2 or not isinstance(node.args[1], fx.Node) or _shape_of(node) is None:
        return False
    a, b = w.value(node.args[0]), w.value(node.args[1])
    if a is None or b is None or not a.chans or len(a.chans) != len(b.chans):
        return False
    out_shape = _shape_of(node)
    axes = [sorted(chan_axes(c.broadcast_to(out_shape)) for c in v.chans) for v in (a, b)]
    return axes[0] == axes[1] and all(_uniform(c) for c in (*a.chans, *b.chans))


def _bounded_by_varying_tensor(w, node: fx.Node, x: Value, slopes=None) -> bool:
    """A second tensor operand (``max(x, t)``, ``clamp(x, t)``) that carries channels, or data that varies along
    an axis where ``x`` carries one: permuting x's coordinates would need it permuted too. ``slopes`` (prelu's
    weight, laid along axis 1) is left to :func:`_slopes_per_channel`."""
    out_shape = _shape_of(node)
    axes = frozenset().union(*(chan_axes(c) for c in x.chans)) if x.chans else frozenset()
    for a in (*node.args[1:], *node.kwargs.values()):
        t = w.value(a) if isinstance(a, fx.Node) and a is not slopes else None
        if t is None:
            continue
        if t.chans or (not t.invariant and data_varies(t.data, axes, out_shape)) or \
                (t.invariant and axes & _varying_axes(t, out_shape)):
            return True
    return False


def _slopes_per_channel(w, node: fx.Node, slopes, chans: list[Chan]) -> None:
    """prelu's weight: one slope for every coordinate, or one per channel of axis 1. A slope per channel moves
    with its channel (a product tie: ``prelu_a(c x) = c prelu_a(x)`` for c > 0, so the slope keeps its value);
    coordinates along other axes see every slope alike. What varies along axis 1 and meets slopes it cannot
    carry (data that differs per channel, slopes of no single channel, heads, a channel varying along other axes
    too) pins."""
    s = w.value(slopes) if isinstance(slopes, fx.Node) else None
    count = slopes.meta["val"].numel() if isinstance(slopes, fx.Node) else 1
    along = [c for c in chans if 1 in chan_axes(c)]
    if count == 1 or s is None or (not s.chans and s.data is not None and not data_varies(s.data, {0}, (count,))):
        _pin_operands(w, node, [s], "one slope shared by every coordinate keeps its value")
        return
    ids = _channel_ids(s, 0) if len(s.chans) == 1 else None
    if ids is None or len(along) != 1 or chan_axes(along[0]) != {1} or along[0].mixed or along[0].block:
        _pin_operands(w, node, [s, Value(chans=along)], "slopes per channel that no single channel of axis 1 "
                                                        "carries alone")
        return
    w.c.tie(ids_along(along[0].ids, 1), ids, product=PRODUCT_WEIGHT, node=node.name)
    w.c.permute_only.append(ids.numpy())


def _even_statistic(w, node: fx.Node, chans: list[Chan]) -> bool:
    """An even map (``|x|``) that every reader reduces over all the axes its coordinates vary along (a mean
    absolute value, a largest absolute value): each statistic is a symmetric function of a row's ``|x_i|``, which
    signed permutations within the row leave unchanged. Restricts the rows as a norm's and says whether it did (the
    map's value is then invariant); a scale would change the statistic."""
    rank = len(_shape_of(node) or ())
    if not chans or not node.users or any(c.block or c.mixed for c in chans):
        return False
    for user in node.users:
        spec = w.spec(user) if user.op == "call_function" else None
        if spec is None or spec.rule != "reduce" or _schema_args(user).get("self") is not node:
            return False
        dims = _schema_args(user).get("dim")
        reduced = frozenset(range(rank)) if not dims else frozenset(d % rank for d in dims)
        if not all(chan_axes(c) <= reduced for c in chans):
            return False
    for c in chans:
        _normalise(w, node, c, chan_axes(c), monomial("sign"))
    return True


def _only_reduced_away(w, node: fx.Node, axes) -> bool:
    """Every reader of ``node`` is a reduction over some of ``axes``."""
    rank = len(_shape_of(node) or ())

    def reduced(user) -> frozenset[int]:
        spec = w.spec(user) if user.op == "call_function" else None
        if spec is None or spec.rule != "reduce":
            return frozenset()
        dims = _schema_args(user).get("dim")
        return frozenset(range(rank)) if not dims else frozenset(d % rank for d in dims)

    return bool(node.users) and all(reduced(u) & axes for u in node.users)


def rule_glu(w, node: fx.Node, spec) -> Value:
    """``glu(x, dim)``: unit i of ``dim``'s first half times the sigmoid of unit i of its second half. The halves'
    units pair up and permute together (the sigmoid passes nothing else); the product's units are the
    activation's, labelled afresh as for any product of two activations. A channel that does not label ``dim``
    would meet itself inside the sigmoid: pinned."""
    x = w.value(schema_arg(node, "self"))
    axis = schema_arg(node, "dim", -1) % len(x.shape)
    half, out_shape = x.shape[axis] // 2, _shape_of(node)
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        if c.block or c.mixed or axis not in chan_axes(c):
            _pin_chan(w, node, c, "gated linear unit over an axis this channel does not label alone")
            continue
        value = replace(c.map(lambda t: t.narrow(axis, 0, half)), degree=1, weight=False, uniform=False)
        gate = replace(c.map(lambda t: t.narrow(axis, half, half)), degree=1, weight=False, uniform=False)
        w.c.restrict(gate.ids, NEUTRAL, "sigmoid gate of a gated linear unit", node.name)
        out = _product_output(w, node, value, gate, NEUTRAL, "gated linear unit: a value times its gate")
        w.c.tag("activation", out.ids)
        chans.append(out)
    return Value(chans=chans, shape=out_shape)


def _opposite_numbers(low, high) -> bool:
    """Bounds given as Python numbers (not tensors, not absent) with ``low == -high``."""
    numbers = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high))
    return numbers and low == -high


def rule_pool(w, node: fx.Node, spec) -> Value:
    """A map of each channel (axis 1) over its positions (pooling, upsampling): like an activation on the channel
    axis (``group``, ``scale``), while the output has positions of its own. Channels that vary along positions
    pin."""
    x = w.value(node.args[0])
    out_shape = _shape_of(node)
    limit = from_group_name(spec.group, spec.scale)
    view = [1, -1] + [1] * (len(out_shape) - 2)
    chans = []
    for c in x.chans:
        ids = _input_channel_ids(w, node, c, beside_data=True)
        if ids is not None:
            w.c.restrict(ids, limit, f"mapped over positions by {node.target.__name__.split('.')[0]}", node.name)
            chans.append(Chan.clean(ids.reshape(view).expand(out_shape)))
    return Value(chans=chans, shape=out_shape)


def rule_scan(w, node: fx.Node, spec) -> Value:
    """A linear map along one axis, ``dim`` (cumulative sums over positions, as causal linear attention takes):
    channels that do not vary along it pass, as through any map of the positions; channels that do pin."""
    args = _schema_args(node)
    x, out_shape = w.value(args["self"]), _shape_of(node)
    dim = args["dim"] % len(out_shape)
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        if dim in chan_axes(c):
            _pin_chan(w, node, c, f"summed cumulatively along this axis by {node.target.__name__.split('.')[0]}")
        else:
            chans.append(c.broadcast_to(out_shape))
    return Value(chans=chans, shape=out_shape)


def rule_pad(w, node: fx.Node, spec) -> Value:
    """Padding: new positions along the padded axes. Channels that vary along no padded axis keep their ids;
    a constant pad other than 0 puts the same value in every coordinate, which only a permutation keeps. Along an
    axis a channel varies along, a constant pad adds positions holding no coordinate, as ``cat`` with a constant
    piece does; any other pad there (a crop, a reflection) pins."""
    args = _schema_args(node)
    x, out_shape = w.value(args["self"]), _shape_of(node)
    amounts = list(args.get("pad", args.get("padding")))
    padded = {len(out_shape) - 1 - i // 2 for i, n in enumerate(amounts) if n}
    value = args.get("value") or 0
    constant = "value" in args and args.get("mode", "constant") == "constant"  # reflection_pad*: no value
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        along = chan_axes(c) & padded
        if c.block or (along and not (constant and not c.mixed and _widened_only(amounts, along, len(out_shape)))):
            for t in c.terms:
                w.c.pin(t.ids, "padded along an axis it varies along", node.name)
            continue
        if value and constant and padded - along:
            w.c.restrict(c.ids, NEUTRAL, f"padded with the constant {value} in every coordinate", node.name)
        chans.append(replace(c, terms=(Term(_padded_labels(c.ids, amounts, along, padded, out_shape), None),),
                             weight=False, uniform=False, factor=None) if along else  # a cat with a constant piece
                     c.map(lambda t: _first_along(t, padded, out_shape)))
    return Value(chans=chans, shape=out_shape)


def _widened_only(amounts: list[int], axes: frozenset[int], rank: int) -> bool:
    """Whether the pad adds positions along ``axes`` and removes none there (a negative amount crops)."""
    return all(n >= 0 for i, n in enumerate(amounts) if rank - 1 - i // 2 in axes)


def _padded_labels(ids: torch.Tensor, amounts: list[int], along: frozenset[int], padded,
                   out_shape) -> torch.Tensor:
    """``ids`` padded with :data:`NO_ID` along ``along`` (new positions of no coordinate), and repeated along the
    other padded axes (new positions of the same coordinates)."""
    rank = len(out_shape)
    own = [n if rank - 1 - i // 2 in along else 0 for i, n in enumerate(amounts)]
    grown = torch.constant_pad_nd(collapse(ids).contiguous(), own, NO_ID)
    return _first_along(grown, padded - along, out_shape)


def rule_pow(w, node: fx.Node, spec) -> Value:
    v = w.value(node.args[0])
    exponent = spec.exponent if spec.exponent is not None else _schema_args(node)["exponent"]
    chans = []
    for c in v.chans:
        c = w.resolve(c, node.name)
        if exponent == 2 and not c.block:
            chans.append(replace(c, degree=2))
            continue
        if not c.block:
            odd = float(exponent).is_integer() and int(exponent) % 2 == 1
            w.c.restrict(c.ids, monomial("sign" if odd else "one"), f"elementwise power {exponent}", node.name)
        chans.append(c)
    return Value(chans=chans, shape=_shape_of(node))


def squared(w, node: fx.Node, chan: Chan) -> Chan:
    """A degree-2 channel (``x * x``) used as a value rather than summed into a norm: a coordinate of its own
    that moves with ``x``'s permutation, its scale the square of ``x``'s (ReLU^2: c in, 1/c^2 out)."""
    x = replace(chan, degree=1)
    return _product_output(w, node, x, x, NEUTRAL, "a square scales with the square of its input")


# -- contractions -------------------------------------------------------------------------------------------
def rule_contract(w, node: fx.Node, spec) -> Value:
    n_factors = spec.factors  # operands after these are added to the output (biases)
    if spec.pattern == "einsum":
        pattern, operands = parse_pattern(schema_arg(node, "equation")), list(schema_arg(node, "tensors"))
        n_factors = len(operands)  # every einsum operand is a factor
        if n_factors < 2:
            return _pin_moved(w, node, "einsum of one operand, which no rule describes")
    else:
        args = _schema_args(node)
        operands = [args[name] for name in operand_names(spec, node.target)]
        pattern = spec.recipe
    values = [w.value(a) if isinstance(a, fx.Node) else None for a in operands]
    if any(v is not None and v.shape is None for v in values):
        return _pin_moved(w, node, "an operand's shape is unknown")
    if not all(_labels_fit(v) for v in values if v is not None):  # labels of a run-time count, not its stand-in
        return _pin_moved(w, node, "an operand's shape is only known at run time")
    shapes = [v.shape if v is not None else () for v in values]
    if pattern is None:
        pattern = matmul_pattern(len(shapes[0]), len(shapes[1]))
    letters, out_letters = expand_ellipsis(pattern, shapes[: len(pattern.operands)])
    if any(len(set(spec)) < len(spec) for spec in letters):  # "ii": only the diagonal is read, which no tie says
        return _pin_moved(w, node, "a contraction that reads a diagonal (a letter repeated in one operand)")
    out_shape = _shape_of(node)
    ops = [Operand(values[i].chans if values[i] else [], shapes[i], letters[i],
                   values[i].data if values[i] else operands[i],
                   values[i].constant_axes if values[i] else frozenset(),
                   operands[i].name if values[i] and n_factors == 2 else None) for i in range(n_factors)]
    out = Value(chans=_contract_factors(w, node, ops, out_letters, out_shape), shape=out_shape)
    for extra in values[n_factors:]:  # biases: added to the output, so broadcast against it (addmm's may be 2-D)
        if extra is not None:
            letter_spec = out_letters[len(out_letters) - len(extra.shape):]
            out = _add_values(w, node, out, _broadcast_value(extra, letter_spec, out_letters, out_shape),
                              residual=False)
    return out


def _labels_fit(value: Value) -> bool:
    """Whether every channel's labels broadcast to the value's shape. A size known only at run time has a stand-in
    (:func:`~symgraph.analysis.labels.concrete_shape`) in the shape, while labels replayed on concrete data (a
    boolean mask of the example input) have the example's size: such an operand cannot be contracted."""
    return all(t.ids.dim() != len(value.shape) or all(i in (1, n) for i, n in zip(t.ids.shape, value.shape))
               for c in value.chans for t in c.terms)


def _contract_factors(w, node: fx.Node, ops: list[Operand], out_letters: str, out_shape) -> list[Chan]:
    """Contract the factors left to right (a product of several factors is the same multilinear map taken
    pairwise); each intermediate keeps the letters a later factor or the output still reads."""
    sizes = {}
    for op in ops:
        for letter, n in zip(op.letters, op.shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    acc = ops[0]
    for i, op in enumerate(ops[1:], start=2):
        letters, shape = out_letters, out_shape
        if i < len(ops):
            later = set("".join(o.letters for o in ops[i:])) | set(out_letters)
            letters = "".join(dict.fromkeys(l for l in acc.letters + op.letters if l in later))
            shape = tuple(sizes[l] for l in letters)
        acc = Operand(Contraction(w, node.name, step=i - 2).run(acc, op, letters, shape), shape, letters)
    return acc.chans


def rule_conv(w, node: fx.Node, spec) -> Value:
    """Convolution: input channels are contracted with the kernel's axis 1, output channels come from its axis 0
    (the other way round when transposed).

    With ``groups`` > 1, output channel ``o`` reads only input group ``o // (C_out / groups)``: channels of
    different groups may not mix (see :func:`_grouped_conv`). Grouped transposed convolutions pin.
    """
    args = _schema_args(node)
    x, weight, bias = w.value(args["input"]), w.value(args["weight"]), w.value(args.get("bias"))
    out_shape = _shape_of(node)
    transposed = spec.transposed or bool(args.get("transposed"))
    # input and output positions get letters of their own (their sizes differ); kernel taps are contracted
    # with input positions (data), so they find no partner and pin
    rank = len(out_shape) - 2
    spatial, out_spatial = "xyz"[:rank], "XYZ"[:rank]
    if args.get("groups", 1) == 1:
        kernel = ("io" if transposed else "oi") + "pqr"[:rank]
        ops = [Operand(x.chans, x.shape, "bi" + spatial), Operand(weight.chans, weight.shape, kernel)]
        chans = Contraction(w, node.name).run(ops[0], ops[1], "bo" + out_spatial, out_shape)
        out = Value(chans=chans, shape=out_shape)
    elif transposed:
        return _pin_operands(w, node, [x, weight, bias], "grouped transposed convolution (no rule describes it)")
    else:
        out = _grouped_conv(w, node, x, weight, args["groups"], out_shape)
    if bias is not None:  # added to the output channels (pinned with them when they are)
        out = _add_values(w, node, out, _broadcast_value(bias, "o", "bo" + out_spatial, out_shape), residual=False)
    return out


def _grouped_conv(w, node, x: Value, weight: Value, groups: int, out_shape) -> Value:
    """A grouped convolution, as the subgroup of its exact group that the labels can express.

    Depthwise (one input and one output channel per group): the output channel is the input channel times its
    own kernel, so both share one permutation and the input's per-channel scale passes through (the kernel
    rows move like a norm weight). Otherwise every group's input channels are tied to the kernel's axis 1, so
    one transformation acts on all groups alike, and each group's output channels form a block of their own.
    Kernel axes left without a partner (taps, input channels of data) are pinned.
    """
    c_out, per_group = weight.shape[0], weight.shape[1]
    rows, columns = _channel_ids(weight, 0), _channel_ids(weight, 1)
    for c in weight.chans:
        if not chan_axes(c) <= {0, 1}:
            w.c.pin(c.ids, "kernel taps are contracted with input positions", node.name)
    inputs = [ids for ids in (_input_channel_ids(w, node, c) for c in x.chans) if ids is not None]
    view = [1, -1] + [1] * (len(out_shape) - 2)
    if per_group == 1 and c_out == groups == x.shape[1]:
        if not inputs:
            w.c.pin(rows, "depthwise kernel applied to input data", node.name)
            return Value(shape=out_shape)
        if rows is None:  # a kernel of data, or one parameter row expanded to every channel: stays when they move
            for ids in [*inputs, *(c.ids for c in weight.chans)]:
                w.c.pin(ids, "depthwise kernel with no rows that move with the channels (data, or one shared row)",
                        node.name)
            return Value(shape=out_shape)
        kernel = replace(Chan.clean(rows.reshape(view).expand(out_shape)), weight=True)
        w.c.permute_only.append(_ids_of(kernel))
        chans = [_product_output(w, node, Chan.clean(ids.reshape(view).expand(out_shape)), kernel,
                                 monomial("nonzero"), "depthwise convolution: channel times its own kernel")
                 for ids in inputs]
        return Value(chans=chans, shape=out_shape)
    for ids in inputs:
        if columns is None:
            w.c.pin(ids, "grouped convolution with one input channel per group (no rule pairs it)", node.name)
            continue
        for group in ids.reshape(groups, per_group):
            w.c.tie(group, columns, dual=True, node=node.name)
    if columns is not None and not inputs:
        w.c.pin(columns, "contracted with data that carries no symmetry", node.name)
    if rows is None:
        return Value(shape=out_shape)
    blocks = rows.reshape(groups, c_out // groups)
    w.c.separate(blocks, node.name)
    # each group's rows read their own input group: a permutation of whole blocks (heads laid one to a group, as in
    # SqueezeBERT's attention) would have to move the input groups too, which one map on all of them cannot do
    w.c.separate_pieces(list(blocks), node.name)
    return Value(chans=[Chan.clean(rows.reshape(view).expand(out_shape))], shape=out_shape)


def _channel_ids(weight: Value, axis: int) -> torch.Tensor | None:
    """The kernel's ids along ``axis`` (None when the axis has size 1 and so carries none)."""
    for c in weight.chans:
        if chan_axes(c) == {axis}:
            return ids_along(c.ids, axis)
    return None


def _input_channel_ids(w, node, chan: Chan, beside_data: bool = False) -> torch.Tensor | None:
    """The ids along channel axis 1 of a convolution, norm or pooling input. A channel that varies along any
    other axis (or a head block, a mix, channels partly made of data unless ``beside_data``: a map of each channel
    on its own, which the data channels' -1 ids keep out of every group) has no per-channel meaning here: pinned."""
    chan = w.resolve(chan, node.name)
    ids = ids_along(chan.ids, 1)
    if chan_axes(chan) != {1} or chan.block or chan.mixed or (not beside_data and bool((ids < 0).any())):
        for t in chan.terms:
            w.c.pin(t.ids, "channel axis input that varies along other axes or is partly data", node.name)
        return None
    return ids


def _pin_operands(w, node, values, why: str) -> Value:
    for v in values:
        for c in (v.chans if v is not None else []):
            for t in c.terms:
                w.c.pin(t.ids, why, node.name)
    return Value(shape=_shape_of(node))


def rule_attention(w, node: fx.Node, spec) -> Value:
    args = _schema_args(node)
    q, k, v = (w.value(args[name]) for name in ("query", "key", "value"))
    mask, gqa = args["attn_mask"], args["enable_gqa"]
    qs, ks, vs = q.shape, k.shape, v.shape
    if gqa and ks[-3] != qs[-3]:
        rep = qs[-3] // ks[-3]
        k = _repeat_heads(k, rep)
        v = _repeat_heads(v, rep)
        ks, vs = k.shape, v.shape
    lead = "".join("ABCDEFG"[i] for i in range(len(qs) - 3))
    scores_shape = (*qs[:-1], ks[-2])
    score_chans = Contraction(w, node.name).run(
        Operand(q.chans, qs, lead + "hnd", constant_axes=q.constant_axes),
        Operand(k.chans, ks, lead + "hmd", constant_axes=k.constant_axes), lead + "hnm", scores_shape)
    scores = Value(chans=score_chans, shape=scores_shape)
    mask_value = w.value(mask) if isinstance(mask, fx.Node) else None
    if args["is_causal"]:  # the mask the op builds itself differs along both token axes, as a mask passed in does
        mask_value = Value(data=_causal_mask(scores_shape[-2:]), shape=scores_shape[-2:])
    if mask_value is not None:
        scores = _add_values(w, node, scores, mask_value, residual=False, out_shape=scores_shape)
    scores = _softmax_value(w, node, scores, len(scores_shape) - 1)
    out_shape = _shape_of(node)
    chans = Contraction(w, node.name, step=1).run(Operand(scores.chans, scores_shape, lead + "hnm"),
                                                  Operand(v.chans, vs, lead + "hmd", constant_axes=v.constant_axes),
                                                  lead + "hnd", out_shape)
    return Value(chans=chans, shape=out_shape)


def _causal_mask(shape) -> torch.Tensor:
    return torch.zeros(shape).masked_fill(~torch.ones(shape, dtype=torch.bool).tril(), float("-inf"))


def _repeat_heads(v: Value, rep: int) -> Value:
    chans = [c.map(lambda t: t.repeat_interleave(rep, dim=-3)) for c in v.chans]
    shape = (*v.shape[:-3], v.shape[-3] * rep, *v.shape[-2:])
    heads = len(shape) - 3  # one KV head repeated for every query head: the same values along the heads axis
    kept = {a for a in v.constant_axes if a != heads} | ({heads} if v.shape[-3] == 1 or heads in v.constant_axes
                                                          else set())
    return Value(chans=chans, shape=shape, constant_axes=frozenset(kept))


# -- arithmetic ------------------------------------------------------------------------------------------------
def rule_add(w, node: fx.Node, spec) -> Value:
    a, b = _self_and_other(w, node)
    alpha = schema_arg(node, "alpha", 1)
    if alpha != 1 and isinstance(b, Value):
        b = Value(chans=[c.scaled(float(alpha)) for c in b.chans], data=b.data, shape=b.shape,
                  invariant=b.invariant)
    return _add_values(w, node, a, b, residual=True)


def rule_sub(w, node: fx.Node, spec) -> Value:
    if not spec.swapped and centred_input(node) is not None and is_centring_mean(node.args[1]):
        return _centred(w, node, w.value(node.args[0]))
    a, b = _self_and_other(w, node)
    if spec.swapped:
        a, b = b, a
    return _add_values(w, node, a, _negated(b) if isinstance(b, Value) else b, residual=True)


def _negated(v: Value) -> Value:
    """``-v`` as an operand of a sum (its data is only read for where it varies and whether it is 0)."""
    # head blocks only say which head is which: a sign does not mix them
    return Value(chans=[c if c.block else c.scaled(-1.0) for c in v.chans], data=v.data, shape=v.shape,
                 invariant=v.invariant)


def rule_lerp(w, node: fx.Node, spec) -> Value:
    """``lerp(a, b, t) = a + t (b - a)``, read as those three ops: a scalar ``t`` is a common factor, a weight
    tensor multiplies as in ``mul`` (a parameter per coordinate moves with its coordinate)."""
    args, shape = _schema_args(node), _shape_of(node)
    a, b, t = (_as_value(_operand(w, args[k])) for k in ("self", "end", "weight"))
    gap = _product(w, node, t, _add_values(w, node, b, _negated(a), residual=True, out_shape=shape), divide=False)
    return _add_values(w, node, a, gap, residual=True, out_shape=shape)


def _centred(w, node, x: Value) -> Value:
    """``x - mean(x)`` over the last axis (a LayerNorm written out): a channel along that axis stays itself, moved
    by orthogonal maps with Q 1 = +-1 (with which centring commutes), as a LayerNorm's input; any other pins."""
    last = len(x.shape) - 1
    for c in x.chans:
        c = w.resolve(c, node.name)
        if last not in chan_axes(c):
            continue
        if c.block or c.mixed or c.degree != 1 or chan_axes(c) != {last}:
            _pin_chan(w, node, c, "centred together with coordinates it cannot follow")
        else:
            _normalise(w, node, c, frozenset({last}), Restriction(orthogonal=True, fixes_ones=True))
    return Value(chans=[w.resolve(c, node.name) for c in x.chans], shape=_shape_of(node))


def _add_values(w, node, a, b, residual: bool, out_shape=None) -> Value:
    out_shape = out_shape or _shape_of(node)
    a, b = _as_value(a), _as_value(b)
    if any(c.block for c in b.chans) and not any(c.block for c in a.chans):
        a, b = b, a  # head scores first: per-head coordinates added to them (bias + scores) find their heads
    chans, used, pinned = [], set(), []
    b_axes = [chan_axes(cb.broadcast_to(out_shape)) for cb in b.chans]  # once: values can carry many channels
    b_at: dict[tuple, list[int]] = {}  # b's channels by the positions they label, made when first needed
    b_single: dict[int, list[int]] | None = None  # b's channels of one coordinate by its id, made when needed
    for ca in a.chans:
        ca = ca.broadcast_to(out_shape)
        axes = chan_axes(ca)
        found = [j for j, cb in enumerate(b.chans) if j not in used and cb.block == ca.block and b_axes[j] & axes]
        if len(found) > 1:  # the first labelling the same positions: the stream beside register tokens (below)
            b_at = b_at or _by_positions(b.chans, out_shape)
            found = [j for j in b_at.get(_positions(ca), ()) if j in found] or found
        j = found[0] if found else None
        if j is None and ca.block:  # per-head coordinates (T5 relative bias columns) added to head scores
            j = next((j for j in range(len(b.chans)) if j not in used and b_axes[j] == axes), None)
        coordinate = one_coordinate(ca) if j is None else None
        if coordinate is not None:  # one coordinate on both sides (x + 0.04 x^3): one channel
            b_single = b_single if b_single is not None else by_one_coordinate(b.chans)
            same = next((j for j in b_single.get(coordinate, ()) if j not in used), None)
            if same is not None:  # kept apart, each sum doubled them (Funnel's token types)
                used.add(same)
                chans.append(_sum_channels(w, node, ca, b.chans[same].broadcast_to(out_shape), residual=False))
                continue
        if j is None:
            (chans if _add_data(w, node, ca, b, out_shape) else pinned).append(_uniform_after_adding(ca, b, out_shape))
            continue
        used.add(j)
        cb = b.chans[j].broadcast_to(out_shape)
        chans.append(_sum_channels(w, node, ca, cb, residual))
    for j, cb in enumerate(b.chans):
        if j not in used:
            cb = cb.broadcast_to(out_shape)
            (chans if _add_data(w, node, cb, a, out_shape) else pinned).append(_uniform_after_adding(cb, a, out_shape))
    # A pinned channel still labels its coordinates for what follows (a norm weight multiplied in later scales
    # them), unless the sum goes on with other channels: carried beside them it would meet them where axes are
    # merged (a hyper-connection's stream coefficients, flattened with the stream's own coordinates into the next
    # layer's linear, took that linear's columns and pinned the stream)
    return Value(chans=chans if chans else pinned, shape=out_shape)


def _by_positions(chans: list[Chan], out_shape) -> dict[tuple, list[int]]:
    """The indices of ``chans`` by :func:`_positions` (broadcast to ``out_shape``). A sum pairs the stream with
    the stream: beside two learned register tokens it varies along the tokens too (their own columns there), and
    the registers' token axis, which shares that axis, labels only their rows."""
    index: dict[tuple, list[int]] = {}
    for j, c in enumerate(chans):
        index.setdefault(_positions(c.broadcast_to(out_shape)), []).append(j)
    return index


def _positions(c: Chan) -> tuple:
    """Which positions ``c`` labels, as a key: the mask cut to one entry along each axis it is constant along."""
    mask = collapse(c.ids) >= 0
    for a in range(mask.dim()):
        if mask.shape[a] > 1 and bool((mask == mask.narrow(a, 0, 1)).all()):
            mask = mask.narrow(a, 0, 1)
    return tuple(mask.shape), mask.numpy().tobytes()


def _sum_channels(w, node, ca: Chan, cb: Chan, residual: bool) -> Chan:
    if not (_uniform(ca) and _uniform(cb) or _term_per_head(ca, cb)):
        # x*cos + rotate(x)*sin: a linear mix, resolved when consumed
        return Chan(_as_mixed(ca) + _as_mixed(cb), block=ca.block)
    w.c.tie(ca.ids, cb.ids, node=node.name)  # a per-head parameter added to head scores moves with the heads
    if residual and not ca.block:
        w.c.tag("residual", ca.ids)
    # a sum is no weight vector: weights multiplied in are only ever permuted, which would leave the other
    # operand's ids (tied here) free to scale
    out = replace(_same_coordinates_added(ca, cb), weight=False, uniform=False)
    return out if torch.equal(*collapse_pair(ca.ids, cb.ids)) else out.read_from(w.order_of(node) + 1)


def _same_coordinates_added(ca: Chan, cb: Chan) -> Chan:
    """``ca + cb`` (both of one term) where both read the same coordinates at every position (``x - 0.5 * x``):
    one channel with the sum of their coefficients, which a later sum of terms must see (``(x0 - 0.5 * x0) * c -
    x1 * s`` is no rotation). Where they read other coordinates, ``ca``, with its factor only where ``cb`` has the
    same one: the sum is another tensor of those coordinates (``0 * h + x``, a scan's first step, is ``x``)."""
    if ca.block or not torch.equal(*collapse_pair(ca.ids, cb.ids)):
        same = ca.factor is None and cb.factor is None or ca.factor is not None and cb.factor is not None and \
            torch.equal(*collapse_pair(ca.factor, cb.factor))
        return ca if same else replace(ca, factor=None)
    a, b = collapse_pair(ca.coef(0), cb.coef(0))
    coef = (a + b).expand(torch.broadcast_shapes(ca.coef(0).shape, cb.coef(0).shape))
    if ca.mixed:
        return replace(ca, terms=(replace(ca.terms[0], coef=coef),), factor=None)
    return replace(ca, factor=None).times(coef)


def _term_per_head(ca: Chan, cb: Chan) -> bool:
    """Head scores (a head block) plus one term of per-head coordinates whose coefficient is the same for every
    head (ALiBi: a learned slope per head times the distance, ``-slope`` included): heads only permute, so the
    term moves with its head whatever multiplies it along the other axes."""
    if not ca.block or ca.mixed or cb.block or len(cb.terms) != 1:
        return False
    coef = cb.terms[0].coef
    return coef is None or not data_varies(coef, chan_axes(ca), ca.ids.shape)


def _uniform_after_adding(chan: Chan, other: Value, out_shape) -> Chan:
    """``chan`` plus a value without channels holds one number per row only if that value does not vary along
    the channel's axes (1 + w of a folded (1 + w)-norm; a uniform weight plus per-coordinate data is no longer
    uniform, and multiplying by it would restrict the stream)."""
    if chan.uniform and (other.data is None or data_varies(other.data, chan_axes(chan), out_shape)):
        return replace(chan, uniform=False)
    return chan


def _uniform(c: Chan) -> bool:
    """One term whose coefficient, if any, is one number everywhere (the -1 of ``a - b``, an ``alpha``), and whose
    factor, if any, is the same for all its coordinates: any map of the coordinates commutes with them, so the sum
    moves like both operands, tied."""
    if len(c.terms) != 1 or c.factor is not None and data_varies(c.factor, chan_axes(c), c.ids.shape):
        return False
    coef = c.terms[0].coef
    return coef is None or bool((collapse(coef) == collapse(coef).reshape(-1)[0]).all())


def _as_mixed(c: Chan) -> tuple[Term, ...]:
    return tuple(replace(t, coef=c.coef(k)) for k, t in enumerate(c.terms))


def _add_data(w, node, chan: Chan, other: Value, out_shape) -> bool:
    """A channel plus something without channels: fine only if that something is the same for every coordinate.
    False where ``chan`` is pinned."""
    axes = chan_axes(chan)
    if (other.invariant and _moves_alike(chan, other, out_shape)) or \
            (other.data is not None and not data_varies(other.data, axes, out_shape)):
        if not chan.block and other.data is not None and _nonzero(other.data):
            w.c.restrict(chan.ids, NEUTRAL, "a constant is added to every coordinate", node.name)
        elif not chan.block and other.invariant:
            w.c.restrict(chan.ids, NEUTRAL, "a per-row statistic is added to every coordinate", node.name)
        return True
    if other.shape is not None and not axes & _varying_axes(other, out_shape):
        # broadcast along this channel's axes (a token-mixing bias beside the feature axis): the same value in
        # every coordinate, which only a permutation keeps (its own channels are tied on their own axes)
        if not chan.block:
            w.c.restrict(chan.ids, NEUTRAL, "a value broadcast along this axis is added to every coordinate",
                         node.name)
        return True
    what = "data that differs per coordinate" if other.data is not None else \
        "a value that differs per coordinate but no transformation moves" if other.invariant else \
        "a value no rule describes"
    for t in chan.terms:
        w.c.pin(t.ids, f"{what} is added", node.name)
    return False


def _nonzero(data) -> bool:
    if isinstance(data, torch.Tensor):
        return bool((data != 0).any())
    return data != 0


def rule_mul(w, node: fx.Node, spec) -> Value:
    a, b = _self_and_other(w, node)
    if node.meta["val"].is_complex():
        return _complex_product(w, node, _as_value(a), _as_value(b))
    return _product(w, node, a, b, divide=False)


def _complex_product(w, node, a: Value, b: Value) -> Value:
    """Complex channels times known data ``z = p + iq`` (Meta's rotary ``x * freqs_cis``): in the real view the
    real part is ``p x_re - q x_im`` and the imaginary part ``q x_re + p x_im``, a mix of each (re, im) pair
    resolved when consumed. Anything else (a real channel times complex data, two channels) pins."""
    if b.complex or b.chans:
        a, b = b, a
    out_shape = (*_shape_of(node), 2)
    if not a.complex or b.chans or b.complex or b.data is None or any(c.block for c in a.chans):
        return _pin_operands(w, node, [a, b], "complex product this rule does not describe")
    z = torch.as_tensor(b.data).to(torch.complex128).expand(out_shape[:-1])
    keep, cross = torch.stack([z.real, z.real], -1), torch.stack([-z.imag, z.imag], -1)
    chans = []
    for c in a.chans:
        terms = []
        c = c.broadcast_to(out_shape)
        for k, t in enumerate(c.terms):
            coef = c.coef(k).expand(out_shape)
            terms += [Term(t.ids, coef * keep), Term(t.ids.flip(-1), coef.flip(-1) * cross)]
        chans.append(Chan(tuple(terms)))
    return Value(chans=chans, shape=out_shape, complex=True)


def rule_complex_view(w, node: fx.Node, spec) -> Value:
    """``view_as_complex`` / ``view_as_real``: the same labels (a complex value is labelled by its real view)."""
    v = w.value(node.args[0])
    real_shape = _shape_of(node) if spec.to == "real" else v.shape
    if v.complex != (spec.to == "real") or v.points_to is not None or tuple(v.shape) != tuple(real_shape):
        return _pin_moved(w, node, f"view_as_{spec.to} of a value this rule cannot follow")
    return Value(chans=list(v.chans), shape=tuple(real_shape), complex=spec.to == "complex")


def rule_div(w, node: fx.Node, spec) -> Value:
    return _product(w, node, *_self_and_other(w, node), divide=True)


def _product(w, node, a, b, divide: bool) -> Value:
    out_shape = _shape_of(node)
    a, b = _as_value(a), _as_value(b)
    ratio = divide and bool(b.chans)
    if ratio:  # a / b = a * (1 / b), and a coordinate's reciprocal passes its permutations only
        b, divide = replace(b, chans=[_reciprocal(w, node, c) for c in b.chans]), False
    if b.chans and not a.chans and not divide:
        a, b = b, a
    if not b.chans:
        return _scale_by(w, node, a, b, divide, out_shape)
    a_chans = [w.resolve(c, node.name).broadcast_to(out_shape) for c in a.chans]
    b_chans = [w.resolve(c, node.name).broadcast_to(out_shape) for c in b.chans]
    pairs, alone = _pair_by_axes(a_chans, b_chans)
    chans = [_weighted_slices(w, node, ca, cb, a, b, out_shape)
             or _multiply_channels(w, node, ca, cb, out_shape, ratio) for ca, cb in pairs]
    for c, from_a in alone:
        other = b if from_a else a
        if chan_axes(c) & _varying_axes(other, out_shape):
            w.c.pin(c.ids, "multiplied by a value that varies along its axes and carries no matching channel",
                    node.name)
        elif not chan_axes(c) and other.chans:
            # one coordinate times values of other coordinates (a routing weight w[:, e:e+1] times expert e's
            # output): moving it to another coordinate would not bring those values along; pieces concatenated
            # later would label them by it
            w.c.pin(c.ids, "one coordinate multiplying values of other coordinates", node.name)
        else:
            chans.append(c)  # the other factor is the same for every coordinate: a common scale
    return Value(chans=chans, shape=out_shape)


def _weighted_slices(w, node, ca: Chan, cb: Chan, a: Value, b: Value, out_shape) -> Chan | None:
    """Whole spaces stacked along an axis, each slice times its own weight (``gates.unsqueeze(-1) * stacked``):
    the weight varies along the stack axis only, so it scales each slice alike and the product keeps the slices'
    coordinates (a sum over the stack then adds them). The weight's own coordinates would have to move with
    whole slices: pinned, unless the slices are stacked experts that move with them (analysis/experts.py). None
    where the factors are anything else."""
    for x, weight, other, stacked in ((ca, cb, b, "self"), (cb, ca, a, "other")):
        along = chan_axes(weight)
        if not weight.block and along < chan_axes(x) and slices_are_whole_spaces(w.ids, x, along) and \
                not _varying_axes(other, out_shape) & (chan_axes(x) - along):
            axis = next(iter(along))
            if not w.branch_reads.weigh(w, node.name, schema_arg(node, stacked), axis, len(out_shape), [weight], axis,
                                        summed_later=True):
                _pin_chan(w, node, weight, "a weight per slice of spaces stacked along this axis")
            return x
    return None


def _pair_by_axes(a_chans: list[Chan], b_chans: list[Chan]):
    """Channels of two factors that vary along a common axis multiply each other; the rest are alone."""
    pairs, used = [], set()
    for ca in a_chans:
        axes = chan_axes(ca)
        j = next((j for j, cb in enumerate(b_chans) if j not in used and chan_axes(cb) == axes), None)
        if j is None:
            j = next((j for j, cb in enumerate(b_chans) if j not in used and chan_axes(cb) & axes), None)
        if j is not None:
            used.add(j)
            pairs.append((ca, b_chans[j]))
    paired_a = {id(ca) for ca, _ in pairs}
    alone = [(c, True) for c in a_chans if id(c) not in paired_a]
    alone += [(c, False) for j, c in enumerate(b_chans) if j not in used]
    return pairs, alone


def _moves_alike(c: Chan, v: Value, out_shape) -> bool:
    """Whether channel-less ``v`` meets ``c`` only where it is the same for every coordinate of ``c``, or where it
    follows ``c``'s own rows (a per-head norm of those heads). An invariant value that differs per head for
    another reason stays put when the heads move: WavLM gates head h's position bias by a value read from residual
    coordinates [h d, (h + 1) d), and permuting the heads without it changed the outputs. A mixed channel (rotary
    q) passes where each term reads the coordinates of the same rows: the statistic's reduction resolved the mixing,
    and a factor constant over a row commutes with any map within it."""
    axes = chan_axes(c) & _varying_axes(v, out_shape)
    if not axes:
        return True
    if not v.invariant or v.follows is None:
        return False
    rows = v.follows.expand(out_shape)
    tracked = varying_axes(rows)
    if not axes <= tracked or not _terms_read_same_rows(c, chan_axes(c) - tracked, out_shape):
        return False
    ids = c.ids.expand(out_shape)
    for a in chan_axes(c) - tracked:  # the axes the reduction summed: compare each row by its first id
        ids, rows = ids.narrow(a, 0, 1), rows.narrow(a, 0, 1)
    ids, rows = collapse_pair(ids, rows)
    return torch.equal(ids, rows)


def _terms_read_same_rows(c: Chan, summed: frozenset[int], out_shape) -> bool:
    """Whether each term of ``c`` holds, in every row over the ``summed`` axes, its first term's coordinates."""
    def row_sets(t: Term) -> torch.Tensor:
        ids = t.ids.expand(out_shape)
        kept = [a for a in range(ids.dim()) if a not in summed]
        return ids.permute(*kept, *sorted(summed)).reshape(*[ids.shape[a] for a in kept], -1).sort(-1).values

    first = row_sets(c.terms[0])
    return all(torch.equal(row_sets(t), first) for t in c.terms[1:])


def _varying_axes(v: Value, out_shape) -> frozenset[int]:
    """Axes of the broadcast output along which ``v``'s values may vary (all but its size-1 axes and the axes an
    expand repeated it along)."""
    if v.shape is None:
        return frozenset(range(len(out_shape)))
    shift = len(out_shape) - len(v.shape)
    return frozenset(a + shift for a, n in enumerate(v.shape) if n > 1 and a not in v.constant_axes)


def _scale_by(w, node, a: Value, b: Value, divide: bool, out_shape) -> Value:
    """A channel times data, a per-row statistic, or a scalar."""
    data = b.data
    if data is None:  # unknown or invariant values: fine only for channels along which they cannot vary
        what = "a value that no transformation moves (computed by a reduction or from pinned coordinates)" \
            if b.invariant else "a value no rule describes"
        kept = []
        for c in a.chans:
            c = c.broadcast_to(out_shape)
            if not _moves_alike(c, b, out_shape):
                for t in c.terms:
                    w.c.pin(t.ids, f"multiplied by {what} that varies along this axis", node.name)
            else:
                kept.append(c)
        return Value(chans=kept, shape=out_shape)
    coef = data if isinstance(data, torch.Tensor) else torch.tensor(float(data))
    coef = coef.to(torch.float64)
    if divide:
        coef = 1.0 / coef
    chans = []
    for c in a.chans:
        c = c.broadcast_to(out_shape)
        if c.block and not c.mixed and data_varies(coef, chan_axes(c), out_shape):
            # data that differs per head (RetNet's decay rates) stays when the heads move: no head permutation;
            # what each head computes from its own coordinates is unchanged
            w.c.pin(c.ids, "multiplied by data that differs from head to head", node.name)
        elif c.mixed or data_varies(coef, chan_axes(c), out_shape):
            c = c.scaled(coef.expand(out_shape) if coef.dim() else coef)
        else:  # the same for all coordinates: no transformation sees it, a later sum of terms does
            c = c.times(coef.expand(out_shape) if coef.dim() else coef)
        chans.append(c)
    return Value(chans=chans, shape=out_shape)


def _reciprocal(w, node, c: Chan) -> Chan:
    """``1 / c``, read as a factor: a head block stays one; coordinates keep their permutations only."""
    c = w.resolve(c, node.name)
    if not c.block:
        w.c.restrict(c.ids, NEUTRAL, "divided by this coordinate", node.name)
    return replace(c, degree=1, weight=False, uniform=False)


def _multiply_channels(w, node, ca: Chan, cb: Chan, out_shape, ratio: bool = False) -> Chan:
    """``a * b`` coordinate-wise; ``ratio``: ``b`` is the reciprocal of a divisor (:func:`_reciprocal`)."""
    ca, cb = ca.broadcast_to(out_shape), cb.broadcast_to(out_shape)
    if ca.block or cb.block:
        w.c.tie(ca.ids, cb.ids, node=node.name)
        return ca
    if torch.equal(ca.ids, cb.ids):
        if not ratio:
            return replace(ca, degree=2)
        w.c.restrict(ca.ids, NEUTRAL, "divided by a value of the same coordinate", node.name)
        return replace(ca, degree=1)  # x / f(x): coordinate-wise, no square
    weight = next((c for c in (ca, cb) if c.weight), None)
    if weight is not None and _holds_uniform(w, node, [weight]):
        return cb if weight is ca else ca
    if weight is not None:
        w.c.permute_only.append(_ids_of(weight))
        limit, why = monomial("nonzero"), "multiplied elementwise by a weight vector"
    else:  # both factors scale with the coordinate: only a permutation moves them alike
        limit, why = NEUTRAL, "elementwise product of two activations"
    return _product_output(w, node, ca, cb, limit, why)


def _holds_uniform(w, node, weight_chans) -> bool:
    """A weight vector known to hold one number everywhere scales every coordinate alike: the product moves like
    its other factor, and the weight is pinned (it keeps its value under every transformation; with entries that
    differ the group would be smaller)."""
    if not weight_chans or not all(c.uniform for c in weight_chans):
        return False
    for c in weight_chans:
        w.c.pin(c.ids, "weight vector of one number everywhere (a folded norm): it keeps its value, and the stream "
                       "it multiplies keeps its full group", node.name)
    return True


def _product_output(w, node, ca: Chan, cb: Chan, limit, why: str) -> Chan:
    """``out = a * b`` coordinate-wise: one permutation for all three, scales related by s_out = s_a + s_b."""
    out = _fresh_like(w, node, ca, cb)
    for factor in (ca, cb):
        w.c.tie(out.ids, factor.ids, product=PRODUCT_WEIGHT if factor.weight else PRODUCT_FACTOR,
                node=node.name)
    triple = torch.broadcast_tensors(out.ids, ca.ids, cb.ids)
    shared = tuple(slice(0, 1) if all(t.stride(x) == 0 for t in triple) else slice(None)
                   for x in range(triple[0].dim()))
    w.c.products.append((*(t[shared].numpy() for t in triple), node.name))
    w.c.restrict(out.ids, limit, why, node.name, scales=False)
    return out


def _fresh_like(w, node, ca: Chan, cb: Chan) -> Chan:
    """New activation ids, one per distinct pair of factor labels (a weight shared across heads times
    per-head values gives one output coordinate per head and position)."""
    full_shape = torch.broadcast_shapes(ca.ids.shape, cb.ids.shape)
    a, b = collapse_pair(ca.ids, cb.ids)  # labels repeat over batch and sequence: label the distinct ones
    pairs = torch.stack([a.reshape(-1), b.reshape(-1)], 1)
    uniq, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    if len(uniq) == 1 and bool((uniq >= 0).all()):
        # one coordinate times one coordinate: the same product wherever it is formed (its ids are tied to the
        # factors' alike), so one id for all; fresh ids at every layer's q.k doubled the single coordinates
        # Funnel's token types carry into the stream at each layer (12 layers: over 15 minutes of analysis)
        key = tuple(int(x) for x in uniq[0])
        if all(k in w.c.pinned for k in key):
            # no group moves either factor, so none moves the product: one pinned id for every such product, or
            # Funnel's token types, pinned where data chooses them, formed powers of each other at every layer
            key = PINNED_PRODUCT
        if key not in w.single_products:
            w.single_products[key] = int(_fresh_per_range(w, uniq)[0])
            if key == PINNED_PRODUCT:
                w.c.pin(w.single_products[key], "a product of pinned coordinates", node.name)
        fresh = torch.tensor([w.single_products[key]])
    else:
        fresh = _fresh_per_range(w, uniq)
    valid = (pairs >= 0).all(1)
    labels = torch.where(valid, fresh[inverse], torch.full_like(inverse, -1))
    return Chan.clean(labels.reshape(a.shape).expand(full_shape))


def _fresh_per_range(w, pairs: torch.Tensor) -> torch.Tensor:
    """One new id per row of ``pairs``, from a new range per pair of the factors' ranges: coordinates of spaces
    kept apart stay apart (:func:`_reorders` tells them apart by range: a class token, register tokens and patch
    rows normalised together repeat along the sequence unlike one another, yet no cut split any of them)."""
    key = torch.from_numpy(w.ids.range_index(pairs.clamp(min=0).numpy()))
    key[(pairs < 0).any(1)] = -1
    keys, which = torch.unique(key, dim=0, return_inverse=True)
    fresh = torch.empty(len(pairs), dtype=torch.int64)
    for k in range(len(keys)):
        fresh[which == k] = w.ids.allocate(int((which == k).sum()))
    return fresh


def _ids_of(chan: Chan):
    ids = collapse(chan.ids).reshape(-1)
    return torch.unique(ids[ids >= 0]).numpy()


# -- normalisation, reductions, softmax --------------------------------------------------------------------
def rule_layer_norm(w, node: fx.Node, spec) -> Value | list[Value]:
    args = _schema_args(node)
    x, normalized = w.value(args["input"]), list(args["normalized_shape"])
    weight, bias = w.value(args["weight"]), w.value(args.get("bias"))  # rms_norm has no bias
    out_shape = _shape_of(node, 0 if isinstance(node.meta.get("val"), (list, tuple)) else None)  # native: 3 outputs
    rank = len(out_shape)
    norm_axes = frozenset(range(rank - len(normalized), rank))
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        axes = chan_axes(c)
        if axes & norm_axes and not c.block:
            _normalise(w, node, c, norm_axes, Restriction(orthogonal=True, fixes_ones=spec.centres))
            w.c.tag("normalised", c.ids)
        elif not c.block:
            _each_coordinate_along_another_axis(w, node, c, "normalisation")
        chans.append(c)
    return _with_saved_stats(node, _affine_output(w, node, chans, weight, bias, norm_axes, out_shape))


def rule_group_norm(w, node: fx.Node, spec) -> Value | list[Value]:
    """``group_norm(x, G, weight, bias)`` over channel axis 1: the channels split into G consecutive groups, each
    centred and scaled over its channels and every position; then a weight and a bias per channel. Within a group
    the channels pass what a LayerNorm over them passes (orthogonal maps fixing the ones vector); groups do not
    mix."""
    args = _schema_args(node)
    x, groups = w.value(args["input"]), args["num_groups"]
    out_shape = _shape_of(node)
    if groups == out_shape[1]:  # one channel per group: an instance norm
        return _per_channel_norm(w, node, x, w.value(args.get("weight")), w.value(args.get("bias")), out_shape)
    grouped = (out_shape[0], groups, out_shape[1] // groups, *out_shape[2:])
    spatial = frozenset(range(2, len(out_shape)))
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        axes = chan_axes(c)
        if axes & (spatial | {1}) and not c.block:  # normalised over the group's channels and the positions
            normalised = frozenset({2} | {a + 1 for a in axes & spatial})
            _normalise(w, node, c.map(lambda t: t.reshape(grouped)), normalised,
                       Restriction(orthogonal=True, fixes_ones=True))
        chans.append(c)
    view = [1, -1] + [1] * (len(out_shape) - 2)
    weight, bias = (_on_channel_axis(w.value(args.get(k)), view) for k in ("weight", "bias"))
    return _affine_output(w, node, chans, weight, bias, spatial | {1}, out_shape)


def _on_channel_axis(param: Value | None, view: list[int]) -> Value | None:
    """A per-channel vector parameter laid along axis 1 (``view``: its shape for broadcasting there)."""
    if param is None:
        return None
    return Value(chans=[c.map(lambda t: t.reshape(view)) for c in param.chans])


def _affine_output(w, node, chans: list[Chan], weight: Value | None, bias: Value | None, norm_axes,
                   out_shape) -> Value:
    """A normalisation's output: the normalised input ``chans`` times the affine ``weight``, plus ``bias``.
    Normalising data (no channel in), the affine part may not be transformed."""
    if not chans and weight is not None:
        for p in (weight, bias):
            if p is not None:
                for c in p.chans:
                    w.c.pin(c.ids, "affine weight of a normalisation applied to input data", node.name)
        return Value(chans=[c.broadcast_to(out_shape) for c in weight.chans], shape=out_shape)
    chans = [c.broadcast_to(out_shape) for c in chans]
    if weight is not None and _holds_uniform(w, node, weight.chans):
        weight = None
    if weight is not None:
        chans = _affine_part(w, node, chans, weight, norm_axes, out_shape, scale=True)
    if bias is not None:
        chans = _affine_part(w, node, chans, bias, norm_axes, out_shape, scale=False)
    return Value(chans=chans, shape=out_shape)


def rule_batch_norm(w, node: fx.Node, spec) -> Value | list[Value]:
    """Eval-mode batch norm ``(x - mean) / sqrt(var + eps) * weight + bias`` over channel axis 1.

    A channel permutation moves weight, bias and both running statistics with the channel. The input may flip
    sign per channel (the running mean flips with it, the output follows) but not scale (``eps`` breaks it);
    the output scale is traded with weight and bias like a norm weight's. Statistics are buffers: they get
    coordinate ids here. Batch statistics (training mode, no running statistics): :func:`_batch_statistics_norm`.
    Inputs that vary along other axes pin.
    """
    args = _schema_args(node)
    x, weight, bias = w.value(args["input"]), w.value(args.get("weight")), w.value(args.get("bias"))
    out_shape = tuple(node.meta["val"][0].shape if isinstance(node.meta["val"], (list, tuple))
                      else node.meta["val"].shape)
    stats = [w.cap.buffers.get(getattr(args.get(k), "name", None)) for k in ("running_mean", "running_var")]
    if args.get("training") and args.get("running_mean") is None and args.get("running_var") is None:
        return _with_saved_stats(node, _batch_statistics_norm(w, node, x, weight, bias, out_shape))
    inputs = [ids for ids in (_input_channel_ids(w, node, c) for c in x.chans) if ids is not None]
    if args.get("training") or None in stats or len(inputs) != 1:
        _pin_operands(w, node, [x, weight, bias], "batch norm in training mode, or without running statistics, "
                                                  "or on a channel it cannot follow")
        return _with_saved_stats(node, Value(shape=out_shape))
    ids = inputs[0]
    mean, var = (w.buffer_ids(name, len(ids)) for name in stats)
    w.c.tie(mean, ids)
    w.c.tie(var, ids, product=PRODUCT_WEIGHT)
    w.c.permute_only.append(var.numpy())
    w.c.restrict(ids, monomial("sign"), "batch norm subtracts a running mean and divides by sqrt(var + eps)",
                 node.name)
    return _with_saved_stats(node, _per_channel_affine(w, node, ids, weight, bias, out_shape))


def _batch_statistics_norm(w, node, x: Value, weight: Value | None, bias: Value | None, out_shape) -> Value:
    """Batch norm on the statistics of its own input, with no running statistics: each channel of axis 1 centred
    and scaled over every other axis (BiT's weight standardisation, ``batch_norm(w.reshape(1, out, -1), None, None,
    training=True)``, normalises each filter over its inputs). A channel along axis 1 alone permutes and flips sign
    (as in an instance norm); one along the normalised axes only takes the maps a LayerNorm over them passes
    (orthogonal, fixing the ones vector: a filter's mean and spread over its inputs stay); any other pins."""
    normalised = frozenset(range(len(out_shape))) - {1}
    channel, others = None, []
    for c in x.chans:
        c = w.resolve(c, node.name)
        axes = chan_axes(c)
        if axes and axes <= normalised and not c.block and not c.mixed and c.degree == 1:
            _normalise(w, node, c, axes, Restriction(orthogonal=True, fixes_ones=True))
            others.append(c.broadcast_to(out_shape))
        elif axes == {1} and channel is None:
            channel = _input_channel_ids(w, node, c)
        else:
            _pin_chan(w, node, c, "normalised on batch statistics together with channels it cannot follow")
    if channel is None:
        _pin_operands(w, node, [weight, bias], "affine part of a per-channel norm of no single channel")
        return Value(chans=others, shape=out_shape)
    w.c.restrict(channel, monomial("sign"), "centred and scaled over every other axis", node.name)
    return Value(chans=_per_channel_affine(w, node, channel, weight, bias, out_shape).chans + others,
                 shape=out_shape)


def rule_instance_norm(w, node: fx.Node, spec) -> Value | list[Value]:
    """Instance norm: each channel (axis 1) of each sample centred and scaled over its own positions, then a weight
    and a bias per channel. Channels permute and flip sign (``IN(-x) = -IN(x)``), never mix; with running
    statistics in use (``use_input_stats`` false: eval with tracked statistics) it is an eval batch norm."""
    args = _schema_args(node)
    if not args.get("use_input_stats", True):
        return rule_batch_norm(w, node, spec)
    x, weight, bias = w.value(args["input"]), w.value(args.get("weight")), w.value(args.get("bias"))
    return _per_channel_norm(w, node, x, weight, bias, _shape_of(node))


def _per_channel_norm(w, node, x: Value, weight: Value | None, bias: Value | None, out_shape) -> Value:
    """Each channel of axis 1 normalised by statistics over its own positions (instance norm; a group norm with one
    channel per group): signed permutations of the channels, the affine part moving with them."""
    inputs = [ids for ids in (_input_channel_ids(w, node, c) for c in x.chans) if ids is not None]
    if len(inputs) != len(x.chans) or len(inputs) != 1:
        for ids in inputs:
            w.c.pin(ids, "normalised per channel together with other channels it cannot follow", node.name)
        return _pin_operands(w, node, [weight, bias], "affine part of a per-channel norm of no single channel")
    w.c.restrict(inputs[0], monomial("sign"), "centred and scaled over its own positions", node.name)
    return _per_channel_affine(w, node, inputs[0], weight, bias, out_shape)


def _per_channel_affine(w, node, ids: torch.Tensor, weight: Value | None, bias: Value | None, out_shape) -> Value:
    """A normalised channel axis 1 (``ids``) times a weight and plus a bias per channel."""
    view = [1, -1] + [1] * (len(out_shape) - 2)
    out = Chan.clean(ids.reshape(view).expand(out_shape))
    if weight is not None:
        kernel = replace(Chan.clean(_channel_ids(weight, 0).reshape(view).expand(out_shape)), weight=True)
        w.c.permute_only.append(_ids_of(kernel))
        out = _product_output(w, node, out, kernel, monomial("nonzero"), "multiplied by the norm weight")
    if bias is not None:
        w.c.tie(out.ids, _channel_ids(bias, 0).reshape(view).expand(out_shape), node=node.name)
    return Value(chans=[out], shape=out_shape)


def _with_saved_stats(node: fx.Node, out: Value) -> Value | list[Value]:
    """The native norm ops also return saved statistics (plain data here)."""
    return [out, Value(), Value()] if isinstance(node.meta.get("val"), (list, tuple)) else out


def _affine_part(w, node, chans: list[Chan], param: Value, norm_axes, out_shape, *, scale: bool) -> list[Chan]:
    """Multiply by the norm weight (``scale``) or add its bias, channel by channel along shared axes. A weight
    or bias channel that meets no channel of the input, or an input channel along the normalised axes that meets
    none of the parameter's, would be left out of every constraint: it is pinned. Head blocks pass."""
    coords = [c for c in chans if not c.block]
    pairs, alone = _pair_by_axes(coords, [pc.broadcast_to(out_shape) for pc in param.chans])
    out = [c for c in chans if c.block]
    for c, pc in pairs:
        if scale:
            w.c.permute_only.append(_ids_of(pc))
            out.append(_product_output(w, node, c, pc, monomial("nonzero"),
                                       "multiplied elementwise by the norm weight"))
        else:
            w.c.tie(c.ids, pc.ids, node=node.name)
            out.append(c)
    for c, from_input in alone:
        if from_input and not chan_axes(c) & norm_axes:
            out.append(c)  # the parameter is the same for every coordinate of this channel
        else:
            w.c.pin(c.ids, f"norm {'weight' if scale else 'bias'} and input channels do not line up", node.name)
    return out


def _normalise(w, node, chan: Chan, axes: frozenset[int], restriction: Restriction) -> None:
    ids = chan.ids
    rows = unique_rows(ids, sorted(axes))
    w.c.separate(rows, node.name)
    w.c.take_rows(rows, node.name)
    # one statistic over these coordinates: no map may mix them with coordinates of their space it leaves out
    # (the units a slice cut away: ``c[..., :3].sum(-1)`` permutes the three, never with the other two)
    w.c.passes_through(ids, node.name)
    if restriction.fixes_ones:
        w.c.centre(rows, node.name)
    w.c.restrict(ids, restriction, "normalised over this axis", node.name)


def rule_weight_norm(w, node: fx.Node, spec) -> Value:
    """``_weight_norm(v, g, dim)`` = ``v * g / ||v||`` (nn.utils weight norm), the norm taken over every axis but
    ``dim`` (over all of them for dim -1). Along ``dim`` each slice of v is scaled to its entry of g: v's and g's
    coordinates there move together, permutations only (v's own scale vanishes in the norm, g's does not). The
    normalised axes keep v's coordinates, and orthogonal maps of each pass, as through any sum of squares."""
    args = _schema_args(node)
    v, g = w.value(args["v"]), w.value(args["g"])
    rank, dim = len(v.shape), args.get("dim", 0)
    dim = None if dim == -1 else dim % rank
    chans = []
    for c in v.chans:
        c = w.resolve(c, node.name)
        axes = chan_axes(c)
        if c.block or c.mixed or len(axes) != 1:
            _pin_chan(w, node, c, "weight norm of a tensor this rule cannot follow")
        elif axes == {dim}:
            scales = [s for s in g.chans if chan_axes(s) == {dim} and not s.mixed]
            if len(scales) != 1:
                _pin_chan(w, node, c, "weight norm whose scales this rule cannot follow")
                continue
            w.c.tie(ids_along(c.ids, dim), ids_along(scales[0].ids, dim), node=node.name)
            w.c.restrict(c.ids, NEUTRAL, "rows of a weight norm, each scaled to its own g", node.name)
            chans.append(c)
        else:
            w.c.restrict(c.ids, ORTHOGONAL, "normalised by a weight norm", node.name)
            chans.append(c)
    for s in g.chans:
        if chan_axes(s) != {dim}:
            _pin_chan(w, node, s, "weight norm scale along an axis of size one")
    return Value(chans=chans, shape=_shape_of(node))


def rule_reduce(w, node: fx.Node, spec) -> Value | list[Value]:
    """Sums and means over axes; with the spec's ``norm``, a vector norm over them, whose coordinates count as
    squared where its ``ord`` is 2 (orthogonal maps pass, as through a sum of squares) and which passes signed
    permutations for any other ``ord``; with ``order_free``, another statistic blind to the order of the entries
    (variance, maximum, logsumexp), which only permutations leave unchanged, squared coordinates included.
    Statistics returned together (``var_mean``) are alike: one value per result."""
    args = _schema_args(node)
    x, dims = w.value(args["self"]), args.get("dim")  # sum.default and mean.default have no dim: every axis
    euclidean = spec.norm and args.get("ord", 2) == 2
    rank = len(x.shape)
    axes = frozenset(range(rank)) if not dims else frozenset(d % rank for d in dims)  # dim=[]: every axis too
    keepdim = bool(args.get("keepdim", False))
    results = len(node.meta["val"]) if isinstance(node.meta.get("val"), (tuple, list)) else 0
    out_shape = _shape_of(node, 0 if results else None)
    passed, invariant, rows = [], False, []
    centring = is_centring_mean(node)  # read only as x - mean(x): restricted there (rule_sub), not here
    for c in x.chans:
        c = w.resolve(c, node.name)
        caxes = chan_axes(c)
        if not (caxes & axes):
            if spec.order_free or spec.norm:  # not linear, as a sum or a mean would be
                _each_coordinate_along_another_axis(w, node, c, "a statistic")
            passed.append(_drop_axes(c, axes, keepdim, out_shape))
            continue
        if not (spec.order_free or spec.norm or centring) and slices_are_whole_spaces(w.ids, c, axes & caxes):
            passed.append(_slices_added(w, node, c, axes, keepdim, out_shape))
            w.branch_reads.summed(node.name, args["self"], next(iter(axes & caxes)), rank)
            continue
        rows.append(_drop_axes(c, axes, keepdim, out_shape).ids)
        if centring:
            invariant = True
            continue
        if c.block:
            invariant = True  # a sum over heads does not see their order
            _pin_grouped_heads(w, node, c, axes & caxes, "reduced over groups of heads")
            continue
        if spec.norm and (c.mixed or c.degree != 1):
            _pin_chan(w, node, c, "a vector norm of products or squares")
        elif (c.degree == 2 or euclidean) and not spec.order_free:
            _normalise(w, node, c, axes & caxes, ORTHOGONAL)
        elif spec.norm:
            _normalise(w, node, c, axes & caxes, monomial("sign"))
        else:
            _permuted_within_rows(w, node, c, axes & caxes, "reduced over this axis")
        invariant = True
    follows = rows[0] if len(rows) == 1 and varying_axes(rows[0]) else None
    value = Value(chans=passed, shape=out_shape, invariant=invariant and not passed,
                  follows=follows if invariant and not passed else None)
    return [value] * results if results else value


def _slices_added(w, node, c: Chan, axes, keepdim, out_shape) -> Chan:
    """The slices tied, as ``add`` ties its operands: the sum carries the first slice's coordinates on (a weight
    per slice, the same for each of its coordinates, scales them all alike)."""
    return _drop_axes(tie_slices(w, c, next(iter(axes & chan_axes(c))), node.name), axes, keepdim, out_shape)


def _drop_axes(c: Chan, axes, keepdim, out_shape) -> Chan:
    def drop(t):
        index = tuple(slice(0, 1) if a in axes else slice(None) for a in range(t.dim()))
        t = t[index]
        return t.reshape(out_shape) if not keepdim else t

    return c.map(drop)


def rule_softmax(w, node: fx.Node, spec) -> Value:
    x = w.value(schema_arg(node, "self"))
    return _softmax_value(w, node, x, schema_arg(node, "dim") % len(x.shape))


def _softmax_value(w, node, x: Value, axis: int) -> Value:
    """Each row along ``axis`` normalised on its own: coordinates permute within a row (rows are kept apart, as a
    reduction keeps them: ``view(4, 8).softmax(-1)`` normalises 4 groups of 8 units, and ``chunk`` halves
    softmaxed by two nodes), heads only where every row holds all of them."""
    chans = []
    for c in x.chans:
        c = w.resolve(c, node.name)
        if axis in chan_axes(c):
            if c.block:
                _pin_grouped_heads(w, node, c, {axis}, "a softmax over groups of heads")
            else:
                _permuted_within_rows(w, node, c, {axis}, "softmax over this axis")
        else:
            _each_coordinate_along_another_axis(w, node, c, "softmax")
        chans.append(c)
    return Value(chans=chans, shape=x.shape)


def _each_coordinate_along_another_axis(w, node, c: Chan, what: str) -> None:
    """``c``'s coordinates each taken through a nonlinear statistic of their own entries along an axis they do not
    vary along (a softmax, a maximum or a layer norm over tokens, per hidden unit): an activation of each
    coordinate, which only permutations pass."""
    w.c.restrict(c.ids, NEUTRAL, f"{what} of each coordinate along another axis", node.name)


def _permuted_within_rows(w, node, c: Chan, axes, why: str) -> None:
    """``c``'s coordinates taken a row along ``axes`` at a time by a statistic blind to their order (a sum, a
    maximum, a softmax): they permute within their row only, and coordinates that pass different such nodes (a
    ``chunk``'s halves, each reduced on its own, then joined) never mix (see _normalise)."""
    rows = unique_rows(c.ids, sorted(axes))
    w.c.separate(rows, node.name)
    w.c.take_rows(rows, node.name)
    w.c.passes_through(c.ids, node.name)
    w.c.restrict(c.ids, NEUTRAL, why, node.name)


def _pin_grouped_heads(w, node, c: Chan, axes, why: str) -> None:
    """Heads (a block channel) reduced or softmaxed along ``axes`` in groups (heads viewed as (2, H / 2), a
    softmax over each half) are not free to move between the groups: pinned (kept out of the head group). Every
    row holding the same heads (a sum over all of them) leaves their order free."""
    rows = [set(row[row >= 0].tolist()) for row in unique_rows(c.ids, sorted(axes))]
    if all(len(heads) <= 1 for heads in rows):
        return  # each row one head's own entries (a sink logit beside its scores): no head meets another
    if any(heads != rows[0] for heads in rows) or not _all_heads(w, rows[0]):
        _pin_chan(w, node, c, why)


def _all_heads(w, held: set[int]) -> bool:
    """Whether ``held`` (head ids) holds every head of each attention op it holds heads of: heads split by
    ``chunk`` and reduced piece by piece are reduced in groups too."""
    low, high = min(held), max(held)
    return all(set(range(r.start, r.start + r.size)) <= held for r in w.ids.ranges
               if r.block and r.start <= high and low < r.start + r.size)


def rule_where(w, node: fx.Node, spec) -> Value:
    """``where(cond, x, y)`` / ``masked_fill(x, mask, value)``: each output element is x or y, chosen by data.

    The chosen values are tied like an addition; a condition that differs between coordinates would apply the
    transformation to some coordinates and not others, so it pins them. An invariant condition known to be equal
    across blocks of coordinates (a routing mask per group of experts) keeps those blocks apart instead.
    """
    args = _schema_args(node)
    cond, (x, y) = args[spec.condition], (args[name] for name in spec.choices)
    out_shape = _shape_of(node)
    cond_value = w.value(cond) if isinstance(cond, fx.Node) else None
    whole_rows = spec.packed and _scatters_whole_rows(cond_value, x, out_shape)
    x, y = _as_value(_operand(w, x)), _as_value(_operand(w, y))
    if spec.packed:
        x = _unpacked(w, node, x, whole_rows, out_shape)
    out = _add_values(w, node, x, y, residual=False, out_shape=out_shape)
    own = _condition_on_own_coordinate(w, node, cond_value, out.chans, out_shape)
    if own is not None:  # where(x > 0, f(x), g(x)): a piecewise activation, permutations only
        if not own.block:
            w.c.restrict(own.ids, NEUTRAL, "chosen by a condition on the coordinate's own value", node.name)
        return out
    if cond_value is not None:
        _pin_value(w, node, cond_value, "a condition that differs per coordinate")
    _pin_chosen_single_coordinates(w, node, cond_value, x, y, out_shape)
    for c in out.chans:
        if cond_value is not None and not cond_value.chans and cond_value.data is None and cond_value.invariant \
                and cond_value.classes is not None and not c.mixed:
            blocks = blocks_kept_by(c.ids.expand(out_shape), cond_value.classes.expand(out_shape), chan_axes(c))
            if blocks is not None:
                w.c.separate(blocks, node.name)
                continue
        if whole_rows and chan_axes(c) <= {len(out_shape) - 1}:
            continue  # every coordinate of a row chosen alike
        if cond_value is None or cond_value.chans or data_varies(cond_value.data, chan_axes(c), out_shape):
            for t in c.terms:
                w.c.pin(t.ids, "selected per coordinate by a condition", node.name)
    return out


def _scatters_whole_rows(cond: Value | None, packed, out_shape) -> bool:
    """Whether ``masked_scatter`` puts whole rows of its ``packed`` source (a graph node) into whole rows of the
    output's last axis: the source's rows are as wide, and the condition, without channels, is the same along that
    axis at every input (known data that does not vary there, or a mask broadcast along it:
    ``mask.unsqueeze(-1).expand_as(x)``)."""
    packed_shape = _shape_of(packed) if isinstance(packed, fx.Node) else None
    if not packed_shape or packed_shape[-1] != out_shape[-1] or cond is None or cond.chans or cond.shape is None:
        return False
    if cond.data is not None:
        return not data_varies(cond.data, frozenset({len(out_shape) - 1}), out_shape)
    return cond.shape[-1] == 1 or len(cond.shape) - 1 in cond.constant_axes


def _unpacked(w, node, packed: Value, whole_rows: bool, out_shape) -> Value:
    """``masked_scatter``'s source as the values it puts at the chosen positions of the output: its elements fill
    them in order, so where it puts ``whole_rows`` (:func:`_scatters_whole_rows`), row k of the source fills the
    k-th chosen row. A channel of the source that varies along its last axis alone labels every row alike and so
    labels every chosen row so (Llava's image features scattered into the text stream at image tokens); any other
    channel pins: which coordinate lands where then depends on how many positions the data chooses."""
    last = len(out_shape) - 1
    chans = []
    row = (1,) * last + (-1,)

    def first_row(t: torch.Tensor) -> torch.Tensor:  # every row alike: the first, put on every row of the output
        return t if t.dim() == 0 else t.reshape(-1, t.shape[-1])[0].reshape(row).expand(out_shape)

    for c in packed.chans:
        tensors = [t for term in c.terms for t in (term.ids, term.coef, term.src) if t is not None]
        tensors += [c.factor] if c.factor is not None else []
        if whole_rows and not c.block and all(not varying_axes(t) - {t.dim() - 1} for t in tensors):
            chans.append(c.map(first_row))
        else:
            _pin_chan(w, node, c, "scattered into the positions a mask chooses in an order that does not keep its "
                                  "coordinates apart")
    return Value(chans=chans)


def _pin_chosen_single_coordinates(w, node, cond: Value | None, x: Value, y: Value, out_shape) -> None:
    """Pin each coordinate one branch carries at every position (a channel of one coordinate) and the other does
    not, where both carry coordinates and data chooses between them position by position (Funnel's token types:
    ``where(same_type, seg[1], seg[0])``). The output holds one coordinate at some positions and the other
    elsewhere, so no map of either alone moves it; unpinned until the model's output, their products formed new
    coordinates at every layer."""
    if not x.chans or not y.chans or cond is None or cond.chans or not data_varies(
            cond.data, frozenset(range(len(out_shape))), out_shape):
        return
    x_single, y_single = by_one_coordinate(x.chans), by_one_coordinate(y.chans)
    for coordinate in set(x_single) ^ set(y_single):
        w.c.pin(np.array([coordinate]), "chosen at some positions only, by data, beside other coordinates",
                node.name)


def _condition_on_own_coordinate(w, node, cond: Value | None, chans: list[Chan], out_shape) -> Chan | None:
    """The one chosen channel when the condition carries one channel along the same axes (computed elementwise
    from a coordinate: each output element is chosen by that coordinate's value, whichever way coordinates move).
    The two are tied: the same labels already (``where(h > 0, h, 0.01 * h)``), or labels the branches' products
    renamed (xIELU: ``where(h > 0, a * h * h + b * h, ...)`` with a parameter ``a``), or another coordinate that
    must then move with the chosen one."""
    if cond is None or len(cond.chans) != 1 or len(chans) != 1:
        return None
    c, k = chans[0], w.resolve(cond.chans[0], node.name)
    if c.mixed or k.mixed or c.block != k.block:
        return None
    chosen, condition = c.ids.expand(out_shape), k.ids.expand(out_shape)
    if torch.equal(chosen, condition):
        return c
    if c.block or chan_axes(c) != chan_axes(k) or bool((chosen < 0).any() or (condition < 0).any()):
        return None
    w.c.tie(chosen, condition, node=node.name)
    return c


_BAG_MAX = 2  # embedding_bag's ``mode``: 0 sum, 1 mean, 2 max


def rule_embedding(w, node: fx.Node, spec) -> Value | list[Value]:
    """Rows of the table picked by input ids; the column axis carries the table's channels to the output's last
    axis. ``embedding_bag`` (a tuple: the bags, then index bookkeeping) sums, averages (any linear map of columns
    passes) or takes the largest (permutations and positive scales pass) of each bag's rows, optionally weighted
    per sample. Indices that point into a labelled axis (``table[h.argmax(-1)]``) pick the row of the coordinate
    they chose: the rows move with that axis."""
    table = w.value(schema_arg(node, "weight"))
    val = node.meta.get("val")
    bag = isinstance(val, (list, tuple))
    out_shape = concrete_shape(val[0].shape) if bag else _shape_of(node)
    pointed = w.value(schema_arg(node, "indices")).points_to
    chans = []
    for c in table.chans:
        if 0 in chan_axes(c) and _rows_follow(c, pointed, bag):
            w.c.tie(ids_along(c.ids, 0), pointed, node=node.name)
            pointed = None
            continue
        if 0 in chan_axes(c):
            w.c.pin(c.ids, "embedding rows are selected by input ids", node.name)
            continue
        ids = c.ids[0]  # (D,)
        view = [1] * (len(out_shape) - 1) + [ids.shape[0]]
        chans.append(Chan.clean(ids.reshape(view).expand(out_shape)))
        if bag and schema_arg(node, "mode") == _BAG_MAX:
            w.c.restrict(ids, monomial("positive"), "the largest of each bag's rows, per column", node.name)
    if pointed is not None:
        w.c.pin(pointed, "indices into this axis pick rows of a table that cannot follow them", node.name)
    if not bag:
        return Value(chans=chans, shape=out_shape)
    weights = schema_arg(node, "per_sample_weights")
    _pin_value(w, node, w.value(weights) if isinstance(weights, fx.Node) else None,
               "per-sample weights of an embedding bag")
    return [Value(chans=chans, shape=out_shape)] + [Value(shape=concrete_shape(v.shape)) for v in val[1:]]


def _rows_follow(c: Chan, pointed: torch.Tensor | None, bag: bool) -> bool:
    """Whether a table's channel ``c`` is its rows alone, as many as the coordinates ``pointed`` indices choose."""
    return (pointed is not None and not bag and chan_axes(c) == {0} and not c.mixed and not c.block
            and c.ids.shape[0] == len(pointed))


# -- routing: top-k, one-hot, gather by routed index ---------------------------------------------------------
def _one_along(t: torch.Tensor, dim: int, out_shape) -> torch.Tensor:
    """Labels constant along ``dim``, laid out as a result of ``out_shape`` that keeps ``dim`` (top-k, max with
    keepdim) or drops it (max without)."""
    t = t.narrow(dim, 0, 1)
    return (t if len(out_shape) == t.dim() else t.squeeze(dim)).expand(out_shape)


def rule_topk(w, node: fx.Node, spec) -> list[Value]:
    """``values, indices = topk(x, k, dim)`` (or ``max(x, dim)``): the choice commutes with permutations of
    ``dim`` only.

    The values are the same numbers whichever way ``dim`` is permuted (invariant); the indices point into
    ``dim``'s coordinates, so a consumer that follows them (one_hot, gather) can move with those coordinates.
    A channel that also varies along other axes (scores viewed as (groups, experts per group)) keeps the values
    invariant under permutations within each row along ``dim``, kept apart from the other rows; its indices
    then name positions within a row, which those permutations change: plain data no rule follows.
    Channels along any other axis are pinned.
    """
    args = _schema_args(node)
    x = w.value(args["self"])
    rank = len(x.shape)
    if args["dim"] is None and rank > 1:  # argmax over the flattened tensor: positions mixing every axis
        return _pin_moved(w, node, "top-1 over the flattened tensor")
    dim, ordered = (args["dim"] or 0) % rank, args.get("sorted", True)  # max.dim: one result, no order to see
    # unsorted results come in an order that depends on the permutation: only consumers blind to it may follow;
    # equal values (a ReLU's zeros) are ranked by position, which a permutation changes
    largest = not spec.smallest and args.get("largest", True)
    followable = (ordered or _order_blind(w.specs, node, dim - rank)) and not _may_tie(w, args["self"], largest)
    pointed, by_rows, rows = None, False, []
    for c in x.chans:
        c = w.resolve(c, node.name)
        if followable and not c.block and dim in chan_axes(c):
            w.c.passes_through(c.ids, node.name)  # ranked together: never mixed with coordinates left out
        if pointed is None and followable and not c.block and chan_axes(c) == {dim}:
            _permuted_within_rows(w, node, c, {dim}, "ranked by top-k over this axis")
            pointed = ids_along(c.ids, dim)
        elif followable and not c.block and dim in chan_axes(c) and _disjoint_rows(c.ids, dim) is not None:
            if _indices_read(node, spec):  # positions within a row, which a permutation there changes: unfollowed
                _pin_chan(w, node, c, "ranked by top-k within rows of this axis, whose indices are read")
            else:
                _permuted_within_rows(w, node, c, {dim}, "ranked by top-k within rows of this axis")
            by_rows = True
        elif not c.mixed and chan_axes(c) and dim not in chan_axes(c):
            rows.append(c)  # a coordinate (or head) per row, ranked within it (experts choosing their tokens)
        else:
            for t in c.terms:
                w.c.pin(t.ids, "top-k over another axis of this channel", node.name)
    if rows and (pointed is not None or by_rows):
        for c in rows:
            _pin_chan(w, node, c, "top-k rows of coordinates, ranked along another labelled axis")
        rows = []
    shapes = (None, _shape_of(node)) if spec.indices_only else (_shape_of(node, 0), _shape_of(node, 1))
    if rows:  # both results are laid out like the rows: the values, and the indices (into an unlabelled axis)
        for c in rows:
            if not c.block:
                w.c.restrict(c.ids, NEUTRAL, "ranked by top-k within each row of these coordinates", node.name)
        results = [Value(chans=[c.map(lambda t, s=s: _one_along(t, dim, s)) for c in rows], shape=s)
                   for s in shapes if s is not None]
    elif pointed is None:
        results = [Value(invariant=by_rows, shape=shapes[0]), Value(shape=shapes[1])]
    else:
        results = [Value(invariant=True, shape=shapes[0]), Value(points_to=pointed, shape=shapes[1])]
    return results[-1] if spec.indices_only else results


_TIE_FREE = frozenset({"contract", "conv", "attention", "embedding", "recurrent"})  # weights mix: no equal values


def _may_tie(w, x: fx.Node, largest: bool = True) -> bool:
    """Whether ``x`` may hold equal values at different coordinates with positive probability where a ranking
    (``largest`` first, else smallest) meets them: its values come, through no contraction with weights, from a
    map that sends whole intervals to one value (``ties`` in specs/ops.yaml), from discrete values (masks,
    one-hots: not floating point), or from a ``where`` / ``masked_fill`` setting entries to one number
    (:func:`_fill_may_tie`). Indices and the conditions of a ``where`` only choose positions: not followed."""
    seen, todo = set(), [x]
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n.op != "call_function" or n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        spec = None if n.target is operator.getitem else w.spec(n)
        if getattr(spec, "ties", False) or (isinstance(val, torch.Tensor) and not val.is_floating_point()):
            return True
        if n.target is operator.getitem:
            todo.append(n.args[0])
        elif spec is not None and spec.rule not in _TIE_FREE:
            choosers = set(index_operands(n, spec.rule))
            if spec.rule == "where":
                if _fill_may_tie(w, n, spec, largest):
                    return True
                choosers.add(schema_arg(n, spec.condition))
            todo.extend(a for a in n.all_input_nodes if a not in choosers)
    return False


def _fill_may_tie(w, n: fx.Node, spec, largest: bool) -> bool:
    """Whether a ``where`` / ``masked_fill`` choosing a number sets entries to one value that a ranking may meet:
    not when the number ranks last (-inf for a largest-first ranking, +inf for a smallest-first one), nor when it
    is 0 or less beside kept values that are all positive (``positive`` in specs/ops.yaml: a softmax or sigmoid
    router's scores masked to 0) and the ranking is largest-first. Assumed, as a router's masking intends: the
    ranking takes no more entries than are kept."""
    chosen = [schema_arg(n, name) for name in spec.choices]
    for number, other in ((chosen[0], chosen[1]), (chosen[1], chosen[0])):
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            continue
        if number == (-math.inf if largest else math.inf):
            continue
        if largest and number <= 0 and _positive(w, other):
            continue
        return True
    return False


def _positive(w, x) -> bool:
    """Whether every value of ``x`` is > 0: the output of a ``positive`` op, moved, viewed or cast to another
    floating-point dtype (one input each)."""
    while isinstance(x, fx.Node) and x.op == "call_function":
        val = x.meta.get("val")
        if not (isinstance(val, torch.Tensor) and val.is_floating_point()):
            return False
        spec = None if x.target is operator.getitem else w.spec(x)
        if getattr(spec, "positive", False):
            return True
        if spec is None or spec.rule not in ("movement", "identity") or getattr(spec, "negates", False) \
                or len(x.all_input_nodes) != 1:
            return False
        x = x.all_input_nodes[0]
    return False


def _indices_read(topk: fx.Node, spec) -> bool:
    """Whether anything reads the indices ``topk`` returns (its second result, or its only one)."""
    if spec.indices_only:
        return bool(topk.users)
    return any(user.target is operator.getitem and user.args[1] == 1 and user.users for user in topk.users)


def _disjoint_rows(ids: torch.Tensor, dim: int) -> torch.Tensor | None:
    """The distinct rows of ids along ``dim`` (rows x ids), when every id lies in exactly one row, once."""
    rows = unique_rows(ids, [dim])
    if bool((rows < 0).any()) or len(torch.unique(rows)) != rows.numel():
        return None
    return rows


def _order_blind(specs, topk: fx.Node, k_axis: int) -> bool:
    """Whether every use of ``topk``'s outputs is blind to the order along the top-k axis (``k_axis``, counted
    from the end): equivariant maths (specs/ops.yaml) among them or with values constant along that axis,
    one-hot, gathering by the indices, up to a sum over that axis."""
    reached = _descendants(topk)
    todo = [(user, k_axis) for user in topk.users]
    while todo:
        node, k = todo.pop()
        spec = specs.op(str(node.target))
        rule = spec.rule if spec is not None else None
        if rule == "ignore":
            continue
        if node.target is operator.getitem or (getattr(spec, "equivariant", False) and _alike_along(node, k, reached)):
            todo += [(user, k) for user in node.users]
        elif rule == "one_hot" or (
                str(node.target) == "aten.unsqueeze.default"
                and schema_arg(node, "dim") in (-1, len(node.meta["val"].shape) - 1)):
            todo += [(user, k - 1) for user in node.users]  # a new last axis
        elif (rule == "gather" and schema_arg(node, "index") in reached
              and schema_arg(node, "self") not in reached):
            todo += [(user, k) for user in node.users]
        elif rule == "reduce" and schema_arg(node, "dim") is not None:
            rank = len(schema_arg(node, "self").meta["val"].shape)
            if k % rank not in {d % rank for d in schema_arg(node, "dim")}:
                return False
        else:
            return False
    return True


def _descendants(node: fx.Node) -> set[fx.Node]:
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen


def _alike_along(node: fx.Node, k: int, reached: set[fx.Node]) -> bool:
    """Every other tensor operand also comes from the top-k, or does not vary along axis ``k`` (size 1 there)."""
    for arg in node.all_input_nodes:
        shape = arg.meta["val"].shape if isinstance(arg.meta.get("val"), torch.Tensor) else ()
        if arg not in reached and len(shape) >= -k and shape[k] != 1:
            return False
    return True


def rule_one_hot(w, node: fx.Node, spec) -> Value:
    """One-hot of indices into a labelled axis: the new last axis carries that axis' coordinates (a routing
    matrix whose column ``e`` is expert ``e``)."""
    index, classes = w.value(schema_arg(node, "self")), schema_arg(node, "num_classes")
    out_shape = _shape_of(node)
    if index.points_to is None or classes != len(index.points_to):
        return _pin_moved(w, node, "one-hot width differs from the axis its indices point into")
    w.c.tag("experts", index.points_to)
    view = [1] * (len(out_shape) - 1) + [len(index.points_to)]
    return Value(chans=[Chan.clean(index.points_to.reshape(view).expand(out_shape))], shape=out_shape)


_GATHER_AS_MOVEMENT = MovementSpec(rule="movement")


def rule_gather(w, node: fx.Node, spec) -> Value:
    """``gather(x, dim, index)``: with indices that point into ``x``'s own labelled ``dim`` (routing weights read
    at the chosen experts), the result follows the coordinates and is invariant; otherwise a movement."""
    args = _schema_args(node)
    x, index = w.value(args["self"]), w.value(args["index"])
    if index is None or index.points_to is None:
        return rule_movement(w, node, _GATHER_AS_MOVEMENT)
    dim = args["dim"] % len(x.shape)
    rank = len(x.shape)
    along = [c for c in x.chans if chan_axes(c) == {dim} and not c.mixed and not c.block]
    if len(x.chans) == 1 and along and torch.equal(
            ids_along(along[0].ids, dim), index.points_to):
        return Value(invariant=True, shape=_shape_of(node))
    return _pin_moved(w, node, "gathered by indices into a different axis")


def rule_scatter(w, node: fx.Node, spec) -> Value:
    """``scatter(self, dim, index, src)``: ``out[..., index[..., j], ...] = src[..., j, ...]`` along ``dim``.

    Relabelling the positions along ``dim`` commutes with the op when ``self`` is the same at every position
    there and ``src`` is unchanged by the transformation: so with indices that point into a labelled axis as long
    as ``dim`` (top-k experts), ``dim`` of the result carries that axis' coordinates (the dense routing matrix,
    column ``e`` for expert ``e``). Any other use pins.
    """
    args = _schema_args(node)
    into, index = w.value(args["self"]), w.value(args["index"])
    out_shape = _shape_of(node)
    dim = args["dim"] % len(out_shape)
    src = args["src"] if "src" in args else args.get("value")
    written = w.value(src) if isinstance(src, fx.Node) else Value(data=src)
    fixed = written is not None and not written.chans and written.points_to is None and (
        written.data is not None or written.invariant)
    if fixed and _into_own_axis(into, index, dim):  # PhiMoE: scores.scatter(-1, top_1, -inf) masks the pick
        w.c.restrict(index.points_to, NEUTRAL, "positions written by a scatter", node.name)
        return Value(chans=list(into.chans), shape=out_shape)
    if (index is None or index.points_to is None or len(index.points_to) != out_shape[dim]
            or into is None or into.chans or into.data is None or data_varies(into.data, frozenset({dim}), out_shape)
            or not fixed):
        return _pin_moved(w, node, "scattered by indices into an axis they do not point into, into a tensor that "
                                   "differs along it, or with values a transformation changes")
    w.c.restrict(index.points_to, NEUTRAL, "positions written by a scatter", node.name)
    w.c.tag("experts", index.points_to)
    view = [1] * len(out_shape)
    view[dim] = out_shape[dim]
    return Value(chans=[Chan.clean(index.points_to.reshape(view).expand(out_shape))], shape=out_shape)


def _into_own_axis(into: Value | None, index: Value | None, dim: int) -> bool:
    """Whether a scatter writes into a tensor labelled along ``dim`` by exactly the coordinates its indices point
    into, and along nothing else: relabelling them moves the tensor's entries and the written positions alike."""
    if into is None or index is None or index.points_to is None or len(into.chans) != 1:
        return False
    chan = into.chans[0]
    return (chan_axes(chan) == {dim} and not chan.mixed and not chan.block and chan.degree == 1
            and torch.equal(ids_along(chan.ids, dim), index.points_to))


def rule_index_add(w, node: fx.Node, spec) -> Value:
    """``index_add(self, dim, index, source, alpha)``: ``alpha * source``'s slices along ``dim`` added into
    ``self`` at the positions ``index`` names (the routed tokens back into the stream). Positions move, values do
    not mix: channels that do not vary along ``dim`` add like an addition; channels that vary there pin."""
    args = _schema_args(node)
    into, source = _as_value(_operand(w, args["self"])), _as_value(_operand(w, args["source"]))
    out_shape = _shape_of(node)
    dim = args["dim"] % len(out_shape)
    alpha = float(args.get("alpha", 1))
    summed = _entries_summed(w, node, w.value(args["index"]), source, dim)
    placed = []
    for c in source.chans:
        if any(c is s for s in summed):
            continue
        if dim in chan_axes(c) or c.mixed or len(c.shape) != len(out_shape):
            _pin_chan(w, node, c, "added at indexed positions along an axis it varies along")
        else:
            c = c.map(lambda t: _first_along(t, {dim}, out_shape))
            placed.append(c.scaled(alpha) if alpha != 1 else c)
    return _add_at_positions(w, node, into, placed, frozenset({dim}), out_shape)


def _entries_summed(w, node: fx.Node, index: Value | None, source: Value, dim: int) -> list[Chan]:
    """The source channels an index's own layout matches entry for entry along ``dim`` (expert choice:
    ``index_add(out, 0, rows.flatten(), y.flatten(0, 1))``, both laid out per expert): the entries are added in
    any order, so a permutation moving index entries and source slices together leaves the sum unchanged. Those
    coordinates are tied (permutations only) and summed out; an index layout matching nothing pins."""
    summed = []
    for lay in index.chans if index is not None else ():
        match = next((c for c in source.chans if not c.mixed and not c.block and c.degree == 1
                      and chan_axes(c) == {dim} and not any(c is s for s in summed)), None)
        if lay.mixed or lay.block or lay.degree != 1 or match is None or chan_axes(lay) - {0}:
            _pin_chan(w, node, lay, "indices laid out along coordinates that the added values do not follow")
            continue
        along = ids_along(match.ids, dim)
        w.c.tie(lay.ids.reshape(-1), along, node=node.name)
        for c in (lay, match):
            w.c.restrict(c.ids, NEUTRAL, "entries added in any order, moved with their indices", node.name)
        summed.append(match)
    return summed


def rule_index_put(w, node: fx.Node, spec) -> Value:
    """``index_put(self, indices, values, accumulate)`` (``x[rows] = v``, ``x[mask] += v``): ``values`` written
    into, or added to, the positions the indices name along ``self``'s leading axes. Each element is ``self``'s,
    ``values``' or their sum, so channels that vary along no indexed axis are tied as in an addition (as ``where``
    does); channels that vary along one, or values laid out otherwise, pin."""
    args = _schema_args(node)
    into, values = _as_value(_operand(w, args["self"])), _as_value(_operand(w, args["values"]))
    out_shape = _shape_of(node)
    indexed = _indexed_axes(args["indices"])
    rest = out_shape[len(indexed):] if indexed == set(range(len(indexed))) else None
    placed = []
    for c in values.chans:
        lead = len(c.shape) - len(rest) if rest is not None else -1
        if lead < 0 or tuple(c.shape[lead:]) != tuple(rest) or chan_axes(c) & set(range(lead)) or c.mixed:
            _pin_chan(w, node, c, "written at indexed positions, laid out along the indexed axes")
        else:
            placed.append(c.map(lambda t, lead=lead: _leading_replaced(t, lead, out_shape)))
    return _add_at_positions(w, node, into, placed, indexed if rest is not None else frozenset(range(len(out_shape))),
                             out_shape)


def _add_at_positions(w, node, into: Value, placed: list[Chan], axes: frozenset[int], out_shape) -> Value:
    """``into`` with ``placed`` channels written or added at some of its positions along ``axes``: ``into``'s
    channels that vary along ``axes`` pin, the rest meet the placed ones as in an addition."""
    kept = []
    for c in into.chans:
        if chan_axes(c) & axes or c.mixed:
            _pin_chan(w, node, c, "written at indexed positions along an axis it varies along")
        else:
            kept.append(c)
    into = Value(chans=kept, data=into.data, shape=into.shape, invariant=into.invariant)
    return _add_values(w, node, into, Value(chans=placed, shape=out_shape), residual=False)


def _pin_chan(w, node, chan: Chan, why: str) -> None:
    for t in chan.terms:
        w.c.pin(t.ids, why, node.name)


# -- new tensors ------------------------------------------------------------------------------------------------
def rule_fill(w, node: fx.Node, spec) -> Value:
    """A tensor of one value with the input's shape (``zeros_like``): plain data, whatever the input carries."""
    shape = _shape_of(node)
    if spec.unset:
        return Value(shape=shape)
    value = spec.value if spec.value is not None else schema_arg(node, "fill_value")
    return Value(data=torch.full(shape, value, dtype=node.meta["val"].dtype), shape=shape)


def rule_copy(w, node: fx.Node, spec) -> Value:
    """``copy_(self, src)``: src's values (broadcast to self's shape, cast to its dtype), none of self's."""
    src, shape = w.value(schema_arg(node, "src")), _shape_of(node)
    if src is None:  # a Python number or a tensor with no value the analysis tracks
        return Value(shape=shape)
    data = src.data.expand(shape) if isinstance(src.data, torch.Tensor) else src.data
    return Value(chans=[c.broadcast_to(shape) for c in src.chans], data=data, shape=shape, invariant=src.invariant)


# -- small helpers -------------------------------------------------------------------------------------------
def schema_arg(node: fx.Node, name: str, default=None):
    """The argument ``name`` of an ATen call, positional or keyword, read through the op's schema."""
    return _schema_args(node).get(name, default)


def _self_and_other(w, node: fx.Node) -> tuple:
    """The two operands of an elementwise binary op (schema arguments ``self`` and ``other``)."""
    args = _schema_args(node)
    return _operand(w, args["self"]), _operand(w, args["other"])


def _operand(w, arg):
    if isinstance(arg, fx.Node):
        return w.value(arg)
    return arg


def _as_value(x) -> Value:
    if isinstance(x, Value):
        return x
    return Value(data=x)


def _broadcast_value(v: Value, letters: str, out_letters: str, out_shape) -> Value:
    view = [v.shape[letters.index(l)] if l in letters else 1 for l in out_letters]
    order = [letters.index(l) for l in out_letters if l in letters]
    chans = [c.map(lambda t: t.permute(*order).reshape(view).expand(out_shape)) for c in v.chans]
    # the shape before broadcasting (size 1 along the output's other axes): what the value may vary along
    return Value(chans=chans, data=v.data, shape=tuple(view), invariant=v.invariant)


def _schema_args(node: fx.Node) -> dict:
    """The op's arguments by their schema names, defaults filled in (positions differ between overloads)."""
    out = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def _shape_of(node: fx.Node, k: int | None = None):
    val = node.meta.get("val")
    if k is not None:
        val = val[k]
    return concrete_shape(val.shape) if isinstance(val, torch.Tensor) else None


def _node_shape(a: fx.Node):
    val = a.meta.get("val")
    return concrete_shape(val.shape) if isinstance(val, torch.Tensor) else None
