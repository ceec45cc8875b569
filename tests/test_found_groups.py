"""Groups the analysis used to miss although they hold: top-1 routing by argmax, per-channel PReLU slopes, a mean
absolute value over the stream, channel shuffles, nn.Bilinear, pooling over channels of which some are raw input,
and towers met by an elementwise maximum. Each form is found (kind and size), fuzzed in float64 at two input
shapes, and checked again by applying sampled elements of every group and comparing outputs at two shapes other
than the traced one; each has a control where the group must not hold."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import symgraph
from symgraph.elements import apply_to_model, sample

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H, E = 8, 12, 4


def load(model: nn.Module, *inputs):
    torch.manual_seed(1)
    model = noisy(model).double()
    return model, symgraph.load(model, tuple(x.double() if x.is_floating_point() else x for x in inputs))


def assert_elements_keep_the_function(model: nn.Module, subject, inputs: list[torch.Tensor]) -> None:
    """Sampled elements of every group applied to ``model`` at once leave its outputs on ``inputs`` unchanged."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        moved = apply_to_model(model, [sample(g, rng) for g in subject.report.groups])
        for x in inputs:
            with torch.no_grad():
                ref, out = model(x), moved(x)
            assert torch.allclose(out, ref, rtol=1e-9, atol=1e-9), float((out - ref).abs().max())


def assert_holds(model, subject, shapes: list[tuple]) -> None:
    """Fuzzed at two shapes, and sampled elements checked on random inputs of ``shapes`` (token ids when
    ``model`` starts with an embedding)."""
    assert_fuzzed_at_two_shapes(subject)
    ids = isinstance(getattr(model, "emb", None), nn.Embedding)
    assert_elements_keep_the_function(model, subject, [
        torch.randint(0, model.emb.num_embeddings, s) if ids else torch.randn(*s, dtype=torch.float64)
        for s in shapes])


# --- top-1 routing by argmax ----------------------------------------------------------------------------------
class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


class Top1(nn.Module):
    """A top-1 MoE routed by ``argmax``: ``form`` "one_hot" (mask times the probabilities), "gather" (the chosen
    probability), "argmin" (of minus the logits), or "read" (the index also added as a number: a control)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.router, self.head = nn.Linear(D, E), nn.Linear(D, 3)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        logits = self.router(x)
        p = logits.softmax(-1)
        i = (-logits).argmin(-1) if self.form == "argmin" else logits.argmax(-1)
        mask = F.one_hot(i, E).to(x.dtype)
        m = mask * p.gather(-1, i[..., None]) if self.form == "gather" else mask * p
        y = sum(m[..., e:e + 1] * self.experts[e](x) for e in range(E))
        if self.form == "read":
            y = y + i[..., None].to(x.dtype)
        return self.head(x + y)


@pytest.mark.parametrize("form", ["one_hot", "gather", "argmin"])
def test_argmax_routing_keeps_the_expert_permutation(form):
    model, subject = load(Top1(form), torch.randn(2, 5, D))
    found = census(subject)
    assert found.get("experts permutation 4x1") == 1, found
    assert found.get("ffn permutation 12x1") == E, found
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


def test_argmax_routing_whose_index_is_also_read_as_a_number_pins_the_experts():
    _, subject = load(Top1("read"), torch.randn(2, 5, D))
    assert not subject.report.by_motif("experts"), census(subject)


class Feature(nn.Module):
    """argmax over a hidden layer's units: ``form`` "one_hot" (the winner's mask times the units), "gather" (the
    largest unit scales the output), "table" (the winner's row of a table of one row per unit is added), "read"
    (the index as a number), "flat" (argmax over every axis) or "long table" (a table with more rows than units)."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, 3)
        self.table = nn.Embedding(H + 8 if form == "long table" else H, D)

    def forward(self, x):
        h = self.a(x)
        if self.form in ("table", "long table"):
            return self.c(self.b(torch.relu(h)) + self.table(h.argmax(-1)))
        if self.form == "one_hot":
            return self.c(self.b(F.one_hot(h.argmax(-1), H).to(x.dtype) * h))
        if self.form == "gather":
            return self.c(self.b(torch.relu(h)) * h.gather(-1, h.argmax(-1, keepdim=True)))
        index = h.argmax(-1, keepdim=True) if self.form == "read" else h.argmax()
        return self.c(self.b(torch.relu(h))) + index.to(x.dtype)


@pytest.mark.parametrize("form, group", [("one_hot", "experts permutation 12x1"), ("gather", "ffn permutation 12x1"),
                                         ("table", "ffn permutation 12x1")])
def test_argmax_over_units_lets_them_permute(form, group):
    model, subject = load(Feature(form), torch.randn(2, 5, D))
    assert census(subject).get(group) == 1, census(subject)
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


@pytest.mark.parametrize("form", ["read", "flat", "long table"])
def test_argmax_read_as_a_number_pins_the_units(form):
    _, subject = load(Feature(form), torch.randn(2, 5, D))
    assert not [g for g in subject.report.groups if g.size == H], census(subject)


class Ties(nn.Module):
    """A choice among ReLU units, most of them 0 for most tokens (a negative bias): ties broken by position."""

    def __init__(self, choose):
        super().__init__()
        self.choose = choose
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, 3)
        with torch.no_grad():
            self.a.bias.fill_(-1.5)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.c(self.b(F.one_hot(self.choose(h), H).to(x.dtype) * (h + 1)))


