"""Learned tokens joined to the residual stream along the sequence (registers, as DINOv2 with registers inserts
them after the class token): the stream keeps its group. Each form is fuzzed in float64 at two input shapes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph
from symgraph.analysis import Walker
from symgraph.analysis.labels import Value
from symgraph.capture import capture

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D = 8


class Registers(nn.Module):
    """Patch embedding, a class token, two register tokens joined ``where``, one residual FFN block, a head."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where
        self.embed = nn.Linear(3, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.registers = nn.Parameter(torch.randn(1, 2, D))
        self.up, self.down, self.head = nn.Linear(D, 16), nn.Linear(16, D), nn.Linear(D, 2)

    def forward(self, x):
        h = self.embed(x)
        cls, registers = self.cls.expand(len(h), -1, -1), self.registers.expand(len(h), -1, -1)
        h = torch.cat([cls, h], 1)
        h = {"after the class token": lambda: torch.cat([h[:, :1], registers, h[:, 1:]], 1),
             "at the end": lambda: torch.cat([h, registers], 1),
             "in front": lambda: torch.cat([registers, h], 1)}[self.where]()
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h[:, 0])


@pytest.mark.parametrize("where", ["after the class token", "at the end", "in front"])
def test_register_tokens_keep_the_residual_stream(where):
    """The joined tensor carries the stream's coordinates on its rows and the registers' own columns (and their
    axis) on theirs. Two faults lost the stream: the stream's coordinates repeat on more rows than the registers'
    do, which read as a cut off a flattened channel's boundary; and the residual sum paired the stream with the
    registers' axis, the first channel along a shared axis, instead of the update's columns."""
    torch.manual_seed(0)
    subject = symgraph.load(noisy(Registers(where)).double(), (torch.randn(2, 5, 3, dtype=torch.float64),))
    assert census(subject)["residual general_linear 8x1"] == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_dinov2_with_registers_keeps_its_residual_stream():
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersForImageClassification

    config = Dinov2WithRegistersConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=32, image_size=8, patch_size=4, num_register_tokens=2,
                                       num_labels=3)
    torch.manual_seed(0)
    model = noisy(Dinov2WithRegistersForImageClassification(config))
    subject = symgraph.load(model)
    assert census(subject)["residual permutation 16x1"] == 1, census(subject)


class GroupTokens(nn.Module):
    """GroupViT's layout: learned group tokens joined after the patches, mixed along their own axis (a linear
    across the tokens: their axis is a space), then cut off again before ``blocks`` residual FFN blocks."""

    def __init__(self, blocks: int):
        super().__init__()
        self.embed = nn.Linear(3, D)
        self.groups = nn.Parameter(torch.randn(1, 3, D))
        self.mix = nn.Linear(3, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, D)) for _ in range(blocks))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = torch.cat([self.embed(x), self.mix(self.groups.transpose(1, 2)).transpose(1, 2).expand(len(x), -1, -1)], 1)
        h = h + self.blocks[0](h)
        h = h[:, :-3]
        for block in self.blocks[1:]:
            h = h + block(h)
        return self.head(h)


def test_a_cut_leaves_no_empty_channels_behind():
    """The patches cut from the joined stream kept the group tokens' own axis as a channel without any id; nothing
    pairs with it, so each residual sum carried both operands' copies on: 2**blocks channels (GroupViT's analysis
    went from 7 s to over 4 minutes)."""
    torch.manual_seed(0)
    model = noisy(GroupTokens(blocks=8)).double()
    walker = Walker(capture(model, (torch.randn(2, 5, 3, dtype=torch.float64),))).run()
    assert max(len(v.chans) for v in walker.values.values() if isinstance(v, Value)) <= 4
    subject = symgraph.load(model, (torch.randn(2, 5, 3, dtype=torch.float64),))
    assert census(subject)["residual permutation 8x1"] == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Vit(nn.Module):
    """timm's layout: a class token and two registers joined in front of the patches by one cat, a pre-LN block
    with ``attention`` (nn.MultiheadAttention, or written out), a final norm, a head reading ``pool``."""

    def __init__(self, attention: str, pool: str):
        super().__init__()
        self.attention, self.pool = attention, pool
        self.embed = nn.Linear(3, D)
        self.cls, self.registers = nn.Parameter(torch.randn(1, 1, D)), nn.Parameter(torch.randn(1, 2, D))
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.mha = nn.MultiheadAttention(D, 2, batch_first=True)
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.up, self.down, self.head = nn.Linear(D, 16), nn.Linear(16, D), nn.Linear(D, 2)

    def attend(self, a):
        if self.attention == "nn.MultiheadAttention":
            return self.mha(a, a, a, need_weights=False)[0]
        b, n, _ = a.shape
        q, k, v = (f(a).view(b, n, 2, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.o((torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v).transpose(1, 2).reshape(b, n, D))

    def forward(self, x):
        h = self.embed(x)
        h = torch.cat([self.cls.expand(len(h), -1, -1), self.registers.expand(len(h), -1, -1), h], 1)
        h = h + self.attend(self.ln1(h))
        h = h + self.down(torch.relu(self.up(self.ln2(h))))
        h = self.lnf(h)
        return self.head(h[:, 0] if self.pool == "class token" else h.mean(1))


@pytest.mark.parametrize("attention, pool", [("nn.MultiheadAttention", "mean")])
def test_vit_with_registers_keeps_the_residual_stream(attention, pool):
    """A norm gave the class token's, the registers' and the patches' coordinates new ids from one range, so the
    registers' (two rows) and the patches' (five) repeating differently along the sequence read, at
    MultiheadAttention's transpose, as a cut off a flattened channel: the stream was pinned."""
    torch.manual_seed(0)
    model = noisy(Vit(attention, pool)).double().eval()
    subject = symgraph.load(model, (torch.randn(2, 5, 3, dtype=torch.float64),))
    assert census(subject)["residual permutation 8x1"] == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)
