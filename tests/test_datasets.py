"""symgraph.datasets: every spec form loads, bad input raises DataError with a useful message, losses are right."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from symgraph.datasets import (CORPUS_FILE, DATASETS, TOPIC_CLASSES, Batch, Dataset, batch_loss,
                               char_vocabulary, corpus_lines, evaluate, load_data, logits_of)
from symgraph.errors import DataError, SymgraphError

MODELS = Path(__file__).resolve().parent.parent / "symgraph" / "data" / "models"


class Linear(torch.nn.Module):
    """A classifier over flattened pixels or summed token embeddings, small enough to check losses by hand."""

    def __init__(self, classes: int = 10, vocab: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8) if vocab else None
        self.head = torch.nn.Linear(8 if vocab else 64, classes)

    def forward(self, pixel_values=None, input_ids=None, attention_mask=None):
        if self.embed is not None:
            return self.head(self.embed(input_ids))  # per-token logits: a causal LM of sorts
        return (self.head(pixel_values.flatten(1)),)


# ---- shipped names ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, task, test_size, train_size", [
    ("digits", "classification", 360, 1437),
    ("pydoc-chars", "causal_lm", None, None),
    ("pydoc-topics", "classification", None, None),
])
def test_shipped_names_load_both_splits(name, task, test_size, train_size):
    test, train = load_data(name), load_data(f"{name}:train")
    assert test.task == train.task == task
    assert test.name == f"{name}:test" and train.name == f"{name}:train"
    assert load_data(name, split="train").name == train.name
    assert 0.1 < len(test) / (len(test) + len(train)) < 0.3  # a fifth is held out
    if test_size is not None:
        assert (len(test), len(train)) == (test_size, train_size)


def test_digits_splits_are_disjoint_and_scaled():
    test = load_data("digits", batch_size=1000).batches[0].inputs["pixel_values"]
    train = load_data("digits:train", batch_size=2000).batches[0].inputs["pixel_values"]
    assert test.shape == (360, 1, 8, 8) and float(test.min()) == -1.0 and float(test.max()) == 1.0
    flat_train = {tuple(x.flatten().tolist()) for x in train}
    assert sum(tuple(x.flatten().tolist()) in flat_train for x in test) < 10  # a few duplicate images exist


def test_corpus_is_shipped_small_and_labelled():
    assert CORPUS_FILE.stat().st_size <= 300_000
    test, train = corpus_lines("test"), corpus_lines("train")
    assert {label for label, _ in test} == set(TOPIC_CLASSES)
    assert not {line for _, line in test} & {line for _, line in train}  # no line in both splits
    assert all(set(line) <= set(char_vocabulary()) for _, line in train + test)


def test_topic_lines_are_labelled_in_order():
    lines = corpus_lines("test")
    data = load_data("pydoc-topics", batch_size=1000)
    assert len(data) == len(lines)
    assert data.batches[0].labels.tolist() == [TOPIC_CLASSES.index(label) for label, _ in lines]
    first = data.batches[0].inputs["input_ids"][0]
    assert first[0] == char_vocabulary()["<cls>"] and int(first.ne(0).sum()) == len(lines[0][1]) + 1


def test_char_windows_are_labelled_with_their_inputs():
    data = load_data("pydoc-chars", batch_size=8, limit=20)
    assert len(data) == 20 and [b.size for b in data.batches] == [8, 8, 4]
    batch = data.batches[0]
    assert batch.inputs["input_ids"].shape == (8, 128) and torch.equal(batch.labels, batch.inputs["input_ids"])


def test_loading_is_deterministic():
    a, b = load_data("pydoc-topics", limit=50), load_data("pydoc-topics", limit=50)
    assert all(torch.equal(x.inputs["input_ids"], y.inputs["input_ids"]) and torch.equal(x.labels, y.labels)
               for x, y in zip(a.batches, b.batches))


@pytest.mark.parametrize("spec, expected", [
    ("cifar10", ["Unknown dataset 'cifar10'", "digits", "pydoc-chars", "pydoc-topics"]),
    ("digits:validation", ["no split 'validation'", "digits:train"]),
    ("missing.txt", ["does not exist"]),
    ("missing.npz", ["does not exist"]),
    ("no_such_module_xyz:make", ["not an importable factory", "no_such_module_xyz"]),
])
def test_bad_specs_raise_data_error_with_hints(spec, expected):
    with pytest.raises(DataError) as info:
        load_data(spec)
    assert isinstance(info.value, SymgraphError) and info.value.hint
    for text in expected:
        assert text in str(info.value)


def test_unsupported_file_type_is_named(tmp_path):
    file = tmp_path / "data.xlsx"
    file.write_text("1,2\n")
    with pytest.raises(DataError, match="only .txt, .jsonl, .json, .csv, .tsv, .parquet, .arrow, .npz files, the "
                                        "text ones also compressed .* or one datasets' save_to_disk wrote"):
        load_data(str(file))
    (tmp_path / "data.npz.gz").write_bytes(b"")
    with pytest.raises(DataError, match="is not a data file symgraph reads"):
        load_data(tmp_path / "data.npz.gz")


# ---- text files ------------------------------------------------------------------------------------------------


def test_txt_is_tokenised_with_the_shipped_char_tokenizer(tmp_path):
    file = tmp_path / "lines.txt"
    file.write_text("def f(x):\n\nreturn x + 1\n")
    data = load_data(file, model=MODELS / "llama-chars-a")
    vocab = char_vocabulary()
    assert data.task == "causal_lm" and len(data) == 2  # the blank line is skipped
    batch = data.batches[0]
    assert batch.inputs["input_ids"][0, :9].tolist() == [vocab[c] for c in "def f(x):"]
    assert batch.inputs["attention_mask"].sum(1).tolist() == [9, 12]
    assert batch.labels[0, 9:].tolist() == [-100] * 3  # padding is not predicted


def test_a_generic_tokenizer_is_kept_for_a_model_type_transformers_reroutes(tmp_path):
    """AutoTokenizer gives a qwen2 folder Qwen2Tokenizer whatever class its tokenizer_config.json names; built from
    the vocabulary alone, it dropped the character tokenizer's spaces (a trained pair's test loss 3.84, not 1.34)."""
    import shutil

    from transformers import Qwen2Config

    folder = tmp_path / "qwen2-chars"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODELS / "llama-chars-a" / name, folder / name)
    Qwen2Config(vocab_size=len(char_vocabulary()), hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=8, num_hidden_layers=1, architectures=["Qwen2ForCausalLM"]).save_pretrained(folder)
    file = tmp_path / "lines.txt"
    file.write_text("a b  c\n")
    vocab = char_vocabulary()
    assert load_data(file, model=folder).batches[0].inputs["input_ids"][0].tolist() == [vocab[c] for c in "a b  c"]


def test_labelled_txt_for_a_char_classifier(tmp_path):
    file = tmp_path / "lines.txt"
    file.write_text("expressions\tx + y\n0\tif x:\n")
    data = load_data(str(file), model=MODELS / "bert-topics-a")
    assert data.task == "classification" and data.batches[0].labels.tolist() == [1, 0]
    assert data.batches[0].inputs["input_ids"][:, 0].tolist() == [char_vocabulary()["<cls>"]] * 2


def test_txt_with_a_hugging_face_tokenizer(tmp_path):
    from transformers import BertConfig, BertTokenizer

    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    folder = tmp_path / "model"
    BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(str(folder))
    BertConfig(vocab_size=7, hidden_size=8, num_attention_heads=2, intermediate_size=8, num_hidden_layers=1,
               architectures=["BertForSequenceClassification"]).save_pretrained(str(folder))
    file = tmp_path / "lines.txt"
    file.write_text("hello world\nworld\n")
    data = load_data(file, model=folder)
    assert data.task == "classification" and data.batches[0].labels is None
    assert data.batches[0].inputs["input_ids"].tolist() == [[2, 5, 6, 3], [2, 6, 3, 0]]


def test_text_for_a_model_folder_without_a_tokenizer_says_what_to_add_there(tmp_path):
    """The hint told command-line users to ``pass model=FOLDER``, which they had done (an API keyword)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text((MODELS / "llama-chars-a" / "config.json").read_text())
    text = tmp_path / "lines.txt"
    text.write_text("hello\n")
    with pytest.raises(DataError, match="needs the model's tokenizer") as caught:
        load_data(text, model=folder)
    assert "tokenizer.json" in caught.value.hint and "model=FOLDER" not in caught.value.hint