@pytest.mark.parametrize("choose", [lambda h: h.argmax(-1), lambda h: h.topk(1, -1).indices[..., 0],
                                    lambda h: torch.clamp(h + 0.2, max=0.5).argmax(-1),
                                    lambda h: (h > 0.1).to(h.dtype).argmax(-1),
                                    lambda h: F.threshold(h, 0.3, 0.2).argmax(-1),
                                    lambda h: F.hardshrink(h - 0.2, 0.3).argmax(-1)],
                         ids=["argmax", "topk", "clamped", "mask", "threshold", "hardshrink"])
def test_a_choice_among_values_that_tie_keeps_the_units_in_place(choose):
    """argmax of all-zero units picks the first: after a permutation another unit is first (a ReLU's or a clamp's
    flat part, or a mask's two values, make equal values likely; the analysis followed top-k through them)."""
    torch.manual_seed(0)
    subject = symgraph.load(Ties(choose).double().eval(), (torch.randn(2, 5, D, dtype=torch.float64),))
    assert not [g for g in subject.report.groups if g.size == H], census(subject)
    assert_fuzzed_at_two_shapes(subject, samples=10)


class Masked(nn.Module):
    """Top-1 routing over router scores ("linear": any sign; "softmax", "sigmoid": positive) whose entries below
    the mean logit are set to ``fill`` first (as group-limited routers mask experts of groups not chosen); ranked
    by argmax or argmin."""

    def __init__(self, scores: str, fill: float, rank: str = "argmax"):
        super().__init__()
        self.scores, self.fill, self.rank = scores, fill, rank
        self.router, self.head = nn.Linear(D, E), nn.Linear(D, 3)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def forward(self, x):
        logits = self.router(x)
        p = logits.softmax(-1)
        s = {"linear": logits, "softmax": p, "sigmoid": logits.sigmoid()}[self.scores]
        keep = logits > logits.mean(-1, keepdim=True)  # never empty: the largest logit is kept
        masked = s.masked_fill(~keep, self.fill)
        i = masked.argmax(-1) if self.rank == "argmax" else masked.argmin(-1)
        y = F.one_hot(i, E).to(x.dtype) * p
        return self.head(x + sum(y[..., e:e + 1] * self.experts[e](x) for e in range(E)))


@pytest.mark.parametrize("scores, fill, rank", [("softmax", 0.0, "argmax"), ("sigmoid", -1.0, "argmax"),
                                                ("linear", -float("inf"), "argmax"),
                                                ("linear", float("inf"), "argmin")])
def test_masked_scores_whose_fill_ranks_last_keep_the_expert_permutation(scores, fill, rank):
    """Entries set to a number below every kept score (minus infinity, or 0 or less under positive scores) are never
    chosen while any entry is kept, so their ties do not matter."""
    model, subject = load(Masked(scores, fill, rank), torch.randn(2, 5, D))
    assert census(subject).get("experts permutation 4x1") == 1, census(subject)
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


@pytest.mark.parametrize("scores, fill, rank", [("linear", 0.0, "argmax"), ("softmax", 0.5, "argmax"),
                                                ("linear", float("inf"), "argmax"),
                                                ("linear", -float("inf"), "argmin")])
def test_masked_scores_whose_fill_can_win_keep_the_experts_in_place(scores, fill, rank):
    """A fill that can rank above kept scores (0 beside negative logits, a positive number, infinity first) is
    chosen among equal entries by position: after a permutation another expert is first (fuzz found it)."""
    torch.manual_seed(0)
    model = Masked(scores, fill, rank).double().eval()
    with torch.no_grad():
        model.router.bias.fill_(-3.0)  # kept logits mostly negative: the fill of 0 wins
    subject = symgraph.load(model, (torch.randn(2, 5, D, dtype=torch.float64),))
    assert not subject.report.by_motif("experts"), census(subject)
    assert_fuzzed_at_two_shapes(subject, samples=10)


