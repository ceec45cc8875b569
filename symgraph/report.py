"""The symmetry report: every group with its kind, size, members and solver, plus the pinned spaces.

``Report.to_json()`` is the documented schema (README, "Report schema"); Markdown and HTML renderings live in
:mod:`symgraph.render`.
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass, field

from .analysis import Analysis
from .groups import FreeOutput, Group, PinnedSpace, Unmoved
from .outputs import describe as describe_free
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
    free_outputs: tuple[FreeOutput, ...] | None = None  # None: outputs pinned (no --free-outputs)
    unmoved: tuple[Unmoved, ...] = ()  # parameters in no group and no pinned space, with the analysis's reason

    @classmethod
    def from_analysis(cls, model: str, analysis: Analysis, notes: tuple[str, ...] = (),
                      free_outputs: bool = False) -> "Report":
        groups = sorted(analysis.groups, key=lambda g: (_layer_index(g.layer), motif_order(g.motif), g.id))
        if free_outputs:
            notes = notes + _free_output_notes(analysis)
        return cls(model, tuple(groups), tuple(analysis.pinned), dict(analysis.params),
                   dict(analysis.unknown_ops), notes, tuple(analysis.free_outputs) if free_outputs else None,
                   _unmoved(analysis))

    def by_motif(self, motif: str) -> list[Group]:
        return [g for g in self.groups if g.motif == motif]

    def summary(self) -> dict:
        kinds = Counter(f"{g.motif}/{g.kind}" for g in self.groups)
        n_params = sum(_numel(s) for s in self.parameters.values())
        touched = {p for g in self.groups for p in g.params}
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
            "unmoved": [dataclasses.asdict(u) for u in self.unmoved],
            "notes": list(self.notes),
        } | ({} if self.free_outputs is None else {"free_outputs": describe_free(self.free_outputs, self.groups)})

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _unmoved(analysis: Analysis) -> tuple[Unmoved, ...]:
    """Every parameter that no group moves and no pinned space names, so that the report says why of each."""
    covered = {p for g in analysis.groups for p in g.params} | {p for s in analysis.pinned for p in s.params}
    return tuple(Unmoved(p, analysis.why_unmoved.get(p, "no group was found that moves it"))
                 for p in sorted(analysis.params) if p not in covered)


def _free_output_notes(analysis: Analysis) -> tuple[str, ...]:
    free = ", ".join(f"{f.name} (group {f.group})" for f in analysis.free_outputs)
    notes = (f"free outputs: {free}; compared after undoing the group's element on them",) if free else \
        ("free outputs: none of the outputs is a plain read of the residual stream",)
    if analysis.fixed_outputs and free:
        notes += (f"outputs still pinned (not the residual stream's coordinates): "
                  f"{', '.join(analysis.fixed_outputs)}",)
    return notes


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _layer_index(layer: str) -> tuple:
    digits = [int(p) for p in layer.split(".") if p.isdigit()]
    return (len(digits) > 0, digits)
