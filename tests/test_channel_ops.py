"""Batch norm (eval), pooling and squared activations: the groups DESIGN section 3 gives them, each fuzzed in
float64 at two input shapes, and the elements just outside them shown to break the function."""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.verify import Evaluator
from symgraph.zoo import _perturb

from group_checks import assert_fuzzed_at_two_shapes, census


def load(model: nn.Module, inputs, seed: int = 0):
    """``model`` with perturbed parameters and non-trivial running statistics, loaded with ``inputs``."""
    model = model.eval()
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    generator = torch.Generator().manual_seed(seed + 2)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.copy_(torch.randn(module.running_mean.shape, generator=generator))
            module.running_var.uniform_(0.5, 2.0, generator=generator)
    return symgraph.load(model, inputs)


def conv_bn(activation: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), activation, nn.Conv2d(6, 2, 1))


def test_batch_norm_statistics_move_with_the_channel():
    subject = load(conv_bn(nn.ReLU()), (torch.randn(2, 3, 6, 6),))
    assert census(subject) == {"ffn permutation 6x1": 1, "ffn scale/positive 6x1": 1}
    perm = next(g for g in subject.report.groups if g.kind == "permutation")
    actions = {m.param: m.action for m in perm.members}
    assert actions == {"0.weight": "primal", "0.bias": "primal", "1.running_mean": "primal",
                       "1.running_var": "permute", "1.weight": "permute", "1.bias": "primal", "3.weight": "dual"}
    scale = next(g for g in subject.report.groups if g.kind == "scale")  # the norm's output scale
    assert {m.param for m in scale.members} == {"1.weight", "1.bias", "3.weight"}
    assert_fuzzed_at_two_shapes(subject, samples=6)


def test_batch_norm_passes_sign_flips_to_an_odd_activation():
    subject = load(conv_bn(nn.Tanh()), (torch.randn(2, 3, 6, 6),))
    assert census(subject) == {"ffn signed_permutation 6x1": 1}
    assert_fuzzed_at_two_shapes(subject, samples=6)


def test_scaling_a_batch_norm_input_channel_breaks_it():
    """x -> 2x with mean -> 2 mean, var -> 4 var is exact only without eps: the input may not scale."""
    subject = load(conv_bn(nn.ReLU()), (torch.randn(2, 3, 6, 6),))
    state = subject.state_dict()
    scaled = dict(state)
    for name, power in [("0.weight", 1), ("0.bias", 1), ("1.running_mean", 1), ("1.running_var", 2)]:
        scaled[name] = state[name].clone()
        scaled[name][0] *= 0.01 ** power
    assert not Evaluator(subject.model, subject.args).check(scaled).ok


def test_resnet_blocks_keep_their_channel_groups_and_align_back():
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=3)
    inputs = ((torch.randn(2, 3, 32, 32),), {})
    torch.manual_seed(0)
    subject = load(ResNetForImageClassification(config), inputs)
    assert census(subject) == {"ffn permutation 8x1": 2, "ffn permutation 16x1": 2, "ffn scale/positive 8x1": 2,
                               "ffn scale/positive 16x1": 2}
    assert not subject.report.unknown_ops  # batch norm, max pool and adaptive average pool are all described
    assert_fuzzed_at_two_shapes(subject, samples=4)
    moved = ResNetForImageClassification(config).eval()
    moved.load_state_dict(symgraph.transform(subject, seed=3))
    result = symgraph.align(symgraph.load(moved, inputs), subject)
    assert result.distance_before > 0.1 and result.distance_after < 1e-6


@pytest.mark.parametrize("pool", [nn.MaxPool2d(2), nn.AvgPool2d(2), nn.AdaptiveAvgPool2d(1),
                                  nn.Upsample(scale_factor=2, mode="bilinear"), nn.Upsample(scale_factor=2)])
def test_pooling_and_upsampling_keep_channel_ids(pool):
    model = nn.Sequential(nn.Conv2d(3, 6, 1), nn.ReLU(), pool, nn.Conv2d(6, 2, 1))
    subject = load(model, (torch.randn(2, 3, 6, 6),))
    assert census(subject) == {"ffn permutation/positive 6x1": 1}
    assert_fuzzed_at_two_shapes(subject, samples=6)


