"""examples/sweep_fold.py: one tied type folds once untied, refusals are grouped without names, the summary."""
from __future__ import annotations


import pytest

from example_scripts import example_module, one_row


@pytest.fixture(scope="module")
def sweep():
    with example_module("sweep_fold") as module:
        yield module


def test_refusals_are_grouped_by_what_stopped_them_not_by_names(sweep):
    a = ("FoldError: Cannot fold norm bert.embeddings.LayerNorm.weight (graph node layer_norm, module "
         "bert.embeddings.LayerNorm): its output is read by aten.add.Tensor (graph node add_4); only linear layers")
    b = a.replace("bert.embeddings", "roberta.embeddings").replace("add_4", "add_7")
    assert sweep.why(a) == sweep.why(b) and "aten.add.Tensor" in sweep.why(a) and "bert" not in sweep.why(a)


def test_the_summary_keeps_the_last_row_per_type(sweep):
    rows = [{"type": "gpt2", "class": "refused", "reason": "FoldError: tied"},
            {"type": "gpt2", "class": "ok_untied", "verified_error": 1e-8},
            {"type": "llama", "class": "ok", "verified_error": 2e-8},
            {"type": "bert", "class": "refused", "reason": "FoldError: Cannot fold X: read by aten.add.Tensor"}]
    summary = sweep.summarize(rows)
    assert summary["counts"] == {"ok_untied": 1, "ok": 1, "refused": 1}
    assert (summary["folded"], summary["folded_once_untied"]) == (["llama"], ["gpt2"])
    assert summary["largest_verified_error"] == 2e-8 and sum(summary["refusals"].values()) == 1


@pytest.mark.slow
def test_a_tied_type_folds_once_untied():
    row = one_row("sweep_fold", "gpt2")
    assert row["class"] == "ok_untied" and row["untied"] == ["lm_head.weight"] and "tied" in row["tied_reason"]
    assert row["verified_error"] < 1e-5


def test_the_summary_counts_the_engine_classes_on_folded_models_and_names_the_unsound(sweep):
    rows = [{"type": "llama", "class": "ok", "verified_error": 1e-8,
             "engine": {"class": "sound", "groups": {"residual/orthogonal": 1, "ffn/permutation": 2},
                        "max_error": 1e-15}},
            {"type": "gemma3", "class": "ok_untied", "verified_error": 1e-8,
             "engine": {"class": "unsound", "groups": {"residual/signed_permutation": 1}, "max_error": 0.5,
                        "bad_groups": ["g1 residual/signed_permutation (5.0e-01)"]}},
            {"type": "bert", "class": "refused", "reason": "FoldError: post-LN"}]
    summary = sweep.summarize(rows)
    assert summary["engine_on_folded"] == {"sound": 1, "unsound": 1}
    assert summary["engine_unsound"] == {"gemma3": ["g1 residual/signed_permutation (5.0e-01)"]}
    assert summary["engine_residual_groups"] == {"residual/orthogonal": 1, "residual/signed_permutation": 1}
    assert summary["engine_largest_error"] == 0.5
    assert "engine_on_folded" not in sweep.summarize(rows[2:])
