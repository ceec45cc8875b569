"""Activation-based costs (symgraph.activations): sites found from the graph's labels, recovery of a reparametrised
copy from activations alone, exact reparametrisation between independent models, bad data, CLI and barrier."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.activations import group_sites, record
from symgraph.connectivity import barrier
from symgraph.datasets import Batch, Dataset
from symgraph.errors import DataError
from symgraph.verify import Evaluator

from cli_runner import run


def tokens(seed: int = 0, high: int = 100, batches: int = 2) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    return Dataset("tokens", "causal_lm", tuple(
        Batch({"input_ids": torch.randint(0, high, (4, 9), generator=g)}) for _ in range(batches)))


def twin_of(subject, seed: int = 1):
    """A randomly reparametrised copy of ``subject`` (same function, every group moved)."""
    twin = copy.deepcopy(subject.model)
    twin.load_state_dict(symgraph.transform(subject, seed=seed))
    return symgraph.load(twin)


@pytest.fixture(scope="module")
def llama():
    model = zoo.build("llama", seed=0)
    return symgraph.load(model, zoo.example_inputs_for("llama", model))


def test_sites_are_the_values_that_carry_a_groups_coordinates():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    subject = symgraph.load(mlp, (torch.randn(5, 4),))
    (group,) = subject.report.groups
    sites, views = group_sites(subject.capture, [group])
    # the hidden layer before and after the ReLU, each unit at its own feature position, moving like W1's rows
    assert sorted(views[m.param][0] for m in sites[group.id]) == ["linear", "relu"]
    for m in sites[group.id]:
        assert m.action == "primal" and m.index.reshape(-1).tolist() == list(range(8))


@pytest.mark.slow
def test_a_reparametrised_copy_is_recovered_from_activations_alone():
    model = zoo.build("bert", seed=0)
    subject = symgraph.load(model, zoo.example_inputs_for("bert", model))
    twin = twin_of(subject)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    result = symgraph.align(twin, subject, data=tokens(), data_groups="all", data_batches=2)
    weights = {g for g, cost in result.costs.items() if cost == "weights"}
    assert weights and all(g.startswith(("qk-rescale", "scale_free")) for g in weights)  # scales: weights only
    # every other group (residual, heads, QK, VO, FFN) is solved before them, from activations alone
    data_stats = [s for s in result.stats if s.stage.startswith("activations")]
    assert {s.group for s in data_stats} == set(result.costs) - weights
    assert result.distance_before > 0.5 and result.distance_after < 1e-5
    assert all(torch.equal(before[k], v) for k, v in twin.state_dict().items())  # the source is not modified


@pytest.mark.slow
def test_grouped_query_attention_is_recovered_with_the_residual_from_activations(llama):
    result = symgraph.align(twin_of(llama), llama, data=tokens(), data_batches=2)
    residual = [g for g in result.costs if g.startswith("residual")]
    assert residual and all(result.costs[g] == "activations" for g in residual)
    assert result.distance_after < 1e-5


@pytest.mark.slow
def test_independent_models_stay_exact_reparametrisations(llama):
    other = zoo.build("llama", seed=1)
    source = symgraph.load(other, zoo.example_inputs_for("llama", other))
    for groups in ("residual", "all"):
        result = symgraph.align(source, llama, data=tokens(), data_groups=groups, data_batches=2, fold=True)
        assert result.distance_after < result.distance_before
        outcome = Evaluator(result_model(source, fold=True), source.args, source.kwargs).check(result.state)
        assert outcome.ok, outcome.relative_error
        # the candidate kept is the one with the lower path loss, and its costs say how it was found
        losses = result.path_losses
        assert set(losses) == {"activations", "weights"} and result.to_json()["path_losses"] == losses
        kept = "activations" if losses["activations"] <= losses["weights"] * (1 + 1e-5) else "weights"
        residual = [g for g, cost in result.costs.items() if g.startswith("residual")]
        assert residual and all(result.costs[g] == kept for g in residual)
        if groups == "residual" or kept == "weights":
            assert {c for g, c in result.costs.items() if not g.startswith("residual")} == {"weights"}


def test_with_data_the_alignment_with_the_lower_path_loss_is_kept(llama):
    """Activation costs and weight costs each win on some pairs; the data decides, by the interpolated loss."""
    from symgraph.alignment import AlignResult
    from symgraph.api import lowest_path_loss
    from symgraph.learn import path_loss

    anchor, data = llama.state_dict(), tokens()
    names = [k for k, v in anchor.items() if v.is_floating_point()]
    near = AlignResult(dict(anchor), [], [], 1.0, 0.0)  # the anchor itself: the path is A all along
    far = AlignResult({k: v * 30 if k == "lm_head.weight" else v for k, v in anchor.items()}, [], [], 1.0, 1.0)
    assert path_loss(llama.model, anchor, near.state, names, data, 2) < \
        path_loss(llama.model, anchor, far.state, names, data, 2)  # over-confident logits along the path
    for candidates in ({"far": far, "near": near}, {"near": near, "far": far}):
        kept = lowest_path_loss(candidates, llama.model, anchor, data, 2)
        assert kept is near and kept.path_losses["near"] < kept.path_losses["far"]
    same = AlignResult(dict(anchor), [], [], 1.0, 0.0)
    assert lowest_path_loss({"first": near, "second": same}, llama.model, anchor, data, 2) is near  # a tie


def result_model(subject, fold: bool):
    from symgraph.fold import folded_subject

    return (folded_subject(subject) if fold else subject).model


@pytest.mark.slow
def test_the_stats_say_which_groups_took_activation_costs(llama):
    result = symgraph.align(twin_of(llama), llama, data=tokens(), data_batches=1)
    stages = {s.group: s.stage for s in result.stats}
    assert any(stage.startswith("activations") for stage in stages.values())
    assert result.to_json()["costs"] == result.costs


@pytest.mark.parametrize("data, message", [
    (tokens(high=10_000), "does not fit"),  # token ids beyond the vocabulary
    (Dataset("pixels", "classification", (Batch({"pixel_values": torch.zeros(2, 3, 8, 8)}),)), "does not fit"),
])
def test_data_that_does_not_fit_is_refused(llama, data, message):
    with pytest.raises(DataError, match=message):
        record(twin_of(llama), llama, llama.report.groups, data)


def test_a_batch_is_recorded_a_few_examples_at_a_time_with_the_activations_it_gives_whole(llama, monkeypatch):
    """Sites are sought in the graph of RUN_EXAMPLES examples, not of a whole batch (some graphs label every
    position apart: lara_mini's sites took 362 s at 32 examples, 12 s at one); the runs record what the whole
    batch would, so every cost the solvers read is unchanged."""
    data, twin = tokens(batches=1), twin_of(llama)  # one batch of 4 examples
    captured = []
    capture_on = symgraph.activations._capture_on
    monkeypatch.setattr(symgraph.activations, "_capture_on",
                        lambda subject, batch, data: captured.append(batch) or capture_on(subject, batch, data))
    by_runs = record(twin, llama, llama.report.groups, data)
    monkeypatch.setattr(symgraph.activations, "RUN_EXAMPLES", 4)
    whole = record(twin, llama, llama.report.groups, data)
    assert [b.inputs["input_ids"].shape for b in captured] == [(2, 9), (4, 9)]
    assert by_runs.sites.keys() == whole.sites.keys() and by_runs.source.keys() == whole.source.keys()
    for key, x in whole.source.items():
        y, a, b = whole.anchor[key], by_runs.source[key], by_runs.anchor[key]
        torch.testing.assert_close(a @ b.T, x @ y.T)
        torch.testing.assert_close(a @ a.T, x @ x.T)


@pytest.mark.parametrize("mean_free", [False, True])
def test_sites_with_more_positions_than_features_keep_every_cost_in_a_basis_of_their_rows(mean_free):
    """Compressed rows give the inner products the solvers read (within and across the models) and the norms, in
    as many columns as both models' rows together; rows that are mean-free across features (a folded LayerNorm's
    stream) leave the Gram matrix singular, which must not break it."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(6, 50, generator=g, dtype=torch.float64) * torch.logspace(0, 6, 6, dtype=torch.float64)[:, None]
            for _ in range(2))
    if mean_free:
        x, y = x - x.mean(0), y - y.mean(0)
    a, b = symgraph.activations._compressed(x, y)
    assert a.shape == b.shape == (6, 12)
    for left, right, left_in, right_in in ((a, b, x, y), (a, a, x, x), (b, b, y, y)):
        scale = left_in.norm(dim=1)[:, None] * right_in.norm(dim=1)[None]  # each product to its rows' precision
        assert ((left @ right.T - left_in @ right_in.T).abs() / scale).max() < 1e-13
    short = x[:, :12], y[:, :12]  # no more positions than both models' rows: kept as they are
    assert all(u is v for u, v in zip(symgraph.activations._compressed(*short), short))


