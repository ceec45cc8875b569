"""The command line end to end: report, transform, fuzz, and every kind of bad input (demo: test_demo.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import symgraph
from symgraph.demo import demo_models
from symgraph.verify import Evaluator

from cli_runner import run, tree_digest

DEMO = demo_models()["llama-a"]


def run_process(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symgraph", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_report_json_schema(tmp_path):
    out = tmp_path / "r.json"
    res = run("report", DEMO, "--format", "json", "-o", out)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["schema"] == 1 and data["summary"]["groups"] == len(data["groups"]) > 0
    for g in data["groups"]:
        assert {"id", "motif", "kind", "size", "copies", "dof", "members", "solver", "layer", "notes"} <= set(g)
        assert g["kind"] in symgraph.groups.KINDS and g["solver"] != "none"
        for m in g["members"]:
            assert m["action"] in ("primal", "dual", "permute") and m["param"]
    kinds = {(g["motif"], g["kind"]) for g in data["groups"]}
    assert ("qk", "rotary") in kinds and ("residual", "signed_permutation") in kinds
    assert any(p["reason"] == "observable model output" for p in data["pinned"])


def test_report_config_only_matches_weights(tmp_path):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    (cfg / "config.json").write_text((DEMO / "config.json").read_text())
    a = json.loads(run("report", DEMO, "--format", "json").stdout)
    b = json.loads(run("report", cfg / "config.json", "--config-only", "--format", "json").stdout)
    assert a["groups"] == b["groups"]
    res = run("report", cfg, "--format", "json")
    assert res.returncode == 2 and "--config-only" in res.stderr and "Traceback" not in res.stderr


def test_report_config_only_with_a_buffer_indexed_by_positions(tmp_path):
    """GPT-J keeps its rotary table as a CPU buffer that the forward indexes by position ids; on the meta device
    (a config-only model) the trace mixed meta and CPU tensors and failed. Its groups must equal the weights'."""
    from symgraph import zoo
    model = zoo.build("gptj", num_hidden_layers=2)
    model.save_pretrained(tmp_path / "weights")
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text((tmp_path / "weights" / "config.json").read_text())
    a = json.loads(run("report", tmp_path / "weights", "--format", "json").stdout)
    res = run("report", tmp_path / "cfg" / "config.json", "--config-only", "--format", "json")
    assert res.returncode == 0, res.stderr
    b = json.loads(res.stdout)
    assert ("qk", "rotary") in {(g["motif"], g["kind"]) for g in b["groups"]}
    assert a["groups"] == b["groups"]


@pytest.mark.parametrize("fmt,marker", [("md", "# Symmetry report"), ("html", "<svg")])
def test_report_human_formats(tmp_path, fmt, marker):
    out = tmp_path / f"r.{fmt}"
    assert run("report", DEMO, "--format", fmt, "-o", out).returncode == 0
    assert marker in out.read_text()


def test_transform_writes_an_equivalent_copy_and_never_touches_the_input(tmp_path):
    before = tree_digest(DEMO)
    out = tmp_path / "t"
    res = run("transform", DEMO, "-o", out, "--seed", "3")
    assert res.returncode == 0, res.stderr
    assert tree_digest(DEMO) == before
    original = symgraph.load(DEMO)
    copy = symgraph.load(out)
    changed = [k for k, v in copy.state_dict().items() if not torch.equal(v, original.state_dict()[k])]
    assert len(changed) > 10
    evaluator = Evaluator(original.model, original.args, original.kwargs)
    assert evaluator.check(copy.state_dict()).ok
    again = run("transform", DEMO, "-o", out)
    assert again.returncode == 2 and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert run("transform", DEMO, "-o", out, "--overwrite", "--seed", "4").returncode == 0


def test_fuzz_passes_and_writes_json(tmp_path):
    res = run("fuzz", DEMO, "--samples", "2", "--json", tmp_path / "f.json")
    assert res.returncode == 0, res.stderr
    assert "all groups invariant" in res.stdout
    data = json.loads((tmp_path / "f.json").read_text())
    assert data["ok"] and all(g["counterexample"] is None for g in data["groups"])