class SquaredReLU(nn.Module):
    def __init__(self, square):
        super().__init__()
        self.up, self.down, self.square = nn.Linear(8, 16), nn.Linear(16, 4), square

    def forward(self, x):
        return self.down(self.square(torch.relu(self.up(x))))


SQUARES = {"square": torch.square, "pow": lambda h: h ** 2, "product": lambda h: h * h}


@pytest.mark.parametrize("how", sorted(SQUARES))
def test_relu_squared_scales_c_in_and_one_over_c_squared_out(how):
    subject = load(SquaredReLU(SQUARES[how]), (torch.randn(2, 5, 8),))
    assert census(subject) == {"ffn permutation 16x1": 1, "ffn scale/positive 16x1": 1}
    scale = next(g for g in subject.report.groups if g.kind == "scale")
    assert {(m.param, m.action, m.exponent) for m in scale.members} == {
        ("up.weight", "primal", 1), ("up.bias", "primal", 1), ("down.weight", "dual", 2)}
    assert_fuzzed_at_two_shapes(subject, samples=6)


def test_relu_squared_with_one_over_c_out_breaks_it():
    """The element the engine used to emit for ``h ** 2`` (a ReLU's scale): it changes the function."""
    subject = load(SquaredReLU(SQUARES["pow"]), (torch.randn(2, 5, 8),))
    state = subject.state_dict()
    scaled = dict(state, **{"up.weight": state["up.weight"] * 2.0, "up.bias": state["up.bias"] * 2.0,
                            "down.weight": state["down.weight"] / 2.0})
    assert not Evaluator(subject.model, subject.args).check(scaled).ok


@pytest.mark.parametrize("how", sorted(SQUARES))
def test_relu_squared_alignment_counts_the_output_side_and_never_moves_farther(how):
    """The scale solve used to fit the input side alone and then divide the output side by d^2: the scale
    group's distance grew fivefold (3.08 -> 16.5) and the aligned model ended farther from the anchor than it began
    (1.39 -> 6.09)."""
    torch.manual_seed(0)
    inputs = (torch.randn(2, 5, 8),)
    anchor, source = (load(SquaredReLU(SQUARES[how]).double(), inputs, seed) for seed in (0, 5))
    result = symgraph.align(source, anchor, refine_rounds=0, matching_start=False)
    scales = [s for s in result.stats if s.kind == "scale"]
    assert scales and all(s.after <= s.before for s in scales)
    assert result.distance_after < result.distance_before


CNN_FACTORY = '''
import torch
import torch.nn.functional as F
from torch import nn


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 8, 3, groups=8, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    for bn in (model[1], model[5]):
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    return model.eval(), (torch.randn(2, 3, 10, 10),)
'''


def test_cli_reports_and_fuzzes_a_cnn_with_batch_norm_and_depthwise_conv(tmp_path):
    from cli_runner import report_json, run

    factory = tmp_path / "cnn.py"
    factory.write_text(CNN_FACTORY)
    report = report_json(f"{factory}:cnn")
    members = {m["param"] for g in report["groups"] for m in g["members"]}
    assert {"1.running_mean", "1.running_var", "4.weight", "5.running_mean"} <= members
    assert not report["summary"]["unknown_ops"]
    res = run("fuzz", f"{factory}:cnn", "--samples", "4")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all groups invariant" in res.stdout and "arg0 2x3x10x10 | arg0 1x3x23x23 | arg0 3x3x6x6" in res.stdout


