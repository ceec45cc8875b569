"""Symmetric alignment in merge: the frame of the merge (onto either model, or a common one) and its choice."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

import symgraph
import symgraph.synthetic
from symgraph import zoo
from symgraph.datasets import Batch, Dataset, batch_loss, evaluate
from symgraph.errors import DataError
from symgraph.consensus import merge_order
from symgraph.merging import _FRAME_TIE, merge
from symgraph.synthetic import merge_examples

from cli_runner import run


def tokens(seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    batches = tuple(Batch({"input_ids": ids}, ids) for ids in torch.randint(0, 100, (2, 6, 10), generator=g))
    return Dataset("tokens", "causal_lm", batches)


@pytest.fixture(scope="module")
def pair():
    """Two independent LLaMAs, fitted a little to the same tokens (so merges differ in loss)."""
    data = tokens()
    subjects = []
    for seed in (0, 1):
        model = zoo.build("llama", seed=seed)
        optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(30):
            optimiser.zero_grad()
            batch_loss(model, data.batches[step % 2], data.task).backward()
            optimiser.step()
        subjects.append(symgraph.load(model.eval()))
    return subjects


def test_best_frame_is_the_lowest_scoring_of_both_directions_and_the_common_frame(pair):
    result = merge(pair, align="permutation", progress=False, fold=False)
    assert len(result.frames) == 3 and any(k.startswith("common") for k in result.frames)
    # scores within the tie margin of the lowest keep the earlier frame (equivalent merges differ by rounding)
    assert result.frames[result.frame] <= min(result.frames.values()) * (1 + _FRAME_TIE)
    assert result.frame in result.frame_note


def test_without_data_the_frame_is_chosen_by_the_merged_loss_on_synthetic_examples(pair):
    result = merge(pair, align="permutation", progress=False, fold=False)
    assert "lowest merged loss on synthetic" in result.frame_note and "no data given" in result.frame_note
    # the score is the kept merge's loss on the examples made from both models, whichever came first
    examples = merge_examples(pair[0].model, [pair[1].state_dict(), pair[0].state_dict()])
    assert examples is not None and len(examples) == 64
    model = copy.deepcopy(pair[0].model)  # not the fixture's own: the later tests merge it
    model.load_state_dict(result.state)
    assert evaluate(model, examples).loss == pytest.approx(result.frames[result.frame], rel=1e-5)
    # ... which the alignment moved: the unaligned average scores otherwise (the frames of a permutation
    # alignment may all score alike: B onto A and A onto B are often inverse permutations, the same merge)
    other = pair[1].state_dict()
    model.load_state_dict({k: (v + other[k]) / 2 if v.is_floating_point() else v
                           for k, v in pair[0].state_dict().items()})
    assert abs(evaluate(model, examples).loss - result.frames[result.frame]) > 1e-3
    backward = merge(pair[::-1], align="permutation", progress=False, fold=False)
    assert sorted(backward.frames.values()) == pytest.approx(sorted(result.frames.values()), rel=1e-6)


def test_three_models_without_data_are_judged_on_examples_made_from_all_three(pair):
    data = tokens(seed=5)
    third = zoo.build("llama", seed=2)
    optimiser = torch.optim.Adam(third.parameters(), lr=1e-2)
    for step in range(30):
        optimiser.zero_grad()
        batch_loss(third, data.batches[step % 2], data.task).backward()
        optimiser.step()
    models = [*pair, symgraph.load(third.eval())]
    result = merge(models, align="permutation", progress=False, fold=False)
    assert len(result.frames) == 4 and "lowest merged loss on synthetic" in result.frame_note
    order = merge_order(models, [1 / 3] * 3, frozenset())
    examples = merge_examples(models[0].model, [models[i].state_dict() for i in order])
    model = copy.deepcopy(models[0].model)
    model.load_state_dict(result.state)
    assert evaluate(model, examples).loss == pytest.approx(result.frames[result.frame], rel=1e-5)


def test_without_data_nor_synthetic_examples_the_frame_is_the_closest_to_the_mean(pair, monkeypatch):
    def cannot(*args, **kwargs):
        raise DataError("no examples for this model")

    monkeypatch.setattr(symgraph.synthetic, "synthetic_data", cannot)
    result = merge(pair, align="permutation", progress=False, fold=False)
    assert result.frames[result.frame] == min(result.frames.values())
    assert "smallest mean distance" in result.frame_note
    assert result.frames[result.frame] == pytest.approx(
        float(np.dot(result.consensus.distances, [0.5, 0.5])), rel=1e-9)


def test_with_data_the_frame_is_chosen_by_the_merged_models_loss(pair):
    data = tokens(seed=3)
    result = merge(pair, data=data, align="permutation", progress=False, fold=False)
    assert result.frames[result.frame] == min(result.frames.values())
    model = copy.deepcopy(pair[0].model)  # not the fixture's own: the later tests merge it
    model.load_state_dict(result.state)
    assert evaluate(model, data).loss == pytest.approx(result.frames[result.frame], rel=1e-5)
    assert "lowest merged loss on tokens" in result.frame_note


def test_the_common_frame_is_never_farther_from_the_merge_than_the_reference_frame(pair):
    reference = merge(pair, frame="reference", align="permutation", progress=False, fold=False)
    common = merge(pair, frame="common", align="permutation", progress=False, fold=False)
    assert list(reference.frames) == [reference.frame] and reference.frame.startswith("onto the reference")
    assert common.frames[common.frame] <= reference.frames[reference.frame] + 1e-12
    assert common.consensus.history[-1] <= common.consensus.history[0]


@pytest.mark.slow
def test_best_frame_does_not_depend_on_the_argument_order(pair):
    forward = merge(pair, align="permutation", progress=False, fold=False)
    backward = merge(pair[::-1], align="permutation", progress=False, fold=False)
    assert max(float((forward.state[k] - backward.state[k]).abs().max()) for k in forward.state) < 1e-5


def test_unknown_frame_is_refused(pair):
    with pytest.raises(symgraph.SymgraphError, match="Unknown frame"):
        merge(pair, frame="mean", progress=False)


def saved(subjects, root) -> list:
    """The subjects' models written as Hugging Face folders m0, m1, ... under ``root``."""
    folders = [root / f"m{i}" for i in range(len(subjects))]
    for subject, folder in zip(subjects, folders):
        subject.model.save_pretrained(folder)
    return folders


