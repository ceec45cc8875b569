"""Walk the exported graph once, in order, and let each op's rule record what it implies for coordinates.

The walker plays the role of torch.fx's ``ShapeProp``: one pass, one handler per rule named in
``specs/ops.yaml``, results kept per node (:class:`~symgraph.analysis.labels.Value`). Ops whose inputs carry no
channel are plain data and need no rule; an op with channels but no spec pins them.
"""
from __future__ import annotations

import math
import operator
import os
import re
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import fx

from ..capture import Capture, data_values
from ..errors import AnalysisError, SymgraphError
from ..spec import OpSpec, Specs, load_specs
from . import rules
from ..outputs import output_names, virtual_name
from .classes import passed_classes
from .constraints import ORTHOGONAL, Constraints
from .cuts import beside_unlabelled, why_cut_moves
from .experts import BranchReads
from .labels import (STAND_IN_SIZE, Chan, IdSpace, Value, chan_axes, collapse, concrete_shape, dropped_ids,
                     labelled_axes, param_channels, varying_axes, without_pinned_repeats)
from .mixing import resolve as resolve_mixed
from .parallel import find_branch_sets, held_at_other_shapes
from .selections import selections_of
from .writes import (Write, aliases_input, mutated_argument, pieces, plan_write, shifted, why_write_moves,
                     written)


