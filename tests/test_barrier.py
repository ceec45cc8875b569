"""Loss barriers: the height formula, a reparametrised model's barrier before and after alignment, plots, CLI."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.connectivity import (BarrierCurve, BarrierResult, barrier, barrier_figure, barrier_height,
                                   plot_barrier)
from symgraph.datasets import Batch, Dataset, batch_loss
from symgraph.errors import DataError, MismatchError, OutputError, SymgraphError

from cli_runner import run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tokens(classes: int | None = None, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 100, (6, 10), generator=g)
        labels = ids if classes is None else torch.randint(0, classes, (6,), generator=g)
        batches.append(Batch({"input_ids": ids}, labels))
    return Dataset("tokens", "causal_lm" if classes is None else "classification", tuple(batches))


def fitted(model: torch.nn.Module, data: Dataset, steps: int = 60) -> torch.nn.Module:
    """``model`` trained a little on ``data``: a random model has no barrier to find (averaging only flattens
    its near-uniform predictions)."""
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        optimiser.zero_grad()
        batch_loss(model, data.batches[step % len(data.batches)], data.task).backward()
        optimiser.step()
    return model.eval()


@pytest.fixture(scope="module")
def llama():
    return symgraph.load(fitted(zoo.build("llama", seed=0), tokens()))


@pytest.fixture(scope="module")
def llama_twin(llama):
    twin = copy.deepcopy(llama.model)
    twin.load_state_dict(symgraph.transform(llama, seed=2))
    return symgraph.load(twin)


@pytest.mark.parametrize("values, height", [
    ([1.0, 1.0, 1.0], 0.0),
    ([1.0, 3.0, 2.0], 1.5),  # rises 1.5 above the chord at t = 0.5
    ([2.0, 1.0, 2.0], 0.0),  # convex path: below the chord inside, on it at the ends
    ([0.0, 0.0, 0.0, 3.0], 0.0),
    ([1.0, 1.2, 1.0, 1.0, 1.0], 0.2),
])
def test_barrier_height_is_the_largest_rise_above_the_chord(values, height):
    assert barrier_height(np.linspace(0, 1, len(values)), values) == pytest.approx(height)


def test_reparametrised_model_has_no_barrier_after_full_alignment_only(llama, llama_twin):
    result = barrier(llama, llama_twin, tokens(), steps=5, aligns=("none", "permutation", "full"), progress=False)
    none, full = result.curves["none"], result.curves["full"]
    assert none.losses[0] == pytest.approx(none.losses[-1], rel=1e-5)  # both ends compute the same function
    assert none.loss_barrier > 0.01 and none.distance > 0.5
    assert abs(full.loss_barrier) < 1e-5 and full.distance < 1e-5
    assert result.curves["permutation"].distance < none.distance
    assert none.accuracies is not None  # causal LM: next-token accuracy


def test_classification_curves_plot_and_json(tmp_path):
    a, b = zoo.build("bert", seed=0), zoo.build("bert", seed=1)
    result = barrier(a, b, tokens(classes=3), steps=3, aligns=("none", "permutation"), progress=False)
    assert result.ts == [0.0, 0.5, 1.0] and result.task == "classification"
    curve = result.curves["permutation"]
    assert len(curve.losses) == 3 and len(curve.accuracies) == 3 and curve.accuracy_barrier is not None
    assert result.curves["none"].losses[0] == curve.losses[0]  # t = 0 is model A in every mode
    data = json.loads(json.dumps(result.to_json()))
    assert set(data["modes"]) == {"none", "permutation"} and data["modes"]["none"]["distance"] > 0

    plot = result.plot(tmp_path / "barrier.png")
    assert plot.read_bytes().startswith(PNG_MAGIC)
    assert [p.name for p in tmp_path.iterdir()] == ["barrier.png"]  # no temporary file left behind


def test_plot_refuses_unknown_formats_and_missing_folders(tmp_path):
    result = BarrierResult(("a", "b"), "toy", "causal_lm", [0.0, 0.5, 1.0],
                           {"none": BarrierCurve("none", [1.0, 2.0, 1.0], None, 1.0, None, 0.3, 0.0)})
    with pytest.raises(OutputError, match="unknown image format"):
        plot_barrier(result, tmp_path / "plot.docx")
    with pytest.raises(OutputError, match="does not exist"):
        plot_barrier(result, tmp_path / "missing" / "plot.png")
    assert list(tmp_path.iterdir()) == []
    assert plot_barrier(result, tmp_path / "plot.svg").read_text().lstrip().startswith("<?xml")


def _full_box_result(task: str) -> BarrierResult:
    """Curves that span the whole plot box (as the shipped pairs' do), with and without accuracy."""
    ts = [0.0, 0.25, 0.5, 0.75, 1.0]
    curves = {mode: BarrierCurve(mode, [1.0 + k, 4.0, 1.0, 4.0, 1.0 + k], [0.9, 0.1, 0.9, 0.1, 0.9],
                                 3.0, 0.8, 0.5, 0.0)
              for k, mode in enumerate(("none", "permutation", "paper", "full"))}
    return BarrierResult(("a", "b"), "toy", task, ts, curves)


@pytest.mark.parametrize("task, unit", [("causal_lm", "nats per predicted token"),
                                        ("classification", "nats per example")])
def test_plot_legend_stays_off_the_curves_and_labels_say_what_is_plotted(task, unit):
    figure = barrier_figure(_full_box_result(task))
    figure.canvas.draw()
    loss_axes, accuracy_axes = figure.axes
    for ax in figure.axes:
        legend = ax.get_legend().get_window_extent()
        assert not legend.overlaps(ax.get_window_extent()), "legend drawn over the plot box"
        assert "B as trained (none)" in ax.get_xlabel() and "B aligned to A (permutation, paper, full)" in ax.get_xlabel()
    assert loss_axes.get_ylabel() == f"cross-entropy loss ({unit})"
    assert accuracy_axes.get_ylabel() == "accuracy (fraction correct)"


def test_plot_x_label_without_the_unaligned_curve_only_names_aligned_b():
    result = _full_box_result("causal_lm")
    result.curves.pop("none")
    assert "as trained" not in barrier_figure(result).axes[0].get_xlabel()


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(steps=2), SymgraphError, "at least 3"),
    (dict(aligns=("none", "rotation")), SymgraphError, "none, permutation, paper, full"),
    (dict(aligns=("full", "full")), SymgraphError, "distinct"),
    (dict(data=Dataset("empty", "causal_lm", ())), DataError, "no examples"),
    (dict(align_options={"rounds": 3}), SymgraphError, "Unknown alignment option\(s\) rounds"),
    (dict(data=Dataset("pixels", "classification",
                       (Batch({"pixel_values": torch.zeros(2, 3, 8, 8)}, torch.zeros(2).long()),))),
     DataError, "does not fit"),
])
def test_bad_input_is_refused(llama, llama_twin, kwargs, error, match):
    kwargs = {"data": tokens(), "aligns": ("none",), **kwargs}
    with pytest.raises(error, match=match):
        barrier(llama, llama_twin, progress=False, **kwargs)


