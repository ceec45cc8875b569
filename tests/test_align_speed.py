"""The alignment's fast paths give what the plain ones give: per-layer member sums (symgraph.solve.sums) equal sums
read afresh after any moves, alignment lands where it lands without them, in-place moves through slice views
equal the copying application."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, select_groups
from symgraph.elements import Element, apply, apply_in_place, sample
from symgraph.fold import folded_subject
from symgraph.solve import sums
from symgraph.solve.workspace import Workspace


def _pair(folded: bool):
    a, b = zoo.build("llama", seed=0, dtype=torch.float64), zoo.build("llama", seed=1, dtype=torch.float64)
    subjects = [symgraph.load(m, zoo.example_inputs_for("llama", m)) for m in (a, b)]
    if folded:
        subjects = [folded_subject(s) for s in subjects]
    return subjects[0].report.groups, subjects[1].state_dict(), subjects[0].state_dict()


def _fresh(ws: Workspace) -> Workspace:
    return Workspace({k: v.clone() for k, v in ws.src.items()}, ws.anc)


@pytest.mark.parametrize("folded", [False, True])
def test_cached_residual_sums_follow_every_move(folded):
    groups, source, anchor = _pair(folded)
    residual = next(g for g in groups if g.motif == "residual")
    inner = [g for g in groups if g.motif != "residual"]
    assert len({sums.layer_of(m.param) for m in residual.members}) > 2  # spans layers: its sums are kept
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    primal = [m for m in residual.members if m.action != "dual"]
    rng = np.random.default_rng(0)
    for step, g in enumerate([residual, inner[0], residual, inner[-1], residual]):
        cached = ws.cross(primal, residual), ws.similarity(residual.members, residual, normalise=False)
        if step:  # after a move: the kept sums must equal sums read afresh from the moved source
            fresh = _fresh(ws)
            np.testing.assert_allclose(cached[0], fresh.cross(primal, residual), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(cached[1], fresh.similarity(residual.members, residual, normalise=False),
                                       rtol=1e-12, atol=1e-12)
        element = sample(g, rng)
        apply_in_place(ws.src, [element])
        ws.moved([element])
    assert any(e.versions == tuple(ws.sums.version[p] for p in e.params) for e in ws.sums._entries.values())


@pytest.mark.parametrize("mode", ["full", "permutation"])
def test_alignment_is_the_same_with_and_without_kept_sums(mode, monkeypatch):
    groups, source, anchor = _pair(folded=mode == "full")
    chosen = select_groups(groups, mode)
    kept = align_states(chosen, source, anchor, mode=mode, rounds=3)
    monkeypatch.setattr(sums, "MIN_FEATURES", 10**12)  # nothing kept: every sum read afresh
    fresh = align_states(chosen, source, anchor, mode=mode, rounds=3)
    assert kept.distance_after < kept.distance_before
    assert kept.distance_after == pytest.approx(fresh.distance_after, rel=1e-9)
    for k in fresh.state:
        torch.testing.assert_close(kept.state[k], fresh.state[k], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_in_place_moves_equal_the_copying_application(family):
    model = zoo.build(family, seed=0, dtype=torch.float64)
    groups = symgraph.load(model, zoo.example_inputs_for(family, model)).report.groups
    state = model.state_dict()
    elements = [sample(g, np.random.default_rng(3)) for g in groups]
    work = {k: v.clone() for k, v in state.items()}
    apply_in_place(work, elements)
    expected = apply(state, elements)
    assert any(not torch.equal(expected[k], state[k]) for k in state)
    # equal to rounding: matmuls on strided views and on copies may take different kernels (bit-equal on some CPUs,
    # not on others: 1e-17 apart on one); a wrong slot, inverse or scale is off by the weights' size, 1e-2 and more
    for k in state:
        torch.testing.assert_close(work[k], expected[k], rtol=1e-12, atol=1e-15)


def test_a_stale_kept_sum_is_read_again_after_its_group_moves():
    """An estimate reads a moved layer without refreshing its kept sum; when the residual group then moves, that
    stale sum must not be carried along as if it were current."""
    groups, source, anchor = _pair(folded=False)
    residual = next(g for g in groups if g.motif == "residual")
    inner = next(g for g in groups if g.motif == "ffn" and g.kind == "permutation")
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    rng = np.random.default_rng(1)
    ws.similarity(residual.members, residual, normalise=False)  # kept sums for every layer
    unsigned = Element(residual, perm=sample(residual, rng).perm, diag=np.ones((1, residual.size)))  # followable
    for element in (sample(inner, rng), unsigned):  # one layer stale, then the residual moves
        apply_in_place(ws.src, [element])
        ws.moved([element])
    np.testing.assert_allclose(ws.similarity(residual.members, residual, normalise=False),
                               _fresh(ws).similarity(residual.members, residual, normalise=False),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_chunked_float64_reductions_match_a_float64_copy(monkeypatch, dtype):
    """row_sums and squared_distance (numpy casting chunk by chunk) equal the same sums over a float64 copy, for
    every working dtype, transposed views and chunks that split the rows."""
    from symgraph.solve import reduce

    monkeypatch.setattr(reduce, "CHUNK", 64)  # several chunks, the last one short
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(3, 41, 23, generator=g).to(dtype).transpose(-1, -2) for _ in range(2))  # (3, 23, 41) views
    x64, y64 = x.double(), y.double()
    scale = (x64.pow(2).sum(-1) * y64.pow(2).sum(-1)).sqrt().numpy()
    cases = [(reduce.row_sums(x), x64.pow(2).sum(-1)), (reduce.row_sums(x, y), (x64 * y64).sum(-1)),
             (reduce.row_sums(x, y, minus=True), (x64 - y64).pow(2).sum(-1))]
    for got, want in cases:
        assert got.shape == (3, 23)
        np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=1e-13 * scale.max())
    assert reduce.squared_distance(x, y) == pytest.approx(float((x64 - y64).pow(2).sum()), rel=1e-14)
    assert reduce.squared_distance(x) == pytest.approx(float(x64.pow(2).sum()), rel=1e-14)


def test_a_last_group_is_solved_without_testing_its_readiness(monkeypatch):
    """The streamed residual stream is one group alone: it is next whatever its Gram matrix says (the rank test
    of a 4096-wide stream is a 2-TFLOP product and an eigendecomposition), and lands where it did."""
    from symgraph.alignment import Aligner

    groups, source, anchor = _pair(folded=True)
    residual = [g for g in groups if g.motif == "residual"]
    assert len(residual) == 1
    before = Aligner(residual, source, anchor, mode="full", rescale=True)
    before.first_pass()
    monkeypatch.setattr(Aligner, "_determined", lambda *a: pytest.fail("readiness tested for a last group"))
    after = Aligner(residual, source, anchor, mode="full", rescale=True)
    after.first_pass()
    assert [e.group.id for e in after.elements] == [e.group.id for e in before.elements]
    for k in before.src:
        assert torch.equal(after.src[k], before.src[k]), k


def test_a_matrix_groups_readiness_is_asked_again_only_when_its_exact_members_change(monkeypatch):
    """Other groups' elements are invertible, so they leave the rank of a matrix group's exact members alone: its
    Gram matrix is tested again only for a new set of exact members (markuplm's many small groups sharing its xpath
    embeddings asked 40k times in a merge), and the first pass solves in the same order to the same place."""
    import transformers

    from symgraph.alignment import Aligner

    config = transformers.MarkupLMConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, max_position_embeddings=64, max_depth=8,
                                         xpath_unit_hidden_size=16, max_xpath_tag_unit_embeddings=32,
                                         max_xpath_subs_unit_embeddings=32)
    anchor, source = (symgraph.load(transformers.MarkupLMModel(config).eval()) for _ in range(2))
    full_rank = Aligner._gram_full_rank
    asked = []
    monkeypatch.setattr(Aligner, "_gram_full_rank", lambda self, g, members: asked.append(g.id) or full_rank(
        self, g, members))
    runs = {}
    for cached in (True, False):
        if not cached:
            monkeypatch.setattr(Aligner, "_full_rank", lambda self, g, members: self._gram_full_rank(g, members))
        asked.clear()
        aligner = Aligner(anchor.report.groups, source.state_dict(), anchor.state_dict(), mode="full", rescale=True)
        aligner.first_pass()
        runs[cached] = len(asked), aligner
    (fewer, with_cache), (more, without) = runs[True], runs[False]
    assert 0 < fewer < more
    assert [e.group.id for e in with_cache.elements] == [e.group.id for e in without.elements]
    for k in with_cache.src:
        assert torch.equal(with_cache.src[k], without.src[k]), k