def test_a_missing_folder_is_called_a_missing_path_not_an_unknown_dataset(tmp_path):
    with pytest.raises(DataError, match="Data path .*nowhere' does not exist"):
        load_data(str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match="Unknown dataset 'nowhere'"):
        load_data("nowhere")


def test_txt_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="no non-empty lines"):
        load_data(empty, model=MODELS / "llama-chars-a")
    text = tmp_path / "lines.txt"
    text.write_text("hello\n")
    with pytest.raises(DataError, match="needs the model's tokenizer"):
        load_data(text)
    with pytest.raises(DataError, match="has no config.json"):
        load_data(text, model=tmp_path / "nowhere")
    text.write_text("sports\thello\n")
    with pytest.raises(DataError, match="'sports' is neither a class id nor one of the model's labels"):
        load_data(text, model=MODELS / "bert-topics-a")
    text.write_text("7\thello\n")
    with pytest.raises(DataError, match="class id 7, but the model has 4 classes"):
        load_data(text, model=MODELS / "bert-topics-a")


# ---- records (.jsonl, .csv, .tsv) -------------------------------------------------------------------------------


def _same_batches(x, y) -> bool:
    return len(x.batches) == len(y.batches) and all(
        a.inputs.keys() == b.inputs.keys() and all(torch.equal(a.inputs[k], b.inputs[k]) for k in a.inputs)
        and (a.labels is None and b.labels is None or torch.equal(a.labels, b.labels))
        for a, b in zip(x.batches, y.batches))


