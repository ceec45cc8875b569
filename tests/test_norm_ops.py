"""torch's own norm ops on hand-written models (examples/sweep_handwritten.py's wider net): ``nn.RMSNorm``
(``aten.rms_norm``), ``nn.GroupNorm`` (``aten.group_norm``) and ``nn.InstanceNorm2d`` (``aten.instance_norm``) had no
spec, so each pinned every channel it normalised: an LLM written with nn.RMSNorm lost its residual stream and
every scale it trades with the next linears, and a conv net normalised by group or instance norms after every conv
had no group at all. RMSNorm is a LayerNorm that does not centre; a group norm normalises each group of channels
like a LayerNorm over the group's channels and positions; an instance norm each channel over its positions."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

WIDTH = 16



class RMSNormMLP(nn.Module):
    """Two pre-norm MLP blocks on a residual stream, torch's nn.RMSNorm before each and before the head."""

    def __init__(self, affine: bool = True):
        super().__init__()
        self.inp = nn.Linear(4, WIDTH)
        self.norms = nn.ModuleList(nn.RMSNorm(WIDTH, elementwise_affine=affine) for _ in range(3))
        self.ups = nn.ModuleList(nn.Linear(WIDTH, 32) for _ in range(2))
        self.downs = nn.ModuleList(nn.Linear(32, WIDTH) for _ in range(2))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = self.inp(x)
        for norm, up, down in zip(self.norms, self.ups, self.downs):
            x = x + down(torch.nn.functional.gelu(up(norm(x))))
        return self.head(self.norms[2](x))


@pytest.mark.parametrize("affine", [True, False])
def test_torch_rms_norm_keeps_the_residual_stream(affine):
    subject = symgraph.load(noisy(RMSNormMLP(affine)), (torch.randn(2, 5, 4),))
    assert not subject.report.unknown_ops
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert residual and residual[0].kind == ("signed_permutation" if affine else "orthogonal")  # RMS(Q x) = Q RMS(x)
    assert any(g.motif == "scale_free" for g in subject.report.groups) == affine
    assert_fuzzed_at_two_shapes(subject)


class NormedConvs(nn.Module):
    """conv -> norm -> ReLU, twice, then a mean-pooled linear head; ``norm(channels)`` builds each norm."""

    def __init__(self, norm):
        super().__init__()
        self.c1, self.n1 = nn.Conv2d(3, 8, 3, padding=1), norm(8)
        self.c2, self.n2 = nn.Conv2d(8, 8, 3, padding=1), norm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = torch.relu(self.n1(self.c1(x)))
        return self.head(torch.relu(self.n2(self.c2(x))).mean((2, 3)))


NORMS = {"group_norm": lambda c: nn.GroupNorm(2, c), "group_norm_per_channel": lambda c: nn.GroupNorm(c, c),
         "instance_norm": lambda c: nn.InstanceNorm2d(c, affine=True)}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_conv_nets_normalised_by_group_or_instance_norms_keep_channel_permutations(norm):
    subject = symgraph.load(noisy(NormedConvs(NORMS[norm])), (torch.randn(2, 3, 6, 6),))
    assert not subject.report.unknown_ops
    ffn = [g for g in subject.report.groups if g.motif == "ffn" and g.kind == "permutation"]
    assert ffn, [p.reason for p in subject.report.pinned]
    assert_fuzzed_at_two_shapes(subject)


def test_a_group_norm_keeps_channels_inside_their_group():
    subject = symgraph.load(noisy(NormedConvs(NORMS["group_norm"])), (torch.randn(2, 3, 6, 6),))
    for g in subject.report.groups:
        for m in g.members:
            if m.param == "c1.weight" and m.axis == 0:
                blocks = m.index.reshape(g.copies, -1)
                assert all(len({int(i) // 4 for i in block}) == 1 for block in blocks)  # 2 groups of 4 channels
    # swapping two channels of different groups changes the function; within a group it does not
    model, x = subject.model.double(), torch.randn(2, 3, 7, 7, dtype=torch.float64)
    for a, b, changes in ((0, 5, True), (0, 1, False)):
        swapped = NormedConvs(NORMS["group_norm"]).double().eval()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        perm = torch.arange(8)
        perm[[a, b]] = perm[[b, a]]
        for k in ("c1.weight", "c1.bias", "n1.weight", "n1.bias"):
            state[k] = state[k][perm]
        state["c2.weight"] = state["c2.weight"][:, perm]
        swapped.load_state_dict(state)
        with torch.no_grad():
            assert (not torch.allclose(swapped(x), model(x), rtol=1e-9, atol=1e-12)) == changes
