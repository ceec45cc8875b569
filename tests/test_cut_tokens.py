"""Fixed cuts of an axis where learned tokens sit beside activations of run-time length.

``torch.cat([x, tokens], 1)[:, 4:]`` keeps every token when ``x`` has 4 or more rows and cuts token 0 away when it
has 3: the tokens' place along the axis moves with the input's length, so a slice at fixed bounds keeps other
tokens at another length. The analysis emitted a permutation of the 3 tokens (fuzz, float64: relative error
5.0e-1 to 6.6e-1 at length 3, by seed). Tokens first and cut ``[:, :3]``, or last and cut ``[:, -3:]``, keep
exactly the tokens at every length, and keep their permutation. A reshape of that axis into pairs or windows is
checked the same way: which tokens share a pair must not change with the length.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import symgraph
from symgraph.elements import apply, sample

from group_checks import assert_fuzzed_at_two_shapes, noisy

WIDTH, PATCH, TOKENS = 16, 8, 3


class CutTokens(nn.Module):
    """Activations and learned tokens concatenated along the token axis, then cut at fixed bounds; what is kept
    goes through a per-token MLP and a mean over tokens (which any order of the tokens leaves alone)."""

    def __init__(self, tokens_first: bool, cut: slice):
        super().__init__()
        self.tokens_first, self.cut = tokens_first, cut
        self.embed, self.tokens = nn.Linear(PATCH, WIDTH), nn.Parameter(torch.randn(TOKENS, WIDTH))
        self.mix, self.head = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, patches):
        x = self.embed(patches)
        tokens = self.tokens.expand(x.shape[0], -1, -1)
        both = torch.cat([tokens, x] if self.tokens_first else [x, tokens], 1)[:, self.cut]
        return self.head(torch.relu(self.mix(both)).mean(1))


def _token_groups(subject) -> list:
    return [g for g in subject.report.groups if any(m.param == "tokens" and m.axis == 0 for m in g.members)]


def _worst_change(subject, model: CutTokens, lengths) -> float:
    """The largest relative change of the outputs, over random elements of every group and inputs of ``lengths``
    rows, in float64."""
    state = {k: v.double() for k, v in subject.state_dict().items()}
    model = model.double()
    worst = 0.0
    for group in subject.report.groups:
        for seed in range(3):
            moved = type(model)(model.tokens_first, model.cut).double()
            moved.load_state_dict(apply(state, [sample(group, np.random.default_rng(seed))]))
            for n in lengths:
                x = torch.randn(2, n, PATCH, dtype=torch.float64)
                with torch.no_grad():
                    a, b = model(x), moved(x)
                worst = max(worst, float((a - b).norm() / a.norm()))
    return worst


def test_a_cut_that_keeps_other_tokens_at_another_length_pins_the_token_axis():
    model = noisy(CutTokens(tokens_first=False, cut=slice(4, None)))
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)  # length 3 is one of the probe shapes: the fuzz found 5.0e-1 there
    assert not _token_groups(subject)
    assert _worst_change(subject, model, [3, 4, 5, 6, 13]) < 1e-12
    assert any(g.motif == "ffn" for g in subject.report.groups)  # the rest keeps its groups


@pytest.mark.parametrize("tokens_first, cut", [(True, slice(None, TOKENS)), (False, slice(-TOKENS, None))],
                         ids=["tokens-first-head", "tokens-last-tail"])
def test_a_cut_that_keeps_exactly_the_tokens_at_every_length_keeps_their_permutation(tokens_first, cut):
    model = noisy(CutTokens(tokens_first, cut))
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert_fuzzed_at_two_shapes(subject)
    assert [(g.kind, g.size) for g in _token_groups(subject)] == [("permutation", TOKENS)]
    assert _worst_change(subject, model, [1, 2, 3, 4, 5, 13]) < 1e-12


class TableCutByLength(nn.Module):
    """``table[:n]`` read without regard to order: at n = 5 rows 0..4 may be permuted, at n = 3 rows 3 and 4 are
    cut away, so no permutation of the rows the traced shape keeps is a symmetry."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))
        self.up, self.head = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.up(x)).mean(1) + torch.tanh(self.table[:x.shape[1]]).mean(0))


def test_rows_a_slice_by_length_keeps_are_pinned_with_those_it_cuts():
    subject = symgraph.load(noisy(TableCutByLength()), (torch.randn(2, 5, 4),))
    assert not any(m.param == "table" and m.axis == 0 for g in subject.report.groups for m in g.members)
    assert any(g.motif == "ffn" and g.size == 8 for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)


