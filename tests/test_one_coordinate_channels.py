"""Channels that label one coordinate at every position (a row picked out of a parameter: Funnel's token-type
embedding split into its two types) pass through every layer. Each sum used to keep both operands' copies and
each attention's query-key product two more, so their number multiplied with depth: a three-layer Funnel's walk
carried 15,077 channels on one value and took over a minute, the sweep's twelve-layer one over fifteen."""
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


def test_channels_of_one_coordinate_do_not_multiply_with_depth():
    subject = symgraph.load(funnel(3))
    widest = max(len(v.chans) for v in walk(subject.capture).values.values() if hasattr(v, "chans"))
    assert widest < 200, widest  # 105 now, 15,077 when every layer multiplied them


def test_a_deeper_funnel_keeps_its_groups_and_they_are_sound():
    subject = symgraph.load(funnel(3))
    kinds = {(g.motif, g.kind) for g in subject.report.groups}
    assert {("residual", "permutation"), ("ffn", "permutation"), ("vo", "orthogonal")} <= kinds
    assert_fuzzed_at_two_shapes(subject, samples=2)
