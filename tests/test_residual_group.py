"""The group full mode aligns a folded model's orthogonal residual stream in (``residual``): ``auto`` narrows a
LayerNorm stream to its permutations between independent models but keeps the whole group for a reparametrised
copy (exact recovery) and for RMSNorm streams; explicit choices, bad values, the API and the command line."""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import symgraph
from symgraph import zoo
from symgraph.alignment import align_states, free_cost_members, select_groups
from symgraph.elements import apply, sample
from symgraph.errors import SymgraphError
from symgraph.fold import folded_subject
from symgraph.io import model_config, save_model
from symgraph.verify import Evaluator

from cli_runner import run


@functools.cache
def _folded(family, seed):
    model = zoo.build(family, seed=seed, dtype=torch.float64)
    return folded_subject(symgraph.load(model, zoo.example_inputs_for(family, model)))


def _residual_kinds(result) -> set[str]:
    return {e.group.kind for e in result.elements if e.group.motif == "residual"}


def _aligned(family, residual="auto"):
    a, b = _folded(family, 0), _folded(family, 1)
    groups = select_groups(b.report.groups, "full")
    return align_states(groups, b.state_dict(), a.state_dict(), mode="full", residual=residual,
                        cost_excluded=free_cost_members(b, groups, "full")), b


@pytest.mark.slow
def test_auto_aligns_a_layernorm_stream_of_independent_models_by_permutations_and_stays_exact():
    result, b = _aligned("vit")
    assert result.residual == "permutation" and result.to_json()["residual_group"] == "permutation"
    assert _residual_kinds(result) == {"permutation"}
    replayed = apply(b.state_dict(), result.elements)  # still a reparametrisation of B
    assert all(torch.allclose(replayed[k], result.state[k], rtol=0, atol=1e-10) for k in result.state)
    assert Evaluator.of(b).check(result.state).ok


def test_orthogonal_keeps_the_whole_group_and_ends_closer_by_weights():
    narrowed, _ = _aligned("vit")
    whole, _ = _aligned("vit", residual="orthogonal")
    assert whole.residual == "orthogonal" and _residual_kinds(whole) == {"orthogonal"}
    assert whole.distance_after < narrowed.distance_after  # the larger group: closer by weights, not by loss


@pytest.mark.slow
def test_auto_keeps_the_orthogonal_group_for_rmsnorm_streams_and_align_states_keeps_it_by_default():
    result, _ = _aligned("llama")
    assert result.residual == "orthogonal" and _residual_kinds(result) == {"orthogonal"}
    forced, _ = _aligned("llama", residual="permutation")
    assert forced.residual == "permutation" and _residual_kinds(forced) <= {"signed_permutation"}
    a, b = _folded("vit", 0), _folded("vit", 1)
    plain = align_states(b.report.groups, b.state_dict(), a.state_dict(), mode="full", rounds=0,
                         matching_start=False)
    assert plain.residual == "orthogonal"  # the primitive's default: callers inside the library keep O(D)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["vit", "phi", "llama"])  # LayerNorm streams (ViT, Phi) and RMSNorm
def test_auto_recovers_a_reparametrised_folded_model_exactly_in_the_whole_group(family):
    subject = _folded(family, 0)
    anchor = subject.state_dict()
    source = apply(anchor, [sample(g, np.random.default_rng(5)) for g in subject.report.groups])
    result = align_states(subject.report.groups, source, anchor, mode="full", residual="auto")
    assert result.residual == "orthogonal"
    assert result.distance_before > 0.2 and result.distance_after < 1e-6


def test_other_modes_and_unfolded_models_have_no_residual_choice_and_bad_values_are_refused():
    subject = _folded("vit", 0)
    state = subject.state_dict()
    for mode in ("permutation", "paper"):
        assert align_states(select_groups(subject.report.groups, mode), state, state, mode=mode).residual is None
    unfolded = symgraph.load(zoo.build("vit", seed=0))
    plain = unfolded.state_dict()
    assert align_states(unfolded.report.groups, plain, plain, mode="full").residual is None
    with pytest.raises(SymgraphError, match="Unknown residual group 'rotation'"):
        align_states(subject.report.groups, state, state, residual="rotation")
    with pytest.raises(SymgraphError, match="Unknown residual group"):
        symgraph.align(unfolded, unfolded, residual="rotation")


@pytest.mark.slow
def test_cli_align_and_barrier_take_the_residual_group(tmp_path):
    for seed in (0, 1):
        model = zoo.build("vit", seed=seed, image_size=8, num_channels=1, num_labels=10)
        save_model(model.state_dict(), tmp_path / f"m{seed}", config=model_config(model))
    for choice in ("permutation", "orthogonal"):
        res = run("align", tmp_path / "m1", tmp_path / "m0", "-o", tmp_path / f"out-{choice}", "--fold", "--quiet",
                  "--residual-group", choice, "--stats", tmp_path / f"{choice}.json")
        assert res.returncode == 0, res.stderr
        assert ("residual stream by permutations" in res.stdout) == (choice == "permutation")
        stats = json.loads((tmp_path / f"{choice}.json").read_text())
        assert stats["residual_group"] == choice
        kinds = {v["kind"] for k, v in stats["groups"].items() if k.startswith("residual")}
        assert kinds == {"permutation" if choice == "permutation" else "orthogonal"}
    bad = run("align", tmp_path / "m1", tmp_path / "m0", "-o", tmp_path / "bad", "--residual-group", "rotation")
    assert bad.returncode == 2 and "rotation" in bad.stderr and not (tmp_path / "bad").exists()
    res = run("barrier", tmp_path / "m0", tmp_path / "m1", "--data", "digits", "--limit", "16", "--steps", "3",
              "--align", "full", "--residual-group", "permutation", "--no-progress", "-o", tmp_path / "b.png",
              "--json", tmp_path / "b.json")
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "b.json").read_text())["modes"]["full"]["loss_barrier"] >= 0
