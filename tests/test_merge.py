"""Merging: the methods against their definitions, alignment before statistics, N-model consensus, heads, the CLI.

Alignment-dependent tests use LLaMA, whose random reparametrisations the aligner recovers exactly.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from transformers.pytorch_utils import Conv1D

import symgraph
import symgraph.learn
from symgraph import zoo
from symgraph.datasets import Batch, Dataset
from symgraph.elements import apply
from symgraph.errors import DataError, MismatchError, SymgraphError
from symgraph.merging import fisher_average, head_parameters, merge, regmean_solution
from symgraph.statistics import input_grams, linear_layers
from symgraph.verify import Evaluator

from cli_runner import run


# -- fixtures and helpers --------------------------------------------------------------------------------------------
def tokens(batches: int = 2, size: int = 6, length: int = 10, seed: int = 0, classes: int | None = None) -> Dataset:
    """Random token ids: causal LM data, or classification data with ``classes`` labels."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        ids = torch.randint(0, 100, (size, length), generator=g)
        labels = ids if classes is None else torch.randint(0, classes, (size,), generator=g)
        out.append(Batch({"input_ids": ids}, labels))
    return Dataset("tokens", "causal_lm" if classes is None else "classification", tuple(out))


def with_state(model: torch.nn.Module, state: dict) -> symgraph.Subject:
    """A copy of ``model`` holding ``state``, loaded as a Subject (its capture is cached across merges)."""
    other = copy.deepcopy(model)
    other.load_state_dict(state)
    return symgraph.load(other)


def noisy(subject, seed: int, noise: float) -> dict:
    """The subject's state with independent relative noise ``noise`` on every tensor."""
    g = torch.Generator().manual_seed(100 + seed)
    return {k: v + noise * v.std() * torch.randn(v.shape, generator=g) for k, v in subject.state_dict().items()}


def planted(subject, seed: int, noise: float) -> symgraph.Subject:
    """A noisy copy of the subject's model, moved by a random element of every group."""
    state = apply(noisy(subject, seed, noise), symgraph.sample_elements(subject.report, seed))
    return with_state(subject.model, state)


@pytest.fixture(scope="module")
def llama():
    return symgraph.load(zoo.build("llama", seed=0))


@pytest.fixture(scope="module")
def llama_other():
    """An independent model of the same architecture."""
    return symgraph.load(zoo.build("llama", seed=1))


@pytest.fixture(scope="module")
def llama_twin(llama):
    """Same function as ``llama``, other parameters (a random element of every group, checked in float64)."""
    return with_state(llama.model, symgraph.transform(llama, seed=1))


def relative_error(subject, state) -> float:
    return Evaluator(subject.model, subject.args, subject.kwargs).check(state).relative_error


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# -- methods against their definitions -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["simple", "fisher", "regmean"])
def test_merging_a_model_with_its_reparametrisation_keeps_its_function(llama, llama_twin, method):
    aligned = merge([llama, llama_twin], method=method, data=tokens(), progress=False)
    assert relative_error(llama, aligned.state) < 1e-5
    assert max(aligned.distances) < 1e-5 < min(aligned.distances_before)
    unaligned = merge([llama, llama_twin], method=method, align="none", data=tokens(), progress=False)
    assert relative_error(llama, unaligned.state) > 1e-2


@pytest.mark.parametrize("method", ["fisher", "regmean"])
def test_statistics_are_taken_on_the_aligned_models(llama, method):
    """B and g.B give the same merge with A: the statistics see B in A's frame either way. Taken before
    alignment, g.B's Fisher or Gram matrices would sit in another frame than its aligned parameters."""
    close = with_state(llama.model, noisy(llama, seed=0, noise=0.05))  # B: near A, in A's frame
    moved = with_state(llama.model, apply(close.state_dict(), symgraph.sample_elements(llama.report, 5)))
    # A stays the reference; unfolded, so both merges recover the exact frame (the folded orthogonal stream
    # is aligned by a descent that stops at a tolerance); by weights alone: judged on synthetic data, B's two starts
    # tie and g.B's recovery is kept at once, so the frames agree only to the descent's tolerance
    kwargs = dict(method=method, data=tokens(), weights=[0.6, 0.4], progress=False, fold=False, frame="reference",
                  judge_starts=False)
    direct, via_moved = merge([llama, close], **kwargs), merge([llama, moved], **kwargs)
    simple = merge([llama, close], method="simple", weights=[0.6, 0.4], progress=False, fold=False,
                   frame="reference", judge_starts=False)
    assert max_difference(direct.state, via_moved.state) < 1e-5
    assert max_difference(direct.state, simple.state) > 1e-3  # the statistics did change the merge


