"""Which motif names a group (specs/motifs.yaml ``classify``): the name decides what paper mode aligns, which
group ``--free-outputs`` and folding treat as the stream, and what a report says."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForMaskedLM, AutoModelForSequenceClassification

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census


def tiny(model_type: str, auto):
    config = AutoConfig.for_model(model_type, vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    return symgraph.load(auto.from_config(config).eval())


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_a_masked_lm_head_tied_to_the_embeddings_moves_with_the_residual_stream(model_type):
    """The prediction head (dense, GELU, LayerNorm, a decoder tied to the word embeddings) reads the stream and
    writes through the embeddings' own matrix, so its hidden units move with the stream, in one group. That group
    also holds an activation boundary and was named an FFN: paper mode aligned it as one, and nothing treated it
    as the stream."""
    subject = tiny(model_type, AutoModelForMaskedLM)
    assert census(subject)["residual permutation 16x1"] == 1, census(subject)
    stream = next(g for g in subject.report.groups if g.motif == "residual")
    assert any("decoder" in m.param or "lm_head" in m.param for m in stream.members)
    assert "ffn permutation 16x1" not in census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_classifier_keeps_its_stream_and_ffn_names():
    """Control: the pooler (dense, tanh) reads the stream too, but its units are its own: still an FFN."""
    found = census(tiny("bert", AutoModelForSequenceClassification))
    assert found["ffn permutation 32x1"] == 2 and found["ffn signed_permutation 16x1"] == 1, found
    assert sum(n for name, n in found.items() if name.startswith("residual ")) == 1, found
