"""Experts modules that loop over the experts a batch hits in their own forward (DBRX, a hand-written module with
identity experts laid out as LongCat-Flash's were before transformers 5.25), outside transformers' experts
interface, and mixture-of-experts modules that route to identity experts by index arithmetic (LongCat-Flash since
5.25): capture runs them densely through specs/experts.yaml, and every group found is sound."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import symgraph
from symgraph.capture import capture
from symgraph.fuzz import fuzz
from symgraph.spec import load_specs
from symgraph.moe import (DENSE, REFERENCE, experts_implementation, identity_routing_modules, layout_modules,
                          scaled_inputs_modules, sorted_tokens_modules)

from group_checks import assert_fuzzed_at_two_shapes, census, noisy


def tiny_dbrx(dtype=torch.float32):
    torch.manual_seed(0)
    config = AutoConfig.for_model("dbrx", d_model=32, n_heads=4, n_layers=2, vocab_size=60, max_seq_len=64,
                                  attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                  ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2))
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():  # no weight exactly 0 or 1
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def _logits(model, input_ids, name):
    with torch.no_grad(), experts_implementation(model, name):
        return model(input_ids=input_ids, use_cache=False).logits


def _assert_dense_is_reference(model, batch: int, seq: int) -> torch.Tensor:
    """The dense form's logits on random ids equal the model's own code's (relative 1e-12); the ids."""
    input_ids = torch.randint(3, 60, (batch, seq), generator=torch.Generator().manual_seed(batch))
    dense, reference = _logits(model, input_ids, DENSE), _logits(model, input_ids, REFERENCE)
    assert float((dense - reference).abs().max() / reference.abs().max()) < 1e-12
    return input_ids


