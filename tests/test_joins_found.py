"""Forms whose group the analysis pinned although it holds: two streams joined by ``torch.lerp``, pieces joined by
``hstack`` / ``vstack`` / ``dstack`` / ``column_stack``, a product with a fixed permutation matrix (``h @
torch.eye(d)``), the untouched heads beside one head treated apart, and a linear layer with no input features.
Each is found (kind and size), fuzzed in float64 at two input shapes and checked by applying sampled elements at
shapes other than the traced one; each has a control where the group must not hold."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph

from group_checks import census
from test_found_groups import assert_holds, load

D, H = 8, 12


# --- lerp ---------------------------------------------------------------------------------------------------------
class Lerp(nn.Module):
    """Two ReLU layers joined by ``lerp`` with ``weight`` "scalar", "parameter" (one per unit), "buffer" (data
    that differs per unit: a control) or "0-d" (a 0-d tensor)."""

    def __init__(self, weight: str):
        super().__init__()
        self.weight = weight
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(H, 3)
        self.t = nn.Parameter(torch.rand(H))
        self.register_buffer("fixed", torch.rand(H))

    def forward(self, x):
        t = {"scalar": 0.3, "parameter": self.t, "buffer": self.fixed, "0-d": self.fixed[0]}[self.weight]
        return self.c(torch.lerp(torch.relu(self.a(x)), torch.relu(self.b(x)), t))


@pytest.mark.parametrize("weight", ["scalar", "parameter", "0-d"])
def test_lerp_joins_two_streams_that_permute_together(weight):
    model, subject = load(Lerp(weight), torch.randn(2, 5, D))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


def test_lerp_by_a_fixed_weight_per_unit_pins_the_units():
    _, subject = load(Lerp("buffer"), torch.randn(2, 5, D))
    assert not subject.report.groups, census(subject)


class LerpStream(nn.Module):
    """An embedding stream and a linear layer of it joined by a scalar ``lerp``: the stream keeps GL(D)."""

    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(20, D), nn.Linear(D, D), nn.Linear(D, 5)

    def forward(self, ids):
        e = self.emb(ids)
        return self.head(torch.lerp(e, self.lin(e), 0.3))


def test_a_scalar_lerp_keeps_the_streams_linear_maps():
    model, subject = load(LerpStream(), torch.randint(0, 20, (2, 5)))
    assert census(subject) == {"residual general_linear 8x1": 1}
    assert_holds(model, subject, [(3, 7), (1, 2)])


# --- hstack, vstack, dstack, column_stack ---------------------------------------------------------------------
class Stacked(nn.Module):
    """Two ReLU layers joined by ``torch.<join>`` into one linear layer; "hstack 1-d" joins rows of one token."""

    def __init__(self, join: str):
        super().__init__()
        self.join = join
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(2 * H, 3)

    def forward(self, x):
        a, b = torch.relu(self.a(x)), torch.relu(self.b(x))
        if self.join == "hstack 1-d":
            return torch.stack([self.c(torch.hstack([p, q])) for p, q in zip(a.unbind(0), b.unbind(0))])
        if self.join == "vstack":  # rows of one after rows of the other, the halves set side by side again
            y = torch.vstack([a, b])
            return self.c(torch.cat([y[:x.shape[0]], y[x.shape[0]:]], -1))
        return self.c(getattr(torch, self.join)([a, b]))


@pytest.mark.parametrize("join, shape", [("hstack", (5, D)), ("column_stack", (5, D)), ("dstack", (2, 5, D))])
def test_pieces_joined_along_the_units_permute_apart(join, shape):
    model, subject = load(Stacked(join), torch.randn(*shape))
    assert census(subject) == {"ffn permutation/positive 12x1": 2}
    assert_holds(model, subject, [(7, *shape[1:]), (1, *shape[1:])] if len(shape) == 2 else [(3, 7, D), (1, 2, D)])


def test_pieces_joined_along_the_rows_permute_together():
    model, subject = load(Stacked("vstack"), torch.randn(5, D))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}
    assert_holds(model, subject, [(7, D), (1, D)])


def test_one_axis_pieces_that_hstack_reshapes_first_pin():
    _, subject = load(Stacked("hstack 1-d"), torch.randn(3, D))
    assert not subject.report.groups, census(subject)


# --- a fixed permutation matrix ---------------------------------------------------------------------------------
class Reordered(nn.Module):
    """A ReLU layer times a constant matrix: ``form`` "eye" (``h @ eye``), "permutation" (a shuffled eye),
    "linear" (``F.linear(h, permutation)``), "twice eye" (no permutation: a control) or "plus" (``h @ P + h``,
    which ties each unit to another: a control)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a, self.c = nn.Linear(D, H), nn.Linear(H, 3)
        matrix = torch.eye(H) if form == "eye" else 2 * torch.eye(H) if form == "twice eye" else \
            torch.eye(H)[torch.randperm(H, generator=torch.Generator().manual_seed(0))]
        self.register_buffer("matrix", matrix)

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.form == "linear":
            return self.c(F.linear(h, self.matrix))
        return self.c(h @ self.matrix + (h if self.form == "plus" else 0))


