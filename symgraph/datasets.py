"""Evaluation and calibration data: turn a ``--data SPEC`` into batches, and score a model on them.

A SPEC is one of

==================================  ==============================================================================
spec                                what it loads
==================================  ==============================================================================
``digits`` / ``digits:train``       scikit-learn's 8x8 digit images, 10 classes (``pixel_values``, 1 channel)
``pydoc-chars[:split]``             character language modelling on the shipped Python help text (128-char windows)
``pydoc-topics[:split]``            which of 4 topics a line of that help text documents (statements,
                                    expressions, special methods, strings)
``FILE.txt``                        one example per line, tokenised with the model's tokenizer; for a
                                    classifier a line may be ``LABEL<TAB>text`` (an id or a name of ``id2label``)
``FILE.jsonl``, ``.csv``, ``.tsv``  one record per line (JSON objects; rows under a header; a ``.json`` file holds
                                    a list of them or columns of equal length): the text field
                                    (``text``, ``sentence``, ``content``, ``prompt`` or ``input``, else the
                                    one text field) tokenised, ``label`` the class of a classifier; text files
                                    may be compressed (``FILE.jsonl.gz``, ``.bz2``, ``.xz``)
``FILE.parquet``, ``.arrow``,       records as above, read with pyarrow: what the Hugging Face Hub serves, what
``DIR[:split]``                     ``datasets`` caches, or a folder its ``save_to_disk`` wrote (a DatasetDict's
                                    split named after a colon, else the split asked for)
``FILE.npz``                        arrays named after forward keywords, plus optional ``labels`` (1-D: classes,
                                    2-D: token ids)
``DIR``                             images or WAV sounds, one subfolder per class (its name a class id or an
                                    ``id2label`` name) or unlabelled, preprocessed by the model folder's
                                    processor (:mod:`symgraph.media_folders`)
``package.module:func``             a function returning a :class:`Dataset` or an iterable of :class:`Batch` /
``path/file.py:func``               ``(inputs_dict, labels)`` pairs
==================================  ==============================================================================

Shipped splits are fixed: digits image ``i`` is a test image when ``i % 5 == 0`` (360 test, 1437 train); the
help text (symgraph/data/text/pydoc-topics.tsv, ``class<TAB>line``) is cut into blocks of 20 consecutive lines and
block ``b`` is test when ``b % 5 == 4``. Everything is deterministic: no data is shuffled or sampled.

Losses follow Hugging Face: causal LM labels are the input ids (the loss shifts them) with ``-100`` at padding.
"""
from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
import os
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import tables
from .errors import DataError
from .inputs import without_cache
from .module_state import eval_mode

__all__ = ["Batch", "Dataset", "Metrics", "DATASETS", "TOPIC_CLASSES", "batch_logits", "batch_loss",
           "char_tokenizer", "char_vocabulary", "corpus_lines", "evaluate", "load_data", "logits_of"]

TASKS = ("classification", "causal_lm")
IGNORE = -100  # the label Hugging Face's losses skip (padding)
DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_FILE = DATA_DIR / "text" / "pydoc-topics.tsv"
TOPIC_CLASSES = ("statements", "expressions", "special methods", "strings")
WINDOW = 128  # characters per causal LM example of the shipped corpus
SPECIAL_TOKENS = ("<pad>", "<unk>", "<cls>")
# whose tokenizer reads the shipped text when load_data is given no model
SHIPPED_TOKENIZERS = {"causal_lm": DATA_DIR / "models" / "llama-chars-a",
                      "classification": DATA_DIR / "models" / "bert-topics-a"}


# ----------------------------------------------------------------------------------------------------------------
# data types
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """Keyword inputs of one forward call and their labels.

    ``labels``: ``(B,)`` class ids for classification; ``(B, T)`` token ids for causal LM (the input ids, with
    ``-100`` where the position is padding); ``None`` for unlabelled data. ``targets``: soft labels, which the
    loss then takes instead: ``(probabilities, ids)`` of each example's (each position's next token's) likeliest
    classes, ``(B, k)`` or ``(B, T, k)`` each, probabilities summing to 1 (:mod:`symgraph.synthetic`).
    """

    inputs: dict[str, torch.Tensor]
    labels: torch.Tensor | None = None
    targets: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def size(self) -> int:
        """Number of examples in the batch."""
        if self.labels is not None:
            return int(self.labels.shape[0])
        return int(next(iter(self.inputs.values())).shape[0])


@dataclass(frozen=True)
class Dataset:
    """Named, fixed batches for one task (``"classification"`` or ``"causal_lm"``)."""

    name: str
    task: str
    batches: tuple[Batch, ...]

    def __post_init__(self):
        if self.task not in TASKS:
            raise DataError(f"Dataset '{self.name}' has task '{self.task}'.", hint=f"use one of {', '.join(TASKS)}.")

    def __len__(self) -> int:
        return sum(b.size for b in self.batches)

    @property
    def labelled(self) -> bool:
        """True when every batch carries labels."""
        return all(b.labels is not None for b in self.batches)


@dataclass(frozen=True)
class Metrics:
    """Mean loss (per example, or per predicted token for causal LM), accuracy where labels exist, examples seen."""

    loss: float
    accuracy: float | None
    examples: int


# ----------------------------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------------------------