def test_records_give_the_batches_of_the_same_lines_as_text(tmp_path):
    import json

    lines = [("expressions", "x + y"), ("0", "if x:"), ("strings", 'say "hi", then go')]
    (tmp_path / "lines.txt").write_text("".join(f"{label}\t{text}\n" for label, text in lines))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"id": i, "text": text, "label": label})
                                                   for i, (label, text) in enumerate(lines)) + "\n\n")
    (tmp_path / "rows.csv").write_text('label,sentence\n' + "".join(
        f'{label},"{text.replace(chr(34), chr(34) * 2)}"\n' for label, text in lines))
    (tmp_path / "rows.tsv").write_text("content\tlabel\n" + "".join(f"{text}\t{label}\n" for label, text in lines))
    # .json: a list of records, columns of equal length, or JSON Lines under that name (datasets' to_json)
    (tmp_path / "list.json").write_text(json.dumps([{"text": text, "label": label} for label, text in lines]))
    (tmp_path / "columns.json").write_text(json.dumps({"label": [label for label, _ in lines],
                                                       "text": [text for _, text in lines]}))
    (tmp_path / "lines.json").write_text((tmp_path / "rows.jsonl").read_text())
    model = MODELS / "bert-topics-a"
    text = load_data(tmp_path / "lines.txt", model=model, batch_size=2)
    assert text.batches[0].labels.tolist() == [1, 0]
    for name in ("rows.jsonl", "rows.csv", "rows.tsv", "list.json", "columns.json", "lines.json"):
        assert _same_batches(load_data(tmp_path / name, model=model, batch_size=2), text), name
    # compressed, as datasets are often shipped
    import bz2
    import gzip
    import lzma

    for name, module, suffix in (("lines.txt", gzip, "gz"), ("rows.jsonl", gzip, "gz"), ("rows.tsv", bz2, "bz2"),
                                 ("columns.json", lzma, "xz")):
        packed = tmp_path / f"{name}.{suffix}"
        packed.write_bytes(module.compress((tmp_path / name).read_bytes()))
        assert _same_batches(load_data(packed, model=model, batch_size=2), text), packed.name
    (tmp_path / "cut.jsonl.gz").write_bytes((tmp_path / "rows.jsonl.gz").read_bytes()[:20])
    with pytest.raises(DataError, match="Cannot read .*cut.jsonl.gz' as UTF-8 text"):
        load_data(tmp_path / "cut.jsonl.gz", model=model)
    # a causal LM takes the texts alone, its labels being its tokens; the one text field needs no known name
    (tmp_path / "lm.jsonl").write_text('{"code": "def f(x):", "label": 3}\n{"code": "return x + 1", "label": 1}\n')
    lm = load_data(tmp_path / "lm.jsonl", model=MODELS / "llama-chars-a")
    assert lm.task == "causal_lm" and len(lm) == 2 and torch.equal(lm.batches[0].labels[0, :9],
                                                                    lm.batches[0].inputs["input_ids"][0, :9])
    assert lm.batches[0].inputs["input_ids"][0, :9].tolist() == [char_vocabulary()[c] for c in "def f(x):"]


