"""Bad checkpoints are refused, and written checkpoints reload exactly: nothing lost, nothing filled in at random.

Each command that reads a model must stop (exit 2, one paragraph naming the tensor, nothing written) on a
checkpoint that transformers would silently complete with random values; every written folder must reload with no
missing or unexpected key, whatever values its tensors hold.
"""
from __future__ import annotations

import pytest
import safetensors.torch
import torch
import transformers

from cli_runner import run, tree_digest
from symgraph import zoo
from symgraph.errors import ModelLoadError
from symgraph.io import load_model, model_config, save_model, state_dict_of

MODEL_COMMANDS = {  # every command that reads MODEL arguments, with the rest of its arguments
    "report": lambda m, o: ["report", m, "-o", o / "r.md"],
    "transform": lambda m, o: ["transform", m, "-o", o / "t"],
    "fuzz": lambda m, o: ["fuzz", m, "--samples", "1", "--json", o / "f.json"],
    "align": lambda m, o: ["align", m, m, "-o", o / "a"],
    "merge": lambda m, o: ["merge", m, m, "-o", o / "m"],
    "barrier": lambda m, o: ["barrier", m, m, "--data", "digits", "--limit", "4", "-o", o / "b.png"],
}


def _saved(family: str, folder, **edits):
    """A zoo model saved by transformers itself; ``edits`` rewrite its stored tensors (None deletes one)."""
    model = zoo.build(family)
    model.save_pretrained(folder)
    file = folder / "model.safetensors"
    stored = safetensors.torch.load_file(file)
    for key, value in edits.items():
        key = key.replace("__", ".")
        if value is None:
            del stored[key]
        else:
            stored[key] = value(stored.get(key))
    safetensors.torch.save_file(stored, file, metadata={"format": "pt"})
    return folder


def _only_output(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name != "model")


@pytest.mark.parametrize("problem, edits, words", [
    ("missing", dict(classifier__bias=None), ["classifier.bias", "missing", "random"]),
    ("unexpected", dict(extra__weight=lambda _: torch.ones(2)), ["extra.weight", "not in the model"]),
    ("integer", dict(classifier__weight=lambda t: (t * 100).to(torch.int64)), ["classifier.weight", "I64"]),
    ("nan", dict(bert__pooler__dense__bias=lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
     ["NaN or Inf", "bert.pooler.dense.bias"]),
])
def test_bad_checkpoint_is_refused_by_the_loader(tmp_path, problem, edits, words):
    folder = _saved("bert", tmp_path / "model", **edits)
    with pytest.raises(ModelLoadError) as info:
        load_model(folder)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("command", sorted(MODEL_COMMANDS))
def test_every_command_refuses_a_checkpoint_with_a_missing_tensor(tmp_path, command):
    folder = _saved("bert", tmp_path / "model", classifier__bias=None)
    before = tree_digest(folder)
    code, out, err = run(*MODEL_COMMANDS[command](folder, tmp_path))
    assert code == 2 and "classifier.bias" in err and "missing" in err and "Traceback" not in err, err
    assert _only_output(tmp_path) == [] and tree_digest(folder) == before


def _equal_valued(model: torch.nn.Module) -> torch.nn.Module:
    """Zero every attention projection bias and make every norm the identity (weights 1, biases 0): many tensors
    equal by value (to each other and across layers), none tied."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner, _, leaf = name.rpartition(".")
            owner = owner.rpartition(".")[2].lower()
            if leaf == "bias" and owner in ("q_proj", "k_proj", "v_proj", "query", "key", "value", "q_lin",
                                            "k_lin", "v_lin", "c_attn", "q", "k", "v"):
                param.zero_()
            elif "norm" in owner or owner.startswith("ln"):
                param.fill_(1.0 if leaf == "weight" else 0.0)
    return model


@pytest.mark.parametrize("family", zoo.HF_FAMILIES)
def test_saved_folder_matches_save_pretrained_and_reloads_whole(tmp_path, family):
    model = _equal_valued(zoo.build(family))
    state = state_dict_of(model)
    out = save_model(state, tmp_path / "ours", config=model_config(model))
    model.save_pretrained(tmp_path / "theirs")
    ours = safetensors.torch.load_file(out / "model.safetensors")
    assert ours.keys() == safetensors.torch.load_file(tmp_path / "theirs" / "model.safetensors").keys()

    cls = getattr(transformers, model_config(model).architectures[0])
    again, info = cls.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    reloaded = again.state_dict()
    for key, value in state.items():
        assert torch.equal(reloaded[key], value), key


def test_tied_tensors_that_differ_are_refused(tmp_path):
    model = zoo.build("llama-tied")
    state = {k: v.clone() for k, v in state_dict_of(model).items()}
    state["lm_head.weight"] += 1.0
    with pytest.raises(Exception, match="ties 'lm_head.weight' to 'model.embed_tokens.weight'"):
        save_model(state, tmp_path / "out", config=model_config(model))
    assert not (tmp_path / "out").exists()


def _dinov2(folder):
    """A DINOv2 checkpoint as transformers 5 writes it: legacy key names (attention.attention.key, loaded as
    attention.k_proj), with every q/k/v bias zero."""
    torch.manual_seed(0)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=64, image_size=16, patch_size=4)
    model = transformers.Dinov2Model(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.zero_()
    model.save_pretrained(folder)
    return model


def test_transform_of_a_legacy_named_checkpoint_keeps_every_tensor(tmp_path):
    model = _dinov2(tmp_path / "dino")
    stored = safetensors.torch.load_file(tmp_path / "dino" / "model.safetensors")
    assert "encoder.layer.0.attention.attention.key.bias" in stored  # the legacy name is what is on disk
    code, out, err = run("transform", tmp_path / "dino", "-o", tmp_path / "t")
    assert code == 0, err
    written = safetensors.torch.load_file(tmp_path / "t" / "model.safetensors")
    assert written.keys() == stored.keys()
    assert all(torch.count_nonzero(written[k]) == 0 for k in stored if k.endswith(("query.bias", "key.bias")))
    again, info = transformers.Dinov2Model.from_pretrained(tmp_path / "t", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"]), info
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(again(pixels).last_hidden_state, model(pixels).last_hidden_state,
                                   rtol=1e-4, atol=1e-5)
