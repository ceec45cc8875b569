"""symgraph.verify: a result stored in float32 may miss the fixed tolerance by its own rounding floors, no further,
and only where its elements, applied without rounding, are exact; one stored in bf16/fp16 only where, besides, every
stored tensor is the rounding of theirs."""
from __future__ import annotations

import copy
import dataclasses
import importlib
import json

import numpy as np
import pytest
import torch

import symgraph
from symgraph.elements import apply
from symgraph.verify import ROUNDING_FLOORS, ROUNDINGS, TOLERANCE, Evaluator, tie_aliases


def _cancelling_model() -> torch.nn.Module:
    """Linear, ReLU, linear, whose outputs are differences of hidden units that nearly cancel: about 1e-4 of the
    hidden activations, so one float32 rounding of rescaled weights moves them by far more than 2e-5 of themselves."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 16, bias=False), torch.nn.Linear(16, 2, bias=False)
    with torch.no_grad():
        rows = torch.randn(8, 6)
        first.weight.copy_(torch.stack([rows, rows + 1e-4 * torch.randn(8, 6)], 1).reshape(16, 6))
        second.weight.copy_(torch.tensor([1.0, -1.0] * 8).repeat(2, 1) * torch.tensor([[1.0], [0.5]]))
    return torch.nn.Sequential(first, torch.nn.ReLU(), second)


def _moved():
    """The model, its evaluator, an element of its FFN group (units permuted and rescaled: ReLU is positively
    homogeneous), and its state moved by it in float64 and stored in float32."""
    model = _cancelling_model()
    inputs = (torch.randn(3, 6),)
    elements = symgraph.sample_elements(symgraph.analyze(model, inputs=inputs), seed=1)
    assert len(elements) == 1 and not np.allclose(elements[0].diag, 1.0)  # scales: the stored state is rounded
    state = {k: v.float() for k, v in apply(model.state_dict(), elements).items()}
    return model, Evaluator(model, inputs), elements, state


def test_a_sound_result_rounded_once_passes_by_its_own_floor():
    _, evaluator, elements, state = _moved()
    fixed = evaluator.check(state, elements)
    assert fixed.relative_error > TOLERANCE[torch.float32] and not fixed.ok  # the fixed tolerance refuses it
    floor = evaluator.rounding_floor(state)
    allowed = evaluator.check(state, elements, rounding_floor=True)
    assert allowed.ok and allowed.tolerance == ROUNDING_FLOORS * floor and allowed.relative_error < 10 * floor
    halves = {k: v.to(torch.bfloat16) for k, v in state.items()}  # bf16: floors near a change of function
    assert evaluator.check(halves, elements, rounding_floor=True).tolerance == TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_result_passes_only_as_the_rounding_of_exact_elements(dtype):
    """Rounded to bf16/fp16 the cancelling model's moved state misses by far more than the fixed tolerance (its
    outputs are differences of nearly equal units); it passes because its elements are exact in float64 and each
    stored tensor is one rounding of theirs. Moved three roundings further, or claimed from an element that is no
    symmetry, or with no elements, it is refused."""
    model, evaluator, elements, _ = _moved()
    exact = apply(model.state_dict(), elements)
    stored = {k: v.to(dtype) for k, v in exact.items()}
    fixed = evaluator.check(stored, elements)
    assert not fixed.ok and fixed.rounded_exact is None and fixed.relative_error > 10 * TOLERANCE[dtype]
    passed = evaluator.check(stored, elements, rounding_floor=True)
    rounded = passed.rounded_exact
    assert passed.ok and passed.relative_error == fixed.relative_error
    assert rounded.exact_error < 1e-9 and 0.1 < rounded.roundings <= 1 and "rounding of an exact result" in \
        passed.describe()
    u = torch.finfo(dtype).eps / 2
    sign = torch.randn(exact["0.weight"].shape, generator=torch.Generator().manual_seed(0)).sign()
    moved = {**stored, "0.weight": (exact["0.weight"] * (1 + 3 * u * sign)).to(dtype)}
    far = evaluator.check(moved, elements, rounding_floor=True)
    assert not far.ok and far.rounded_exact.tensor == "0.weight" and ROUNDINGS < far.rounded_exact.roundings < 4
    group = elements[0].group
    claimed = [dataclasses.replace(elements[0], group=dataclasses.replace(group, members=group.members[:1]))]
    unsound = evaluator.check(stored, claimed, rounding_floor=True)
    assert not unsound.ok and unsound.rounded_exact.exact_error > 1e-3
    assert not evaluator.check(stored, (), rounding_floor=True).ok  # no elements (a fold): the fixed tolerance


def test_no_allowance_without_exact_elements():
    model, evaluator, elements, state = _moved()
    # the same stored state, said to come from an element that is no symmetry (its second layer's member dropped)
    group = elements[0].group
    claimed = [dataclasses.replace(elements[0], group=dataclasses.replace(group, members=group.members[:1]))]
    assert not evaluator.check(state, claimed, rounding_floor=True).ok
    assert not evaluator.check(state, (), rounding_floor=True).ok  # no elements (a fold): the fixed tolerance
    unsound = {**state, "2.weight": model.state_dict()["2.weight"]}  # the second layer not moved back
    wrong = evaluator.check(unsound, elements, rounding_floor=True)
    assert not wrong.ok and wrong.relative_error > 1e3 * TOLERANCE[torch.float32]


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_the_floor_nudges_tied_names_alike():
    model = Tied()
    evaluator = Evaluator(model, (torch.tensor([[1, 2, 3]]),))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    floor = evaluator.rounding_floor(state)  # tied names nudged differently would be refused as two tensors
    assert 0 < floor < 1e-6


def test_tied_names_are_one_tensor_when_a_bf16_state_is_compared_with_its_exact_result(monkeypatch):
    """An embedding tied to the head, rotated (its orthogonal group) and stored in bf16: the rounded route compares
    the tensor the model holds, so the tie passes; the fixed tolerance lowered below the rounding's change."""
    torch.manual_seed(0)
    model, inputs = Tied(), (torch.tensor([[1, 2, 3]]),)
    elements = symgraph.sample_elements(symgraph.analyze(model, inputs=inputs), seed=1)
    assert [e.group.kind for e in elements] == ["orthogonal"]
    state = {k: v.to(torch.bfloat16) for k, v in tie_aliases(model, apply(model.state_dict(), elements)).items()}
    monkeypatch.setitem(TOLERANCE, torch.bfloat16, 1e-7)
    outcome = Evaluator(model, inputs).check(state, elements, rounding_floor=True)
    assert outcome.relative_error > 1e-4 and outcome.ok and outcome.rounded_exact.roundings <= 1