def test_runs_cover_every_example_in_one_shape_unless_an_input_is_not_per_example():
    batch = Batch({"input_ids": torch.arange(5)[:, None].expand(5, 3), "attention_mask": torch.ones(5, 3)})
    runs = symgraph.activations._runs(batch, 2)
    assert [r.inputs["input_ids"][:, 0].tolist() for r in runs] == [[0, 1], [2, 3], [3, 4]]
    assert all(r.inputs["attention_mask"].shape == (2, 3) for r in runs)
    grid = Batch({"pixel_values": torch.zeros(5, 3), "image_grid_thw": torch.ones(2, 3)})  # listed per image
    assert symgraph.activations._runs(grid, 2) == [grid]
    assert symgraph.activations._runs(batch, 5) == [batch]


def test_recording_needs_a_batch(llama):
    with pytest.raises(symgraph.errors.SymgraphError, match="at least one batch"):
        record(llama, llama, llama.report.groups, tokens(), batches=0)


@pytest.mark.slow
def test_barrier_full_data_ends_at_the_same_function(llama):
    twin = twin_of(llama)
    result = barrier(llama, twin, tokens(), steps=3, aligns=("none", "full+data"), fold=False, progress=False,
                     align_options={"align_data": tokens(seed=1), "data_batches": 1})
    none, data = result.curves["none"], result.curves["full+data"]
    assert abs(data.losses[-1] - none.losses[-1]) < 1e-4  # B aligned computes what B computes
    assert data.distance < 1e-5 < none.distance  # and is the anchor again


