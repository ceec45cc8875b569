"""Which motif names a group (specs/motifs.yaml ``classify``). A masked LM's head reads the stream through a
transform (linear, GELU, LayerNorm) and a decoder tied to the word embeddings, so the transform's units join the
stream's group; the group was named ``ffn`` for the transform's activation, so ``--data`` took no activation costs
for the stream (they go to residual groups) and paper mode aligned the stream as an FFN. Coordinates summed by an
activation's own arithmetic (GELU-tanh's x + 0.044715 x^3, a ResNet block's relu(x + identity)) keep ``ffn``."""
from __future__ import annotations

import torch
import transformers
from torch import nn

import symgraph
from symgraph import zoo
from symgraph.activations import data_cost_groups


def _group_of(report, param: str):
    return next(g for g in report.groups if g.kind != "scale" and param in g.params)


def test_a_masked_lms_tied_head_is_named_with_the_stream():
    torch.manual_seed(0)
    model = transformers.AutoModelForMaskedLM.from_config(zoo.tiny_config("bert")).eval()
    report = symgraph.load(model).report
    stream = _group_of(report, "bert.embeddings.position_embeddings.weight")
    assert "cls.predictions.transform.dense.weight" in stream.params
    assert stream.motif == "residual"
    assert stream in data_cost_groups(report.groups)
    assert all(g.motif == "ffn" for g in report.groups if "bert.encoder.layer.0.intermediate.dense.bias" in g.params)


def test_an_activations_own_sums_keep_its_units_an_ffn():
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(zoo.tiny_config("gpt2")).eval()
    report = symgraph.load(model).report  # GELU-tanh sums x and 0.044715 x^3
    assert _group_of(report, "transformer.h.0.mlp.c_fc.bias").motif == "ffn"


class Block(nn.Module):  # a ResNet block: the activation reads the residual sum
    def __init__(self, d: int = 6):
        super().__init__()
        self.inp, self.a, self.b, self.head = nn.Linear(3, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x)
        return self.head(torch.relu(self.b(torch.relu(self.a(h))) + h))


def test_a_sum_an_activation_reads_keeps_its_name():
    report = symgraph.load(Block(), (torch.randn(2, 3),)).report
    assert _group_of(report, "b.bias").motif == "ffn"
