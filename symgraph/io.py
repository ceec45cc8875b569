"""Model input/output: turn a MODEL argument into a module, and write state dicts back as Hugging Face folders.

``load_model`` accepts an ``nn.Module``, a local Hugging Face folder (config.json plus weights), a config file or
weightless folder (``config_only=True``: the model is built on the meta device, no weight memory), or a factory
string ``package.module:function`` / ``path/to/file.py:function``. Every way it can fail raises
:class:`~symgraph.errors.ModelLoadError` with a message that names the offending path or string.

Writing lives beside it and is re-exported here: ``save_model`` (:mod:`symgraph.checkpoint`: a state dict as a
Hugging Face folder laid out as ``save_pretrained`` would) and ``write_atomic`` / ``write_text_atomic``
(:mod:`symgraph.files`: outputs that are whole or absent). Their failures raise
:class:`~symgraph.errors.OutputError`.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import importlib.util
import json
import logging
import os
import sys
import uuid
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .checkpoint import save_model
from .errors import ModelLoadError
from .files import write_atomic, write_text_atomic
from .module_state import copied_module, private_tree

_log = logging.getLogger(__name__)

if TYPE_CHECKING:  # importing transformers is slow; the loaders import it lazily
    from transformers import PretrainedConfig

__all__ = [
    "LoadedModel",
    "check_finite",
    "load_model",
    "save_model",
    "state_dict_of",
    "stored_names",
    "stored_tensors",
    "write_atomic",
    "write_text_atomic",
    "WEIGHT_FILES",
    "TOKENIZER_FILES",
]

#: Weight files ``from_pretrained`` looks for, in its order of preference.
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

#: Files copied verbatim from ``like`` into a saved folder (tokenizer, processor, generation settings): every
#: file name a transformers tokenizer's ``vocab_files_names`` lists, and the processor and generation configs.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "spm.model",
    "spm_char.model",
    "sentencepiece.model",
    "sentencepiece.bpe.model",
    "source.spm",
    "target.spm",
    "tokenizer.model",
    "bpe.codes",
    "dict.txt",
    "byte_maps.json",
    "emoji.json",
    "entity_vocab.json",
    "normalizer.json",
    "prophetnet.tokenizer",
    "target_vocab.json",
    "vocab-src.json",
    "vocab-tgt.json",
    "word_pronunciation.json",
    "word_shape.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "audio_tokenizer_config.json",
    "processor_config.json",
    "generation_config.json",
)


#: Folders a tokenizer reads (its named chat templates, ``additional_chat_templates/NAME.jinja``), carried whole.
TOKENIZER_FOLDERS = ("additional_chat_templates",)

#: Every file (and folder) a model folder is read from by name (weight shards aside).
MODEL_FILES = frozenset(("config.json", *WEIGHT_FILES, *TOKENIZER_FILES, *TOKENIZER_FOLDERS))

#: Files of other formats that users hand over as models: (file name pattern, what it is, what to do instead).
FOREIGN_FORMATS = (
    ("adapter_config.json", "the config of a PEFT adapter (LoRA or similar): weight deltas for a base model, "
     "not a model",
     "merge the adapter into its base model first (peft: PeftModel.from_pretrained(base, ADAPTER)"
     ".merge_and_unload().save_pretrained(OUT)) and pass OUT"),
    ("*.gguf", "a GGUF file (llama.cpp), which symgraph does not read",
     "pass the Hugging Face checkpoint they were converted from (config.json plus safetensors)"),
    ("*.onnx", "an ONNX export, which symgraph does not read",
     "pass the PyTorch or Hugging Face model it was exported from"),
)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for capture: the module (eval mode), its HF config if any, where it came from, a display name."""

    model: torch.nn.Module
    config: PretrainedConfig | None
    path: Path | None
    name: str
    inputs: tuple[tuple, dict] | None = None  # example (args, kwargs) a factory returned with its module
    # the parameters the checkpoint stores in a narrower dtype than the model holds them (see _load_path)
    stored_dtypes: Mapping[str, torch.dtype] = dataclasses.field(default_factory=dict)

    @property
    def is_meta(self) -> bool:
        """True when the weights live on the meta device (a config-only load): shapes only, no values."""
        return any(t.device.type == "meta" for t in _tensors(self.model))


# ----------------------------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------------------------


