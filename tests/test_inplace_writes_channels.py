"""In-place writes into views of a preallocated buffer (symgraph/analysis/writes.py) with operands whose channels lie
on different axes: learned tokens labelled on their token and coordinate axes written beside activations labelled on
the coordinate axis (GroupViT's ``cat([x, group_tokens], 1)`` written as two slice assignments).

The write rule paired the base's and the written value's channels by their place in the channel lists, so the
activations' coordinates were joined with the tokens' *token* channel, as the movement rule once did for ``cat``:
the residual class took in the token axis, and its sign flip changed the outputs (relative 2.7e-1 in float64). The
channels are now paired by the axes they vary along (the helper the movement rule uses).
"""
from __future__ import annotations

import pytest
import torch

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy
from test_token_concat import PATCH, WIDTH, GroupTokens


class WrittenGroupTokens(GroupTokens):
    """GroupTokens with the concatenation written into a buffer: activations into rows ``:n``, the learned tokens
    into rows ``n:`` (``order`` says which comes first)."""

    def __init__(self, tokens: int, order: str, alloc: str):
        super().__init__(tokens)
        self.order, self.alloc = order, alloc

    def forward(self, patches):
        x = self.embed(patches)
        b, n, d = x.shape
        both = torch.zeros(b, n + self.tokens, d, dtype=x.dtype) if self.alloc == "zeros" \
            else x.new_empty(b, n + self.tokens, d)
        for part in (("x", "tokens") if self.order == "x_first" else ("tokens", "x")):
            if part == "x":
                both[:, :n] = x
            else:
                both[:, n:] = self.group_token
        both = both + self.mix(self.norm(both))
        x, groups = both[:, :-self.tokens], both[:, -self.tokens:]
        groups = self.norm_post(self.mixer(self.norm_tokens(groups)))
        return self.head(groups.mean(1)) + self.head_x(x.mean(1))


@pytest.mark.parametrize("order, alloc", [("x_first", "zeros"), ("tokens_first", "new_empty")])
@pytest.mark.parametrize("tokens", [6, WIDTH])  # as many tokens as coordinates: sizes cannot tell the axes apart
def test_tokens_written_beside_activations_keep_their_own_axis(tokens, order, alloc):
    subject = symgraph.load(noisy(WrittenGroupTokens(tokens, order, alloc)), (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    token_axis = {g.id for g in subject.report.groups for m in g.members if m.param == "group_token" and m.axis == 1}
    coordinates = {g.id for g in subject.report.groups for m in g.members if m.param == "embed.weight"}
    assert not token_axis & coordinates  # the token axis never moves with the coordinates
    assert census(subject)["ffn permutation 16x1"] == 1  # the token mixer's hidden units still permute
