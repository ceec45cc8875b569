"""Python control flow on the input shape (examples/sweep_handwritten.py, ``python_shape_branches``), and
torch.nn.TransformerDecoder's branch on its mask values (``torch_decoder_mask_without_is_causal``: a hint that works).

A model that runs an extra MLP on the residual stream only for sequences longer than 8 was traced at length 7:
the report listed a residual permutation that changed its outputs by 42% at lengths 11 and 19 (float64), since
the extra MLP's weights never moved with the stream. The report now runs the model at the probe shapes and
refuses, naming the parameters, when one of them uses a parameter the traced graph never reads.
"""
from __future__ import annotations

import pytest
import torch

import symgraph
from symgraph.errors import CaptureError

from cli_runner import run

WIDTH = 8


class LongOnly(torch.nn.Module):
    """``extra`` runs only for long sequences; ``threshold`` above every probe length never takes the branch."""

    def __init__(self, threshold: int = 8):
        super().__init__()
        self.threshold = threshold
        self.up, self.down, self.extra, self.head = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        x = x + self.down(torch.relu(self.up(x)))
        if x.shape[1] > self.threshold:
            x = x + self.extra(x)
        return self.head(x)


def make_long_only():
    return LongOnly(), (torch.randn(2, 7, WIDTH),)


def test_a_branch_the_trace_did_not_take_is_refused_with_its_parameters():
    with pytest.raises(CaptureError, match=r"extra\.bias, extra\.weight.*never reads") as caught:
        symgraph.analyze(LongOnly(), inputs=(torch.randn(2, 7, WIDTH),))
    assert "takes every branch" in str(caught.value)


def test_inputs_that_take_the_branch_are_analysed():
    report = symgraph.analyze(LongOnly(), inputs=(torch.randn(2, 11, WIDTH),))  # probes run shorter and longer
    assert [g.kind for g in report.groups if g.motif == "ffn"] == ["permutation"]


def test_a_branch_no_probe_takes_does_not_stop_the_report():
    report = symgraph.analyze(LongOnly(threshold=10_000), inputs=(torch.randn(2, 7, WIDTH),))
    assert any(g.motif == "ffn" for g in report.groups)


class OneTokenPath(torch.nn.Module):
    """A decode-style fast path: ``single`` runs only for sequences of length 1, which no probe of the traced
    length 7 reaches but the shortest probe does."""

    def __init__(self):
        super().__init__()
        self.up, self.down, self.single, self.head = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x):
        if x.shape[1] == 1:
            x = x + self.single(x)
        return self.head(x + self.down(torch.relu(self.up(x))))


def test_a_branch_for_one_token_only_is_refused():
    with pytest.raises(CaptureError, match=r"1x8.*single\.bias, single\.weight.*never reads"):
        symgraph.analyze(OneTokenPath(), inputs=(torch.randn(2, 7, WIDTH),))


def test_the_command_line_says_what_to_do():
    out = run("report", f"{__file__}:make_long_only")
    assert out.returncode == 2
    assert "extra.weight" in out.stderr and "takes every branch" in out.stderr and "Traceback" not in out.stderr


class TorchDecoder(torch.nn.Module):
    """nn.TransformerDecoder with a causal mask; ``say_causal`` passes tgt_is_causal=True beside it."""

    def __init__(self, say_causal: bool):
        super().__init__()
        self.say_causal = say_causal
        layer = torch.nn.TransformerDecoderLayer(WIDTH, 2, 16, dropout=0.0, batch_first=True)
        self.decoder = torch.nn.TransformerDecoder(layer, 1)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.decoder(x, x, tgt_mask=mask, **({"tgt_is_causal": True} if self.say_causal else {}))


def test_a_torch_decoder_mask_without_is_causal_gets_a_hint_that_works():
    x = torch.randn(2, 5, WIDTH)
    with pytest.raises(CaptureError, match="tgt_is_causal=True"):
        symgraph.analyze(TorchDecoder(say_causal=False).eval(), inputs=(x,))
    report = symgraph.analyze(TorchDecoder(say_causal=True).eval(), inputs=(x,))
    assert {"qk", "vo", "ffn"} <= {g.motif for g in report.groups}


class AsksItsFirstParameter(torch.nn.Module):
    """A parameter only a branch the inputs never take reads (XLNet's ``mask_emb``), registered first, so that the
    dtype query Hugging Face models make on every call (``model.dtype``: the first floating parameter's) touches it."""

    def __init__(self):
        super().__init__()
        self.mask_emb = torch.nn.Parameter(torch.randn(WIDTH))
        self.up, self.down = torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, target=None):
        first = next(self.parameters())
        x = x.to(first.dtype if first.is_floating_point() and first.dim() == 1 else torch.float32)
        if target is not None:
            x = x + self.mask_emb
        return self.down(torch.relu(self.up(x)))


def test_a_parameter_whose_metadata_alone_is_read_is_not_a_branch():
    # XLNet was refused ("At input shape 1x17 the model uses transformer.mask_emb, which the graph traced at 2x7
    # never reads"): is_floating_point() and .dtype counted as uses, at the probe shapes and not in the trace
    report = symgraph.analyze(AsksItsFirstParameter(), inputs=(torch.randn(2, 7, WIDTH),))
    assert [g.kind for g in report.groups if g.motif == "ffn"] == ["permutation"]
    assert "mask_emb" in " ".join(p for s in report.pinned for p in s.params)
