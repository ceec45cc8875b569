"""Rows of data stored in Arrow's formats, as records (dicts) for :mod:`symgraph.datasets`.

Hugging Face datasets come as Parquet files (what the Hub serves: ``train-00000-of-00001.parquet``), as Arrow IPC
files (what ``datasets`` caches), or as a folder written by ``Dataset.save_to_disk`` (``state.json`` naming its
``data-*.arrow`` shards) or ``DatasetDict.save_to_disk`` (``dataset_dict.json`` naming one such folder per split).
All are read with pyarrow; ``datasets`` itself is not needed. Only the first ``limit`` rows are converted.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import DataError

SUFFIXES = (".parquet", ".arrow")
_SAVED_HINT = "save it again with datasets' save_to_disk, or export it with to_parquet and pass the .parquet file."


def is_saved_dataset(folder: Path) -> bool:
    """A folder ``datasets``' ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def table_records(path: Path, limit: int | None) -> list[dict]:
    """The first ``limit`` rows (all with None) of a ``.parquet`` or ``.arrow`` file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            file = pq.ParquetFile(path)
            batches = file.iter_batches() if limit is None else file.iter_batches(batch_size=min(limit, 65536))
            table = pa.Table.from_batches(_first_rows(batches, limit), schema=file.schema_arrow)
        else:
            table = _ipc_table(path, limit)
    except (pa.ArrowException, OSError) as exc:
        kind = "a Parquet" if path.suffix == ".parquet" else "an Arrow IPC"
        raise DataError(f"Cannot read '{path}' as {kind} file: {exc}",
                        hint="check that it is one, and complete (a download or a copy may have been cut short).") \
            from exc
    return table.slice(0, limit).to_pylist()


def saved_dataset_records(folder: Path, split: str | None, default_split: str, limit: int | None) -> list[dict]:
    """The rows of a ``save_to_disk`` folder: a Dataset's shards in order, or one split of a DatasetDict (``split``,
    else ``default_split`` where the folder has it, else its only split)."""
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json").get("splits") or []
        chosen = split or (default_split if default_split in splits else splits[0] if len(splits) == 1 else None)
        if chosen not in splits:
            asked = f"has no split '{chosen}'" if chosen else f"holds {len(splits)} splits and none was chosen"
            raise DataError(f"The saved DatasetDict '{folder}' {asked}; its splits are {', '.join(splits) or 'none'}.",
                            hint=f"name one after a colon: '{folder}:{splits[0] if splits else 'train'}'.")
        folder = folder / chosen
    elif split:
        raise DataError(f"'{folder}' is a saved Dataset, which has no splits, and ':{split}' names one.",
                        hint=f"pass '{folder}' alone.")
    state = _json(folder / "state.json")
    files = [entry.get("filename") for entry in state.get("_data_files") or []]
    if not files or not all(isinstance(f, str) and (folder / f).is_file() for f in files):
        raise DataError(f"The saved dataset '{folder}' names data files in state.json that are not all there "
                        f"({', '.join(map(str, files)) or 'none named'}).", hint=_SAVED_HINT)
    records: list[dict] = []
    for file in files:
        records += table_records(folder / file, None if limit is None else limit - len(records))
        if limit is not None and len(records) >= limit:
            break
    return records


def _ipc_table(path: Path, limit: int | None):
    """An Arrow IPC stream (what ``datasets`` writes) or file, up to ``limit`` rows."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    with pa.memory_map(str(path)) as source:
        try:
            reader = ipc.open_stream(source)
        except pa.ArrowInvalid:  # not a stream: the random-access file format
            source.seek(0)
            file = ipc.open_file(source)
            return pa.Table.from_batches(_first_rows((file.get_batch(i) for i in range(file.num_record_batches)),
                                                     limit), schema=file.schema)
        return pa.Table.from_batches(_first_rows(reader, limit), schema=reader.schema)


def _first_rows(batches, limit: int | None) -> list:
    kept, rows = [], 0
    for batch in batches:
        if limit is not None and rows >= limit:
            break
        kept.append(batch)
        rows += batch.num_rows
    return kept


def _json(file: Path) -> dict:
    try:
        document = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"Cannot read '{file}' of a saved dataset: {exc}.", hint=_SAVED_HINT) from exc
    if not isinstance(document, dict):
        raise DataError(f"'{file}' of a saved dataset holds a JSON {type(document).__name__}, not an object.",
                        hint=_SAVED_HINT)
    return document
