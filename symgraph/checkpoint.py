"""The tensors of a written checkpoint, laid out as transformers' own ``save_pretrained`` lays them out.

``save_pretrained`` drops the keys the model ties to another one (``lm_head.weight`` when the embeddings are
tied) and renames keys back to the checkpoint format of the model type (DINOv2 writes
``attention.attention.key``, which loads as ``attention.k_proj``; MoE experts fused on load are split again). We
do the same from the model's own information, read off an empty (meta-device) model built from the config: its
declared ties and transformers' conversion mapping. Tensors are never dropped because their values happen to
equal another's (all-zero biases, norms all ones are ordinary after folding or for a fresh model). Written from
an input checkpoint (``like``), a tie keeps the names the input stores it by, and the tensors transformers skipped
loading it that no weight concerns are written as stored (:func:`carried_as_stored`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from safetensors import SafetensorError

from .errors import ModelLoadError, OutputError
from .files import install_folder, os_errors_as_output_error, prepare_output, refuse_overlap, temp_sibling

__all__ = ["save_model", "hf_layout", "carried_as_stored", "stored_weight_names", "StoredLayout", "StoredUnit",
           "owned_tensors", "output_folder", "staged_folder", "write_side_files", "not_carried_over",
           "carried_metadata", "carried_index_metadata", "file_metadata", "warn_side_files_differ",
           "unloaded_tensors", "refuse_unloaded", "refuse_unloaded_inputs"]

_log = logging.getLogger(__name__)


def hf_layout(state: Mapping[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """``state`` (keyed as the model's ``state_dict``) as transformers would store it for ``config``'s model.

    ``config`` is a ``PretrainedConfig`` or a config dict naming its class in ``architectures`` (or a
    ``model_type``). Without a config that transformers can build a model from, ``state`` is returned as is.
    Raises :class:`OutputError` when the keys are not the model's, or when tensors the model ties differ.
    """
    return _laid_out(state, _meta_model(config))


def _laid_out(state: Mapping[str, torch.Tensor], model, stored=frozenset()) -> dict[str, torch.Tensor]:
    """:func:`hf_layout` for the empty model ``model`` (None: ``state`` as it is); a tie is kept under the names
    the input checkpoint stores it by (``stored``: its names)."""
    if model is None:
        return dict(state)
    _check_keys(state, model)
    return _as_stored(model, state, check_ties=True, stored=stored)


def stored_weight_names(config: Any) -> set[str] | None:
    """The names under which a complete checkpoint of ``config``'s model stores its floating-point tensors (as
    :func:`hf_layout` writes them); None without a config transformers can build a model from. Integer buffers
    (BatchNorm's counters) are left out: a checkpoint without them loads them at their fixed start value."""
    model = _meta_model(config)
    if model is None:
        return None
    floating = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    return set(_as_stored(model, floating, check_ties=False))


def carried_as_stored(model, names) -> list[str]:
    """Of the stored ``names``, those a written model keeps as stored: tensors ``model`` does not hold, which
    transformers skips on loading (the class's ``_keys_to_ignore_on_load_unexpected``) and which no weight of the
    model concerns: copies of a buffer it computes itself (a ``rotary_emb.inv_freq`` stored in every layer,
    ``embeddings.position_ids``), stale entries of a module it has (GPT-2's causal mask ``attn.bias``), all of
    which older versions of its class stored, or a submodule its config leaves out (DeBERTa's position embeddings
    without ``position_biased_input``), which nothing reads. Anything else it skips (multi-token-prediction layers,
    a decoder beside an encoder) lies in modules it does not have and reads its weights."""
    own = set(model.state_dict())
    foreign = [n for n in names if n not in own]
    skipped = _skipped_on_load(model, foreign)
    buffers = {tuple(n.split(".")[-2:]) for n, _ in model.named_buffers() if n not in own}
    modules = dict(model.named_modules())

    def in_own_module(name: str) -> bool:
        owner = name.rpartition(".")[0]
        parent, _, slot = owner.rpartition(".")
        return owner in modules or (parent in modules and getattr(modules[parent], slot, False) is None)

    return [n for n in foreign if n in skipped and (tuple(n.split(".")[-2:]) in buffers or in_own_module(n))]


def unloaded_tensors(model, names) -> list[str]:
    """Of the stored ``names``, those ``model``'s class skips on loading that a written model cannot keep as stored
    (:func:`carried_as_stored`): they fill modules the model does not have (multi-token-prediction layers, which
    transformers' MtpModel runs beside the model on its embeddings and hidden states) and read the weights symgraph
    moves. Read-only work may leave them out; a written model must not (:func:`refuse_unloaded`)."""
    own = set(model.state_dict())
    foreign = [n for n in names if n not in own]
    return sorted(_skipped_on_load(model, foreign) - set(carried_as_stored(model, foreign)))


def refuse_unloaded(model, names, where: str) -> None:
    """Refuse to write a model made from a checkpoint (``where``: how to name it) that stores ``names``, some of
    them :func:`unloaded_tensors`: written without them the model loses them, written as stored they no longer fit
    the weights moved beside them (a plain average of every stored tensor, ``merge --stream``, keeps them)."""
    from .io import _some

    lost = unloaded_tensors(model, names)
    if lost:
        raise ModelLoadError(
            f"{where} hold {len(lost)} tensor(s) that {type(model).__name__} does not load (multi-token-prediction "
            f"layers or the like): {_some(lost)}. symgraph cannot move them with the weights it changes, so the "
            "written model would lose them or hold them unmoved.",
            hint="to write the model without them, pass a copy of the checkpoint that leaves them out (the written "
            "model then lacks them too); `merge --stream` (a plain average of every stored tensor) averages them "
            "too; report, fuzz and barrier read the checkpoint as it is.")


def refuse_unloaded_inputs(sources) -> None:
    """:func:`refuse_unloaded` for every checkpoint folder among ``sources`` (a folder or its config.json; anything
    else holds no checkpoint), from its config.json and stored names alone: before any work is done. What cannot be
    read is left to the loader, which says why."""
    from .io import stored_names

    for source in sources:
        path = Path(str(source)).expanduser()
        folder = path.parent if path.suffix == ".json" else path
        try:
            model = _meta_model(_config_of(folder)) if folder.is_dir() else None
            names = stored_names(folder) if model is not None else ()
        except Exception:  # a damaged config or weights file: the loader refuses it with the reason
            continue
        if model is not None:
            refuse_unloaded(model, names, f"The weights in '{folder}'")


def _skipped_on_load(model, names) -> set[str]:
    """Of the stored ``names`` the model does not hold, those transformers' loading leaves out of its report."""
    from types import SimpleNamespace

    adjust = getattr(model, "_adjust_missing_and_unexpected_keys", None)
    if adjust is None:  # another transformers: nothing is known to be skipped
        return set()
    info = SimpleNamespace(missing_keys=set(), unexpected_keys=set(names))
    adjust(info)
    return set(names) - set(info.unexpected_keys)


def _as_stored(model, state: Mapping[str, torch.Tensor], *, check_ties: bool,
               stored=frozenset()) -> dict[str, torch.Tensor]:
    """``state`` without the keys ``model`` ties to another or ignores on save, renamed to its checkpoint format.
    A tie is kept under the names ``stored`` (the input checkpoint's names) holds it by, where it holds any."""
    out = dict(state)
    for tied, source in _declared_ties(model).items():
        if tied in out and source in out:
            if check_ties:
                _check_tie(out, tied, source, model)
            if not {tied, source} <= stored:  # a tie the input stores twice is written twice (equal)
                del out[source if tied in stored else tied]
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        out.pop(key, None)
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, out)


