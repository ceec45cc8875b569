"""symgraph.verify: a result stored in float32 may miss the fixed tolerance by its own rounding floors, no further,
and only where its elements, applied without rounding, are exact."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

import symgraph
from symgraph.elements import apply
from symgraph.verify import ROUNDING_FLOORS, TOLERANCE, Evaluator


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


def test_the_floor_nudges_tied_names_alike():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    model = Tied()
    evaluator = Evaluator(model, (torch.tensor([[1, 2, 3]]),))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    floor = evaluator.rounding_floor(state)  # tied names nudged differently would be refused as two tensors
    assert 0 < floor < 1e-6
