"""Selections by known indices (symgraph/analysis/selections.py): indices that are the same at every probe shape
select positions and leave the others unconstrained (Falcon's fused QKV, ``fused_qkv[..., [-2], :]``); indices
built from the input's shape, even when the trace bakes them in as constants, still pin what they skip."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from transformers import FalconConfig, FalconForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP

import symgraph
from symgraph import depth, zoo
from symgraph.analysis.selections import selections_of
from symgraph.probes import shape_summary

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

FALCON = dict(vocab_size=60, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
FALCON_VARIANTS = {
    "multi_query": dict(multi_query=True),  # one key and one value head: [..., [-2], :], [..., [-1], :]
    "new_decoder_architecture": dict(new_decoder_architecture=True, num_kv_heads=2),  # GQA, broadcast_to
}


def falcon(variant: str, **overrides):
    torch.manual_seed(0)
    model = noisy(FalconForCausalLM(FalconConfig(**{**FALCON, **FALCON_VARIANTS[variant], **overrides})), 0.02)
    return symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})


@pytest.fixture(scope="module", params=list(FALCON_VARIANTS))
def falcon_subject(request):
    return falcon(request.param)


def test_falcon_fused_qkv_gives_qk_vo_and_head_groups(falcon_subject):
    kinds = census(falcon_subject)
    assert sum(n for k, n in kinds.items() if k.startswith("qk ")) == 2, kinds  # one per layer
    assert sum(n for k, n in kinds.items() if k.startswith("vo ")) == 2, kinds
    assert any(k.startswith("heads permutation") for k in kinds), kinds
    for g in falcon_subject.report.groups:
        if g.motif in ("qk", "vo", "heads"):
            assert any(m.param.endswith("query_key_value.weight") for m in g.members), g.id
    assert not any(p.reason.startswith("not selected by indices") for p in falcon_subject.report.pinned)


def test_falcon_groups_are_invariant_in_float64_at_every_probe_shape(falcon_subject):
    assert_fuzzed_at_two_shapes(falcon_subject)


def _reversed_units(self, x):
    """A LLaMA MLP whose down projection reads its units through a constant index list (as Falcon read its key
    and query heads through ``fused_qkv[..., [-2], :]`` before transformers 5.25)."""
    units = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(units[..., list(range(units.shape[-1]))[::-1]])


def test_a_deep_model_reading_index_lists_keeps_its_selections_at_full_depth(monkeypatch, caplog):
    """The depth fast path's meta-device copy traces index lists as meta constants, whose values are lost: it
    declines (symgraph.depth), and the report of 5 blocks is the full-depth one, with every block's groups."""
    monkeypatch.setattr(LlamaMLP, "forward", _reversed_units)
    model = zoo.build("llama", num_hidden_layers=5)
    fast = symgraph.load(model, zoo.example_inputs_for("llama", model))
    slow = symgraph.load(model, fast.kwargs, full_depth=True)
    with caplog.at_level(logging.INFO, logger="symgraph.depth"):
        assert depth.analyse_by_repeats(fast) is None
    assert "tensor constants made while tracing the meta-device copy" in caplog.text
    assert fast.report.to_json() == slow.report.to_json()
    units = [g for g in fast.report.groups if g.motif == "ffn" and g.kind == "permutation"]
    assert sorted(m.param for g in units for m in g.members if m.param.endswith("down_proj.weight")) == [
        f"model.layers.{i}.mlp.down_proj.weight" for i in range(5)]


class FusedPicks(nn.Module):
    """One projection viewed as 3 blocks of 4 units, read through constant index lists: block 2 by one ReLU
    branch, blocks 0 and 1 by another (as Falcon reads its key head and its query heads)."""

    def __init__(self):
        super().__init__()
        self.up, self.first, self.rest = nn.Linear(8, 12), nn.Linear(4, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = self.up(x).view(*x.shape[:2], 3, 4)
        return self.first(torch.relu(h[:, :, [2]]).flatten(2)) + self.rest(torch.relu(h[:, :, [0, 1]]).flatten(2))


def test_constant_index_lists_are_fixed_selections_and_pin_nothing():
    torch.manual_seed(0)
    subject = symgraph.load(noisy(FusedPicks()), (torch.randn(2, 5, 8),))
    assert not any(p.reason.startswith("not selected by indices") for p in subject.report.pinned)
    assert not any("up.weight" in p.params and "linear" != p.node for p in subject.report.pinned)
    selections = selections_of(subject.capture)
    picks = [n for n in subject.capture.graph.nodes if n.target is torch.ops.aten.index.Tensor]
    assert len(picks) == 2
    for node in picks:
        indices = [a for a in node.args[1] if a is not None]
        assert selections.why_not_fixed(node, indices, frozenset({2})) is None
        assert selections.why_not_fixed(node, indices, frozenset({1})) is not None  # the length axis varies
    assert [shape_summary(p) for p in selections.probes()] == ["arg0 1x13x8", "arg0 3x3x8"]


class ShapeBuiltIndex(nn.Module):
    """Reads FFN units through indices Python builds from the input's length: ``torch.arange(n)`` (units
    0..n-1) or ``torch.tensor([n])`` (unit n). Both are constants in a graph traced at one shape."""

    def __init__(self, build):
        super().__init__()
        self.build = build
        self.up, self.down, self.side = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(1, 8)

    def forward(self, x):
        h = torch.relu(self.up(x))
        picked = h[..., self.build(x.shape[1])].sum(-1, keepdim=True)
        return self.down(h) + self.side(picked)


@pytest.mark.parametrize("build", [torch.arange, lambda n: torch.tensor([n])], ids=["arange", "tensor"])
def test_indices_built_from_the_input_shape_still_pin_what_they_skip(build):
    torch.manual_seed(0)
    subject = symgraph.load(noisy(ShapeBuiltIndex(build)), (torch.randn(2, 5, 8),))
    skipped = [p for p in subject.report.pinned if p.reason.startswith("not selected by indices")]
    assert skipped and all("their values differ at input shape" in p.reason for p in skipped)
    assert {"up.weight", "down.weight"} <= {q for p in skipped for q in p.params}
    assert_fuzzed_at_two_shapes(subject)


class InputValuedIndex(nn.Module):
    """Reads the FFN unit named by the first token id: the probes keep the original inputs as a prefix, so the
    value agrees at every probe shape, but it comes from the input."""

    def __init__(self):
        super().__init__()
        self.embed, self.up, self.down = nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, ids):
        h = torch.relu(self.up(self.embed(ids)))
        return self.down(h) + h[..., ids[:1, 0]]


def test_indices_computed_from_input_values_are_never_a_fixed_selection():
    torch.manual_seed(0)
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    subject = symgraph.load(noisy(InputValuedIndex()), (ids,))
    skipped = [p for p in subject.report.pinned if p.reason.startswith("not selected by indices")]
    assert skipped and all("computed from the model's inputs" in p.reason for p in skipped)
    assert_fuzzed_at_two_shapes(subject)


def test_selections_are_traced_once_per_capture():
    torch.manual_seed(0)
    subject = symgraph.load(noisy(FusedPicks()), (torch.randn(2, 5, 8),))
    assert selections_of(subject.capture) is selections_of(subject.capture)