def _quiet_transformers() -> None:
    """transformers prints progress bars and load reports while loading; symgraph reports what matters itself."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_model(source: Any, *, config_only: bool = False, dtype: Any = None) -> LoadedModel:
    """Turn a MODEL argument into a :class:`LoadedModel`.

    ``source`` is an ``nn.Module`` (used in eval mode, through :func:`~symgraph.module_state.private_tree`: the
    caller's module keeps its training flags, hooks and tensors), a path to a Hugging Face folder, a path to
    a ``config.json`` (or a weightless folder) with ``config_only=True``, or a factory string
    ``package.module:function`` / ``path/to/file.py:function`` whose function takes no arguments and returns an
    ``nn.Module``. ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"float64"``) is passed to transformers or
    applied with ``.to(dtype)`` (to a copy of a module given as ``source``: the caller's weights never change).
    """
    dtype = _parse_dtype(dtype)
    _quiet_transformers()
    if isinstance(source, torch.nn.Module):
        return _wrap_module(source, name=type(source).__name__, path=None, dtype=dtype)
    if isinstance(source, os.PathLike):
        path = Path(source).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"Model path '{path}' does not exist.",
                hint="check the spelling, or pass a Hugging Face folder (config.json plus weights), a config.json "
                "with --config-only, or a factory 'package.module:function'.",
            )
        return _load_path(path, config_only=config_only, dtype=dtype)
    if isinstance(source, str):
        return _load_string(source, config_only=config_only, dtype=dtype)
    raise ModelLoadError(
        f"Cannot load a model from a {type(source).__name__} ({source!r:.80}).",
        hint="pass an nn.Module, a path to a Hugging Face folder or config.json, or a factory string "
        "'package.module:function'.",
    )


def _load_string(source: str, *, config_only: bool, dtype: torch.dtype | None) -> LoadedModel:
    text = source.strip()
    path = Path(text).expanduser()
    if text and path.exists():
        return _load_path(path, config_only=config_only, dtype=dtype)
    module_part, sep, attr = text.rpartition(":")
    if not sep or not module_part or not attr:
        raise ModelLoadError(
            f"Model path '{source}' does not exist, and it is not a factory string either (no ':function' part).",
            hint="pass an existing Hugging Face folder (config.json plus weights), a config.json with "
            "--config-only, or a factory 'package.module:function' / 'path/to/file.py:function'.",
        )
    try:
        factory = _resolve_factory(module_part, attr)
    except _FactoryImportError as exc:
        raise ModelLoadError(
            f"Cannot load a model from '{source}': it is not a folder (no such directory), not a config file "
            f"(no such file), and not an importable factory ({exc}).",
            hint="check the path, or make sure the module is importable (installed, or on PYTHONPATH / given as "
            "'path/to/file.py:function') and defines that function.",
        ) from exc.__cause__
    return _call_factory(factory, text, dtype=dtype)


class _FactoryImportError(Exception):
    pass


def _resolve_factory(module_part: str, attr: str):
    if module_part.endswith(".py"):
        file = Path(module_part).expanduser()
        if not file.is_file():
            raise _FactoryImportError(f"file '{file}' does not exist")
        module = _import_file(file)
        where = f"file '{file}'"
    else:
        if not all(part.isidentifier() for part in module_part.split(".")):
            raise _FactoryImportError(f"'{module_part}' is not a valid module name")
        try:
            module = importlib.import_module(module_part)
        except (Exception, SystemExit) as exc:  # ImportError, or anything the module raises (or exits) on import
            err = _FactoryImportError(f"importing module '{module_part}' failed: {_describe(exc)}")
            err.__cause__ = exc
            raise err from exc
        where = f"module '{module_part}'"
    obj: Any = module
    for part in attr.split("."):
        if not part.isidentifier() or not hasattr(obj, part):
            raise _FactoryImportError(f"{where} has no attribute '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise _FactoryImportError(f"'{attr}' in {where} is a {type(obj).__name__}, not a callable")
    return obj


def _import_file(file: Path):
    file = file.resolve()
    mod_name = f"_symgraph_factory_{file.stem}_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    if spec is None or spec.loader is None:
        raise _FactoryImportError(f"file '{file}' cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    sys.path.insert(0, str(file.parent))  # let the file import its sibling modules
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        sys.modules.pop(mod_name, None)
        if not isinstance(exc, (Exception, SystemExit)):
            raise
        err = _FactoryImportError(f"executing file '{file}' failed: {_describe(exc)}")
        err.__cause__ = exc
        raise err from exc
    finally:
        try:
            sys.path.remove(str(file.parent))
        except ValueError:
            pass
    return module


def _call_factory(factory, text: str, *, dtype: torch.dtype | None) -> LoadedModel:
    try:
        model = factory()
    except (Exception, SystemExit) as exc:  # SystemExit: a factory calling sys.exit() must not end symgraph quietly
        raise ModelLoadError(
            f"The factory '{text}' raised {_describe(exc)}",
            hint="the factory must build and return the model when called with no arguments.",
        ) from exc
    inputs = None
    if isinstance(model, tuple) and 2 <= len(model) <= 3 and isinstance(model[0], torch.nn.Module):
        model, args, *rest = model
        inputs = (tuple(args) if isinstance(args, (tuple, list)) else (args,), dict(rest[0]) if rest else {})
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(
            f"The factory '{text}' returned a {type(model).__module__}.{type(model).__qualname__}, "
            "not a torch.nn.Module.",
            hint="make the function return the model (an nn.Module instance), or (model, args) / "
            "(model, args, kwargs) with example inputs.",
        )
    loaded = _wrap_module(model, name=text, path=None, dtype=dtype)
    return dataclasses.replace(loaded, inputs=inputs)


def _wrap_module(model: torch.nn.Module, *, name: str, path: Path | None, dtype) -> LoadedModel:
    """A module given to symgraph (by the caller or a factory, which may hand out a module it keeps) is never
    changed: converted in a copy, or put in eval mode in a tree of its own that shares its tensors."""
    if dtype not in (None, "auto") and any(t.is_floating_point() and t.dtype != dtype for t in _tensors(model)):
        model = copied_module(model).to(dtype)  # .to(dtype) converts the parameters in place
    else:
        model = private_tree(model)
    check_finite(model, f"the parameters of {name}")
    model.eval()
    return LoadedModel(model=model, config=model_config(model), path=path, name=name)


def model_config(model: torch.nn.Module):
    """The model's Hugging Face config, naming the model's class in ``architectures`` (a model built with
    ``from_config`` leaves it empty, and a folder saved without it would load back as the bare base model).
    The model's own config object is not modified; None for modules without a config."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or getattr(config, "architectures", None):
        return config
    named = copy.deepcopy(config)
    named.architectures = [type(model).__name__]
    return named


def _load_path(path: Path, *, config_only: bool, dtype) -> LoadedModel:
    if path.is_dir():
        folder = path
        config_file = folder / "config.json"
        if not config_file.is_file():
            found = sorted(p.name for p in folder.iterdir())[:8]
            _refuse_foreign(sorted(folder.iterdir()))
            raise ModelLoadError(
                f"Folder '{folder}' has no config.json (it contains: {', '.join(found) or 'nothing'}).",
                hint="point at the Hugging Face model folder itself (the one holding config.json), or use a "
                "factory 'package.module:function' for models that are not Hugging Face checkpoints.",
            )
    elif path.is_file():
        _refuse_foreign([path])
        if path.suffix == ".py":
            raise ModelLoadError(
                f"'{path}' is a Python file, not a model folder or config.",
                hint=f"name the factory function in it: '{path}:function_name'.",
            )
        if path.suffix != ".json":
            raise ModelLoadError(
                f"'{path}' is neither a model folder nor a config.json file.",
                hint="pass the folder that holds config.json and the weights, or the config.json itself with "
                "--config-only.",
            )
        config_file, folder = path, path.parent
    else:
        raise ModelLoadError(f"Model path '{path}' is neither a file nor a folder.")

    folder = folder.resolve()
    config_dict = read_config_json(config_file)
    config, cls = _build_config(config_dict, config_file)
    try:
        config.name_or_path = str(folder)
    except Exception:
        pass
    name = (folder.name if config_file.name == "config.json" else config_file.stem) or str(folder)

    if config_only:
        return _build_meta(cls, config, config_file, name=name, folder=folder, dtype=dtype)

    not_files = [f for f in WEIGHT_FILES if (folder / f).exists() and not (folder / f).is_file()]
    if not_files:
        raise ModelLoadError(
            f"'{folder / not_files[0]}' is a {'folder' if (folder / not_files[0]).is_dir() else 'special file'}, "
            "not a weights file.",
            hint=f"{not_files[0]} must be the weights file itself: replace it with the file (or re-save the model).",
        )
    weights = [folder / f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not weights:
        _refuse_foreign(sorted(folder.iterdir()))
        stray = sorted(p.name for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        detail = (
            f" It has {', '.join(stray[:4])}, but transformers only reads {', '.join(WEIGHT_FILES)}."
            if stray
            else ""
        )
        raise ModelLoadError(
            f"No weights found next to '{config_file}' (looked for {', '.join(WEIGHT_FILES)}).{detail}",
            hint="point at a folder that contains the weights; only `symgraph report` (and load with "
            "config_only=True) works without them: `report --config-only` analyses the architecture alone.",
        )
    _check_weights(folder, weights[0])

    from .shards import widest_dtype

    kwargs: dict[str, Any] = {"config": config, "local_files_only": True, "output_loading_info": True}
    listing = list(_stored_dtypes(folder, weights[0]))  # read once for every check below
    stored = {} if dtype is not None else _stored_float_dtypes(listing)
    config_dtype = getattr(config, "dtype", None)
    if dtype is not None or stored:  # never narrower than config.json's dtype, which transformers would load in
        named = getattr(torch, config_dtype, None) if isinstance(config_dtype, str) else config_dtype
        kwargs["dtype"] = dtype if dtype is not None else widest_dtype(
            [*stored.values(), *([named] if isinstance(named, torch.dtype) else [])])
    try:
        model, loading_info = cls.from_pretrained(str(folder), **kwargs)
    except Exception as exc:
        mismatches = _shape_mismatches(cls, config, folder, weights[0])
        if mismatches:  # transformers only logs these; spell them out
            reason = (
                "shapes in the weights do not match config.json: "
                + "; ".join(f"{k}: file {tuple(a)} vs config {tuple(b)}" for k, a, b in mismatches[:3])
                + (f" (and {len(mismatches) - 3} more)" if len(mismatches) > 3 else "")
                + "."
            )
        else:
            reason = _describe(exc)
        raise ModelLoadError(
            f"transformers could not load the model in '{folder}' as {_cls_name(cls)} (weights: "
            f"{weights[0].name}): {reason}",
            hint="check that the weights match config.json (same model_type and sizes) and are complete; "
            "re-download or re-save the checkpoint if a file is damaged.",
        ) from exc
    try:
        _check_loading_info(loading_info, model, folder, weights[0])
    except ModelLoadError as exc:
        if _architecture_class(config_dict) is not None:
            raise
        raise _unnamed_class_error(exc, config, folder, weights[0]) from None
    _warn_unloaded(model, folder, listing)
    _check_stored_dtypes(model, folder, listing)
    _check_ties_kept(model, folder)
    check_finite(model, f"the weights in '{folder}'")
    model.eval()
    if stored:
        model.config.dtype = config_dtype  # the dtype config.json names, not the one the model was loaded in
    return LoadedModel(model=model, config=getattr(model, "config", config), path=folder, name=name,
                       stored_dtypes=_narrower_stored(model, stored, folder))


def _refuse_foreign(paths) -> None:
    """Name a file of another format (:data:`FOREIGN_FORMATS`) among ``paths`` for what it is."""
    import fnmatch

    for pattern, what, todo in FOREIGN_FORMATS:
        hit = next((p for p in paths if fnmatch.fnmatch(p.name.lower(), pattern)), None)
        if hit is not None:
            raise ModelLoadError(f"'{hit}' is {what}.", hint=f"{todo}.")


def _unnamed_class_error(error: ModelLoadError, config, folder: Path, weights: Path) -> ModelLoadError:
    """``error`` (weights that do not fit the bare model) for a config.json whose "architectures" names no class
    transformers has: say so, and name the classes of its model type whose stored tensors are exactly the file's."""
    stored = {key for key, _, is_float, _ in _stored_dtypes(folder, weights) if is_float}
    fitting = [name for name in _head_classes(config.model_type) if _stores(name, config) == stored]
    named = ", ".join(f'"{n}"' for n in fitting)
    return ModelLoadError(
        f"{error.message} config.json names no class transformers has in \"architectures\", so the weights were "
        f"matched against the bare model" + (f"; they are those of {' or '.join(fitting)}." if fitting else "."),
        hint=(f"set \"architectures\": [{named.split(', ')[0]}] in config.json" + (
            " (the classes above store the same tensors: pick the one the model was trained as)."
            if len(fitting) > 1 else ".")) if fitting else error.hint)


def _head_classes(model_type: str) -> list[str]:
    """The class names transformers' auto classes map ``model_type`` to, the bare model first."""
    from transformers.models.auto import modeling_auto

    mappings = [getattr(modeling_auto, n) for n in sorted(dir(modeling_auto))
                if n.startswith("MODEL_") and n.endswith("_MAPPING_NAMES")]
    names = [m.get(model_type) for m in [modeling_auto.MODEL_MAPPING_NAMES, *mappings]]
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))


def _stores(class_name: str, config) -> set[str]:
    """The floating-point tensor names a checkpoint of ``class_name`` built from ``config`` stores."""
    from .checkpoint import stored_weight_names

    named = copy.deepcopy(config)
    named.architectures = [class_name]
    return stored_weight_names(named) or set()


def _check_loading_info(info: Mapping[str, Any], model, folder: Path, weights: Path) -> None:
    """transformers fills missing tensors with random values and only logs it: a checkpoint that does not match
    the model key for key is bad input, never a model to analyse or transform."""
    problems = []
    # an integer buffer (BatchNorm's num_batches_tracked) starts from a fixed value and is no weight: not missing
    counters = {k for k, v in model.state_dict().items() if not v.is_floating_point()}
    for key, what in (("missing_keys", "missing from the file (transformers would initialise them afresh, weights "
                                       "at random)"),
                      ("unexpected_keys", "in the file but not in the model"),
                      ("mismatched_keys", "of another shape than the model's")):
        names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(key) or ())
        names = [n for n in names if key != "missing_keys" or n not in counters]
        if names:
            problems.append(f"{len(names)} tensor(s) {what}: {_some(names)}")
    if info.get("error_msgs"):
        problems.append("transformers reported: " + "; ".join(map(str, info["error_msgs"]))[:400])
    if problems:
        raise ModelLoadError(
            f"The weights in '{folder}' ({weights.name}) do not match {type(model).__name__} built from its "
            f"config.json: " + "; ".join(problems) + ".",
            hint="the checkpoint is incomplete or belongs to another architecture or head: check that "
            "config.json's \"architectures\" and sizes describe these weights, or re-save the checkpoint from the "
            "model it came from.",
        )


