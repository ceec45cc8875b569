"""Checks shared by the per-op test files: generic weights, a census of a report's groups, a fuzz at several
input shapes, and the largest change of outputs on given inputs under random group elements."""
from __future__ import annotations

import collections

import numpy as np
import torch

from symgraph.elements import apply, sample
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


def largest_change(model, report, inputs, draws=3, run=lambda model, inputs: model(**inputs)) -> float:
    """The largest relative change of ``model``'s float64 outputs (``run``) on ``inputs`` under random elements
    of each group of ``report`` (the model is put back as it was)."""
    model = model.double().eval()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = run(model, inputs)
    rng, worst = np.random.default_rng(0), 0.0
    for group in report.groups:
        for _ in range(draws):
            model.load_state_dict(apply(state, [sample(group, rng)]))
            with torch.no_grad():
                worst = max(worst, float((run(model, inputs) - ref).abs().max() / ref.abs().max()))
    model.load_state_dict(state)
    return worst