def test_cli_barrier_reads_records_as_it_reads_text(tmp_path):
    import json

    from cli_runner import run

    lines = [(label, text) for label, text in corpus_lines("test")[:12]]
    (tmp_path / "lines.txt").write_text("".join(f"{label}\t{text}\n" for label, text in lines))
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"text": t, "label": c}) + "\n" for c, t in lines))
    (tmp_path / "columns.json").write_text(json.dumps({"text": [t for _, t in lines], "label": [c for c, _ in lines]}))
    curves = {}
    for name in ("lines.txt", "rows.jsonl", "columns.json"):
        code, _, stderr = run("barrier", MODELS / "bert-topics-a", MODELS / "bert-topics-b", "--data", tmp_path / name,
                              "--align", "none", "--steps", 3, "-o", tmp_path / f"{name}.png",
                              "--json", tmp_path / f"{name}.json")
        assert code == 0, stderr
        curves[name] = json.loads((tmp_path / f"{name}.json").read_text())["modes"]["none"]["losses"]
    assert curves["rows.jsonl"] == curves["lines.txt"] == curves["columns.json"] and len(curves["lines.txt"]) == 3


@pytest.mark.parametrize("name, content, expected", [
    ("a.jsonl", '{"text": "x"}\n{"text": \n', "Line 2 of .* is not JSON"),
    ("a.jsonl", "[1, 2]\n", "Line 1 of .* is a JSON list, not an object"),
    ("a.jsonl", '{"a": "x", "b": "y"}\n', "Cannot tell which field .* holds the text: .*'a', 'b'"),
    ("a.jsonl", '{"text": "x", "label": 0}\n{"text": "y"}\n', "Record 2 of .* has no class in field 'label'"),
    ("a.jsonl", '{"text": "x"}\n{"text": 5}\n', "Record 2 of .* has no text in field 'text'"),
    ("a.jsonl", '{"text": "x", "label": "sports"}\n', "'sports' is neither a class id nor one of the model"),
    ("a.jsonl", "\n\n", "has no records"),
    ("a.json", '{"text": ["x", "y"], "label": [0]}', "columns of .* have different lengths: text 2, label 1"),
    ("a.json", '["x", 3]', "Entry 2 of .* is a JSON int, not an object"),
    ("a.json", '"x"', "holds a JSON str, not records"),
    ("a.json", "[]", "has no records"),
    ("a.csv", "text,label\nx,0\ny,1,extra\n", "Row 2 of .* has more cells than its header"),
    ("a.csv", "text,label\n", "has no records"),
])
def test_bad_records_say_what_is_wrong(tmp_path, name, content, expected):
    file = tmp_path / name
    file.write_text(content)
    with pytest.raises(DataError, match=expected) as info:
        load_data(file, model=MODELS / "bert-topics-a")
    assert info.value.hint


# ---- image and sound folders -----------------------------------------------------------------------------------


def _vit_with_processor(tmp_path: Path, name: str = "vit-digits-a", mean=(0.5,)) -> Path:
    """A copy of a shipped ViT folder with the image processor its digits were scaled by (grey, 8x8, to [-1, 1])."""
    import shutil

    from transformers import ViTImageProcessor

    folder = tmp_path / name
    shutil.copytree(MODELS / name, folder)
    ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=list(mean), image_std=[0.5] * len(mean),
                      resample=0).save_pretrained(folder)
    return folder