# --- PReLU ----------------------------------------------------------------------------------------------------
class PRelu(nn.Module):
    """``Linear -> PReLU -> Linear``; ``slopes``: "channel" (one per unit), "shared" (one for all) or "buffer"
    (one per unit, but constants the model does not train: a control)."""

    def __init__(self, slopes: str):
        super().__init__()
        self.slopes = slopes
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(H, D), nn.Linear(D, 3)
        self.act = nn.PReLU(1 if slopes == "shared" else H)
        self.register_buffer("fixed", torch.rand(H))

    def forward(self, x):
        h = self.a(x).transpose(1, 2)  # units on axis 1, where PReLU reads its slopes
        h = F.prelu(h, self.fixed) if self.slopes == "buffer" else self.act(h)
        return self.c(self.b(h.transpose(1, 2)))


@pytest.mark.parametrize("slopes", ["channel", "shared"])
def test_prelu_units_permute_and_scale_with_their_slopes(slopes):
    """prelu_a(c x) = c prelu_a(x) for c > 0: the units permute (their slopes with them) and scale."""
    model, subject = load(PRelu(slopes), torch.randn(2, 5, D))
    assert census(subject).get("ffn permutation/positive 12x1") == 1, census(subject)
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


def test_prelu_units_take_no_sign_flip():
    """prelu_a(-x) is no +-prelu_a'(x): flipping one unit (a's row and bias, b's column) changes the output."""
    model, _ = load(PRelu("channel"), torch.randn(2, 5, D))
    flipped = PRelu("channel").double()
    flipped.load_state_dict(model.state_dict())
    with torch.no_grad():
        for t in (flipped.a.weight[0], flipped.a.bias[:1], flipped.b.weight[:, 0]):
            t.neg_()
    x = torch.randn(3, 7, D, dtype=torch.float64)
    assert not torch.allclose(flipped(x), model(x))


def test_prelu_slopes_that_are_constants_per_unit_pin_the_units():
    _, subject = load(PRelu("buffer"), torch.randn(2, 5, D))
    assert not [g for g in subject.report.groups if g.size == H], census(subject)


class HeadSlopes(nn.Module):
    """Attention whose output (batch, heads, length, d) goes through a PReLU with a slope per head (axis 1)."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.heads, self.qkv, self.o = heads, nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.act = nn.PReLU(heads)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = self.act(F.scaled_dot_product_attention(q, k, v))
        return self.o(out.transpose(1, 2).flatten(-2))


def test_prelu_slopes_per_head_keep_the_heads_in_place():
    """Slopes along the head axis would have to move with a head permutation: the heads are pinned (sound)."""
    model, subject = load(HeadSlopes(), torch.randn(2, 5, D))
    assert not subject.report.by_motif("heads"), census(subject)
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


def test_prelu_on_convolution_channels():
    model = nn.Sequential(nn.Conv2d(4, H, 3, padding=1), nn.PReLU(H), nn.Conv2d(H, 3, 1))
    model, subject = load(model, torch.randn(2, 4, 6, 6))
    assert census(subject).get("ffn permutation/positive 12x1") == 1, census(subject)
    assert_holds(model, subject, [(1, 4, 5, 7), (3, 4, 4, 4)])


# --- a mean absolute value over the stream -------------------------------------------------------------------
class AbsNorm(nn.Module):
    """Embedding, one block normalised by the mean absolute value of the stream, a head. ``cut``: the statistic
    reads only the first half of the stream (a control: the |x| are then read as values, not as a whole row)."""

    def __init__(self, cut: bool = False):
        super().__init__()
        self.cut = cut
        self.emb, self.head = nn.Embedding(20, D), nn.Linear(D, 20)
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def norm(self, t):
        size = t.abs()[..., :D // 2] if self.cut else t.abs()
        return t / (size.mean(-1, keepdim=True) + 1e-6)

    def forward(self, ids):
        x = self.emb(ids)
        x = x + self.b(F.silu(self.a(self.norm(x))))
        return self.head(self.norm(x))


def test_a_mean_absolute_value_passes_signed_permutations_of_the_stream():
    """mean(|P S x|) = mean(|x|) for a permutation P and signs S; a scale would change it."""
    model, subject = load(AbsNorm(), torch.randint(0, 20, (2, 6)))
    assert census(subject).get("residual signed_permutation 8x1") == 1, census(subject)
    assert_holds(model, subject, [(3, 7), (1, 2)])


def test_an_absolute_value_read_in_part_keeps_no_signed_permutation_of_the_stream():
    _, subject = load(AbsNorm(cut=True), torch.randint(0, 20, (2, 6)))
    assert not [g for g in subject.report.groups if g.kind == "signed_permutation" and g.size == D], census(subject)


# --- channel shuffle ------------------------------------------------------------------------------------------
def shuffled_by_hand(x, groups):
    b, c, h, w = x.shape
    return x.view(b, groups, c // groups, h, w).transpose(1, 2).reshape(b, c, h, w)


class Shuffle(nn.Module):
    """Grouped 1x1 convolutions around a channel shuffle (ShuffleNet): ``how`` "op" (F.channel_shuffle),
    "module" (nn.ChannelShuffle) or "hand" (view and transpose, which the analysis always read)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.c1, self.g, self.out = nn.Conv2d(4, D, 3, padding=1), nn.Conv2d(D, D, 1, groups=4), nn.Conv2d(D, 3, 1)
        self.shuffle = nn.ChannelShuffle(4)

    def forward(self, x):
        h = torch.relu(self.g(torch.relu(self.c1(x))))
        h = {"op": lambda: F.channel_shuffle(h, 4), "module": lambda: self.shuffle(h),
             "hand": lambda: shuffled_by_hand(h, 4)}[self.how]()
        return self.out(torch.relu(self.g(h)))


