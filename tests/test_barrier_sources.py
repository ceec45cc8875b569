"""examples/barrier_sources.py: which family each parameter is mixed with (the study's rows)."""
from __future__ import annotations

import pytest

from example_scripts import example_module


@pytest.fixture(scope="module")
def sources():
    with example_module("barrier_sources") as module:
        yield module


@pytest.mark.parametrize("name, expected", [
    ("vit.layers.0.attention.q_proj.weight", "L0.attn"),
    ("vit.layers.2.mlp.fc1.bias", "L2.mlp"),
    ("vit.layers.1.layernorm_before.weight", "L1.norm"),
    ("vit.embeddings.position_embeddings", "embed"),
    ("vit.layernorm.weight", "head"),
    ("classifier.weight", "head"),
    ("model.layers.3.self_attn.o_proj.weight", "L3.attn"),
    ("model.layers.3.post_attention_layernorm.weight", "L3.norm"),
    ("model.norm.weight", "head"),
    ("lm_head.weight", "head"),
    ("model.embed_tokens.weight", "embed"),
    ("bert.encoder.layer.1.attention.output.LayerNorm.weight", "L1.norm"),
    ("bert.encoder.layer.1.output.dense.weight", "L1.mlp"),
    ("bert.pooler.dense.weight", "head"),
    ("bert.embeddings.LayerNorm.bias", "embed"),
])
def test_every_parameter_lands_in_its_family(sources, name, expected):
    assert sources.family(name, None) == expected


def test_split_prefix_mixes_one_module_at_a_time(sources):
    assert sources.family("vit.layers.0.attention.k_proj.weight", "vit.layers.0") == "vit.layers.0.attention.k_proj"
    assert sources.family("vit.layers.1.attention.k_proj.weight", "vit.layers.0") == "L1.attn"
