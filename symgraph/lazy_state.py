"""A checkpoint's tensors read on demand: a safetensors file or folder (single or sharded) as a mapping whose
values are read from the memory-mapped file only when asked for, in the dtype they are stored in.

Alignment and merging at 7B cannot hold two models: they read a block's tensors, work on them in fp32 and let
them go. ``state[name]`` is a tensor backed by a private (copy-on-write) memory map of just that tensor's bytes
(safetensors' ``safe_open``): pages are read from disk when first touched, writing to the tensor never reaches the
file, and the mapping goes away with the tensor, so the resident memory is the tensors alive and no more (a handle
kept open on a whole 5 GB shard would count every page read through it).

Examples
--------
>>> import tempfile, torch
>>> from symgraph.shards import TensorInfo, write_checkpoint
>>> out = write_checkpoint(tempfile.mkdtemp() + "/m", [TensorInfo("w", (2, 2), torch.float16)],
...                        lambda name: torch.eye(2, dtype=torch.float16))
>>> state = LazyState(out)
>>> list(state), state.info("w").shape, state["w"].dtype
(['w'], (2, 2), torch.float16)
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .errors import MismatchError, ModelLoadError
from .shards import SAFETENSORS_DTYPES, TensorInfo

__all__ = ["LazyState", "RenamedState", "UntiedState", "check_same_tensors", "safetensors_files"]

_TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class LazyState(Mapping[str, torch.Tensor]):
    """The tensors of the safetensors checkpoint at ``source`` (a model folder, its index file, or one
    ``.safetensors`` file), keyed as stored; ``state[name]`` reads one tensor in its stored dtype.

    Raises :class:`~symgraph.errors.ModelLoadError` when the folder has no safetensors weights, the index names a
    shard that is missing, or a file's header is damaged; with ``finite``, also when a floating-point tensor read
    holds NaN or Inf (bad input, named as such before any solver fails on it).
    """

    def __init__(self, source, *, finite: bool = False):
        self.finite = finite
        self.files = safetensors_files(source)
        self.folder = self.files[0].parent
        self._file_of: dict[str, Path] = {}
        self._infos: dict[str, TensorInfo] = {}
        for file in self.files:
            for info in _header_infos(file):
                self._file_of[info.name] = file
                self._infos[info.name] = info

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._file_of[name]  # KeyError for an unknown name, as a mapping should
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensor = handle.get_tensor(name)
        except Exception as exc:  # SafetensorError, OSError: the file changed or broke since it was opened
            raise ModelLoadError(f"Cannot read tensor '{name}' from '{file}': {exc}",
                                 hint="the file is damaged or was changed while it was read: re-save it.") from exc
        if self.finite and tensor.is_floating_point():
            from .io import all_finite, nonfinite_error

            if not all_finite(tensor):
                raise nonfinite_error(f"the weights in '{self.folder}'", [name])
        return tensor

    def __contains__(self, name) -> bool:  # Mapping's default would read the tensor to find out
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> TensorInfo:
        """Name, shape and stored dtype of one tensor, from the file header (no values read)."""
        return self._infos[name]

    def infos(self) -> list[TensorInfo]:
        """Every tensor's :class:`~symgraph.shards.TensorInfo`, in file order."""
        return list(self._infos.values())

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self._infos.values())


class ReadThrough(Mapping[str, torch.Tensor]):
    """A mapping over the names of ``self.state`` (a :class:`LazyState`, or another of these) whose tensors are
    computed from it as they are read; names, sizes and the folder are ``state``'s."""

    state: "LazyState | ReadThrough"

    @property
    def folder(self) -> Path:
        return self.state.folder

    def __contains__(self, name) -> bool:
        return name in self.state

    def __iter__(self):
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)

    def info(self, name: str):
        return self.state.info(name)

    def infos(self):
        return self.state.infos()

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


