"""Invariance fuzzing: hypothesis-generated elements of every group, outputs compared in float64 at every probe
input shape (:mod:`symgraph.probes`).

For each group, ``hypothesis.find`` searches for an element whose transformed model differs from the original
beyond the dtype's tolerance, and shrinks it towards the identity when it finds one. Finally all groups are
applied together, once, to check they compose.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from .elements import Element, apply, sample
from .probes import shape_summary
from .testing import group_elements
from .verify import Evaluator


@dataclass
class GroupVerdict:
    group_id: str
    motif: str
    kind: str
    examples: int
    max_error: float
    counterexample: str | None = None

    @property
    def ok(self) -> bool:
        return self.counterexample is None


@dataclass
class FuzzResult:
    model: str
    tolerance: float
    verdicts: list[GroupVerdict] = field(default_factory=list)
    joint_error: float = 0.0
    shapes: list[str] = field(default_factory=list)  # the input shapes every check ran at

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts) and self.joint_error <= self.tolerance

    @property
    def failures(self) -> list[GroupVerdict]:
        return [v for v in self.verdicts if not v.ok]

    def to_json(self) -> dict:
        return {"model": self.model, "ok": self.ok, "tolerance": self.tolerance, "joint_error": self.joint_error,
                "shapes": self.shapes, "groups": [v.__dict__ for v in self.verdicts]}


def fuzz(source, *, samples: int = 20, seed: int = 0, inputs=None, groups=None, progress=None,
         free_outputs: bool = False) -> FuzzResult:
    """Check every group of ``source`` (anything :func:`symgraph.load` accepts) for invariance.

    ``groups`` restricts the check to some groups (default: all of the report); ``progress`` is called with
    each verdict as it is reached. With ``free_outputs`` (see :func:`symgraph.load`) free outputs are compared
    after undoing each element on them.
    """
    from .api import load

    subject = load(source, inputs, free_outputs=free_outputs)
    groups = list(subject.report.groups if groups is None else groups)
    evaluator = Evaluator.of(subject)
    state = evaluator.state
    result = FuzzResult(subject.name, evaluator.tolerance, shapes=[shape_summary(p) for p in evaluator.probes])
    for i, group in enumerate(groups):
        verdict = check_group(evaluator, state, group, samples=samples, seed=seed + i)
        result.verdicts.append(verdict)
        if progress is not None:
            progress(verdict)
    rng = np.random.default_rng(seed)
    if groups:
        elements = [sample(g, rng) for g in groups]
        result.joint_error = evaluator.check(apply(state, elements), elements).relative_error
    return result


def check_group(evaluator: Evaluator, state, group, *, samples: int, seed: int) -> GroupVerdict:
    errors = []

    def violates(element: Element) -> bool:
        outcome = evaluator.check(apply(state, [element]), [element])
        errors.append(outcome.relative_error)
        return not outcome.ok

    config = settings(max_examples=samples, database=None, deadline=None, derandomize=False,
                      phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    try:
        bad = find(group_elements(group), violates, settings=config, random=random.Random(seed))
    except NoSuchExample:
        return GroupVerdict(group.id, group.motif, group.kind, len(errors), max(errors, default=0.0))
    error = evaluator.check(apply(state, [bad]), [bad]).relative_error
    return GroupVerdict(group.id, group.motif, group.kind, len(errors), max(errors), describe(bad, error))


def describe(element: Element, error: float) -> str:
    """A short, human description of a (shrunk) counterexample."""
    g = element.group
    parts = [f"group {g.id} ({g.kind}, size {g.size} x {g.copies}): relative output change {error:.3e}"]
    if element.matrices is not None:
        dist = float(np.linalg.norm(element.matrices - np.eye(g.size)))
        parts.append(f"matrix distance from identity {dist:.3g}")
    if element.perm is not None:
        moved = int((element.perm != np.arange(g.size)).sum())
        parts.append(f"{moved} coordinates permuted")
    if element.diag is not None:
        d = element.diag
        parts.append(f"factors in [{d.min():.3g}, {d.max():.3g}], {int((d < 0).sum())} negative")
    return "; ".join(parts)
