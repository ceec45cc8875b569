"""Model input/output: turn a MODEL argument into a module, and write state dicts back as Hugging Face folders.

``load_model`` accepts an ``nn.Module``, a local Hugging Face folder (config.json plus weights), a config file or
weightless folder (``config_only=True``: the model is built on the meta device, no weight memory), or a factory
string ``package.module:function`` / ``path/to/file.py:function``. Every way it can fail raises
:class:`~symgraph.errors.ModelLoadError` with a message that names the offending path or string.

``save_model`` writes ``config.json`` + ``model.safetensors`` (+ tokenizer files copied from ``like``) into a
temporary sibling directory and renames it into place, so a crash or a full disk never leaves a half-written or
half-replaced output folder behind. Its failures raise :class:`~symgraph.errors.OutputError`.
"""
from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import uuid
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from safetensors import SafetensorError

from .errors import ModelLoadError, OutputError

if TYPE_CHECKING:  # importing transformers is slow; the loaders import it lazily
    from transformers import PretrainedConfig

__all__ = [
    "LoadedModel",
    "load_model",
    "save_model",
    "state_dict_of",
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

#: Files copied verbatim from ``like`` into a saved folder (tokenizer, processor, generation settings).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "generation_config.json",
)


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """A model ready for capture: the module (eval mode), its HF config if any, where it came from, a display name."""

    model: torch.nn.Module
    config: PretrainedConfig | None
    path: Path | None
    name: str
    inputs: tuple[tuple, dict] | None = None  # example (args, kwargs) a factory returned with its module

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

    ``source`` is an ``nn.Module`` (used as is, switched to eval mode), a path to a Hugging Face folder, a path to
    a ``config.json`` (or a weightless folder) with ``config_only=True``, or a factory string
    ``package.module:function`` / ``path/to/file.py:function`` whose function takes no arguments and returns an
    ``nn.Module``. ``dtype`` (a ``torch.dtype`` or its name, e.g. ``"float64"``) is passed to transformers or
    applied with ``.to(dtype)``.
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
        except Exception as exc:  # ImportError, or anything the module raises while importing
            err = _FactoryImportError(f"importing module '{module_part}' failed: {type(exc).__name__}: {exc}")
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
        if not isinstance(exc, Exception):
            raise
        err = _FactoryImportError(f"executing file '{file}' failed: {type(exc).__name__}: {exc}")
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
    except Exception as exc:
        raise ModelLoadError(
            f"The factory '{text}' raised {type(exc).__name__}: {exc}",
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
    if dtype is not None and dtype != "auto":
        model = model.to(dtype)
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
            raise ModelLoadError(
                f"Folder '{folder}' has no config.json (it contains: {', '.join(found) or 'nothing'}).",
                hint="point at the Hugging Face model folder itself (the one holding config.json), or use a "
                "factory 'package.module:function' for models that are not Hugging Face checkpoints.",
            )
    elif path.is_file():
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
    config_dict = _read_json(config_file, what="config file")
    config, cls = _build_config(config_dict, config_file)
    try:
        config.name_or_path = str(folder)
    except Exception:
        pass
    name = (folder.name if config_file.name == "config.json" else config_file.stem) or str(folder)

    if config_only:
        return _build_meta(cls, config, config_file, name=name, folder=folder, dtype=dtype)

    weights = [folder / f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not weights:
        stray = sorted(p.name for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
        detail = (
            f" It has {', '.join(stray[:4])}, but transformers only reads {', '.join(WEIGHT_FILES)}."
            if stray
            else ""
        )
        raise ModelLoadError(
            f"No weights found next to '{config_file}' (looked for {', '.join(WEIGHT_FILES)}).{detail}",
            hint="pass --config-only (config_only=True) to analyse the architecture without weights (built on "
            "the meta device, no memory used), or point at a folder that contains the weights.",
        )
    _check_weights(folder, weights[0])

    kwargs: dict[str, Any] = {"config": config, "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        model = cls.from_pretrained(str(folder), **kwargs)
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
            reason = f"{type(exc).__name__}: {_first_line(exc)}"
        raise ModelLoadError(
            f"transformers could not load the model in '{folder}' as {_cls_name(cls)} (weights: "
            f"{weights[0].name}): {reason}",
            hint="check that the weights match config.json (same model_type and sizes) and are complete; "
            "re-download or re-save the checkpoint if a file is damaged.",
        ) from exc
    if isinstance(model, tuple):  # output_loading_info-style returns, just in case
        model = model[0]
    model.eval()
    return LoadedModel(model=model, config=getattr(model, "config", config), path=folder, name=name)


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
            f"transformers could not build a {config_cls.__name__} from '{config_file}': "
            f"{type(exc).__name__}: {_first_line(exc)}",
            hint="check the values in config.json against the model's documentation.",
        ) from exc
    if arch_cls is not None and not isinstance(config, arch_cls.config_class):
        arch_cls = None  # architectures disagrees with model_type: let AutoModel pick from the config
    return config, (arch_cls or transformers.AutoModel)


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
            f"Could not build {_cls_name(cls)} from '{config_file}' on the meta device: "
            f"{type(exc).__name__}: {_first_line(exc)}",
            hint="check the sizes in config.json; if the model's constructor needs real tensors, load it with "
            "weights instead of --config-only.",
        ) from exc
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
        shards = sorted(set(map(str, weight_map.values())))
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
    for file in files:
        if file.suffix == ".safetensors":
            _check_safetensors(file)
        elif file.suffix == ".bin" and file.stat().st_size == 0:
            raise ModelLoadError(
                f"Weights file '{file}' is empty.", hint="re-download or re-save the checkpoint."
            )


def _check_safetensors(file: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as exc:  # SafetensorError (header), OSError (unreadable)
        raise ModelLoadError(
            f"Weights file '{file}' is corrupt or truncated: {_first_line(exc)}",
            hint="the file is probably an incomplete download or a failed write: re-download or re-save it "
            "(check its size against the original).",
        ) from exc


def _shape_mismatches(cls, config, folder: Path, weights: Path) -> list[tuple[str, tuple, tuple]]:
    """Best-effort diagnosis after a failed load: (key, shape in file, shape the config implies), safetensors only."""
    try:
        from safetensors import safe_open

        if weights.name.endswith(".index.json"):
            files = sorted({folder / s for s in json.loads(weights.read_text())["weight_map"].values()})
        elif weights.suffix == ".safetensors":
            files = [weights]
        else:
            return []
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


def save_model(
    state_dict: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    config: Any = None,
    like: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``state_dict`` as a Hugging Face folder at ``out_dir``, atomically; return the folder.

    Writes ``config.json`` (from ``config``: a ``PretrainedConfig`` or a dict; else copied from ``like``),
    ``model.safetensors`` and, from ``like``, tokenizer/processor/generation files. Everything goes into a
    temporary sibling folder first and is renamed into place at the end; with ``overwrite=True`` an existing
    folder is replaced only once the new one is complete. On failure nothing is left behind and an existing
    ``out_dir`` is untouched. Input tensors are never modified (tensors sharing memory are cloned before writing).

    When ``like`` is given and its weights file does not store a key (tied weights are usually stored once),
    that key is left out if its tensor is an exact copy of a stored one.
    """
    out = Path(out_dir).expanduser()
    out = out.parent.resolve() / out.name if out.name else out.resolve()
    like_dir = _like_dir(like) if like is not None else None

    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputError(
                f"Output folder '{out}' already exists.",
                hint="pass --overwrite (overwrite=True) to replace it, or choose another output path.",
            )
        if not out.is_dir() or out.is_symlink():
            raise OutputError(
                f"Output path '{out}' exists and is not a folder; refusing to replace it.",
                hint="choose another output path, or remove that file yourself.",
            )

    tensors = _prepare_tensors(state_dict, like_dir)

    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as exc:
        raise OutputError(
            f"Cannot create the output folder '{out}': {exc.strerror or exc}.",
            hint="check that the parent folder is writable, or choose another output path.",
        ) from exc

    done = False
    try:
        _write_folder(tmp, tensors, config=config, like_dir=like_dir)
        _move_into_place(tmp, out, overwrite=overwrite)
        done = True
    except OutputError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
        # OSError: disk full, permissions; safetensors reports some I/O problems as SafetensorError.
        reason = getattr(exc, "strerror", None) or _first_line(exc)
        raise OutputError(
            f"Writing the model to '{out}' failed: {reason}. Nothing was written"
            + (" and the existing folder was left as it was." if out.exists() else "."),
            hint="free disk space or fix permissions on the output location, then run again.",
        ) from exc
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


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


def _stored_keys(like_dir: Path) -> set[str] | None:
    """Keys stored in ``like``'s safetensors weights, or None when unknown."""
    try:
        index = like_dir / "model.safetensors.index.json"
        if index.is_file():
            return set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        single = like_dir / "model.safetensors"
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                return set(handle.keys())
    except Exception:
        return None
    return None


def _prepare_tensors(state_dict: Mapping[str, torch.Tensor], like_dir: Path | None) -> dict[str, torch.Tensor]:
    """Validate, drop tied duplicates ``like`` did not store, and make each tensor own its contiguous memory."""
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

    stored = _stored_keys(like_dir) if like_dir is not None else None
    if stored is not None and stored & items.keys():
        kept = {k: v for k, v in items.items() if k in stored}
        for key, value in items.items():
            if key in kept:
                continue
            if any(_same_tensor(value, other) for other in kept.values()):
                continue  # a tied copy that the reference checkpoint stores once
            kept[key] = value
        items = kept

    out: dict[str, torch.Tensor] = {}
    seen_storage: set[tuple] = set()
    for key, value in items.items():
        value = value.cpu()
        storage_key = (value.untyped_storage().data_ptr(), value.untyped_storage().nbytes())
        shared = value.numel() > 0 and storage_key in seen_storage
        whole = value.is_contiguous() and value.storage_offset() == 0 and (
            value.numel() * value.element_size() == value.untyped_storage().nbytes()
        )
        if shared or not whole:
            value = value.contiguous().clone()
        else:
            seen_storage.add(storage_key)
        out[key] = value
    return out


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


def _write_folder(tmp: Path, tensors: dict[str, torch.Tensor], *, config, like_dir: Path | None) -> None:
    from safetensors.torch import save_file

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

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})

    if like_dir is not None:
        for name in TOKENIZER_FILES:
            src = like_dir / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    _fsync_dir(tmp)


def _fsync_dir(folder: Path) -> None:
    """Flush the new files to disk so the rename cannot expose empty files after a crash (best effort)."""
    for file in folder.iterdir():
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


def _move_into_place(tmp: Path, out: Path, *, overwrite: bool) -> None:
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700 folders; give the result ordinary permissions
    for file in tmp.iterdir():
        os.chmod(file, 0o644)  # safetensors writes 0600 files: installed or shared copies must stay readable
    if not out.exists():
        os.rename(tmp, out)  # atomic; fails if someone created a non-empty out meanwhile
        return
    if not overwrite:  # appeared while we were writing
        raise OutputError(
            f"Output folder '{out}' appeared while the model was being written.",
            hint="pass --overwrite (overwrite=True) to replace it, or choose another output path.",
        )
    old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)  # put the original back before reporting
        raise
    shutil.rmtree(old, ignore_errors=True)



def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary sibling and a rename, so no half-written file is left."""
    return write_atomic(path, lambda tmp: tmp.write_text(text))


def write_atomic(path, write) -> Path:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, then rename it into place: readers see the old file
    or the whole new one, never half of it. OS errors become :class:`OutputError`."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise OutputError(f"Cannot write '{path}': folder '{path.parent}' does not exist.",
                          hint="create the folder first, or choose another output path.")
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        raise OutputError(f"Cannot write '{path}': {exc.strerror or exc}.",
                          hint="check the path is writable and the disk has space.") from exc
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a successful rename
    return path