# -- command line ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory, llama):
    root = tmp_path_factory.mktemp("models")
    llama.model.save_pretrained(root / "a")
    twin_of(llama).model.save_pretrained(root / "twin")
    np.savez(root / "tokens.npz", input_ids=torch.cat([b.inputs["input_ids"] for b in tokens().batches]).numpy())
    np.savez(root / "too-big.npz", input_ids=np.full((4, 9), 5000))
    return root


@pytest.mark.slow
def test_cli_align_with_data_writes_the_recovered_model_and_its_costs(folders, tmp_path):
    out, stats = tmp_path / "aligned", tmp_path / "stats.json"
    code, stdout, stderr = run("align", folders / "twin", folders / "a", "-o", out, "--data", folders / "tokens.npz",
                               "--data-batches", 1, "--stats", stats, "--quiet")
    assert code == 0, stderr
    numbers = json.loads(stats.read_text())
    assert numbers["distance_after"] < 1e-5 and "activations" in numbers["costs"].values()
    assert "1 group from activations" in stdout
    assert symgraph.load(out).state_dict().keys() == symgraph.load(folders / "a").state_dict().keys()


def test_cli_align_with_data_that_does_not_fit_exits_2_and_writes_nothing(folders, tmp_path):
    code, _, stderr = run("align", folders / "twin", folders / "a", "-o", tmp_path / "aligned", "--data",
                          folders / "too-big.npz", "--quiet")
    assert code == 2, stderr
    assert "vocabulary" in stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_barrier_full_data(folders, tmp_path):
    numbers = tmp_path / "barrier.json"
    code, stdout, stderr = run("barrier", folders / "a", folders / "twin", "--data", folders / "tokens.npz",
                               "--steps", 3, "--align", "none,full+data", "--data-batches", 1,
                               "-o", tmp_path / "barrier.png", "--json", numbers)
    assert code == 0, stderr
    modes = json.loads(numbers.read_text())["modes"]
    assert modes["full+data"]["distance"] < 1e-5
    # how the alignment was reached: the two candidates' path losses, and which cost the groups kept took
    alignment = modes["full+data"]["alignment"]
    assert set(alignment["path_losses"]) == {"activations", "weights"} and alignment["costs"]
    assert modes["none"]["alignment"] == {}
    assert "full+data" in stdout


@pytest.mark.slow
def test_merge_full_data_aligns_on_activations_first(llama):
    twin = twin_of(llama)
    result = symgraph.merge([llama, twin], align="full+data", data=tokens(), fold=False, progress=False)
    from symgraph.alignment import relative_distance

    assert result.align == "full+data"
    reference = (llama, twin)[result.consensus.reference]  # the merge lives in the reference model's frame
    assert relative_distance(result.state, reference.state_dict()) < 1e-5  # the other was brought back exactly


def test_merge_full_data_without_data_is_refused(llama):
    with pytest.raises(DataError, match="full\\+data"):
        symgraph.merge([llama, llama], align="full+data", progress=False)


@pytest.mark.slow
def test_a_folded_vit_residual_rotation_is_recovered_from_activations():
    """The LayerNorm residual group {Q in O(D) : Q 1 = +-1} of a folded ViT, solved by Procrustes on activations."""
    from symgraph.fold import folded_subject

    model = zoo.build("vit", seed=0)
    subject = folded_subject(symgraph.load(model, zoo.example_inputs_for("vit", model)))
    g = torch.Generator().manual_seed(0)
    images = Dataset("images", "classification", tuple(
        Batch({"pixel_values": torch.randn(4, 3, 16, 16, generator=g)}) for _ in range(2)))
    result = symgraph.align(twin_of(subject), subject, data=images, data_batches=2)
    residual = [gid for gid in result.costs if gid.startswith("residual")]
    assert [result.costs[gid] for gid in residual] == ["activations"]
    assert {s.kind for s in result.stats if s.group in residual} == {"orthogonal"}
    assert result.distance_before > 0.2 and result.distance_after < 1e-5