def test_align_options_reach_every_alignment(llama, llama_twin, monkeypatch):
    seen = []
    real = symgraph.connectivity.align
    monkeypatch.setattr(symgraph.connectivity, "align", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    options = {"rescale": False, "refine_rounds": 0}
    barrier(llama, llama_twin, tokens(), steps=3, aligns=("none", "permutation", "full"), align_options=options,
            progress=False)
    assert [kw["mode"] for kw in seen] == ["permutation", "full"]
    assert all(kw["rescale"] is False and kw["refine_rounds"] == 0 for kw in seen)


def test_models_of_different_architectures_are_refused(llama):
    with pytest.raises(MismatchError):
        barrier(llama, zoo.build("llama", hidden_size=32), tokens(), aligns=("none",), progress=False)


# -- command line ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory, llama, llama_twin):
    root = tmp_path_factory.mktemp("models")
    llama.model.save_pretrained(root / "a")
    llama_twin.model.save_pretrained(root / "twin")
    np.savez(root / "tokens.npz", input_ids=torch.cat([b.inputs["input_ids"] for b in tokens().batches]).numpy())
    np.savez(root / "too-big.npz", input_ids=np.full((4, 10), 500))
    return root


def test_cli_barrier_writes_plot_and_json(folders, tmp_path):
    plot, numbers = tmp_path / "barrier.png", tmp_path / "barrier.json"
    code, stdout, stderr = run("barrier", folders / "a", folders / "twin", "--data", folders / "tokens.npz",
                               "--steps", 3, "--align", "none,full", "-o", plot, "--json", numbers)
    assert code == 0, stderr
    assert plot.read_bytes().startswith(PNG_MAGIC)
    data = json.loads(numbers.read_text())
    assert data["modes"]["full"]["distance"] < 1e-5 < data["modes"]["none"]["distance"]
    assert "full" in stdout and "loss barrier" in stdout


def test_cli_barrier_passes_the_descent_options_to_every_alignment(folders, tmp_path, monkeypatch):
    seen = []
    real = symgraph.connectivity.align
    monkeypatch.setattr(symgraph.connectivity, "align", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    code, _, stderr = run("barrier", folders / "a", folders / "twin", "--data", folders / "tokens.npz", "--steps", 3,
                          "--align", "permutation,full", "--no-rescale", "--refine-rounds", 0, "--tolerance", 0.5,
                          "--no-matching-start", "--no-synthetic-activations", "--no-short-learning",
                          "-o", tmp_path / "barrier.png")
    assert code == 0, stderr
    assert [kw["mode"] for kw in seen] == ["permutation", "full"]
    assert all((kw["rescale"], kw["refine_rounds"], kw["tolerance"], kw["matching_start"],
                kw["synthetic_activations"], kw["short_learning"]) == (False, 0, 0.5, False, False, False)
               for kw in seen)


@pytest.mark.parametrize("extra, message", [
    (["--align", "none,rotation"], "none, permutation, paper, full"),
    (["--data", "too-big.npz"], "vocabulary"),
    (["--steps", "1"], "--steps"),
    (["-o", "{tmp}/plot.docx"], "unknown image format"),
])
def test_cli_barrier_errors_exit_2_and_write_nothing(folders, tmp_path, extra, message):
    extra = [str(folders / e) if e.endswith(".npz") else e.format(tmp=tmp_path) for e in extra]
    defaults = {"--data": str(folders / "tokens.npz"), "-o": str(tmp_path / "plot.png")}
    for flag, value in defaults.items():
        if flag not in extra:
            extra += [flag, value]
    code, _, stderr = run("barrier", folders / "a", folders / "twin", "--align", "none", *extra)
    assert code == 2, stderr
    assert message in stderr
    assert list(tmp_path.iterdir()) == []
