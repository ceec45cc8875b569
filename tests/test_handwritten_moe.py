"""Hand-written mixtures of experts, Meta's complex rotary and MLP-Mixer's token mixing
(examples/sweep_handwritten.py: ``moe_soft_bmm``, ``moe_top2_softmax_dense_einsum``, ``moe_top1_softmax_loop``,
``moe_expert_choice``, ``complex_rotary_meta_llama``, ``mlp_mixer``), each as a tiny module: the groups the sweep
missed are found, and every one is fuzzed in float64.

What each needed: soft MoE runs every expert on ``x.expand(E, ...)`` through ``bmm``, and an expand repeats its
input, so expert ``e``'s weights meet the same tokens as any other's (specs/ops.yaml ``broadcasts``); the dense
routed form builds its routing matrix with ``zeros_like(...).scatter(-1, top_k_index, weights)`` (rules ``fill``
and ``scatter``) and mixes the experts with a three-operand einsum (contracted pairwise); the loop and
expert-choice forms pick tokens by routed indices (``index_select``, ``x[rows]``: the stream's labels are the same
at every token, whatever the count) and add them back with ``index_add``; Meta's rotary multiplies
``view_as_complex(q)`` by known complex numbers (rule ``complex_view``, complex products in ``mul``); the Mixer's
token-mixing linear adds its bias along the patch axis, the same in every channel of the residual stream.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.groups import TensorMember

from cli_runner import run
from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, E, HIDDEN, TOKENS = 8, 3, 6, 4



class ExpertsBlock(nn.Module):
    """``inp -> x + experts(norm(x)) -> out``, experts stored as (E, D, HIDDEN) and (E, HIDDEN, D) tensors."""

    def __init__(self):
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.randn(E, D, HIDDEN) / 3)
        self.w_out = nn.Parameter(torch.randn(E, HIDDEN, D) / 3)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.experts(self.norm(h).reshape(-1, D)).view_as(h))


class SoftMoE(ExpertsBlock):
    """Every expert on every token (bmm over an expanded input), mixed by the router's softmax."""

    def experts(self, flat):
        weights = self.router(flat).softmax(-1)
        hidden = F.gelu(torch.bmm(flat.expand(E, -1, -1), self.w_in))
        return (torch.bmm(hidden, self.w_out) * weights.t()[..., None]).sum(0)


class DenseRoutedMoE(ExpertsBlock):
    """Top-2 routing scattered into a dense (tokens, experts) matrix; one einsum over experts, units and weights."""

    def experts(self, flat):
        top, index = self.router(flat).softmax(-1).topk(2, -1)
        routing = torch.zeros_like(self.router(flat)).scatter(-1, index, top / top.sum(-1, keepdim=True))
        hidden = F.relu(torch.einsum("td,edh->eth", flat, self.w_in))
        return torch.einsum("eth,ehd,te->td", hidden, self.w_out, routing)


class InPlaceRoutedMoE(ExpertsBlock):
    """Llama 4's router: the top-2 logits written in place into a tensor of -inf (``scatter_``), then a sigmoid."""

    def experts(self, flat):
        logits = self.router(flat)
        top, index = logits.topk(2, -1)
        routing = torch.full_like(logits, float("-inf")).scatter_(1, index, top).sigmoid()
        hidden = F.relu(torch.einsum("td,edh->eth", flat, self.w_in))
        return torch.einsum("eth,ehd,te->td", hidden, self.w_out, routing)


class TwoMaxRoutedMoE(ExpertsBlock):
    """PhiMoE's sparsemixer at inference: the best expert, then the best of the scores with it masked out by a
    ``scatter`` of -inf into the scores themselves; the two picks' indices concatenated."""

    def experts(self, flat):
        scores = self.router(flat)
        first = scores.max(-1, keepdim=True)[1]
        second = scores.scatter(-1, first, float("-inf")).max(-1, keepdim=True)[1]
        index = torch.cat((first, second), dim=-1)
        routing = torch.zeros_like(scores).scatter(-1, index, scores.softmax(-1).gather(-1, index))
        hidden = F.relu(torch.einsum("td,edh->eth", flat, self.w_in))
        return torch.einsum("eth,ehd,te->td", hidden, self.w_out, routing)


class CrossScatterMoE(ExpertsBlock):
    """A second router's scores, masked at the first router's pick by a ``scatter`` of -inf, mix the experts: the
    masked position follows the first router's rows, so the experts may not permute with the second's alone."""

    def __init__(self):
        super().__init__()
        self.other = nn.Linear(D, E, bias=False)

    def experts(self, flat):
        first = self.router(flat).max(-1, keepdim=True)[1]
        routing = self.other(flat).scatter(-1, first, float("-inf")).softmax(-1)
        hidden = F.relu(torch.einsum("td,edh->eth", flat, self.w_in))
        return torch.einsum("eth,ehd,te->td", hidden, self.w_out, routing)


