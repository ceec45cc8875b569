"""Per-head query/key norms as one module per head (StableLM's ``torch.split`` into heads, a LayerNorm per head,
``torch.cat``), and the report's account of the parameters no group moves."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.groups import TensorMember
from symgraph.render import to_markdown

from group_checks import assert_fuzzed_at_two_shapes, census, noisy


class Attn(nn.Module):
    """Attention with q/k LayerNorms, one for all heads or one per head, and rotate_half RoPE on ``r`` dims."""

    def __init__(self, per_head: bool, r: int = 4, d: int = 16, h: int = 2):
        super().__init__()
        self.h, self.dh, self.per_head, self.r = h, d // h, per_head, r
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        n = h if per_head else 1
        self.qn = nn.ModuleList(nn.LayerNorm(self.dh, bias=False) for _ in range(n))
        self.kn = nn.ModuleList(nn.LayerNorm(self.dh, bias=False) for _ in range(n))
        for m in [*self.qn, *self.kn]:
            nn.init.normal_(m.weight)
        ang = torch.outer(torch.arange(5).float(), 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r)))
        emb = torch.cat([ang, ang], -1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def norm(self, x, norms):
        if not self.per_head:
            return norms[0](x)
        return torch.cat([n(s) for n, s in zip(norms, torch.split(x, 1, dim=1))], dim=1)

    def rope(self, x):
        if not self.r:
            return x
        rot, rest = x[..., :self.r], x[..., self.r:]
        a, b = rot[..., :self.r // 2], rot[..., self.r // 2:]
        return torch.cat([rot * self.cos + torch.cat([-b, a], -1) * self.sin, rest], -1)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.h, self.dh).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = self.rope(self.norm(q, self.qn)), self.rope(self.norm(k, self.kn))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))


def _report(model):
    torch.manual_seed(0)
    return symgraph.analyze(model, inputs=(torch.randn(2, 5, 16),))


def _subject(model):
    torch.manual_seed(0)
    return symgraph.load(noisy(model), (torch.randn(2, 5, 16),))


def _swapped(group) -> list[tuple[str, ...]]:
    return [m.params for m in group.members if isinstance(m, TensorMember)]


def test_parameters_in_no_group_are_listed_with_a_reason():
    # norm weights shared by both heads, before a rotary that leaves them one sign: in no group, and not pinned
    report = _report(Attn(per_head=False))
    in_groups = {p for g in report.groups for p in g.params}
    pinned = {p for s in report.pinned for p in s.params}
    missing = sorted(set(report.parameters) - in_groups - pinned)
    assert missing == ["kn.0.weight", "qn.0.weight"]
    unmoved = json.loads(report.dumps())["unmoved"]
    assert [u["param"] for u in unmoved] == missing
    assert all("rotary pairs" in u["reason"] and "norm weight" in u["reason"] for u in unmoved)
    md = to_markdown(report)
    assert "## In no group" in md and "| in no group and not pinned | 2 tensors" in md
    assert all(f"| `{p}` | rotary pairs" in md for p in missing)


def test_a_model_with_every_parameter_covered_lists_none():
    report = _report(Attn(per_head=False, r=0))
    assert json.loads(report.dumps())["unmoved"] == []
    assert "In no group" not in to_markdown(report)


@pytest.mark.parametrize("r", [0, 4])
def test_heads_move_with_their_own_norm_modules(r):
    # split into heads, a LayerNorm per head, cat: the joined axis is the heads axis again, and a head
    # permutation swaps the heads' norm tensors with them
    subject = _subject(Attn(per_head=True, r=r))
    (heads,) = [g for g in subject.report.groups if g.motif == "heads"]
    assert _swapped(heads) == [("kn.0.weight", "kn.1.weight"), ("qn.0.weight", "qn.1.weight")]
    if not r:  # each head's own QK permutation, moving its two norm weights
        assert census(subject)["qk permutation 8x1"] == 2
    assert_fuzzed_at_two_shapes(subject)


class Unlike(Attn):
    """Head 1's normalised queries doubled: the heads are no longer computed alike."""

    def norm(self, x, norms):
        pieces = [n(s) for n, s in zip(norms, torch.split(x, 1, dim=1))]
        return torch.cat([pieces[0], 2 * pieces[1]], dim=1)


def test_heads_computed_unlike_get_no_head_permutation():
    subject = _subject(Unlike(per_head=True, r=0))
    assert not [g for g in subject.report.groups if g.motif == "heads"]
    assert_fuzzed_at_two_shapes(subject)


def test_alignment_undoes_a_head_swap_with_its_norms():
    torch.manual_seed(0)
    a = noisy(Attn(per_head=True))
    b = Attn(per_head=True)
    rows = torch.cat([torch.arange(8, 16), torch.arange(8)])
    state = {k: v[rows] if k[0] in "qkv" and k[1] == "." else v for k, v in a.state_dict().items()}
    state["o.weight"] = a.o.weight[:, rows]
    for n in ("qn", "kn"):
        state[f"{n}.0.weight"], state[f"{n}.1.weight"] = state[f"{n}.1.weight"], state[f"{n}.0.weight"]
    b.load_state_dict(state)
    x = (torch.randn(2, 5, 16),)
    result = symgraph.align(symgraph.load(b.eval(), x), symgraph.load(a, x), mode="permutation")
    assert all(torch.equal(result.state[k], v) for k, v in a.state_dict().items())


def test_stablelm_with_a_layernorm_per_head():
    transformers = pytest.importorskip("transformers")
    config = transformers.StableLmConfig(vocab_size=60, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True,
                                         partial_rotary_factor=0.25, use_qkv_bias=True)
    torch.manual_seed(0)
    model = noisy(transformers.AutoModelForCausalLM.from_config(config), 0.02)
    subject = symgraph.load(model, {"input_ids": torch.randint(3, 60, (2, 7)), "use_cache": False})
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert len(heads) == 2 and all(len(_swapped(g)) == 2 and len(_swapped(g)[0]) == 4 for g in heads)
    assert not subject.report.unmoved
    assert_fuzzed_at_two_shapes(subject, samples=3)


class Crossed(Attn):
    """Head 0 reads the second norm module and head 1 the first: each slot holds the tensor its head reads."""

    def norm(self, x, norms):
        a, b = torch.split(x, 1, dim=1)
        return torch.cat([norms[1](a), norms[0](b)], dim=1)


class Reused(Attn):
    """The first query norm's weight also scales the layer's first 8 outputs: it may not move with head 0."""

    def forward(self, x):
        y = super().forward(x)
        return torch.cat([y[..., :8] * self.qn[0].weight, y[..., 8:]], -1)


def test_norm_modules_swap_with_the_head_that_reads_them():
    subject = _subject(Crossed(per_head=True, r=0))
    (heads,) = [g for g in subject.report.groups if g.motif == "heads"]
    assert _swapped(heads) == [("kn.1.weight", "kn.0.weight"), ("qn.1.weight", "qn.0.weight")]
    assert_fuzzed_at_two_shapes(subject)


def test_a_norm_read_elsewhere_too_keeps_its_heads_in_place():
    subject = _subject(Reused(per_head=True, r=0))
    assert not [g for g in subject.report.groups if g.motif == "heads"]
    assert_fuzzed_at_two_shapes(subject)
