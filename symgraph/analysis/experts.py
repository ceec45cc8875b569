"""Groups that permute whole branches: the experts of a loop over an ``nn.ModuleList`` with their router rows.

:mod:`symgraph.analysis.parallel` finds isomorphic branches meeting in a sum. Each branch reads the routing
tensors at its own position (``index == e``, ``w[:, e:e+1]``); while walking the graph such a read (registered in
:class:`BranchReads`) records the coordinate ids found at that position and yields a value no group changes,
instead of pinning them. After assembly, :func:`with_expert_groups` turns the group holding those coordinates into
the expert permutation: its members restricted to the branches' coordinates (router rows, biases, any per-expert
vector), one coordinate per branch, plus a :class:`~symgraph.groups.TensorMember` per role moving the branches'
tensors with them. A branch set is dropped (its coordinates pinned, the graph assembled again) unless:

* each read found one coordinate: of a labelled axis (``positions``) or of the axis an index tensor points into
  (``values``);
* every coordinate a branch reads lies in exactly one group, a permutation group (any monomial group: its
  permutations are a subgroup) of one copy, linked to no other group;
* each branch reads one coordinate of each such group, the branches distinct ones, and together the branch sets
  reading a group cover all of its coordinates (a coordinate no branch reads would move with nothing).

Why that is exact: the group was found treating every read as a value no group changes, so permuting its
coordinates alone changes the model only through the reads. A read takes the value at the branch's own
coordinate; moving branch ``i``'s tensors to slot ``j`` while coordinate ``i`` moves to ``j`` makes slot ``j``
compute what branch ``i`` computed, and the sum of the branches is unchanged. Branch sets that read no position
of their own (a plain sum of parallel copies) give the tensor swap alone.

Branches may also meet in a ``stack`` (``torch.stack([e(h) for e in experts], -2)``), branch ``b`` at slot ``b``.
There nothing in a branch reads a position; instead the weights that multiply the stacked slots (a product with
weights varying along the stack axis only, summed over it; or a contraction of that axis with them) are read,
per branch, at its slot: :meth:`BranchReads.weigh` records the coordinate found there and leaves the weights no
value any group changes, as a read would. The stack's order is otherwise visible, so such a set is kept only
where every reader of the stack is one of those products (each read only by sums over the axis), a contraction,
or a sum over the axis (:meth:`BranchReads.check_stacks`); then the argument above holds slot for slot.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import fx

from ..groups import Group, Member, TensorMember
from .labels import Chan, Value, collapse, concrete_shape
from .naming import common_prefix, short_members
from .parallel import BranchSet

_MONOMIAL = ("permutation", "signed_permutation")


@dataclass
class BranchReads:
    """The branch sets of a graph and what walking it found at their reads."""

    sets: list[BranchSet]
    ids: dict[int, list[list[np.ndarray]]] = field(default_factory=dict)  # set -> per branch, the ids read
    broken: dict[int, tuple[str, str]] = field(default_factory=dict)  # set -> (why, node)

    def __post_init__(self):
        self.node = {name: (k, b) for k, s in enumerate(self.sets) for name, b in s.reads.items()}
        self.ids = {k: [[] for _ in s.branches] for k, s in enumerate(self.sets)}
        self._pinned: set[int] = set()
        self.stacks = {s.stack.name: k for k, s in enumerate(self.sets) if s.stack is not None}
        self.blind: dict[int, set[str]] = defaultdict(set)  # set -> readers of its stack blind to the slots' order
        self._weighed: dict[str, tuple[int, int, int]] = {}  # product -> (set, axis of the slots, rank)

    def reads_positions(self, k: int) -> bool:
        """Whether the branches of set ``k`` read coordinates at their own positions (or slots)."""
        return bool(self.sets[k].reads) or any(len(found) for found in self.ids[k])

    def weigh(self, walker, node: str, source, axis: int, rank: int, weights: list[Chan], weight_axis: int,
              summed_later: bool) -> bool:
        """Weights per slot of stacked branches (``gates[..., None] * stacked``, or contracted with the stack axis):
        each branch reads, as at its own position, the coordinate the weights hold at its slot (along their axis
        ``weight_axis``); the weights are then no value any group changes. False where ``source`` (a node or its
        name, its ``axis`` of ``rank``) is no such stack: the caller pins the weights. ``summed_later``: the product
        ``node`` is blind to the slots' order only once a sum over the axis reads it."""
        k = self._stack_at(source, axis, rank)
        if k is None or not weights:
            return False
        found = []
        for branch in self.sets[k].branches:
            at = [collapse(c.ids.narrow(weight_axis, branch.slot, 1)).reshape(-1) for c in weights]
            ids = torch.unique(torch.cat(at))
            if len(ids) != 1 or ids[0] < 0:
                self.broken.setdefault(k, ("an expert's weight at its slot is not one coordinate", node))
                return False
            found.append(ids.numpy())
        for b, ids in enumerate(found):
            self.ids[k][b].append(ids)
        walker.mark_read([Value(chans=list(weights))])
        if summed_later:
            self._weighed[node] = (k, axis, rank)
        else:
            self.blind[k].add(node)
        return True

    def summed(self, node: str, source, axis: int, rank: int) -> None:
        """A sum over ``axis`` of ``source``: blind to the order of the slots of a stack, or of its weighed slots."""
        k = self._stack_at(source, axis, rank)
        weighed = self._weighed.get(_name(source))
        if k is None and weighed is not None and weighed[1:] == (axis, rank):
            k = weighed[0]
        if k is not None:
            self.blind[k].add(node)

    def _stack_at(self, source, axis: int, rank: int) -> int | None:
        """The set whose stack ``source`` is, when ``axis`` (of a tensor of ``rank`` axes, broadcast from it) is
        its stacking axis."""
        k = self.stacks.get(_name(source))
        if k is None:
            return None
        from .rules import _schema_args

        stack = self.sets[k].stack
        stacked = len(stack.meta["val"].shape)
        return k if _schema_args(stack)["dim"] % stacked + rank - stacked == axis else None

    def check_stacks(self) -> None:
        """Break every stack set some reader of whose stack may see the order of its slots."""
        for name, k in self.stacks.items():
            stack = self.sets[k].stack
            if not all(u.name in self.blind[k] or (self._weighed.get(u.name, (None,))[0] == k and u.users and
                                                   all(v.name in self.blind[k] for v in u.users))
                       for u in stack.users):
                self.broken.setdefault(k, ("the stacked experts are read by an op that may see their order", name))

    def __contains__(self, name: str) -> bool:
        return name in self.node

    def read(self, walker, node: fx.Node, inputs: list[Value]) -> Value | None:
        """The value of a registered read: one no group changes, with the coordinate it read recorded; None (the
        set broken) when it does not read exactly one coordinate, so that the op's own rule handles it."""
        k, b = self.node[node.name]
        ids = _read_ids(walker, node, walker.specs.branches.reads[str(node.target)])
        if ids is None:
            self.broken.setdefault(k, ("read at an expert's own position, but not one coordinate", node.name))
            return None
        walker.mark_read(inputs)
        self.ids[k][b].append(ids)
        val = node.meta.get("val")
        return Value(invariant=True, shape=concrete_shape(val.shape) if isinstance(val, torch.Tensor) else None)

    def pin_broken(self, constraints) -> None:
        """Pin what the broken sets read (their reads did not pin it while the graph was walked)."""
        for k, (why, node) in self.broken.items():
            if k not in self._pinned:
                self._pinned.add(k)
                for per_branch in self.ids[k]:
                    for ids in per_branch:
                        constraints.pin(ids, why, node)


