"""Every zoo family builds, exports with torch.export (non-strict), matches eager, and runs in float64."""
from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch.utils._pytree import tree_leaves

from symgraph import zoo
from symgraph.errors import ModelLoadError
from symgraph.inputs import example_inputs, forward_kwargs


def _tensors(output) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)]


@functools.lru_cache(maxsize=None)
def _built(family: str):
    model = zoo.build(family)
    args, kwargs = zoo.example_inputs_for(family, model)
    with torch.no_grad():
        output = model(*args, **kwargs)
    return model, args, kwargs, output


@functools.lru_cache(maxsize=None)
def _exported(family: str) -> torch.export.ExportedProgram:
    model, args, kwargs, _ = _built(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(model, args, kwargs, strict=False)


def test_families_are_unique_and_cover_the_brief():
    assert len(set(zoo.FAMILIES)) == len(zoo.FAMILIES)
    assert {"llama", "llama-tied", "gptj", "clip", "t5", "torch-mha"} <= set(zoo.FAMILIES)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_builds_in_eval_mode_with_logits(family):
    model, _, _, output = _built(family)
    assert not model.training
    assert _tensors(output) and all(torch.isfinite(t).all() for t in _tensors(output))
    if family == "clip":
        assert tuple(output.logits_per_image.shape) == (2, 2)
    elif family in zoo.HF_FAMILIES:
        assert output.logits.shape[-1] in (3, 100)  # classifier with 3 labels, or LM head over the vocabulary


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_no_parameter_is_constant(family):
    model = _built(family)[0]
    for name, param in model.named_parameters():
        assert param.numel() < 2 or param.std() > 0, name
        assert not torch.all(param == 1) and not torch.all(param == 0), name


@pytest.mark.parametrize("family", ["llama", "bert", "torch-relu-mlp"])
def test_weights_are_deterministic_in_seed(family):
    a, b, c = zoo.build(family, seed=3), zoo.build(family, seed=3), zoo.build(family, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_build_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    zoo.build("torch-mha")
    assert torch.equal(torch.rand(3), before)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_exports(family):
    program = _exported(family)
    targets = {node.target for node in program.graph.nodes if node.op == "call_function"}
    assert targets, "empty graph"
    assert program.graph_signature.parameters


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_exported_program_matches_eager(family):
    _, args, kwargs, output = _built(family)
    expected = _tensors(output)
    with torch.no_grad():
        got = _tensors(_exported(family).module()(*args, **kwargs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", zoo.FAMILIES)
def test_runs_in_float64(family):
    model = zoo.build(family, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    args, kwargs = zoo.example_inputs_for(family, model)
    with torch.no_grad():
        got = _tensors(model(*args, **kwargs))
    floats = [t for t in got if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float64 for t in floats)
    for g, e in zip(got, _tensors(_built(family)[3])):  # same seed, same function: float32 agrees to its precision
        torch.testing.assert_close(g, e.to(g.dtype), rtol=1e-4, atol=1e-4)


def test_llama_tied_ties_and_llama_does_not():
    tied, untied = zoo.build("llama-tied"), zoo.build("llama")
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_tiny_config_overrides_and_unknown_family():
    assert zoo.tiny_config("qwen3", num_hidden_layers=1).num_hidden_layers == 1
    with pytest.raises(ModelLoadError, match="llama"):
        zoo.tiny_config("no-such-family")
    with pytest.raises(ModelLoadError):
        zoo.tiny_config("torch-mha")


# ---- symgraph.inputs on configs outside the zoo ------------------------------------------------------------


def test_inputs_on_meta_device_have_shapes_and_dtypes():
    inputs = example_inputs(zoo.tiny_config("clip"), device="meta", dtype=torch.float16, batch=3, seq=5)
    assert {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in inputs.items()} == {
        "input_ids": ((3, 5), torch.int64, "meta"),
        "pixel_values": ((3, 3, 16, 16), torch.float16, "meta"),
    }


def test_inputs_avoid_special_tokens_and_are_seeded():
    config = zoo.tiny_config("bart")
    a, b = example_inputs(config, seed=5), example_inputs(config, seed=5)
    assert set(a) == {"input_ids", "decoder_input_ids"}
    assert all(torch.equal(a[k], b[k]) for k in a)
    special = {config.pad_token_id, config.bos_token_id, config.eos_token_id}
    assert not set(a["input_ids"].flatten().tolist()) & special
    assert (a["decoder_input_ids"][:, 0] == config.decoder_start_token_id).all()
    assert forward_kwargs(config) == {"return_dict": True, "use_cache": False}
    assert "use_cache" not in forward_kwargs(zoo.tiny_config("vit"))
    assert example_inputs(config, attention_mask=True)["attention_mask"].eq(1).all()


def test_inputs_for_whisper_like_and_wav2vec_like_configs():
    from transformers import AutoConfig, AutoModel

    whisper = AutoConfig.for_model(
        "whisper", vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=1, bos_token_id=2, eos_token_id=2, decoder_start_token_id=3)
    wav2vec = AutoConfig.for_model(
        "wav2vec2", vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2)
    w_inputs, v_inputs = example_inputs(whisper), example_inputs(wav2vec)
    assert tuple(w_inputs["input_features"].shape) == (2, 8, 32)
    assert tuple(v_inputs["input_values"].shape) == (2, 80)
    with torch.no_grad():
        hidden = AutoModel.from_config(whisper).eval()(**w_inputs, **forward_kwargs(whisper)).last_hidden_state
        frames = AutoModel.from_config(wav2vec).eval()(**v_inputs, **forward_kwargs(wav2vec)).last_hidden_state
    assert tuple(hidden.shape) == (2, 7, 32) and tuple(frames.shape) == (2, 7, 32)