def load_data(spec: Any, *, model: Any = None, batch_size: int = 32, limit: int | None = None,
              split: str = "test") -> Dataset:
    """Turn a data SPEC (see the module docstring) into a :class:`Dataset`.

    Parameters
    ----------
    spec
        A shipped dataset name (``digits``, ``pydoc-chars``, ``pydoc-topics``, optionally ``:train``/``:test``),
        a ``.txt``, ``.jsonl``, ``.json``, ``.csv``, ``.tsv``, ``.parquet``, ``.arrow`` or ``.npz`` path, a folder
        of images or sounds or one ``datasets``' ``save_to_disk`` wrote (``FOLDER:SPLIT`` for a DatasetDict), a
        factory ``package.module:func`` / ``path/file.py:func``, or a Dataset.
    model
        The model the data is for: a Hugging Face folder, a :class:`symgraph.Subject` or a loaded module. Text is
        tokenised with its tokenizer, and labels and token ids are checked against its config.
    batch_size
        Examples per batch (batches from a factory are kept as they are).
    limit
        Keep only the first ``limit`` examples.
    split
        ``"test"`` or ``"train"`` for shipped datasets; a ``:split`` suffix on the name wins.

    Examples
    --------
    >>> data = load_data("digits", limit=64)
    >>> data.task, len(data), tuple(data.batches[0].inputs["pixel_values"].shape)
    ('classification', 64, (32, 1, 8, 8))
    """
    if batch_size < 1 or (limit is not None and limit < 1):
        raise DataError(f"batch_size must be >= 1 and limit >= 1 or None (got {batch_size}, {limit}).",
                        hint="pass a positive batch size, and a positive limit or none.")
    target = _Target.of(model)
    if isinstance(spec, Dataset):
        data = spec
    else:
        data = _dispatch(str(spec) if isinstance(spec, os.PathLike) else spec, target, batch_size, split, limit)
    data = _limited(data, limit)
    if not data.batches or len(data) == 0:
        raise DataError(f"Data '{data.name}' has no examples.",
                        hint="check the file or factory: it must give at least one example.")
    target.check(data)
    return data


def batch_loss(model: torch.nn.Module, batch: Batch, task: str) -> torch.Tensor:
    """Differentiable mean loss of ``model`` on ``batch``: cross-entropy per example (classification) or per
    predicted token (causal LM). Unlabelled classification batches use the model's own top class as the label,
    so unlabelled data still gives gradients (e.g. a Fisher estimate).

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    >>> batch = Batch({"input": torch.zeros(4, 1, 8, 8)}, torch.tensor([0, 1, 2, 3]))
    >>> round(batch_loss(model, batch, "classification").item(), 2) > 0
    True
    """
    logits = batch_logits(model, batch)
    total, count, _ = _loss_sum(logits, batch, task)
    return total / max(count, 1)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset) -> Metrics:
    """Loss and accuracy of ``model`` on every batch of ``data`` (eval mode, no gradients; means weighted by
    examples, or by predicted tokens for causal LM). Every submodule's train/eval mode is restored afterwards.

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))  # forward(input)
    >>> batch = Batch({"input": torch.zeros(8, 1, 8, 8)}, torch.zeros(8, dtype=torch.long))
    >>> metrics = evaluate(model, Dataset("zeros", "classification", (batch,)))
    >>> metrics.examples, 0.0 <= metrics.accuracy <= 1.0
    (8, True)
    """
    with eval_mode(model):
        loss = correct = count = 0.0
        for batch in data.batches:
            total, n, right = _loss_sum(batch_logits(model, batch), batch, data.task)
            loss, correct, count = loss + float(total), correct + right, count + n
    return Metrics(loss=loss / max(count, 1), accuracy=correct / count if data.labelled and count else None,
                   examples=len(data))


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: a Hugging Face ``ModelOutput`` (``.logits``), a dict with ``"logits"``,
    a tuple/list (its first element), or the tensor itself.

    Examples
    --------
    >>> logits_of((torch.ones(2, 3), None)).shape
    torch.Size([2, 3])
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor):
        raise DataError(f"Cannot find logits in the model's output (a {type(output).__name__}).",
                        hint="make forward return a tensor of logits, a tuple starting with them, or an object "
                             "with a .logits attribute.")
    return logits


def char_vocabulary() -> dict[str, int]:
    """The character vocabulary of the shipped char models: 3 special tokens, newline, printable ASCII.

    Examples
    --------
    >>> vocab = char_vocabulary()
    >>> len(vocab), vocab["<pad>"], vocab["a"]
    (99, 0, 69)
    """
    tokens = [*SPECIAL_TOKENS, "\n", *(chr(c) for c in range(32, 127))]
    return {t: i for i, t in enumerate(tokens)}


