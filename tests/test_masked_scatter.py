"""``masked_scatter``: a vision-language model (Llava, Gemma 3, PaliGemma) puts its projected image features into
the text stream at its image tokens with ``embeds.masked_scatter(mask, features)``, the mask broadcast along the
stream's width. The features fill the chosen rows in order, so a map of the stream's coordinates passes when the
projector's output moves with it; a mask that picks parts of rows would not let it pass, and pins."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

IMAGE, VOCAB, WIDTH, PIXELS, TOKENS = 1, 20, 8, 6, 3  # placeholder id; features per image


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 16), nn.Linear(16, WIDTH)

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h))))


class PlaceholderLM(nn.Module):
    """Token embeddings with image features scattered in at the placeholders, two residual blocks, logits only.
    ``partial``: the mask picks only the first half of each chosen row's coordinates."""

    def __init__(self, partial: bool = False, in_place: bool = False):
        super().__init__()
        self.partial, self.in_place = partial, in_place
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.project = nn.Sequential(nn.Linear(PIXELS, 12), nn.GELU(), nn.Linear(12, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, ids, pixels):
        h = self.embed(ids)
        mask = (ids == IMAGE).unsqueeze(-1).expand_as(h)
        if self.partial:
            mask = mask & (torch.arange(WIDTH) < WIDTH // 2)
        features = self.project(pixels)
        h = h.clone().masked_scatter_(mask, features) if self.in_place else h.masked_scatter(mask, features)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def inputs(batch: int = 2, length: int = 7):
    ids = torch.randint(IMAGE + 1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    ids[:, :TOKENS] = IMAGE
    return ids, torch.randn(batch, TOKENS, PIXELS, generator=torch.Generator().manual_seed(1))


def stream_params(subject) -> set[str]:
    return {m.param for g in subject.report.groups if g.motif == "residual" for m in g.members}


@pytest.mark.parametrize("in_place", [False, True])
def test_image_features_scattered_at_placeholders_move_with_the_text_stream(in_place):
    subject = symgraph.load(noisy(PlaceholderLM(in_place=in_place)), inputs())
    params = stream_params(subject)
    assert {"embed.weight", "project.2.weight", "project.2.bias", "blocks.1.down.weight", "head.weight"} <= params
    assert "project.0.weight" not in params  # the projector's hidden units are their own space
    assert_fuzzed_at_two_shapes(subject)


def test_a_mask_that_picks_parts_of_rows_pins_the_stream():
    subject = symgraph.load(noisy(PlaceholderLM(partial=True)), inputs())
    assert "project.2.weight" not in stream_params(subject) and "embed.weight" not in stream_params(subject)
    assert any("masked_scatter" in p.node for p in subject.report.pinned)
    assert_fuzzed_at_two_shapes(subject)
