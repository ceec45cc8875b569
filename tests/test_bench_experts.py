"""Smoke test of examples/bench_experts.py at two experts: it runs end to end, in a subprocess, and reports what it
promises (the copy comes back to rounding; the figures themselves are the benchmark's output, not assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_experts.py"


@pytest.mark.slow
def test_bench_experts_reports_both_alignments(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--experts", "2", "--json", str(out)], capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["experts"] == 2 and row["expert_groups"] == 2  # one per block
    assert row["copy"]["distance_after"] < 1e-9 < row["copy"]["distance_before"]
    assert row["twin"]["distance_after"] < row["twin"]["distance_before"] and row["twin"]["expert_solves"] > 0
