"""Mixtures of experts: the dense capture form against transformers' own loop, the expert permutation (router rows
move with the experts), rules that follow routed indices or pin, and the command line end to end on a MoE pair.

Per-family expected groups and fuzzing live in test_architectures.py; exact recovery by align in test_align.py.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import symgraph
from symgraph import zoo
from symgraph.capture import capture
from symgraph.elements import apply, identity
from symgraph.fuzz import fuzz
from symgraph.moe import DENSE, REFERENCE, experts_implementation, experts_modules
from symgraph.verify import Evaluator

from cli_runner import run, tree_digest

MOE = ("mixtral", "qwen2-moe", "olmoe", "deepseek-v2", "gpt-oss")


def _logits(model, kwargs, name):
    with torch.no_grad(), experts_implementation(model, name):
        return model(**kwargs).logits


@pytest.mark.parametrize("family", MOE)
@pytest.mark.parametrize("batch,seq", [(2, 7), (3, 12)])
def test_dense_experts_compute_what_the_reference_loop_computes(family, batch, seq):
    model = zoo.build(family, dtype=torch.float64)
    _, kwargs = zoo.example_inputs_for(family, model, batch=batch, seq=seq, seed=batch)
    dense, reference = _logits(model, kwargs, DENSE), _logits(model, kwargs, REFERENCE)
    assert float((dense - reference).abs().max() / reference.abs().max()) < 1e-12


@pytest.mark.parametrize("routine", ["grouped_mm", "batched_mm", "eager"])
def test_capture_traces_dense_experts_whatever_the_model_runs_and_restores_it(routine):
    model = zoo.build("mixtral")
    _, kwargs = zoo.example_inputs_for("mixtral", model)
    with experts_implementation(model, routine):
        cap = capture(model, (), kwargs)
        assert all(m.config._experts_implementation == routine for m in experts_modules(model))
    targets = {str(n.target) for n in cap.graph.nodes if n.op == "call_function"}
    assert "aten.one_hot.default" in targets and "aten.topk.default" in targets
    assert not any("grouped_mm" in t or "nonzero" in t for t in targets)


@pytest.mark.parametrize("family,router", [("mixtral", {"gate.weight"}),
                                           ("gpt-oss", {"router.weight", "router.bias"})])
def test_expert_permutation_moves_router_rows_and_every_expert_tensor(family, router, zoo_subject):
    subject = zoo_subject(family)
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert len(experts) == subject.config.num_hidden_layers
    for g in experts:
        expert_tensors = {n for n, _ in subject.model.named_parameters() if n.startswith(f"{g.layer}.experts.")}
        assert {m.param for m in g.members} == expert_tensors | {f"{g.layer}.{r}" for r in router}
        assert all(m.axis == 0 for m in g.members)
        assert g.kind == "permutation" and g.size == subject.config.num_local_experts and g.scale is None
    inside = [g for g in subject.report.groups if g.motif == "ffn" and ".experts." in g.members[0].param]
    assert inside and all(any("each expert's units" in n for n in g.notes) for g in inside)


def test_moving_the_experts_without_their_router_rows_changes_the_function(zoo_subject):
    """The check the expert group passes is not vacuous: leave the router rows behind and the output moves."""
    subject = zoo_subject("mixtral")
    group = next(g for g in subject.report.groups if g.motif == "experts")
    element = identity(group)
    element.perm[0] = np.array([1, 0, 3, 2])
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs)
    state = subject.state_dict()
    assert evaluator.check(apply(state, [element])).ok
    without_router = type(group)(**{**group.__dict__, "members": tuple(
        m for m in group.members if not m.param.endswith("gate.weight"))})
    moved = apply(state, [type(element)(without_router, perm=element.perm, diag=element.diag)])
    assert evaluator.check(moved).relative_error > 1e-3


class _Routed(torch.nn.Module):
    """A router whose top-k indices pick expert weights by indexing (the ``batched_mm`` layout) or through a
    one-hot wider than the router: neither follows the expert axis, so nothing may permute it."""

    def __init__(self, wide: bool):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8))
        self.wide = wide

    def forward(self, x):
        weights, index = torch.topk(self.router(x), 2, dim=-1)
        if self.wide:
            routing = torch.nn.functional.one_hot(index, 5)[..., :4].to(x.dtype)
            return torch.einsum("tkeo,tk->to", torch.einsum("tke,eod->tkeo", routing, self.experts), weights)
        picked = self.experts[index]  # (tokens, k, out, in)
        return torch.einsum("tko,tk->to", torch.einsum("tkod,td->tko", picked, x), weights)


@pytest.mark.parametrize("wide", [False, True])
def test_indices_that_are_not_followed_pin_the_expert_axis(wide):
    model = _Routed(wide)
    report = symgraph.analyze(model, inputs=(torch.randn(5, 8),))
    for g in report.groups:
        assert not any(m.param in ("router.weight", "router.bias", "experts") and m.axis == 0 for m in g.members), \
            g.id
    reasons = " ".join(p.reason for p in report.pinned if "router.weight" in p.params)
    assert "indices" in reasons or "routed" in reasons, reasons


def test_top_k_allows_permutations_only():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), _TopKSum())
    report = symgraph.analyze(model, inputs=(torch.randn(4, 6),))
    (group,) = report.groups
    assert (group.kind, group.scale, group.size) == ("permutation", None, 5)
    assert fuzz(symgraph.load(model, (torch.randn(4, 6),)), samples=3).ok


class _TopKSum(torch.nn.Module):
    def forward(self, x):
        return torch.topk(x, 2, dim=-1).values.sum(-1)


# -- command line, end to end on a saved MoE pair ----------------------------------------------------------------
@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixtral") / "a"
    zoo.build("mixtral", seed=0).save_pretrained(folder)
    return folder


def test_cli_reports_fuzzes_aligns_and_merges_a_moe_pair(moe_folder, tmp_path):
    digest = tree_digest(moe_folder)
    res = run("report", moe_folder, "--format", "json")
    assert res.returncode == 0, res.stderr
    groups = json.loads(res.stdout)["groups"]
    assert sum(g["motif"] == "experts" for g in groups) == 2
    assert run("fuzz", moe_folder, "--samples", "2").returncode == 0
    moved, aligned, merged = tmp_path / "moved", tmp_path / "aligned", tmp_path / "merged"
    assert run("transform", moe_folder, "-o", moved, "--seed", "5").returncode == 0
    res = run("align", moved, moe_folder, "-o", aligned)
    assert res.returncode == 0, res.stderr
    anchor, back = symgraph.load(moe_folder).state_dict(), symgraph.load(aligned).state_dict()
    assert max(float((back[k] - anchor[k]).abs().max()) for k in anchor) < 1e-5
    res = run("merge", moe_folder, moved, "-o", merged, "--no-progress")
    assert res.returncode == 0, res.stderr
    subject = symgraph.load(moe_folder)
    merged_state = symgraph.load(merged).state_dict()
    assert Evaluator(subject.model, subject.args, subject.kwargs).check(merged_state).relative_error < 1e-5
    assert tree_digest(moe_folder) == digest  # inputs are never modified


class _PickedByRouterScore(torch.nn.Module):
    """Rows of a table picked by an index computed from routing values: the values do not move with any group,
    but the analysis does not know them, so the rows they pick cannot be labelled."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.table = torch.nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        chosen = (torch.topk(self.router(x), 2, dim=-1).values.sum(-1) > 0).long()
        return self.table[chosen] * x


