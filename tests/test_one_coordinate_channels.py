"""Channels that label one coordinate at every position (a row picked out of a parameter: Funnel's token-type
embedding split into its two types) pass through every layer. Each sum used to keep both operands' copies and
each attention's query-key product two more, so their number multiplied with depth: a three-layer Funnel's walk
carried 15,077 channels on one value and took over a minute, the sweep's twelve-layer one over fifteen. Then
their products, powers of each other, still doubled them with every layer (105 at three layers, 989 at six): the
token types are now pinned where data chooses between them, products of pinned coordinates share one pinned id,
and a value keeps one copy of each pinned coordinate's channel."""
from __future__ import annotations

import importlib

import torch
import transformers
from transformers import AutoConfig

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

walk = importlib.import_module("symgraph.analysis.walk").walk  # the package exports the function by the same name


def funnel(layers: int):
    config = AutoConfig.for_model("funnel", vocab_size=100, d_model=32, n_head=4, d_head=8, d_inner=64,
                                  block_sizes=[layers], num_decoder_layers=1)
    torch.manual_seed(0)
    return noisy(transformers.AutoModelForMaskedLM.from_config(config), scale=0.02)


def widest_value(layers: int) -> int:
    subject = symgraph.load(funnel(layers))
    return max(len(v.chans) for v in walk(subject.capture).values.values() if hasattr(v, "chans"))


def test_channels_of_one_coordinate_do_not_multiply_with_depth():
    three, six = widest_value(3), widest_value(6)
    assert three < 40, three  # 18 now; 105 with products of powers, 15,077 when every layer multiplied them
    assert six < three + 30, (three, six)  # 30: a few more a layer (989 when products of powers doubled them)


class ChosenByType(torch.nn.Module):
    """Funnel's token-type bias in small: a score per type, and data choosing one of the two per pair of tokens."""

    def __init__(self):
        super().__init__()
        self.types = torch.nn.Parameter(torch.randn(2, 8))
        self.proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def forward(self, x, token_types):
        h = self.proj(x)
        diff, same = torch.einsum("bnd,td->bnt", h, self.types).split(1, dim=-1)
        chosen = torch.where(token_types[:, :, None] == token_types[:, None, :], same, diff)
        return self.out(torch.softmax(chosen, -1) @ h)


def test_coordinates_chosen_per_position_by_data_are_pinned_there():
    x = torch.randn(2, 5, 8)
    subject = symgraph.load(ChosenByType(), inputs=(x, torch.tensor([[0, 0, 1, 1, 1], [0, 1, 0, 1, 1]])))
    walked = walk(subject.capture)
    at_where = {int(i) for ids, reason, node in walked.c.pins if reason.startswith("chosen at some positions")
                for i in ids}
    assert at_where == set(walked.param_ids["types"][0].tolist())  # both types, at the where, not the output
    moved = {(m.param, m.axis) for g in subject.report.groups for m in g.members}
    assert ("types", 1) in moved and ("types", 0) not in moved  # the map of h's coordinates moves the type scores


def test_a_deeper_funnel_keeps_its_groups_and_they_are_sound():
    subject = symgraph.load(funnel(3))
    kinds = {(g.motif, g.kind) for g in subject.report.groups}
    assert {("residual", "permutation"), ("ffn", "permutation"), ("vo", "orthogonal")} <= kinds
    assert_fuzzed_at_two_shapes(subject, samples=2)
