"""Config variants found by ``examples/sweep_architectures.py --variants`` (options flipped on top of a default
transformers config): each test is a tiny model of one variant that once went wrong."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import symgraph

from example_scripts import example_module
BASE = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, num_hidden_layers=2,
            vocab_size=60, pad_token_id=0, eos_token_id=1, bos_token_id=2)


def tiny(model_type: str, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**BASE, **overrides})).eval()
    with torch.no_grad():  # no weight exactly 0 or 1
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


@pytest.mark.slow
def test_long_context_rotary_leaves_no_fake_tensor_on_the_model():
    # longrope switches to its long factors past original_max_position_embeddings and caches them on the module
    # (self.long_inv_freq) while it runs; traced at a longer probe shape, that cache was a FakeTensor, and the
    # model could no longer be copied: transform crashed
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=6,
                short_factor=[1.0 + i / 4 for i in range(4)], long_factor=[1.0 + i / 2 for i in range(4)])
    model = tiny("phi3", rope_parameters=rope)
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    state = symgraph.transform(subject, seed=0)  # checked in float64 at several shapes before it returns
    assert state.keys() == subject.state_dict().keys()
    fakes = [f"{name}.{k}" for name, m in model.named_modules() for k, v in {**vars(m), **m._buffers}.items()
             if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor and not isinstance(v, torch.nn.Parameter)]
    assert not fakes


@pytest.fixture(scope="module")
def sweep():
    with example_module("sweep_architectures") as module:
        yield module


def test_dynamic_ntk_rotary_is_traced_with_the_frequencies_it_holds():
    """Dynamic NTK scaling recomputes the frequencies from the largest position's value on every call, a branch
    on data: export refused every such model ("could not trace ... dynamic_frequency_update"). Traced with the
    frequencies it holds below its context, the rotary groups hold past it too, where the frequencies change."""
    from group_checks import largest_change

    rope = dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)
    model = tiny("llama", rope_parameters=rope, max_position_embeddings=16)
    report = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False}).report
    assert {"qk", "heads"} <= {g.motif for g in report.groups}
    assert model.model.rotary_emb.rope_type == "dynamic", "the model is left as it was"
    run = lambda m, x: m(**x, use_cache=False).logits  # noqa: E731
    for length in (7, 40):  # 40: past the 16 positions, the frequencies rescaled (in float32: 1e-7 apart)
        ids = torch.randint(3, 60, (1, length), generator=torch.Generator().manual_seed(length))
        assert largest_change(model, report, {"input_ids": ids}, draws=1, run=run) < 1e-6


def test_every_variant_flips_an_option_its_config_has(sweep):
    # a config class accepts any keyword: a misspelt option would leave the default graph and look swept
    from transformers import CONFIG_MAPPING

    assert len(sweep.VARIANT_BY_NAME) == len(sweep.VARIANTS)  # names are unique: rows are keyed by them
    for variant in sweep.VARIANTS:
        config_class = CONFIG_MAPPING[variant[0]]
        fields = config_class().to_dict()
        code = inspect.getsource(importlib.import_module(config_class.__module__.replace(".configuration_",
                                                                                          ".modeling_")))
        unknown = {k for k in variant[1] if k not in fields and k not in (fields.get("rope_parameters") or {})
                   and k != "num_labels" and f"config.{k}" not in code and f'"{k}"' not in code}
        assert not unknown, (sweep.variant_name(variant), unknown)  # read with getattr(config, k, default) only


def test_rows_a_slice_cuts_after_a_dropout_are_pinned():
    # DeBERTa (v1) with relative attention reads rel_embeddings[16 - n : 16 + n] for length n, through a dropout
    # (identity in eval); the dropout counted as reading every row, so the 18 rows cut away at length 7 were left
    # free: a GL(18) on them changed the outputs at lengths 11 and 19 (relative error 5e-6 in the variants sweep)
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    config = AutoConfig.for_model("deberta", **{**BASE, "relative_attention": True, "pos_att_type": ["c2p", "p2c"],
                                                "max_relative_positions": 16, "type_vocab_size": 0})
    model = AutoModelForSequenceClassification.from_config(config).eval()
    report = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7))}).report
    on_rows = [g.id for g in report.groups for m in g.members
               if m.param == "deberta.encoder.rel_embeddings.weight" and m.axis == 0]
    assert not on_rows
    assert any("rel_embeddings" in p for p in report.parameters)


def test_a_tower_no_auto_class_builds_is_swept_through_its_own_model_class(sweep):
    # SigLIP's text tower: no Auto class maps SiglipTextConfig, so the sweep once skipped every such tower
    from transformers import SiglipTextConfig, SiglipTextModel

    assert sweep.own_model_class(SiglipTextConfig) is SiglipTextModel
    row = sweep.sweep_one("siglip_text_model")
    assert row["head"] == "SiglipTextModel" and row["class"] == "sound", row
    assert row["groups"] and row["max_error"] < row["tolerance"]


@pytest.mark.slow
def test_gemma3n_text_with_shared_key_value_layers_is_sound(sweep):
    # its last layers read earlier layers' keys and values (the plain shrink left more sharing layers than layers):
    # an attention group of a layer whose keys another layer reads must move that reader's queries too
    row = sweep.sweep_one("gemma3n_text")
    assert row["class"] == "sound", row
    assert row["groups"].get("vo/orthogonal") and row["max_error"] < row["tolerance"]
