"""Matchings decided on low-precision costs (symgraph.solve.screen: bfloat16 or int8) are the matchings the working
costs give: the alignment is the same bit for bit with and without screening, a screen that cannot prove its
answer hands over, and the low-precision products stay inside the bound the proof uses."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from symgraph.alignment import align_states, select_groups
from symgraph.elements import apply, sample
from symgraph.solve import screen
from symgraph.solve.workspace import Workspace
from tests.test_certify import _noisy_copy


KERNELS = ["bfloat16", "int8"]


def _screening(monkeypatch, kernel="bfloat16"):
    """Screen every group screen.pays_off would screen on a large model with ``kernel``'s units; count the
    answers."""
    used = []
    original = screen.certified_matching

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        used.append(out is not None)
        return out
    monkeypatch.setattr(screen, "MIN_SIZE", 0)
    monkeypatch.setattr(screen, "kernel", lambda: kernel)
    monkeypatch.setattr(screen, "certified_matching", counted)
    return used


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("noise, dtype", [(0.02, torch.float32), (0.02, torch.float64), (1.0, torch.float32)])
def test_alignment_is_the_same_with_and_without_screening(noise, dtype, kernel, monkeypatch):
    groups, source, anchor = _noisy_copy("llama", noise, dtype)
    chosen = select_groups(groups, "full")
    used = _screening(monkeypatch, kernel)
    screened = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert used and (any(used) or noise == 1.0)  # a noisy copy's FFN matchings are proven from low precision
    monkeypatch.setattr(screen, "pays_off", lambda ws, g, members: False)
    plain = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert screened.distance_after == plain.distance_after
    assert [s.group for s in screened.stats] == [s.group for s in plain.stats]
    for k in plain.state:
        assert torch.equal(screened.state[k], plain.state[k]), k


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_screen_that_cannot_separate_two_units_hands_over(kernel, monkeypatch):
    _screening(monkeypatch, kernel)
    groups, _, anchor = _noisy_copy("llama", 0.0, torch.float32)
    g = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    source = apply(anchor, [sample(g, np.random.default_rng(1))], dtype=torch.float32)
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    members = [m for m in g.members if m.action != "permute"]
    assert screen.pays_off(ws, g, members)
    found = screen.certified_matching(ws, g, members, signed=False, normalise=False)
    assert found is not None and (found[2] > 0).all()  # a permuted copy: every margin proven
    for m in members:  # anchor units 0 and 1 differ by less than the kernel can tell: no proof, the working costs
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


@pytest.mark.parametrize("spread", [0.0, 3.0])
def test_int8_products_stay_inside_the_bound(spread):
    """int8 screening: integers on a scale per unit, exact int32 sums; half a step per entry bounds every
    product, and on Gaussian units the bound is small enough to prove a matching."""
    from symgraph.groups import Member

    g = torch.Generator().manual_seed(1)
    features = 4096
    ramp = torch.logspace(-spread, spread, features)
    x = torch.randn(1, 96, features, generator=g) * ramp  # source units
    y = torch.randn(1, 80, features, generator=g) * ramp.flip(0)  # anchor units
    ws = Workspace({"w": x[0, :80]}, {"w": y[0]})
    columns = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same units stored as columns (strided)
    for units in (x, columns):
        (q, s), bound = screen._quantised(units)
        error = (x.double() - s.double() * q.double()).pow(2).sum(-1)
        assert (error <= torch.from_numpy(bound)).all()
    member = Member("w", 0, np.arange(80).reshape(1, 80, 1), "primal")
    part = screen._Part(ws, [member], "int8")
    got = torch.from_numpy(part.rows(slice(0, 80), normalise=False)).double()
    exact = torch.bmm(y.double(), x[:, :80].double().transpose(1, 2))
    bound = part.error * torch.from_numpy(part.alpha[0][:, None] * part.sigma[0][None, :])
    assert ((got - exact)[0].abs() <= bound).all()
    if spread == 0.0:
        assert part.error < 0.05


def test_the_kernel_follows_the_cpu(monkeypatch):
    units = {}
    monkeypatch.setattr(screen, "_cpu_has", lambda probe: units.get(probe, False))
    assert screen.kernel() is None
    units["_is_vnni_supported"] = True
    assert screen.kernel() == "int8"
    units["_is_amx_tile_supported"] = True
    assert screen.kernel() == "bfloat16"


def test_a_hard_matching_stops_after_one_chunk(monkeypatch):
    """Two unrelated models: the screen stops at the first chunk of rows it cannot prove."""
    _screening(monkeypatch, "int8")
    monkeypatch.setattr(screen, "CHUNK_ENTRIES", 1)  # one row per chunk
    groups, _, anchor = _noisy_copy("llama", 0.0, torch.float32)
    g = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    gen = torch.Generator().manual_seed(3)
    source = {k: torch.randn(v.shape, generator=gen) if v.is_floating_point() else v for k, v in anchor.items()}
    ws = Workspace(source, anchor)
    members = [m for m in g.members if m.action != "permute"]
    calls = []
    original = screen._Part.rows
    monkeypatch.setattr(screen._Part, "rows", lambda self, rows, normalise: calls.append(rows) or
                        original(self, rows, normalise))
    assert screen.certified_matching(ws, g, members, signed=False, normalise=False) is None
    assert len(calls) < g.size / 4
