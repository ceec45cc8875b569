"""``symgraph demo``: the main job on the shipped pairs runs end to end (``--quick``), writes what it promises,
prints its summary, and refuses an output folder it cannot write."""
from __future__ import annotations

import json

import pytest

from symgraph.demo import QUICK_PLAN, SHIPPED_PAIRS, shipped_pair

from cli_runner import run


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """One quick demo run, with --overwrite into a folder an earlier run left: a stale file of the demo's own
    and a file of the user's (one run of the demo serves every test here; it takes most of a minute)."""
    out = tmp_path_factory.mktemp("demo") / "out"
    (out / QUICK_PLAN.pairs[0]).mkdir(parents=True)
    (out / QUICK_PLAN.pairs[0] / "report.json").write_text("stale")
    (out / "notes.txt").write_text("mine")
    code, stdout, stderr = run("demo", "--out", out, "--quick", "--overwrite")
    assert code == 0, stderr
    return out, stdout


def test_every_shipped_pair_exists():
    for name in SHIPPED_PAIRS:
        assert all((folder / "config.json").is_file() for folder in shipped_pair(name))


def test_quick_demo_writes_every_promised_file(quick_demo):
    out, _ = quick_demo
    pair = out / QUICK_PLAN.pairs[0]
    expected = [*(f"report.{fmt}" for fmt in ("json", "md", "html")),
                *(f"align-{mode}.json" for mode in ("permutation", "paper", "full")),
                "aligned-full/model.safetensors", "aligned-full/config.json", "merged-simple/model.safetensors",
                "barrier.png"]
    assert [name for name in expected if not (pair / name).is_file()] == []
    assert json.loads((pair / "report.json").read_text())["groups"]
    assert json.loads((pair / "align-full.json").read_text())["verified_relative_error"] < 1e-4


def test_quick_demo_summary_is_printed_and_saved(quick_demo):
    out, stdout = quick_demo
    for line in ("groups (", "distance |B'-A|/|A|", "loss barrier", "computes what B computes", "test loss / acc.",
                 "endpoint A", "merged simple", "aligned B (full)", "barrier plot", f"everything is in {out}"):
        assert line in stdout, line
    summary = json.loads((out / "summary.json").read_text())[QUICK_PLAN.pairs[0]]
    assert set(summary["barrier"]) == {"none", "permutation", "paper", "full"}
    assert summary["barrier"]["full"]["distance"] < summary["barrier"]["none"]["distance"]


def test_quick_demo_announces_each_step_before_its_summary(quick_demo):
    _, stdout = quick_demo
    lines = stdout.splitlines()
    assert lines[0].startswith("symgraph demo: 1 shipped pair(s) (llama-chars)")
    steps = [i for i, line in enumerate(lines) if line.startswith("llama-chars: ")]
    assert len(steps) == 5 and steps == list(range(1, 6))  # printed as each step starts, before any result
    assert "aligning B onto A" in lines[3] and "loss barrier" in lines[5]


def test_quick_demo_says_why_from_scratch_twins_merge_badly(quick_demo):
    out, stdout = quick_demo
    summary = json.loads((out / "summary.json").read_text())["llama-chars"]
    worst = max(m["loss"] for m in summary["endpoints"].values())
    assert summary["merged_after_full_alignment"]["simple"]["loss"] > worst  # the twins merge badly
    assert "why the merges lose" in stdout and "different random initialisations" in stdout


def test_demo_refuses_an_out_that_holds_files_unless_overwrite(quick_demo, tmp_path):
    out = tmp_path / "out"
    (out / "llama-chars").mkdir(parents=True)
    (out / "llama-chars" / "report.json").write_text("an earlier run's")
    before = {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None) for p in out.rglob("*")}
    code, stdout, stderr = run("demo", "--out", out, "--quick")
    assert code == 2 and "already holds files" in stderr and "--overwrite" in stderr and stdout == ""
    assert {p: (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in out.rglob("*")} == before  # nothing touched
    done, stdout = quick_demo  # the fixture's run: --overwrite replaced its stale files and kept the user's
    assert f"everything is in {done}" in stdout and (done / "notes.txt").read_text() == "mine"
    assert json.loads((done / QUICK_PLAN.pairs[0] / "report.json").read_text())["groups"]


def test_demo_refuses_a_file_as_out(tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a folder")
    code, _, stderr = run("demo", "--out", target, "--quick")
    assert code == 2 and "is a file, not a folder" in stderr and "Traceback" not in stderr


def test_demo_refuses_an_out_it_cannot_create(tmp_path):
    (tmp_path / "file").write_text("")
    code, _, stderr = run("demo", "--out", tmp_path / "file" / "demo", "--quick")
    assert code == 2 and "Cannot write the demo" in stderr and "Traceback" not in stderr