def _digit_images(root: Path, count: int, labelled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``count`` digits test images as PNG files (in a subfolder per class when ``labelled``), and their
    pixels and labels in the order the folder lists them: classes interleaved, files by name."""
    from PIL import Image

    data = load_data("digits", limit=count)
    pixels = torch.cat([b.inputs["pixel_values"] for b in data.batches])
    labels = torch.cat([b.labels for b in data.batches])
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels.tolist()):
        folder = root / str(label) if labelled else root
        folder.mkdir(parents=True, exist_ok=True)
        grey = ((pixels[i, 0] + 1) / 2 * 255).round().to(torch.uint8).numpy()
        Image.fromarray(grey).save(folder / f"{i:03d}.png")
        by_class.setdefault(label if labelled else 0, []).append(i)
    columns = [by_class[c] for c in sorted(by_class, key=str)]
    order = [i for rank in range(max(map(len, columns))) for column in columns if rank < len(column)
             for i in [column[rank]]]
    return pixels[order], labels[order]


def test_image_folder_gives_the_pixels_and_classes_of_its_images(tmp_path):
    model = _vit_with_processor(tmp_path)
    pixels, labels = _digit_images(tmp_path / "images", 40)
    data = load_data(tmp_path / "images", model=model, batch_size=16)
    assert (data.task, len(data), [b.size for b in data.batches]) == ("classification", 40, [16, 16, 8])
    loaded = torch.cat([b.inputs["pixel_values"] for b in data.batches])
    assert torch.equal(torch.cat([b.labels for b in data.batches]), labels)
    assert (loaded - pixels).abs().max() < 1 / 255 + 1e-6  # only the PNGs' 8-bit rounding
    assert set(data.batches[0].labels.tolist()) == set(labels.tolist())  # classes interleaved: each batch mixes them
    from symgraph.io import load_model

    vit = load_model(model).model
    same = Dataset("same", "classification", (Batch({"pixel_values": pixels}, labels),))
    assert evaluate(vit, data).loss == pytest.approx(evaluate(vit, same).loss, abs=0.02)
    assert len(load_data(tmp_path / "images", model=model, limit=12)) == 12


def test_image_folder_without_classes_is_unlabelled_and_class_folders_may_be_label_names(tmp_path):
    model = _vit_with_processor(tmp_path)
    _digit_images(tmp_path / "flat", 10, labelled=False)
    flat = load_data(tmp_path / "flat", model=model)
    assert len(flat) == 10 and not flat.labelled
    config = json.loads((model / "config.json").read_text())
    config["id2label"] = {str(i): f"digit {i}" for i in range(10)}
    (model / "config.json").write_text(json.dumps(config))
    _, labels = _digit_images(tmp_path / "named", 20)
    for folder in sorted((tmp_path / "named").iterdir()):
        folder.rename(folder.with_name(f"digit {folder.name}"))
    named = load_data(tmp_path / "named", model=model)
    assert torch.equal(torch.cat([b.labels for b in named.batches]), labels)


@pytest.mark.parametrize("case, expected", [
    ("no processor", "has no preprocessor_config.json"),
    ("not an image", r"Cannot read image .*bad\.png"),
    ("both layouts", "holds data files both directly and in class subfolders"),
    ("no images", "holds no images .* or sounds"),
    ("unknown class", "'cat' is neither a class id nor one of the model's labels"),
    ("a language model", "is a folder, which is read as images or sounds, and the model is a causal language model"),
    ("a language model, no images", "is a folder, which is read as images .* causal language model"),
    ("rgb processor", "cannot preprocess"),
])
def test_bad_image_folders_say_what_is_wrong(tmp_path, case, expected):
    import shutil

    model = _vit_with_processor(tmp_path, mean=(0.5, 0.5, 0.5) if case == "rgb processor" else (0.5,))
    images = tmp_path / "images"
    _digit_images(images, 6)
    if case == "no processor":
        (model / "preprocessor_config.json").unlink()
    elif case == "not an image":
        (images / "0" / "bad.png").write_bytes(b"not a png")
    elif case == "both layouts":
        shutil.copy(next((images / "0").iterdir()), images / "loose.png")
    elif case == "no images":
        shutil.rmtree(images)
        (images / "empty").mkdir(parents=True)
    elif case == "unknown class":
        (images / "0").rename(images / "cat")
    elif case.startswith("a language model"):
        model = MODELS / "llama-chars-a"
        if case.endswith("no images"):  # said 'is a folder of images or sounds' of a folder holding none
            shutil.rmtree(images)
            images.mkdir()
            (images / "junk.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=expected) as info:
        load_data(images, model=model)
    assert info.value.hint


def test_cli_barrier_reads_an_image_folder_as_it_reads_the_same_pixels(tmp_path):
    from cli_runner import run

    folders = [_vit_with_processor(tmp_path, name) for name in ("vit-digits-a", "vit-digits-b")]
    pixels, labels = _digit_images(tmp_path / "images", 24)
    np.savez(tmp_path / "pixels.npz", pixel_values=load_data(tmp_path / "images", model=folders[0]).batches[0]
             .inputs["pixel_values"].numpy(), labels=labels.numpy())
    curves = {}
    for name in ("images", "pixels.npz"):
        code, _, stderr = run("barrier", *folders, "--data", tmp_path / name, "--align", "none", "--steps", 3,
                              "-o", tmp_path / f"{name}.png", "--json", tmp_path / f"{name}.json")
        assert code == 0, stderr
        assert "torchvision" not in stderr
        curves[name] = json.loads((tmp_path / f"{name}.json").read_text())["modes"]["none"]["losses"]
    assert curves["images"] == curves["pixels.npz"] and len(curves["images"]) == 3


def _audio_classifier(folder: Path, seed: int = 0) -> Path:
    """A tiny wav2vec2 classifier of 3 classes with its feature extractor (16 kHz, normalised, attention mask)."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForSequenceClassification

    torch.manual_seed(seed)
    config = Wav2Vec2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                            conv_dim=(8, 8), conv_kernel=(10, 3), conv_stride=(5, 2), num_labels=3,
                            num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, vocab_size=8)
    Wav2Vec2ForSequenceClassification(config).eval().save_pretrained(folder)
    Wav2Vec2FeatureExtractor(sampling_rate=16000, return_attention_mask=True).save_pretrained(folder)
    return folder