class TableHalvesCutByLength(TableCutByLength):
    """Per-position scales and shifts of the hidden units in one table, ``table[:n, :8]`` and ``table[:n, 8:]``:
    its rows follow the length, and each half's columns are the hidden units', read whole at every length."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        n = x.shape[1]
        return self.head(torch.relu(self.up(x) * self.table[:n, :8] + self.table[:n, 8:]).mean(1))


def test_columns_a_cut_drops_for_good_below_rows_cut_by_length_move_with_their_units():
    # the cut of each half drops the other half's columns from its tensor for good; asked whether it keeps other
    # labels at another length, it was compared with the rows too (another length keeps other rows) and pinned
    # the columns, and with them the hidden units
    subject = symgraph.load(noisy(TableHalvesCutByLength()), (torch.randn(2, 5, 4),))
    (ffn,) = [g for g in subject.report.groups if g.motif == "ffn" and g.kind == "permutation"]
    assert ffn.size == 8 and {("up.weight", 0), ("table", 1)} <= {(m.param, m.axis) for m in ffn.members}
    assert not any(m.param == "table" and m.axis == 0 for g in subject.report.groups for m in g.members)
    assert_fuzzed_at_two_shapes(subject)


class TableHalfCutByLength(TableHalvesCutByLength):
    """Only the scales, ``table[:n, :8]``: columns 8.. are never read."""

    def forward(self, x):
        return self.head(torch.relu(self.up(x) * self.table[:x.shape[1], :8]).mean(1))


def test_columns_a_cut_keeps_below_rows_cut_by_length_move_with_their_units():
    # columns 8.. are pinned, unread; the columns the cut keeps were pinned with them, as if another length could
    # cut them: the cut keeps other rows there, never other columns
    subject = symgraph.load(noisy(TableHalfCutByLength()), (torch.randn(2, 5, 4),))
    (ffn,) = [g for g in subject.report.groups if g.motif == "ffn" and g.kind == "permutation"]
    assert ffn.size == 8 and {("up.weight", 0), ("table", 1)} <= {(m.param, m.axis) for m in ffn.members}
    assert not any(m.param == "table" and m.axis == 0 for g in subject.report.groups for m in g.members)
    assert_fuzzed_at_two_shapes(subject)


class TableHalfUnitsCutByLength(TableHalvesCutByLength):
    """The units scaled by ``table[:n, :8]``, then cut at ``min(n + 2, 8)`` and padded back: unit 7 is dropped at
    length 5 and read from length 6 on, units 5-6 are dropped at length 3."""

    def forward(self, x):
        n = x.shape[1]
        h = torch.relu(self.up(x)) * self.table[:n, :8]
        return self.head(nn.functional.pad(h[..., :min(n + 2, 8)], (0, 8 - min(n + 2, 8))).mean(1))


def test_units_a_cut_by_length_drops_stay_where_they_are_beside_a_table():
    # the cut drops unit 7 of h, which the product reads: with the table's columns no longer pinned with its rows,
    # only the check of coordinates dropped for good sees it, which skipped a cut dropping one coordinate
    subject = symgraph.load(noisy(TableHalfUnitsCutByLength()), (torch.randn(2, 5, 4),))
    assert not any(g.size == 7 for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)


class TableCutFixed(TableCutByLength):
    """``table[:6]`` at any length: rows 6.. are never read, and rows 0..5 may be permuted (LongCat-Flash's experts
    read the first entries of a parameter that also holds its identity experts' unused ones)."""

    def forward(self, x):
        return self.head(torch.relu(self.up(x)).mean(1) + torch.tanh(self.table[:6]).mean(0))


def test_rows_a_fixed_slice_keeps_may_permute_and_the_rows_it_cuts_stay():
    subject = symgraph.load(noisy(TableCutFixed()), (torch.randn(2, 5, 4),))
    (rows,) = [g for g in subject.report.groups if any(m.param == "table" and m.axis == 0 for m in g.members)]
    assert rows.kind == "permutation" and rows.size == 6
    assert_fuzzed_at_two_shapes(subject)


class ChunkTokens(CutTokens):
    """The same tokens after the activations, the whole split in halves (``chunk(2)``), each half read by its own
    MLP: at 3 or more rows of activations every token is in the second half, at 2 rows token 0 is in the first."""

    def __init__(self, tokens_first: bool = False, cut: slice | None = None):
        super().__init__(tokens_first, cut)
        self.first = nn.Linear(WIDTH, WIDTH)

    def forward(self, patches):
        x = self.embed(patches)
        first, second = torch.cat([x, self.tokens.expand(x.shape[0], -1, -1)], 1).chunk(2, 1)
        return self.head(torch.relu(self.first(first)).mean(1) + torch.relu(self.mix(second)).mean(1))


@pytest.mark.parametrize("model", [CutTokens(tokens_first=False, cut=slice(2, None)), ChunkTokens()],
                         ids=["cut-at-2", "chunk-in-halves"])
def test_a_cut_that_moves_only_at_the_shortest_lengths_pins_the_token_axis(model):
    # the probe lengths (5 traced, 13 and 3) all keep every token; length 1 (cut at 2) or 2 (halves) does not, and
    # the token permutation emitted from the probes alone changed the outputs there (relative 0.2-0.7, float64)
    model = noisy(model)
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert not _token_groups(subject)
    assert _worst_change(subject, model, [1, 2, 3, 4, 5, 13]) < 1e-12
    assert any(g.motif == "ffn" for g in subject.report.groups)


class PairedTokens(CutTokens):
    """The tokens beside the activations, every two positions summed (a reshape into pairs, or unfold into windows
    of two, either dropping an odd last position): a sum of two tokens is the same in either order, so a
    permutation of the tokens that share a pair looked free. Which tokens share a pair moves with the length when
    they come last (tokens 1 and 2 at an odd length of activations, tokens 0 and 1 at an even one), not when they
    come first (tokens 0 and 1 always)."""

    def forward(self, patches):
        x = self.embed(patches)
        tokens = self.tokens.expand(x.shape[0], -1, -1)
        both = torch.cat([tokens, x] if self.tokens_first else [x, tokens], 1)
        if self.cut == "unfold":
            pairs = both.unfold(1, 2, 2).sum(-1)
        else:
            pairs = both[:, : both.shape[1] // 2 * 2].unflatten(1, (-1, 2)).sum(2)
        return self.head(torch.relu(self.mix(pairs)).mean(1))


@pytest.mark.parametrize("windows", ["unfold", "unflatten"])
def test_a_reshape_that_pairs_other_tokens_at_another_length_pins_them(windows):
    # traced at length 5, tokens 1 and 2 share a pair; at length 4 tokens 0 and 1 do, and swapping 1 and 2 changed
    # the outputs by 0.2-0.3 at every even length (float64); fuzz drew only the identity of that pair at 3 samples
    model = noisy(PairedTokens(tokens_first=False, cut=windows))
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert not _token_groups(subject)
    assert _worst_change(subject, model, [1, 2, 3, 4, 5, 6, 13]) < 1e-12
    assert any(g.motif == "ffn" for g in subject.report.groups)
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("windows", ["unfold", "unflatten"])
def test_a_reshape_that_pairs_the_same_tokens_at_every_length_keeps_their_permutation(windows):
    model = noisy(PairedTokens(tokens_first=True, cut=windows))
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert [(g.kind, g.size) for g in _token_groups(subject)] == [("permutation", 2)]
    assert _worst_change(subject, model, [1, 2, 3, 4, 5, 6, 13]) < 1e-12
    assert_fuzzed_at_two_shapes(subject)


class TokensThroughFlatBatch(CutTokens):
    """The tokens after the activations, batch and token axes flattened and viewed back (as mixtures of experts
    route ``hidden.view(-1, d)``): the view splits the flat axis into batch and tokens, each batch row holds every
    token, and where a token sits along the token axis moves with the length as it did before the reshape."""

    def forward(self, patches):
        x = self.embed(patches)
        both = torch.cat([x, self.tokens.expand(x.shape[0], -1, -1)], 1)
        back = both.reshape(-1, WIDTH).view(both.shape[0], -1, WIDTH)
        return self.head(torch.relu(self.mix(back)).mean(1))


def test_a_view_back_from_flattened_batch_and_tokens_keeps_the_token_permutation():
    model = noisy(TokensThroughFlatBatch(tokens_first=False, cut=None))
    subject = symgraph.load(model, (torch.randn(2, 5, PATCH),))
    assert [(g.kind, g.size) for g in _token_groups(subject)] == [("permutation", TOKENS)]
    assert _worst_change(subject, model, [1, 2, 3, 4, 5, 6, 13]) < 1e-12
    assert_fuzzed_at_two_shapes(subject)


class CutAtValue(nn.Module):
    """A cut at bounds computed from values (``.item()``: torch.export knows them only at run time): the hidden
    unit that the argmax of a learned vector picks, read beside the usual output."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.pick = nn.Linear(PATCH, WIDTH), nn.Linear(WIDTH, 3), nn.Parameter(torch.randn(WIDTH))

    def forward(self, patches):
        h = torch.relu(self.up(patches))
        unit = self.pick.argmax().item()
        return self.down(h).mean(1) + h[..., unit:unit + 1].mean(1)


def test_a_cut_at_bounds_known_only_at_run_time_pins_what_it_picks():
    # the analysis failed on this graph (AnalysisError: a stand-in for the bounds cut the labels to nothing); the
    # cut picks its unit by values, like indices of unknown values, so the hidden units are pinned
    subject = symgraph.load(noisy(CutAtValue()), (torch.randn(2, 5, PATCH),))
    assert not any(m.param == "up.weight" and m.axis == 0 for g in subject.report.groups for m in g.members)
    assert any("indices that depend on the weights" in p.reason and "up.weight" in p.params
               for p in subject.report.pinned)
    assert_fuzzed_at_two_shapes(subject)


def test_the_lookup_of_a_cut_reads_each_distinct_origin_and_label_pair_once():
    # one integer key per pair instead of unique along a dimension (40 s of a YOLOS analysis at 6,912 patches)
    from symgraph.analysis.cuts import _distinct_pairs

    generator = torch.Generator().manual_seed(0)
    for n in (0, 1, 9, 500):
        origins = torch.randint(-2, 40, (n,), generator=generator)
        labels = torch.randint(-1, 7, (n,), generator=generator)
        expected = torch.unique(torch.stack([origins, labels]), dim=1) if n else torch.stack([origins, labels])
        got = _distinct_pairs(origins, labels)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
