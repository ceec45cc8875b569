"""The symmetry report: every group with its kind, size, members and solver, plus the pinned spaces.

``Report.to_json()`` is the documented schema (README, "Report schema"); Markdown and HTML renderings live in
:mod:`symgraph.render`.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from .analysis import Analysis
from .groups import Group, PinnedSpace
from .spec import motif_order

SCHEMA_VERSION = 1


def solver_for(group: Group) -> str:
    """The solver the alignment dispatcher uses for this group (:mod:`symgraph.solve.dispatch`)."""
    from .solve.dispatch import solver_name

    return solver_name(group)


@dataclass(frozen=True)
class Report:
    model: str
    groups: tuple[Group, ...]
    pinned: tuple[PinnedSpace, ...]
    parameters: dict[str, tuple[int, ...]]
    unknown_ops: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @classmethod
    def from_analysis(cls, model: str, analysis: Analysis, notes: tuple[str, ...] = ()) -> "Report":
        groups = sorted(analysis.groups, key=lambda g: (_layer_index(g.layer), motif_order(g.motif), g.id))
        return cls(model, tuple(groups), tuple(analysis.pinned), dict(analysis.params),
                   dict(analysis.unknown_ops), notes)

    def by_motif(self, motif: str) -> list[Group]:
        return [g for g in self.groups if g.motif == motif]

    def summary(self) -> dict:
        kinds = Counter(f"{g.motif}/{g.kind}" for g in self.groups)
        n_params = sum(_numel(s) for s in self.parameters.values())
        touched = {m.param for g in self.groups for m in g.members}
        return {
            "groups": len(self.groups),
            "by_motif_kind": dict(sorted(kinds.items())),
            "continuous_dof": sum(g.dof for g in self.groups),
            "parameters": len(self.parameters),
            "parameter_count": n_params,
            "parameters_in_some_group": len(touched),
            "pinned_spaces": len(self.pinned),
            "unknown_ops": dict(self.unknown_ops),
        }

    def to_json(self) -> dict:
        groups = []
        for g in self.groups:
            d = g.to_json()
            d["solver"] = solver_for(g)
            groups.append(d)
        return {
            "schema": SCHEMA_VERSION,
            "model": self.model,
            "summary": self.summary(),
            "groups": groups,
            "pinned": [p.to_json() for p in self.pinned],
            "notes": list(self.notes),
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _layer_index(layer: str) -> tuple:
    digits = [int(p) for p in layer.split(".") if p.isdigit()]
    return (len(digits) > 0, digits)