@pytest.mark.parametrize("method", ["simple", "fisher", "regmean"])
def test_weights_one_and_zero_return_the_first_model(llama, llama_other, method):
    result = merge([llama, llama_other], method=method, weights=[1, 0], data=tokens(), fold=False, progress=False)
    assert max_difference(result.state, llama.state_dict()) < 1e-6
    assert all(result.state[k].dtype == v.dtype for k, v in llama.state_dict().items())


def test_fisher_with_equal_fishers_is_the_weighted_average():
    g = torch.Generator().manual_seed(0)
    states = [{"w": torch.randn(4, 3, generator=g)} for _ in range(3)]
    fisher = {"w": torch.rand(4, 3, generator=g)}
    fisher["w"][0] = 0.0  # no data reached this row: it must still get the weighted average
    weights = [0.2, 0.3, 0.5]
    merged = fisher_average(states, [fisher] * 3, weights, ["w"])["w"]
    expected = sum(w * s["w"].double() for w, s in zip(weights, states))
    torch.testing.assert_close(merged, expected)


def test_fisher_weights_each_coordinate_by_its_fisher():
    states = [{"w": torch.tensor([1.0, 1.0])}, {"w": torch.tensor([5.0, 5.0])}]
    fishers = [{"w": torch.tensor([3.0, 1.0])}, {"w": torch.tensor([1.0, 3.0])}]
    merged = fisher_average(states, fishers, [0.5, 0.5], ["w"])["w"]
    torch.testing.assert_close(merged, torch.tensor([2.0, 4.0], dtype=torch.float64), atol=1e-5, rtol=0)


def _layer(kind: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(5, 3) if kind == "linear" else Conv1D(3, 5)


def _weight_and_bias(layer: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
    w = layer.weight.detach().double().numpy()
    return (w.T if isinstance(layer, Conv1D) else w), layer.bias.detach().double().numpy()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_regmean_solves_the_merged_least_squares_problem(kind):
    """alpha = 1: the merged layer minimises sum_i w_i ||X_i W^T + b - (X_i W_i^T + b_i)||^2 (bias included)."""
    layers = [_layer(kind, seed) for seed in (0, 1)]
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(40, 5, generator=g) * torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0]) + i for i in range(2)]
    data = [Dataset(f"x{i}", "classification", (Batch({"input": x[:20]}, torch.zeros(20).long()),
                                                  Batch({"input": x[20:]}, torch.zeros(20).long())))
            for i, x in enumerate(xs)]
    subjects = [symgraph.load(layer, (xs[0][:2],)) for layer in layers]
    if kind == "conv1d":
        data = [Dataset(d.name, d.task, tuple(Batch({"x": b.inputs["input"]}, b.labels) for b in d.batches))
                for d in data]
    weights = [0.25, 0.75]
    result = merge(subjects, method="regmean", align="none", data=data, weights=weights, alpha=1.0,
                   progress=False)

    rows, targets = [], []
    for w, x, layer in zip(weights, xs, layers):
        weight, bias = _weight_and_bias(layer)
        design = np.hstack([x.double().numpy(), np.ones((len(x), 1))])
        rows.append(np.sqrt(w) * design)
        targets.append(np.sqrt(w) * (x.double().numpy() @ weight.T + bias))
    solution = np.linalg.lstsq(np.vstack(rows), np.vstack(targets), rcond=None)[0]
    merged_weight = result.state["weight"].double().numpy()
    merged_weight = merged_weight if kind == "linear" else merged_weight.T
    np.testing.assert_allclose(merged_weight, solution[:-1].T, atol=1e-5)
    np.testing.assert_allclose(result.state["bias"].double().numpy(), solution[-1], atol=1e-5)


def test_regmean_with_alpha_zero_weights_each_input_feature_by_its_energy():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(3, 4, generator=g, dtype=torch.float64) for _ in range(2)]
    xs = [torch.randn(10, 4, generator=g, dtype=torch.float64) * (i + 1) for i in range(2)]
    grams = [x.T @ x for x in xs]
    scales = [0.3, 0.7]
    merged = regmean_solution(ws, grams, scales, alpha=0.0)
    energy = [s * torch.diagonal(gram) for s, gram in zip(scales, grams)]  # per input feature
    expected = sum(e * w for e, w in zip(energy, ws)) / sum(energy)
    torch.testing.assert_close(merged, expected)


