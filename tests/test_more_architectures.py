"""Architectures no issue names: every emitted group must still preserve the function (soundness first), and a
few structural facts must hold (ALiBi blocks head permutations, shared layers give shared groups, MQA shares
one value transform, fused projections are split by the graph)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import symgraph
from symgraph.elements import apply, sample
from symgraph.verify import Evaluator

BASE = dict(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2, vocab_size=60,
            pad_token_id=0, eos_token_id=1, bos_token_id=2)
FAMILIES = {
    "phi3": ("phi3", dict(num_key_value_heads=2), AutoModelForCausalLM),  # fused qkv_proj and gate_up_proj
    "albert": ("albert", dict(embedding_size=16), AutoModelForSequenceClassification),  # one layer, shared
    "gemma": ("gemma", dict(num_key_value_heads=1, head_dim=8), AutoModelForCausalLM),  # MQA, (1 + w) norms
    "falcon": ("falcon", dict(), AutoModelForCausalLM),
    "bloom": ("bloom", dict(n_head=4, n_layer=2), AutoModelForCausalLM),  # ALiBi
    "gpt_bigcode": ("gpt_bigcode", dict(n_embd=32, n_head=4, n_layer=2, multi_query=True), AutoModelForCausalLM),
    "electra": ("electra", dict(embedding_size=16), AutoModelForSequenceClassification),
    "gemma2": ("gemma2", dict(num_key_value_heads=2, head_dim=8), AutoModelForCausalLM),  # logit softcapping
    # its RMSNorm casts the weight before the product (weight.to(float32) * x): the report's fold note crashed on it
    "helium": ("helium", dict(num_key_value_heads=2, head_dim=8), AutoModelForCausalLM),
}


def build(family):
    model_type, extra, cls = FAMILIES[family]
    torch.manual_seed(0)
    model = cls.from_config(AutoConfig.for_model(model_type, **{**BASE, **extra})).eval()
    with torch.no_grad():  # no weight exactly 0 or 1
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    inputs = {"input_ids": torch.randint(3, 60, (2, 7))}
    if getattr(model.config, "use_cache", None) is not None:
        inputs["use_cache"] = False
    return symgraph.load(model, inputs)


@pytest.fixture(scope="module")
def subjects():
    return {family: build(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_group_preserves_the_function(family, subjects):
    subject = subjects[family]
    report = subject.report
    assert report.groups and not report.unknown_ops
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs)
    rng = np.random.default_rng(0)
    elements = [sample(g, rng) for g in report.groups]
    for element in elements:
        assert evaluator.check(apply(evaluator.state, [element])).ok, element.group.id
    assert evaluator.check(apply(evaluator.state, elements)).ok


def kinds(subject):
    return collections.Counter(f"{g.motif}/{g.kind}" for g in subject.report.groups)


def test_alibi_blocks_head_permutations(subjects):
    assert kinds(subjects["bloom"])["heads/permutation"] == 0
    assert kinds(subjects["bloom"])["qk/orthogonal"] == 2


def test_shared_layers_give_one_group_for_all_of_them(subjects):
    assert kinds(subjects["albert"])["qk/orthogonal"] == 1  # ALBERT: 2 layers, one set of weights


@pytest.mark.parametrize("family", ["gemma", "gpt_bigcode"])
def test_multi_query_attention_shares_one_value_transform(family, subjects):
    vo = [g for g in subjects[family].report.groups if g.motif == "vo"]
    assert vo and all(g.copies == 1 for g in vo)
    for g in vo:  # the one value head's transform acts on the output columns of all 4 query heads
        assert max(m.index.shape[2] for m in g.members) == 4


def test_fused_projections_are_split_by_the_graph(subjects):
    groups = subjects["phi3"].report.groups
    rotary = [g for g in groups if g.kind == "rotary"]
    assert rotary and all(any("qkv_proj" in m.param for m in g.members) for g in rotary)
    ffn = [g for g in groups if g.motif == "ffn" and g.kind == "permutation"]
    assert ffn and all(any("gate_up_proj" in m.param for m in g.members) for g in ffn)
    scales = [g for g in groups if g.motif == "ffn" and g.kind == "scale"]
    assert len(scales) == 2  # SwiGLU's up/down scale survives the fusion: the up half of the rows only
    for g in scales:
        rows = next(m for m in g.members if m.param.endswith("gate_up_proj.weight"))
        assert rows.action == "primal" and sorted(rows.index.ravel().tolist()) == list(range(64, 128))


@pytest.mark.parametrize("family", FAMILIES)
def test_alignment_undoes_a_random_group_element_exactly(family, subjects):
    from symgraph.alignment import align_states

    subject = subjects[family]
    anchor = {k: v.detach().double() for k, v in subject.state_dict().items()}
    source = apply(anchor, [sample(g, np.random.default_rng(7)) for g in subject.report.groups])
    result = align_states(subject.report.groups, source, anchor, mode="full")
    assert result.distance_before > 0.5
    assert max(float((result.state[k] - v).norm() / v.norm().clamp_min(1e-30))
               for k, v in anchor.items() if v.is_floating_point()) < 1e-6
