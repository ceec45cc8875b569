"""Checks shared by the per-op test files: a census of a report's groups, and a fuzz at several input shapes."""
from __future__ import annotations

import collections

from symgraph.fuzz import fuzz


def census(subject) -> dict[str, int]:
    """``{"motif kind[/scale] SIZExCOPIES": count}`` for every group of ``subject``'s report."""
    return dict(collections.Counter(f"{g.motif} {g.kind}{'/' + g.scale if g.scale else ''} {g.size}x{g.copies}"
                                    for g in subject.report.groups))


def assert_fuzzed_at_two_shapes(subject, samples: int = 5) -> None:
    result = fuzz(subject, samples=samples)
    assert result.ok, [v.counterexample for v in result.failures]
    assert len(result.shapes) >= 2 and len(set(result.shapes)) == len(result.shapes)