def test_regmean_falls_back_to_the_average_where_no_model_saw_data():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    xs = [torch.randn(8, 3, generator=g, dtype=torch.float64) for _ in range(2)]
    for x in xs:
        x[:, 2] = 0.0  # input feature 2 is never active: its column is not determined by the data
    merged = regmean_solution(ws, [x.T @ x for x in xs], [0.5, 0.5], alpha=1.0)
    assert torch.isfinite(merged).all()
    torch.testing.assert_close(merged[:, 2], (ws[0][:, 2] + ws[1][:, 2]) / 2)


def test_gram_matrices_leave_padding_out():
    """Right-padded sequences with an attention mask give the Gram matrices of the unpadded sequences."""
    model = zoo.build("bert", seed=0)
    ids = torch.randint(1, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    padded = torch.cat([ids, torch.zeros(4, 3, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(4, 6), torch.zeros(4, 3)], 1).long()
    labels = torch.zeros(4).long()
    plain = input_grams(model, Dataset("plain", "classification", (Batch({"input_ids": ids}, labels),)),
                        progress=False)
    masked = input_grams(model, Dataset("padded", "classification", (
        Batch({"input_ids": padded, "attention_mask": mask}, labels),)), progress=False)
    for name in ("bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.output.dense"):
        torch.testing.assert_close(masked[name], plain[name], rtol=1e-4, atol=1e-6)


def test_linear_layers_find_conv1d_transposed():
    layers = linear_layers(zoo.build("gpt2"))
    assert layers["transformer.h.0.attn.c_attn"].transposed
    assert layers["transformer.h.0.mlp.c_proj"].bias == "transformer.h.0.mlp.c_proj.bias"
    assert not layers["lm_head"].transposed


# -- more than two models ------------------------------------------------------------------------------------------
def test_consensus_does_not_depend_on_the_argument_order(llama):
    models = [llama, planted(llama, seed=1, noise=0.02), planted(llama, seed=2, noise=0.02)]
    results = [merge([models[i] for i in order], progress=False) for order in [(0, 1, 2), (2, 0, 1), (1, 2, 0)]]
    for result in results[1:]:
        assert max_difference(results[0].state, result.state) < 1e-5
    assert sorted(results[0].distances) == pytest.approx(sorted(results[1].distances), abs=1e-9)
    assert max(results[0].distances) < 0.02 < min(results[0].distances_before)


# -- heads --------------------------------------------------------------------------------------------------------------
def test_full_merges_align_each_model_first_as_align_does():
    """Without data, a full merge's first alignment onto the reference is `align`'s: starts judged and activations
    of synthetic examples tried on the models themselves (not by weights alone), and the result says what it kept."""
    a, b = (symgraph.load(zoo.build("vit", seed=s)) for s in (0, 1))
    merged = merge([a, b], method="simple", fold=True, frame="reference", progress=False)
    reference = merged.consensus.reference
    other = 1 - reference
    aligned = symgraph.align([a, b][other], [a, b][reference], fold=True)  # folded, as the merge folds them
    anchor = merged.consensus.states[reference]
    expected = {k: 0.5 * anchor[k] + 0.5 * aligned.state[k].double() for k in anchor}
    assert max_difference(merged.state, expected) < 1e-5
    summary = merged.alignments[other]
    assert merged.alignments[reference] is None and summary["judged_on"].startswith("synthetic")
    assert {"recovery", "weights", "activations"} <= summary["path_losses"].keys()
    assert summary["path_losses"] == aligned.path_losses and merged.to_json()["alignments"][other] == summary

    by_weights = merge([a, b], method="simple", fold=True, frame="reference", progress=False, judge_starts=False)
    assert by_weights.alignments == () and by_weights.consensus.reference == reference
    assert max_difference(by_weights.state, merged.state) > 1e-3  # the judge kept another alignment here


def test_full_merges_learn_on_synthetic_data_as_align_does_unless_told_not_to(monkeypatch):
    """A full merge's first alignment takes align's short learning on synthetic data where the path rises (here on
    any path: random twins hardly rise), and leaves it out with ``short_learning=False``."""
    a, b = (symgraph.load(zoo.build("vit", seed=s)) for s in (0, 1))
    monkeypatch.setattr(symgraph.learn, "SHORT_LEARNING_RISE", -1.0)
    kwargs = dict(method="simple", fold=True, frame="reference", progress=False)
    learning, plain = merge([a, b], **kwargs), merge([a, b], **kwargs, short_learning=False)
    other = 1 - learning.consensus.reference
    assert {"aligned", "learned"} <= learning.alignments[other]["path_losses"].keys()
    assert not {"aligned", "learned"} & plain.alignments[other]["path_losses"].keys()
    aligned = symgraph.align([a, b][other], [a, b][learning.consensus.reference], fold=True)
    assert learning.alignments[other]["path_losses"] == aligned.path_losses


def test_merges_aligned_on_activations_learn_on_the_other_batches_as_align_does_unless_told_not_to(monkeypatch):
    """``full+data`` merges align each model as ``align --data`` does: its short learning runs on the batches the
    activation costs left (here on any path: random twins hardly rise), and ``short_learning=False`` leaves it
    out; the merge states what was kept."""
    a, b = (symgraph.load(zoo.build("vit", seed=s)) for s in (0, 1))
    g = torch.Generator().manual_seed(1)
    data = Dataset("pixels", "classification", tuple(
        Batch({"pixel_values": torch.randn(8, 3, 16, 16, generator=g)}, torch.randint(0, 3, (8,), generator=g))
        for _ in range(6)))  # 4 for the costs (align's default), 2 to learn on
    monkeypatch.setattr(symgraph.learn, "SHORT_LEARNING_RISE", -1.0)
    kwargs = dict(method="simple", data=data, align="full+data", fold=False, frame="reference", progress=False)
    learning, plain = merge([a, b], **kwargs), merge([a, b], **kwargs, short_learning=False)
    other = 1 - learning.consensus.reference
    learned, unlearned = learning.alignments[other], plain.alignments[other]
    assert learned["judged_on"] == unlearned["judged_on"] == "pixels"
    assert {"aligned", "learned"} <= learned["path_losses"].keys()
    assert not {"aligned", "learned"} & unlearned["path_losses"].keys()
    assert learned["path_losses"]["aligned"] == pytest.approx(min(unlearned["path_losses"].values()), rel=1e-9)
    kept = min(("aligned", "learned"), key=learned["path_losses"].get)
    assert ("learned" in learned) == (kept == "learned")  # the learning record, where the learned one was kept
    assert (max_difference(learning.state, plain.state) > 1e-6) == (kept == "learned")


@pytest.mark.parametrize("method", ["fisher", "regmean"])
def test_with_data_each_frame_is_also_tried_by_weights_and_on_activations_and_the_data_decides(method):
    """The first alignments `align` makes without data are judged on simple interpolation of synthetic examples;
    with data the merge also tries each frame aligned by weights alone and on activations of the data (as
    ``full+data``), and keeps the lowest merged loss on the data, saying which and what its alignment kept."""
    a, b = (symgraph.load(zoo.build("vit", seed=s)) for s in (0, 1))  # the judge keeps another alignment here
    g = torch.Generator().manual_seed(1)
    data = Dataset("pixels", "classification", tuple(
        Batch({"pixel_values": torch.randn(8, 3, 16, 16, generator=g)}, torch.randint(0, 3, (8,), generator=g))
        for _ in range(4)))
    kwargs = dict(method=method, data=data, fold=True, frame="reference", progress=False)
    both = merge([a, b], **kwargs)
    by_weights = merge([a, b], judge_starts=False, **kwargs)
    on_activations = merge([a, b], **{**kwargs, "align": "full+data"})
    (judged, weights, activations), (alone,), (data_frame,) = both.frames, by_weights.frames, on_activations.frames
    assert (weights, activations) == (judged + ", aligned by weights", judged + ", aligned on activations of the data")
    assert alone == data_frame == judged
    assert both.frames[weights] == pytest.approx(by_weights.frames[alone], rel=1e-9)
    assert both.frames[activations] == pytest.approx(on_activations.frames[data_frame], rel=1e-9)
    assert len(set(round(v, 4) for v in both.frames.values())) == 3  # three merges, not one thrice
    assert both.frame == min(both.frames, key=both.frames.get) and both.frame in both.frame_note
    kept = {judged: None, weights: by_weights, activations: on_activations}[both.frame]
    for other in (by_weights, on_activations):
        assert (max_difference(both.state, other.state) < 1e-6) == (other is kept)
    other = 1 - both.consensus.reference
    assert (both.alignments == ()) == (both.frame == weights)  # what the kept first alignment kept, if made
    summary = both.alignments[other] if both.alignments else {}
    assert summary.get("judged_on", "").startswith({judged: "synthetic", weights: "", activations: "pixels"}[
        both.frame])
    assert on_activations.alignments[other]["judged_on"] == "pixels"
    simple = merge([a, b], method="simple", fold=True, frame="reference", progress=False)
    assert len(simple.frames) == 1  # without data nothing ranks them on the task: align's alignment is kept


def test_a_frame_on_activations_that_fails_costs_only_itself_unless_asked_for(llama, llama_other, monkeypatch):
    def fails(*args, **kwargs):
        raise SymgraphError("no site records these activations")
    monkeypatch.setattr(symgraph.merging, "_aligned_on_activations", fails)
    kwargs = dict(method="fisher", data=tokens(), frame="reference", progress=False)
    result = merge([llama, llama_other], **kwargs)
    assert len(result.frames) == 2 and not any(label.endswith("of the data") for label in result.frames)
    with pytest.raises(SymgraphError, match="no site records"):
        merge([llama, llama_other], align="full+data", **kwargs)


def test_the_consensus_takes_each_first_move_from_the_first_pass_where_given(llama, llama_twin):
    """``first_pass(model, reference)`` replaces the plan's first move: one that moves nothing leaves the twin
    where it was (unaligned, the twin's distance stays), and it is asked once per other model."""
    from symgraph.consensus import align_to_consensus

    asked = []

    def nothing(index, reference):
        asked.append((index, reference))
        return []
    moved = align_to_consensus([llama, llama_twin], [0.5, 0.5], progress=False, reference=0)
    kept = align_to_consensus([llama, llama_twin], [0.5, 0.5], progress=False, reference=0, first_pass=nothing)
    assert asked == [(1, 0)]
    assert max(moved.distances) < 1e-5 < min(kept.distances)
    assert kept.distances == pytest.approx(kept.distances_before)


def test_head_from_copies_the_head_of_a_model_with_other_labels():
    three, five = zoo.build("bert", seed=0), zoo.build("bert", seed=1, num_labels=5)
    assert head_parameters(symgraph.load(five)) == {"classifier.weight", "classifier.bias"}
    result = merge([three, five], align="none", head_from=1, progress=False)
    torch.testing.assert_close(result.state["classifier.weight"], five.classifier.weight.detach())
    body = "bert.encoder.layer.0.attention.self.query.weight"
    torch.testing.assert_close(result.state[body], (three.state_dict()[body] + five.state_dict()[body]) / 2)
    assert result.config.num_labels == 5
    aligned = merge([three, five], align="full", head_from=1, progress=False)
    assert aligned.state["classifier.weight"].shape == (5, 32)
    # heads of other labels: no mean prediction labels synthetic examples, so the frame goes by distance
    assert "smallest mean distance" in aligned.frame_note
    with pytest.raises(MismatchError, match="--head-from"):
        merge([three, five], align="none", progress=False)


def test_plain_modules_need_a_head_pattern():
    a, b = zoo.build("torch-relu-mlp", seed=0), zoo.build("torch-relu-mlp", seed=1)
    subjects = [symgraph.load(m, zoo.example_inputs_for("torch-relu-mlp", m)) for m in (a, b)]
    with pytest.raises(MismatchError, match="--head PATTERN"):
        merge(subjects, head_from=0, progress=False)
    result = merge(subjects, head_from=1, head=["4.*"], progress=False)
    assert result.head == ("4.bias", "4.weight")
    head_of_b = result.consensus.states[1]["4.weight"]  # model 2's last layer, moved along with its body
    torch.testing.assert_close(result.state["4.weight"], head_of_b.float())
    torch.testing.assert_close(result.state["2.weight"], torch.stack(
        [s["2.weight"].float() for s in result.consensus.states]).mean(0))


# -- bad input ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(weights=[1, 2, 3]), SymgraphError, "3 weights for 2 models"),
    (dict(weights=[0, 0]), SymgraphError, "sum to a positive"),
    (dict(weights=[-1, 2]), SymgraphError, "non-negative"),
    (dict(method="fisher"), DataError, "none was given"),
    (dict(method="average"), SymgraphError, "simple, fisher, regmean"),
    (dict(align="rotations"), SymgraphError, "full, paper, permutation, none"),
    (dict(method="regmean", data=Dataset("empty", "causal_lm", ())), DataError, "no examples"),
    (dict(method="fisher", data=Dataset("images", "classification",
                                        (Batch({"pixel_values": torch.zeros(2, 3, 8, 8)}, torch.zeros(2).long()),))),
     DataError, "does not fit model 1"),
    (dict(method="regmean", data=[tokens(), tokens(), tokens()]), DataError, "3 data specs for 2 models"),
])
def test_bad_input_is_refused_with_a_clear_error(llama, llama_other, kwargs, error, match):
    with pytest.raises(error, match=match):
        merge([llama, llama_other], progress=False, **kwargs)


