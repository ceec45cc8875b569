"""The shipped model pairs: they load, score what symgraph/data/models/README.md says, differ within a pair,
stay small, and go through symgraph's capture and analysis."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import symgraph
from symgraph import datasets
from symgraph.datasets import char_vocabulary, evaluate, load_data
from symgraph.io import load_model

MODELS = Path(__file__).resolve().parent.parent / "symgraph" / "data" / "models"
FAMILIES = {"vit-digits": "digits", "llama-chars": "pydoc-chars", "bert-topics": "pydoc-topics"}
NAMES = [f"{family}-{s}" for family in FAMILIES for s in "ab"]


@lru_cache(maxsize=None)
def _model(name: str) -> torch.nn.Module:
    return load_model(MODELS / name).model


def _readme_rows() -> dict[str, dict[str, str]]:
    """The table of README.md, as {model: {column: cell}}."""
    lines = [line for line in (MODELS / "README.md").read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
    return {row[0]: dict(zip(header, row)) for row in rows}


def test_every_model_is_shipped_and_recorded():
    assert set(_readme_rows()) == set(NAMES)
    recorded = json.loads((MODELS / "training.json").read_text())["models"]
    assert {name: recorded[name]["seed"] for name in NAMES} == {n: 0 if n.endswith("-a") else 1 for n in NAMES}
    for name in NAMES:
        assert {p.name for p in (MODELS / name).iterdir()} >= {"config.json", "model.safetensors"}


@pytest.mark.parametrize("name", NAMES)
def test_test_metrics_match_the_readme(name):
    row = _readme_rows()[name]
    assert type(_model(name)).__name__ == row["class"]  # config.json names the head, so it is loaded too
    metrics = evaluate(_model(name), load_data(FAMILIES[name[:-2]], model=MODELS / name, batch_size=128))
    assert metrics.examples == int(row["test examples"])
    assert metrics.loss == pytest.approx(float(row["test loss"]), abs=2e-4)
    assert metrics.accuracy == pytest.approx(float(row["test accuracy"]), abs=2e-4)


def test_models_learned_their_task():
    rows = _readme_rows()
    for s in "ab":
        assert float(rows[f"vit-digits-{s}"]["test accuracy"]) > 0.85
        assert float(rows[f"bert-topics-{s}"]["test accuracy"]) > 0.45  # the largest of 4 classes: 27%
        assert float(rows[f"llama-chars-{s}"]["test loss"]) < 0.6 * _unigram_entropy()


def _unigram_entropy() -> float:
    """Nats per character of the best model that ignores context, fitted on the training windows."""
    ids = torch.cat([b.inputs["input_ids"].flatten() for b in load_data("pydoc-chars:train").batches])
    p = torch.bincount(ids, minlength=len(char_vocabulary())).double() / ids.numel()
    return float(-(p[p > 0] * p[p > 0].log()).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pair_differs_only_in_its_weights(family):
    a, b = _model(f"{family}-a"), _model(f"{family}-b")
    assert a.config.to_dict() | {"_name_or_path": ""} == b.config.to_dict() | {"_name_or_path": ""}
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        if pa.numel() > 1 and pa.std() > 0:  # constant initialisations (norm weights at 1) may coincide
            assert not torch.allclose(pa, pb), name
    for file in ("tokenizer.json", "tokenizer_config.json"):
        if (MODELS / f"{family}-a" / file).is_file():
            assert (MODELS / f"{family}-a" / file).read_text() == (MODELS / f"{family}-b" / file).read_text()


def test_shipped_weights_are_a_few_megabytes():
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    assert 0.5e6 < total < 5e6
    assert all(t.dtype == torch.float32 for name in NAMES for t in _model(name).state_dict().values()
               if t.is_floating_point())


CHAR_MODELS = [name for name in NAMES if not name.startswith("vit")]


@pytest.mark.parametrize("name", CHAR_MODELS)
def test_char_models_ship_a_hugging_face_tokenizer_with_the_training_ids(name):
    """AutoTokenizer reads the folder, and every line of the corpus gets the ids the weights were trained on:
    one id of the fixed vocabulary per character, after ``<cls>`` for the classifier."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODELS / name, local_files_only=True)
    vocab = char_vocabulary()
    assert tokenizer.get_vocab() == vocab and tokenizer.pad_token_id == vocab["<pad>"]
    prefix = [vocab["<cls>"]] if name.startswith("bert") else []
    lines = [line for split in ("train", "test") for _, line in datasets.corpus_lines(split)]
    encoded = tokenizer(lines + ["<cls> and <pad> are text here", "tab\there, é"])["input_ids"]
    assert encoded == [prefix + [vocab.get(c, vocab["<unk>"]) for c in line]
                       for line in lines + ["<cls> and <pad> are text here", "tab\there, é"]]
    assert tokenizer.decode(encoded[0], skip_special_tokens=True) == lines[0]
    assert not (MODELS / name / "vocab.json").exists()  # no second, hand-read vocabulary


@pytest.mark.parametrize("name", CHAR_MODELS)
def test_shipped_tokenizer_files_are_what_train_models_writes(name, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(MODELS / name)
    datasets.char_tokenizer(classifier=name.startswith("bert"),
                            max_length=config.max_position_embeddings).save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / file).read_text()) == json.loads((MODELS / name / file).read_text())


@pytest.mark.parametrize("family, kinds", [
    ("vit-digits", {"qk/orthogonal", "vo/orthogonal", "ffn/permutation", "heads/permutation"}),
    ("llama-chars", {"qk/rotary", "vo/orthogonal", "ffn/permutation", "heads/permutation"}),
    ("bert-topics", {"qk/orthogonal", "vo/orthogonal", "ffn/permutation", "heads/permutation"}),
])
def test_symgraph_analyses_each_family(family, kinds):
    subject = symgraph.load(MODELS / f"{family}-a")
    example = {k: v for k, v in subject.kwargs.items() if isinstance(v, torch.Tensor)}
    data = load_data(FAMILIES[family], model=subject, batch_size=2).batches[0].inputs
    key = "pixel_values" if family == "vit-digits" else "input_ids"  # what symgraph traces with, and the data has
    assert set(example) == {key} and key in data
    if key == "pixel_values":  # single-channel 8x8 images, read from the config
        assert example[key].shape[1:] == data[key].shape[1:] == (1, 8, 8)
    found = {f"{g.motif}/{g.kind}" for g in subject.report.groups}
    assert kinds <= found, found - kinds
