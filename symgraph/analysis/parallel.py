"""Isomorphic parallel branches that meet in a sum: the experts of a loop over an ``nn.ModuleList``.

torch.export unrolls ``for e, expert in enumerate(self.experts): out = out.index_add(0, rows_e, expert(x[rows_e])
* w[rows_e, e:e+1])`` into one branch per expert. Each branch reads its own expert's tensors, the shared inputs
(the tokens, the router's output) and, at its own position ``e``, the routing tensors. When the branches compute
the same thing (the same ops on the same shared inputs, with the same shapes and constants, their own tensors in
the same roles) but for that position, and their results meet in a commutative sum (a chain of ``index_add``, a
tree of adds: specs/branches.yaml), moving every tensor of branch ``i`` into branch ``j``'s slot, together with
the router's rows, leaves the model's function unchanged.

Branches that meet in a ``stack`` (specs/branches.yaml ``stacks``), each at its own slot, form sets too; whether
every reader of the stack is blind to the order of its slots is settled while walking the graph
(:mod:`symgraph.analysis.experts`).

This module finds such branch sets in the graph, from the structure alone (:func:`find_branch_sets`); whether
the positions they read are the router's own coordinates is settled while walking the graph (a read names
coordinate ids, :meth:`BranchSet.read_node`), and whether those coordinates may permute by assembly
(:mod:`symgraph.analysis.experts`).

A node is *private* to a branch when every user of it (among the nodes the output depends on) is private to the
branch or is the sum it enters; the branch's tensors are its private parameters and state-dict buffers, in the
order the branch first reads them (their *roles*). Anything a branch reads that another part of the graph also
reads is shared, and must be the same node for every branch.
"""
from __future__ import annotations

import heapq
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx

from ..spec import Specs
from .rules import _schema_args
from .selections import selections_of
from .writes import aliases_input, mutated_argument

_SYMBOL = re.compile(r"\bu\d+\b")  # a size torch.export knows only at run time (the tokens routed to one expert)


@dataclass(frozen=True)
class Branch:
    """One branch: the sum node its result enters, its private nodes (graph order) and tensors (by role)."""

    link: fx.Node
    nodes: tuple[fx.Node, ...]
    tensors: tuple[str, ...]
    slot: int | None = None  # its position along the new axis of a stack it meets in (None: a sum)


@dataclass(frozen=True)
class BranchSet:
    """Branches that compute the same function of their own tensors and position, meeting in one sum.

    ``positions[b]`` is the position branch ``b`` reads the routing tensors at (None for all when the branches
    read no position of their own: a plain sum of parallel copies); ``reads`` maps each reading node to its
    branch."""

    branches: tuple[Branch, ...]
    positions: tuple[int | None, ...]
    reads: dict[str, int]

    @property
    def roles(self) -> int:
        return len(self.branches[0].tensors)

    @property
    def stack(self) -> fx.Node | None:
        """The stack the branches meet in (each at its own slot), or None where they meet in a sum."""
        return self.branches[0].link if self.branches[0].slot is not None else None

    def describe(self) -> str:
        return f"{len(self.branches)} branches meeting in {self.branches[-1].link.name}"


def find_branch_sets(cap, specs: Specs) -> list[BranchSet]:
    """Every set of two or more isomorphic branches that meet in a commutative sum and own a tensor.

    >>> import torch
    >>> from symgraph.capture import capture
    >>> from symgraph.spec import load_specs
    >>> class Twins(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         return torch.relu(self.a(x)) + torch.relu(self.b(x))
    >>> [[b.tensors for b in s.branches] for s in find_branch_sets(capture(Twins(), (torch.randn(2, 3),)),
    ...                                                             load_specs())]
    [[('a.weight', 'a.bias'), ('b.weight', 'b.bias')]]
    """
    graph = _Graph(cap)
    found = []
    for terms in _sums(graph, specs) + _stacks(graph, specs):
        found += _isomorphic_sets(graph, terms, specs)
    return found


