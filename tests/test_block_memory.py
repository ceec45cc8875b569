"""What a block of a large model holds while it is aligned (streamed 7B and MoE alignments): tensors moved and costs
summed a part at a time, a bf16 anchor read in its own dtype, and speed-ups that would copy a whole MoE layer's
experts skipped, and a streamed block's source tensors let go once the aligner holds its copy. Each must give what
the whole-tensor computation gives; the memory itself is measured by examples/bench_7b_align.py, not here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import symgraph
from symgraph import elements as element_module
from symgraph.alignment import Aligner, align_states, select_groups
from symgraph.elements import apply, apply_in_place
from symgraph.groups import TensorMember
from symgraph.solve import certify, screen
from symgraph.solve.workspace import Workspace
from tests.test_certify import _noisy_copy


@pytest.fixture
def small_parts(monkeypatch):
    """Parts of at most 40 elements: every matrix of a zoo model is split, into parts of uneven sizes."""
    monkeypatch.setattr(element_module, "PART", 40)


@pytest.mark.parametrize("family", ["llama", "mixtral", "bert"])
def test_moving_a_tensor_part_by_part_moves_it_as_a_whole(family, zoo_subject, small_parts):
    subject = zoo_subject(family)
    state = {k: v.double() for k, v in subject.state_dict().items()}
    elements = symgraph.sample_elements(subject.report, seed=3)
    assert any(v.dim() >= 2 and v.numel() > 40 for v in state.values())
    expected = apply(state, elements)
    work = {k: v.clone() for k, v in state.items()}
    apply_in_place(work, elements)
    for k in state:
        assert torch.allclose(work[k], expected[k], rtol=1e-12, atol=1e-13), k
    assert any(not torch.equal(work[k], state[k]) for k in state)


def test_split_beside_keeps_the_moved_axis_whole_and_covers_the_tensor(small_parts):
    x = torch.arange(5 * 7 * 3, dtype=torch.float32).reshape(5, 7, 3)
    for axis in range(3):
        parts = element_module.split_beside(x, axis)
        assert len(parts) > 1 and all(p.shape[axis] == x.shape[axis] and p.numel() <= 40 or p.shape[axis] * 3 > 40
                                      for p in parts)
        assert sum(p.numel() for p in parts) == x.numel()
        assert all(p.data_ptr() >= x.data_ptr() for p in parts)  # views of x, not copies
    assert element_module.split_beside(torch.ones(100), 0)[0].shape == (100,)  # a vector is never split


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_costs_summed_part_by_part_are_the_costs(family, monkeypatch):
    groups, source, anchor = _noisy_copy(family, 0.3, torch.float64)
    ws = Workspace({k: v.clone() for k, v in source.items()}, anchor)
    checked = [(g, m) for g in groups for m in g.members if not isinstance(m, TensorMember)]
    assert checked
    whole = [(ws.product("anc", "src", m), ws.unit_sums(m, "src"), ws.unit_sums(m, "src", "anc")) for _, m in checked]
    monkeypatch.setattr(element_module, "PART", 40)
    for (g, m), (product, norms, inner) in zip(checked, whole):
        assert np.allclose(ws.product("anc", "src", m), product, rtol=1e-10, atol=1e-12), m.describe()
        assert np.allclose(ws.unit_sums(m, "src"), norms, rtol=1e-10, atol=1e-12), m.describe()
        assert np.allclose(ws.unit_sums(m, "src", "anc"), inner, rtol=1e-10, atol=1e-12), m.describe()


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_bf16_anchor_is_read_in_its_own_dtype_and_aligns_as_its_float32_copy(family):
    groups, source, anchor = _noisy_copy(family, 0.3, torch.float32)
    anchor = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in anchor.items()}
    chosen = select_groups(groups, "full")
    aligner = Aligner(chosen, source, anchor, mode="full", rescale=True)
    kept = {k: v.dtype for k, v in aligner.ws.anc.items()}
    assert set(kept.values()) == {torch.bfloat16}, "the anchor is not copied to float32"
    assert all(aligner.ws.gather("anc", m).dtype == torch.float32 for g in chosen for m in g.members)
    narrow = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    wide = align_states(chosen, source, {k: v.float() if v.is_floating_point() else v for k, v in anchor.items()},
                        mode="full", rounds=3, tolerance=0.0)
    assert narrow.distance_after == wide.distance_after
    for k in wide.state:
        assert torch.equal(narrow.state[k], wide.state[k]), k


def test_a_weighted_anchor_is_still_copied_to_the_working_dtype():
    """``balance``: each tensor's costs weighted by a factor, which a bf16 anchor cannot hold exactly."""
    groups, source, anchor = _noisy_copy("llama", 0.3, torch.float32)
    anchor = {k: v.to(torch.bfloat16) for k, v in anchor.items()}
    chosen = select_groups(groups, "full")
    weights = {k: 0.5 for k in anchor}
    aligner = Aligner(chosen, source, anchor, mode="full", rescale=True, weights=weights)
    assert {v.dtype for v in aligner.ws.anc.values()} == {torch.float32}


