"""examples/sweep_depth.py: per-layer config lists grow with the depth, rows compare both paths, the summary."""
from __future__ import annotations

import pytest

from example_scripts import example_module, one_row


@pytest.fixture(scope="module")
def sweep():
    with example_module("sweep_depth") as module:
        yield module


def test_per_layer_config_lists_are_repeated_to_the_depth(sweep):
    overrides = sweep.deep_overrides("qwen2", 6)
    assert overrides["num_hidden_layers"] == 6
    assert len(overrides["layer_types"]) == 6  # the tiny config's 2-entry list, cycled


def test_summary_counts_classes_and_reasons(sweep):
    rows = [{"type": "a", "class": "same", "fast_path": True, "why_not": ""},
            {"type": "b", "class": "same", "fast_path": False, "why_not": "analysing the full depth: hooks (x)"},
            {"type": "c", "class": "differs", "fast_path": True, "why_not": ""},
            {"type": "a", "class": "error", "reason": "boom"}]  # a later row of a type replaces the earlier one
    summary = sweep.summarize(rows)
    assert summary["counts"] == {"error": 1, "same": 1, "differs": 1}
    assert summary["fast_path"] == 1 and summary["why_not_fast"] == {"hooks": 1}
    assert set(summary["failures"]) == {"a", "c"}


@pytest.mark.slow
def test_one_type_end_to_end():
    row = one_row("sweep_depth", "llama", timeout=300)
    assert row["class"] == "same" and row["fast_path"] and row["depth"] == 6