def test_models_of_different_architectures_are_refused(llama):
    with pytest.raises(MismatchError, match="different model classes"):
        merge([llama, zoo.build("mistral")], progress=False)
    with pytest.raises(MismatchError, match="differ in shape"):
        merge([llama, zoo.build("llama", hidden_size=32)], progress=False)


# -- command line ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory, llama, llama_twin):
    root = tmp_path_factory.mktemp("models")
    llama.model.save_pretrained(root / "a")
    llama_twin.model.save_pretrained(root / "twin")
    zoo.build("gpt2").save_pretrained(root / "gpt2")
    np.savez(root / "tokens.npz", input_ids=np.random.default_rng(0).integers(0, 100, (12, 10)))
    np.savez(root / "too-big.npz", input_ids=np.full((4, 10), 500))
    return root


def test_cli_merge_writes_the_folder_and_the_summary(folders, tmp_path, llama):
    out, summary = tmp_path / "merged", tmp_path / "merge.json"
    code, stdout, stderr = run("merge", folders / "a", folders / "twin", "-o", out, "--method", "regmean",
                               "--data", folders / "tokens.npz", "--json", summary)
    assert code == 0, stderr
    assert "regmean merge of 2 models" in stdout
    merged = symgraph.load(out)
    assert relative_error(llama, merged.state_dict()) < 1e-5  # a model merged with itself, once aligned
    report = json.loads(summary.read_text())
    assert report["method"] == "regmean" and len(report["consensus"]["distances"]) == 2
    # with --data each frame is also tried by weights alone, and each model's frame on activations of the data
    ways = [label.rsplit(", aligned ", 1)[1] if ", aligned " in label else "as align" for label in report["frames"]]
    assert ways.count("by weights") == 3 and ways.count("on activations of the data") == 2 and len(ways) == 8
    assert report["frame"] in report["frames"] and report["frame"] in stdout

    before = (out / "model.safetensors").read_bytes()
    code, _, stderr = run("merge", folders / "a", folders / "twin", "-o", out)
    assert code == 2 and "already exists" in stderr and "--overwrite" in stderr
    assert (out / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("second, extra, message", [
    ("twin", ["--method", "fisher"], "none was given"),
    ("twin", ["--weights", "1,two"], "--weights"),
    ("twin", ["--weights", "1,2,3"], "3 weights for 2 models"),
    ("twin", ["--head-from", "3"], "not a model number"),
    ("twin", ["--method", "fisher", "--data", "too-big.npz"], "vocabulary"),
    ("twin", ["--method", "regmean", "--data", "digits"], "does not fit model 1"),  # images for an LM
    ("gpt2", ["--align", "none"], "different model classes"),
])
def test_cli_merge_errors_exit_2_and_write_nothing(folders, tmp_path, second, extra, message):
    extra = [str(folders / e) if e.endswith(".npz") else e for e in extra]
    code, _, stderr = run("merge", folders / "a", folders / second, "-o", tmp_path / "out", *extra)
    assert code == 2, stderr
    assert message in stderr
    assert list(tmp_path.iterdir()) == []


class _Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin_a, self.lin_b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.lin_b(torch.relu(self.lin_a(x))))


class _Chain(torch.nn.Module):
    """Blocks in a row with no residual: the units between blocks 0-1 and between 1-2 make groups of one name."""

    def __init__(self, width: int = 6, depth: int = 3):
        super().__init__()
        self.layer = torch.nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.layer:
            x = block(x)
        return x


def test_groups_whose_names_coincide_each_move_their_own_tensors():
    torch.manual_seed(0)
    model, inputs = _Chain(), (torch.randn(4, 6),)
    subject = symgraph.load(model, inputs)
    ids = [g.id for g in subject.report.groups]
    assert len(set(ids)) == len(ids) == 5 and "ffn:layer:lin_a+lin_b#2" in ids
    twin = copy.deepcopy(model)
    twin.load_state_dict(symgraph.transform(subject, seed=1))
    merged = merge([subject, symgraph.load(twin, inputs)], progress=False)
    assert max(merged.distances) < 1e-5 < min(merged.distances_before)
    assert relative_error(subject, merged.state) < 1e-5
