"""Picks whose number of positions is known only at run time: ``h[mask]`` with a mask built from the input ids
(HiggsAudio's dual FFN sends audio tokens through their own norm and MLP). torch.export gives the pick a
run-time size; the analysis must not replay this input's mask (another input picks other positions, and as
many as it likes), yet channels constant along the picked axes keep their groups."""
from __future__ import annotations

import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

SPECIAL = 3  # token ids below this take the second FFN


class Mlp(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class DualFfn(nn.Module):
    """Embedding, then per layer an FFN for ordinary tokens and another for special ones, written back in place."""

    def __init__(self, vocab: int = 20, d: int = 8, hidden: int = 12, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.text = nn.ModuleList(Mlp(d, hidden) for _ in range(layers))
        self.special = nn.ModuleList(Mlp(d, hidden) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        mask = ids < SPECIAL
        for text, special in zip(self.text, self.special):
            h = h.clone()
            h[~mask] += text(h[~mask])
            h[mask] += special(h[mask])
        return self.head(h)


def dual_ffn_subject(ids):
    return symgraph.load(noisy(DualFfn()), (ids,))


def test_a_pick_counted_at_run_time_keeps_both_ffns_groups():
    """The example has no special token: the mask picks none, where the trace's stand-in size is not 0 (main
    raised an AnalysisError in the rule after the pick)."""
    subject = dual_ffn_subject(torch.randint(SPECIAL, 20, (2, 6)))
    kinds = census(subject)
    assert kinds.get("ffn permutation/positive 12x1") == 4, kinds  # both FFNs of both layers
    params = {m.param for g in subject.report.groups if g.motif == "ffn" for m in g.members}
    assert {"special.0.up.weight", "special.1.down.weight", "text.0.up.weight"} <= params


def test_groups_found_without_special_tokens_hold_on_inputs_that_have_them():
    plain = dual_ffn_subject(torch.randint(SPECIAL, 20, (2, 6)))
    mixed = torch.tensor([[0, 5, 1, 9, 2, 7, 4], [1, 1, 8, 0, 6, 2, 3]])
    assert (mixed < SPECIAL).any() and (mixed >= SPECIAL).any()
    with_special = symgraph.load(plain.model, (mixed,))
    assert_fuzzed_at_two_shapes(with_special)
    from symgraph.fuzz import fuzz

    result = fuzz(plain.model, inputs=(mixed,), groups=plain.report.groups, samples=5)
    assert result.ok and len(result.verdicts) == len(plain.report.groups), [v.counterexample for v in
                                                                             result.failures]


def test_channels_that_vary_along_the_picked_axis_are_pinned():
    """A pick along the coordinate axis, by a mask counted at run time, cannot keep those coordinates' group."""

    class PickUnits(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)

        def forward(self, x, keep):
            h = torch.relu(self.up(x))
            return self.down(h * keep) + h[..., keep > 0].sum(-1, keepdim=True)

    subject = symgraph.load(noisy(PickUnits()), (torch.randn(2, 6), (torch.arange(10) % 3 > 0).float()))
    assert not any(g.motif == "ffn" for g in subject.report.groups), census(subject)