def char_tokenizer(*, classifier: bool, max_length: int):
    """A Hugging Face fast tokenizer for :func:`char_vocabulary`: one token per character (unknown ones to
    ``<unk>``); a classifier's tokenizer starts every text with ``<cls>``, like BERT's ``[CLS]``. The shipped char
    models carry its files (``tokenizer.json``, ``tokenizer_config.json``), written by ``save_pretrained``.

    Examples
    --------
    >>> tokenizer = char_tokenizer(classifier=True, max_length=160)
    >>> tokenizer("ab")["input_ids"], tokenizer.decode([69, 70])
    ([2, 69, 70], 'ab')
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocabulary()
    # BPE without merges is a character tokenizer that needs no pre-tokenizer (newlines and spaces are tokens)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()  # decode without spaces between characters
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    specials = {"pad_token": "<pad>", "unk_token": "<unk>"}
    if classifier:
        backend.post_processor = processors.TemplateProcessing(single="<cls> $A",
                                                               special_tokens=[("<cls>", vocab["<cls>"])])
        specials["cls_token"] = "<cls>"
    # split_special_tokens: the text "<pad>" is five characters, as the models were trained
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length,
                                   split_special_tokens=True, **specials)


# ----------------------------------------------------------------------------------------------------------------
# spec dispatch
# ----------------------------------------------------------------------------------------------------------------


def _dispatch(spec: Any, target: _Target, batch_size: int, split: str, limit: int | None) -> Dataset:
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"Cannot read data from {spec!r:.80}.", hint=_FORMS_HINT)
    spec = spec.strip()
    name, _, suffix = spec.partition(":")
    if name == "synthetic":
        from .synthetic import learning_only

        raise learning_only()
    if name in DATASETS:
        return DATASETS[name](_split_of(name, suffix or split), target, batch_size, limit)
    path = Path(spec).expanduser()
    saved = Path(name).expanduser()
    if suffix and saved.is_dir() and tables.is_saved_dataset(saved):  # FOLDER:SPLIT of a saved DatasetDict
        return _load_records(saved, target, batch_size, limit, split=(suffix, split))
    form = _form(path)
    if form in FILE_LOADERS:
        if not path.is_file():
            raise DataError(f"Data file '{path}' does not exist.", hint="check the path, or " + _FORMS_HINT)
        return FILE_LOADERS[form](path, target, batch_size, limit)
    if ":" in spec and not path.exists():
        return _load_factory(spec, target)
    if path.is_dir() and tables.is_saved_dataset(path):
        return _load_records(path, target, batch_size, limit, split=(None, split))
    if path.is_dir():
        return _load_media_folder(path, target, batch_size, limit)
    if path.exists():
        raise DataError(f"'{path}' is not a data file symgraph reads (only {', '.join(FILE_LOADERS)} files, the text "
                        "ones also compressed (.gz, .bz2, .xz), a folder of images or sounds, or one datasets' "
                        "save_to_disk wrote).",
                        hint=_FORMS_HINT)
    if "/" in spec or os.sep in spec:  # a path (a save_to_disk folder, a file without suffix), not a name
        raise DataError(f"Data path '{path}' does not exist.", hint="check the path, or " + _FORMS_HINT)
    raise DataError(f"Unknown dataset '{spec}'. Shipped datasets: {', '.join(DATASETS)}.", hint=_FORMS_HINT)


_FORMS_HINT = ("pass a shipped dataset name (digits, pydoc-chars, pydoc-topics; add ':train' or ':test'), a "
               "FILE.txt (one example per line), a FILE.jsonl / .json / .csv / .tsv / .parquet / .arrow or a "
               "datasets save_to_disk folder (records with a 'text' field and, for a classifier, a 'label'), a "
               "FILE.npz (arrays named after forward arguments, optional "
               "'labels'), a folder of images or WAV files (one subfolder per class), or a factory "
               "'package.module:func' / 'path/file.py:func'.")


def _split_of(name: str, split: str) -> str:
    if split not in ("train", "test"):
        raise DataError(f"Dataset '{name}' has no split '{split}'.", hint=f"use '{name}:train' or '{name}:test'.")
    return split


def _limited(data: Dataset, limit: int | None) -> Dataset:
    """The first ``limit`` examples of ``data`` (the last batch kept is cut)."""
    if limit is None or len(data) <= limit:
        return data
    kept, left = [], limit
    for batch in data.batches:
        if left <= 0:
            break
        kept.append(batch if batch.size <= left else _head(batch, left))
        left -= batch.size
    return Dataset(data.name, data.task, tuple(kept))


def _head(batch: Batch, n: int) -> Batch:
    return Batch({k: v[:n] for k, v in batch.inputs.items()}, None if batch.labels is None else batch.labels[:n])


def _batched(inputs: dict[str, torch.Tensor], labels: torch.Tensor | None, batch_size: int) -> tuple[Batch, ...]:
    """Cut equally long tensors into consecutive batches."""
    total = (labels if labels is not None else next(iter(inputs.values()))).shape[0]
    return tuple(Batch({k: v[i:i + batch_size] for k, v in inputs.items()},
                       None if labels is None else labels[i:i + batch_size]) for i in range(0, total, batch_size))


# ----------------------------------------------------------------------------------------------------------------
# the model the data is for: tokenizer, task, and the checks labels must pass
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Target:
    """What the loader needs from the model: its config and the folder its tokenizer lives in (either may be
    missing)."""

    config: Any = None
    folder: Path | None = None
    classes: tuple[str, ...] = ()  # class names of the model: its own, then its config's ``architectures``

    @classmethod
    def of(cls, model: Any) -> _Target:
        if model is None:
            return cls()
        if isinstance(model, (str, os.PathLike)):
            return cls._from_folder(Path(model).expanduser())
        config = getattr(model, "config", None)
        if config is None and isinstance(getattr(model, "model", None), torch.nn.Module):
            config = getattr(model.model, "config", None)  # a symgraph Subject or LoadedModel
        folder = getattr(model, "path", None) or getattr(config, "_name_or_path", None) or None
        folder = Path(folder) if folder and Path(folder).is_dir() else None
        module = model if isinstance(model, torch.nn.Module) else getattr(model, "model", None)
        return cls(config, folder, (type(module).__name__, *_architectures(config)))

    @classmethod
    def _from_folder(cls, folder: Path) -> _Target:
        if not (folder / "config.json").is_file():
            raise DataError(f"Model folder '{folder}' does not exist or has no config.json.",
                            hint="pass the Hugging Face folder of the model the data is for.")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        return cls(config, folder.resolve(), _architectures(config))

    @property
    def task(self) -> str | None:
        """The task the model's head does, read from its architecture names."""
        names = " ".join(self.classes)
        if "CausalLM" in names or "LMHead" in names:
            return "causal_lm"
        return "classification" if "Classification" in names else None

    @property
    def vocab_size(self) -> int | None:
        config = getattr(self.config, "text_config", None) or self.config
        size = getattr(config, "vocab_size", None)
        return int(size) if size is not None else None

    @property
    def max_tokens(self) -> int:
        positions = getattr(self.config, "max_position_embeddings", None)
        return min(int(positions), 512) if positions else 512

    def tokenizer(self, *, required: bool) -> Any | None:
        """The model folder's Hugging Face tokenizer, or None when it has none and ``required`` is false."""
        folder = self.folder
        if folder is not None and any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return _auto_tokenizer(folder)
        if required:
            where = "copy the tokenizer files (tokenizer.json, tokenizer_config.json) into that folder" if folder \
                else "pass model=FOLDER with the Hugging Face folder that holds the tokenizer files"
            raise DataError("Text data needs the model's tokenizer, and the model has none"
                            + (f" (nothing in '{folder}')." if folder else " (no model folder was given)."),
                            hint=f"{where}, or give the data as token ids in a .npz file.")
        return None

    def check(self, data: Dataset) -> None:
        """Raise :class:`DataError` when labels or inputs of ``data`` cannot be fed to the model."""
        for batch in data.batches:
            if batch.labels is not None:
                _check_negative_labels(data.name, batch.labels, data.task)
            if self.config is None:
                continue
            self._check_tokens(data.name, batch.inputs.get("input_ids"), "input token id")
            self._check_pixels(data.name, batch.inputs.get("pixel_values"))
            if batch.labels is None:
                continue
            if data.task == "causal_lm":
                self._check_tokens(data.name, batch.labels, "label token id")
            elif self.task == "classification":
                self._check_classes(data.name, batch.labels)

    def _check_tokens(self, name: str, ids: torch.Tensor | None, what: str) -> None:
        vocab = self.vocab_size
        if ids is not None and vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            raise DataError(f"Data '{name}' has {what} {int(ids.max())}, but the model's vocabulary has {vocab} "
                            f"tokens (ids 0..{vocab - 1}).",
                            hint="tokenise the data with this model's tokenizer (or give it as text, which is "
                                 "tokenised by the model folder's tokenizer).")

    def _check_classes(self, name: str, labels: torch.Tensor) -> None:
        classes = int(getattr(self.config, "num_labels", 0) or 0)
        if classes and labels.numel() and int(labels.max()) >= classes:
            raise DataError(f"Data '{name}' has class id {int(labels.max())}, but the model has {classes} classes "
                            f"(ids 0..{classes - 1}).",
                            hint="use data labelled for this model's classes, or a model with more labels.")

    def _check_pixels(self, name: str, pixels: torch.Tensor | None) -> None:
        size, channels = getattr(self.config, "image_size", None), getattr(self.config, "num_channels", None)
        if pixels is None or not isinstance(size, int) or channels is None:
            return
        if tuple(pixels.shape[1:]) != (channels, size, size):
            raise DataError(f"Data '{name}' has images of shape {tuple(pixels.shape[1:])}, but the model takes "
                            f"{(channels, size, size)} (channels, height, width).",
                            hint="use images the model was built for (its config's num_channels and image_size).")


