"""Shape soundness: coordinates a slice cuts away at the traced shape are not free, coordinates that meet data
(concatenated beside activations) are not free, and every float64 check runs at more than one input shape (the
Whisper trap: a position table sliced by the input's length)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import symgraph
from symgraph.elements import apply, sample
from symgraph.fuzz import fuzz
from symgraph.groups import Group, Member
from symgraph.errors import UnverifiableError
from symgraph.probes import every_probe, probe_inputs
from symgraph.verify import Evaluator

from cli_runner import run


class SlicedPositions(nn.Module):
    """A learned position table of 16 rows, sliced by the input's length (as Whisper's decoder does)."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Parameter(torch.randn(16, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(x + self.positions[: x.shape[1]]))


def sliced_positions():
    torch.manual_seed(0)
    return SlicedPositions().eval(), (torch.randn(2, 5, 8),)


def rows_group(param: str, rows: range) -> Group:
    """The group the engine used to emit on rows the probe never read: any invertible map of them."""
    index = np.arange(rows.start, rows.stop).reshape(1, -1, 1)
    return Group("trap", "other", "general_linear", len(rows), 1, (Member(param, 0, index),))


def unread_at_this_shape(reason: str) -> bool:
    """Pinned because the traced shape does not read it: a slice cut it away, or indices skipped it (the decoder
    reads its position table at position ids)."""
    return "cut away by a slice" in reason or reason.startswith("not selected by indices")


def axis_groups(report, param: str, axis: int) -> list[Group]:
    return [g for g in report.groups if any(m.param == param and m.axis == axis for m in g.members)]