def _noisy_lm(model_type: str, dtype, **config):
    """A causal LM of ``model_type`` from a tiny config, every parameter moved off its initialisation."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("batch,seq", [(2, 7), (3, 12)])
def test_dense_layout_computes_what_the_module_loop_computes(batch, seq):
    model = tiny_dbrx(torch.float64)
    assert len(layout_modules(model)) == 2  # one experts module per layer
    _assert_dense_is_reference(model, batch, seq)


def test_capture_traces_the_layout_densely_and_gives_the_module_its_loop_back():
    model = tiny_dbrx()
    cap = capture(model, (), {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    targets = {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}
    assert "aten.one_hot.default" in targets and not any("nonzero" in t for t in targets)
    assert all("forward" not in vars(m) for m, _ in layout_modules(model))


def test_dbrx_experts_units_permute_per_expert_and_every_group_is_sound():
    model = tiny_dbrx()
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    groups = subject.report.groups
    units = [g for g in groups if g.kind == "permutation" and {m.param.rsplit(".", 1)[-1] for m in g.members}
             == {"w1", "v1", "w2"}]
    assert len(units) == 2 and all(m.index.shape[:2] == (4, 16) for g in units for m in g.members)
    # the stream passes the experts' einsums beside their row blocks as values pass heads: still the stream
    assert [(g.kind, g.size) for g in groups if g.motif == "residual"] == [("permutation", 32)]
    assert not any(g.motif == "vo" and any(m.param.endswith("wte.weight") for m in g.members) for g in groups)
    assert fuzz(subject, samples=2, seed=1).ok


def test_dbrx_experts_permute_with_their_router_rows_and_their_units_are_ffn_units():
    """Experts stacked in one parameter's rows meet their down projection one expert at a time, as queries meet
    keys one head at a time; the routing weights summing the experts' outputs were pinned as data, so no expert
    permutation was found and each expert's units were named qk. Each routing weight weighs one expert's output:
    the experts permute with their router rows, and the units within each expert are FFN units."""
    subject = symgraph.load(tiny_dbrx(), {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [(g.kind, g.size, g.copies) for g in experts] == [("permutation", 4, 1)] * 2
    assert all({p.rsplit(".", 1)[-1] for p in g.params} == {"w1", "v1", "w2", "weight"} for g in experts)
    groups = census(subject)
    assert groups.get("ffn permutation 16x4") == 2 and groups.get("qk scale/sign 4x2") == 2, groups
    assert not any("router" in p for pin in subject.report.pinned for p in pin.params)
    assert_fuzzed_at_two_shapes(subject, samples=4)


class RowStackedExperts(nn.Module):
    """DBRX's experts by hand: w1, v1, w2 stacked as (experts * units, width) rows, every expert run on every
    token and the outputs summed with ``weights(self, tokens, out)`` (``einsum("ted,te->td")``)."""

    def __init__(self, weights, width=8, experts=4, units=6):
        super().__init__()
        self.shape, self.weights = (experts, units, width), weights
        self.inp, self.router, self.out = nn.Linear(width, width), nn.Linear(width, experts), nn.Linear(width, 3)
        self.w1, self.v1, self.w2 = (nn.Parameter(0.3 * torch.randn(experts * units, width)) for _ in range(3))

    def forward(self, x):
        tokens = self.inp(x).flatten(0, -2)
        w1, v1, w2 = (p.view(self.shape) for p in (self.w1, self.v1, self.w2))
        hidden = nn.functional.silu(torch.einsum("td,eud->teu", tokens, w1)) * torch.einsum("td,eud->teu", tokens, v1)
        out = torch.einsum("teu,eud->ted", hidden, w2)
        return self.out(torch.einsum("ted,te->td", out, self.weights(self, tokens, out)).view_as(x))


EXPERT_WEIGHTS = {  # name -> (the weights, whether the experts permute)
    "router": (lambda m, tokens, out: m.router(tokens).softmax(-1), True),
    "the experts' own outputs": (lambda m, tokens, out: out.sum(-1).softmax(-1), False),
}


@pytest.mark.parametrize("name", list(EXPERT_WEIGHTS))
def test_row_stacked_experts_weighed_by_a_router_or_their_own_outputs_are_sound(name):
    """A router's weights let the experts permute with its rows; weights computed from the experts' own outputs
    move with them anyway and carry no router rows: whatever is found must keep the function."""
    weights, permute = EXPERT_WEIGHTS[name]
    subject = symgraph.load(noisy(RowStackedExperts(weights)).double(), (torch.randn(2, 7, 8, dtype=torch.float64),))
    assert [g.size for g in subject.report.groups if g.motif == "experts"] == ([4] if permute else [])
    assert_fuzzed_at_two_shapes(subject)


class GatedHeads(nn.Module):
    """Attention whose values are the input itself (no coordinates: each head's values are data) and whose output
    is weighed unit by unit by a gate computed from the tokens (``einsum("bni,bni->bn")``)."""

    def __init__(self, width=16, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.gate = (nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in (self.q(x), self.k(x), x))
        out = ((q @ k.transpose(-1, -2)).softmax(-1) @ v).transpose(1, 2).flatten(2)
        return torch.einsum("bni,bni->bn", out, self.gate(x))


def test_a_gate_per_unit_of_each_heads_output_is_no_router():
    """The rule that links routing weights to their experts read a weight contracted with heads as one weight per
    head; a head here spans four units, each gated by its own weight, so the gate's rows were linked to the heads
    and every row linked to them (the queries' and keys') tagged an expert's units: the qk group became
    'other general_linear'. A weight only routes where each index it is contracted along holds a head of its own."""
    subject = symgraph.load(noisy(GatedHeads()).double(), (torch.randn(2, 7, 16, dtype=torch.float64),))
    assert sorted(census(subject)) == ["qk orthogonal 4x4", "qk scale/nonzero 1x4"], census(subject)
    assert_fuzzed_at_two_shapes(subject)


class LoopExpertsWithIdentity(nn.Module):
    """Routed experts in one (experts + identity, 2 units, hidden) gate/up parameter and identity experts after
    them, run by a loop over the experts the batch hits (layout fused_gate_up_identity)."""

    def __init__(self, routed=4, identity=2, hidden=16, units=8):
        super().__init__()
        self.num_routed_experts, self.zero_expert_num = routed, identity
        self.gate_up_proj = nn.Parameter(0.3 * torch.randn(routed + identity, 2 * units, hidden))
        self.down_proj = nn.Parameter(0.3 * torch.randn(routed, hidden, units))
        self.act_fn = nn.SiLU()

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_routed_experts + self.zero_expert_num):
            rows, slot = torch.where(top_k_index == e)
            weight = top_k_weights[rows, slot, None]
            if e >= self.num_routed_experts:
                out = out.index_add(0, rows, hidden_states[rows] * weight)
                continue
            gate, up = nn.functional.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out.index_add(0, rows, nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]) * weight)
        return out


class TinyIdentityMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.router, self.head = nn.Embedding(60, 16), nn.Linear(16, 6, bias=False), nn.Linear(16, 60)
        self.experts = LoopExpertsWithIdentity()

    def forward(self, ids):
        h = self.embed(ids).reshape(-1, 16)
        weights, picked = self.router(h).softmax(-1).topk(2, dim=-1)
        return self.head(h + self.experts(h, picked, weights))


def test_a_loop_with_identity_experts_runs_densely_with_the_same_function_and_sound_groups():
    torch.manual_seed(0)
    model = TinyIdentityMoE().double()
    ids = torch.randint(0, 60, (3, 9), generator=torch.Generator().manual_seed(1))
    assert [layout for _, layout in layout_modules(model)] == [load_specs().experts["fused_gate_up_identity"]]
    picked = model.router(model.embed(ids).reshape(-1, 16)).topk(2, dim=-1).indices
    assert len(picked.unique()) >= 5  # routed and identity experts both chosen
    with torch.no_grad():
        dense, reference = _outputs(model, ids, DENSE), _outputs(model, ids, REFERENCE)
    assert float((dense - reference).abs().max() / reference.abs().max()) < 1e-12
    subject = symgraph.load(model.float(), (ids,))
    experts = sorted(g.size for g in subject.report.groups if g.motif == "experts")
    assert experts == [2, 4], experts  # routed experts, and identity experts among themselves
    assert_fuzzed_at_two_shapes(subject, samples=3)


def _outputs(model, ids, name):
    with experts_implementation(model, name):
        return model(ids)


def tiny_longcat(dtype=torch.float32, identity=2):
    """LongCat-Flash: 4 routed experts and ``identity`` zero-computation ones (the token passed on), a score
    correction buffer that differs between experts, and a router spread enough that tokens pick different
    experts."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "longcat_flash", hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=60,
        max_position_embeddings=64, ffn_hidden_size=24, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, head_dim=4, v_head_dim=8, qk_head_dim=8, moe_topk=2, n_routed_experts=4,
        zero_expert_num=identity, expert_ffn_hidden_size=8, routed_scaling_factor=2.0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((2.0 if name.endswith("router.classifier.weight") else 0.02) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


@pytest.mark.parametrize("batch,seq", [(2, 7), (3, 12)])
def test_longcat_dense_routing_computes_what_its_own_forward_computes(batch, seq):
    model = tiny_longcat(torch.float64)
    assert len(identity_routing_modules(model)) == 2
    input_ids = _assert_dense_is_reference(model, batch, seq)
    # routed and identity experts are both chosen on these inputs, so the comparison covers them
    router = model.model.layers[0].mlp.router
    picked = router(model.model.embed_tokens(input_ids).reshape(-1, 32))[2]
    assert bool((picked >= 4).any()) and len(picked[picked < 4].unique()) >= 2


@pytest.mark.parametrize("identity", [2, 0])
def test_longcat_routed_and_identity_experts_permute_apart_and_every_group_is_sound(identity):
    model = tiny_longcat(identity=identity)
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    groups = [g for g in subject.report.groups if g.motif == "experts"]
    routed = [g for g in groups if g.size == 4]
    assert len(routed) == 2  # one per layer: weights, router rows and their score correction move together
    assert {m.param.rsplit(".", 1)[-1] for m in routed[0].members} == {
        "gate_up_proj", "down_proj", "weight", "e_score_correction_bias"}
    passing = [g for g in groups if g.size == identity]
    assert len(passing) == (2 if identity else 0)  # the identity experts permute among themselves only
    assert all({m.param.rsplit(".", 1)[-1] for m in g.members} == {"weight", "e_score_correction_bias"}
               for g in passing)
    assert_fuzzed_at_two_shapes(subject, samples=3)


def tiny_jetmoe(dtype=torch.float32):
    """JetMoE: a mixture of attention heads (each pick's query and output projections) and a mixture of GLU
    experts, both routing by sorting tokens per expert and splitting them by counts read with ``.tolist()``."""
    return _noisy_lm("jetmoe", dtype, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_key_value_heads=2,
                     kv_channels=8, num_local_experts=4, num_experts_per_tok=2, vocab_size=60, use_cache=False)


@pytest.mark.parametrize("batch,seq", [(2, 7), (3, 12)])
def test_jetmoe_dense_forms_compute_what_its_own_code_computes(batch, seq):
    model = tiny_jetmoe(torch.float64)
    assert sorted(layout.form for _, layout in sorted_tokens_modules(model)) == ["glu", "glu", "heads", "heads"]
    _assert_dense_is_reference(model, batch, seq)
    assert not any({"forward", "map", "reduce"} & set(vars(m)) for m in model.modules())


def test_jetmoe_experts_and_attention_experts_permute_with_their_router_rows_and_every_group_is_sound():
    model = tiny_jetmoe()
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    moved = sorted(sorted({m.param.split(".", 3)[-1].rsplit(".", 2)[-2] for m in g.members}) for g in experts)
    assert moved == 4 * [["input_linear", "layer", "output_linear"]] and all(g.size == 4 for g in experts)
    assert sorted(g.members[0].param.split(".")[3] for g in experts) == 2 * ["mlp"] + 2 * ["self_attention"]
    assert census(subject)["vo orthogonal 8x2"] == 2 and census(subject)["heads permutation 2x1"] == 2
    assert [g.motif for g in subject.report.groups].count("residual") == 1
    assert_fuzzed_at_two_shapes(subject, samples=3)


def tiny_llama4(dtype=torch.float32):
    """Llama 4's text model: every expert on every token scaled by its router score, the experts' inputs stacked
    along the rows, and a shared expert."""
    return _noisy_lm("llama4_text", dtype, hidden_size=32, intermediate_size=16, intermediate_size_mlp=24,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     num_local_experts=4, num_experts_per_tok=1, vocab_size=60, use_cache=False)


@pytest.mark.parametrize("batch,seq", [(2, 7), (3, 12)])
def test_llama4_dense_form_computes_what_its_own_code_computes(batch, seq):
    model = tiny_llama4(torch.float64)
    assert len(scaled_inputs_modules(model)) == 2
    _assert_dense_is_reference(model, batch, seq)
    assert not any("forward" in vars(m) for m in model.modules())


def test_llama4_experts_permute_with_their_router_rows_and_every_group_is_sound():
    model = tiny_llama4()
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [g.size for g in experts] == [4, 4]
    assert all({m.param.rsplit(".", 2)[-2:][-1] for m in g.members} == {"gate_up_proj", "down_proj", "weight"}
               for g in experts)
    assert_fuzzed_at_two_shapes(subject, samples=3)
