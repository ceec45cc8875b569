"""Checkpoints written tensor by tensor: sharded safetensors with the Hugging Face index, whole or absent.

A 7B model does not fit in memory twice, so nothing here holds more than one tensor: the shards are planned
from names, shapes and dtypes alone (:func:`plan_shards`), each shard's header is written first, and each tensor
is asked for (``produce(name)``) only when its bytes are due. The folder is staged beside OUT and moved into place
once every shard, the index and the side files are complete (:func:`symgraph.checkpoint.staged_folder`); a write
that fails (a full disk) removes the staged shards and leaves OUT as it was.

Examples
--------
>>> import tempfile, torch
>>> from symgraph.lazy_state import LazyState
>>> state = {"a": torch.ones(2, 3, dtype=torch.bfloat16), "b": torch.ones(4)}
>>> out = write_checkpoint(tempfile.mkdtemp() + "/m", infos_of(state), state.__getitem__, shard_bytes=16)
>>> sorted(p.name for p in out.iterdir())
['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
>>> LazyState(out)["a"].dtype
torch.bfloat16
"""
from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (carried_index_metadata, carried_metadata, file_metadata, index_dropped, output_folder,
                         staged_folder, write_side_files)
from .errors import OutputError

__all__ = ["TensorInfo", "DEFAULT_SHARD_BYTES", "plan_shards", "shard_names", "infos_of", "write_checkpoint",
           "SAFETENSORS_DTYPES"]

#: transformers' default ``max_shard_size`` for ``save_pretrained``.
DEFAULT_SHARD_BYTES = 5 * 10**9
INDEX_FILE = "model.safetensors.index.json"

#: torch dtype <-> the dtype names of the safetensors header.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def widest_dtype(dtypes) -> torch.dtype:
    """The dtype that holds a value of each of ``dtypes`` exactly (torch's promotion: float32 for bfloat16 and
    float16, which do not nest)."""
    result = None
    for dtype in dtypes:
        result = dtype if result is None else torch.promote_types(result, dtype)
    return result


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint stores under ``name``, without its values."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= int(size)
        return count * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(infos: Sequence[TensorInfo], shard_bytes: int) -> list[list[TensorInfo]]:
    """``infos`` in their order, cut into consecutive shards of at most ``shard_bytes`` (a tensor larger than
    that gets a shard of its own), as ``save_pretrained`` cuts them."""
    if shard_bytes <= 0:
        raise OutputError(f"The shard size must be positive, got {shard_bytes} bytes.",
                          hint="give a size such as 5GB (the transformers default) or 500MB.")
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in infos:
        if shards[-1] and size + info.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.nbytes
    return shards


def shard_names(count: int) -> list[str]:
    """File names of ``count`` shards as transformers names them (one shard: ``model.safetensors``)."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_checkpoint(out_dir, infos: Sequence[TensorInfo], produce: Callable[[str], torch.Tensor], *,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, config: Any = None, like=None,
                     overwrite: bool = False, check: Callable[[Path], None] | None = None,
                     metadata: Mapping[str, str] | None = None,
                     index_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a Hugging Face folder at ``out_dir`` whose weights are the tensors ``infos`` names, in that order,
    each obtained from ``produce(name)`` when its bytes are written (one tensor in memory at a time).

    Several shards get ``model.safetensors.index.json``; ``config`` (a dict or ``PretrainedConfig``) or
    ``like``'s config.json and tokenizer files go beside them; every shard's safetensors metadata is ``metadata``
    (default: ``like``'s, :func:`~symgraph.checkpoint.carried_metadata`) with ``format`` ``pt``; the index's
    "metadata" is ``index_metadata`` (default: ``like``'s, :func:`~symgraph.checkpoint.carried_index_metadata`) with
    the shards' ``total_size``. Atomic: nothing at ``out_dir`` until every file is complete; on failure the staged
    files are removed and :class:`~symgraph.errors.OutputError` says why.
    ``check(staged_folder)``, when given, runs on the complete staged folder before it is moved to ``out_dir``;
    whatever it raises propagates and leaves nothing at ``out_dir``.
    """
    _check_infos(infos)
    out, like_dir = output_folder(out_dir, like, overwrite=overwrite)
    shards = plan_shards(infos, shard_bytes)
    names = shard_names(len(shards))
    metadata = file_metadata(metadata if metadata is not None else carried_metadata([like_dir]))
    index_metadata = index_metadata if index_metadata is not None else carried_index_metadata([like_dir])
    if len(shards) == 1:
        index_dropped(index_metadata)
    with staged_folder(out, overwrite=overwrite) as tmp:
        for name, shard in zip(names, shards):
            _write_shard(tmp / name, shard, produce, metadata)
        if len(shards) > 1:
            _write_index(tmp / INDEX_FILE, shards, names, index_metadata)
        write_side_files(tmp, config=config, like_dir=like_dir, dtypes=[i.dtype for i in infos])
        if check is not None:
            check(tmp)
    return out


def _check_infos(infos: Sequence[TensorInfo]) -> None:
    names = [info.name for info in infos]
    if len(set(names)) != len(names):
        raise OutputError("The tensors to write name some key twice.", hint="this is a symgraph bug: report it.")
    unknown = [info for info in infos if info.dtype not in SAFETENSORS_DTYPES]
    if unknown:
        raise OutputError(f"Tensor '{unknown[0].name}' has dtype {unknown[0].dtype}, which safetensors cannot store.",
                          hint=f"convert it to one of {', '.join(map(str, SAFETENSORS_DTYPES))}.")


def _write_shard(path: Path, shard: Sequence[TensorInfo], produce: Callable[[str], torch.Tensor],
                 metadata: dict[str, str]) -> None:
    """One safetensors file: the header (offsets known from shapes), then each tensor's bytes as produced.
    Wider dtypes come first, as safetensors orders them, so every tensor starts aligned to its element size."""
    shard = sorted(shard, key=lambda info: -torch.empty((), dtype=info.dtype).element_size())
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for info in shard:
        header[info.name] = {"dtype": SAFETENSORS_DTYPES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(blob)) + blob)
        for info in shard:
            file.write(_bytes_of(produce(info.name), info))


def _bytes_of(tensor: torch.Tensor, info: TensorInfo) -> memoryview:
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != info.shape or tensor.dtype != info.dtype:
        got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise OutputError(f"The tensor produced for '{info.name}' is {got}, but the plan says {info.shape} "
                          f"{info.dtype}.", hint="this is a bug in the code producing the tensors: report it.")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _write_index(path: Path, shards: Sequence[Sequence[TensorInfo]], names: Sequence[str],
                 metadata: Mapping[str, Any]) -> None:
    weight_map = {info.name: name for name, shard in zip(names, shards) for info in shard}
    total = sum(info.nbytes for shard in shards for info in shard)
    index = {"metadata": {**metadata, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    path.write_text(json.dumps(index, indent=2) + "\n")


def infos_of(state: Mapping[str, torch.Tensor]) -> list[TensorInfo]:
    """The plan of an in-memory state dict, in its order."""
    return [TensorInfo(name, tuple(value.shape), value.dtype) for name, value in state.items()]
