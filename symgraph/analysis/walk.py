"""Walk the exported graph once, in order, and let each op's rule record what it implies for coordinates.

The walker plays the role of torch.fx's ``ShapeProp``: one pass, one handler per rule named in
``specs/ops.yaml``, results kept per node (:class:`~symgraph.analysis.labels.Value`). Ops whose inputs carry no
channel are plain data and need no rule; an op with channels but no spec pins them.
"""
from __future__ import annotations

import operator
import os
import re
from typing import Any

import torch
from torch import fx

from ..capture import Capture, data_values
from ..errors import AnalysisError, SymgraphError
from ..spec import OpSpec, Specs, load_specs
from . import rules
from .constraints import Constraints
from .labels import Chan, IdSpace, Value, param_channels
from .mixing import resolve as resolve_mixed


class Walker:
    def __init__(self, cap: Capture, specs: Specs | None = None):
        self.cap = cap
        self.specs = specs or load_specs()
        self.ids = IdSpace()
        self.c = Constraints()
        self.data = data_values(cap)
        self.values: dict[str, Any] = {}
        self.param_ids: dict[str, dict[int, torch.Tensor]] = {}
        self.unknown_ops: dict[str, int] = {}

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
        return self

    def _placeholder(self, node: fx.Node) -> Value:
        name = self.cap.params.get(node.name)
        if name is None:
            data = self.data.get(node.name)
            return Value(data=data, shape=_shape(node))
        shape = self.cap.shapes[name]
        # size-1 axes (a class token's batch and position axes) have nothing to permute or mix: no ids
        ids = {a: self.ids.allocate(n, owner=name, axis=a) for a, n in enumerate(shape) if n > 1}
        self.param_ids[name] = ids
        if not node.users:  # tied to a parameter the graph reads instead: moving it alone would be wrong
            for axis_ids in ids.values():
                self.c.pin(axis_ids, "not read by the traced graph (tied to another parameter, or unused)",
                           node.name)
        return Value(chans=param_channels(ids, shape), shape=shape)

    def _call(self, node: fx.Node):
        if node.target is operator.getitem:
            container, index = node.args
            return self.values[container.name][index]
        inputs = _flat_values(node, self.values)
        if not any(v.chans for v in inputs):
            return self._data_node(node, inputs)
        spec = self.specs.op(str(node.target))
        if spec is None:
            return self._unknown(node, inputs)
        handler = getattr(rules, f"rule_{spec.rule}")
        try:
            return handler(self, node, spec)
        except SymgraphError:
            raise
        except Exception as exc:  # a rule met a case it was not written for: say where, never guess
            raise AnalysisError(
                f"The '{spec.rule}' rule (specs/ops.yaml, {node.target}) failed on graph node {node.name}"
                f" ({source_line(node) or 'no source line recorded'}): {type(exc).__name__}: {exc}",
                hint=f"report this with the model; meanwhile, deleting the {node.target} line from specs/ops.yaml "
                     "makes the op pin every axis it touches (sound, fewer groups).") from exc

    def _data_node(self, node: fx.Node, inputs: list[Value]):
        if any(v.data is None and not v.invariant for v in inputs if isinstance(v, Value)):
            return _like_output(node, lambda: Value(shape=_shape(node)))
        if any(v.invariant for v in inputs):
            return _like_output(node, lambda: Value(invariant=True, shape=_shape(node)))
        data = self.data.get(node.name)
        if isinstance(data, (list, tuple)):
            return [Value(data=d, shape=tuple(getattr(d, "shape", ()))) for d in data]
        return Value(data=data, shape=_shape(node))

    def _unknown(self, node: fx.Node, inputs: list[Value]):
        target = str(node.target)
        self.unknown_ops[target] = self.unknown_ops.get(target, 0) + 1
        for v in inputs:
            for c in v.chans:
                for t in c.terms:
                    self.c.pin(t.ids, f"consumed by {target}, which no spec describes", node.name)
        return _like_output(node, lambda: Value(shape=_shape(node)))

    def _output(self, node: fx.Node) -> None:
        for v in _flat_values(node, self.values):
            for c in v.chans:
                c = self.resolve(c, node.name)
                self.c.pin(c.ids, "observable model output", node.name)

    # -- helpers shared by rules -------------------------------------------------------------------------
    def value(self, arg) -> Value | None:
        if isinstance(arg, fx.Node):
            v = self.values.get(arg.name)
            return v if isinstance(v, Value) else None
        return None

    def resolve(self, chan: Chan, node: str) -> Chan:
        return resolve_mixed(self, chan, node)

    def spec(self, node: fx.Node) -> OpSpec | None:
        return self.specs.op(str(node.target))


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
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


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


def _like_output(node: fx.Node, make):
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return [make() for _ in val]
    return make()
