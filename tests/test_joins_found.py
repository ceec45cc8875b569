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
