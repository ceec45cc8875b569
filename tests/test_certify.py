"""Certified identity solves (symgraph.solve.certify): a permutation solve skipped because the kept margins prove
its answer is the identity gives what the full solve gives, and a source that moved too far is solved again."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.elements import Element, apply, apply_in_place, sample
from symgraph.solve import certify, dispatch
from symgraph.solve.workspace import Workspace


def _noisy_copy(family, noise, dtype):
    model = zoo.build(family, seed=0, dtype=dtype)
    subject = symgraph.load(model, zoo.example_inputs_for(family, model))
    anchor = subject.state_dict()
    source = apply(anchor, [sample(g, np.random.default_rng(7)) for g in subject.report.groups], dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    source = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen, dtype=v.dtype)
              if v.is_floating_point() and v.numel() > 1 else v for k, v in source.items()}
    return subject.report.groups, source, anchor


def _counting(monkeypatch):
    used = []
    original = certify.identity_if_certified

    def counted(ws, g, members):
        out = original(ws, g, members)
        used.append(out is not None)
        return out
    monkeypatch.setattr(certify, "identity_if_certified", counted)
    return used


@pytest.mark.parametrize("family, mode, dtype", [("llama", "full", torch.float32), ("llama", "full", torch.float64),
                                                 ("bert", "permutation", torch.float32)])
def test_alignment_is_the_same_with_and_without_certificates(family, mode, dtype, monkeypatch):
    groups, source, anchor = _noisy_copy(family, 0.02, dtype)
    chosen = select_groups(groups, mode)
    used = _counting(monkeypatch)
    certified = align_states(chosen, source, anchor, mode=mode, rounds=4, tolerance=0.0)
    assert any(used)  # the descent re-solved some permutation whose answer was certified
    monkeypatch.setattr(certify, "identity_if_certified", lambda ws, g, members: None)
    plain = align_states(chosen, source, anchor, mode=mode, rounds=4, tolerance=0.0)
    assert certified.distance_after == plain.distance_after
    assert [s.group for s in certified.stats] == [s.group for s in plain.stats]
    for k in plain.state:
        assert torch.equal(certified.state[k], plain.state[k]), k


def test_a_solve_is_skipped_only_while_the_margins_prove_the_identity():
    groups, _, anchor = _noisy_copy("llama", 0.0, torch.float64)
    g = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    source = apply(anchor, [sample(g, np.random.default_rng(1))])  # the anchor with its FFN units permuted
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    ctx = dispatch.SolveContext(mode="permutation", first_pass=False)
    element = dispatch.solve(ws, g, list(g.members), ctx)[0]
    assert not element.is_identity()  # the source is a permuted copy: the first solve moves it
    apply_in_place(ws.src, [element])
    assert g.id in ws.certificates
    members = ws.costed(list(g.members))
    assert certify.identity_if_certified(ws, g, members) is not None  # nothing moved since

    rng = np.random.default_rng(0)
    small = Element(g, perm=np.tile(np.arange(g.size), (g.copies, 1)),
                    diag=1 + 1e-3 * rng.standard_normal((g.copies, g.size)))
    apply_in_place(ws.src, [small])
    assert certify.identity_if_certified(ws, g, members) is not None
    ws.certificates.clear()
    assert dispatch.solve(ws, g, list(g.members), ctx)[0].is_identity()  # what the skip returned

    apply_in_place(ws.src, [small])
    swap = np.tile(np.arange(g.size), (g.copies, 1))
    swap[:, [0, 1]] = swap[:, [1, 0]]
    apply_in_place(ws.src, [Element(g, perm=swap, diag=np.ones((g.copies, g.size)))])
    assert certify.identity_if_certified(ws, g, members) is None  # two units swapped: solved again
    assert not dispatch.solve(ws, g, list(g.members), ctx)[0].is_identity()


def test_no_certificate_is_kept_when_the_margins_cannot_hold():
    groups, _, anchor = _noisy_copy("llama", 0.0, torch.float64)
    g = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    ws = Workspace({k: v.clone() for k, v in anchor.items()}, anchor)
    members = list(g.members)
    for m in members:  # source units 0 and 1 alike: anchor unit 0's best entry is no longer alone in its row
        x = ws.src[m.param]
        x.select(m.axis, int(m.index[0, 1, 0])).copy_(x.select(m.axis, int(m.index[0, 0, 0])))
    dispatch.solve(ws, g, members, dispatch.SolveContext(mode="permutation", first_pass=False))
    assert g.id not in ws.certificates
