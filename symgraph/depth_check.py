"""The full-depth graph must be the shallow graph unrolled (a check for :mod:`symgraph.depth`).

Blocks that look alike (same classes, attributes, parameters, config entries) can still run differently: a forward
may compare its ``layer_idx`` with a config number (``if self.layer_idx >= config.sorted_from``), or the parent's
loop may treat one index apart (``if i == config.first_shared_layer``). A shallow copy never reaches that index, so
its analysis would be replicated onto blocks that compute something else. The full model is therefore captured too
(on the meta device: a trace, not an analysis) and its graph is cut into segments, the ops before the first block,
each block's ops and the ops after each block, and every segment must equal, op for op, the shallow segment that
stands for it. An input of an op is the same when it is the same parameter, buffer or example input, or the same op
output of an earlier segment, found at the same distance back (the residual stream from the block before) or in the
same front block, at the same index in both graphs (T5's position bias computed in block 0 and read by every block).
The check also gives the full graph's name of each shallow op (:meth:`Unrolled.full_name`), for the notes.
"""
from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import fx
from torch.export.graph_signature import InputKind

if TYPE_CHECKING:
    from .depth import DepthPlan

_PRE = "pre"  # ops before the first block: the embeddings, positions, masks, rotary tables
_BLOCK = "block"
_AFTER = "after"  # ops after a block and before the next one (after the last: the head)


class NotReplicable(Exception):
    """The shallow analysis cannot be carried over exactly; the caller analyses the full depth instead."""


@dataclass(frozen=True)
class _Ref:
    """An input of an op: an op of segment (``kind``, ``block``) at ``index``, or a placeholder (``index`` -1).

    ``anchor`` is what the input is without its position: for an op, its target, module, value shape and how many
    ops of that target and module follow it in its segment (T5's block 0 runs more ops than the blocks after it, so
    a block reading the last op of the block before finds it at another position); for a placeholder, its name
    within its block, or in the model.
    """

    kind: str
    block: int
    index: int
    anchor: tuple


class Segments:
    """A captured graph cut at its block boundaries, each op described with its inputs as :class:`_Ref`."""

    def __init__(self, cap, stack: str, depth: int):
        self.stack = stack
        self.nodes: dict[tuple[str, int], list[fx.Node]] = {}
        self.where: dict[str, _Ref] = {}  # node name -> where it is
        self.placeholders: dict[tuple[str, int, str], str] = {}  # (kind, block, name in the block) -> node name
        self._placeholders(cap)
        current, in_block = -1, False
        for node in cap.graph.nodes:
            if node.op == "placeholder":
                continue
            block = block_of_node(node, stack) if node.op != "output" else None
            if block is None:
                key, in_block = ((_AFTER, current) if current >= 0 else (_PRE, -1)), False
            elif block == current and in_block:
                key = (_BLOCK, block)
            elif block == current + 1:
                current, in_block, key = block, True, (_BLOCK, block)
            else:
                raise NotReplicable(f"the ops of {stack}.{block} do not run as one stretch after block "
                                    f"{current} (node {node.name})")
            self.nodes.setdefault(key, []).append(node)
        if current != depth - 1:
            raise NotReplicable(f"the graph runs {current + 1} of the {depth} blocks of {stack}")
        for (kind, block), nodes in self.nodes.items():
            later: dict[tuple, int] = defaultdict(int)
            for index in range(len(nodes) - 1, -1, -1):
                node = nodes[index]
                what = (_target(node), self._module(node), _value_key(node.meta.get("val")))
                self.where[node.name] = _Ref(kind, block, index, what + (later[what],))
                later[what] += 1

    def _placeholders(self, cap) -> None:
        prefix = self.stack + "."
        for spec in cap.program.graph_signature.input_specs:
            name, target = spec.arg.name, spec.target
            if spec.kind == InputKind.USER_INPUT:
                self.where[name] = _Ref("input", -1, -1, (name,))
            elif spec.kind == InputKind.CONSTANT_TENSOR:  # lifted constants are numbered per graph: compare values
                value = cap.program.constants.get(target)
                self.where[name] = _Ref("constant", -1, -1, tensor_key(value) if value is not None else ())
            elif target.startswith(prefix) and target[len(prefix):].partition(".")[0].isdigit():
                block, _, rest = target[len(prefix):].partition(".")
                self.where[name] = _Ref(f"tensor:{spec.kind.name}", int(block), -1, (rest,))
                self.placeholders[f"tensor:{spec.kind.name}", int(block), rest] = name
            else:
                self.where[name] = _Ref(f"tensor:{spec.kind.name}", -1, -1, (target,))

    def describe(self, node: fx.Node) -> tuple:
        """What the op computes, with its inputs as :class:`_Ref` (compared by :func:`_same`)."""
        def arg(value):
            if isinstance(value, fx.Node):
                return self.where[value.name]
            if isinstance(value, (list, tuple)):
                return tuple(arg(v) for v in value)
            if isinstance(value, dict):
                return tuple((k, arg(v)) for k, v in value.items())
            if isinstance(value, (torch.device, torch.dtype, torch.layout, torch.memory_format)):
                return str(value)
            return _plain(value)

        return (node.op, _target(node), arg(node.args), arg(node.kwargs), _value_key(node.meta.get("val")),
                self._module(node))

    def _module(self, node: fx.Node) -> str:
        """The innermost module the op runs in, its block index left out."""
        stack = node.meta.get("nn_module_stack") or {}
        if not stack:
            return ""
        path, cls = list(stack.values())[-1]
        prefix = self.stack + "."
        if path.startswith(prefix):
            path = path[len(prefix):].partition(".")[2]
        return f"{path}:{cls}"