def _name(source) -> str | None:
    return source.name if isinstance(source, fx.Node) else source


def _read_ids(walker, node: fx.Node, spec) -> np.ndarray | None:
    from .rules import _schema_args

    args = _schema_args(node)
    x, position = walker.value(args[spec.tensor]), args[spec.index]
    if x is None or isinstance(position, bool) or not isinstance(position, int) or position < 0:
        return None
    if spec.of == "values":  # indices == e: the elements pointing at position e of the axis they index
        if x.points_to is None or x.chans or position >= len(x.points_to):
            return None
        return x.points_to[position:position + 1].numpy()
    if x.points_to is not None or len(x.chans) != 1:
        return None
    c = x.chans[0]
    if c.mixed or c.block:  # a square (one-hot mask times the probabilities) moves with its coordinate too
        return None
    dim = args[spec.dim] % c.ids.dim()
    if position >= c.ids.shape[dim]:
        return None
    ids = torch.unique(collapse(c.ids.narrow(dim, position, 1))).numpy()
    return ids if len(ids) == 1 and ids[0] >= 0 else None


def with_expert_groups(assembler, analyse):
    """``analyse()`` (the assembler's groups and pins) with the expert permutation of every branch set that
    passes the checks of the module docstring; the reads of the others are pinned and the graph assembled again."""
    reads: BranchReads = assembler.w.branch_reads
    reads.check_stacks()
    while True:
        reads.pin_broken(assembler.c)
        analysis = analyse()
        outcome = _expert_groups(assembler, analysis.groups, reads)
        if isinstance(outcome, list):
            analysis.groups = outcome
            return analysis
        reads.broken.update(outcome)


def _expert_groups(assembler, groups: list[Group], reads: BranchReads) -> list[Group] | dict:
    """``groups`` with the expert groups in place of the groups their branches read; or, when some branch set
    fails, the failures (set -> (why, node))."""
    live = [k for k in range(len(reads.sets)) if k not in reads.broken]
    if not live:
        return groups
    by_id = {g.id: g for g in groups}
    plans, broken = _plans(assembler, groups, reads, live)
    users = defaultdict(list)
    for k, plan in plans.items():
        for gid in plan:
            users[gid].append(k)
    for gid, ks in users.items():  # the coordinates of a group the experts read must all be read
        if sorted(j for k in ks for j in plans[k][gid]) != list(range(by_id[gid].size)):
            broken.update({k: (f"experts read only some coordinates of {gid}", _where(reads.sets[k])) for k in ks})
    if broken:
        return broken
    made = {k: _swap_group(reads.sets[k], bool(plans[k]), [_restrict(m, js) for gid, js in plans[k].items()
                                          for m in by_id[gid].members]) for k in live}
    out = []
    for g in groups:
        out += [made[k] for k in users[g.id]] if g.id in users else [g]
    return _unique_ids(out + [made[k] for k in live if not plans[k]])


