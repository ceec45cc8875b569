"""Convolutions: grouped and depthwise channels may only move as the group structure allows; every group found
is fuzzed in float64 at two input shapes (the traced one and a larger batch / image / sequence)."""
from __future__ import annotations


import pytest
import torch
from torch import nn

import symgraph
from symgraph.elements import apply
from symgraph.verify import Evaluator
from symgraph.zoo import _perturb

from group_checks import assert_fuzzed_at_two_shapes, census


def load(model: nn.Module, inputs) -> symgraph.api.Subject:
    """``model`` with every parameter perturbed (no bias exactly 0), loaded with ``inputs``."""
    model = model.eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return symgraph.load(model, inputs)


def grouped_then_dense():
    """The issue's stack: a Conv2d(groups=2) on the input, ReLU, a dense Conv2d."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2), nn.ReLU(), nn.Conv2d(8, 3, 1))
    return load(model, (torch.randn(2, 4, 6, 6),))


def test_grouped_conv_output_channels_stay_in_their_group():
    subject = grouped_then_dense()
    assert census(subject) == {"ffn permutation/positive 4x2": 1}  # one permutation per group, not one of 8
    (group,) = subject.report.groups
    rows = next(m for m in group.members if m.param == "0.weight").index[:, :, 0]
    assert sorted(map(tuple, rows // 4)) == [(0,) * 4, (1,) * 4]
    assert_fuzzed_at_two_shapes(subject)


def test_swapping_channels_across_groups_is_not_a_symmetry():
    """The element the engine used to emit: it changes the function, so the check above is not vacuous."""
    subject = grouped_then_dense()
    state = subject.state_dict()
    swapped = dict(state)
    perm = torch.tensor([4, 1, 2, 3, 0, 5, 6, 7])
    swapped["0.weight"], swapped["0.bias"] = state["0.weight"][perm], state["0.bias"][perm]
    swapped["2.weight"] = state["2.weight"][:, perm]
    assert not Evaluator(subject.model, subject.args).check(swapped).ok


def test_stacked_grouped_convs_tie_groups_and_keep_the_last_groups_apart():
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=2, padding=1),
                          nn.ReLU(), nn.Conv2d(8, 6, 1, groups=2), nn.ReLU(), nn.Conv2d(6, 3, 1))
    subject = load(model, (torch.randn(2, 4, 6, 6),))
    # inputs of a grouped conv: one permutation for all groups (each coordinate sits once in every group)
    assert census(subject) == {"ffn permutation/positive 4x1": 2, "ffn permutation/positive 3x2": 1}
    feeding = [g for g in subject.report.groups if g.copies == 1]
    assert all(m.index.shape == (1, 4, 2) for g in feeding for m in g.members if m.action == "primal")
    assert_fuzzed_at_two_shapes(subject)


def test_depthwise_conv_shares_one_permutation_with_its_input():
    model = nn.Sequential(nn.Conv2d(4, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=8, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 3, 1))
    subject = load(model, (torch.randn(2, 4, 6, 6),))
    assert census(subject) == {"ffn permutation/positive 8x1": 1}
    actions = {(m.param, m.axis): m.action for m in subject.report.groups[0].members}
    assert actions == {("0.weight", 0): "primal", ("0.bias", 0): "primal", ("2.weight", 0): "permute",
                       ("2.bias", 0): "primal", ("4.weight", 1): "dual"}
    assert_fuzzed_at_two_shapes(subject)


def test_same_padding_convs_use_the_same_rule():
    """``padding="same"`` traces to the ``conv*d.padding`` overloads: read through the schema like the others."""
    model = nn.Sequential(nn.Conv1d(3, 6, 3, padding="same"), nn.ReLU(), nn.Conv1d(6, 4, 3, padding="same", groups=2),
                          nn.ReLU(), nn.Conv1d(4, 2, 1))
    subject = load(model, (torch.randn(2, 3, 8),))
    assert census(subject) == {"ffn permutation/positive 3x1": 1, "ffn permutation/positive 2x2": 1}
    assert_fuzzed_at_two_shapes(subject)


def test_depthwise_conv_on_input_data_pins_its_kernel():
    model = nn.Sequential(nn.Conv2d(3, 3, 3, groups=3), nn.ReLU(), nn.Conv2d(3, 2, 1))
    subject = load(model, (torch.randn(2, 3, 5, 5),))
    assert subject.report.groups == ()
    assert any(p.reason == "depthwise kernel applied to input data" for p in subject.report.pinned)


def test_transposed_conv_reads_its_kernel_as_in_out():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.ConvTranspose2d(4, 6, 2, stride=2), nn.ReLU(),
                          nn.Conv2d(6, 2, 1))
    subject = load(model, (torch.randn(2, 3, 5, 5),))
    assert census(subject) == {"ffn permutation/positive 4x1": 1, "ffn permutation/positive 6x1": 1}
    kernel = {g.size: [(m.axis, m.action) for m in g.members if m.param == "2.weight"] for g in subject.report.groups}
    assert kernel == {4: [(0, "dual")], 6: [(1, "primal")]}
    assert_fuzzed_at_two_shapes(subject)


def test_grouped_transposed_conv_pins_its_channels():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(), nn.ConvTranspose2d(4, 6, 2, stride=2, groups=2), nn.ReLU(),
                          nn.Conv2d(6, 2, 1))
    subject = load(model, (torch.randn(2, 3, 5, 5),))
    assert subject.report.groups == ()
    assert any("grouped transposed convolution" in p.reason for p in subject.report.pinned)


def test_convnext_depthwise_blocks_keep_the_residual_permutation():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=2,
                            num_labels=3)
    subject = load(ConvNextForImageClassification(config), (torch.randn(2, 3, 16, 16),))
    found = census(subject)
    assert found["residual permutation 8x1"] == 1 and found["residual permutation 16x1"] == 1
    assert_fuzzed_at_two_shapes(subject, samples=4)


def squeezebert(layers: int, qkv_groups: int, post_attention_groups: int, output_groups: int):
    """A tiny SqueezeBERT classifier (4 heads, width 32) with these conv groups, loaded on its example inputs."""
    from transformers import SqueezeBertConfig, SqueezeBertForSequenceClassification

    from symgraph.inputs import example_inputs, forward_kwargs

    config = SqueezeBertConfig(vocab_size=100, hidden_size=32, embedding_size=32, num_hidden_layers=layers,
                               num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                               q_groups=qkv_groups, k_groups=qkv_groups, v_groups=qkv_groups,
                               post_attention_groups=post_attention_groups, intermediate_groups=4,
                               output_groups=output_groups, num_labels=3)
    inputs = ((), {**example_inputs(config), **forward_kwargs(config)})
    return load(SqueezeBertForSequenceClassification(config), inputs)


def test_squeezebert_grouped_conv1d_is_analysed_and_invariant():
    subject = squeezebert(layers=1, qkv_groups=2, post_attention_groups=2, output_groups=2)
    found = census(subject)
    assert found["qk orthogonal 8x4"] == 1 and found["ffn permutation 16x2"] == 1
    assert_fuzzed_at_two_shapes(subject, samples=4)


def test_squeezebert_heads_one_to_a_conv_group_are_not_permuted():
    """With as many query/key/value groups as heads (SqueezeBERT's default), head h reads only input group h: the
    engine emitted a permutation of the heads, which moves a head to another group's input (float64 error up to
    9e-3 in the sweep). The heads stay; each head's own QK and VO maps remain."""
    subject = squeezebert(layers=2, qkv_groups=4, post_attention_groups=1, output_groups=4)
    assert not [g for g in subject.report.groups if g.motif == "heads"]
    assert census(subject)["qk orthogonal 8x4"] == 2
    assert_fuzzed_at_two_shapes(subject, samples=4)


@pytest.mark.parametrize("seed", [0, 1])
def test_grouped_conv_groups_survive_random_elements(seed):
    """Sampled elements of every emitted group, applied together, keep the function at both shapes."""
    model = nn.Sequential(nn.Conv1d(4, 8, 1), nn.Tanh(), nn.Conv1d(8, 8, 3, groups=4, padding=1), nn.Tanh(),
                          nn.Conv1d(8, 3, 1))
    subject = load(model, (torch.randn(2, 4, 5),))
    assert census(subject) == {"ffn signed_permutation 2x1": 1, "ffn signed_permutation 2x4": 1}
    elements = symgraph.sample_elements(subject.report, seed=seed)
    evaluator = Evaluator(subject.model, subject.args)
    assert len(evaluator.probes) == 5 and evaluator.check(apply(subject.state_dict(), elements)).ok
