"""examples/study_heldout_pairs.py: held-out twins trained into a cache and measured by barrier mode."""
from __future__ import annotations

from dataclasses import replace

import pytest

from example_scripts import example_module


def test_a_held_out_pair_is_trained_into_the_cache_once_and_measured_per_mode(tmp_path, monkeypatch):
    with example_module("study_heldout_pairs") as study:
        build, family = study.PAIRS["gpt2-chars"]
        monkeypatch.setitem(study.PAIRS, "gpt2-chars", (build, replace(family, steps=3, warmup=1)))
        out = tmp_path / "heldout.json"
        study.main(["--pairs", "gpt2-chars", "--modes", "none,permutation,textbook", "--points", "3", "--root",
                    str(tmp_path / "cache"), "--out", str(out)])
        first = (tmp_path / "cache" / "gpt2-chars-a" / "model.safetensors").stat().st_mtime_ns
        row = study.measure("gpt2-chars", ("none",), 3, tmp_path / "cache")  # trained already: not again
        assert (tmp_path / "cache" / "gpt2-chars-a" / "model.safetensors").stat().st_mtime_ns == first
        with pytest.raises(SystemExit):
            study.main(["--pairs", "gpt3-chars"])
    import json

    pair = json.loads(out.read_text())["pairs"]["gpt2-chars"]
    assert set(pair["modes"]) == {"none", "permutation", "textbook"}
    assert pair["modes"]["permutation"]["distance"] <= pair["modes"]["textbook"]["distance"] * (1 + 1e-9)
    assert pair["modes"]["none"]["of_unaligned"] == 1.0
    assert pair["modes"]["permutation"]["barrier"] >= 0 and pair["modes"]["permutation"]["distance"] > 0
    assert row["modes"]["none"]["barrier"] == pair["modes"]["none"]["barrier"]


def test_a_topic_classifier_pair_trains_on_topic_batches(tmp_path, monkeypatch):
    with example_module("study_heldout_pairs") as study:
        build, family = study.PAIRS["distilbert-topics"]
        monkeypatch.setitem(study.PAIRS, "distilbert-topics", (build, replace(family, steps=2, warmup=1)))
        row = study.measure("distilbert-topics", ("none",), 3, tmp_path / "cache")
    assert row["data"] == "pydoc-topics" and row["modes"]["none"]["of_unaligned"] in (1.0, None)