def _write_wav(file: Path, samples: np.ndarray, rate: int, width: int = 2) -> None:
    """PCM samples in [-1, 1] ((frames,) or (frames, channels)) as a WAV of ``width`` bytes a sample."""
    import wave

    frames = samples.reshape(len(samples), -1)
    ints = np.round(frames * (2 ** (8 * width - 1) - 1)).astype("<i4")
    raw = ints.astype("<i2").tobytes() if width == 2 else b"".join(v.to_bytes(4, "little", signed=True)[:3]
                                                                    for v in ints.reshape(-1).tolist())
    file.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(file), "wb") as out:
        out.setnchannels(frames.shape[1])
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(raw)


def test_sound_folder_gives_the_feature_extractors_inputs_of_its_sounds(tmp_path):
    from transformers import AutoFeatureExtractor

    model = _audio_classifier(tmp_path / "model")
    rng = np.random.default_rng(0)
    clips = {f"{c}/{i}.wav": rng.uniform(-0.5, 0.5, 800 + 160 * i).astype(np.float32)
             for c in ("0", "1", "2") for i in range(2)}
    for name, clip in clips.items():
        _write_wav(tmp_path / "sounds" / name, clip, 16000)
    data = load_data(tmp_path / "sounds", model=model, batch_size=4)
    assert (data.task, len(data), [b.size for b in data.batches]) == ("classification", 6, [4, 2])
    assert torch.cat([b.labels for b in data.batches]).tolist() == [0, 1, 2, 0, 1, 2]  # classes interleaved
    order = ["0/0.wav", "1/0.wav", "2/0.wav", "0/1.wav"]
    int16 = [np.round(clips[n] * 32767) / 32768 for n in order]  # what the 16-bit files hold
    expected = AutoFeatureExtractor.from_pretrained(model)(int16, sampling_rate=16000, padding=True,
                                                           return_tensors="pt")
    assert set(data.batches[0].inputs) == {"input_values", "attention_mask"}
    assert torch.equal(data.batches[0].inputs["attention_mask"], expected["attention_mask"])
    assert torch.allclose(data.batches[0].inputs["input_values"], expected["input_values"].float(), atol=1e-4)
    # another rate, two channels and 24-bit samples: resampled to 16 kHz, channels averaged
    tone = np.sin(np.arange(4000) * 2 * np.pi * 440 / 8000) * 0.5
    _write_wav(tmp_path / "other" / "a.wav", np.stack([tone, tone], 1), 8000, width=3)
    _write_wav(tmp_path / "other" / "b.wav", tone, 8000)
    other = load_data(tmp_path / "other", model=model).batches[0].inputs
    assert other["attention_mask"].sum(1).tolist() == [8000, 8000]
    assert torch.allclose(other["input_values"][0], other["input_values"][1], atol=1e-3)


def test_bad_sound_folders_say_what_is_wrong(tmp_path):
    model = _audio_classifier(tmp_path / "model")
    _write_wav(tmp_path / "sounds" / "0" / "a.wav", np.zeros(800), 16000)
    (tmp_path / "sounds" / "0" / "b.wav").write_bytes(b"RIFF\0\0\0\0WAVEjunk")
    with pytest.raises(DataError, match=r"Cannot read sound .*b\.wav") as info:
        load_data(tmp_path / "sounds", model=model)
    assert "PCM WAV" in info.value.hint
    (tmp_path / "sounds" / "0" / "b.wav").unlink()
    from PIL import Image

    Image.new("L", (8, 8)).save(tmp_path / "sounds" / "0" / "c.png")
    with pytest.raises(DataError, match="holds both images and sounds"):
        load_data(tmp_path / "sounds", model=model)