class ExpertChoiceMoE(ExpertsBlock):
    """Each expert takes its top tokens (top-k over the token axis), gathered with ``x[rows]``, added back with
    ``index_add``."""

    def experts(self, flat):
        gate, rows = self.router(flat).softmax(-1).t().topk(flat.shape[0] // 2, -1)
        hidden = F.relu(torch.einsum("ecd,edh->ech", flat[rows], self.w_in))
        y = torch.einsum("ech,ehd->ecd", hidden, self.w_out) * gate[..., None]
        return torch.zeros_like(flat).index_add(0, rows.reshape(-1), y.reshape(-1, D))


class LoopMoE(nn.Module):
    """A ModuleList of experts, each run on the tokens routed to it (a data-dependent count: ``nonzero``,
    ``index_select``) and added back with ``index_add`` or, ``out[rows] += y``, ``index_put``."""

    def __init__(self, put: bool = False):
        super().__init__()
        self.put = put
        self.inp, self.norm, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D))
                                     for _ in range(E))

    def forward(self, x):
        h = self.inp(x)
        flat = self.norm(h).reshape(-1, D)
        probs = self.router(flat).softmax(-1)
        top, index = probs.topk(2, -1)
        weights = torch.zeros_like(probs).scatter(-1, index, top)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (index == e).any(-1).nonzero().squeeze(-1)
            y = expert(flat.index_select(0, rows)) * weights.index_select(0, rows)[:, e:e + 1]
            out = out.index_put((rows,), y, accumulate=True) if self.put else out.index_add(0, rows, y)
        return self.out(h + out.view_as(h))