def _warn_unloaded(model, folder: Path, listing) -> None:
    """Stored tensors the class skips on loading in modules the model lacks (multi-token-prediction layers) are
    left out of what is analysed, with a warning: only a written model would lose them, and writing refuses them
    (:func:`~symgraph.checkpoint.refuse_unloaded`)."""
    from .checkpoint import unloaded_tensors

    own = set(model.state_dict())
    lost = unloaded_tensors(model, [key for key, *_ in listing if _model_key(model, key, own) not in own])
    if lost:
        _log.warning("'%s' holds %d tensor(s) that %s does not load (multi-token-prediction layers or the like): "
                     "%s. They are left out here; a command that writes a model from it (align, transform, fold, "
                     "merge without --stream) refuses it.", folder, len(lost), type(model).__name__, _some(lost))


def _some(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _check_stored_dtypes(model, folder: Path, listing) -> None:
    """transformers casts an integer tensor into a float parameter without a word; refuse it (``listing``:
    :func:`_stored_dtypes`'s)."""
    floating = {k for k, v in model.state_dict().items() if v.is_floating_point()}
    bad = [f"{key} ({dtype} in {file.name})" for key, dtype, is_float, file in listing
           if not is_float and _model_key(model, key, floating) in floating]
    if bad:
        raise ModelLoadError(
            f"The weights in '{folder}' store integer or boolean values for floating-point parameters: "
            f"{_some(bad)}.",
            hint="the checkpoint was written wrongly (or quantised in a format transformers cannot read back): "
            "re-save it from the floating-point model.",
        )


def _check_ties_kept(model, folder: Path) -> None:
    """transformers leaves a tie untied (and only warns) where the checkpoint stores both tensors with different
    values: refused, as the model loaded is not the one config.json describes, and written back it would be tied."""
    from .checkpoint import _declared_ties

    state = model.state_dict()
    for tied, source in _declared_ties(model).items():
        if tied in state and source in state and state[tied].data_ptr() != state[source].data_ptr():
            raise tied_copies_differ(folder, tied, source)


def tied_copies_differ(folder: Path, tied: str, source: str) -> ModelLoadError:
    """The error for a checkpoint storing both tensors of a tie (``tied`` and ``source``) with different values."""
    return ModelLoadError(
        f"config.json in '{folder}' ties {tied} to {source}, but the checkpoint stores both with different values: "
        "transformers then leaves them untied (and only warns), so the model it loads is not the one config.json "
        "describes, and a written copy would keep one of the two.",
        hint="if the two are meant to differ, untie them in config.json (e.g. \"tie_word_embeddings\": false); "
        "else re-save the checkpoint with one copy of the tie (save_pretrained does).")


def _stored_float_dtypes(listing) -> dict[str, torch.dtype]:
    """Stored key -> dtype of every floating-point tensor the checkpoint stores (``listing``: what
    :func:`_stored_dtypes` yields). transformers loads a checkpoint in one dtype (config.json's): one that stores
    some tensors wider (float32 norms beside bfloat16 weights) is loaded in the widest (each value exact, the model
    runs in one dtype) and written back in the stored dtypes (:func:`_narrower_stored`), as a streamed alignment
    writes it."""
    from .shards import SAFETENSORS_DTYPES

    by_name = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
    found = {key: by_name.get(name) or getattr(torch, name, None)
             for key, name, is_float, _ in listing if is_float}
    return {key: dtype for key, dtype in found.items() if isinstance(dtype, torch.dtype)}


def _narrower_stored(model, stored: Mapping[str, torch.dtype], folder: Path) -> dict[str, torch.dtype]:
    """Model key -> stored dtype of the parameters ``stored`` (stored key -> dtype) holds in a dtype other than
    the model's. Tensors loaded into one parameter (experts stored one by one) must share their dtype."""
    own = model.state_dict()
    floating = {k for k, v in own.items() if v.is_floating_point()}
    parts: dict[str, dict[str, torch.dtype]] = {}
    for key, dtype in stored.items():
        parts.setdefault(_model_key(model, key, floating), {})[key] = dtype
    mixed = next((key for key, dtypes in parts.items() if len(set(dtypes.values())) > 1), None)
    if mixed is not None:
        raise mixed_dtypes_error(folder, mixed, parts[mixed])
    by_key = {key: next(iter(dtypes.values())) for key, dtypes in parts.items()}
    return {key: dtype for key, dtype in by_key.items() if key in floating and own[key].dtype != dtype}


def mixed_dtypes_error(folder: Path, model_key: str, dtypes: Mapping[str, torch.dtype]) -> ModelLoadError:
    """The error for stored tensors (``dtypes``: name -> dtype) of different dtypes that transformers loads into
    the one parameter ``model_key``."""
    first: dict[torch.dtype, str] = {}  # a tensor of each dtype
    for name, dtype in sorted(dtypes.items()):
        first.setdefault(dtype, name)
    named = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for dtype, name in first.items())
    return ModelLoadError(
        f"The checkpoint '{folder}' stores the tensors transformers loads into {model_key} in different dtypes "
        f"({named}): symgraph writes them back from that one tensor, in one dtype, so some would not keep their "
        "stored dtype.",
        hint="convert them to one dtype first (the widest, to lose nothing), then pass that checkpoint.")


