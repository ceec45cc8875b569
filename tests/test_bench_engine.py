"""Smoke test of examples/bench_engine.py: both parts at one layer, in a subprocess, JSON keys and positive figures.

The figures themselves are not checked against any threshold (timings belong in the benchmark's output, not in
assertions); this only makes sure the script runs end to end and reports what it promises.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "bench_engine.py"

COMMON = ("groups", "by_motif_kind", "capture_s", "analysis_s", "parameter_count")
BERT_KEYS = COMMON + ("build_model_s", "load_s", "capture_plus_analysis_s", "peak_rss_delta_capture_plus_analysis_mb",
                      "tracemalloc_peak_analysis_mb", "weights_read", "ratio_analysis_to_weights_read",
                      "ratio_capture_plus_analysis_to_weights_read")
LLAMA_KEYS = COMMON + ("load_s", "peak_rss_mb", "fp16_weights_gb", "all_parameters_on_meta",
                       "parameters_not_on_meta")


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    # 6 GB of address space is plenty for one layer; a runaway allocation then fails fast with MemoryError
    # (reported in the JSON) instead of exhausting a shared machine's memory.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--part", "all", "--layers", "1", "--mem-limit-gb", "6",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip(), f"no JSON on stdout (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
    result = json.loads(proc.stdout)  # exactly one JSON object
    assert json.loads(out.read_text()) == result
    result["_returncode"] = proc.returncode
    return result


def _check_part(part: dict, keys: tuple[str, ...], name: str) -> None:
    assert part.get("ok"), (f"part {name} failed in stage {part.get('failed_stage')}: {part.get('error')} "
                            f"(peak RSS at failure {part.get('peak_rss_at_failure_mb')} MB)")
    missing = [k for k in keys if k not in part]
    assert not missing, f"{name}: missing keys {missing}"
    for k in ("capture_s", "analysis_s", "parameter_count", "groups"):
        assert part[k] > 0, f"{name}: {k} = {part[k]}"
    assert part["config"]["num_hidden_layers"] == 1
    assert sum(part["by_motif_kind"].values()) == part["groups"]
    assert part["summary"]["groups"] == part["groups"]


@pytest.mark.slow
def test_bert_part(bench):
    bert = bench["bert"]
    _check_part(bert, BERT_KEYS, "bert")
    assert bert["weights_read"]["best_s"] > 0
    assert bert["ratio_analysis_to_weights_read"] > 0
    assert bert["tracemalloc_peak_analysis_mb"] > 0
    assert bert["peak_rss_delta_capture_plus_analysis_mb"] >= 0
    assert bert["analysis_deterministic"]


@pytest.mark.slow
def test_llama70b_config_part(bench):
    llama = bench["llama70b_config"]
    _check_part(llama, LLAMA_KEYS, "llama70b_config")
    assert llama["all_parameters_on_meta"] and llama["parameters_not_on_meta"] == 0
    assert llama["config"]["hidden_size"] == 8192 and llama["config"]["vocab_size"] == 128256
    assert 0 < llama["peak_rss_mb"] * 2**20 < llama["fp16_weights_gb"] * 1e9, \
        f"a config-only analysis peaked at {llama['peak_rss_mb']} MB, more than the fp16 weights would take"
    assert bench["_returncode"] == 0
