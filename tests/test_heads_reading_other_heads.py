"""Heads that read another head's values: a rolled or flipped heads axis, and products nothing reads.

``probs @ v.roll(1, 1)`` gives head h the values of head h - 1. Two faults made that unsound:

* torch.export keeps ops whose results nothing reads. A model that computed ``probs @ v`` and then overwrote it
  with ``probs @ v.roll(1, 1)`` left both products in the graph, and the dead one's links said every head also read
  its own values: each head seemed to read two heads' values, the four heads formed one "KV group", and a
  permutation of query heads within it was emitted (relative output change 0.78-0.98; a flip gave 1.56).
  Dead ops are now removed from the captured graph (``symgraph.capture``).
* ``probs @ v + probs @ v.roll(1, 1)``, both live: each head reads its own values and its neighbour's, and the sum
  ties all values into one space, so every head's content held every value row as if all heads shared one KV
  head, and the query heads were permuted while the values stayed (0.66-0.83). A permutation within a KV group now
  needs each head to read the same shared rows (as GQA's and MQA's query heads do) and rows of its own that no
  other head of the group holds. A flip (head h with head 3 - h) reads the same pair from both heads of a pair,
  so the pairs' query heads still permute.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import symgraph
from symgraph.capture import capture

from group_checks import assert_fuzzed_at_two_shapes, noisy

D, DH, H = 16, 4, 4


class Attention(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.q, self.k, self.v = (nn.Linear(D, H * DH) for _ in range(3))
        self.o = nn.Linear(H * DH, D)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (p(x).view(b, n, H, DH).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(DH)
        probs = (scores + torch.triu(torch.full((n, n), -1e9, dtype=x.dtype), 1)).softmax(-1)
        out = probs @ v
        if self.form == "rolled, the plain product left unread":
            out = probs @ v.roll(1, 1)
        elif self.form == "flipped, the plain product left unread":
            out = probs @ v.flip(1)
        elif self.form == "own and rolled values summed":
            out = out + probs @ v.roll(1, 1)
        elif self.form == "own and flipped values summed":
            out = out + probs @ v.flip(1)
        return self.o(out.transpose(1, 2).flatten(2))


# form -> the sizes of the head groups: whole heads (with their values, wherever they sit), or permutations within
# pairs of heads that read the same two values
FORMS = {
    "rolled, the plain product left unread": [H],
    "flipped, the plain product left unread": [H],
    "own and rolled values summed": [],
    "own and flipped values summed": [2, 2],
}


@pytest.mark.parametrize("form", list(FORMS))
def test_heads_reading_other_heads_values_permute_only_where_sound(form):
    subject = symgraph.load(noisy(Attention(form)).double(), (torch.randn(2, 7, D, dtype=torch.float64),))
    heads = [g for g in subject.report.groups if g.motif == "heads"]
    assert sorted(g.size for g in heads) == FORMS[form], [g.id for g in heads]
    assert_fuzzed_at_two_shapes(subject)


def test_the_capture_drops_ops_nothing_reads():
    model = Attention("rolled, the plain product left unread")
    graph = capture(model, (torch.randn(2, 7, D),)).program.graph
    products = [n for n in graph.nodes if n.op == "call_function" and "matmul" in str(n.target)]
    assert len(products) == 2, [n.name for n in products]  # q @ k^T and probs @ rolled v, not probs @ v
    assert all(n.users for n in graph.nodes if n.op == "call_function")