def _architectures(config: Any) -> tuple[str, ...]:
    return tuple(getattr(config, "architectures", None) or ())


def _check_negative_labels(name: str, labels: torch.Tensor, task: str) -> None:
    allowed = IGNORE if task == "causal_lm" else 0
    bad = labels[(labels < 0) & (labels != allowed)]
    if bad.numel():
        raise DataError(f"Data '{name}' has negative label {int(bad[0])}.",
                        hint="labels are class ids >= 0, or token ids with -100 marking padding (causal LM).")


# ----------------------------------------------------------------------------------------------------------------
# shipped datasets
# ----------------------------------------------------------------------------------------------------------------


def _digits(split: str, target: _Target, batch_size: int, limit: int | None) -> Dataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    keep = (np.arange(len(digits.target)) % 5 == 0) == (split == "test")
    # Pixels 0..16 scaled to [-1, 1], as ViT image processors do with mean = std = 0.5.
    pixels = torch.tensor(digits.images[keep], dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    labels = torch.tensor(digits.target[keep], dtype=torch.long)
    return Dataset(f"digits:{split}", "classification", _batched({"pixel_values": pixels}, labels, batch_size))


def corpus_lines(split: str) -> list[tuple[str, str]]:
    """``(class, line)`` pairs of the shipped help text in ``split`` (blocks of 20 lines, every 5th is test).

    Examples
    --------
    >>> corpus_lines("test")[0][0] in TOPIC_CLASSES
    True
    """
    return [row for block in _corpus_blocks(split) for row in block]


def _corpus_blocks(split: str) -> list[list[tuple[str, str]]]:
    if not CORPUS_FILE.is_file():
        raise DataError(f"The shipped corpus '{CORPUS_FILE}' is missing.",
                        hint="reinstall symgraph, or regenerate it with `python examples/train_models.py "
                             "--extract-corpus`.")
    rows = [tuple(line.split("\t", 1)) for line in CORPUS_FILE.read_text(encoding="utf-8").splitlines()]
    blocks = [rows[i:i + 20] for i in range(0, len(rows), 20)]
    return [block for b, block in enumerate(blocks) if (b % 5 == 4) == (split == "test")]


def _pydoc_chars(split: str, target: _Target, batch_size: int, limit: int | None) -> Dataset:
    text = "\n".join(line for _, line in corpus_lines(split))
    ids = _encode_stream(text, target.tokenizer(required=False) or _auto_tokenizer(SHIPPED_TOKENIZERS["causal_lm"]))
    windows = torch.tensor(ids[:len(ids) // WINDOW * WINDOW], dtype=torch.long).view(-1, WINDOW)
    return Dataset(f"pydoc-chars:{split}", "causal_lm", _batched({"input_ids": windows}, windows.clone(), batch_size))


def _pydoc_topics(split: str, target: _Target, batch_size: int, limit: int | None) -> Dataset:
    rows = corpus_lines(split)[:limit]
    tokenizer = target.tokenizer(required=False) or _auto_tokenizer(SHIPPED_TOKENIZERS["classification"])
    ids = [_encode_line(text, tokenizer, max_tokens=target.max_tokens) for _, text in rows]
    labels = [TOPIC_CLASSES.index(label) for label, _ in rows]
    batches = _padded_batches(ids, labels, "classification", _pad_id(tokenizer), batch_size)
    return Dataset(f"pydoc-topics:{split}", "classification", batches)


DATASETS = {"digits": _digits, "pydoc-chars": _pydoc_chars, "pydoc-topics": _pydoc_topics}


# ----------------------------------------------------------------------------------------------------------------
# text: tokenising and padding
# ----------------------------------------------------------------------------------------------------------------


# Tokenizer classes with no pipeline of their own: they run the folder's tokenizer.json as written.
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _auto_tokenizer(folder: Path) -> Any:
    """The folder's tokenizer. Where its tokenizer_config.json names a generic class, that class: AutoTokenizer
    replaces it by the model type's own class for some types (transformers' list of hubs with a wrong class:
    qwen2, phi3, ...), which rebuilds its pre-tokenizer from the vocabulary and drops what the folder's
    tokenizer.json does (a character tokenizer's spaces), so the data would not be the model's."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        config = folder / "tokenizer_config.json"
        named = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
        if named in _GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
            return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:  # a damaged or incomplete tokenizer file is bad input, not a bug
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise DataError(f"Cannot load the tokenizer in '{folder}' for text data: {type(exc).__name__}: {reason}",
                        hint="repair or re-download the tokenizer files (tokenizer.json, tokenizer_config.json) "
                             "there, or give the data as token ids in a .npz file.") from exc


def _encode_stream(text: str, tokenizer: Any) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])  # a stream: no length limit


def _encode_line(text: str, tokenizer: Any, *, max_tokens: int) -> list[int]:
    """Token ids of one example, with the tokenizer's special tokens (a classifier's ``<cls>`` or ``[CLS]``)."""
    return list(tokenizer(text, truncation=True, max_length=max_tokens)["input_ids"])


def _pad_id(tokenizer: Any) -> int:
    return int(tokenizer.pad_token_id) if tokenizer.pad_token_id is not None else 0


def _padded_batches(ids: Sequence[list[int]], labels: Sequence[int] | None, task: str, pad_id: int,
                    batch_size: int) -> tuple[Batch, ...]:
    """Right-padded batches with an ``attention_mask``; causal LM labels are the ids with -100 at padding."""
    batches = []
    for start in range(0, len(ids), batch_size):
        chunk = ids[start:start + batch_size]
        width = max(len(x) for x in chunk)
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in chunk], dtype=torch.long)
        input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in chunk], dtype=torch.long)
        if task == "causal_lm":
            target = input_ids.masked_fill(mask == 0, IGNORE)
        else:
            target = None if labels is None else torch.tensor(labels[start:start + batch_size], dtype=torch.long)
        batches.append(Batch({"input_ids": input_ids, "attention_mask": mask}, target))
    return tuple(batches)


def _load_txt(path: Path, target: _Target, batch_size: int, limit: int | None) -> Dataset:
    lines = [line for line in _read_text(path).splitlines() if line.strip()][:limit]
    if not lines:
        raise DataError(f"Data file '{path}' has no non-empty lines.", hint="put one example per line.")
    if target.task == "classification":
        labels, texts = _line_labels(lines, target)
    else:
        labels, texts = None, lines
    return _text_dataset(path, texts, labels, target, batch_size)


def _text_dataset(path: Path, texts: list[str], labels: list[int] | None, target: _Target,
                  batch_size: int) -> Dataset:
    """Texts tokenised with the model's tokenizer, padded into batches (with ``labels``, a classifier's class ids,
    where given)."""
    tokenizer = target.tokenizer(required=True)
    task = target.task or "causal_lm"
    ids = [_encode_line(t, tokenizer, max_tokens=target.max_tokens) for t in texts]
    if any(not x for x in ids):
        raise DataError(f"An example of '{path}' tokenises to nothing.", hint="remove examples with no text.")
    return Dataset(path.name, task, _padded_batches(ids, labels, task, _pad_id(tokenizer), batch_size))


# text files may come compressed (data.jsonl.gz, as datasets are often shipped); the suffix before says the form
DECOMPRESS = {".gz": gzip, ".bz2": bz2, ".xz": lzma}


def _form(path: Path) -> str:
    """The suffix that says how to read ``path``: its own, or for a compressed text file the one before the
    compression suffix (``.parquet.gz`` has none: Parquet and the other binary forms compress inside)."""
    suffixes = path.suffixes
    if len(suffixes) > 1 and suffixes[-1] in DECOMPRESS:
        return suffixes[-2] if suffixes[-2] in TEXT_FORMS else path.suffix
    return path.suffix


def _read_text(path: Path) -> str:
    try:
        if path.suffix in DECOMPRESS:
            with DECOMPRESS[path.suffix].open(path, "rt", encoding="utf-8") as file:
                return file.read()
        return path.read_text(encoding="utf-8")
    except (OSError, EOFError, UnicodeDecodeError, ValueError) as exc:  # gzip's BadGzipFile is an OSError
        raise DataError(f"Cannot read '{path}' as UTF-8 text: {exc}.",
                        hint="save the file as UTF-8 (compressed or not: .gz, .bz2 and .xz are read).") from exc


def _line_labels(lines: list[str], target: _Target) -> tuple[list[int] | None, list[str]]:
    """Labels of ``LABEL<TAB>text`` lines (a class id or a name in the config's ``id2label``), when every line
    has one; otherwise no labels and the lines as they are."""
    parts = [line.split("\t", 1) for line in lines]
    if not all(len(p) == 2 for p in parts):
        return None, lines
    return _class_ids([label for label, _ in parts], target), [text for _, text in parts]


def _class_ids(labels: list[Any], target: _Target) -> list[int]:
    """Class ids of labels given as ids (ints or digit strings) or as names in the config's ``id2label``."""
    names = {str(v): int(k) for k, v in (getattr(target.config, "id2label", None) or {}).items()}
    ids = []
    for label in labels:
        text = str(label).strip()
        if isinstance(label, int) and not isinstance(label, bool) or text.isdigit():
            ids.append(int(text))
        elif text in names:
            ids.append(names[text])
        else:
            raise DataError(f"Label '{label}' is neither a class id nor one of the model's labels "
                            f"({', '.join(sorted(names)) or 'none named'}).",
                            hint="label each example with a class id or label name, or leave labels out.")
    return ids


# ----------------------------------------------------------------------------------------------------------------
# records (.jsonl, .json, .csv, .tsv; Parquet and Arrow files and saved datasets: symgraph.tables)
# ----------------------------------------------------------------------------------------------------------------

TEXT_FIELDS = ("text", "sentence", "content", "prompt", "input")  # the first present is an example's text
LABEL_FIELDS = ("label", "labels")  # the first present is a classifier's class (an id or an id2label name)


def _load_records(path: Path, target: _Target, batch_size: int, limit: int | None,
                  split: tuple[str | None, str] = (None, "test")) -> Dataset:
    """One example per record: a JSON object per line (``.jsonl``), one of a list of them or a row of columns
    (``.json``: :func:`_json_document_records`), a row under a header (``.csv``, ``.tsv``), or a row of a Parquet
    or Arrow file or of a folder ``datasets`` saved (:mod:`symgraph.tables`; ``split``: the split named after the
    folder, if any, and the one asked for by default).
    Its text is the first of :data:`TEXT_FIELDS` the records have, else their one field holding text (or, in a
    dataset of images or sounds, the field holding one as ``datasets`` stores it); a classifier's class is the first of
    :data:`LABEL_FIELDS` (every record has it, or none does)."""
    if path.is_dir():
        records = tables.saved_dataset_records(path, *split, limit)
    elif path.suffix in tables.SUFFIXES:
        records = tables.table_records(path, limit)
    else:
        read = {".jsonl": _json_records, ".json": _json_document_records}.get(_form(path), _table_records)
        records = read(path)[:limit]
    if not records:
        raise DataError(f"Data '{path}' has no records.",
                        hint="put one JSON object per line (.jsonl), or rows under a header line (.csv, .tsv).")
    label = next((f for f in LABEL_FIELDS if f in records[0]), None)
    media = next((f for f, value in records[0].items() if _media_cell(value)), None)
    text = None if media else _text_field(path, records, exclude=label)
    for number, record in enumerate(records, 1):
        for field, what in ((text, "text"), (label, "class")):
            if field is not None and (record.get(field) in (None, "") or what == "text"
                                      and not isinstance(record[field], str)):
                raise DataError(f"Record {number} of '{path}' has no {what} in field '{field}' (the first has).",
                                hint=f"give every record its {what} in '{field}', or leave the field out of all.")
    if media is not None:
        return _load_record_media(path, records, media, label, target, batch_size)
    texts = [r[text] for r in records]
    classifier = target.task == "classification"  # a causal LM's labels are its tokens: a label field is ignored
    labels = _class_ids([r[label] for r in records], target) if label and classifier else None
    return _text_dataset(path, texts, labels, target, batch_size)


def _json_document_records(path: Path) -> list[dict]:
    """The records of a ``.json`` file: a list of objects (or of texts), an object of equally long columns
    (``{"text": [...], "label": [...]}``), or JSON Lines under a ``.json`` name (what ``datasets``' ``to_json``
    writes)."""
    text = _read_text(path)
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return _json_records(path, text)
    if isinstance(document, dict) and document and all(isinstance(v, list) for v in document.values()):
        lengths = {k: len(v) for k, v in document.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"The columns of '{path}' have different lengths: "
                            + ", ".join(f"{k} {n}" for k, n in lengths.items()) + ".",
                            hint="give every column one entry per example.")
        return [dict(zip(document, row)) for row in zip(*document.values())]
    if isinstance(document, dict):
        document = [document]
    if not isinstance(document, list):
        raise DataError(f"'{path}' holds a JSON {type(document).__name__}, not records.",
                        hint="write a list of objects such as [{\"text\": \"...\", \"label\": 0}], or one "
                             "object per line.")
    hint = "write a list of objects such as [{\"text\": \"...\", \"label\": 0}]."
    return [_record(value, f"Entry {number} of '{path}'", hint) for number, value in enumerate(document, 1)]


def _json_records(path: Path, text: str | None = None) -> list[dict]:
    records = []
    for number, line in enumerate((_read_text(path) if text is None else text).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"Line {number} of '{path}' is not JSON: {exc.msg} (column {exc.colno}).",
                            hint="write one JSON object per line, such as {\"text\": \"...\", \"label\": 0}.") \
                from exc
        records.append(_record(record, f"Line {number} of '{path}'",
                               "write one JSON object per line, such as {\"text\": \"...\", \"label\": 0}."))
    return records


def _record(value: Any, where: str, hint: str) -> dict:
    """A JSON value as a record: an object as it is, a string as its text; anything else is refused."""
    if isinstance(value, str):
        return {"text": value}
    if not isinstance(value, dict):
        raise DataError(f"{where} is a JSON {type(value).__name__}, not an object.", hint=hint)
    return value


def _table_records(path: Path) -> list[dict]:
    rows = csv.DictReader(io.StringIO(_read_text(path)), delimiter="\t" if _form(path) == ".tsv" else ",")
    try:
        records = [row for row in rows if any((v or "").strip() for v in row.values() if isinstance(v, str))]
    except csv.Error as exc:
        raise DataError(f"Cannot read '{path}' as a table: {exc}.", hint="write a header line, then one row "
                                                                         "per example.") from exc
    longer = next((n for n, row in enumerate(records, 1) if None in row), None)
    if longer is not None:
        raise DataError(f"Row {longer} of '{path}' has more cells than its header names.",
                        hint="quote cells that hold the delimiter.")
    return records


def _text_field(path: Path, records: list[dict], exclude: str | None) -> str:
    fields = list(records[0])
    named = next((f for f in TEXT_FIELDS if f in fields), None)
    if named:
        return named
    texts = [f for f in fields if f != exclude and isinstance(records[0][f], str)]
    if len(texts) == 1:
        return texts[0]
    raise DataError(f"Cannot tell which field of '{path}' holds the text: its records have "
                    f"{', '.join(map(repr, fields)) or 'no fields'}.",
                    hint=f"name the text field one of {', '.join(TEXT_FIELDS)} (and a classifier's class 'label').")


# ----------------------------------------------------------------------------------------------------------------
# arrays and factories
# ----------------------------------------------------------------------------------------------------------------


def _load_npz(path: Path, target: _Target, batch_size: int) -> Dataset:
    try:
        with np.load(path, allow_pickle=False) as arrays:
            tensors = {k: _tensor(arrays[k]) for k in arrays.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # EOFError: an empty file
        raise DataError(f"Cannot read '{path}' as a .npz of arrays: {exc or type(exc).__name__}.",
                        hint="write it with numpy.savez(path, input_ids=..., labels=...).") from exc
    labels = tensors.pop("labels", None)
    if not tensors:
        raise DataError(f"'{path}' holds no input arrays (only: {', '.join(['labels'] if labels is not None else [])}"
                        ").", hint="name the arrays after the model's forward arguments, e.g. input_ids.")
    lengths = {k: int(v.shape[0]) if v.ndim else -1 for k, v in {**tensors, "labels": labels}.items() if v is not None}
    if len(set(lengths.values())) != 1:
        raise DataError(f"The arrays in '{path}' have different numbers of examples: "
                        + ", ".join(f"{k} {n}" for k, n in lengths.items()) + ".",
                        hint="give every array the same first dimension (one row per example).")
    task = _task_of(labels, target, path.name)
    if task == "causal_lm" and labels is None and "input_ids" in tensors:
        labels = _lm_labels(tensors["input_ids"], tensors.get("attention_mask"))
    return Dataset(path.name, task, _batched(tensors, labels, batch_size))


def _load_media_folder(path: Path, target: _Target, batch_size: int, limit: int | None) -> Dataset:
    """A folder of images or sounds (:mod:`symgraph.media_folders`): the model's processor's inputs, and class ids
    where the files sit in class subfolders."""
    from .media_folders import media_batches

    _refuse_media_for_lm(path, target, "a folder, which is read as images or sounds")  # whatever it holds
    inputs, names = media_batches(path, model_folder=target.folder, channels=_channels(target),
                                  batch_size=batch_size, limit=limit)
    return _media_dataset(path, inputs, None if names is None else _class_ids(names, target))


def _media_cell(value: Any) -> bool:
    """A record's field holding an image or a sound as ``datasets``' Image and Audio features store them: the
    file's bytes, or its path."""
    return isinstance(value, dict) and set(value) == {"bytes", "path"} and (
        isinstance(value["bytes"], bytes) or isinstance(value["path"], str))


def _load_record_media(path: Path, records: list[dict], field: str, label: str | None, target: _Target,
                       batch_size: int) -> Dataset:
    """Records whose ``field`` holds images or sounds (a Parquet or Arrow dataset of them), made the model's inputs
    by its processor as a folder's files are; ``label`` their classes."""
    from .media_folders import EncodedFile, file_batches

    _refuse_media_for_lm(path, target, "a dataset of images or sounds")
    files = []
    for number, record in enumerate(records, 1):
        cell = record.get(field)
        if not _media_cell(cell):
            raise DataError(f"Record {number} of '{path}' has no image or sound in field '{field}' (the first has).",
                            hint=f"give every record its file in '{field}'.")
        if isinstance(cell["bytes"], bytes):
            files.append(EncodedFile(f"record {number} of '{path}'" + (f" ({cell['path']})" if cell["path"] else ""),
                                     cell["bytes"]))
        else:  # stored as a path, as datasets keeps files it read and did not embed
            file = path.parent / cell["path"] if path.is_file() else Path(cell["path"])
            if not file.is_file():
                raise DataError(f"Record {number} of '{path}' names its file by the path '{cell['path']}', and "
                                "there is no such file.",
                                hint="embed the files in the dataset (datasets' save_to_disk or push_to_hub embeds "
                                     "them), or run from the folder the paths are relative to.")
            files.append(file)
    labels = _class_ids([r.get(label) for r in records], target) if label else None
    chunks = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    return _media_dataset(path, file_batches(chunks, path, model_folder=target.folder, channels=_channels(target)),
                          labels)


def _refuse_media_for_lm(path: Path, target: _Target, what: str) -> None:
    if target.task == "causal_lm":
        raise DataError(f"'{path}' is {what}, and the model is a causal language model.",
                        hint="give a language model text (a .txt, .jsonl, .csv or .tsv file, or token ids in a .npz).")


def _channels(target: _Target) -> int | None:
    config = getattr(target.config, "vision_config", None) or target.config
    return getattr(config, "num_channels", None)


def _media_dataset(path: Path, inputs: list[dict[str, torch.Tensor]], classes: list[int] | None) -> Dataset:
    """The batches of images or sounds made inputs, each with its examples' classes (if any)."""
    labels = None if classes is None else torch.tensor(classes, dtype=torch.long)
    batches, start = [], 0
    for batch in inputs:
        size = int(next(iter(batch.values())).shape[0])
        batches.append(Batch(batch, None if labels is None else labels[start:start + size]))
        start += size
    return Dataset(path.name, "classification", tuple(batches))


TEXT_FORMS = (".txt", ".jsonl", ".json", ".csv", ".tsv")  # read by _read_text: may be compressed
FILE_LOADERS = {".txt": _load_txt, ".jsonl": _load_records, ".json": _load_records, ".csv": _load_records,
                ".tsv": _load_records, ".parquet": _load_records, ".arrow": _load_records,
                ".npz": lambda path, target, batch_size, limit: _load_npz(path, target, batch_size)}


def _tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype.kind in "iub":
        return torch.from_numpy(array.astype(np.int64))
    if array.dtype.kind == "f":
        return torch.from_numpy(array.astype(np.float32))
    raise ValueError(f"array of dtype {array.dtype} is neither numbers nor booleans")


def _task_of(labels: torch.Tensor | None, target: _Target, name: str) -> str:
    """Task from the labels' shape ((B,): classification, (B, T): causal LM), else from the model's head."""
    if labels is None:
        return target.task or "classification"
    if labels.ndim in (1, 2):
        return "classification" if labels.ndim == 1 else "causal_lm"
    raise DataError(f"Labels in '{name}' have shape {tuple(labels.shape)}.",
                    hint="use (examples,) class ids or (examples, tokens) token ids.")


def _lm_labels(input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return input_ids.clone() if mask is None else input_ids.masked_fill(mask == 0, IGNORE)


def _load_factory(spec: str, target: _Target) -> Dataset:
    from .io import _FactoryImportError, _resolve_factory

    module_part, _, attr = spec.rpartition(":")
    try:
        made = _resolve_factory(module_part, attr)()
    except _FactoryImportError as exc:
        raise DataError(f"Cannot load data from '{spec}': it is not a shipped dataset name or a data file, and not "
                        f"an importable factory ({exc}).", hint=_FORMS_HINT) from exc
    except Exception as exc:
        raise DataError(f"The data factory '{spec}' raised {type(exc).__name__}: {exc}",
                        hint="the function must return the data when called with no arguments.") from exc
    if isinstance(made, Dataset):
        return made
    if not isinstance(made, Iterable) or isinstance(made, (str, bytes, dict)):
        raise DataError(f"The data factory '{spec}' returned a {type(made).__name__}.",
                        hint="return a symgraph.datasets.Dataset, or an iterable of Batch or (inputs, labels).")
    batches = tuple(_as_batch(item, spec) for item in made)
    task = _task_of(batches[0].labels if batches else None, target, spec)
    if task == "causal_lm":
        batches = tuple(b if b.labels is not None or "input_ids" not in b.inputs
                        else Batch(b.inputs, _lm_labels(b.inputs["input_ids"], b.inputs.get("attention_mask")))
                        for b in batches)
    return Dataset(spec, task, batches)


def _as_batch(item: Any, spec: str) -> Batch:
    if isinstance(item, Batch):
        return item
    if isinstance(item, dict):
        item = (item, None)
    if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], dict) and \
            all(isinstance(v, torch.Tensor) for v in item[0].values()) and \
            (item[1] is None or isinstance(item[1], torch.Tensor)):
        return Batch(dict(item[0]), item[1])
    raise DataError(f"The data factory '{spec}' gave a {type(item).__name__} where a batch was expected.",
                    hint="yield Batch(inputs, labels) or (inputs_dict, labels) pairs of tensors.")


# ----------------------------------------------------------------------------------------------------------------
# forward and losses
# ----------------------------------------------------------------------------------------------------------------


def batch_logits(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """``model``'s logits on ``batch``'s inputs (on the model's device; a model with a cache runs without it)."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    inputs = {k: v.to(device) for k, v in batch.inputs.items()}
    return logits_of(model(**inputs, **without_cache(getattr(model, "config", None))))


def _soft_loss_sum(logits: torch.Tensor, probabilities: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int,
                                                                                                  int]:
    """:func:`_loss_sum` against soft targets: every example (every position of a causal LM, whose target is the
    distribution of the token after it) counts, and the top logit is right where it names the likeliest class."""
    ids = ids.to(logits.device)
    log_probabilities = logits.float().log_softmax(-1).gather(-1, ids)
    total = -(probabilities.to(log_probabilities) * log_probabilities).sum()
    right = int((logits.argmax(-1) == ids[..., 0]).sum())
    return total, probabilities[..., 0].numel(), right


def _loss_sum(logits: torch.Tensor, batch: Batch, task: str) -> tuple[torch.Tensor, int, int]:
    """Summed cross-entropy, the number of terms, and how many of them the top logit predicts correctly."""
    if batch.targets is not None:
        return _soft_loss_sum(logits, *batch.targets)
    if task == "causal_lm":
        labels = batch.labels if batch.labels is not None else _lm_labels(
            batch.inputs["input_ids"], batch.inputs.get("attention_mask"))
        logits, labels = logits[:, :-1], labels[:, 1:].to(logits.device)
    else:
        labels = batch.labels.to(logits.device) if batch.labels is not None else logits.argmax(-1).detach()
    flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    total = F.cross_entropy(flat_logits.float(), flat_labels, ignore_index=IGNORE, reduction="sum")
    counted = flat_labels != IGNORE
    right = int((flat_logits.argmax(-1) == flat_labels)[counted].sum())
    return total, int(counted.sum()), right

