"""Images or sounds in a folder as a data SPEC (``--data DIR``), preprocessed by the model's own processor.

Two layouts, as torchvision's ``ImageFolder`` and Hugging Face's ``imagefolder`` / ``audiofolder`` read them: one
subfolder per class (``DIR/cat/1.png``; the folder's name is a class id or a name in the config's ``id2label``),
or the files directly in ``DIR`` (unlabelled: a classifier's loss then takes its own top class, as for every
unlabelled data). A folder holds images (decoded by Pillow) or WAV files (PCM, read by the standard library;
several channels averaged, resampled to the processor's rate), not both. How they become inputs (sizes, scaling,
spectrograms) is the model's, not symgraph's to guess: the model folder's ``preprocessor_config.json``
(``AutoImageProcessor`` for images, ``AutoFeatureExtractor`` for sound) does it, and a model folder without one
is refused with what to add.
"""
from __future__ import annotations

import io
import itertools
import wave
from math import gcd
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .errors import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
AUDIO_SUFFIXES = (".wav",)
PROCESSOR_FILE = "preprocessor_config.json"


def media_batches(root: Path, *, model_folder: Path | None, channels: int | None, batch_size: int,
                  limit: int | None) -> tuple[list[dict[str, torch.Tensor]], list[str] | None]:
    """``(inputs of each batch, class name of each example or None)`` for the files under ``root``, the first
    ``limit`` of them, ``batch_size`` to a batch (sounds are padded within their batch).

    Classes are interleaved (the first file of every class, then the second, ...; classes and files in name
    order), so every batch mixes the classes and a limit keeps some of each. Images are converted to grey for a
    one-channel model, to RGB otherwise."""
    files, names = _layout(root)
    files, names = files[:limit], (names[:limit] if names is not None else None)
    chunks = [files[i:i + batch_size] for i in range(0, len(files), batch_size)]
    return file_batches(chunks, root, model_folder=model_folder, channels=channels), names


class EncodedFile(NamedTuple):
    """An image or sound file's bytes held in memory (a row of a Parquet or Arrow dataset), ``name`` saying where
    from."""

    name: str
    data: bytes

    def __str__(self) -> str:
        return self.name


def file_batches(chunks: list[list], root, *, model_folder: Path | None, channels: int | None) \
        -> list[dict[str, torch.Tensor]]:
    """The model's inputs for each chunk of image or sound files (paths, or :class:`EncodedFile`), from the model
    folder's processor; ``root`` names where they come from. Sounds (WAV) are padded within their chunk; images
    are converted to grey for a one-channel model, to RGB otherwise."""
    if _is_sound(chunks[0][0]):
        extractor = _processor(root, model_folder, "AutoFeatureExtractor", "sounds")
        rate = int(getattr(extractor, "sampling_rate", 0) or 16000)
        return [_processed(lambda: extractor([_sound(f, rate) for f in chunk], sampling_rate=rate, padding=True,
                                             return_tensors="pt"), model_folder, chunk) for chunk in chunks]
    processor = _processor(root, model_folder, "AutoImageProcessor", "images")
    mode = "L" if channels == 1 else "RGB"
    return [_processed(lambda: processor(images=[_image(f, mode) for f in chunk], return_tensors="pt"),
                       model_folder, chunk) for chunk in chunks]


def _is_sound(file: "Path | EncodedFile") -> bool:
    if isinstance(file, EncodedFile):  # a WAV file's header (WebP images are RIFF files too)
        return file.data[:4] == b"RIFF" and file.data[8:12] == b"WAVE"
    return file.suffix.lower() in AUDIO_SUFFIXES


def _layout(root: Path) -> tuple[list[Path], list[str] | None]:
    top = _files_in(root)
    classes = [(d.name, _files_in(d)) for d in _subfolders(root)]
    classes = [(name, files) for name, files in classes if files]
    if top and classes:
        raise DataError(f"Folder '{root}' holds data files both directly and in class subfolders "
                        f"({', '.join(name for name, _ in classes[:3])}).",
                        hint="put every file in its class's subfolder, or all of them directly in the folder "
                             "(unlabelled).")
    if not top and not classes:
        raise DataError(f"Folder '{root}' holds no images ({', '.join(IMAGE_SUFFIXES)}) or sounds "
                        f"({', '.join(AUDIO_SUFFIXES)}), directly or one subfolder down.",
                        hint="pass a folder of images or WAV files, one subfolder per class.")
    if top:
        files, names = top, None
    else:
        pairs = [pair for rank in itertools.zip_longest(*[[(f, name) for f in files] for name, files in classes])
                 for pair in rank if pair is not None]
        files, names = [f for f, _ in pairs], [name for _, name in pairs]
    kinds = {f.suffix.lower() in AUDIO_SUFFIXES for f in files}
    if len(kinds) > 1:
        raise DataError(f"Folder '{root}' holds both images and sounds.",
                        hint="give one kind of data: the images for an image model, the sounds for an audio one.")
    return files, names