class Unrolled:
    """The full graph checked to be the shallow graph unrolled by ``plan`` (raises :class:`NotReplicable` where it
    is not; see the module docstring), and the full graph's names of the shallow graph's ops."""

    def __init__(self, full_cap, shallow_cap, plan: DepthPlan):
        self.plan = plan
        self.full = Segments(full_cap, plan.stack, plan.depth)
        self.small = Segments(shallow_cap, plan.stack, plan.reduced)
        own = plan.reduced - plan.period  # blocks below this index sit at the same index in both graphs
        for kind, j in [(_PRE, -1)] + [(kind, j) for j in range(plan.depth) for kind in (_BLOCK, _AFTER)]:
            s = plan.source[j] if j >= 0 else j
            ours, theirs = self.full.nodes.get((kind, j), []), self.small.nodes.get((kind, s), [])
            where = f"{plan.stack}.{j}" if kind == _BLOCK else f"the ops {kind} {plan.stack}.{j}" if j >= 0 else \
                "the ops before the blocks"
            if len(ours) != len(theirs):
                raise NotReplicable(f"{where} run {len(ours)} ops at full depth but {len(theirs)} in the shallow "
                                    f"copy's block {s}: the blocks differ in what they compute")
            for a, b in zip(ours, theirs):
                if not _same(self.full.describe(a), self.small.describe(b), (kind, j), (kind, s), own):
                    raise NotReplicable(f"{where} computes {a.name} ({_target(a)}) differently from the shallow "
                                        f"copy's {b.name}: the blocks differ in what they compute")

    def full_name(self, name: str, segment: int, target: int) -> str:
        """Name in the full graph of shallow op ``name`` from block ``segment`` (with the ops after it; -1: before
        the blocks), placed at full block ``target``."""
        ref = self.small.where.get(name)
        if ref is None or ref.block != segment:
            raise NotReplicable(f"node {name!r} lies outside the block it is moved with")
        if ref.index >= 0:
            return self.full.nodes[ref.kind, target if segment >= 0 else segment][ref.index].name
        if segment < 0:  # a placeholder outside the blocks: named after its tensor in both graphs
            return name
        return self.full.placeholders[ref.kind, target, ref.anchor[0]]  # a block's tensor, in block target

    def embedded(self, name: str) -> str:
        """Name in the full graph of a node that is not moved with a block (global groups and pins)."""
        ref = self.small.where.get(name)
        if ref is None:
            raise NotReplicable(f"node {name!r} is not in the shallow graph")
        return self.full_name(name, ref.block, self.plan.shallow_to_full(ref.block) if ref.block >= 0 else -1)


def _same(x, y, at: tuple[str, int], there: tuple[str, int], own: int) -> bool:
    """``x`` (from the full graph's segment ``at``) and ``y`` (from the shallow segment ``there``) describe the same
    op; blocks below ``own`` sit at the same index in both graphs."""
    if isinstance(x, _Ref) or isinstance(y, _Ref):
        if not (isinstance(x, _Ref) and isinstance(y, _Ref)) or x.kind != y.kind:
            return False
        local = ((x.kind, x.block) == at, (y.kind, y.block) == there)
        if local != (False, False):  # an input from the op's own segment: at the same position
            return local == (True, True) and x.index == y.index
        if x.anchor != y.anchor:
            return False
        if x.block < 0 or y.block < 0:
            return x.block == y.block
        return at[1] - x.block == there[1] - y.block or (x.block == y.block and x.block < own)
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_same(a, b, at, there, own) for a, b in zip(x, y))
    return type(x) is type(y) and x == y


def _target(node: fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", repr(node.target))


def _plain(value):
    """A size torch.export left symbolic (an expert's token count from ``.item()``) as one mark: its symbol is
    numbered per graph. (Such graphs hold unknown ops, which send the model to full depth anyway.)"""
    return "<symbolic>" if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) else value


def _value_key(value):
    if isinstance(value, torch.Tensor):
        return tuple(_plain(n) for n in value.shape), str(value.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_value_key(v) for v in value)
    return type(value).__name__


def block_of_node(node: fx.Node, stack: str) -> int | None:
    """The index of the block of ``stack`` an op runs in (from its module stack), or ``None`` outside the blocks."""
    prefix = stack + "."
    for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
        if path.startswith(prefix):
            head = path[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                return int(head)
    return None


def tensor_key(t: torch.Tensor) -> tuple:
    """Shape, dtype and a hash of the values (none for a meta tensor): equal keys, equal tensors."""
    meta = (tuple(t.shape), str(t.dtype))
    if t.device.type == "meta":
        return meta + ("meta",)
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return meta + (hashlib.sha1(raw.tobytes()).hexdigest(),)
