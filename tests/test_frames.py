"""Symmetric alignment in merge: the frame of the merge (onto either model, or a common one) and its choice."""
from __future__ import annotations

import json

import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.datasets import Batch, Dataset, batch_loss, evaluate
from symgraph.merging import merge

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
    assert result.frames[result.frame] == min(result.frames.values())
    assert "distance" in result.frame_note and result.frame in result.frame_note


def test_with_data_the_frame_is_chosen_by_the_merged_models_loss(pair):
    data = tokens(seed=3)
    result = merge(pair, data=data, align="permutation", progress=False, fold=False)
    assert result.frames[result.frame] == min(result.frames.values())
    model = symgraph.load(pair[0].model).model
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


def test_cli_merge_says_which_frame_and_why(pair, tmp_path):
    folders = []
    for i, subject in enumerate(pair):
        folder = tmp_path / f"m{i}"
        subject.model.save_pretrained(folder)
        folders.append(folder)
    code, stdout, stderr = run("merge", *folders, "-o", tmp_path / "out", "--frame", "common", "--no-fold",
                               "--align", "permutation", "--json", tmp_path / "merge.json", "--no-progress")
    assert code == 0, stderr
    assert "frame: common" in stdout
    assert json.loads((tmp_path / "merge.json").read_text())["frame"].startswith("common")
    code, _, stderr = run("merge", *folders, "-o", tmp_path / "bad", "--frame", "mean")
    assert code == 2 and "mean" in stderr and not (tmp_path / "bad").exists()
