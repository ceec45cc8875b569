"""Hand-written forms a third soundness pass tried: each one fuzzed in float64 at two input shapes, beside a
control that keeps the group the fixed form must not lose."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph

from group_checks import assert_fuzzed_at_two_shapes, census, noisy

D, H = 8, 12


class Cast(nn.Module):
    """``Linear -> relu(h) + f(h) -> Linear``, ``f`` a cast of the hidden units (or none)."""

    def __init__(self, cast):
        super().__init__()
        self.cast = cast
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.relu(h) * self.cast(h))


def cast_subject(cast):
    return symgraph.load(noisy(Cast(cast)).double(), (torch.randn(2, 5, D, dtype=torch.float64),))


@pytest.mark.parametrize("cast", [lambda h: h.long().double(), lambda h: h.bool().double(),
                                  lambda h: h.to(torch.int32).type_as(h)], ids=["long", "bool", "int32"])
def test_a_cast_to_integers_rounds_so_no_scale_passes_it(cast):
    """(2.4 c).long() is not c * 2: identity passed the ReLU's scale through the cast (the bool one took c twice)."""
    subject = cast_subject(cast)
    assert census(subject).get("ffn permutation 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


def test_a_cast_between_float_types_keeps_the_scale():
    subject = cast_subject(lambda h: h.float().double())
    assert census(subject).get("ffn scale/positive 12x1") == 1, census(subject)
    assert_fuzzed_at_two_shapes(subject)


class Rms(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(D))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class WeightedStream(nn.Module):
    """An embedding, one RMSNorm MLP block and a head; ``form`` multiplies a vector read from a parameter into the
    block: a norm-like weight of its own, the embedding's column sums, or the bias of the layer it multiplies; or
    adds the norm's weight to the stream."""

    def __init__(self, form: str, vocab: int = 11):
        super().__init__()
        self.form = form
        self.emb, self.norm, self.final = nn.Embedding(vocab, D), Rms(), Rms()
        self.a, self.b = nn.Linear(D, H), nn.Linear(H, D, bias=False)
        self.alpha = nn.Parameter(torch.ones(D))
        self.head = nn.Linear(D, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        h = torch.relu(self.a(self.norm(x)))
        if self.form == "own bias":
            h = h * self.a.bias
        out = self.b(h)
        if self.form == "embedding column sums":
            out = out * self.emb.weight.sum(0)
        if self.form == "weight of its own":
            out = out * self.alpha
        if self.form == "norm weight added":
            out = out + self.norm.weight
        return self.head(self.final(x + out))


def weighted_subject(form):
    return symgraph.load(noisy(WeightedStream(form)).double(), (torch.randint(0, 11, (2, 5)),))


@pytest.mark.parametrize("form", ["embedding column sums", "own bias", "norm weight added"])
def test_a_weight_vector_that_also_moves_as_a_coordinate_is_no_pure_weight(form):
    """A vector multiplied in as a weight was only permuted by every group, also where the same entries are an
    embedding's columns (signed with the stream), its own layer's bias (scaled with the ReLU units) or a vector
    added to the stream: the embedding lost its signs, the bias its scale, the added norm weight its signs."""
    subject = weighted_subject(form)
    assert_fuzzed_at_two_shapes(subject)


def test_a_weight_vector_of_its_own_keeps_the_signed_stream():
    subject = weighted_subject("weight of its own")
    kinds = census(subject)
    assert kinds.get("residual signed_permutation 8x1") == 1, kinds
    assert kinds.get("ffn permutation/positive 12x1") == 1, kinds
    assert_fuzzed_at_two_shapes(subject)


WEIGHT_NORMED = '''
import torch
from torch import nn


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(8, 12)), nn.ReLU(), nn.Linear(12, 8))
    return model, (torch.randn(2, 5, 8),)
'''


def test_a_module_holding_a_computed_weight_is_copied_checked_and_transformed(tmp_path):
    """torch.nn.utils.weight_norm keeps ``weight`` as a tensor computed from ``weight_g`` and ``weight_v`` (a
    pre-forward hook recomputes it), which ``copy.deepcopy`` refuses: the float64 check, ``apply_to_model`` and
    the command line's fuzz crashed with a RuntimeError from deepcopy."""
    from cli_runner import assert_fuzzed

    model = noisy(nn.Sequential(torch.nn.utils.weight_norm(nn.Linear(D, H)), nn.ReLU(), nn.Linear(H, D))).double()
    subject = symgraph.load(model, (torch.randn(2, 5, D, dtype=torch.float64),))
    assert census(subject).get("ffn permutation 12x1") == 1, census(subject)  # g would take a scale
    assert_fuzzed_at_two_shapes(subject)
    elements = symgraph.sample_elements(subject.report, seed=1)
    moved = symgraph.apply_to_model(model, elements)
    x = torch.randn(3, 4, D, dtype=torch.float64)
    with torch.no_grad():
        assert torch.allclose(moved(x), model(x), rtol=1e-10, atol=1e-12)
        assert not torch.equal(moved[0].weight_v, model[0].weight_v)
    factory = tmp_path / "weight_normed.py"
    factory.write_text(WEIGHT_NORMED)
    assert_fuzzed(f"{factory}:factory", tmp_path)