class SharedNorm(nn.Module):
    """One batch norm applied after two convolutions: its statistics tie both channel sets together."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(3, 6, 1), nn.Conv2d(6, 6, 1), nn.Conv2d(6, 2, 1)
        self.norm = nn.BatchNorm2d(6)

    def forward(self, x):
        h = torch.relu(self.norm(self.a(x)))
        return self.c(torch.relu(self.norm(self.b(h))))


def test_a_batch_norm_read_twice_moves_its_statistics_once():
    subject = load(SharedNorm(), (torch.randn(2, 3, 5, 5),))
    members = [(m.param, m.action) for g in subject.report.groups for m in g.members]
    assert members.count(("norm.running_mean", "primal")) == 1 and members.count(("norm.running_var", "permute")) == 1
    assert_fuzzed_at_two_shapes(subject, samples=6)


class Padded(nn.Module):
    """conv -> ReLU -> pad -> conv; ``pad`` as for ``F.pad`` (a third pair pads the channel axis)."""

    def __init__(self, pad: tuple[int, ...], value: float = 0.0, mode: str = "constant"):
        super().__init__()
        new_channels = sum(pad[4:6])
        self.a, self.b = nn.Conv2d(3, 6, 1), nn.Conv2d(6 + new_channels, 2, 3)
        self.pad, self.value, self.mode = pad, value, mode

    def forward(self, x):
        h = torch.relu(self.a(x))
        value = self.value if self.mode == "constant" else None
        return self.b(nn.functional.pad(h, self.pad, mode=self.mode, value=value))


@pytest.mark.parametrize("padded, expected", [
    (Padded((1, 1, 1, 1)), {"ffn permutation/positive 6x1": 1}),  # zeros: any channel map keeps them
    (Padded((1, 1, 1, 1), mode="reflect"), {"ffn permutation/positive 6x1": 1}),  # copies within a channel
    (Padded((1, 1, 1, 1), value=1.0), {"ffn permutation 6x1": 1}),  # the same 1 in every channel: no scale
    (Padded((0, 0, 0, 0, 1, 1)), {"ffn permutation/positive 6x1": 1}),  # new channels hold no coordinate
    (Padded((0, 0, 0, 0, 1, 1), value=1.0), {"ffn permutation/positive 6x1": 1}),  # as cat([h, ones], 1)
    (Padded((0, 0, 0, 0, 0, -1)), {}),  # a crop of the channel axis: pinned
])
def test_padding_keeps_channels_it_does_not_pad(padded, expected):
    subject = load(padded, (torch.randn(2, 3, 5, 5),))
    assert census(subject) == expected
    assert_fuzzed_at_two_shapes(subject, samples=6)


class PaddedUnits(nn.Module):
    """``F.pad(inp(x), (0, 4)) + g(x)`` (``join``: ``cat([inp(x), zeros], -1) + g(x)``), then an FFN on the
    stream."""

    def __init__(self, join: str):
        super().__init__()
        self.join = join
        self.inp, self.g, self.out = nn.Linear(8, 6), nn.Linear(8, 10), nn.Linear(10, 3)
        self.a, self.b = nn.Linear(10, 12), nn.Linear(12, 10)

    def forward(self, x):
        h = self.inp(x)
        h = {"pad": lambda: F.pad(h, (0, 4)), "cat": lambda: torch.cat([h, h.new_zeros(*h.shape[:-1], 4)], -1),
             "replicate": lambda: F.pad(h, (0, 4), mode="replicate"),
             "reflection op": lambda: torch.ops.aten.reflection_pad1d(h, [0, 4])}[self.join]() + self.g(x)
        return self.out(h + self.b(torch.relu(self.a(h))))


@pytest.mark.parametrize("join, stream", [("pad", 1), ("cat", 1), ("replicate", 0), ("reflection op", 0)])
def test_zero_padded_units_keep_the_stream_as_a_concatenation_does(join, stream):
    """Positions a constant pad adds along the units hold no coordinate, as a piece of zeros joined by ``cat``;
    a pad that copies units into them (replicate, reflect) pins."""
    subject = load(PaddedUnits(join), (torch.randn(2, 4, 8),))
    groups = census(subject)
    assert groups.get("residual general_linear 6x1", 0) == stream, groups
    assert_fuzzed_at_two_shapes(subject)


def test_scaling_channels_padded_with_ones_breaks_it():
    subject = load(Padded((1, 1, 1, 1), value=1.0), (torch.randn(2, 3, 5, 5),))
    state = subject.state_dict()
    scaled = dict(state, **{"a.weight": state["a.weight"] * 2.0, "a.bias": state["a.bias"] * 2.0,
                            "b.weight": state["b.weight"] / 2.0})
    assert not Evaluator(subject.model, subject.args).check(scaled).ok
