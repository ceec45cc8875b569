"""Selections by known indices that do not depend on the input: evidence from traces at other input shapes.

An ``index``/``gather``/``index_select`` whose indices the analysis knows (plain data in the graph) reads the
positions they name. When those indices come from the input's shape (``torch.arange(seq_len)``, relative-position
buckets), another input shape reads other positions, so what the traced shape skips is not free and is pinned
(:func:`symgraph.analysis.rules.rule_movement`). A constant in the graph proves nothing by itself: the trace bakes
Python's ``torch.tensor([n - 1])`` in at the traced ``n``. So the evidence is read, not assumed: the model is traced
again at the probe shapes (:func:`symgraph.probes.probe_inputs`, without padding: shapes change, nothing else) and a
node counts as a fixed selection (Falcon's ``fused_qkv[..., [-2], :]``: the key head of a fused projection) only
when

* its indices depend on no model input (constants, buffers and sizes only: values drawn from ``input_ids`` may
  agree at every probe, since the probes keep the original as a prefix),
* the same node (op, source line, module, and its rank among those) is in the graph at every probe shape,
* with the same index values there, into axes of the same size.

Anything else (a probe that cannot be traced, no probe the model takes, a node missing) is no evidence: the rule
pins. The probe traces are made once per capture, on the first node that needs them.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch import fx

from ..capture import Capture, capture, data_values
from ..errors import CaptureError
from ..probes import probe_inputs, shape_summary, shortest_inputs

_BY_PROGRAM: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def selections_of(cap: Capture, constants: frozenset[str] = frozenset()) -> "Selections":
    """The :class:`Selections` of ``cap`` (one per captured program and set of parameters held constant, however
    many walks read it)."""
    by_constants = _BY_PROGRAM.setdefault(cap.program, {})
    if constants not in by_constants:
        by_constants[constants] = Selections(cap, constants)
    return by_constants[constants]


class Trace:
    """One capture's data-node values and its nodes keyed for matching across traces (never the capture itself:
    :func:`selections_of` keeps this while its program lives, and must not keep the program alive)."""

    def __init__(self, cap: Capture, branches: bool = False, constants: frozenset[str] = frozenset()):
        self.values = data_values(cap, constants)
        ranks: dict[tuple, int] = defaultdict(int)
        self.by_key: dict[tuple, fx.Node] = {}
        self.key_of: dict[fx.Node, tuple] = {}
        for node in cap.graph.nodes:
            site = _site(node)
            key = (*site, ranks[site])
            ranks[site] += 1
            self.by_key[key] = node
            self.key_of[node] = key
        # with ``branches``: the keys of the sums each set of isomorphic branches meets in (analysis/parallel.py)
        self.branch_sets = _branch_links(cap, self.key_of) if branches else []


class Selections:
    """Decides, per node, whether known indices select the same positions at every input shape."""

    def __init__(self, cap: Capture, constants: frozenset[str] = frozenset()):
        self.constants = constants  # parameters whose values count as data (analysis/walk.py)
        self.traced = Trace(cap, constants=constants)
        self.model, self.args, self.kwargs = cap.model, cap.args, cap.kwargs
        self.from_inputs = _input_dependent(cap)
        self._probes: list | None = None
        self._shortest: list | None = None
        self._traces: dict[str, Trace | None] = {}

    def why_not_fixed(self, node: fx.Node, indices: list[fx.Node], axes: frozenset[int]) -> str | None:
        """``None`` when ``indices`` (the index operands of ``node``, reading ``axes`` of its first operand) are a
        fixed selection; otherwise the reason they may select other positions at another input shape."""
        if any(a in self.from_inputs for a in indices):
            return "the indices are computed from the model's inputs"

        def differs(other: fx.Node, probe: Trace) -> str | None:
            if not self._same_indices(node, other, indices, probe):
                return "their values differ"
            if not _same_sizes(node.args[0], other.args[0], axes):
                return "the indexed axis has another size"
            return None

        return self.why_differs(node, differs)

    def why_differs(self, node: fx.Node, differs, shortest: bool = False) -> str | None:
        """``None`` when ``node`` is in the graph traced at every probe shape and ``differs(other, probe)`` (that
        node there, and that trace) finds nothing; otherwise the reason, with the input shape it was found at.
        ``shortest``: at the shortest lengths the model takes as well (:func:`~symgraph.probes.shortest_inputs`)."""
        probes = self.probes() + (self.shortest() if shortest else [])
        if not probes:
            return "the model takes no other input shape to compare them at"
        for inputs in probes:  # traced one at a time: the first difference ends the search
            summary = shape_summary(inputs)
            probe = self._trace(inputs)
            if probe is None:
                return f"the model could not be traced at input shape ({summary}) to compare them"
            other = probe.by_key.get(self.traced.key_of[node])
            if other is None:
                return f"the graph traced at ({summary}) has no such node to compare"
            why = differs(other, probe)
            if why is not None:
                return f"{why} at input shape ({summary})"
        return None

    def _same_indices(self, node: fx.Node, other: fx.Node, indices: list[fx.Node], probe: Trace) -> bool:
        mine, theirs = _operands(node), _operands(other)
        if len(mine) != len(theirs):
            return False
        for a, b in zip(mine, theirs):
            if a in indices:
                x, y = self.traced.values.get(a.name), probe.values.get(b.name)
                if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                        and x.shape == y.shape and torch.equal(x, y)):
                    return False
        return True

    def probes(self) -> list:
        """The probe inputs (:func:`~symgraph.probes.probe_inputs` without padding) but the traced ones, found
        once. A model on the meta device (a config-only or shallow copy) cannot run: a shape it takes is one it
        can be traced at."""
        if self._probes is None:
            self._probes = probe_inputs(self.model, self.args, self.kwargs, padding=False,
                                        accepts=self._accepts())[1:]
        return self._probes

    def shortest(self) -> list:
        """The inputs cut to lengths 1 and 2 that the model takes (found once; traced only when asked for)."""
        if self._shortest is None:
            self._shortest = shortest_inputs(self.model, self.args, self.kwargs, accepts=self._accepts())
        return self._shortest

    def _accepts(self):
        on_meta = any(p.device.type == "meta" for p in self.model.parameters())
        return (lambda inputs: self._trace(inputs) is not None) if on_meta else None

    def traces(self) -> list[tuple[str, Trace | None]]:
        """(shape summary, trace or None where torch.export cannot trace it) at every probe shape."""
        return [(shape_summary(inputs), self._trace(inputs)) for inputs in self.probes()]

    def _trace(self, inputs) -> Trace | None:
        """The trace at ``inputs``' shapes (made once per shape: the indices compared depend on no input value),
        or ``None`` when torch.export cannot trace the model there."""
        summary = shape_summary(inputs)
        if summary not in self._traces:
            try:
                # the probes are variants of the capture's own inputs, optional ones added there included
                traced = capture(self.model, *inputs, add_optional=False)
                self._traces[summary] = Trace(traced, branches=True, constants=self.constants)
            except CaptureError:
                self._traces[summary] = None
        return self._traces[summary]


def _branch_links(cap: Capture, key_of: dict[fx.Node, tuple]) -> list[frozenset[tuple]]:
    from ..spec import load_specs
    from .parallel import find_branch_sets  # parallel reads the rules, which read this module

    return [frozenset((key_of[b.link], b.slot) for b in s.branches) for s in find_branch_sets(cap, load_specs())]


def _input_dependent(cap: Capture) -> set[fx.Node]:
    """The nodes whose values depend on a model input (the example tensors)."""
    users, found = set(cap.user_inputs), set()
    for node in cap.graph.nodes:
        if node.name in users or any(a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def _site(node: fx.Node) -> tuple:
    """What identifies a node across traces at other shapes, but for its rank: its op, the source lines it came
    from and the modules it ran in (names carry counters that shift when another part of the graph changes)."""
    modules = tuple(path for path, _ in (node.meta.get("nn_module_stack") or {}).values())
    return node.op, str(node.target), node.meta.get("stack_trace"), modules


def _operands(node: fx.Node) -> list[fx.Node]:
    """The graph nodes ``node`` reads, in argument order (``None`` entries of an index list skipped alike)."""
    out: list[fx.Node] = []
    fx.node.map_aggregate((node.args, node.kwargs), lambda a: out.append(a) if isinstance(a, fx.Node) else None)
    return out


def _same_sizes(a, b, axes: frozenset[int]) -> bool:
    """Whether the tensors of nodes ``a`` and ``b`` have the same sizes along ``axes``."""
    x, y = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (a, b))
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.dim() != y.dim():
        return False
    return all(0 <= axis < x.dim() and x.shape[axis] == y.shape[axis] for axis in axes)
