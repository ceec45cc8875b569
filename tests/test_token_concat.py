"""Learned tokens concatenated to activations along the token axis (GroupViT's group tokens, found by the type sweep).

``cat([x, tokens], 1)`` joins activations whose coordinates lie on axis 2 with a parameter labelled on both its token
axis (1) and its coordinate axis (2). The movement rule replayed the operands' channels by position in their lists,
so x's coordinates travelled with the parameter's *token* channel: the residual stream's class took in the token
axis (and the token mixer's input columns), and its sign flip changed the outputs (GroupViT: relative 1.7e-1 in
float64). Channels are now paired by the axes they vary along.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

WIDTH, PATCH = 16, 8


class TokenMixer(nn.Module):
    """An MLP over the token axis (GroupViT's mixer): the coordinates pass through as a batch axis."""

    def __init__(self, tokens: int, hidden: int, out: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(tokens, hidden), nn.Linear(hidden, out)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x.transpose(1, 2)))).transpose(1, 2)


class GroupTokens(nn.Module):
    def __init__(self, tokens: int):
        super().__init__()
        self.tokens = tokens
        self.embed = nn.Linear(PATCH, WIDTH)
        self.group_token = nn.Parameter(torch.zeros(1, tokens, WIDTH))
        self.norm, self.mix = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)
        self.norm_tokens, self.mixer, self.norm_post = nn.LayerNorm(WIDTH), TokenMixer(tokens, 16, 4), \
            nn.LayerNorm(WIDTH)
        self.head, self.head_x = nn.Linear(WIDTH, 3), nn.Linear(WIDTH, 3)

    def forward(self, patches):
        x = self.embed(patches)
        both = torch.cat([x, self.group_token.expand(x.shape[0], -1, -1)], 1)
        both = both + self.mix(self.norm(both))
        x, groups = both[:, :-self.tokens], both[:, -self.tokens:]
        groups = self.norm_post(self.mixer(self.norm_tokens(groups)))
        return self.head(groups.mean(1)) + self.head_x(x.mean(1))


@pytest.mark.parametrize("tokens", [6, WIDTH])  # as many tokens as coordinates: sizes cannot tell the axes apart
def test_coordinates_concatenated_with_learned_tokens_keep_their_own_axis(tokens):
    subject = symgraph.load(noisy(GroupTokens(tokens)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    token_axis = [(g.id, m.param) for g in subject.report.groups for m in g.members
                  if m.param == "group_token" and m.axis == 1]
    coordinates = {g.id for g in subject.report.groups for m in g.members if m.param == "embed.weight"}
    assert not {gid for gid, _ in token_axis} & coordinates  # the token axis never moves with the coordinates
    assert any(g.motif == "ffn" for g in subject.report.groups)  # the token mixer's hidden units still permute
