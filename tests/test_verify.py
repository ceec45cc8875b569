"""symgraph.verify: a result stored in float32 may miss the fixed tolerance by its own rounding floors, no further."""
from __future__ import annotations

import torch

from symgraph.verify import ROUNDING_FLOORS, TOLERANCE, Evaluator


def _cancelling_model() -> torch.nn.Module:
    """Two linear layers whose outputs are differences of hidden units that nearly cancel: outputs about 1e-4 of
    the hidden activations, so one float32 rounding of the weights moves them by far more than 2e-5 of themselves."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(6, 16, bias=False), torch.nn.Linear(16, 2, bias=False)
    with torch.no_grad():
        rows = torch.randn(8, 6)
        first.weight.copy_(torch.stack([rows, rows + 1e-4 * torch.randn(8, 6)], 1).reshape(16, 6))
        second.weight.copy_(torch.tensor([1.0, -1.0] * 8).repeat(2, 1) * torch.tensor([[1.0], [0.5]]))
    return torch.nn.Sequential(first, second)


def _rotated(model: torch.nn.Module, undo: bool = True) -> dict[str, torch.Tensor]:
    """The hidden units rotated by an orthogonal map in float64 (a symmetry of two linear layers when ``undo``
    rotates the second layer back; without it, a change of function), stored as float32."""
    q, _ = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    w1, w2 = (p.detach().to(torch.float64) for p in (model[0].weight, model[1].weight))
    return {"0.weight": (q @ w1).float(), "1.weight": (w2 @ q.T if undo else w2).float()}


def test_a_sound_result_rounded_once_passes_by_its_own_floor_and_an_unsound_one_does_not():
    model = _cancelling_model()
    evaluator = Evaluator(model, (torch.randn(3, 6),))
    sound, unsound = _rotated(model), _rotated(model, undo=False)
    fixed = evaluator.check(sound)
    assert fixed.relative_error > TOLERANCE[torch.float32] and not fixed.ok  # the fixed tolerance refuses it
    floor = evaluator.rounding_floor(sound)
    allowed = evaluator.check(sound, rounding_floor=True)
    assert allowed.ok and allowed.tolerance == ROUNDING_FLOORS * floor and allowed.relative_error < 10 * floor
    wrong = evaluator.check(unsound, rounding_floor=True)
    assert not wrong.ok and wrong.relative_error > 1e3 * wrong.tolerance
    halves = {k: v.to(torch.bfloat16) for k, v in sound.items()}  # bf16: floors near a change of function
    assert evaluator.check(halves, rounding_floor=True).tolerance == TOLERANCE[torch.bfloat16]


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