def _stored_dtypes(folder: Path, weights: Path):
    """(key, dtype name, is floating, file) of every stored tensor, without reading values: safetensors headers, or
    memory-mapped .bin files (the dtype of an unreadable old-format .bin is left to transformers)."""
    from safetensors import safe_open

    for file in _weight_files(folder, weights):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    dtype = handle.get_slice(key).get_dtype()
                    yield key, dtype, dtype.startswith(("F", "BF")), file
            continue
        try:
            stored = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except Exception:
            continue
        for key, value in _state_dict_in(stored, file).items():
            if isinstance(value, torch.Tensor):
                yield key, str(value.dtype).removeprefix("torch."), value.is_floating_point(), file


def stored_names(folder: Path) -> set[str]:
    """The names of the tensors the checkpoint in ``folder`` stores (safetensors or .bin); none without weights."""
    weights = _weights_in(folder)
    return {key for key, *_ in _stored_dtypes(folder, weights)} if weights is not None else set()


def stored_tensors(folder: Path, names) -> dict[str, torch.Tensor]:
    """The tensors ``names`` as the checkpoint in ``folder`` stores them (safetensors or .bin)."""
    from safetensors import safe_open

    wanted, out = set(names), {}
    weights = _weights_in(folder) if wanted else None
    for file in _weight_files(folder, weights) if weights is not None else ():
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as handle:
                out.update({key: handle.get_tensor(key) for key in wanted & set(handle.keys())})
        else:
            stored = _state_dict_in(torch.load(file, map_location="cpu", weights_only=True), file)
            out.update({key: stored[key] for key in wanted & set(stored)})
    return out


