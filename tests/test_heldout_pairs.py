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
        study.main(["--pairs", "gpt2-chars", "--modes", "none,permutation", "--points", "3", "--root",
                    str(tmp_path / "cache"), "--out", str(out)])
        first = (tmp_path / "cache" / "gpt2-chars-a" / "model.safetensors").stat().st_mtime_ns
        row = study.measure("gpt2-chars", ("none",), 3, tmp_path / "cache")  # trained already: not again
        assert (tmp_path / "cache" / "gpt2-chars-a" / "model.safetensors").stat().st_mtime_ns == first
        with pytest.raises(SystemExit):
            study.main(["--pairs", "gpt3-chars"])
    import json

    pair = json.loads(out.read_text())["pairs"]["gpt2-chars"]
    assert set(pair["modes"]) == {"none", "permutation"}
    assert pair["modes"]["none"]["of_unaligned"] == 1.0
    assert pair["modes"]["permutation"]["barrier"] >= 0 and pair["modes"]["permutation"]["distance"] > 0
    assert row["modes"]["none"]["barrier"] == pair["modes"]["none"]["barrier"]