@pytest.mark.parametrize("how", ["op", "module"])
def test_a_channel_shuffle_keeps_the_groups_of_the_same_shuffle_by_hand(how):
    model, subject = load(Shuffle(how), torch.randn(2, 4, 6, 6))
    _, by_hand = load(Shuffle("hand"), torch.randn(2, 4, 6, 6))
    assert subject.report.groups and census(subject) == census(by_hand), (census(subject), census(by_hand))
    assert_holds(model, subject, [(1, 4, 5, 7), (3, 4, 4, 4)])


# --- nn.Bilinear ----------------------------------------------------------------------------------------------
class Bilinear(nn.Module):
    """``y = x1^T W_k x2 + b_k`` between a ReLU layer and a tanh layer, then a linear head."""

    def __init__(self):
        super().__init__()
        self.a, self.a2, self.c = nn.Linear(D, H), nn.Linear(D, H), nn.Linear(D, 3)
        self.bil = nn.Bilinear(H, H, D)

    def forward(self, x):
        return self.c(self.bil(torch.relu(self.a(x)), torch.tanh(self.a2(x))))


def test_bilinear_inputs_and_output_move_with_their_layers():
    """Each input's units move with the layer that writes them (W_k's axes 1 and 2 alike), the output's with
    the head (W's axis 0 and the bias)."""
    model, subject = load(Bilinear(), torch.randn(2, 5, D))
    found = census(subject)
    assert found.get("ffn permutation/positive 12x1") == 1, found
    assert found.get("ffn signed_permutation 12x1") == 1, found
    assert found.get("other general_linear 8x1") == 1, found
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


# --- pooling over channels some of which are raw input ----------------------------------------------------------
class PoolBeside(nn.Module):
    """A ReLU convolution's channels beside the raw input channels, pooled together, then a linear head."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(4, D, 3, padding=1), nn.Linear(D + 4, 3)

    def forward(self, x):
        z = torch.cat([torch.relu(self.conv(x)), x], 1)
        return self.head(F.adaptive_avg_pool2d(z, 1).flatten(1))


def test_pooling_beside_raw_channels_keeps_the_convolution_channels_free():
    model, subject = load(PoolBeside(), torch.randn(2, 4, 6, 6))
    assert census(subject) == {"ffn permutation/positive 8x1": 1}, census(subject)
    assert_holds(model, subject, [(1, 4, 5, 7), (3, 4, 4, 4)])


# --- towers met by an elementwise maximum -------------------------------------------------------------------------
class Towers(nn.Module):
    """Two ReLU MLP towers met by ``meet`` (torch.maximum or torch.minimum), then a head; ``reread``: the second
    tower's output is also added to the result (a control: the towers' roles then differ)."""

    def __init__(self, meet, reread: bool = False):
        super().__init__()
        self.meet, self.reread = meet, reread
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        t1, t2 = (t(x) for t in self.towers)
        y = self.meet(t1, t2)
        return self.head(y + t2 if self.reread else y)


@pytest.mark.parametrize("meet", [torch.maximum, torch.minimum], ids=["maximum", "minimum"])
def test_towers_met_by_an_elementwise_maximum_swap(meet):
    """max(t1, t2) = max(t2, t1): every tensor of one tower may move to the other's slot."""
    model, subject = load(Towers(meet), torch.randn(2, 5, D))
    assert census(subject).get("experts permutation 2x1") == 1, census(subject)
    assert_holds(model, subject, [(3, 7, D), (1, 2, D)])


def test_towers_whose_output_is_read_again_do_not_swap():
    _, subject = load(Towers(torch.maximum, reread=True), torch.randn(2, 5, D))
    assert not subject.report.by_motif("experts"), census(subject)