def _state_dict_in(stored, file: Path) -> dict:
    """``stored`` (what ``torch.load`` read from ``file``), which must map tensor names to tensors."""
    if not isinstance(stored, dict):
        raise ModelLoadError(f"'{file}' holds a {type(stored).__name__}, not a state dict (tensor names mapped to "
                             "tensors), so no model can be read from it.",
                             hint="save the weights with model.save_pretrained(folder), or "
                                  "torch.save(model.state_dict(), file).")
    return stored


def _weights_in(folder: Path) -> Path | None:
    """The weights file ``from_pretrained`` reads in ``folder`` (None: none)."""
    return next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)


def _model_key(model, stored_key: str, model_keys: set[str]) -> str:
    """The model parameter a stored key loads into: transformers' own load-time renaming (legacy names,
    base-model prefix) when it attached one to the model, else the key itself."""
    if stored_key in model_keys:
        return stored_key
    try:
        from transformers.core_model_loading import WeightConverter, rename_source_key

        conversions = getattr(model, "_weight_conversions", None) or []
        renamed, _ = rename_source_key(
            stored_key, [c for c in conversions if not isinstance(c, WeightConverter)],
            [c for c in conversions if isinstance(c, WeightConverter)],
            getattr(model, "base_model_prefix", None), dict.fromkeys(model_keys, True))
        return renamed
    except Exception:  # transformers' internals moved: fall back to the stored name
        return stored_key