class RenamedState(ReadThrough):
    """``state`` (a checkpoint, keyed as stored) keyed by the model's own names: ``renamed`` maps each model name the
    checkpoint stores under another name to that name (:func:`symgraph.checkpoint.renamed_on_save`). Reading a
    stored name still works, so what was written can be compared name by name."""

    def __init__(self, state: "LazyState | ReadThrough", renamed: dict[str, str]):
        self.state, self.stored_of = state, dict(renamed)
        self.named_of = {stored: name for name, stored in self.stored_of.items()}

    def stored(self, name: str) -> str:
        """The name ``name`` (a model name) is stored under."""
        return self.stored_of.get(name, name)

    def named(self, stored: str) -> str:
        """The model's name for the stored name ``stored``."""
        return self.named_of.get(stored, stored)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[self.stored(name)]

    def __contains__(self, name) -> bool:
        return name in self.stored_of or (name in self.state and name not in self.named_of)

    def __iter__(self):
        return (self.named(stored) for stored in self.state)

    def info(self, name: str) -> TensorInfo:
        stored = self.state.info(self.stored(name))
        return TensorInfo(name, stored.shape, stored.dtype)

    def infos(self) -> list[TensorInfo]:
        return [self.info(name) for name in self]


class UntiedState(ReadThrough):
    """``state`` with tied names it does not store read as tensors of their own: ``untied`` maps each such name
    (an LM head tied to the embedding) to the stored name it ties to, whose numbers it reads. What an untied model
    (``tie_word_embeddings`` false) loads from the checkpoint, so that a fold can move the two apart. A name
    ``state`` stores reads its own tensor."""

    def __init__(self, state: "LazyState | ReadThrough", untied: dict[str, str]):
        self.state, self.untied = state, {name: tie for name, tie in untied.items() if name not in state}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[self.untied.get(name, name)]

    def __contains__(self, name) -> bool:
        return name in self.untied or name in self.state

    def __iter__(self):
        yield from self.state
        yield from self.untied

    def __len__(self) -> int:
        return len(self.state) + len(self.untied)

    def info(self, name: str) -> TensorInfo:
        stored = self.state.info(self.untied.get(name, name))
        return TensorInfo(name, stored.shape, stored.dtype)

    def infos(self) -> list[TensorInfo]:
        return [self.info(name) for name in self]


def safetensors_files(source) -> list[Path]:
    """The safetensors files of a checkpoint: the file itself, the folder's ``model.safetensors``, or the shards
    the folder's (or the given) ``model.safetensors.index.json`` lists, each checked to exist and to be readable."""
    from .io import _check_weights, _weight_files

    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".safetensors":
        folder, weights = path.parent, path
    else:
        folder = path if path.is_dir() else path.parent
        if path.is_file() and path.name.endswith(".index.json"):
            weights = path
        else:
            weights = next((folder / n for n in ("model.safetensors", "model.safetensors.index.json")
                            if (folder / n).is_file()), None)
        if weights is None:
            what = "does not exist" if not path.exists() else "has no model.safetensors or model.safetensors.index.json"
            raise ModelLoadError(f"'{path}' {what}: streaming reads safetensors checkpoints only.",
                                 hint="pass a Hugging Face folder saved as safetensors (re-save a .bin checkpoint "
                                 "with save_pretrained(safe_serialization=True)).")
    _check_weights(folder, weights)  # a missing shard or a damaged header: a clear error naming the file
    return _weight_files(folder, weights)


def _header_infos(file: Path) -> list[TensorInfo]:
    from safetensors import safe_open

    infos = []
    with safe_open(str(file), framework="pt") as handle:
        for name in handle.keys():
            tensor_slice = handle.get_slice(name)
            stored = tensor_slice.get_dtype()
            if stored not in _TORCH_DTYPES:
                raise ModelLoadError(f"Tensor '{name}' in '{file}' has dtype {stored}, which symgraph cannot read.",
                                     hint=f"symgraph reads {', '.join(_TORCH_DTYPES)}.")
            infos.append(TensorInfo(name, tuple(tensor_slice.get_shape()), _TORCH_DTYPES[stored]))
    return infos


def check_same_tensors(first: LazyState, other: LazyState, where: str, hint: str) -> None:
    """Refuse two checkpoints that store different tensor names or shapes (read from their headers), naming what
    differs; ``where`` names the pair ("Model 1 (A) and model 2 (B)")."""
    if set(first) != set(other):
        only_a, only_b = sorted(set(first) - set(other))[:3], sorted(set(other) - set(first))[:3]
        raise MismatchError(f"{where} store different tensors (only in the first: {only_a}; only in the second: "
                            f"{only_b}).", hint=hint)
    differ = [k for k in first if first.info(k).shape != other.info(k).shape]
    if differ:
        k = differ[0]
        raise MismatchError(f"{where} differ in shape: {k} is {first.info(k).shape} vs {other.info(k).shape} "
                            f"({len(differ)} tensors differ).", hint=hint)
