"""Smoke test of examples/bench_lap.py at small widths: it runs, prints one JSON object, and every solver that ran
reached scipy's optimum (the figures themselves are not checked: timings belong in the benchmark's output)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_lap.py"


def test_bench_lap_reports_every_solver_at_scipys_optimum(tmp_path):
    out = tmp_path / "lap.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--widths", "48", "96", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    ran = [r for r in result["rows"] if r["status"] == "ok"]
    assert {(r["kind"], r["width"]) for r in ran} == {(k, n) for k in ("gaussian", "correlation") for n in (48, 96)}
    assert all(r["same_optimum_as_scipy"] for r in ran if r["solver"] != "scipy")
    assert {r["solver"] for r in result["rows"]} | set(result["missing"]) >= {"scipy", "lapjv"}