def check_finite(model: torch.nn.Module, where: str) -> None:
    """NaN or Inf weights are bad input: say which tensor, before any analysis could be blamed for them.
    Every loader calls it; alignment and merging call it again for subjects built by hand."""
    bad = [k for k, v in model.state_dict().items()
           if v.is_floating_point() and v.device.type != "meta" and not all_finite(v)]
    if bad:
        raise nonfinite_error(where, bad)


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``: its smallest and largest entries are finite (``torch.aminmax`` propagates NaN).
    One pass without temporaries, where ``isfinite(t).all()`` makes four (a 7B bf16 checkpoint read three times in
    a streamed alignment spent minutes in them); dtypes aminmax does not take fall back to that."""
    if t.numel() == 0:
        return True
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):
        return bool(torch.isfinite(t).all())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def nonfinite_error(where: str, names) -> ModelLoadError:
    """The error for NaN or Inf weights in ``names`` of ``where`` (a model, a checkpoint)."""
    return ModelLoadError(
        f"NaN or Inf values in {where}: {_some(names)}.",
        hint="symgraph needs finite weights; the checkpoint is damaged or training diverged: use an earlier "
        "or re-saved checkpoint.",
    )


def read_config_json(file: Path) -> dict:
    """A config.json as transformers reads it: JSON, with the floats JSON has no number for (``inf``, NaN) decoded
    from the objects transformers writes them as (``{"__float__": "Infinity"}``: Mamba2's ``time_step_limit``)."""
    from transformers import PretrainedConfig

    return PretrainedConfig._decode_special_floats(_read_json(file, what="config file"))


def _read_json(file: Path, *, what: str) -> dict:
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"Cannot read {what} '{file}': {exc}",
            hint="check the file's permissions and that it is a UTF-8 JSON file.",
        ) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(
            f"The {what} '{file}' is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}.",
            hint="fix the file by hand at that position, or re-download / re-save it.",
        ) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(
            f"The {what} '{file}' holds a JSON {type(data).__name__}, not an object.",
            hint="a Hugging Face config.json is a JSON object with at least \"model_type\".",
        )
    return data


def _known_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return sorted(CONFIG_MAPPING.keys())


def _architecture_class(config_dict: Mapping[str, Any]):
    import transformers

    archs = config_dict.get("architectures") or []
    if isinstance(archs, list) and archs and isinstance(archs[0], str):
        try:
            cls = getattr(transformers, archs[0])
        except Exception:  # AttributeError, or a lazy import failing on a missing optional dependency
            return None
        if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
            return cls
    return None


