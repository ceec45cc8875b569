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

__all__ = ["LazyState", "ConvertedState", "UntiedState", "check_same_tensors", "safetensors_files"]

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

    def forget(self) -> None:
        """Nothing is kept between reads: each read is a tensor of its own (see :meth:`ReadThrough.forget`)."""


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

    def forget(self) -> None:
        """Let go of any tensors kept for the next read (a block done with them frees their memory)."""
        self.state.forget()


class ConvertedState(ReadThrough):
    """``state`` (a checkpoint, keyed as stored) keyed by the model's own names: ``layout``
    (:class:`symgraph.checkpoint.StoredLayout`) says which parameters the checkpoint stores under other names or
    in another layout (experts stored one by one that the model stacks, a renamed attention key), and each is read
    by converting its unit's stored tensors as transformers does on loading. Every converted unit is converted
    back as on saving and must give the stored tensors again, bit for bit (a conversion that is not a
    rearrangement could not be written back: refused). The last unit converted is kept, as a block reads its
    tensors one by one."""

    def __init__(self, state: "LazyState | ReadThrough", layout):
        self.state, self.layout = state, layout
        units = [u for u in layout.units if any(n in state for n in u.stored)]
        self.unit_of = {name: u for u in units for name in u.model}
        self.unit_of_stored = {name: u for u in units for name in u.stored}
        self._unit, self._tensors = None, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        unit = self.unit_of.get(name)
        if unit is None:
            return self.state[name]
        if unit.renames:
            return self.state[unit.stored[0]]
        if unit is not self._unit:
            self._unit, self._tensors = None, {}  # the previous unit let go before the next is read
            self._tensors, self._unit = self._converted(unit), unit
        return self._tensors[name]

    def _converted(self, unit) -> dict[str, torch.Tensor]:
        missing = [n for n in unit.stored if n not in self.state]
        if missing:
            raise ModelLoadError(f"The checkpoint '{self.folder}' stores {unit.stored[0]} but not {missing[0]}, "
                                 f"which transformers reads with it into {unit.model[0]}.",
                                 hint="the checkpoint is incomplete: re-save it with save_pretrained.")
        stored = {n: self.state[n] for n in unit.stored}
        tensors = self.layout.to_model(unit, stored)
        back = self.layout.to_stored(unit, tensors)
        if back.keys() != stored.keys() or not all(torch.equal(back[n], stored[n]) for n in stored):
            raise ModelLoadError(f"transformers' conversion of {unit.stored[0]} (and {len(stored) - 1} more) into "
                                 f"{', '.join(unit.model)} of '{self.folder}' does not give the stored tensors back "
                                 "when reverted, so an aligned checkpoint could not be written in its layout.",
                                 hint="align it in memory (without --stream).")
        return tensors

    def __contains__(self, name) -> bool:
        return name in self.unit_of or (name in self.state and name not in self.unit_of_stored)

    def forget(self) -> None:
        self._unit, self._tensors = None, {}
        self.state.forget()

    def __iter__(self):
        seen = set()
        for stored in self.state:
            unit = self.unit_of_stored.get(stored)
            if unit is None:
                yield stored
            elif unit not in seen:
                seen.add(unit)
                yield from unit.model

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def info(self, name: str) -> TensorInfo:
        unit = self.unit_of.get(name)
        if unit is None:
            return self.state.info(name)
        stored = self.state.info(unit.stored[0])
        return TensorInfo(name, self.layout.shapes[name], stored.dtype)

    def infos(self) -> list[TensorInfo]:
        return [self.info(name) for name in self]

    def stored_infos(self, model_state) -> list[TensorInfo]:
        """The stored tensors that hold the tensors of ``model_state`` (this state or one reading through it, keyed
        by model names; a name no unit converts is stored as it is named, its info ``model_state``'s), each once,
        in the order of the first name each holds."""
        infos, seen = [], set()
        for name in model_state:
            unit = self.unit_of.get(name)
            if unit is None:
                infos.append(model_state.info(name))
            elif unit not in seen:
                seen.add(unit)
                infos += [self.state.info(n) for n in unit.stored]
        return infos

    def stored_producer(self, produce):
        """``produce`` (model name -> tensor) made a producer of stored tensors by stored name: a unit's stored
        tensors are converted from its model tensors when the first of them is asked for, and kept until each has
        been taken."""
        pending: dict = {}

        def stored(name: str) -> torch.Tensor:
            unit = self.unit_of_stored.get(name)
            if unit is None:
                return produce(name)
            if unit.renames:
                return produce(unit.model[0])
            if unit not in pending:
                pending[unit] = self.layout.to_stored(unit, {n: produce(n) for n in unit.model})
            out = pending[unit].pop(name)
            if not pending[unit]:
                del pending[unit]
            return out

        return stored


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
                                 hint="pass a Hugging Face folder saved as safetensors: load a .bin checkpoint "
                                 "with from_pretrained and save it with save_pretrained (transformers writes "
                                 "safetensors), or align or merge it without --stream, which reads .bin too.")
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
