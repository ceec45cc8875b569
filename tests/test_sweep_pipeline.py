"""examples/sweep_pipeline.py: how a type's stages make its class, the summary, and one tiny type end to end."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from example_scripts import example_module, one_row


@pytest.fixture(scope="module")
def pipeline():
    with example_module("sweep_pipeline") as module:
        yield module


def stages(**classes):
    return {name: {"class": c, "seconds": 0.1} for name, c in classes.items()}


@pytest.mark.parametrize("classes, expected, failed", [
    (dict(fold="refused", align="ok", merge="ok"), "ok", []),  # fold refusing is no failure
    (dict(fold="wrong", align="ok"), "wrong", ["fold"]),
    (dict(fold="ok", align="refused", merge="crash"), "crash", ["align", "merge"]),
    (dict(learn_merge="ok", learn_align="wrong"), "wrong", ["learn_align"]),
])
def test_a_type_takes_its_worst_stages_class(pipeline, classes, expected, failed):
    assert pipeline.type_class(stages(**classes)) == expected
    assert pipeline.failed_stages(stages(**classes)) == failed


def test_names_carry_the_mode(pipeline):
    assert pipeline.parse_name("olmo") == ("olmo", "base")
    assert pipeline.parse_name(pipeline.name_of("qwen3_moe", "learn")) == ("qwen3_moe", "learn")
    assert pipeline.parse_name(pipeline.name_of("qwen3_moe", "data")) == ("qwen3_moe", "data")
    for mode in ("base", "learn", "data", "disk", "stream"):
        flags = {flag: flag == mode for flag in ("learn", "data", "disk", "stream")}
        args = argparse.Namespace(types="olmo,gpt2+learn", variants=None, **flags)
        assert pipeline.names_of(args) == [pipeline.name_of("olmo", mode), "gpt2+learn"]
        assert set(pipeline.STAGES[mode]) >= {"align" if mode == "base" else f"{mode}_align"}


def test_variants_are_named_and_built_by_their_variant(pipeline):
    args = argparse.Namespace(types="falcon", variants=[], learn=True)
    names = pipeline.names_of(args)
    variants = [n for n, v in pipeline.VARIANT_BY_NAME.items() if v[0] == "falcon"]
    assert names == [pipeline.name_of(n, "learn") for n in variants] and len(names) > 1
    row = pipeline.identity(names[0])
    assert (row["type"], row["mode"], row["variant"]) == ("falcon", "learn", variants[0])
    assert row["overrides"] == pipeline.VARIANT_BY_NAME[variants[0]][1]
    model_type, overrides, heads = pipeline.recipe("gpt2 @TokenClassification")
    assert (model_type, overrides, heads) == ("gpt2", {}, ("AutoModelForTokenClassification",))
    assert "variant" not in pipeline.identity("gpt2")


def test_summary_keeps_the_last_row_per_name_and_lists_failures(pipeline):
    rows = [{"name": "olmo", "class": "refused", "failed": ["merge"], "wall": 5.0,
             "stages": {**stages(fold="refused", align="ok"), "merge": {"class": "refused", "message": "no"}}},
            {"name": "olmo", "class": "ok", "failed": [], "wall": 6.0, "stages": stages(align="ok", merge="ok")},
            {"name": "swin", "class": "timeout", "reason": ">300 s", "wall": 300.0}]
    summary = pipeline.summarize(rows)
    assert summary["classes"] == {"olmo": "ok", "swin": "timeout"}
    assert summary["failures"] == {"swin": {"class": "timeout", "reason": ">300 s"}}
    assert summary["stage_counts"] == {"align": {"ok": 1}, "merge": {"ok": 1}}
    assert summary["seconds"] == 306.0


@pytest.mark.slow
def test_one_tiny_type_runs_every_stage():
    row = one_row("sweep_pipeline", "deit")
    assert set(row["stages"]) == {"fold", "align", "merge", "self_merge"}
    assert row["class"] == "ok", row["stages"]


@pytest.mark.slow
def test_the_streamed_commands_run_on_files_and_are_checked_from_disk():
    row = one_row("sweep_pipeline", "qwen2+stream")
    assert set(row["stages"]) == {"stream_align", "stream_fold"}
    assert row["class"] == "ok", row["stages"]
    assert all(s["max_rel_err"] <= s["tol"] for s in row["stages"].values())


@pytest.mark.slow
def test_a_command_that_loses_a_tensor_on_loading_is_wrong(pipeline, tmp_path, monkeypatch):
    """What transformers re-initialises or drops on loading an output is a failure, whatever the function check
    says (a merge has no function to keep)."""
    import symgraph.cli

    pair = pipeline.Pair("qwen2")
    real_main = symgraph.cli.main

    def dropping(argv):  # the command runs, then loses one tensor of what it wrote
        from safetensors.torch import load_file, save_file

        real_main(argv)
        out = Path(argv[argv.index("-o") + 1]) / "model.safetensors"
        tensors = load_file(out)
        tensors.pop(next(k for k in tensors if k.endswith("down_proj.weight")))
        save_file(tensors, out, metadata={"format": "pt"})

    monkeypatch.setattr(symgraph.cli, "main", dropping)
    out = pipeline.disk_stage(pair, "merge")
    assert out["class"] == "wrong" and out["lost_on_loading"]["missing_keys"]


@pytest.mark.slow
def test_one_variant_runs_every_stage():
    # a variant with batch norms: their running statistics get the variants sweep's noise and must move with
    # their channels through every stage
    name = 'resnet hidden_sizes=[16,32] depths=[1,1] embedding_size=16 @base'
    row = one_row("sweep_pipeline", name)
    assert (row["name"], row["variant"], row["type"], row["head"]) == (name, name, "resnet", "AutoModel")
    assert set(row["stages"]) == {"fold", "align", "merge", "self_merge"}
    assert row["class"] == "ok", row["stages"]


def test_a_result_written_untied_is_checked_on_the_untied_model_its_config_builds(pipeline):
    import symgraph
    from symgraph import zoo

    model = zoo.build("llama-tied", seed=0).float().eval()
    folded = symgraph.fold(symgraph.load(model, zoo.example_inputs_for("llama-tied", model)))
    assert folded.untied == ["lm_head.weight"]
    checker = pipeline.Checker(model)
    on_tied = pipeline.function_kept({}, folded.state, model, checker, 1e-5)  # both names in one tensor
    assert on_tied["class"] == "wrong" and on_tied["tied_inconsistent"]
    as_written = pipeline.function_kept({}, folded.state, model, checker, 1e-5, folded.config)
    assert as_written["untied"] and "class" not in as_written and as_written["max_rel_err"] < 1e-5