def _build_config(config_dict: dict, config_file: Path):
    """Return (config, model class): the class from ``architectures[0]`` when transformers has it, else AutoModel."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    arch_cls = _architecture_class(config_dict)
    if arch_cls is None and config_dict.get("auto_map"):
        raise _custom_code_error(config_dict, config_file)
    model_type = config_dict.get("model_type")
    if model_type is None:
        if arch_cls is None:
            raise ModelLoadError(
                f"The config file '{config_file}' has no \"model_type\" key, and its architectures "
                f"({config_dict.get('architectures')!r}) name no class transformers {transformers.__version__} "
                "knows.",
                hint="add \"model_type\" (e.g. \"llama\", \"bert\") to config.json.",
            )
        config_cls = arch_cls.config_class
    else:
        if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
            known = _known_model_types()
            close = difflib.get_close_matches(str(model_type), known, n=5, cutoff=0.5)
            common = [t for t in ("llama", "mistral", "qwen2", "gemma", "gpt2", "bert", "t5") if t in known]
            suggestion = (
                f"Close known types: {', '.join(close)}."
                if close
                else f"Known types include {', '.join(common)}, ... ({len(known)} in all)."
            )
            raise ModelLoadError(
                f"The config file '{config_file}' has model_type '{model_type}', which transformers "
                f"{transformers.__version__} does not know. {suggestion}",
                hint="fix the model_type in config.json if it is misspelt; if the model needs custom code "
                "(trust_remote_code) or a newer transformers, load it yourself and pass a factory "
                "'package.module:function' instead.",
            )
        config_cls = CONFIG_MAPPING[model_type]
    try:
        config = config_cls.from_dict(dict(config_dict))
    except Exception as exc:
        raise ModelLoadError(
            f"transformers could not build a {config_cls.__name__} from '{config_file}': {_describe(exc)}",
            hint="check the values in config.json against the model's documentation.",
        ) from exc
    return config, (_builds(arch_cls, config) or transformers.AutoModel)


def _builds(cls, config):
    """``cls`` (the class ``architectures`` names) where it is ``config``'s model, else None: architectures then
    disagrees with model_type, and AutoModel picks from the config."""
    return cls if cls is not None and (isinstance(config, cls.config_class) or _built_by_auto(config, cls)) else None


def _built_by_auto(config, cls) -> bool:
    """Whether one of transformers' Auto classes builds ``cls`` for ``config``: a model type that reuses another's
    classes (InternLM3's causal LM is LlamaForCausalLM, whose own config class is LlamaConfig) names them in its
    architectures, and they are its architecture, not a disagreement with its model_type."""
    from transformers.models.auto import modeling_auto

    for name in dir(modeling_auto):
        mapping = getattr(modeling_auto, name)
        if not (name.endswith("_MAPPING") and isinstance(mapping, modeling_auto._LazyAutoMapping)):
            continue
        try:
            built = mapping[type(config)]
        except (KeyError, ValueError, AttributeError, ImportError):  # unmapped, or its module fails to import
            continue
        if cls in (built if isinstance(built, (tuple, list)) else (built,)):
            return True
    return False


def _custom_code_error(config_dict: Mapping[str, Any], config_file: Path) -> ModelLoadError:
    """A config whose class lives in the checkpoint's own code (``auto_map``, run by transformers only with
    trust_remote_code): the stock class of its model_type may compute something else, so it is never substituted."""
    code = ", ".join(sorted({str(v) for v in dict(config_dict["auto_map"]).values()}))
    return ModelLoadError(
        f"The config file '{config_file}' names the class {config_dict.get('architectures')!r}, which is custom "
        f"code shipped with the checkpoint (auto_map: {code}) and not part of transformers; symgraph does not run "
        "downloaded code (trust_remote_code), and the stock class of its model_type may compute something else.",
        hint="if you trust the code, load the model yourself in a factory (e.g. a file model.py with "
        "def build(): return AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)) and pass "
        "'model.py:build'.")


def _model_class(config) -> tuple[Any, Any]:
    """(model class, config object) for a ``PretrainedConfig`` or a config dict, as loading would pick them; the
    class is None when the config names one transformers does not have (custom code: its layout is unknown)."""
    import transformers

    as_dict = dict(config) if isinstance(config, Mapping) else config.to_dict() \
        if isinstance(config, transformers.PretrainedConfig) else None
    if as_dict is None or (as_dict.get("architectures") and _architecture_class(as_dict) is None):
        return None, config
    if isinstance(config, Mapping):
        config, cls = _build_config(as_dict, Path("config.json"))
        return cls, config
    return _builds(_architecture_class(as_dict), config) or transformers.AutoModel, config


def _cls_name(cls) -> str:
    return getattr(cls, "__name__", str(cls))


def _build_meta(cls, config, config_file: Path, *, name: str, folder: Path, dtype) -> LoadedModel:
    """Build the architecture with every parameter on the meta device: shapes only, no weight memory.

    Buffers stay real (they are small: rotary frequency tables, position ids) because the analysis reads
    parameter-free values such as RoPE's cos/sin tables to tell which coordinates rotate together.
    """
    import transformers

    kwargs = {} if dtype is None or dtype == "auto" else {"dtype": dtype}
    try:
        with _parameters_on_meta():
            if cls is transformers.AutoModel or not hasattr(cls, "_from_config"):
                model = cls.from_config(config, **kwargs)
            else:
                model = cls._from_config(config, **kwargs)
    except Exception as exc:
        raise ModelLoadError(
            f"Could not build {_cls_name(cls)} from '{config_file}' on the meta device: {_describe(exc)}",
            hint="check the sizes in config.json; if the model's constructor needs real tensors, load it with "
            "weights instead of --config-only.",
        ) from exc
    if hasattr(model, "tie_weights"):
        # Built with its parameters registered on the meta device, a model does not tie its weights as it does
        # when built from the same config otherwise; untied, its graph has symmetries the real model lacks (a tied
        # LLaMA's final norm rescaled against its LM head, not against its embedding).
        model.tie_weights()
    model.eval()
    return LoadedModel(model=model, config=getattr(model, "config", config), path=folder, name=name)


@contextlib.contextmanager
def _parameters_on_meta():
    """Register every new parameter on the meta device; buffers are created as usual."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _check_weights(folder: Path, weights: Path) -> None:
    """Read the headers of the weight files (cheap) so that damaged files get a clear error naming them."""
    if weights.name.endswith(".index.json"):
        index = _read_json(weights, what="weights index")
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(
                f"The weights index '{weights}' has no \"weight_map\".",
                hint="re-download or re-save the checkpoint.",
            )
        shards = _shard_names(weights, weight_map)
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelLoadError(
                f"The weights index '{weights}' lists shard files that are missing from '{folder}': "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}.",
                hint="the download is incomplete: fetch the missing shards, or re-save the checkpoint.",
            )
        files = [folder / s for s in shards]
    else:
        files = [weights]
    shard_of: dict[str, Path] = {}
    for file in files:
        if file.suffix == ".safetensors":
            for name in _check_safetensors(file):
                if name in shard_of:
                    _check_same_copies(name, shard_of[name], file)
                shard_of[name] = file
        elif file.suffix == ".bin" and file.stat().st_size == 0:
            raise ModelLoadError(
                f"Weights file '{file}' is empty.", hint="re-download or re-save the checkpoint."
            )