@pytest.mark.parametrize("form", ["eye", "permutation", "linear"])
def test_a_fixed_permutation_matrix_moves_the_units_along(form):
    model, subject = load(Reordered(form), torch.randn(2, 5, D))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


@pytest.mark.parametrize("form", ["twice eye", "plus"])
def test_a_matrix_that_does_not_only_reorder_pins(form):
    _, subject = load(Reordered(form), torch.randn(2, 5, D))
    assert not subject.report.groups, census(subject)


class InputMatrix(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.c = nn.Linear(D, H), nn.Linear(H, 3)

    def forward(self, x, matrix):
        return self.c(torch.relu(self.a(x)) @ matrix)


def test_an_input_that_is_a_permutation_matrix_when_traced_pins():
    """The example input's values say nothing of the next input's: ``torch.eye`` there is no fixed reordering."""
    torch.manual_seed(1)
    subject = symgraph.load(InputMatrix().double(), (torch.randn(2, 5, D, dtype=torch.float64),
                                                     torch.eye(H, dtype=torch.float64)))
    assert not subject.report.groups, census(subject)


# --- heads beside one head treated apart -----------------------------------------------------------------------
class OneHeadApart(nn.Module):
    """Three heads (or ``heads``) of size 4; the queries of head 0 are shifted by a constant (``form`` "shift"),
    scaled, or left as they are ("same"), then joined to the others again."""

    def __init__(self, form: str, heads: int = 3):
        super().__init__()
        self.form, self.heads = form, heads
        self.q, self.k, self.v, self.o = (nn.Linear(4 * heads, 4 * heads) for _ in range(4))

    def forward(self, x):
        n, t, _ = x.shape
        q, k, v = (f(x).view(n, t, self.heads, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        first = {"shift": lambda z: z + 1.0, "scale": lambda z: z * 2.0, "same": lambda z: z}[self.form]
        q = torch.cat([first(q[:, :1]), q[:, 1:]], 1)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(n, t, 4 * self.heads))


@pytest.mark.parametrize("form", ["shift", "scale"])
def test_the_untouched_heads_permute_among_themselves(form):
    model, subject = load(OneHeadApart(form), torch.randn(2, 5, D + 4))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert [(g.kind, g.size) for g in heads] == [("permutation", 2)]
    assert {int(i) // 4 for m in heads[0].members if m.param == "q.weight" for i in m.index.reshape(-1)} == {1, 2}
    assert_holds(model, subject, [(3, 7, D + 4), (1, 2, D + 4)])


@pytest.mark.parametrize("form, expected", [
    ("shift", {"qk permutation 4x1": 1, "qk orthogonal 4x1": 1, "qk scale/nonzero 1x1": 1, "vo orthogonal 4x2": 1}),
    ("scale", {"qk orthogonal 4x2": 1, "qk scale/nonzero 1x2": 1, "vo orthogonal 4x2": 1}),
    ("same", {"qk orthogonal 4x2": 1, "qk scale/nonzero 1x2": 1, "vo orthogonal 4x2": 1, "heads permutation 2x1": 1}),
])
def test_two_heads_cut_apart_and_joined_keep_a_group_each(form, expected):
    """With two heads each piece is one head wide: no channel varies along the heads axis of either piece, but
    both are cut from it, so the join is no concatenation along a data axis (which tied the two heads' maps)."""
    model, subject = load(OneHeadApart(form, heads=2), torch.randn(2, 5, 8))
    assert census(subject) == expected
    assert_holds(model, subject, [(3, 7, 8), (1, 2, 8)])


# --- a linear layer with no input features ----------------------------------------------------------------------
class NoFeatures(nn.Module):
    """A ReLU layer, and a ``Linear(0, 3)`` (its bias alone) of an empty slice of it or of the input."""

    def __init__(self, read: str):
        super().__init__()
        self.read = read
        self.a, self.c, self.empty = nn.Linear(D, H), nn.Linear(H, 3), nn.Linear(0, 3)

    def forward(self, x):
        h = self.a(x)
        source = {"units": h[..., []], "input": x[..., :0]}[self.read]
        return self.c(torch.relu(h)) + self.empty(source)


@pytest.mark.parametrize("read", ["units", "input"])
def test_a_linear_layer_with_no_input_features_is_read(read):
    with pytest.warns(UserWarning, match="zero-element"):
        module = NoFeatures(read)
    model, subject = load(module, torch.randn(2, 5, D))
    assert census(subject) == {"ffn permutation/positive 12x1": 1}  # the empty slice reads no unit
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])
