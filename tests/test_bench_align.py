"""Smoke test of examples/bench_align.py on a trained pair: every mode runs in its own process and the time ratios
the issue bounds are computed from the modes' totals (the figures themselves belong in the benchmark's output)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_align.py"


@pytest.mark.slow
def test_bench_align_times_every_mode_on_a_shipped_pair(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pair", "bert-topics", "--modes", "paper,permutation,full",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "BENCH_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    entry = result["pairs"]["bert-topics/trained"]
    modes = entry["modes"]
    assert set(modes) == {"paper", "permutation", "full"}
    assert all(m["distance_after"] < m["distance_before"] and m["peak_rss_mb"] > 0 for m in modes.values())
    assert not any(m["folded"] for m in modes.values())  # post-LN BERT cannot be folded
    assert entry["full_over_paper_time"] == pytest.approx(modes["full"]["total_s"] / modes["paper"]["total_s"])
    assert entry["full_over_permutation_time"] == pytest.approx(
        modes["full"]["total_s"] / modes["permutation"]["total_s"])
