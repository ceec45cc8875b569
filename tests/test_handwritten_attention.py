"""Hand-written attention forms found by examples/sweep_handwritten.py.

* ``nn.MultiheadAttention(add_bias_kv=True)`` concatenates a learned key and value row to the keys and values; with
  ``add_zero_attn=True`` a row of zeros. Both pinned every per-head group: the learned rows were tied to the key
  and value coordinates but counted as never read, and the zeros were data meeting coordinates. A learned row
  carries the coordinates it is tied to, and zeros stay zeros under every group element (all are linear maps).
  The same miscount pinned the head permutation of attention with a learned sink logit per head (gpt-oss style,
  written by hand: the sink concatenated to the scores). A sink held in a buffer, differing per head, was the
  opposite: it carries no labels, so the heads were permuted and it stayed (unsound); it now pins the heads, and a
  sink the same for every head leaves them free. A fixed piece joined beside the heads along the head axis
  (ConvBERT joins its convolution heads so) holds other coordinates and leaves the heads' rotations.
* A LayerNorm over the whole query (or key) width, split into heads afterwards, centres the row of all heads
  together: a sign flip must be one sign for the whole row. Each head drew its own sign (relative output change
  2.7e-2 in float64, the only unsound group of the sweep); such a row now keeps the sign-free permutations.
"""
from __future__ import annotations

import pytest
import torch

import symgraph

from cli_runner import run
from group_checks import assert_fuzzed_at_two_shapes, census, noisy

WIDTH, HEADS = 16, 4


class ExtraKeys(torch.nn.Module):
    """Self-attention through nn.MultiheadAttention (sequence first) with its extra key/value rows."""

    def __init__(self, bias_kv: bool, zero_attn: bool):
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, WIDTH)
        self.attn = torch.nn.MultiheadAttention(WIDTH, HEADS, add_bias_kv=bias_kv, add_zero_attn=zero_attn)

    def forward(self, x):
        h = self.inp(x).transpose(0, 1)
        return self.attn(h, h, h, need_weights=False)[0].transpose(0, 1)


class WidthNormedQK(torch.nn.Module):
    """Queries and keys layer-normed over all heads at once (OLMo2-like, with a LayerNorm), then split."""

    def __init__(self, affine: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.q_norm = torch.nn.LayerNorm(WIDTH, elementwise_affine=affine)
        self.k_norm = torch.nn.LayerNorm(WIDTH, elementwise_affine=affine)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        q, k, v = (t.view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, n, WIDTH))


class SinkAttention(torch.nn.Module):
    """Attention whose softmax also sees one learned logit per head, dropped afterwards."""

    def __init__(self, sinks: str = "parameter", logaddexp: bool = False):
        super().__init__()
        self.logaddexp = logaddexp  # the sink joined to each row's log-sum-exp, not concatenated to the scores
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        if sinks == "parameter":
            self.sinks = torch.nn.Parameter(torch.zeros(HEADS))
        else:  # fixed: one number per head, or the same for all
            self.register_buffer("sinks", torch.linspace(-1.0, 1.0, HEADS) if sinks == "buffer per head"
                                 else torch.full((HEADS,), 0.7))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / 2.0
        if self.logaddexp:
            weights = torch.exp(scores - torch.logaddexp(scores.logsumexp(-1, keepdim=True),
                                                         self.sinks.view(1, HEADS, 1, 1)))
        else:
            sink = self.sinks.view(1, HEADS, 1, 1).expand(b, HEADS, n, 1)
            weights = torch.cat((scores, sink), -1).softmax(-1)[..., :-1]
        return self.o((weights @ v).transpose(1, 2).reshape(b, n, WIDTH))


