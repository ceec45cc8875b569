"""Model structures a soundness pass tried (shared weights, several towers, latent arrays, routed depth, ...):
each fixed form fuzzed in float64 at two input shapes, beside a control that keeps the group the fix must not
lose."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, noisy

D, HEADS = 16, 4


class Latents(nn.Module):
    """Perceiver-style: a learned array of latent tokens attends to itself, then is mean-pooled."""

    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal
        self.latents = nn.Parameter(torch.randn(4, D))
        self.q, self.k, self.v, self.head = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        lat = self.latents.expand(x.shape[0], -1, -1)
        b, n, _ = lat.shape
        q, k, v = (p(lat).view(b, n, HEADS, D // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(b, n, D)
        return self.head((lat + out + x.mean(1, keepdim=True)).mean(1))


def latent_token_groups(causal: bool):
    subject = symgraph.load(noisy(Latents(causal)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))
    on_tokens = [g for g in subject.report.groups for m in g.members if m.param == "latents" and m.axis == 0]
    return subject, on_tokens


@pytest.mark.parametrize("causal", [True, False])
def test_a_causal_flag_pins_the_latent_tokens_it_masks(causal):
    """is_causal builds a mask that differs along both token axes; read as no mask at all, the latent tokens of a
    causal self-attention were free to permute. Without it (the control) they are."""
    subject, on_tokens = latent_token_groups(causal)
    assert bool(on_tokens) is not causal, [g.id for g in on_tokens]
    assert_fuzzed_at_two_shapes(subject)
