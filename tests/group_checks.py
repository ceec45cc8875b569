"""Checks shared by the per-op test files: generic weights, a census of a report's groups, and a fuzz at several
input shapes."""
from __future__ import annotations

import collections

import torch

from symgraph.fuzz import fuzz


def noisy(model: torch.nn.Module, scale: float = 0.2) -> torch.nn.Module:
    """``model`` in eval mode with every parameter moved by Gaussian noise (seed 0): no norm weight stays 1 and no
    bias 0, so no symmetry appears that only special values have."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.eval()


def census(subject) -> dict[str, int]:
    """``{"motif kind[/scale] SIZExCOPIES": count}`` for every group of ``subject``'s report."""
    return dict(collections.Counter(f"{g.motif} {g.kind}{'/' + g.scale if g.scale else ''} {g.size}x{g.copies}"
                                    for g in subject.report.groups))


def assert_fuzzed_at_two_shapes(subject, samples: int = 5) -> None:
    result = fuzz(subject, samples=samples)
    assert result.ok, [v.counterexample for v in result.failures]
    assert len(result.shapes) >= 2 and len(set(result.shapes)) == len(result.shapes)
