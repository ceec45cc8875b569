"""Eighth soundness pass: forms that got around the checks of numbers the trace bakes in (cut points far from
their join, per-unit data, roll shifts and in-place fills computed from the input's length). Each form is fuzzed in
float64 at two input shapes, beside a control with the same numbers fixed, whose group must stay."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy
from test_sizes_from_the_input import D, H, Units

def subject_of(module):
    torch.manual_seed(0)
    return symgraph.load(noisy(module).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


def _far_apart(first):
    def f(h, n):
        p, q = h[..., :first(n)], h[..., first(n):]
        for _ in range(9):  # 18 ops between each cut and the join
            p, q = torch.tanh(p) * 1.5, torch.sigmoid(q) * 1.25
        return torch.cat([p, q], -1)
    return f


def _zeroed_in_place(first):
    def f(h, n):
        z = h.clone()
        z[..., first(n):] = 0
        return z
    return f


def _table(first):
    def f(h, n):
        p, u = torch.arange(n, dtype=h.dtype)[:, None], torch.arange(H)[None]
        return h * (1 + (u < first(n)).to(h.dtype) * (p + 1) / n)
    return f


class CachedTable(nn.Module):
    """A table of positions by units cached at construction and cut to the input's length: unit ``u`` is doubled
    from position ``u + 1`` on."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.register_buffer("table", 1.0 + (torch.arange(H)[None] < torch.arange(32)[:, None]).double(),
                             persistent=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * self.table[:x.shape[1]].to(x.dtype))


def _padded(first):
    return lambda h, n: F.pad(h[..., :first(n)], (0, H - first(n)))


def _beside_zeros(first):
    return lambda h, n: torch.cat([h[..., :first(n)], h.new_zeros(*h.shape[:-1], H - first(n))], -1)


MOVING = {
    "pieces cut at min(n, 6), 18 ops from their join": lambda: Units(_far_apart(lambda n: min(n, 6))),
    "units rolled by the length": lambda: Units(lambda h, n: torch.roll(h, n, -1)),
    "units from min(n, 6) on zeroed in place": lambda: Units(_zeroed_in_place(lambda n: min(n, 6))),
    "a table of positions by units doubling units below min(n, 6)": lambda: Units(_table(lambda n: min(n, 6))),
    "a cached table of positions by units cut to the length": CachedTable,
    "units cut at min(n, 6), padded back": lambda: Units(_padded(lambda n: min(n, 6))),
    "units cut at min(n, 6), joined with zeros": lambda: Units(_beside_zeros(lambda n: min(n, 6))),
    "one unit cut at min(n + 6, 12), padded back": lambda: Units(_padded(lambda n: min(n + 6, H))),
}


@pytest.mark.parametrize("name", MOVING)
def test_numbers_that_follow_the_length_keep_no_group_they_break(name):
    """On the old engine: the cut 18 ops up was past the 16 nodes searched, and units 5-11 were permuted (relative
    change 0.24); a roll along the units by the length kept a permutation of all 12 units, whose columns in the
    next layer the length picks (0.53); units zeroed in place by fill_, an op no spec described, kept their labels,
    and a permutation of units 0-4 was kept where units 3-4 are zeroed at length 3 (0.15); data varying along
    positions as well as units was never compared at other lengths, and units 5-11 (4-11 for the cached table) were
    permuted where unit 5 is doubled from length 6 on (0.03-0.34); units cut away at a bound that follows the length
    and never read again (padded back, joined with zeros) were free to move, and unit 5 is read from length 6 on
    (0.20); where the cut dropped one unit only (unit 11 at length 5), units 0-10 were permuted, and units 9-10 are
    cut away at length 3."""
    subject = subject_of(MOVING[name]())
    assert not any(g.size in (5, 7, 8, 11, 12) for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject, samples=8)