def test_cli_barrier_runs_on_a_sound_folder(tmp_path):
    from cli_runner import run

    models = [_audio_classifier(tmp_path / f"model-{seed}", seed) for seed in (0, 1)]
    rng = np.random.default_rng(0)
    for c in range(3):
        for i in range(3):
            _write_wav(tmp_path / "sounds" / str(c) / f"{i}.wav", rng.uniform(-0.5, 0.5, 1600), 16000)
    code, _, stderr = run("barrier", *models, "--data", tmp_path / "sounds", "--align", "none", "--steps", 3,
                          "-o", tmp_path / "plot.png", "--json", tmp_path / "curve.json")
    assert code == 0, stderr
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert len(curve["modes"]["none"]["losses"]) == 3 and all(np.isfinite(curve["modes"]["none"]["losses"]))


# ---- arrays ----------------------------------------------------------------------------------------------------


def test_npz_classification_and_causal_lm(tmp_path):
    np.savez(tmp_path / "cls.npz", pixel_values=np.zeros((5, 1, 8, 8), np.float32), labels=np.arange(5))
    cls = load_data(tmp_path / "cls.npz", batch_size=2)
    assert cls.task == "classification" and [b.size for b in cls.batches] == [2, 2, 1]
    assert cls.batches[0].inputs["pixel_values"].dtype == torch.float32
    ids = np.arange(12).reshape(3, 4) % 5
    np.savez(tmp_path / "lm.npz", input_ids=ids, labels=ids)
    lm = load_data(str(tmp_path / "lm.npz"))
    assert lm.task == "causal_lm" and lm.batches[0].labels.dtype == torch.int64 and len(lm) == 3


def test_npz_without_labels_takes_the_models_task(tmp_path):
    mask = np.ones((2, 4), np.int64)
    mask[1, 2:] = 0
    np.savez(tmp_path / "lm.npz", input_ids=np.full((2, 4), 5), attention_mask=mask)
    data = load_data(tmp_path / "lm.npz", model=MODELS / "llama-chars-a")
    assert data.task == "causal_lm" and data.batches[0].labels[1].tolist() == [5, 5, -100, -100]


def test_npz_errors(tmp_path):
    np.savez(tmp_path / "ragged.npz", input_ids=np.zeros((3, 4), np.int64), labels=np.zeros(2, np.int64))
    with pytest.raises(DataError, match="different numbers of examples: input_ids 3, labels 2"):
        load_data(tmp_path / "ragged.npz")
    np.savez(tmp_path / "big.npz", input_ids=np.full((2, 4), 500), labels=np.full((2, 4), 500))
    with pytest.raises(DataError, match="input token id 500, but the model's vocabulary has 99 tokens"):
        load_data(tmp_path / "big.npz", model=MODELS / "llama-chars-a")
    np.savez(tmp_path / "classes.npz", pixel_values=np.zeros((2, 1, 8, 8), np.float32), labels=np.array([3, 12]))
    with pytest.raises(DataError, match="class id 12, but the model has 10 classes"):
        load_data(tmp_path / "classes.npz", model=MODELS / "vit-digits-a")
    np.savez(tmp_path / "negative.npz", pixel_values=np.zeros((2, 1, 8, 8), np.float32), labels=np.array([-1, 0]))
    with pytest.raises(DataError, match="negative label -1"):
        load_data(tmp_path / "negative.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match="Cannot read"):
        load_data(tmp_path / "junk.npz")


def test_images_of_the_wrong_shape_are_refused(tmp_path):
    np.savez(tmp_path / "rgb.npz", pixel_values=np.zeros((2, 3, 8, 8), np.float32), labels=np.array([0, 1]))
    with pytest.raises(DataError, match=r"images of shape \(3, 8, 8\), but the model takes \(1, 8, 8\)"):
        load_data(tmp_path / "rgb.npz", model=MODELS / "vit-digits-a")


def test_a_forward_that_misses_an_input_is_data_that_does_not_fit():
    from symgraph.statistics import data_must_fit

    # text through a ViT: its forward's pixel_values is None, which was a symgraph "internal error" in merges
    data = Dataset("tokens", "causal_lm", (Batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)}),))
    with pytest.raises(DataError, match="Data 'tokens' does not fit model 1: .*AttributeError: 'NoneType'"):
        with data_must_fit(data, "model 1"):
            Linear()(input_ids=data.batches[0].inputs["input_ids"])  # no pixel_values: None.flatten


# ---- factories -------------------------------------------------------------------------------------------------