def _check_safetensors(file: Path) -> list[str]:
    """The tensor names in ``file``'s header, or a clear error when the header cannot be read."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # SafetensorError (header), OSError (unreadable)
        raise ModelLoadError(
            f"Weights file '{file}' is corrupt or truncated: {_first_line(exc)}",
            hint="the file is probably an incomplete download or a failed write: re-download or re-save it "
            "(check its size against the original).",
        ) from exc


def _check_same_copies(name: str, first: Path, second: Path) -> None:
    """A tensor stored in two shards must hold the same values in both: transformers loads the later shard's
    copy whatever the index says, so two different copies leave no way to tell which one the model is."""
    from safetensors import safe_open

    copies = []
    for file in (first, second):
        with safe_open(str(file), framework="pt") as handle:
            copies.append(handle.get_tensor(name))
    a, b = copies
    if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
        raise ModelLoadError(
            f"Tensor '{name}' is stored in two shards with different values: '{first.name}' and '{second.name}' "
            f"(in '{first.parent}').",
            hint="a damaged or hand-edited checkpoint: keep the copy the model should have in one shard only "
            "(the one its model.safetensors.index.json names), or re-save the model with save_pretrained.",
        )


def _weight_files(folder: Path, weights: Path) -> list[Path]:
    """The weight files of a checkpoint: ``weights`` itself, or the shards its index lists."""
    if weights.name.endswith(".index.json"):
        index = _read_json(weights, what="weights index")
        return [folder / s for s in _shard_names(weights, index.get("weight_map") or {})]
    return [weights]


def _shard_names(index: Path, weight_map: dict) -> list[str]:
    """The shard files a weights index names, each a file of the index's own folder: a name that reaches outside it
    (``../other/model-00001.safetensors``, an absolute path) would read another checkpoint's tensors, which
    transformers refuses too."""
    shards = sorted(set(map(str, weight_map.values())))
    outside = [s for s in shards if Path(s).name != s or s in (".", "..")]
    if outside:
        raise ModelLoadError(
            f"The weights index '{index}' names shard files outside its folder: {', '.join(outside[:3])}"
            f"{' ...' if len(outside) > 3 else ''}.",
            hint="shards must be files of the model folder itself: move them there and name them by file name.")
    return shards


def _safetensors_files(folder: Path, weights: Path) -> list[Path]:
    """The safetensors files of a checkpoint (its shards when ``weights`` is an index); none for .bin files."""
    return [f for f in _weight_files(folder, weights) if f.suffix == ".safetensors"]


def _shape_mismatches(cls, config, folder: Path, weights: Path) -> list[tuple[str, tuple, tuple]]:
    """Best-effort diagnosis after a failed load: (key, shape in file, shape the config implies), safetensors only."""
    try:
        from safetensors import safe_open

        files = _safetensors_files(folder, weights)
        stored: dict[str, tuple] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    stored[key] = tuple(handle.get_slice(key).get_shape())
        expected = {
            k: tuple(v.shape) for k, v in _build_meta(cls, config, weights, name="", folder=folder, dtype=None)
            .model.state_dict().items()
        }
        out = []
        for key, shape in stored.items():
            # checkpoints of a base model loaded into a head model (or back) differ by a prefix such as "bert."
            match = next((k for k in expected if k == key or k.endswith("." + key) or key.endswith("." + k)), None)
            if match is not None and expected[match] != shape:
                out.append((key, shape, expected[match]))
        return out
    except Exception:
        return []


def _describe(exc: BaseException) -> str:
    """An exception as one readable clause; ``sys.exit(n)`` is named as such, not as a bare number."""
    if isinstance(exc, SystemExit):
        return f"SystemExit: it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {_full_text(exc)}"


def _full_text(exc: BaseException) -> str:
    """The whole message on one line: transformers often puts the reason on the second line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _parse_dtype(dtype):
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        if dtype == "auto":
            return dtype
        candidate = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(candidate, torch.dtype):
            return candidate
    raise ModelLoadError(
        f"Unknown dtype {dtype!r}.",
        hint="use a torch dtype or its name: float32, float64, bfloat16, float16.",
    )


def _tensors(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


# ----------------------------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------------------------


def state_dict_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict (parameters and persistent buffers), detached from autograd, sharing memory."""
    return {k: v.detach() for k, v in model.state_dict(keep_vars=False).items()}