class LearnedAlibi(torch.nn.Module):
    """ALiBi with a learned slope per head: ``-slope * |i - j|`` added to each head's scores, the bias written
    before or after the scores; ``fixed factor``: the slopes also scaled by a fixed number per head."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.q, self.k, self.v, self.o = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.slopes = torch.nn.Parameter(torch.linspace(0.2, 0.8, HEADS))
        self.register_buffer("factor", torch.linspace(1.0, 2.0, HEADS))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / 2.0
        i = torch.arange(n)
        distance = (i[None, :] - i[:, None]).to(x.dtype).abs()
        slopes = self.slopes * self.factor if self.form == "fixed factor" else self.slopes
        bias = -slopes.view(HEADS, 1, 1) * distance
        scores = bias + scores if self.form == "bias first" else scores + bias
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, WIDTH))


class ExtraHead(torch.nn.Module):
    """Attention heads joined, along the head axis, with one more head of fixed values before the output."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.o = torch.nn.Linear(WIDTH + WIDTH // HEADS, WIDTH)
        self.register_buffer("fixed", torch.linspace(-1.0, 1.0, WIDTH // HEADS))

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, HEADS, WIDTH // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        heads = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        joined = torch.cat([heads, self.fixed.expand(b, n, 1, WIDTH // HEADS)], 2)
        return self.o(joined.reshape(b, n, -1))


def make_extra_keys():
    """For the command line: both extra rows."""
    return noisy(ExtraKeys(True, True)), (torch.randn(2, 5, WIDTH),)


@pytest.mark.parametrize("bias_kv,zero_attn", [(True, False), (False, True), (True, True)])
def test_extra_key_value_rows_keep_the_per_head_groups(bias_kv, zero_attn):
    subject = symgraph.load(noisy(ExtraKeys(bias_kv, zero_attn)), (torch.randn(2, 5, WIDTH),))
    groups = census(subject)
    assert groups.get("qk orthogonal 4x4") == 1 and groups.get("vo orthogonal 4x4") == 1, groups
    assert groups.get("heads permutation 4x1") == 1, groups
    if bias_kv:  # the learned rows move with the heads' coordinates
        moved = {m.param for g in subject.report.groups if g.motif in ("qk", "vo") for m in g.members}
        assert {"attn.bias_k", "attn.bias_v"} <= moved, moved
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("logaddexp", [False, True], ids=["concatenated", "logaddexp"])
def test_a_learned_sink_logit_moves_with_its_head(logaddexp):
    # logaddexp(scores.logsumexp(-1), sink): an unknown op that pinned the heads
    subject = symgraph.load(noisy(SinkAttention(logaddexp=logaddexp)), (torch.randn(2, 5, WIDTH),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert len(heads) == 1 and "sinks" in {m.param for m in heads[0].members}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("sinks,permuted", [("buffer per head", False), ("buffer alike", True)])
@pytest.mark.parametrize("logaddexp", [False, True], ids=["concatenated", "logaddexp"])
def test_a_fixed_sink_logit_keeps_heads_in_place_unless_every_head_has_the_same(sinks, permuted, logaddexp):
    subject = symgraph.load(SinkAttention(sinks, logaddexp).eval(), (torch.randn(2, 5, WIDTH),))
    groups = census(subject)
    assert (groups.get("heads permutation 4x1") == 1) == permuted, groups
    assert groups.get("qk orthogonal 4x4") == 1 and groups.get("vo orthogonal 4x4") == 1, groups
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["scores first", "bias first"])
def test_a_learned_alibi_slope_moves_with_its_head(form):
    """``-slope * distance``: negated before the product, the slope's term carried the distance as a coefficient
    and was read as a linear mix of the head scores, which lost the head permutation and every value group; the
    coefficient is the same for every head, so the slope moves with its head. Added before the scores, the bias
    found no heads to move with."""
    subject = symgraph.load(noisy(LearnedAlibi(form)), (torch.randn(2, 5, WIDTH),))
    groups = census(subject)
    assert groups.get("vo orthogonal 4x4") == 1, groups
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert len(heads) == 1 and "slopes" in {m.param for m in heads[0].members}, groups
    assert_fuzzed_at_two_shapes(subject)


def test_an_alibi_slope_scaled_by_a_fixed_number_per_head_keeps_heads_in_place():
    subject = symgraph.load(noisy(LearnedAlibi("fixed factor")), (torch.randn(2, 5, WIDTH),))
    assert not [g for g in subject.report.groups if g.motif == "heads"], census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_fixed_head_joined_beside_the_heads_leaves_their_groups():
    subject = symgraph.load(noisy(ExtraHead()), (torch.randn(2, 5, WIDTH),))
    groups = census(subject)
    assert groups.get("vo orthogonal 4x4") == 1 and groups.get("qk orthogonal 4x4") == 1, groups
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("affine", [True, False])
def test_a_layer_norm_across_heads_gives_no_head_its_own_sign(affine):
    subject = symgraph.load(noisy(WidthNormedQK(affine)), (torch.randn(2, 5, WIDTH),))
    qk = [g for g in subject.report.groups if g.motif == "qk" and g.kind != "scale"]
    assert [(g.kind, g.size, g.copies) for g in qk] == [("permutation", 4, 4)]
    assert not qk[0].global_sign and not qk[0].fixes_ones
    assert any("one sign for a centred row" in note for note in qk[0].notes)
    assert_fuzzed_at_two_shapes(subject, samples=10)


def test_extra_key_value_rows_through_the_command_line(tmp_path):
    factory = f"{__file__}:make_extra_keys"
    out = run("report", factory, "--format", "json")
    assert out.returncode == 0, out.stderr
    assert '"qk"' in out.stdout and '"heads"' in out.stdout
    checked = run("fuzz", factory, "--samples", "3")
    assert checked.returncode == 0, checked.stdout + checked.stderr