@pytest.fixture
def bf16_llamas(tmp_path):
    """Two independent tiny LLaMAs saved in bf16."""
    from symgraph import zoo
    from symgraph.io import model_config, save_model

    return [save_model({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, tmp_path / f"m{seed}",
                       config=model_config(model))
            for seed, model in ((seed, zoo.build("llama", seed=seed)) for seed in (0, 1))]


def test_the_command_line_says_how_a_bf16_alignment_past_its_tolerance_passed(tmp_path, monkeypatch, bf16_llamas):
    """bf16 LLaMAs aligned through `symgraph align`: with the fixed tolerance lowered below what their rounding
    changes (as a more sensitive checkpoint would meet it) the result is still written, and the summary and the
    stats file say it passed as an exact result rounded; at the real tolerance the summary does not."""
    from cli_runner import run

    plain = run("align", bf16_llamas[1], bf16_llamas[0], "-o", tmp_path / "plain", "--mode", "paper")
    assert plain.returncode == 0, plain.stderr
    assert "past the fixed tolerance" not in plain.stdout
    monkeypatch.setitem(TOLERANCE, torch.bfloat16, 1e-6)
    res = run("align", bf16_llamas[1], bf16_llamas[0], "-o", tmp_path / "out", "--mode", "paper",
              "--stats", tmp_path / "stats.json")
    assert res.returncode == 0, res.stderr
    assert "past the fixed tolerance, but computed without rounding to the stored dtype it changes" in res.stdout
    rounded = json.loads((tmp_path / "stats.json").read_text())["verified_rounded_exact"]
    assert rounded["exact_error"] <= rounded["exact_tolerance"] and 0 < rounded["roundings"] <= ROUNDINGS


def test_a_bf16_fold_past_its_tolerance_passes_as_its_float64_rewrite_rounded(tmp_path, monkeypatch, bf16_llamas):
    """`symgraph fold` of a bf16 LLaMA, the fixed tolerance lowered below what rounding the folded weights
    changes: written, as the same rewrite in float64 computes what the model computes and each folded tensor is its
    rounding; a rewrite that is wrong in float64 as well (a reader's column scaled) is refused all the same."""
    from cli_runner import run

    fold_module = importlib.import_module("symgraph.fold")  # symgraph.fold is also the function
    monkeypatch.setitem(TOLERANCE, torch.bfloat16, 1e-6)
    res = run("fold", bf16_llamas[0], "-o", tmp_path / "out", "--json", tmp_path / "fold.json")
    assert res.returncode == 0, res.stderr
    assert "past the fixed tolerance, but computed without rounding" in res.stdout
    rounded = json.loads((tmp_path / "fold.json").read_text())["verified_rounded_exact"]
    assert rounded["exact_error"] <= rounded["exact_tolerance"] and 0 < rounded["roundings"] <= ROUNDINGS
    folded = fold_module._folded_params

    def wrong(state, norms):  # every folded reader's first column doubled, in float64 too
        return {k: torch.cat([2 * v[:, :1], v[:, 1:]], 1) if v.dim() == 2 else v
                for k, v in folded(state, norms).items()}

    monkeypatch.setattr(fold_module, "_folded_params", wrong)
    refused = run("fold", bf16_llamas[0], "-o", tmp_path / "wrong")
    assert refused.returncode != 0 and "not the rounding of an exact result" in refused.stderr
    assert not (tmp_path / "wrong").exists()


class _SharedOutputLM(torch.nn.Module):
    """Two attention blocks whose output projection is one module (``blocks[1].o = blocks[0].o``)."""

    def __init__(self, width=16, heads=4, vocab=50):
        super().__init__()
        self.heads = heads
        self.embed, self.head = torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({n: torch.nn.Linear(width, width) for n in "qkvo"})
                                          for _ in range(2))
        self.blocks[1].o = self.blocks[0].o

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            b, n, _ = x.shape
            q, k, v = (block[m](x).view(b, n, self.heads, -1).transpose(1, 2) for m in "qkv")
            attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["o"](attended.transpose(1, 2).reshape(b, n, -1))
        return self.head(x)


