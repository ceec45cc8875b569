"""The wide pairs of examples/train_models.py: trained on first use into a cache folder, deterministically, and
read from there afterwards (shrunk here to a few steps of a narrow model: the recipe, not the figures, is tested)."""
from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import symgraph

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def train_models():
    spec = importlib.util.spec_from_file_location("train_models", EXAMPLES / "train_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_models"] = module  # the dataclasses in it look their module up
    spec.loader.exec_module(module)
    deterministic = torch.are_deterministic_algorithms_enabled()  # training switches it on for the process
    yield module
    torch.use_deterministic_algorithms(deterministic)
    sys.modules.pop("train_models", None)


def test_wide_families_are_the_issue_sizes(train_models):
    vit, llama = train_models.WIDE_FAMILIES["vit-wide"].build(), train_models.WIDE_FAMILIES["llama-wide"].build()
    assert (vit.config.hidden_size, vit.config.num_hidden_layers) == (256, 6)
    assert (llama.config.hidden_size, llama.config.num_hidden_layers) == (256, 4)
    assert train_models.WIDE_PAIRS == {"vit-digits-wide": "digits", "llama-chars-wide": "pydoc-chars"}


@pytest.mark.slow
def test_wide_pair_trains_once_into_its_cache_deterministically(train_models, tmp_path, monkeypatch):
    tiny = replace(train_models.WIDE_FAMILIES["llama-wide"], steps=3, batch=2, warmup=1, size=(16, 1))
    monkeypatch.setitem(train_models.WIDE_FAMILIES, "llama-wide", tiny)
    first = train_models.wide_pair("llama-chars-wide", tmp_path / "cache")
    assert [f.name for f in first] == ["llama-chars-wide-a", "llama-chars-wide-b"]
    record = json.loads((tmp_path / "cache" / "training.json").read_text())["models"]
    assert {record[f.name]["seed"] for f in first} == {0, 1} and record[first[0].name]["steps"] == 3
    assert list(record[first[0].name]["test_loss_by_step"]) == ["1", "2", "3"]  # the test loss along the way
    a, b = (load_file(str(f / "model.safetensors")) for f in first)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two seeds, two models

    again = train_models.wide_pair("llama-chars-wide", tmp_path / "other")  # same recipe, another folder
    assert all(torch.equal(a[k], v) for k, v in load_file(str(again[0] / "model.safetensors")).items())

    monkeypatch.setattr(train_models, "train_into", lambda *_: pytest.fail("a cached pair was trained again"))
    assert train_models.wide_pair("llama-chars-wide", tmp_path / "cache") == first
    assert symgraph.load(first[1]).config.hidden_size == 16


def test_wide_pair_refuses_models_cached_by_another_recipe(train_models, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    for suffix in "ab":
        (cache / f"llama-chars-wide-{suffix}").mkdir(parents=True)
        (cache / f"llama-chars-wide-{suffix}" / "config.json").write_text("{}")
    old = {f"llama-chars-wide-{s}": {"steps": 300, "batch": 16, "lr": 0.002} for s in "ab"}  # version 1's record
    (cache / "training.json").write_text(json.dumps({"models": old}))
    monkeypatch.setattr(train_models, "train_into", lambda *_: pytest.fail("a cached pair was trained again"))
    with pytest.raises(SystemExit, match="trained with .*'steps': 300.*remove the folder"):
        train_models.wide_pair("llama-chars-wide", cache)


@pytest.mark.slow
def test_paper_experiments_wide_run_reports_every_mode_and_the_merge(train_models, tmp_path, monkeypatch):
    tiny = replace(train_models.WIDE_FAMILIES["llama-wide"], steps=3, batch=2, warmup=1, size=(16, 1))
    monkeypatch.setitem(train_models.WIDE_FAMILIES, "llama-wide", tiny)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    # imported afresh, so it takes wide_pair from this fixture's train_models (an import left by an earlier
    # instance of the module fixture on this worker bound the old module, and trained the real pair for minutes)
    monkeypatch.delitem(sys.modules, "paper_experiments", raising=False)
    import paper_experiments

    monkeypatch.setattr(paper_experiments, "WIDE_MERGED", ("llama-chars-wide",))  # the ViT's merge, on this pair
    out = tmp_path / "report" / "RESULTS.md"
    paper_experiments.main(["--quick", "--pairs", "llama-chars-wide", "--wide-models", str(tmp_path / "cache"),
                            "--out", str(out)])
    wide = json.loads((out.parent / "results" / "wide.json").read_text())
    result = wide["pairs"]["llama-chars-wide"]
    assert set(result["barrier"]["modes"]) == set(paper_experiments.COLUMNS)  # every mode and the textbook
    assert set(result["training"]) == {"llama-chars-wide-a", "llama-chars-wide-b"}
    assert {record["steps"] for record in result["training"].values()} == {tiny.steps}  # the tiny recipe ran
    merge, ends = result["merge"], result["endpoints"]
    aligned = {m: c["loss_barrier"] for m, c in result["barrier"]["modes"].items() if m not in ("none", "textbook")}
    assert merge["align"] == min(aligned, key=aligned.get)
    assert merge["ratio"] == pytest.approx(merge["loss"] / ((ends["A"]["loss"] + ends["B"]["loss"]) / 2))
    section = (out.parent / "results" / "wide.md").read_text()  # no shipped results.json there: the section alone
    assert "llama-chars-wide" in section and "| full+learn |" in section and not out.exists()
