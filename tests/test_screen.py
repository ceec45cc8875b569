"""Matchings decided on bfloat16 costs (symgraph.solve.screen) are the matchings the working costs give: the
alignment is the same bit for bit with and without screening, a screen that cannot prove its answer hands over,
and the bfloat16 products stay inside the bound the proof uses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from symgraph.alignment import align_states, select_groups
from symgraph.elements import apply, sample
from symgraph.solve import screen
from symgraph.solve.workspace import Workspace
from tests.test_certify import _noisy_copy


def _screening(monkeypatch):
    """Screen every group screen.pays_off would screen on a large model with bfloat16 units; count the answers."""
    used = []
    original = screen.certified_matching

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        used.append(out is not None)
        return out
    monkeypatch.setattr(screen, "MIN_SIZE", 0)
    monkeypatch.setattr(screen, "bf16_matrix_units", lambda: True)
    monkeypatch.setattr(screen, "certified_matching", counted)
    return used


@pytest.mark.slow
@pytest.mark.parametrize("noise, dtype", [(0.02, torch.float32), (0.02, torch.float64), (1.0, torch.float32)])
def test_alignment_is_the_same_with_and_without_screening(noise, dtype, monkeypatch):
    groups, source, anchor = _noisy_copy("llama", noise, dtype)
    chosen = select_groups(groups, "full")
    used = _screening(monkeypatch)
    screened = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert used and (any(used) or noise == 1.0)  # a noisy copy's FFN matchings are proven from bfloat16
    monkeypatch.setattr(screen, "pays_off", lambda ws, g, members: False)
    plain = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert screened.distance_after == plain.distance_after
    assert [s.group for s in screened.stats] == [s.group for s in plain.stats]
    for k in plain.state:
        assert torch.equal(screened.state[k], plain.state[k]), k


def test_a_screen_that_cannot_separate_two_units_hands_over(monkeypatch):
    _screening(monkeypatch)
    groups, _, anchor = _noisy_copy("llama", 0.0, torch.float32)
    g = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    source = apply(anchor, [sample(g, np.random.default_rng(1))], dtype=torch.float32)
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    members = [m for m in g.members if m.action != "permute"]
    assert screen.pays_off(ws, g, members)
    found = screen.certified_matching(ws, g, members, signed=False, normalise=False)
    assert found is not None and (found[2] > 0).all()  # a permuted copy: every margin proven
    for m in members:  # anchor units 0 and 1 differ by less than bfloat16 can tell: no proof, the working costs
        x = ws.anc[m.param] = ws.anc[m.param].clone()
        row = x.select(m.axis, int(m.index[0, 0, 0]))
        x.select(m.axis, int(m.index[0, 1, 0])).copy_(row * (1 + 1e-4))
    assert screen.certified_matching(ws, g, members, signed=False, normalise=False) is None


def test_bfloat16_products_stay_inside_the_bound():
    """The proof's assumption about the kernel: bfloat16 inputs, float32 accumulation, one bfloat16 rounding."""
    g = torch.Generator().manual_seed(0)
    features = 8192
    x = torch.randn(1, 64, features, generator=g) * torch.logspace(-3, 3, features)  # wide range, cancellation
    y = torch.randn(1, 64, features, generator=g) * torch.logspace(3, -3, features)
    got = torch.bmm(x.bfloat16(), y.bfloat16().transpose(1, 2)).double()
    exact = torch.bmm(x.double(), y.double().transpose(1, 2))
    ws = Workspace({"w": x[0]}, {"w": y[0]})
    from symgraph.groups import Member

    member = Member("w", 0, np.arange(64).reshape(1, 64, 1), "primal")
    bound = screen._epsilon(ws, [member]) * x.double().norm(dim=2)[0, :, None] * y.double().norm(dim=2)[0, None, :]
    assert ((got - exact)[0].abs() <= bound).all()
