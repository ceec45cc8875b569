"""nn.RNN, nn.GRU and nn.LSTM: one fused op over a flat list of weights, which no spec described, so every model
with one found nothing around it. Each layer's and direction's hidden units now permute (gate blocks of rows,
the recurrent weights' columns, the next layer's input columns, an encoder's final state handed to a decoder),
fuzzed in float64 at two input shapes; what the rule does not describe (projections) pins."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import symgraph
from symgraph.zoo import _perturb

from cli_runner import assert_fuzzed, report_json
from group_checks import assert_fuzzed_at_two_shapes

V, E, H = 30, 12, 10
CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}


def token_ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))


class RecurrentLM(nn.Module):
    def __init__(self, cell: str, layers: int = 2, bidirectional: bool = False, **kwargs):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.rnn = CELLS[cell](E, H, num_layers=layers, batch_first=True, bidirectional=bidirectional, **kwargs)
        width = kwargs.get("proj_size") or H
        self.head = nn.Linear(width * (2 if bidirectional else 1), V)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


class EncoderDecoder(nn.Module):
    """The encoder's final state starts the decoder: both layers' units must move alike in both."""

    def __init__(self, cell: str):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.encoder = CELLS[cell](E, H, num_layers=2, batch_first=True)
        self.decoder = CELLS[cell](E, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, V)

    def forward(self, ids):
        x = self.emb(ids)
        _, state = self.encoder(x)
        out, _ = self.decoder(x.flip(1), state)
        return self.head(out)


def subject_of(model: nn.Module):
    torch.manual_seed(0)
    model = model.eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return symgraph.load(model, (token_ids(2, 7),))


def unit_groups(subject) -> list:
    return [g for g in subject.report.groups if any("weight_hh" in p for p in g.params)]


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("bidirectional", [False, True], ids=["one-way", "two-way"])
def test_each_layer_and_direction_permutes_its_hidden_units(cell, bidirectional):
    subject = subject_of(RecurrentLM(cell, bidirectional=bidirectional))
    assert not subject.report.unknown_ops
    groups = unit_groups(subject)
    assert len(groups) == 2 * (2 if bidirectional else 1)
    for g in groups:
        assert (g.kind, g.size, g.copies) == ("permutation", H, 1)
        # one layer and direction: its own rows and recurrent columns, and what reads its output
        suffixes = {p.split("_", 2)[-1] for p in g.params if p.startswith("rnn.weight_hh")}
        assert len(suffixes) == 1, g.params
    assert_fuzzed_at_two_shapes(subject)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_an_encoder_state_handed_to_a_decoder_ties_their_units(cell):
    subject = subject_of(EncoderDecoder(cell))
    groups = unit_groups(subject)
    assert len(groups) == 2  # one per layer, each spanning encoder and decoder
    for g in groups:
        assert any(p.startswith("encoder.") for p in g.params) and any(p.startswith("decoder.") for p in g.params)
    assert_fuzzed_at_two_shapes(subject)


def test_an_lstm_with_projections_pins_its_weights():
    subject = subject_of(RecurrentLM("lstm", proj_size=6))
    assert not unit_groups(subject)
    assert any(p.startswith("rnn.weight_hr") for pin in subject.report.pinned for p in pin.params)


FACTORY = '''
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(30, 12)
        self.rnn = nn.LSTM(12, 10, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(20, 5)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0])


def build():
    torch.manual_seed(0)
    return Tagger(), (torch.randint(0, 30, (2, 7)),)
'''


def test_the_cli_reports_and_fuzzes_an_lstm(tmp_path):
    path = tmp_path / "tagger.py"
    path.write_text(FACTORY)
    data = report_json(f"{path}:build")
    assert data["summary"]["unknown_ops"] == {}
    units = [g for g in data["groups"] if any("weight_hh" in m["param"] for m in g["members"])]
    assert sorted((g["kind"], g["size"]) for g in units) == [("permutation", H)] * 4
    assert_fuzzed(f"{path}:build", tmp_path)
