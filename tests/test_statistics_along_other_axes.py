"""A nonlinear statistic of each coordinate along another axis (a softmax or maximum over tokens, per hidden unit)
is an activation of that coordinate's entries: its units may only be permuted, never mixed (float64 checks)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import symgraph
from symgraph.elements import apply, sample

STATISTICS = {
    "softmax over tokens": lambda h: h.softmax(1),
    "log_softmax over tokens": lambda h: h.log_softmax(1),
    "max over tokens subtracted": lambda h: h - h.amax(1, keepdim=True),
    "logsumexp over tokens subtracted": lambda h: h - torch.logsumexp(h, 1, keepdim=True),
    "norm over tokens": lambda h: h * torch.linalg.vector_norm(h, dim=1, keepdim=True),
    "layer norm over tokens": lambda h: nn.functional.layer_norm(h.transpose(1, 2), (h.shape[1],)).transpose(1, 2),
    "rms norm over tokens": lambda h: nn.functional.rms_norm(h.transpose(1, 2), (h.shape[1],)).transpose(1, 2),
}
LINEAR = {"cumulative sum over tokens": lambda h: h.cumsum(1),
          "mean over tokens added": lambda h: h + h.mean(1)[:, None]}


class UnitMLP(nn.Module):
    def __init__(self, statistic):
        super().__init__()
        self.statistic = statistic
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(self.statistic(self.up(x)))


def _groups_and_worst_error(statistic):
    torch.manual_seed(0)
    model = UnitMLP(statistic).double().eval()
    report = symgraph.analyze(model, inputs=(torch.randn(2, 5, 8, dtype=torch.float64),))
    state = dict(model.state_dict())
    worst = 0.0
    for seed, g in enumerate(report.groups):
        moved = copy.deepcopy(model)
        moved.load_state_dict(apply(state, [sample(g, np.random.default_rng(seed))]))
        for shape in ((2, 5, 8), (3, 7, 8)):
            x = torch.randn(*shape, dtype=torch.float64)
            with torch.no_grad():
                y, z = model(x), moved(x)
            worst = max(worst, float((z - y).norm() / y.norm()))
    return report.groups, worst


@pytest.mark.parametrize("name", STATISTICS)
def test_units_of_a_statistic_along_another_axis_only_permute(name):
    groups, worst = _groups_and_worst_error(STATISTICS[name])
    assert [(g.kind, g.size) for g in groups] == [("permutation", 16)]
    assert worst < 1e-12


@pytest.mark.parametrize("name", LINEAR)
def test_a_linear_map_along_another_axis_keeps_the_general_linear_group(name):
    groups, worst = _groups_and_worst_error(LINEAR[name])
    assert [(g.kind, g.size) for g in groups] == [("general_linear", 16)]
    assert worst < 1e-12