@dataclass(frozen=True)
class StoredUnit:
    """Parameters a checkpoint stores under other names or in another layout: transformers' conversion on loading
    makes the model's tensors ``model`` from the stored tensors ``stored`` (``patterns``: the conversion's source
    pattern each matched, ``converter`` the conversion; None for a rename, one name each side), and its reverse
    on saving makes them back. Fused experts (``experts.gate_up_proj`` stacks every expert's ``gate_proj`` and
    ``up_proj``), a fused QKV split on loading, a ViT's ``attention.attention.key`` read as ``attention.k_proj``."""

    model: tuple[str, ...]
    stored: tuple[str, ...]
    patterns: tuple[str, ...] = ()
    converter: Any = field(default=None, compare=False, repr=False)

    @property
    def renames(self) -> bool:
        return self.converter is None


class StoredLayout:
    """How the checkpoints of ``model``'s class store its parameters (read off ``model``, built on the meta device
    from its config): the :class:`StoredUnit` of every parameter stored under another name or layout, found by
    running transformers' conversion on saving over the model's (meta) tensors and its conversion on loading back.
    Parameters stored as they are named belong to no unit. A model transformers' conversions cannot be run for
    (no conversion mapping, one that fails on meta tensors) has no units: its checkpoints are read by the model's
    own names, and one that stores them otherwise is refused where a name is missing.

    :meth:`to_model` and :meth:`to_stored` convert one unit's tensors either way, with transformers' own
    operations (what ``from_pretrained`` and ``save_pretrained`` do), so what is read and written is what
    transformers loads and saves."""

    def __init__(self, model):
        self.model = model
        try:
            self.units = _stored_units(model)
        except Exception:  # transformers' conversion could not run on this model: no units
            self.units = []
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def to_model(self, unit: StoredUnit, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's tensors of ``unit`` from its stored ones (``tensors``, keyed by ``unit.stored``)."""
        return _loaded(self.model, unit, tensors)

    def to_stored(self, unit: StoredUnit, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stored tensors of ``unit`` from the model's (``tensors``, keyed by ``unit.model``)."""
        if unit.renames:
            return {unit.stored[0]: tensors[unit.model[0]]}
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.model, {k: tensors[k] for k in unit.model})


def _stored_units(model) -> list[StoredUnit]:
    """:class:`StoredLayout`'s units: the model's meta tensors saved as transformers saves them, each stored name
    traced back by the conversion on loading (renamings, then at most one converter, as ``from_pretrained``
    applies them), the converted units run on the meta tensors to name their model tensors and check their
    shapes."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (PrefixChange, WeightConverter, WeightRenaming,
                                                 revert_weight_conversion, rename_source_key)

    meta = dict(model.state_dict())
    stored = revert_weight_conversion(model, dict(meta))  # what save_pretrained writes (without its tie dropping)
    # the transformations revert_weight_conversion reverses for a model not loaded by from_pretrained
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    renames, converted = [], {}
    for name in stored:
        key, pattern = rename_source_key(name, renamings, converters, model.base_model_prefix, meta)
        if key not in meta:  # from_pretrained then loads a model name as it is (no conversion fits it)
            continue
        if pattern is None:
            if key != name:
                renames.append(StoredUnit((key,), (name,)))
        else:
            converted.setdefault(key, []).append((name, pattern))
    units = renames
    for key, parts in converted.items():
        unit = StoredUnit((key,), tuple(n for n, _ in parts), tuple(p for _, p in parts),
                          copy.deepcopy(converter_of[parts[0][1]]))
        made = _loaded(model, unit, {n: stored[n] for n, _ in parts})
        wrong = [k for k, v in made.items() if k not in meta or tuple(v.shape) != tuple(meta[k].shape)]
        if wrong:
            raise ValueError(f"the conversion of {unit.stored[0]} makes {wrong[0]}, which the model does not have")
        units.append(replace(unit, model=tuple(made)))
    return units


def _loaded(model, unit: StoredUnit, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:meth:`StoredLayout.to_model`: the unit's stored tensors given to a copy of its converter in the order
    ``from_pretrained`` gives them (experts by their index), converted."""
    if unit.renames:
        return {unit.model[0]: tensors[unit.stored[0]]}
    from transformers.core_model_loading import dot_natural_key

    converter = copy.deepcopy(unit.converter)
    for name, pattern in sorted(zip(unit.stored, unit.patterns), key=lambda item: dot_natural_key(item[0])):
        converter.add_tensor(unit.model[0], name, pattern, tensors[name])
    made = converter.convert(unit.model[0], model=model, config=model.config)
    return {k: (v[0] if isinstance(v, list) else v) for k, v in made.items()}


def _meta_model(config: Any):
    """An empty model (parameters on the meta device) of ``config``'s class, or None without a usable config."""
    from .io import _build_meta, _model_class

    if config is None:
        return None
    try:
        cls, config = _model_class(config)
        return None if cls is None else _build_meta(cls, config, None, name="", folder=None, dtype=None).model
    except Exception:  # no transformers config, or a model that cannot be built empty: nothing to lay out by
        return None


def _check_keys(state: Mapping[str, torch.Tensor], model) -> None:
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unexpected:
        from .io import _some

        parts = ([f"missing {len(missing)}: {_some(missing)}"] if missing else []) + (
            [f"not in the model {len(unexpected)}: {_some(unexpected)}"] if unexpected else [])
        unnamed = not getattr(model.config, "architectures", None)
        raise OutputError(
            f"The state dict to save does not match {type(model).__name__} of its config ({'; '.join(parts)}); "
            "the written folder would not load back."
            + (f" The config names no class in \"architectures\", so it describes the bare {type(model).__name__}."
               if unnamed else ""),
            hint=("pass symgraph.io.model_config(model), which names the model's class, instead of model.config."
                  if unnamed else "save the full state dict of the model the config describes (model.state_dict()),"
                  " or pass the config of the model these tensors belong to."))


def _declared_ties(model) -> dict[str, str]:
    """Tied key -> the key transformers keeps, as the model declares them (config-aware)."""
    try:
        return dict(model.get_expanded_tied_weights_keys(all_submodels=True))
    except Exception:  # older transformers: no declared ties we can read, so nothing is dropped
        return {}


def _check_tie(state: Mapping[str, torch.Tensor], tied: str, source: str, model) -> None:
    a, b = state[tied], state[source]
    if a.shape != b.shape or not torch.equal(a.to(b.dtype), b):
        raise OutputError(
            f"{type(model).__name__} ties '{tied}' to '{source}' (tie_word_embeddings or a shared module), but the "
            "two tensors to save differ: a checkpoint stores a tied tensor once, so one of them would be lost.",
            hint="this is a symgraph bug if symgraph produced the tensors (a transformation must move tied tensors "
            "together); otherwise untie them in the config (e.g. tie_word_embeddings=false) before saving.")


def owned_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor on the CPU owning its whole contiguous memory (safetensors refuses views and shared storage);
    tensors that already do are written without a copy, and the caller's tensors are never modified."""
    out: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple] = set()
    for key, value in state.items():
        value = value.detach().cpu()
        storage_key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        shared = value.numel() > 0 and storage_key in seen_storage
        whole = value.is_contiguous() and value.storage_offset() == 0 and (
            value.numel() * value.element_size() == value.untyped_storage().nbytes())
        if shared or not whole:
            value = value.contiguous().clone()
        else:
            seen_storage.add(storage_key)
        out[key] = value
    return out