class ComplexRotary(nn.Module):
    """Attention whose queries and keys are rotated as complex numbers (Meta's LLaMA ``apply_rotary_emb``)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        b, n, _ = h.shape
        angle = torch.arange(n, dtype=h.dtype)[:, None] / 10000 ** (torch.arange(0, 4, 2, dtype=h.dtype) / 4)
        turn = torch.polar(torch.ones_like(angle), angle)

        def rotary(t):
            pairs = torch.view_as_complex(t.reshape(b, 2, n, 2, 2).contiguous())
            return torch.view_as_real(pairs * turn).flatten(-2)

        q, k, v = (lin(h).view(b, n, 2, 4).transpose(1, 2) for lin in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        return self.out(h + self.o(attended.transpose(1, 2).reshape(b, n, D)))


class TokenMixer(nn.Module):
    """MLP-Mixer: a token-mixing MLP across the TOKENS positions (on the transposed stream), then a channel MLP."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.tokens = nn.Sequential(nn.Linear(TOKENS, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, TOKENS))
        self.channels = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D))

    def forward(self, x):
        h = self.inp(x)
        h = h + self.tokens(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.channels(h)
        return self.out(h.mean(1))


def _load(model):
    return symgraph.load(noisy(model), (torch.randn(2, TOKENS, D),))


@pytest.mark.parametrize("form", [SoftMoE, DenseRoutedMoE, InPlaceRoutedMoE, TwoMaxRoutedMoE])
def test_experts_move_with_their_router_rows(form):
    subject = _load(form())
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [(g.kind, g.size) for g in experts] == [("permutation", E)], census(subject)
    assert {(m.param, m.axis) for m in experts[0].members} == {("router.weight", 0), ("w_in", 0), ("w_out", 0)}
    units = [g for g in subject.report.groups if g.motif == "ffn" and g.size == HIDDEN]
    assert {(m.param, m.axis) for g in units for m in g.members} == {("w_in", 2), ("w_out", 1)}, census(subject)
    assert any(g.motif == "residual" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_scatter_into_another_routers_scores_moves_no_experts():
    subject = _load(CrossScatterMoE())
    assert not any(g.motif == "experts" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("put", [False, True])
def test_routed_loop_keeps_each_experts_units_and_the_stream(put):
    """Tokens picked by routed indices (a count known only at run time) keep the stream's labels; the router rows
    move with whole experts (each expert compares the indices with its own number: tests/test_moe_loop.py)."""
    subject = _load(LoopMoE(put))
    recorded = {str(n.target) for n in subject.capture.graph.nodes if n.op == "call_function"}
    assert ("aten.index_put.default" if put else "aten.index_add.default") in recorded
    units = sorted(g.layer for g in subject.report.groups if g.motif == "ffn" and g.kind == "permutation")
    assert units == [f"experts.{e}" for e in range(E)], census(subject)
    assert any(g.motif == "residual" for g in subject.report.groups), census(subject)
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [(g.size, sorted(g.params)[-1]) for g in experts] == [(E, "router.weight")], census(subject)
    assert not any("router.weight" in p.params for p in subject.report.pinned)
    assert_fuzzed_at_two_shapes(subject)


class StackedMoE(nn.Module):
    """Every expert run on every token, the outputs stacked and mixed: by the router's weights
    (``(gates.unsqueeze(-1) * stacked).sum(-2)``, or along a leading stack axis, or contracted with the stack
    axis by ``einsum`` or ``matmul``), a fixed weight per expert, or a plain sum (``1.0 * stacked``, or ``sum``).
    ``per unit`` (``per unit einsum``): the gates weigh each output unit of each expert (E * D router outputs)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)
        self.router = nn.Linear(D, E * D if form.startswith("per unit") else E)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D))
                                     for _ in range(E))

    def forward(self, x):
        h = self.inp(x)
        gates = self.router(h)
        if self.form == "stack first":
            mixed = (gates.softmax(-1).permute(2, 0, 1).unsqueeze(-1)
                     * torch.stack([e(h) for e in self.experts])).sum(0)
        elif self.form == "per unit":
            mixed = (gates.unflatten(-1, (E, D)).sigmoid() * torch.stack([e(h) for e in self.experts], -2)).sum(-2)
        elif self.form == "per unit einsum":
            mixed = torch.einsum("bned,bned->bnd", gates.unflatten(-1, (E, D)).sigmoid(),
                                 torch.stack([e(h) for e in self.experts], -2))
        elif self.form == "sum":
            mixed = torch.stack([e(h) for e in self.experts], -2).sum(-2)
        elif self.form in ("einsum", "matmul"):
            stacked = torch.stack([e(h) for e in self.experts], -2)
            mixed = torch.einsum("bne,bned->bnd", gates.softmax(-1), stacked) if self.form == "einsum" else \
                (gates.softmax(-1).unsqueeze(-2) @ stacked).squeeze(-2)
        else:
            weights = {"gates": gates.softmax(-1).unsqueeze(-1), "plain": 1.0,
                       "fixed": torch.tensor([[0.2], [0.3], [0.5]], dtype=h.dtype)}[self.form]
            mixed = (weights * torch.stack([e(h) for e in self.experts], -2)).sum(-2)
        return self.out(h + mixed)


@pytest.mark.parametrize("form", ["gates", "stack first", "fixed", "plain", "sum", "einsum", "matmul"])
def test_experts_stacked_then_summed_keep_the_stream(form):
    """The stacked experts' outputs were summed as a statistic of coordinates (a value no map moves), which the
    stream it is added to could not follow; each slice holds one expert's whole output, so the sum adds the
    slices, as the loop over experts adds them. A contraction of the stack axis with the gates (einsum, matmul) is
    the same weighted sum. The experts permute with the router rows that weigh their slots; fixed weights per slot
    stay, so they keep the experts in place (as does ``1.0 * stacked``, a product no weight of slots)."""
    subject = _load(StackedMoE(form))
    groups = census(subject)
    assert groups.get("residual general_linear 8x1") == 1, groups
    assert groups.get(f"ffn permutation/positive {HIDDEN}x1") == E, groups
    experts = [g for g in subject.report.groups if g.motif == "experts"]
    assert [g.size for g in experts] == ([] if form in ("fixed", "plain") else [E]), groups
    routed = {m.param for g in experts for m in g.members if not isinstance(m, TensorMember)}
    assert routed == (set() if form in ("fixed", "plain", "sum") else {"router.weight", "router.bias"}), routed
    assert_fuzzed_at_two_shapes(subject)


class StackedInOrder(nn.Module):
    """Experts stacked, weighed by the router's softmax and summed, the stack also read where its order shows:
    flattened into a linear layer, one slot read on its own, or a running sum over the slots."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.inp, self.out, self.router = nn.Linear(D, D), nn.Linear(D, 3), nn.Linear(D, E)
        self.mix = nn.Linear(E * D, D)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D))
                                     for _ in range(E))

    def forward(self, x):
        h = self.inp(x)
        stacked = torch.stack([e(h) for e in self.experts], -2)
        weighed = self.router(h).softmax(-1).unsqueeze(-1) * stacked
        extra = {"flattened": lambda: self.mix(stacked.flatten(-2)), "one slot": lambda: stacked[..., 0, :],
                 "running sum": lambda: weighed.cumsum(-2)[..., 1, :]}[self.form]()
        return self.out(h + weighed.sum(-2) + extra)


