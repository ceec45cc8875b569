"""Group-limited routing (DeepSeek-V3): a mask per routing group, broadcast to its experts, keeps the expert
permutation within each routing group (analysis/classes.py); scores ranked within each group (top-k over a
(groups, experts per group) view) keep it within the groups too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph
from symgraph.verify import Evaluator

from cli_runner import assert_fuzzed, report_json
from group_checks import assert_fuzzed_at_two_shapes, census
from test_config_variants import tiny


class GroupRouted(nn.Module):
    """Scores ranked inside the best of two routing groups of four (DeepSeek-V3's router, without experts).

    ``interleaved``: the mask of group g is laid on experts g, g + 2, ... instead of the ranked group's own four,
    so only experts in the same ranked group AND under the same mask entry may swap."""

    def __init__(self, interleaved: bool = False):
        super().__init__()
        self.router = nn.Linear(6, 8)
        self.interleaved = interleaved

    def forward(self, x):
        scores = self.router(x).view(-1, 8)
        group_scores = scores.view(-1, 2, 4).topk(2, dim=-1).values.sum(-1)
        mask = torch.zeros_like(group_scores).scatter(1, group_scores.topk(1, dim=-1).indices, 1.0)
        if self.interleaved:
            mask = mask.unsqueeze(1).expand(-1, 4, 2).reshape(-1, 8)
        else:
            mask = mask.unsqueeze(-1).expand(-1, 2, 4).reshape(-1, 8)
        return scores.masked_fill(~mask.bool(), float("-inf")).topk(2, dim=-1).values.sum(-1)


def _router_groups(subject) -> list[tuple[str, int, int]]:
    return sorted((g.kind, g.size, g.copies) for g in subject.report.groups
                  if any(m.param == "router.weight" and m.axis == 0 for m in g.members))


@pytest.mark.parametrize("interleaved, expected", [(False, [("permutation", 4, 2)]),
                                                   (True, [("permutation", 2, 4)])])
def test_router_rows_permute_only_where_the_group_mask_is_equal(interleaved, expected):
    torch.manual_seed(0)
    subject = symgraph.load(GroupRouted(interleaved), (torch.randn(5, 6),))
    assert _router_groups(subject) == expected
    assert_fuzzed_at_two_shapes(subject, samples=4)


def test_swapping_router_rows_across_mask_entries_changes_the_function():
    # what the interleaved mask forbids (rows 0 and 1: same ranked group, different mask entries) is no symmetry;
    # what it allows (rows 0 and 2) is one: the fuzz above is not vacuous
    torch.manual_seed(0)
    subject = symgraph.load(GroupRouted(interleaved=True), (torch.randn(9, 6),))
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs)
    state = subject.state_dict()

    def swapped(i, j):
        order = list(range(8))
        order[i], order[j] = j, i
        return {**state, "router.weight": state["router.weight"][order], "router.bias": state["router.bias"][order]}

    assert evaluator.check(swapped(0, 2)).ok
    assert not evaluator.check(swapped(0, 1)).ok


def _deepseek(n_group: int, experts: int, correction: torch.Tensor | None = None, model_type="deepseek_v3",
              **overrides):
    model = tiny(model_type, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=8, head_dim=8, num_key_value_heads=4, n_routed_experts=experts, num_experts_per_tok=2,
                 moe_intermediate_size=16, first_k_dense_replace=1, n_group=n_group, topk_group=1, **overrides)
    if correction is not None:
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(correction)
    return symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})


def _expert_groups(subject):
    return [g for g in subject.report.groups if g.motif == "experts"]


@pytest.mark.slow
@pytest.mark.parametrize("n_group, experts, size, copies", [(1, 4, 4, 1), (2, 8, 4, 2)])
def test_deepseek_v3_experts_permute_within_routing_groups(n_group, experts, size, copies):
    # the routing mask (expand then reshape of a per-group mask) pinned the router rows, so no expert group
    subject = _deepseek(n_group, experts)
    (group,) = _expert_groups(subject)
    assert (group.kind, group.size, group.copies) == ("permutation", size, copies)
    assert {m.param.rsplit(".", 1)[-1] for m in group.members} == {"gate_up_proj", "down_proj", "weight",
                                                                    "e_score_correction_bias"}
    assert census(subject)["heads permutation 4x1"] == 2
    assert_fuzzed_at_two_shapes(subject, samples=3)
    state = symgraph.transform(subject, seed=0)  # checked in float64 at several shapes before it returns
    assert not torch.equal(state["model.layers.1.mlp.gate.weight"], subject.state_dict()["model.layers.1.mlp.gate.weight"])


@pytest.mark.slow
def test_deepseek_v2_group_limited_greedy_keeps_experts_within_routing_groups():
    # its group scores are a max over each group's experts (max.dim had no spec: the router rows were pinned)
    subject = _deepseek(2, 8, model_type="deepseek_v2", topk_method="group_limited_greedy")
    (group,) = _expert_groups(subject)
    assert (group.kind, group.size, group.copies) == ("permutation", 4, 2)
    assert not subject.report.unknown_ops
    assert_fuzzed_at_two_shapes(subject, samples=3)
    symgraph.transform(subject, seed=0)  # checked in float64 at several shapes before it returns


def _swapped(state, i, j, moved_with_correction=True):
    names = [k for k in state if k.startswith(("model.layers.1.mlp.experts.", "model.layers.1.mlp.gate."))
             and (moved_with_correction or "correction" not in k)]
    order = list(range(len(state["model.layers.1.mlp.gate.weight"])))
    order[i], order[j] = j, i
    return {**state, **{k: state[k][order] for k in names}}


@pytest.mark.slow
def test_deepseek_v3_experts_swapped_across_routing_groups_change_the_function():
    subject = _deepseek(2, 8)
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs)
    state = subject.state_dict()
    assert evaluator.check(_swapped(state, 0, 1)).ok  # same routing group
    assert not evaluator.check(_swapped(state, 0, 4)).ok  # different routing groups
    # a correction large enough to decide the routing: it must move with its experts
    subject = _deepseek(2, 8, correction=torch.linspace(-0.5, 0.5, 8))
    evaluator = Evaluator(subject.model, subject.args, subject.kwargs)
    state = subject.state_dict()
    assert evaluator.check(_swapped(state, 4, 7)).ok
    assert not evaluator.check(_swapped(state, 4, 7, moved_with_correction=False)).ok


@pytest.mark.slow
def test_deepseek_v3_score_correction_moves_with_the_experts():
    # the correction bias is a saved buffer added to the router scores; read as data, a bias that differs between
    # experts pinned them (the sweep perturbs buffers, and trained checkpoints have one)
    subject = _deepseek(2, 8, correction=torch.linspace(-0.5, 0.5, 8))
    (group,) = _expert_groups(subject)
    assert (group.size, group.copies) == (4, 2)
    assert any(m.param.endswith("e_score_correction_bias") for m in group.members)
    assert_fuzzed_at_two_shapes(subject, samples=3)


FACTORY = '''
import torch
from test_moe_routing_groups import GroupRouted


def routed():
    torch.manual_seed(0)
    return GroupRouted(), (torch.randn(5, 6),)
'''


def test_cli_reports_and_fuzzes_group_limited_routing(tmp_path):
    path = tmp_path / "routing_factories.py"
    path.write_text(FACTORY)
    groups = report_json(f"{path}:routed")["groups"]
    assert [(g["kind"], g["size"]) for g in groups if any(m["param"] == "router.weight" for m in g["members"])] \
        == [("permutation", 4)]
    assert_fuzzed(f"{path}:routed", tmp_path)