def tiny_whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from symgraph.zoo import _perturb

    config = WhisperConfig(vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                           max_source_positions=16, max_target_positions=64, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    _perturb(model, torch.Generator().manual_seed(1))
    return model


@pytest.fixture(scope="module")
def whisper():
    return symgraph.load(tiny_whisper())


def test_rows_a_slice_cuts_away_are_pinned_not_free():
    model, inputs = sliced_positions()
    report = symgraph.analyze(model, inputs=inputs)
    assert axis_groups(report, "positions", 0) == []
    cut = [p for p in report.pinned if "cut away by a slice" in p.reason]
    assert [(p.params, p.size, p.node) for p in cut] == [(("positions",), 11, "slice_1")]


def test_a_group_on_unread_rows_passes_at_the_traced_shape_and_fails_at_another():
    model, inputs = sliced_positions()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    moved = apply(state, [sample(rows_group("positions", range(5, 16)), np.random.default_rng(0))])
    assert Evaluator(model, inputs, shapes=False).check(moved).ok  # the trap: invisible at one shape
    outcome = Evaluator(model, inputs).check(moved)
    assert not outcome.ok and outcome.relative_error > 1e-3


def test_fuzz_catches_a_group_that_only_breaks_longer_inputs():
    model, inputs = sliced_positions()
    result = fuzz(symgraph.load(model, inputs), groups=[rows_group("positions", range(5, 16))], samples=3)
    assert not result.ok and result.failures[0].group_id == "trap"
    # 2x1x1: a feature width of 1 broadcasts against the table, so the model takes it
    assert result.shapes == ["arg0 2x5x8", "arg0 1x13x8", "arg0 3x3x8", "arg0 2x1x1", "arg0 2x2x8"]


class ShortAndSingleRowPaths(nn.Module):
    """Takes another path for short inputs and for a single row (as padding-free or unbatched fast paths do): the
    traced (2, 5) shape runs none of ``short``, ``shortest`` and ``single``; each probe variant runs one of them
    (the decode path of a language model, taken for one token only, is the ``shortest`` kind)."""

    def __init__(self):
        super().__init__()
        self.long, self.short, self.shortest, self.single = (nn.Linear(8, 3) for _ in range(4))

    def forward(self, x):
        if x.shape[0] == 1:
            return self.single(x)
        if x.shape[1] == 1:
            return self.shortest(x)
        return self.long(x) if x.shape[1] >= 5 else self.short(x)


@pytest.mark.parametrize("param,catching_probes", [("single.weight", [1]), ("short.weight", [2, 4]),
                                                   ("shortest.weight", [3])])
def test_a_group_on_a_path_only_small_inputs_take_is_caught(param, catching_probes):
    """A group on weights the traced shape never reads: invisible there, caught by the probes that read them
    (batch size 1, a shorter input with more than one row, a length of 1)."""
    torch.manual_seed(0)
    model, inputs = ShortAndSingleRowPaths().eval(), (torch.randn(2, 5, 8),)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    moved = apply(state, [sample(rows_group(param, range(3)), np.random.default_rng(0))])
    evaluator = Evaluator(model, inputs)
    assert [tuple(a[0].shape) for a, _ in evaluator.probes] == [(2, 5, 8), (1, 13, 8), (3, 3, 8), (2, 1, 8),
                                                                 (2, 2, 8)]
    errors = [float((out - ref).norm() / ref.norm()) for out, ref in zip(evaluator.outputs(moved),
                                                                         evaluator.references)]
    assert [i for i, e in enumerate(errors) if e > 1e-3] == catching_probes and errors[0] == 0.0
    assert not evaluator.check(moved).ok
    result = fuzz(symgraph.load(model, inputs), groups=[rows_group(param, range(3))], samples=3)
    assert not result.ok and result.failures[0].group_id == "trap"


class BucketedPositions(nn.Module):
    """Per-token scores for 16 relative-position buckets, gathered at buckets computed from the input's length
    (as ProphetNet does): length 5 reads buckets 3..11 only."""

    def __init__(self):
        super().__init__()
        self.buckets, self.head = nn.Linear(8, 16), nn.Linear(8, 3)

    def forward(self, x):
        n = x.shape[1]
        relative = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        index = (relative.clamp(-7, 8) + 7).expand(x.shape[0], n, n)  # length 5: rows 3-11, 7 rows unread
        scores = torch.gather(self.buckets(x), 2, index)
        return self.head(torch.softmax(scores, dim=-1) @ x)


def test_coordinates_that_computed_indices_skip_are_pinned_not_free():
    torch.manual_seed(0)
    subject = symgraph.load(BucketedPositions().eval(), (torch.randn(2, 5, 8),))
    assert axis_groups(subject.report, "buckets.weight", 0) == []
    skipped = [p for p in subject.report.pinned if p.reason.startswith("not selected by indices")]
    assert [(p.params, p.size, p.node) for p in skipped] == [(("buckets.bias", "buckets.weight"), 14, "gather")]
    assert fuzz(subject, samples=3).ok


def test_whisper_decoder_positions_beyond_the_probe_are_pinned(whisper):
    table = "model.decoder.embed_positions.weight"
    assert axis_groups(whisper.report, table, 0) == []
    assert any(table in p.params and unread_at_this_shape(p.reason) for p in whisper.report.pinned)
    evaluator = Evaluator(whisper.model, whisper.args, whisper.kwargs)
    assert [tuple(kw["decoder_input_ids"].shape) for _, kw in evaluator.probes] == [(2, 7), (1, 17), (3, 4), (2, 1),
                                                                                   (2, 2)]
    moved = apply(whisper.state_dict(), [sample(rows_group(table, range(7, 64)), np.random.default_rng(0))])
    assert not evaluator.check(moved).ok


def test_whisper_groups_are_invariant_at_every_probe_shape(whisper):
    result = fuzz(whisper, samples=3)
    assert result.ok, [v.counterexample for v in result.failures]
    assert len(result.shapes) == 5 and {v.motif for v in result.verdicts} >= {"qk", "vo", "ffn", "heads"}


def test_probe_inputs_grow_batch_and_length_and_pad_token_models(zoo_subject):
    bert = zoo_subject("bert")
    probes = probe_inputs(bert.model, bert.args, bert.kwargs)
    assert len(probes) == 3 and probes[0][1] is not bert.kwargs
    longer, shorter = probes[1][1], probes[2][1]
    assert tuple(longer["input_ids"].shape) == (1, 17) and "attention_mask" not in longer
    assert torch.equal(longer["input_ids"][:, :7], bert.kwargs["input_ids"][:1])  # the original is a prefix
    assert tuple(shorter["input_ids"].shape) == (3, 4)
    assert torch.equal(shorter["input_ids"][:2], bert.kwargs["input_ids"][:, :4])
    assert shorter["attention_mask"][0, -1:].eq(0).all() and shorter["attention_mask"][1:].eq(1).all()
    assert "attention_mask" not in bert.kwargs  # inputs are never modified


def test_probe_inputs_keep_sizes_a_vision_model_rejects(zoo_subject):
    vit = zoo_subject("vit")
    (_, original), (_, longer), (_, shorter) = probe_inputs(vit.model, vit.args, vit.kwargs)
    assert tuple(original["pixel_values"].shape) == (2, 3, 16, 16)
    assert tuple(longer["pixel_values"].shape) == (1, 3, 16, 16)  # fixed image size and channels
    assert tuple(shorter["pixel_values"].shape) == (3, 3, 16, 16)


def test_fuzz_cli_reports_the_probe_shapes(tmp_path):
    factory = tmp_path / "sliced.py"
    factory.write_text("import torch\nfrom torch import nn\n"
                       + "\n".join(_source(SlicedPositions, sliced_positions)))
    res = run("fuzz", f"{factory}:sliced_positions", "--samples", "2", "--json", tmp_path / "f.json")
    assert res.returncode == 0, res.stderr
    assert "input shapes: arg0 2x5x8 | arg0 1x13x8 | arg0 3x3x8 | arg0 2x1x1 | arg0 2x2x8" in res.stdout
    assert json.loads((tmp_path / "f.json").read_text())["shapes"] == ["arg0 2x5x8", "arg0 1x13x8", "arg0 3x3x8",
                                                                      "arg0 2x1x1", "arg0 2x2x8"]


def _source(*objects) -> list[str]:
    import inspect

    return [inspect.getsource(o) for o in objects]


class ConcatenatedWithData(nn.Module):
    """``b`` reads hidden units and, beside them, the raw input: its columns for the input meet data."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(10, 3)

    def forward(self, x):
        return self.b(torch.cat([torch.relu(self.a(x)), x], dim=-1))


def test_columns_that_read_concatenated_data_are_pinned():
    torch.manual_seed(0)
    subject = symgraph.load(ConcatenatedWithData().eval(), (torch.randn(2, 5, 4),))
    assert [(g.kind, g.size) for g in subject.report.groups] == [("permutation", 6)]  # the hidden units only
    reads_data = [p for p in subject.report.pinned if p.reason.startswith("meets data")]
    assert [(p.params, p.size, p.node) for p in reads_data] == [(("b.weight",), 4, "linear_1")]
    result = fuzz(subject, samples=5)
    assert result.ok, [v.counterexample for v in result.failures]


def test_cli_report_and_transform_of_a_whisper_folder(tmp_path):
    folder = tmp_path / "whisper"
    tiny_whisper().save_pretrained(folder)
    res = run("report", folder, "--format", "json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    table = "model.decoder.embed_positions.weight"
    assert not [g for g in report["groups"] for m in g["members"] if m["param"] == table and m["axis"] == 0]
    assert any(table in p["params"] and unread_at_this_shape(p["reason"]) for p in report["pinned"])
    res = run("transform", folder, "-o", tmp_path / "out", "--seed", "1")
    assert res.returncode == 0, res.stderr  # checked at (2, 7) and (3, 17) decoder tokens before writing


class NanBeyondSeven(nn.Module):
    """Gives NaN for sequences longer than 7: such a probe could never compare equal, so it is not used."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        out = self.lin(x)
        return out if x.shape[1] <= 7 else out * float("nan")


def test_probe_inputs_skip_shapes_with_non_finite_outputs():
    probes = probe_inputs(NanBeyondSeven(), (torch.randn(2, 7, 4),), {})
    assert [tuple(args[0].shape) for args, _ in probes] == [(2, 7, 4), (1, 7, 4), (3, 4, 4)]


class ShrinksItsWindow(nn.Module):
    """Swin's pattern: an input shorter than the window shrinks the window for good, and the weights made for two
    windows of the traced length (8) then no longer fit it. ``in_place`` keeps the window in a buffer written in
    place, which no probe can put back."""

    def __init__(self, in_place: bool = False):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.per_window = nn.Parameter(torch.randn(2, 4))
        self.in_place = in_place
        self.window = 4
        self.register_buffer("window_buffer", torch.tensor(4))

    def forward(self, x):
        if self.in_place and x.shape[1] < self.window_buffer:
            self.window_buffer.fill_(x.shape[1])
        elif x.shape[1] < self.window:
            self.window = x.shape[1]
        window = int(self.window_buffer) if self.in_place else self.window
        return self.linear(x).unflatten(1, (-1, window)).sum(2) * self.per_window


def test_probes_and_checks_leave_a_model_that_changes_itself_as_it_was():
    """Before: the probe at length 1 shrank the float64 copy's window for good, and the check refused the model
    as one that "does not run in float64"."""
    model, x = ShrinksItsWindow(), torch.randn(2, 8, 4)
    probes = every_probe(model, (x,), {})
    assert model.window == 4 and (2, 2, 4) in [tuple(a[0].shape) for a, _ in probes]  # it ran at length 2
    evaluator = Evaluator(model, (x,))
    assert evaluator.check(evaluator.state).ok and evaluator.check(evaluator.state).ok  # checked twice: all shapes
    assert torch.allclose(evaluator.references[0], model(x).double().flatten())


def test_a_model_that_fails_in_float32_too_is_not_blamed_on_float64():
    with pytest.raises(UnverifiableError, match="in float32 as well as in float64, so float64 is not the cause"):
        Evaluator(ShrinksItsWindow(in_place=True), (torch.randn(2, 8, 4),))


def test_verification_benchmark_runs_and_reports_both_shape_settings(capsys):
    """Smoke test of examples/bench_verify.py (figures are not asserted: timings belong in its output)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "bench_verify.py"
    spec = importlib.util.spec_from_file_location("bench_verify", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--families", "torch-relu-mlp", "--samples", "2", "--repeats", "1"])
    result = json.loads(capsys.readouterr().out)["torch-relu-mlp"]
    assert len(result["one_shape"]["probes"]) == 1 and len(result["every_shape"]["probes"]) == 5
    assert result["every_shape"]["all_invariant"] and result["ratio"]["check_ms"] > 0


def test_a_long_axis_grows_by_a_part_of_it_not_twice():
    """An image's sides grown to twice made an attention over its patches sixteen times as costly (YOLOS at
    512x864: 8 s a float32 run, the float64 checks there too); a long axis now grows by 64 + n // 8 + 3."""
    conv = nn.Conv2d(3, 4, 3)
    (_, _), (longer, _), (shorter, _) = probe_inputs(conv, (torch.randn(2, 3, 256, 160),), {})
    assert tuple(longer[0].shape) == (1, 3, 3 + 256 + 64 + 32, 3 + 160 + 64 + 20)  # channels stay
    assert tuple(shorter[0].shape) == (3, 3, 129, 81)
    (_, _), (longer, _), _ = probe_inputs(nn.Linear(4, 4), (torch.randn(2, 17, 4),), {})
    assert tuple(longer[0].shape) == (1, 37, 4)  # a short axis still more than doubles


class CountsRuns(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        return self.linear(x)


def test_whether_a_model_takes_inputs_is_asked_once_until_its_weights_change():
    """The report's path check and the walk's cut checks ask the same probes of one model: each shape ran twice
    (YOLOS at 512x864: 21 s of 63)."""
    model, x = CountsRuns(), torch.randn(2, 7, 4)
    first = every_probe(model, (x,), {})
    runs = model.runs
    again = every_probe(model, (x,), {})
    assert model.runs == runs and len(again) == len(first) == 5
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(first, again))
    with torch.no_grad():
        model.linear.weight.mul_(2.0)  # an in-place write: the answers may differ now
    every_probe(model, (x,), {})
    assert model.runs == 2 * runs
    every_probe(model, (x + 1,), {})  # other values: asked anew
    assert model.runs == 3 * runs