def test_speedups_past_the_copy_budget_are_skipped_and_change_nothing(monkeypatch):
    """The screen's low-precision copies and a certificate's snapshot hold every member of a group: past the
    budget (an MoE layer's experts at 7B) neither is made, and the alignment is the one made with them."""
    groups, source, anchor = _noisy_copy("llama", 0.02, torch.float32)
    chosen = select_groups(groups, "full")
    monkeypatch.setattr(screen, "MIN_SIZE", 0)
    monkeypatch.setattr(screen, "kernel", lambda: "bfloat16")
    screened, kept = [], []
    pays_off, keep = screen.pays_off, certify.keep
    monkeypatch.setattr(screen, "pays_off", lambda *a: screened.append(pays_off(*a)) or screened[-1])
    monkeypatch.setattr(certify, "keep",
                        lambda ws, g, *a: kept.append(keep(ws, g, *a) or g.id in ws.certificates))
    with_copies = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert any(screened) and any(kept)
    screened.clear(), kept.clear()
    for module in (screen, certify):
        monkeypatch.setattr(module, "COPY_BUDGET", 0)
    without = align_states(chosen, source, anchor, mode="full", rounds=3, tolerance=0.0)
    assert screened and not any(screened) and kept and not any(kept)
    assert without.distance_after == with_copies.distance_after
    for k in with_copies.state:
        assert torch.equal(without.state[k], with_copies.state[k]), k


def test_a_streamed_block_lets_go_of_the_source_tensors_it_read(tmp_path, monkeypatch):
    """A streamed block's source tensors as read (an MoE layer's experts converted to the model's stacks: 2.8 GB in
    bf16 at 8x7B) are let go once the aligner holds its working copy; the distances and the written model are those
    of an alignment that kept them."""
    import weakref

    from symgraph import zoo
    from symgraph.io import model_config, save_model
    from symgraph.lazy_state import ConvertedState, LazyState
    from symgraph.streamed_align import align_streamed

    models = [zoo.build("mixtral", seed=s) for s in (0, 1)]
    a, b = (save_model(m.state_dict(), tmp_path / f"m{i}", config=model_config(m)) for i, m in enumerate(models))
    read, alive_when_solving = [], []
    getitem, first_pass = ConvertedState.__getitem__, Aligner.first_pass

    def recorded(self, name):
        tensor = getitem(self, name)
        if self.folder == b and ".layers." in name and tensor.dim() > 1:  # a block's matrices, not its norms
            read.append((name, weakref.ref(tensor)))
        return tensor

    def solving(self, *args, **kwargs):
        alive_when_solving.append([n for n, ref in read if ref() is not None])
        return first_pass(self, *args, **kwargs)

    monkeypatch.setattr(ConvertedState, "__getitem__", recorded)
    monkeypatch.setattr(Aligner, "first_pass", solving)
    streamed = align_streamed(b, a, tmp_path / "out", mode="full")
    assert read and len(alive_when_solving) > 1
    assert not any(alive_when_solving[1:]), alive_when_solving  # the first solves the groups spanning blocks
    sa, sb, out = (m.state_dict() for m in (*models, symgraph.load(tmp_path / "out").model))
    floats = [k for k in sa if sa[k].is_floating_point()]

    def relative(state):
        return float(sum((state[k].double() - sa[k].double()).square().sum() for k in floats).sqrt()
                     / sum(sa[k].double().square().sum() for k in floats).sqrt())

    assert streamed.distance_before == pytest.approx(relative(sb), rel=1e-9)
    assert streamed.distance_after == pytest.approx(relative(out), rel=1e-6) and relative(out) < relative(sb)


def test_a_streamed_alignment_warns_before_reading_when_its_largest_block_cannot_fit(tmp_path, monkeypatch, caplog):
    """The largest block's copies (float32 working copy, anchor and output in their stored dtypes) against the memory
    available: a warning before any block is read, naming the block; none where it fits."""
    from symgraph import streamed_align, zoo
    from symgraph.io import model_config, save_model

    models = [zoo.build("mixtral", seed=s) for s in (0, 1)]
    a, b = (save_model(m.state_dict(), tmp_path / f"m{i}", config=model_config(m)) for i, m in enumerate(models))
    layer = sum(v.numel() for k, v in models[0].state_dict().items() if k.startswith("model.layers.1."))
    need = layer * (4 + 4 + 4)  # float32 checkpoints
    monkeypatch.setattr(streamed_align, "available_memory", lambda: need - 1)
    with caplog.at_level("WARNING", logger="symgraph.streamed_align"):
        streamed_align.align_streamed(b, a, tmp_path / "out", mode="permutation", verify=False)
    warned = [r.getMessage() for r in caplog.records if "The largest block" in r.getMessage()]
    assert len(warned) == 1 and f"needs at least {need / 1e9:.2f} GB" in warned[0] and "--device cuda" in warned[0]
    assert "model.layers.0" in warned[0] or "model.layers.1" in warned[0]
    caplog.clear()
    monkeypatch.setattr(streamed_align, "available_memory", lambda: need)
    with caplog.at_level("WARNING", logger="symgraph.streamed_align"):
        streamed_align.align_streamed(b, a, tmp_path / "out2", mode="permutation", verify=False)
    assert not [r for r in caplog.records if "The largest block" in r.getMessage()]
    assert streamed_align.available_memory() is None or streamed_align.available_memory() > 0