def save_model(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    config: Any = None,
    like: str | os.PathLike | None = None,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state_dict`` as a Hugging Face folder at ``out_dir``, atomically; return the folder.

    Writes ``config.json`` (from ``config``: a ``PretrainedConfig`` or a dict; else copied from ``like``),
    ``model.safetensors`` laid out as ``save_pretrained`` would (:func:`hf_layout`: tied copies left out, key names
    of the checkpoint format) and, from ``like``, tokenizer/processor/generation files. Everything goes into a
    temporary sibling folder first and is moved into place at the end; the safetensors metadata is ``metadata``
    (default: ``like``'s, see :func:`carried_metadata`) with ``format`` set to ``pt``; with ``overwrite=True`` an
    existing folder is swapped for the new one only once it is complete (:mod:`symgraph.files`). On failure nothing is left behind and
    an existing ``out_dir`` is untouched. ``out_dir`` may not be, contain or lie inside ``like`` (an input). Input
    tensors are never modified.

    Examples
    --------
    >>> import tempfile, torch
    >>> from symgraph import zoo
    >>> from symgraph.io import model_config  # model.config, naming the model's class in "architectures"
    >>> model = zoo.build("llama-tied")
    >>> out = save_model(model.state_dict(), tempfile.mkdtemp() + "/copy", config=model_config(model))
    >>> sorted(p.name for p in out.iterdir())
    ['config.json', 'model.safetensors']
    """
    from .io import stored_names, stored_tensors

    out, like_dir = output_folder(out_dir, like, overwrite=overwrite)
    model = _meta_model(config if config is not None else _config_of(like_dir))
    stored = stored_names(like_dir) if like_dir is not None else set()
    if model is not None:
        refuse_unloaded(model, stored, f"The weights in '{like_dir}'")
    tensors = _laid_out(_checked(state_dict), model, stored)
    # what transformers skipped loading the input, the output keeps as stored
    carried = [n for n in carried_as_stored(model, stored) if n not in tensors] if model is not None else []
    tensors = owned_tensors({**tensors, **(stored_tensors(like_dir, carried) if carried else {})})
    metadata = file_metadata(metadata if metadata is not None else carried_metadata([like_dir]))
    index_dropped(carried_index_metadata([like_dir]))
    with staged_folder(out, overwrite=overwrite) as tmp:
        _write_folder(tmp, tensors, config=config, like_dir=like_dir, metadata=metadata)
    return out


def carried_metadata(folders) -> dict[str, str]:
    """The safetensors metadata (``__metadata__``) a checkpoint written from the model folders ``folders`` carries:
    every entry that all their safetensors files store with one value. An entry they disagree on (two merged
    models of different provenance) describes no single input, so it is left out, and a warning names it.
    Folders that are None or hold no safetensors (``.bin`` weights, modules) add nothing."""
    from .lazy_state import safetensors_files
    from safetensors import safe_open

    stored = []
    for folder in folders:
        if folder is None or not any(Path(folder, n).is_file() for n in ("model.safetensors",
                                                                         "model.safetensors.index.json")):
            continue
        for file in safetensors_files(folder):
            with safe_open(str(file), framework="pt") as handle:
                stored.append(handle.metadata() or {})
    return _agreed(stored, "safetensors metadata", ignored={"format"})


# index metadata entries that count the stored files: those of the written files, not carried
INDEX_COUNTS = frozenset({"total_size", "total_parameters"})


def carried_index_metadata(folders) -> dict[str, Any]:
    """The entries of the index "metadata" (``model.safetensors.index.json``, or ``pytorch_model.bin.index.json``)
    a sharded checkpoint written from the model folders ``folders`` (None: skipped) carries: those every folder
    stores with one value (one without an index stores none; the others are named in a warning), but the counts
    of the stored files (:data:`INDEX_COUNTS`; ``total_size`` is the written files')."""
    stored = []
    for folder in (Path(f) for f in folders if f is not None):
        index = next((folder / n for n in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
                      if (folder / n).is_file()), None)
        entries = json.loads(index.read_text()).get("metadata") if index is not None else None
        stored.append({k: v for k, v in (entries if isinstance(entries, dict) else {}).items()
                       if k not in INDEX_COUNTS})
    return _agreed(stored, "index metadata (model.safetensors.index.json)")


def _agreed(stored: list[dict], what: str, ignored=frozenset()) -> dict:
    """The entries every mapping of ``stored`` holds with one value; a warning names the others (but
    ``ignored``)."""
    if not stored:
        return {}
    agreed = {k: v for k, v in stored[0].items() if all(k in m and m[k] == v for m in stored[1:])}
    dropped = sorted({k for m in stored for k in m} - agreed.keys() - ignored)
    if dropped:
        _log.warning("%s not carried into the written model (the inputs store different values, or only some "
                     "store it): %s.", what, ", ".join(dropped))
    return agreed


def index_dropped(entries: Mapping[str, Any]) -> None:
    """Warn that the index metadata ``entries`` are not carried: the written checkpoint is one file, which has no
    index to hold them (and safetensors metadata holds strings only)."""
    if entries:
        _log.warning("index metadata (model.safetensors.index.json) not carried into the written model, which is "
                     "one file with no index: %s. Add them to an index yourself if they still apply.",
                     ", ".join(sorted(entries)))


def file_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as written into a safetensors file of ours: str to str, ``format`` ``pt`` (torch tensors;
    transformers refuses a file without it)."""
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise OutputError(f"safetensors metadata maps strings to strings; entry {bad[0]!r} is "
                          f"{type(metadata[bad[0]]).__name__}.", hint="convert the metadata values to strings.")
    return {**metadata, "format": "pt"}


def output_folder(out_dir, like, *, overwrite: bool) -> tuple[Path, Path | None]:
    """``out_dir`` as an absolute folder path checked to be writable as a model folder (see :func:`save_model`),
    and ``like``'s folder (None without one)."""
    out = Path(out_dir).expanduser()
    if not out.name:
        raise OutputError(f"The output path '{out_dir}' names no folder.", hint="give a name, e.g. -o out/model.")
    out = out.parent.resolve() / out.name
    like_dir = _like_dir(like) if like is not None else None
    if like_dir is not None:
        refuse_overlap(out, [like_dir])
    prepare_output(out, overwrite=overwrite, folder=True)
    return out, like_dir


@contextlib.contextmanager
def staged_folder(out: Path, *, overwrite: bool) -> Iterator[Path]:
    """A temporary sibling folder of ``out`` to write into; moved to ``out`` when the block ends without error,
    removed (with everything written so far, and the folders made to hold it) when it fails. OS and safetensors
    errors become :class:`OutputError`; other errors propagate unchanged (the folder is removed all the same)."""
    made = [p for p in out.parents if not p.exists()]  # innermost first
    tmp, done = None, False
    try:  # made inside: an interrupt (Ctrl-C) right after the mkdir still removes the folder
        with os_errors_as_output_error(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = temp_sibling(out)
            tmp.mkdir(mode=0o755)
        yield tmp
        install_folder(tmp, out, overwrite=overwrite)
        done = True
    except OutputError:
        raise
    except (OSError, SafetensorError) as exc:
        # OSError: disk full, permissions; safetensors reports I/O problems as SafetensorError. Anything else (a
        # failure computing the tensors a streamed writer asks for) is no writing problem: it propagates as is.
        reason = getattr(exc, "strerror", None) or str(exc).strip().splitlines()[0]
        involved = [f for f in (getattr(exc, "filename", None), getattr(exc, "filename2", None)) if f]
        if involved:  # the file it failed on: a source to copy (a tokenizer file) or a file written in the folder
            reason += f" ({' -> '.join(map(str, involved))})"
        raise OutputError(
            f"Writing the model to '{out}' failed: {reason}. Nothing was written (the partly written files were "
            "removed)" + (" and the existing folder was left as it was." if out.exists() else "."),
            hint="free disk space or fix permissions on the output location, then run again.",
        ) from exc
    finally:
        if not done:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            for folder in made:
                with contextlib.suppress(OSError):  # another run may have put something there meanwhile
                    folder.rmdir()


def _like_dir(like) -> Path:
    path = Path(like).expanduser()
    if path.is_file() and path.suffix == ".json":
        path = path.parent
    if not path.is_dir():
        raise OutputError(
            f"The reference folder given as like='{path}' does not exist or is not a folder.",
            hint="pass the Hugging Face folder the model was loaded from (its config and tokenizer are copied).",
        )
    return path


def _config_of(like_dir: Path | None):
    """The config dict stored in ``like``, which lays out the tensors when no config is given."""
    file = like_dir / "config.json" if like_dir is not None else None
    if file is None or not file.is_file():
        return None
    from .io import read_config_json

    return read_config_json(file)


def _checked(state_dict) -> dict[str, torch.Tensor]:
    if not isinstance(state_dict, Mapping):
        raise OutputError(
            f"save_model needs a mapping of names to tensors, got a {type(state_dict).__name__}.",
            hint="pass model.state_dict() or symgraph.io.state_dict_of(model).",
        )
    items: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise OutputError(
                f"State dict entry {key!r} is a {type(value).__name__}; only str -> torch.Tensor entries can be "
                "saved to safetensors.",
                hint="drop non-tensor entries before saving.",
            )
        if value.device.type == "meta":
            raise OutputError(
                f"Tensor '{key}' is on the meta device and has no values to save (a --config-only model?).",
                hint="load the model with its weights to save it.",
            )
        items[key] = value.detach()
    return items


def _write_folder(tmp: Path, tensors: dict[str, torch.Tensor], *, config, like_dir: Path | None,
                  metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
    write_side_files(tmp, config=config, like_dir=like_dir, dtypes=[t.dtype for t in tensors.values()])


def write_side_files(tmp: Path, *, config, like_dir: Path | None, dtypes=()) -> None:
    """Beside the weights in ``tmp``: config.json (from ``config``, else ``like_dir``'s; its dtype made the one of
    the weights' ``dtypes`` when they share one) and ``like_dir``'s tokenizer files; then every file made readable
    and flushed to disk."""
    from .io import TOKENIZER_FILES, TOKENIZER_FOLDERS

    if config is not None:
        if isinstance(config, Mapping):
            (tmp / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        elif hasattr(config, "save_pretrained"):
            config.save_pretrained(str(tmp))
        else:
            raise OutputError(
                f"config must be a transformers PretrainedConfig or a dict, got a {type(config).__name__}.",
                hint="pass model.config, or leave config out and give like= to copy config.json.",
            )
    elif like_dir is not None and (like_dir / "config.json").is_file():
        shutil.copy2(like_dir / "config.json", tmp / "config.json")
    _config_names_dtype(tmp / "config.json", dtypes)

    if like_dir is not None:
        for name in (*TOKENIZER_FILES, *TOKENIZER_FOLDERS):
            src = like_dir / name
            if (tmp / name).exists():
                continue
            if src.is_file():
                shutil.copy2(src, tmp / name)
            elif src.is_dir() and name in TOKENIZER_FOLDERS:
                shutil.copytree(src, tmp / name)
        for name in auto_map_code(like_dir):
            if not (tmp / name).exists():
                shutil.copy2(like_dir / name, tmp / name)
        left = not_carried_over(like_dir)
        if left:
            _log.warning("Not copied from '%s' into the written model (only its config, tokenizer, processor and "
                         "generation files are): %s. Copy them yourself if they still apply.", like_dir,
                         ", ".join(left))
    for path in tmp.rglob("*"):  # safetensors writes 0600 files: installed or shared copies must stay readable
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    _fsync_files(tmp)


def _config_names_dtype(file: Path, dtypes) -> None:
    """transformers loads weights in the dtype config.json names: a merge of float32 and bf16 models is written in
    float32 and must not keep a config that says bfloat16."""
    floating = {d for d in dtypes if d.is_floating_point}
    if len(floating) != 1 or not file.is_file():
        return
    name = str(floating.pop()).removeprefix("torch.")
    config = json.loads(file.read_text())
    stale = [k for k in ("dtype", "torch_dtype") if k in config and config[k] != name]
    if stale:
        file.write_text(json.dumps({**config, **dict.fromkeys(stale, name)}, indent=2, sort_keys=True) + "\n")


def warn_side_files_differ(folders, like) -> None:
    """Warn about the tokenizer, processor and generation files (:data:`symgraph.io.TOKENIZER_FILES`) that the
    merged model folders ``folders`` do not all store alike: the merge carries those of ``like``'s folder alone,
    and a tokenizer that maps ids to other tokens makes the averaged embeddings mean nothing."""
    from .io import TOKENIZER_FILES

    folders = [Path(f) for f in folders if f is not None]
    differ = [name for name in TOKENIZER_FILES
              if len({(f / name).read_bytes() if (f / name).is_file() else None for f in folders}) > 1]
    if differ:
        _log.warning("The merged models' %s differ (or only some have them); the merge carries those of '%s'. "
                     "Merge models that share a tokenizer: averaged embeddings of differently numbered tokens mean "
                     "nothing.", ", ".join(differ), like)


def not_carried_over(like_dir: Path) -> list[str]:
    """What in the model folder ``like_dir`` a written folder does not carry: every entry but the config, the
    weights (rewritten) and the files copied (:data:`symgraph.io.TOKENIZER_FILES`); hidden ones aside. Folders
    end in ``/``."""
    from .io import MODEL_FILES

    shards = {str(v) for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json")
              for v in dict(_json_object(like_dir / name).get("weight_map") or {}).values()}
    carried = {*MODEL_FILES, *shards, *auto_map_code(like_dir)}
    return sorted(p.name + "/" * p.is_dir() for p in like_dir.iterdir()
                  if not p.name.startswith(".") and p.name not in carried)


def auto_map_code(folder: Path) -> list[str]:
    """The Python files in ``folder`` that the ``auto_map`` of its configs names (a model, tokenizer or processor
    class of the checkpoint's own code, which transformers runs with ``trust_remote_code``), with the files they
    import relatively: a written folder keeps those configs, so it keeps their code, and loads as the input did."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from .io import TOKENIZER_FILES

    modules = set()
    for name in ("config.json", *(n for n in TOKENIZER_FILES if n.endswith(".json"))):
        entries = _json_object(folder / name).get("auto_map")
        for value in (entries.values() if isinstance(entries, dict) else ()):
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "--" not in reference:  # "repo--module.Class": another repo's
                    modules.add(reference.rpartition(".")[0] + ".py")
    files = {m for m in modules if (folder / m).is_file()}
    return sorted(files | {Path(f).name for m in files for f in get_relative_import_files(folder / m)})


def _json_object(file: Path) -> dict:
    """The JSON object in ``file``; empty when it is missing or holds no object."""
    try:
        found = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _fsync_files(folder: Path) -> None:
    """Flush the new files to disk so the rename cannot expose empty files after a crash (best effort)."""
    for file in folder.rglob("*"):
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
