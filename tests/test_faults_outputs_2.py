"""Written models lose nothing of their inputs, and what cannot be written is refused where it is written: read-only
commands read every checkpoint they can analyse (second pass; see test_faults_outputs.py)."""
from __future__ import annotations

import logging

import pytest
import torch
import transformers

from cli_runner import run
from symgraph.errors import ModelLoadError
from symgraph.io import save_model
from test_faults_outputs import _deepseek_v3_with_mtp, _stored, _with_extra

MTP = "model.layers.61.eh_proj.weight"


def test_read_only_commands_read_a_checkpoint_with_tensors_the_model_skips(tmp_path, caplog):
    """Multi-token-prediction layers were refused on loading, so report and fuzz, which write no model, refused
    DeepSeek-V3 / GLM-4.5 / Qwen3-Next checkpoints; now they warn, naming the tensors left out."""
    folder = _deepseek_v3_with_mtp(tmp_path / "m", 0)
    for args in (["report", folder], ["fuzz", folder, "--samples", "1"]):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="symgraph"):
            code, _, err = run(*args)
        assert code == 0, err
        assert MTP in caplog.text and "left out" in caplog.text, caplog.text


def test_commands_writing_moved_weights_refuse_tensors_the_model_skips_before_any_work(tmp_path):
    """align, transform, fold and an in-memory merge would write the model without them: refused before loading,
    naming them and what to do; an anchor holding them is only read (the output is the source's)."""
    folder, other = _deepseek_v3_with_mtp(tmp_path / "m", 0), _deepseek_v3_with_mtp(tmp_path / "o", 1)
    for args in (["transform", folder], ["fold", folder], ["align", folder, other, "--quiet"],
                 ["merge", folder, other, "--align", "none", "--no-progress"]):
        code, _, err = run(*args, "-o", tmp_path / "out")
        assert code == 2 and MTP in err and "does not load" in err and "merge --stream" in err, (args, err)
        assert not (tmp_path / "out").exists()


def test_a_streamed_plain_merge_averages_tensors_the_model_skips(tmp_path):
    """merge --stream averages every stored tensor: the multi-token-prediction layers too, as the model's."""
    a, b = _deepseek_v3_with_mtp(tmp_path / "a", 0), _deepseek_v3_with_mtp(tmp_path / "b", 1)
    code, _, err = run("merge", a, b, "--stream", "--align", "none", "-o", tmp_path / "out")
    assert code == 0, err
    merged, first, second = _stored(tmp_path / "out"), _stored(a), _stored(b)
    assert merged.keys() == first.keys()
    assert torch.allclose(merged[MTP], (first[MTP] + second[MTP]) / 2)


def test_a_streamed_alignment_refuses_tensors_not_in_the_model(tmp_path):
    """Tensors the class does not skip belong to another model: refused as loading refuses them."""
    extra = {"extra.weight": torch.ones(3)}
    a, b = _with_extra(tmp_path / "a", "llama", extra), _with_extra(tmp_path / "b", "llama", extra, seed=1)
    code, _, err = run("align", a, b, "--stream", "--quiet", "-o", tmp_path / "out")
    assert code == 2 and "extra.weight" in err and "not in the model" in err, err


def test_save_model_refuses_to_drop_tensors_the_model_skips(tmp_path):
    """The Python API: a state loaded without the multi-token-prediction layers, written like its checkpoint."""
    folder = _deepseek_v3_with_mtp(tmp_path / "m", 0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(ModelLoadError, match="does not load"):
        save_model(model.state_dict(), tmp_path / "out", config=model.config, like=folder)
    assert not (tmp_path / "out").exists()