def test_cli_merge_says_which_frame_and_why(pair, tmp_path):
    folders = saved(pair, tmp_path)
    code, stdout, stderr = run("merge", *folders, "-o", tmp_path / "out", "--frame", "common", "--no-fold",
                               "--align", "permutation", "--json", tmp_path / "merge.json", "--no-progress")
    assert code == 0, stderr
    assert "frame: common" in stdout
    assert json.loads((tmp_path / "merge.json").read_text())["frame"].startswith("common")
    code, _, stderr = run("merge", *folders, "-o", tmp_path / "bad", "--frame", "mean")
    assert code == 2 and "mean" in stderr and not (tmp_path / "bad").exists()


def merged_without_and_with(folders, tmp_path, flag: str) -> tuple[dict, dict]:
    """``merge --frame reference`` of ``folders`` through the CLI without and with ``flag``: each run's stdout and
    its --json summary, keyed ``without`` and ``with``."""
    outputs, summaries = {}, {}
    for name, extra in (("without", ()), ("with", (flag,))):
        summary = tmp_path / f"{name}.json"
        code, stdout, stderr = run("merge", *folders, "-o", tmp_path / name, "--frame", "reference", "--no-progress",
                                   "--json", summary, *extra)
        assert code == 0, stderr
        outputs[name], summaries[name] = stdout, json.loads(summary.read_text())
    return outputs, summaries


def test_cli_merge_says_whether_the_first_alignment_learned_on_synthetic_data_unless_told_not_to(pair, tmp_path,
                                                                                                  monkeypatch):
    import symgraph.learn

    monkeypatch.setattr(symgraph.learn, "SHORT_LEARNING_RISE", -1.0)  # learn on any path
    outputs, summaries = merged_without_and_with(saved(pair, tmp_path), tmp_path, "--no-short-learning")
    other = next(a for a in summaries["without"]["alignments"] if a is not None)
    assert {"aligned", "learned"} <= other["path_losses"].keys()
    assert "tuned by a short learning" in outputs["without"]
    assert "tuned by a short learning" not in outputs["with"]
    assert not any(a and "learned" in a["path_losses"] for a in summaries["with"]["alignments"])


def test_cli_merge_says_what_each_first_alignment_kept_unless_told_not_to_judge(pair, tmp_path):
    outputs, summaries = merged_without_and_with(saved(pair, tmp_path), tmp_path, "--no-judge-starts")
    alignments = summaries["without"]["alignments"]
    reference = summaries["without"]["consensus"]["reference"]
    other = alignments[1 - reference]
    assert alignments[reference] is None and other["judged_on"].startswith("synthetic")
    kept = min(("weights", "activations"), key=other["path_losses"].get)
    assert (kept == "activations") == ("activations" in other["costs"])
    assert f"model {2 - reference} (" in outputs["without"]
    assert "first aligned onto the reference; costs:" in outputs["without"]
    why = "the start of the short learning" if other.get("learned") else "kept for its lower path loss"
    assert f"({why}; path loss on synthetic" in outputs["without"]
    assert summaries["with"]["alignments"] == [] and "path loss" not in outputs["with"]