def test_a_module_used_in_two_places_is_evaluated_with_the_state_given_every_time():
    """``functional_call`` rewrites the state dict it is given where one module is reached by two names, and the
    evaluator passed one dict to the runs at every probe shape: the valid groups of a model sharing a module
    between blocks failed their check at every shape after the first (relative change 0.3-0.6), and ``transform``
    refused the model."""
    torch.manual_seed(0)
    model = _SharedOutputLM().eval()
    ids = torch.randint(0, 50, (2, 7))
    subject = symgraph.load(model, (ids,))
    assert any(g.motif == "vo" for g in subject.report.groups)
    moved = symgraph.transform(subject, seed=1)  # checked in float64 at every probe shape, or refused
    assert not torch.equal(moved["blocks.0.o.weight"], model.state_dict()["blocks.0.o.weight"])


class _UpcastBeforeALinear(torch.nn.Module):
    """An FFN whose output is cast to float32 before a linear whose weight is in the model's dtype, as Inkling 2's
    router does (``F.linear(x.float(), self.weight)``): its float64 copy fails unless the cast stays float64."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(6, 8), torch.nn.Linear(8, 6)
        self.router = torch.nn.Parameter(torch.randn(3, 6))

    def forward(self, x):
        return torch.nn.functional.linear(self.down(torch.relu(self.up(x))).float(), self.router)


def test_a_model_that_casts_to_float32_is_checked_with_its_casts_kept_in_float64():
    model, inputs = _UpcastBeforeALinear(), (torch.randn(3, 6),)
    with pytest.raises(RuntimeError, match="dtype"):
        copy.deepcopy(model).double()(inputs[0].double())  # as it is, the float64 copy cannot run
    evaluator = Evaluator(model, inputs)
    assert evaluator.casts and evaluator.tolerance == TOLERANCE[torch.float64]  # every op computed in float64
    report = symgraph.analyze(model, inputs=inputs)
    elements = symgraph.sample_elements(report, seed=1)
    assert "ffn" in {g.motif for g in report.groups} and elements  # the FFN's units, and the map into the router
    moved = apply(model.state_dict(), elements)
    assert evaluator.check(moved).ok
    broken = dict(moved, **{"up.weight": moved["up.weight"].flip(0)})  # rows swapped without the down projection's
    assert not evaluator.check(broken).ok
    assert not Evaluator(torch.nn.Linear(6, 3), inputs).casts  # a model that runs in float64 runs as it is