def _files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.suffix.lower() in IMAGE_SUFFIXES + AUDIO_SUFFIXES)


def _subfolders(folder: Path) -> list[Path]:
    return sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _processor(root: Path, model_folder: Path | None, auto_class: str, what: str) -> Any:
    if model_folder is None or not (model_folder / PROCESSOR_FILE).is_file():
        where = f"the model folder '{model_folder}' has no {PROCESSOR_FILE}" if model_folder else \
            "no model folder was given"
        raise DataError(f"Cannot preprocess the {what} in '{root}': {where}, so how the model wants them turned into "
                        "inputs is unknown.",
                        hint=f"save the model's processor there (processor.save_pretrained(FOLDER) writes "
                             f"{PROCESSOR_FILE}), or give the inputs as arrays in a .npz file.")
    import transformers
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "torchvision is not installed: using the PIL backend" is no news to the user
    try:
        return getattr(transformers, auto_class).from_pretrained(str(model_folder), local_files_only=True)
    except Exception as exc:  # a damaged processor file is bad input, not a bug
        raise DataError(f"Cannot load the {what}' processor in '{model_folder}': {type(exc).__name__}: "
                        f"{' '.join(str(exc).split())[:300]}",
                        hint=f"repair {PROCESSOR_FILE} there (processor.save_pretrained writes it).") from exc
    finally:
        logging.set_verbosity(verbosity)


def _image(file: "Path | EncodedFile", mode: str) -> Any:
    from PIL import Image

    try:
        with Image.open(_opened(file)) as image:
            return image.convert(mode)
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise DataError(f"Cannot read image '{file}': {exc}.",
                        hint="remove or replace the file; symgraph reads what Pillow reads.") from exc


def _opened(file: "Path | EncodedFile") -> Any:
    """What Pillow and ``wave`` open: a file's path, or its bytes as a file."""
    return io.BytesIO(file.data) if isinstance(file, EncodedFile) else str(file)


def _sound(file: "Path | EncodedFile", rate: int) -> np.ndarray:
    """The samples of a PCM WAV file in [-1, 1], channels averaged, resampled to ``rate``."""
    try:
        with wave.open(_opened(file), "rb") as sound:
            width, count, own_rate = sound.getsampwidth(), sound.getnchannels(), sound.getframerate()
            raw = sound.readframes(sound.getnframes())
    except (OSError, EOFError, wave.Error) as exc:
        raise DataError(f"Cannot read sound '{file}': {exc}.",
                        hint="save it as PCM WAV (8, 16, 24 or 32-bit integer samples).") from exc
    if width == 3:  # 24-bit: widen each sample to 32 bits (little-endian: a zero low byte keeps the sign on top)
        wide = np.zeros((len(raw) // 3, 4), dtype=np.uint8)
        wide[:, 1:] = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
        raw, width = wide.tobytes(), 4
    samples = np.frombuffer(raw, dtype={1: np.uint8, 2: "<i2", 4: "<i4"}[width]).astype(np.float64)
    samples = (samples - 128) / 128 if width == 1 else samples / 2.0 ** (8 * width - 1)
    samples = samples.reshape(-1, count).mean(axis=1)
    if own_rate != rate:
        from scipy.signal import resample_poly

        common = gcd(own_rate, rate)
        samples = resample_poly(samples, rate // common, own_rate // common)
    return samples.astype(np.float32)


def _processed(run, model_folder: Path | None, files: list[Path]) -> dict[str, torch.Tensor]:
    try:
        out = run()
    except DataError:
        raise
    except Exception as exc:  # a processor made for other data (say, RGB statistics for a grey model)
        raise DataError(f"The processor in '{model_folder}' cannot preprocess '{files[0]}' and the files with it: "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                        hint="use the processor the model was trained with (for images, its image_mean and "
                             "image_std have one entry per channel of the model).") from exc
    tensors = {k: torch.as_tensor(v) for k, v in out.items()}
    return {k: t.float() if t.is_floating_point() else t for k, t in tensors.items()}