class Walker:
    def __init__(self, cap: Capture, specs: Specs | None = None, free_outputs: frozenset[int] = frozenset(),
                 constants: frozenset[str] = frozenset()):
        self.cap = cap
        self.constants = constants  # parameters read as data: their values, never moved (see :func:`walk`)
        self.free_outputs = free_outputs  # indices of flattened outputs that may move with the residual stream
        self.free_sites: dict[str, tuple[int, str, int]] = {}  # virtual parameter -> (index, name, axis)
        self.specs = specs or load_specs()
        self.ids = IdSpace()
        self.c = Constraints()
        self.data = data_values(cap, constants)
        self.values: dict[str, Any] = {}
        self.param_ids: dict[str, dict[int, torch.Tensor]] = {}
        self.param_nodes: dict[str, fx.Node] = {}
        self._buffer_ids: dict[str, torch.Tensor] = {}
        # placeholders of registered buffers and constant parameters: the same tensor at every input shape (lifted
        # constants are not)
        registered = {name for name, _ in cap.model.named_buffers()}
        self._registered_buffers = frozenset(p for p, name in cap.buffers.items() if name in registered) | \
            frozenset(p for p, name in cap.params.items() if name in constants)
        self.unknown_ops: dict[str, int] = {}
        self._read = np.zeros(0, dtype=bool)  # by id: consumed by a non-movement op (or the output)
        self._cuts: list[tuple[fx.Node, list[Chan], set[int]]] = []  # cut (spec flag cuts), its input, ids dropped
        self._cut_moves: dict[tuple, bool] = {}  # cut, channels -> whether it keeps other labels at another shape
        self.origins: dict = {}  # ids asked about -> each trace's origins, for every cut asked (analysis/cuts.py)
        self._order = {n: i for i, n in enumerate(cap.graph.nodes)}
        self._last_write: dict[fx.Node, int] = {}  # fresh tensor -> position of its latest in-place write
        self._writes: dict[fx.Node, list[tuple[fx.Node, Write]]] = {}  # fresh tensor -> its writes so far
        # fresh tensor -> the computations (rules.piece_structure) of what it holds so far, labelled pieces only
        self._held: dict[fx.Node, set[int]] = {}
        self._structures: tuple[dict, dict] = ({}, {})  # rules.piece_structure's memo, kept for the whole walk
        self.single_products: dict[tuple[int, int], int] = {}  # rules._fresh_like's ids of one coordinate's products
        # isomorphic branches (ModuleList experts): their reads of their own position (analysis/experts.py)
        self.branch_reads = BranchReads(held_at_other_shapes(cap, find_branch_sets(cap, self.specs)))

    # -- driver ------------------------------------------------------------------------------------------
    def run(self) -> "Walker":
        for node in self.cap.graph.nodes:
            if node.op == "placeholder":
                self.values[node.name] = self._placeholder(node)
            elif node.op == "get_attr":
                self.values[node.name] = Value(data=self.data.get(node.name))
            elif node.op == "call_function":
                self.values[node.name] = self._call(node)
            elif node.op == "output":
                self._output(node)
        self._pin_unread()
        self._pin_dropped_for_good()
        return self

    def constant_params(self) -> frozenset[str]:
        """Parameters with stored values whose every coordinate was pinned where it was joined beside data that
        differs along it (a class token's learned rotary angles beside a computed table): no group moves them, so
        they may as well be read as data, which lets the table's rotary structure show (see :func:`walk`)."""
        pinned = set(np.concatenate(self.c.beside_data).tolist()) if self.c.beside_data else set()
        return frozenset(name for name, ids in self.param_ids.items() if ids and self._generic(name) and
                         all(set(axis.tolist()) <= pinned for axis in ids.values()))

    def _generic(self, name: str) -> bool:
        """Whether ``name`` holds stored values, no two alike: read as data, values that repeat (zeros at
        initialisation) could show symmetries the other values of the parameter lack."""
        value = self.cap.program.state_dict.get(name)
        return isinstance(value, torch.Tensor) and value.device.type != "meta" and \
            torch.unique(value.detach()).numel() == value.numel()

    def _placeholder(self, node: fx.Node) -> Value:
        name = self.cap.params.get(node.name)
        if name is None and self._added_buffer(node):
            buffer = self.cap.buffers[node.name]
            shape = tuple(self.cap.program.state_dict[buffer].shape)
            return Value(chans=param_channels({0: self.buffer_ids(buffer, shape[0])}, shape), shape=shape)
        if name is None or name in self.constants:
            return _data_value(node, self.data.get(node.name))
        shape = self.cap.shapes[name]
        # size-1 axes (a class token's batch and position axes) have nothing to permute or mix: no ids
        ids = {a: self.ids.allocate(n, owner=name, axis=a) for a, n in enumerate(shape) if n > 1}
        self.param_ids[name] = ids
        self.param_nodes[name] = node
        if not node.users:  # tied to a parameter the graph reads instead: moving it alone would be wrong
            for axis_ids in ids.values():
                self.c.pin(axis_ids, "not read by the traced graph (tied to another parameter, or unused)",
                           node.name)
        if name in self.cap.token_embeddings and 1 in ids:
            self.c.pin(ids[1], f"the token embeddings' output, where the model writes what its "
                               f"{', '.join(self.cap.untraced_inputs)} compute (not traced)", node.name)
        return Value(chans=param_channels(ids, shape, uniform=self._is_uniform_vector(name)), shape=shape)

    def _added_buffer(self, node: fx.Node) -> bool:
        """A saved vector buffer the graph only adds to other tensors (DeepSeek-V3's and LongCat-Flash's expert score
        correction), directly or after movements that keep its axis whole (an unsqueeze to broadcast): it gets ids
        like a bias, so it moves with the coordinates it is added to (pinned where it meets data)."""
        value = self.cap.program.state_dict.get(self.cap.buffers.get(node.name, ""))
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() != 1 \
                or len(value) < 2:
            return False
        return self._only_added(node)

    def _only_added(self, node: fx.Node) -> bool:
        def added(user: fx.Node) -> bool:
            spec = self.specs.op(str(user.target))
            if spec is None or mutated_argument(user) is not None:
                return False
            if spec.rule == "add":
                return True
            return spec.rule == "movement" and not (spec.cuts or spec.regroups) and self._only_added(user)
        return bool(node.users) and all(added(u) for u in node.users)

    def _is_uniform_vector(self, name: str) -> bool:
        """A vector parameter whose stored entries are one number (a folded norm weight). Meta parameters
        (config-only capture) have no value: never uniform, so their groups stay those of an arbitrary weight."""
        return uniform_value(self.cap.program.state_dict.get(name)) is not None

    def _call(self, node: fx.Node):
        if node.target is operator.getitem:
            container, index = node.args
            return self.values[container.name][index]
        inputs = _flat_values(node, self.values)
        if node.name in self.branch_reads:
            value = self.branch_reads.read(self, node, inputs)
            if value is not None:
                return value
        pointers = [v.points_to for v in inputs if v.points_to is not None]
        if not any(v.chans for v in inputs) and not pointers:
            return self._data_node(node, inputs)
        spec = self.specs.op(str(node.target))
        if spec is not None and spec.rule in _BROADCASTS_DATA and \
                self._forget_data_of_other_shapes(node, inputs, spec.rule == "attention"):
            inputs = _flat_values(node, self.values)
        if spec is None or spec.rule not in _PASSES_COORDINATES:
            self.mark_read(inputs)
        if spec is None:
            if mutated_argument(node) is not None:  # into a view: what the base holds elsewhere is no longer known
                self._unsafe_write(node, inputs)
            return self._unknown(node, inputs)
        write = plan_write(node, self._order, self._last_write, self.data) if mutated_argument(node) else None
        if mutated_argument(node) is not None and write is None:
            return self._unsafe_write(node, inputs)
        if spec.rule not in _READS_COMPLEX and any(v.complex for v in inputs):
            for v in inputs:
                for c in v.chans if v.complex else ():
                    for t in c.terms:
                        self.c.pin(t.ids, f"complex values reach {node.target}, whose rule reads real ones only",
                                   node.name)
            return _like_output(node, lambda shape: Value(shape=shape))
        if pointers and spec.rule not in _FOLLOWS_INDICES:  # the op loses track of which coordinate was chosen
            for ids in pointers:
                self.c.pin(ids, f"indices into this axis reach {node.target}, which does not follow them", node.name)
            if not any(v.chans for v in inputs):
                return self._data_node(node, inputs)
        if spec.rule not in _FOLLOWS_LAYOUTS:  # indices laid out along coordinates (top-k rows): pinned here
            for arg in rules.index_operands(node, spec.rule):
                v = self.value(arg)
                for c in v.chans if v is not None else ():
                    for t in c.terms:
                        self.c.pin(t.ids, f"indices laid out along coordinates reach {node.target}, which does not "
                                          "follow them", node.name)
        if spec.rule not in _DEGREE_AWARE:
            self._materialise_squares(node)
        handler = getattr(rules, f"rule_{spec.rule}")
        try:
            value = handler(self, node, spec)
        except SymgraphError:
            raise
        except Exception as exc:  # a rule met a case it was not written for: say where, never guess
            raise AnalysisError(
                f"The '{spec.rule}' rule (specs/ops.yaml, {node.target}) failed on graph node {node.name}"
                f" ({source_line(node) or 'no source line recorded'}): {type(exc).__name__}: {exc}",
                hint=f"report this with the model; meanwhile, deleting the {node.target} line from specs/ops.yaml "
                     "makes the op pin every axis it touches (sound, fewer groups).") from exc
        if write is not None and write.base is not None:
            self._write_back(node, write, value)
        return self._without_pinned_repeats(value)

    def _without_pinned_repeats(self, value):
        """``value`` (or each of a list of values) with repeated channels of one pinned coordinate dropped."""
        if isinstance(value, (list, tuple)):
            return type(value)(self._without_pinned_repeats(v) for v in value)
        if not isinstance(value, Value) or len(value.chans) < 2:
            return value
        chans = without_pinned_repeats(value.chans, self.c.pinned)
        return value if len(chans) == len(value.chans) else replace(value, chans=chans)

    def _forget_data_of_other_shapes(self, node: fx.Node, inputs: list[Value], scores: bool) -> bool:
        """Data computed from the input's size alone that meets another operand's channel along an axis may differ
        there at another input shape, where the trace baked the size in: a window per head (``min(n, 8 + 8 h)``)
        is the same for heads whose windows both exceed the traced length, a factor per unit (``1 + (u < n)``)
        doubles other units, and so does a table of positions by units (``1 + (u < n) * p``, a cached table cut
        to the length). Such data is compared with the graphs traced at the probe shapes where it is constant
        along that axis, or varies along it; where the probe's data is not constant there, or tells coordinates
        apart that are alike at the traced shape, or cannot be compared, it is forgotten (any values), so the rule
        reads it as varying. Whether any was forgotten. ``scores``: an attention's mask meets the scores, whose
        last axis holds the keys, not the head's width."""
        rank = max((len(v.shape) for v in inputs if v.shape is not None), default=0)
        varying = {a + rank - c.ids.dim() for v in inputs for c in v.chans for a in chan_axes(c)} - \
            ({rank - 1} if scores else set())
        forgot = False
        complex_view = any(v.complex for v in inputs)  # axes of the real view: data's do not line up with them
        for arg in node.all_input_nodes:
            v = self.value(arg)
            data = v.data if v is not None and not v.chans else None
            if not isinstance(data, torch.Tensor) or data.dim() == 0 or arg.name in self._registered_buffers:
                continue
            shift = rank - data.dim()
            met = frozenset(a for a in range(data.dim()) if data.shape[a] > 1 and a + shift in varying)
            along = varying_axes(data)
            per_coordinate = frozenset() if complex_view else met & along
            if met and self._varies_elsewhere(arg, data, met - along, per_coordinate):
                self.values[arg.name] = Value(shape=v.shape)
                forgot = True
        return forgot

    def _varies_elsewhere(self, arg: fx.Node, data: torch.Tensor, flat: frozenset[int],
                          per_coordinate: frozenset[int]) -> bool:
        """Whether ``data`` (of node ``arg``), constant along ``flat``, varies along them at some probe shape, or
        tells entries along ``per_coordinate`` apart there that are alike at the traced shape (entries alike at the
        traced shape only there are no harm: a rotary table's lowest frequencies at a few positions)."""
        if not (flat or per_coordinate):
            return False
        pattern = _equal_entries(data, per_coordinate)
        built = self._built_alike(arg, min(per_coordinate)) if len(per_coordinate) == 1 else torch.arange(len(pattern))
        if not flat and built is not None and _coarser(built, pattern):
            return False  # alike where built alike at every shape (a rotary table's cat([f, f])), or all apart
        selections = selections_of(self.cap, self.constants)
        if arg in selections.from_inputs or not selections.probes():
            return False  # drawn from the inputs (not baked in), or no other shape to meet

        def differs(other: fx.Node, probe) -> str | None:
            there = probe.values.get(other.name)
            if not isinstance(there, torch.Tensor) or there.dim() != data.dim() or varying_axes(there) & flat:
                return "it varies along an axis it is constant along at the traced shape"
            if per_coordinate and (any(there.shape[a] != data.shape[a] for a in per_coordinate) or
                                   not _coarser(_equal_entries(there, per_coordinate), pattern)):
                return "it tells other coordinates apart than at the traced shape"
            return None

        return selections.why_differs(arg, differs) is not None

    def _built_alike(self, node: fx.Node, axis: int) -> torch.Tensor:
        """Labels of ``node``'s entries along ``axis`` (a label per entry, equal for entries whose slices along the
        other axes are equal at every input shape, whatever the length), read from how the graph builds it: ops
        elementwise in operands that span the axis or lack it (absent or added by ``unsqueeze``), ``unsqueeze`` of
        another axis, and ``cat`` of one piece repeated along it or its ``repeat_interleave`` (rotary tables). Every
        entry has its own label where the graph builds it otherwise (its width or pattern may follow the length);
        ``None`` for a node that holds no tensor."""
        shape = _shape(node)
        apart = torch.arange(shape[axis]) if shape is not None and 0 <= axis < len(shape) else None
        if apart is None or node.op != "call_function" or mutated_argument(node) is not None or _written(node):
            return apart  # a write may fall at places that follow the length
        spec, target = self.specs.op(str(node.target)), str(node.target)
        operands = [a for a in node.args if isinstance(a, fx.Node)]
        if spec is not None and spec.rule in _ELEMENTWISE and operands:
            spanning = [a for a in operands if not self._lacks_axis(a, axis - len(shape) + len(_shape(a) or ()))]
            labels = [self._built_alike(a, axis - len(shape) + len(_shape(a))) for a in spanning]
            if not labels or any(x is None or len(x) != len(apart) for x in labels):
                return apart
            return torch.unique(torch.stack(labels), dim=1, return_inverse=True)[1]
        if target == "aten.unsqueeze.default" and operands:
            added = node.args[1] % len(shape)
            return apart if added == axis else self._built_alike(node.args[0], axis - (added < axis))
        if target == "aten.repeat_interleave.self_int" and isinstance(node.args[1], int) and \
                (rules.schema_arg(node, "dim") or 0) % len(shape) == axis and len(_shape(node.args[0])) == len(shape):
            once = self._built_alike(node.args[0], axis)
            return once.repeat_interleave(node.args[1]) if once is not None else apart
        if getattr(spec, "concatenates", False) and isinstance(node.args[0], (list, tuple)):
            pieces, dim = node.args[0], (node.args[1] if len(node.args) > 1 else 0) % len(shape)
            if dim == axis and len(set(pieces)) == 1 and isinstance(pieces[0], fx.Node):
                once = self._built_alike(pieces[0], axis)
                return once.repeat(len(pieces)) if once is not None else apart
        return apart

    def _lacks_axis(self, node: fx.Node, axis: int) -> bool:
        """Whether ``node`` lacks ``axis`` (negative: broadcast in front of its first axis) at every input shape:
        absent, added by ``unsqueeze``, or elementwise in operands that lack it."""
        if axis < 0:
            return True
        if str(node.target) == "aten.unsqueeze.default" and isinstance(node.args[0], fx.Node):
            added = node.args[1] % len(_shape(node))
            return added == axis or self._lacks_axis(node.args[0], axis - (added < axis))
        spec = self.specs.op(str(node.target)) if node.op == "call_function" else None
        operands = [a for a in node.args if isinstance(a, fx.Node)]
        rank = len(_shape(node) or ())
        return spec is not None and spec.rule in _ELEMENTWISE and bool(operands) and \
            all(self._lacks_axis(a, axis - rank + len(_shape(a) or ())) for a in operands)

    def _data_node(self, node: fx.Node, inputs: list[Value]):
        if any(v.data is None and not v.invariant for v in inputs if isinstance(v, Value)):
            return _like_output(node, lambda shape: Value(shape=shape))
        if any(v.invariant for v in inputs):
            spec = self.specs.op(str(node.target))
            follows = _elementwise_follows(node, inputs) if spec is not None and spec.rule in _ELEMENTWISE else None
            classes = passed_classes(node, spec, inputs)
            moved = self.value(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
            constant = rules.repeated_axes(node, spec, moved)  # a norm expanded to its input's shape
            return _like_output(node, lambda shape: Value(invariant=True, shape=shape, follows=follows,
                                                    classes=classes, constant_axes=constant))
        data = self.data.get(node.name)
        if isinstance(data, (list, tuple)):
            return [Value(data=d, shape=tuple(getattr(d, "shape", ()))) for d in data]
        return _data_value(node, data)

    def _unknown(self, node: fx.Node, inputs: list[Value]):
        target = str(node.target)
        self.unknown_ops[target] = self.unknown_ops.get(target, 0) + 1
        for v in inputs:
            if v.points_to is not None:
                self.c.pin(v.points_to, f"indices into this axis reach {target}, which no spec describes", node.name)
            for c in v.chans:
                for t in c.terms:
                    self.c.pin(t.ids, f"consumed by {target}, which no spec describes", node.name)
        return _like_output(node, lambda shape: Value(shape=shape))

    def _write_back(self, node: fx.Node, write: Write, value: Value) -> None:
        """The base of a write through views now carries ``value``'s labels at the written positions."""
        base = self.values.get(write.base.name)
        updated = written(base, _shape(write.base), value, write.positions) if isinstance(base, Value) else None
        if updated is None:
            self._unsafe_write(node, [value])
            return
        writes = self._writes.setdefault(write.base, [])
        writes.append((node, write))
        self._separate_unlike_write(node, write, base, value, writes)
        self._pin_shifted(writes, base)
        self.values[write.base.name] = updated
        self._last_write[write.base] = self._order[node]

    def _separate_unlike_write(self, node: fx.Node, write: Write, base: Value, value: Value,
                               writes: list[tuple[fx.Node, Write]]) -> None:
        """Keep what ``node`` writes apart from what the base holds elsewhere when other ops computed it
        (``z[..., :6] = shift(z)[..., :6]``), as a concatenation's pieces are; writes computed alike (heads
        attended one by one into a buffer of zeros) stay together. Where the pieces were cut apart (the written
        view, the cuts its value came through) or where ``writes`` (those into the base so far) land may follow
        the input's length (``z[..., :min(n, 6)] = h[..., :min(n, 6)]``): checked as a concatenation's cuts are.
        So are coordinates written along an axis the write cuts beside places without labels (``ones[...,
        min(n, 6):] = h[..., min(n, 6):]``) or beside writes computed alike (``z[..., :m] = h[..., 12 - m:]; z[...,
        m:] = h[..., :12 - m]``, a roll by ``m``), though not kept apart from them."""
        held = self._held.setdefault(write.base, {rules.piece_structure(self, write.base, self._structures)}
                                     if base.chans else set())
        written = rules.piece_structure(self, node, self._structures)
        shape = _shape(write.base)
        split, across = (pieces(base, shape, value, write.positions, across) for across in (False, True))

        def moves(ids: torch.Tensor | None) -> str | None:
            cuts = rules.coordinate_cuts_before(self, node.all_input_nodes, ids)
            return rules.why_cuts_move(self, cuts) or next(
                (why for n, w in writes if (why := why_write_moves(n, shape, w.positions, selections_of(self.cap)))),
                None)

        if held - {written}:
            self.c.separate_pieces(split, node.name)
            self.c.separate_pieces(across, node.name, lambda: moves(torch.cat(across)))  # within split: a check
        elif (ids := torch.cat(across))[ids >= 0].numel():  # beside zeros or alike writes: pinned if it moves
            self.c.beside_unlabelled.append((ids.numpy(), node.name, lambda: moves(None)))
        held.add(written)

    def _pin_shifted(self, writes: list[tuple[fx.Node, Write]], base: Value) -> None:
        """Pin what the base keeps along an axis the last of ``writes`` (those into one tensor so far) cuts, unless
        every one of them lands at the same place at every probe shape: an earlier write that lands elsewhere puts
        the labels the last one cuts elsewhere (see :func:`~symgraph.analysis.writes.shifted`)."""
        node, last = writes[-1]
        shape = _shape(last.base)
        chans = shifted(base, shape, last.positions)
        if not chans:
            return
        for n, w in writes:
            why = why_write_moves(n, shape, w.positions, selections_of(self.cap))
            if why is not None:
                for t in (t for c in chans for t in c.terms):
                    self.c.pin(t.ids, f"left beside an in-place write that may land elsewhere at another input "
                                      f"shape ({why})", node.name)
                return

    def _unsafe_write(self, node: fx.Node, inputs: list[Value]):
        """An in-place op the graph does not prove safe to read as a function (see analysis/writes.py): pin what
        it reads and what the tensor it writes into carried, so stale labels can only name fixed coordinates."""
        root = node.args[0]
        while isinstance(root, fx.Node) and root.op == "call_function" and aliases_input(root):
            root = root.args[0]
        written_into = self.values.get(root.name) if isinstance(root, fx.Node) else None
        why = f"written in place by {node.target} while the graph may still read the tensor's older value"
        for v in [*inputs, *([written_into] if isinstance(written_into, Value) else [])]:
            if v.points_to is not None:
                self.c.pin(v.points_to, why, node.name)
            for c in v.chans:
                for t in c.terms:
                    self.c.pin(t.ids, why, node.name)
        return _like_output(node, lambda shape: Value(shape=shape))

    def _output(self, node: fx.Node) -> None:
        self.mark_read(_flat_values(node, self.values))
        freed = self._free_outputs(node) if self.free_outputs else set()
        for v in _flat_values(node, self.values):
            if id(v) in freed:
                continue
            if v.points_to is not None:
                self.c.pin(v.points_to, "indices into this axis are a model output", node.name)
            for c in v.chans:
                c = self.resolve(c, node.name)
                self.c.pin(c.ids, "observable model output", node.name)

    def _free_outputs(self, node: fx.Node) -> set[int]:
        """Free the outputs listed in ``self.free_outputs`` that qualify; the ids of their values."""
        leaves = node.args[0] if isinstance(node.args[0], (list, tuple)) else node.args  # flat, in pytree order
        names = output_names(self.cap)
        freed = set()
        for index, leaf in enumerate(leaves):
            v = self.values.get(leaf.name) if isinstance(leaf, fx.Node) else None
            if index in self.free_outputs and isinstance(v, Value) and self._free_output(index, names[index], v,
                                                                                           node):
                freed.add(id(v))
        return freed

    def _free_output(self, index: int, name: str, v: Value, node: fx.Node) -> bool:
        """Tie an output that is exactly a set of coordinates (one clean channel, varying along one axis, each
        coordinate once) to a virtual vector and keep its transformations isometric; False leaves it pinned."""
        if v.points_to is not None or len(v.chans) != 1 or v.shape is None:
            return False
        c = v.chans[0]
        if c.mixed or c.block or c.weight or c.degree != 1:
            return False
        axes = chan_axes(c)
        if len(axes) != 1:
            return False
        axis = next(iter(axes))
        ids = c.ids.expand(v.shape).movedim(axis, -1).reshape(-1, v.shape[axis])[0]
        if bool((ids < 0).any()) or len(torch.unique(ids)) != len(ids):
            return False
        owner = virtual_name(name)
        self.c.tie(self.ids.allocate(len(ids), owner=owner), ids, node=node.name)
        self.c.restrict(ids, ORTHOGONAL, f"the free output {name} may only move by an isometry", node.name)
        self.free_sites[owner] = (index, name, axis - len(v.shape))
        return True

    def _materialise_squares(self, node: fx.Node) -> None:
        """Give squared channels (kept as ``x``'s ids so a reduction can recognise a norm) ids of their own
        before any other rule reads them, once per value."""
        for arg in node.all_input_nodes:
            v = self.values.get(arg.name)
            if isinstance(v, Value) and any(c.degree == 2 for c in v.chans):
                chans = [rules.squared(self, arg, c) if c.degree == 2 else c for c in v.chans]
                self.values[arg.name] = replace(v, chans=chans)

    def mark_read(self, inputs: list[Value]) -> None:
        """Record that the coordinates of ``inputs`` are kept (consumed, or tied to ones the graph carries on)."""
        if len(self._read) < self.ids.next:
            self._read = np.concatenate([self._read, np.zeros(self.ids.next - len(self._read), dtype=bool)])
        for v in inputs:
            for c in v.chans:
                for t in c.terms:
                    ids = collapse(t.ids).reshape(-1).numpy()
                    self._read[ids[ids >= 0]] = True

    def note_cut(self, node: fx.Node, x: Value | None, kept: list[Chan]) -> None:
        """Record the ids of ``x`` that cut ``node`` dropped (none of ``kept``, its result's channels, has them)."""
        if x is not None:
            dropped = dropped_ids(x.chans, kept)
            if len(dropped):
                self._cuts.append((node, list(x.chans), set(dropped.tolist())))

    def _cut_by_a_moving_cut(self, unread: np.ndarray) -> bool:
        """Whether a cut that dropped some of ``unread`` may keep other labels at another input shape. A cut that
        keeps the same ones at every probe shape (a fixed slice of a weight: LongCat-Flash's experts read the first
        entries of a parameter that also holds its identity experts') leaves what it keeps free. Asked only where a
        cut left coordinates unread: the probe traces it may need cost a capture per shape. Only the channels
        holding them are asked: ``table[:n, :8]`` keeps other rows at another length, the same columns."""
        unread = set(unread.tolist())
        return any(dropped & unread and self._cut_moves_elsewhere(node, _holding(chans, dropped & unread))
                   for node, chans, dropped in self._cuts)

    def _cut_moves_elsewhere(self, node: fx.Node, chans: list[Chan]) -> bool:
        """Whether cut ``node`` keeps other labels of ``chans`` (channels of its input) at another input shape,
        its positions told apart along their axes only (asked once)."""
        key = (node, tuple(map(id, chans)))  # the channels live in self._cuts: their ids are not reused
        if key not in self._cut_moves:
            self._cut_moves[key] = why_cut_moves(self, node, chans, own_axes=True) is not None
        return self._cut_moves[key]

    def _pin_dropped_for_good(self) -> None:
        """Pin the coordinates of a tensor that its cuts drop for good (none of its users keeps them) where a cut
        may keep others at another input shape: ``b(F.pad(h[..., :min(n, 6)], (0, 6 - min(n, 6))))`` reads units
        0-4 of ``h`` at the traced length 5, leaving units 5-11 free to move, and unit 5 from length 6 on. Asked
        only of such cuts: a fused projection's pieces, or rotate_half's halves, keep every coordinate."""
        pinned = np.zeros(self.ids.next, dtype=bool)
        for ids, _reason, _node in self.c.pins:
            pinned[ids] = True
        for node, chans, dropped in self._cuts:
            kept = self._kept_by_users(node.args[0])
            gone = np.array(sorted(dropped - kept), dtype=np.int64) if kept is not None else np.zeros(0, np.int64)
            if not gone.size or pinned[gone].all():
                continue
            rank = len(_shape(node.args[0]))
            dim = rules.schema_arg(node, "dim", 0) % rank
            # dropped coordinates in a channel laid out along the cut axis, one is enough (h[..., :min(n + 6, 12)]
            # drops unit 11 alone at length 5); a channel beside unlabelled positions, tokens, is checked at the cut
            held = [c for c in chans if not beside_unlabelled(c, dim, rank) and _laid_out_along(c, gone, dim, rank)]
            if held and self._cut_moves_elsewhere(node, held):
                for t in (t for c in held for t in c.terms):
                    self.c.pin(t.ids, "cut away by a cut that may keep other coordinates at another input shape",
                               node.name)

    def _kept_by_users(self, x: fx.Node) -> set[int] | None:
        """The ids that the users of ``x`` keep, where every one is a cut or reads no value of ``x`` (zeros_like);
        None where one reads all of ``x``."""
        kept: set[int] = set()
        for user in x.users:
            spec = self.spec(user) if user.op == "call_function" else None
            if getattr(spec, "rule", None) in _READS_NO_VALUE:
                continue
            if not getattr(spec, "cuts", False):
                return None
            results = self.values.get(user.name)
            for v in results if isinstance(results, list) else [results]:
                for c in v.chans if isinstance(v, Value) else ():
                    kept.update(collapse(c.ids).reshape(-1).tolist())
        return kept

    def _pin_unread(self) -> None:
        """Pin parameter coordinates that only movement ops touched and none kept (rows a slice cut away), and with
        them the rest of their axis when a cut dropped them.

        They are not free: the probe input reads a slice whose bounds may follow its shape (a position table
        sliced by sequence length), so a longer or larger input reads coordinates this one never saw, and a
        shorter one cuts some of those this one kept (``table[:n].sum(0)`` at n = 5 reads rows 0..4 in any order,
        at n = 3 only rows 0..2: a permutation of the five is no symmetry).
        """
        read = np.concatenate([self._read, np.zeros(self.ids.next - len(self._read), dtype=bool)])
        pinned = np.zeros(self.ids.next, dtype=bool)
        for ids, _reason, _node in self.c.pins:
            pinned[ids] = True
        for name, axes in self.param_ids.items():
            for axis_ids in axes.values():
                ids = axis_ids.numpy()
                unread = ids[~read[ids] & ~pinned[ids]]
                if unread.size:
                    users = list(self.param_nodes[name].users)
                    where = users[0].name if users else self.param_nodes[name].name
                    self.c.pin(unread, "cut away by a slice at the traced input shape; another input shape may "
                                       "read it", where)
                    kept = ids[read[ids] & ~pinned[ids]]
                    if kept.size and self._cut_by_a_moving_cut(unread):
                        self.c.pin(kept, "kept by a slice that cut other coordinates of this axis away; another "
                                         "input shape may cut these", where)

    # -- helpers shared by rules -------------------------------------------------------------------------
    def buffer_ids(self, name: str, size: int) -> torch.Tensor:
        """Ids of a buffer that moves with the coordinates it describes (running statistics), one set per
        buffer however often the graph reads it."""
        if name not in self._buffer_ids:
            self._buffer_ids[name] = self.ids.allocate(size, owner=name)
        return self._buffer_ids[name]

    def value(self, arg) -> Value | None:
        if isinstance(arg, fx.Node):
            v = self.values.get(arg.name)
            return v if isinstance(v, Value) else None
        return None

    def resolve(self, chan: Chan, node: str) -> Chan:
        return resolve_mixed(self, chan, node)

    def order_of(self, node: fx.Node) -> int:
        """``node``'s position in the graph: a tag for the tensor it computes."""
        return self._order[node]

    def spec(self, node: fx.Node) -> OpSpec | None:
        return self.specs.op(str(node.target))



def walk(cap: Capture, specs: Specs | None = None, free_outputs: frozenset[int] = frozenset()) -> Walker:
    """The walk of ``cap``, walked again with :meth:`Walker.constant_params` read as data where it found any:
    holding a parameter fixed is always sound (the groups found are symmetries of the model with that value), and
    these are fixed by every group of the first walk anyway."""
    walker = Walker(cap, specs, free_outputs).run()
    constants = walker.constant_params()
    return Walker(cap, specs, free_outputs, constants).run() if constants else walker


def _holding(chans: list[Chan], ids: set[int]) -> list[Chan]:
    """The channels of ``chans`` that carry one of ``ids``."""
    wanted = np.array(sorted(ids), dtype=np.int64)
    return [c for c in chans if any(np.isin(collapse(t.ids).numpy(), wanted).any() for t in c.terms)]


def _laid_out_along(chan: Chan, ids: np.ndarray, axis: int, rank: int) -> bool:
    """Whether ``chan`` (of a tensor of ``rank`` axes) holds one of ``ids`` in a term laid out along ``axis``."""
    for t in chan.terms:
        small = collapse(t.ids)
        if axis - rank + t.ids.dim() in labelled_axes(small) and np.isin(small.numpy(), ids).any():
            return True
    return False


_READS_NO_VALUE = frozenset({"fill", "ignore"})  # rules of ops that read only the shape of their input


def uniform_value(value) -> float | None:
    """The one number every entry of a real (not meta) vector holds, else None: the analysis reads this of vector
    parameters (a folded norm weight: 1, or 0 where the model multiplies by 1 + w)."""
    if not (isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() and value.device.type != "meta"):
        return None
    first = value.detach()[0]
    return float(first) if bool((value == first).all()) else None

# rules that read a squared channel as such (a sum of squares is a norm) or pass it on unchanged
_DEGREE_AWARE = frozenset({"reduce", "identity"})

# Rules that read complex values (labelled by their real view); any other rule pins them.
_READS_COMPLEX = frozenset({"complex_view", "mul"})

# Rules that keep indices pointing at the coordinates they chose (the others pin those coordinates).
_FOLLOWS_INDICES = frozenset({"movement", "identity", "one_hot", "gather", "scatter", "embedding", "ignore"})
# Rules that follow (or pin themselves) the channels of integer tensors they read as indices: a pick's leading axes
# (x[rows], index_select), index_add's entries (analysis/rules.py index_operands); the others get them pinned.
_FOLLOWS_LAYOUTS = frozenset({"movement", "index_add"})
# rules whose output carries its input's coordinates on unconsumed (a slice after a dropout still cuts rows away):
# they do not count as reading them, so _pin_unread still sees rows that a later slice drops
_PASSES_COORDINATES = frozenset({"movement", "identity", "copy"})


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def source_line(node: fx.Node) -> str:
    """The line of model code that produced ``node``: the innermost frame of its stack trace outside torch
    itself (``self.q(x)`` rather than ``F.linear`` inside ``nn.Linear``), or ''."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    frames = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    if not frames:
        return ""
    path, line, function, code = frames[-1]
    return f"{os.path.basename(path)}:{line} in {function}: {code.strip()}"


def _shape(node: fx.Node):
    val = node.meta.get("val")
    return concrete_shape(val.shape) if isinstance(val, torch.Tensor) else None


def _data_value(node: fx.Node, data: Any) -> Value:
    """The Value of a node that reads no parameter, its data (computed at the example's sizes) at the sizes its
    shape uses (:func:`at_stand_in_sizes`)."""
    shape = _shape(node)
    return Value(data=at_stand_in_sizes(data, shape), shape=shape)


def at_stand_in_sizes(data: Any, shape: tuple[int, ...] | None) -> Any:
    """``data`` computed at the example's sizes, brought to ``shape``, where a size known only at run time stands
    in as :data:`~symgraph.analysis.labels.STAND_IN_SIZE` (the images a vision-language model keeps, picked by
    pixel values): repeated along such an axis where it does not vary along it, unknown (None: read as varying,
    which pins) where it does, or where the shapes do not otherwise agree. Left as it was, data of the example's size
    beside labels of the stand-in's cannot broadcast (SmolVLM's patch mask against its tower's attention scores).

    Examples
    --------
    >>> at_stand_in_sizes(torch.ones(2, 3), (5, 3)).shape
    torch.Size([5, 3])
    >>> at_stand_in_sizes(torch.arange(6.0).reshape(2, 3), (5, 3)) is None
    True
    """
    if not isinstance(data, torch.Tensor) or shape is None or tuple(data.shape) == tuple(shape):
        return data
    if data.dim() != len(shape):
        return None
    for axis, (have, want) in enumerate(zip(data.shape, shape)):
        if have == want:
            continue
        if have == 0 or want != STAND_IN_SIZE or axis in varying_axes(data):
            return None
        data = data.narrow(axis, 0, 1).expand(*data.shape[:axis], want, *data.shape[axis + 1:])
    return data.contiguous()


def _flat_values(node: fx.Node, values: dict) -> list[Value]:
    out = []

    def visit(a):
        if isinstance(a, fx.Node):
            v = values.get(a.name)
            if isinstance(v, Value):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(x for x in v if isinstance(x, Value))
        return a

    fx.node.map_aggregate((node.args, node.kwargs), visit)
    return out


_ELEMENTWISE = frozenset({"identity", "activation", "add", "sub", "mul", "div", "pow"})  # value i from input i
_BROADCASTS_DATA = _ELEMENTWISE | {"where", "attention"}  # data meets channels position by position (a mask)


def _equal_entries(data: torch.Tensor, axes: frozenset[int]) -> torch.Tensor:
    """Which entries of ``data`` along ``axes`` are equal (each entry the slice along every other axis): a label
    per entry, equal for equal entries."""
    rest = [a for a in range(data.dim()) if a not in axes]
    rows = data.permute(*sorted(axes), *rest)
    rows = torch.view_as_real(rows) if rows.is_complex() else rows
    _, inverse = torch.unique(rows.reshape(math.prod(data.shape[a] for a in axes), -1), dim=0, return_inverse=True)
    return inverse


def _written(node: fx.Node) -> bool:
    """Whether an in-place op writes into ``node``'s tensor, directly or through views of it."""
    return any(mutated_argument(u) is node or (aliases_input(u) and u.args and u.args[0] is node and _written(u))
               for u in node.users)


def _coarser(there: torch.Tensor, here: torch.Tensor) -> bool:
    """Whether labels ``there`` are equal wherever labels ``here`` are (per entry, as :func:`_equal_entries`)."""
    return len(torch.unique(torch.stack([here, there]), dim=1)[0]) == len(torch.unique(here))


def _elementwise_follows(node: fx.Node, inputs: list) -> torch.Tensor | None:
    """The rows an invariant result still follows (``rsqrt(var + eps)`` of a per-head variance): those of its one
    invariant input, when every other input is a scalar and the shape is kept; otherwise none."""
    invariant = [v for v in inputs if isinstance(v, Value) and v.invariant]
    scalars = all(v.invariant or not isinstance(v.data, torch.Tensor) or v.data.dim() == 0
                  for v in inputs if isinstance(v, Value))
    if len(invariant) != 1 or not scalars or invariant[0].follows is None or invariant[0].shape != _shape(node):
        return None
    return invariant[0].follows


def _like_output(node: fx.Node, make):
    """``make(shape)`` for the node's output, or for each of its outputs (a tuple: embedding_bag, var_mean), each
    with its own shape, so a rule reading one of them knows its shape."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return [make(concrete_shape(v.shape) if isinstance(v, torch.Tensor) else None) for v in val]
    return make(_shape(node))