def test_rows_picked_by_unknown_indices_are_pinned():
    report = symgraph.analyze(_PickedByRouterScore(), inputs=(torch.randn(5, 8),))
    assert not any(m.param == "table" and m.axis == 0 for g in report.groups for m in g.members)
    assert any("table" in p.params and "indices" in p.reason for p in report.pinned)


def test_routing_weights_cast_like_the_activations_stay_invariant():
    """GraniteMoE's router returns ``softmax(top_k_logits).type_as(hidden_states)``: the cast must not turn the
    weights into an unknown value (that pinned the router and hid the expert permutation)."""
    config = AutoConfig.for_model("granitemoe", vocab_size=100, hidden_size=32, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  num_local_experts=4, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1,
                                  eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    subject = symgraph.load(model)
    (experts,) = [g for g in subject.report.groups if g.motif == "experts"]
    assert any(m.param.endswith("router.weight") for m in experts.members)
    assert fuzz(subject, samples=2, seed=1).ok


def test_two_independent_moe_models_merge_closer_once_aligned(zoo_subject):
    from symgraph.merging import merge

    other = zoo.build("mixtral", seed=1)
    pair = [zoo_subject("mixtral"), symgraph.load(other, zoo.example_inputs_for("mixtral", other))]
    aligned = merge(pair, method="simple", progress=False)
    assert max(aligned.distances) < min(aligned.distances_before)
    assert set(aligned.state) == set(pair[0].state_dict())


class _Unsorted(torch.nn.Module):
    """``topk(sorted=False)`` returns its k results in an order that depends on the router rows' order: summing
    over them is blind to it, taking the first one is not."""

    def __init__(self, first_only: bool):
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.experts = torch.nn.Parameter(torch.randn(4, 8, 8))
        self.first_only = first_only

    def forward(self, x):
        weights, index = torch.topk(self.router(x), 2, dim=-1, sorted=False)
        if self.first_only:
            weights, index = weights[:, :1], index[:, :1]
        routing = (torch.nn.functional.one_hot(index, 4).to(x.dtype) * weights.unsqueeze(-1)).sum(-2)
        return torch.einsum("teo,te->to", torch.einsum("eod,td->teo", self.experts, x), routing)


@pytest.mark.parametrize("first_only", [False, True])
def test_unsorted_top_k_is_followed_only_by_order_blind_consumers(first_only):
    model, x = _Unsorted(first_only), torch.randn(6, 8)
    subject = symgraph.load(model, (x,))
    moves_router = any(m.param == "router.weight" for g in subject.report.groups for m in g.members)
    assert moves_router is not first_only
    assert fuzz(subject, samples=3, seed=2).ok


def test_phimoe_sparsemixer_picks_keep_the_experts_permutation():
    """PhiMoE picks its second expert after masking the first with ``scores.scatter(-1, first, -inf)`` and
    concatenates the two picks' indices: both follow the router's rows, so the experts still permute with them."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("phimoe", hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                  vocab_size=60, use_cache=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [g.size for g in experts] == [4, 4]
    assert all({m.param.rsplit(".", 1)[-1] for m in g.members} == {"gate_up_proj", "down_proj", "weight"}
               for g in experts)
    result = fuzz(subject, samples=3)
    assert result.ok and len(set(result.shapes)) >= 2, [v.counterexample for v in result.failures]
