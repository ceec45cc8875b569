"""A LayerNorm written out, ``x - mean(x)`` over the last axis: the analysis reads it as the channel itself under
orthogonal maps with Q 1 = +-1 (as a LayerNorm's input), which the fuzzer confirms in float64 at two input shapes;
a mean read by anything else stays a per-row statistic that only permutations keep."""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.fuzz import fuzz


class _CentredStream(torch.nn.Module):
    """Blocks whose residual stream is centred by hand before every linear that reads it (no norm weight: the
    folded form of a written-out LayerNorm); ``leak`` also adds the stream's mean to the output."""

    def __init__(self, leak: bool = False, d: int = 8, vocab: int = 12):
        super().__init__()
        self.leak = leak
        self.emb = torch.nn.Embedding(vocab, d)
        self.ups = torch.nn.ModuleList(torch.nn.Linear(d, 2 * d) for _ in range(2))
        self.downs = torch.nn.ModuleList(torch.nn.Linear(2 * d, d) for _ in range(2))
        self.head = torch.nn.Linear(d, vocab)

    @staticmethod
    def centred(h):
        mean = h.mean(-1, keepdim=True)
        return (h - mean) * torch.rsqrt((h - mean).pow(2).mean(-1, keepdim=True) + 1e-5)

    def forward(self, ids):
        h = self.emb(ids)
        for up, down in zip(self.ups, self.downs):
            h = h + down(torch.relu(up(self.centred(h))))
        out = self.head(self.centred(h))
        return out + h.mean(-1, keepdim=True) if self.leak else out


def _residual(leak: bool):
    torch.manual_seed(0)
    subject = symgraph.load(_CentredStream(leak).double(), (torch.randint(0, 12, (2, 5)),))
    return subject, [g for g in subject.report.groups if g.motif == "residual"]


def test_a_centred_stream_takes_orthogonal_maps_that_fix_the_ones_vector():
    subject, residual = _residual(leak=False)
    assert [(g.kind, g.fixes_ones) for g in residual] == [("orthogonal", True)]
    checked = fuzz(subject, samples=6)
    assert checked.ok and len(set(checked.shapes)) >= 2


def test_a_mean_read_by_anything_else_keeps_the_stream_to_permutations():
    subject, residual = _residual(leak=True)
    assert [g.kind for g in residual] == ["permutation"]
    assert fuzz(subject, samples=6).ok


@pytest.mark.parametrize("leak", [False, True])
def test_the_unconstrained_orthogonal_group_would_change_the_function(leak):
    """The restriction is needed: a random rotation of the stream that moves the ones vector changes the outputs
    (so the fuzzer would see a group that allowed it)."""
    from symgraph.verify import Evaluator

    subject, _ = _residual(leak)
    model = subject.model
    q, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["emb.weight"] = state["emb.weight"] @ q.T
    for i in range(2):
        state[f"ups.{i}.weight"] = state[f"ups.{i}.weight"] @ q.T
        state[f"downs.{i}.weight"] = q @ state[f"downs.{i}.weight"]
        state[f"downs.{i}.bias"] = q @ state[f"downs.{i}.bias"]
    state["head.weight"] = state["head.weight"] @ q.T
    evaluator = Evaluator.of(subject)
    assert evaluator.check(state).relative_error > 1e-3