FACTORY = '''
import torch
from symgraph.datasets import Batch, Dataset

def pairs():
    for i in range(3):
        yield {"pixel_values": torch.zeros(2, 1, 8, 8)}, torch.tensor([i, i])

def tokens():
    return [{"input_ids": torch.ones(2, 5, dtype=torch.long)}]

def dataset():
    return Dataset("mine", "classification", (Batch({"x": torch.zeros(4, 2)}, torch.zeros(4, dtype=torch.long)),))

def broken():
    raise RuntimeError("no data today")

def wrong():
    return 42
'''


def test_factories(tmp_path):
    file = tmp_path / "make_data.py"
    file.write_text(FACTORY)
    pairs = load_data(f"{file}:pairs", model=MODELS / "vit-digits-a")
    assert pairs.task == "classification" and len(pairs) == 6 and pairs.batches[2].labels.tolist() == [2, 2]
    tokens = load_data(f"{file}:tokens", model=MODELS / "llama-chars-a")
    assert tokens.task == "causal_lm" and tokens.batches[0].labels.tolist() == [[1] * 5] * 2
    mine = load_data(f"{file}:dataset", limit=3)
    assert mine.name == "mine" and len(mine) == 3
    with pytest.raises(DataError, match="raised RuntimeError: no data today"):
        load_data(f"{file}:broken")
    with pytest.raises(DataError, match="returned a int"):
        load_data(f"{file}:wrong")
    with pytest.raises(DataError, match="has no attribute 'absent'"):
        load_data(f"{file}:absent")


def test_bad_arguments():
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        load_data("digits", batch_size=0)
    with pytest.raises(DataError, match="task 'regression'"):
        Dataset("x", "regression", ())


# ---- losses and metrics ----------------------------------------------------------------------------------------


def test_evaluate_weights_batches_by_examples():
    model = Linear()
    small, big = load_data("digits", batch_size=7), load_data("digits", batch_size=1000)
    a, b = evaluate(model, small), evaluate(model, big)
    assert a.examples == b.examples == 360
    assert a.loss == pytest.approx(b.loss, rel=1e-5) and a.accuracy == pytest.approx(b.accuracy)
    logits = model(big.batches[0].inputs["pixel_values"])[0]
    assert b.loss == pytest.approx(F.cross_entropy(logits, big.batches[0].labels).item(), rel=1e-5)
    assert b.accuracy == pytest.approx((logits.argmax(1) == big.batches[0].labels).float().mean().item())


def test_causal_lm_loss_shifts_and_skips_padding():
    model = Linear(classes=6, vocab=6)
    ids = torch.tensor([[1, 2, 3, 4], [5, 1, 0, 0]])
    labels = torch.tensor([[1, 2, 3, 4], [5, 1, -100, -100]])
    data = Dataset("toy", "causal_lm", (Batch({"input_ids": ids}, labels),))
    logits = model(input_ids=ids)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 6), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert evaluate(model, data).loss == pytest.approx(expected.item(), rel=1e-5)
    assert batch_loss(model, data.batches[0], "causal_lm").item() == pytest.approx(expected.item(), rel=1e-5)


def test_batch_loss_is_differentiable_and_evaluate_restores_mode():
    model = Linear().train()
    batch = load_data("digits", limit=16).batches[0]
    batch_loss(model, batch, "classification").backward()
    assert model.head.weight.grad is not None and model.head.weight.grad.abs().sum() > 0
    evaluate(model, load_data("digits", limit=4))
    assert model.training


def test_unlabelled_classification_uses_the_models_own_predictions():
    model = Linear()
    pixels = load_data("digits", limit=8).batches[0].inputs["pixel_values"]
    data = Dataset("unlabelled", "classification", (Batch({"pixel_values": pixels}),))
    metrics = evaluate(model, data)
    logits = model(pixels)[0]
    assert metrics.accuracy is None
    assert metrics.loss == pytest.approx(F.cross_entropy(logits, logits.argmax(1)).item(), rel=1e-5)


def test_logits_of_every_output_form():
    from transformers.modeling_outputs import SequenceClassifierOutput

    t = torch.ones(2, 3)
    for output in (t, (t, None), [t], {"logits": t}, SequenceClassifierOutput(logits=t)):
        assert logits_of(output) is t
    with pytest.raises(DataError, match="Cannot find logits"):
        logits_of({"hidden": t})


def test_vocabulary_is_fixed():
    vocab = char_vocabulary()
    assert len(vocab) == 99 and sorted(vocab.values()) == list(range(99)) and vocab["\n"] == 3
    assert set(DATASETS) == {"digits", "pydoc-chars", "pydoc-topics"}