@pytest.mark.parametrize("form", ["flattened", "one slot", "running sum"])
def test_stacked_experts_read_in_order_stay_in_place(form):
    subject = _load(StackedInOrder(form))
    assert not any(g.motif == "experts" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("form", ["per unit", "per unit einsum"])
def test_gates_per_output_unit_keep_the_stream_pinned(form):
    """A gate per unit of each expert's output is no weight of whole slices: the stream stays pinned."""
    subject = _load(StackedMoE(form))
    assert not any(g.motif == "residual" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)


class RoutedReshape(nn.Module):
    """Routed tokens reshaped by their run-time count: ``view(rows.shape[0], 2, 4)`` splits the channel axis only;
    ``reshape(rows.shape[0] * D)`` merges the count with it, which the labels cannot follow."""

    def __init__(self, merged: bool):
        super().__init__()
        self.merged = merged
        self.inp, self.out, self.router = nn.Linear(D, D), nn.Linear(D, 3), nn.Linear(D, 2)

    def forward(self, x):
        h = self.inp(x).reshape(-1, D)
        rows = (self.router(h)[:, 0] > 0).nonzero().squeeze(-1)
        y = h.index_select(0, rows)
        y = y.reshape(rows.shape[0] * D).view(-1, D) if self.merged else y.view(rows.shape[0], 2, 4).flatten(1)
        return self.out(h.index_add(0, rows, torch.relu(y)))


@pytest.mark.parametrize("merged", [False, True])
def test_sizes_known_only_at_run_time_reshape_or_pin(merged):
    subject = _load(RoutedReshape(merged))
    units = [g for g in subject.report.groups if g.motif == "ffn" and g.size == D]
    run_time = [p for p in subject.report.pinned if "known only at run time" in p.reason]
    assert (len(units), len(run_time)) == ((0, 1) if merged else (1, 0)), census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_expert_choice_keeps_the_stream_the_units_and_the_experts():
    """The expert order lives in the layout of the top-k token indices (tests/test_expert_choice.py)."""
    subject = _load(ExpertChoiceMoE())
    assert any(g.motif == "residual" for g in subject.report.groups), census(subject)
    assert [g.size for g in subject.report.groups if g.motif == "experts"] == [E], census(subject)
    units = [g for g in subject.report.groups if g.motif == "ffn" and g.size == HIDDEN]
    assert {(m.param, m.axis) for g in units for m in g.members} == {("w_in", 2), ("w_out", 1)}, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_complex_rotary_keeps_a_rotation_per_frequency_pair():
    subject = _load(ComplexRotary())
    rotary = [g for g in subject.report.groups if g.motif == "qk" and g.kind == "rotary"]
    assert [(g.size, g.copies, g.rotary_pairs) for g in rotary] == [(4, 2, ((0, 1), (2, 3)))], census(subject)
    assert "aten.view_as_complex.default" not in subject.report.unknown_ops
    assert_fuzzed_at_two_shapes(subject)


def test_a_complex_value_no_rule_reads_pins_what_it_carries():
    """view_as_complex, then an op whose rule reads real coordinates only (a complex add): nothing is guessed."""

    class ComplexShift(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(D, D), nn.Linear(D, 3)

        def forward(self, x):
            z = torch.view_as_complex(self.inp(x).reshape(*x.shape[:-1], D // 2, 2).contiguous())
            return self.out(torch.view_as_real(z + 1j).flatten(-2))

    subject = _load(ComplexShift())
    assert not any(g.members[0].param.startswith("inp.") for g in subject.report.groups), census(subject)
    assert any("complex values reach aten.add.Tensor" in p.reason for p in subject.report.pinned)


def test_token_mixing_keeps_the_residual_stream_a_group():
    subject = _load(TokenMixer())
    residual = [g for g in subject.report.groups if g.motif == "residual"]
    assert [(g.kind, g.size) for g in residual] == [("permutation", D)], census(subject)
    assert any("broadcast along this axis" in note for note in residual[0].notes)
    assert_fuzzed_at_two_shapes(subject)


def make_dense_moe():
    return noisy(DenseRoutedMoE()), (torch.randn(2, TOKENS, D),)


def make_complex_rotary():
    return noisy(ComplexRotary()), (torch.randn(2, TOKENS, D),)


@pytest.mark.parametrize("factory,motif", [("make_dense_moe", "experts"), ("make_complex_rotary", "qk")])
def test_command_line_reports_and_fuzzes(factory, motif, tmp_path):
    reported = run("report", f"{__file__}:{factory}", "--format", "json")
    assert reported.returncode == 0, reported.stderr
    assert motif in {g["motif"] for g in json.loads(reported.stdout)["groups"]}
    fuzzed = run("fuzz", f"{__file__}:{factory}", "--samples", "3", "--json", tmp_path / "fuzz.json")
    assert fuzzed.returncode == 0, fuzzed.stdout + fuzzed.stderr
    assert json.loads((tmp_path / "fuzz.json").read_text())["ok"]