FIXED = {
    "pieces cut at 6, 18 ops from their join": (lambda: Units(_far_apart(lambda n: 6)), 6),
    "units rolled by 5": (lambda: Units(lambda h, n: torch.roll(h, 5, -1)), 12),
    "units from 6 on zeroed in place": (lambda: Units(_zeroed_in_place(lambda n: 6)), 6),
    "a table of positions by units doubling units below 6": (lambda: Units(_table(lambda n: 6)), 6),
    "units cut at 6, padded back": (lambda: Units(_padded(lambda n: 6)), 6),
    "units cut at 6, joined with zeros": (lambda: Units(_beside_zeros(lambda n: 6)), 6),
    "one unit cut at 11, padded back": (lambda: Units(_padded(lambda n: 11)), 11),
}


@pytest.mark.parametrize("name", FIXED)
def test_the_same_numbers_fixed_keep_their_groups(name):
    build, size = FIXED[name]
    subject = subject_of(build())
    assert any(g.motif == "ffn" and g.kind == "permutation" and g.size == size for g in subject.report.groups), \
        census(subject)
    assert_fuzzed_at_two_shapes(subject)


class RepeatedTable(nn.Module):
    """A rotary-like table ``cat([f, f])`` of positions by units, ``f = p * freq``: units ``j`` and ``j + 6`` are
    scaled alike at every length, which the graph shows (one piece repeated), so no other length is traced; but
    units below ``doubled(n)`` are doubled in place where given. ``repeat``: how ``f`` is repeated (interleaved
    rotary: ``f.repeat_interleave(2, -1)``)."""

    def __init__(self, doubled=None, repeat=lambda f: torch.cat([f, f], -1)):
        super().__init__()
        self.repeat = repeat
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)
        self.register_buffer("freq", torch.linspace(0.1, 1.0, H // 2, dtype=torch.float64), persistent=False)
        self.doubled = doubled

    def forward(self, x):
        f = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.freq
        table = 1 + torch.cos(self.repeat(f))
        if self.doubled is not None:
            table[..., :self.doubled(x.shape[1])] *= 2
        return self.b(torch.relu(self.a(x)) * table)


@pytest.mark.parametrize("repeat", [lambda f: torch.cat([f, f], -1), lambda f: f.repeat_interleave(2, -1)],
                         ids=["cat", "repeat_interleave"])
def test_a_table_built_alike_keeps_its_group_without_tracing_other_lengths(monkeypatch, repeat):
    """Comparing every table of positions by units at other lengths doubled a tiny LLaMA's analysis time (its
    rotary tables): entries alike by construction are not compared."""
    from symgraph.analysis.selections import Selections

    traced = []
    monkeypatch.setattr(Selections, "_trace", lambda self, inputs: traced.append(inputs))
    subject = subject_of(RepeatedTable(repeat=repeat))
    assert any(g.motif == "ffn" and g.kind == "permutation" for g in subject.report.groups), census(subject)
    assert not traced
    monkeypatch.undo()
    assert_fuzzed_at_two_shapes(subject)


def test_a_table_built_alike_but_written_at_places_that_follow_the_length_is_compared_there():
    """Units 5 and 11 are alike at length 5, where units 0-4 are doubled in place, but not from length 6 on."""
    assert_fuzzed_at_two_shapes(subject_of(RepeatedTable(lambda n: min(n, 6))), samples=8)


def test_a_float32_rotary_table_alike_only_by_rounding_keeps_its_rotary_group():
    """With rope_theta 1e6 the cosines of a tiny LLaMA's two lowest frequencies are all 1.0 in float32 at the traced
    positions and differ at longer lengths; the sines tell them apart everywhere. The table's data is computed in
    double precision, as groups are checked, so comparing it at other lengths finds nothing to forget."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, use_cache=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    subject = symgraph.load(LlamaModel(config).eval(), (torch.randint(0, 64, (2, 5)),))
    assert any(g.motif == "qk" and g.kind == "rotary" for g in subject.report.groups), census(subject)
    assert_fuzzed_at_two_shapes(subject)
