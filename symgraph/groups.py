"""What the analysis emits: symmetry groups and the parameter slices they act on.

A group acts on ``copies`` independent blocks of ``size`` coordinates each (one block per attention head or KV
group, a single block for an FFN or the residual stream). A :class:`Member` says where those coordinates live in
one parameter: ``index[c, j, :]`` are the positions along ``axis`` that coordinate ``j`` of copy ``c`` occupies
(``block`` positions per coordinate: 1 for ordinary groups, d_head for a head permutation that moves whole heads).

Actions, for an element ``T`` of copy ``c`` (an ``size x size`` matrix):

* ``primal``: the slice transforms like an activation, ``X -> T X`` along ``axis`` (linear rows, biases).
* ``dual``: the slice is contracted with such an activation, ``X -> T^{-T} X`` (linear columns).
* ``permute``: a weight vector multiplied elementwise into the activation (norm weights): only the permutation
  part of a monomial element acts on it; signs and scales pass through to the activation.

Scale groups act by ``s ** exponent`` (primal) or ``s ** -exponent`` (dual) per coordinate.

A :class:`TensorMember` is whole tensors instead of positions along an axis: coordinate ``j`` of copy ``c`` is the
tensor named ``slots[c][j]`` (one role of the experts of an ``nn.ModuleList``: every expert's up projection), and
a permutation moves whole tensors between the slots (action ``swap``; permutation groups only).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

Kind = Literal["general_linear", "orthogonal", "rotary", "permutation", "signed_permutation", "scale"]
Action = Literal["primal", "dual", "permute", "swap"]
ScaleAttr = Literal["positive", "nonzero", "sign"]

KINDS: tuple[str, ...] = ("general_linear", "orthogonal", "rotary", "permutation", "signed_permutation", "scale")


@dataclass(frozen=True, eq=False)
class Member:
    """One parameter slice a group acts on."""

    param: str
    axis: int
    index: np.ndarray  # int64, shape (copies, size, block)
    action: Action = "primal"
    exponent: int = 1

    def __post_init__(self):
        if self.index.ndim != 3:
            raise ValueError(f"Member index for {self.param} must be (copies, size, block), got {self.index.shape}")

    @property
    def params(self) -> tuple[str, ...]:
        """The tensors the member moves (one: ``param``)."""
        return (self.param,)

    def describe(self) -> str:
        """A one-line, human summary of where the member sits (``rows 0:64 per head of 4``)."""
        flat = self.index.reshape(-1)
        where = f"{flat.min()}..{flat.max()}" if flat.size > 1 else str(int(flat[0]))
        return f"{self.param}[axis {self.axis}, {where}] {self.action}"

    def to_json(self) -> dict:
        copies, size, block = self.index.shape
        return {
            "param": self.param,
            "axis": self.axis,
            "action": self.action,
            "exponent": self.exponent,
            "copies": copies,
            "size": size,
            "block": block,
            "index": _compress_index(self.index),
        }


@dataclass(frozen=True, eq=False)
class TensorMember:
    """Whole tensors a permutation moves between slots: ``slots[c][j]`` names the tensor in slot ``j`` of copy
    ``c``, all of one role and shape. An element puts the tensor of slot ``perm[c][j]`` into slot ``j`` (the
    monomial convention of :mod:`symgraph.elements`); the tensors themselves are not changed."""

    slots: tuple[tuple[str, ...], ...]  # (copies, size)
    action: Action = "swap"

    def __post_init__(self):
        if self.action != "swap" or len({len(row) for row in self.slots}) != 1:
            raise ValueError(f"A tensor member needs action 'swap' and slots of one size per copy: {self.slots}")

    @property
    def params(self) -> tuple[str, ...]:
        """Every tensor the member moves, copy by copy and slot by slot."""
        return tuple(name for row in self.slots for name in row)

    @property
    def role(self) -> str:
        """The tensors' common name with the slot's part starred (``experts.*.up.weight``)."""
        parts = [name.split(".") for name in self.params]
        if len({len(p) for p in parts}) != 1:
            return self.params[0]
        return ".".join(level[0] if len(set(level)) == 1 else "*" for level in zip(*parts))

    def describe(self) -> str:
        return f"{self.role}[whole tensors, {len(self.slots[0])} slots] swap"

    def to_json(self) -> dict:
        return {"tensors": [list(row) for row in self.slots], "action": self.action, "copies": len(self.slots),
                "size": len(self.slots[0]), "block": 1}


@dataclass(frozen=True, eq=False)
class Group:
    """A symmetry group of the model's parameters, ready for reports, sampling and solvers."""

    id: str
    motif: str
    kind: Kind
    size: int
    copies: int
    members: tuple[Member | TensorMember, ...]
    scale: ScaleAttr | None = None
    global_sign: bool = False  # permutation times one sign shared by every coordinate (post-LN residual)
    fixes_ones: bool = False  # orthogonal only: Q 1 = +-1 (a stream LayerNorm centres: O(n-1) on the complement of 1)
    full_group: Kind | None = None  # the exact group when the emitted kind is a chosen subgroup (QK: GL, we use O)
    rotary_pairs: tuple[tuple[int, int], ...] = ()  # rotary: coordinate pairs rotated together
    passthrough: tuple[int, ...] = ()  # rotary: coordinates that RoPE leaves alone (GL among themselves)
    layer: str = ""
    notes: tuple[str, ...] = ()
    links: tuple[str, ...] = field(default=())  # ids of groups acting on the same spaces (heads <-> qk/vo)

    @property
    def dof(self) -> int:
        """Continuous degrees of freedom (0 for finite groups)."""
        n = self.size
        per_copy = {
            "general_linear": n * n,
            "orthogonal": (n - 1) * (n - 2) // 2 if self.fixes_ones else n * (n - 1) // 2,
            "rotary": 2 * len(self.rotary_pairs) + len(self.passthrough) ** 2,
            "scale": n,
        }.get(self.kind, n if self.scale else 0)
        return per_copy * self.copies

    @property
    def params(self) -> tuple[str, ...]:
        """Every tensor the group moves, once each, in member order."""
        return tuple(dict.fromkeys(p for m in self.members for p in m.params))

    @property
    def swaps_tensors(self) -> bool:
        """Whether the group moves whole tensors between slots (:class:`TensorMember`)."""
        return any(isinstance(m, TensorMember) for m in self.members)

    def with_notes(self, *notes: str) -> "Group":
        return dataclasses.replace(self, notes=self.notes + tuple(notes))

    def renamed(self, names: dict[str, str]) -> "Group":
        """The group acting on the same slices of the same tensors, called by the names ``names`` maps them to
        (a tensor not in ``names`` keeps its own)."""
        if not set(self.params) & set(names):
            return self

        def member(m):
            if isinstance(m, TensorMember):
                return dataclasses.replace(m, slots=tuple(tuple(names.get(s, s) for s in row) for row in m.slots))
            return dataclasses.replace(m, param=names.get(m.param, m.param))

        return dataclasses.replace(self, members=tuple(map(member, self.members)))

    def to_json(self) -> dict:
        out = {
            "id": self.id,
            "motif": self.motif,
            "kind": self.kind,
            "size": self.size,
            "copies": self.copies,
            "dof": self.dof,
            "scale": self.scale,
            "global_sign": self.global_sign,
            "full_group": self.full_group,
            "layer": self.layer,
            "members": [m.to_json() for m in self.members],
            "notes": list(self.notes),
            "links": list(self.links),
        }
        if self.fixes_ones:
            out["fixes_ones"] = True
        if self.kind == "rotary":
            out["rotary_pairs"] = [list(p) for p in self.rotary_pairs]
            out["passthrough"] = list(self.passthrough)
        return out


