"""Multiple-choice heads (``BertForMultipleChoice``) score ``batch x choices`` sequences: their code flattens a
choices axis, so the 2-D token ids symgraph builds from a config could not be traced ("shape '[-1, 7]' is invalid")
and every command refused the folder. The built inputs get an axis of choices where the plain ones fail
(:func:`symgraph.inputs.other_forms`), in ``load`` and in the streamed check of ``compare`` alike."""
from __future__ import annotations

import pytest
import torch

import symgraph

from cli_runner import run
from group_checks import assert_fuzzed_at_two_shapes, noisy

transformers = pytest.importorskip("transformers")


def _multiple_choice(seed):
    config = transformers.BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48)
    torch.manual_seed(seed)
    return noisy(transformers.BertForMultipleChoice(config), 0.05)


def test_groups_of_a_multiple_choice_head_hold_at_two_shapes():
    subject = symgraph.load(_multiple_choice(0))
    assert {"qk", "heads", "ffn", "residual"} <= {g.motif for g in subject.report.groups}
    assert subject.kwargs["input_ids"].dim() == 3, "traced on sequences grouped into choices"
    assert_fuzzed_at_two_shapes(subject)


def test_cli_aligns_and_compares_multiple_choice_folders(tmp_path):
    anchor, source, aligned = tmp_path / "a", tmp_path / "b", tmp_path / "aligned"
    _multiple_choice(0).save_pretrained(anchor)
    model = _multiple_choice(1)
    model.save_pretrained(source)
    result = run("align", source, anchor, "-o", aligned)
    assert result.returncode == 0, result.stderr
    same = run("compare", source, aligned)
    assert same.returncode == 0 and "the same function" in same.stdout, same.stdout + same.stderr
    different = run("compare", source, anchor)
    assert different.returncode == 1 and "DIFFERENT" in different.stdout, different.stdout + different.stderr
    ids = torch.randint(3, 60, (2, 3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.double()(input_ids=ids).logits
        got = transformers.BertForMultipleChoice.from_pretrained(aligned).double().eval()(input_ids=ids).logits
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5
