"""Data in Arrow's formats (symgraph.tables): Parquet files as the Hugging Face Hub serves them, Arrow IPC files as
``datasets`` caches them, and folders ``save_to_disk`` writes (a Dataset's shards, a DatasetDict's splits). Each
must give the batches the same rows give as JSON Lines; images and sounds stored as ``datasets``' Image and Audio
features store them (the file's bytes, or its path) the inputs their files give in a folder. The files are written
here with pyarrow in the layout ``datasets`` 5.2 writes (checked against files it wrote)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import torch

from symgraph.datasets import load_data
from symgraph.errors import DataError
from tests.test_datasets import (MODELS, _audio_classifier, _digit_images, _same_batches, _vit_with_processor,
                                 _write_wav)

MEDIA = pa.struct([("bytes", pa.binary()), ("path", pa.string())])  # datasets' Image and Audio storage

LINES = [(1, "x + y"), (0, "if x:"), (3, 'say "hi", then go'), (2, "def __add__(self, other):"), (1, "a or b")]


def _table(rows) -> pa.Table:
    return pa.table({"sentence": [t for _, t in rows], "label": pa.array([c for c, _ in rows], pa.int64())})


def _arrow(table: pa.Table, file: Path, stream: bool = True) -> Path:
    with pa.OSFile(str(file), "wb") as sink:
        writer = (ipc.new_stream if stream else ipc.new_file)(sink, table.schema)
        writer.write_table(table, max_chunksize=2)  # several record batches, as datasets writes 1000-row ones
        writer.close()
    return file


def _saved(folder: Path, table: pa.Table, shards: int = 1) -> Path:
    """What ``Dataset.save_to_disk(folder, num_shards=shards)`` writes."""
    folder.mkdir(parents=True)
    size = -(-table.num_rows // shards)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    for i, name in enumerate(names):
        _arrow(table.slice(i * size, size), folder / name)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                                   "_fingerprint": "0", "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def _saved_dict(folder: Path, splits: dict[str, pa.Table]) -> Path:
    """What ``DatasetDict.save_to_disk(folder)`` writes."""
    for name, table in splits.items():
        _saved(folder / name, table)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return folder


def test_parquet_arrow_and_saved_datasets_give_the_batches_of_the_same_records(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"sentence": t, "label": c}) + "\n" for c, t in LINES))
    table = _table(LINES)
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=2)
    model = MODELS / "bert-topics-a"
    want = load_data(tmp_path / "rows.jsonl", model=model, batch_size=2)
    assert want.batches[0].labels.tolist() == [1, 0]
    for spec in (tmp_path / "rows.parquet", _arrow(table, tmp_path / "stream.arrow"),
                 _arrow(table, tmp_path / "file.arrow", stream=False), _saved(tmp_path / "one", table),
                 _saved(tmp_path / "three", table, shards=3)):
        assert _same_batches(load_data(spec, model=model, batch_size=2), want), spec
    # a limit keeps the first rows, across row groups and shards
    first = load_data(tmp_path / "rows.jsonl", model=model, batch_size=2, limit=3)
    for spec in (tmp_path / "rows.parquet", tmp_path / "stream.arrow", tmp_path / "three"):
        assert _same_batches(load_data(spec, model=model, batch_size=2, limit=3), first), spec
    # a causal LM reads the texts alone
    lm = load_data(tmp_path / "rows.parquet", model=MODELS / "llama-chars-a")
    assert lm.task == "causal_lm" and len(lm) == len(LINES)


def test_a_saved_dataset_dict_gives_the_split_named_or_asked_for(tmp_path):
    train, test = LINES[:3], LINES[3:]
    folder = _saved_dict(tmp_path / "dict", {"train": _table(train), "test": _table(test)})
    model = MODELS / "bert-topics-a"

    def labels(spec, **options):
        return torch.cat([b.labels for b in load_data(spec, model=model, **options).batches]).tolist()

    assert labels(folder, split="train") == [c for c, _ in train]
    assert labels(folder) == [c for c, _ in test]  # load_data's own default split
    assert labels(f"{folder}:train", split="test") == [c for c, _ in train]  # the colon wins
    with pytest.raises(DataError, match="has no split 'valid'; its splits are train, test") as info:
        load_data(f"{folder}:valid", model=model)
    assert f"'{folder}:train'" in info.value.hint
    only = _saved_dict(tmp_path / "only", {"validation": _table(LINES)})
    assert labels(only, split="train") == [c for c, _ in LINES]  # its only split
    with pytest.raises(DataError, match="is a saved Dataset, which has no splits"):
        load_data(f"{_saved(tmp_path / 'single', _table(LINES))}:train", model=model)


def test_the_cli_reads_a_parquet_file_as_it_reads_the_same_records(tmp_path):
    from cli_runner import run

    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"sentence": t, "label": c}) + "\n" for c, t in LINES))
    pq.write_table(_table(LINES), tmp_path / "rows.parquet")
    curves = {}
    for name in ("rows.jsonl", "rows.parquet"):
        code, _, stderr = run("barrier", MODELS / "bert-topics-a", MODELS / "bert-topics-b", "--data", tmp_path / name,
                              "--align", "none", "--steps", 3, "-o", tmp_path / f"{name}.png",
                              "--json", tmp_path / f"{name}.json")
        assert code == 0, stderr
        curves[name] = json.loads((tmp_path / f"{name}.json").read_text())["modes"]["none"]["losses"]
    assert curves["rows.parquet"] == curves["rows.jsonl"] and len(curves["rows.jsonl"]) == 3


def test_images_stored_as_bytes_or_paths_give_the_pixels_of_the_image_folder(tmp_path):
    model = _vit_with_processor(tmp_path)
    _digit_images(tmp_path / "images", 12)
    want = load_data(tmp_path / "images", model=model, batch_size=5)
    files = [(f, int(f.parent.name)) for b in range(12) for f in (tmp_path / "images").glob(f"*/{b:03d}.png")]
    # the folder lists classes interleaved; a dataset keeps its rows' order: store the rows in the folder's order
    pixels = torch.cat([b.inputs["pixel_values"] for b in want.batches])
    labels = torch.cat([b.labels for b in want.batches]).tolist()
    by_class = {}
    for f, c in sorted(files, key=lambda fc: fc[0].name):
        by_class.setdefault(c, []).append(f)
    columns = [by_class[c] for c in sorted(by_class, key=str)]
    listed = [col[rank] for rank in range(max(map(len, columns))) for col in columns if rank < len(col)]
    assert [int(f.parent.name) for f in listed] == labels
    embedded = pa.table({"image": pa.array([{"bytes": f.read_bytes(), "path": None} for f in listed], MEDIA),
                         "label": labels})
    linked = pa.table({"image": pa.array([{"bytes": None, "path": str(f)} for f in listed], MEDIA),
                       "label": labels})
    pq.write_table(embedded, tmp_path / "embedded.parquet")
    pq.write_table(linked, tmp_path / "linked.parquet")  # what datasets' to_parquet writes for images read from files
    for spec in (tmp_path / "embedded.parquet", tmp_path / "linked.parquet", _saved(tmp_path / "saved", embedded)):
        data = load_data(spec, model=model, batch_size=5)
        assert data.task == "classification" and [b.size for b in data.batches] == [5, 5, 2], spec
        assert torch.equal(torch.cat([b.inputs["pixel_values"] for b in data.batches]), pixels), spec
        assert torch.cat([b.labels for b in data.batches]).tolist() == labels
    # WebP images are RIFF files, as WAV sounds are: still read as images (lossless: the same pixels)
    from PIL import Image

    webp = []
    for f in listed:
        buffer = io.BytesIO()
        Image.open(f).save(buffer, format="WEBP", lossless=True)
        webp.append({"bytes": buffer.getvalue(), "path": None})
    assert webp[0]["bytes"][:4] == b"RIFF"
    pq.write_table(pa.table({"image": pa.array(webp, MEDIA), "label": labels}), tmp_path / "webp.parquet")
    data = load_data(tmp_path / "webp.parquet", model=model, batch_size=5)
    assert torch.equal(torch.cat([b.inputs["pixel_values"] for b in data.batches]), pixels)
    with pytest.raises(DataError, match="is a dataset of images or sounds, and the model is a causal language"):
        load_data(tmp_path / "embedded.parquet", model=MODELS / "llama-chars-a")


def test_sounds_stored_as_bytes_give_the_inputs_of_the_sound_folder(tmp_path):
    model = _audio_classifier(tmp_path / "model")
    rng = np.random.default_rng(0)
    for c in range(3):
        _write_wav(tmp_path / "sounds" / str(c) / "0.wav", rng.uniform(-0.5, 0.5, 800 + 160 * c), 16000)
    want = load_data(tmp_path / "sounds", model=model)  # classes 0, 1, 2 in that order
    rows = [{"bytes": (tmp_path / "sounds" / str(c) / "0.wav").read_bytes(), "path": f"{c}.wav"} for c in range(3)]
    pq.write_table(pa.table({"audio": pa.array(rows, MEDIA), "label": [0, 1, 2]}), tmp_path / "sounds.parquet")
    assert _same_batches(load_data(tmp_path / "sounds.parquet", model=model), want)


def test_broken_tables_and_saved_folders_say_what_is_wrong(tmp_path):
    model = MODELS / "bert-topics-a"
    pq.write_table(_table(LINES), tmp_path / "rows.parquet")
    data = (tmp_path / "rows.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[:len(data) // 2])
    with pytest.raises(DataError, match="Cannot read .*cut.parquet' as a Parquet file") as info:
        load_data(tmp_path / "cut.parquet", model=model)
    assert "cut short" in info.value.hint
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all" * 4)
    with pytest.raises(DataError, match="as an Arrow IPC file"):
        load_data(tmp_path / "junk.arrow", model=model)
    folder = _saved(tmp_path / "saved", _table(LINES), shards=2)
    (folder / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DataError, match="names data files in state.json that are not all there"):
        load_data(folder, model=model)
    (folder / "state.json").write_text("[1]")
    with pytest.raises(DataError, match="holds a JSON list, not an object"):
        load_data(folder, model=model)
    pq.write_table(pa.table({"a": ["x"], "b": ["y"]}), tmp_path / "two.parquet")
    with pytest.raises(DataError, match="Cannot tell which field .* holds the text"):
        load_data(tmp_path / "two.parquet", model=model)
    pq.write_table(pa.table({"image": pa.array([{"bytes": None, "path": "gone.png"}], MEDIA)}),
                   tmp_path / "gone.parquet")
    with pytest.raises(DataError, match="names its file by the path 'gone.png', and there is no such file"):
        load_data(tmp_path / "gone.parquet", model=_vit_with_processor(tmp_path))
    pq.write_table(pa.table({"image": pa.array([{"bytes": b"\x89PNG broken", "path": None}], MEDIA)}),
                   tmp_path / "bad.parquet")
    with pytest.raises(DataError, match="Cannot read image 'record 1 of"):
        load_data(tmp_path / "bad.parquet", model=_vit_with_processor(tmp_path / "m"))