def _plans(assembler, groups: list[Group], reads: BranchReads, live: list[int]) -> tuple[dict, dict]:
    """Per live branch set, the coordinate each branch reads of each group (:func:`_plan`); and the sets that
    read no such coordinates, with why."""
    by_id = {g.id: g for g in groups}
    linked = {link for g in groups for link in g.links}
    owners = _owners(assembler, groups) if any(reads.reads_positions(k) for k in live) else {}
    plans, broken = {}, {}
    for k in live:
        plan = _plan(assembler, reads.ids[k], owners, by_id, linked) if reads.reads_positions(k) else {}
        if isinstance(plan, str):
            broken[k] = (plan, _where(reads.sets[k]))
        else:
            plans[k] = plan
    return plans, broken


def _owners(assembler, groups: list[Group]) -> dict[int, list[tuple[str, int, int]]]:
    """Class -> every (group id, copy, coordinate) holding it."""
    out = defaultdict(list)
    for g in groups:
        for m in g.members:
            if isinstance(m, TensorMember) or m.axis not in assembler.w.param_ids.get(m.param, {}):
                continue
            classes = assembler.cls[assembler.w.param_ids[m.param][m.axis].numpy()[m.index]]  # (copies, size, block)
            for (c, j), row in np.ndenumerate(classes[:, :, 0]):
                for cls in np.unique(classes[c, j]):
                    if (g.id, c, j) not in out[int(cls)]:
                        out[int(cls)].append((g.id, c, j))
    return out


def _plan(assembler, ids: list[list[np.ndarray]], owners, by_id, linked: set[str]) -> dict[str, list[int]] | str:
    """Per group the branches read, the coordinate of each branch (branch order); or why there is none."""
    per_branch = []
    for found in ids:
        places = _places(assembler, found, owners, by_id, linked)
        if isinstance(places, str):
            return places
        per_branch.append(places)
    if any(set(p) != set(per_branch[0]) for p in per_branch):
        return "the experts read their own positions of different groups"
    plan = {gid: [p[gid] for p in per_branch] for gid in per_branch[0]}
    if any(len(set(js)) != len(js) for js in plan.values()):
        return "two experts read one coordinate"
    return plan


def _places(assembler, found: list[np.ndarray], owners, by_id, linked: set[str]) -> dict[str, int] | str:
    """The coordinate, per group, that one branch's reads name; or why they name none usable."""
    if not found:
        return "an expert reads no coordinate at its own position"
    places: dict[str, int] = {}
    for cls in np.unique(assembler.cls[np.concatenate(found)]):
        where = owners.get(int(cls), [])
        if len(where) != 1:
            return ("an expert reads, at its own position, a coordinate no group moves" if not where else
                    "an expert reads, at its own position, a coordinate two groups move")
        gid, c, j = where[0]
        g = by_id[gid]
        if g.kind not in _MONOMIAL or g.copies != 1 or g.links or gid in linked or places.setdefault(gid, j) != j:
            return f"the coordinates the experts read ({gid}) cannot follow whole experts"
    return places


def _restrict(m: Member, js: list[int]) -> Member:
    """``m`` on the coordinates ``js`` (one per branch, in branch order) of its group's only copy."""
    return Member(m.param, m.axis, m.index[0][js][None], m.action, m.exponent)


def _swap_group(s: BranchSet, reads: bool, members: list[Member]) -> Group:
    tensors = tuple(TensorMember((tuple(b.tensors[r] for b in s.branches),)) for r in range(s.roles))
    members = tuple(members) + tensors
    layer = common_prefix(list(dict.fromkeys(p for m in members for p in m.params)))
    note = ("permutes whole experts (isomorphic branches meeting in a sum): every tensor of one expert moves to "
            "another's slot" + (", with the coordinates each reads at its own position" if reads else ""))
    return Group(id=f"experts:{layer or 'model'}:{short_members(members)}", motif="experts", kind="permutation",
                 size=len(s.branches), copies=1, members=members, layer=layer, notes=(note,))


def _unique_ids(groups: list[Group]) -> list[Group]:
    """Two expert sets of one layer (sharing a router) would share an id: later ones get ``#2``, ``#3``."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for g in groups:
        seen[g.id] += 1
        out.append(g if seen[g.id] == 1 else dataclasses.replace(g, id=f"{g.id}#{seen[g.id]}"))
    return out


def _where(s: BranchSet) -> str:
    return s.branches[-1].link.name