def held_at_other_shapes(cap, sets: list[BranchSet]) -> list[BranchSet]:
    """The branch sets whose branches are isomorphic at every probe shape the model can be traced at too. A
    trace bakes in sizes computed from the input's shape (an expert's capacity ``n // 3``): branches equal at the
    traced length may take other numbers of tokens at another (expert-choice experts of capacities n // 3 and 1
    were swapped: relative change 0.1)."""
    if not sets:
        return sets
    selections = selections_of(cap)
    traced = selections.traced.key_of
    probes = [t for _, t in selections.traces() if t is not None]
    return [s for s in sets
            if all(any({(traced[b.link], b.slot) for b in s.branches} <= other for other in t.branch_sets)
                   for t in probes)]


class _Graph:
    """The graph with what the search reads of it: node order, the nodes the output depends on, tensor roles."""

    def __init__(self, cap):
        self.cap = cap
        nodes = list(cap.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        self.live = _ancestors([n for n in nodes if n.op == "output"])
        state = cap.program.state_dict
        names = {**cap.params, **cap.buffers}
        self.tensor = {n: names[n.name] for n in nodes
                       if n.op == "placeholder" and names.get(n.name) in state}  # state-dict tensors: movable
        self.written = {_storage(mutated_argument(n)) for n in nodes if mutated_argument(n) is not None}

    def users(self, node: fx.Node) -> list[fx.Node]:
        return [u for u in node.users if u in self.live]

    def changes_in_place(self, node: fx.Node) -> bool:
        """Whether some op writes into ``node``'s storage: branches reading it at different times would see
        different values (one branch's partial sum, say), so their order would matter."""
        return _storage(node) in self.written


def _storage(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` views (itself when it is no view or in-place result)."""
    while node.op == "call_function" and aliases_input(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen, todo = set(roots), list(roots)
    while todo:
        for a in todo.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


# -- sums ---------------------------------------------------------------------------------------------------------
def _sums(graph: _Graph, specs: Specs) -> list[list[tuple[fx.Node, tuple[fx.Node, ...], tuple[str, ...]]]]:
    """The terms (sum node, the nodes of one term, the arguments they are) of every maximal commutative sum with
    two terms or more: a chain of one op through its ``into`` argument, or a tree of adds, whose inner results
    nothing else reads."""
    links = {n for n in graph.live if n.op == "call_function" and _sum_spec(n, specs) is not None}
    inner = set()
    for n in links:
        for a in _inner_args(n, specs):
            if a in links and a.target == n.target and graph.users(a) == [n]:
                inner.add(a)
    out = []
    for tail in sorted(links - inner, key=graph.order.get):
        terms: list[tuple[fx.Node, tuple[fx.Node, ...], tuple[str, ...]]] = []
        todo = [tail]
        while todo:
            n = todo.pop()
            spec = _sum_spec(n, specs)
            args = _args(n)
            if spec.into is not None:
                terms.append((n, _nodes_in([args[t] for t in spec.terms]), spec.terms))
                start = args[spec.into]
                if start in inner:
                    todo.append(start)
                elif mutated_argument(n) is not None and graph.users(start) != [n]:
                    terms = []  # written in place: another reader of the start would see a partial sum
                    break
                continue
            for t in spec.terms:
                a = args[t]
                if a in inner:
                    todo.append(a)
                elif isinstance(a, fx.Node):
                    terms.append((n, (a,), (t,)))
        if len(terms) > 1:
            out.append(terms)
    return out


def _stacks(graph: _Graph, specs: Specs) -> list[list[tuple[fx.Node, tuple[fx.Node, ...], tuple[str, ...]]]]:
    """The terms of every stack of two or more distinct tensors, as :func:`_sums` gives a sum's."""
    out = []
    for n in sorted(graph.live, key=graph.order.get):
        spec = specs.branches.stacks.get(str(n.target)) if n.op == "call_function" else None
        pieces = _args(n)[spec.terms[0]] if spec is not None else []
        if len(pieces) > 1 and all(isinstance(a, fx.Node) for a in pieces) and len(set(pieces)) == len(pieces):
            out.append([(n, (a,), spec.terms) for a in pieces])
    return out


def _meeting_spec(link: fx.Node, specs: Specs):
    return specs.branches.sums.get(str(link.target)) or specs.branches.stacks[str(link.target)]


def _sum_spec(node: fx.Node, specs: Specs):
    spec = specs.branches.sums.get(str(node.target))
    if spec is None:
        return None
    args = _args(node)
    if spec.flag is not None and args.get(spec.flag) is not True:
        return None
    if spec.unit is not None and args.get(spec.unit, 1) != 1:
        return None
    return spec


def _inner_args(node: fx.Node, specs: Specs) -> list:
    spec = specs.branches.sums[str(node.target)]
    args = _args(node)
    return [args[spec.into]] if spec.into is not None else [args[t] for t in spec.terms]


def _nodes_in(values) -> tuple[fx.Node, ...]:
    out = []
    fx.node.map_aggregate(values, lambda a: out.append(a) if isinstance(a, fx.Node) else None)
    return tuple(dict.fromkeys(out))


# -- branches -----------------------------------------------------------------------------------------------------
def _private(graph: _Graph, link: fx.Node, term: tuple[fx.Node, ...], names: tuple[str, ...]) -> set[fx.Node]:
    """The nodes only ``term`` (arguments ``names`` of ``link``) depends on: walked upward in reverse graph order,
    so every user of a node is decided before the node is."""
    private: set[fx.Node] = set()
    elsewhere = set(_nodes_in([v for k, v in _args(link).items() if k not in names]))  # x + x: in two terms
    heap = [(-graph.order[n], n.name, n) for n in term]
    heapq.heapify(heap)
    seen = set(term)
    while heap:
        _, _, n = heapq.heappop(heap)
        if n.op not in ("placeholder", "call_function") or (n.op == "placeholder" and n not in graph.tensor):
            continue
        users = graph.users(n)
        if not users or not all(u in private or (u is link and n in term and n not in elsewhere) for u in users):
            continue
        private.add(n)
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                heapq.heappush(heap, (-graph.order[a], a.name, a))
    return private


def _isomorphic_sets(graph: _Graph, terms, specs: Specs) -> list[BranchSet]:
    """The classes of terms whose branches are isomorphic (see the module docstring), as branch sets."""
    classes = defaultdict(list)
    for link, term, names in terms:
        private = _private(graph, link, term, names)
        if not any(n in graph.tensor for n in private):
            continue
        stack = specs.branches.stacks.get(str(link.target))
        slot = list(_args(link)[stack.terms[0]]).index(term[0]) if stack is not None else None
        form = _Form(graph, link, term, private, _meeting_spec(link, specs), slot)
        classes[form.skeleton].append(form)
    out = []
    for forms in classes.values():
        if len(forms) > 1 and not any(f.reads_written for f in forms):
            found = _branch_set(sorted(forms, key=lambda f: (f.slot or 0, graph.order[f.nodes[0]])), specs)
            if found is not None:
                out.append(found)
    return out


class _Form:
    """A branch written so that isomorphic branches give equal forms: nodes by their place in the branch, tensors
    by role, shared nodes by name, run-time sizes by order of appearance; integers kept apart
    (``ints``, with where each sits), since a branch's own position is one."""

    def __init__(self, graph: _Graph, link: fx.Node, term: tuple[fx.Node, ...], private: set[fx.Node], spec,
                 slot: int | None = None):
        self.nodes = tuple(sorted(private, key=graph.order.get))
        local = {n: i for i, n in enumerate(n for n in self.nodes if n.op == "call_function")}
        self.tensors: list[str] = []
        role: dict[fx.Node, int] = {}
        symbols: dict[str, str] = {}
        self.ints: list[tuple[fx.Node, str, int]] = []  # (node, argument, value)
        self.link = link
        self.reads_written = False  # a shared input that some op changes in place
        self.slot = slot

        def ref(a):
            if a in local:
                return ("node", local[a])
            if a in graph.tensor and a in private:
                if a not in role:
                    role[a] = len(role)
                    self.tensors.append(graph.tensor[a])
                return ("tensor", role[a], _value_shape(a, symbols))
            self.reads_written |= graph.changes_in_place(a)
            return ("shared", a.name)

        def canonical(node, name, value):
            if isinstance(value, fx.Node):
                return ref(value)
            if isinstance(value, (list, tuple)):
                return ("list", tuple(canonical(node, name, v) for v in value))
            if isinstance(value, bool) or not isinstance(value, int):
                return ("const", type(value).__name__, repr(value))
            self.ints.append((node, name, value))
            return ("int",)

        steps = []
        for n in self.nodes:
            if n.op != "call_function":
                continue
            args = tuple((k, canonical(n, k, v)) for k, v in _args(n).items())
            steps.append((str(n.target), args, _value_shape(n, symbols)))
        entry = tuple(canonical(link, "term", t) for t in term)
        link_args = tuple((k, canonical(link, k, v)) for k, v in _args(link).items()
                          if k != spec.into and k not in spec.terms)
        self.skeleton = (tuple(steps), entry, str(link.target), link_args)


def _branch_set(forms: list[_Form], specs: Specs) -> BranchSet | None:
    """The branch set of equal-skeleton forms, or None when their integers differ anywhere but in a consistent
    position per branch, read by an op of specs/branches.yaml ``reads``."""
    ints = [[v for _, _, v in f.ints] for f in forms]
    differ = [k for k in range(len(ints[0])) if len({row[k] for row in ints}) > 1]
    positions: list[int | None] = [None] * len(forms)
    reads: dict[str, int] = {}
    if differ and forms[0].slot is not None:
        return None  # stacked branches read the weights at their slot, after the stack: not within themselves
    if differ:
        positions = [row[differ[0]] for row in ints]
        if len(set(positions)) != len(positions) or min(positions) < 0:
            return None
        offsets = {}
        for k in differ:
            node, arg, _ = forms[0].ints[k]
            offsets[k] = ints[0][k] - positions[0]
            if any(row[k] - p != offsets[k] for row, p in zip(ints, positions)):
                return None
            if not _reads_position(node, arg, offsets[k], specs):
                return None
        for b, f in enumerate(forms):
            for k in differ:
                reads[f.ints[k][0].name] = b
        if not _whole_reads(forms, reads, differ, specs):
            return None
    branches = tuple(Branch(f.link, f.nodes, tuple(f.tensors), f.slot) for f in forms)
    return BranchSet(branches, tuple(positions), reads)


def _reads_position(node: fx.Node, arg: str, offset: int, specs: Specs) -> bool:
    spec = specs.branches.reads.get(str(node.target))
    if spec is None:
        return False
    if spec.unit is not None and _args(node).get(spec.unit, 1) != 1:
        return False
    return (arg, offset) in ((spec.index, 0), (spec.end, 1))


def _whole_reads(forms: list[_Form], reads: dict[str, int], differ: list[int], specs: Specs) -> bool:
    """Every reading node reads its position through all of its position arguments (a slice [e:e+1], not
    [e:3])."""
    for f in forms:
        by_node = defaultdict(set)
        for k in differ:
            node, arg, _ = f.ints[k]
            by_node[node].add(arg)
        for node, args in by_node.items():
            spec = specs.branches.reads[str(node.target)]
            if args != {a for a in (spec.index, spec.end) if a is not None}:
                return False
    return True


# -- helpers ------------------------------------------------------------------------------------------------------
def _args(node: fx.Node) -> dict:
    """The call's arguments by schema name, defaults filled in (by position for targets without a schema)."""
    if getattr(node.target, "_schema", None) is None:
        return {**{str(i): a for i, a in enumerate(node.args)}, **node.kwargs}
    return _schema_args(node)


def _value_shape(node: fx.Node, symbols: dict[str, str]):
    """The node's value as (shape, dtype), run-time sizes named by order of first appearance in the branch."""
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return tuple(_one_shape(v, symbols) for v in val)
    return _one_shape(val, symbols)


def _one_shape(val, symbols: dict[str, str]):
    if isinstance(val, torch.Tensor):
        return tuple(_size(s, symbols) for s in val.shape), str(val.dtype)
    if isinstance(val, torch.SymInt):
        return ("symint", _size(val, symbols))
    return type(val).__name__


def _size(s, symbols: dict[str, str]):
    if isinstance(s, int):
        return s
    return _SYMBOL.sub(lambda m: symbols.setdefault(m.group(0), f"s{len(symbols)}"), str(s))