def slot_tensors(g: Group) -> dict[tuple[int, int], tuple[str, ...]]:
    """(copy, slot) -> the tensors of that slot, one per tensor member of ``g`` (empty for other groups)."""
    tensors = [m for m in g.members if isinstance(m, TensorMember)]
    if not tensors:
        return {}
    return {(c, j): tuple(m.slots[c][j] for m in tensors) for c in range(g.copies) for j in range(g.size)}


def inner_groups(g: Group, groups) -> list[Group]:
    """The groups other than ``g`` acting inside a single slot of ``g``'s tensor members (an expert's own units)."""
    slots = [set(names) for names in slot_tensors(g).values()]
    return [h for h in groups if h is not g and any(set(h.params) <= slot for slot in slots)]


@dataclass(frozen=True, eq=False)
class FreeOutput:
    """A model output whose basis moves with a group (``--free-outputs``; see :mod:`symgraph.outputs`).

    ``member`` is a virtual member (no state dict holds it) along the output's ``axis`` (counted from the end, so
    it holds at every input shape): an element of ``group`` multiplies the output by what it does to that member.
    """

    index: int  # position among the model's flattened outputs
    name: str
    axis: int
    group: str = ""
    member: Member | None = field(default=None, repr=False)


@dataclass(frozen=True)
class PinnedSpace:
    """A set of coordinates no transformation may touch, and why."""

    params: tuple[str, ...]
    size: int
    reason: str
    node: str = ""
    source: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"params": list(self.params)}


@dataclass(frozen=True)
class Unmoved:
    """A parameter that no group moves and no pinned space names, and the best reason the analysis has."""

    param: str
    reason: str


def _compress_index(index: np.ndarray) -> dict:
    """Describe an index array compactly: as an arithmetic progression when it is one, else explicitly."""
    flat = index.reshape(-1)
    if flat.size == 1:
        return {"start": int(flat[0]), "step": 1, "count": 1}
    steps = np.diff(flat)
    if np.all(steps == steps[0]):
        return {"start": int(flat[0]), "step": int(steps[0]), "count": int(flat.size)}
    return {"explicit": flat.tolist()}