FACTORY = '''
import torch

class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        if self.lin(x).sum() > 0:   # data-dependent control flow: torch.export cannot trace it
            return x
        return -x

def untraceable():
    return Branchy(), (torch.randn(2, 4),)

def mlp():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)), (torch.randn(3, 4),)

def not_a_model():
    return 42
'''


@pytest.fixture
def factories(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(FACTORY)
    return path


def test_factory_model_reports(factories):
    res = run("report", f"{factories}:mlp", "--format", "json")
    assert res.returncode == 0, res.stderr
    groups = json.loads(res.stdout)["groups"]
    assert [(g["motif"], g["kind"], g["size"]) for g in groups] == [("ffn", "signed_permutation", 8)]


@pytest.mark.parametrize("model,words", [
    ("{tmp}/does-not-exist", ["does-not-exist"]),
    ("{factories}:untraceable", ["torch.export could not trace", "Branchy"]),
    ("{factories}:not_a_model", ["not_a_model", "nn.Module"]),
    ("{factories}:missing", ["missing"]),
    ("no.such.module:factory", ["no.such.module"]),
    ("{tmp}/bad-json", ["config.json", "JSON"]),
    ("{tmp}/unknown-type", ["model_type", "zzz-not-a-model"]),
])
def test_bad_model_argument_gets_a_clear_error(tmp_path, factories, model, words):
    (tmp_path / "bad-json").mkdir()
    (tmp_path / "bad-json" / "config.json").write_text("{ not json")
    (tmp_path / "unknown-type").mkdir()
    (tmp_path / "unknown-type" / "config.json").write_text(json.dumps({"model_type": "zzz-not-a-model"}))
    res = run("report", model.format(tmp=tmp_path, factories=factories))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and res.stderr.startswith("error:")
    for word in words:
        assert word in res.stderr, res.stderr


def test_corrupt_weights_are_named(tmp_path):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / "config.json").write_text((DEMO / "config.json").read_text())
    (folder / "model.safetensors").write_bytes((DEMO / "model.safetensors").read_bytes()[:1000])
    res = run("report", folder)
    assert res.returncode == 2 and "model.safetensors" in res.stderr and "Traceback" not in res.stderr


def test_bad_options_exit_non_zero(tmp_path):
    assert run("report", DEMO, "--format", "pdf").returncode == 2
    assert run("fuzz", DEMO, "--samples", "0").returncode == 2
    res = run("report", DEMO, "-o", tmp_path / "no" / "such" / "dir" / "r.md")
    assert res.returncode == 2 and "does not exist" in res.stderr


def test_console_script_runs_as_a_process(tmp_path, factories):
    """The real entry point, once for success and once for a bad input (no traceback reaches the user)."""
    ok = run_process("report", f"{factories}:mlp", "--format", "json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["groups"]
    bad = run_process("report", f"{factories}:untraceable")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "could not trace" in bad.stderr


def test_fuzz_reports_a_shrunk_counterexample_and_exits_1(monkeypatch, tmp_path):
    """Widen one detected group (RoPE commutant -> any rotation) and the CLI must catch it."""
    import dataclasses

    from symgraph.api import Subject

    real = Subject.report.fget

    def widened(self):
        report = real(self)
        groups = tuple(dataclasses.replace(g, kind="orthogonal") if g.kind == "rotary" else g
                       for g in report.groups)
        return dataclasses.replace(report, groups=groups)

    monkeypatch.setattr(Subject, "report", property(widened))
    res = run("fuzz", DEMO, "--samples", "10", "--json", tmp_path / "f.json")
    assert res.returncode == 1
    assert "VIOLATE" in res.stdout and "counterexample:" in res.stdout
    data = json.loads((tmp_path / "f.json").read_text())
    bad = [g for g in data["groups"] if g["counterexample"]]
    assert bad and all(g["kind"] == "orthogonal" and g["motif"] == "qk" for g in bad)
